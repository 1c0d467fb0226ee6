// HiSparse's host-to-device gather (src/ops/cuda/hisparse.h) against the copy engines.
//
// A decode step of ML4 that misses every selected row moves 2,048 rows x 72 layers of 656 B
// (97 MB); a step with good locality moves a few percent of that. The rows lie scattered in an
// 8 GiB pinned host pool. Measured, per row count:
//   gather  : the UVA kernel reading the scattered rows where they lie;
//   memcpy  : cudaMemcpyAsync of the same bytes, contiguous, host to device (the copy-engine
//             ceiling: what staging the rows first would at best reach, before the staging);
//   per-row : one cudaMemcpyAsync per row (what copying the rows in place by copy engine costs).
// GB/s = row bytes moved / time. Usage: hisparse_gather_bench [pool_gib=8]
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "gpu_bench_util.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/hisparse.h"

using namespace ml4;
using namespace ml4::cuda;

int main(int argc, char** argv) {
  const double pool_gib = argc > 1 ? std::atof(argv[1]) : 8.0;
  const int64_t row = 656;  // fp8_ds_mla
  const int64_t pool_rows = static_cast<int64_t>(pool_gib * (1ll << 30)) / row;
  auto pool_r = DeviceBuffer::alloc_host_mapped(pool_rows * row);
  BENCH_CHECK(pool_r.status());
  DeviceBuffer pool = std::move(pool_r).value();
  // Random bytes, never zeros (METHOD.md).
  std::mt19937_64 rng(1);
  auto* p = pool.as<uint64_t>();
  for (int64_t i = 0; i < pool_rows * row / 8; ++i) p[i] = rng();
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreate(&s));
  std::printf("pool %.2f GiB pinned host memory, %lld rows of %lld B\n", pool_gib, static_cast<long long>(pool_rows),
              static_cast<long long>(row));
  for (int64_t n : {2048ll, 2048ll * 8, 2048ll * 72, 2048ll * 72 * 4}) {
    auto hot_r = DeviceBuffer::alloc(n * row);
    BENCH_CHECK(hot_r.status());
    DeviceBuffer hot = std::move(hot_r).value();
    std::vector<int64_t> src(n);
    std::vector<int32_t> dst(n);
    for (int64_t i = 0; i < n; ++i) src[i] = static_cast<int64_t>(rng() % pool_rows), dst[i] = static_cast<int32_t>(i);
    auto dsrc = DeviceBuffer::alloc(n * 8).value();
    auto ddst = DeviceBuffer::alloc(n * 4).value();
    BENCH_CHECK(dsrc.upload(src.data(), n * 8));
    BENCH_CHECK(ddst.upload(dst.data(), n * 4));
    HotGatherParams g{pool.as<uint8_t>(), hot.as<uint8_t>(), dsrc.as<int64_t>(), ddst.as<int32_t>(), n, row, pool_rows,
                      n, s};
    const double bytes = static_cast<double>(n) * row;
    const double gather = bench::median_ms(s, 3, 20, [&](int) { BENCH_CHECK(hot_gather(g)); });
    const double memcpy = bench::median_ms(s, 3, 20, [&](int i) {
      const int64_t off = (static_cast<int64_t>(i) * n * row) % (pool_rows * row - n * row);
      BENCH_CUDA(cudaMemcpyAsync(hot.data(), pool.as<uint8_t>() + off, n * row, cudaMemcpyHostToDevice, s));
    });
    const int64_t per_row_n = std::min<int64_t>(n, 2048);
    const double per_row = bench::median_ms(s, 1, 5, [&](int) {
      for (int64_t i = 0; i < per_row_n; ++i)
        BENCH_CUDA(cudaMemcpyAsync(hot.as<uint8_t>() + i * row, pool.as<uint8_t>() + src[i] * row, row,
                                   cudaMemcpyHostToDevice, s));
    });
    std::printf("GATHER rows=%lld MB=%.1f gather_ms=%.3f gather_GBs=%.1f memcpy_contig_ms=%.3f memcpy_GBs=%.1f "
                "ratio=%.2f per_row_copy_GBs=%.2f (%lld rows)\n",
                static_cast<long long>(n), bytes / 1e6, gather, bytes / gather / 1e6, memcpy, bytes / memcpy / 1e6,
                memcpy / gather, static_cast<double>(per_row_n) * row / per_row / 1e6, static_cast<long long>(per_row_n));
  }
  return 0;
}
