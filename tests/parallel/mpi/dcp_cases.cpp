// Decode context parallelism against one process (issue 15, SYSTEM.md S8), through the
// production path (ParallelRunner on rank 0): TP N with the KV cache sharded over DCP groups
// of 2 or N ranks, both combines (a2a, ag_rs), interleave sizes 1, 4 and 8.
//
// What must hold, and why:
//  - Layer 0's top-k sets equal the single process's exactly, ties included, at every step:
//    its inputs are the embeddings (bit-identical under TP), so each rank's scores are the
//    single process's scores of the same keys, and the merge of the ranks' candidates must
//    give the single process's selection (ties to the lower position). Random ml4-tiny
//    weights give many exact ties (relu zeroes every head's term for a share of the keys).
//  - Teacher-forced (the single process's top-k sets and routed experts imposed; ml4-tiny,
//    bf16 cache), both sides compute one function and what differs is the order of f32 sums:
//    TP's (model_cases.cpp), and the log-sum-exp merge of the ranks' partial softmaxes (each
//    renormalised by exp(lse_p - L): a few ulps per element, 2^-24 relative, the size of TP's
//    reordered sums). The bound is the TP test's (golden_check.h: rel L2 1e-3, max-abs 2e-3
//    of the largest |logit|), for the reason given there (bf16 cache rounding points).
//    Measured 6.3e-4 .. 9.7e-4 (2 and 4 ranks, 2026-12-04).
//  - Free running on the trained model (ml4-small decoded to bf16, English text, prompts of
//    600 / 1000 / 1500 tokens against a top-k of 256, and one 16k-token prompt): greedy ids
//    equal at every step, logits within rel L2 3e-3 (measured 4e-6 .. 3.2e-4).
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include <gtest/gtest.h>

#include "parallel/mpi/harness.h"
#include "engine/engine.h"
#include "engine/text_codec.h"
#include "model/quantize_checkpoint.h"
#include "runtime/cpu/cpu_runner.h"
#include "runtime/golden_check.h"
#include "runtime/test_models.h"
#include "tokenizer/tokenizer.h"

