// The parallel plan (parallel/parallel_plan.h) on the full ml4 preset at TP 8, TP 8 + EP 8
// and DP 8 + EP 8: what each rank holds and how many bytes, checked against the single
// process's bytes (every split tensor's slices add up to the whole, replicated ones are
// whole on every rank) and against counts written out from the config; and the rank layout.
#include <gtest/gtest.h>

#include "model/presets.h"
#include "model/weight_names.h"
#include "parallel/parallel_plan.h"

namespace ml4 {
namespace {

ParallelPlan plan_for(const ModelConfig& cfg, int tp, int dp, bool ep, int rank) {
  ParallelConfig pc;
  pc.tensor_parallel_size = tp;
  pc.data_parallel_size = dp;
  pc.enable_expert_parallel = ep;
  auto L = RankLayout::make(pc, tp * dp, rank);
  EXPECT_TRUE(L.ok()) << L.status().message();
  auto p = ParallelPlan::make(cfg, *L);
  EXPECT_TRUE(p.ok()) << p.status().message();
  return std::move(p).value();
}

// FP8 block bytes of an [N, K] linear: one byte per weight, one f32 per 128 x 128 block.
int64_t fp8(int64_t N, int64_t K) { return N * K + 4 * ((N + 127) / 128) * ((K + 127) / 128); }

struct Ml4 : ::testing::Test {
  void SetUp() override {
    auto c = preset_config("ml4");
    ASSERT_TRUE(c.ok()) << c.status().message();
    cfg = *c;
    whole = plan_for(cfg, 1, 1, false, 0).weight_bytes();
    for (const auto& l : cfg.layers) moe_layers += l.ffn == FfnKind::kMoe;
  }
  ModelConfig cfg;
  RankWeightBytes whole;
  int64_t moe_layers = 0;
};

TEST_F(Ml4, Tp8SplitsHeadsVocabularyAndFfnInWholeBlocks) {
  ASSERT_EQ(cfg.n_heads, 64);
  ASSERT_EQ(cfg.moe.expert_hidden_dim, 5632);  // 44 blocks of 128
  ASSERT_EQ(moe_layers, 71);
  RankWeightBytes sum;
  for (int q = 0; q < 8; ++q) {
    ParallelPlan p = plan_for(cfg, 8, 1, false, q);
    EXPECT_EQ(p.heads(), 8);
    EXPECT_EQ(p.head_begin(), 8 * q);
    EXPECT_EQ(p.vocab(), 16384);
    EXPECT_EQ(p.vocab_begin(), 16384 * q);
    EXPECT_EQ(p.experts(), 128);  // no EP: every rank runs every expert's slice
    EXPECT_EQ(p.local_config().n_heads, 8);
    // 44 blocks over 8 ranks: 6 6 6 6 5 5 5 5.
    const int64_t rows = (q < 4 ? 6 : 5) * 128;
    EXPECT_EQ(p.shard().expert_hidden, rows);
    EXPECT_EQ(p.shard().expert_hidden_begin, q < 4 ? 768 * q : 3072 + 640 * (q - 4));
    EXPECT_EQ(p.local_config().moe.expert_hidden_dim, rows);
    EXPECT_EQ(p.shard().dense, 2048);  // 16384 / 8
    const RankWeightBytes b = p.weight_bytes();
    // Routed experts: w1, w3 [rows, 6144] and w2 [6144, rows] of all 128 experts, 71 layers.
    EXPECT_EQ(b.routed_experts, moe_layers * 128 * (2 * fp8(rows, 6144) + fp8(6144, rows)));
    EXPECT_EQ(b.shared_experts, moe_layers * (2 * fp8(rows, 6144) + fp8(6144, rows)));
    // Replicated: the router and the norms are whole on every rank.
    EXPECT_EQ(b.router, whole.router);
    EXPECT_EQ(b.norms, whole.norms);
    // Embedding (bf16) and output (bf16): 16384 rows of 6144 each.
    EXPECT_EQ(b.embedding, 2 * 16384 * 6144 * 2);
    sum.attention += b.attention;
    sum.dense_ffn += b.dense_ffn;
    sum.routed_experts += b.routed_experts;
    sum.shared_experts += b.shared_experts;
    sum.embedding += b.embedding;
  }
  // Every split tensor's slices add up to the whole (blocks are never cut, so scales too).
  EXPECT_EQ(sum.routed_experts, whole.routed_experts);
  EXPECT_EQ(sum.shared_experts, whole.shared_experts);
  EXPECT_EQ(sum.dense_ffn, whole.dense_ffn);
  EXPECT_EQ(sum.embedding, whole.embedding);
  // Attention: the query, wkv_b, wo and SSMax are split, the KV and indexer projections are
  // replicated, so 8 ranks hold the whole split part once and the replicated part 8 times.
  int64_t replicated = 0;
  for (const auto& l : cfg.layers) {
    if (l.owns_kv()) replicated += fp8(512 + 64, 6144) + 512 * 4;  // wkv_a_with_mqa, kv_a_norm counted in norms
    if (l.indexer == IndexerRole::kOwner)
      replicated += fp8(32 * 128, 6144) + fp8(128, 6144) + 32 * 6144 * 2;  // wq, wk, weights_proj (bf16)
  }
  // kv_a_norm is a norm (RankWeightBytes::norms), so take it back out.
  for (const auto& l : cfg.layers)
    if (l.owns_kv()) replicated -= 512 * 4;
  EXPECT_EQ(sum.attention, whole.attention + 7 * replicated);
}

TEST_F(Ml4, Ep8PlacesSixteenExpertsPerRank) {
  for (int tp : {8, 1}) {  // -tp 8 --enable-expert-parallel, and -dp 8 --enable-expert-parallel
    const int dp = 8 / tp;
    RankWeightBytes sum;
    for (int r = 0; r < 8; ++r) {
      ParallelPlan p = plan_for(cfg, tp, dp, true, r);
      EXPECT_EQ(p.ep_size(), 8);
      EXPECT_EQ(p.ep_rank(), r);
      EXPECT_EQ(p.expert_begin(), 16 * r);
      EXPECT_EQ(p.experts(), 16);
      for (int e = 0; e < 128; ++e) EXPECT_EQ(p.expert_owner(e), e / 16) << e;
      EXPECT_EQ(p.shard().expert_hidden, -1);  // experts whole on their owner
      const RankWeightBytes b = p.weight_bytes();
      EXPECT_EQ(b.routed_experts, moe_layers * 16 * (2 * fp8(5632, 6144) + fp8(6144, 5632)));
      if (tp == 1) {  // DP: attention, embedding, dense and shared experts whole on every rank
        EXPECT_EQ(p.heads(), 64);
        EXPECT_EQ(b.attention, whole.attention);
        EXPECT_EQ(b.embedding, whole.embedding);
        EXPECT_EQ(b.shared_experts, whole.shared_experts);
        EXPECT_EQ(b.dense_ffn, whole.dense_ffn);
        EXPECT_EQ(p.dispatch_range(37), std::make_pair(int64_t{0}, int64_t{37}));
      } else {  // TP 8: each rank dispatches its eighth of the (replicated) tokens
        EXPECT_EQ(p.heads(), 8);
        const auto [b0, b1] = p.dispatch_range(37);  // 37 = 8 x 4 + 5: ranks 0-4 take 5, 5-7 take 4
        EXPECT_EQ(b1 - b0, r < 5 ? 5 : 4);
        EXPECT_EQ(b0, r < 5 ? 5 * r : 25 + 4 * (r - 5));
      }
      sum.routed_experts += b.routed_experts;
    }
    EXPECT_EQ(sum.routed_experts, whole.routed_experts);
    // Per rank, far below one H200: the reason the preset runs with EP.
    EXPECT_LT(plan_for(cfg, tp, dp, true, 0).weight_bytes().total(), 141ll << 30);
  }
}

TEST(ParallelPlan, UnevenExpertPlacementAndErrors) {
  auto c = preset_config("ml4-tiny");
  ASSERT_TRUE(c.ok());
  ModelConfig cfg = *c;  // 8 experts
  cfg.moe.num_experts = 8;
  ParallelConfig pc;
  pc.data_parallel_size = 3;
  pc.enable_expert_parallel = true;
  std::vector<int> owners;
  for (int r = 0; r < 3; ++r) {
    auto L = RankLayout::make(pc, 3, r);
    ASSERT_TRUE(L.ok());
    auto p = ParallelPlan::make(cfg, *L);
    ASSERT_TRUE(p.ok()) << p.status().message();
    EXPECT_EQ(p->experts(), r < 2 ? 3 : 2);  // 8 = 3 + 3 + 2
    EXPECT_EQ(p->expert_begin(), r == 0 ? 0 : r == 1 ? 3 : 6);
    if (r == 0)
      for (int e = 0; e < 8; ++e) owners.push_back(p->expert_owner(e));
  }
  EXPECT_EQ(owners, (std::vector<int>{0, 0, 0, 1, 1, 1, 2, 2}));
  // Heads that do not divide, DP without EP, a world that does not match.
  pc = {};
  pc.tensor_parallel_size = 3;
  auto L = RankLayout::make(pc, 3, 0);
  ASSERT_TRUE(L.ok());
  auto bad = ParallelPlan::make(cfg, *L);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("n_heads = 4 is not divisible by 3"), std::string::npos) << bad.status().message();
  pc = {};
  pc.data_parallel_size = 2;
  EXPECT_NE(RankLayout::make(pc, 2, 0).status().message().find("needs --enable-expert-parallel"), std::string::npos);
  pc.enable_expert_parallel = true;
  EXPECT_NE(RankLayout::make(pc, 4, 0).status().message().find("mpirun -np 2"), std::string::npos);
}

TEST(RankLayout, GroupsFollowVllmOrder) {
  ParallelConfig pc;
  pc.tensor_parallel_size = 2;
  pc.data_parallel_size = 2;
  pc.enable_expert_parallel = true;
  auto L = RankLayout::make(pc, 4, 3);
  ASSERT_TRUE(L.ok());
  EXPECT_EQ(L->tp_rank, 1);
  EXPECT_EQ(L->dp_rank, 1);
  EXPECT_EQ(L->ep_rank, 3);
  EXPECT_EQ(L->tp_group, (std::vector<int>{2, 3}));
  EXPECT_EQ(L->dp_group, (std::vector<int>{1, 3}));
  EXPECT_EQ(L->ep_group, (std::vector<int>{0, 1, 2, 3}));
  const std::string d = L->describe();
  EXPECT_NE(d.find("rank 3: dp 1 tp 1 ep 3"), std::string::npos) << d;
  EXPECT_NE(d.find("world 4 = dp 2 x tp 2"), std::string::npos) << d;
}

}  // namespace
}  // namespace ml4
