// The engine invariants again, on the real CPU runner with ml4-tiny (random weights, seed 0):
// greedy output alone == in a batch of 32 (chunked prefill, mixed prefill/decode steps);
// prefix-cache hit == miss; preemption by recompute with a small cache changes nothing and
// leaks nothing. The runner's logits depend on the paged latent and indexer caches, so a
// wrong block table or a bad prefix reuse shows up as a different token.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "model/random_checkpoint.h"
#include "runtime/cpu/cpu_runner.h"

namespace ml4 {
namespace {

const std::string& tiny_model_dir() {
  static const std::string dir = [] {
    std::string d = (std::filesystem::temp_directory_path() / ("ml4_engine_tiny_" + std::to_string(::getpid()))).string();
    MakeModelOptions o;
    o.preset = "ml4-tiny";
    o.out_dir = d;
    o.seed = 0;
    Status s = make_model(o);
    EXPECT_TRUE(s.ok()) << s.message();
    return d;
  }();
  return dir;
}

struct TinyEnv : ::testing::Environment {
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(tiny_model_dir(), ec);
  }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new TinyEnv);

std::unique_ptr<ModelRunner> load(int64_t kv_bytes) {
  RunnerOptions ro;
  ro.kv_cache_bytes = kv_bytes;
  auto r = load_cpu_runner(tiny_model_dir(), ro);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : nullptr;
}

std::map<std::string, std::vector<int32_t>> drain(Engine& e) {
  std::map<std::string, std::vector<int32_t>> out;
  for (int i = 0; i < 20000 && e.has_work(); ++i) {
    auto r = e.step();
    EXPECT_TRUE(r.ok()) << r.status().message();
    if (!r.ok()) break;
    for (auto& o : r.value()) out[o.request_id].insert(out[o.request_id].end(), o.new_tokens.begin(), o.new_tokens.end());
  }
  return out;
}

using testing::greedy;

EngineConfig config(int seqs, int64_t budget, bool prefix) {
  EngineConfig c;
  c.scheduler.max_num_seqs = seqs;
  c.scheduler.max_num_batched_tokens = budget;
  c.scheduler.max_model_len = 1024;
  c.enable_prefix_caching = prefix;
  return c;
}

std::vector<std::vector<int32_t>> prompts(int n, uint32_t seed, int min_len, int max_len) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p{1};
    int len = min_len + static_cast<int>(rng() % (max_len - min_len + 1));
    for (int k = 0; k < len; ++k) p.push_back(256 + static_cast<int32_t>(rng() % 256));
    ps.push_back(p);
  }
  return ps;
}

TEST(CpuEngine, GreedyAloneEqualsBatchOf32) {
  auto runner = load(64ll << 20);
  ASSERT_TRUE(runner);
  ByteTextCodec codec(2000);  // the engine uses it only for EOS/stop text; ids are raw
  auto ps = prompts(32, 1, 4, 60);
  std::map<std::string, std::vector<int32_t>> alone;
  {
    Engine e(runner.get(), &codec, config(1, 4096, false));
    for (int i = 0; i < 32; ++i) {
      ASSERT_TRUE(e.add_request("r" + std::to_string(i), ps[i], greedy(6)).ok());
      auto out = drain(e);
      alone.insert(out.begin(), out.end());
    }
  }
  Engine e(runner.get(), &codec, config(32, 160, false));
  int64_t max_tokens = 0;
  e.set_step_hook([&](const SchedulerOutput& so, const StepInput&) { max_tokens = std::max(max_tokens, so.num_batched_tokens); });
  for (int i = 0; i < 32; ++i) ASSERT_TRUE(e.add_request("r" + std::to_string(i), ps[i], greedy(6)).ok());
  auto batched = drain(e);
  for (const auto& [id, toks] : alone) {
    EXPECT_EQ(toks.size(), 6u);
    EXPECT_EQ(batched[id], toks) << id;
  }
  EXPECT_LE(max_tokens, 160);
}

TEST(CpuEngine, PrefixHitEqualsMissAndPreemptionLeaksNothing) {
  auto probe = load(64ll << 20);
  ASSERT_TRUE(probe);
  // 8 blocks of 64 tokens per group: 8 requests of 177..198 prompt tokens sharing a 2-block
  // prefix, growing past 192 tokens while decoding, need more than 8 blocks at once, so
  // the scheduler must preempt.
  int64_t block_bytes = 0;
  for (const auto& g : probe->cache_groups())
    if (g.sliding_window == 0) block_bytes += g.bytes_per_token * g.page_tokens;
  probe.reset();
  auto runner = load(block_bytes * 8);
  ASSERT_TRUE(runner);
  ASSERT_EQ(runner->cache_groups()[0].num_blocks, 8);
  ByteTextCodec codec(2000);

  std::mt19937 rng(9);
  std::vector<int32_t> shared{1};
  for (int k = 0; k < 175; ++k) shared.push_back(256 + static_cast<int32_t>(rng() % 256));
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 8; ++i) {
    auto p = shared;
    for (int k = 0; k <= i * 3; ++k) p.push_back(256 + static_cast<int32_t>(rng() % 256));
    ps.push_back(p);
  }
  std::map<std::string, std::vector<int32_t>> miss, hit;
  {
    Engine e(runner.get(), &codec, config(1, 4096, false));
    for (int i = 0; i < 8; ++i) {
      ASSERT_TRUE(e.add_request("p" + std::to_string(i), ps[i], greedy(12)).ok());
      auto o = drain(e);
      miss.insert(o.begin(), o.end());
    }
  }
  Engine e(runner.get(), &codec, config(8, 256, true));
  const int64_t free0 = e.blocks().num_free_blocks_total();
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(e.add_request("p" + std::to_string(i), ps[i], greedy(12)).ok());
  hit = drain(e);
  EXPECT_EQ(hit, miss);
  EXPECT_GT(e.counters().prefix_hits, 0);
  EXPECT_GT(e.counters().preemptions, 0);
  EXPECT_EQ(e.blocks().num_free_blocks_total(), free0);
  EXPECT_TRUE(e.blocks().check_invariants().ok());
}

}  // namespace
}  // namespace ml4
