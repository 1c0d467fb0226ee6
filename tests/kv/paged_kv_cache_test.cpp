// Paged storage: read-after-write across pages at random slots for every group, the
// page() address arithmetic against independently encoded rows, and budget splitting.
#include "kv/paged_kv_cache.h"

#include <cstring>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "kv/indexer_layout.h"
#include "kv/kv_test_util.h"
#include "kv/latent_layout.h"

namespace ml4 {
namespace {

using kv_test::wide_random;

// 6 layers, layer 4 reads layer 2's latent (5 latent slots); indexer on even layers
// (3 slots); a 2-layer drafter with a 100-token window.
ModelConfig small_config() {
  ModelConfig cfg = kv_test::hand_built_config(6, 128, 32, 128, {4}, 2, [](int i) { return i % 2 == 0; });
  cfg.drafter.enabled = true;
  cfg.drafter.n_layers = 2;
  cfg.drafter.window = 100;
  return cfg;
}

// Distinct random slots in [0, blocks * 64), spread over every page.
std::vector<int64_t> random_slots(std::mt19937& rng, int64_t blocks, int n) {
  std::set<int64_t> s;
  std::uniform_int_distribution<int64_t> u(0, blocks * kPageTokens - 1);
  while (static_cast<int>(s.size()) < n) s.insert(u(rng));
  std::vector<int64_t> v(s.begin(), s.end());
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

TEST(PagedKvCache, LatentReadAfterWriteAcrossPages) {
  for (auto dtype : {KvCacheDtype::kFp8DsMla, KvCacheDtype::kFp8, KvCacheDtype::kBf16}) {
    auto spec = make_kv_cache_spec(small_config(), dtype);
    ASSERT_TRUE(spec.ok()) << spec.status().message();
    const int r = 128, dr = 32;
    const int64_t blocks = 5;
    const float fp8_scale = dtype == KvCacheDtype::kFp8 ? 0.25f : 1.0f;
    auto cache = PagedKvCache::create(*spec, {blocks, blocks, 2}, fp8_scale);
    ASSERT_TRUE(cache.ok()) << cache.status().message();
    const size_t tb = latent_token_bytes(dtype, r, dr);
    std::mt19937 rng(31);
    struct Row { std::vector<uint8_t> bytes; };
    std::map<std::pair<int, int64_t>, Row> expect;
    for (int layer = 0; layer < 5; ++layer) {
      for (int64_t slot : random_slots(rng, blocks, 40)) {
        auto c = wide_random(rng, r, -10, 2);
        auto kr = wide_random(rng, dr, -10, 2);
        cache->write_latent(layer, slot, c.data(), kr.data());
        Row row{std::vector<uint8_t>(tb)};
        encode_latent(dtype, c.data(), kr.data(), r, dr, fp8_scale, row.bytes.data());
        expect[{layer, slot}] = std::move(row);
      }
    }
    std::vector<float> c(r), kr(dr), c_ref(r), kr_ref(dr);
    for (const auto& [key, row] : expect) {
      const auto [layer, slot] = key;
      const uint8_t* p = cache->page(0, layer, slot / kPageTokens) + (slot % kPageTokens) * tb;
      ASSERT_EQ(0, std::memcmp(p, row.bytes.data(), tb)) << layer << " " << slot;
      cache->read_latent(layer, slot, c.data(), kr.data());
      decode_latent(dtype, row.bytes.data(), r, dr, fp8_scale, c_ref.data(), kr_ref.data());
      ASSERT_EQ(c, c_ref);
      ASSERT_EQ(kr, kr_ref);
    }
    // Layer slots and blocks do not alias: one layer's pages are contiguous.
    EXPECT_EQ(cache->page(0, 1, 0) - cache->page(0, 0, 0), blocks * 64 * static_cast<int64_t>(tb));
    EXPECT_EQ(cache->page(0, 0, 3) - cache->page(0, 0, 2), 64 * static_cast<int64_t>(tb));
  }
}

TEST(PagedKvCache, IndexerAndDrafterReadAfterWrite) {
  auto spec = make_kv_cache_spec(small_config(), KvCacheDtype::kFp8DsMla);
  ASSERT_TRUE(spec.ok());
  const int dI = 128, r = 128, dr = 32;
  auto cache = PagedKvCache::create(*spec, {4, 4, 3});
  ASSERT_TRUE(cache.ok());
  std::mt19937 rng(37);
  std::map<std::pair<int, int64_t>, std::vector<float>> keys;
  for (int s = 0; s < 3; ++s) {
    for (int64_t slot : random_slots(rng, 4, 50)) keys[{s, slot}] = wide_random(rng, dI, -10, 2);
  }
  for (auto& [key, k] : keys) cache->write_indexer_key(key.first, key.second, k.data());
  std::vector<float> got(dI), ref(dI);
  std::vector<uint8_t> page(indexer_page_bytes(dI)), raw(dI);
  float scale;
  for (auto& [key, k] : keys) {
    encode_indexer_key(k.data(), dI, page.data(), static_cast<int>(key.second % 64));
    decode_indexer_key(page.data(), static_cast<int>(key.second % 64), dI, ref.data());
    cache->read_indexer_key(key.first, key.second, got.data());
    ASSERT_EQ(got, ref) << key.first << " " << key.second;
    cache->read_indexer_key_raw(key.first, key.second, raw.data(), &scale);
    ASSERT_EQ(0, std::memcmp(raw.data(), page.data() + (key.second % 64) * dI, dI));
  }
  // Drafter: bf16, so reads equal the bf16 rounding of what was written.
  for (int layer = 0; layer < 2; ++layer) {
    for (int64_t slot : random_slots(rng, 3, 30)) {
      auto c = wide_random(rng, r, -10, 2), kr = wide_random(rng, dr, -10, 2);
      cache->write_drafter(layer, slot, c.data(), kr.data());
      std::vector<float> c2(r), kr2(dr);
      cache->read_drafter(layer, slot, c2.data(), kr2.data());
      for (int i = 0; i < r; ++i) ASSERT_EQ(c2[i], round_bf16(c[i]));
      for (int i = 0; i < dr; ++i) ASSERT_EQ(kr2[i], round_bf16(kr[i]));
    }
  }
}

TEST(PagedKvCache, SizeBytesAndCreateErrors) {
  auto spec = make_kv_cache_spec(small_config(), KvCacheDtype::kFp8DsMla);
  ASSERT_TRUE(spec.ok());
  auto cache = PagedKvCache::create(*spec, {3, 2, 1});
  ASSERT_TRUE(cache.ok());
  // latent 5 x 3 x 64 x 196 (128 e4m3 + 4 scale + 64 rope), indexer 3 x 2 x 64 x 132, drafter 2 x 1 x 64 x 320.
  EXPECT_EQ(cache->size_bytes(), 5u * 3 * 64 * 196 + 3u * 2 * 64 * 132 + 2u * 1 * 64 * 320);
  EXPECT_EQ(latent_token_bytes(KvCacheDtype::kFp8DsMla, 128, 32), 196u);

  auto wrong_count = PagedKvCache::create(*spec, {3, 2});
  ASSERT_FALSE(wrong_count.ok());
  EXPECT_EQ(wrong_count.status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(PagedKvCache::create(*spec, {3, -1, 1}).ok());
  EXPECT_FALSE(PagedKvCache::create(*spec, {3, 2, 1}, 0.0f).ok());

  EXPECT_TRUE(cache->check_slot(0, 4, 3 * 64 - 1).ok());
  auto past = cache->check_slot(0, 4, 3 * 64);
  EXPECT_EQ(past.code(), StatusCode::kOutOfRange);
  EXPECT_NE(past.message().find("latent"), std::string::npos);
  EXPECT_FALSE(cache->check_slot(0, 5, 0).ok());   // 5 latent slots: 0..4
  EXPECT_FALSE(cache->check_slot(1, 0, -1).ok());
  EXPECT_FALSE(cache->check_slot(3, 0, 0).ok());   // 3 groups
}

TEST(PagedKvCache, BlocksForBudgetNeverExceedsIt) {
  const ModelConfig cfg = kv_test::ml4_like_config();
  std::mt19937_64 rng(41);
  for (auto dtype : {KvCacheDtype::kFp8DsMla, KvCacheDtype::kFp8, KvCacheDtype::kBf16}) {
    auto spec = make_kv_cache_spec(cfg, dtype);
    ASSERT_TRUE(spec.ok());
    // One block of every full-attention group = 64 tokens x bytes_per_token.
    const int64_t full_block = 64 * spec->bytes_per_token();
    for (int trial = 0; trial < 200; ++trial) {
      const int64_t budget = static_cast<int64_t>(rng() % (int64_t{200} << 30));
      const int64_t max_requests = trial % 2 ? static_cast<int64_t>(rng() % 64) : 0;
      auto blocks = PagedKvCache::blocks_for_budget(*spec, budget, max_requests);
      ASSERT_EQ(blocks.size(), spec->groups.size());
      int64_t used = 0;
      for (size_t g = 0; g < blocks.size(); ++g) {
        const auto& gs = spec->groups[g];
        used += blocks[g] * gs.page_bytes_per_layer() * static_cast<int64_t>(gs.layers.size());
      }
      ASSERT_LE(used, budget);
      ASSERT_EQ(blocks[0], blocks[1]);  // same token capacity in latent and indexer groups
      ASSERT_GT(used + full_block, budget);  // and the largest such count
      const int64_t want_drafter = max_requests * ((2048 + 63) / 64 + 1);
      if (budget >= want_drafter * 64 * 3 * 1152) {
        ASSERT_EQ(blocks[2], want_drafter);
      }
    }
  }
  auto spec = make_kv_cache_spec(cfg, KvCacheDtype::kFp8DsMla);
  EXPECT_EQ(PagedKvCache::blocks_for_budget(*spec, -5), std::vector<int64_t>(3, 0));
  // 100 GiB at 47,136 B/token: floor(100 GiB / (64 x 47,136)) blocks.
  auto b = PagedKvCache::blocks_for_budget(*spec, int64_t{100} << 30);
  EXPECT_EQ(b[0], (int64_t{100} << 30) / (64 * 47136));
}

}  // namespace
}  // namespace ml4
