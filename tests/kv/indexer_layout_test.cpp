// Indexer key pages: vLLM's page-major layout (64 x dI e4m3, then 64 x G f32 scales) and
// DeepSeek act_quant's scale max(amax, 1e-4) / 448.
#include "kv/indexer_layout.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "kv/kv_cache_dtype.h"
#include "kv/kv_test_util.h"

namespace ml4 {
namespace {

using kv_test::e4m3_bound;
using kv_test::wide_random;

TEST(IndexerLayout, Sizes) {
  EXPECT_EQ(indexer_token_bytes(128), 132u);  // MODEL.md 3.5
  EXPECT_EQ(indexer_page_bytes(128), 64u * 132u);
  EXPECT_EQ(indexer_token_bytes(256), 264u);
  EXPECT_EQ(indexer_token_bytes(64), 68u);  // toy configs: one scale for a short head
}

TEST(IndexerLayout, PageBytesAtTheirOffsets) {
  for (int dI : {128, 256, 64}) {
    const int G = indexer_scales_per_token(dI);
    std::mt19937 rng(21 + dI);
    std::vector<uint8_t> page(indexer_page_bytes(dI), 0);
    std::vector<std::vector<float>> keys(kPageTokens);
    std::vector<int> order(kPageTokens);
    for (int t = 0; t < kPageTokens; ++t) order[t] = t;
    std::shuffle(order.begin(), order.end(), rng);  // write order must not matter
    for (int t : order) {
      keys[t] = wide_random(rng, dI, -10, 3);
      encode_indexer_key(keys[t].data(), dI, page.data(), t);
    }
    for (int t = 0; t < kPageTokens; ++t) {
      for (int g = 0; g < G; ++g) {
        float amax = 0;
        for (int i = g * 128; i < std::min(dI, (g + 1) * 128); ++i) amax = std::max(amax, std::fabs(keys[t][i]));
        const float scale = std::max(amax, 1e-4f) / 448.0f;
        float stored;
        std::memcpy(&stored, page.data() + 64 * dI + t * 4 * G + 4 * g, 4);
        ASSERT_EQ(stored, scale) << dI << " " << t << " " << g;
        for (int i = g * 128; i < std::min(dI, (g + 1) * 128); ++i) {
          ASSERT_EQ(page[t * dI + i], f32_to_e4m3(keys[t][i] / scale)) << dI << " " << t << " " << i;
        }
      }
      std::vector<uint8_t> raw(dI);
      std::vector<float> scales(G);
      read_indexer_key_raw(page.data(), t, dI, raw.data(), scales.data());
      ASSERT_EQ(0, std::memcmp(raw.data(), page.data() + t * dI, dI));
      ASSERT_EQ(0, std::memcmp(scales.data(), page.data() + 64 * dI + t * 4 * G, 4 * G));
    }
  }
}

// decode_indexer_key's vector path gives e4m3_to_f32(v) * scale bit for bit: every code (NaN
// codes as NaN), scales from the 1e-4 floor to large, dI with a short last group.
TEST(IndexerLayout, DecodeIsTableTimesScaleEveryCode) {
  for (int dI : {128, 256, 64, 136, 100}) {
    const int G = indexer_scales_per_token(dI);
    std::mt19937 rng(31 + dI);
    std::vector<uint8_t> page(indexer_page_bytes(dI));
    for (auto& b : page) b = static_cast<uint8_t>(rng());
    // 3e36: 256 x scale overflows f32 (a page no encoder writes, e.g. a hostile P/D peer's):
    // the vector path must hand that group to the scalar loop.
    const float picks[] = {1e-4f / 448.0f, 3.7e-3f, 1.0f, 0.1f, 7.3e20f, 1.0e35f, 3.0e36f};
    for (int t = 0; t < kPageTokens; ++t)
      for (int g = 0; g < G; ++g) {
        const float sc = picks[(t + g) % 7] * (1.0f + static_cast<float>(rng() % 1000) / 997.0f);
        std::memcpy(page.data() + 64 * dI + t * 4 * G + 4 * g, &sc, 4);
      }
    for (int i = 0; i < 256 && i < 64 * dI; ++i) page[i] = static_cast<uint8_t>(i);  // every code
    std::vector<float> k(dI);
    for (int t = 0; t < kPageTokens; ++t) {
      decode_indexer_key(page.data(), t, dI, k.data());
      for (int i = 0; i < dI; ++i) {
        float sc;
        std::memcpy(&sc, page.data() + 64 * dI + t * 4 * G + 4 * (i / 128), 4);
        const float ref = e4m3_to_f32(page[t * dI + i]) * sc;
        if (std::isnan(ref)) {
          ASSERT_TRUE(std::isnan(k[i])) << dI << " " << t << " " << i;
        } else {
          ASSERT_EQ(std::bit_cast<uint32_t>(k[i]), std::bit_cast<uint32_t>(ref)) << dI << " " << t << " " << i;
        }
      }
    }
  }
}

TEST(IndexerLayout, RoundTripWithinE4M3Bound) {
  constexpr int dI = 128;
  std::mt19937 rng(23);
  std::vector<uint8_t> page(indexer_page_bytes(dI));
  std::vector<float> k2(dI);
  for (int trial = 0; trial < 100; ++trial) {
    const int t = static_cast<int>(rng() % kPageTokens);
    auto k = wide_random(rng, dI, -12, 3);
    encode_indexer_key(k.data(), dI, page.data(), t);
    decode_indexer_key(page.data(), t, dI, k2.data());
    double amax = 0;
    for (float x : k) amax = std::max(amax, std::fabs(double(x)));
    const double s = std::max(amax, 1e-4) / 448.0;
    for (int i = 0; i < dI; ++i) ASSERT_LE(std::fabs(double(k2[i]) - k[i]), e4m3_bound(k[i], s)) << i;
  }
}

TEST(IndexerLayout, TinyKeyUsesScaleFloor) {
  // amax below 1e-4: scale is 1e-4/448, so values decode to within 2^-10 * scale of the input.
  constexpr int dI = 128;
  std::mt19937 rng(29);
  auto k = wide_random(rng, dI, -30, -16);
  std::vector<uint8_t> page(indexer_page_bytes(dI));
  encode_indexer_key(k.data(), dI, page.data(), 5);
  float scale;
  std::memcpy(&scale, page.data() + 64 * dI + 5 * 4, 4);
  EXPECT_EQ(scale, 1e-4f / 448.0f);
  std::vector<float> k2(dI);
  decode_indexer_key(page.data(), 5, dI, k2.data());
  for (int i = 0; i < dI; ++i) ASSERT_LE(std::fabs(double(k2[i]) - k[i]), e4m3_bound(k[i], scale));
}

}  // namespace
}  // namespace ml4
