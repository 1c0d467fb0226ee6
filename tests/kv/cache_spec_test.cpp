// Cache groups and byte counts for a hand-built config mirroring ml4 (63 latent owners,
// 44 indexer owners): MODEL.md section 1's 47,136 / 42,096 / 78,384 B per token.
#include "kv/cache_spec.h"

#include <gtest/gtest.h>

#include "kv/kv_test_util.h"

namespace ml4 {
namespace {

TEST(CacheSpec, Ml4ByteCounts) {
  const ModelConfig cfg = kv_test::ml4_like_config();
  ASSERT_EQ(cfg.num_latent_layers(), 63);
  ASSERT_EQ(cfg.num_indexer_layers(), 44);
  const struct { KvCacheDtype dtype; int64_t latent, total; } cases[] = {
      {KvCacheDtype::kFp8DsMla, 63 * 656, 47136},
      {KvCacheDtype::kFp8, 63 * 576, 42096},
      {KvCacheDtype::kBf16, 63 * 1152, 78384},
  };
  for (const auto& c : cases) {
    auto spec = make_kv_cache_spec(cfg, c.dtype);
    ASSERT_TRUE(spec.ok()) << spec.status().message();
    ASSERT_EQ(spec->groups.size(), 3u);
    const auto& lat = spec->groups[0];
    const auto& idx = spec->groups[1];
    const auto& dft = spec->groups[2];
    EXPECT_EQ(lat.kind, CacheGroupSpec::kLatent);
    EXPECT_EQ(lat.layers.size(), 63u);
    EXPECT_EQ(lat.bytes_per_token(), c.latent);
    EXPECT_EQ(idx.kind, CacheGroupSpec::kIndexer);
    EXPECT_EQ(idx.bytes_per_token(), 44 * 132);
    EXPECT_EQ(idx.page_bytes_per_layer(), 64 * 132);
    EXPECT_EQ(spec->bytes_per_token(), c.total) << kv_cache_dtype_name(c.dtype);
    // Drafter: bf16 (512 + 64) x 2 B per drafter layer, sliding window, left out of the total.
    EXPECT_EQ(dft.kind, CacheGroupSpec::kDrafter);
    EXPECT_EQ(dft.bytes_per_token(), 3 * 1152);
    EXPECT_EQ(dft.sliding_window, 2048);
    EXPECT_FALSE(dft.full_attention());
    EXPECT_EQ(spec->group_index(CacheGroupSpec::kDrafter), 2);
  }
}

TEST(CacheSpec, GroupsFollowLayerSpecs) {
  const ModelConfig cfg = kv_test::ml4_like_config();
  auto spec = make_kv_cache_spec(cfg, KvCacheDtype::kFp8DsMla);
  ASSERT_TRUE(spec.ok());
  const auto& lat = spec->groups[0].layers;
  for (size_t s = 0; s < lat.size(); ++s) {
    EXPECT_EQ(cfg.layers[lat[s]].latent_slot, static_cast<int>(s));
    EXPECT_TRUE(cfg.layers[lat[s]].owns_kv());
  }
  for (int consumer = 39; consumer <= 71; consumer += 4) {
    EXPECT_EQ(std::count(lat.begin(), lat.end(), consumer), 0) << consumer;
  }
  const auto& idx = spec->groups[1].layers;
  for (size_t s = 0; s < idx.size(); ++s) EXPECT_EQ(cfg.layers[idx[s]].indexer_slot, static_cast<int>(s));
}

TEST(CacheSpec, NoDsaNoDrafterMeansOneGroup) {
  ModelConfig cfg = kv_test::hand_built_config(4, 256, 32, 0, {}, 0, [](int) { return false; });
  auto spec = make_kv_cache_spec(cfg, KvCacheDtype::kBf16);
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  ASSERT_EQ(spec->groups.size(), 1u);
  EXPECT_EQ(spec->bytes_per_token(), 4 * 2 * (256 + 32));
  EXPECT_EQ(spec->group_index(CacheGroupSpec::kIndexer), -1);
}

TEST(CacheSpec, RejectsBadConfigsWithAMessage) {
  // fp8_ds_mla needs r % 128 == 0; the other dtypes do not.
  ModelConfig small = kv_test::hand_built_config(2, 96, 16, 64, {}, 0, [](int) { return true; });
  auto bad = make_kv_cache_spec(small, KvCacheDtype::kFp8DsMla);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("multiple of 128"), std::string::npos);
  EXPECT_TRUE(make_kv_cache_spec(small, KvCacheDtype::kFp8).ok());

  ModelConfig slots = kv_test::ml4_like_config();
  slots.layers[5].latent_slot = 7;
  auto s = make_kv_cache_spec(slots, KvCacheDtype::kBf16);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("layer 5"), std::string::npos);

  ModelConfig source = kv_test::ml4_like_config();
  source.layers[39].kv_source = 43;  // a later consumer, not an owner
  EXPECT_FALSE(make_kv_cache_spec(source, KvCacheDtype::kBf16).ok());

  ModelConfig drafter = kv_test::ml4_like_config();
  drafter.drafter.window = 0;
  EXPECT_FALSE(make_kv_cache_spec(drafter, KvCacheDtype::kBf16).ok());

  ModelConfig count = kv_test::ml4_like_config();
  count.n_layers = 71;
  EXPECT_FALSE(make_kv_cache_spec(count, KvCacheDtype::kBf16).ok());
}

}  // namespace
}  // namespace ml4
