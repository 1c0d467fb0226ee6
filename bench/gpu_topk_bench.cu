// The indexer's causal top-k (ops/cuda/topk.h) at decode shapes: one block per row (looping over
// the row in global memory, or holding it in registers up to 16k scores) against the
// multi-block path, k = 2048, rows of 8k-256k normal scores, T = 1..32 rows. Prints
// `TOPK T=.. n=.. path=.. ms=..` per path and its speedup over the looping kernel.
//
// Bytes per call: each path reads the row 4-5 times (3-4 radix passes, the count and the
// write), ~1 MB at n = 61440, from L2 after the first pass: the floor is a few microseconds;
// the one-block kernel is bound by its passes' latency chains (~25 us at 8k, ~100 us at 60k
// in the 14:50 attention run), which more blocks per row shorten.
//
// usage: gpu_topk_bench
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gpu_bench_util.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/topk.h"

using namespace ml4;
using namespace ml4::cuda;

int main() {
  if (!device_available()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreate(&stream));
  const int k = 2048;
  const int64_t max_n = 262144;
  const int64_t max_T = 32;
  std::vector<float> host(max_T * max_n);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : host) v = nd(rng);
  auto scores = DeviceBuffer::alloc(host.size() * 4);
  BENCH_CHECK(scores.status());
  BENCH_CHECK(scores->upload(host.data(), host.size() * 4));
  auto len = DeviceBuffer::alloc(max_T * 4), pos = DeviceBuffer::alloc(max_T * k * 4), cnt = DeviceBuffer::alloc(max_T * 4);
  BENCH_CHECK(len.status());
  BENCH_CHECK(pos.status());
  BENCH_CHECK(cnt.status());
  auto ws = DeviceBuffer::alloc(topk_workspace_bytes(max_T, 264));
  BENCH_CHECK(ws.status());
  for (int64_t n : {8192, 8448, 16384, 61440, 262144}) {
    for (int64_t T : {1, 4, 8, 32}) {
      std::vector<int32_t> lengths(T, static_cast<int32_t>(n));
      BENCH_CHECK(len->upload(lengths.data(), T * 4));
      double loop = 0;
      // loop: one block a row walking the row in global memory (max_length unknown); reg: one
      // block a row with the row in registers (n <= 16384); multi: 4096 positions a block.
      for (const char* path : {"loop", "reg", "multi"}) {
        const std::string pa = path;
        const int64_t multi = std::min<int64_t>(n / 4096, 264 / T);
        if (pa.rfind("reg", 0) == 0 && n > 16384) continue;
        if (pa == "multi" && multi < 4) continue;
        TopkParams p;
        p.scores = scores->as<float>();
        p.scores_stride = n;
        p.lengths = len->as<int32_t>();
        p.T = T;
        p.k = k;
        p.positions = pos->as<int32_t>();
        p.counts = cnt->as<int32_t>();
        p.splits = pa == "multi" ? static_cast<int>(multi) : 1;
        p.max_length = pa == "loop" ? 0 : n;
        p.workspace = ws->data();
        p.workspace_bytes = ws->bytes();
        p.stream = stream;
        const double ms = bench::median_ms(stream, 3, 20, [&](int) { BENCH_CHECK(topk(p)); });
        if (pa == "loop") loop = ms;
        std::printf("TOPK T=%ld n=%ld path=%s splits=%d ms=%.4f vs_loop=%.2f%s\n", static_cast<long>(T),
                    static_cast<long>(n), path, p.splits, ms, loop / ms,
                    topk_choose_splits(T, n) == p.splits && (pa != "loop" || n > 16384) ? " (default)" : "");
      }
    }
  }
  cudaStreamDestroy(stream);
  return 0;
}
