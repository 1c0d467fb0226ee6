// DSpark speculative decoding on the real CPU runner (its drafter, its draft() and its K/V
// caches), every model family:
//   - ml4-tiny (its preset carries an `mtp` block; make-model writes mtp_dspark.* tensors);
//   - the mistral4-tiny and dsv32-tiny shapes, which have no drafter as presets: the test writes
//     their config as a native params.json with an `mtp` block added (query LoRA and no DSA,
//     resp. DSA with sigmoid routing, under a drafter) and make-model writes random weights;
//   - assets/ml4-small, the trained model (greedy acceptance ~1.3 tokens per step here).
// Greedy is lossless: token for token what the engine gives without drafts (each request
// alone), for a batch of mixed lengths with prefix-cache hits, chunked prefill, preemption
// (a KV cache smaller than the batch needs) and aborts; then every cache group is back at its
// idle block count. Sampling is lossless on a small vocabulary (ml4-tiny with 6 ids, the real
// drafter's q): chi-square on the joint of 3 tokens. No leaks after 1,000 mixed requests with
// aborts on ml4-tiny.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "engine/chi_square.h"
#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/sampling_exact_dist.h"
#include "engine/spec_decode.h"
#include "model/config_loader.h"
#include "model/config_overrides.h"
#include "model/random_checkpoint.h"
#include "runtime/cpu/cpu_runner.h"
#include "tokenizer/tokenizer.h"

