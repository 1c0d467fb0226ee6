// Device sampling through the engine, on the FakeRunner playing a runner that samples on its
// device (tests/engine/fake_runner.h: device_sampling_), and the host reference of the device
// contract (ops/cpu/sampling.h) against the exact distribution (CI has no GPU: this is
// where the contract's semantics are checked on every build).
//   - greedy tokens and logprobs equal the host path's;
//   - a seeded request gives the same tokens alone, in a batch, and when the runner returns
//     logits instead (the engine's host fallback draws the same way);
//   - requests the device cannot serve (penalties, top-N logprobs, min_tokens still masking)
//     never carry device_sampling and keep the host Sampler's tokens;
//   - the reference's empirical distribution over 20000 counters is within a TV bound of the
//     exact f64 one (bound as in tests/cuda/sampling_test.cu: 1/2 sum sqrt(p/N) + McDiarmid
//     t = sqrt(ln(1e6) / 2N)) and never leaves the kept set.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "ops/cpu/sampling.h"
#include "engine/engine.h"
#include "engine/fake_runner.h"
#include "engine/sampling_exact_dist.h"

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

EngineConfig config(int max_seqs) {
  EngineConfig c;
  c.scheduler.max_num_seqs = max_seqs;
  c.scheduler.max_num_batched_tokens = 64;
  c.scheduler.max_model_len = 512;
  c.seed = 77;
  return c;
}

struct RunOut {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, std::vector<TokenLogprob>> logprobs;
};

RunOut drain(Engine& e) {
  RunOut run;
  for (int i = 0; i < 100000 && e.has_work(); ++i) {
    auto r = e.step();
    EXPECT_TRUE(r.ok()) << r.status().message();
    if (!r.ok()) break;
    for (auto& o : r.value()) {
      auto& t = run.tokens[o.request_id];
      t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
      auto& l = run.logprobs[o.request_id];
      l.insert(l.end(), o.new_logprobs.begin(), o.new_logprobs.end());
    }
  }
  EXPECT_FALSE(e.has_work());
  return run;
}

SamplingParams sampled(uint64_t seed, int max_tokens) {
  SamplingParams p;
  p.temperature = 0.8;
  p.top_k = 50;
  p.top_p = 0.9;
  p.min_p = 0.02;
  p.seed = seed;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

TEST(DeviceSamplingEngine, GreedyEqualsHostPathWithLogprobs) {
  std::mt19937 rng(3);
  ByteTextCodec codec(kVocab);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(random_prompt(rng, 5 + 9 * i));
  SamplingParams p;
  p.temperature = 0.0;
  p.max_tokens = 12;
  p.ignore_eos = true;
  p.logprobs = 0;
  FakeRunner host(kVocab, FakeRunner::two_groups(512)), dev(kVocab, FakeRunner::two_groups(512));
  dev.device_sampling_ = true;
  Engine eh(&host, &codec, config(8)), ed(&dev, &codec, config(8));
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(eh.add_request("g" + std::to_string(i), prompts[i], p).ok());
    ASSERT_TRUE(ed.add_request("g" + std::to_string(i), prompts[i], p).ok());
  }
  RunOut h = drain(eh), d = drain(ed);
  for (int i = 0; i < 8; ++i) {
    const std::string id = "g" + std::to_string(i);
    EXPECT_EQ(h.tokens[id], d.tokens[id]) << id;
    ASSERT_EQ(d.logprobs[id].size(), d.tokens[id].size()) << id;
    for (size_t t = 0; t < d.tokens[id].size(); ++t) {
      EXPECT_EQ(d.logprobs[id][t].token, d.tokens[id][t]);
      // Both are f32 values of an f64 log_softmax (the host's subtracts in f32 first).
      EXPECT_NEAR(d.logprobs[id][t].logprob, h.logprobs[id][t].logprob, 1e-5) << id << " token " << t;
    }
  }
  EXPECT_GT(dev.device_steps_, 0);
  EXPECT_EQ(host.device_rows_, 0);  // a runner that does not sample on its device is never asked
}

