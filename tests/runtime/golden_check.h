// A backend against independent implementations (MODEL.md section 6, issue 4): the checks
// shared by tests/runtime/golden_test.cpp (CPU runner) and tests/cuda/golden_cuda_test.cpp
// (CUDA runner); check_case takes the runner to test.
//
// tests/golden/<case>/ holds what a reference computed on the same random weights
// (tools/reference/make_goldens.sh): transformers' own mistral4 and deepseek_v32, and a
// PyTorch ML4 reference built on their modules (tools/reference/ml4_model.py), each in
// float64. Per prompt: logits at every position of prompt + a 32-token greedy continuation,
// the indexer's top-k set per sparse layer and position, and the greedy tokens. This test
// regenerates the checkpoint with make_model (same preset, seed and dtype; the weights'
// fingerprint must equal the manifest's), runs the prompt as one prefill and the
// continuation token by token through the paged cache (`--kv-cache-dtype bf16`) twice:
//
//   * teacher-forced: sparse layers attend to the golden's top-k sets and MoE layers run
//     the golden's experts (ForwardTrace::forced_topk / forced_experts), so both sides
//     compute one function up to rounding: logits at every row (relative L2 and max-abs,
//     bounds argued from the dtypes below), greedy tokens equal, ml4's own top-k sets
//     equal except documented near-ties of the reference scores, its own routing equal
//     in all but a few cells;
//   * free running (the production path): logits and greedy tokens equal up to the first
//     row whose own selection differs; past it, numbers are reported.
//
// The goldens emulate ml4's cache stores (bf16 latent rows, DeepSeek's Hadamard + FP8
// indexer): see tools/reference/numerics.py. What transformers computes without that
// emulation ("pure.*" tensors) is compared too, on the rows before the first differing
// discrete decision. Numbers measured on these cases are in docs/ARCHITECTURE.md ("How
// correctness is established"); ML4_GOLDEN_VERBOSE=1 prints per-row errors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>

#include <functional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/safetensors.h"
#include "runtime/test_models.h"

