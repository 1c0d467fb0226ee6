// DSpark speculative decoding in the engine (engine/spec_decode.h) on the FakeRunner playing a
// DSpark runner (tests/engine/fake_runner.h: enable_drafter): its drafts are the target's own
// next tokens under a perturbation, so some are accepted and some not, and draft() fails the
// step when the drafter window's table or context is wrong. Checked:
//   - --speculative-config parsing and the start-up refusals, each naming the problem;
//   - greedy is lossless: token for token (and logprob for logprob) the outputs of an engine
//     without drafts, for a batch of mixed lengths with prefix-cache hits, chunked prefill, a
//     budget that cuts drafts, preemption, aborts and stops inside an accepted run;
//   - sampling is lossless (both draft methods): the joint distribution of 4 sampled tokens on
//     a 5-token vocabulary against the exact one, by a chi-square test (sample count,
//     threshold and power argued at the test);
//   - no leaks after 1,000 mixed requests with aborts; a drafter pool too small to draft for
//     everyone only costs drafts;
//   - requests that cannot speculate (penalties, logit_bias, min_tokens) never carry drafts;
//   - on a runner that samples on its device, steps mixing prompt-logprob chunks, device and
//     host verification, random drafts and top-N logprobs give each request what it gets alone.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <set>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/chi_square.h"
#include "engine/fake_runner.h"
#include "engine/sampling_exact_dist.h"
#include "engine/spec_decode.h"

