// ParallelGroup: this process's place in a parallel run, set up once at start-up: the MPI
// world (mpi_env.h), the rank layout printed by rank 0, the model's parallel plan, and the
// MPI communicators of the control channel (the world: rank 0 sends each step to the
// workers) and of the forward's groups (TP, EP, DCP). CUDA ranks build their NCCL communicators
// over the same groups from these (cuda/nccl_communicator.h).
#pragma once

#include <memory>

#include "core/status.h"
#include "model/model_config.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_env.h"
#include "parallel/parallel_plan.h"
#include "parallel/rank_layout.h"

namespace ml4 {

struct ParallelGroup {
  MpiEnv* env = nullptr;
  RankLayout layout;
  std::unique_ptr<ParallelPlan> plan;
  std::unique_ptr<MpiCommunicator> world;  // control: steps from rank 0, results back
  std::unique_ptr<MpiCommunicator> tp;     // this rank's TP group (size 1 without TP)
  std::unique_ptr<MpiCommunicator> ep;     // the EP group (size 1 without EP)
  std::unique_ptr<MpiCommunicator> dcp;    // the DCP group (size 1 without DCP)
  std::unique_ptr<MpiCommunicator> pcp;    // the PCP group (size 1 without PCP)
  bool is_driver() const { return layout.world_rank == 0; }
  // The forward's communicators (MPI: CPU ranks); null for a group of one (no collectives).
  ParallelComms comms() const {
    return {tp->size() > 1 ? tp.get() : nullptr, ep->size() > 1 ? ep.get() : nullptr,
            dcp->size() > 1 ? dcp.get() : nullptr, pcp->size() > 1 ? pcp.get() : nullptr};
  }

  // Initialises MPI when needed, checks the world size against the config, makes the layout,
  // the plan (from the model's config) and the communicators; rank 0 logs the layout.
  static Result<std::unique_ptr<ParallelGroup>> create(const ParallelConfig& config, const ModelConfig& model);
};

}  // namespace ml4
