// CpuRunner: the CPU backend behind the ModelRunner interface (SYSTEM.md S3).
//
// Loads a model directory (params.json or config.json, safetensors, any weight format),
// sizes the paged KV cache from RunnerOptions::kv_cache_bytes (every full-attention group
// gets the same number of token slots) and runs steps: the one model program
// (runtime/model_forward.h) over CpuBackend (cpu_backend.h).
#pragma once

#include <memory>
#include <string>

#include "kv/cache_spec.h"
#include "kv/paged_kv_cache.h"
#include "model/checkpoint.h"
#include "runtime/cpu/cpu_backend.h"
#include "runtime/model_forward.h"
#include "runtime/model_runner.h"

namespace ml4 {

class CpuRunner : public ModelRunner {
 public:
  // duplicate_shared_kv: KV-sharing consumers keep their own copy of the source's rows
  // (the no-sharing memory baseline; see ModelForward::Options).
  static Result<std::unique_ptr<CpuRunner>> load(const std::string& model_dir, const RunnerOptions& opts,
                                                 bool duplicate_shared_kv = false);
  // The same over weights already in memory (tests: a model and its dequantized twin).
  static Result<std::unique_ptr<CpuRunner>> create(const ModelConfig& cfg, std::shared_ptr<const ModelWeights> weights,
                                                   const RunnerOptions& opts, bool duplicate_shared_kv = false);

  const ModelConfig& config() const override { return program_->config(); }
  const std::vector<CacheGroupInfo>& cache_groups() const override { return groups_; }
  Result<StepOutput> execute(const StepInput& in) override;
  // As execute(), also recording the forward's decisions (top-k sets, routed experts).
  Result<StepOutput> execute_traced(const StepInput& in, ForwardTrace* trace) override;
  std::vector<KvRegion> kv_regions() override;
  bool has_drafter() const override { return program_->has_drafter(); }
  Result<DraftOutput> draft(const DraftInput& in) override;
  void release(int64_t seq_id) override {
    if (hisparse_) hisparse_->release(seq_id);
  }
  const HiSparseState* hisparse() const override { return hisparse_.get(); }

  const KvCacheSpec& kv_spec() const { return spec_; }
  PagedKvCache& cache() { return *cache_; }
  CpuBackend& backend() { return *backend_; }
  int64_t max_model_len() const { return max_model_len_; }

 private:
  std::shared_ptr<Checkpoint> ckpt_;  // the weights are views into it
  KvCacheSpec spec_;
  std::unique_ptr<PagedKvCache> cache_;
  std::unique_ptr<CpuBackend> backend_;
  std::unique_ptr<HiSparseState> hisparse_;  // before program_, which points to it
  std::unique_ptr<ModelForward> program_;
  std::vector<CacheGroupInfo> groups_;
  ContextShard shard_;  // decode context parallelism: this rank's share of the KV
  int pcp_size_ = 1, pcp_rank_ = 0;  // prefill context parallelism
  int64_t max_model_len_ = 0;
};

// The engine-facing factory.
Result<std::unique_ptr<ModelRunner>> load_cpu_runner(const std::string& model_dir, const RunnerOptions& opts);

}  // namespace ml4
