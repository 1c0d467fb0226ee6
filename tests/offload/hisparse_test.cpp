// HiSparse's policy (offload/hisparse.h) on its own: the hot buffer's LRU against a plain
// reference model over random working sets, regions and rollback, the connector JSON, and the
// capacity plan, including the sharing-aware vs materialised host pool of the ML4 config
// (the seed: +14.3%).
#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <map>
#include <random>
#include <set>

#include "kv/cache_spec.h"
#include "model/presets.h"
#include "offload/hisparse.h"

namespace ml4 {
namespace {

// The reference: a list of resident positions, least recently used first.
struct RefLru {
  int slots;
  std::list<int32_t> order;
  // Returns the positions loaded (misses), in wanted order.
  std::vector<int32_t> touch(const std::vector<int32_t>& wanted) {
    std::vector<int32_t> missed;
    std::set<int32_t> want(wanted.begin(), wanted.end());
    for (int32_t p : wanted) {
      auto it = std::find(order.begin(), order.end(), p);
      if (it != order.end()) {
        order.erase(it);
        order.push_back(p);
      }
    }
    for (int32_t p : wanted) {
      if (std::find(order.begin(), order.end(), p) != order.end()) continue;
      if (static_cast<int>(order.size()) == slots) order.pop_front();  // never a wanted one: hits are at the back
      order.push_back(p);
      missed.push_back(p);
    }
    return missed;
  }
};

TEST(HotBuffer, MatchesAReferenceLruOnRandomWorkingSets) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    const int slots = 8 + static_cast<int>(rng() % 40);
    HotBuffer hb(slots);
    RefLru ref{slots, {}};
    std::map<int32_t, int32_t> row_of;  // what the buffer told us
    int64_t context = 10;
    for (int step = 0; step < 300; ++step) {
      context += rng() % 3;
      // A working set that drifts: mostly recent positions, some old ones.
      std::set<int32_t> w;
      const int n = 1 + static_cast<int>(rng() % slots);
      while (static_cast<int>(w.size()) < std::min<int64_t>(n, context))
        w.insert(static_cast<int32_t>(rng() % 4 ? context - 1 - rng() % std::min<int64_t>(context, 2 * slots) : rng() % context));
      std::vector<int32_t> wanted(w.begin(), w.end());
      std::vector<int32_t> rows(wanted.size());
      std::vector<std::pair<int32_t, int32_t>> loads;
      hb.touch(wanted, rows.data(), &loads);
      const auto missed = ref.touch(wanted);
      ASSERT_EQ(loads.size(), missed.size()) << "trial " << trial << " step " << step;
      for (size_t i = 0; i < missed.size(); ++i) ASSERT_EQ(loads[i].first, missed[i]);
      // Rows: distinct, in range, stable for hits, and a loaded row's previous position gone.
      std::set<int32_t> distinct(rows.begin(), rows.end());
      ASSERT_EQ(distinct.size(), rows.size());
      for (const auto& [p, row] : loads) {
        for (auto it = row_of.begin(); it != row_of.end();)
          it = it->second == row ? row_of.erase(it) : std::next(it);
        row_of[p] = row;
      }
      for (size_t i = 0; i < wanted.size(); ++i) {
        ASSERT_GE(rows[i], 0);
        ASSERT_LT(rows[i], slots);
        ASSERT_EQ(row_of.at(wanted[i]), rows[i]);
      }
      ASSERT_EQ(hb.resident(), static_cast<int>(ref.order.size()));
    }
  }
}

TEST(HotBuffer, ForgetFromDropsRewrittenPositions) {
  HotBuffer hb(8);
  std::vector<int32_t> rows(6);
  std::vector<std::pair<int32_t, int32_t>> loads;
  hb.touch({1, 2, 3, 10, 11, 12}, rows.data(), &loads);
  EXPECT_EQ(loads.size(), 6u);
  hb.forget_from(10);
  EXPECT_EQ(hb.resident(), 3);
  loads.clear();
  hb.touch({1, 2, 3, 10, 11, 12}, rows.data(), &loads);
  ASSERT_EQ(loads.size(), 3u);  // only the forgotten ones come back from the host pool
  EXPECT_EQ(loads[0].first, 10);
}

TEST(HiSparseState, RegionsAreTakenReleasedAndBounded) {
  HiSparseState st(3, 2, 16);
  ASSERT_TRUE(st.begin_seq_step(7, 0, 100).ok());
  ASSERT_TRUE(st.begin_seq_step(9, 0, 50).ok());
  auto third = st.region(11);
  ASSERT_FALSE(third.ok());
  EXPECT_NE(third.status().message().find("in use"), std::string::npos);
  std::vector<int32_t> rows(4);
  std::vector<std::pair<int32_t, int32_t>> loads;
  const int g = st.region(7).value();
  st.buffer(g, 1).touch({5, 60, 98, 99}, rows.data(), &loads);
  EXPECT_EQ(st.resident_rows(), 4);
  // A step that starts at 98 (drafts past it rejected) forgets 98 and 99 in every layer.
  ASSERT_TRUE(st.begin_seq_step(7, 98, 101).ok());
  EXPECT_EQ(st.resident_rows(), 2);
  st.release(7);
  EXPECT_EQ(st.regions_in_use(), 1);
  EXPECT_EQ(st.resident_rows(), 0);
  EXPECT_TRUE(st.region(11).ok());
  st.release(9);
  st.release(11);
  st.release(12345);  // unknown: nothing
  EXPECT_EQ(st.regions_in_use(), 0);
}

