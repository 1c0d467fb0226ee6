// CPU tensor parallelism: decode-step time and the communication cost per step (issue 14).
//
//   mpirun --allow-run-as-root --oversubscribe -np N tp_decode_bench --model DIR [--batch 4]
//          [--prompt 32] [--steps 64] [--kv-cache-dtype bf16] [--ep] [--dcp M] [--dcp-backend a2a|ag_rs]
//
// --dcp M (issue 15): the KV cache sharded over DCP groups of M of the N TP ranks; then also
// printed: the DCP collectives per step (query all-gather, top-k candidates' all-gathers, the
// combine) and rank 0's time in the DCP pieces of attention (the query gather, the attention
// over its share, the combine), against the whole attention time of the step.
//
// N = 1 runs the plain CpuRunner (no MPI group); N > 1 runs -tp N (--ep adds expert
// parallelism) through the production path (ParallelRunner on rank 0, workers serving). Each
// step decodes one token for each of --batch sequences after a --prompt-token prefill.
// Printed by rank 0: the median decode step (ms), and per step the TP all-reduce / all-gather
// calls, bytes and the time rank 0 spent inside them (us), plus the control channel (the step's
// broadcast to the workers). The peer, measured in the same run: a bare MPI_Allreduce of one
// step's activation (batch x dim floats) in a loop, the cost MPI itself puts on each of the
// program's all-reduces. On 2 shared cores no speed-up is expected (each rank gets one
// core: ML4_THREADS is set to cores / ranks); the point is the cost of the exchanges.
//
// Output: TPBENCH ranks=2 ep=0 batch=4 step_ms=.. comm_calls=.. comm_kib=.. comm_us=.. ctrl_us=.. mpi_allreduce_us=..
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "model/config_loader.h"
#include "parallel/mpi_env.h"
#include "runtime/cpu/cpu_runner.h"
#include "runtime/parallel_runner.h"

namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Args {
  std::string model, kv = "bf16";
  int batch = 4, prompt = 32, steps = 64, dcp = 1;
  std::string dcp_backend = "a2a";
  bool ep = false;
};

int blocks_per_seq = 4;

ml4::SeqStep seq(const ml4::ModelRunner& r, int i, std::vector<int32_t> toks, int64_t start) {
  ml4::SeqStep s;
  s.seq_id = 1 + i;
  s.tokens = std::move(toks);
  s.start_pos = start;
  for (const auto& g : r.cache_groups()) {
    std::vector<int32_t> bt;
    if (g.sliding_window == 0)
      for (int b = 0; b < blocks_per_seq; ++b) bt.push_back(i * blocks_per_seq + b);
    s.block_tables.push_back(bt);
  }
  return s;
}

