// Device helpers of rotary embedding, shared by the MLA / indexer query path (elementwise.cu
// q_path_kernel) and the fused indexer key path (cache_write.cu), so both rotate with the same
// f32 operations: cpu::rope_* (ops/cpu) computes the same angles in f64 and the same f32 products.
#pragma once

#include <cstdint>

#include "ops/cuda/rope_rows.h"

namespace ml4::cuda {

// cpu::lerope_position: past the window the position advances by 1 / leak per token, in f64.
__device__ __forceinline__ double rope_position(int64_t p, bool lerope, int64_t window, double leak) {
  if (lerope && p >= window && leak > 0.0) return static_cast<double>(window) + static_cast<double>(p - window) / leak;
  return static_cast<double>(p);
}

// (cos, sin) of pos * inv_freq, in f64, each rounded to f32 and times the attention factor.
__device__ __forceinline__ void rope_cos_sin(double pos, float inv_freq, float attn_factor, float* c, float* s) {
  double sd, cd;
  sincos(pos * static_cast<double>(inv_freq), &sd, &cd);
  *c = static_cast<float>(cd) * attn_factor;
  *s = static_cast<float>(sd) * attn_factor;
}

// One pair (x0, x1) rotated by (c, s), in f32, with its roundings pinned (the compiler would
// contract x0 * c - x1 * s and x0 * s + x1 * c into an FMA of its choosing, differently at
// different call sites): x0' = fma(x0, c, -(x1 s)), x1' = fma(x1, c, x0 s), what q_path_kernel
// compiled to before this helper existed.
__device__ __forceinline__ void rope_rotate(float* x0p, float* x1p, float c, float s) {
  const float x0 = *x0p, x1 = *x1p;
  *x0p = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
  *x1p = __fmaf_rn(x1, c, __fmul_rn(x0, s));
}

// One row of a fused kernel (token `token`'s), its values v in shared memory: the first r.dim
// rotated, NeoX pairs; cs: shared scratch of r.dim floats. Every thread of the block calls it
// (two barriers).
__device__ __forceinline__ void rope_row(float* v, float* cs, const RopeRows& r, int64_t token) {
  const int rh = r.dim / 2;
  const double pos = rope_position(r.positions[token], r.lerope, r.lerope_window, r.lerope_leak);
  for (int i = threadIdx.x; i < rh; i += blockDim.x) rope_cos_sin(pos, r.inv_freq[i], r.attn_factor, &cs[2 * i], &cs[2 * i + 1]);
  __syncthreads();
  for (int i = threadIdx.x; i < rh; i += blockDim.x) rope_rotate(&v[i], &v[i + rh], cs[2 * i], cs[2 * i + 1]);
  __syncthreads();
}

}  // namespace ml4::cuda
