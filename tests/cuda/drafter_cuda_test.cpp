// The DSpark drafter on the CUDA runner (exact numerics: f32 GEMV, f32 attention over the bf16
// drafter window) against the same float64 PyTorch golden as the CPU runner
// (tests/runtime/drafter_check.h: per-slot distributions within 5e-3 rel L2, greedy drafts
// equal up to rounding-level near-ties), and probabilistic drafts equal to the CPU runner's,
// token for token (both draw with the counter-based generator of ops/cpu/sampling.h from the
// same logits up to f32 rounding; a draw can only differ where a Gumbel race is decided within
// that rounding, which these few draws of a 8192-token vocabulary do not meet). And random
// requests verified on the device (CudaRunnerOptions::device_verification) equal the host
// verifier's through the engine.
#include <random>

#include <gtest/gtest.h>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/spec_decode.h"
#include "ops/cuda/cuda_common.h"
#include "runtime/cuda/cuda_runner.h"
#include "runtime/drafter_check.h"
#include "runtime/test_models.h"

namespace ml4 {
namespace {

Result<std::unique_ptr<cuda::CudaRunner>> cuda_drafter_runner() {
  cuda::CudaRunnerOptions o;
  o.base.kv_cache_dtype = "bf16";
  o.base.kv_cache_bytes = 64ll << 20;
  o.base.drafter = true;
  o.base.max_num_seqs = 4;
  o.exact_activations = true;
  return cuda::CudaRunner::load(testing::drafter_golden_model_dir(), o);
}

TEST(CudaDrafter, Ml4SmallDraftBlockMatchesPytorch) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  auto r = cuda_drafter_runner();
  ASSERT_TRUE(r.ok()) << r.status().message();
  testing::check_drafter_golden(**r, "cuda");
}

TEST(CudaDrafter, ProbabilisticDraftsEqualTheCpuRunners) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  auto g = cuda_drafter_runner();
  ASSERT_TRUE(g.ok()) << g.status().message();
  RunnerOptions ro;
  ro.kv_cache_dtype = "bf16";
  ro.kv_cache_bytes = 64ll << 20;
  ro.drafter = true;
  ro.max_num_seqs = 4;
  auto c = CpuRunner::load(testing::drafter_golden_model_dir(), ro);
  ASSERT_TRUE(c.ok()) << c.status().message();
  const ModelConfig& cfg = (*c)->config();
  const int B = cfg.drafter.block_size;
  std::mt19937 rng(7);
  std::vector<int32_t> prompt(90);
  for (auto& t : prompt) t = static_cast<int32_t>(rng() % cfg.vocab_size);
  std::vector<std::vector<int32_t>> tables;
  tables.assign((*c)->cache_groups().size(), {0, 1});
  SeqStep s;
  s.seq_id = 1;
  s.tokens = prompt;
  s.block_tables = tables;
  s.num_logits = 1;
  ASSERT_TRUE((*c)->execute(StepInput{{s}}).ok());
  ASSERT_TRUE((*g)->execute(StepInput{{s}}).ok());
  // top_p 0.95 (the kept-prefix cut first) and top_p 1 with min_p: both drawn on the device
  // (sampling.h draft_rows) and replayed as a graph after the first draft of the shape (top-p
  // drafts were host draws, without a graph, before the tenth session).
  for (const float top_p : {0.95f, 1.0f}) {
  int equal = 0, total = 0;
  const int64_t replays0 = (*g)->draft_replays();
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    DraftInput din;
    DraftSeq d;
    d.seq_id = 1;
    d.anchor_token = static_cast<int32_t>(rng() % cfg.vocab_size);
    d.anchor_pos = static_cast<int64_t>(prompt.size());
    d.block_tables = tables;
    d.num_drafts = B - 1;
    DeviceSamplingParams p;
    p.temperature = 1.0f;
    p.top_p = top_p;
    p.min_p = top_p < 1.0f ? 0.0f : 0.02f;
    p.seed = seed;
    d.sampling = p;
    din.seqs.push_back(d);
    din.want_probs = true;
    auto a = (*c)->draft(din);
    auto b = (*g)->draft(din);
    ASSERT_TRUE(a.ok() && b.ok());
    for (int j = 0; j < B - 1; ++j) {
      ++total;
      if (a->tokens[0][j] != b->tokens[0][j]) break;  // the chains diverge after a difference
      ++equal;
    }
  }
  // The two runners' logits agree to ~1e-6 relative (exact numerics, different summation
  // order), so a draw differs only where the uniform or the top-p cut falls within that
  // distance of a boundary of the (cumulative) distribution: rare, not impossible (one slot in
  // 50 with the current ml4-small). A systematic difference (a wrong row, a wrong counter)
  // diverges at the first slot of most of the 8 chains; one divergence is allowed.
  std::printf("cuda vs cpu probabilistic drafts (top_p %.2f): %d of %d compared slots equal, %lld graph replays\n",
              top_p, equal, total, static_cast<long long>((*g)->draft_replays() - replays0));
  EXPECT_GE(equal, total - 1);
  EXPECT_GE((*g)->draft_replays() - replays0, 6);  // the first draft of each kind captures
  }
}

