// moe_route against a naive f64 router written from transformers' Mistral4TopkRouter /
// DeepseekV3TopkRouter (full sorts, no shortcuts), with groups and correction bias,
// plus a hand-made case where top-2-sum and max group scores disagree.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "ops/cpu/moe.h"
#include "ops_test_util.h"

namespace ml4::cpu {
namespace {

struct RefRoute {
  std::vector<double> p, s;  // scores, selection scores (after group masking)
  std::vector<int32_t> ids;
  std::vector<double> w;
};

RefRoute ref_route(const float* l, const MoeConfig& cfg, const float* bias) {
  const int E = cfg.num_experts, G = cfg.num_expert_groups, per = E / G;
  RefRoute r;
  r.p.resize(E);
  if (cfg.scoring == RouterScoring::kSoftmax) {
    double mx = *std::max_element(l, l + E), sum = 0.0;
    for (int e = 0; e < E; ++e) sum += r.p[e] = std::exp(double(l[e]) - mx);
    for (auto& v : r.p) v /= sum;
  } else {
    for (int e = 0; e < E; ++e) r.p[e] = 1.0 / (1.0 + std::exp(-double(l[e])));
  }
  r.s = r.p;
  if (bias)
    for (int e = 0; e < E; ++e) r.s[e] += bias[e];
  if (G > 1) {
    std::vector<std::pair<double, int>> gs;
    for (int g = 0; g < G; ++g) {
      std::vector<double> v(r.s.begin() + g * per, r.s.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gs.push_back({-(v[0] + (per > 1 ? v[1] : 0.0)), g});
    }
    std::sort(gs.begin(), gs.end());
    for (int i = cfg.num_expert_groups_per_tok; i < G; ++i)
      for (int e = gs[i].second * per; e < (gs[i].second + 1) * per; ++e) r.s[e] = -INFINITY;
  }
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return r.s[a] > r.s[b]; });
  r.ids.assign(order.begin(), order.begin() + cfg.num_experts_per_tok);
  double sum = 0.0;
  for (int id : r.ids) sum += r.p[id];
  for (int id : r.ids) r.w.push_back(r.p[id] / (cfg.renormalize ? sum : 1.0) * cfg.routed_scale);
  return r;
}

void check_route(const MoeConfig& cfg, bool with_bias, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "E=" << cfg.num_experts << " G=" << cfg.num_expert_groups
                                  << " bias=" << with_bias);
  const int64_t T = 7;
  const int E = cfg.num_experts, K = cfg.num_experts_per_tok;
  auto logits = test::random_floats(T * E, seed, -4.0f, 4.0f);
  auto bias = test::random_floats(E, seed + 1, -0.1f, 0.1f);
  std::vector<int32_t> ids(T * K, -5);
  std::vector<float> w(T * K);
  moe_route(logits.data(), T, cfg, with_bias ? bias.data() : nullptr, ids.data(), w.data());
  for (int64_t t = 0; t < T; ++t) {
    RefRoute r = ref_route(logits.data() + t * E, cfg, with_bias ? bias.data() : nullptr);
    for (int i = 0; i < K; ++i) {
      const int32_t got = ids[t * K + i];
      ASSERT_GE(got, 0);
      ASSERT_LT(got, E);
      // Ranks may only differ between experts whose f64 scores are within f32 noise.
      EXPECT_NEAR(r.s[got], r.s[r.ids[i]], 1e-6) << "t=" << t << " i=" << i;
      // Weight of the expert actually chosen: p in f32 (few ulp) / f64 sum: 1e-6 relative.
      double sum = 0.0;
      for (int j = 0; j < K; ++j) sum += r.p[ids[t * K + j]];
      const double want = r.p[got] / (cfg.renormalize ? sum : 1.0) * cfg.routed_scale;
      EXPECT_NEAR(w[t * K + i], want, 1e-6 * want) << "t=" << t << " i=" << i;
    }
    EXPECT_EQ(std::vector<int32_t>(ids.begin() + t * K, ids.begin() + (t + 1) * K), r.ids);
  }
}

MoeConfig cfg(int E, int K, int G, int Gk, RouterScoring sc, bool renorm, double scale) {
  MoeConfig c;
  c.num_experts = E;
  c.num_experts_per_tok = K;
  c.num_expert_groups = G;
  c.num_expert_groups_per_tok = Gk;
  c.scoring = sc;
  c.renormalize = renorm;
  c.routed_scale = scale;
  return c;
}

TEST(MoeRoute, SoftmaxNoGroups) {
  check_route(cfg(128, 4, 1, 1, RouterScoring::kSoftmax, true, 1.0), false, 1);
  check_route(cfg(16, 2, 1, 1, RouterScoring::kSoftmax, false, 2.5), false, 2);
}

TEST(MoeRoute, SoftmaxGroups) {
  check_route(cfg(64, 4, 8, 3, RouterScoring::kSoftmax, true, 1.5), false, 3);
}

TEST(MoeRoute, SigmoidGroupsWithBias) {  // DeepSeek-V3 shape, scaled down
  check_route(cfg(64, 6, 8, 4, RouterScoring::kSigmoid, true, 2.5), true, 4);
  check_route(cfg(32, 4, 4, 2, RouterScoring::kSigmoid, false, 1.0), true, 5);
}

// Sigmoid scores set by hand: group A = {0.5, .01, .01, .01} (max 0.5, top-2 0.51),
// group B = {0.3, 0.3, .01, .01} (max 0.3, top-2 0.6). Top-2 sums keep B.
TEST(MoeRoute, GroupScoreIsTopTwoSum) {
  const float s[8] = {0.5f, 0.01f, 0.01f, 0.01f, 0.3f, 0.3f, 0.01f, 0.01f};
  float logits[8];
  for (int e = 0; e < 8; ++e) logits[e] = std::log(s[e] / (1 - s[e]));
  MoeConfig c = cfg(8, 2, 2, 1, RouterScoring::kSigmoid, true, 1.0);
  int32_t ids[2];
  float w[2];
  moe_route(logits, 1, c, nullptr, ids, w);
  EXPECT_EQ(ids[0], 4);
  EXPECT_EQ(ids[1], 5);
  EXPECT_NEAR(w[0], 0.5f, 1e-6);
  // The bias steers selection only: +0.5 on expert 7 picks it, its weight stays p = 0.01.
  float bias[8] = {0, 0, 0, 0, 0, 0, 0, 0.5f};
  moe_route(logits, 1, c, bias, ids, w);
  EXPECT_EQ(ids[0], 7);
  EXPECT_EQ(ids[1], 4);
  EXPECT_NEAR(w[0], 0.01 / 0.31, 1e-6);
}

TEST(MoeRoute, BadConfigIsLoggedNotACrash) {
  MoeConfig c = cfg(10, 2, 3, 1, RouterScoring::kSoftmax, true, 1.0);  // 10 % 3 != 0
  std::vector<float> logits(10, 0.5f);
  int32_t ids[2] = {7, 7};
  float w[2] = {7, 7};
  moe_route(logits.data(), 1, c, nullptr, ids, w);
  EXPECT_EQ(ids[0], -1);
  EXPECT_EQ(ids[1], -1);
  EXPECT_EQ(w[0], 0.0f);
}

}  // namespace
}  // namespace ml4::cpu
