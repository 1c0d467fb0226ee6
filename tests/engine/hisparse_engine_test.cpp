// HiSparse (SYSTEM.md S12) through the engine on the CPU runner (ml4-tiny, random weights):
// greedy outputs equal those of a runner without offload under preemption (a host pool of
// 14 blocks for 6 running requests of up to ~380 tokens), with DSpark speculation (verify
// blocks through the hot buffers, rejected drafts rolled back), and after a mixed load with
// aborts every hot-buffer region and row, and every block, is free again.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/spec_decode.h"
#include "model/config_loader.h"
#include "runtime/cpu/cpu_runner.h"
#include "runtime/test_models.h"

namespace ml4 {
namespace {

// ml4-tiny (seed 4), written once per test binary and removed at exit (runtime/test_models.h).
const std::string& model_dir() {
  static const std::string dir = testing::test_model("ml4-tiny", 4, "bf16");
  return dir;
}

// host_blocks 0: no offload (64 MiB of ordinary cache).
std::unique_ptr<ModelRunner> load(int64_t host_blocks, int hot_slots, bool drafter, int max_seqs) {
  auto cfg = load_model_config(model_dir());
  EXPECT_TRUE(cfg.ok());
  RunnerOptions ro;
  ro.kv_cache_dtype = "fp8_ds_mla";
  ro.kv_cache_bytes = 64ll << 20;
  ro.drafter = drafter;
  ro.max_num_seqs = drafter ? drafter_runner_seqs(max_seqs, *cfg) : max_seqs;
  if (host_blocks > 0) {
    auto probe = load_cpu_runner(model_dir(), ro);
    EXPECT_TRUE(probe.ok());
    int64_t latent_block = 0;
    for (const auto& g : (*probe)->cache_groups())
      if (g.name == "latent") latent_block = g.bytes_per_token * g.page_tokens;
    ro.hisparse.enabled = true;
    ro.hisparse.host_pool_bytes = latent_block * host_blocks;
    ro.hisparse.hot_slots_per_request = hot_slots;
  }
  auto r = load_cpu_runner(model_dir(), ro);
  EXPECT_TRUE(r.ok()) << r.status().message();
  if (!r.ok()) return nullptr;
  if (host_blocks > 0) {
    for (const auto& g : (*r)->cache_groups()) {
      if (g.sliding_window == 0) {
        EXPECT_EQ(g.num_blocks, host_blocks) << g.name;
      }
    }
  }
  return std::move(r).value();
}

EngineConfig config(int seqs, int64_t budget, int drafts) {
  EngineConfig c;
  c.scheduler.max_num_seqs = seqs;
  c.scheduler.max_num_batched_tokens = budget;
  c.scheduler.max_model_len = 1024;
  c.enable_prefix_caching = true;
  if (drafts > 0) {
    c.speculative.method = "dspark";
    c.speculative.num_speculative_tokens = drafts;
  }
  return c;
}

std::vector<std::vector<int32_t>> prompts(int n, uint32_t seed, int min_len, int max_len) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> ps;
  std::vector<int32_t> shared;  // a common prefix for prefix-cache hits
  for (int k = 0; k < 128; ++k) shared.push_back(3 + static_cast<int32_t>(rng() % 500));
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p = i % 3 == 0 ? shared : std::vector<int32_t>{};
    const int len = min_len + static_cast<int>(rng() % (max_len - min_len + 1));
    while (static_cast<int>(p.size()) < len) p.push_back(3 + static_cast<int32_t>(rng() % 500));
    ps.push_back(p);
  }
  return ps;
}

std::map<std::string, std::vector<int32_t>> drain(Engine& e) {
  std::map<std::string, std::vector<int32_t>> out;
  for (int i = 0; i < 50000 && e.has_work(); ++i) {
    auto r = e.step();
    EXPECT_TRUE(r.ok()) << r.status().message();
    if (!r.ok()) break;
    for (auto& o : r.value()) out[o.request_id].insert(out[o.request_id].end(), o.new_tokens.begin(), o.new_tokens.end());
  }
  return out;
}

