// Latent row formats: fp8_ds_mla against vLLM's concat_and_cache_ds_mla rules (byte
// positions, tile scale = max(amax/448, FLT_MIN), bf16 rope), fp8 per-tensor and bf16.
#include "kv/latent_layout.h"

#include <cfloat>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "kv/kv_test_util.h"

namespace ml4 {
namespace {

using kv_test::e4m3_bound;
using kv_test::wide_random;

TEST(KvCacheDtype, ParsesNamesAndRejectsOthers) {
  EXPECT_EQ(parse_kv_cache_dtype("auto").value(), KvCacheDtype::kFp8DsMla);
  EXPECT_EQ(parse_kv_cache_dtype("fp8_ds_mla").value(), KvCacheDtype::kFp8DsMla);
  EXPECT_EQ(parse_kv_cache_dtype("fp8").value(), KvCacheDtype::kFp8);
  EXPECT_EQ(parse_kv_cache_dtype("bf16").value(), KvCacheDtype::kBf16);
  auto bad = parse_kv_cache_dtype("fp16");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fp8_ds_mla"), std::string::npos);
  for (auto d : {KvCacheDtype::kFp8DsMla, KvCacheDtype::kFp8, KvCacheDtype::kBf16}) {
    EXPECT_EQ(parse_kv_cache_dtype(kv_cache_dtype_name(d)).value(), d);
  }
}

TEST(LatentLayout, TokenBytesMatchModelSpec) {
  // MODEL.md section 4: 656 / 576 / 1,152 B per token per layer for r=512, dr=64.
  EXPECT_EQ(latent_token_bytes(KvCacheDtype::kFp8DsMla, 512, 64), 656u);
  EXPECT_EQ(latent_token_bytes(KvCacheDtype::kFp8, 512, 64), 576u);
  EXPECT_EQ(latent_token_bytes(KvCacheDtype::kBf16, 512, 64), 1152u);
}

TEST(LatentLayout, DsMlaBytesAtTheirOffsets) {
  constexpr int r = 512, dr = 64;
  std::mt19937 rng(7);
  auto c = wide_random(rng, r);
  auto kr = wide_random(rng, dr, -8, 4);
  std::vector<uint8_t> row(656, 0xAB);
  encode_latent(KvCacheDtype::kFp8DsMla, c.data(), kr.data(), r, dr, 1.0f, row.data());
  for (int t = 0; t < 4; ++t) {
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(c[t * 128 + i]));
    const float scale = amax / 448.0f;
    float stored;
    std::memcpy(&stored, row.data() + 512 + 4 * t, 4);
    EXPECT_EQ(stored, scale) << "tile " << t;  // bit-exact, not rounded to a power of two
    for (int i = 0; i < 128; ++i) {
      ASSERT_EQ(row[t * 128 + i], f32_to_e4m3(c[t * 128 + i] / scale)) << t << " " << i;
    }
  }
  for (int i = 0; i < dr; ++i) {
    uint16_t h;
    std::memcpy(&h, row.data() + 528 + 2 * i, 2);
    EXPECT_EQ(h, f32_to_bf16(kr[i])) << i;
  }
}

TEST(LatentLayout, DsMlaKnownAnswer) {
  // A tile whose amax is 448 has scale 1 exactly, so bytes are plain e4m3 codes:
  // 448 -> 0x7e, 1.0 -> 0x38, -2.0 -> 0xc0, 0.5 -> 0x30. An all-zero tile gets FLT_MIN.
  constexpr int r = 256, dr = 2;
  std::vector<float> c(r, 0.0f), kr = {1.5f, -3.0f};
  c[0] = 448.0f;
  c[1] = 1.0f;
  c[2] = -2.0f;
  c[3] = 0.5f;
  std::vector<uint8_t> row(latent_token_bytes(KvCacheDtype::kFp8DsMla, r, dr));
  ASSERT_EQ(row.size(), 256u + 8u + 4u);
  encode_latent(KvCacheDtype::kFp8DsMla, c.data(), kr.data(), r, dr, 1.0f, row.data());
  EXPECT_EQ(row[0], 0x7e);
  EXPECT_EQ(row[1], 0x38);
  EXPECT_EQ(row[2], 0xc0);
  EXPECT_EQ(row[3], 0x30);
  float s0, s1;
  std::memcpy(&s0, row.data() + 256, 4);
  std::memcpy(&s1, row.data() + 260, 4);
  EXPECT_EQ(s0, 1.0f);
  EXPECT_EQ(s1, FLT_MIN);
  for (int i = 128; i < 256; ++i) EXPECT_EQ(row[i], 0);
  EXPECT_EQ(row[264], 0xc0);  // bf16 1.5 = 0x3fc0, little-endian
  EXPECT_EQ(row[265], 0x3f);
  std::vector<float> c2(r), kr2(dr);
  decode_latent(KvCacheDtype::kFp8DsMla, row.data(), r, dr, 1.0f, c2.data(), kr2.data());
  EXPECT_EQ(c2, c);  // all exactly representable
  EXPECT_EQ(kr2, kr);
}

TEST(LatentLayout, DsMlaRoundTripWithinE4M3Bound) {
  constexpr int r = 512, dr = 64;
  std::mt19937 rng(11);
  std::vector<uint8_t> row(656);
  std::vector<float> c2(r), kr2(dr);
  int subnormal_hits = 0;
  for (int trial = 0; trial < 200; ++trial) {
    auto c = wide_random(rng, r);
    auto kr = wide_random(rng, dr, -8, 4);
    encode_latent(KvCacheDtype::kFp8DsMla, c.data(), kr.data(), r, dr, 1.0f, row.data());
    decode_latent(KvCacheDtype::kFp8DsMla, row.data(), r, dr, 1.0f, c2.data(), kr2.data());
    for (int t = 0; t < r / 128; ++t) {
      double amax = 0;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(double(c[t * 128 + i])));
      const double s = amax / 448.0;
      for (int i = t * 128; i < (t + 1) * 128; ++i) {
        ASSERT_LE(std::fabs(double(c2[i]) - c[i]), e4m3_bound(c[i], s)) << trial << " " << i;
        subnormal_hits += std::fabs(c[i]) / s < std::ldexp(1.0, -6);
      }
    }
    for (int i = 0; i < dr; ++i) ASSERT_EQ(kr2[i], round_bf16(kr[i]));  // rope exact to bf16
  }
  EXPECT_GT(subnormal_hits, 0);  // the subnormal branch of the bound was exercised
}

