// Sampling on the GPU (ops/cuda/sampling.h) vs the logits download it replaces, at
// V = 131072 and B = 1, 8, 64: the split path (sample_rows with a workspace: four kernels,
// several blocks per row), eager and replayed from a CUDA graph, next to the one-block-per-row
// kernel (sample_rows without a workspace) it replaces.
//
// What the device path costs: H2D of the params (32 B/row), sample_rows, D2H of token +
// logprob (8 B/row). What it replaces: D2H of B x V f32 logits (512 KiB/row; 33.5 MB at
// B = 64) into host memory (pinned, and pageable as the engine's std::vector is), then the
// host Sampler (not timed here: it runs after the copy, O(V) to O(V log V) per row).
//
// Prediction for the split path (before measuring): K1 reads every row once (512 KiB),
// K2 (top-k / top-p rows) and K3 (sampled rows) once more, from L2 at small B; K4 reads
// ~2 KiB of tile results per row and sorts <= 2048 candidates. At B = 1 the row is split
// over 32 blocks of 4 warps, each warp's 4 KiB in flight at once: one memory latency per
// kernel (~2-3 us) plus the launch gap (~2 us eager): greedy ~8 us (K2/K3 exit at once),
// temperature ~12 us, top-k / top-p ~15-25 us. At B = 64: 3 x 33.5 MB, half of it out of
// L2, at ~3 TB/s: ~40-60 us.
//
// usage: gpu_sampling_bench [hbm_copy_GBps] [profile]
//   profile: one split-path call per config and B, nothing timed (for ncu: per-kernel times).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_bench_util.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/sampling.h"

using namespace ml4;
using namespace ml4::cuda;

