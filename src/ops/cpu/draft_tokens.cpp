#include "ops/cpu/draft_tokens.h"

#include <algorithm>
#include <vector>

#include "ops/cpu/basic.h"

namespace ml4::cpu {

void choose_draft_tokens(const float* logits, int64_t rows, int64_t V, const DeviceSamplingParams* params,
                         int32_t* ids, float* probs) {
  std::vector<double> dist(probs != nullptr ? V : 0);
  for (int64_t i = 0; i < rows; ++i) {
    const float* l = logits + i * V;
    DeviceSamplingParams p;
    p.temperature = 0.0f;
    if (params != nullptr) p = params[i];
    if (probs != nullptr && params == nullptr) {  // greedy: the drafter's softmax
      ids[i] = sampling::sample_row_reference(l, V, p);
      std::copy_n(l, V, probs + i * V);
      softmax_inplace(probs + i * V, V);
    } else if (probs != nullptr) {  // sampled: q, then the token drawn from q itself
      sampling::row_distribution(l, V, p, dist.data());
      for (int64_t v = 0; v < V; ++v) probs[i * V + v] = static_cast<float>(dist[v]);
      ids[i] = sampling::greedy(p) ? sampling::sample_row_reference(l, V, p)
                                   : sampling::draw_from_weights(probs + i * V, V, p.seed, p.counter);
    } else {
      ids[i] = sampling::sample_row_reference(l, V, p);
    }
  }
}

}  // namespace ml4::cpu
