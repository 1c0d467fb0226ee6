// linear: y[M, N] = x[M, K] W^T for every LinearFormat (model/linear_weight.h).
//
// The CPU backend's one matmul. Weights stay in their stored format (a view into the
// mapped checkpoint); each worker decodes a tile of weight rows to f32 once, exactly
// (core/dtype.h), and uses it for all M activation rows, so decode cost is paid once
// per weight element whatever M is. Accumulation is f32 (AVX2/FMA where present).
// Work is split over N with parallel_for (core/threads.h).
//
// A weight whose tensors do not match its declared format/shape is a load-time error:
// validate_linear_weight() says exactly what is wrong. linear() itself never crashes on
// one: it logs the same message and writes NaN to y, so a skipped check is loud.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "model/linear_weight.h"

namespace ml4::cpu {

// Largest M for which bf16 / FP8 weights are read directly (GEMV); above it each weight row
// is decoded once to f32 and run as a GEMM tile.
constexpr int64_t kGemvMaxM = 4;

// Checks dtypes and shapes of weight/scale against w.format, out_features, in_features.
Status validate_linear_weight(const LinearWeight& w);

// The activations' precision (vLLM's --dtype):
//   kF32 (the default and the reference): x as given, every format above.
//   kBF16: x rounded to bf16 and summed in f32 by AVX512_BF16 dot products, 32 products an
//     instruction (transformers' and vLLM's bf16 numerics; linear_bf16dot.h has the order).
//     Applies to bf16 and FP8 weights; f32, NVFP4 and MXFP4 weights keep f32 activations.
//     Needs AVX512_BF16 and AVX512_VBMI: activation_dtype_supported() says, and linear() writes
//     NaN (and logs why) rather than fall back to another order where they are missing.
enum class ActivationDtype { kF32, kBF16 };
Status activation_dtype_supported(ActivationDtype a);
// "float32" | "bfloat16" (vLLM's names; also "float", "bf16", "auto" = float32).
Result<ActivationDtype> parse_activation_dtype(const std::string& name);
const char* activation_dtype_name(ActivationDtype a);

// x: [M, K] f32 row-major; y: [M, N] f32 row-major (must not alias x).
void linear(const float* x, int64_t M, const LinearWeight& w, float* y, ActivationDtype act = ActivationDtype::kF32);

// Columns [n0, n1) of linear()'s y (y is still [M, N]), bit-identical to linear(), on the
// calling thread only: for callers that split one parallel region over several weights
// (the MoE decode runs every active expert's gate and up rows in one region). n0 must be a
// multiple of 4 (a GEMV tile, so an FP8 scale group never splits one).
void linear_rows(const float* x, int64_t M, const LinearWeight& w, int64_t n0, int64_t n1, float* y,
                 ActivationDtype act = ActivationDtype::kF32);

// Whether linear() may use its AVX-512 kernels where the CPU has them (default true). They
// give the same bits as the AVX2 ones; tests switch them off to compare the two.
void linear_allow_avx512(bool allow);
// True when linear() runs AVX-512 kernels (allowed, built, and the CPU has them).
bool linear_uses_avx512();

// Decodes weight rows [n0, n1) to f32 into out ([n1-n0, K] row-major), exactly.
// Exposed for tests, the CUDA backend's reference path, and re-quantization tools.
void decode_weight_rows(const LinearWeight& w, int64_t n0, int64_t n1, float* out);
// W[n0:n1, k0:k1] decoded the same way into out (rows ldo apart). k0 is a multiple of the
// format's block (FP8 128, NVFP4 16, MXFP4 32), k1 one too or K.
void decode_weight_block(const LinearWeight& w, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* out,
                         int64_t ldo);

}  // namespace ml4::cpu
