// Sampler with a grammar's bitmask, logit_bias and prompt logprobs, against direct f64
// references on fresh random logits and masks (the seed is printed on failure).
// Tolerances as sampler_test.cpp: logprobs are f32 values of an f64 log_softmax, 1e-5
// absolute; frequencies within 5 binomial sigma.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "engine/sampler.h"
#include "engine/structured_output.h"

namespace ml4 {
namespace {

uint32_t fresh_seed() { return std::random_device{}(); }

std::vector<float> random_logits(int vocab, std::mt19937& rng, float scale = 3.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(vocab);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<uint32_t> random_mask(int vocab, std::mt19937& rng, double keep) {
  std::vector<uint32_t> m(bitmask_words(vocab), 0u);
  std::bernoulli_distribution b(keep);
  bool any = false;
  for (int i = 0; i < vocab; ++i)
    if (b(rng)) {
      m[i >> 5] |= 1u << (i & 31);
      any = true;
    }
  if (!any) m[0] |= 1u;
  return m;
}

Request request(double temperature, uint64_t seed) {
  Request r;
  r.prompt = {5, 6, 7};
  r.params.temperature = temperature;
  r.params.seed = seed;
  r.rng.seed(seed);
  return r;
}

// log_softmax over the allowed ids only, f64.
std::vector<double> masked_logp(const std::vector<float>& l, const std::vector<uint32_t>& m) {
  double mx = -INFINITY, s = 0;
  for (size_t i = 0; i < l.size(); ++i)
    if (bitmask_allows(m.data(), static_cast<int32_t>(i))) mx = std::max(mx, double(l[i]));
  for (size_t i = 0; i < l.size(); ++i)
    if (bitmask_allows(m.data(), static_cast<int32_t>(i))) s += std::exp(double(l[i]) - mx);
  std::vector<double> out(l.size(), -INFINITY);
  for (size_t i = 0; i < l.size(); ++i)
    if (bitmask_allows(m.data(), static_cast<int32_t>(i))) out[i] = double(l[i]) - mx - std::log(s);
  return out;
}

TEST(SamplerMask, GreedyAndSampledTokensAreAllowedAndLogprobsAreTheMaskedOnes) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int vocab = 1000 + static_cast<int>(rng() % 300);  // not a multiple of 32
  for (int trial = 0; trial < 20; ++trial) {
    auto logits = random_logits(vocab, rng);
    auto mask = random_mask(vocab, rng, trial % 2 ? 0.02 : 0.5);
    const auto ref = masked_logp(logits, mask);
    Request g = request(0.0, 0);
    g.params.logprobs = 3;
    auto c = logits;
    const int32_t t = Sampler::sample(g, c.data(), vocab, -1, mask.data());
    EXPECT_EQ(t, std::max_element(ref.begin(), ref.end()) - ref.begin());
    ASSERT_EQ(g.logprobs.size(), 1u);
    EXPECT_NEAR(g.logprobs[0].logprob, ref[t], 1e-5);
    for (auto& [id, lp] : g.logprobs[0].top) {
      EXPECT_TRUE(bitmask_allows(mask.data(), id)) << id;
      EXPECT_NEAR(lp, ref[id], 1e-5);
    }
    Request s = request(1.3, rng());
    s.params.top_p = 0.95;
    for (int k = 0; k < 50; ++k) {
      auto c2 = logits;
      const int32_t x = Sampler::sample(s, c2.data(), vocab, -1, mask.data());
      ASSERT_TRUE(bitmask_allows(mask.data(), x)) << "token " << x << " is masked";
    }
  }
}

TEST(SamplerMask, MaskedDistributionMatchesTheRenormalisedSoftmax) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int vocab = 64;
  auto logits = random_logits(vocab, rng, 1.0f);
  auto mask = random_mask(vocab, rng, 0.25);
  const auto ref = masked_logp(logits, mask);
  Request r = request(1.0, rng());
  const int n = 20000;
  std::vector<int> count(vocab, 0);
  for (int k = 0; k < n; ++k) {
    auto c = logits;
    ++count[Sampler::sample(r, c.data(), vocab, -1, mask.data())];
  }
  for (int i = 0; i < vocab; ++i) {
    const double p = std::exp(ref[i]);
    if (!bitmask_allows(mask.data(), i)) {
      EXPECT_EQ(count[i], 0);
      continue;
    }
    EXPECT_NEAR(count[i], n * p, 5 * std::sqrt(n * p * (1 - p)) + 1) << "id " << i;
  }
}

TEST(SamplerMask, GrammarWinsOverMinTokensWhenOnlyEosIsAllowed) {
  const int vocab = 100, eos = 2;
  std::mt19937 rng(fresh_seed());
  auto logits = random_logits(vocab, rng);
  std::vector<uint32_t> only_eos(bitmask_words(vocab), 0u);
  only_eos[0] = 1u << eos;
  Request r = request(0.7, 3);
  r.params.min_tokens = 5;  // would mask EOS
  auto c = logits;
  EXPECT_EQ(Sampler::sample(r, c.data(), vocab, eos, only_eos.data()), eos);
  // With another id allowed, min_tokens masks EOS as usual.
  std::vector<uint32_t> two = only_eos;
  two[0] |= 1u << 7;
  for (int k = 0; k < 20; ++k) {
    auto c2 = logits;
    EXPECT_EQ(Sampler::sample(r, c2.data(), vocab, eos, two.data()), 7);
  }
}

TEST(SamplerLogitBias, BiasShiftsTheDrawButNotTheLogprobs) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int vocab = 500;
  auto logits = random_logits(vocab, rng);
  const int32_t target = static_cast<int32_t>(rng() % vocab);
  Request r = request(0.0, 0);
  r.params.logprobs = 0;
  r.params.logit_bias = {{target, 100.0f}};
  auto c = logits;
  EXPECT_EQ(Sampler::sample(r, c.data(), vocab, -1), target);
  // The logprob is the unbiased one (vLLM: logprobs before logits processors).
  double mx = *std::max_element(logits.begin(), logits.end()), s = 0;
  for (float x : logits) s += std::exp(double(x) - mx);
  EXPECT_NEAR(r.logprobs[0].logprob, logits[target] - mx - std::log(s), 1e-5);
  // -100 removes the argmax from a greedy pick.
  const int32_t best = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  Request q = request(0.0, 0);
  q.params.logit_bias = {{best, -100.0f}};
  auto c2 = logits;
  EXPECT_NE(Sampler::sample(q, c2.data(), vocab, -1), best);
}

TEST(SamplerPromptLogprob, ValueRankAndTopMatchF64) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int vocab = 777;
  auto logits = random_logits(vocab, rng);
  const int32_t tok = static_cast<int32_t>(rng() % vocab);
  TokenLogprob lp = Sampler::prompt_logprob(logits.data(), vocab, tok, 4);
  double mx = *std::max_element(logits.begin(), logits.end()), s = 0;
  for (float x : logits) s += std::exp(double(x) - mx);
  EXPECT_EQ(lp.token, tok);
  EXPECT_NEAR(lp.logprob, logits[tok] - mx - std::log(s), 1e-5);
  int64_t rank = 1;
  for (float x : logits) rank += x > logits[tok] ? 1 : 0;
  EXPECT_EQ(lp.rank, rank);
  ASSERT_EQ(lp.top.size(), 4u);
  for (int i = 1; i < 4; ++i) EXPECT_GE(lp.top[i - 1].second, lp.top[i].second);
  EXPECT_EQ(lp.top[0].first, std::max_element(logits.begin(), logits.end()) - logits.begin());
}

}  // namespace
}  // namespace ml4