// The peer: a bare MPI_Allreduce of one decode step's activation, every rank, 2000 times.
double bare_allreduce_us(int n) {
  std::vector<float> buf(n, 1.0f);
  const int reps = 2000;
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r) MPI_Allreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  return secs(t0, Clock::now()) / reps * 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc || (i < argc && std::strcmp(argv[i], "--ep") == 0); ++i) {
    const std::string k = argv[i];
    if (k == "--ep") { a.ep = true; continue; }
    const std::string v = argv[++i];
    if (k == "--model") a.model = v;
    else if (k == "--batch") a.batch = std::stoi(v);
    else if (k == "--prompt") a.prompt = std::stoi(v);
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--kv-cache-dtype") a.kv = v;
    else if (k == "--dcp") a.dcp = std::stoi(v);
    else if (k == "--dcp-backend") a.dcp_backend = v;
  }
  if (a.model.empty()) {
    std::fprintf(stderr, "usage: tp_decode_bench --model DIR [--batch 4] [--prompt 32] [--steps 64] [--ep] [--dcp M]\n");
    return 2;
  }
  blocks_per_seq = (a.prompt + a.steps + 63) / 64;
  const int world = ml4::MpiEnv::launched_world_size();
  ml4::RunnerOptions ro;
  ro.kv_cache_dtype = a.kv;
  ro.kv_cache_bytes = 256ll << 20;
  ro.max_model_len = a.prompt + a.steps + 1;
  std::unique_ptr<ml4::ModelRunner> runner;
  ml4::ParallelRunner* par = nullptr;
  if (world == 1) {
    auto r = ml4::CpuRunner::load(a.model, ro);
    if (!r.ok()) return std::fprintf(stderr, "%s\n", r.status().message().c_str()), 1;
    runner = std::move(r).value();
  } else {
    ml4::ParallelConfig pc;
    pc.tensor_parallel_size = world;
    pc.enable_expert_parallel = a.ep;
    pc.decode_context_parallel_size = a.dcp;
    pc.dcp_comm_backend = a.dcp_backend;
    ml4::Status ws;
    const std::string dir = a.model;
    auto r = ml4::load_parallel_runner(pc, a.model, ro,
                                       [dir](const ml4::RunnerOptions& o) -> ml4::Result<std::unique_ptr<ml4::ModelRunner>> {
                                         ML4_ASSIGN_OR_RETURN(auto c, ml4::CpuRunner::load(dir, o));
                                         return std::unique_ptr<ml4::ModelRunner>(std::move(c));
                                       },
                                       &ws);
    if (!r.ok()) return std::fprintf(stderr, "%s\n", r.status().message().c_str()), 1;
    if (*r == nullptr) {  // a worker: rank 0's steps are done; the peer loop with it
      auto cfg = ml4::load_model_config(a.model);
      bare_allreduce_us(a.batch * (cfg.ok() ? cfg->dim : 1));
      return ws.ok() ? 0 : 1;
    }
    runner = std::move(r).value();
    par = static_cast<ml4::ParallelRunner*>(runner.get());
  }
  const int V = runner->config().vocab_size, D = runner->config().dim;
  std::mt19937 g(1);
  ml4::StepInput in;
  for (int i = 0; i < a.batch; ++i) {
    std::vector<int32_t> p(a.prompt);
    for (auto& t : p) t = static_cast<int32_t>(g() % V);
    in.seqs.push_back(seq(*runner, i, p, 0));
  }
  std::vector<double> step_s;
  ml4::CommStats tp0, ctrl0, ep0, dcp0;
  auto* cpu = dynamic_cast<ml4::CpuRunner*>(par != nullptr ? &par->local() : runner.get());
  for (int s = 0; s <= a.steps; ++s) {
    if (s == 1 && par != nullptr) {  // the decode steps only
      par->group().tp->reset_stats();
      par->group().ep->reset_stats();
      par->group().dcp->reset_stats();
      par->group().world->reset_stats();
    }
    if (s == 1 && cpu != nullptr) cpu->backend().set_profile(true);
    const auto t0 = Clock::now();
    auto out = runner->execute(in);
    const auto t1 = Clock::now();
    if (!out.ok()) return std::fprintf(stderr, "%s\n", out.status().message().c_str()), 1;
    if (s > 0) step_s.push_back(secs(t0, t1));
    ml4::StepInput next;
    for (int i = 0; i < a.batch; ++i) {
      const auto& l = out->logits[i];
      const int32_t t = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
      next.seqs.push_back(seq(*runner, i, {t}, in.seqs[i].start_pos + static_cast<int64_t>(in.seqs[i].tokens.size())));
    }
    in = next;
  }
  if (par != nullptr) {
    tp0 = par->group().tp->stats();
    ctrl0 = par->group().world->stats();
  }
  std::sort(step_s.begin(), step_s.end());
  const double med = step_s[step_s.size() / 2];
  if (par != nullptr) ep0 = par->group().ep->stats();
  if (par != nullptr) dcp0 = par->group().dcp->stats();
  std::map<std::string, double> prof;
  if (cpu != nullptr) prof = cpu->backend().profile();
  auto us = [&](const char* label) { return prof.count(label) ? prof[label] / a.steps * 1e6 : 0.0; };
  runner.reset();  // stops the workers, which then join the peer loop below
  const double mpi_us = par != nullptr ? bare_allreduce_us(a.batch * D) : 0.0;
  const double n = a.steps;
  std::printf("TPBENCH ranks=%d ep=%d batch=%d prompt=%d steps=%d step_ms=%.3f comm_calls=%.1f comm_kib=%.1f comm_us=%.1f "
              "ep_calls=%.1f ep_us=%.1f ctrl_us=%.1f mpi_allreduce_us=%.1f\n",
              world, a.ep ? 1 : 0, a.batch, a.prompt, a.steps, med * 1e3, tp0.calls / n, tp0.bytes / n / 1024.0,
              tp0.seconds / n * 1e6, ep0.calls / n, ep0.seconds / n * 1e6, ctrl0.seconds / n * 1e6, mpi_us);
  // Rank 0's attention per step: all of it, its DCP pieces, and the DCP collectives inside them.
  const double attn = us("attn: DCP attention") + us("attn: MLA kernel");
  std::printf("DCPBENCH ranks=%d dcp=%d backend=%s batch=%d context=%d attn_kernel_us=%.1f indexer_us=%.1f dcp_calls=%.1f "
              "dcp_kib=%.1f dcp_comm_us=%.1f dcp_gather_q_us=%.1f dcp_local_attn_us=%.1f dcp_combine_us=%.1f\n",
              world, a.dcp, a.dcp_backend.c_str(), a.batch, a.prompt + a.steps / 2, attn, us("attn: indexer + top-k"),
              dcp0.calls / n, dcp0.bytes / n / 1024.0, dcp0.seconds / n * 1e6, us("attn: DCP query all-gather"),
              us("attn: DCP local attention"), us("attn: DCP combine"));
  return 0;
}