TEST(DeviceSamplingEngine, SeededAloneEqualsBatchedAndFallback) {
  std::mt19937 rng(9);
  ByteTextCodec codec(kVocab);
  auto prompt = random_prompt(rng, 23);
  std::vector<std::vector<int32_t>> others;
  for (int i = 0; i < 6; ++i) others.push_back(random_prompt(rng, 4 + 11 * i));

  auto run = [&](bool batched, bool logits_anyway) {
    FakeRunner dev(kVocab, FakeRunner::two_groups(512));
    dev.device_sampling_ = true;
    dev.logits_anyway_ = logits_anyway;
    Engine e(&dev, &codec, config(8));
    EXPECT_TRUE(e.add_request("seeded", prompt, sampled(4242, 24)).ok());
    if (batched)
      for (int i = 0; i < 6; ++i) {
        SamplingParams q = sampled(0, 10 + i);
        q.seed.reset();  // drawn from the engine seed
        q.temperature = 1.2;
        EXPECT_TRUE(e.add_request("o" + std::to_string(i), others[i], q).ok());
      }
    RunOut r = drain(e);
    EXPECT_GT(dev.device_rows_, 0);
    EXPECT_EQ(dev.device_steps_ > 0, !logits_anyway);
    return r.tokens["seeded"];
  };
  const auto alone = run(false, false);
  ASSERT_EQ(alone.size(), 24u);
  EXPECT_EQ(run(true, false), alone);
  EXPECT_EQ(run(false, true), alone);
  EXPECT_EQ(run(true, true), alone);
  std::set<int32_t> distinct(alone.begin(), alone.end());
  EXPECT_GT(distinct.size(), 3u);  // really sampled, not greedy
}

TEST(DeviceSamplingEngine, IneligibleRequestsStayOnTheHostSampler) {
  std::mt19937 rng(21);
  ByteTextCodec codec(kVocab);
  std::vector<std::pair<std::string, SamplingParams>> reqs;
  SamplingParams pen = sampled(1, 10);
  pen.repetition_penalty = 1.3;
  reqs.push_back({"repetition", pen});
  SamplingParams freq = sampled(2, 10);
  freq.frequency_penalty = 0.5;
  reqs.push_back({"frequency", freq});
  SamplingParams lp = sampled(3, 10);
  lp.logprobs = 3;
  reqs.push_back({"top_logprobs", lp});
  SamplingParams mt = sampled(4, 10);
  mt.min_tokens = 4;
  mt.ignore_eos = false;
  reqs.push_back({"min_tokens", mt});
  reqs.push_back({"plain", sampled(5, 10)});
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < reqs.size(); ++i) prompts.push_back(random_prompt(rng, 6 + 5 * static_cast<int>(i)));

  FakeRunner dev(kVocab, FakeRunner::two_groups(512));
  dev.device_sampling_ = true;
  Engine e(&dev, &codec, config(8));
  int checked = 0;
  e.set_step_hook([&](const SchedulerOutput& so, const StepInput& in) {
    for (size_t i = 0; i < so.seqs.size(); ++i) {
      const Request& r = *so.seqs[i].req;
      const SamplingParams& p = r.params;
      const bool eligible = p.repetition_penalty == 1.0 && p.frequency_penalty == 0.0 && p.logprobs <= 0 &&
                            static_cast<int>(r.output.size()) >= p.min_tokens;
      EXPECT_EQ(in.seqs[i].device_sampling.has_value(), eligible && in.seqs[i].num_logits == 1) << r.request_id;
      if (in.seqs[i].device_sampling) {
        EXPECT_EQ(in.seqs[i].device_sampling->counter, static_cast<int64_t>(r.output.size()));
        EXPECT_EQ(in.seqs[i].device_sampling->seed, *p.seed);
      }
      ++checked;
    }
  });
  for (size_t i = 0; i < reqs.size(); ++i) ASSERT_TRUE(e.add_request(reqs[i].first, prompts[i], reqs[i].second).ok());
  RunOut d = drain(e);
  EXPECT_GT(checked, 20);

  // The ineligible requests' tokens equal a plain host runner's (the host Sampler, same rng).
  FakeRunner host(kVocab, FakeRunner::two_groups(512));
  Engine eh(&host, &codec, config(8));
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(eh.add_request(reqs[i].first, prompts[i], reqs[i].second).ok());
  RunOut h = drain(eh);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(d.tokens[reqs[i].first], h.tokens[reqs[i].first]) << reqs[i].first;
  EXPECT_EQ(d.logprobs["top_logprobs"].size(), 10u);
  EXPECT_EQ(d.logprobs["top_logprobs"][0].top.size(), 3u);
}

