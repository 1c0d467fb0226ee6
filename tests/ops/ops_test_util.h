// Shared helpers for tests/ops: seeded random inputs and error measures against f64.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace ml4::test {

constexpr double kU = 0x1p-24;  // f32 unit roundoff (round to nearest)

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ||a - b||_2 / ||b||_2 with b the f64 reference.
inline double rel_l2(const float* a, const double* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0.0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline double max_abs(const float* a, const double* b, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

}  // namespace ml4::test
