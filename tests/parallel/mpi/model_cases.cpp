// The parallel forward against the single process (issue 14): ml4-tiny, mistral4-tiny and
// dsv32-tiny under TP N, TP N + EP N, DP N + EP N and (N = 4) DP 2 x TP 2 + EP 4, through the
// production path (ParallelRunner on rank 0, run_parallel_worker elsewhere). Three sequences
// (prompts of 5, 13 and 30 random tokens) are prefilled in one step and decoded greedily for
// 4 more; under DP, sequence i lives on DP rank i % dp (its blocks in that rank's range).
//
// Teacher-forced (the single process's own top-k sets and routed experts imposed on the
// parallel run, as the goldens do): both sides then compute one function, and what differs
// is only the order of f32 sums: wo over heads, w2 over the hidden, the experts of a token
// summed per owning rank before the ranks' answers are added, and MPI's all-reduce order.
// Each reordered sum moves by a few ulps (2^-24 relative); what makes that visible is the
// bf16 latent cache: a value within ~1e-7 of a bf16 rounding boundary rounds the other way
// and moves by one bf16 ulp (2^-8), and every later token reads it. That is exactly the
// situation of the goldens' f32-vs-f64 comparison (another f32 summation order against the
// same rounding points), whose measured floor is rel L2 3.5e-5 .. 7.6e-4 and whose bounds
// (golden_check.h: rel L2 1e-3, max-abs 2e-3 of the largest |logit|) apply here unchanged.
// Measured (2 and 4 ranks, 2026-12-03): forced, worst rel L2 6.2e-4 (ml4-tiny TP 4, whose 12
// sparse layers read the most cache rows), 2.8e-4 (mistral4-tiny), 8.9e-5 (dsv32-tiny),
// 0 .. 4e-7 for DP + EP with one TP rank (the same sums, nearly the same order); free running
// equals forced until an indexer top-k or routing near-tie flips (ml4-tiny TP 4, dsv32-tiny
// TP 2: then 3.5e-2 .. 1.6e-1 on the following rows, as the goldens' free runs do). A wrong
// head, a missing all-reduce or a misrouted token costs 1e-1 and more on every row. Greedy
// ids are equal at every step forced; free running they may differ only at a near-tie that
// the rows' difference can reorder (2026-12-04: with the bf16 linears' two-chain order,
// ml4-tiny TP 4 flips a top-k near-tie in the prefill and one sequence's greedy id with it,
// free rel L2 1.4e-1, forced 7.4e-4).
#include <random>

#include <gtest/gtest.h>

#include "parallel/mpi/harness.h"
#include "runtime/cpu/cpu_runner.h"
#include "runtime/golden_check.h"
#include "runtime/test_models.h"

