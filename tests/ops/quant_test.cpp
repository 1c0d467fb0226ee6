// Hadamard vs the explicit Sylvester matrix (scipy.linalg.hadamard ordering) in f64, and
// the FP8 group quantization round trip.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "core/dtype.h"
#include "ops/cpu/quant.h"
#include "ops_test_util.h"

namespace ml4::cpu {
namespace {

using test::kU;

// H_1 = [1]; H_2n = [[H, H], [H, -H]]: entry (i, j) = (-1)^popcount(i & j).
double sylvester(int i, int j) { return (__builtin_popcount(i & j) % 2) ? -1.0 : 1.0; }

TEST(Quant, HadamardMatchesMatrix) {
  for (int n : {1, 2, 8, 128}) {
    const int rows = 3;
    auto x = test::random_floats(rows * n, n);
    auto y = x;
    hadamard_transform(y.data(), rows, n);
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < n; ++i) {
        double ref = 0.0, mag = 0.0;
        for (int j = 0; j < n; ++j) {
          ref += sylvester(i, j) * x[r * n + j];
          mag += std::fabs(x[r * n + j]);
        }
        ref /= std::sqrt(double(n));
        // log2(n) butterfly levels of f32 adds plus the scale: <= (log2 n + 1) u * sum|x| / sqrt n.
        const double tol = (std::log2(n) + 2) * kU * mag / std::sqrt(double(n)) + 1e-30;
        ASSERT_NEAR(y[r * n + i], ref, tol) << n << " " << i;
      }
  }
  // scipy.linalg.hadamard(4) @ [1, 2, 3, 4] / 2 = [5, -1, -2, 0].
  std::vector<float> v = {1, 2, 3, 4};
  hadamard_transform(v.data(), 1, 4);
  EXPECT_EQ(v, (std::vector<float>{5, -1, -2, 0}));
  std::vector<float> bad = {1, 2, 3};
  hadamard_transform(bad.data(), 1, 3);  // not a power of two: logged, unchanged
  EXPECT_EQ(bad, (std::vector<float>{1, 2, 3}));
}

TEST(Quant, Fp8GroupsRoundTrip) {
  const int64_t n = 128 * 3 + 40;  // last group short
  const int group = 128;
  auto x = test::random_floats(n, 7, -5.0f, 5.0f);
  for (int i = 128; i < 256; ++i) x[i] *= 1e-7f;  // a group below the 1e-4 amax floor
  std::vector<uint8_t> q(n);
  std::vector<float> s(4), y(n);
  quantize_fp8_groups(x.data(), n, group, q.data(), s.data());
  dequantize_fp8_groups(q.data(), s.data(), n, group, y.data());
  for (int g = 0; g < 4; ++g) {
    float amax = 0.0f;
    for (int64_t i = g * group; i < std::min<int64_t>(n, (g + 1) * group); ++i)
      amax = std::max(amax, std::fabs(x[i]));
    EXPECT_EQ(s[g], std::max(amax, 1e-4f) / 448.0f) << g;
  }
  for (int64_t i = 0; i < n; ++i) {
    // e4m3 has 3 mantissa bits: RNE error <= 2^-4 relative for normals (|v| >= 2^-6),
    // <= 2^-10 absolute in the subnormal range (spacing 2^-9), in units of the scale;
    // plus the f32 division and product roundings (2 ulp).
    const double sc = s[i / group];
    const double tol = std::max(std::fabs(x[i]) * 0x1p-4, sc * 0x1p-10) + 4 * kU * std::fabs(x[i]);
    ASSERT_LE(std::fabs(y[i] - x[i]), tol) << i;
  }
  // The group maximum maps to 448 exactly (0x7e / 0xfe).
  int64_t imax = 0;
  for (int64_t i = 0; i < 128; ++i)
    if (std::fabs(x[i]) > std::fabs(x[imax])) imax = i;
  EXPECT_EQ(q[imax] & 0x7f, 0x7e);
  // Known bytes: 1.0 with scale 1/448 * 448 ... a group {448 * s, s} gives 0x7e and 0x38? use amax 448.
  std::vector<float> k = {448.0f, 1.0f, -2.0f, 0.0f};
  std::vector<uint8_t> kq(4);
  float ks;
  quantize_fp8_groups(k.data(), 4, 4, kq.data(), &ks);
  EXPECT_EQ(ks, 1.0f);
  EXPECT_EQ(kq, (std::vector<uint8_t>{0x7e, 0x38, 0xc0, 0x00}));
}

// The vector hadamard_transform gives the scalar butterflies' bits (every level's a + c, a - c,
// then the scale), at every power-of-two length.
TEST(Quant, HadamardSameBitsAsScalarButterflies) {
  for (int n : {1, 2, 4, 8, 16, 32, 64, 128, 256, 1024}) {
    const int rows = 5;
    auto x = test::random_floats(rows * n, 100 + n, -3.0f, 3.0f);
    auto ref = x;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
    for (int r = 0; r < rows; ++r) {
      float* v = ref.data() + r * n;
      for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
          for (int j = i; j < i + h; ++j) {
            const float a = v[j], c = v[j + h];
            v[j] = a + c;
            v[j + h] = a - c;
          }
      for (int i = 0; i < n; ++i) v[i] *= scale;
    }
    hadamard_transform(x.data(), rows, n);
    ASSERT_EQ(0, std::memcmp(x.data(), ref.data(), x.size() * 4)) << n;
  }
}

// round_fp8_groups equals quantize_fp8_groups + dequantize_fp8_groups bit for bit: random groups
// over wide magnitudes (normals, e4m3 subnormals, the amax floor), short groups, NaN, +-inf,
// +-0; and, with scale 1 (amax 448), f32_to_e4m3 over a sweep of every exponent's bit patterns.
TEST(Quant, RoundFp8GroupsSameBitsAsQuantizeDequantize) {
  auto check = [](std::vector<float> x, int group, const char* what) {
    const int64_t n = static_cast<int64_t>(x.size());
    std::vector<uint8_t> q(n);
    std::vector<float> s((n + group - 1) / group), ref(n);
    quantize_fp8_groups(x.data(), n, group, q.data(), s.data());
    dequantize_fp8_groups(q.data(), s.data(), n, group, ref.data());
    round_fp8_groups(x.data(), n, group);
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(ref[i])) {
        ASSERT_TRUE(std::isnan(x[i])) << what << " " << i;
      } else {
        ASSERT_EQ(std::bit_cast<uint32_t>(x[i]), std::bit_cast<uint32_t>(ref[i])) << what << " " << i << " " << ref[i];
      }
    }
  };
  std::mt19937 rng(77);
  for (int trial = 0; trial < 200; ++trial) {
    const int group = trial % 3 == 0 ? 128 : trial % 3 == 1 ? 64 : 40;
    const int64_t n = 128 * 2 + (trial % 7) * 9;
    auto x = test::random_floats(n, 300 + trial, -1.0f, 1.0f);
    for (auto& v : x) v = std::ldexp(v, static_cast<int>(rng() % 40) - 30);  // mixed magnitudes in a group
    if (trial % 5 == 1) x[rng() % n] = std::numeric_limits<float>::quiet_NaN();
    if (trial % 5 == 2) x[rng() % n] = -std::numeric_limits<float>::infinity();
    if (trial % 5 == 3) x[rng() % n] = -0.0f, x[rng() % n] = 0.0f;
    if (trial % 5 == 4)
      for (int64_t i = 0; i < n; ++i) x[i] *= 1e-9f;  // under the amax floor
    check(x, group, "random");
  }
  // Scale exactly 1: every value goes through f32_to_e4m3 unchanged by the division.
  std::vector<float> sweep;
  for (uint32_t u = 0; u <= 0x43e00000u + 0x100000u; u += 997) {
    if (sweep.size() % 128 == 0) sweep.push_back(448.0f);
    float f;
    std::memcpy(&f, &u, 4);
    sweep.push_back((u / 997) % 2 ? -f : f);
  }
  while (sweep.size() % 128 != 0) sweep.push_back(0.5f);
  check(sweep, 128, "sweep");
}

}  // namespace
}  // namespace ml4::cpu
