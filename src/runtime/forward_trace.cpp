// See forward_trace.h.
#include "runtime/forward_trace.h"

namespace ml4 {

Status validate_forced_decisions(const ForwardTrace& trace, const ModelConfig& cfg,
                                 const std::vector<int64_t>& positions) {
  const size_t L = static_cast<size_t>(cfg.n_layers), T = positions.size();
  for (size_t l = 0; l < trace.forced_experts.size() && l < L; ++l) {
    const auto& f = trace.forced_experts[l];
    if (f.empty()) continue;
    if (f.size() != T || cfg.layers[l].ffn != FfnKind::kMoe)
      return invalid_argument("forced_experts[{}]: {} rows for {} tokens, or not an MoE layer", l, f.size(), T);
    for (const auto& row : f) {
      if (static_cast<int>(row.size()) != cfg.moe.num_experts_per_tok)
        return invalid_argument("forced_experts[{}]: {} experts per token, expected {}", l, row.size(),
                                cfg.moe.num_experts_per_tok);
      for (int32_t e : row)
        if (e < 0 || e >= cfg.moe.num_experts) return invalid_argument("forced_experts[{}]: expert {}", l, e);
    }
  }
  for (size_t l = 0; l < trace.forced_topk.size() && l < L; ++l) {
    const auto& f = trace.forced_topk[l];
    if (f.empty()) continue;
    if (f.size() != T) return invalid_argument("forced_topk[{}]: {} rows for {} tokens", l, f.size(), T);
    for (size_t t = 0; t < T; ++t) {
      if (static_cast<int64_t>(f[t].size()) > cfg.indexer.topk)
        return invalid_argument("forced_topk[{}][{}]: {} keys, top-k is {}", l, t, f[t].size(), cfg.indexer.topk);
      for (int32_t s : f[t])
        if (s < 0 || s > positions[t])
          return invalid_argument("forced_topk[{}][{}]: key {} outside [0, {}]", l, t, s, positions[t]);
    }
  }
  return ok_status();
}

}  // namespace ml4
