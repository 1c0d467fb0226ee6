// Small-M GEMV (ops/cuda/gemv.h) against cpu::linear on the same LinearWeight and the same
// f32 activations. Both accumulate f32 products of exactly decoded weights; only the
// order differs (per-lane partial sums, one warp reduction, per-128-block FP8 scale
// products, split-K slices): ~sqrt(K) 2^-24 relative, bound 1e-5. The tensor-core path
// splits x into three bf16 parts whose sum is x exactly (24 significand bits), so each
// product w * part is exact in f32 and its mma accumulates in f32 (per-mma rounding of
// the same order as an f32 add): the same bound. Every kernel variant is run: tensor
// cores with a workspace (split-K), tensor cores without (one slice, several 1024-k x
// chunks), kAuto with a workspace, and the CUDA-core kernel (null workspace); M = 1..8, N
// tails (not a multiple of 16 / 128), bf16 K tails (not a multiple of 32), and the CUDA-core
// weight stream (kStream: 2 and 4 rows per block, each of its three exact e4m3 decodings;
// f32 FMAs over 4-k partials times the block scale, the same bound). AllE4m3Codes
// checks both kernels' e4m3 decoding on every finite code (subnormals, -0, +-448) bit for
// bit: one-hot x makes every
// output a single exact product (weight times a power-of-two block scale), so any variant
// must return exactly e4m3_to_f32(code) * scale. The f16 mma kernel (gemv_mma.cuh; variants
// "stream-mma4/8/16", each warp count, and "auto-mma", kAuto with the count by N) keeps x to 22
// bits (two f16 parts of x times a power of two per 256 k): each element off by <= 2^-22
// relative, rms ~1.4e-7, far inside the same 1e-5; one-hot x (1.0, a power of two) it keeps
// exactly. MmaKeepsEachTokensRange gives its tokens magnitudes 2^-100 .. 2^90 apart and checks
// each token's own relative error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "cuda_test_util.h"
#include "model/quant.h"
#include "ops/cpu/linear.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/gemv_tc.cuh"
#include "ops/cuda/linear.h"

