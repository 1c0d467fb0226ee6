// P/D in one process, through the engine hooks and real UCX: a producer engine (CPU runner,
// ml4-tiny) prefills with do_remote_decode and holds its blocks; a consumer engine loads
// them and decodes. The consumer's tokens equal a colocated engine's (greedy and seeded
// sampling, prompts within one block, on block edges and over several blocks); a second
// request for a known prompt reads only what the consumer's prefix cache lacks; an abort
// while loading frees the consumer's blocks only once the reads settle and releases the
// producer's hold; a failed load fails its request with the connector's error, never a
// local prefill. Every block is back in both pools at the end.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "engine/engine.h"
#include "model/random_checkpoint.h"
#include "runtime/cpu/cpu_runner.h"
#include "transfer/kv_connector.h"

namespace ml4 {
namespace {

#if defined(ML4_WITH_UCX)

const std::string& pd_model_dir() {
  static const std::string dir = [] {
    std::string d = (std::filesystem::temp_directory_path() / ("ml4_pd_tiny_" + std::to_string(::getpid()))).string();
    MakeModelOptions o;
    o.preset = "ml4-tiny";
    o.out_dir = d;
    o.seed = 3;
    o.weight_dtype = "bf16";
    Status s = make_model(o);
    EXPECT_TRUE(s.ok()) << s.message();
    return d;
  }();
  return dir;
}

struct PdEnv : ::testing::Environment {
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(pd_model_dir(), ec);
  }
};
const auto* const kPdEnv = ::testing::AddGlobalTestEnvironment(new PdEnv);

std::unique_ptr<ModelRunner> load_runner() {
  RunnerOptions ro;
  ro.kv_cache_bytes = 48ll << 20;
  auto r = load_cpu_runner(pd_model_dir(), ro);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : nullptr;
}

EngineConfig engine_config() {
  EngineConfig c;
  c.scheduler.max_num_seqs = 16;
  c.scheduler.max_num_batched_tokens = 512;
  c.scheduler.max_model_len = 1024;
  return c;
}

struct Side {
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<transfer::KvConnector> connector;
  std::unique_ptr<Engine> engine;
};

Side make_side(const char* role, const std::string& id, const ByteTextCodec& codec, double timeout_s = 30.0,
               int delay_ms = 0) {
  Side s;
  s.runner = load_runner();
  transfer::KvTransferConfig c;
  c.kv_role = role;
  c.engine_id = id;
  c.timeout_s = timeout_s;
  c.load_delay_ms = delay_ms;
  auto made = transfer::KvConnector::create(c, s.runner->kv_regions(), s.runner->cache_groups());
  EXPECT_TRUE(made.ok()) << made.status().message();
  s.connector = std::move(made).value();
  s.engine = std::make_unique<Engine>(s.runner.get(), &codec, engine_config());
  s.engine->set_kv_connector(s.connector.get());
  return s;
}

// Steps until nothing is left to do; returns outputs by request. A consumer also waits for
// its loads (and aborted loads) to settle; a producer's holds are not waited for (they last
// until a consumer reads them): settle() polls those.
std::map<std::string, std::vector<RequestOutput>> drain(Engine& e) {
  std::map<std::string, std::vector<RequestOutput>> out;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  const bool producer = e.kv_connector() != nullptr && e.kv_connector()->producer();
  while ((e.has_work() || (!producer && e.kv_active())) && std::chrono::steady_clock::now() < end) {
    auto r = e.step();
    EXPECT_TRUE(r.ok()) << r.status().message();
    if (!r.ok()) break;
    for (auto& o : r.value()) out[o.request_id].push_back(o);
    if (!e.has_work()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return out;
}

// Producer: steps (polling the connector) until no block is held for a consumer.
void settle(Engine& e, double limit_s = 10.0) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
  while (e.num_blocks_held_for_remote() > 0 && std::chrono::steady_clock::now() < end) {
    EXPECT_TRUE(e.step().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::vector<int32_t> tokens_of(const std::vector<RequestOutput>& outs) {
  std::vector<int32_t> t;
  for (const auto& o : outs) t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
  return t;
}

void expect_pools_whole(const Engine& e) {
  for (int g = 0; g < e.blocks().num_groups(); ++g)
    EXPECT_EQ(e.blocks().num_free_blocks(g), e.blocks().num_total_blocks(g)) << "group " << g;
  EXPECT_TRUE(e.blocks().check_invariants().ok());
  EXPECT_EQ(e.num_blocks_held_for_remote(), 0);
}

std::string unique(const char* base) {
  static std::mt19937_64 rng(std::random_device{}());
  return fmt::format("{}-{}", base, rng() % 1000000000);
}

TEST(PdEngine, ConsumerOutputEqualsColocatedAndReadsOnlyWhatItLacks) {
  ByteTextCodec codec(2000);
  Side prod = make_side("kv_producer", unique("prefill"), codec);
  Side cons = make_side("kv_consumer", unique("decode"), codec);
  ASSERT_TRUE(prod.engine && cons.engine);
  auto colocated_runner = load_runner();
  Engine colocated(colocated_runner.get(), &codec, engine_config());
  ASSERT_TRUE(cons.connector->load_peer(prod.connector->metadata()).ok());

  std::mt19937 rng(std::random_device{}());
  const int V = prod.runner->config().vocab_size;
  const int lengths[] = {1, 5, 63, 64, 65, 128, 200, 300};
  int64_t blocks_before = 0;
  std::vector<std::vector<int32_t>> prompts;
  for (int len : lengths) {
    std::vector<int32_t> p;
    for (int k = 0; k < len; ++k) p.push_back(3 + static_cast<int32_t>(rng() % (V - 3)));
    prompts.push_back(p);
  }
  for (int round = 0; round < 2; ++round) {  // round 1: same prompts, the consumer's cache has them
    for (size_t i = 0; i < prompts.size(); ++i) {
      SamplingParams sp;
      sp.max_tokens = 12;
      sp.ignore_eos = true;
      if (i % 2 == 0) sp.temperature = 0;  // greedy
      else sp.seed = rng();                 // seeded sampling
      const std::string id = fmt::format("r{}-{}", round, i);
      SamplingParams pre = sp;
      pre.max_tokens = 1;
      transfer::KvTransferRequest produce;
      produce.do_remote_decode = true;
      Status added = prod.engine->add_request(id, prompts[i], pre, 0, 0.0, produce);
      ASSERT_TRUE(added.ok()) << added.message();
      auto pout = drain(*prod.engine);
      ASSERT_EQ(pout[id].size(), 1u);
      ASSERT_TRUE(pout[id].back().kv_source.has_value());
      const transfer::RemoteKvSource src = *pout[id].back().kv_source;
      EXPECT_EQ(src.num_tokens, static_cast<int64_t>(prompts[i].size()));
      EXPECT_GT(prod.engine->num_blocks_held_for_remote(), 0);

      transfer::KvTransferRequest consume;
      consume.remote_prefill = src;
      ASSERT_TRUE(cons.engine->add_request(id, prompts[i], sp, 0, 0.0, consume).ok());
      auto cout = drain(*cons.engine);
      ASSERT_FALSE(cout[id].empty());
      EXPECT_EQ(cout[id].back().finish_reason, FinishReason::kLength) << cout[id].back().error;
      ASSERT_TRUE(colocated.add_request(id, prompts[i], sp).ok());
      auto ref = drain(colocated);
      EXPECT_EQ(tokens_of(cout[id]), tokens_of(ref[id])) << "prompt of " << prompts[i].size() << " tokens, "
                                                         << (i % 2 == 0 ? "greedy" : "seeded");
      settle(*prod.engine);  // the consumer's "done" released the hold
      EXPECT_EQ(prod.engine->num_blocks_held_for_remote(), 0);
    }
    const int64_t blocks = cons.connector->stats().blocks;
    if (round == 0) {
      // All but the last prompt token's blocks, both groups: sum of ceil((n-1)/64) * 2.
      int64_t want = 0;
      for (int len : lengths) want += 2 * ((len - 1 + 63) / 64);
      EXPECT_EQ(blocks, want);
      blocks_before = blocks;
    } else {
      // The consumer's prefix cache holds every full block: only the partial tail block
      // (if any) of each prompt but its last token is read again.
      int64_t want = 0;
      for (int len : lengths) want += 2 * ((len - 1 + 63) / 64 - (len - 1) / 64);
      EXPECT_EQ(blocks - blocks_before, want);
    }
  }
  const auto cs = cons.connector->stats();
  EXPECT_EQ(cs.failures, 0);
  EXPECT_EQ(cs.transfers_ok, 2 * static_cast<int64_t>(std::size(lengths)));
  expect_pools_whole(*prod.engine);
  expect_pools_whole(*cons.engine);
}

TEST(PdEngine, AbortWhileLoadingAndFailedLoads) {
  ByteTextCodec codec(2000);
  Side prod = make_side("kv_producer", unique("prefill"), codec, 30.0);
  Side cons = make_side("kv_consumer", unique("decode"), codec, 30.0, 300);  // loads wait 300 ms
  ASSERT_TRUE(prod.engine && cons.engine);
  ASSERT_TRUE(cons.connector->load_peer(prod.connector->metadata()).ok());
  std::vector<int32_t> prompt;
  const int V = prod.runner->config().vocab_size;
  for (int k = 0; k < 150; ++k) prompt.push_back(3 + (k * 37) % (V - 3));
  SamplingParams one;
  one.max_tokens = 1;
  transfer::KvTransferRequest produce;
  produce.do_remote_decode = true;

  // Abort during the load: the consumer keeps the blocks until the load settles, the
  // producer hears of it and frees at once.
  ASSERT_TRUE(prod.engine->add_request("a", prompt, one, 0, 0.0, produce).ok());
  auto src = drain(*prod.engine)["a"].back().kv_source;
  ASSERT_TRUE(src);
  transfer::KvTransferRequest consume;
  consume.remote_prefill = *src;
  SamplingParams sp;
  sp.max_tokens = 8;
  ASSERT_TRUE(cons.engine->add_request("a", prompt, sp, 0, 0.0, consume).ok());
  ASSERT_TRUE(cons.engine->step().ok());  // admitted for loading
  EXPECT_EQ(cons.engine->num_loading(), 1u);
  EXPECT_LT(cons.engine->blocks().num_free_blocks(0), cons.engine->blocks().num_total_blocks(0));
  ASSERT_TRUE(cons.engine->abort("a"));
  drain(*cons.engine);
  settle(*prod.engine);
  expect_pools_whole(*cons.engine);
  expect_pools_whole(*prod.engine);
  EXPECT_EQ(prod.connector->stats().holds_released, 1);
  EXPECT_EQ(prod.connector->stats().expired, 0);

  // A load from a producer that no longer holds the blocks fails the request with the
  // reason; the prompt is not computed locally.
  ASSERT_TRUE(prod.engine->add_request("b", prompt, one, 0, 0.0, produce).ok());
  src = drain(*prod.engine)["b"].back().kv_source;
  ASSERT_TRUE(src);
  consume.remote_prefill = *src;
  // The hold goes away before this consumer reads (as by the producer's timeout): another
  // consumer aborts it.
  Side other = make_side("kv_consumer", unique("decode2"), codec);
  ASSERT_TRUE(other.connector->load_peer(prod.connector->metadata()).ok());
  other.connector->release_remote(*src);
  settle(*prod.engine);
  ASSERT_EQ(prod.engine->num_blocks_held_for_remote(), 0);
  const int64_t steps_before = cons.engine->counters().batched_tokens;
  ASSERT_TRUE(cons.engine->add_request("b", prompt, sp, 0, 0.0, consume).ok());
  auto out = drain(*cons.engine);
  ASSERT_FALSE(out["b"].empty());
  EXPECT_EQ(out["b"].back().finish_reason, FinishReason::kError);
  EXPECT_NE(out["b"].back().error.find("already freed"), std::string::npos) << out["b"].back().error;
  EXPECT_TRUE(out["b"].back().new_tokens.empty());
  EXPECT_EQ(cons.engine->counters().batched_tokens, steps_before);  // no local prefill ran
  EXPECT_EQ(cons.connector->stats().failures, 1);
  expect_pools_whole(*cons.engine);
  expect_pools_whole(*prod.engine);

  // Params that do not match the prompt are refused before anything is allocated.
  auto bad = *src;
  bad.num_tokens += 1;
  transfer::KvTransferRequest wrong;
  wrong.remote_prefill = bad;
  Status st = cons.engine->add_request("c", prompt, sp, 0, 0.0, wrong);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("prompt tokens"), std::string::npos) << st.message();
  bad = *src;
  bad.prompt_hash ^= 1;
  wrong.remote_prefill = bad;
  st = cons.engine->add_request("c", prompt, sp, 0, 0.0, wrong);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("different prompt"), std::string::npos) << st.message();
  // A server without a connector refuses P/D params.
  auto plain_runner = load_runner();
  Engine plain(plain_runner.get(), &codec, engine_config());
  st = plain.add_request("d", prompt, one, 0, 0.0, produce);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("kv_producer"), std::string::npos) << st.message();
}

#else

TEST(PdEngine, ConnectorRefusedWithoutUcx) {
  transfer::KvTransferConfig c;
  c.kv_role = "kv_consumer";
  auto made = transfer::KvConnector::create(c, {}, {});
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("without"), std::string::npos) << made.status().message();
}

#endif

}  // namespace
}  // namespace ml4
