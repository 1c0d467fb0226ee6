// linear() for every weight format against an f64 reference computed from the weight
// decoded independently here (scalar core/dtype.h conversions, in f64).
//
// Bound: the f32 dot product of K terms has |error| <= gamma_K * sum_k |x_k w_k|, gamma_K
// ~ K * 2^-24 (Higham, Accuracy and Stability, 3.1), whatever the summation order; the
// one f32 rounding of a block-scaled weight (e4m3 * scale) adds 2^-24 relative per term.
// That worst case is asserted per element with a factor (K + 2). The typical error
// grows like sqrt(K) * 2^-24 relative (random rounding errors), asserted on the relative
// L2 error with a margin of 8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "core/dtype.h"
#include "ops/cpu/linear.h"
#include "ops_test_util.h"
#include "test_weights.h"

namespace ml4::cpu {
namespace {

using test::kU;

using test::make_weight;
using test::TestWeight;

void check_linear(LinearFormat format, int64_t M, int64_t N, int64_t K, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "format " << static_cast<int>(format) << " M=" << M
                                  << " N=" << N << " K=" << K);
  TestWeight t = make_weight(format, N, K, seed);
  ASSERT_TRUE(validate_linear_weight(t.w).ok()) << validate_linear_weight(t.w).message();
  std::vector<float> x = test::random_floats(static_cast<size_t>(M * K), seed + 1);
  std::vector<float> y(static_cast<size_t>(M * N), -7.0f);
  linear(x.data(), M, t.w, y.data());

  std::vector<double> ref(static_cast<size_t>(M * N));
  double worst_violation = 0.0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0.0, mag = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        acc += x[m * K + k] * t.ref[n * K + k];
        mag += std::fabs(x[m * K + k] * t.ref[n * K + k]);
      }
      ref[m * N + n] = acc;
      const double bound = (K + 2) * kU * mag + 1e-30;
      worst_violation = std::max(worst_violation, std::fabs(y[m * N + n] - acc) / bound);
    }
  EXPECT_LE(worst_violation, 1.0) << "an element exceeds the gamma_K worst-case bound";
  const double rel = test::rel_l2(y.data(), ref.data(), ref.size());
  EXPECT_LE(rel, 8.0 * std::sqrt(static_cast<double>(K)) * kU);
}

TEST(Linear, F32AllShapes) {
  for (int64_t M : {1, 3, 8, 17}) check_linear(LinearFormat::kF32, M, 37, 300, 11);
  check_linear(LinearFormat::kF32, 2, 5, 7, 12);  // K below one SIMD vector
}

TEST(Linear, BF16RaggedShapes) {
  for (int64_t M : {1, 3, 5, 17}) {
    check_linear(LinearFormat::kBF16, M, 37, 300, 21);
    check_linear(LinearFormat::kBF16, M, 130, 259, 22);
  }
  check_linear(LinearFormat::kBF16, 3, 1000, 1024, 23);  // several threads' worth of N
}

TEST(Linear, FP8BlockRaggedShapes) {
  // M 1-4: the GEMV on stored bytes; M >= 5: decoded tiles (GEMM), whose row groups of
  // 72 rows at K = 300 straddle the scale-block row 128.
  for (int64_t M : {1, 3, 5, 17}) check_linear(LinearFormat::kFP8Block, M, 200, 300, 31);
  check_linear(LinearFormat::kFP8Block, 9, 260, 1040, 33);  // several 128-blocks, tail-free K
  check_linear(LinearFormat::kFP8Block, 2, 129, 129, 32);  // one element past a block
}

TEST(Linear, NVFP4) {
  for (int64_t M : {1, 3, 17}) check_linear(LinearFormat::kNVFP4, M, 45, 336, 41);
}

TEST(Linear, MXFP4) {
  for (int64_t M : {1, 3, 17}) check_linear(LinearFormat::kMXFP4, M, 45, 352, 51);
}