// Greedy drafts run as CUDA graphs (CudaRunner::draft): over consecutive anchors (a window
// that slides, two sequences at once, then one, then two asking for fewer drafts), the replayed
// drafts equal those of a runner drafting eagerly, token for token (the same kernels on the
// same inputs), and replays happen.
TEST(CudaDrafter, GreedyDraftGraphsEqualEagerDrafts) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaRunnerOptions o;
  o.base.kv_cache_dtype = "bf16";
  o.base.kv_cache_bytes = 64ll << 20;
  o.base.drafter = true;
  o.base.max_num_seqs = 4;
  auto eager_o = o;
  eager_o.cuda_graphs = false;
  auto g = cuda::CudaRunner::load(testing::drafter_golden_model_dir(), o);
  auto e = cuda::CudaRunner::load(testing::drafter_golden_model_dir(), eager_o);
  ASSERT_TRUE(g.ok() && e.ok());
  const ModelConfig& cfg = (*g)->config();
  const int B = cfg.drafter.block_size;
  std::mt19937 rng(11);
  const int blocks = 8;  // 512 positions per sequence, in every group
  auto tables = [&](int seq) {
    std::vector<std::vector<int32_t>> t((*g)->cache_groups().size());
    for (size_t k = 0; k < t.size(); ++k)
      for (int b = 0; b < blocks; ++b) t[k].push_back(seq * blocks + b);
    return t;
  };
  // Both prefills eager (a padded prefill graph may round differently; what is compared here
  // is the draft's graph against the eager draft over the same caches).
  (*g)->set_cuda_graphs(false);
  for (int seq = 0; seq < 2; ++seq) {
    SeqStep s;
    s.seq_id = seq;
    for (int i = 0; i < 100 + 20 * seq; ++i) s.tokens.push_back(static_cast<int32_t>(rng() % cfg.vocab_size));
    s.block_tables = tables(seq);
    ASSERT_TRUE((*g)->execute(StepInput{{s}}).ok());
    ASSERT_TRUE((*e)->execute(StepInput{{s}}).ok());
  }
  (*g)->set_cuda_graphs(true);
  int compared = 0;
  // Steps 12..19 ask for 3 and 2 drafts: the Markov head runs 3 slots, a graph of its own.
  for (int step = 0; step < 20; ++step) {
    DraftInput din;
    for (int seq = 0; seq < (step < 8 || step >= 12 ? 2 : 1); ++seq) {
      DraftSeq d;
      d.seq_id = seq;
      d.anchor_token = static_cast<int32_t>(rng() % cfg.vocab_size);
      d.anchor_pos = 100 + 20 * seq + step;
      d.block_tables = tables(seq);
      d.num_drafts = step >= 12 ? 3 - seq : B - 1;
      din.seqs.push_back(d);
    }
    auto a = (*g)->draft(din);
    auto b = (*e)->draft(din);
    ASSERT_TRUE(a.ok()) << a.status().message();
    ASSERT_TRUE(b.ok()) << b.status().message();
    EXPECT_EQ(a->tokens, b->tokens) << "step " << step;
    compared += static_cast<int>(din.seqs.size());
  }
  EXPECT_GE((*g)->draft_replays(), 15);  // 20 draft steps of three shapes, the first of each captured
  EXPECT_EQ((*e)->draft_replays(), 0);
  std::printf("greedy draft graphs: %d blocks compared, %lld replays\n", compared,
              static_cast<long long>((*g)->draft_replays()));
}


