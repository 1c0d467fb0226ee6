// Latent row formats: fp8_ds_mla against vLLM's concat_and_cache_ds_mla rules (byte
// positions, tile scale = max(amax/448, FLT_MIN), bf16 rope), fp8 per-tensor and bf16.
#include "kv/latent_layout.h"

#include <bit>
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

// decode_latent's vector path (F16C: e4m3 -> f16 times 256 * scale; bf16 by a shift) gives the
// table's bits, code * scale rounded once, for every code in every position: fp8_ds_mla tile
// scales from FLT_MIN (an all-zero tile) to ones whose 256x overflows (the table path), a zero
// scale; fp8 per-tensor scales likewise; rows with a NaN code (the table path, NaN with its
// sign); r / dr with 8-steps and scalar tails; bf16 rows of any bits.
TEST(LatentLayout, DecodeIsTableTimesScaleEveryCode) {
  auto same = [](float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); };
  auto bf16 = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return bf16_to_f32(h);
  };
  std::mt19937 rng(41);
  const float picks[] = {FLT_MIN, 1e-30f, 3.7e-3f, 1.0f, 0.1f, 7.3e20f, 1.0e35f, 2.0e36f, 3.0e38f, 0.0f, -0.5f};
  for (auto [r, dr] : {std::pair<int, int>{128, 32}, {256, 64}, {512, 64}, {128, 2}, {384, 13}}) {
    const size_t tb = latent_token_bytes(KvCacheDtype::kFp8DsMla, r, dr);
    const int tiles = r / kDsMlaTile;
    std::vector<uint8_t> row(tb);
    std::vector<float> c(r), kr(dr);
    for (int trial = 0; trial < 64; ++trial) {
      for (auto& b : row) b = static_cast<uint8_t>(rng());
      for (int i = 0; i < r; ++i) row[i] = static_cast<uint8_t>(i + trial);  // every code, moving
      if (trial % 4 != 3)  // else keep NaN codes in the row
        for (int i = 0; i < r; ++i)
          if ((row[i] & 0x7f) == 0x7f) row[i] = static_cast<uint8_t>(rng() % 0x7f);
      for (int t = 0; t < tiles; ++t) {
        const float sc = picks[(trial + t) % 11] * (1.0f + static_cast<float>(rng() % 1000) / 997.0f);
        std::memcpy(row.data() + r + 4 * t, &sc, 4);
      }
      decode_latent(KvCacheDtype::kFp8DsMla, row.data(), r, dr, 1.0f, c.data(), kr.data());
      for (int i = 0; i < r; ++i) {
        float sc;
        std::memcpy(&sc, row.data() + r + 4 * (i / kDsMlaTile), 4);
        ASSERT_TRUE(same(c[i], e4m3_to_f32(row[i]) * sc)) << r << " " << trial << " " << i << " " << c[i];
      }
      for (int i = 0; i < dr; ++i) ASSERT_TRUE(same(kr[i], bf16(row.data() + r + 4 * tiles + 2 * i))) << i;
    }
  }
  for (auto [r, dr] : {std::pair<int, int>{128, 32}, {512, 64}, {100, 13}, {8, 0}}) {
    std::vector<uint8_t> row(latent_token_bytes(KvCacheDtype::kFp8, r, dr));
    std::vector<float> c(r), kr(dr);
    for (int trial = 0; trial < 44; ++trial) {
      for (size_t i = 0; i < row.size(); ++i) row[i] = static_cast<uint8_t>(i * 7 + trial);
      if (trial % 4 != 3)
        for (auto& b : row)
          if ((b & 0x7f) == 0x7f) b = 0x7e;
      const float sc = picks[trial % 11];
      decode_latent(KvCacheDtype::kFp8, row.data(), r, dr, sc, c.data(), kr.data());
      for (int i = 0; i < r; ++i) ASSERT_TRUE(same(c[i], e4m3_to_f32(row[i]) * sc)) << r << " " << trial << " " << i;
      for (int i = 0; i < dr; ++i) ASSERT_TRUE(same(kr[i], e4m3_to_f32(row[r + i]) * sc)) << trial << " " << i;
    }
  }
  for (auto [r, dr] : {std::pair<int, int>{128, 32}, {100, 13}}) {
    std::vector<uint8_t> row(latent_token_bytes(KvCacheDtype::kBf16, r, dr));
    std::vector<float> c(r), kr(dr);
    for (auto& b : row) b = static_cast<uint8_t>(rng());
    decode_latent(KvCacheDtype::kBf16, row.data(), r, dr, 1.0f, c.data(), kr.data());
    for (int i = 0; i < r; ++i) ASSERT_TRUE(same(c[i], bf16(row.data() + 2 * i))) << i;
    for (int i = 0; i < dr; ++i) ASSERT_TRUE(same(kr[i], bf16(row.data() + 2 * (r + i)))) << i;
  }
}

}  // namespace
}  // namespace ml4
