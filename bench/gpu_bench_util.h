// Timing helpers shared by the GPU harnesses (bench/*_bench.cu): CUDA events around each
// repetition, warm-up first, the median reported (METHOD.md "Time properly").
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "core/status.h"

#define BENCH_CHECK(expr)                                                       \
  do {                                                                          \
    ::ml4::Status bench_st_ = (expr);                                           \
    if (!bench_st_.ok()) {                                                   \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, bench_st_.message().c_str()); \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

#define BENCH_CUDA(expr)                                                                  \
  do {                                                                                    \
    cudaError_t bench_e_ = (expr);                                                        \
    if (bench_e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(bench_e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace ml4::bench {

// Median milliseconds of `reps` runs of fn(i) (i = repetition index, for rotating inputs),
// each bracketed by events on `stream`, after `warmup` untimed runs.
template <typename F>
double median_ms(cudaStream_t stream, int warmup, int reps, F&& fn) {
  for (int i = 0; i < warmup; ++i) fn(i);
  BENCH_CUDA(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(a, stream));
    fn(i);
    BENCH_CUDA(cudaEventRecord(b, stream));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  BENCH_CUDA(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace ml4::bench