namespace ml4 {
namespace {

using Run = mpitest::ReferenceRun;

// Sequence i takes blocks [i * stride, ...) of every full-attention group, as many as the
// runner's block size needs (a DCP runner's block holds N pages).
SeqStep make_seq(const ModelRunner& r, int i, int stride, std::vector<int32_t> tokens, int64_t start) {
  SeqStep s;
  s.seq_id = 100 + i;
  s.start_pos = start;
  s.num_logits = 1;
  const int64_t end = start + static_cast<int64_t>(tokens.size());
  s.tokens = std::move(tokens);
  for (const auto& g : r.cache_groups()) {
    std::vector<int32_t> bt;
    if (g.sliding_window == 0)
      for (int64_t b = 0; b * g.page_tokens < end; ++b) bt.push_back(static_cast<int32_t>(i * stride + b));
    s.block_tables.push_back(bt);
  }
  return s;
}

struct Case {
  std::string dir, kv;
  std::vector<std::vector<int32_t>> prompts;
  int decode_steps = 4;
  int stride = 8;      // blocks per sequence
  int kv_mib = 32;     // KV budget per rank
  int max_len = 0;
  bool free_greedy = true;  // free running must give the same greedy ids, but at near-ties
  double free_rel_l2 = 0.0; // > 0: free running's logits within this rel L2 of one process
  // Teacher-forced bounds (default: the goldens', tests/runtime/golden_check.h).
  double forced_rel_l2 = golden::kRelL2, forced_max_abs_rel = golden::kMaxAbsRel;
  bool exact = false;       // bit-identical logits (set per config by check())
};

Run reference(ModelRunner& r, const Case& c) {
  return mpitest::reference_run(r, c.prompts, c.decode_steps, [&](int i, std::vector<int32_t> t, int64_t start) {
    return make_seq(r, i, c.stride, std::move(t), start);
  });
}

enum Mode { kFree, kTraced, kForced };

// kFree: as served; kTraced: also layer 0's sets must equal; kForced: teacher-forced.
void compare(ModelRunner& p, const Run& ref, const Case& c, Mode mode, const std::string& what) {
  const int V = p.config().vocab_size;
  double worst = 0.0;
  int64_t sets = 0, differ = 0, greedy_diff = 0;
  for (size_t k = 0; k < ref.steps.size(); ++k) {
    StepInput in;
    for (size_t i = 0; i < ref.steps[k].seqs.size(); ++i) {
      const auto& s = ref.steps[k].seqs[i];
      in.seqs.push_back(make_seq(p, static_cast<int>(i), c.stride, s.tokens, s.start_pos));
    }
    ForwardTrace tr;
    if (mode == kForced) {
      tr.forced_topk = ref.traces[k].topk;
      tr.forced_experts = ref.traces[k].experts;
    }
    auto out = mode == kFree ? p.execute(in) : p.execute_traced(in, &tr);
    ASSERT_TRUE(out.ok()) << what << ": " << out.status().message();
    if (mode == kTraced) {
      ASSERT_EQ(tr.topk.size(), ref.traces[k].topk.size());
      for (size_t l = 0; l < tr.topk.size(); ++l)
        for (size_t t = 0; t < tr.topk[l].size(); ++t) {
          if (l == 0) {
            EXPECT_EQ(tr.topk[l][t], ref.traces[k].topk[l][t]) << what << " step " << k << " token " << t
                                                               << ": layer 0's top-k set differs";
            ++sets;
          } else {
            differ += tr.topk[l][t] != ref.traces[k].topk[l][t];
          }
        }
    }
    for (size_t i = 0; i < in.seqs.size(); ++i) {
      const auto& a = out->logits[i];
      const auto& b = ref.outs[k].logits[i];
      ASSERT_EQ(a.size(), static_cast<size_t>(V));
      const mpitest::LogitsDiff d = mpitest::logits_diff(a, b);
      const double rel = d.rel_l2, mx = d.max_abs, big = d.max_ref;
      worst = std::max(worst, rel);
      greedy_diff += d.argmax != d.argmax_ref;
      if (mode == kForced) {
        EXPECT_EQ(d.argmax, d.argmax_ref) << what << " step " << k << " seq " << i;
      } else if (c.free_greedy && d.argmax != d.argmax_ref) {
        // Free running (each step fed the one process's tokens) may pick another token only at
        // a near-tie its logits' difference can reorder: the one process's margin between the
        // two tokens at most twice the largest |difference| (else it is a real error).
        const double margin = static_cast<double>(b[d.argmax_ref]) - b[d.argmax];
        EXPECT_LE(margin, 2.0 * mx) << what << " step " << k << " seq " << i << ": greedy " << d.argmax << " vs "
                                    << d.argmax_ref << " with a margin of " << margin << " (max |diff| " << mx << ")";
      }
      if (mode != kForced && c.free_rel_l2 > 0.0) {
        EXPECT_LT(rel, c.free_rel_l2) << what << " step " << k << " seq " << i;
      }
      if (c.exact) {
        EXPECT_EQ(rel, 0.0) << what << " step " << k << " seq " << i;
      }
      if (mode == kForced) {
        EXPECT_LT(rel, c.forced_rel_l2) << what << " step " << k << " seq " << i;
        EXPECT_LT(mx, c.forced_max_abs_rel * big) << what << " step " << k << " seq " << i;
      }
    }
  }
  static const char* names[] = {"free", "traced", "forced"};
  std::string extra = mode == kTraced ? fmt::format(", layer-0 sets equal: {}, later layers' sets differing: {}", sets, differ)
                                      : "";
  std::printf("  %-44s %-6s: worst rel L2 %.2e, greedy ids differing %lld%s\n", what.c_str(), names[mode], worst,
              static_cast<long long>(greedy_diff), extra.c_str());
}

struct Config {
  int tp, dcp, interleave;
  const char* backend;
  int pcp = 1;
};

std::vector<Config> dcp_configs(int world) {
  if (world == 2) return {{2, 2, 1, "a2a"}, {2, 2, 1, "ag_rs"}, {2, 2, 8, "a2a"}};
  if (world == 4) return {{4, 4, 1, "a2a"}, {4, 4, 1, "ag_rs"}, {4, 4, 4, "a2a"}, {4, 2, 1, "a2a"}};
  return {};
}

std::unique_ptr<ModelRunner> single_runner(const Case& c) {
  RunnerOptions ro;
  ro.kv_cache_dtype = c.kv;
  ro.kv_cache_bytes = static_cast<int64_t>(c.kv_mib) << 20;
  ro.max_model_len = c.max_len;
  auto r = CpuRunner::load(c.dir, ro);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::unique_ptr<ModelRunner>(std::move(r).value()) : nullptr;
}

void check(const Case& c, const std::vector<Config>& configs, const std::vector<Mode>& modes, const std::string& name) {
  auto single = single_runner(c);
  ASSERT_TRUE(single);
  const Run ref = reference(*single, c);
  ASSERT_EQ(ref.steps.size(), static_cast<size_t>(c.decode_steps + 1));
  single.reset();
  ASSERT_FALSE(configs.empty()) << "run with mpirun -np 2 or 4";
  for (const Config& cf : configs) {
    ParallelConfig pc;
    pc.tensor_parallel_size = cf.tp;
    pc.decode_context_parallel_size = cf.dcp;
    pc.dcp_kv_cache_interleave_size = cf.interleave;
    pc.dcp_comm_backend = cf.backend;
    pc.prefill_context_parallel_size = cf.pcp;
    auto p = mpitest::load_everywhere(c.dir, c.kv, pc, c.max_len, c.kv_mib);
    ASSERT_TRUE(p);
    // PCP alone changes no arithmetic: every CPU op is row-independent (batch-invariant) and the
    // gathered K/V rows are the bytes one process writes, so the logits are bit-identical.
    Case cc = c;
    cc.exact = cf.pcp > 1 && cf.tp == 1 && cf.dcp == 1;
    const std::string what = fmt::format("{} tp{} dcp{} I{} {}{} kv {}", name, cf.tp, cf.dcp, cf.interleave, cf.backend,
                                         cf.pcp > 1 ? fmt::format(" pcp{}", cf.pcp) : "", c.kv);
    for (Mode m : modes)
      if (m == kFree || cf.pcp == 1) compare(*p, ref, cc, m, what);  // PCP refuses traced steps
  }
}

std::vector<int32_t> random_tokens(std::mt19937& rng, int n, int V) {
  std::vector<int32_t> p(n);
  for (auto& t : p) t = static_cast<int32_t>(rng() % V);
  return p;
}

// English text for the trained model: the repository's docs, tokenized, cut into prompts.
std::vector<int32_t> docs_tokens(const std::string& dir, int64_t n) {
  auto tok = Tokenizer::load(dir + "/tekken.json");
  EXPECT_TRUE(tok.ok()) << tok.status().message();
  std::vector<int32_t> out;
  if (!tok.ok()) return out;
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(std::string(ML4_SOURCE_DIR) + "/docs"))
    if (e.path().extension() == ".md") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f);
    std::stringstream ss;
    ss << in.rdbuf();
    auto ids = (*tok)->encode(ss.str());
    out.insert(out.end(), ids.begin(), ids.end());
    if (static_cast<int64_t>(out.size()) >= n) break;
  }
  EXPECT_GE(static_cast<int64_t>(out.size()), n) << "docs/*.md hold too little text";
  out.resize(std::min<int64_t>(n, static_cast<int64_t>(out.size())));
  return out;
}