namespace ml4 {
namespace {

using testing::chi_square;
using testing::ChiSquare;
using testing::FakeRunner;
using testing::gamma_q;

std::vector<int32_t> random_prompt(std::mt19937& rng, int len, int vocab) {
  std::uniform_int_distribution<int32_t> d(3, vocab - 1);
  std::vector<int32_t> p(len);
  for (auto& t : p) t = d(rng);
  return p;
}

struct RunOut {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, std::vector<TokenLogprob>> logprobs;
  std::map<std::string, RequestOutput> last;
};

void collect(RunOut* run, std::vector<RequestOutput>& outs) {
  for (auto& o : outs) {
    auto& t = run->tokens[o.request_id];
    t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
    auto& l = run->logprobs[o.request_id];
    l.insert(l.end(), o.new_logprobs.begin(), o.new_logprobs.end());
    run->last[o.request_id] = o;
  }
}

RunOut drain(Engine& e) {
  RunOut run;
  for (int i = 0; i < 1000000 && e.has_work(); ++i) {
    auto r = e.step();
    EXPECT_TRUE(r.ok()) << r.status().message();
    if (!r.ok()) break;
    collect(&run, r.value());
  }
  EXPECT_FALSE(e.has_work());
  return run;
}

using testing::greedy;

EngineConfig config(int max_seqs, int64_t budget, int drafts, bool probabilistic = false) {
  EngineConfig c;
  c.scheduler.max_num_seqs = max_seqs;
  c.scheduler.max_num_batched_tokens = budget;
  c.scheduler.max_model_len = 512;
  c.seed = 77;
  if (drafts > 0) {
    c.speculative.method = "dspark";
    c.speculative.num_speculative_tokens = drafts;
    c.speculative.probabilistic_drafts = probabilistic;
  }
  return c;
}

// A named request of the mixed-step tests, and a seeded random request's parameters.
struct Req {
  std::string id;
  std::vector<int32_t> prompt;
  SamplingParams params;
};
SamplingParams seeded(double temperature, int max_tokens, uint64_t seed) {
  SamplingParams p;
  p.temperature = temperature;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  p.seed = seed;
  return p;
}

TEST(SpecDecodeConfig, ParsesVllmSpellingAndRefusesBadInput) {
  auto ok = parse_speculative_config(
      R"({"method":"dspark","num_speculative_tokens":7,"draft_sample_method":"probabilistic"})");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->num_speculative_tokens, 7);
  EXPECT_TRUE(ok->probabilistic_drafts);
  auto g = parse_speculative_config(R"({"method":"dspark","num_speculative_tokens":3})");
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(g->probabilistic_drafts);  // vLLM's default draft_sample_method is greedy
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{", "not valid JSON"},
      {"[1]", "must be a JSON object"},
      {R"({"num_speculative_tokens":3})", "'method' is required"},
      {R"({"method":"eagle","num_speculative_tokens":3})", "method 'eagle' is not supported"},
      {R"({"method":"dspark"})", "'num_speculative_tokens' is required"},
      {R"({"method":"dspark","num_speculative_tokens":0})", "must be >= 1"},
      {R"({"method":"dspark","num_speculative_tokens":2.5})", "must be an integer"},
      {R"({"method":"dspark","num_speculative_tokens":2,"draft_sample_method":"topk"})", "\"greedy\" or \"probabilistic\""},
      {R"({"method":"dspark","num_speculative_tokens":2,"model":"/other"})", "'model' must be absent"},
      {R"({"method":"dspark","num_speculative_tokens":2,"num_spec_tokens":2})", "unknown field 'num_spec_tokens'"},
  };
  for (const auto& [text, what] : bad) {
    auto r = parse_speculative_config(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.status().message().find(what), std::string::npos) << text << " -> " << r.status().message();
  }
}

TEST(SpecDecodeConfig, RefusesAModelWithoutDrafterOrTooManyDrafts) {
  FakeRunner plain(64, FakeRunner::two_groups(64));
  EngineConfig c = config(4, 64, 3);
  Status s = Engine::check_speculation(plain, c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no DSpark drafter"), std::string::npos) << s.message();
  ByteTextCodec codec(64);
  Engine e(&plain, &codec, c);  // built anyway: runs without speculation
  EXPECT_FALSE(e.speculative());

  FakeRunner dr(64, FakeRunner::drafter_groups(64, 64, 8));
  dr.enable_drafter(4, 0.0);
  EXPECT_TRUE(Engine::check_speculation(dr, c).ok());
  c.speculative.num_speculative_tokens = 4;  // a block of 4 holds the accepted token + 3 drafts
  s = Engine::check_speculation(dr, c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("exceeds what the drafter proposes per step (3"), std::string::npos) << s.message();
}

// Greedy with drafts == greedy without, through everything the scheduler does.
// device: the runner samples on its device, so greedy requests without top-N logprobs verify
// from each row's device argmax (engine.cpp device_verifiable) while the others, and steps
// mixing them, take the rows to the host.
class SpecDecodeGreedy : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(HostOrDevice, SpecDecodeGreedy, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "DeviceVerification" : "HostVerification"; });

TEST_P(SpecDecodeGreedy, LosslessWithPrefixHitsChunksPreemptionAbortsAndStops) {
  const bool device = GetParam();
  constexpr int V = 1300;
  std::mt19937 rng(2024);
  ByteTextCodec codec(V);
  const auto shared = random_prompt(rng, 24, V);  // 6 pages of 4: prefix-cache hits
  struct Req {
    std::string id;
    std::vector<int32_t> prompt;
    SamplingParams params;
  };
  std::vector<Req> reqs;
  for (int i = 0; i < 20; ++i) {
    std::vector<int32_t> p = (i % 3 == 0) ? shared : std::vector<int32_t>{};
    auto tail = random_prompt(rng, 3 + (i * 13) % 57, V);
    p.insert(p.end(), tail.begin(), tail.end());
    SamplingParams sp = greedy(8 + (i * 5) % 21);
    if (i % 4 == 1) sp.logprobs = 2;
    if (i % 4 == 3) sp.logprobs = 0;  // the chosen token's: device-verifiable
    reqs.push_back({"g" + std::to_string(i), p, sp});
  }
  // The reference: each request alone, no drafts.
  auto reference = [&](const Req& q) {
    FakeRunner r(V, FakeRunner::two_groups(512));
    Engine e(&r, &codec, config(1, 512, 0));
    EXPECT_TRUE(e.add_request(q.id, q.prompt, q.params).ok());
    return drain(e);
  };
  // Stops that land inside accepted runs: a stop id taken from the reference output.
  for (int i : {2, 7, 11}) {
    RunOut ref = reference(reqs[i]);
    const auto& t = ref.tokens[reqs[i].id];
    reqs[i].params.stop_token_ids = {t[t.size() / 2]};
  }
  RunOut ref;
  for (const auto& q : reqs) {
    RunOut one = reference(q);
    ref.tokens[q.id] = one.tokens[q.id];
    ref.logprobs[q.id] = one.logprobs[q.id];
    ref.last[q.id] = one.last[q.id];
  }

  // 40 blocks of 4 tokens per full group: less than 12 running requests need, so it preempts;
  // a 20-token budget chunks prefills and cuts verification steps short.
  FakeRunner runner(V, FakeRunner::drafter_groups(40, 12 * 7, 12));
  runner.enable_drafter(5, 0.004);  // 4 drafts per step; the noise makes ~half of them wrong
  runner.device_sampling_ = device;
  Engine e(&runner, &codec, config(12, 20, 4));
  ASSERT_TRUE(e.speculative());
  std::vector<int64_t> free0;
  for (int g = 0; g < e.blocks().num_groups(); ++g) free0.push_back(e.blocks().num_free_blocks(g));
  int64_t verify_rows = 0, cut = 0;
  e.set_step_hook([&](const SchedulerOutput& so, const StepInput& in) {
    EXPECT_LE(so.num_batched_tokens, 20);
    for (size_t i = 0; i < in.seqs.size(); ++i) {
      if (in.seqs[i].num_logits > 1) verify_rows += in.seqs[i].num_logits;
      if (in.seqs[i].num_logits > 1 && in.seqs[i].num_logits < 5) ++cut;
    }
  });
  for (const auto& q : reqs) ASSERT_TRUE(e.add_request(q.id, q.prompt, q.params).ok());
  RunOut got;
  int step = 0;
  std::set<std::string> aborted;
  while (e.has_work()) {
    if (step == 9) {
      aborted.insert("g4");
      EXPECT_TRUE(e.abort("g4"));
    }
    if (step == 23) {
      aborted.insert("g13");
      EXPECT_TRUE(e.abort("g13"));
    }
    auto r = e.step();
    ASSERT_TRUE(r.ok()) << r.status().message();
    collect(&got, r.value());
    ASSERT_TRUE(e.blocks().check_invariants().ok());
    ASSERT_LT(++step, 20000);
  }
  for (const auto& q : reqs) {
    const auto& want = ref.tokens[q.id];
    const auto& have = got.tokens[q.id];
    if (aborted.count(q.id)) {
      ASSERT_LE(have.size(), want.size()) << q.id;
      EXPECT_TRUE(std::equal(have.begin(), have.end(), want.begin())) << q.id;
      continue;
    }
    EXPECT_EQ(have, want) << q.id;
    EXPECT_EQ(got.last[q.id].finish_reason, ref.last[q.id].finish_reason) << q.id;
    EXPECT_EQ(got.last[q.id].stop_reason, ref.last[q.id].stop_reason) << q.id;
    ASSERT_EQ(got.logprobs[q.id].size(), ref.logprobs[q.id].size()) << q.id;
    for (size_t t = 0; t < ref.logprobs[q.id].size(); ++t) {
      EXPECT_EQ(got.logprobs[q.id][t].token, ref.logprobs[q.id][t].token) << q.id << " " << t;
      // The device's logprob is its own log-softmax (ops/cpu/sampling.h's reference here): f32
      // rounding of a different summation order, |logprob| < ~12 for 1,300 ids: 1e-5 absolute.
      if (device && q.params.logprobs == 0)
        EXPECT_NEAR(got.logprobs[q.id][t].logprob, ref.logprobs[q.id][t].logprob, 1e-5) << q.id << " " << t;
      else
        EXPECT_EQ(got.logprobs[q.id][t].logprob, ref.logprobs[q.id][t].logprob) << q.id << " " << t;
      EXPECT_EQ(got.logprobs[q.id][t].top, ref.logprobs[q.id][t].top) << q.id << " " << t;
    }
  }
  if (device) {  // greedy verification did run on the device, and mixed steps on the host
    EXPECT_GT(runner.device_verify_rows_, 0);
    std::printf("device verification: %ld rows on the device of %ld steps answered there\n",
                (long)runner.device_verify_rows_, (long)runner.device_steps_);
  }
  const EngineCounters c = e.counters();
  std::printf("greedy: %ld drafts, %ld draft tokens, %ld accepted; per position", (long)c.spec.num_drafts,
              (long)c.spec.num_draft_tokens, (long)c.spec.num_accepted_tokens);
  for (int64_t a : c.spec.accepted_per_pos) std::printf(" %ld", (long)a);
  std::printf("; preemptions %ld, prefix hits %ld, cut verifications %ld\n", (long)c.preemptions, (long)c.prefix_hits,
              (long)cut);
  EXPECT_GT(c.spec.num_accepted_tokens, c.spec.num_draft_tokens / 10);  // drafts do get accepted
  EXPECT_LT(c.spec.num_accepted_tokens, c.spec.num_draft_tokens);       // and rejected
  EXPECT_EQ(verify_rows, c.spec.num_drafts + c.spec.num_draft_tokens);
  int64_t sum = 0;
  for (size_t j = 0; j < c.spec.accepted_per_pos.size(); ++j) {
    sum += c.spec.accepted_per_pos[j];
    if (j > 0) {
      EXPECT_LE(c.spec.accepted_per_pos[j], c.spec.accepted_per_pos[j - 1]);
    }
  }
  EXPECT_EQ(sum, c.spec.num_accepted_tokens);
  EXPECT_GT(c.preemptions, 0);
  EXPECT_GT(c.prefix_hits, 0);
  EXPECT_GT(cut, 0);
  for (int g = 0; g < e.blocks().num_groups(); ++g) EXPECT_EQ(e.blocks().num_free_blocks(g), free0[g]) << g;
}

TEST(SpecDecodeStats, ChiSquareSurvivalMatchesKnownQuantiles) {
  // chi2(df) 0.95 / 0.999 quantiles (standard tables).
  EXPECT_NEAR(gamma_q(1.0 / 2, 3.841 / 2), 0.05, 1e-4);
  EXPECT_NEAR(gamma_q(10.0 / 2, 18.307 / 2), 0.05, 1e-4);
  EXPECT_NEAR(gamma_q(100.0 / 2, 149.449 / 2), 0.001, 1e-5);
}

// Sampling with drafts draws 4 tokens (1 by the sampler after prefill, then one verification
// of 2 drafts + bonus, or more steps after rejections) from exactly the target's joint
// distribution P(t1..t4) = prod_i p(t_i | prompt, t_<i), p the request's sampling distribution
// (tests/engine/sampling_exact_dist.h) of the fake target's rows.
//   Sample count and threshold: N = 40,000 requests, each with its own seed (drawn from a
// fresh engine seed, printed); Pearson's chi-square over the 625 cells (cells expected < 5
// merged). The test fails when p < 1e-6: a correct engine fails one run in a million. Power,
// computed (not sampled) for the two classic bugs: accepting every draft (tokens 2-3 from q)
// and resampling from p instead of the residual on rejection. The expected statistic under
// each is about df + N * sum (m - P)^2 / P (noncentral chi-square); the test asserts that it
// exceeds the 1e-6 critical value by 5 of its standard deviations, so either bug fails.
struct SamplingCase {
  const char* name;
  bool probabilistic;
  float temperature;
  int top_k;
  float top_p;
  float min_p;
};

class SpecDecodeSampling : public ::testing::TestWithParam<SamplingCase> {};

TEST_P(SpecDecodeSampling, JointOfFourTokensEqualsTheTargets) {
  const SamplingCase sc = GetParam();
  constexpr int V = 5;
  constexpr int64_t N = 40000;
  constexpr double kNoise = 3.0;  // q far from p: many rejections, so the residual matters
  const std::vector<int32_t> prompt = {3, 1, 4};
  DeviceSamplingParams dp;
  dp.temperature = sc.temperature;
  dp.top_k = sc.top_k;
  dp.top_p = sc.top_p;
  dp.min_p = sc.min_p;
  auto p_of = [&](const std::vector<int32_t>& hist) { return testing::exact_dist(FakeRunner::target_row(hist, V), dp); };
  auto q_of = [&](const std::vector<int32_t>& hist) {
    if (!sc.probabilistic || dp.temperature <= 0) {
      std::vector<double> q(V, 0.0);
      auto l = FakeRunner::draft_row(hist, V, kNoise);
      q[std::max_element(l.begin(), l.end()) - l.begin()] = 1.0;
      return q;
    }
    return testing::exact_dist(FakeRunner::draft_row(hist, V, kNoise), dp);
  };
  // Exact joint, and the joints of the two mutations (for the power argument).
  std::vector<double> exact(V * V * V * V), all_accept(exact.size()), resample_p(exact.size());
  for (int c = 0; c < static_cast<int>(exact.size()); ++c) {
    const int t[4] = {c / 125, c / 25 % 5, c / 5 % 5, c % 5};
    std::vector<int32_t> h = prompt;
    double pe = 1, pa = 1, pr = 1;
    for (int i = 0; i < 4; ++i) {
      const auto p = p_of(h);
      pe *= p[t[i]];
      if (i == 1 || i == 2) {  // drafted positions of the one verification
        const auto q = q_of(h);
        pa *= q[t[i]];
        double beta = 0;
        for (int v = 0; v < V; ++v) beta += std::min(p[v], q[v]);
        pr *= std::min(p[t[i]], q[t[i]]) + (1 - beta) * p[t[i]];
      } else {
        pa *= p[t[i]];
        pr *= p[t[i]];
      }
      h.push_back(t[i]);
    }
    exact[c] = pe;
    all_accept[c] = pa;
    resample_p[c] = pr;
  }
  const uint64_t seed = std::random_device{}();
  FakeRunner runner(V, FakeRunner::drafter_groups(4096, 4096, 8));
  runner.enable_drafter(4, kNoise);
  ByteTextCodec codec(V);
  EngineConfig cfg = config(256, 4096, 3, sc.probabilistic);
  cfg.seed = seed;
  cfg.enable_prefix_caching = false;
  Engine e(&runner, &codec, cfg);
  ASSERT_TRUE(e.speculative());
  SamplingParams sp;
  sp.temperature = sc.temperature;
  sp.top_k = sc.top_k;
  sp.top_p = sc.top_p;
  sp.min_p = sc.min_p;
  sp.max_tokens = 4;
  sp.ignore_eos = true;
  std::vector<int64_t> counts(exact.size(), 0);
  const Status st = testing::count_outputs(e, prompt, sp, N, 4, 5, 512, &counts);
  ASSERT_TRUE(st.ok()) << st.message();
  const EngineCounters c = e.counters();
  const ChiSquare x = chi_square(exact, counts, N);
  const double lo = testing::chi_square_critical(x.df, 1e-6);  // the test's critical value
  auto expected_stat = [&](const std::vector<double>& m) {
    double s = 0;
    for (size_t i = 0; i < m.size(); ++i)
      if (exact[i] > 0) s += (m[i] - exact[i]) * (m[i] - exact[i]) / exact[i];
    return x.df + N * s;
  };
  std::printf("%s (seed %llu): chi2 %.1f, df %d, p %.3g (fails below 1e-6: chi2 > %.1f); expected chi2 if every "
              "draft were accepted %.0f, if rejections resampled from p %.0f; %ld drafts, acceptance %.3f\n",
              sc.name, static_cast<unsigned long long>(seed), x.stat, x.df, x.p_value, lo, expected_stat(all_accept),
              expected_stat(resample_p), (long)c.spec.num_drafts,
              c.spec.num_draft_tokens ? double(c.spec.num_accepted_tokens) / c.spec.num_draft_tokens : 0.0);
  EXPECT_GT(x.p_value, 1e-6) << sc.name << " seed " << seed;
  // Power: under a bug the statistic is noncentral chi-square, mean df + lambda, variance
  // 2 (df + 2 lambda); 5 standard deviations below its mean must still fail the test.
  auto detected = [&](double mean) { return mean - 5 * std::sqrt(2 * (x.df + 2 * (mean - x.df))) > lo; };
  EXPECT_TRUE(detected(expected_stat(all_accept)));
  EXPECT_TRUE(detected(expected_stat(resample_p)));
  EXPECT_GT(c.spec.num_draft_tokens, N);  // speculation really ran
  EXPECT_GT(c.spec.num_accepted_tokens, c.spec.num_draft_tokens / 10);
  EXPECT_LT(c.spec.num_accepted_tokens, c.spec.num_draft_tokens * 9 / 10);
}

INSTANTIATE_TEST_SUITE_P(
    DraftMethods, SpecDecodeSampling,
    ::testing::Values(SamplingCase{"probabilistic_t1", true, 1.0f, 0, 1.0f, 0.0f},
                      SamplingCase{"greedy_drafts_t1", false, 1.0f, 0, 1.0f, 0.0f},
                      SamplingCase{"probabilistic_filtered", true, 0.8f, 4, 0.9f, 0.05f},
                      SamplingCase{"greedy_drafts_filtered", false, 0.8f, 4, 0.9f, 0.05f}),
    [](const ::testing::TestParamInfo<SamplingCase>& i) { return std::string(i.param.name); });

// A seeded request gives the same tokens alone and in a batch, with either draft method.
TEST(SpecDecodeEngine, SeededSamplingDoesNotDependOnTheBatch) {
  constexpr int V = 40;
  std::mt19937 rng(5);
  ByteTextCodec codec(V);
  const auto prompt = random_prompt(rng, 17, V);
  for (bool prob : {false, true}) {
    auto run = [&](bool batched) {
      FakeRunner r(V, FakeRunner::drafter_groups(1024, 1024, 16));
      r.enable_drafter(5, 0.5);
      Engine e(&r, &codec, config(16, 64, 4, prob));
      SamplingParams p;
      p.temperature = 0.9;
      p.seed = 1234;
      p.max_tokens = 30;
      p.ignore_eos = true;
      EXPECT_TRUE(e.add_request("s", prompt, p).ok());
      if (batched)
        for (int i = 0; i < 7; ++i) {
          SamplingParams q = p;
          q.seed.reset();
          q.max_tokens = 5 + 4 * i;
          EXPECT_TRUE(e.add_request("o" + std::to_string(i), random_prompt(rng, 3 + 9 * i, V), q).ok());
        }
      RunOut o = drain(e);
      EXPECT_GT(e.counters().spec.num_accepted_tokens, 0);
      return o.tokens["s"];
    };
    const auto alone = run(false);
    EXPECT_EQ(alone.size(), 30u);
    EXPECT_EQ(run(true), alone) << (prob ? "probabilistic" : "greedy") << " drafts";
    EXPECT_GT(std::set<int32_t>(alone.begin(), alone.end()).size(), 5u);  // really sampled
  }
}

// A runner that samples on its device, and steps that mix every kind of sequence: prefill
// chunks with prompt-logprob rows, greedy verification (rows' argmax from the device, or host
// rows when the step mixes), seeded random verification (host rows, the thread-pool pre-pass),
// top-N logprobs, a request that cannot speculate, and chunks with no rows. Each request is
// seeded or greedy, so its tokens, logprobs and prompt logprobs must be those it gets alone:
// an entry read for the wrong sequence or row (engine.cpp's `entry`) changes them.
TEST(SpecDecodeEngine, MixedStepsOnADeviceSamplingRunnerMatchEachRequestAlone) {
  constexpr int V = 300;
  std::mt19937 rng(31);
  ByteTextCodec codec(V);
  std::vector<Req> reqs;
  // The greedy ones outlive the others: their last steps verify on the device alone.
  reqs.push_back({"greedy", random_prompt(rng, 9, V), greedy(300)});
  SamplingParams plp = greedy(250);
  plp.prompt_logprobs = 2;  // its 70-token prompt is chunked beside the others' verification
  plp.logprobs = 0;
  reqs.push_back({"prompt_lp", random_prompt(rng, 70, V), plp});
  SamplingParams rnd = seeded(0.8, 30, 11);
  rnd.logprobs = 1;
  reqs.push_back({"random", random_prompt(rng, 13, V), rnd});
  reqs.push_back({"random2", random_prompt(rng, 40, V), seeded(1.1, 28, 12)});
  SamplingParams top = greedy(27);
  top.logprobs = 3;
  reqs.push_back({"top_n", random_prompt(rng, 21, V), top});
  SamplingParams pen = seeded(0.7, 20, 13);
  pen.repetition_penalty = 1.2;  // no drafts
  reqs.push_back({"penalty", random_prompt(rng, 33, V), pen});
  SamplingParams dev = seeded(0.9, 26, 14);  // device-samplable between its verifications
  reqs.push_back({"device_random", random_prompt(rng, 5, V), dev});

  struct Out {
    std::vector<int32_t> tokens;
    std::vector<TokenLogprob> logprobs, prompt_logprobs;
  };
  int64_t mixed_steps = 0;
  auto run = [&](const std::vector<const Req*>& batch, int64_t* device_verify_rows) {
    FakeRunner r(V, FakeRunner::drafter_groups(1024, 1024, 16));
    r.enable_drafter(5, 0.05);
    r.device_sampling_ = true;
    Engine e(&r, &codec, config(8, 24, 4));
    EXPECT_TRUE(e.speculative());
    e.set_step_hook([&](const SchedulerOutput&, const StepInput& in) {
      bool device_verify = false, host_rows = false;
      for (const auto& s : in.seqs) {
        device_verify |= s.num_logits > 1 && s.device_sampling.has_value();
        host_rows |= s.num_logits > 0 && !s.device_sampling;
      }
      if (batch.size() > 1 && device_verify && host_rows) ++mixed_steps;
    });
    for (const Req* q : batch) EXPECT_TRUE(e.add_request(q->id, q->prompt, q->params).ok());
    std::map<std::string, Out> got;
    for (int i = 0; i < 100000 && e.has_work(); ++i) {
      auto res = e.step();
      EXPECT_TRUE(res.ok()) << res.status().message();
      if (!res.ok()) break;
      for (auto& o : res.value()) {
        Out& g = got[o.request_id];
        g.tokens.insert(g.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
        g.logprobs.insert(g.logprobs.end(), o.new_logprobs.begin(), o.new_logprobs.end());
        if (!o.prompt_logprobs.empty()) g.prompt_logprobs = o.prompt_logprobs;
      }
    }
    EXPECT_FALSE(e.has_work());
    if (device_verify_rows != nullptr) {
      EXPECT_GT(e.counters().spec.num_accepted_tokens, 0);
      *device_verify_rows = r.device_verify_rows_;
    }
    return got;
  };
  std::vector<const Req*> all;
  for (const auto& q : reqs) all.push_back(&q);
  int64_t device_verify_rows = 0;
  std::map<std::string, Out> batched = run(all, &device_verify_rows);
  EXPECT_GT(mixed_steps, 0) << "no step mixed device verification with host rows";
  EXPECT_GT(device_verify_rows, 0) << "no greedy verification on the device";
  for (const auto& q : reqs) {
    const Out alone = run({&q}, nullptr)[q.id];
    const Out& b = batched[q.id];
    EXPECT_EQ(b.tokens, alone.tokens) << q.id;
    EXPECT_EQ(b.tokens.size(), static_cast<size_t>(q.params.max_tokens)) << q.id;
    ASSERT_EQ(b.logprobs.size(), alone.logprobs.size()) << q.id;
    for (size_t t = 0; t < alone.logprobs.size(); ++t) {
      EXPECT_EQ(b.logprobs[t].token, alone.logprobs[t].token) << q.id << " " << t;
      // A greedy row's logprob is the device's (its own log-softmax) or the host's, by what the
      // step mixed: f32 rounding apart (the greedy test's bound).
      EXPECT_NEAR(b.logprobs[t].logprob, alone.logprobs[t].logprob, 1e-5) << q.id << " " << t;
      EXPECT_EQ(b.logprobs[t].top, alone.logprobs[t].top) << q.id << " " << t;
    }
    ASSERT_EQ(b.prompt_logprobs.size(), alone.prompt_logprobs.size()) << q.id;
    if (q.params.prompt_logprobs >= 0) {
      EXPECT_EQ(b.prompt_logprobs.size(), q.prompt.size() - 1) << q.id;
    }
    for (size_t t = 0; t < alone.prompt_logprobs.size(); ++t) {
      EXPECT_EQ(b.prompt_logprobs[t].token, alone.prompt_logprobs[t].token) << q.id << " " << t;
      EXPECT_EQ(b.prompt_logprobs[t].logprob, alone.prompt_logprobs[t].logprob) << q.id << " " << t;
      EXPECT_EQ(b.prompt_logprobs[t].rank, alone.prompt_logprobs[t].rank) << q.id << " " << t;
    }
  }
}

// Rejection sampling on the device (SeqStep::device_verify, DraftSeq::keep_probs): a runner that
// verifies random requests itself, with q kept from its drafts, gives every seeded request the
// tokens and logprobs the host verifier gives it (the same rows, uniforms and q), under a budget
// that preempts and cuts verifications short, with aborts; kept q is released with its
// sequence. Requests the device cannot verify (top-k / top-p rows, top-N logprobs) mix into the
// same steps on the host path.
TEST(SpecDecodeEngine, DeviceRejectionSamplingEqualsHostVerification) {
  constexpr int V = 300;
  std::mt19937 rng(47);
  ByteTextCodec codec(V);
  std::vector<Req> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back({"t" + std::to_string(i), random_prompt(rng, 5 + 11 * i, V),
                                              seeded(0.6 + 0.15 * i, 20 + 3 * i, 100 + i)});
  SamplingParams mp = seeded(1.0, 30, 7);
  mp.min_p = 0.2;
  reqs.push_back({"min_p", random_prompt(rng, 17, V), mp});
  SamplingParams lp = seeded(0.9, 25, 8);
  lp.logprobs = 0;  // the chosen token's logprob: from the device
  reqs.push_back({"logprob", random_prompt(rng, 23, V), lp});
  SamplingParams tk = seeded(0.9, 25, 9);
  tk.top_k = 20;  // verified on the device too, as top-p below
  reqs.push_back({"top_k", random_prompt(rng, 9, V), tk});
  SamplingParams tp = seeded(1.1, 25, 14);
  tp.top_p = 0.8;
  tp.top_k = 40;
  reqs.push_back({"top_p", random_prompt(rng, 13, V), tp});
  SamplingParams top = seeded(1.0, 22, 10);
  top.logprobs = 2;  // top-N: host rows
  reqs.push_back({"top_n", random_prompt(rng, 31, V), top});
  reqs.push_back({"greedy", random_prompt(rng, 12, V), greedy(40)});
  // Random requests that never draft (their sampling edits each token): one token per step,
  // drawn on the host with their edits, beside the device verifications.
  SamplingParams pen = seeded(0.9, 18, 11);
  pen.repetition_penalty = 1.3;
  reqs.push_back({"penalty", random_prompt(rng, 14, V), pen});
  SamplingParams bias = seeded(1.0, 18, 12);
  bias.logit_bias.push_back({17, 3.0f});
  reqs.push_back({"logit_bias", random_prompt(rng, 8, V), bias});
  SamplingParams mt = seeded(0.8, 18, 13);
  mt.min_tokens = 6;
  reqs.push_back({"min_tokens", random_prompt(rng, 19, V), mt});

  for (bool prob : {true, false}) {
    auto run = [&](bool device_verification, int64_t* verified, int64_t* preemptions) {
      // 45 blocks of 4 tokens per full group for 14 requests of up to ~95 tokens: it preempts;
      // a 24-token budget chunks prefills and cuts verifications.
      FakeRunner r(V, FakeRunner::drafter_groups(45, 11 * 7, 12));
      r.enable_drafter(6, 0.3);
      r.device_sampling_ = true;
      r.device_verification_ = device_verification;
      Engine e(&r, &codec, config(11, 24, 5, prob));
      EXPECT_TRUE(e.speculative());
      for (const Req& q : reqs) EXPECT_TRUE(e.add_request(q.id, q.prompt, q.params).ok());
      RunOut got;
      for (int step = 0; e.has_work() && step < 20000; ++step) {
        if (step == 8) {
          EXPECT_TRUE(e.abort("t5"));
        }
        auto res = e.step();
        EXPECT_TRUE(res.ok()) << res.status().message();
        if (!res.ok()) break;
        collect(&got, res.value());
      }
      EXPECT_FALSE(e.has_work());
      EXPECT_EQ(r.kept_q_size(), 0u);  // every kept q released with its sequence
      EXPECT_GT(e.counters().spec.num_accepted_tokens, 0);
      *verified = r.device_verified_seqs_;
      *preemptions = e.counters().preemptions;
      return got;
    };
    int64_t dv = 0, hv = 0, dp = 0, hp = 0;
    const RunOut dev = run(true, &dv, &dp);
    const RunOut host = run(false, &hv, &hp);
    std::printf("%s drafts: %ld sequences verified on the device, %ld preemptions\n", prob ? "probabilistic" : "greedy",
                (long)dv, (long)dp);
    EXPECT_GT(dv, 0);
    EXPECT_EQ(hv, 0);
    EXPECT_GT(dp, 0);
    EXPECT_EQ(dp, hp);
    for (const Req& q : reqs) {
      auto of = [&](const auto& m) { return m.count(q.id) ? m.at(q.id) : typename std::decay_t<decltype(m)>::mapped_type{}; };
      EXPECT_EQ(of(dev.tokens), of(host.tokens)) << q.id << (prob ? " probabilistic" : " greedy");
      if (q.id != "t5") {
        EXPECT_EQ(of(dev.tokens).size(), static_cast<size_t>(q.params.max_tokens)) << q.id;
      }
      const auto a = of(dev.logprobs);
      const auto b = of(host.logprobs);
      ASSERT_EQ(a.size(), b.size()) << q.id;
      for (size_t t = 0; t < a.size(); ++t) {
        EXPECT_EQ(a[t].token, b[t].token) << q.id << " " << t;
        // The fake's device verification takes its logprob from the Sampler over the same row,
        // as the host path does: the same bits.
        EXPECT_EQ(a[t].logprob, b[t].logprob) << q.id << " " << t;
        EXPECT_EQ(a[t].top, b[t].top) << q.id << " " << t;
      }
    }
  }
}

// Penalties, logit_bias and min_tokens need the sampler's per-token edits: no drafts, and
// their tokens are the non-speculative engine's.
TEST(SpecDecodeEngine, IneligibleRequestsDecodeOneByOne) {
  constexpr int V = 400;
  std::mt19937 rng(8);
  ByteTextCodec codec(V);
  std::vector<std::pair<std::string, SamplingParams>> reqs;
  SamplingParams pen = greedy(12);
  pen.repetition_penalty = 1.4;
  reqs.push_back({"repetition", pen});
  SamplingParams fp = greedy(12);
  fp.presence_penalty = 0.7;
  reqs.push_back({"presence", fp});
  SamplingParams bias = greedy(12);
  bias.logit_bias = {{17, 5.0f}};
  reqs.push_back({"logit_bias", bias});
  SamplingParams mt = greedy(12);
  mt.min_tokens = 12;
  mt.ignore_eos = false;
  reqs.push_back({"min_tokens", mt});
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < reqs.size(); ++i) prompts.push_back(random_prompt(rng, 9 + 4 * static_cast<int>(i), V));
  FakeRunner r(V, FakeRunner::drafter_groups(512, 512, 16));
  r.enable_drafter(5, 0.0);  // perfect drafts: any request that speculated would show it
  Engine e(&r, &codec, config(8, 64, 4));
  e.set_step_hook([&](const SchedulerOutput&, const StepInput& in) {
    for (const auto& s : in.seqs) EXPECT_LE(s.num_logits, 1);
  });
  FakeRunner plain(V, FakeRunner::two_groups(512));
  Engine ref(&plain, &codec, config(8, 64, 0));
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(e.add_request(reqs[i].first, prompts[i], reqs[i].second).ok());
    ASSERT_TRUE(ref.add_request(reqs[i].first, prompts[i], reqs[i].second).ok());
  }
  RunOut a = drain(e), b = drain(ref);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(e.counters().spec.num_drafts, 0);
  EXPECT_EQ(r.draft_calls_, 0);
}

