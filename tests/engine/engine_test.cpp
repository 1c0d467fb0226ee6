// Engine invariants on the FakeRunner (tests/engine/fake_runner.h), whose logits depend on
// the token history read back through the block tables: a wrong table, a stale block or a
// bad prefix hit changes the output or fails the step.
//   - greedy output alone == in a batch of 32 (with chunked prefill and a small budget);
//   - prefix-cache hit == miss;
//   - the token budget and max_num_seqs are never exceeded;
//   - no leaked blocks after completion, abort and preemption (free count back to start);
//   - outputs under preemption == outputs without it.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/fake_runner.h"

namespace ml4 {
namespace {

using testing::FakeRunner;
constexpr int kVocab = 1300;

std::vector<int32_t> random_prompt(std::mt19937& rng, int len) {
  std::uniform_int_distribution<int32_t> d(3, kVocab - 1);
  std::vector<int32_t> p(len);
  for (auto& t : p) t = d(rng);
  return p;
}

struct RunResult {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, std::string> text;
  std::map<std::string, RequestOutput> last;
};

// Steps until idle, collecting outputs; fails the test on a step error.
RunResult drain(Engine& e, int max_steps = 100000) {
  RunResult run;
  for (int i = 0; i < max_steps && e.has_work(); ++i) {
    auto r = e.step();
    EXPECT_TRUE(r.ok()) << r.status().message();
    if (!r.ok()) break;
    for (auto& o : r.value()) {
      auto& t = run.tokens[o.request_id];
      t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
      run.text[o.request_id] += o.new_text;
      run.last[o.request_id] = o;
    }
  }
  EXPECT_FALSE(e.has_work());
  return run;
}

using testing::greedy;

EngineConfig config(int max_seqs, int64_t budget, bool prefix = true) {
  EngineConfig c;
  c.scheduler.max_num_seqs = max_seqs;
  c.scheduler.max_num_batched_tokens = budget;
  c.scheduler.max_model_len = 512;
  c.enable_prefix_caching = prefix;
  return c;
}

TEST(Engine, GreedyAloneEqualsBatchOf32) {
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 32; ++i) prompts.push_back(random_prompt(rng, 5 + (i * 7) % 60));
  ByteTextCodec codec(kVocab);

  std::map<std::string, std::vector<int32_t>> alone;
  for (int i = 0; i < 32; ++i) {
    FakeRunner runner(kVocab, FakeRunner::two_groups(512));
    Engine e(&runner, &codec, config(1, 64, false));
    ASSERT_TRUE(e.add_request("r" + std::to_string(i), prompts[i], greedy(12)).ok());
    alone["r" + std::to_string(i)] = drain(e).tokens["r" + std::to_string(i)];
    ASSERT_EQ(alone["r" + std::to_string(i)].size(), 12u);
  }
  FakeRunner runner(kVocab, FakeRunner::two_groups(512));
  Engine e(&runner, &codec, config(32, 96));
  int64_t max_seen = 0;
  size_t max_seqs = 0;
  e.set_step_hook([&](const SchedulerOutput& so, const StepInput& in) {
    int64_t n = 0;
    for (const auto& s : in.seqs) n += static_cast<int64_t>(s.tokens.size());
    EXPECT_EQ(n, so.num_batched_tokens);
    max_seen = std::max(max_seen, n);
    max_seqs = std::max(max_seqs, in.seqs.size());
  });
  for (int i = 0; i < 32; ++i) ASSERT_TRUE(e.add_request("r" + std::to_string(i), prompts[i], greedy(12)).ok());
  RunResult batched = drain(e);
  for (const auto& [id, toks] : alone) EXPECT_EQ(batched.tokens[id], toks) << id;
  EXPECT_LE(max_seen, 96);  // the budget
  EXPECT_EQ(max_seen, 96);  // and it was actually reached (chunked prefill filled it)
  EXPECT_GT(max_seqs, 16u); // really batched
}

TEST(Engine, PrefixHitEqualsMiss) {
  std::mt19937 rng(11);
  ByteTextCodec codec(kVocab);
  auto shared = random_prompt(rng, 40);  // 10 full pages of 4
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    auto p = shared;
    auto tail = random_prompt(rng, 1 + i * 3);
    p.insert(p.end(), tail.begin(), tail.end());
    prompts.push_back(p);
  }
  prompts.push_back(shared);  // a prompt that is entirely cached: one token must still run

  FakeRunner r_miss(kVocab, FakeRunner::two_groups(256));
  Engine miss(&r_miss, &codec, config(8, 64, false));
  FakeRunner r_hit(kVocab, FakeRunner::two_groups(256));
  Engine hit(&r_hit, &codec, config(8, 64, true));
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::string id = "p" + std::to_string(i);
    ASSERT_TRUE(miss.add_request(id, prompts[i], greedy(9)).ok());
    ASSERT_TRUE(hit.add_request(id, prompts[i], greedy(9)).ok());
    // One at a time, so each later request can hit the earlier ones' blocks.
    RunResult a = drain(miss), b = drain(hit);
    EXPECT_EQ(a.tokens[id], b.tokens[id]) << id;
    EXPECT_EQ(a.last[id].cached_tokens, 0);
    if (i > 0) EXPECT_GE(b.last[id].cached_tokens, 36) << id;  // 9+ of the 10 shared pages
  }
  EXPECT_GT(hit.counters().prefix_hits, 0);
  EXPECT_EQ(miss.counters().prefix_hits, 0);
  ASSERT_TRUE(hit.blocks().check_invariants().ok());
}

