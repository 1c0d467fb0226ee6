// The rank-0 / worker split of a parallel run (SYSTEM.md S10), in the manner of vLLM's
// multiprocessing executor and TensorRT-LLM's MPI orchestrator: rank 0 owns the API server,
// the engine and the scheduler; every rank holds its shard in a local runner (CPU or CUDA);
// each step rank 0 broadcasts the step's input to the workers, all ranks run the one model
// program (whose collectives join them), and rank 0 returns the logits.
//
// Protocol, over the world's control communicator: a 16-byte header {kind, payload bytes},
// then the payload (the StepInput and, for traced steps, the forced decisions; parallel/
// wire.h). Workers wait for the header without a time limit (the next step may come in an
// hour); every other wait is bounded by the group's failure checks (parallel/mpi_env.h).
//
// Data parallelism: the engine sees one KV pool per cache group holding dp x the blocks of
// one rank, block b living on DP rank b / blocks-per-rank; the scheduler keeps each sequence
// within one DP rank's range (engine/block_manager.h partitions). Each DP group runs the
// sequences whose blocks it holds, with block ids made local; a DP rank without sequences
// runs an empty step (its MoE layers still join the expert-parallel exchanges, as vLLM's
// dummy batches do). The leaders of DP groups 1.. send their logits rows to rank 0.
//
// A step is validated on rank 0 before it is sent, so every rank sees a valid step; a
// worker whose step then fails anyway stops the group (the failure is logged on that rank,
// the MPI job is aborted, rank 0 reports the lost rank).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "parallel/parallel_group.h"
#include "runtime/model_runner.h"

namespace ml4 {

class ParallelRunner : public ModelRunner {
 public:
  // local: rank 0's shard of the model, made with the group's plan and communicators.
  ParallelRunner(std::shared_ptr<ParallelGroup> group, std::unique_ptr<ModelRunner> local);
  ~ParallelRunner() override;

  const ModelConfig& config() const override { return group_->plan->global_config(); }
  const std::vector<CacheGroupInfo>& cache_groups() const override { return groups_; }
  Result<StepOutput> execute(const StepInput& in) override { return execute_traced(in, nullptr); }
  Result<StepOutput> execute_traced(const StepInput& in, ForwardTrace* trace) override;
  bool samples_on_device() const override { return group_->layout.dp_size == 1 && local_->samples_on_device(); }
  bool has_drafter() const override { return local_->has_drafter(); }
  Result<DraftOutput> draft(const DraftInput& in) override;
  void release(int64_t seq_id) override;
  const HiSparseState* hisparse() const override { return local_->hisparse(); }

  // Tells the workers to leave their loop (also done by the destructor); idempotent.
  Status stop();
  ModelRunner& local() { return *local_; }
  ParallelGroup& group() { return *group_; }

 private:
  std::shared_ptr<ParallelGroup> group_;  // declared first: outlives local_, which uses its communicators
  std::unique_ptr<ModelRunner> local_;
  std::vector<CacheGroupInfo> groups_;  // the local groups, dp x their blocks
  bool stopped_ = false;
};

// Loads this rank's runner of a parallel run: sets up the group (MPI; the model directory's
// config gives the plan), loads the rank's shard with `load_local` (CPU or CUDA) and, on rank
// 0, returns the ParallelRunner. On a worker it serves rank 0's steps until rank 0 stops the
// group and then returns null with *worker_status set (the caller ends the process).
using LocalRunnerLoader = std::function<Result<std::unique_ptr<ModelRunner>>(const RunnerOptions&)>;
Result<std::unique_ptr<ModelRunner>> load_parallel_runner(const ParallelConfig& config, const std::string& model_dir,
                                                          const RunnerOptions& opts, const LocalRunnerLoader& load_local,
                                                          Status* worker_status);

// A worker's life: serves rank 0's steps on `local` until rank 0 sends stop (OK) or the
// group fails (the error).
Status run_parallel_worker(ParallelGroup& group, ModelRunner& local);

// The wire form of a step and of a draft step (exposed for tests).
std::vector<uint8_t> encode_step(const StepInput& in, const ForwardTrace* forced);
std::vector<uint8_t> encode_draft(const DraftInput& in);
Status decode_draft(const std::vector<uint8_t>& bytes, DraftInput* in);
Status decode_step(const std::vector<uint8_t>& bytes, StepInput* in, ForwardTrace* forced, bool* traced);
// The sequences of `in` that DP rank `dp` runs, with block ids made local; blocks_per_rank
// per cache group. Fails when a sequence's blocks are not all on one DP rank.
Result<StepInput> dp_slice(const StepInput& in, int dp, int dp_size, const std::vector<int64_t>& blocks_per_rank,
                           std::vector<int>* seq_index = nullptr);

}  // namespace ml4
