// The layer loop and the FFN of CpuModel; attention and the indexer are in cpu_attention.cpp.
#include <algorithm>
#include <cmath>

#include "ops/cpu/ops.h"
#include "runtime/cpu_model.h"

namespace ml4 {

CpuModel::CpuModel(ModelConfig cfg, std::shared_ptr<const ModelWeights> weights, int latent_group, int indexer_group,
                   bool duplicate_shared_kv)
    : cfg_(std::move(cfg)), w_(std::move(weights)), latent_group_(latent_group), indexer_group_(indexer_group) {
  const int L = cfg_.n_layers;
  latent_read_slot_.assign(L, -1);
  latent_write_slots_.assign(L, {});
  int extra = cfg_.num_latent_layers();
  for (int l = 0; l < L; ++l) {
    const LayerSpec& s = cfg_.layers[l];
    if (s.owns_kv()) {
      latent_read_slot_[l] = s.latent_slot;
      latent_write_slots_[l].push_back(s.latent_slot);
    } else if (duplicate_shared_kv) {
      latent_read_slot_[l] = extra;
      latent_write_slots_[s.kv_source].push_back(extra++);
    } else {
      latent_read_slot_[l] = cfg_.layers[s.kv_source].latent_slot;
    }
  }
  inv_freq_ = cpu::rope_inv_freq(cfg_.rope_theta, cfg_.qk_rope_head_dim, cfg_.yarn);
  if (cfg_.has_dsa()) indexer_inv_freq_ = cpu::rope_inv_freq(cfg_.rope_theta, cfg_.indexer.rope_head_dim, cfg_.yarn);
  rope_factor_ = cpu::rope_attention_factor(cfg_.yarn);
}

namespace {

// SwiGLU MLP: w2(silu(w1 x) * w3 x).
void mlp(const MlpWeights& m, const float* x, int64_t T, float* out) {
  const int64_t I = m.w1.out_features;
  std::vector<float> g(T * I), u(T * I);
  cpu::linear(x, T, m.w1, g.data());
  cpu::linear(x, T, m.w3, u.data());
  cpu::silu_mul(g.data(), u.data(), T * I, g.data());
  cpu::linear(g.data(), T, m.w2, out);
}

}  // namespace

void CpuModel::ffn(int layer, const float* x, int64_t T, float* out, ForwardTrace* trace) const {
  const LayerSpec& spec = cfg_.layers[layer];
  const FfnWeights& F = w_->layers[layer].ffn;
  const int64_t D = cfg_.dim;
  switch (spec.ffn) {
    case FfnKind::kDense:
      mlp(F.dense, x, T, out);
      return;
    case FfnKind::kMoe:
      break;
  }
  const int E = cfg_.moe.num_experts, K = cfg_.moe.num_experts_per_tok;
  // Router in f32 (MODEL.md 3.7).
  std::vector<float> logits(T * E);
  cpu::linear(x, T, F.gate, logits.data());
  std::vector<int32_t> ids(T * K);
  std::vector<float> wts(T * K);
  cpu::moe_route(logits.data(), T, cfg_.moe, F.correction_bias.empty() ? nullptr : F.correction_bias.data(),
                 ids.data(), wts.data());
  if (trace != nullptr) {
    auto& rec = trace->experts[layer];
    rec.assign(T, {});
    for (int64_t t = 0; t < T; ++t) rec[t].assign(ids.begin() + t * K, ids.begin() + (t + 1) * K);
  }
  if (trace != nullptr && layer < static_cast<int>(trace->forced_experts.size()) &&
      !trace->forced_experts[layer].empty()) {
    // Test input (ForwardTrace::forced_experts, checked in forward()): run these experts,
    // weighted as moe_route weighs its own choice (router probability, renormalised, times
    // routed_scale).
    const auto& forced = trace->forced_experts[layer];
    std::vector<float> prob(E);
    for (int64_t t = 0; t < T; ++t) {
      const float* l = logits.data() + t * E;
      if (cfg_.moe.scoring == RouterScoring::kSoftmax) {
        std::copy(l, l + E, prob.begin());
        cpu::softmax_inplace(prob.data(), E);
      } else {
        for (int e = 0; e < E; ++e) prob[e] = 1.0f / (1.0f + std::exp(-l[e]));
      }
      double sum = 0.0;
      for (int k = 0; k < K; ++k) sum += prob[forced[t][k]];
      const double norm = cfg_.moe.renormalize ? 1.0 / (sum + 1e-20) : 1.0;
      for (int k = 0; k < K; ++k) {
        ids[t * K + k] = forced[t][k];
        wts[t * K + k] = static_cast<float>(prob[forced[t][k]] * norm * cfg_.moe.routed_scale);
      }
    }
  }
  std::fill(out, out + T * D, 0.0f);
  // Group token rows by expert so each expert's weights are decoded once per step.
  std::vector<std::vector<std::pair<int64_t, float>>> rows(E);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) rows[ids[t * K + k]].push_back({t, wts[t * K + k]});
  std::vector<float> xs, ys;
  for (int e = 0; e < E; ++e) {
    const auto& r = rows[e];
    if (r.empty()) continue;
    const int64_t n = static_cast<int64_t>(r.size());
    xs.resize(n * D);
    ys.resize(n * D);
    for (int64_t i = 0; i < n; ++i) std::copy(x + r[i].first * D, x + (r[i].first + 1) * D, xs.begin() + i * D);
    mlp(F.experts[e], xs.data(), n, ys.data());
    for (int64_t i = 0; i < n; ++i) {
      float* o = out + r[i].first * D;
      const float wt = r[i].second;
      for (int64_t d = 0; d < D; ++d) o[d] += wt * ys[i * D + d];
    }
  }
  if (F.shared) {
    std::vector<float> sh(T * D);
    mlp(*F.shared, x, T, sh.data());
    for (int64_t i = 0; i < T * D; ++i) out[i] += sh[i];
  }
}