// Spec bytes (linear_weight.h): element 2j is the low nibble; NVFP4 value = e2m1 * e4m3
// scale * global; MXFP4 = e2m1 * 2^(e - 127). e2m1 codes: 1 = 0.5, 2 = 1.0, 7 = 6.0,
// 0xA = -1.0. e4m3 0x40 = 2.0; e8m0 126 = 0.5.
TEST(Linear, Fp4KnownBytes) {
  for (LinearFormat f : {LinearFormat::kNVFP4, LinearFormat::kMXFP4}) {
    const bool nv = f == LinearFormat::kNVFP4;
    const int64_t K = nv ? 16 : 32;
    LinearWeight w;
    w.format = f;
    w.out_features = 1;
    w.in_features = K;
    w.weight = Tensor(DType::kU8, {1, K / 2});
    w.scale = Tensor(nv ? DType::kF8E4M3 : DType::kE8M0, {1, 1});
    w.global_scale = nv ? 0.25f : 1.0f;
    uint8_t* q = w.weight.mutable_as<uint8_t>();
    q[0] = 0x21;  // k=0: 0.5, k=1: 1.0
    q[1] = 0xA7;  // k=2: 6.0, k=3: -1.0
    w.scale.mutable_as<uint8_t>()[0] = nv ? 0x40 : 126;
    std::vector<float> dec(K);
    decode_weight_rows(w, 0, 1, dec.data());
    const float s = nv ? 2.0f * 0.25f : 0.5f;
    EXPECT_EQ(dec[0], 0.5f * s);
    EXPECT_EQ(dec[1], 1.0f * s);
    EXPECT_EQ(dec[2], 6.0f * s);
    EXPECT_EQ(dec[3], -1.0f * s);
    for (int64_t k = 4; k < K; ++k) EXPECT_EQ(dec[k], 0.0f);
  }
}

TEST(Linear, FP8KnownBytes) {
  LinearWeight w;
  w.format = LinearFormat::kFP8Block;
  w.out_features = 130;  // two block rows
  w.in_features = 2;
  w.weight = Tensor(DType::kF8E4M3, {130, 2});
  w.scale = Tensor(DType::kF32, {2, 1});
  w.scale.mutable_as<float>()[0] = 3.0f;
  w.scale.mutable_as<float>()[1] = 0.5f;
  uint8_t* q = w.weight.mutable_as<uint8_t>();
  q[0] = 0x38;        // 1.0
  q[1] = 0xC0;        // -2.0
  q[129 * 2] = 0x7e;  // 448
  std::vector<float> dec(130 * 2);
  decode_weight_rows(w, 0, 130, dec.data());
  EXPECT_EQ(dec[0], 3.0f);
  EXPECT_EQ(dec[1], -6.0f);
  EXPECT_EQ(dec[129 * 2], 224.0f);
}

// Every e4m3 code through the (vectorized) FP8 decode equals core/dtype.h's scalar
// decode, subnormals and NaN included; likewise every byte of packed e2m1.
TEST(Linear, DecodeCoversEveryCode) {
  LinearWeight w;
  w.format = LinearFormat::kFP8Block;
  w.out_features = 2;
  w.in_features = 256;
  w.weight = Tensor(DType::kF8E4M3, {2, 256});
  w.scale = Tensor(DType::kF32, {1, 2});
  w.scale.mutable_as<float>()[0] = 1.0f;
  w.scale.mutable_as<float>()[1] = 0.375f;
  for (int i = 0; i < 512; ++i) w.weight.mutable_as<uint8_t>()[i] = static_cast<uint8_t>(i);
  std::vector<float> dec(512);
  decode_weight_rows(w, 0, 2, dec.data());
  for (int i = 0; i < 512; ++i) {
    const float want = e4m3_to_f32(static_cast<uint8_t>(i)) * ((i % 256) < 128 ? 1.0f : 0.375f);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(dec[i])) << i;
    } else {
      EXPECT_EQ(f32_to_bits(dec[i]), f32_to_bits(want)) << i;
    }
  }
  LinearWeight m;
  m.format = LinearFormat::kMXFP4;
  m.out_features = 1;
  m.in_features = 512;
  m.weight = Tensor(DType::kU8, {1, 256});
  m.scale = Tensor(DType::kE8M0, {1, 16});
  for (int i = 0; i < 256; ++i) m.weight.mutable_as<uint8_t>()[i] = static_cast<uint8_t>(i);
  for (int g = 0; g < 16; ++g) m.scale.mutable_as<uint8_t>()[g] = static_cast<uint8_t>(120 + g);
  std::vector<float> d4(512);
  decode_weight_rows(m, 0, 1, d4.data());
  for (int k = 0; k < 512; ++k) {
    const uint8_t byte = static_cast<uint8_t>(k / 2);
    const float want = e2m1_to_f32((k % 2) ? byte >> 4 : byte & 0xf) * e8m0_to_f32(static_cast<uint8_t>(120 + k / 32));
    EXPECT_EQ(f32_to_bits(d4[k]), f32_to_bits(want)) << k;
  }
  // NVFP4: each value is e2m1 * e4m3 * global rounded once (the triple product is exact
  // in f64: 2 + 4 + 24 significant bits), for every packed byte and every finite scale.
  LinearWeight nv;
  nv.format = LinearFormat::kNVFP4;
  nv.out_features = 1;
  nv.in_features = 4096;  // 256 groups of 16
  nv.global_scale = 0.1f;
  nv.weight = Tensor(DType::kU8, {1, 2048});
  nv.scale = Tensor(DType::kF8E4M3, {1, 256});
  for (int i = 0; i < 2048; ++i) nv.weight.mutable_as<uint8_t>()[i] = static_cast<uint8_t>(i * 37 + 11);
  for (int g = 0; g < 256; ++g) nv.scale.mutable_as<uint8_t>()[g] = static_cast<uint8_t>((g & 0x7f) == 0x7f ? 0x38 : g);
  std::vector<float> dn(4096);
  decode_weight_rows(nv, 0, 1, dn.data());
  for (int k = 0; k < 4096; ++k) {
    const uint8_t byte = nv.weight.as<uint8_t>()[k / 2];
    const double v = e2m1_to_f32((k % 2) ? byte >> 4 : byte & 0xf);
    const float want = static_cast<float>(v * e4m3_to_f32(nv.scale.as<uint8_t>()[k / 16]) * double(0.1f));
    ASSERT_EQ(f32_to_bits(dn[k]), f32_to_bits(want)) << k;
  }
}

