// linear()'s bf16-activation mode (ActivationDtype::kBF16) bit for bit against a scalar model
// of the order contract in src/ops/cpu/linear_bf16dot.h, written here from that text: x
// rounded to bf16, each vdpbf16ps lane two FMAs (odd element first) with subnormal inputs
// read as zero and subnormal results flushed, the FP8 chunk interleave, the per-block scale,
// the hsum tree. Matching it on every shape means the GEMV (M <= 4) and GEMM (M > 4) paths and
// every tile edge agree, so a row's result does not depend on its batch. Also: the result
// against f64 of the bf16-rounded x (any order's bound, (K + 2) u sum |x_b w|), NaN codes, and
// the refusal where the CPU lacks AVX512_BF16.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/dtype.h"
#include "ops/cpu/linear.h"
#include "ops_test_util.h"
#include "test_weights.h"

namespace ml4::cpu {
namespace {

float flush(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

// vcvtneps2bf16: subnormal in -> signed zero, else round to nearest even.
float x_bf16(float x) { return bf16_to_f32(f32_to_bf16(flush(x))); }

// One lane of one vdpbf16ps: pairs (a1, b1) then (a0, b0).
float lane_dp(float acc, float a1, float b1, float a0, float b0) {
  acc = flush(std::fma(flush(a1), flush(b1), flush(acc)));
  return flush(std::fma(flush(a0), flush(b0), acc));
}

float hsum8(const float* l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }
float hsum16(const float* l) {
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = l[i] + l[i + 8];
  return hsum8(v);
}

// The contract for one output: x [K] f32, w [K] the weight row's values (bf16: the bf16 value;
// FP8: the e4m3 value, unscaled), srow the FP8 row's scales (null: bf16).
float model_dot(const float* x, const float* w, int64_t K, const float* srow) {
  auto xv = [&](int64_t k) { return k < K ? x_bf16(x[k]) : 0.0f; };
  auto wv = [&](int64_t k) { return k < K ? w[k] : 0.0f; };
  float lanes[16] = {};
  if (srow == nullptr) {
    for (int64_t s = 0; s < K; s += 32)
      for (int l = 0; l < 16; ++l) {
        const int64_t e = s + 2 * l;
        lanes[l] = lane_dp(lanes[l], xv(e + 1), wv(e + 1), xv(e), wv(e));
      }
    return hsum16(lanes);
  }
  for (int64_t b0 = 0; b0 < K; b0 += 128) {
    float blk[16] = {};
    for (int64_t c = b0; c < b0 + 128 && c < K; c += 64)
      for (int half = 0; half < 2; ++half)  // vector a (elements 16L + 0..7), then b (16L + 8..15)
        for (int p = 0; p < 16; ++p) {
          const int64_t e = c + 16 * (p / 4) + 8 * half + 2 * (p % 4);
          blk[p] = lane_dp(blk[p], xv(e + 1), wv(e + 1), xv(e), wv(e));
        }
    for (int l = 0; l < 16; ++l) lanes[l] = std::fma(blk[l], srow[b0 / 128], lanes[l]);
  }
  return hsum16(lanes);
}

// A random bf16 or FP8 weight (test_weights.h) and its values as the contract reads them:
// [N, K] bf16 values, or unscaled e4m3 values; optionally one NaN code in the middle.
struct Case {
  LinearWeight w;
  std::vector<float> values;
};

Case make_case(LinearFormat f, int64_t N, int64_t K, uint32_t seed, bool nan_code = false) {
  Case c{test::make_weight(f, N, K, seed).w, {}};
  c.values.resize(static_cast<size_t>(N * K));
  if (f == LinearFormat::kBF16) {
    for (int64_t i = 0; i < N * K; ++i) c.values[i] = bf16_to_f32(c.w.weight.as<uint16_t>()[i]);
    return c;
  }
  uint8_t* q = c.w.weight.mutable_as<uint8_t>();
  if (nan_code) q[(N / 2) * K + K / 2] = 0xff;
  for (int64_t i = 0; i < N * K; ++i) c.values[i] = e4m3_to_f32(q[i]);
  return c;
}

class LinearBf16Dot : public testing::Test {
 protected:
  void SetUp() override {
    if (!activation_dtype_supported(ActivationDtype::kBF16).ok())
      GTEST_SKIP() << activation_dtype_supported(ActivationDtype::kBF16).message();
  }
};

void check_against_model(LinearFormat f, int64_t M, int64_t N, int64_t K, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << linear_format_name(f) << " M=" << M << " N=" << N << " K=" << K);
  Case c = make_case(f, N, K, seed);
  std::vector<float> x = test::random_floats(static_cast<size_t>(M * K), seed + 1);
  x[0] = 1e-40f;  // a subnormal activation: read as zero
  std::vector<float> y(static_cast<size_t>(M * N), -7.0f);
  linear(x.data(), M, c.w, y.data(), ActivationDtype::kBF16);
  const int64_t kb = (K + 127) / 128;
  double err2 = 0.0, ref2 = 0.0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float* srow = f == LinearFormat::kFP8Block ? c.w.scale.as<float>() + (n / 128) * kb : nullptr;
      const float want = model_dot(x.data() + m * K, c.values.data() + n * K, K, srow);
      ASSERT_EQ(f32_to_bits(y[m * N + n]), f32_to_bits(want)) << "m=" << m << " n=" << n << ": " << y[m * N + n]
                                                               << " vs " << want;
      // And against f64 of the same rounded operands: any order's bound.
      double ref = 0.0, mag = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double term = double(x_bf16(x[m * K + k])) * c.values[n * K + k] * (srow ? srow[k / 128] : 1.0);
        ref += term;
        mag += std::fabs(term);
      }
      ASSERT_LE(std::fabs(y[m * N + n] - ref), (K + 2) * test::kU * mag + 1e-30);
      err2 += (y[m * N + n] - ref) * (y[m * N + n] - ref);
      ref2 += ref * ref;
    }
  // Typical error ~ sqrt(K) u relative (random roundings), with a margin of 8.
  EXPECT_LE(std::sqrt(err2 / ref2), 8.0 * std::sqrt(double(K)) * test::kU);
}