TEST(DeviceSamplingReference, DistributionMatchesExactWithTies) {
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  // 1001 ids (not a multiple of 4), logits in steps of 0.25: tie runs at every cut.
  std::vector<float> row(1001);
  for (auto& x : row) x = std::round(nd(rng) * 4.0f) * 0.25f;
  auto P = [](float t, int k, float tp, float mp) {
    DeviceSamplingParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = tp;
    p.min_p = mp;
    p.seed = 99;
    return p;
  };
  const int64_t N = 20000;
  for (const DeviceSamplingParams& p : {P(1.0f, 0, 1.0f, 0.0f), P(0.7f, 25, 1.0f, 0.0f), P(1.3f, 0, 0.5f, 0.0f),
                                        P(1.0f, 0, 1.0f, 0.2f), P(0.9f, 60, 0.8f, 0.05f)}) {
    const std::vector<double> ex = testing::exact_dist(row, p);
    std::vector<int64_t> cnt(row.size(), 0);
    DeviceSamplingParams q = p;
    for (int64_t c = 0; c < N; ++c) {
      q.counter = c;
      ++cnt[sampling::sample_row_reference(row.data(), static_cast<int64_t>(row.size()), q)];
    }
    // Buckets: ids with p >= 1e-3 alone, the rest of the support merged; outside must be 0.
    double tv = 0, e_tv = 0, rest_p = 0, rest_n = 0;
    int64_t outside = 0;
    for (size_t i = 0; i < row.size(); ++i) {
      if (ex[i] == 0.0) {
        outside += cnt[i];
      } else if (ex[i] >= 1e-3) {
        tv += std::abs(static_cast<double>(cnt[i]) / N - ex[i]);
        e_tv += std::sqrt(ex[i] / N);
      } else {
        rest_p += ex[i];
        rest_n += static_cast<double>(cnt[i]) / N;
      }
    }
    tv = 0.5 * (tv + std::abs(rest_n - rest_p));
    const double bound = 0.5 * (e_tv + std::sqrt(rest_p / N)) + std::sqrt(std::log(1e6) / (2.0 * N));
    EXPECT_EQ(outside, 0) << "T " << p.temperature << " k " << p.top_k << " p " << p.top_p << " min_p " << p.min_p;
    EXPECT_LT(tv, bound) << "T " << p.temperature << " k " << p.top_k << " p " << p.top_p << " min_p " << p.min_p;
  }
}

TEST(DeviceSamplingReference, GreedyTiesNanAndSeedDeterminism) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> l = {nan, 1.0f, 3.0f, nan, 3.0f, -2.0f};
  DeviceSamplingParams g;
  g.temperature = 0.0f;
  float lp = 0;
  EXPECT_EQ(sampling::sample_row_reference(l.data(), 6, g, &lp), 2);
  const double ref = 3.0 - (3.0 + std::log(std::exp(-2.0) + 2.0 + std::exp(-5.0)));
  EXPECT_NEAR(lp, ref, 1e-6);
  DeviceSamplingParams s;
  s.temperature = 1.0f;
  s.seed = 5;
  s.counter = 9;
  const int32_t a = sampling::sample_row_reference(l.data(), 6, s);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(sampling::sample_row_reference(l.data(), 6, s), a);
  EXPECT_TRUE(a == 1 || a == 2 || a == 4 || a == 5);  // never a NaN id
}

}  // namespace
}  // namespace ml4
