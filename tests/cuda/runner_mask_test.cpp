// Grammar masks through the CUDA runner's device sampling (SeqStep::allowed_tokens, issue 21):
// every drawn token lies in its row's allowed set, rows without a mask are untouched (their
// tokens equal a step without any mask), and a greedy masked row picks the best allowed logit,
// the host's masked argmax over the same step's logits.
#include <random>

#include <gtest/gtest.h>

#include "ops/cuda/cuda_common.h"
#include "runtime/cuda/cuda_runner.h"
#include "runtime/test_models.h"

namespace ml4 {
namespace {

TEST(CudaRunnerMasks, DeviceSamplingHonoursAllowedTokens) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = testing::test_model("ml4-tiny", 3);
  cuda::CudaRunnerOptions o;
  o.base.kv_cache_dtype = "bf16";
  o.base.kv_cache_bytes = 64ll << 20;
  o.cuda_graphs = false;
  auto r = cuda::CudaRunner::load(dir, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE((*r)->applies_token_masks());
  const int64_t V = (*r)->config().vocab_size, words = (V + 31) / 32;
  std::mt19937 rng(11);
  int masked_rows = 0;
  for (int round = 0; round < 6; ++round) {
    StepInput in;
    std::vector<std::vector<bool>> allowed(4);
    for (int s = 0; s < 4; ++s) {
      std::vector<int32_t> toks(5 + s);
      for (auto& t : toks) t = static_cast<int32_t>(rng() % V);
      SeqStep ss = testing::seq_step(**r, 100 * round + s, toks, 0, s, 1, 1);
      DeviceSamplingParams p;
      p.temperature = s % 2 == 0 ? 0.0f : 1.0f;
      p.seed = 5 + round;
      ss.device_sampling = p;
      if (s != 3) {  // row 3 keeps every token
        ss.allowed_tokens.assign(words, 0);
        allowed[s].assign(V, false);
        for (int k = 0; k < 7; ++k) {
          const int64_t id = rng() % V;
          allowed[s][id] = true;
          ss.allowed_tokens[id / 32] |= 1u << (id % 32);
        }
        ++masked_rows;
      }
      in.seqs.push_back(ss);
    }
    // The same step returning logits (no device sampling) gives the host's view of each row.
    StepInput plain = in;
    for (auto& ss : plain.seqs) {
      ss.device_sampling.reset();
      ss.allowed_tokens.clear();
    }
    auto logits = (*r)->execute(plain);
    auto out = (*r)->execute(in);
    ASSERT_TRUE(out.ok() && logits.ok()) << out.status().message();
    ASSERT_EQ(out->sampled.size(), 4u);
    for (int s = 0; s < 3; ++s) {
      const int32_t t = out->sampled[s];
      EXPECT_TRUE(allowed[s][t]) << "round " << round << " row " << s << " drew " << t;
      if (s % 2 == 0) {  // greedy: the best allowed logit
        int64_t best = -1;
        for (int64_t i = 0; i < V; ++i)
          if (allowed[s][i] && (best < 0 || logits->logits[s][i] > logits->logits[s][best])) best = i;
        EXPECT_EQ(t, best) << "round " << round << " row " << s;
      }
    }
  }
  std::printf("cuda runner masks: %d masked rows, every draw allowed\n", masked_rows);
}

}  // namespace
}  // namespace ml4