namespace ml4::cuda {
namespace {

using namespace testing;

TEST(CudaGemv, MatchesCpuLinear) {
  ML4_REQUIRE_GPU();
  struct Shape {
    int64_t M, N, K;
  };
  const Shape shapes[] = {{1, 576, 6144}, {3, 576, 1024}, {8, 160, 2048}, {2, 12288, 512}, {5, 9000, 256},
                          {8, 16384, 384}, {4, 100, 128}, {6, 1536, 6144}, {7, 200, 1000}, {1, 4100, 2048},
                          {1, 301, 640}, {1, 300, 20480}, {2, 301, 640}};
  uint32_t seed = 1;
  for (LinearFormat f : {LinearFormat::kBF16, LinearFormat::kFP8Block}) {
    for (const auto& s : shapes) {
      if (f == LinearFormat::kFP8Block && s.K % 128 != 0) continue;
      auto wf = randn(s.N * s.K, seed++, 0.05f);
      auto W = quantize_linear(wf.data(), s.N, s.K, f, "w");
      ML4_ASSERT_OK(W.status());
      auto x = randn(s.M * s.K, seed++);
      std::vector<float> ref(s.M * s.N);
      cpu::linear(x.data(), s.M, *W, ref.data());
      auto dx = to_device(x);
      auto dw = DeviceBuffer::alloc(W->weight.nbytes());
      ML4_ASSERT_OK(dw.status());
      ML4_ASSERT_OK(dw->upload(W->weight.data(), W->weight.nbytes()));
      DeviceBuffer dws;
      if (f == LinearFormat::kFP8Block) {
        auto b = DeviceBuffer::alloc(W->scale.nbytes());
        ML4_ASSERT_OK(b.status());
        ML4_ASSERT_OK(b->upload(W->scale.data(), W->scale.nbytes()));
        dws = std::move(b).value();
      }
      auto ws = poisoned<float>(gemv_workspace_floats(s.M, s.N, s.K));
      struct Variant {
        const char* name;
        bool ws;
        GemvImpl impl;
        int conv, rows;  // stream kernel: e4m3 decoding, rows per block (0: by N)
        int warp_rows = 1;  // FP8 at M = 1: each warp its own 4 rows (another summation order): 1
                            // where N >= 16 blocks an SM (the default), 2 always, 0 never
        int warp_rows_max_m = 1;  // ... at M up to this (the stream variants; kAuto: the default)
        int mma = 0;              // FP8 at M <= this on the tensor cores in f16 (gemv_mma.cuh)
        int mma_warps = 0;        // its warps a block (0: by N)
      };
      const GemvStreamConfig saved = gemv_stream_config();
      for (const Variant v : {Variant{"tc+splitk", true, GemvImpl::kTensorCore, 0, 0},
                              Variant{"tc", false, GemvImpl::kTensorCore, 0, 0},
                              Variant{"cudacore", false, GemvImpl::kCudaCore, 0, 0},
                              Variant{"auto", false, GemvImpl::kAuto, 0, 0},
                              Variant{"auto+splitk", true, GemvImpl::kAuto, 0, 0},
                              Variant{"stream-c0r2", false, GemvImpl::kStream, 0, 2},
                              Variant{"stream-c0r4", false, GemvImpl::kStream, 0, 4},
                              Variant{"stream-c1", false, GemvImpl::kStream, 1, 0},
                              Variant{"stream-c1-shared", false, GemvImpl::kStream, 1, 0, 0},
                              Variant{"stream-warp", false, GemvImpl::kStream, 1, 0, 2},
                              Variant{"stream-warp-m2", false, GemvImpl::kStream, 1, 0, 2, 2},
                              Variant{"stream-c2", false, GemvImpl::kStream, 2, 0},
                              Variant{"stream-mma4", false, GemvImpl::kStream, 1, 0, 1, 1, 4, 4},
                              Variant{"stream-mma8", false, GemvImpl::kStream, 1, 0, 1, 1, 4, 8},
                              Variant{"stream-mma16", false, GemvImpl::kStream, 1, 0, 1, 1, 4, 16},
                              Variant{"auto-mma", false, GemvImpl::kAuto, 1, 0, 1, 1, 4}}) {
        if (v.mma > 0 && f != LinearFormat::kFP8Block) continue;  // FP8 only
        if (f == LinearFormat::kBF16 && v.impl == GemvImpl::kStream && v.conv != 1) continue;  // no e4m3 to decode
        if (v.warp_rows_max_m == 2 && s.M != 2) continue;  // elsewhere the same launch as stream-warp
        GemvStreamConfig c = saved;  // kAuto variants: the defaults
        if (v.impl == GemvImpl::kStream) {
          c.conv = v.conv;
          c.rows = v.rows;
          c.warp_rows = v.warp_rows;
          c.warp_rows_max_m = v.warp_rows_max_m;
          c.mma = v.mma;  // 0: the CUDA-core stream at every M (its passes of 4 too)
        }
        if (v.mma > 0) {  // at every M
          c.mma = v.mma;
          c.mma_min_m = 1;
          c.mma_warps = v.mma_warps;
        }
        gemv_set_stream_config(c);
        std::vector<std::vector<float>> runs;
        for (int rep = 0; rep < 2; ++rep) {
          auto dy = poisoned<float>(s.M * s.N);
          ML4_ASSERT_OK(gemv({dx.as<float>(), s.M, s.N, s.K, f, dw->data(), dws.as<float>(), dy.as<float>(),
                              v.ws ? ws.as<float>() : nullptr, nullptr, v.impl}));
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          runs.push_back(to_host<float>(dy, s.M * s.N));
        }
        ASSERT_TRUE(all_finite(runs[0])) << "unwritten output " << v.name;
        const double e = rel_err(runs[0], ref);
        std::printf("gemv %-11s %s M=%ld N=%ld K=%ld rel_err=%.3g (bound 1e-5)\n", v.name, linear_format_name(f), s.M,
                    s.N, s.K, e);
        EXPECT_LT(e, 1e-5) << v.name;
        EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4)) << "not deterministic " << v.name;
      }
      gemv_set_stream_config(saved);
    }
  }
  auto b = DeviceBuffer::alloc(1024);
  EXPECT_EQ(gemv({b->as<float>(), 9, 16, 16, LinearFormat::kBF16, b->data(), nullptr, b->as<float>(), nullptr, nullptr})
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gemv({b->as<float>(), 1, 16, 100, LinearFormat::kFP8Block, b->data(), b->as<float>(), b->as<float>(),
                  nullptr, nullptr})
                .code(),
            StatusCode::kInvalidArgument);
}