// A drafter pool that cannot hold a window + block for every running request costs drafts
// (and, when the target step itself lacks drafter pages, preemptions), never tokens or blocks.
TEST(SpecDecodeEngine, SmallDrafterPoolOnlyCostsDrafts) {
  constexpr int V = 700;
  std::mt19937 rng(31);
  ByteTextCodec codec(V);
  FakeRunner r(V, FakeRunner::drafter_groups(512, 14, 8));  // ~2 requests' windows of 8 + block 5
  r.enable_drafter(5, 0.0);
  Engine e(&r, &codec, config(6, 64, 4));
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(random_prompt(rng, 5 + 7 * i, V));
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(e.add_request("w" + std::to_string(i), prompts[i], greedy(40)).ok());
  const int64_t free0 = e.blocks().num_free_blocks_total();
  RunOut got = drain(e);
  for (int i = 0; i < 6; ++i) {
    FakeRunner plain(V, FakeRunner::two_groups(512));
    Engine ref(&plain, &codec, config(1, 64, 0));
    const std::string id = "w" + std::to_string(i);
    ASSERT_TRUE(ref.add_request(id, prompts[i], greedy(40)).ok());
    EXPECT_EQ(got.tokens[id], drain(ref).tokens[id]) << id;
  }
  const EngineCounters c = e.counters();
  std::printf("small drafter pool: %ld window misses, %ld drafts, %ld preemptions\n", (long)c.spec_window_misses,
              (long)c.spec.num_drafts, (long)c.preemptions);
  EXPECT_GT(c.spec_window_misses + c.preemptions, 0);
  EXPECT_GT(c.spec.num_accepted_tokens, 0);
  EXPECT_EQ(e.blocks().num_free_blocks_total(), free0);
}

