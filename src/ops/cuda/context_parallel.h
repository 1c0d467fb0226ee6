// Decode context parallelism's combine on the GPU (SYSTEM.md S8), the twins of
// cpu::merge_attention_parts and cpu::rescale_attention_part (ops/cpu/attention.h): the same
// formulas in the same part order, natural-log lse, -inf parts weighing 0. One block per row.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"

namespace ml4::cuda {

// out [rows, cols] = sum_p exp(lse_p - L) out_p; part p's out at parts + p * part_stride, its
// lse [rows] right after its out.
Status merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols, float* out,
                             cudaStream_t stream);
// out [rows, cols] *= exp(lse - L), L over lse_all [n][rows].
Status rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows, int64_t cols,
                              cudaStream_t stream);

}  // namespace ml4::cuda