namespace ml4 {
namespace {

constexpr double kRelL2 = golden::kRelL2;          // 1e-3
constexpr double kMaxAbsRel = golden::kMaxAbsRel;  // 2e-3

using Run = mpitest::ReferenceRun;

// Block tables: sequence i takes block `i` of DP rank (i % dp)'s range in every
// full-attention group (64-token pages; the sequences stay below 64 tokens).
SeqStep make_seq(const ModelRunner& r, int i, int dp, std::vector<int32_t> tokens, int64_t start) {
  SeqStep s;
  s.seq_id = 100 + i;
  s.tokens = std::move(tokens);
  s.start_pos = start;
  s.num_logits = 1;
  for (const auto& g : r.cache_groups()) {
    std::vector<int32_t> bt;
    if (g.sliding_window == 0) bt.push_back(static_cast<int32_t>((i % dp) * (g.num_blocks / dp) + i));
    s.block_tables.push_back(bt);
  }
  return s;
}

// The single process: prefill, then greedy decode, recording inputs, logits and decisions.
Run reference(ModelRunner& r, int decode_steps, uint64_t seed) {
  std::mt19937 rng(seed);
  const int V = r.config().vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  for (int n : {5, 13, 30}) {
    std::vector<int32_t> p(n);
    for (auto& t : p) t = static_cast<int32_t>(rng() % V);
    prompts.push_back(p);
  }
  return mpitest::reference_run(r, prompts, decode_steps, [&](int i, std::vector<int32_t> t, int64_t start) {
    return make_seq(r, i, 1, std::move(t), start);
  });
}

// The same steps on the parallel runner (block ids moved to DP ranks), forced or free.
void compare(ModelRunner& p, const Run& ref, int dp, bool forced, const std::string& what) {
  const int V = p.config().vocab_size;
  double worst = 0.0, worst_abs = 0.0;
  for (size_t k = 0; k < ref.steps.size(); ++k) {
    StepInput in;
    for (int i = 0; i < 3; ++i) {
      const auto& s = ref.steps[k].seqs[i];
      in.seqs.push_back(make_seq(p, i, dp, s.tokens, s.start_pos));
    }
    ForwardTrace tr;
    if (forced) {
      tr.forced_topk = ref.traces[k].topk;
      tr.forced_experts = ref.traces[k].experts;
    }
    auto out = forced ? p.execute_traced(in, &tr) : p.execute(in);
    ASSERT_TRUE(out.ok()) << what << ": " << out.status().message();
    ASSERT_EQ(out->logits.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      const auto& a = out->logits[i];
      const auto& b = ref.outs[k].logits[i];
      ASSERT_EQ(a.size(), static_cast<size_t>(V));
      const mpitest::LogitsDiff d = mpitest::logits_diff(a, b);
      const double rel = d.rel_l2, mx = d.max_abs, big = d.max_ref;
      worst = std::max(worst, rel);
      worst_abs = std::max(worst_abs, mx / big);
      if (forced) {
        EXPECT_EQ(d.argmax, d.argmax_ref) << what << " step " << k << " seq " << i;
      } else if (d.argmax != d.argmax_ref) {
        // Free running may pick another token only at a near-tie that its logits' difference
        // can reorder (the rule of dcp_cases.cpp): the one process's margin between the two
        // tokens at most twice the largest |difference|, else it is a real error.
        const double margin = static_cast<double>(b[d.argmax_ref]) - b[d.argmax];
        EXPECT_LE(margin, 2.0 * mx) << what << " step " << k << " seq " << i << ": greedy " << d.argmax << " vs "
                                    << d.argmax_ref << " with a margin of " << margin << " (max |diff| " << mx << ")";
      }
      if (forced) {
        EXPECT_LT(rel, kRelL2) << what << " step " << k << " seq " << i;
        EXPECT_LT(mx, kMaxAbsRel * big) << what << " step " << k << " seq " << i;
      }
    }
  }
  std::printf("  %-44s %s: worst rel L2 %.2e, max-abs %.2e of max |logit|\n", what.c_str(),
              forced ? "forced" : "free  ", worst, worst_abs);
}

struct Config {
  const char* name;
  int tp, dp;
  bool ep;
};

std::vector<Config> configs_for(int world) {
  if (world == 2) return {{"tp2", 2, 1, false}, {"tp2+ep2", 2, 1, true}, {"dp2+ep2", 1, 2, true}};
  if (world == 4)
    return {{"tp4", 4, 1, false}, {"tp4+ep4", 4, 1, true}, {"dp2xtp2+ep4", 2, 2, true}, {"dp4+ep4", 1, 4, true}};
  return {};
}

void check_model(const std::string& preset, const std::string& kv) {
  mpitest::run_case([&] {
    const std::string dir = testing::test_model(preset, 1234, "bf16", "native");
    auto single = testing::load_runner(dir, kv);
    ASSERT_TRUE(single);
    const Run ref = reference(*single, 4, 99);
    ASSERT_EQ(ref.steps.size(), 5u);
    const auto configs = configs_for(mpitest::world());
    ASSERT_FALSE(configs.empty()) << "run with mpirun -np 2 or 4";
    for (const Config& c : configs) {
      ParallelConfig pc;
      pc.tensor_parallel_size = c.tp;
      pc.data_parallel_size = c.dp;
      pc.enable_expert_parallel = c.ep;
      auto p = mpitest::load_everywhere(dir, kv, pc);
      ASSERT_TRUE(p);
      const std::string what = fmt::format("{} {} kv {}", preset, c.name, kv);
      compare(*p, ref, c.dp, true, what);
      compare(*p, ref, c.dp, false, what);
    }
  });
}

TEST(ParallelForward, Ml4TinyMatchesOneProcess) { check_model("ml4-tiny", "bf16"); }
TEST(ParallelForward, Mistral4TinyMatchesOneProcess) { check_model("mistral4-tiny", "bf16"); }
TEST(ParallelForward, Dsv32TinyMatchesOneProcess) { check_model("dsv32-tiny", "bf16"); }

// The goldens (tests/runtime/golden_check.h, the same checks as the single process) through a
// TP group of every rank of the job (CTest runs them in the 2-rank job): the parallel runner
// against transformers / the PyTorch reference.
std::unique_ptr<ModelRunner> tp_runner(const std::string& dir, const std::string& kv) {
  ParallelConfig pc;
  pc.tensor_parallel_size = mpitest::world();
  return mpitest::load_everywhere(dir, kv, pc);
}

TEST(ParallelGolden, Ml4TinyUnderTp) {
  mpitest::run_case([] { golden::check_case("ml4-tiny", "native", "", tp_runner); });
}
TEST(ParallelGolden, Mistral4TinyUnderTp) {
  mpitest::run_case([] { golden::check_case("mistral4-tiny", "both", "/hf", tp_runner); });
}
TEST(ParallelGolden, Dsv32TinyUnderTp) {
  mpitest::run_case([] { golden::check_case("dsv32-tiny", "both", "", tp_runner); });
}

}  // namespace
}  // namespace ml4