TEST_F(LinearBf16Dot, Bf16WeightsEqualTheOrderContract) {
  uint32_t seed = 100;
  for (int64_t M : {1, 2, 3, 4, 5, 9})
    for (int64_t K : {32, 37, 64, 200})
      for (int64_t N : {1, 7, 130}) check_against_model(LinearFormat::kBF16, M, N, K, seed++);
}

TEST_F(LinearBf16Dot, Fp8WeightsEqualTheOrderContract) {
  uint32_t seed = 300;
  for (int64_t M : {1, 2, 3, 4, 5, 9})
    for (int64_t K : {64, 75, 128, 200, 384})
      for (int64_t N : {1, 7, 130}) check_against_model(LinearFormat::kFP8Block, M, N, K, seed++);
}

// linear_rows over a split of N gives linear()'s bits (the MoE decode's shared region).
TEST_F(LinearBf16Dot, RowsEqualWholeCall) {
  for (LinearFormat f : {LinearFormat::kBF16, LinearFormat::kFP8Block})
    for (int64_t M : {1, 6}) {
      const int64_t N = 136, K = 192;
      Case c = make_case(f, N, K, 7 + M);
      std::vector<float> x = test::random_floats(static_cast<size_t>(M * K), 9);
      std::vector<float> y(M * N), yr(M * N, -1.0f);
      linear(x.data(), M, c.w, y.data(), ActivationDtype::kBF16);
      linear_rows(x.data(), M, c.w, 0, 64, yr.data(), ActivationDtype::kBF16);
      linear_rows(x.data(), M, c.w, 64, N, yr.data(), ActivationDtype::kBF16);
      for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(f32_to_bits(y[i]), f32_to_bits(yr[i])) << i;
    }
}

// A NaN weight code gives NaN in its output row, and only there.
TEST_F(LinearBf16Dot, Fp8NanCodeIsNan) {
  const int64_t N = 9, K = 256;
  Case c = make_case(LinearFormat::kFP8Block, N, K, 5, /*nan_code=*/true);
  for (int64_t M : {1, 7}) {
    std::vector<float> x = test::random_floats(static_cast<size_t>(M * K), 6);
    std::vector<float> y(M * N);
    linear(x.data(), M, c.w, y.data(), ActivationDtype::kBF16);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) EXPECT_EQ(std::isnan(y[m * N + n]), n == N / 2) << "m=" << m << " n=" << n;
  }
}

// Other formats keep f32 activations: kBF16 gives kF32's bits.
TEST(LinearActivationDtype, F32WeightsIgnoreIt) {
  const LinearWeight f = test::make_weight(LinearFormat::kF32, 5, 64, 3).w;
  std::vector<float> x = test::random_floats(2 * 64, 4), a(10), b(10);
  linear(x.data(), 2, f, a.data(), ActivationDtype::kF32);
  linear(x.data(), 2, f, b.data(), ActivationDtype::kBF16);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(f32_to_bits(a[i]), f32_to_bits(b[i]));
}

TEST(LinearActivationDtype, Names) {
  EXPECT_EQ(*parse_activation_dtype("auto"), ActivationDtype::kF32);
  EXPECT_EQ(*parse_activation_dtype("float32"), ActivationDtype::kF32);
  EXPECT_EQ(*parse_activation_dtype("bfloat16"), ActivationDtype::kBF16);
  auto bad = parse_activation_dtype("float16");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("float16"), std::string::npos);
}

}  // namespace
}  // namespace ml4::cpu
