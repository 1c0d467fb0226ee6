// Sampler: every feature against a direct f64 reference on fresh random logits.
// Tolerances: logprobs are f32 values of an f64 log_softmax, so 1e-5 absolute (f32 ulp at
// |x| < 16 is ~1e-6); sampling frequencies are checked against 5 sigma of the binomial.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "engine/sampler.h"

namespace ml4 {
namespace {

std::vector<float> random_logits(int vocab, uint32_t seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(vocab);
  for (auto& x : v) x = d(rng);
  return v;
}

Request request(double temperature, uint64_t seed) {
  Request r;
  r.prompt = {5, 6, 7};
  r.params.temperature = temperature;
  r.params.seed = seed;
  r.rng.seed(seed);
  return r;
}

TEST(Sampler, GreedyIsArgmaxAndLogprobsMatchF64) {
  auto logits = random_logits(500, 1);
  Request r = request(0.0, 0);
  r.params.logprobs = 5;
  auto copy = logits;
  int32_t t = Sampler::sample(r, copy.data(), 500, -1);
  EXPECT_EQ(t, std::max_element(logits.begin(), logits.end()) - logits.begin());
  double mx = *std::max_element(logits.begin(), logits.end()), s = 0;
  for (float x : logits) s += std::exp(double(x) - mx);
  const double lse = mx + std::log(s);
  ASSERT_EQ(r.logprobs.size(), 1u);
  EXPECT_NEAR(r.logprobs[0].logprob, logits[t] - lse, 1e-5);
  ASSERT_EQ(r.logprobs[0].top.size(), 5u);
  EXPECT_EQ(r.logprobs[0].top[0].first, t);
  for (int i = 1; i < 5; ++i) EXPECT_GE(r.logprobs[0].top[i - 1].second, r.logprobs[0].top[i].second);
  for (auto& [id, lp] : r.logprobs[0].top) EXPECT_NEAR(lp, logits[id] - lse, 1e-5);
}

TEST(Sampler, SeedReproducesAndTopKOneIsGreedy) {
  auto logits = random_logits(300, 2);
  std::vector<int32_t> a, b;
  Request ra = request(0.9, 42), rb = request(0.9, 42);
  for (int i = 0; i < 50; ++i) {
    auto c1 = logits, c2 = logits;
    a.push_back(Sampler::sample(ra, c1.data(), 300, -1));
    b.push_back(Sampler::sample(rb, c2.data(), 300, -1));
  }
  EXPECT_EQ(a, b);
  EXPECT_GT(std::set<int32_t>(a.begin(), a.end()).size(), 1u);  // really random
  Request rk = request(1.5, 9);
  rk.params.top_k = 1;
  auto c = logits;
  EXPECT_EQ(Sampler::sample(rk, c.data(), 300, -1), std::max_element(logits.begin(), logits.end()) - logits.begin());
}

TEST(Sampler, TemperatureTopPMinPDistribution) {
  const int V = 8;
  auto logits = random_logits(V, 3, 1.0f);
  const double T = 0.7, top_p = 0.8;
  // Reference: softmax(l / T), nucleus by descending probability, renormalised.
  std::vector<double> p(V);
  double mx = *std::max_element(logits.begin(), logits.end()) / T, s = 0;
  for (int i = 0; i < V; ++i) s += p[i] = std::exp(logits[i] / T - mx);
  for (auto& x : p) x /= s;
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
  std::vector<double> ref(V, 0.0);
  double acc = 0;
  for (int i : order) {
    ref[i] = p[i];
    acc += p[i];
    if (acc >= top_p) break;
  }
  for (auto& x : ref) x /= acc;

  Request r = request(T, 123);
  r.params.top_p = top_p;
  const int N = 20000;
  std::vector<int> counts(V, 0);
  for (int n = 0; n < N; ++n) {
    auto c = logits;
    ++counts[Sampler::sample(r, c.data(), V, -1)];
  }
  for (int i = 0; i < V; ++i) {
    const double sigma = std::sqrt(N * ref[i] * (1 - ref[i])) + 1e-9;
    if (ref[i] == 0.0) EXPECT_EQ(counts[i], 0) << i;
    else EXPECT_NEAR(counts[i], N * ref[i], 5 * sigma) << i;
  }
  // min_p = 1 keeps only the most likely token.
  Request m = request(1.0, 5);
  m.params.min_p = 1.0;
  for (int n = 0; n < 20; ++n) {
    auto c = logits;
    EXPECT_EQ(Sampler::sample(m, c.data(), V, -1), order[0]);
  }
}

TEST(Sampler, PenaltiesAndMinTokensMatchReference) {
  const int V = 64;
  auto logits = random_logits(V, 4);
  Request r = request(0.0, 0);
  r.prompt = {1, 2, 3};
  r.output = {3, 4, 4, 5};
  for (int32_t t : r.output) ++r.output_counts[t];
  r.params.repetition_penalty = 1.3;
  r.params.frequency_penalty = 0.5;
  r.params.presence_penalty = 0.25;
  r.params.min_tokens = 10;  // masks EOS (id 9 here) and stop id 11
  r.params.stop_token_ids = {11};
  auto ref = logits;
  for (int t : {1, 2, 3, 4, 5}) ref[t] = ref[t] > 0 ? ref[t] / 1.3f : ref[t] * 1.3f;
  std::map<int, int> cnt{{3, 1}, {4, 2}, {5, 1}};
  for (auto& [t, c] : cnt) ref[t] -= 0.5f * c + 0.25f;
  ref[9] = ref[11] = -INFINITY;
  auto c = logits;
  int32_t tok = Sampler::sample(r, c.data(), V, 9);
  for (int i = 0; i < V; ++i) EXPECT_FLOAT_EQ(c[i], ref[i]) << i;
  EXPECT_EQ(tok, std::max_element(ref.begin(), ref.end()) - ref.begin());
}

TEST(SamplingParams, ValidateNamesTheField) {
  SamplingParams p;
  EXPECT_TRUE(p.validate(100).ok());
  p.temperature = -1;
  EXPECT_NE(p.validate(100).message().find("temperature"), std::string::npos);
  p = {};
  p.stop_token_ids = {100};
  EXPECT_NE(p.validate(100).message().find("stop_token_ids"), std::string::npos);
  p = {};
  p.logprobs = 21;
  EXPECT_FALSE(p.validate(100).ok());
  p = {};
  p.min_tokens = 20;
  EXPECT_FALSE(p.validate(100).ok());
}

}  // namespace
}  // namespace ml4