namespace ml4::golden {

using testing::seq_step;
using testing::test_model;

// Makes the runner under test for a model directory and a KV cache dtype.
using RunnerLoader = std::function<std::unique_ptr<ModelRunner>(const std::string& dir, const std::string& kv)>;

// Against the emulating goldens both sides round the same values the same way; what is
// left is f32 (ml4) vs f64 (reference) arithmetic, ~2^-24 per operation, and its one
// amplifier: a value within that distance of a bf16 (latent cache) or e4m3 (indexer)
// rounding boundary rounds the other way on one side, moving one element by a bf16 ulp
// (2^-8 relative) at once. How large that floor is on these models was measured with
// transformers itself: its own mistral4 in float32 against float64 (same emulation,
// same prompts) differs by rel L2 3.5e-5 .. 7.6e-4 and max-abs up to 7.7e-3 (logits of
// magnitude <= 10, i.e. 9e-4 of the largest). The floor is a lottery of those flips, not
// a precision: ml4's CPU backend itself, with only the summation order of its bf16 linears
// changed (one FMA chain per weight row -> two, 2026-12-04), moved ml4-tiny's three prompts
// from 2.4e-4 / 4.6e-4 / 6.4e-4 to 1.19e-3 / 8.4e-6 / 6.8e-4. Any correct f32
// implementation sits at that floor, so the bounds are: rel L2 1.5e-3 per prompt, max-abs
// 2e-3 of the largest |logit|. Both stay below what one wrong formula costs (llama4's q
// temperature alone is 7% at position 32, a missing bf16 cache rounding 3e-3 rel L2).
constexpr double kRelL2 = 1.5e-3;
constexpr double kMaxAbsRel = 2e-3;  // times the largest |golden logit| of the prompt

// Without emulation (transformers / the reference as is) ml4's bf16 latent cache rounds
// every c and kr by up to 2^-9 relative: measured 2e-3 .. 6e-3 relative per row on
// mistral4-tiny. Bound 1e-2, applied only to the rows before the first discrete decision
// (a top-k set or an MoE routing) that differs between ml4 and the unemulated run: past
// that row the two attend to different keys or run different experts, which is not
// rounding (docs/ARCHITECTURE.md lists where and why they differ).
constexpr double kPureRelL2 = 1e-2;

// Top-k near-ties. Upstream of an indexer ml4 (f32) and the reference (f64) differ by
// ~1e-4 relative after a few layers (the logits bound above). The indexer quantizes q and
// k to e4m3 (3 mantissa bits): an element within that distance of a rounding boundary
// rounds the other way on one side and moves by one e4m3 ulp, 1/16..1/8 of itself. With
// 512 q values per row, ~16 * 1e-4 flip probability each, most rows of a deep layer see
// a flip; one flip moves a head's q.k by ~ulp * |q_j k_j| ~ 1e-2 of that head's |q||k| /
// sqrt(d) scale, i.e. up to ~1e-2 of the row's largest |score|. So a key may be swapped
// for another when both reference scores are within kTieRelTol = 2e-2 of the row's
// largest |score| from the selection boundary. (Scores exactly 0, every head's q.k <= 0,
// tie among themselves and are broken by index on both sides.) The check runs with the
// golden's sets forced into the attention (ForwardTrace::forced_topk), so that each
// layer's inputs agree to rounding; free running, one such swap makes a row attend to a
// different key and every later layer that reads that row sees a different key, which
// is not rounding: see check_case.
constexpr double kTieRelTol = 2e-2;

// MoE routing near-ties: the router picks the top-k of E probabilities; a row whose k-th
// and (k+1)-th probabilities are closer than the ~1e-4 relative f32-vs-f64 difference of
// its input flips. The golden keeps no router scores, so such flips cannot be shown to be
// ties one by one; with the reference's experts forced into the forward they change
// nothing downstream, and they are bounded in number: at most 1% of the (row, MoE layer)
// cells (measured: 1 of 792 on ml4-tiny, none on mistral4-tiny / dsv32-tiny).
constexpr double kMaxRouteFlips = 0.01;

// The bounds one check_case applies: the defaults above (a backend computing in f32 like
// the CPU's), or looser ones argued by the caller for a backend that rounds activations
// (the CUDA runner's production path: bf16 GEMM inputs, bf16 tensor-core attention).
struct Bounds {
  double rel_l2 = kRelL2;
  double max_abs_rel = kMaxAbsRel;
  double pure_rel_l2 = kPureRelL2;
  double max_route_flips = kMaxRouteFlips;
  double tie_rel_tol = kTieRelTol;
  // 0: greedy tokens must equal the reference's. > 0: a greedy token may differ where the
  // reference's top-1 margin is below this many times the prompt's max-abs logit error
  // (a rounding-level near-tie), and the count is printed.
  double greedy_margin_factor = 0.0;
};

struct Golden {
  nlohmann::json manifest;
  std::shared_ptr<const SafetensorsFile> file;