// Batch invariance: row m of a batched call equals the same row computed alone, bit for
// bit (every y element sees the same FMA sequence whatever M, the row pairing or the
// thread split), and repeated calls are identical. The runtime's batch/chunk invariance
// tests rely on this.
// FP8's GEMM (each block's even steps, then its odd ones) against its GEMV, for last blocks
// of 2, 3, 5, 7 and 16 8-element steps plus a tail, with and without the AVX-512 GEMV.
TEST(Linear, Fp8GemmEqualsGemvForEveryBlockShape) {
  for (bool avx512 : {true, false}) {
    linear_allow_avx512(avx512);
    for (int64_t K : {100, 144, 152, 168, 184, 256 + 3}) {
      SCOPED_TRACE(testing::Message() << "K=" << K << " avx512 " << avx512);
      TestWeight t = make_weight(LinearFormat::kFP8Block, 133, K, 111 + static_cast<uint32_t>(K));
      const int64_t M = 7;
      auto x = test::random_floats(M * K, 112 + static_cast<uint32_t>(K));
      std::vector<float> y(M * 133), row(133);
      linear(x.data(), M, t.w, y.data());
      for (int64_t m = 0; m < M; ++m) {
        linear(x.data() + m * K, 1, t.w, row.data());
        for (int64_t n = 0; n < 133; ++n) ASSERT_EQ(f32_to_bits(row[n]), f32_to_bits(y[m * 133 + n])) << "m=" << m << " n=" << n;
      }
    }
  }
  linear_allow_avx512(true);
}

TEST(Linear, BatchInvariantAndDeterministic) {
  // Every M crosses a path or tile boundary: GEMV (M <= 4, rows in pairs) and the GEMM
  // tiles (4 rows at a time) against the same row computed alone.
  for (LinearFormat f : {LinearFormat::kF32, LinearFormat::kBF16, LinearFormat::kFP8Block, LinearFormat::kNVFP4,
                         LinearFormat::kMXFP4}) {
    SCOPED_TRACE(testing::Message() << "format " << static_cast<int>(f));
    const int64_t K = 512 + 13 * (f == LinearFormat::kF32 || f == LinearFormat::kBF16 || f == LinearFormat::kFP8Block);
    TestWeight t = make_weight(f, 203, f == LinearFormat::kNVFP4 || f == LinearFormat::kMXFP4 ? 512 : K, 71);
    const int64_t Kw = t.w.in_features;
    std::vector<float> row(203);
    for (int64_t M : {2, 3, 4, 5, 8, 17}) {
      auto x = test::random_floats(M * Kw, 72 + static_cast<uint32_t>(M));
      std::vector<float> y(M * 203), y2(M * 203);
      linear(x.data(), M, t.w, y.data());
      linear(x.data(), M, t.w, y2.data());
      EXPECT_EQ(y, y2);
      for (int64_t m = 0; m < M; ++m) {
        linear(x.data() + m * Kw, 1, t.w, row.data());
        for (int64_t n = 0; n < 203; ++n)
          ASSERT_EQ(f32_to_bits(row[n]), f32_to_bits(y[m * 203 + n])) << "M=" << M << " m=" << m << " n=" << n;
      }
    }
  }
}