// Random ml4-tiny: teacher-forced within the bound, layer 0's sets exact. Free running is
// reported, not asserted: random weights make the indexer's scores near-tie everywhere, so
// a few-ulp difference flips later layers' sets (the debugging run showed layers 0-2 exact
// and a growing share of differing sets from layer 3 on, as under TP alone with long
// contexts); the trained model below is where free-running greedy equality is asserted.
void check_tiny(const std::string& kv) {
  mpitest::run_case([&] {
    Case c;
    c.dir = testing::test_model("ml4-tiny", 1234, "bf16", "native");
    c.kv = kv;
    std::mt19937 rng(7);
    for (int n : {40, 100, 200}) c.prompts.push_back(random_tokens(rng, n, 512));
    c.free_greedy = false;
    check(c, dcp_configs(mpitest::world()), {kForced, kTraced, kFree}, "ml4-tiny");
  });
}

TEST(ContextParallel, Ml4TinyBf16) { check_tiny("bf16"); }

// assets/ml4-small with its linears decoded to bf16, once per job (rank 0 writes it; every
// rank reads the directory named in the load message): its FP8 128-blocks cannot be split
// over TP 2 (a 128-wide shared expert), bf16 weights split at any width.
std::string ml4_small_bf16() {
  static const std::string dir = [] {
    const std::string out =
        (std::filesystem::temp_directory_path() / fmt::format("ml4-dcp-small-bf16-{}", ::getpid())).string();
    QuantizeOptions o;
    o.in_dir = std::string(ML4_SOURCE_DIR) + "/assets/ml4-small";
    o.out_dir = out;
    o.to = "bf16";
    auto r = quantize_checkpoint(o);
    EXPECT_TRUE(r.ok()) << r.status().message();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(
          std::filesystem::temp_directory_path() / fmt::format("ml4-dcp-small-bf16-{}", ::getpid()), ec);
    });
    return out;
  }();
  return dir;
}