TEST(Engine, NoLeaksAfterCompletionAbortAndPreemption) {
  std::mt19937 rng(3);
  ByteTextCodec codec(kVocab);
  // 48 blocks of 4 tokens per group: far less than 24 requests need, so it must preempt.
  FakeRunner runner(kVocab, FakeRunner::two_groups(48));
  Engine e(&runner, &codec, config(16, 40));
  const int64_t free0 = e.blocks().num_free_blocks_total();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 24; ++i) {
    prompts.push_back(random_prompt(rng, 6 + i % 20));
    ASSERT_TRUE(e.add_request("q" + std::to_string(i), prompts.back(), greedy(10 + i % 7)).ok());
  }
  RunResult run;
  int step = 0;
  while (e.has_work()) {
    if (step == 3) EXPECT_TRUE(e.abort("q5"));
    if (step == 9) EXPECT_TRUE(e.abort("q17"));
    auto r = e.step();
    ASSERT_TRUE(r.ok()) << r.status().message();
    for (auto& o : r.value()) {
      auto& t = run.tokens[o.request_id];
      t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
    ASSERT_TRUE(e.blocks().check_invariants().ok());
    ASSERT_LT(++step, 10000);
  }
  EXPECT_GT(e.counters().preemptions, 0);
  EXPECT_FALSE(e.abort("q5"));  // already gone
  EXPECT_EQ(e.blocks().num_free_blocks_total(), free0);
  EXPECT_EQ(e.num_live(), 0u);
  // Preemption by recompute is invisible in the output: compare with each request alone.
  for (int i = 0; i < 24; ++i) {
    if (i == 5 || i == 17) continue;
    FakeRunner r1(kVocab, FakeRunner::two_groups(64));
    Engine alone(&r1, &codec, config(1, 40, false));
    std::string id = "q" + std::to_string(i);
    ASSERT_TRUE(alone.add_request(id, prompts[i], greedy(10 + i % 7)).ok());
    EXPECT_EQ(drain(alone).tokens[id], run.tokens[id]) << id;
  }
}

TEST(Engine, StopStringsIdsAndLengths) {
  ByteTextCodec codec(kVocab);
  FakeRunner runner(kVocab, FakeRunner::two_groups(128));
  Engine e(&runner, &codec, config(4, 64));
  std::mt19937 rng(5);
  auto prompt = random_prompt(rng, 10);
  // Find what greedy produces, then ask it to stop on a piece of that.
  ASSERT_TRUE(e.add_request("base", prompt, greedy(20)).ok());
  RunResult base = drain(e);
  const auto& toks = base.tokens["base"];
  ASSERT_EQ(toks.size(), 20u);
  EXPECT_EQ(base.last["base"].finish_reason, FinishReason::kLength);

  SamplingParams p = greedy(20);
  p.stop_token_ids = {toks[6]};
  ASSERT_TRUE(e.add_request("ids", prompt, p).ok());
  RunResult r = drain(e);
  size_t first = std::find(toks.begin(), toks.end(), toks[6]) - toks.begin();
  EXPECT_EQ(r.tokens["ids"].size(), first + 1);
  EXPECT_EQ(r.last["ids"].finish_reason, FinishReason::kStop);

  SamplingParams q = greedy(20);
  // A stop string that is the text of output tokens 8..9, when they are plain bytes.
  std::string s8 = codec.token_bytes(toks[8]) + codec.token_bytes(toks[9]);
  if (!codec.is_special(toks[8]) && !codec.is_special(toks[9]) && (static_cast<unsigned char>(s8[0]) < 0x80)) {
    q.stop = {s8};
    ASSERT_TRUE(e.add_request("str", prompt, q).ok());
    RunResult s = drain(e);
    EXPECT_EQ(s.last["str"].finish_reason, FinishReason::kStop);
    EXPECT_EQ(s.last["str"].stop_reason, s8);
    EXPECT_EQ(s.text["str"].find(s8), std::string::npos);  // excluded, never streamed
  }
  EXPECT_EQ(e.blocks().num_free_blocks_total(), 2 * 128);
}

TEST(Engine, PriorityThenArrivalOrder) {
  ByteTextCodec codec(kVocab);
  FakeRunner runner(kVocab, FakeRunner::two_groups(128));
  Engine e(&runner, &codec, config(1, 64));  // one sequence at a time: finish order = schedule order
  std::mt19937 rng(2);
  ASSERT_TRUE(e.add_request("low", random_prompt(rng, 9), greedy(3), /*priority=*/5).ok());
  ASSERT_TRUE(e.add_request("normal-1", random_prompt(rng, 9), greedy(3), 0).ok());
  ASSERT_TRUE(e.add_request("urgent", random_prompt(rng, 9), greedy(3), -1).ok());
  ASSERT_TRUE(e.add_request("normal-2", random_prompt(rng, 9), greedy(3), 0).ok());
  std::vector<std::string> order;
  while (e.has_work()) {
    auto r = e.step();
    ASSERT_TRUE(r.ok());
    for (auto& o : r.value())
      if (o.finished) order.push_back(o.request_id);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"urgent", "normal-1", "normal-2", "low"}));
}