// linear_rows over any split of [0, N) at multiples of 4 (how the MoE decode spreads several
// experts' rows over one parallel region) writes exactly linear()'s bits, on both paths.
TEST(Linear, RowRangesEqualTheWholeCall) {
  std::mt19937 rng(91);
  for (LinearFormat f : {LinearFormat::kF32, LinearFormat::kBF16, LinearFormat::kFP8Block, LinearFormat::kNVFP4,
                         LinearFormat::kMXFP4}) {
    SCOPED_TRACE(testing::Message() << "format " << static_cast<int>(f));
    const bool fp4 = f == LinearFormat::kNVFP4 || f == LinearFormat::kMXFP4;
    const int64_t N = 301, K = fp4 ? 256 : 269;
    TestWeight t = make_weight(f, N, K, 92);
    for (int64_t M : {1, 3, 6}) {
      auto x = test::random_floats(M * K, 93 + static_cast<uint32_t>(M));
      std::vector<float> y(M * N), y2(M * N, -1.0f);
      linear(x.data(), M, t.w, y.data());
      int64_t n0 = 0;
      while (n0 < N) {
        const int64_t n1 = std::min<int64_t>(N, n0 + 4 * (1 + static_cast<int64_t>(rng() % 40)));
        linear_rows(x.data(), M, t.w, n0, n1, y2.data());
        n0 = n1;
      }
      for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(f32_to_bits(y[i]), f32_to_bits(y2[i])) << "M=" << M << " i=" << i;
    }
  }
}

// The AVX-512 kernels (chosen at run time where the CPU has them) give the AVX2 kernels' bits:
// the FP8 GEMV at M = 1..4, rows whose last block has 1, 2, 3 or 16 8-element steps, and K
// with a scalar tail.
TEST(Linear, Avx512GivesTheAvx2Bits) {
  linear_allow_avx512(true);
  if (!linear_uses_avx512()) GTEST_SKIP() << "this CPU (or build) has no AVX-512";
  for (int64_t K : {136, 144, 152, 256, 264, 269, 2048 + 24, 2048 + 128})
    for (int64_t M = 1; M <= kGemvMaxM; ++M) {
      SCOPED_TRACE(testing::Message() << "K=" << K << " M=" << M);
      TestWeight t = make_weight(LinearFormat::kFP8Block, 150, K, 101 + static_cast<uint32_t>(K));
      auto x = test::random_floats(M * K, 102 + static_cast<uint32_t>(K + M));
      std::vector<float> a(M * 150), b(M * 150);
      linear(x.data(), M, t.w, a.data());
      linear_allow_avx512(false);
      EXPECT_FALSE(linear_uses_avx512());
      linear(x.data(), M, t.w, b.data());
      linear_allow_avx512(true);
      for (int64_t i = 0; i < M * 150; ++i) ASSERT_EQ(f32_to_bits(a[i]), f32_to_bits(b[i])) << "i=" << i;
    }
}

