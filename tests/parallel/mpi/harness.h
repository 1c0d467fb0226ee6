// Tests that run as MPI ranks (mpirun -np N ml4_parallel_mpi_tests; CTest starts them with
// N = 2 and 4). Every rank runs the same GoogleTest cases in the same order. Cases on the
// model run the production path: rank 0 drives a ParallelRunner exactly as the engine does
// and the other ranks serve its steps in run_parallel_worker. To start them, rank 0 sends the
// workers a "load" message (model directory, KV dtype, parallel config) over MPI_COMM_WORLD;
// each rank then builds its group and loads its shard. A case ends with "end", after which
// the workers go on to the next case. Only rank 0 checks results and prints.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "parallel/mpi_env.h"
#include "parallel/rank_layout.h"
#include "runtime/model_runner.h"

namespace ml4::mpitest {

int rank();
int world();

// Rank 0: makes every rank load `dir` as a parallel runner and returns rank 0's; null (with
// a test failure) when loading failed. max_model_len 0: the model's; kv_mib: each rank's KV
// budget; drafter: load the DSpark drafter (windows for 8 sequences).
std::unique_ptr<ModelRunner> load_everywhere(const std::string& dir, const std::string& kv, const ParallelConfig& pc,
                                             int max_model_len = 0, int kv_mib = 32, bool drafter = false);
// Rank 0: the workers leave serve() for the next case.
void end_case();
// Workers: serve load requests until end_case().
void serve();

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
