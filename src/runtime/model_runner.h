// ModelRunner: what the engine drives. One implementation per backend (CPU now, CUDA
// later); the engine, scheduler and server never see which one runs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model_config.h"
#include "model/weight_memory.h"
#include "offload/hisparse.h"
#include "parallel/communicator.h"
#include "parallel/parallel_plan.h"
#include "runtime/forward_trace.h"
#include "runtime/step.h"

namespace ml4 {

// One KV cache group as the block manager sees it: the runner owns the page memory,
// the engine owns which block ids belong to which sequence.
struct CacheGroupInfo {
  std::string name;             // "latent", "indexer", "drafter"
  int page_tokens = 64;         // tokens per block
  int64_t num_blocks = 0;       // blocks the runner allocated for this group
  int64_t sliding_window = 0;   // 0: full attention; else only the last N tokens are read
  int64_t bytes_per_token = 0;  // summed over the group's layers
  // Data parallelism (runtime/parallel_runner.h): blocks [k n / p, (k + 1) n / p) live on DP
  // rank k, and the block manager keeps each sequence's blocks within one such range.
  int partitions = 1;
  // Decode context parallelism (kv/context_shard.h): the group's tokens are sharded over this
  // many ranks; a block covers page_tokens tokens of which each rank holds page_tokens / this.
  int context_shards = 1;
};

// The memory of one layer slot of one cache group: num_blocks pages of block_bytes each,
// contiguous from base (block b at base + b * block_bytes). What a KV transport registers
// (P/D, src/transfer/) and an offload pool mirrors. `device`: GPU memory (else host).
struct KvRegion {
  int group = 0;        // index into ModelRunner::cache_groups()
  int layer_slot = 0;   // the layer's slot inside its group (LayerSpec::latent_slot, ...)
  void* base = nullptr;
  int64_t block_bytes = 0;
  int64_t num_blocks = 0;
  bool device = false;
};

struct RunnerOptions {
  std::string kv_cache_dtype = "fp8_ds_mla";  // fp8_ds_mla | fp8 | bf16
  // The CPU backend's linear activations (vLLM's --dtype; ops/cpu/linear.h ActivationDtype):
  // auto | float32 (exact, the default) | bfloat16 (AVX512_BF16 dot products).
  std::string dtype = "auto";
  int64_t kv_cache_bytes = 256ll << 20;       // KV memory budget, split across groups
  int64_t max_model_len = 0;                  // 0: the model's max_position_embeddings
  bool experts_to_mxfp4 = false;              // re-quantize FP8 routed experts to MXFP4 at load
  // CPU: the linears as views into the file mapping or copied into huge-page memory
  // (model/weight_memory.h; `--mmap` / `--no-mmap`). Devices that upload ignore it.
  WeightMemory weight_memory = WeightMemory::kAuto;
  // DSpark speculative decoding: load the checkpoint's drafter, write its context K/V in every
  // forward, give the drafter group max_num_seqs windows of blocks, and serve draft().
  bool drafter = false;
  int64_t max_num_seqs = 0;  // sequences the drafter group must hold windows for
  // A rank of a parallel group (SYSTEM.md S10; runtime/parallel_runner.h): load only this
  // rank's shard and run the program on plan->local_config() with these communicators (MPI,
  // host memory: CPU ranks; a CUDA runner makes NCCL communicators over the same groups,
  // bootstrapped through them). Null: a single process.
  const ParallelPlan* plan = nullptr;
  ParallelComms comms;
  // HiSparse (SYSTEM.md S12; offload/hisparse.h): the latent group in a host pool of
  // hisparse.host_pool_bytes, kv_cache_bytes for the device side (indexer cache, drafter
  // windows, max_num_seqs x hot buffers).
  HiSparseConfig hisparse;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual const ModelConfig& config() const = 0;
  virtual const std::vector<CacheGroupInfo>& cache_groups() const = 0;
  // Runs one step. Tokens of all sequences are processed; KV for them is written into the
  // blocks named by each SeqStep's block tables.
  virtual Result<StepOutput> execute(const StepInput& in) = 0;
  // As execute(), also recording the forward's decisions into *trace and obeying its
  // forced ones (tests and golden comparisons; forward_trace.h).
  virtual Result<StepOutput> execute_traced(const StepInput& in, ForwardTrace* trace) {
    if (trace == nullptr) return execute(in);
    return unimplemented("this runner does not record or force its forward's decisions");
  }
  // True when execute() honours SeqStep::device_sampling (fills StepOutput::sampled): the
  // engine then asks for device sampling for the sequences that need nothing more.
  virtual bool samples_on_device() const { return false; }
  // True when device sampling honours SeqStep::allowed_tokens (grammar masks).
  virtual bool applies_token_masks() const { return false; }
  // True when execute() honours SeqStep::device_verify for a random request drawn with `p`
  // (and draft() DraftSeq::keep_probs): DSpark's rejection sampler on the device, so neither
  // the target's rows nor the drafts' q cross to the host. Only asked of a runner that
  // samples_on_device().
  virtual bool verifies_on_device(const DeviceSamplingParams& p) const { return false; }
  // The KV pages, one region per (group, layer slot); empty when the runner cannot expose
  // them. Block ids are those of the step's block tables. Reading or writing a block that a
  // running step uses is the caller's race to avoid (the engine moves KV between steps).
  virtual std::vector<KvRegion> kv_regions() { return {}; }
  // Makes the calling thread use this runner's device (CUDA: its primary context current), for
  // other threads that touch the KV memory, such as the KV transfer agent's. CPU: nothing.
  virtual void bind_thread() const {}
  // DSpark (step.h DraftInput): true when the runner loaded a drafter (RunnerOptions::drafter).
  virtual bool has_drafter() const { return false; }
  virtual Result<DraftOutput> draft(const DraftInput& in) {
    return unimplemented("this runner has no DSpark drafter");
  }
  // The engine gave up the sequence's KV (finished, aborted, preempted): state the runner
  // keeps per sequence (HiSparse's hot buffers) is freed.
  virtual void release(int64_t seq_id) {}
  // HiSparse's hot-buffer state; null without offload.
  virtual const HiSparseState* hisparse() const { return nullptr; }
};

}  // namespace ml4
