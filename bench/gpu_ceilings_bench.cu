// The two ceilings of the card (METHOD.md "Two numbers first"), measured once per run so
// every other figure is set against numbers from the same machine:
//   HBM copy bandwidth: a 2 GiB device-to-device copy, bytes read + written;
//   BF16 and FP8 (128x128 block weight scales, 1x128 activation scales) matrix rates:
//   8192^3 through cuBLASLt (ops/cuda/gemm.h) on random data (never zeros: METHOD.md).
// Output: one "CEILING name value unit" line per figure (scripts/gpu_run.sh greps them).
#include <cstdio>

#include "gpu_bench_util.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/gemm.h"

using namespace ml4;
using namespace ml4::cuda;

int main() {
  if (!device_available()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MiB, %.1f GiB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, prop.totalGlobalMem / 1073741824.0);
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreate(&s));

  {  // HBM copy.
    const size_t bytes = size_t{2} << 30;
    auto a = DeviceBuffer::alloc(bytes), b = DeviceBuffer::alloc(bytes);
    BENCH_CHECK(a.status());
    BENCH_CHECK(b.status());
    BENCH_CHECK(fill_uniform_f32(a->as<float>(), bytes / 4, 1, -1, 1, s));
    const double ms = bench::median_ms(s, 3, 20, [&](int) {
      BENCH_CUDA(cudaMemcpyAsync(b->data(), a->data(), bytes, cudaMemcpyDeviceToDevice, s));
    });
    std::printf("CEILING hbm_copy %.0f GB/s (2 x %zu bytes in %.3f ms)\n", 2.0 * bytes / (ms * 1e6), bytes, ms);
  }

  auto lt = LtGemm::create();
  BENCH_CHECK(lt.status());
  const int64_t M = 8192, N = 8192, K = 8192;
  const double flop = 2.0 * M * N * K;
  {  // BF16.
    auto x = DeviceBuffer::alloc(M * K * 2), w = DeviceBuffer::alloc(N * K * 2), y = DeviceBuffer::alloc(M * N * 2);
    BENCH_CHECK(x.status());
    BENCH_CHECK(w.status());
    BENCH_CHECK(y.status());
    BENCH_CHECK(fill_uniform_bf16(x->data(), M * K, 2, -1, 1, s));
    BENCH_CHECK(fill_uniform_bf16(w->data(), N * K, 3, -1, 1, s));
    GemmBf16Params p{x->data(), w->data(), y->data(), DType::kBF16, M, N, K, s};
    const double ms = bench::median_ms(s, 3, 20, [&](int) { BENCH_CHECK((*lt)->bf16(p)); });
    std::printf("CEILING bf16_gemm %.0f TFLOP/s (8192^3 cuBLASLt, bf16 out, %.3f ms)\n", flop / (ms * 1e9), ms);
  }
  {  // FP8 block-scaled.
    auto x = DeviceBuffer::alloc(M * K), w = DeviceBuffer::alloc(N * K), y = DeviceBuffer::alloc(M * N * 2);
    auto xs = DeviceBuffer::alloc(K / 128 * M * 4), ws = DeviceBuffer::alloc(N / 128 * K / 128 * 4);
    BENCH_CHECK(x.status());
    BENCH_CHECK(w.status());
    BENCH_CHECK(y.status());
    BENCH_CHECK(xs.status());
    BENCH_CHECK(ws.status());
    BENCH_CHECK(fill_uniform_e4m3(x->data(), M * K, 4, -448, 448, s));
    BENCH_CHECK(fill_uniform_e4m3(w->data(), N * K, 5, -448, 448, s));
    BENCH_CHECK(fill_uniform_f32(xs->as<float>(), K / 128 * M, 6, 1e-4f, 2e-4f, s));
    BENCH_CHECK(fill_uniform_f32(ws->as<float>(), N / 128 * K / 128, 7, 1e-4f, 2e-4f, s));
    GemmFp8BlockParams p{x->data(), xs->as<float>(), w->data(), ws->as<float>(), y->data(), DType::kBF16, M, N, K, s};
    const double ms = bench::median_ms(s, 3, 20, [&](int) { BENCH_CHECK((*lt)->fp8_block(p)); });
    std::printf("CEILING fp8_block_gemm %.0f TFLOP/s (8192^3 cuBLASLt VEC128 x BLK128x128, bf16 out, %.3f ms)\n",
                flop / (ms * 1e9), ms);
  }
  BENCH_CUDA(cudaStreamDestroy(s));
  return 0;
}
