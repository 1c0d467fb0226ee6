// CPU backend op harness (llm.c style): times linear() per weight format against a hand
// count of bytes moved and FLOPs, plus the attention core. A plain main, no framework:
//   cpu_ops_bench [--quick] [--shape N,K]
// (--shape: one weight shape, e.g. 131072,2048 for a 2B model's output head; M = 1, 4, 64.)
// Prints one line per case: shape, ms, weight GB/s (bytes of the stored weight / time),
// GFLOP/s (2*M*N*K / time). The bound for M=1 is DRAM bandwidth (measured here by a
// streaming read of the same size, printed first as the ceiling).
//
// Record (2026-12-02, `build-ops/cpu_ops_bench`, dev machine: 2-core AMD EPYC VM shared by
// ~6 builds, load average 5-13, so +-40% run to run; N=4096 K=7168, 2 threads):
//   stream read 7.5-16 GB/s; linear M=1: bf16 6.4-9.0 GB/s (target >= 5), f32 7.7-11 GB/s,
//   fp8 1.6-2.9 GB/s of e4m3 (~3.5-6 G weights/s: decode-bound), nvfp4 1.0-1.7 GB/s,
//   mxfp4 0.9-1.5 GB/s; M=64: 18-43 GFLOP/s; mla_attention H=128 S=2048: 11-20 GFLOP/s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/threads.h"
#include "ops/cpu/ops.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double time_ms(F&& f, int reps) {
  f();  // warm
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) f();
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / reps;
}

ml4::LinearWeight make(ml4::LinearFormat fmt, int64_t N, int64_t K) {
  using namespace ml4;
  std::mt19937 rng(1);
  LinearWeight w;
  w.name = "bench";
  w.format = fmt;
  w.out_features = N;
  w.in_features = K;
  auto fill = [&](Tensor& t, uint8_t mask) {
    auto* p = t.mutable_as<uint8_t>();
    for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng()) & mask;
  };
  switch (fmt) {
    case LinearFormat::kF32:
      w.weight = Tensor(DType::kF32, {N, K});
      for (int64_t i = 0; i < N * K; ++i) w.weight.mutable_as<float>()[i] = 0.01f * (rng() % 200 - 100);
      break;
    case LinearFormat::kBF16:
      w.weight = Tensor(DType::kBF16, {N, K});
      for (int64_t i = 0; i < N * K; ++i) w.weight.mutable_as<uint16_t>()[i] = f32_to_bf16(0.01f * (rng() % 200 - 100));
      break;
    case LinearFormat::kFP8Block:
      w.weight = Tensor(DType::kF8E4M3, {N, K});
      fill(w.weight, 0x77);
      w.scale = Tensor(DType::kF32, {(N + 127) / 128, (K + 127) / 128});
      for (int64_t i = 0; i < w.scale.numel(); ++i) w.scale.mutable_as<float>()[i] = 1e-3f;
      break;
    case LinearFormat::kNVFP4:
      w.weight = Tensor(DType::kU8, {N, K / 2});
      fill(w.weight, 0xff);
      w.scale = Tensor(DType::kF8E4M3, {N, K / 16});
      fill(w.scale, 0x3f);
      w.global_scale = 1e-3f;
      break;
    case LinearFormat::kMXFP4:
      w.weight = Tensor(DType::kU8, {N, K / 2});
      fill(w.weight, 0xff);
      w.scale = Tensor(DType::kE8M0, {N, K / 32});
      for (int64_t i = 0; i < w.scale.numel(); ++i) w.scale.mutable_as<uint8_t>()[i] = 120;
      break;
  }
  return w;
}