TEST(LatentLayout, Fp8PerTensorRoundTrip) {
  constexpr int r = 512, dr = 64;
  std::mt19937 rng(13);
  std::vector<uint8_t> row(576);
  std::vector<float> c2(r), kr2(dr);
  for (float scale : {1.0f, 0.03125f, 0.7f}) {
    auto c = wide_random(rng, r, -10, 2);  // |x / scale| stays below 448 for these scales
    auto kr = wide_random(rng, dr, -10, 2);
    encode_latent(KvCacheDtype::kFp8, c.data(), kr.data(), r, dr, scale, row.data());
    for (int i = 0; i < r; ++i) ASSERT_EQ(row[i], f32_to_e4m3(c[i] / scale));
    for (int i = 0; i < dr; ++i) ASSERT_EQ(row[r + i], f32_to_e4m3(kr[i] / scale));
    decode_latent(KvCacheDtype::kFp8, row.data(), r, dr, scale, c2.data(), kr2.data());
    for (int i = 0; i < r; ++i) ASSERT_LE(std::fabs(double(c2[i]) - c[i]), e4m3_bound(c[i], scale));
    for (int i = 0; i < dr; ++i) ASSERT_LE(std::fabs(double(kr2[i]) - kr[i]), e4m3_bound(kr[i], scale));
  }
}

TEST(LatentLayout, Fp8SaturatesInsteadOfNan) {
  std::vector<float> c = {1e6f, -1e6f}, kr = {};
  std::vector<uint8_t> row(2);
  encode_latent(KvCacheDtype::kFp8, c.data(), kr.data(), 2, 0, 1.0f, row.data());
  EXPECT_EQ(row[0], 0x7e);
  EXPECT_EQ(row[1], 0xfe);
}

TEST(LatentLayout, Bf16ExactToBf16) {
  constexpr int r = 512, dr = 64;
  std::mt19937 rng(17);
  auto c = wide_random(rng, r, -20, 20);
  auto kr = wide_random(rng, dr, -20, 20);
  std::vector<uint8_t> row(1152);
  encode_latent(KvCacheDtype::kBf16, c.data(), kr.data(), r, dr, 1.0f, row.data());
  uint16_t h;
  std::memcpy(&h, row.data() + 2 * r, 2);  // rope follows the latent directly
  EXPECT_EQ(h, f32_to_bf16(kr[0]));
  std::vector<float> c2(r), kr2(dr);
  decode_latent(KvCacheDtype::kBf16, row.data(), r, dr, 1.0f, c2.data(), kr2.data());
  for (int i = 0; i < r; ++i) ASSERT_EQ(c2[i], round_bf16(c[i]));
  for (int i = 0; i < dr; ++i) ASSERT_EQ(kr2[i], round_bf16(kr[i]));
}

}  // namespace
}  // namespace ml4