  template <typename T>
  std::vector<T> get(const std::string& name, std::vector<int64_t>* shape = nullptr) const {
    auto t = file->get(name);
    EXPECT_TRUE(t.ok()) << name << ": " << t.status().message();
    if (!t.ok()) return {};
    if (shape) shape->assign(t->shape().begin(), t->shape().end());
    const T* p = t->template as<T>();
    return std::vector<T>(p, p + t->numel());
  }
  bool has(const std::string& name) const { return file->contains(name); }
};

// ML4_SOURCE_DIR in the environment overrides the compiled-in tree (binaries carried to
// another machine, scripts/gpu_run.sh).
inline std::string golden_dir(const std::string& name) {
  const char* env = std::getenv("ML4_SOURCE_DIR");
  return std::string(env != nullptr ? env : ML4_SOURCE_DIR) + "/tests/golden/" + name;
}

inline Result<Golden> load_golden(const std::string& name) {
  Golden g;
  std::ifstream in(golden_dir(name) + "/manifest.json");
  if (!in) return not_found("{}/manifest.json missing", golden_dir(name));
  g.manifest = nlohmann::json::parse(in, nullptr, false);
  if (g.manifest.is_discarded()) return invalid_argument("{}/manifest.json is not JSON", golden_dir(name));
  ML4_ASSIGN_OR_RETURN(g.file, SafetensorsFile::open(golden_dir(name) + "/golden.safetensors"));
  return g;
}

// FNV-1a 64 over every tensor's bytes, names sorted, the drafter left out (no golden
// forward reads it); make_goldens.py fnv1a64_tensors.
inline Result<std::string> weights_fingerprint(const std::string& path) {
  ML4_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(path));
  uint64_t h = 0xCBF29CE484222325ull;
  for (const auto& name : f->names()) {
    if (name.rfind("mtp_dspark.", 0) == 0) continue;
    ML4_ASSIGN_OR_RETURN(Tensor t, f->get(name));
    const auto* p = static_cast<const uint8_t*>(t.data());
    for (size_t i = 0; i < t.nbytes(); ++i) {
      h ^= p[i];
      h *= 0x100000001B3ull;
    }
  }
  return fmt::format("{:016x}", h);
}

struct ErrorStats {
  double rel_l2 = 0, max_abs = 0, ref_max = 0;
};

inline ErrorStats compare_logits(const std::vector<float>& got, const std::vector<float>& ref) {
  ErrorStats e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
    e.max_abs = std::max(e.max_abs, std::fabs(d));
    e.ref_max = std::max(e.ref_max, std::fabs(static_cast<double>(ref[i])));
  }
  e.rel_l2 = std::sqrt(num / den);
  return e;
}

// What the CPU backend computed for one prompt + continuation.
struct BackendRun {
  std::vector<float> logits;                       // [T, V]
  std::vector<int32_t> greedy;                     // argmax of rows n-1 .. T-2
  std::vector<std::vector<std::vector<int32_t>>> topk;     // [layer][row] sorted key ids
  std::vector<std::vector<std::vector<int32_t>>> experts;  // [layer][row] routed experts, sorted
};

// Golden top-k sets [layer][row] (ascending key ids) of the sparse layers; empty for others.
using TopkSets = std::vector<std::vector<std::vector<int32_t>>>;

inline TopkSets golden_sets(const Golden& g, const std::string& prefix, const std::vector<int>& sparse, int L, int T) {
  TopkSets sets(L);
  for (int l : sparse) {
    std::vector<int64_t> ks;
    auto topk = g.get<int32_t>(fmt::format("{}.L{}.topk", prefix, l), &ks);
    if (ks.size() != 2 || ks[0] < T) continue;
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> row;
      for (int j = 0; j < ks[1] && topk[t * ks[1] + j] >= 0; ++j) row.push_back(topk[t * ks[1] + j]);
      std::sort(row.begin(), row.end());
      sets[l].push_back(row);
    }
  }
  return sets;
}

// Prefill of the prompt (all rows' logits), then one decode step per golden continuation
// token. The golden token is fed even where ml4's argmax differs, so that one flip does
// not hide what follows; the flip itself is checked by the caller. With `forced`, sparse
// layers attend to the golden's sets (ForwardTrace::forced_topk), with `forced_experts`
// MoE layers run the golden's experts (forced_experts), while the trace still records
// ml4's own choices.
// Golden routed experts [layer][row] (ascending ids) of the MoE layers; empty for others.
inline TopkSets golden_experts(const Golden& g, const std::string& prefix, int L, int T) {
  TopkSets sets(L);
  for (int l = 0; l < L; ++l) {
    const std::string name = fmt::format("{}.L{}.experts", prefix, l);
    if (!g.has(name)) continue;
    std::vector<int64_t> ks;
    auto ids = g.get<int32_t>(name, &ks);
    if (ks.size() != 2 || ks[0] < T) continue;
    for (int t = 0; t < T; ++t) sets[l].emplace_back(ids.begin() + t * ks[1], ids.begin() + (t + 1) * ks[1]);
  }
  return sets;
}