// DSpark's rejection sampler on the device through the engine (ml4-small with its drafter,
// production numerics): seeded random requests (temperatures 0.7-1.2, min-p, a logprob
// request, a top-k one that stays on the host), probabilistic and greedy drafts, with device
// verification and without. The two runners compute the same logits and q (the same kernels
// in the same steps), and verify_rows decides as verify_drafts does up to f64 rounding, so
// every request's tokens are equal; logprobs within f32 rounding; the device did verify, and
// no kept q outlives its request (one is aborted mid-decode).
TEST(CudaDrafter, DeviceRejectionSamplingEqualsHostVerification) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(21);
  std::vector<std::pair<std::vector<int32_t>, SamplingParams>> reqs;
  for (int i = 0; i < 7; ++i) {
    std::vector<int32_t> prompt;
    for (int t = 0; t < 20 + 37 * i; ++t) prompt.push_back(3 + static_cast<int32_t>(rng() % 8000));
    SamplingParams p;
    p.temperature = 0.7 + 0.1 * i;
    p.max_tokens = 48;
    p.ignore_eos = true;
    p.seed = 500 + i;
    if (i == 2) p.min_p = 0.05;
    if (i == 4) p.logprobs = 0;
    if (i == 6) p.top_k = 40;  // not on the device: host rows beside device verification
    reqs.push_back({prompt, p});
  }
  for (bool prob : {true, false}) {
    auto run = [&](bool device, int64_t* verified) {
      cuda::CudaRunnerOptions o;
      o.base.kv_cache_dtype = "fp8_ds_mla";
      o.base.kv_cache_bytes = 256ll << 20;
      o.base.drafter = true;
      o.device_verification = device;
      auto cfg = ModelConfig{};
      EngineConfig c;
      c.scheduler.max_num_seqs = 8;
      c.scheduler.max_num_batched_tokens = 256;
      c.scheduler.max_model_len = 1024;
      c.speculative.method = "dspark";
      c.speculative.num_speculative_tokens = 7;
      c.speculative.probabilistic_drafts = prob;
      std::map<std::string, std::vector<int32_t>> toks;
      std::map<std::string, std::vector<TokenLogprob>> lps;
      setenv("ML4_DEVICE_VERIFY", device ? "1" : "0", 1);
      // The drafter group holds a window per sequence: the engine's max_num_seqs as the runner's.
      auto probe = cuda::CudaRunner::load(std::string(ML4_SOURCE_DIR) + "/assets/ml4-small", o);
      EXPECT_TRUE(probe.ok()) << probe.status().message();
      if (!probe.ok()) return toks;
      cfg = (*probe)->config();
      probe->reset();
      o.base.max_num_seqs = drafter_runner_seqs(c.scheduler.max_num_seqs, cfg);
      auto made = cuda::CudaRunner::load(std::string(ML4_SOURCE_DIR) + "/assets/ml4-small", o);
      unsetenv("ML4_DEVICE_VERIFY");
      EXPECT_TRUE(made.ok()) << made.status().message();
      if (!made.ok()) return toks;
      auto& r = *made;
      ByteTextCodec codec(cfg.vocab_size);
      Engine e(r.get(), &codec, c);
      EXPECT_TRUE(e.speculative());
      for (size_t i = 0; i < reqs.size(); ++i)
        EXPECT_TRUE(e.add_request("r" + std::to_string(i), reqs[i].first, reqs[i].second).ok());
      for (int i = 0; i < 20000 && e.has_work(); ++i) {
        if (i == 12) {
          EXPECT_TRUE(e.abort("r3"));  // mid-decode: its kept q must go with it
        }
        auto s = e.step();
        EXPECT_TRUE(s.ok()) << s.status().message();
        if (!s.ok()) break;
        for (auto& x : *s) {
          toks[x.request_id].insert(toks[x.request_id].end(), x.new_tokens.begin(), x.new_tokens.end());
          lps[x.request_id].insert(lps[x.request_id].end(), x.new_logprobs.begin(), x.new_logprobs.end());
        }
      }
      EXPECT_GT(e.counters().spec.num_accepted_tokens, 0);
      EXPECT_EQ(r->kept_q_count(), 0u);
      *verified = r->device_verifications();
      for (const auto& [id, l] : lps)
        for (size_t t = 0; t < l.size(); ++t) toks["lp_" + id].push_back(static_cast<int32_t>(std::lround(l[t].logprob * 1e4)));
      return toks;
    };
    int64_t dv = 0, hv = 0;
    const auto dev = run(true, &dv);
    const auto host = run(false, &hv);
    std::printf("%s drafts: %lld random verifications on the device\n", prob ? "probabilistic" : "greedy",
                static_cast<long long>(dv));
    EXPECT_GT(dv, 0);
    EXPECT_EQ(hv, 0);
    ASSERT_EQ(dev.size(), host.size());
    for (const auto& [id, t] : host) {
      if (id.rfind("lp_", 0) == 0) {  // logprobs x 1e4, rounded: f32 rounding apart (<= 1 unit)
        ASSERT_EQ(dev.at(id).size(), t.size()) << id;
        for (size_t i = 0; i < t.size(); ++i) EXPECT_LE(std::abs(dev.at(id)[i] - t[i]), 1) << id << " " << i;
        continue;
      }
      EXPECT_EQ(dev.at(id), t) << id << (prob ? " probabilistic" : " greedy");
      if (id != "r3") {
        EXPECT_EQ(t.size(), 48u) << id;
      }
    }
  }
}

}  // namespace
}  // namespace ml4
