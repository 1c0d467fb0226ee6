#include "parallel/parallel_plan.h"

#include <fmt/format.h>

namespace ml4 {
namespace {

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

int64_t stored_bytes(const ExpectedTensor& t) {
  int64_t b = shape_numel(t.stored_shape()) * static_cast<int64_t>(dtype_size(t.stored_dtype()));
  for (const auto& s : t.scales) b += shape_numel(s.shape) * static_cast<int64_t>(dtype_size(s.dtype));
  return b;
}

std::string gib(int64_t b) { return fmt::format("{:.2f} GiB", static_cast<double>(b) / static_cast<double>(int64_t{1} << 30)); }

}  // namespace

Result<ParallelPlan> ParallelPlan::make(const ModelConfig& cfg, const RankLayout& layout) {
  ParallelPlan p;
  p.global_ = cfg;
  p.layout_ = layout;
  const int t = layout.tp_size, q = layout.tp_rank;
  auto split = [&](int64_t n, const char* what) -> Status {
    if (n % t != 0)
      return invalid_argument("--tensor-parallel-size {}: {} = {} is not divisible by {}", t, what, n, t);
    return Status::ok();
  };
  ML4_RETURN_IF_ERROR(split(cfg.n_heads, "n_heads"));
  ML4_RETURN_IF_ERROR(split(cfg.vocab_size, "vocab_size"));
  ML4_RETURN_IF_ERROR(split(cfg.hidden_dim, "hidden_dim (dense FFN)"));
  const bool has_moe = cfg.moe.num_experts > 0;
  if (has_moe) {
    ML4_RETURN_IF_ERROR(split(int64_t{cfg.moe.expert_hidden_dim} * cfg.moe.num_shared_experts, "shared experts' hidden"));
    if (!layout.config.enable_expert_parallel) ML4_RETURN_IF_ERROR(split(cfg.moe.expert_hidden_dim, "expert_hidden_dim"));
    if (layout.config.enable_expert_parallel && cfg.moe.num_experts < layout.ep_size)
      return invalid_argument("--enable-expert-parallel over {} ranks: the model has only {} routed experts",
                              layout.ep_size, cfg.moe.num_experts);
  } else if (layout.config.enable_expert_parallel && layout.ep_size > 1) {
    return invalid_argument("--enable-expert-parallel: the model has no routed experts");
  }
  p.heads_ = cfg.n_heads / t;
  p.head_begin_ = q * p.heads_;
  p.vocab_ = cfg.vocab_size / t;
  p.vocab_begin_ = q * p.vocab_;
  WeightShard& s = p.shard_;
  ModelConfig& L = p.local_;
  L = cfg;
  if (t > 1) {
    s.head_begin = p.head_begin_;
    s.heads = p.heads_;
    s.vocab_begin = p.vocab_begin_;
    s.vocab = p.vocab_;
    s.dense_begin = q * (cfg.hidden_dim / t);
    s.dense = cfg.hidden_dim / t;
    const int64_t sh = int64_t{cfg.moe.expert_hidden_dim} * cfg.moe.num_shared_experts;
    if (sh > 0) {
      s.shared_begin = q * (sh / t);
      s.shared = sh / t;
    }
    L.n_heads = static_cast<int>(p.heads_);
    L.hidden_dim = cfg.hidden_dim / t;
    if (has_moe && !layout.config.enable_expert_parallel) {
      s.expert_hidden_begin = q * (cfg.moe.expert_hidden_dim / t);
      s.expert_hidden = cfg.moe.expert_hidden_dim / t;
      L.moe.expert_hidden_dim = cfg.moe.expert_hidden_dim / t;
    }
  }
  if (has_moe && layout.config.enable_expert_parallel && layout.ep_size > 1) {
    s.expert_begin = p.expert_begin();
    s.experts = p.experts();
  }
  return p;
}

int ParallelPlan::experts_of(int r) const {
  const int E = global_.moe.num_experts, n = std::max(1, ep_size());
  if (!expert_parallel() || ep_size() == 1) return E;
  return E / n + (r < E % n ? 1 : 0);
}

int ParallelPlan::expert_begin_of(int r) const {
  const int E = global_.moe.num_experts, n = std::max(1, ep_size());
  if (!expert_parallel() || ep_size() == 1) return 0;
  return r * (E / n) + std::min(r, E % n);
}

int ParallelPlan::expert_owner(int e) const {
  if (!expert_parallel() || ep_size() == 1) return 0;
  const int E = global_.moe.num_experts, n = ep_size(), base = E / n, rem = E % n;
  // The first `rem` ranks hold base + 1.
  if (e < rem * (base + 1)) return e / (base + 1);
  return rem + (e - rem * (base + 1)) / base;
}

std::pair<int64_t, int64_t> ParallelPlan::dispatch_range(int64_t T) const {
  const int t = tp_size(), q = tp_rank();
  const int64_t base = T / t, rem = T % t;
  const int64_t begin = q * base + std::min<int64_t>(q, rem);
  return {begin, begin + base + (q < rem ? 1 : 0)};
}

std::pair<int64_t, int64_t> ParallelPlan::share_of(const ExpectedTensor& x) const {
  const int t = tp_size();
  const std::string& n = x.name;
  if (x.drafter) return {1, 1};
  if (x.routed_expert) {
    if (expert_parallel() && ep_size() > 1) {
      if (x.expert >= 0) return {expert_owner(x.expert) == ep_rank() ? 1 : 0, 1};
      return {experts(), global_.moe.num_experts};  // HF fused [E, ...] tensors
    }
    return {1, t};
  }
  if (x.role == TensorRole::kEmbedding || n == "output.weight" || n == "lm_head.weight") return {1, t};
  if (contains(n, "attention.wq.") || contains(n, "attention.wq_b.") || contains(n, "attention.wkv_b.") ||
      contains(n, "attention.wo.") || contains(n, "attention.ssmax_s"))
    return {1, t};
  if (contains(n, "feed_forward.") || contains(n, "shared_experts.")) return {1, t};
  return {1, 1};
}

RankWeightBytes ParallelPlan::weight_bytes(bool drafter) const {
  RankWeightBytes b;
  for (const auto& x : expected_tensors(global_, CheckpointLayout::kMistral)) {
    if (x.drafter && !drafter) continue;
    const auto [num, den] = share_of(x);
    const int64_t bytes = stored_bytes(x) * num / den;
    const std::string& n = x.name;
    if (x.drafter) {
      b.drafter += bytes;
    } else if (x.routed_expert) {
      b.routed_experts += bytes;
    } else if (contains(n, "shared_experts.")) {
      b.shared_experts += bytes;
    } else if (contains(n, "feed_forward.")) {
      b.dense_ffn += bytes;
    } else if (x.role == TensorRole::kRouterGate || x.role == TensorRole::kCorrectionBias) {
      b.router += bytes;
    } else if (x.role == TensorRole::kEmbedding || n == "output.weight") {
      b.embedding += bytes;
    } else if (x.role == TensorRole::kNorm || x.role == TensorRole::kNormBias) {
      b.norms += bytes;
    } else {
      b.attention += bytes;
    }
  }
  return b;
}

std::string ParallelPlan::describe() const {
  const RankWeightBytes b = weight_bytes();
  std::string s = fmt::format(
      "rank {} (dp {} tp {}{}): heads [{}, {}), vocabulary [{}, {}), routed experts [{}, {})\n", layout_.world_rank,
      layout_.dp_rank, layout_.tp_rank, expert_parallel() ? fmt::format(" ep {}", ep_rank()) : "", head_begin_,
      head_begin_ + heads_, vocab_begin_, vocab_begin_ + vocab_, expert_begin(), expert_begin() + experts());
  s += fmt::format("  weights: {} (attention {}, dense FFN {}, routed experts {}, shared experts {}, router {}, "
                   "embedding + output {}, norms {})\n",
                   gib(b.total()), gib(b.attention), gib(b.dense_ffn), gib(b.routed_experts), gib(b.shared_experts),
                   gib(b.router), gib(b.embedding), gib(b.norms));
  return s;
}

}  // namespace ml4
