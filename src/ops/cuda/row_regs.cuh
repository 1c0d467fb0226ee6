// A thread's share of a row in registers: elements threadIdx.x + j * kThreads, j < V, of src
// (those below n). One unrolled loop with no store in it, so every load is issued before any
// is used: the one-block row kernels that walked their rows with `for (i = tid; i < n; i +=
// blockDim)` waited about one memory latency per pass (docs/BENCHMARKS.md "Twelfth session").
#pragma once

namespace ml4::cuda {

template <int kThreads, int V, typename T>
__device__ __forceinline__ void load_row_regs(T (&v)[V], const T* src, int n) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kThreads;
    if (i < n) v[j] = src[i];
  }
}

// rms_norm's per-thread arithmetic on a row held as V float4s a thread (elements threadIdx.x +
// j * kThreads, those below n4): v += r when kAdd, then the thread's f64 sum of v's squares in j
// order. rms_norm_vec_kernel and the fused router (moe.cu) both use it, so they norm a row to
// the same bits.
template <int kThreads, bool kAdd, int V>
__device__ __forceinline__ double add_sum_squares(float4 (&v)[V], const float4 (&r)[V], int n4) {
  double ss = 0.0;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (static_cast<int>(threadIdx.x) + j * kThreads < n4) {
      if (kAdd) {
        v[j].x += r[j].x;
        v[j].y += r[j].y;
        v[j].z += r[j].z;
        v[j].w += r[j].w;
      }
      ss += static_cast<double>(v[j].x) * v[j].x;
      ss += static_cast<double>(v[j].y) * v[j].y;
      ss += static_cast<double>(v[j].z) * v[j].z;
      ss += static_cast<double>(v[j].w) * v[j].w;
    }
  }
  return ss;
}

// The normalized value v * inv * w of four elements.
__device__ __forceinline__ float4 rms_scale(float4 v, float inv, float4 w) {
  return make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w);
}

// The sum of every thread's v over the block (blockDim.x a multiple of 32, at most 1024), the
// same value to every thread: warp shuffles, then warp 0 over the warps' sums in warp order, so
// a row kernel and a fused kernel that hand it the same per-thread values get the same bits.
// smem: 32 doubles of shared memory. Three block barriers.
__device__ __forceinline__ double block_sum_f64(double v, double* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (blockDim.x >> 5) ? smem[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) smem[0] = v;
  }
  __syncthreads();
  const double r = smem[0];
  __syncthreads();
  return r;
}

}  // namespace ml4::cuda