// The exact mode (x_parts < 0, --batch-invariant): a token's outputs do not depend on the
// other rows of its launch. Each format's 8-row launch against every window of 1..7 of its
// rows launched alone (offsets 0 and 8 - m), bit for bit: BF16 and FP8 take gemv_tc at every M
// and N with the split-K count of 8 rows, FP4 the exact CUDA-core stream. The wide shape is the
// smallest (by N * K) whose split-K count outside the exact mode differs between 1 and 8 rows on
// this card (gemv_tc::tc_split), so the split rule is exercised; the narrow one (N = 300, K = 256)
// would stream at M <= 2 outside the exact mode. The 8-row launch also matches cpu::linear (f32
// sums of exact products: 1e-5), and outside the exact mode the M = 1 launch too.
TEST(CudaGemv, ExactModeIsBatchInvariant) {
  ML4_REQUIRE_GPU();
  constexpr int64_t M = kGemvMaxM;
  struct Shape {
    int64_t N, K;
  };
  auto split_varies = [](int64_t N, int64_t K, gemv_tc::TcFormat f) {
    int64_t ks = 0;
    const int s1 = gemv_tc::tc_split(1, N, K, f, true, &ks);
    for (int64_t m = 2; m <= M; ++m)
      if (gemv_tc::tc_split(m, N, K, f, true, &ks) != s1) return true;
    return false;
  };
  uint32_t seed = 91;
  for (LinearFormat f : {LinearFormat::kBF16, LinearFormat::kFP8Block, LinearFormat::kNVFP4}) {
    std::vector<Shape> shapes = {{300, 256}};
    if (f != LinearFormat::kNVFP4) {
      Shape wide{0, 0};
      for (int64_t N = 16; N <= 20000; N += 16)
        for (int64_t K = 256; K <= 8192; K += 128)
          if ((wide.N == 0 || N * K < wide.N * wide.K) && split_varies(N, K, gemv_tc::tc_format(f))) wide = {N, K};
      ASSERT_GT(wide.N, 0) << "no shape whose split-K count depends on M: the rule this test guards is gone";
      shapes.push_back(wide);
    }
    for (const Shape s : shapes) {
      auto wf = randn(s.N * s.K, seed++, 0.05f);
      auto W = quantize_linear(wf.data(), s.N, s.K, f, "w");
      ML4_ASSERT_OK(W.status());
      // The weight's bytes as they are (upload_linear also fits FP8 to the prefill GEMM, which
      // refuses N % 16 != 0); FP4 through upload_linear (its global scale after the scales).
      DeviceBuffer dw, dsc;
      if (f == LinearFormat::kNVFP4) {
        auto dl = upload_linear(*W);
        ML4_ASSERT_OK(dl.status());
        dw = std::move(dl->weight);
        dsc = std::move(dl->scale);
      } else {
        dw = to_device_bytes(W->weight.data(), W->weight.nbytes());
        if (f == LinearFormat::kFP8Block) dsc = to_device_bytes(W->scale.data(), W->scale.nbytes());
      }
      auto x = randn(M * s.K, seed++);
      std::vector<float> ref(M * s.N);
      cpu::linear(x.data(), M, *W, ref.data());
      auto dx = to_device(x);
      auto ws = poisoned<float>(gemv_workspace_floats(M, s.N, s.K));
      auto run = [&](int64_t m0, int64_t m, int x_parts) {
        auto dy = poisoned<float>(m * s.N);
        GemvParams p{dx.as<float>() + m0 * s.K, m, s.N, s.K, f, dw.data(), dsc.as<float>(),
                     dy.as<float>(), ws.as<float>(), nullptr};
        p.x_parts = x_parts;
        EXPECT_TRUE(gemv(p).ok());
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        return to_host<float>(dy, m * s.N);
      };
      const auto all = run(0, M, -1);
      ASSERT_TRUE(all_finite(all));
      EXPECT_LT(rel_err(all, ref), 1e-5) << linear_format_name(f) << " N=" << s.N << " K=" << s.K;
      int differ = 0, launches = 0;
      for (int64_t m = 1; m < M; ++m) {
        for (int64_t m0 : {int64_t{0}, M - m}) {
          const auto part = run(m0, m, -1);
          differ += std::memcmp(part.data(), all.data() + m0 * s.N, m * s.N * 4) != 0;
          ++launches;
        }
      }
      std::printf("gemv exact mode %s N=%ld K=%ld: %d of %d launches of 1..7 rows differ from the 8-row one (bound 0)\n",
                  linear_format_name(f), s.N, s.K, differ, launches);
      EXPECT_EQ(differ, 0) << linear_format_name(f) << " N=" << s.N << " K=" << s.K;
      const auto one = run(0, 1, 0);  // outside the exact mode (the stream at M = 1)
      EXPECT_LT(rel_err(one, std::vector<float>(ref.begin(), ref.begin() + s.N)), 1e-5);
    }
  }
}