Status CpuModel::forward(const StepMetadata& md, PagedKvCache& cache, std::vector<float>* logits,
                         ForwardTrace* trace) const {
  const int64_t T = md.num_tokens();
  const int64_t D = cfg_.dim;
  const int L = cfg_.n_layers;
  const float eps = static_cast<float>(cfg_.norm_eps);
  if (trace != nullptr) {
    trace->topk.assign(L, {});
    trace->experts.assign(L, {});
    ML4_RETURN_IF_ERROR(validate_forced_decisions(*trace, cfg_, md.positions));
  }
  std::vector<float> residual(T * D), a(T * D), tmp(T * D);
  cpu::embedding_lookup(w_->tok_embeddings, md.token_ids.data(), T, residual.data());
  std::vector<std::vector<std::vector<int32_t>>> topk(L);
  for (int l = 0; l < L; ++l) {
    const LayerWeights& LW = w_->layers[l];
    cpu::rms_norm(residual.data(), LW.attention_norm.data(), T, D, eps, a.data());
    const bool forced = trace != nullptr && l < static_cast<int>(trace->forced_topk.size()) &&
                        !trace->forced_topk[l].empty();
    attention(l, md, cache, a.data(), tmp.data(), topk, forced ? &trace->forced_topk[l] : nullptr);
    cpu::add_rms_norm(residual.data(), tmp.data(), LW.ffn_norm.data(), T, D, eps, a.data());
    ffn(l, a.data(), T, tmp.data(), trace);
    for (int64_t i = 0; i < T * D; ++i) residual[i] += tmp[i];
    if (trace != nullptr) trace->topk[l] = topk[l];
  }
  const int64_t R = static_cast<int64_t>(md.logits_rows.size());
  std::vector<float> rows(R * D), normed(R * D);
  for (int64_t i = 0; i < R; ++i)
    std::copy(residual.begin() + md.logits_rows[i] * D, residual.begin() + (md.logits_rows[i] + 1) * D, rows.begin() + i * D);
  cpu::rms_norm(rows.data(), w_->norm.data(), R, D, eps, normed.data());
  logits->assign(R * static_cast<int64_t>(cfg_.vocab_size), 0.0f);
  if (R > 0) cpu::linear(normed.data(), R, w_->output, logits->data());
  return Status::ok();
}

}  // namespace ml4