const char* name(ml4::LinearFormat f) {
  switch (f) {
    case ml4::LinearFormat::kF32: return "f32";
    case ml4::LinearFormat::kBF16: return "bf16";
    case ml4::LinearFormat::kFP8Block: return "fp8";
    case ml4::LinearFormat::kNVFP4: return "nvfp4";
    case ml4::LinearFormat::kMXFP4: return "mxfp4";
  }
  return "?";
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int64_t N = 4096, K = 7168;
  bool shape = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true, N = 1024;
    else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc && std::sscanf(argv[++i], "%ld,%ld", &N, &K) == 2)
      shape = true;
    else {
      std::fprintf(stderr, "usage: cpu_ops_bench [--quick] [--shape N,K]\n");
      return 2;
    }
  }
  std::printf("threads %d\n", ml4::num_threads());

  {  // Ceiling: a parallel streaming read of N*K*2 bytes (the bf16 weight's size).
    std::vector<float> buf(static_cast<size_t>(N * K / 2), 1.0f);
    std::vector<double> part(64);
    double ms = time_ms([&] {
      ml4::parallel_for(static_cast<int64_t>(buf.size()), 1 << 16, [&](int64_t b, int64_t e) {
        float s[8] = {};  // 8 independent sums: the loop is bound by loads, not add latency
        int64_t i = b;
        for (; i + 8 <= e; i += 8)
          for (int j = 0; j < 8; ++j) s[j] += buf[i + j];
        for (; i < e; ++i) s[0] += buf[i];
        part[b % 64] += s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
      });
    }, 10);
    std::printf("stream read        %8.3f ms  %7.2f GB/s\n", ms, N * K * 2 / ms / 1e6);
  }

  std::vector<float> x(static_cast<size_t>(64 * K)), y(static_cast<size_t>(64 * N));
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.001f * static_cast<float>(i % 1000);
  for (auto fmt : {ml4::LinearFormat::kBF16, ml4::LinearFormat::kFP8Block, ml4::LinearFormat::kNVFP4,
                   ml4::LinearFormat::kMXFP4, ml4::LinearFormat::kF32}) {
    ml4::LinearWeight w = make(fmt, N, K);
    const double wbytes = static_cast<double>(w.weight.nbytes() + (w.scale.empty() ? 0 : w.scale.nbytes()));
    // x in bf16 too (--dtype bfloat16) where it applies and the CPU can.
    const bool bf16x = (fmt == ml4::LinearFormat::kBF16 || fmt == ml4::LinearFormat::kFP8Block) &&
                       ml4::cpu::activation_dtype_supported(ml4::cpu::ActivationDtype::kBF16).ok();
    for (auto act : {ml4::cpu::ActivationDtype::kF32, ml4::cpu::ActivationDtype::kBF16}) {
      if (act == ml4::cpu::ActivationDtype::kBF16 && !bf16x) continue;
      for (int64_t M : {1, 4, 17, 64}) {
        if ((quick && M > 4) || (shape && M == 17)) continue;
        double ms = time_ms([&] { ml4::cpu::linear(x.data(), M, w, y.data(), act); }, M == 1 ? 10 : 3);
        std::printf("linear %-5s x %-4s M=%-3lld N=%lld K=%lld  %8.3f ms  %7.2f GB/s  %7.2f GFLOP/s\n", name(fmt),
                    act == ml4::cpu::ActivationDtype::kBF16 ? "bf16" : "f32", static_cast<long long>(M),
                    static_cast<long long>(N), static_cast<long long>(K), ms, wbytes / ms / 1e6,
                    2.0 * M * N * K / ms / 1e6);
      }
    }
  }

  {  // MLA decode core: 128 heads (TP1 ML4-like), r 512, dr 64, S 2048 gathered rows.
    const int H = quick ? 16 : 128, r = 512, dr = 64;
    const int64_t S = 2048;
    std::vector<float> ql(H * r, 0.01f), qr(H * dr, 0.01f), c(S * r, 0.5f), kr(S * dr, 0.5f),
        sc(H, 0.07f), out(H * r), lse(H);
    double ms = time_ms([&] {
      ml4::cpu::mla_attention(ql.data(), qr.data(), H, r, dr, c.data(), kr.data(), S, sc.data(), out.data(), lse.data());
    }, 3);
    std::printf("mla_attention H=%d S=%lld  %8.3f ms  %7.2f GFLOP/s\n", H, static_cast<long long>(S), ms,
                2.0 * H * S * (2 * r + dr) / ms / 1e6);
  }
  return 0;
}