TEST(CudaGemv, MmaKeepsEachTokensRange) {
  ML4_REQUIRE_GPU();
  // K = 1280: 10 scale blocks over 4 warps (2, 3, 2, 3: chunks of 256 and of 128 k); N = 300:
  // a partial 16-row tile. Token m is randn times 2^e[m]; M = 3 runs a pass of 4 with one
  // row unused, M = 6 two passes.
  const int64_t N = 300, K = 1280;
  const int e[6] = {-100, 60, 0, -37, 17, 90};
  auto wf = randn(N * K, 77, 0.05f);
  auto W = quantize_linear(wf.data(), N, K, LinearFormat::kFP8Block, "w");
  ML4_ASSERT_OK(W.status());
  auto dw = DeviceBuffer::alloc(W->weight.nbytes());
  ML4_ASSERT_OK(dw.status());
  ML4_ASSERT_OK(dw->upload(W->weight.data(), W->weight.nbytes()));
  auto dsc = DeviceBuffer::alloc(W->scale.nbytes());
  ML4_ASSERT_OK(dsc.status());
  ML4_ASSERT_OK(dsc->upload(W->scale.data(), W->scale.nbytes()));
  const GemvStreamConfig saved = gemv_stream_config();
  GemvStreamConfig c = saved;
  c.mma = 4;
  c.mma_min_m = 1;
  for (int warps : {4, 16}) {
    c.mma_warps = warps;  // 16: 10 scale blocks over 16 warps, six of them idle (16 -> 8 at M > 2)
    gemv_set_stream_config(c);
    for (int64_t M : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{6}}) {
      auto x = randn(M * K, 100 + static_cast<uint32_t>(M));
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) x[m * K + k] = std::ldexp(x[m * K + k], e[m]);
      std::vector<float> ref(M * N);
      cpu::linear(x.data(), M, *W, ref.data());
      auto dx = to_device(x);
      auto dy = poisoned<float>(M * N);
      ML4_ASSERT_OK(gemv({dx.as<float>(), M, N, K, LinearFormat::kFP8Block, dw->data(), dsc->as<float>(),
                          dy.as<float>(), nullptr, nullptr, GemvImpl::kStream}));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto y = to_host<float>(dy, M * N);
      for (int64_t m = 0; m < M; ++m) {
        const std::vector<float> ym(y.begin() + m * N, y.begin() + (m + 1) * N);
        const std::vector<float> rm(ref.begin() + m * N, ref.begin() + (m + 1) * N);
        ASSERT_TRUE(all_finite(ym)) << "M " << M << " token " << m;
        const double err = rel_err(ym, rm);
        std::printf("gemv mma warps=%d M=%ld token %ld (x ~2^%d) rel_err=%.3g (bound 1e-5)\n", warps, M, m, e[m], err);
        EXPECT_LT(err, 1e-5) << "M " << M << " token " << m;
      }
    }
  }
  gemv_set_stream_config(saved);
}