// The trained model (ml4-small: top-k 256) on English text, prompts of 600, 1000 and
// 1500 tokens: free-running greedy ids equal to one process.
TEST(ContextParallel, Ml4SmallGreedyEqualsOneProcess) {
  mpitest::run_case([&] {
    Case c;
    c.dir = ml4_small_bf16();
    c.kv = "fp8_ds_mla";
    const auto text = docs_tokens(c.dir, 3200);
    c.prompts = {{text.begin(), text.begin() + 600}, {text.begin() + 600, text.begin() + 1600},
                 {text.begin() + 1600, text.begin() + 3100}};
    c.decode_steps = 8;
    c.stride = 32;
    // Teacher-forced (the one process's top-k sets and experts): the ranks' arithmetic alone.
    // With the fp8_ds_mla cache, TP's other reduction order changes a latent value's last bits
    // and a value near an e4m3 rounding boundary then lands one format step (1/16 .. 1/8 of
    // itself) the other way; the retrained model's sharp attention carries that to 2.5e-3 of
    // the logits (max |diff| 2.7e-3 of the largest logit), the same at every DCP size, interleave
    // and combine backend, and TP 2 alone (PCP 2 x TP 2, no DCP) gives 2.3e-3 free running: it is
    // TP's rounding, not the merge. The bound is 2x that, where a wrong merge or shard costs 1e-1.
    c.forced_rel_l2 = 5e-3;
    c.forced_max_abs_rel = 5e-3;
    // Free running, a near-tie key swapped in a set of 256 moves the logits too (the runs are
    // deterministic on a machine: fixed reduction orders and thread counts): 2e-2.
    c.free_rel_l2 = 2e-2;
    check(c, dcp_configs(mpitest::world()), {kForced, kFree, kTraced}, "ml4-small");
  });
}

// Prefill context parallelism (S9): each PCP rank runs its DualChunkSwap share of the prompts
// (pcp_split.h) and every rank writes the whole step's K/V. The trained model, free running,
// against one process: PCP 2 (TP 1); at 4 ranks PCP 4, PCP 2 x TP 2 and PCP 2 x TP 2 x DCP 2.
TEST(ContextParallel, PrefillContextParallelMatchesOneProcess) {
  mpitest::run_case([&] {
    Case c;
    c.dir = ml4_small_bf16();
    c.kv = "fp8_ds_mla";
    const auto text = docs_tokens(std::string(ML4_SOURCE_DIR) + "/assets/ml4-small", 3200);
    c.prompts = {{text.begin(), text.begin() + 600}, {text.begin() + 600, text.begin() + 1601},
                 {text.begin() + 1601, text.begin() + 1610}, {text.begin() + 1610, text.begin() + 3100}};
    c.decode_steps = 6;
    c.stride = 32;
    c.free_rel_l2 = 2e-2;  // as above
    std::vector<Config> configs;
    if (mpitest::world() == 2) configs = {{1, 1, 1, "a2a", 2}};
    if (mpitest::world() == 4) configs = {{1, 1, 1, "a2a", 4}, {2, 1, 1, "a2a", 2}, {2, 2, 1, "a2a", 2}};
    check(c, configs, {kFree}, "ml4-small");
  });
}

