// Whole-model logits of the CUDA runner against the CPU runner (src/runtime/cpu/cpu_runner.h)
// on mistral4-tiny (MLA + query LoRA + MoE with groups + YaRN + llama_4 scaling), ml4-tiny
// (DSA with indexer reuse, KV sharing, NoPE, SSMax, LeRoPE) and dsv32-tiny, two sequences
// prefilled in one step and then decoded token by token, fp8_ds_mla and bf16 KV caches.
// The bounds are argued at each TEST.
// A .cpp (host compiler, C++20: the runtime headers are not nvcc-C++17-clean); compiled only
// when the CUDA backend is (ML4_WITH_CUDA comes with ml4_cuda).
#if defined(ML4_WITH_CUDA)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <tuple>

#include <unistd.h>

#include "cuda_test_util.h"
#include "ops/cpu/sampling.h"
#include "kv/latent_layout.h"
#include "model/presets.h"
#include "runtime/cuda/cuda_runner.h"
#include "runtime/test_models.h"

namespace ml4::cuda {
namespace {

int argmax(const std::vector<float>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Runs two sequences (a 37-token and a 20-token prompt in one prefill step, then 6 decode
// steps on the CPU's greedy tokens) through both runners. The GPU runner is given the CPU's
// decisions (its routed experts and top-k sets, ForwardTrace forced_*), so both compute one
// function; how often the GPU's own decisions differ is counted and printed.
// weights: make-model's format, or "fp8-to-mxfp4": an FP8 checkpoint whose routed experts both
// runners re-quantize to MXFP4 at load (the CPU on the host, the GPU on the device).
void compare_runs(const std::string& preset, const std::string& kv, bool exact, double bound,
                  const std::string& weights = "bf16", bool absorb_gemm = false) {
  const bool requant = weights == "fp8-to-mxfp4";
  const std::string dir = ::ml4::testing::test_model(preset, 11, requant ? "fp8" : weights);
  RunnerOptions ro;
  ro.kv_cache_dtype = kv;
  ro.kv_cache_bytes = 64ll << 20;
  ro.experts_to_mxfp4 = requant;
  auto cpu_r = CpuRunner::load(dir, ro);
  ASSERT_TRUE(cpu_r.ok()) << cpu_r.status().message();
  auto cpu = std::move(cpu_r).value();
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = kv;
  o.base.kv_cache_bytes = 64ll << 20;
  o.base.experts_to_mxfp4 = requant;
  o.exact_activations = exact;
  o.fp4_weights = requant || weights == "nvfp4" || weights == "mxfp4";
  o.absorb_gemm = absorb_gemm;
  o.absorb_gemm_min_tokens = 1;  // every step, decode included
  auto gpu = CudaRunner::load(dir, o);
  ASSERT_TRUE(gpu.ok()) << gpu.status().message();
  std::mt19937 g(5);
  std::uniform_int_distribution<int> tok(1, cpu->config().vocab_size - 1);
  std::vector<int32_t> pa(37), pb(20);
  for (auto& t : pa) t = tok(g);
  for (auto& t : pb) t = tok(g);
  StepInput in;
  in.seqs.push_back(::ml4::testing::seq_step(*cpu, 1, pa, 0, 0, 1, 1));
  in.seqs.push_back(::ml4::testing::seq_step(*cpu, 2, pb, 0, 3, 1, 1));
  int64_t pos_a = 37, pos_b = 20;
  double worst = 0;
  int mismatched = 0, route_diff = 0, route_cells = 0, topk_diff = 0, topk_cells = 0;
  int64_t cache_values = 0, cache_flips = 0, cache_far = 0, cache_far_first = 0;
  double worst_flip = 0;  // the largest |a - b| / allowed among values beyond one step
  for (int step = 0; step < 7; ++step) {
    ForwardTrace tc;
    auto rc = cpu->execute_traced(in, &tc);
    ASSERT_TRUE(rc.ok()) << rc.status().message();
    ForwardTrace tg;
    tg.forced_experts = tc.experts;
    tg.forced_topk = tc.topk;
    auto rg = (*gpu)->execute_traced(in, &tg);
    ASSERT_TRUE(rg.ok()) << rg.status().message();
    for (size_t l = 0; l < tc.experts.size(); ++l)
      for (size_t t = 0; t < tc.experts[l].size(); ++t, ++route_cells) route_diff += tc.experts[l][t] != tg.experts[l][t];
    for (size_t l = 0; l < tc.topk.size(); ++l)
      for (size_t t = 0; t < tc.topk[l].size(); ++t, ++topk_cells) topk_diff += tc.topk[l][t] != tg.topk[l][t];
    ASSERT_EQ(rc->logits.size(), rg->logits.size());
    for (size_t s = 0; s < rc->logits.size(); ++s) {
      ASSERT_TRUE(testing::all_finite(rg->logits[s]));
      const double e = ::ml4::testing::rel_l2(rg->logits[s], rc->logits[s]);
      worst = std::max(worst, e);
      mismatched += argmax(rg->logits[s]) != argmax(rc->logits[s]);
      EXPECT_LT(e, bound) << preset << " step " << step << " seq " << s;
    }
    // The latent pages both wrote (blocks 0 and 3), value by value. The two sides' f32
    // values differ by summation order (~1e-7 relative), so a value may land one step of
    // the cache format apart (a rounding boundary between them), and an fp8_ds_mla tile's
    // scale (amax / 448) may differ in its last bits. Allowed per value: one step of the
    // format at the larger magnitude (bf16 2^-7 relative; e4m3 2^-2, plus its subnormal
    // step scale * 2^-9) plus 1e-5 of the row's largest |value| (the f32 difference on
    // near-cancelling values). That must hold in the first latent layer, whose inputs are
    // the embeddings on both sides. Deeper layers' inputs already carry the earlier layers'
    // flips (amplified, as the logits are), so there values beyond one step are counted and
    // printed, not asserted (the H200 run of 16:55 counted 187 / 1661 of 282k / 706k values
    // with fp8_ds_mla, 0 / 5 with bf16).
    const auto& spec = cpu->kv_spec();
    const int lg = spec.group_index(CacheGroupSpec::kLatent);
    const int r = cpu->config().kv_lora_rank, dr = cpu->config().qk_rope_head_dim;
    const size_t tb_bytes = latent_token_bytes(spec.dtype, r, dr);
    const bool fp8 = spec.dtype != KvCacheDtype::kBf16;
    std::vector<uint8_t> page;
    std::vector<float> cg(r), kg(dr), cc(r), kc(dr);
    for (int slot = 0; slot < static_cast<int>(spec.groups[lg].layers.size()); ++slot) {
      for (int64_t blk : {0, 3}) {
        ASSERT_TRUE((*gpu)->read_cache_page(lg, slot, blk, &page).ok());
        const uint8_t* cp = cpu->cache().page(lg, slot, blk);
        const int64_t used = std::min<int64_t>(64, blk == 0 ? pos_a : pos_b);
        for (int64_t t = 0; t < used; ++t) {
          decode_latent(spec.dtype, page.data() + t * tb_bytes, r, dr, 1.0f, cg.data(), kg.data());
          decode_latent(spec.dtype, cp + t * tb_bytes, r, dr, 1.0f, cc.data(), kc.data());
          float amax_c = 0, amax_k = 0;
          for (int j = 0; j < r; ++j) amax_c = std::max(amax_c, std::fabs(cc[j]));
          for (int j = 0; j < dr; ++j) amax_k = std::max(amax_k, std::fabs(kc[j]));
          for (int j = 0; j < r + dr; ++j) {
            const bool rope = j >= r;
            const double a = rope ? kg[j - r] : cg[j], b = rope ? kc[j - r] : cc[j];
            ++cache_values;
            if (a == b) continue;
            ++cache_flips;
            const double mag = std::max(std::fabs(a), std::fabs(b));
            const double amax = rope ? amax_k : amax_c;
            const double tol = (fp8 && !rope) ? mag * 0.25 + amax / 448.0 * std::ldexp(1.0, -9) + 1e-5 * amax
                                              : mag * std::ldexp(1.0, -7) + 1e-5 * amax;
            if (std::fabs(a - b) > tol) {
              ++cache_far;
              if (slot == 0) ++cache_far_first;
              worst_flip = std::max(worst_flip, std::fabs(a - b) / std::max(tol, 1e-30));
            }
          }
        }
      }
    }
    // Next decode step on the CPU's greedy tokens.
    const int ta = argmax(rc->logits[0]), tb = argmax(rc->logits[1]);
    in.seqs.clear();
    in.seqs.push_back(::ml4::testing::seq_step(*cpu, 1, {ta}, pos_a++, 0, 1, 1));
    in.seqs.push_back(::ml4::testing::seq_step(*cpu, 2, {tb}, pos_b++, 3, 1, 1));
  }
  std::printf("cuda runner vs cpu runner, %s (%s weights) kv=%s exact=%d: worst logits rel_err=%.3g (bound %.0e), %d greedy "
              "mismatches over 14 rows; GPU's own routing differs in %d of %d cells, own top-k in %d of %d; latent "
              "cache values differing %ld of %ld, beyond one format step %ld (first latent layer %ld; worst %.3g x "
              "allowed)\n",
              preset.c_str(), weights.c_str(), kv.c_str(), exact ? 1 : 0, worst, bound, mismatched, route_diff, route_cells, topk_diff,
              topk_cells, static_cast<long>(cache_flips), static_cast<long>(cache_values), static_cast<long>(cache_far),
              static_cast<long>(cache_far_first), worst_flip);
  if (exact) {
    EXPECT_EQ(mismatched, 0);
    EXPECT_EQ(cache_far_first, 0) << preset << " " << kv
                                  << ": first-layer cache values further apart than one format step";
  }
}

// Exact mode: each op equals the CPU's to summation order (~1e-7..1e-6 relative). The
// cache quantizes what both sides computed: a value within that distance of a bf16 / e4m3
// rounding boundary lands one format step apart (2^-8 / up to 2^-3 relative), and an
// fp8_ds_mla tile scale moves in its last bits; checked value by value above (never more
// than one step apart). Each such step moves that key's attention
// logits by ~step/sqrt(r) of their size, which these random models carry into the logits
// at ~1e-4 (bf16) to ~1e-3 (e4m3) per flip (measured: bf16 <= 1.2e-4, fp8_ds_mla <=
// 4.7e-3 with a handful of flips; transformers' own f32-vs-f64 floor on these models is
// 7.6e-4). Bounds: 1e-2 with fp8_ds_mla; with a bf16 cache 1.5e-3, twice that f32-vs-f64
// floor: two f32 implementations may each sit the floor away from the exact result. (It was
// 5e-4 while the CPU's MLA kernel summed in the GPU kernel's order; since the CPU kernel's
// vectorised exp and one-accumulation logits (commits be9951f, a3fa892) mistral4-tiny's bf16
// row measured 7.6e-4 on the H200 and H100, with 133 deeper-layer cache values beyond one step
// and none in the first layer, which stays asserted.) Greedy tokens equal.
TEST(CudaRunner, MatchesCpuRunnerExact) {
  ML4_REQUIRE_GPU();
  compare_runs("mistral4-tiny", "fp8_ds_mla", true, 1e-2);
  compare_runs("mistral4-tiny", "bf16", true, 1.5e-3);
  compare_runs("ml4-tiny", "fp8_ds_mla", true, 1e-2);
  compare_runs("dsv32-tiny", "bf16", true, 1.5e-3);
  // FP8 / NVFP4 / MXFP4 checkpoints (make-model's: every non-expert linear FP8 block) on ml4-tiny,
  // whose FP8 linears all have K % 128 == 0 (mistral4-tiny's q LoRA has K = 64, which the GPU's
  // FP8 GEMMs refuse): the plain FP8 row first, so that an FP4 failure is not an FP8 one; the FP4
  // weight stream decodes the CPU's weights bit for bit, so the FP8 row's bound.
  compare_runs("ml4-tiny", "fp8_ds_mla", true, 1e-2, "fp8");
  compare_runs("ml4-tiny", "fp8_ds_mla", true, 1e-2, "nvfp4");
  compare_runs("ml4-tiny", "fp8_ds_mla", true, 1e-2, "mxfp4");
  compare_runs("ml4-tiny", "fp8_ds_mla", true, 1e-2, "fp8-to-mxfp4");
}

// The exact mode (--batch-invariant) on an FP8 checkpoint: a sequence's logits do not depend on
// the batch it runs in. Three sequences (21, 30 and 13 prompt tokens: the linears' 8-row chunks
// then mix sequences) prefilled in one step and decoded 6 steps together, against each sequence
// alone in a runner of its own on the same tokens, bit for bit, eager and with graphs (which pad
// 3 rows to 4). Every op is either per token with one order whatever the step (the GEMVs: gemv_tc
// with the split-K count of 8 rows, FP8 and bf16; the router: router_route in chunks of <= 8 tokens;
// the grouped MoE: each token its own mma column) or per sequence (attention, indexer).
TEST(CudaRunner, ExactModeIsBatchInvariant) {
  ML4_REQUIRE_GPU();
  const std::string dir = ::ml4::testing::test_model("ml4-tiny", 11, "fp8");
  for (bool graphs : {false, true}) {
    CudaRunnerOptions o;
    o.base.kv_cache_dtype = "fp8_ds_mla";
    o.base.kv_cache_bytes = 64ll << 20;
    o.exact_activations = true;
    o.cuda_graphs = graphs;
    auto batch = CudaRunner::load(dir, o);
    ASSERT_TRUE(batch.ok()) << batch.status().message();
    constexpr int kSeqs = 3;
    std::vector<std::unique_ptr<CudaRunner>> alone;
    for (int s = 0; s < kSeqs; ++s) {
      auto r = CudaRunner::load(dir, o);
      ASSERT_TRUE(r.ok()) << r.status().message();
      alone.push_back(std::move(r).value());
    }
    std::mt19937 rng(33);
    std::uniform_int_distribution<int> tok(1, (*batch)->config().vocab_size - 1);
    const int lens[kSeqs] = {21, 30, 13};
    std::vector<std::vector<int32_t>> next(kSeqs);
    std::vector<int64_t> pos(kSeqs, 0);
    for (int s = 0; s < kSeqs; ++s) {
      next[s].resize(lens[s]);
      for (auto& t : next[s]) t = tok(rng);
    }
    int differing = 0, rows = 0;
    for (int step = 0; step < 7; ++step) {
      StepInput in;
      for (int s = 0; s < kSeqs; ++s) in.seqs.push_back(::ml4::testing::seq_step(**batch, s, next[s], pos[s], 4 * s, 4, 1));
      auto b = (*batch)->execute(in);
      ASSERT_TRUE(b.ok()) << b.status().message();
      for (int s = 0; s < kSeqs; ++s) {
        StepInput one;
        one.seqs.push_back(::ml4::testing::seq_step(*alone[s], s, next[s], pos[s], 4 * s, 4, 1));
        auto a = alone[s]->execute(one);
        ASSERT_TRUE(a.ok()) << a.status().message();
        ASSERT_TRUE(testing::all_finite(a->logits[0]));
        ++rows;
        if (a->logits[0] != b->logits[s]) {
          ++differing;
          std::printf("  graphs=%d step %d seq %d: logits differ alone vs in the batch (rel %.3g)\n", graphs ? 1 : 0,
                      step, s, ::ml4::testing::rel_l2(a->logits[0], b->logits[s]));
        }
      }
      for (int s = 0; s < kSeqs; ++s) {
        pos[s] += static_cast<int64_t>(next[s].size());
        next[s] = {argmax(b->logits[s])};
      }
    }
    std::printf("exact mode, ml4-tiny fp8, graphs=%d: %d of %d logits rows differ alone vs in a batch of 3 (bound 0)\n",
                graphs ? 1 : 0, differing, rows);
    EXPECT_EQ(differing, 0) << "graphs=" << graphs;
    if (graphs) EXPECT_GT((*batch)->graph_replays(), 0);
  }
}

// Production mode: bf16-rounded GEMM inputs for M > 8 (prefill), bf16 tensor-core
// attention (q, keys and P rounded to bf16), FP8 tensor-core indexer: three 2^-9 roundings
// per layer input instead of f32 sums, ~1e-2 relative per layer on these random models;
// measured 4.9e-2 (mistral4-tiny, 4 layers) and 5.8e-2 (ml4-tiny, 12 layers): bound 8e-2,
// and greedy tokens are compared (printed).
TEST(CudaRunner, MatchesCpuRunnerProduction) {
  ML4_REQUIRE_GPU();
  compare_runs("mistral4-tiny", "fp8_ds_mla", false, 8e-2);
  compare_runs("ml4-tiny", "fp8_ds_mla", false, 8e-2);
  // The MLA absorption as TF32 GEMMs (issue 18): TF32's inputs (10 mantissa bits) are finer
  // than the bf16 the production attention already rounds to, so the same bound holds.
  compare_runs("mistral4-tiny", "fp8_ds_mla", false, 8e-2, "bf16", true);
  compare_runs("ml4-tiny", "fp8_ds_mla", false, 8e-2, "bf16", true);
}

// The MLA latents of a prefill step in bf16 (CudaBackendOptions::mla_latent_bf16, issue 18)
// against the f32 form, on ml4-slice-1 with synthetic full-width weights (the sparse prefill
// kernel it rides on needs r 512 and dr 64, which the tiny presets lack): one 2,304-token prefill
// (past the indexer's top-k of 2,048, as the step bench's) through one runner, bf16 then f32
// then bf16 again, the same KV pages rewritten with the same rows; the backend counts the
// attention calls that took the bf16 form. The two forms differ by q's nope part and W_UK / W_UV
// rounded to bf16 instead of TF32 and out_lat rounded to bf16 before W_UV: a few 2^-9 roundings
// of the attention output (~3e-3 relative, CudaElementwise.MlaAbsorptionGemmBf16MatchesF64),
// which the o projection's FP8 activations and one layer carry to the logits at about that
// size (an e4m3 flip is 2^-4 of one value among 8192). Bound 2e-2; the repeat must be
// bit-identical. (A first version at 512 tokens saw no difference at all on an H100.)
TEST(CudaRunner, LatentBf16PrefillMatchesF32) {
  ML4_REQUIRE_GPU();
  auto cfg = preset_config("ml4-slice-1");
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "fp8_ds_mla";
  o.base.kv_cache_bytes = 256ll << 20;
  auto rr = CudaRunner::load_synthetic(*cfg, o, 1234);
  ASSERT_TRUE(rr.ok()) << rr.status().message();
  CudaRunner& r = **rr;
  std::mt19937 g(17);
  std::uniform_int_distribution<int> tok(1, cfg->vocab_size - 1);
  std::vector<int32_t> prompt(2304);
  for (auto& t : prompt) t = tok(g);
  const StepInput in{{::ml4::testing::seq_step(r, 1, prompt, 0, 0, 36, 16)}};
  std::vector<int64_t> took;  // bf16 attention calls of each run
  auto run = [&](bool bf16) {
    r.set_mla_latent_bf16(bf16);
    const int64_t before = r.latent_bf16_attentions();
    auto res = r.execute(in);
    took.push_back(r.latent_bf16_attentions() - before);
    EXPECT_TRUE(res.ok()) << res.status().message();
    std::vector<float> all;
    if (res.ok())
      for (const auto& row : res->logits) all.insert(all.end(), row.begin(), row.end());
    return all;
  };
  const std::vector<float> a = run(true), f = run(false), b = run(true);
  ASSERT_EQ(a.size(), size_t{16} * cfg->vocab_size);
  ASSERT_TRUE(testing::all_finite(a) && testing::all_finite(f));
  const double e = ::ml4::testing::rel_l2(a, f);
  int mismatched = 0;
  for (int row = 0; row < 16; ++row) {
    const std::vector<float> ra(a.begin() + row * cfg->vocab_size, a.begin() + (row + 1) * cfg->vocab_size),
        rf(f.begin() + row * cfg->vocab_size, f.begin() + (row + 1) * cfg->vocab_size);
    mismatched += argmax(ra) != argmax(rf);
  }
  std::printf("ml4-slice-1, 2304-token prefill: bf16 latents vs f32: logits rel_err %.3g (bound 2e-2), %d of 16 greedy "
              "tokens differ; bf16 attention calls %ld / %ld / %ld\n",
              e, mismatched, static_cast<long>(took[0]), static_cast<long>(took[1]), static_cast<long>(took[2]));
  EXPECT_EQ(took[0], 1);
  EXPECT_EQ(took[1], 0);
  EXPECT_LT(e, 2e-2);
  EXPECT_GT(e, 0.0) << "the bf16 form did not run";
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "repeat differs";
}

// Runs a 150- and a 20-token prompt (sequence 1 prefilled in pieces of at most `chunk` tokens,
// sequence 2 with its first piece), then two decode steps on a's greedy tokens, through runners
// a and b, b forced to a's routing and top-k (ForwardTrace), so that both compute one function.
// Returns the worst logits rel_l2 of b against a over the prefill steps and over the decode steps.
struct PairErr {
  double prefill = 0, decode = 0;
  int mismatched = 0, rows = 0;
};
PairErr run_pair(CudaRunner& a, CudaRunner& b, int64_t chunk) {
  std::mt19937 g(5);
  std::uniform_int_distribution<int> tok(1, a.config().vocab_size - 1);
  std::vector<int32_t> pa(150), pb(20);
  for (auto& t : pa) t = tok(g);
  for (auto& t : pb) t = tok(g);
  std::vector<StepInput> steps;  // 64-token pages: sequence 1 on blocks 0-2, sequence 2 on block 3
  for (int64_t p0 = 0; p0 < 150; p0 += chunk) {
    const int64_t p1 = std::min<int64_t>(150, p0 + chunk);
    StepInput in;
    in.seqs.push_back(::ml4::testing::seq_step(a, 1, {pa.begin() + p0, pa.begin() + p1}, p0, 0, 3, 1));
    if (p0 == 0) in.seqs.push_back(::ml4::testing::seq_step(a, 2, pb, 0, 3, 1, 1));
    steps.push_back(std::move(in));
  }
  const size_t n_prefill = steps.size();
  PairErr r;
  int64_t pos[3] = {0, 150, 20};
  std::vector<float> last[3];
  for (size_t i = 0; i < n_prefill + 2; ++i) {
    if (i >= n_prefill) {  // a decode step on a's greedy tokens
      StepInput in;
      for (int sq : {1, 2})
        in.seqs.push_back(::ml4::testing::seq_step(a, sq, {argmax(last[sq])}, pos[sq]++, sq == 1 ? 0 : 3,
                                                   sq == 1 ? 3 : 1, 1));
      steps.push_back(std::move(in));
    }
    const StepInput& in = steps[i];
    ForwardTrace ta;
    auto ra = a.execute_traced(in, &ta);
    EXPECT_TRUE(ra.ok()) << ra.status().message();
    ForwardTrace tb;
    tb.forced_experts = ta.experts;
    tb.forced_topk = ta.topk;
    auto rb = b.execute_traced(in, &tb);
    EXPECT_TRUE(rb.ok()) << rb.status().message();
    if (!ra.ok() || !rb.ok() || ra->logits.size() != rb->logits.size()) return {1e9, 1e9, 0, 0};
    for (size_t s = 0; s < ra->logits.size(); ++s) {
      EXPECT_TRUE(testing::all_finite(rb->logits[s]));
      const double e = ::ml4::testing::rel_l2(rb->logits[s], ra->logits[s]);
      double& worst = i < n_prefill ? r.prefill : r.decode;
      worst = std::max(worst, e);
      r.mismatched += argmax(rb->logits[s]) != argmax(ra->logits[s]);
      ++r.rows;
      last[in.seqs[s].seq_id] = ra->logits[s];
    }
  }
  return r;
}

// FP4 experts in a prefill step above kGroupedMoeMaxTokens (the 150- and 20-token prompts in one
// 170-token step): ml4-tiny (D 256, I 128) takes the FP4 grouped GEMMs (moe_grouped_gemm_fp4,
// issue 18; its FP8 shared expert through cuBLASLt) with grouped_moe_gemm on, the loop over
// experts (the FP4 weight stream on f32 x, which MatchesCpuRunnerExact checks against the CPU)
// with it off; production runners otherwise alike, the grouped one on the loop's routing and
// top-k. They differ by the grouped path's bf16 rounding of the routed experts' x and hidden
// rows: 3e-3 of the MoE output (CudaMoe.GroupedGemmFp4PrefillVsCpu), which these random
// 12-layer models amplify (exact mode's ~1e-7 op differences reach 6e-4..6e-3 in the logits,
// MatchesCpuRunnerExact): measured 0.079 / 0.089 / 0.113 (nvfp4 / mxfp4 / fp8-to-mxfp4) on an
// H100 and, the same values, on an H200 (2026-12-05; the runs are deterministic). The control:
// the same prompts prefilled in steps of at most 128 tokens through the decode-shaped grouped
// path with the same rounding (fp4_x_parts 1: x and the hidden rows in bf16) against it exact
// (fp4_x_parts 3), printed beside: 0.030..0.035, so the grouped path's 2.5-3.3x over it is not
// explained by the bf16 rounding alone (open; the FP8 shared expert's e4m3 activations on this
// path are the suspect). Asserted: < 0.15, 1.3x the worst measured, not a bound derived from the
// dtype (wrong rows or scales give O(1)).
void fp4_grouped_vs_loop(const std::string& weights) {
  const bool requant = weights == "fp8-to-mxfp4";
  const std::string dir = ::ml4::testing::test_model("ml4-tiny", 11, requant ? "fp8" : weights);
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "bf16";
  o.base.kv_cache_bytes = 64ll << 20;
  o.base.experts_to_mxfp4 = requant;
  o.fp4_weights = true;
  auto loop_o = o, exact_x_o = o;
  loop_o.grouped_moe_gemm = false;
  exact_x_o.fp4_x_parts = 3;
  auto grouped = CudaRunner::load(dir, o);
  auto loop = CudaRunner::load(dir, loop_o);
  auto bf16_x = CudaRunner::load(dir, o);
  auto exact_x = CudaRunner::load(dir, exact_x_o);
  for (auto* r : {&grouped, &loop, &bf16_x, &exact_x}) ASSERT_TRUE(r->ok()) << r->status().message();
  const PairErr e = run_pair(**loop, **grouped, 170);
  const PairErr c = run_pair(**exact_x, **bf16_x, 128);
  std::printf("ml4-tiny %s, 170-token prefill: FP4 grouped GEMMs vs the FP4 expert loop: logits rel_err %.3g "
              "(prefill), %.3g (decode after it) (bound 0.15), %d of %d greedy tokens differ; control, bf16 vs exact "
              "x in the decode-shaped grouped path (prefill in steps <= 128 tokens): %.3g, %.3g, %d of %d\n",
              weights.c_str(), e.prefill, e.decode, e.mismatched, e.rows, c.prefill, c.decode, c.mismatched, c.rows);
  EXPECT_LT(e.prefill, 0.15) << weights;
  EXPECT_LT(e.decode, 0.15) << weights;
}

TEST(CudaRunner, Fp4GroupedPrefillMatchesLoop) {
  ML4_REQUIRE_GPU();
  fp4_grouped_vs_loop("nvfp4");
  fp4_grouped_vs_loop("mxfp4");
  fp4_grouped_vs_loop("fp8-to-mxfp4");
}

// Decode steps as CUDA graphs. A repeated step is idempotent (it rewrites the same cache
// rows), so running one decode step twice compares the eager first run (which then
// captures) with the graph replay: they must be bit-identical. Against a runner without
// graphs the padded batch (3 -> 4) and the rounded-up launch lengths change only the
// attention's split points (f32 summation order, ~1e-7 relative): bound 1e-5, and
// greedy tokens equal. A third runner runs the DSA indexer on the main stream instead of
// overlapping its key and query halves on two side streams (CudaRunnerOptions::overlap_indexer):
// the same kernels on the same inputs, so its logits must equal the eager runner's bit for bit.
// Replaying the last graph alone (CudaRunner::replay_last_graph_ms) leaves the next step's logits
// as they were.
void graph_vs_eager(const std::string& preset) {
  const std::string dir = ::ml4::testing::test_model(preset, 11, "bf16");
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "fp8_ds_mla";
  o.base.kv_cache_bytes = 64ll << 20;
  auto eager_o = o;
  eager_o.cuda_graphs = false;
  auto serial_o = eager_o;
  serial_o.overlap_indexer = false;
  auto g = CudaRunner::load(dir, o);
  auto e = CudaRunner::load(dir, eager_o);
  auto sr = CudaRunner::load(dir, serial_o);
  ASSERT_TRUE(g.ok()) << g.status().message();
  ASSERT_TRUE(e.ok()) << e.status().message();
  ASSERT_TRUE(sr.ok()) << sr.status().message();
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> tok(1, (*g)->config().vocab_size - 1);
  const int kSeqs = 3;
  std::vector<int64_t> pos(kSeqs);
  StepInput in;
  for (int s = 0; s < kSeqs; ++s) {
    std::vector<int32_t> p(20 + 7 * s);
    for (auto& t : p) t = tok(rng);
    pos[s] = static_cast<int64_t>(p.size());
    in.seqs.push_back(::ml4::testing::seq_step(**g, s, p, 0, 4 * s, 4, 1));
  }
  EXPECT_FALSE((*e)->replay_last_graph_ms(1).ok()) << "an eager runner has no graph to replay";
  double worst = 0;
  int mismatched = 0;
  for (int step = 0; step < 8; ++step) {
    auto rg = (*g)->execute(in);
    auto re = (*e)->execute(in);
    auto rs = (*sr)->execute(in);
    ASSERT_TRUE(rg.ok()) << rg.status().message();
    ASSERT_TRUE(re.ok()) << re.status().message();
    ASSERT_TRUE(rs.ok()) << rs.status().message();
    for (int s = 0; s < kSeqs; ++s)
      EXPECT_EQ(re->logits[s], rs->logits[s]) << preset << " step " << step << " seq " << s
                                              << ": the overlapped indexer changed the result";
    if (step > 0) {  // a decode step: run it again, now replayed from the graph
      const int64_t before = (*g)->graph_replays();
      auto again = (*g)->execute(in);
      ASSERT_TRUE(again.ok()) << again.status().message();
      EXPECT_EQ((*g)->graph_replays(), before + 1) << preset << " step " << step << " was not replayed";
      for (int s = 0; s < kSeqs; ++s)
        EXPECT_EQ(again->logits[s], rg->logits[s]) << preset << " step " << step << " seq " << s
                                                    << ": graph replay differs from the eager run";
      if (step == 3) {  // the step bench's hook: replays of the same step change nothing after them
        auto ms = (*g)->replay_last_graph_ms(3);
        ASSERT_TRUE(ms.ok()) << ms.status().message();
        EXPECT_GT(*ms, 0.0);
        auto third = (*g)->execute(in);
        ASSERT_TRUE(third.ok()) << third.status().message();
        for (int s = 0; s < kSeqs; ++s)
          EXPECT_EQ(third->logits[s], rg->logits[s]) << preset << " seq " << s << ": changed by replay_last_graph_ms";
      }
    }
    in.seqs.clear();
    for (int s = 0; s < kSeqs; ++s) {
      const double err = ::ml4::testing::rel_l2(rg->logits[s], re->logits[s]);
      worst = std::max(worst, err);
      EXPECT_LT(err, 1e-5) << preset << " step " << step << " seq " << s;
      const int t = argmax(re->logits[s]);
      mismatched += argmax(rg->logits[s]) != t;
      in.seqs.push_back(::ml4::testing::seq_step(**g, s, {t}, pos[s]++, 4 * s, 4, 1));
    }
  }
  EXPECT_EQ(mismatched, 0);
  EXPECT_GT((*g)->graph_replays(), 0);
  // The comparison above means something only if the indexer did overlap.
  if ((*e)->config().has_dsa()) {
    EXPECT_GT((*e)->overlapped_layers(), 0) << preset;
  }
  EXPECT_EQ((*sr)->overlapped_layers(), 0) << preset;
  std::printf("%s: decode graphs vs eager runner: worst rel_err %.3g (bound 1e-5), %d greedy mismatches, %zu graphs, "
              "%ld replays\n",
              preset.c_str(), worst, mismatched, (*g)->graphs_captured(), static_cast<long>((*g)->graph_replays()));
}

TEST(CudaRunner, DecodeGraphsMatchEager) {
  ML4_REQUIRE_GPU();
  graph_vs_eager("mistral4-tiny");
  graph_vs_eager("ml4-tiny");
}

// A runner option that must not change what the runner computes (`what` names it; `off` and
// `on` set it): a runner with it gives the logits of a runner without it bit for bit, graphed
// against graphed and eager against eager (graphs pad the batch, which may move the last
// bits), over a prefill of mixed lengths and decode steps (graph replays included).
template <typename Off, typename On>
void option_vs_plain(const std::string& preset, const char* what, Off off, On on,
                     const std::function<void(const CudaRunner&, bool on)>& check = nullptr, int seqs = 3) {
  const std::string dir = ::ml4::testing::test_model(preset, 11, "bf16");
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "fp8_ds_mla";
  o.base.kv_cache_bytes = 64ll << 20;
  off(o);
  auto pdl_o = o;
  on(pdl_o);
  auto plain_eager_o = o, pdl_eager_o = pdl_o;
  plain_eager_o.cuda_graphs = pdl_eager_o.cuda_graphs = false;
  auto plain = CudaRunner::load(dir, o);
  auto pdl = CudaRunner::load(dir, pdl_o);
  auto plain_eager = CudaRunner::load(dir, plain_eager_o);
  auto pdl_eager = CudaRunner::load(dir, pdl_eager_o);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  ASSERT_TRUE(pdl.ok()) << pdl.status().message();
  ASSERT_TRUE(plain_eager.ok()) << plain_eager.status().message();
  ASSERT_TRUE(pdl_eager.ok()) << pdl_eager.status().message();
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> tok(1, (*plain)->config().vocab_size - 1);
  const int kSeqs = seqs;
  std::vector<int64_t> pos(kSeqs);
  StepInput in;
  for (int s = 0; s < kSeqs; ++s) {
    std::vector<int32_t> p(24 + 9 * s);
    for (auto& t : p) t = tok(rng);
    pos[s] = static_cast<int64_t>(p.size());
    in.seqs.push_back(::ml4::testing::seq_step(**plain, s, p, 0, 4 * s, 4, 1));
  }
  int differing = 0;
  for (int step = 0; step < 8; ++step) {
    const int reps = step > 0 ? 2 : 1;  // a decode step twice: capture, then replay (idempotent)
    for (int rep = 0; rep < reps; ++rep) {
      auto a = (*plain)->execute(in);
      auto b = (*pdl)->execute(in);
      auto ae = (*plain_eager)->execute(in);
      auto be = (*pdl_eager)->execute(in);
      ASSERT_TRUE(a.ok()) << a.status().message();
      ASSERT_TRUE(b.ok()) << b.status().message();
      ASSERT_TRUE(ae.ok()) << ae.status().message();
      ASSERT_TRUE(be.ok()) << be.status().message();
      for (int s = 0; s < kSeqs; ++s) {
        differing += a->logits[s] != b->logits[s];
        differing += ae->logits[s] != be->logits[s];
      }
      if (rep == reps - 1) {
        in.seqs.clear();
        for (int s = 0; s < kSeqs; ++s)
          in.seqs.push_back(::ml4::testing::seq_step(**plain, s, {argmax(a->logits[s])}, pos[s]++, 4 * s, 4, 1));
      }
    }
  }
  EXPECT_EQ(differing, 0) << preset << ": logits rows that differ with " << what;
  EXPECT_GT((*pdl)->graph_replays(), 0) << preset;
  if (check) {  // the option's own evidence that it was (and was not) taken
    check(**pdl, true);
    check(**pdl_eager, true);
    check(**plain, false);
    check(**plain_eager, false);
  }
  std::printf("%s: %s vs plain: %d differing logits rows (graphed and eager), %ld replays\n", preset.c_str(), what,
              differing, static_cast<long>((*pdl)->graph_replays()));
}

// option_vs_plain's check for an option that counts where it was taken: a runner with it counted
// some (`what` never happened otherwise), one without it none.
std::function<void(const CudaRunner&, bool)> taken_iff_on(int64_t (CudaRunner::*count)() const, const char* what) {
  return [count, what](const CudaRunner& r, bool on) {
    if (on) EXPECT_GT((r.*count)(), 0) << "never with the option on: " << what;
    else EXPECT_EQ((r.*count)(), 0) << "with the option off: " << what;
  };
}

// Programmatic dependent launch (ops/cuda/pdl.cuh, issue 19) changes when a kernel starts, not
// what it computes: every kernel waits on the device for its predecessor before it touches the
// step's data.
TEST(CudaRunner, ProgrammaticLaunchIsBitIdentical) {
  ML4_REQUIRE_GPU();
  auto off = [](CudaRunnerOptions& o) {
    o.programmatic_launch = false;
    o.programmatic_launch_tokens = 0;
  };
  auto on = [](CudaRunnerOptions& o) { o.programmatic_launch = true; };
  // The comparison means something only if steps ran with it (and none without it).
  const auto ran = taken_iff_on(&CudaRunner::programmatic_steps, "a step with programmatic launch");
  option_vs_plain("mistral4-tiny", "programmatic launch", off, on, ran);
  option_vs_plain("ml4-tiny", "programmatic launch", off, on, ran);
  // The default: single-token decode steps with it, every other step without (graphs of both
  // kinds in one runner), against none: one sequence decoding after its prefill.
  auto single = [](CudaRunnerOptions& o) {
    o.programmatic_launch = false;
    o.programmatic_launch_tokens = 1;  // `off` set 0
  };
  option_vs_plain("ml4-tiny", "programmatic launch on single-token steps", off, single, ran, 1);
}

// The fused indexer paths (issue 19): the key half in one kernel (cache_write.h
// indexer_key_path) writes the keys the three launches write (its LayerNorm sums in f64 in
// another order: an f32 output, hence a key byte, moves only where that ~1e-16 difference
// crosses a rounding), and the queries rotated inside their quantization are the same bytes by
// construction; so the logits are the same bits.
TEST(CudaRunner, FusedIndexerIsBitIdentical) {
  ML4_REQUIRE_GPU();
  option_vs_plain(
      "ml4-tiny", "the fused indexer paths", [](CudaRunnerOptions& o) { o.fused_indexer = false; },
      [](CudaRunnerOptions& o) { o.fused_indexer = true; });
}

// The final norm writing the logits rows itself (CudaRunnerOptions::final_norm_rows, issue 19)
// against the gather + second norm: the same kernel on the same stored residual, so the same
// bits, on a prefill (rows are not the tokens: the gather path in both) and decode steps.
TEST(CudaRunner, FinalNormRowsAreBitIdentical) {
  ML4_REQUIRE_GPU();
  auto off = [](CudaRunnerOptions& o) { o.final_norm_rows = false; };
  auto on = [](CudaRunnerOptions& o) { o.final_norm_rows = true; };
  option_vs_plain("mistral4-tiny", "the final norm writing the rows", off, on);
  option_vs_plain("ml4-tiny", "the final norm writing the rows", off, on);
}

// The FFN norm inside the fused router's launch (CudaRunnerOptions::fused_ffn_norm, issue 19)
// against its own rms_norm launch: the same bits (CudaMoe.FusedRouterNormIsTheNormThenTheRouter
// checks the kernel alone).
TEST(CudaRunner, FusedFfnNormIsBitIdentical) {
  ML4_REQUIRE_GPU();
  auto off = [](CudaRunnerOptions& o) { o.fused_ffn_norm = false; };
  auto on = [](CudaRunnerOptions& o) { o.fused_ffn_norm = true; };
  // The comparison means something only if the fused launch ran with the option (decode steps
  // of MoE layers) and never without it.
  const auto ran = taken_iff_on(&CudaRunner::fused_ffn_norms, "the fused FFN norm");
  option_vs_plain("mistral4-tiny", "the FFN norm inside the router", off, on, ran);
  option_vs_plain("ml4-tiny", "the FFN norm inside the router", off, on, ran);
}

// The shared expert on its own lane beside the router (CudaRunnerOptions::shared_expert_lane,
// issue 19) against the one-stream grouped path: the same bits, graphed and eager
// (CudaMoe.SharedExpertSplitIsBitIdentical checks the split alone).
TEST(CudaRunner, SharedExpertLaneIsBitIdentical) {
  ML4_REQUIRE_GPU();
  auto off = [](CudaRunnerOptions& o) { o.shared_expert_lane = false; };
  auto on = [](CudaRunnerOptions& o) {
    o.shared_expert_lane = true;
    o.shared_expert_lane_min_bytes = 0;  // the tiny models' shared experts are below the default
  };
  const auto ran = taken_iff_on(&CudaRunner::shared_lane_runs, "the shared expert on its lane");
  option_vs_plain("mistral4-tiny", "the shared expert on its lane", off, on, ran);
  option_vs_plain("ml4-tiny", "the shared expert on its lane", off, on, ran);
}

// A step's metadata through mapped host memory and one copy launch (CudaRunnerOptions::
// mapped_step_io, issue 19) against a cudaMemcpyAsync per array: the same bytes arrive, so the
// same logits, on prefills of mixed lengths and graphed and eager decode steps. (Its other
// half, sampled tokens written into mapped memory: CudaRunner.MappedSampledOutputIsTheCopiedOne.)
TEST(CudaRunner, MappedStepIoIsBitIdentical) {
  ML4_REQUIRE_GPU();
  auto off = [](CudaRunnerOptions& o) { o.mapped_step_io = false; };
  auto on = [](CudaRunnerOptions& o) { o.mapped_step_io = true; };
  option_vs_plain("mistral4-tiny", "the metadata through mapped memory", off, on);
  option_vs_plain("ml4-tiny", "the metadata through mapped memory", off, on);
}

// DSpark verification steps (every token a logits row, several tokens per sequence) take the
// decode buckets (power-of-two token counts, the GEMV path): graphed and replayed, within the
// decode graphs' bound of the eager runner, and a replay equal to the first graphed run.
TEST(CudaRunner, VerificationStepsRunAsDecodeGraphs) {
  ML4_REQUIRE_GPU();
  const std::string dir = ::ml4::testing::test_model("ml4-tiny", 11, "bf16");
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "fp8_ds_mla";
  o.base.kv_cache_bytes = 64ll << 20;
  auto eager_o = o;
  eager_o.cuda_graphs = false;
  auto g = CudaRunner::load(dir, o);
  auto e = CudaRunner::load(dir, eager_o);
  ASSERT_TRUE(g.ok() && e.ok());
  std::mt19937 rng(4);
  std::uniform_int_distribution<int> tok(1, (*g)->config().vocab_size - 1);
  for (int per_seq : {5, 3}) {  // 1 x 5 -> 8 tokens; 3 x 3 -> 16
    const int seqs = per_seq == 5 ? 1 : 3;
    StepInput prefill;
    for (int s = 0; s < seqs; ++s) {
      std::vector<int32_t> p(30 + 5 * s);
      for (auto& t : p) t = tok(rng);
      prefill.seqs.push_back(::ml4::testing::seq_step(**g, s, p, 0, 4 * s, 4, 1));
    }
    ASSERT_TRUE((*g)->execute(prefill).ok());
    ASSERT_TRUE((*e)->execute(prefill).ok());
    for (int step = 0; step < 4; ++step) {
      StepInput in;
      for (int s = 0; s < seqs; ++s) {
        std::vector<int32_t> v(per_seq);
        for (auto& t : v) t = tok(rng);
        in.seqs.push_back(::ml4::testing::seq_step(**g, s, v, 30 + 5 * s + step, 4 * s, 4, per_seq));
      }
      const int64_t before = (*g)->graph_replays();
      auto rg = (*g)->execute(in);
      auto again = (*g)->execute(in);
      auto re = (*e)->execute(in);
      ASSERT_TRUE(rg.ok() && again.ok() && re.ok());
      EXPECT_GE((*g)->graph_replays(), before + 1) << per_seq << " tokens per sequence: not replayed";
      for (int s = 0; s < seqs; ++s) {
        EXPECT_EQ(again->logits[s], rg->logits[s]) << "replay differs, step " << step;
        EXPECT_LT(::ml4::testing::rel_l2(rg->logits[s], re->logits[s]), 1e-5) << "step " << step << " seq " << s;
      }
    }
  }
}

// The ml4-tiny test model (bf16 weights) on a runner with 64 MiB of KV in `kv`.
Result<std::unique_ptr<CudaRunner>> tiny_runner(const std::string& kv, bool mapped_step_io = true) {
  CudaRunnerOptions o;
  o.mapped_step_io = mapped_step_io;
  o.base.kv_cache_dtype = kv;
  o.base.kv_cache_bytes = 64ll << 20;
  return CudaRunner::load(::ml4::testing::test_model("ml4-tiny", 11, "bf16"), o);
}

// Sequence s's sampling parameters in the device-sampling tests: row 0 greedy, then temperature
// t0 + dt * s with top-k 20 (s % 3 == 1), top-p 0.8 (s % 3 == 2) and min-p 0.05 (s == 5).
DeviceSamplingParams mixed_sampling(int s, float t0, float dt, uint64_t seed, int64_t counter) {
  DeviceSamplingParams dp;
  dp.temperature = s == 0 ? 0.0f : t0 + dt * s;
  dp.top_k = s % 3 == 1 ? 20 : 0;
  dp.top_p = s % 3 == 2 ? 0.8f : 1.0f;
  dp.min_p = s == 5 ? 0.05f : 0.0f;
  dp.seed = seed;
  dp.counter = counter;
  return dp;
}

// Device sampling through the runner: a decode step whose sequences all ask for it returns
// tokens (and logprobs) drawn on the GPU; the same step again without it (the step is
// idempotent) returns the logits, and the host reference (ops/cpu/sampling.h, the
// same Philox draw) must pick the same tokens. Logprobs agree to f32 rounding of a log-sum
// over 512 logits (1e-4 absolute).
TEST(CudaRunner, DeviceSamplingMatchesHostReference) {
  ML4_REQUIRE_GPU();
  auto r = tiny_runner("fp8_ds_mla");
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE((*r)->samples_on_device());
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> tok(1, (*r)->config().vocab_size - 1);
  const int kSeqs = 8;
  StepInput prefill, decode;
  for (int s = 0; s < kSeqs; ++s) {
    std::vector<int32_t> p(10 + 3 * s);
    for (auto& t : p) t = tok(rng);
    prefill.seqs.push_back(::ml4::testing::seq_step(**r, s, p, 0, 2 * s, 2, 1));
    auto d = ::ml4::testing::seq_step(**r, s, {tok(rng)}, static_cast<int64_t>(p.size()), 2 * s, 2, 1);
    d.device_sampling = mixed_sampling(s, 0.5f, 0.2f, 1000 + s, 7);
    decode.seqs.push_back(d);
  }
  ASSERT_TRUE((*r)->execute(prefill).ok());
  auto sampled = (*r)->execute(decode);
  ASSERT_TRUE(sampled.ok()) << sampled.status().message();
  ASSERT_EQ(sampled->sampled.size(), static_cast<size_t>(kSeqs));
  StepInput plain = decode;
  for (auto& s : plain.seqs) s.device_sampling.reset();
  auto logits = (*r)->execute(plain);
  ASSERT_TRUE(logits.ok()) << logits.status().message();
  ASSERT_TRUE(logits->sampled.empty());
  const int V = (*r)->config().vocab_size;
  for (int s = 0; s < kSeqs; ++s) {
    float lp = 0;
    const int32_t want = sampling::sample_row_reference(logits->logits[s].data(), V, *decode.seqs[s].device_sampling, &lp);
    EXPECT_EQ(sampled->sampled[s], want) << "seq " << s;
    EXPECT_NEAR(sampled->sampled_logprob[s], lp, 1e-4) << "seq " << s;
  }
}

// The sampler writing its tokens and logprobs into mapped host memory (mapped_step_io) returns
// what the device buffers and two read-back copies return: the same bits, over decode steps of
// eight sequences with greedy, temperature, top-k, top-p and min-p rows (graphed after the first).
TEST(CudaRunner, MappedSampledOutputIsTheCopiedOne) {
  ML4_REQUIRE_GPU();
  auto mapped = tiny_runner("fp8_ds_mla", true);
  auto copied = tiny_runner("fp8_ds_mla", false);
  ASSERT_TRUE(mapped.ok() && copied.ok());
  std::mt19937 rng(23);
  std::uniform_int_distribution<int> tok(1, (*mapped)->config().vocab_size - 1);
  const int kSeqs = 8;
  StepInput prefill;
  std::vector<int64_t> pos(kSeqs);
  for (int s = 0; s < kSeqs; ++s) {
    std::vector<int32_t> p(12 + 5 * s);
    for (auto& t : p) t = tok(rng);
    pos[s] = static_cast<int64_t>(p.size());
    prefill.seqs.push_back(::ml4::testing::seq_step(**mapped, s, p, 0, 2 * s, 2, 1));
  }
  ASSERT_TRUE((*mapped)->execute(prefill).ok());
  ASSERT_TRUE((*copied)->execute(prefill).ok());
  std::vector<int32_t> next(kSeqs);
  for (auto& t : next) t = tok(rng);
  for (int step = 0; step < 4; ++step) {
    StepInput decode;
    for (int s = 0; s < kSeqs; ++s) {
      auto d = ::ml4::testing::seq_step(**mapped, s, {next[s]}, pos[s]++, 2 * s, 2, 1);
      d.device_sampling = mixed_sampling(s, 0.6f, 0.1f, 500 + s, step);
      decode.seqs.push_back(d);
    }
    auto a = (*mapped)->execute(decode);
    auto b = (*copied)->execute(decode);
    ASSERT_TRUE(a.ok()) << a.status().message();
    ASSERT_TRUE(b.ok()) << b.status().message();
    ASSERT_EQ(a->sampled.size(), static_cast<size_t>(kSeqs));
    EXPECT_EQ(a->sampled, b->sampled) << "step " << step;
    ASSERT_EQ(a->sampled_logprob.size(), b->sampled_logprob.size());
    EXPECT_EQ(0, std::memcmp(a->sampled_logprob.data(), b->sampled_logprob.data(), kSeqs * 4)) << "step " << step;
    for (int s = 0; s < kSeqs; ++s) next[s] = a->sampled[s];
  }
  EXPECT_GT((*mapped)->graph_replays(), 0);
}

// Greedy verification on the device (step.h): sequences verifying drafts carry greedy
// device_sampling over their 1 + k rows and get one token per row, rows in order, each the
// argmax of the row the same step returns as logits without it (ties to the lowest id, as the
// host verifier); a step where one sequence lacks device_sampling returns logits for all.
TEST(CudaRunner, GreedyVerificationRowsAreTheRowsArgmax) {
  ML4_REQUIRE_GPU();
  auto r = tiny_runner("fp8_ds_mla");
  ASSERT_TRUE(r.ok()) << r.status().message();
  std::mt19937 rng(33);
  std::uniform_int_distribution<int> tok(1, (*r)->config().vocab_size - 1);
  const int V = (*r)->config().vocab_size;
  const int rows[] = {5, 1, 8};  // 4 drafts, a plain greedy decode, 7 drafts
  StepInput prefill, verify;
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> p(12 + 7 * s);
    for (auto& t : p) t = tok(rng);
    prefill.seqs.push_back(::ml4::testing::seq_step(**r, s, p, 0, 2 * s, 2, 1));
    std::vector<int32_t> v(rows[s]);
    for (auto& t : v) t = tok(rng);
    auto d = ::ml4::testing::seq_step(**r, s, v, static_cast<int64_t>(p.size()), 2 * s, 2, rows[s]);
    DeviceSamplingParams dp;  // greedy
    dp.temperature = 0.0f;
    dp.seed = 5 + s;
    dp.counter = 3;
    d.device_sampling = dp;
    verify.seqs.push_back(d);
  }
  ASSERT_TRUE((*r)->execute(prefill).ok());
  auto sampled = (*r)->execute(verify);
  ASSERT_TRUE(sampled.ok()) << sampled.status().message();
  ASSERT_TRUE(sampled->logits.empty());
  ASSERT_EQ(sampled->sampled.size(), static_cast<size_t>(5 + 1 + 8));
  ASSERT_EQ(sampled->sampled_logprob.size(), sampled->sampled.size());
  StepInput mixed = verify;
  mixed.seqs[1].device_sampling.reset();  // one sequence wants logits: every sequence gets them
  auto logits = (*r)->execute(mixed);
  ASSERT_TRUE(logits.ok()) << logits.status().message();
  ASSERT_TRUE(logits->sampled.empty());
  ASSERT_EQ(logits->logits.size(), 3u);
  size_t e = 0;
  for (int s = 0; s < 3; ++s) {
    ASSERT_EQ(logits->logits[s].size(), static_cast<size_t>(rows[s]) * V);
    for (int j = 0; j < rows[s]; ++j, ++e) {
      const float* row = logits->logits[s].data() + static_cast<size_t>(j) * V;
      float lp = 0;
      const int32_t want = sampling::sample_row_reference(row, V, *verify.seqs[s].device_sampling, &lp);
      EXPECT_EQ(sampled->sampled[e], want) << "seq " << s << " row " << j;
      EXPECT_EQ(want, static_cast<int32_t>(std::max_element(row, row + V) - row)) << "seq " << s << " row " << j;
      EXPECT_NEAR(sampled->sampled_logprob[e], lp, 1e-4) << "seq " << s << " row " << j;
    }
  }
}

// Fail closed (issue 19): once a kernel has recorded a device fault in the runner's fault word
// (here the barrier probe with a block that never arrives, on the runner's own record), the
// next step fails with the fault named, and so does every step after it; the steps before it
// ran normally.
TEST(CudaRunner, DeviceFaultFailsEveryLaterStep) {
  ML4_REQUIRE_GPU();
  auto gpu = tiny_runner("bf16");
  ASSERT_TRUE(gpu.ok()) << gpu.status().message();
  std::vector<int32_t> prompt(12);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + 7 * i);
  StepInput in;
  in.seqs.push_back(::ml4::testing::seq_step(**gpu, 1, prompt, 0, 0, 1, 1));
  auto ok = (*gpu)->execute(in);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_FALSE((*gpu)->fault_word().raised());
  BarrierProbe probe;
  probe.rounds = 10;
  probe.never_arrive_block = 1;
  probe.timeout_ns = 50'000'000;
  auto pr = run_barrier_probe(probe, (*gpu)->fault_word(), nullptr);
  ASSERT_TRUE(pr.ok()) << pr.status().message();
  ASSERT_TRUE((*gpu)->fault_word().raised());
  StepInput next;
  next.seqs.push_back(::ml4::testing::seq_step(**gpu, 1, {9}, 12, 0, 1, 1));
  for (int i = 0; i < 2; ++i) {
    auto bad = (*gpu)->execute(next);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("device fault"), std::string::npos) << bad.status().message();
    EXPECT_NE(bad.status().message().find("never arrived"), std::string::npos) << bad.status().message();
  }
}

// `--decode-backend latency_specialized` (each layer's FFN half as the resident kernel,
// ops/cuda/ffn_resident.h, through Backend::ffn_block) against the standard path on ml4-tiny
// with FP8 weights (a dense layer; MoE layers with a shared expert, two expert groups keeping
// one, routed_scale 1.5), graphs on: one prefill of four prompts (28 tokens: the standard
// path on both runners, logits equal), then decode steps of 1 to 4 sequences on the standard
// runner's greedy tokens.
// - One sequence: every linear of the standard step takes the stream GEMV with four warps
//   sharing 4 rows (ml4-tiny's widths are below the 16 blocks an SM where one-warp blocks take
//   over, gemv.cu warp_rows_at; at ml4-slice widths the two paths differ in summation order),
//   whose sums the resident kernel computes the same way, and its router, norm, SiLU and combine
//   too: the logits are bit-identical while the sequence has only ever decoded alone (a step at
//   batch 2..4 leaves its cache rows apart in the last bits, as below).
// - Two to four: the standard path's grouped expert GEMVs and attention linears run on the
//   stream's M = 2 kernel (two tokens) or the f16 mma kernel (three, four: gemv_mma.cuh, x kept
//   to 22 bits): summation order and x's last bits (~1e-7), but ml4-tiny's random routing is near-tied, so one flip
//   can move a row's logits (the exact CPU comparison measured up to 5.6e-3): bound 1e-2.
// The graphed latency runner equals a latency runner without graphs (the same launches) bit
// for bit (within 1e-5 where graphs pad the batch: 3 sequences). Then the fault switch: a block that never arrives at the kernel's first barrier
// (50 ms bound) fails that step and every later one, naming the device fault.
TEST(CudaRunner, LatencyDecodeMatchesStandard) {
  ML4_REQUIRE_GPU();
  const std::string dir = ::ml4::testing::test_model("ml4-tiny", 11, "fp8");
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "fp8_ds_mla";
  o.base.kv_cache_bytes = 64ll << 20;
  o.fp4_x_parts = 0;
  auto std_r = CudaRunner::load(dir, o);
  ASSERT_TRUE(std_r.ok()) << std_r.status().message();
  o.latency_decode = true;
  auto lat_r = CudaRunner::load(dir, o);
  ASSERT_TRUE(lat_r.ok()) << lat_r.status().message();
  o.cuda_graphs = false;
  auto eager_r = CudaRunner::load(dir, o);  // the latency path without graphs: the same launches
  ASSERT_TRUE(eager_r.ok()) << eager_r.status().message();
  CudaRunner& sr = **std_r;
  CudaRunner& lr = **lat_r;
  CudaRunner& er = **eager_r;
  std::mt19937 g(31);
  std::uniform_int_distribution<int> tok(1, sr.config().vocab_size - 1);
  const int lens[4] = {5, 7, 9, 7};
  std::vector<int64_t> pos(4);
  std::vector<int32_t> next(4);
  StepInput prefill;
  for (int s = 0; s < 4; ++s) {
    std::vector<int32_t> p(lens[s]);
    for (auto& t : p) t = tok(g);
    prefill.seqs.push_back(::ml4::testing::seq_step(sr, s + 1, p, 0, s, 1, 1));
    pos[s] = lens[s];
  }
  auto a = sr.execute(prefill);
  auto b = lr.execute(prefill);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().message() << b.status().message();
  ASSERT_TRUE(er.execute(prefill).ok());
  ASSERT_EQ(a->logits.size(), 4u);
  EXPECT_EQ(a->logits, b->logits) << "prefill runs the standard path on both";
  EXPECT_EQ(lr.resident_ffn_launches(), 0) << "a 28-token step is not the latency path's";
  for (int s = 0; s < 4; ++s) next[s] = argmax(a->logits[s]);
  const std::vector<std::vector<int>> schedule = {{0}, {0}, {1, 2}, {0, 1, 2}, {0, 1, 2, 3}, {3}, {0, 1, 2, 3}, {2}};
  double worst = 0.0;
  std::vector<bool> apart(4, false);  // a sequence whose earlier steps ran at batch > 1
  for (const auto& seqs : schedule) {
    StepInput in;
    for (int s : seqs) in.seqs.push_back(::ml4::testing::seq_step(sr, s + 1, {next[s]}, pos[s], s, 1, 1));
    auto ra = sr.execute(in);
    auto rb = lr.execute(in);
    auto rc = er.execute(in);
    ASSERT_TRUE(ra.ok()) << ra.status().message();
    ASSERT_TRUE(rb.ok()) << rb.status().message();
    ASSERT_TRUE(rc.ok()) << rc.status().message();
    ASSERT_EQ(ra->logits.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      ASSERT_TRUE(testing::all_finite(rb->logits[i]));
      const double ge = ::ml4::testing::rel_l2(rb->logits[i], rc->logits[i]);
      if ((seqs.size() & (seqs.size() - 1)) == 0)  // a padded batch may move the last bits (option_vs_plain)
        EXPECT_EQ(rb->logits[i], rc->logits[i]) << "graphed vs eager latency path, batch " << seqs.size() << ": rel " << ge;
      else
        EXPECT_LT(ge, 1e-5) << "graphed vs eager latency path, batch " << seqs.size();
      const double e = ::ml4::testing::rel_l2(rb->logits[i], ra->logits[i]);
      if (seqs.size() == 1 && !apart[seqs[i]]) {
        EXPECT_EQ(rb->logits[i], ra->logits[i]) << "batch 1, seq " << seqs[i] << ": rel " << e;
      } else {
        worst = std::max(worst, e);
        EXPECT_LT(e, 1e-2) << "batch " << seqs.size() << " seq " << seqs[i];
      }
      next[seqs[i]] = argmax(ra->logits[i]);
      ++pos[seqs[i]];
      apart[seqs[i]] = apart[seqs[i]] || seqs.size() > 1;  // its cache rows now differ in the last bits
    }
  }
  std::printf("latency path vs standard on ml4-tiny fp8: batch 1 bit-identical; batches 2-4 (and what follows them) "
              "worst rel_l2 %.3g (bound 1e-2); %ld resident launches, %ld graph replays\n",
              worst, static_cast<long>(lr.resident_ffn_launches()), static_cast<long>(lr.graph_replays()));
  EXPECT_GT(lr.resident_ffn_launches(), 0);
  EXPECT_EQ(sr.resident_ffn_launches(), 0);
  EXPECT_GT(lr.graph_replays(), 0);

  lr.set_resident_fault_test(3, 0.05);
  StepInput one;
  one.seqs.push_back(::ml4::testing::seq_step(sr, 1, {next[0]}, pos[0], 0, 1, 1));
  for (int i = 0; i < 2; ++i) {
    auto bad = lr.execute(one);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("device fault"), std::string::npos) << bad.status().message();
    EXPECT_NE(bad.status().message().find("wait site 1"), std::string::npos) << bad.status().message();
  }
  // The other runner (the same card, its own fault word) goes on.
  auto fine = sr.execute(one);
  ASSERT_TRUE(fine.ok()) << fine.status().message();
}

