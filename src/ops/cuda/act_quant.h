// Per-token-group FP8 activation quantization (DeepSeek-V3 inference/kernel.py act_quant):
// for each row and each group of `group` consecutive values,
//   scale = max(amax, 1e-4) / 448,  q = e4m3(x / scale)  (RNE, saturating),
// bit-identical to ml4::cpu::quantize_fp8_groups (the division is IEEE f32 on both sides).
//
// Scales are written either [ceil(K/group)][rows] (kGroupMajor: M fastest, the VEC128 layout
// the FP8 block GEMMs read, gemm.h) or [rows][ceil(K/group)] (kRowMajor), rows = M or
// rows_out: rows in [M, rows_out) are written as quantized zeros (q = 0, scale 1e-4/448),
// the padding cuBLASLt's FP8 GEMM needs when M % 4 != 0 (gemm.h).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/status.h"

namespace ml4::cuda {

enum class ScaleLayout { kGroupMajor, kRowMajor };

struct Fp8ActQuantParams {
  const void* x = nullptr;  // [M, K] x_dtype (kF32 or kBF16), rows x_stride elements apart
  DType x_dtype = DType::kF32;
  int64_t x_stride = 0;     // 0: K
  int64_t M = 0, K = 0;
  int group = 128;          // a multiple of 32, at most 1024
  void* q = nullptr;        // [M, K] e4m3 row-major
  float* scale = nullptr;   // see ScaleLayout
  ScaleLayout scale_layout = ScaleLayout::kGroupMajor;
  cudaStream_t stream = nullptr;
  int64_t rows_out = 0;     // 0: M; else >= M, q and scale hold rows_out rows
};

Status fp8_act_quant(const Fp8ActQuantParams& p);

}  // namespace ml4::cuda