inline BackendRun run_prompt(ModelRunner& r, const std::vector<int32_t>& tokens, int n, int seq, const TopkSets* forced,
               const TopkSets* forced_experts = nullptr) {
  BackendRun out;
  const int L = r.config().n_layers, V = r.config().vocab_size;
  const int T = static_cast<int>(tokens.size());
  const int blocks = (T + 63) / 64 + 1;
  out.topk.assign(L, {});
  out.experts.assign(L, {});
  auto keep = [&](const ForwardTrace& tr) {
    for (int l = 0; l < L; ++l) {
      for (const auto& row : tr.topk[l]) out.topk[l].push_back(row);
      for (auto row : tr.experts[l]) {
        std::sort(row.begin(), row.end());
        out.experts[l].push_back(row);
      }
    }
  };
  auto force = [&](ForwardTrace& tr, int first, int count) {
    auto slice = [&](const TopkSets* from, std::vector<std::vector<std::vector<int32_t>>>& to) {
      to.assign(from != nullptr ? L : 0, {});
      for (int l = 0; from != nullptr && l < L; ++l)
        if (!(*from)[l].empty()) to[l].assign((*from)[l].begin() + first, (*from)[l].begin() + first + count);
    };
    slice(forced, tr.forced_topk);
    slice(forced_experts, tr.forced_experts);
  };
  ForwardTrace tr;
  force(tr, 0, n);
  std::vector<int32_t> prompt(tokens.begin(), tokens.begin() + n);
  auto o = r.execute_traced(StepInput{{seq_step(r, seq, prompt, 0, seq * blocks, blocks, n)}}, &tr);
  EXPECT_TRUE(o.ok()) << o.status().message();
  if (!o.ok()) return out;
  out.logits = o->logits[0];
  keep(tr);
  for (int p = n; p < T; ++p) {
    out.greedy.push_back(testing::argmax(out.logits, static_cast<size_t>(p - 1) * V, V));
    force(tr, p, 1);
    auto d = r.execute_traced(StepInput{{seq_step(r, seq, {tokens[p]}, p, seq * blocks, blocks, 1)}}, &tr);
    EXPECT_TRUE(d.ok()) << d.status().message();
    if (!d.ok()) return out;
    out.logits.insert(out.logits.end(), d->logits[0].begin(), d->logits[0].end());
    keep(tr);
  }
  return out;
}

// Rows whose routed experts differ from the golden's record under `prefix` (p0, pure.p0).
inline std::vector<int> routing_differs(const Golden& g, const std::string& prefix, int layer, const BackendRun& cpu, int T) {
  std::vector<int> rows;
  const std::string name = fmt::format("{}.L{}.experts", prefix, layer);
  if (!g.has(name)) return rows;
  std::vector<int64_t> shape;
  auto ids = g.get<int32_t>(name, &shape);
  const int K = static_cast<int>(shape[1]);
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> want(ids.begin() + t * K, ids.begin() + (t + 1) * K);
    if (static_cast<size_t>(t) >= cpu.experts[layer].size() || cpu.experts[layer][t] != want) rows.push_back(t);
  }
  return rows;
}