// The fault test at the process level: `ml4 generate --decode-backend latency_specialized` with
// the test switch (ML4_TEST_RESIDENT_NEVER_ARRIVE: the resident kernel's block 3 never arrives)
// and a 50 ms bound must end by itself, non-zero, naming the device fault, within seconds; the
// next process on the card then generates on the same path. (`ml4` beside this binary.)
TEST(CudaRunner, LatencyDecodeFaultEndsTheProcessAndTheCardServesTheNext) {
  ML4_REQUIRE_GPU();
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  std::string ml4 = self;
  ml4 = ml4.substr(0, ml4.rfind('/')) + "/ml4";
  ASSERT_EQ(access(ml4.c_str(), X_OK), 0) << ml4;
  const std::string dir = ::ml4::testing::test_model("ml4-tiny", 11, "fp8");
  const std::string log = ::testing::TempDir() + "/latency_fault.log";
  const std::string gen = "'" + ml4 + "' generate --device cuda --model '" + dir +
                          "' --prompt-ids 5,17,33,9 --max-tokens 4 --temperature 0 "
                          "--decode-backend latency_specialized --latency-wait-timeout 0.05";
  auto run = [&](const std::string& env) {
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = std::system((env + " " + gen + " > '" + log + "' 2>&1").c_str());
    std::ifstream f(log);
    std::stringstream out;
    out << f.rdbuf();
    return std::make_tuple(rc, out.str(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  const auto [rc1, out1, s1] = run("ML4_TEST_RESIDENT_NEVER_ARRIVE=3");
  EXPECT_NE(rc1, 0) << out1;
  EXPECT_NE(out1.find("device fault"), std::string::npos) << out1;
  EXPECT_EQ(out1.find("ids:"), std::string::npos) << out1;
  EXPECT_LT(s1, 60.0);
  const auto [rc2, out2, s2] = run("");
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("ids:"), std::string::npos) << out2;
  std::printf("latency fault: faulting process exited %d after %.1f s; the next generated in %.1f s\n", rc1, s1, s2);
}

TEST(CudaRunner, SizesKvFromGpuMemoryUtilization) {
  ML4_REQUIRE_GPU();
  const std::string dir = ::ml4::testing::test_model("mistral4-tiny", 11, "bf16");
  CudaRunnerOptions o;
  o.gpu_memory_utilization = 0.05;
  auto r = CudaRunner::load(dir, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  std::printf("gpu_memory_utilization 0.05: weights %.1f MiB, kv %.1f MiB, %ld blocks\n", (*r)->weight_bytes() / 1048576.0,
              (*r)->kv_bytes() / 1048576.0, (*r)->cache_groups()[0].num_blocks);
  EXPECT_GT((*r)->cache_groups()[0].num_blocks, 0);
  o.gpu_memory_utilization = 1.5;
  EXPECT_EQ(CudaRunner::load(dir, o).status().code(), StatusCode::kInvalidArgument);
  // A DSA model gets its three cache groups (latent, indexer, drafter) from one budget.
  auto dsa = CudaRunner::load(::ml4::testing::test_model("ml4-tiny", 11, "bf16"), CudaRunnerOptions{});
  ASSERT_TRUE(dsa.ok()) << dsa.status().message();
  EXPECT_EQ((*dsa)->cache_groups().size(), 3u);
}

}  // namespace
}  // namespace ml4::cuda
#endif  // ML4_WITH_CUDA
