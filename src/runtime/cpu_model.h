// CpuModel: the whole forward of MODEL.md section 3 on the CPU, over the paged KV cache.
//
// One forward is written against ModelConfig/LayerSpec; per-layer differences (RoPE or
// NoPE, SSMax, KV owner or consumer, indexer owner / reuser / none, dense or MoE) are
// fields of the spec, never model names. Activations are f32; weights are decoded from
// their stored format inside the linear kernels.
//
// Attention always reads keys back from the cache pages (after this step's rows were
// written), in prefill and decode alike: the prompt pass and the incremental pass see
// the same quantized latent rows, so "incremental decode equals recomputation" holds to
// f32 rounding for every KV dtype. The absorbed MLA form is used for every token.
#pragma once

#include <memory>
#include <vector>

#include "core/status.h"
#include "kv/paged_kv_cache.h"
#include "model/model_config.h"
#include "model/model_weights.h"
#include "runtime/forward_trace.h"
#include "runtime/step_metadata.h"

namespace ml4 {

class CpuModel {
 public:
  // duplicate_shared_kv: the baseline without KV sharing's memory saving: each consumer
  // layer gets latent layer slot num_latent_layers + k (k-th consumer) holding its own copy
  // of its source's rows (written when the source writes) and reads that copy. The cache
  // must then have those extra layer slots (CpuRunner does this).
  CpuModel(ModelConfig cfg, std::shared_ptr<const ModelWeights> weights, int latent_group, int indexer_group,
           bool duplicate_shared_kv = false);

  const ModelConfig& config() const { return cfg_; }

  // Writes this step's KV into `cache` and returns logits [md.logits_rows.size(), vocab].
  Status forward(const StepMetadata& md, PagedKvCache& cache, std::vector<float>* logits,
                 ForwardTrace* trace = nullptr) const;

 private:
  void attention(int layer, const StepMetadata& md, PagedKvCache& cache, const float* a, float* out,
                 std::vector<std::vector<std::vector<int32_t>>>& topk_by_layer,
                 const std::vector<std::vector<int32_t>>* forced_topk = nullptr) const;
  void indexer_topk(int layer, const StepMetadata& md, PagedKvCache& cache, const float* a, const float* q_latent,
                    std::vector<std::vector<int32_t>>& topk) const;
  void ffn(int layer, const float* x, int64_t T, float* out, ForwardTrace* trace) const;

  ModelConfig cfg_;
  std::shared_ptr<const ModelWeights> w_;
  int latent_group_ = -1, indexer_group_ = -1;
  std::vector<float> inv_freq_;          // MLA rope
  std::vector<float> indexer_inv_freq_;  // indexer rope
  float rope_factor_ = 1.0f;
  std::vector<int> latent_read_slot_;                // [layer] latent layer slot attention reads
  std::vector<std::vector<int>> latent_write_slots_;  // [layer] slots its rows are written to
};

}  // namespace ml4