// 1,000 requests of mixed lengths and sampling, a fifth aborted at random moments, prefix hits
// and preemption: every cache group ends at its idle block count.
TEST(SpecDecodeEngine, NoLeaksAfterAThousandMixedRequestsWithAborts) {
  constexpr int V = 500;
  std::mt19937 rng(std::random_device{}());
  ByteTextCodec codec(V);
  FakeRunner r(V, FakeRunner::drafter_groups(200, 200, 12));
  r.enable_drafter(5, 0.05);
  Engine e(&r, &codec, config(24, 48, 4, /*probabilistic=*/true));
  std::vector<int64_t> free0;
  for (int g = 0; g < e.blocks().num_groups(); ++g) free0.push_back(e.blocks().num_free_blocks(g));
  const auto shared = random_prompt(rng, 16, V);
  auto made = testing::run_with_aborts(e, 1000, 40, 8, rng, [&] {
    std::vector<int32_t> p = rng() % 2 ? shared : std::vector<int32_t>{};
    auto tail = random_prompt(rng, 1 + rng() % 40, V);
    p.insert(p.end(), tail.begin(), tail.end());
    SamplingParams sp = greedy(1 + rng() % 12);
    if (rng() % 2) sp.temperature = 0.7 + (rng() % 5) * 0.2;
    if (rng() % 7 == 0) sp.stop_token_ids = {static_cast<int32_t>(3 + rng() % (V - 3))};
    return std::make_pair(p, sp);
  });
  ASSERT_TRUE(made.ok()) << made.status().message();
  const int aborted = *made;
  EXPECT_GT(aborted, 50);
  EXPECT_GT(e.counters().spec.num_accepted_tokens, 0);
  EXPECT_EQ(e.num_live(), 0u);
  ASSERT_TRUE(e.blocks().check_invariants().ok());
  for (int g = 0; g < e.blocks().num_groups(); ++g) EXPECT_EQ(e.blocks().num_free_blocks(g), free0[g]) << g;
}

}  // namespace
}  // namespace ml4