namespace ml4 {
namespace {


std::string temp_dir(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("ml4_spec_" + name + "_" + std::to_string(::getpid()))).string();
}

std::vector<std::string>& made_dirs() {
  static std::vector<std::string> d;
  return d;
}
struct CleanUp : ::testing::Environment {
  void TearDown() override {
    std::error_code ec;
    for (const auto& d : made_dirs()) std::filesystem::remove_all(d, ec);
  }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new CleanUp);

// A model directory of `family` with a DSpark drafter (written once per process).
std::string family_model(const std::string& family, const std::vector<std::string>& overrides = {}) {
  static std::map<std::string, std::string> made;
  std::string key = family;
  for (const auto& o : overrides) key += "," + o;
  if (auto it = made.find(key); it != made.end()) return it->second;
  if (family == "ml4-small") return made[key] = std::string(ML4_SOURCE_DIR) + "/assets/ml4-small";
  MakeModelOptions o;
  o.out_dir = temp_dir(std::to_string(made.size()) + "_" + family);
  o.seed = 3;
  if (family == "ml4-tiny") {
    o.preset = family;
    o.overrides = overrides;
  } else {
    auto cfg = resolve_model_config(family, "", overrides);
    EXPECT_TRUE(cfg.ok()) << cfg.status().message();
    cfg->drafter.enabled = true;
    cfg->drafter.n_layers = 1;
    cfg->drafter.block_size = 4;
    cfg->drafter.target_layers.clear();  // the last (up to) three layers
    for (int l = std::max(0, cfg->n_layers - 3); l < cfg->n_layers; ++l) cfg->drafter.target_layers.push_back(l);
    cfg->drafter.window = 64;
    cfg->drafter.rnn_rank = 32;
    o.params_text = params_json_from_config(*cfg);
  }
  Status s = make_model(o);
  EXPECT_TRUE(s.ok()) << family << ": " << s.message();
  made_dirs().push_back(o.out_dir);
  return made[key] = o.out_dir;
}

// A runner with its drafter and `full_blocks` blocks in every full-attention group.
std::unique_ptr<ModelRunner> load(const std::string& dir, int max_seqs, int64_t full_blocks) {
  auto cfg = load_model_config(dir);
  EXPECT_TRUE(cfg.ok()) << cfg.status().message();
  RunnerOptions ro;
  ro.drafter = true;
  ro.max_num_seqs = drafter_runner_seqs(max_seqs, *cfg);
  ro.kv_cache_bytes = 256ll << 20;
  auto probe = load_cpu_runner(dir, ro);
  EXPECT_TRUE(probe.ok()) << probe.status().message();
  if (!probe.ok()) return nullptr;
  int64_t full = 0, window = 0;
  for (const auto& g : (*probe)->cache_groups()) {
    if (g.sliding_window == 0) full += g.bytes_per_token * g.page_tokens;
    else window += g.bytes_per_token * g.page_tokens * g.num_blocks;
  }
  probe->reset();
  ro.kv_cache_bytes = window + full * full_blocks;
  auto r = load_cpu_runner(dir, ro);
  EXPECT_TRUE(r.ok()) << r.status().message();
  if (!r.ok()) return nullptr;
  EXPECT_TRUE((*r)->has_drafter());
  for (const auto& g : (*r)->cache_groups()) EXPECT_EQ(g.sliding_window == 0 ? full_blocks : g.num_blocks, g.num_blocks);
  return std::move(r).value();
}

EngineConfig config(int seqs, int64_t budget, bool prefix, int drafts, bool probabilistic = false) {
  EngineConfig c;
  c.scheduler.max_num_seqs = seqs;
  c.scheduler.max_num_batched_tokens = budget;
  c.scheduler.max_model_len = 512;
  c.enable_prefix_caching = prefix;
  c.seed = 5;
  if (drafts > 0) {
    c.speculative.method = "dspark";
    c.speculative.num_speculative_tokens = drafts;
    c.speculative.probabilistic_drafts = probabilistic;
  }
  return c;
}

using testing::greedy;

using Outputs = std::map<std::string, std::vector<int32_t>>;

// Prompts of mixed lengths; every third one starts with a 70-token shared prefix (a full
// 64-token page: prefix-cache hits). ml4-small gets English text from its own tokenizer.
std::vector<std::vector<int32_t>> make_prompts(const std::string& family, const std::string& dir, int vocab, int n) {
  std::mt19937 rng(41);
  std::vector<std::vector<int32_t>> out;
  if (family == "ml4-small") {
    auto tok = Tokenizer::load(dir + "/tekken.json");
    EXPECT_TRUE(tok.ok()) << tok.status().message();
    const std::vector<std::string> texts = {
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families",
        "In the beginning God created the heaven and the earth.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "To be, or not to be, that is the question:",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        "SELECT name FROM users WHERE id = 1;",
        "And God said, Let there be light: and there was light.",
        "Vim is a highly configurable text editor built to make creating and changing any kind of text very efficient.",
    };
    std::vector<int32_t> stream;  // all texts, one after the other
    for (const auto& t : texts) {
      auto ids = (*tok)->encode(t + "\n");
      stream.insert(stream.end(), ids.begin(), ids.end());
    }
    std::vector<int32_t> shared = {(*tok)->bos_id()};
    shared.insert(shared.end(), stream.begin(), stream.begin() + 65);
    for (int i = 0; i < n; ++i) {
      // As the random prompts below: shared prefix + 1..6 tokens, or 44..58 tokens.
      std::vector<int32_t> p = i % 3 == 0 ? shared : std::vector<int32_t>{(*tok)->bos_id()};
      const size_t from = i % 3 == 0 ? 65 : static_cast<size_t>(13 * i) % (stream.size() - 60);
      const size_t len = i % 3 == 0 ? 1 + i % 6 : 43 + (i * 5) % 15;
      p.insert(p.end(), stream.begin() + from, stream.begin() + from + len);
      out.push_back(p);
    }
    return out;
  }
  std::uniform_int_distribution<int32_t> d(3, vocab - 1);
  std::vector<int32_t> shared(66);
  for (auto& t : shared) t = d(rng);
  for (int i = 0; i < n; ++i) {
    // Shared: 66 + 1..6 tokens; others 44..58, so decoding crosses into a second page.
    std::vector<int32_t> p = i % 3 == 0 ? shared : std::vector<int32_t>{};
    const int len = i % 3 == 0 ? 1 + i % 6 : 44 + (i * 5) % 15;
    for (int k = 0; k < len; ++k) p.push_back(d(rng));
    out.push_back(p);
  }
  return out;
}

void greedy_is_lossless(const std::string& family, double min_acceptance_length) {
  const std::string dir = family_model(family);
  constexpr int kSeqs = 5, kRequests = 8;
  // 7 blocks of 64 tokens per full group: 5 running requests of 44..72 prompt tokens that
  // grow past 64 need more than that once they decode, so the scheduler preempts.
  auto runner = load(dir, kSeqs, 7);
  ASSERT_TRUE(runner);
  const int V = runner->config().vocab_size;
  const int B = runner->config().drafter.block_size;
  ByteTextCodec codec(V);  // ids are raw; the codec only serves stop checks here
  const auto prompts = make_prompts(family, dir, V, kRequests);
  auto params = [&](int i) { return greedy(14 + (i * 3) % 7); };

  Outputs ref;
  {
    Engine e(runner.get(), &codec, config(1, 4096, false, 0));
    for (int i = 0; i < kRequests; ++i) {
      const std::string id = "r" + std::to_string(i);
      ASSERT_TRUE(e.add_request(id, prompts[i], params(i)).ok());
      while (e.has_work()) {
        auto out = e.step();
        ASSERT_TRUE(out.ok()) << out.status().message();
        for (auto& o : *out) ref[o.request_id].insert(ref[o.request_id].end(), o.new_tokens.begin(), o.new_tokens.end());
      }
    }
  }
  Engine e(runner.get(), &codec, config(kSeqs, 48, true, B - 1));
  ASSERT_TRUE(e.speculative());
  std::vector<int64_t> free0;
  for (int g = 0; g < e.blocks().num_groups(); ++g) free0.push_back(e.blocks().num_free_blocks(g));
  for (int i = 0; i < kRequests; ++i) ASSERT_TRUE(e.add_request("r" + std::to_string(i), prompts[i], params(i)).ok());
  Outputs got;
  std::set<std::string> aborted;
  for (int step = 0; e.has_work(); ++step) {
    if (step == 6) {
      aborted.insert("r4");
      EXPECT_TRUE(e.abort("r4"));
    }
    if (step == 17) {
      aborted.insert("r7");
      EXPECT_TRUE(e.abort("r7"));
    }
    auto out = e.step();
    ASSERT_TRUE(out.ok()) << out.status().message();
    for (auto& o : *out) got[o.request_id].insert(got[o.request_id].end(), o.new_tokens.begin(), o.new_tokens.end());
    ASSERT_LT(step, 5000);
  }
  for (int i = 0; i < kRequests; ++i) {
    const std::string id = "r" + std::to_string(i);
    if (aborted.count(id)) {
      ASSERT_LE(got[id].size(), ref[id].size()) << id;
      EXPECT_TRUE(std::equal(got[id].begin(), got[id].end(), ref[id].begin())) << family << " " << id;
    } else {
      EXPECT_EQ(got[id], ref[id]) << family << " " << id;
    }
  }
  const EngineCounters c = e.counters();
  const double len = c.spec.num_drafts ? 1.0 + double(c.spec.num_accepted_tokens) / c.spec.num_drafts : 0.0;
  std::printf("%s greedy: %ld drafts, %ld draft tokens, %ld accepted, acceptance length %.2f; per position", family.c_str(),
              (long)c.spec.num_drafts, (long)c.spec.num_draft_tokens, (long)c.spec.num_accepted_tokens, len);
  for (int64_t a : c.spec.accepted_per_pos) std::printf(" %ld", (long)a);
  std::printf("; preemptions %ld, prefix-hit tokens %ld; %ld tokens fed in %.2f s of forward, %.2f s of drafts\n",
              (long)c.preemptions, (long)c.prefix_hits, (long)c.batched_tokens, c.forward_seconds, c.draft_seconds);
  EXPECT_GT(c.spec.num_drafts, 20);
  EXPECT_GE(len, min_acceptance_length);
  EXPECT_GT(c.preemptions, 0);
  EXPECT_GT(c.prefix_hits, 0);
  ASSERT_TRUE(e.blocks().check_invariants().ok());
  for (int g = 0; g < e.blocks().num_groups(); ++g) EXPECT_EQ(e.blocks().num_free_blocks(g), free0[g]) << g;
}

TEST(CpuSpecDecode, GreedyLosslessMl4Tiny) { greedy_is_lossless("ml4-tiny", 1.0); }
TEST(CpuSpecDecode, GreedyLosslessMistral4TinyShape) { greedy_is_lossless("mistral4-tiny", 1.0); }
TEST(CpuSpecDecode, GreedyLosslessDsv32TinyShape) { greedy_is_lossless("dsv32-tiny", 1.0); }
// The trained drafter: on these prompts the PyTorch simulation gives 1.35 tokens per step and
// the engine 1.27 (docs/ML4-SMALL.md; the retrained target no longer repeats itself, which
// made the first drafter's 2.8 easy). 1.0 is no draft ever accepted: the bound says drafts are
// really accepted, one in nine or more.
TEST(CpuSpecDecode, GreedyLosslessMl4Small) { greedy_is_lossless("ml4-small", 1.11); }


// Sampling through the real drafter and verifier draws from the target's distribution. The
// model: the mistral4-tiny shape cut to 2 layers with a 4-token vocabulary (random weights, a
// random drafter: q far from p), so the exact joint of 3 tokens (64 cells) is computable from
// 21 prefills. Each request: token 1 from the sampler after prefill, token 2 drafted (k = 1)
// and verified, token 3 the bonus or a new step. N = 4,000 requests per draft method (own
// seeds from a fresh engine seed); Pearson's chi-square (cells expected < 5 merged) fails
// below p = 1e-6 (a correct engine fails one run in a million). Power: the expected statistic
// of the two classic bugs (accept every draft; resample from p on rejection), computed from
// the runner's own q, is printed and must exceed the 1e-6 critical value by 5 standard
// deviations of its noncentral chi-square (N was chosen for that: at 4,000 the resampling bug
// has a mean statistic ~3x the critical value).
class CpuSpecSampling : public ::testing::TestWithParam<bool> {};

TEST_P(CpuSpecSampling, JointOfThreeTokensEqualsTheTargets) {
  const bool probabilistic = GetParam();
  constexpr int V = 4;
  constexpr int64_t N = 4000;
  const std::string dir = family_model("mistral4-tiny", {"vocab_size=4", "num_hidden_layers=2"});
  RunnerOptions ro;
  ro.drafter = true;
  ro.max_num_seqs = 64;
  ro.kv_cache_bytes = 64ll << 20;
  auto loaded = load_cpu_runner(dir, ro);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  ModelRunner& runner = **loaded;
  const auto& groups = runner.cache_groups();
  const int B = runner.config().drafter.block_size;
  SamplingParams sp;
  sp.temperature = 1.0;
  sp.max_tokens = 3;
  sp.ignore_eos = true;
  DeviceSamplingParams dp;
  dp.temperature = 1.0f;
  const std::vector<int32_t> prompt = {1, 3, 2};
  // Exact p for every history, from one prefill each (block b of every group for history b).
  std::vector<std::vector<int32_t>> hist = {prompt};
  for (int a = 0; a < V; ++a) {
    auto h = prompt;
    h.push_back(a);
    hist.push_back(h);
    for (int b = 0; b < V; ++b) {
      auto h2 = h;
      h2.push_back(b);
      hist.push_back(h2);
    }
  }
  StepInput in;
  for (size_t i = 0; i < hist.size(); ++i) {
    SeqStep s;
    s.seq_id = static_cast<int64_t>(i + 1);
    s.tokens = hist[i];
    for (size_t g = 0; g < groups.size(); ++g) s.block_tables.push_back({static_cast<int32_t>(i)});
    in.seqs.push_back(s);
  }
  auto out = runner.execute(in);
  ASSERT_TRUE(out.ok()) << out.status().message();
  std::map<std::vector<int32_t>, std::vector<double>> p;
  for (size_t i = 0; i < hist.size(); ++i) p[hist[i]] = testing::exact_dist(out->logits[i], dp);
  // The drafter's q for token 2 after each token 1 (anchor at position 3, window = the prompt
  // the prefill of `prompt + a` just wrote into blocks 1 + 5a).
  std::vector<std::vector<double>> q(V);
  DraftInput din;
  din.want_probs = true;
  for (int a = 0; a < V; ++a) {
    DraftSeq d;
    d.seq_id = 100 + a;
    d.anchor_token = a;
    d.anchor_pos = static_cast<int64_t>(prompt.size());
    d.num_drafts = 1;
    const int32_t blk = static_cast<int32_t>(1 + a * (V + 1));  // where hist {prompt, a} was prefilled
    for (size_t g = 0; g < groups.size(); ++g) d.block_tables.push_back({blk});
    if (probabilistic) d.sampling = dp;
    din.seqs.push_back(d);
  }
  ASSERT_LE(static_cast<int64_t>(prompt.size()) + B, 64);
  auto dr = runner.draft(din);
  ASSERT_TRUE(dr.ok()) << dr.status().message();
  for (int a = 0; a < V; ++a) {
    if (probabilistic) {
      q[a].assign(dr->probs[a].begin(), dr->probs[a].begin() + V);
    } else {
      q[a].assign(V, 0.0);
      q[a][dr->tokens[a][0]] = 1.0;
    }
  }
  std::vector<double> exact(V * V * V), all_accept(exact.size()), resample_p(exact.size());
  for (int c = 0; c < V * V * V; ++c) {
    const int t1 = c / (V * V), t2 = c / V % V, t3 = c % V;
    auto h1 = prompt;
    h1.push_back(t1);
    auto h2 = h1;
    h2.push_back(t2);
    const double p1 = p[prompt][t1], p2 = p[h1][t2], p3 = p[h2][t3];
    double beta = 0;
    for (int v = 0; v < V; ++v) beta += std::min(p[h1][v], q[t1][v]);
    exact[c] = p1 * p2 * p3;
    all_accept[c] = p1 * q[t1][t2] * p3;
    resample_p[c] = p1 * (std::min(p2, q[t1][t2]) + (1 - beta) * p2) * p3;
  }
  // Sample.
  const uint64_t seed = std::random_device{}();
  ByteTextCodec codec(V);
  EngineConfig cfg = config(64, 1024, false, 1, probabilistic);
  cfg.seed = seed;
  Engine e(&runner, &codec, cfg);
  ASSERT_TRUE(e.speculative());
  std::vector<int64_t> counts(exact.size(), 0);
  const Status st = testing::count_outputs(e, prompt, sp, N, 3, V, 128, &counts);
  ASSERT_TRUE(st.ok()) << st.message();
  const testing::ChiSquare x = testing::chi_square(exact, counts, N);
  const double stat = x.stat, pv = x.p_value;
  const int df = x.df;
  const double lo = testing::chi_square_critical(df, 1e-6);
  auto expected_stat = [&](const std::vector<double>& m) {
    double s = 0;
    for (size_t i = 0; i < m.size(); ++i)
      if (exact[i] > 0) s += (m[i] - exact[i]) * (m[i] - exact[i]) / exact[i];
    return df + N * s;
  };
  const EngineCounters c = e.counters();
  std::printf("%s drafts (seed %llu): chi2 %.1f, df %d, p %.3g (fails above chi2 %.1f); expected chi2 if every draft "
              "were accepted %.0f, if rejections resampled from p %.0f; acceptance %.3f\n",
              probabilistic ? "probabilistic" : "greedy", static_cast<unsigned long long>(seed), stat, df, pv, lo,
              expected_stat(all_accept), expected_stat(resample_p),
              c.spec.num_draft_tokens ? double(c.spec.num_accepted_tokens) / c.spec.num_draft_tokens : 0.0);
  EXPECT_GT(pv, 1e-6) << "seed " << seed;
  // Power: under a bug the statistic is noncentral chi-square, mean df + lambda, variance
  // 2 (df + 2 lambda); 5 standard deviations below its mean must still fail the test.
  auto detected = [&](double mean) { return mean - 5 * std::sqrt(2 * (df + 2 * (mean - df))) > lo; };
  EXPECT_TRUE(detected(expected_stat(all_accept)));
  EXPECT_TRUE(detected(expected_stat(resample_p)));
  EXPECT_EQ(c.spec.num_draft_tokens, N);  // every request verified exactly one draft
}

INSTANTIATE_TEST_SUITE_P(DraftMethods, CpuSpecSampling, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "probabilistic" : "greedy"; });

