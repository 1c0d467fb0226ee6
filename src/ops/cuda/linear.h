// A linear layer resident on the GPU, and y = x W^T with f32 activations on both sides.
//
// DeviceLinear holds a LinearWeight's bytes in device memory in the format the GEMM reads:
//   kBF16     -> bf16 [N, K]; x is cast to bf16, cuBLASLt BF16 GEMM (gemm.h)
//   kFP8Block -> e4m3 [N, K] + f32 scales [ceil(N/128)][K/128] as stored (the GEMV and the
//                MoE grouped GEMV read them so); when K/128 % 4 != 0 also a copy re-laid
//                [ceil(N/128)][roundup(K/128, 4)] (scale_lt), the layout cuBLASLt's FP8
//                GEMM reads (gemm.h; ML4's K are all multiples of 512, so no copy there).
//                M <= 8: our GEMV on f32 x (exact activations); M > 8: x quantized per
//                1x128 group (act_quant.h, DeepSeek act_quant, rows padded to 4) and
//                LtGemm::fp8_block (cuBLASLt or our kernel, whichever gemm.h picks)
//   kF32      -> f32 [N, K]; full-f32 GEMM (no TF32): routers, MODEL.md 3.7
//   kNVFP4 /  -> the packed e2m1 bytes [N, K/2] and the scale bytes as stored (NVFP4: then
//   kMXFP4      its f32 global scale at gemv.h's fp4_global_offset); K % 32 == 0. Every M
//               through the FP4 weight stream (gemv.h: exact decoding, f32 x); routed experts
//               of prefill-sized steps take moe_gemm.h's grouped FP4 GEMM instead.
// LinearScratch holds the converted activations; reserve() it once for the largest M so
// that calls allocate nothing (CUDA graphs replay fixed addresses).
#pragma once

#include <cstdint>

#include "model/linear_weight.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/gemm.h"

namespace ml4::cuda {

struct DeviceLinear {
  std::string name;
  LinearFormat format = LinearFormat::kBF16;
  int64_t N = 0, K = 0;
  DeviceBuffer weight;  // [N, K] in format's element type
  DeviceBuffer scale;   // kFP8Block: [ceil(N/128), K/128] f32; FP4: the scale bytes (+ NVFP4's global)
  DeviceBuffer scale_lt;  // kFP8Block, K/128 % 4 != 0 only: [ceil(N/128), roundup(K/128, 4)] f32
  // The FP8 GEMM's weight scales and their leading dimension.
  const float* gemm_scale() const { return scale_lt.empty() ? scale.as<float>() : scale_lt.as<float>(); }
  int64_t gemm_scale_ld() const { return scale_lt.empty() ? K / 128 : (K / 128 + 3) / 4 * 4; }
  size_t bytes() const { return weight.bytes() + scale.bytes() + scale_lt.bytes(); }
};

// Uploads (and validates) a host weight. kF32 stays f32; kBF16 and kFP8Block as stored.
Result<DeviceLinear> upload_linear(const LinearWeight& w);

class LinearScratch {
 public:
  // Capacity for M x K activations (bytes for bf16 or e4m3 plus the group scales; the
  // scales get half again as slack for the FP8 path's rows padded to a multiple of 4).
  Status reserve(int64_t elems, int64_t groups);
  DeviceBuffer act;    // bf16 or e4m3 copy of x
  DeviceBuffer scale;  // [K/128][roundup(M, 4)] f32
  DeviceBuffer out;    // bf16 output when a GEMM has no f32-output kernel (elems x 2 bytes)
};

// y[M, N] f32 = x[M, K] f32 W^T. scratch must hold max(M*K, M*N) elements and M*K/128 scales.
// FP8 with M > 8 quantizes x (DeepSeek per-1x128 scaling), so it matches cpu::linear on the
// quantized activations, not on x itself.
Status linear_f32(LtGemm& lt, const DeviceLinear& w, const float* x, int64_t M, float* y, LinearScratch& scratch,
                  cudaStream_t stream);

}  // namespace ml4::cuda
