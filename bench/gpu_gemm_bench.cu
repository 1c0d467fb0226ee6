// cuBLASLt GEMMs on ML4's projection shapes (presets.cpp "ml4": dim 6144, 64 heads x 192,
// experts 5632 wide, dense 16384), decode-shaped (M = 1..64) and prefill-shaped (4096),
// BF16 and FP8 block-scaled, plus the FP8 activation quantization in front of them.
//
// Bytes counted: weight + activations + output, each once. Decode GEMMs are memory-bound
// (M=64 FP8: 2*64 flop per weight byte, below the card's ~300 flop/byte ridge), so their
// figure is GB/s against the measured copy bandwidth; prefill's is TFLOP/s against the
// gpu_ceilings_bench rates. Weights rotate over enough copies (>= 256 MB) that L2 (60 MB)
// holds none of them between repetitions (METHOD.md).
#include <cstdio>
#include <vector>

#include "gpu_bench_util.h"
#include "ops/cuda/act_quant.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv.h"

using namespace ml4;
using namespace ml4::cuda;

int main(int argc, char** argv) {
  if (!device_available()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  const double copy_gbps = argc > 1 ? std::atof(argv[1]) : 0.0;  // from gpu_ceilings_bench, if given
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreate(&s));
  auto lt = LtGemm::create();
  BENCH_CHECK(lt.status());
  struct Shape {
    const char* name;
    int64_t N, K;
  };
  const Shape shapes[] = {{"wq", 12288, 6144}, {"wkv_a", 576, 6144}, {"wo", 6144, 8192},
                          {"expert_w1", 5632, 6144}, {"expert_w2", 6144, 5632}, {"dense_w1", 16384, 6144}};
  const int64_t Ms[] = {1, 8, 32, 64, 4096};
  std::printf("%-10s %6s %6s %6s %5s %9s %9s %9s %s\n", "shape", "M", "N", "K", "fmt", "us", "GB/s", "TFLOP/s",
              copy_gbps > 0 ? "%copy" : "");
  for (int fp8 = 0; fp8 <= 1; ++fp8) {
    for (const auto& sh : shapes) {
      const size_t wbytes = sh.N * sh.K * (fp8 ? 1 : 2);
      const int copies = static_cast<int>(std::min<size_t>(64, (size_t{256} << 20) / wbytes + 1));
      std::vector<DeviceBuffer> ws, wss;
      for (int c = 0; c < copies; ++c) {
        auto w = DeviceBuffer::alloc(wbytes);
        BENCH_CHECK(w.status());
        if (fp8) {
          BENCH_CHECK(fill_uniform_e4m3(w->data(), sh.N * sh.K, 10 + c, -448, 448, s));
          auto sc = DeviceBuffer::alloc((sh.N / 128 + 1) * (sh.K / 128) * 4);
          BENCH_CHECK(sc.status());
          BENCH_CHECK(fill_uniform_f32(sc->as<float>(), (sh.N / 128 + 1) * (sh.K / 128), 20 + c, 1e-4f, 2e-4f, s));
          wss.push_back(std::move(sc).value());
        } else {
          BENCH_CHECK(fill_uniform_bf16(w->data(), sh.N * sh.K, 10 + c, -0.05f, 0.05f, s));
        }
        ws.push_back(std::move(w).value());
      }
      for (int64_t M : Ms) {
        auto x = DeviceBuffer::alloc(M * sh.K * 4), xq = DeviceBuffer::alloc(M * sh.K * 2),
             xs = DeviceBuffer::alloc(M * (sh.K / 128) * 4), y = DeviceBuffer::alloc(M * sh.N * 2);
        BENCH_CHECK(x.status());
        BENCH_CHECK(xq.status());
        BENCH_CHECK(xs.status());
        BENCH_CHECK(y.status());
        BENCH_CHECK(fill_uniform_f32(x->as<float>(), M * sh.K, 3, -2, 2, s));
        if (fp8) {
          BENCH_CHECK(fp8_act_quant({x->data(), DType::kF32, 0, M, sh.K, 128, xq->data(), xs->as<float>(),
                                     ScaleLayout::kGroupMajor, s}));
        } else {
          BENCH_CHECK(fill_uniform_bf16(xq->data(), M * sh.K, 4, -2, 2, s));
        }
        const double ms = bench::median_ms(s, 3, 30, [&](int i) {
          const int c = i % copies;
          if (fp8) {
            BENCH_CHECK((*lt)->fp8_block({xq->data(), xs->as<float>(), ws[c].data(), wss[c].as<float>(), y->data(),
                                          DType::kBF16, M, sh.N, sh.K, s}));
          } else {
            BENCH_CHECK((*lt)->bf16({xq->data(), ws[c].data(), y->data(), DType::kBF16, M, sh.N, sh.K, s}));
          }
        });
        const double bytes = wbytes + M * sh.K * (fp8 ? 1 : 2) + M * sh.N * 2;
        const double gbps = bytes / (ms * 1e6), tflops = 2.0 * M * sh.N * sh.K / (ms * 1e9);
        std::printf("%-10s %6ld %6ld %6ld %5s %9.1f %9.0f %9.1f", sh.name, M, sh.N, sh.K, fp8 ? "fp8" : "bf16",
                    ms * 1e3, gbps, tflops);
        if (copy_gbps > 0) std::printf(" %5.0f%%", 100.0 * gbps / copy_gbps);
        std::printf("\n");
        if (M <= kGemvMaxM) {  // our GEMV on the same weights (f32 x, no activation quantization)
          auto gws = DeviceBuffer::alloc(gemv_workspace_floats(M, sh.N, sh.K) * 4), yf = DeviceBuffer::alloc(M * sh.N * 4);
          BENCH_CHECK(gws.status());
          BENCH_CHECK(yf.status());
          const double gms = bench::median_ms(s, 3, 30, [&](int i) {
            const int c = i % copies;
            BENCH_CHECK(gemv({x->as<float>(), M, sh.N, sh.K, fp8 ? LinearFormat::kFP8Block : LinearFormat::kBF16,
                              ws[c].data(), fp8 ? wss[c].as<float>() : nullptr, yf->as<float>(), gws->as<float>(), s}));
          });
          const double gb = (wbytes + M * sh.K * 4 + M * sh.N * 4) / (gms * 1e6);
          std::printf("%-10s %6ld %6ld %6ld %5s %9.1f %9.0f %9.1f", "  gemv", M, sh.N, sh.K, fp8 ? "fp8" : "bf16",
                      gms * 1e3, gb, 2.0 * M * sh.N * sh.K / (gms * 1e9));
          if (copy_gbps > 0) std::printf(" %5.0f%%", 100.0 * gb / copy_gbps);
          std::printf("  (%.2fx cuBLASLt)\n", ms / gms);
        }
      }
    }
  }
  {  // act_quant alone: bytes = f32 in + e4m3 out + scales.
    const int64_t M = 4096, K = 6144;
    auto x = DeviceBuffer::alloc(M * K * 4), q = DeviceBuffer::alloc(M * K), sc = DeviceBuffer::alloc(M * K / 128 * 4);
    BENCH_CHECK(x.status());
    BENCH_CHECK(q.status());
    BENCH_CHECK(sc.status());
    BENCH_CHECK(fill_uniform_f32(x->as<float>(), M * K, 5, -3, 3, s));
    const double ms = bench::median_ms(s, 3, 30, [&](int) {
      BENCH_CHECK(fp8_act_quant({x->data(), DType::kF32, 0, M, K, 128, q->data(), sc->as<float>(),
                                 ScaleLayout::kGroupMajor, s}));
    });
    std::printf("act_quant M=%ld K=%ld: %.1f us, %.0f GB/s\n", M, K, ms * 1e3, M * K * (4 + 1 + 4.0 / 128) / (ms * 1e6));
  }
  return 0;
}