// The AVX-512 FP8 GEMV at M = 1 and short rows (K % 32 == 0, K <= 512) runs 4 weight rows at
// a time: each row's bits are those of the row computed alone (a one-row range), across
// scale-group boundaries (N > 128, ranges starting off a multiple of 4), and a NaN code
// still poisons only its own row.
TEST(Linear, Fp8FourRowGemvEqualsOneRowAtATime) {
  linear_allow_avx512(true);
  if (!linear_uses_avx512()) GTEST_SKIP() << "this CPU (or build) has no AVX-512";
  for (int64_t K : {32, 128, 160, 384, 512, 544})
    for (bool nan : {false, true}) {
      SCOPED_TRACE(testing::Message() << "K=" << K << " nan " << nan);
      const int64_t N = 263;
      TestWeight t = make_weight(LinearFormat::kFP8Block, N, K, 121 + static_cast<uint32_t>(K));
      if (nan) t.w.weight.mutable_as<uint8_t>()[129 * K + K / 2] = 0x7f;
      auto x = test::random_floats(K, 122 + static_cast<uint32_t>(K));
      std::vector<float> whole(N), ranged(N, -1.0f), single(N, -1.0f);
      linear(x.data(), 1, t.w, whole.data());
      for (int64_t n = 0; n < N; ++n) linear_rows(x.data(), 1, t.w, n, n + 1, single.data());
      for (int64_t n0 = 0; n0 < N;) {  // ranges of 1..13 rows from any offset
        const int64_t n1 = std::min<int64_t>(N, n0 + 1 + (n0 * 7) % 13);
        linear_rows(x.data(), 1, t.w, n0, n1, ranged.data());
        n0 = n1;
      }
      for (int64_t n = 0; n < N; ++n) {
        if (nan && n == 129) {
          EXPECT_TRUE(std::isnan(whole[n]) && std::isnan(ranged[n]) && std::isnan(single[n]));
          continue;
        }
        ASSERT_EQ(f32_to_bits(whole[n]), f32_to_bits(single[n])) << "n=" << n;
        ASSERT_EQ(f32_to_bits(ranged[n]), f32_to_bits(single[n])) << "n=" << n;
      }
    }
}

// An e4m3 NaN code (0x7f / 0xff) in a weight row makes exactly that row's outputs NaN, on
// the GEMV path (M = 1, whose fast decoder does not produce NaN by itself) and the GEMM
// path (M = 6); the other rows keep their exact results.
TEST(Linear, FP8NanCodePropagatesToItsRowOnly) {
  // bad_k 37: in a block; 266: in the scalar tail (K = 269). Every GEMV tile height (M = 1..4,
  // AVX-512 and AVX2) and the GEMM (M = 6).
  for (auto [K, bad_k] : {std::pair<int64_t, int64_t>{264, 37}, {269, 266}})
    for (uint8_t code : {uint8_t{0x7f}, uint8_t{0xff}})
      for (bool avx512 : {true, false}) {
        linear_allow_avx512(avx512);
        const int64_t N = 140, bad_row = 130;
        TestWeight t = make_weight(LinearFormat::kFP8Block, N, K, 81);
        TestWeight clean = make_weight(LinearFormat::kFP8Block, N, K, 81);
        t.w.weight.mutable_as<uint8_t>()[bad_row * K + bad_k] = code;
        for (int64_t M : {1, 2, 3, 4, 6}) {
          SCOPED_TRACE(testing::Message() << "K=" << K << " code " << int(code) << " avx512 " << avx512 << " M=" << M);
          auto x = test::random_floats(M * K, 82);
          std::vector<float> y(M * N), yc(M * N);
          linear(x.data(), M, t.w, y.data());
          linear(x.data(), M, clean.w, yc.data());
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
              if (n == bad_row) {
                EXPECT_TRUE(std::isnan(y[m * N + n])) << "m=" << m;
              } else {
                ASSERT_EQ(f32_to_bits(y[m * N + n]), f32_to_bits(yc[m * N + n])) << "m=" << m << " n=" << n;
              }
            }
        }
      }
  linear_allow_avx512(true);
}

TEST(Linear, BadWeightIsAnErrorNotACrash) {
  TestWeight t = make_weight(LinearFormat::kBF16, 8, 16, 61);
  t.w.in_features = 32;  // declared K disagrees with the tensor
  Status st = validate_linear_weight(t.w);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("test.weight"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("[8, 32]"), std::string::npos) << st.message();
  std::vector<float> x(32, 1.0f), y(8, 0.0f);
  linear(x.data(), 1, t.w, y.data());
  for (float v : y) EXPECT_TRUE(std::isnan(v));

  TestWeight f = make_weight(LinearFormat::kFP8Block, 8, 16, 62);
  f.w.scale = Tensor();
  EXPECT_FALSE(validate_linear_weight(f.w).ok());

  TestWeight nv = make_weight(LinearFormat::kNVFP4, 4, 32, 63);
  nv.w.in_features = 24;  // not a multiple of 16
  EXPECT_FALSE(validate_linear_weight(nv.w).ok());
}

}  // namespace
}  // namespace ml4::cpu