std::map<std::string, std::vector<int32_t>> run(ModelRunner* runner, const EngineConfig& c,
                                                const std::vector<std::vector<int32_t>>& ps, int max_tokens,
                                                int64_t* preemptions = nullptr) {
  ByteTextCodec codec(2000);
  Engine e(runner, &codec, c);
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_TRUE(e.add_request("r" + std::to_string(i), ps[i], testing::greedy(max_tokens)).ok());
  auto out = drain(e);
  if (preemptions != nullptr) *preemptions = e.counters().preemptions;
  for (int g = 0; g < e.blocks().num_groups(); ++g)
    EXPECT_EQ(e.blocks().num_free_blocks(g), e.blocks().num_total_blocks(g)) << "group " << g;
  return out;
}

void expect_no_hot_state(const ModelRunner& r) {
  ASSERT_NE(r.hisparse(), nullptr);
  EXPECT_EQ(r.hisparse()->regions_in_use(), 0);
  EXPECT_EQ(r.hisparse()->resident_rows(), 0);
}

TEST(HiSparseEngine, GreedyEqualsWithoutOffloadUnderPreemption) {
  const auto ps = prompts(12, 1, 150, 350);
  auto plain = load(0, 0, false, 6);
  auto hs = load(14, 32, false, 6);
  ASSERT_TRUE(plain && hs);
  const auto want = run(plain.get(), config(6, 256, 0), ps, 24);
  int64_t preemptions = 0;
  const auto got = run(hs.get(), config(6, 256, 0), ps, 24, &preemptions);
  EXPECT_GT(preemptions, 0);  // 14 blocks = 896 tokens for 6 requests of 150..374
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [id, toks] : want) EXPECT_EQ(got.at(id), toks) << id;
  const HiSparseState& st = *hs->hisparse();
  EXPECT_GT(st.hot_layers, 0);
  EXPECT_GT(st.loads, 0);
  std::printf("HiSparse engine: %lld preemptions, %lld hot layer-steps, %lld direct, %lld rows loaded, %lld hits\n",
              static_cast<long long>(preemptions), static_cast<long long>(st.hot_layers),
              static_cast<long long>(st.direct_layers), static_cast<long long>(st.loads),
              static_cast<long long>(st.hits));
  expect_no_hot_state(*hs);
}

TEST(HiSparseEngine, SpeculationIsLosslessAndRollsBackHotRows) {
  const auto ps = prompts(8, 2, 100, 300);
  auto plain = load(0, 0, false, 4);
  auto hs = load(64, 64, true, 4);  // a 4-token verify block selects at most 4 x 16 rows
  ASSERT_TRUE(plain && hs);
  const auto want = run(plain.get(), config(4, 512, 0), ps, 32);
  const auto got = run(hs.get(), config(4, 512, 3), ps, 32);
  for (const auto& [id, toks] : want) EXPECT_EQ(got.at(id), toks) << id;
  EXPECT_GT(hs->hisparse()->hot_layers, 0);
  expect_no_hot_state(*hs);
}

TEST(HiSparseEngine, MixedLoadWithAbortsLeavesNothingBehind) {
  auto hs = load(40, 24, false, 8);
  ASSERT_TRUE(hs);
  ByteTextCodec codec(2000);
  Engine e(hs.get(), &codec, config(8, 192, 0));
  std::mt19937 rng(9);
  auto aborted = testing::run_with_aborts(e, 80, 12, 30, rng, [&] {
    std::vector<int32_t> p;
    const int len = 20 + static_cast<int>(rng() % 300);
    for (int k = 0; k < len; ++k) p.push_back(3 + static_cast<int32_t>(rng() % 500));
    return std::make_pair(p, testing::greedy(1 + static_cast<int>(rng() % 40)));
  });
  ASSERT_TRUE(aborted.ok()) << aborted.status().message();
  EXPECT_GT(*aborted, 0);
  EXPECT_GT(hs->hisparse()->hot_layers, 0);
  for (int g = 0; g < e.blocks().num_groups(); ++g) EXPECT_EQ(e.blocks().num_free_blocks(g), e.blocks().num_total_blocks(g));
  ASSERT_TRUE(e.blocks().check_invariants().ok());
  expect_no_hot_state(*hs);
}

}  // namespace
}  // namespace ml4
