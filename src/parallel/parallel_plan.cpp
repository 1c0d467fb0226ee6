#include "parallel/parallel_plan.h"

#include <fmt/format.h>

#include <tuple>

namespace ml4 {
namespace {

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// Stored bytes of an [rows, cols] slice of a linear in format f (scales included).
int64_t linear_bytes(LinearFormat f, int64_t rows, int64_t cols) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  switch (f) {
    case LinearFormat::kF32: return rows * cols * 4;
    case LinearFormat::kBF16: return rows * cols * 2;
    case LinearFormat::kFP8Block: return rows * cols + 4 * cdiv(rows, kFp8BlockSize) * cdiv(cols, kFp8BlockSize);
    case LinearFormat::kNVFP4: return rows * cols / 2 + rows * cols / kNvfp4GroupSize + 4;
    case LinearFormat::kMXFP4: return rows * cols / 2 + rows * cols / kMxfp4GroupSize;
  }
  return 0;
}

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
    return ok_status();
  };
  ML4_RETURN_IF_ERROR(split(cfg.n_heads, "n_heads"));
  ML4_RETURN_IF_ERROR(split(cfg.vocab_size, "vocab_size"));
  // FFN hidden sizes split in whole quantization blocks (see the file comment).
  const int64_t unit = cfg.weight_format == WeightFormat::kBF16 ? 1 : kFp8BlockSize;
  auto hidden = [&](int64_t n, const char* what) -> Status {
    if ((n + unit - 1) / unit < t)
      return invalid_argument("--tensor-parallel-size {}: {} = {} has fewer than {} blocks of {}", t, what, n, t, unit);
    return ok_status();
  };
  ML4_RETURN_IF_ERROR(hidden(cfg.hidden_dim, "hidden_dim (dense FFN)"));
  const bool has_moe = cfg.moe.num_experts > 0;
  if (has_moe) {
    if (cfg.moe.num_shared_experts > 0)
      ML4_RETURN_IF_ERROR(hidden(int64_t{cfg.moe.expert_hidden_dim} * cfg.moe.num_shared_experts, "shared experts' hidden"));
    if (!layout.config.enable_expert_parallel) ML4_RETURN_IF_ERROR(hidden(cfg.moe.expert_hidden_dim, "expert_hidden_dim"));
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
    std::tie(s.dense_begin, s.dense) = hidden_split(cfg.hidden_dim, unit, t, q);
    const int64_t sh = int64_t{cfg.moe.expert_hidden_dim} * cfg.moe.num_shared_experts;
    if (sh > 0) std::tie(s.shared_begin, s.shared) = hidden_split(sh, unit, t, q);
    L.n_heads = static_cast<int>(p.heads_);
    L.hidden_dim = static_cast<int>(s.dense);
    if (has_moe && !layout.config.enable_expert_parallel) {
      std::tie(s.expert_hidden_begin, s.expert_hidden) = hidden_split(cfg.moe.expert_hidden_dim, unit, t, q);
      L.moe.expert_hidden_dim = static_cast<int>(s.expert_hidden);
    }
  }
  if (has_moe && layout.config.enable_expert_parallel && layout.ep_size > 1) {
    s.expert_begin = p.expert_begin();
    s.experts = p.experts();
  }
  return p;
}

std::pair<int64_t, int64_t> ParallelPlan::hidden_split(int64_t n, int64_t unit, int t, int q) {
  const int64_t blocks = (n + unit - 1) / unit, base = blocks / t, rem = blocks % t;
  const int64_t b0 = q * base + std::min<int64_t>(q, rem), nb = base + (q < rem ? 1 : 0);
  const int64_t begin = std::min(n, b0 * unit);
  return {begin, std::min(n, (b0 + nb) * unit) - begin};
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

int64_t ParallelPlan::bytes_on_rank(const ExpectedTensor& x) const {
  const std::string& n = x.name;
  const WeightShard& S = shard_;
  // The drafter's layers split as the target's (heads, FFN hidden); its fc, norms, mask and
  // Markov head are replicated.
  if (x.drafter && !contains(n, ".layers.")) return stored_bytes(x);
  const bool linear = x.role == TensorRole::kLinear || x.role == TensorRole::kExpertsLinear;
  const int64_t N = x.shape.size() >= 2 ? x.shape[x.shape.size() - 2] : x.shape[0];
  const int64_t K = x.shape.back();
  // A [rows, cols] slice of a (per-expert) linear, times the experts held.
  auto slice = [&](int64_t rows, int64_t cols, int64_t experts = 1) { return experts * linear_bytes(x.format, rows, cols); };
  const int64_t H = global_.n_heads;
  if (x.routed_expert) {
    const int64_t held = S.experts < 0 ? global_.moe.num_experts : S.experts;
    if (x.expert >= 0 && S.experts >= 0 && (x.expert < S.expert_begin || x.expert >= S.expert_begin + S.experts)) return 0;
    const int64_t per = x.expert >= 0 ? 1 : held;  // HF fused [E, ...] tensors
    if (S.expert_hidden < 0) return slice(N, K, per);
    const int64_t I = global_.moe.expert_hidden_dim;
    if (contains(n, "w2.") || contains(n, "down_proj")) return slice(N, S.expert_hidden, per);
    return slice(N / I * S.expert_hidden, K, per);  // w1 / w3, or HF gate_up [2I, D]
  }
  if (x.role == TensorRole::kEmbedding && !contains(n, "mask_embed")) {
    return stored_bytes(x) / N * (S.vocab < 0 ? N : S.vocab);
  }
  if (linear && (n == "output.weight" || n == "lm_head.weight")) return slice(S.vocab < 0 ? N : S.vocab, K);
  const int64_t heads = S.heads < 0 ? H : S.heads;
  if (linear && (contains(n, "attention.wq.") || contains(n, "attention.wq_b.") || contains(n, "attention.wkv_b.")))
    return slice(N / H * heads, K);
  if (linear && contains(n, "attention.wo.")) return slice(N, K / H * heads);
  if (contains(n, "attention.ssmax_s")) return stored_bytes(x) / H * heads;
  auto ffn = [&](int64_t count) {
    if (count < 0) return stored_bytes(x);
    return contains(n, "w2.") ? slice(N, count) : slice(count, K);
  };
  if (linear && contains(n, "feed_forward.")) return ffn(S.dense);
  if (linear && contains(n, "shared_experts.")) return ffn(S.shared);
  return stored_bytes(x);
}

RankWeightBytes ParallelPlan::weight_bytes(bool drafter) const {
  RankWeightBytes b;
  for (const auto& x : expected_tensors(global_, CheckpointLayout::kMistral)) {
    if (x.drafter && !drafter) continue;
    const int64_t bytes = bytes_on_rank(x);
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