TEST(HiSparseConfig, ParsesTheConnectorAndRefusesBadInput) {
  const std::string ok =
      R"({"kv_connector":"HiSparseConnector","kv_connector_extra_config":{"host_pool_gb":2.5,"hot_slots_per_request":512}})";
  EXPECT_TRUE(is_hisparse_connector(ok));
  EXPECT_FALSE(is_hisparse_connector(R"({"kv_connector":"UcxConnector","kv_role":"kv_both"})"));
  EXPECT_FALSE(is_hisparse_connector("not json"));
  auto c = parse_hisparse_config(ok);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(c->enabled);
  EXPECT_EQ(c->host_pool_bytes, static_cast<int64_t>(2.5 * (1ll << 30)));
  EXPECT_EQ(c->hot_slots_per_request, 512);
  for (const char* bad : {
           R"({"kv_connector":"HiSparseConnector"})",
           R"({"kv_connector":"HiSparseConnector","kv_connector_extra_config":{"host_pool_gb":0}})",
           R"({"kv_connector":"HiSparseConnector","kv_connector_extra_config":{"host_pool_gb":-1}})",
           R"({"kv_connector":"HiSparseConnector","kv_connector_extra_config":{"host_pool_gb":"8"}})",
           R"({"kv_connector":"HiSparseConnector","kv_connector_extra_config":{"host_pool_gb":8,"hot_slots_per_request":0}})",
           R"({"kv_connector":"HiSparseConnector","kv_connector_extra_config":{"host_pool_gb":8,"hot_slots_per_request":1.5}})",
           R"({"kv_connector":"HiSparseConnector","kv_connector_extra_config":{"host_pool_gb":8,"swap_in":960}})",
           R"({"kv_connector":"HiSparseConnector","kv_role":"kv_producer","kv_connector_extra_config":{"host_pool_gb":8}})",
           R"({"kv_connector":"HiSparseConnector","extra":1,"kv_connector_extra_config":{"host_pool_gb":8}})",
           R"([1,2])",
       }) {
    auto r = parse_hisparse_config(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) EXPECT_NE(r.status().message().find("--kv-transfer-config"), std::string::npos);
  }
}

// The ML4 config: 63 latent owners + 9 consumers of layer 35's rows. Binding the consumers to
// their source's host rows instead of materialising them holds 72 / 63 = 1.143x the tokens in
// the same host pool (the seed: +14.3%); the device side (indexer, hot buffers) is the same.
TEST(HiSparseSizing, SharingAwarePoolHoldsTheSeedsShareMoreTokens) {
  auto cfg = preset_config("ml4");
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  auto spec = make_kv_cache_spec(*cfg, KvCacheDtype::kFp8DsMla);
  ASSERT_TRUE(spec.ok());
  KvCacheSpec materialised = *spec;
  const int g = spec->group_index(CacheGroupSpec::kLatent);
  for (const auto& l : cfg->layers)
    if (!l.owns_kv()) materialised.groups[g].layers.push_back(l.index);
  EXPECT_EQ(spec->groups[g].layers.size(), 63u);
  EXPECT_EQ(materialised.groups[g].layers.size(), 72u);
  HiSparseConfig hc;
  hc.enabled = true;
  hc.host_pool_bytes = 440ll << 30;  // the seed's pool
  const int64_t device = 100ll << 30;
  auto aware = hisparse_sizing(*cfg, *spec, hc, device, 64, false);
  auto mat = hisparse_sizing(*cfg, materialised, hc, device, 64, false);
  ASSERT_TRUE(aware.ok()) << aware.status().message();
  ASSERT_TRUE(mat.ok());
  const double ratio = static_cast<double>(aware->blocks[g]) / static_cast<double>(mat->blocks[g]);
  std::printf("ML4 fp8_ds_mla, 440 GiB host pool: %lld tokens sharing-aware, %lld materialised: +%.1f%%\n",
              static_cast<long long>(aware->blocks[g] * kPageTokens), static_cast<long long>(mat->blocks[g] * kPageTokens),
              100.0 * (ratio - 1.0));
  EXPECT_NEAR(ratio, 72.0 / 63.0, 1e-4);  // +14.29%
  // Every full-attention group gets the same block count, and the host pool bounds it.
  const int gi = spec->group_index(CacheGroupSpec::kIndexer);
  EXPECT_EQ(aware->blocks[gi], aware->blocks[g]);
  EXPECT_EQ(aware->layers, 72);  // MODEL.md: 44 indexer owners + 28 reusers, every layer sparse
  EXPECT_EQ(aware->slots, 2 * cfg->indexer.topk);
  EXPECT_LE(aware->blocks[g] * spec->groups[g].page_bytes_per_layer() * 63, hc.host_pool_bytes);
}

}  // namespace
}  // namespace ml4