// 1,000 requests of mixed lengths, greedy and sampled, a fifth aborted at random moments,
// with prefix hits and preemption: every cache group (latent, indexer, drafter window) ends at
// its idle block count. The model is the dsv32-tiny shape cut to 2 layers (all three kinds of
// cache group, a quarter of ml4-tiny's cost per token, so 1,000 requests take seconds).
TEST(CpuSpecDecode, NoLeaksAfterAThousandMixedRequestsWithAborts) {
  const std::string dir = family_model("dsv32-tiny", {"num_hidden_layers=2"});
  auto runner = load(dir, 16, 16);
  ASSERT_TRUE(runner);
  const int V = runner->config().vocab_size;
  ByteTextCodec codec(V);
  Engine e(runner.get(), &codec, config(16, 96, true, 3, /*probabilistic=*/true));
  ASSERT_TRUE(e.speculative());
  std::vector<int64_t> free0;
  for (int g = 0; g < e.blocks().num_groups(); ++g) free0.push_back(e.blocks().num_free_blocks(g));
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int32_t> tok(3, V - 1);
  std::vector<int32_t> shared(64);
  for (auto& t : shared) t = tok(rng);
  // A third share a 64-token page (prefix hits); the rest are short. (Preemption with drafts
  // on this runner is in the greedy tests above, which check the free counts too.)
  auto made = testing::run_with_aborts(e, 1000, 24, 6, rng, [&] {
    std::vector<int32_t> p = rng() % 3 == 0 ? shared : std::vector<int32_t>{};
    const int len = 1 + static_cast<int>(rng() % (p.empty() ? 10 : 6));
    for (int k = 0; k < len; ++k) p.push_back(tok(rng));
    SamplingParams sp = greedy(1 + static_cast<int>(rng() % 5));
    if (rng() % 2) sp.temperature = 1.0;
    return std::make_pair(p, sp);
  });
  ASSERT_TRUE(made.ok()) << made.status().message();
  const int aborted = *made;
  const EngineCounters c = e.counters();
  std::printf("1000 requests: %d aborted, %ld steps, %ld drafts, %ld accepted, %ld preemptions, %ld prefix-hit tokens, "
              "%ld tokens fed\n",
              aborted, (long)c.steps, (long)c.spec.num_drafts, (long)c.spec.num_accepted_tokens, (long)c.preemptions,
              (long)c.prefix_hits, (long)c.batched_tokens);
  EXPECT_GT(aborted, 50);
  EXPECT_GT(c.spec.num_drafts, 100);
  EXPECT_GT(c.prefix_hits, 0);
  EXPECT_EQ(e.num_live(), 0u);
  ASSERT_TRUE(e.blocks().check_invariants().ok());
  for (int g = 0; g < e.blocks().num_groups(); ++g) EXPECT_EQ(e.blocks().num_free_blocks(g), free0[g]) << g;
}

}  // namespace
}  // namespace ml4
