// HiSparse (SYSTEM.md S12) on the CPU runner: the same steps through a runner whose latent
// cache is the host pool and whose attention reads hot buffers (offload/hisparse.h) give the
// same logits, bit for bit, as a runner without offload: the same rows are read in the same
// order. ml4-tiny (top-k 16, KV-sharing consumers 7 and 11, indexer reusers) with contexts of
// 200-400 tokens against hot buffers of 48 rows, so rows are evicted and reloaded all the time;
// prefill chunks overflow the buffers (read from the host pool), decode and 3-token
// verification steps go through them, and a step that starts inside the previous one (the
// verifier rejected drafts) rewrites rows the buffers hold.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "runtime/test_models.h"

namespace ml4 {
namespace {

using testing::seq_step;
using testing::test_model;

std::unique_ptr<CpuRunner> runner(const std::string& dir, bool hisparse, int hot_slots) {
  RunnerOptions ro;
  ro.kv_cache_dtype = "fp8_ds_mla";
  ro.kv_cache_bytes = 64ll << 20;
  ro.max_num_seqs = 4;
  if (hisparse) {
    ro.hisparse.enabled = true;
    ro.hisparse.host_pool_bytes = 64ll << 20;
    ro.hisparse.hot_slots_per_request = hot_slots;
  }
  auto r = CpuRunner::load(dir, ro);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : nullptr;
}

bool bit_equal(const StepOutput& a, const StepOutput& b) {
  if (a.logits.size() != b.logits.size()) return false;
  for (size_t i = 0; i < a.logits.size(); ++i) {
    if (a.logits[i].size() != b.logits[i].size()) return false;
    if (std::memcmp(a.logits[i].data(), b.logits[i].data(), a.logits[i].size() * 4) != 0) return false;
  }
  return true;
}

TEST(HiSparseRunner, LogitsEqualWithoutOffloadBitForBit) {
  const std::string dir = test_model("ml4-tiny", 11);
  auto plain = runner(dir, false, 0);
  auto hs = runner(dir, true, 48);
  ASSERT_TRUE(plain && hs);
  ASSERT_NE(hs->hisparse(), nullptr);
  const int V = plain->config().vocab_size;
  std::mt19937 rng(5);
  auto tok = [&] { return static_cast<int32_t>(3 + rng() % (V - 3)); };
  const std::vector<int> prompt_len{300, 200, 257};
  std::vector<std::vector<int32_t>> prompts(3);
  for (int i = 0; i < 3; ++i)
    for (int p = 0; p < prompt_len[i]; ++p) prompts[i].push_back(tok());
  std::vector<int64_t> pos(3, 0);
  int steps = 0;
  auto run = [&](const StepInput& in) {
    auto a = plain->execute(in);
    auto b = hs->execute(in);
    ASSERT_TRUE(a.ok()) << a.status().message();
    ASSERT_TRUE(b.ok()) << b.status().message();
    EXPECT_TRUE(bit_equal(a.value(), b.value())) << "step " << steps;
    ++steps;
  };
  // Chunked prefill, 100 tokens per sequence per step.
  while (pos[0] < prompt_len[0] || pos[1] < prompt_len[1] || pos[2] < prompt_len[2]) {
    StepInput in;
    for (int i = 0; i < 3; ++i) {
      if (pos[i] >= prompt_len[i]) continue;
      const int64_t n = std::min<int64_t>(100, prompt_len[i] - pos[i]);
      std::vector<int32_t> chunk(prompts[i].begin() + pos[i], prompts[i].begin() + pos[i] + n);
      in.seqs.push_back(seq_step(*plain, i, chunk, pos[i], i * 8, 8, pos[i] + n == prompt_len[i] ? 1 : 0));
      pos[i] += n;
    }
    run(in);
  }
  const int64_t direct_after_prefill = hs->hisparse()->direct_layers;
  EXPECT_GT(direct_after_prefill, 0);  // 100-token chunks overflow 48 rows
  // Decode: one token per sequence per step.
  for (int s = 0; s < 40; ++s) {
    StepInput in;
    for (int i = 0; i < 3; ++i) in.seqs.push_back(seq_step(*plain, i, {tok()}, pos[i]++, i * 8, 8, 1));
    run(in);
  }
  // Verification-like steps of 3 tokens; sequence 0 then keeps only the first (the rows of
  // the other two are rewritten by the next step with other tokens).
  for (int s = 0; s < 12; ++s) {
    StepInput in;
    for (int i = 0; i < 3; ++i) in.seqs.push_back(seq_step(*plain, i, {tok(), tok(), tok()}, pos[i], i * 8, 8, 3));
    run(in);
    for (int i = 0; i < 3; ++i) pos[i] += i == 0 ? 1 : 3;
  }
  const HiSparseState& st = *hs->hisparse();
  EXPECT_EQ(st.direct_layers, direct_after_prefill);  // decode and verification fit the buffers
  EXPECT_GT(st.hot_layers, 0);
  EXPECT_GT(st.loads, 0);
  EXPECT_GT(st.hits, 0);
  // The buffers hold 3 x 12 layers x 48 rows; far more rows were loaded, so rows were evicted
  // and loaded again (random weights select with little locality: most rows are misses).
  EXPECT_GT(st.loads, 3 * st.layers() * st.slots());
  EXPECT_EQ(st.regions_in_use(), 3);
  for (int i = 0; i < 3; ++i) hs->release(i);
  EXPECT_EQ(st.regions_in_use(), 0);
  EXPECT_EQ(st.resident_rows(), 0);
  std::printf("HiSparse runner: %d steps, hot layer-steps %lld, direct %lld, rows loaded %lld, hits %lld\n", steps,
              static_cast<long long>(st.hot_layers), static_cast<long long>(st.direct_layers),
              static_cast<long long>(st.loads), static_cast<long long>(st.hits));
}

TEST(HiSparseRunner, RefusesWhatItCannotServe) {
  RunnerOptions ro;
  ro.kv_cache_bytes = 64ll << 20;
  ro.max_num_seqs = 4;
  ro.hisparse.enabled = true;
  ro.hisparse.host_pool_bytes = 64ll << 20;
  ro.hisparse.hot_slots_per_request = 8;  // below ml4-tiny's top-k of 16
  auto r = CpuRunner::load(test_model("ml4-tiny", 11), ro);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("top-k"), std::string::npos) << r.status().message();
  ro.hisparse.hot_slots_per_request = 32;
  ro.kv_cache_bytes = 1 << 16;  // the hot buffers alone exceed it
  r = CpuRunner::load(test_model("ml4-tiny", 11), ro);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("do not fit"), std::string::npos) << r.status().message();
  ro.kv_cache_bytes = 64ll << 20;
  ro.hisparse.host_pool_bytes = 1000;  // less than one block
  r = CpuRunner::load(test_model("ml4-tiny", 11), ro);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("holds no block"), std::string::npos) << r.status().message();
  ro.hisparse.host_pool_bytes = 64ll << 20;
  r = CpuRunner::load(test_model("mistral4-tiny", 11), ro);  // attends every key
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("DSA"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace ml4
