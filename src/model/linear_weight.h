// A linear layer's weight in its stored format: y[M, N] = x[M, K] @ W^T.
//
// Formats (MODEL.md section 4), with the value of element (n, k):
//   kF32 / kBF16 : w [N, K] f32 or bf16
//   kFP8Block    : w [N, K] e4m3, scale [ceil(N/128), ceil(K/128)] f32 (DeepSeek
//                  `weight_scale_inv`, a multiplier): w(n,k) * scale[n/128][k/128]
//   kNVFP4       : w [N, K/2] u8, two e2m1 per byte, element 2j in the low nibble;
//                  scale [N, K/16] e4m3; global_scale f32 [] (ModelOpt `weight_scale_2`):
//                  e2m1 * scale[n][k/16] * global_scale
//   kMXFP4       : w [N, K/2] as NVFP4; scale [N, K/32] e8m0: e2m1 * 2^(scale[n][k/32]-127)
// The tensors are views into the mapped checkpoint or owned buffers (make-model, tests).
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace ml4 {

enum class LinearFormat { kF32, kBF16, kFP8Block, kNVFP4, kMXFP4 };

const char* linear_format_name(LinearFormat f);

constexpr int kFp8BlockSize = 128;   // 128x128 weight blocks
constexpr int kNvfp4GroupSize = 16;  // one e4m3 scale per 16 values
constexpr int kMxfp4GroupSize = 32;  // one e8m0 scale per 32 values

struct LinearWeight {
  std::string name;  // checkpoint name of the weight, for messages and debug dumps
  LinearFormat format = LinearFormat::kBF16;
  int64_t out_features = 0;  // N
  int64_t in_features = 0;   // K
  Tensor weight;
  Tensor scale;         // empty for kF32 / kBF16
  float global_scale = 1.0f;  // kNVFP4 only
};

}  // namespace ml4
