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

}  // namespace ml4::cuda
