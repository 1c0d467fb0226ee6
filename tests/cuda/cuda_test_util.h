// Helpers of the GPU tests: skip without a device, relative error, poison checks.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cuda/cuda_common.h"

// Skips the test when no CUDA device is visible (CI compiles these but has no GPU).
#define ML4_REQUIRE_GPU()                                        \
  do {                                                           \
    if (!::ml4::cuda::device_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

#define ML4_ASSERT_OK(expr)                                   \
  do {                                                        \
    ::ml4::Status st_ = (expr);                               \
    ASSERT_TRUE(st_.ok()) << st_.message();                \
  } while (0)

namespace ml4::cuda::testing {

// ||out - ref|| / ||ref|| in f64; NaN in out gives NaN (never passes a < bound check).
inline double rel_err(const std::vector<float>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}
inline double rel_err(const std::vector<float>& out, const std::vector<float>& ref) {
  return rel_err(out, std::vector<double>(ref.begin(), ref.end()));
}

inline bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

template <typename T> T* dptr(const ml4::cuda::DeviceBuffer& b) { return b.as<T>(); }

// Allocates a device buffer holding `bytes` bytes from `host` (fails the test on an error).
inline ml4::cuda::DeviceBuffer to_device_bytes(const void* host, size_t bytes) {
  auto b = ml4::cuda::DeviceBuffer::alloc(bytes);
  EXPECT_TRUE(b.ok()) << b.status().message();
  if (!b.ok()) return {};
  EXPECT_TRUE(b->upload(host, bytes).ok());
  return std::move(b).value();
}

// Allocates a device buffer holding `host` (dies on failure, via the test's ASSERT).
template <typename T>
ml4::cuda::DeviceBuffer to_device(const std::vector<T>& host) {
  return to_device_bytes(host.data(), host.size() * sizeof(T));
}

// A device buffer of n T's poisoned with 0xFF bytes (NaN for f32/bf16/e4m3, -1 for ints).
template <typename T>
ml4::cuda::DeviceBuffer poisoned(size_t n) {
  auto b = ml4::cuda::DeviceBuffer::alloc(n * sizeof(T));
  EXPECT_TRUE(b.ok()) << b.status().message();
  if (!b.ok()) return {};
  EXPECT_TRUE(b->fill_bytes(0xFF).ok());
  return std::move(b).value();
}

template <typename T>
std::vector<T> to_host(const ml4::cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> h(n);
  EXPECT_TRUE(b.download(h.data(), n * sizeof(T)).ok());
  return h;
}

inline std::vector<float> bf16_to_f32_vec(const std::vector<uint16_t>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_f32(v[i]);
  return o;
}

// Fresh normal(0, sd) values from a fixed seed.
inline std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

}  // namespace ml4::cuda::testing