// Long context (vllm #41623 reports drift there): one 16k-token prompt under DCP 2 and PCP 2.
// ml4-small rather than ml4-tiny: ml4-tiny stops at 4096 positions, and its random weights make
// free running meaningless at any length (see check_tiny). 16k is 4x ml4-small's training length:
// there its indexer scores have near-ties that any other reduction order flips (TP 2 x PCP 2
// without DCP moves the free-running logits by 6.8e-2, the greedy ids staying equal), so the
// merge is checked teacher-forced (the one process's sets: DCP's arithmetic alone, against the
// goldens' bound) and free running must keep the greedy ids but at near-ties within its logits'
// difference (which tokens tie depends on the prompt: the repository's docs); PCP alone stays
// bit-identical.
TEST(ContextParallel, Ml4SmallLongContext16k) {
  mpitest::run_case([&] {
    Case c;
    c.dir = ml4_small_bf16();
    c.kv = "fp8_ds_mla";
    c.prompts = {docs_tokens(c.dir, 16384)};
    c.decode_steps = 4;
    c.stride = 300;
    c.kv_mib = 128;
    c.max_len = 16384 + 8;
    // TP 2 x DCP 2 on the fp8_ds_mla cache: TP's rounding moves latent values across e4m3
    // boundaries, which the trained model's sharp attention carries to ~2.5e-3 of the logits
    // (Ml4SmallGreedyEqualsOneProcess above argues it): its bounds. The prompt is the repository's
    // docs, so the figure moves with every docs edit: 1.9e-3 rel L2 and 2.8e-3 max |diff| of the
    // largest logit on 2026-12-06, beyond the goldens' 1.5e-3 / 2e-3 that held before by chance.
    c.forced_rel_l2 = 5e-3;
    c.forced_max_abs_rel = 5e-3;
    check(c, {{mpitest::world(), 2, 1, "a2a"}, {mpitest::world() / 2, 1, 1, "a2a", 2}}, {kForced, kFree}, "ml4-small 16k");
  });
}

// HiSparse (SYSTEM.md S12) on TP ranks: every rank holds whole latent rows, runs the same
// policy on the same selections and frees a sequence's buffers when rank 0's engine releases
// it (ParallelRunner::release broadcasts it). Against the same TP group without offload: logits
// bit for bit equal (the same rows, in the same order), over a prefill that overflows the hot
// buffers and 30 decode steps that go through them, evicting and reloading rows (ml4-tiny:
// top-k 16, hot buffers of 32 rows, contexts of 120-220 tokens).
TEST(ParallelHiSparse, TensorParallelEqualsWithoutOffload) {
  mpitest::run_case([&] {
    const std::string dir = testing::test_model("ml4-tiny", 1234, "bf16", "native");
    std::mt19937 rng(21);
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 3; ++i) prompts.push_back(random_tokens(rng, 120 + 50 * i, 512));
    ParallelConfig pc;
    pc.tensor_parallel_size = mpitest::world();
    auto run = [&](int slots) {
      auto p = mpitest::load_everywhere(dir, "fp8_ds_mla", pc, 0, 32, false, slots);
      EXPECT_TRUE(p);
      if (!p) return mpitest::ReferenceRun{};
      auto r = mpitest::reference_run(*p, prompts, 30, [&](int i, std::vector<int32_t> t, int64_t start) {
        return make_seq(*p, i, 8, std::move(t), start);
      });
      if (slots > 0) {
        const HiSparseState* st = p->hisparse();
        EXPECT_NE(st, nullptr);
        if (st != nullptr) {
          EXPECT_GT(st->hot_layers, 0);
          EXPECT_GT(st->direct_layers, 0);
          EXPECT_GT(st->loads, 3 * st->layers() * st->slots());
          for (int i = 0; i < 3; ++i) p->release(100 + i);  // make_seq's ids; reaches every rank
          EXPECT_EQ(st->regions_in_use(), 0);
          std::printf("  hisparse tp%d: hot layer-steps %lld, direct %lld, rows loaded %lld, hits %lld\n",
                      mpitest::world(), static_cast<long long>(st->hot_layers),
                      static_cast<long long>(st->direct_layers), static_cast<long long>(st->loads),
                      static_cast<long long>(st->hits));
        }
      }
      return r;
    };
    const auto plain = run(0);
    const auto hs = run(32);
    ASSERT_EQ(plain.outs.size(), hs.outs.size());
    for (size_t k = 0; k < plain.outs.size(); ++k)
      for (size_t i = 0; i < plain.outs[k].logits.size(); ++i)
        EXPECT_EQ(plain.outs[k].logits[i], hs.outs[k].logits[i]) << "step " << k << " seq " << i;
  });
}

