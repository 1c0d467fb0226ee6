// The shapes the resident FFN kernel takes (ops/cuda/ffn_resident.h), without CUDA: the
// start-up check of `--decode-backend latency_specialized` (runtime/latency_decode.h) and the
// kernel's own argument check read the same rule.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "model/model_config.h"

namespace ml4 {

inline constexpr int kFfnResidentMaxTokens = 4;
inline constexpr int kFfnResidentMaxTopK = 8;
inline constexpr int64_t kFfnResidentMaxDim = 8192;

// Empty when the kernel takes a step of T tokens through an FFN of width D (moe: its routing,
// I_routed its experts' hidden width; I_mlp the shared expert's or the dense MLP's, 0: none),
// else every reason it does not, "; "-separated.
inline std::string ffn_resident_unsupported(int64_t D, const MoeConfig* moe, int64_t I_routed, int64_t I_mlp, int T) {
  std::string why;
  auto add = [&](const std::string& s) { why += (why.empty() ? "" : "; ") + s; };
  if (T < 1 || T > kFfnResidentMaxTokens) add(fmt::format("{} tokens (1..{})", T, kFfnResidentMaxTokens));
  if (D <= 0 || D % 128 != 0 || D > kFfnResidentMaxDim)
    add(fmt::format("width {} (a multiple of 128, at most {})", D, kFfnResidentMaxDim));
  if (I_mlp % 128 != 0) add(fmt::format("MLP hidden width {} (a multiple of 128)", I_mlp));
  if (moe != nullptr) {
    const int G = std::max(moe->num_expert_groups, 1);
    if (moe->num_experts <= 0 || moe->num_experts > 256) add(fmt::format("{} experts (at most 256)", moe->num_experts));
    if (moe->num_experts_per_tok <= 0 || moe->num_experts_per_tok > kFfnResidentMaxTopK)
      add(fmt::format("{} experts per token (at most {})", moe->num_experts_per_tok, kFfnResidentMaxTopK));
    if (moe->num_experts % G != 0) add("experts not a multiple of the expert groups");
    if (I_routed <= 0 || I_routed % 128 != 0) add(fmt::format("expert hidden width {} (a multiple of 128)", I_routed));
  } else if (I_mlp <= 0) {
    add("neither a router nor an MLP");
  }
  return why;
}

}  // namespace ml4
