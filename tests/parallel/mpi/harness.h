// Tests that run as MPI ranks (mpirun -np N ml4_parallel_mpi_tests; CTest starts them with
// N = 2 and 4). Every rank runs the same GoogleTest cases in the same order. Cases on the
// model run the production path: rank 0 drives a ParallelRunner exactly as the engine does
// and the other ranks serve its steps in run_parallel_worker. To start them, rank 0 sends the
// workers a "load" message (model directory, KV dtype, parallel config) over MPI_COMM_WORLD;
// each rank then builds its group and loads its shard. A case ends with "end", after which
// the workers go on to the next case. Only rank 0 checks results and prints.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "parallel/mpi_env.h"
#include "parallel/rank_layout.h"
#include "runtime/model_runner.h"
#include "runtime/forward_trace.h"
#include "runtime/step.h"

namespace ml4::mpitest {

int rank();
int world();

// Rank 0: makes every rank load `dir` as a parallel runner and returns rank 0's; null (with
// a test failure) when loading failed. max_model_len 0: the model's; kv_mib: each rank's KV
// budget; drafter: load the DSpark drafter (windows for 8 sequences).
// hisparse_slots > 0: HiSparse with hot buffers of that many rows and a host pool of kv_mib.
std::unique_ptr<ModelRunner> load_everywhere(const std::string& dir, const std::string& kv, const ParallelConfig& pc,
                                             int max_model_len = 0, int kv_mib = 32, bool drafter = false,
                                             int hisparse_slots = 0);
// Rank 0: the workers leave serve() for the next case.
void end_case();
// Workers: serve load requests until end_case().
void serve();

// One logits row against the single process's: rel L2, the largest |difference| and the
// largest |reference logit| (the goldens' max-abs bound is relative to it), and both argmaxes.
struct LogitsDiff {
  double rel_l2 = 0.0, max_abs = 0.0, max_ref = 0.0;
  int argmax = 0, argmax_ref = 0;
};
inline LogitsDiff logits_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  LogitsDiff d;
  double num = 0.0, den = 0.0;
  for (size_t v = 0; v < a.size() && v < ref.size(); ++v) {
    const double e = static_cast<double>(a[v]) - ref[v];
    num += e * e;
    den += static_cast<double>(ref[v]) * ref[v];
    d.max_abs = std::max(d.max_abs, std::abs(e));
    d.max_ref = std::max(d.max_ref, static_cast<double>(std::abs(ref[v])));
    if (a[v] > a[d.argmax]) d.argmax = static_cast<int>(v);
    if (ref[v] > ref[d.argmax_ref]) d.argmax_ref = static_cast<int>(v);
  }
  d.rel_l2 = den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
  return d;
}

// One process's run that the parallel ones are compared with: the prompts prefilled in one
// step, then greedy decoding for decode_steps more, recording each step's input, logits and
// decisions (top-k sets, routed experts). make_seq(i, tokens, start_pos): sequence i's SeqStep
// with its block tables.
struct ReferenceRun {
  std::vector<StepInput> steps;
  std::vector<StepOutput> outs;
  std::vector<ForwardTrace> traces;
};
using MakeSeq = std::function<SeqStep(int, std::vector<int32_t>, int64_t)>;
inline ReferenceRun reference_run(ModelRunner& r, const std::vector<std::vector<int32_t>>& prompts, int decode_steps,
                                  const MakeSeq& make_seq) {
  ReferenceRun run;
  const int n = static_cast<int>(prompts.size());
  StepInput in;
  for (int i = 0; i < n; ++i) in.seqs.push_back(make_seq(i, prompts[i], 0));
  for (int step = 0; step <= decode_steps; ++step) {
    ForwardTrace tr;
    auto out = r.execute_traced(in, &tr);
    EXPECT_TRUE(out.ok()) << out.status().message();
    if (!out.ok()) return run;
    run.steps.push_back(in);
    run.outs.push_back(*out);
    run.traces.push_back(tr);
    StepInput next;
    for (int i = 0; i < n; ++i) {
      const auto& s = in.seqs[i];
      const auto& l = out->logits[i];
      const int32_t id = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
      next.seqs.push_back(make_seq(i, {id}, s.start_pos + static_cast<int64_t>(s.tokens.size())));
    }
    in = next;
  }
  return run;
}

// The body of a model case: rank 0 runs `driver`; the workers serve.
inline void run_case(const std::function<void()>& driver) {
  if (rank() != 0) {
    serve();
    return;
  }
  driver();
  end_case();
}

}  // namespace ml4::mpitest
