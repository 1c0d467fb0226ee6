// Hadamard vs the explicit Sylvester matrix (scipy.linalg.hadamard ordering) in f64, and
// the FP8 group quantization round trip.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace ml4::cpu
