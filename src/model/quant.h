// Weight quantization formats: validation of stored weights, quantizers from f32, the exact
// dequantization every kernel is checked against, and load-time FP8 -> MXFP4 re-quantization.
//
// The formats are defined in model/linear_weight.h (MODEL.md section 4). The quantizers
// follow the public recipes the checkpoints are made with:
//   FP8 block  : DeepSeek-V3 `weight_quant` (inference/kernel.py): per 128x128 block
//                scale = amax / 448, q = e4m3(w / scale); the stored `weight_scale_inv` is
//                that scale, a multiplier. An all-zero block gets scale 1.
//   NVFP4      : NVIDIA TensorRT-Model-Optimizer NVFP4QTensor: global_scale
//                (`weight_scale_2`) = amax(W) / (448 * 6); per 16 values
//                scale = e4m3(amax_16 / 6 / global_scale); q = e2m1(w / (scale * global)).
//   MXFP4      : OCP Microscaling Formats v1.0, section 6.3: per 32 values
//                X = 2^(floor(log2(amax)) - emax_elem), emax_elem(e2m1) = 2, stored as e8m0;
//                q = e2m1(w / X). Values past 6 * X saturate (the spec's known clipping).
// All element roundings are round-to-nearest-even and saturating (core/dtype.h).
//
// dequantize_linear returns, for every element, the exact product of the stored factors
// rounded once to f32. The products are exact in f64 (e2m1 x e4m3 x f32 needs at most
// 2 + 4 + 24 significant bits), so this is the best value an f32 kernel can produce; a
// kernel that first folds scale * global_scale into one f32 may differ by an ulp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/linear_weight.h"

namespace ml4 {

// Checks `weight` and `scale` against `fmt` for an [out_features, in_features] layer and
// assembles the LinearWeight. Accepted storage:
//   kF32 [N, K] f32; kBF16 [N, K] bf16 (no scale);
//   kFP8Block [N, K] f8_e4m3 + [ceil(N/128), ceil(K/128)] f32 (values must be finite);
//   kNVFP4 [N, K/2] u8 or e2m1x2 + [N, K/16] f8_e4m3, global_scale finite and > 0;
//   kMXFP4 [N, K/2] u8 or e2m1x2 + [N, K/32] u8 or e8m0.
// Packed FP4 (stored as safetensors U8) is retagged kF4E2M1x2 and U8 MXFP4 scales kE8M0;
// the bytes are not copied. Errors name the tensor:
//   "tensor layers.3.attention.wkv_b.weight: expected [16384, 512] bf16, found [16384, 256] bf16".
Result<LinearWeight> make_linear_weight(std::string name, LinearFormat fmt, int64_t out_features,
                                        int64_t in_features, Tensor weight, Tensor scale = Tensor(),
                                        float global_scale = 1.0f);

// Re-checks an assembled LinearWeight (shapes, dtypes, scale presence) without copying.
Status validate_linear_weight_format(const LinearWeight& w);

// Quantizes a row-major f32 [N, K] matrix (see the file comment for each recipe). FP8
// handles ragged edges (N, K not multiples of 128); NVFP4 / MXFP4 need K % 16 / K % 32 == 0.
// Non-finite input is an error naming the element.
Result<LinearWeight> quantize_linear(const float* w, int64_t N, int64_t K, LinearFormat fmt, std::string name);

// Every element's value, row-major [N, K]: the exact product of its stored factors rounded
// once to f32. An invalid weight (see validate_linear_weight_format) yields an empty vector.
std::vector<float> dequantize_linear(const LinearWeight& w);

// Load-time FP8 block -> MXFP4 for routed experts (SYSTEM.md S1): each value is
// dequantized exactly (in f64) and quantized to MXFP4 as quantize_linear does. Needs
// in_features % 32 == 0. Runs on the thread pool.
Result<LinearWeight> requantize_fp8_to_mxfp4(const LinearWeight& fp8);

// Converts any tensor to an owned f32 tensor of the same shape: f32/f64/f16/bf16/e4m3/e8m0
// by value, integer and bool types by value; kF4E2M1x2 [.., n] unpacks to [.., 2n]
// (low nibble first). Norm weights and biases are stored in bf16 and used in f32.
// An empty tensor gives an empty tensor.
Tensor to_f32(const Tensor& t);

// OCP MX scale exponent for a block whose largest magnitude is `amax` (finite, >= 0):
// floor(log2(amax)) - 2, clamped to the e8m0 range [-127, 127]; 0 for amax == 0.
int mxfp4_scale_exponent(double amax);

}  // namespace ml4