// Rows whose top-k set differs from the golden's record under `prefix`. With `diverged`
// (one entry per row, -1: not yet), rows that diverged in an earlier layer are skipped, a
// difference must be a near-tie of the golden's scores (else the test fails) and marks
// the row diverged at this layer.
inline std::vector<int> check_topk(const Golden& g, const std::string& prefix, int layer, const BackendRun& cpu, int T,
                            std::vector<int>* diverged, const std::string& what, double tie_rel_tol = kTieRelTol) {
  std::vector<int64_t> ks, ss;
  auto topk = g.get<int32_t>(fmt::format("{}.L{}.topk", prefix, layer), &ks);
  auto scores = g.get<float>(fmt::format("{}.L{}.scores", prefix, layer), &ss);
  std::vector<int> differing;
  if (ks.size() != 2 || ss.size() != 2 || ks[0] < T || ss[0] < T) {
    ADD_FAILURE() << what << " layer " << layer << ": golden top-k / scores missing or short";
    return differing;
  }
  const int K = static_cast<int>(ks[1]);
  for (int t = 0; t < T; ++t) {
    if (diverged != nullptr && (*diverged)[t] >= 0) continue;
    std::set<int32_t> want, got(cpu.topk[layer][t].begin(), cpu.topk[layer][t].end());
    int last = -1;
    for (int j = 0; j < K && topk[t * K + j] >= 0; ++j) {
      want.insert(topk[t * K + j]);
      last = topk[t * K + j];
    }
    if (want == got) continue;
    differing.push_back(t);
    if (diverged == nullptr) continue;
    (*diverged)[t] = layer;
    const float* row = scores.data() + static_cast<int64_t>(t) * ss[1];
    double top = 0;
    for (int s = 0; s <= t; ++s) top = std::max(top, std::fabs(static_cast<double>(row[s])));
    const double boundary = row[last];
    std::vector<int32_t> diff;
    std::set_symmetric_difference(want.begin(), want.end(), got.begin(), got.end(), std::back_inserter(diff));
    for (int32_t s : diff) {
      if (s < 0 || s > t) {
        ADD_FAILURE() << what << " layer " << layer << " row " << t << ": key " << s << " is not visible";
        continue;
      }
      EXPECT_LE(std::fabs(row[s] - boundary), tie_rel_tol * top)
          << what << " layer " << layer << " row " << t << ": key " << s << " (score " << row[s]
          << ") swapped, boundary score " << boundary << ", row max |score| " << top << ": not a near-tie";
    }
  }
  return differing;
}

