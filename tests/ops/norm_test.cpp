// rms_norm / add_rms_norm / layer_norm against f64 on random rows.
// Bound: each output is a handful of f32 roundings (x * inv * w, inv correctly rounded
// from an f64 reduction): relative error <= ~4 * 2^-24 per element; asserted as
// max |y - ref| <= 8 * 2^-24 * (|ref| + tiny).
#include <gtest/gtest.h>

#include "ops/cpu/norm.h"
#include "ops_test_util.h"

namespace ml4::cpu {
namespace {

using test::kU;

void expect_close_rel(const std::vector<float>& y, const std::vector<double>& ref, double k) {
  for (size_t i = 0; i < y.size(); ++i)
    ASSERT_LE(std::fabs(y[i] - ref[i]), k * kU * (std::fabs(ref[i]) + 1e-6)) << "at " << i;
}

TEST(Norm, RmsNorm) {
  const int64_t rows = 5, dim = 257;
  auto x = test::random_floats(rows * dim, 1, -3.0f, 3.0f);
  auto w = test::random_floats(dim, 2, 0.5f, 1.5f);
  const float eps = 1e-6f;
  std::vector<float> y(rows * dim);
  rms_norm(x.data(), w.data(), rows, dim, eps, y.data());
  std::vector<double> ref(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + double(eps));
    for (int64_t i = 0; i < dim; ++i) ref[r * dim + i] = x[r * dim + i] * inv * w[i];
  }
  expect_close_rel(y, ref, 8);
  // In place gives the same bytes.
  std::vector<float> xin = x;
  rms_norm(xin.data(), w.data(), rows, dim, eps, xin.data());
  EXPECT_EQ(xin, y);
}

TEST(Norm, AddRmsNorm) {
  const int64_t rows = 3, dim = 130;
  auto res = test::random_floats(rows * dim, 3, -2.0f, 2.0f);
  auto x = test::random_floats(rows * dim, 4, -2.0f, 2.0f);
  auto w = test::random_floats(dim, 5, 0.5f, 1.5f);
  std::vector<double> sum(rows * dim), ref(rows * dim);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = double(res[i]) + x[i];
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += sum[r * dim + i] * sum[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-5);
    for (int64_t i = 0; i < dim; ++i) ref[r * dim + i] = sum[r * dim + i] * inv * w[i];
  }
  std::vector<float> y(rows * dim);
  add_rms_norm(res.data(), x.data(), w.data(), rows, dim, 1e-5f, y.data());
  // residual: one f32 add, relative error <= 2^-24 (plus cancellation, absolute 2^-24 * |a|+|b|).
  for (size_t i = 0; i < sum.size(); ++i) ASSERT_LE(std::fabs(res[i] - sum[i]), 4 * kU * 4.0);
  for (size_t i = 0; i < y.size(); ++i)
    ASSERT_LE(std::fabs(y[i] - ref[i]), 16 * kU * (std::fabs(ref[i]) + 1.0)) << i;
}

TEST(Norm, LayerNormWithAndWithoutBias) {
  const int64_t rows = 4, dim = 128;
  auto x = test::random_floats(rows * dim, 6, 9.0f, 11.0f);  // |mean| >> std: cancellation
  auto w = test::random_floats(dim, 7, 0.5f, 1.5f);
  auto b = test::random_floats(dim, 8, -0.5f, 0.5f);
  for (const float* bias : {static_cast<const float*>(b.data()), static_cast<const float*>(nullptr)}) {
    std::vector<float> y(rows * dim);
    layer_norm(x.data(), w.data(), bias, rows, dim, 1e-6f, y.data());
    for (int64_t r = 0; r < rows; ++r) {
      double mean = 0.0, var = 0.0;
      for (int64_t i = 0; i < dim; ++i) mean += x[r * dim + i];
      mean /= dim;
      for (int64_t i = 0; i < dim; ++i) var += (x[r * dim + i] - mean) * (x[r * dim + i] - mean);
      var /= dim;
      for (int64_t i = 0; i < dim; ++i) {
        const double ref = (x[r * dim + i] - mean) / std::sqrt(var + 1e-6) * w[i] + (bias ? bias[i] : 0.0);
        ASSERT_NEAR(y[r * dim + i], ref, 8 * kU * 4.0) << i;  // |ref| <= ~3.5
      }
    }
  }
}

}  // namespace
}  // namespace ml4::cpu
