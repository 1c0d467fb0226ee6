// GEMMs on ML4's projection shapes (presets.cpp "ml4": dim 6144; wq_a 1536, wkv_a 576, wq 12288
// (no query LoRA, as in ml4-slice-4), wo 6144 x 8192, experts 5632 wide, dense 16384), decode-
// shaped (M = 1..64) and prefill-shaped (4096): BF16 through cuBLASLt, FP8 block-scaled through
// cuBLASLt and through our kernel (fp8_gemm.h), our GEMV at M <= 8 (the earlier CUDA-core kernel,
// the register-pipelined tensor-core stream and the cp.async ring kernel, same run), plus the FP8
// activation quantization in front of them. `gpu_gemm_bench [copy GB/s] gemv`: the decode rows
// alone (M <= 8), a short device run.
//
// Bytes counted: weight + activations + output, each once (FP8 rows: f32 output, what
// linear_f32 asks for; the cuBLASLt FP8 row includes its y^T -> y transpose). Decode GEMMs
// are memory-bound (M=64 FP8: 2*64 flop per weight byte, below the card's ~300 flop/byte
// ridge), so their figure is GB/s against the measured copy bandwidth; prefill's is
// TFLOP/s against the gpu_ceilings_bench rates (BF16 779, FP8 1287 TFLOP/s). "floor" is
// max(bytes / copy, flops / peak) in microseconds: the time the row could reach at best.
// Weights rotate over enough copies (>= 256 MB) that L2 (60 MB) holds none of them between
// repetitions (METHOD.md).
#include <algorithm>
#include <cstdio>
#include <string>
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
  const double copy_gbps = argc > 1 ? std::atof(argv[1]) : 4253.0;  // from gpu_ceilings_bench, if given
  const double bf16_peak = 779e12, fp8_peak = 1287e12;
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreate(&s));
  auto lt = LtGemm::create();
  BENCH_CHECK(lt.status());
  struct Shape {
    const char* name;
    int64_t N, K;
  };
  const Shape shapes[] = {{"wq_a", 1536, 6144},      {"wkv_a", 576, 6144},       {"wq", 12288, 6144},
                          {"wo", 6144, 8192},
                          {"expert_w1", 5632, 6144}, {"expert_w2", 6144, 5632}, {"dense_w1", 16384, 6144}};
  // argv[2] == "gemv": decode rows only (M <= 8: our GEMV variants and the BF16 cuBLASLt /
  // own FP8 GEMM peers), for a short device run.
  // argv[2] == "profile": wo at M = 1 only (BF16 and FP8), one launch per GEMV kernel, untimed (for ncu).
  const bool profile_only = argc > 2 && std::string(argv[2]) == "profile";
  const bool gemv_only = profile_only || (argc > 2 && std::string(argv[2]) == "gemv");
  std::vector<int64_t> Ms = {1, 2, 4, 8, 32, 64, 4096};
  if (gemv_only) Ms = {1, 2, 4, 8};
  if (profile_only) Ms = {1};
  std::printf("copy %.0f GB/s, peaks bf16 %.0f / fp8 %.0f TFLOP/s\n", copy_gbps, bf16_peak / 1e12, fp8_peak / 1e12);
  std::printf("%-10s %5s %6s %6s %5s %-9s %9s %8s %8s %6s %6s %8s\n", "shape", "M", "N", "K", "fmt", "backend", "us",
              "GB/s", "TFLOP/s", "%copy", "%peak", "floor_us");
  auto row = [&](const char* name, int64_t M, int64_t N, int64_t K, const char* fmt, const char* be, double ms,
                 double bytes, double peak) {
    const double flops = 2.0 * M * N * K;
    const double gbps = bytes / (ms * 1e6), tf = flops / (ms * 1e9);
    const double floor_us = std::max(bytes / (copy_gbps * 1e3), flops / peak * 1e6);
    std::printf("%-10s %5ld %6ld %6ld %5s %-9s %9.1f %8.0f %8.1f %5.0f%% %5.0f%% %8.1f\n", name, M, N, K, fmt, be,
                ms * 1e3, gbps, tf, 100.0 * gbps / copy_gbps, 100.0 * tf * 1e12 / peak, floor_us);
  };
  // Passes: BF16 (cuBLASLt + GEMV), FP8 ours (+ GEMV), FP8 cuBLASLt last (a fault inside
  // cuBLASLt would end the run; the rows before it are printed).
  for (int pass = 0; pass < (gemv_only ? 2 : 3); ++pass) {
    const int fp8 = pass > 0;
    const Fp8Backend fp8_be = pass == 1 ? Fp8Backend::kOwn : Fp8Backend::kCublasLt;
    // (profile: BF16 too, the stream kernel at the copy rate beside the FP8 one)
    for (const auto& sh : shapes) {
      if (profile_only && std::string(sh.name) != "wo") continue;
      const size_t wbytes = sh.N * sh.K * (fp8 ? 1 : 2);
      const int64_t nb = (sh.N + 127) / 128, kb = sh.K / 128;  // ML4's K/128 are multiples of 4
      const int copies = static_cast<int>(std::min<size_t>(64, (size_t{256} << 20) / wbytes + 1));
      std::vector<DeviceBuffer> ws, wss;
      for (int c = 0; c < copies; ++c) {
        auto w = DeviceBuffer::alloc(wbytes);
        BENCH_CHECK(w.status());
        if (fp8) {
          BENCH_CHECK(fill_uniform_e4m3(w->data(), sh.N * sh.K, 10 + c, -448, 448, s));
          auto sc = DeviceBuffer::alloc(nb * kb * 4);
          BENCH_CHECK(sc.status());
          BENCH_CHECK(fill_uniform_f32(sc->as<float>(), nb * kb, 20 + c, 1e-4f, 2e-4f, s));
          wss.push_back(std::move(sc).value());
        } else {
          BENCH_CHECK(fill_uniform_bf16(w->data(), sh.N * sh.K, 10 + c, -0.05f, 0.05f, s));
        }
        ws.push_back(std::move(w).value());
      }
      for (int64_t M : Ms) {
        const int64_t m4 = (M + 3) / 4 * 4;
        auto x = DeviceBuffer::alloc(M * sh.K * 4), xq = DeviceBuffer::alloc(m4 * sh.K * 2),
             xs = DeviceBuffer::alloc(m4 * kb * 4), y = DeviceBuffer::alloc(M * sh.N * 4);
        BENCH_CHECK(x.status());
        BENCH_CHECK(xq.status());
        BENCH_CHECK(xs.status());
        BENCH_CHECK(y.status());
        BENCH_CHECK(fill_uniform_f32(x->as<float>(), M * sh.K, 3, -2, 2, s));
        if (!fp8) {
          BENCH_CHECK(fill_uniform_bf16(xq->data(), M * sh.K, 4, -2, 2, s));
          const double ms = bench::median_ms(s, 2, 20, [&](int i) {
            BENCH_CHECK((*lt)->bf16({xq->data(), ws[i % copies].data(), y->data(), DType::kBF16, M, sh.N, sh.K, s}));
          });
          row(sh.name, M, sh.N, sh.K, "bf16", "cublaslt", ms, wbytes + M * sh.K * 2.0 + M * sh.N * 2.0, bf16_peak);
        } else {
          Fp8ActQuantParams q{x->data(), DType::kF32, 0, M, sh.K, 128, xq->data(), xs->as<float>(),
                              ScaleLayout::kGroupMajor, s};
          q.rows_out = m4;
          BENCH_CHECK(fp8_act_quant(q));
          const double bytes = wbytes + nb * kb * 4.0 + M * sh.K * (1 + 4.0 / 128) + M * sh.N * 4.0;
          for (Fp8Backend be : {fp8_be}) {
            (*lt)->set_fp8_backend(be);
            GemmFp8BlockParams p{xq->data(), xs->as<float>(), nullptr, nullptr, y->data(), DType::kF32, M, sh.N, sh.K,
                                 s};
            p.m_pad = m4;
            p.w_scale_ld = kb;
            p.w = ws[0].data();
            p.w_scale = wss[0].as<float>();
            Status st = (*lt)->fp8_block(p);
            if (!st.ok()) {
              std::printf("%-10s %5ld %6ld %6ld %5s %-9s %s\n", sh.name, M, sh.N, sh.K, "fp8",
                          be == Fp8Backend::kOwn ? "own" : "cublaslt", st.message().c_str());
              continue;
            }
            const double ms = bench::median_ms(s, 2, 20, [&](int i) {
              p.w = ws[i % copies].data();
              p.w_scale = wss[i % copies].as<float>();
              BENCH_CHECK((*lt)->fp8_block(p));
            });
            row(sh.name, M, sh.N, sh.K, "fp8", be == Fp8Backend::kOwn ? "own" : "cublaslt", ms, bytes, fp8_peak);
          }
          (*lt)->set_fp8_backend(Fp8Backend::kAuto);
        }
        if (M <= kGemvMaxM && pass < 2) {
          // Our GEMV on the same weights (f32 x, no activation quantization), with a split-K
          // workspace as the runner gives it: "gemv-cc" = the earlier CUDA-core kernel,
          // "gemv-tc" = the register-pipelined tensor-core stream (L2 prefetch off, measured
          // slower), "st-cC-rR" = the CUDA-core weight stream (gemv_stream.cuh) with e4m3
          // decoding C (0 integer -> f16, 1 cvt -> f16, 2 integer -> f32; bf16: none) and R
          // rows per block. Bytes: W (+ FP8 scales) + f32 x + f32 y.
          auto gws = DeviceBuffer::alloc(gemv_workspace_floats(M, sh.N, sh.K) * 4);
          BENCH_CHECK(gws.status());
          const double gbytes = wbytes + (fp8 ? nb * kb * 4.0 : 0.0) + M * sh.K * 4.0 + M * sh.N * 4.0;
          struct V {
            GemvImpl impl;
            int conv, rows;
            int warp_rows = 0;  // 2 ("st-warp"): each warp its own 4 rows (FP8 at M <= 2); 0: shared
            int mma = 0;        // 4 ("st-mma"): FP8 at M <= 4 on the tensor cores in f16 (gemv_mma.cuh)
            int mma_warps = 0;  // its warps a block ("st-mmaW"; 0: by N)
          };
          // (decoding 2, integer -> f32, measured slowest on the H200 at every shape: not listed)
          std::vector<V> vs = {{GemvImpl::kCudaCore, 0, 0}, {GemvImpl::kTensorCore, 0, 0},
                               {GemvImpl::kStream, 1, 2}, {GemvImpl::kStream, 1, 4}};
          if (fp8) vs.push_back({GemvImpl::kStream, 0, 4});
          if (fp8) vs.push_back({GemvImpl::kStream, 1, 0, 2});
          if (fp8)
            for (int mw : {0, 4, 8, 16}) vs.push_back({GemvImpl::kStream, 1, 0, 0, 4, mw});
          if (profile_only) vs = {{GemvImpl::kStream, 1, 4}, {GemvImpl::kStream, 1, 0, 2}, {GemvImpl::kStream, 1, 0, 0, 4}};
          const GemvStreamConfig saved = gemv_stream_config();
          for (const V& v : vs) {
            GemvStreamConfig c = saved;
            c.conv = v.conv;
            c.rows = v.rows;
            c.warp_rows = v.warp_rows;
            c.warp_rows_max_m = 2;
            c.mma = v.mma;  // 0: the stream variants are the CUDA-core stream at every M
            c.mma_min_m = 1;
            c.mma_warps = v.mma_warps;
            gemv_set_stream_config(c);
            auto launch = [&](int i) {
              const int cc = i % copies;
              BENCH_CHECK(gemv({x->as<float>(), M, sh.N, sh.K, fp8 ? LinearFormat::kFP8Block : LinearFormat::kBF16,
                                ws[cc].data(), fp8 ? wss[cc].as<float>() : nullptr, y->as<float>(), gws->as<float>(),
                                s, v.impl}));
            };
            char name[32];
            if (v.mma > 0 && v.mma_warps > 0)
              std::snprintf(name, sizeof name, "st-mma%d", v.mma_warps);
            else if (v.mma > 0)
              std::snprintf(name, sizeof name, "st-mma");
            else if (v.impl == GemvImpl::kStream && v.warp_rows > 0)
              std::snprintf(name, sizeof name, "st-warp");
            else if (v.impl == GemvImpl::kStream)
              std::snprintf(name, sizeof name, "st-c%d-r%d", v.conv, v.rows);
            else
              std::snprintf(name, sizeof name, "%s", v.impl == GemvImpl::kCudaCore ? "gemv-cc" : "gemv-tc");
            if (profile_only) {  // a few launches for the profiler, no timing
              launch(0);
              BENCH_CUDA(cudaStreamSynchronize(s));
              std::printf("profiled %s %s M=%ld\n", sh.name, name, M);
              continue;
            }
            const double gms = bench::median_ms(s, 3, 30, launch);
            row(sh.name, M, sh.N, sh.K, fp8 ? "fp8" : "bf16", name, gms, gbytes, fp8 ? fp8_peak : bf16_peak);
            // Back to back: 20 launches (weights rotating) between one event pair, per launch --
            // what a graph of consecutive GEMVs sees, without the single launch's fixed latency;
            // then the same with programmatic dependent launch (pdl.cuh; the decode step's setting
            // at one token): each launch's prologue and its blocks' L2 prefetch of their rows overlap
            // the tail of the one before, so the difference is what a launch's ramp and tail cost in
            // the step. Third: PDL without the L2 prefetch (GemvStreamConfig::pdl_prefetch_bytes 0).
            const bool pdl_saved = programmatic_launch();
            const GemvStreamConfig with_prefetch = gemv_stream_config();
            for (int mode = 0; mode < 3; ++mode) {
              set_programmatic_launch(mode > 0);
              GemvStreamConfig pc = with_prefetch;
              if (mode == 2) pc.pdl_prefetch_bytes = 0;
              gemv_set_stream_config(pc);
              const double b2b = bench::median_ms(s, 1, 5, [&](int j) {
                                   for (int i = 0; i < 20; ++i) launch(j * 20 + i);
                                 }) / 20.0;
              std::printf("%-10s %5ld %6ld %6ld %5s %-9s %9.1f us back-to-back%s (%.0f%% of copy)\n", sh.name, M,
                          sh.N, sh.K, fp8 ? "fp8" : "bf16", name, b2b * 1e3,
                          mode == 1 ? ", PDL" : mode == 2 ? ", PDL no prefetch" : "",
                          100.0 * gbytes / (b2b * 1e6) / copy_gbps);
            }
            gemv_set_stream_config(with_prefetch);
            set_programmatic_launch(pdl_saved);
          }
          gemv_set_stream_config(saved);
        }
      }
    }
  }
  if (!gemv_only) {  // act_quant alone: bytes = f32 in + e4m3 out + scales.
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
