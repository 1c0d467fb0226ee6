// Device helper shared by the indexer key cache write (cache_write.cu) and the indexer
// query quantization (indexer.cu): one row of dI values in shared memory, held as pairs
// (tid, tid + dI/2) by dI/2 threads, goes through the Walsh-Hadamard butterflies of
// ml4::cpu::hadamard_transform (pairs (j, j + h), h = 1, 2, 4, ..., then * hscale) and gets
// one e4m3 scale per 128 values, max(amax, 1e-4) / 448 (DeepSeek act_quant). Both callers
// must produce bytes identical to the CPU encoders, so there is exactly one copy of this.
#pragma once

#include <cstdint>

namespace ml4::cuda {

constexpr int kFp8GroupSize = 128;

struct Fp8GroupPair {
  float x0, x1;  // the thread's two values after the transform
  float s0, s1;  // their groups' scales
};

// v: shared [dI] (already loaded); gmax: shared [dI / 128] scratch. Call with all dI/2 threads.
__device__ inline Fp8GroupPair hadamard_fp8_groups(float* v, unsigned* gmax, int dI, bool hadamard, float hscale) {
  const int tid = threadIdx.x, half = dI / 2, G = dI / kFp8GroupSize;
  if (tid < G) gmax[tid] = 0u;
  __syncthreads();
  if (hadamard) {
    for (int h = 1; h < dI; h *= 2) {
      const int j = (tid / h) * 2 * h + (tid % h);
      const float a = v[j], b = v[j + h];
      __syncthreads();
      v[j] = a + b;
      v[j + h] = a - b;
      __syncthreads();
    }
    v[tid] *= hscale;
    v[tid + half] *= hscale;
    __syncthreads();
  }
  Fp8GroupPair r{v[tid], v[tid + half], 0.0f, 0.0f};
  // Group amax: each warp's 32 values lie in one group (32 | 128).
  float a0 = fabsf(r.x0), a1 = fabsf(r.x1);
  for (int o = 16; o > 0; o >>= 1) {
    a0 = fmaxf(a0, __shfl_xor_sync(0xffffffffu, a0, o));
    a1 = fmaxf(a1, __shfl_xor_sync(0xffffffffu, a1, o));
  }
  if ((tid & 31) == 0) {
    atomicMax(&gmax[tid / kFp8GroupSize], __float_as_uint(a0));
    atomicMax(&gmax[(tid + half) / kFp8GroupSize], __float_as_uint(a1));
  }
  __syncthreads();
  r.s0 = fmaxf(__uint_as_float(gmax[tid / kFp8GroupSize]), 1e-4f) / 448.0f;
  r.s1 = fmaxf(__uint_as_float(gmax[(tid + half) / kFp8GroupSize]), 1e-4f) / 448.0f;
  return r;
}

// The scale of group g (< dI / 128), after hadamard_fp8_groups.
__device__ inline float fp8_group_scale(const unsigned* gmax, int g) {
  return fmaxf(__uint_as_float(gmax[g]), 1e-4f) / 448.0f;
}

}  // namespace ml4::cuda