// NVFP4 / MXFP4 through upload_linear, M = 1..20 (passes of up to 8 tokens), N not a multiple
// of the rows a block owns, K a multiple of 256 and not (a partial load batch), on both
// kernels: the exact CUDA-core stream (gemv_fp4.cuh; impl kStream, or x_parts -1) and the
// tensor-core kernel (gemv_tc.cuh, the default) with x in 3, 2 and 1 bf16 parts, with and
// without split-K.
// Bounds on ||y - ref|| / ||ref||, ref = cpu::linear (f32 x times the same weights):
//   stream, and 3 parts: the weights are the CPU's bit for bit and every product is exact, so
//     only the f32 summation order differs: 1e-5 as above;
//   2 parts: x keeps 16 significant bits, each element off by at most 2^-17 relative (rms
//     2^-17 / sqrt(3) = 4.4e-6 for round-to-nearest); with x and W independent the output's
//     relative error is that rms: bound 2e-5 (4.5 sigma of the mean, which concentrates);
//   1 part: x rounded to bf16, 2^-9 / sqrt(3) = 1.1e-3 rms: bound 3e-3.
// Two runs bit-identical. Then every byte of e2m1 pairs under a spread of scale codes
// (subnormal and large e4m3, e8m0 0 and 254, NaN codes) with one-hot x: each output is one
// exact weight, equal to dequantize_linear's, on both kernels.
TEST(CudaGemv, Fp4MatchesCpuLinear) {
  ML4_REQUIRE_GPU();
  struct Shape {
    int64_t M, N, K;
  };
  uint32_t seed = 77;
  for (LinearFormat f : {LinearFormat::kNVFP4, LinearFormat::kMXFP4}) {
    // The last shape: more 128-row blocks than the SMs hold at once (N = 40000).
    for (const Shape s : {Shape{1, 578, 2048}, Shape{3, 301, 96}, Shape{8, 1024, 512}, Shape{20, 130, 6144},
                          Shape{2, 40000, 256}}) {
      auto wf = randn(s.N * s.K, seed++, 0.05f);
      auto W = quantize_linear(wf.data(), s.N, s.K, f, "w");
      ML4_ASSERT_OK(W.status());
      auto x = randn(s.M * s.K, seed++);
      std::vector<float> ref(s.M * s.N);
      cpu::linear(x.data(), s.M, *W, ref.data());
      auto dl = upload_linear(*W);
      ML4_ASSERT_OK(dl.status());
      auto dx = to_device(x);
      auto ws = DeviceBuffer::alloc(gemv_workspace_floats(s.M, s.N, s.K) * 4);
      ML4_ASSERT_OK(ws.status());
      struct Variant {
        const char* name;
        GemvImpl impl;
        int parts;
        bool split;
        double bound;
      };
      for (const Variant v : {Variant{"stream", GemvImpl::kStream, 0, false, 1e-5},
                              Variant{"stream(-1)", GemvImpl::kAuto, -1, true, 1e-5},  // x_parts < 0: the stream
                              Variant{"tc3", GemvImpl::kAuto, 3, false, 1e-5},
                              Variant{"tc3-splitk", GemvImpl::kAuto, 0, true, 1e-5},
                              Variant{"tc2", GemvImpl::kAuto, 2, false, 2e-5},
                              Variant{"tc1", GemvImpl::kAuto, 1, true, 3e-3}}) {
        std::vector<std::vector<float>> runs;
        for (int rep = 0; rep < 2; ++rep) {
          auto dy = poisoned<float>(s.M * s.N);
          GemvParams p{dx.as<float>(), s.M, s.N, s.K, f, dl->weight.data(), dl->scale.as<float>(), dy.as<float>(),
                       v.split ? ws->as<float>() : nullptr, nullptr, v.impl};
          p.x_parts = v.parts;
          ML4_ASSERT_OK(gemv(p));
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          runs.push_back(to_host<float>(dy, s.M * s.N));
        }
        ASSERT_TRUE(all_finite(runs[0])) << "unwritten output " << v.name;
        const double e = rel_err(runs[0], ref);
        std::printf("gemv fp4 %-10s %s M=%ld N=%ld K=%ld rel_err=%.3g (bound %.0e)\n", v.name, linear_format_name(f),
                    s.M, s.N, s.K, e, v.bound);
        EXPECT_LT(e, v.bound) << v.name;
        EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4)) << "not deterministic " << v.name;
      }
    }
    // Every weight byte, one-hot x: output n = the weight at (n, k).
    const int64_t N = 256, K = 64;  // row n holds byte n at every position
    LinearWeight w;
    w.name = "codes";
    w.format = f;
    w.out_features = N;
    w.in_features = K;
    w.weight = Tensor(DType::kU8, {N, K / 2});
    const int64_t groups = K / (f == LinearFormat::kNVFP4 ? 16 : 32);
    // NVFP4's scales are e4m3 bytes, MXFP4's e8m0 (dequantize_linear refuses other dtypes).
    w.scale = Tensor(f == LinearFormat::kNVFP4 ? DType::kF8E4M3 : DType::kE8M0, {N, groups});
    auto* wb = w.weight.mutable_as<uint8_t>();
    auto* sb = w.scale.mutable_as<uint8_t>();
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < K / 2; ++j) wb[n * K / 2 + j] = static_cast<uint8_t>(n);
      for (int64_t g = 0; g < groups; ++g)
        sb[n * groups + g] = f == LinearFormat::kNVFP4 ? static_cast<uint8_t>((n * 37 + g * 11) % 256)
                                                        : static_cast<uint8_t>((n * 53 + g * 101) % 256);
    }
    w.global_scale = f == LinearFormat::kNVFP4 ? 0.3f : 1.0f;
    const std::vector<float> deq = dequantize_linear(w);
    ASSERT_EQ(deq.size(), static_cast<size_t>(N * K)) << "the hand-made weight is not a valid " << linear_format_name(f);
    auto dl = upload_linear(w);
    ML4_ASSERT_OK(dl.status());
    // A row holding a NaN or infinite weight sums to NaN under one-hot x too (0 * inf):
    // those rows are checked for NaN only.
    std::vector<bool> finite_row(N, true);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) finite_row[n] = finite_row[n] && std::isfinite(deq[n * K + k]);
    const int64_t rows_exact = std::count(finite_row.begin(), finite_row.end(), true);
    EXPECT_GT(rows_exact, N / 2);
    int mismatches = 0;
    for (int64_t k = 0; k < 2 * K; ++k) {  // k < K: the tensor-core kernel, then the stream
      const GemvImpl impl = k < K ? GemvImpl::kAuto : GemvImpl::kStream;
      std::vector<float> x(K, 0.0f);
      x[k % K] = 1.0f;
      auto dx = to_device(x);
      auto dy = poisoned<float>(N);
      ML4_ASSERT_OK(gemv({dx.as<float>(), 1, N, K, f, dl->weight.data(), dl->scale.as<float>(), dy.as<float>(), nullptr,
                          nullptr, impl}));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto y = to_host<float>(dy, N);
      for (int64_t n = 0; n < N; ++n) {
        const float want = deq[n * K + k % K];
        const bool same = !finite_row[n] ? std::isnan(y[n]) : y[n] == want;  // -0 == +0
        mismatches += !same;
        if (!same && mismatches < 5)
          ADD_FAILURE() << linear_format_name(f) << (k < K ? " tensor cores" : " stream") << " n=" << n
                        << " k=" << k % K << " got " << y[n] << " want " << want;
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(CudaGemv, AllE4m3CodesExact) {
  ML4_REQUIRE_GPU();
  // W[n][k] = code (n + 37 k) mod 256 (NaN codes 0x7f / 0xff -> 0): for any fixed k the 256
  // rows cover every code. Token m is one-hot at k_m (different lanes, steps, scale blocks).
  const int64_t M = 8, N = 256, K = 256;
  const int64_t km[M] = {0, 1, 2, 3, 77, 130, 201, 255};
  std::vector<uint8_t> w(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t c = static_cast<uint8_t>((n + 37 * k) & 0xFF);
      w[n * K + k] = (c & 0x7F) == 0x7F ? 0 : c;
    }
  const std::vector<float> sc = {1.0f, 0.5f, 0.25f, 2.0f};  // [N/128][K/128], powers of two
  std::vector<float> x(M * K, 0.0f);
  for (int64_t m = 0; m < M; ++m) x[m * K + km[m]] = 1.0f;
  auto dx = to_device(x);
  auto dw = to_device(w);
  auto ds = to_device(sc);
  auto ws = poisoned<float>(gemv_workspace_floats(M, N, K));
  const GemvStreamConfig saved = gemv_stream_config();
  // tensor cores, CUDA cores, the stream with each e4m3 decoding, the f16 mma kernel (passes of 4)
  for (int variant = 0; variant < 6; ++variant) {
    const GemvImpl impl = variant == 0 ? GemvImpl::kTensorCore : variant == 1 ? GemvImpl::kCudaCore : GemvImpl::kStream;
    GemvStreamConfig c = saved;
    c.conv = variant == 5 ? 1 : std::max(variant - 2, 0);
    c.mma = variant == 5 ? 4 : 0;
    c.mma_min_m = 1;
    gemv_set_stream_config(c);
    for (bool use_ws : {true, false}) {
      auto dy = poisoned<float>(M * N);
      ML4_ASSERT_OK(gemv({dx.as<float>(), M, N, K, LinearFormat::kFP8Block, dw.data(), ds.as<float>(), dy.as<float>(),
                          use_ws ? ws.as<float>() : nullptr, nullptr, impl}));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto y = to_host<float>(dy, M * N);
      int bad = 0;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          const float want = e4m3_to_f32(w[n * K + km[m]]) * sc[(n / 128) * 2 + km[m] / 128];
          if (!(y[m * N + n] == want) && bad++ < 5)
            ADD_FAILURE() << "impl " << static_cast<int>(impl) << " ws " << use_ws << " m " << m << " n " << n
                          << " code " << int{w[n * K + km[m]]} << ": " << y[m * N + n] << " want " << want;
        }
      std::printf("gemv all-e4m3-codes impl=%d conv=%d mma=%d ws=%d: %d of %ld outputs differ (bound 0: exact)\n",
                  static_cast<int>(impl), c.conv, c.mma, use_ws, bad, M * N);
      EXPECT_EQ(bad, 0);
    }
  }
  gemv_set_stream_config(saved);
}

}  // namespace
}  // namespace ml4::cuda
