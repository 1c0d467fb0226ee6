// main() of ml4_parallel_mpi_tests and the load / serve harness (harness.h).
#include <mpi.h>

#include <gtest/gtest.h>

#include "core/log.h"
#include "parallel/mpi/harness.h"
#include "runtime/cpu/cpu_runner.h"
#include "runtime/parallel_runner.h"

namespace ml4::mpitest {
namespace {

constexpr int kLoad = 1, kEnd = 2;

struct Message {
  int kind = 0;
  int tp = 1, dp = 1, ep = 0, dcp = 1, interleave = 1, a2a = 1, max_len = 0, kv_mib = 32, drafter = 0, pcp = 1;
  int hisparse_slots = 0;
  std::string dir, kv;
};

void bcast_message(Message* m) {
  int hdr[12] = {m->kind,   m->tp,     m->dp,      m->ep,     m->dcp, m->interleave, m->a2a, m->max_len, m->kv_mib,
                 m->drafter, m->pcp, m->hisparse_slots};
  MPI_Bcast(hdr, 12, MPI_INT, 0, MPI_COMM_WORLD);
  m->kind = hdr[0], m->tp = hdr[1], m->dp = hdr[2], m->ep = hdr[3];
  m->dcp = hdr[4], m->interleave = hdr[5], m->a2a = hdr[6], m->max_len = hdr[7], m->kv_mib = hdr[8];
  m->drafter = hdr[9], m->pcp = hdr[10], m->hisparse_slots = hdr[11];
  std::string s = m->dir + '\n' + m->kv;
  int n = static_cast<int>(s.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  s.resize(n);
  MPI_Bcast(s.data(), n, MPI_CHAR, 0, MPI_COMM_WORLD);
  const size_t nl = s.find('\n');
  m->dir = s.substr(0, nl);
  m->kv = s.substr(nl + 1);
}

RunnerOptions options(const Message& m) {
  RunnerOptions ro;
  ro.kv_cache_dtype = m.kv;
  ro.kv_cache_bytes = static_cast<int64_t>(m.kv_mib) << 20;
  ro.max_model_len = m.max_len;
  ro.drafter = m.drafter != 0;
  ro.max_num_seqs = 8;
  if (m.hisparse_slots > 0) {
    ro.hisparse.enabled = true;
    ro.hisparse.host_pool_bytes = ro.kv_cache_bytes;
    ro.hisparse.hot_slots_per_request = m.hisparse_slots;
  }
  return ro;
}

Result<std::unique_ptr<ModelRunner>> load(const Message& m, Status* worker_status) {
  ParallelConfig pc;
  pc.tensor_parallel_size = m.tp;
  pc.data_parallel_size = m.dp;
  pc.enable_expert_parallel = m.ep != 0;
  pc.decode_context_parallel_size = m.dcp;
  pc.dcp_kv_cache_interleave_size = m.interleave;
  pc.dcp_comm_backend = m.a2a ? "a2a" : "ag_rs";
  pc.prefill_context_parallel_size = m.pcp;
  const std::string dir = m.dir;
  auto load_local = [dir](const RunnerOptions& o) -> Result<std::unique_ptr<ModelRunner>> {
    ML4_ASSIGN_OR_RETURN(auto r, CpuRunner::load(dir, o));
    return std::unique_ptr<ModelRunner>(std::move(r));
  };
  return load_parallel_runner(pc, m.dir, options(m), load_local, worker_status);
}

}  // namespace

int rank() { return MpiEnv::get()->rank(); }
int world() { return MpiEnv::get()->size(); }

std::unique_ptr<ModelRunner> load_everywhere(const std::string& dir, const std::string& kv, const ParallelConfig& pc,
                                             int max_model_len, int kv_mib, bool drafter, int hisparse_slots) {
  Message m;
  m.kind = kLoad;
  m.tp = pc.tensor_parallel_size;
  m.dp = pc.data_parallel_size;
  m.ep = pc.enable_expert_parallel;
  m.dcp = pc.decode_context_parallel_size;
  m.interleave = pc.dcp_kv_cache_interleave_size;
  m.a2a = pc.dcp_comm_backend == "a2a";
  m.pcp = pc.prefill_context_parallel_size;
  m.max_len = max_model_len;
  m.kv_mib = kv_mib;
  m.drafter = drafter;
  m.hisparse_slots = hisparse_slots;
  m.dir = dir;
  m.kv = kv;
  bcast_message(&m);
  Status unused;
  auto r = load(m, &unused);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : nullptr;
}

void end_case() {
  Message m;
  m.kind = kEnd;
  bcast_message(&m);
}

void serve() {
  for (;;) {
    Message m;
    bcast_message(&m);
    if (m.kind == kEnd) return;
    Status ws;
    auto r = load(m, &ws);
    EXPECT_TRUE(r.ok()) << "rank " << rank() << ": " << r.status().message();
    EXPECT_TRUE(ws.ok()) << "rank " << rank() << ": " << ws.message();
  }
}

}  // namespace ml4::mpitest

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto env = ml4::MpiEnv::init();
  if (!env.ok()) {
    std::fprintf(stderr, "%s\n", env.status().message().c_str());
    return 1;
  }
  if ((*env)->rank() != 0) {
    // Workers report only failures (rank 0 prints the run).
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  // Every rank's verdict: the job fails when any rank saw a failure.
  int all = 0;
  MPI_Allreduce(&rc, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return all;
}