TEST(Engine, RejectsBadRequests) {
  ByteTextCodec codec(kVocab);
  FakeRunner runner(kVocab, FakeRunner::two_groups(64));
  Engine e(&runner, &codec, config(4, 64));
  EXPECT_EQ(e.max_model_len(), 256);  // bounded by the cache: 64 blocks x 4 tokens
  EXPECT_FALSE(e.add_request("a", {}, greedy(4)).ok());
  EXPECT_FALSE(e.add_request("a", {5, kVocab}, greedy(4)).ok());
  EXPECT_FALSE(e.add_request("a", std::vector<int32_t>(250, 7), greedy(10)).ok());
  SamplingParams bad = greedy(4);
  bad.top_p = 0.0;
  EXPECT_FALSE(e.add_request("a", {5}, bad).ok());
  ASSERT_TRUE(e.add_request("a", {5}, greedy(4)).ok());
  EXPECT_FALSE(e.add_request("a", {5}, greedy(4)).ok());  // duplicate id
  drain(e);
}

// A positive temperature below SamplingParams::kGreedyBelow (vLLM's _SAMPLING_EPS, 1e-5) is
// greedy: the same tokens as temperature 0, and no step fails (7.18e-233, found by the server's
// fuzz test, overflowed the f32 logits / T to inf and the NaN step stopped the engine). Just
// above the threshold the request samples normally, without a step error.
TEST(Engine, TinyTemperatureIsGreedy) {
  ByteTextCodec codec(kVocab);
  std::mt19937 rng(3);
  const std::vector<int32_t> prompt = random_prompt(rng, 20);
  FakeRunner runner(kVocab, FakeRunner::two_groups(512));
  Engine e(&runner, &codec, config(8, 64));
  const double temps[] = {0.0, 7.18503611641747e-233, 1e-300, 9.9e-6, 2e-5};
  for (size_t i = 0; i < 5; ++i) {
    SamplingParams p = greedy(16);
    p.temperature = temps[i];
    p.seed = 11;
    ASSERT_TRUE(e.add_request("t" + std::to_string(i), prompt, p).ok());
  }
  RunResult r = drain(e);
  ASSERT_EQ(r.tokens["t0"].size(), 16u);
  for (int i = 1; i <= 3; ++i) EXPECT_EQ(r.tokens["t" + std::to_string(i)], r.tokens["t0"]) << "temperature " << temps[i];
  EXPECT_EQ(r.tokens["t4"].size(), 16u);
}

}  // namespace
}  // namespace ml4

namespace ml4 {
namespace {

// A drafter-like sliding-window group (window 8, page 4) with far fewer blocks than the
// sequences' lengths: blocks behind the window are released every step, so the requests
// run to the end, give the same tokens as without the group, and leak nothing.
TEST(Engine, SlidingWindowGroupKeepsOnlyTheWindow) {
  ByteTextCodec codec(kVocab);
  std::mt19937 rng(21);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(random_prompt(rng, 10 + 3 * i));
  auto groups = FakeRunner::two_groups(256);
  groups.push_back({"drafter", 4, 24, 8, 100});
  FakeRunner windowed(kVocab, groups);
  Engine e(&windowed, &codec, config(4, 16));  // 16-token chunks: a chunk needs <= 7 window blocks
  const int64_t free0 = e.blocks().num_free_blocks(2);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e.add_request("w" + std::to_string(i), prompts[i], greedy(40)).ok());
  int64_t max_used = 0;
  std::map<std::string, std::vector<int32_t>> got;
  while (e.has_work()) {
    auto r = e.step();
    ASSERT_TRUE(r.ok()) << r.status().message();
    for (auto& o : r.value()) got[o.request_id].insert(got[o.request_id].end(), o.new_tokens.begin(), o.new_tokens.end());
    max_used = std::max(max_used, free0 - e.blocks().num_free_blocks(2));
    ASSERT_TRUE(e.blocks().check_invariants().ok());
  }
  EXPECT_EQ(e.blocks().num_free_blocks(2), free0);
  EXPECT_LE(max_used, 24);
  // Holding every block would need 4 x 15 > 24 and force preemptions; releasing needs none.
  EXPECT_EQ(e.counters().preemptions, 0);
  for (int i = 0; i < 4; ++i) {
    FakeRunner plain(kVocab, FakeRunner::two_groups(256));
    Engine ref(&plain, &codec, config(1, 64, false));
    std::string id = "w" + std::to_string(i);
    ASSERT_TRUE(ref.add_request(id, prompts[i], greedy(40)).ok());
    EXPECT_EQ(got[id], drain(ref).tokens[id]) << id;
    EXPECT_EQ(got[id].size(), 40u);
  }
}

}  // namespace
}  // namespace ml4