inline void check_case(const std::string& name, const std::string& layout, const std::string& subdir,
                       const RunnerLoader& load_runner, const Bounds& bounds = Bounds{}) {
  auto gr = load_golden(name);
  ASSERT_TRUE(gr.ok()) << gr.status().message();
  const Golden& g = *gr;
  const auto& m = g.manifest;
  // A shipped model (manifest "model_dir", relative to the source tree) is read as it is;
  // the other cases are regenerated with make_model.
  const std::string dir =
      m.contains("model_dir")
          ? golden_dir("../../" + m.at("model_dir").get<std::string>())
          : test_model(m.at("preset").get<std::string>(), m.at("seed").get<uint64_t>(),
                       m.at("weight_dtype").get<std::string>(), layout);
  // The reference saw these exact weights (its files named in the manifest).
  auto fp = weights_fingerprint(dir + "/" + m.at("weights_file").get<std::string>());
  ASSERT_TRUE(fp.ok()) << fp.status().message();
  ASSERT_EQ(*fp, m.at("weights_fnv1a64").get<std::string>())
      << "make_model no longer writes the weights the golden was made from: regenerate with "
         "tools/reference/make_goldens.sh (and say why in the commit)";

  auto r = load_runner(dir + subdir, m.at("kv_cache_dtype").get<std::string>());
  ASSERT_TRUE(r) << "runner for " << dir + subdir;
  const int V = r->config().vocab_size;
  std::vector<int> sparse = m.at("sparse_layers").get<std::vector<int>>();
  const auto lengths = m.at("prompt_lengths").get<std::vector<int>>();
  const int L = r->config().n_layers;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const std::string p = fmt::format("p{}", i);
    const std::string what = fmt::format("{}{} {}", name, subdir, p);
    auto tokens = g.get<int32_t>(p + ".tokens");
    const int n = lengths[i], T = static_cast<int>(tokens.size());
    auto ref = g.get<float>(p + ".logits");
    auto margin = g.get<float>(p + ".margin");
    ASSERT_EQ(ref.size(), static_cast<size_t>(T) * V) << what;

    // 1. Teacher-forced decisions: every sparse layer attends to the golden's top-k set
    // and every MoE layer runs the golden's experts, so both sides compute the same
    // function up to rounding: logits at every row and greedy tokens must agree; ml4's
    // own top-k sets may differ only at near-ties, its own routing in few cells (below).
    const TopkSets sets = golden_sets(g, p, sparse, L, T);
    const TopkSets experts = golden_experts(g, p, L, T);
    BackendRun cpu = run_prompt(*r, tokens, n, static_cast<int>(2 * i), &sets, &experts);
    ASSERT_EQ(cpu.logits.size(), static_cast<size_t>(T) * V) << what;
    ErrorStats e = compare_logits(cpu.logits, ref);
    int greedy_near_ties = 0;
    for (int j = n; j < T; ++j) {
      if (bounds.greedy_margin_factor > 0 && cpu.greedy[j - n] != tokens[j] &&
          margin[j - 1] < bounds.greedy_margin_factor * e.max_abs) {
        ++greedy_near_ties;
        continue;
      }
      EXPECT_EQ(cpu.greedy[j - n], tokens[j]) << what << " greedy step " << j - n << " (reference top-1 margin "
                                              << margin[j - 1] << ")";
    }
    EXPECT_LT(e.rel_l2, bounds.rel_l2) << what;
    EXPECT_LT(e.max_abs, bounds.max_abs_rel * e.ref_max) << what;
    int tie_cells = 0;
    for (int l : sparse) {
      std::vector<int> none(T, -1);  // forced: every row is checked on its own
      tie_cells += static_cast<int>(check_topk(g, p, l, cpu, T, &none, what, bounds.tie_rel_tol).size());
    }
    int route_rows = 0, moe_cells = 0;
    for (int l = 0; l < L; ++l) {
      if (experts[l].empty()) continue;
      moe_cells += T;
      route_rows += static_cast<int>(routing_differs(g, p, l, cpu, T).size());
    }
    EXPECT_LE(route_rows, bounds.max_route_flips * moe_cells) << what << ": ml4's own routing differs in " << route_rows
                                                     << " of " << moe_cells << " (row, layer) cells";
    if (std::getenv("ML4_GOLDEN_VERBOSE") != nullptr) {  // per-row errors, to locate a problem
      for (int t = 0; t < T; ++t) {
        const size_t o = static_cast<size_t>(t) * V;
        ErrorStats rs = compare_logits(std::vector<float>(cpu.logits.begin() + o, cpu.logits.begin() + o + V),
                                       std::vector<float>(ref.begin() + o, ref.begin() + o + V));
        std::printf("[golden] %s row %d: rel_l2 %.2e max_abs %.2e\n", what.c_str(), t, rs.rel_l2, rs.max_abs);
      }
    }

    // 2. Free running (the production path: ml4 attends to its own selections). Up to
    // the first row whose selection differs (a near-tie, or a key that an earlier
    // divergence changed; or a routing) both are the same function: those rows' logits and greedy
    // tokens must agree. Past it, a sparse model follows its own choices; the numbers
    // are reported (docs/ARCHITECTURE.md).
    BackendRun fr = run_prompt(*r, tokens, n, static_cast<int>(2 * i + 1), nullptr);
    ASSERT_EQ(fr.logits.size(), static_cast<size_t>(T) * V) << what;
    std::vector<int> diverged(T, -1);
    int first = T;
    for (int l : sparse) {
      auto rows = check_topk(g, p, l, fr, T, nullptr, what);
      if (!rows.empty()) first = std::min(first, rows.front());
      for (int t : rows)
        if (diverged[t] < 0) diverged[t] = l;
    }
    // A routing that differs from the golden's is a selection too: past it the row runs
    // other experts (rare at f32 rounding, 1 in ~800 cells; more with rounded activations).
    for (int l = 0; l < L; ++l) {
      auto rows = routing_differs(g, p, l, fr, T);
      if (!rows.empty()) first = std::min(first, rows.front());
    }
    int diverged_rows = 0, free_greedy_diff = 0;
    for (int t = 0; t < T; ++t) diverged_rows += diverged[t] >= 0;
    for (int j = n; j < T; ++j) {
      if (fr.greedy[j - n] == tokens[j]) continue;
      ++free_greedy_diff;
      if (bounds.greedy_margin_factor > 0 && margin[j - 1] < bounds.greedy_margin_factor * e.max_abs) continue;
      EXPECT_GE(j - 1, first) << what << " free-running greedy step " << j - n << " differs before any selection did";
    }
    const size_t keep = static_cast<size_t>(first) * V;
    ErrorStats fe;
    if (first > 0) {
      fe = compare_logits(std::vector<float>(fr.logits.begin(), fr.logits.begin() + keep),
                          std::vector<float>(ref.begin(), ref.begin() + keep));
      EXPECT_LT(fe.rel_l2, bounds.rel_l2) << what << " (free running, rows before " << first << ")";
    }
    ErrorStats fall = compare_logits(fr.logits, ref);

    // 3. transformers / the reference without the cache emulation, against the free run:
    // logits of the rows before the first differing discrete decision.
    std::string pure_note;
    if (g.has("pure." + p + ".logits")) {
      int pfirst = T, pure_topk = 0, pure_route = 0;
      for (int l : sparse) {
        auto rows = check_topk(g, "pure." + p, l, fr, T, nullptr, what);
        pure_topk += static_cast<int>(rows.size());
        if (!rows.empty()) pfirst = std::min(pfirst, rows.front());
      }
      for (int l = 0; l < L; ++l) {
        auto rows = routing_differs(g, "pure." + p, l, fr, T);
        pure_route += static_cast<int>(rows.size());
        if (!rows.empty()) pfirst = std::min(pfirst, rows.front());
      }
      auto pl = g.get<float>("pure." + p + ".logits");
      const size_t pkeep = static_cast<size_t>(pfirst) * V;
      std::string prefix_note = "none";
      if (pfirst > 0) {
        ErrorStats pe = compare_logits(std::vector<float>(fr.logits.begin(), fr.logits.begin() + pkeep),
                                       std::vector<float>(pl.begin(), pl.begin() + pkeep));
        EXPECT_LT(pe.rel_l2, bounds.pure_rel_l2) << what << " (pure, rows before " << pfirst << ")";
        prefix_note = fmt::format("rel_l2 {:.2e} max_abs {:.2e}", pe.rel_l2, pe.max_abs);
      }
      ErrorStats all = compare_logits(fr.logits, pl);
      pure_note = fmt::format(
          "\n         vs pure: top-k cells differing {}, routing rows differing {}, first at row {}; rows before: {}; "
          "all rows: rel_l2 {:.2e} max_abs {:.2e}",
          pure_topk, pure_route, pfirst, prefix_note, all.rel_l2, all.max_abs);
    }
    std::printf(
        "[golden] %s rows %d: forced top-k: rel_l2 %.2e max_abs %.2e (max |logit| %.1f), near-tie cells %d, routing "
        "rows %d, greedy near-ties %d\n         free running: first selection difference at row %d (rows before: rel_l2 %.2e), rows "
        "diverged %d, greedy tokens differing %d, all rows rel_l2 %.2e%s\n",
        what.c_str(), T, e.rel_l2, e.max_abs, e.ref_max, tie_cells, route_rows, greedy_near_ties, first, fe.rel_l2, diverged_rows,
        free_greedy_diff, fall.rel_l2, pure_note.c_str());
  }
}

}  // namespace ml4::golden