// DSpark x DCP (issue 15, SYSTEM.md S7): the drafter's layers split over the TP ranks as the
// target's, its window cache whole on every DCP rank while the target's is sharded. Lossless:
// greedy outputs with 7 drafts per step equal the same runner's without speculation, token for
// token; and the trained drafter's drafts are really accepted (one process and DCP both measure
// ~1.3 tokens per step on these prompts), at the rate one process accepts them.
TEST(ContextParallel, DsparkIsLosslessUnderDcp) {
  mpitest::run_case([&] {
    const std::string dir = ml4_small_bf16();
    const auto text = docs_tokens(std::string(ML4_SOURCE_DIR) + "/assets/ml4-small", 2400);
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 4; ++i) prompts.emplace_back(text.begin() + 500 * i, text.begin() + 500 * i + 300 + 100 * i);
    ParallelConfig pc;
    pc.tensor_parallel_size = mpitest::world();
    pc.decode_context_parallel_size = 2;
    auto p = mpitest::load_everywhere(dir, "fp8_ds_mla", pc, 0, 64, true);
    ASSERT_TRUE(p);
    ASSERT_TRUE(p->has_drafter());
    ByteTextCodec codec(p->config().vocab_size);
    auto run = [&](int drafts, EngineCounters* counters, ModelRunner* runner = nullptr) {
      EngineConfig c;
      c.scheduler.max_num_seqs = 4;
      c.scheduler.max_num_batched_tokens = 512;
      c.scheduler.max_model_len = 2048;
      c.seed = 5;
      if (drafts > 0) {
        c.speculative.method = "dspark";
        c.speculative.num_speculative_tokens = drafts;
      }
      Engine e(runner != nullptr ? runner : p.get(), &codec, c);
      std::map<std::string, std::vector<int32_t>> out;
      SamplingParams sp;
      sp.temperature = 0.0;
      sp.max_tokens = 24;
      sp.ignore_eos = true;
      for (size_t i = 0; i < prompts.size(); ++i) EXPECT_TRUE(e.add_request("r" + std::to_string(i), prompts[i], sp).ok());
      for (int step = 0; e.has_work() && step < 2000; ++step) {
        auto o = e.step();
        EXPECT_TRUE(o.ok()) << o.status().message();
        if (!o.ok()) break;
        for (auto& r : *o) out[r.request_id].insert(out[r.request_id].end(), r.new_tokens.begin(), r.new_tokens.end());
      }
      EXPECT_TRUE(e.blocks().check_invariants().ok());
      if (counters != nullptr) *counters = e.counters();
      return out;
    };
    const auto plain = run(0, nullptr);
    EngineCounters c;
    const auto spec = run(7, &c);
    ASSERT_EQ(plain.size(), prompts.size());
    for (const auto& [id, toks] : plain) {
      EXPECT_EQ(toks.size(), 24u) << id;
      EXPECT_EQ(spec.count(id) ? spec.at(id) : std::vector<int32_t>{}, toks) << id;
    }
    auto acceptance = [](const EngineCounters& k) {
      return k.spec.num_drafts ? 1.0 + double(k.spec.num_accepted_tokens) / k.spec.num_drafts : 0.0;
    };
    // The same load on one process: the drafter split over the ranks must draft as it does.
    EngineCounters c1;
    {
      RunnerOptions ro;
      ro.kv_cache_dtype = "fp8_ds_mla";
      ro.kv_cache_bytes = 64ll << 20;
      ro.drafter = true;
      ro.max_num_seqs = 8;
      auto single = CpuRunner::load(dir, ro);
      ASSERT_TRUE(single.ok()) << single.status().message();
      const auto one = run(7, &c1, single->get());
      for (const auto& [id, toks] : one) {
        int same = 0;
        while (same < static_cast<int>(toks.size()) && plain.count(id) && same < static_cast<int>(plain.at(id).size()) &&
               plain.at(id)[same] == toks[same])
          ++same;
        std::printf("  %s: one process and DCP agree on the first %d of %zu tokens\n", id.c_str(), same, toks.size());
      }
    }
    const double len = acceptance(c), len1 = acceptance(c1);
    std::printf("  ml4-small tp%d dcp2 DSpark greedy: %ld drafts, acceptance length %.2f (one process %.2f), outputs "
                "equal to no speculation\n",
                mpitest::world(), (long)c.spec.num_drafts, len, len1);
    EXPECT_GT(c.spec.num_drafts, 10);
    EXPECT_GT(len, 1.0);
    EXPECT_NEAR(len, len1, 0.15 * len1);
  });
}

}  // namespace
}  // namespace ml4
