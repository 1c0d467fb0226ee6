// Random weights of every LinearFormat for tests/ops, with their f64 decoding computed
// independently (scalar core/dtype.h conversions): linear_test.cpp, linear_bf16dot_test.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "model/linear_weight.h"

namespace ml4::test {

// A weight with random content in `format`, and its f64 decoding [N, K].
struct TestWeight {
  LinearWeight w;
  std::vector<double> ref;
};

inline uint8_t random_e4m3(std::mt19937& rng, bool positive) {
  for (;;) {
    uint8_t b = static_cast<uint8_t>(rng() & 0xff);
    if ((b & 0x7f) == 0x7f) continue;  // NaN
    if (positive) b &= 0x7f;
    return b;
  }
}

inline TestWeight make_weight(LinearFormat format, int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  TestWeight t;
  t.w.name = "test.weight";
  t.w.format = format;
  t.w.out_features = N;
  t.w.in_features = K;
  t.ref.resize(static_cast<size_t>(N * K));
  switch (format) {
    case LinearFormat::kF32: {
      t.w.weight = Tensor(DType::kF32, {N, K});
      float* p = t.w.weight.mutable_as<float>();
      for (int64_t i = 0; i < N * K; ++i) t.ref[i] = p[i] = uni(rng);
      break;
    }
    case LinearFormat::kBF16: {
      t.w.weight = Tensor(DType::kBF16, {N, K});
      uint16_t* p = t.w.weight.mutable_as<uint16_t>();
      for (int64_t i = 0; i < N * K; ++i) {
        p[i] = f32_to_bf16(uni(rng));
        t.ref[i] = bf16_to_f32(p[i]);
      }
      break;
    }
    case LinearFormat::kFP8Block: {
      const int64_t nb = (N + 127) / 128, kb = (K + 127) / 128;
      t.w.weight = Tensor(DType::kF8E4M3, {N, K});
      t.w.scale = Tensor(DType::kF32, {nb, kb});
      uint8_t* q = t.w.weight.mutable_as<uint8_t>();
      float* s = t.w.scale.mutable_as<float>();
      std::uniform_real_distribution<float> sd(1e-4f, 1e-2f);
      for (int64_t i = 0; i < nb * kb; ++i) s[i] = sd(rng);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          q[n * K + k] = random_e4m3(rng, false);
          t.ref[n * K + k] = static_cast<double>(e4m3_to_f32(q[n * K + k])) * s[(n / 128) * kb + k / 128];
        }
      break;
    }
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4: {
      const bool nv = format == LinearFormat::kNVFP4;
      const int64_t group = nv ? 16 : 32;
      t.w.weight = Tensor(DType::kU8, {N, K / 2});
      t.w.scale = Tensor(nv ? DType::kF8E4M3 : DType::kE8M0, {N, K / group});
      t.w.global_scale = nv ? 0.0123f : 1.0f;
      uint8_t* q = t.w.weight.mutable_as<uint8_t>();
      uint8_t* s = t.w.scale.mutable_as<uint8_t>();
      for (int64_t i = 0; i < N * K / 2; ++i) q[i] = static_cast<uint8_t>(rng() & 0xff);
      for (int64_t i = 0; i < N * K / group; ++i)
        s[i] = nv ? random_e4m3(rng, true) : static_cast<uint8_t>(118 + rng() % 16);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t byte = q[n * (K / 2) + k / 2];
          const uint8_t nib = (k % 2 == 0) ? (byte & 0xf) : (byte >> 4);
          const uint8_t sv = s[n * (K / group) + k / group];
          const double scale = nv ? static_cast<double>(e4m3_to_f32(sv)) * t.w.global_scale
                                  : std::ldexp(1.0, sv - 127);
          t.ref[n * K + k] = e2m1_to_f32(nib) * scale;
        }
      break;
    }
  }
  return t;
}

}  // namespace ml4::test
