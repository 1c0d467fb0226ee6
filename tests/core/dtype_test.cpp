// Scalar formats against their definitions: every e4m3 / e2m1 / e8m0 code decodes to the
// value the OCP spec gives, and encoding is round-to-nearest-even with saturation.
#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace ml4 {
namespace {

TEST(DType, E4M3DecodeAllCodes) {
  for (int c = 0; c < 256; ++c) {
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    float v = e4m3_to_f32(static_cast<uint8_t>(c));
    if (e == 15 && m == 7) { EXPECT_TRUE(std::isnan(v)); continue; }
    double ref = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    EXPECT_EQ(v, static_cast<float>(s ? -ref : ref)) << c;
    // Every finite code round-trips.
    if (c != 0x80) {
      EXPECT_EQ(f32_to_e4m3(v), c) << c;
    }
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
}

TEST(DType, E4M3RoundsToNearestAndSaturates) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-500.f, 500.f);
  for (int i = 0; i < 20000; ++i) {
    float x = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
    float q = round_e4m3(x);
    if (std::fabs(x) >= 448.f) { EXPECT_EQ(std::fabs(q), 448.f); continue; }
    // Nearest: no representable value is closer.
    float best = 0; double bd = 1e30;
    for (int c = 0; c < 256; ++c) {
      float v = e4m3_to_f32(static_cast<uint8_t>(c));
      if (std::isnan(v)) continue;
      double d = std::fabs(static_cast<double>(v) - x);
      if (d < bd) { bd = d; best = v; }
    }
    EXPECT_EQ(std::fabs(static_cast<double>(q) - x), bd) << x << " -> " << q << " best " << best;
  }
}

// The encoder works on the bits; this is the definition it must equal: frexp / ldexp /
// nearbyint (round to nearest even), saturating to 448.
uint8_t e4m3_by_definition(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < std::ldexp(1.0f, -6)) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  int e;
  std::frexp(a, &e);
  float q = std::nearbyint(std::ldexp(a, 4 - e));
  if (q >= 16.0f) q = 8.0f, e += 1;
  const int code = ((e + 6) << 3) | (static_cast<int>(q) & 7);
  return sign | static_cast<uint8_t>(std::min(code, 0x7e));
}

// Every code's value, the midpoints between neighbours (the ties) and the floats next to both,
// a sweep over the bit patterns of [0, 2^10), both signs, and the special values.
TEST(DType, E4M3EncoderEqualsItsDefinition) {
  std::vector<float> xs = {0.0f, 1e-30f, 1e-45f, 448.0f, 449.0f, 464.0f, 480.0f, 1e30f, INFINITY, 0x1p-10f, 0x1p-9f,
                           0x1p-6f, std::nextafter(0x1p-6f, 0.0f)};
  for (int c = 0; c < 0x7f; ++c) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(c)), w = e4m3_to_f32(static_cast<uint8_t>(c + 1));
    const float mid = c + 1 < 0x7f ? 0.5f * (v + w) : v;
    for (float y : {v, mid}) xs.insert(xs.end(), {y, std::nextafter(y, 0.0f), std::nextafter(y, 1e9f)});
  }
  for (uint32_t b = 0; b < 0x44800000u; b += 4099) {
    float y;
    std::memcpy(&y, &b, 4);
    xs.push_back(y);
  }
  for (float x : xs)
    for (float y : {x, -x}) ASSERT_EQ(f32_to_e4m3(y), e4m3_by_definition(y)) << y;
  EXPECT_EQ(f32_to_e4m3(NAN), 0x7f);
  EXPECT_EQ(f32_to_e4m3(-INFINITY), 0xfe);
}

TEST(DType, E2M1AndE8M0) {
  const float vals[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c)), (c & 8 ? -1.f : 1.f) * vals[c & 7]);
  }
  EXPECT_EQ(f32_to_e2m1(2.5f), 4);   // tie between 2 (code 4) and 3 (code 5) -> even code 4
  EXPECT_EQ(f32_to_e2m1(5.0f), 6);   // tie between 4 (6) and 6 (7) -> 6
  EXPECT_EQ(f32_to_e2m1(100.f), 7);  // saturate
  EXPECT_EQ(f32_to_e2m1(-0.7f), 8 | 1);
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(f32_to_e8m0_ceil(8.0f), 130);
  EXPECT_EQ(f32_to_e8m0_ceil(8.5f), 131);
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

TEST(DType, Bf16AndF16RoundTrip) {
  std::mt19937 rng(99);
  std::normal_distribution<float> n(0.f, 3.f);
  for (int i = 0; i < 10000; ++i) {
    float x = n(rng);
    float b = round_bf16(x);
    EXPECT_LE(std::fabs(b - x), std::fabs(x) * std::ldexp(1.0f, -8));
    float h = f16_to_f32(f32_to_f16(x));
    EXPECT_LE(std::fabs(h - x), std::max(std::fabs(x) * std::ldexp(1.0f, -11), std::ldexp(1.0f, -25)));
  }
  for (int c = 0; c < 65536; ++c) {
    float v = f16_to_f32(static_cast<uint16_t>(c));
    if (std::isnan(v)) continue;
    EXPECT_EQ(f32_to_f16(v), c) << c;
  }
}

}  // namespace
}  // namespace ml4