int main(int argc, char** argv) {
  const double hbm = argc > 1 ? std::atof(argv[1]) : 4250.0;
  const bool profile = argc > 2 && std::string(argv[2]) == "profile";
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
  // passes: reads of the whole row by the split path (K1, K2, K3).
  const Cfg cfgs[] = {{"greedy", 0.0f, 0, 1.0f, 0.0f, 1},
                      {"T=1", 1.0f, 0, 1.0f, 0.0f, 2},
                      {"T=0.8 top_k=50", 0.8f, 50, 1.0f, 0.0f, 3},
                      {"T=0.8 top_p=0.9", 0.8f, 0, 0.9f, 0.0f, 3},
                      {"k=50 p=0.9 min_p=0.05", 0.8f, 50, 0.9f, 0.05f, 3},
                      {"T=1 top_p=0.99", 1.0f, 0, 0.99f, 0.0f, 3}};
  auto dws = DeviceBuffer::alloc(sample_rows_workspace_bytes(Bmax, V));
  BENCH_CHECK(dws.status());
  const char* plan_names[] = {"no cut", "top-k bin", "top-p bin", "top-k+top-p", "fallback"};
  if (profile) {
    for (int64_t B : {1, 8, 64})
      for (const Cfg& c : cfgs) {
        for (int64_t b = 0; b < B; ++b) hp[b] = DeviceSamplingParams{c.t, c.k, c.p, c.mp, 7ull + b, 100};
        BENCH_CUDA(cudaMemcpyAsync(dp->data(), hp, B * sizeof(DeviceSamplingParams), cudaMemcpyHostToDevice, st));
        BENCH_CHECK(sample_rows(dl->as<float>(), B, V, dp->as<DeviceSamplingParams>(), dt->as<int32_t>(),
                                dt->as<float>() + Bmax, dws->data(), sample_rows_workspace_bytes(B, V), st));
        BENCH_CUDA(cudaStreamSynchronize(st));
        std::printf("profile: B=%lld %s\n", static_cast<long long>(B), c.name);
      }
    return 0;
  }
  std::printf("sample_rows V=%lld: split path (eager, graph) vs one block per row, vs logits D2H (hbm copy ceiling "
              "%.0f GB/s)\n",
              static_cast<long long>(V), hbm);
  std::printf("%-24s %4s %10s %10s %10s %8s %10s %14s %14s  %s\n", "config", "B", "row_us", "split_us", "graph_us",
              "speedup", "split_GB/s", "device_path_us", "D2H_pinned_us", "plan (row 0)");
  for (int64_t B : {1, 8, 64}) {
    const double copy_pinned = bench::median_ms(st, 3, 20, [&](int) {
      BENCH_CUDA(cudaMemcpyAsync(pinned, dl->data(), B * V * 4, cudaMemcpyDeviceToHost, st));
    });
    const double copy_pageable = bench::median_ms(st, 2, 10, [&](int) {
      BENCH_CUDA(cudaMemcpyAsync(pageable.data(), dl->data(), B * V * 4, cudaMemcpyDeviceToHost, st));
    });
    const size_t wb = sample_rows_workspace_bytes(B, V);
    auto split = [&]() {
      BENCH_CHECK(sample_rows(dl->as<float>(), B, V, dp->as<DeviceSamplingParams>(), dt->as<int32_t>(),
                              dt->as<float>() + Bmax, dws->data(), wb, st));
    };
    for (const Cfg& c : cfgs) {
      for (int64_t b = 0; b < B; ++b) {
        hp[b] = DeviceSamplingParams{c.t, c.k, c.p, c.mp, 7ull + static_cast<uint64_t>(b), 100};
      }
      BENCH_CUDA(cudaMemcpyAsync(dp->data(), hp, B * sizeof(DeviceSamplingParams), cudaMemcpyHostToDevice, st));
      const double row = bench::median_ms(st, 2, 10, [&](int) {
        BENCH_CHECK(sample_rows(dl->as<float>(), B, V, dp->as<DeviceSamplingParams>(), dt->as<int32_t>(),
                                dt->as<float>() + Bmax, st));
      });
      const double kern = bench::median_ms(st, 5, 50, [&](int) { split(); });
      SplitPlan plan = SplitPlan::kAll;
      BENCH_CUDA(cudaStreamSynchronize(st));
      BENCH_CHECK(sample_rows_split_plans(dws->data(), 1, V, &plan));
      // The same call replayed from a graph (as the runner's captured decode step does).
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      BENCH_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      split();
      BENCH_CUDA(cudaStreamEndCapture(st, &graph));
      BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      const double graph_ms = bench::median_ms(st, 5, 50, [&](int) { BENCH_CUDA(cudaGraphLaunch(exec, st)); });
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      const double path = bench::median_ms(st, 3, 30, [&](int i) {
        hp[0].counter = 100 + i;
        BENCH_CUDA(cudaMemcpyAsync(dp->data(), hp, B * sizeof(DeviceSamplingParams), cudaMemcpyHostToDevice, st));
        split();
        BENCH_CUDA(cudaMemcpyAsync(hout, dt->data(), B * 4, cudaMemcpyDeviceToHost, st));
        BENCH_CUDA(cudaMemcpyAsync(hout + Bmax, dt->as<float>() + Bmax, B * 4, cudaMemcpyDeviceToHost, st));
      });
      const double bytes = static_cast<double>(c.passes) * B * V * 4;
      std::printf("%-24s %4lld %10.1f %10.1f %10.1f %7.1fx %10.0f %14.1f %14.1f  %s\n", c.name,
                  static_cast<long long>(B), row * 1e3, kern * 1e3, graph_ms * 1e3, row / kern,
                  bytes / (kern * 1e-3) / 1e9, path * 1e3, copy_pinned * 1e3, plan_names[static_cast<int>(plan)]);
    }
    std::printf("%-24s %4lld logits D2H pinned %.1f us, pageable %.1f us\n", "", static_cast<long long>(B),
                copy_pinned * 1e3, copy_pageable * 1e3);
  }
  cudaFreeHost(pinned);
  cudaFreeHost(hp);
  cudaFreeHost(hout);
  cudaStreamDestroy(st);
  return 0;
}
