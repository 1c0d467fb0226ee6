// MoE router: see moe.h.
//
// Follows DeepSeek-V3 inference/model.py `Gate.forward` and transformers
// `DeepseekV3TopkRouter` / Mistral 4's router:
//   p = softmax(logits) (kSoftmax, Mistral 4 / ML4) or sigmoid(logits) (kSigmoid, DeepSeek-V3)
//   s = p + correction_bias (selection only; bias absent -> s = p)
//   groups (num_expert_groups > 1): group score = sum of the top-2 s in the group, for
//     both scorings: transformers' Mistral4TopkRouter (softmax) and DeepseekV3TopkRouter
//     (sigmoid + bias) both use `topk(2).sum`. (DeepSeek's own inference/model.py uses
//     the group max when there is no bias; no ML4 config asks for that, so it is not
//     offered.) A group of one expert scores that expert. The best
//     num_expert_groups_per_tok groups stay; experts of the others are masked to -inf
//     (DeepSeek's masked_fill(-inf); transformers fills 0.0, which only differs when
//     every kept score is negative, i.e. with a negative bias)
//   ids = top-k(s) (descending, ties to the lower id); weights = p[ids] (not s),
//   divided by their sum if cfg.renormalize, times routed_scale.
#include "ops/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/log.h"
#include "ops/cpu/basic.h"

namespace ml4::cpu {

void moe_route(const float* logits, int64_t T, const MoeConfig& cfg, const float* correction_bias,
               int32_t* ids, float* weights) {
  const int E = cfg.num_experts, K = cfg.num_experts_per_tok;
  const int G = std::max(cfg.num_expert_groups, 1);
  if (E <= 0 || K <= 0 || K > E || E % G != 0 || cfg.num_expert_groups_per_tok < 1) {
    ML4_LOG_ERROR("moe_route: bad config experts={} per_tok={} groups={} groups_per_tok={}", E, K,
                  cfg.num_expert_groups, cfg.num_expert_groups_per_tok);
    for (int64_t i = 0; i < T * std::max(K, 0); ++i) {
      ids[i] = -1;  // no expert: a caller that skips the check still reads defined values
      weights[i] = 0.0f;
    }
    return;
  }
  const int per_group = E / G;
  const int keep_groups = std::min(cfg.num_expert_groups_per_tok, G);
  const float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> p(E), s(E), gscore(G);
  std::vector<int32_t> gidx(G);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    if (cfg.scoring == RouterScoring::kSoftmax) {
      std::copy(l, l + E, p.begin());
      softmax_inplace(p.data(), E);
    } else {
      for (int e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + std::exp(-l[e]));
    }
    for (int e = 0; e < E; ++e) s[e] = correction_bias ? p[e] + correction_bias[e] : p[e];
    if (G > 1 && keep_groups < G) {
      for (int g = 0; g < G; ++g) {
        const float* sg = s.data() + g * per_group;
        if (per_group >= 2) {
          float a = kNegInf, b = kNegInf;  // top-2
          for (int i = 0; i < per_group; ++i) {
            if (sg[i] > a) {
              b = a;
              a = sg[i];
            } else if (sg[i] > b) {
              b = sg[i];
            }
          }
          gscore[g] = a + b;
        } else {
          gscore[g] = *std::max_element(sg, sg + per_group);
        }
      }
      topk(gscore.data(), G, keep_groups, gidx.data());
      std::vector<bool> keep(G, false);
      for (int i = 0; i < keep_groups; ++i) keep[gidx[i]] = true;
      for (int g = 0; g < G; ++g)
        if (!keep[g]) std::fill(s.begin() + g * per_group, s.begin() + (g + 1) * per_group, kNegInf);
    }
    int32_t* id = ids + t * K;
    float* wt = weights + t * K;
    topk(s.data(), E, K, id);
    double sum = 0.0;
    for (int i = 0; i < K; ++i) {
      wt[i] = p[id[i]];
      sum += wt[i];
    }
    const double norm = cfg.renormalize ? 1.0 / (sum + 1e-20) : 1.0;
    for (int i = 0; i < K; ++i) wt[i] = static_cast<float>(wt[i] * norm * cfg.routed_scale);
  }
}

}  // namespace ml4::cpu
