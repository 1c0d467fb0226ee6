// Whole-model properties of the CPU forward on ml4-tiny (every layer kind): incremental
// decode equals recomputation for every KV dtype, KV-sharing consumers equal a model with
// private copies, indexer reuse, real sparsity, batch and chunking invariance, bad steps.
#include <algorithm>
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "runtime/test_models.h"

namespace ml4 {
namespace {

using testing::load_runner;
using testing::rel_l2;
using testing::seq_step;
using testing::test_model;

std::vector<int32_t> random_tokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

TEST(CpuModel, TinyPresetExercisesEveryLayerKind) {
  auto r = load_runner(test_model("ml4-tiny"));
  ASSERT_TRUE(r);
  const ModelConfig& c = r->config();
  int nope = 0, ssmax = 0, consumers = 0, owners = 0, reusers = 0, dense = 0, moe = 0;
  for (const auto& l : c.layers) {
    nope += !l.rope;
    ssmax += l.ssmax;
    consumers += !l.owns_kv();
    owners += l.indexer == IndexerRole::kOwner;
    reusers += l.indexer == IndexerRole::kReuser;
    dense += l.ffn == FfnKind::kDense;
    moe += l.ffn == FfnKind::kMoe;
  }
  EXPECT_GT(nope, 0);
  EXPECT_GT(ssmax, 0);
  EXPECT_GE(consumers, 2);
  EXPECT_GT(owners, 0);
  EXPECT_GT(reusers, 0);
  EXPECT_GT(dense, 0);
  EXPECT_GT(moe, 0);
  EXPECT_TRUE(c.lerope.enabled);
  EXPECT_TRUE(c.llama4_scaling.enabled);
  EXPECT_TRUE(c.yarn.enabled);
  EXPECT_LT(c.indexer.topk, 40);  // the prompts below are longer: attention is sparse
}

// Logits of step t from the cache equal a fresh prefill over all t+1 tokens. Both paths
// read keys back from identically quantized pages; they differ only in f32 summation
// order of batched vs single-row kernels, so the bound is f32-level (1e-4 relative leaves
// room for ~1e3 ulps of accumulated reordering through 12 layers). For FP8 caches a value
// that lands on an e4m3 rounding boundary could round differently; none does at this seed,
// and the same bound holds.
class IncrementalDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(IncrementalDecode, EqualsRecomputation) {
  const std::string dir = test_model("ml4-tiny");
  auto inc = load_runner(dir, GetParam());
  ASSERT_TRUE(inc);
  const int V = inc->config().vocab_size;
  std::vector<int32_t> tokens = random_tokens(37, V, 11);
  auto out = inc->execute(StepInput{{seq_step(*inc, 1, tokens, 0, 0, 2, 1)}});
  ASSERT_TRUE(out.ok()) << out.status().message();
  std::vector<float> logits = out->logits[0];
  for (int step = 0; step < 8; ++step) {
    // Recompute from scratch in a fresh cache.
    auto full = load_runner(dir, GetParam());
    auto ref = full->execute(StepInput{{seq_step(*full, 1, tokens, 0, 0, 2, 1)}});
    ASSERT_TRUE(ref.ok()) << ref.status().message();
    const double err = rel_l2(logits, ref->logits[0]);
    EXPECT_LT(err, 1e-4) << "step " << step << " kv " << GetParam();
    EXPECT_EQ(testing::argmax(logits, 0, V), testing::argmax(ref->logits[0], 0, V));
    const int32_t next = testing::argmax(logits, 0, V);
    const int64_t pos = static_cast<int64_t>(tokens.size());
    tokens.push_back(next);
    out = inc->execute(StepInput{{seq_step(*inc, 1, {next}, pos, 0, 2, 1)}});
    ASSERT_TRUE(out.ok()) << out.status().message();
    logits = out->logits[0];
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, IncrementalDecode, ::testing::Values("fp8_ds_mla", "fp8", "bf16"));

TEST(CpuModel, KvSharingEqualsPrivateCopies) {
  const std::string dir = test_model("ml4-tiny");
  auto shared = load_runner(dir, "fp8_ds_mla");
  auto copies = load_runner(dir, "fp8_ds_mla", /*duplicate_shared_kv=*/true);
  ASSERT_TRUE(shared && copies);
  // The copies model really holds more latent layers.
  const auto& sl = shared->kv_spec().groups[shared->kv_spec().group_index(CacheGroupSpec::kLatent)];
  const auto& cl = copies->kv_spec().groups[copies->kv_spec().group_index(CacheGroupSpec::kLatent)];
  EXPECT_GT(cl.layers.size(), sl.layers.size());
  const int V = shared->config().vocab_size;
  std::vector<int32_t> tokens = random_tokens(45, V, 5);
  auto a = shared->execute(StepInput{{seq_step(*shared, 1, tokens, 0, 0, 1, 45)}});
  auto b = copies->execute(StepInput{{seq_step(*copies, 1, tokens, 0, 0, 1, 45)}});
  ASSERT_TRUE(a.ok() && b.ok());
  // Same arithmetic on the same bytes: bit-identical.
  EXPECT_EQ(a->logits[0], b->logits[0]);
}

TEST(CpuModel, IndexerReuseAndSparsity) {
  auto r = load_runner(test_model("ml4-tiny"), "fp8_ds_mla");
  const ModelConfig& c = r->config();
  const int n = 50;
  std::vector<int32_t> tokens = random_tokens(n, c.vocab_size, 3);
  ForwardTrace trace;
  auto out = r->execute_traced(StepInput{{seq_step(*r, 1, tokens, 0, 0, 1, 1)}}, &trace);
  ASSERT_TRUE(out.ok()) << out.status().message();
  int reusers = 0;
  for (const auto& l : c.layers) {
    const auto& tk = trace.topk[l.index];
    if (!l.sparse()) {
      EXPECT_TRUE(tk.empty());
      continue;
    }
    ASSERT_EQ(static_cast<int>(tk.size()), n);
    for (int t = 0; t < n; ++t) {
      // Causal and exactly min(topk, p+1) distinct keys.
      EXPECT_EQ(static_cast<int>(tk[t].size()), std::min(c.indexer.topk, t + 1));
      EXPECT_TRUE(std::is_sorted(tk[t].begin(), tk[t].end()));
      EXPECT_TRUE(std::adjacent_find(tk[t].begin(), tk[t].end()) == tk[t].end());
      EXPECT_LE(tk[t].back(), t);
    }
    if (l.indexer == IndexerRole::kReuser) {
      ++reusers;
      EXPECT_EQ(tk, trace.topk[l.indexer_source]) << "layer " << l.index;
    }
  }
  EXPECT_GT(reusers, 0);
  // Different owners select differently (the selection depends on the layer's own keys).
  std::vector<int> owners;
  for (const auto& l : c.layers)
    if (l.indexer == IndexerRole::kOwner) owners.push_back(l.index);
  ASSERT_GE(owners.size(), 2u);
  EXPECT_NE(trace.topk[owners[0]][n - 1], trace.topk[owners[1]][n - 1]);
}

// Two sequences in one step give the same logits as each alone, and a prompt in three
// chunks gives the same logits as in one: f32-level bound as above.
TEST(CpuModel, BatchAndChunkInvariance) {
  const std::string dir = test_model("ml4-tiny");
  auto r = load_runner(dir, "fp8_ds_mla");
  const int V = r->config().vocab_size;
  auto t1 = random_tokens(30, V, 21), t2 = random_tokens(41, V, 22);
  auto both = r->execute(StepInput{{seq_step(*r, 1, t1, 0, 0, 1, 1), seq_step(*r, 2, t2, 0, 4, 1, 1)}});
  ASSERT_TRUE(both.ok()) << both.status().message();
  auto r1 = load_runner(dir, "fp8_ds_mla");
  auto a1 = r1->execute(StepInput{{seq_step(*r1, 1, t1, 0, 7, 1, 1)}});
  auto r2 = load_runner(dir, "fp8_ds_mla");
  auto a2 = r2->execute(StepInput{{seq_step(*r2, 2, t2, 0, 0, 1, 1)}});
  EXPECT_LT(rel_l2(both->logits[0], a1->logits[0]), 1e-4);
  EXPECT_LT(rel_l2(both->logits[1], a2->logits[0]), 1e-4);
  auto rc = load_runner(dir, "fp8_ds_mla");
  std::vector<int32_t> c1(t2.begin(), t2.begin() + 10), c2(t2.begin() + 10, t2.begin() + 25), c3(t2.begin() + 25, t2.end());
  ASSERT_TRUE(rc->execute(StepInput{{seq_step(*rc, 2, c1, 0, 0, 1, 0)}}).ok());
  ASSERT_TRUE(rc->execute(StepInput{{seq_step(*rc, 2, c2, 10, 0, 1, 0)}}).ok());
  auto last = rc->execute(StepInput{{seq_step(*rc, 2, c3, 25, 0, 1, 1)}});
  ASSERT_TRUE(last.ok());
  EXPECT_LT(rel_l2(last->logits[0], a2->logits[0]), 1e-4);
}

TEST(CpuModel, BadStepsAreRejectedAndTheRunnerGoesOn) {
  auto r = load_runner(test_model("ml4-tiny"), "bf16");
  const int V = r->config().vocab_size;
  auto bad_id = r->execute(StepInput{{seq_step(*r, 1, {1, V}, 0, 0, 1, 1)}});
  ASSERT_FALSE(bad_id.ok());
  EXPECT_NE(bad_id.status().message().find("outside the vocabulary"), std::string::npos);
  auto short_table = r->execute(StepInput{{seq_step(*r, 1, random_tokens(70, V, 1), 0, 0, 1, 1)}});
  ASSERT_FALSE(short_table.ok());
  EXPECT_NE(short_table.status().message().find("covers 64 tokens, needs 70"), std::string::npos);
  auto bad_block = r->execute(StepInput{{seq_step(*r, 1, {1, 2}, 0, 1 << 30, 1, 1)}});
  ASSERT_FALSE(bad_block.ok());
  EXPECT_NE(bad_block.status().message().find("block id"), std::string::npos);
  auto good = r->execute(StepInput{{seq_step(*r, 1, {1, 2, 3}, 0, 0, 1, 1)}});
  ASSERT_TRUE(good.ok());
  for (float v : good->logits[0]) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace ml4
