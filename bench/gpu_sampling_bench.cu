// Sampling on the GPU (ops/cuda/sampling.h) vs the logits download it replaces, at
// V = 131072 and B = 1, 8, 64.
//
// What the device path costs: H2D of the params (32 B/row), sample_rows, D2H of token +
// logprob (8 B/row). What it replaces: D2H of B x V f32 logits (512 KiB/row; 33.5 MB at
// B = 64) into host memory (pinned, and pageable as the engine's std::vector is), then the
// host Sampler (not timed here: it runs after the copy, O(V) to O(V log V) per row).
//
// Prediction before measuring: each pass of sample_rows reads the row once (512 KiB); one
// 1024-thread block per row, so a row is read by one SM, ~150-200 GB/s from L2 per SM:
// ~3 us per pass and row, rows in parallel up to 132 (one SM each). Passes: greedy 2
// (argmax, logprob sum), plain temperature 3, top-k or top-p 6, top-k + top-p 9 (+1 when a
// cut splits a tie run). So ~6-30 us at any B <= 132, against ~10 us (B = 1) to ~0.7 ms
// (B = 64, ~50 GB/s PCIe Gen5) for the pinned copy.
//
// usage: gpu_sampling_bench [hbm_copy_GBps]
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpu_bench_util.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/sampling.h"

using namespace ml4;
using namespace ml4::cuda;

int main(int argc, char** argv) {
  const double hbm = argc > 1 ? std::atof(argv[1]) : 4250.0;
  if (!device_available()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  constexpr int64_t V = 131072;
  const int64_t Bmax = 64;
  cudaStream_t st;
  BENCH_CUDA(cudaStreamCreate(&st));
  auto dl = DeviceBuffer::alloc(Bmax * V * 4);
  auto dp = DeviceBuffer::alloc(Bmax * sizeof(DeviceSamplingParams));
  auto dt = DeviceBuffer::alloc(Bmax * 8);
  BENCH_CHECK(dl.status());
  BENCH_CHECK(dp.status());
  BENCH_CHECK(dt.status());
  // Logits like a model's: uniform [-12, 4] (a long tail, a few dozen strong candidates).
  BENCH_CHECK(fill_uniform_f32(dl->as<float>(), Bmax * V, 42, -12.0f, 4.0f, st));
  float* pinned = nullptr;
  BENCH_CUDA(cudaMallocHost(&pinned, Bmax * V * 4));
  std::vector<float> pageable(Bmax * V);
  DeviceSamplingParams* hp = nullptr;
  BENCH_CUDA(cudaMallocHost(&hp, Bmax * sizeof(DeviceSamplingParams)));
  int32_t* hout = nullptr;
  BENCH_CUDA(cudaMallocHost(&hout, Bmax * 8));

  struct Cfg {
    const char* name;
    float t;
    int k;
    float p;
    float mp;
    int passes;
  };
  const Cfg cfgs[] = {{"greedy", 0.0f, 0, 1.0f, 0.0f, 2},
                      {"T=1", 1.0f, 0, 1.0f, 0.0f, 3},
                      {"T=0.8 top_k=50", 0.8f, 50, 1.0f, 0.0f, 6},
                      {"T=0.8 top_p=0.9", 0.8f, 0, 0.9f, 0.0f, 6},
                      {"k=50 p=0.9 min_p=0.05", 0.8f, 50, 0.9f, 0.05f, 9}};
  std::printf("sample_rows V=%lld vs logits D2H (hbm copy ceiling %.0f GB/s)\n", static_cast<long long>(V), hbm);
  std::printf("%-24s %4s %12s %12s %12s %14s %14s\n", "config", "B", "kernel_us", "eff_GB/s", "device_path_us",
              "D2H_pinned_us", "D2H_pageable_us");
  for (int64_t B : {1, 8, 64}) {
    const double copy_pinned = bench::median_ms(st, 3, 20, [&](int) {
      BENCH_CUDA(cudaMemcpyAsync(pinned, dl->data(), B * V * 4, cudaMemcpyDeviceToHost, st));
    });
    const double copy_pageable = bench::median_ms(st, 2, 10, [&](int) {
      BENCH_CUDA(cudaMemcpyAsync(pageable.data(), dl->data(), B * V * 4, cudaMemcpyDeviceToHost, st));
    });
    for (const Cfg& c : cfgs) {
      for (int64_t b = 0; b < B; ++b) {
        hp[b] = DeviceSamplingParams{c.t, c.k, c.p, c.mp, 7ull + static_cast<uint64_t>(b), 100};
      }
      BENCH_CUDA(cudaMemcpyAsync(dp->data(), hp, B * sizeof(DeviceSamplingParams), cudaMemcpyHostToDevice, st));
      const double kern = bench::median_ms(st, 3, 30, [&](int i) {
        BENCH_CHECK(sample_rows(dl->as<float>(), B, V, dp->as<DeviceSamplingParams>(), dt->as<int32_t>(),
                                dt->as<float>() + Bmax, st));
      });
      const double path = bench::median_ms(st, 3, 30, [&](int i) {
        hp[0].counter = 100 + i;
        BENCH_CUDA(cudaMemcpyAsync(dp->data(), hp, B * sizeof(DeviceSamplingParams), cudaMemcpyHostToDevice, st));
        BENCH_CHECK(sample_rows(dl->as<float>(), B, V, dp->as<DeviceSamplingParams>(), dt->as<int32_t>(),
                                dt->as<float>() + Bmax, st));
        BENCH_CUDA(cudaMemcpyAsync(hout, dt->data(), B * 4, cudaMemcpyDeviceToHost, st));
        BENCH_CUDA(cudaMemcpyAsync(hout + Bmax, dt->as<float>() + Bmax, B * 4, cudaMemcpyDeviceToHost, st));
      });
      const double bytes = static_cast<double>(c.passes) * B * V * 4;
      std::printf("%-24s %4lld %12.1f %12.0f %12.1f %14.1f %14.1f\n", c.name, static_cast<long long>(B), kern * 1e3,
                  bytes / (kern * 1e-3) / 1e9, path * 1e3, copy_pinned * 1e3, copy_pageable * 1e3);
    }
  }
  cudaFreeHost(pinned);
  cudaFreeHost(hp);
  cudaFreeHost(hout);
  cudaStreamDestroy(st);
  return 0;
}
