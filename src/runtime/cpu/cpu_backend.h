// CpuBackend: the ops of ops/backend.h on the host (SYSTEM.md S3), over the paged KV cache.
//
// Activations are f32 host vectors, grown to the largest step and reused (no allocation per
// step once warm). Weights stay in their stored format (bf16, FP8 blocks, NVFP4, MXFP4) and
// are decoded exactly inside cpu::linear. Sparse selections are kept as key positions.
//
// Attention always reads keys back from the cache pages (after this step's rows were
// written), in prefill and decode alike: the prompt pass and the incremental pass see the
// same quantized latent rows, so "incremental decode equals recomputation" holds to f32
// rounding for every KV dtype. A sequence's keys are decoded from the pages once per layer
// and shared by its tokens.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kv/paged_kv_cache.h"
#include "model/model_weights.h"
#include "ops/backend.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/linear.h"
#include "runtime/step_metadata.h"

namespace ml4 {

class CpuBackend : public Backend {
 public:
  // weights: kept alive here (linears and vectors are used in place); cache: the runner's.
  CpuBackend(const ModelConfig& cfg, std::shared_ptr<const ModelWeights> weights, PagedKvCache* cache);

  // The step the next forward runs (md must outlive it); sizes the activations. write_md:
  // the whole step whose rows the *_gathered writes take (prefill context parallelism; md
  // is then this rank's share of it); null: md.
  void begin_step(const StepMetadata& md, const StepMetadata* write_md = nullptr);
  // Per-piece wall time of the program's timed() labels, summed while profiling is on
  // (benchmarks: bench/tp_decode_bench.cpp, bench/cpu_model_bench.cpp); nested labels count
  // in both. Turning it on starts from zero.
  void set_profile(bool on) {
    profile_on_ = on;
    if (on) profile_.clear();
  }
  const std::map<std::string, double>& profile() const { return profile_; }
  Status timed(const char* label, const Fn& fn) override;
  // The linears' activation precision (ops/cpu/linear.h), set before the program adds its
  // weights; routers stay f32 (MODEL.md 3.7). An error where the CPU cannot run it.
  Status set_activation_dtype(cpu::ActivationDtype a);

  Status set_embedding(const Tensor& table) override;
  Status set_embedding_shard(const Tensor& table, int64_t first_id) override;
  Result<LinearRef> add_linear(const LinearWeight& w, LinearUse use) override;
  Result<MlpRef> add_mlp(const MlpWeights& m) override;
  Result<const float*> add_vector(const std::vector<float>& v) override;
  Result<MoeRef> add_moe(const std::vector<MlpWeights>& experts, const MlpWeights* shared) override;
  Result<AbsorbRef> add_absorb(const LinearWeight& wkv_b) override;
  Status reserve_selections(int n) override;
  Status enable_drafter() override;

  const Activations& acts() const override { return acts_; }
  int64_t step_tokens() const override { return md_ == nullptr ? 0 : md_->num_tokens(); }
  int64_t step_rows() const override { return md_ == nullptr ? 0 : static_cast<int64_t>(md_->logits_rows.size()); }
  // logits_rows are increasing token indices: as many as the tokens means every token in order.
  bool rows_are_tokens() const override { return md_ != nullptr && step_rows() == step_tokens(); }

  Status embedding(float* out) override;
  Status rms_norm(const NormArgs& p) override;
  Status layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t dim, float eps,
                    float* y) override;
  Status linear(LinearRef w, const float* x, int64_t M, float* y) override;
  Status silu_mul(const float* g, const float* u, int64_t rows, int64_t cols, float* out) override;
  Status rope(const RopeArgs& p) override;
  Status q_path(const QPathArgs& p) override;
  Status latent_cache_write(CacheGroup group, int cache_slot, const float* c, const float* kr, int kr_stride) override;
  Status indexer_key_write(int cache_slot, float* k) override;
  Status latent_cache_write_gathered(CacheGroup group, int cache_slot, const float* c, int c_stride, const float* kr,
                                     int kr_stride) override;
  Status indexer_key_write_gathered(int cache_slot, float* k) override;
  Status indexer_select(const IndexerSelectArgs& p) override;
  Result<std::vector<std::vector<int32_t>>> read_selection(int selection) override;
  Status set_selection(int selection, const std::vector<std::vector<int32_t>>& positions) override;
  Status mla_absorb_q(AbsorbRef a, const float* q, float* q_lat) override;
  Status mla_attention(const MlaArgs& p) override;
  Status mla_apply_uv(AbsorbRef a, const float* out_lat, float* o) override;
  Status moe_route(const MoeRouteArgs& p) override;
  Status moe_experts(MoeRef moe, const float* x, const int32_t* ids, const float* weights, float* out) override;
  Result<std::vector<int32_t>> read_ints(const int32_t* p, int64_t n) override;
  Status gather_logits_rows(const float* x, float* out) override;
  Result<void*> scratch(int slot, int64_t bytes) override;
  Status upload(void* dst, const void* src_host, int64_t bytes) override;
  Status gather_rows_at(const float* src, const int32_t* idx, int64_t n, int64_t cols, float* dst) override;
  Status scatter_add_rows_at(const float* src, const int32_t* idx, int64_t n, int64_t cols, float* dst) override;
  Status moe_experts_rows(MoeRef moe, const float* x, int64_t n, const int32_t* ids, const float* weights,
                          float* out) override;
  Status merge_topk_candidates(const void* candidates, int n, int selection, int local_selection) override;
  Status merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols,
                               float* out) override;
  Status rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows,
                                int64_t cols) override;
  Result<TableRef> add_table(const Tensor& t) override;
  Status gather_table_rows(TableRef t, const int32_t* ids, int64_t n, float* out) override;
  Status copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                   int64_t cols) override;
  Status add_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t rows, int64_t cols) override;
  Status fill(float* x, int64_t n, float value) override;
  Status block_embed(const float* mask, float* out) override;
  Status select_block_window(CacheGroup group, int64_t window) override;
  Status gru_update(const float* gi, const float* gh, const float* b_ih, const float* b_hh, int64_t rows, int64_t r,
                    float* s) override;
  Status choose_tokens(float* logits, int64_t rows, const DeviceSamplingParams* params, int32_t* ids,
                       float* probs, const float* base, int64_t base_stride) override;
  Status hisparse_reserve(int layers, int64_t rows) override;
  Status hisparse_load_rows(int latent_slot, int hot_layer, const std::vector<HotLoad>& loads) override;
  Status set_hot_selection(const int32_t* rows, const int32_t* counts) override;
  // The HiSparse "device" pool's bytes (the CPU runs the policy with a bounded pool).
  int64_t hot_pool_bytes() const;

 private:
  struct Moe {
    const std::vector<MlpWeights>* experts = nullptr;
    const MlpWeights* shared = nullptr;
  };
  void mlp(const MlpWeights& m, const float* x, int64_t T, float* out);
  // Several MLPs (MoE experts of a decode-sized step),
  // each as mlp() computes it, in two parallel regions: all gate and up rows, then all down
  // rows (not three regions per expert).
  struct MlpJob {
    const MlpWeights* w;
    const float* x;
    int64_t rows;
    float* out;
  };
  void mlps(const std::vector<MlpJob>& jobs);
  const std::vector<int32_t>& selected(int selection, int64_t t) const {
    return selection == kBlockWindow ? window_[t] : selection == kHotSelection ? hot_selection_[t] : selections_[selection][t];
  }
  int group_index(CacheGroup g) const { return g == CacheGroup::kDrafter ? drafter_group_ : latent_group_; }

  ModelConfig cfg_;
  std::shared_ptr<const ModelWeights> weights_;
  PagedKvCache* cache_ = nullptr;
  int latent_group_ = -1, indexer_group_ = -1, drafter_group_ = -1;
  const Tensor* embed_ = nullptr;
  int64_t embed_first_ = 0;  // vocabulary-parallel: the first token id embed_ holds
  std::vector<std::vector<uint8_t>> scratch_;
  std::vector<const LinearWeight*> linears_;
  std::vector<const LinearWeight*> absorbs_;  // wkv_b per layer (ops/cpu/attention.h reads it as stored)
  std::vector<cpu::AbsorbLayout> absorb_layout_;  // per absorb: the decode kernels' layout (or empty)
  std::vector<cpu::ActivationDtype> linear_act_;  // per linear: act_, or f32 for a router
  cpu::ActivationDtype act_ = cpu::ActivationDtype::kF32;
  std::vector<Moe> moes_;
  std::vector<std::vector<std::vector<int32_t>>> selections_;  // [selection][token] positions
  std::vector<std::vector<int32_t>> window_;                  // [token] kBlockWindow positions
  // moe_experts' / mlps' scratch, kept across calls: rows grouped by expert (expert e's
  // (token, weight) pairs from moe_first_[e] in moe_rows_), gathered inputs and outputs,
  // the shared expert's output, the jobs and their linear parts, the hidden activations.
  std::vector<int64_t> moe_first_;
  std::vector<std::pair<int64_t, float>> moe_rows_;
  std::vector<float> moe_xs_, moe_ys_, moe_sh_, mlps_g_, mlps_u_;
  std::vector<MlpJob> moe_jobs_;
  struct MlpPart {
    const LinearWeight* w;
    const float* x;
    int64_t rows;
    float* y;
  };
  std::vector<MlpPart> mlps_up_, mlps_down_;
  std::vector<int64_t> mlps_first_;
  // indexer_select's scratch, kept across calls: decoded keys, a token group's scores, visible counts.
  std::vector<float> indexer_keys_, indexer_scores_;
  std::vector<int64_t> indexer_visible_;
  // indexer_select's one-group steps: each token's first score (in indexer_scores_), each
  // sequence's key count and first 16-key block.
  std::vector<int64_t> indexer_score_at_, indexer_seq_needed_, indexer_block_first_;
  // mla_attention's scratch: rows decoded once for the step ((sequence, index) of each in
  // mla_index_, sequence i's from row mla_first_[i] where mla_shared_[i]), a sequence's
  // selection index -> row map (from mla_map_first_[i] in mla_row_), the step's (sequence,
  // token) pairs.
  std::vector<float> mla_keys_c_, mla_keys_kr_;
  std::vector<int64_t> mla_first_, mla_map_first_;
  std::vector<char> mla_shared_;
  std::vector<int32_t> mla_row_;
  std::vector<std::pair<int, int64_t>> mla_index_, mla_tokens_;
  // HiSparse: the hot pool [layer][rows * latent token bytes] and the step's hot rows.
  std::vector<std::vector<uint8_t>> hot_;
  int64_t hot_rows_ = 0;
  std::vector<std::vector<int32_t>> hot_selection_;  // [token] hot-pool rows
  std::vector<const Tensor*> tables_;
  bool drafter_ = false;
  std::vector<int32_t> draft_ids_;
  const StepMetadata* md_ = nullptr;
  const StepMetadata* write_md_ = nullptr;
  Status write_latent_rows(const StepMetadata& m, CacheGroup group, int cache_slot, const float* c, int c_stride,
                           const float* kr, int kr_stride);
  Status write_indexer_rows(const StepMetadata& m, int cache_slot, float* k);
  Activations acts_;
  std::vector<std::vector<float>> act_storage_;
  std::vector<int32_t> expert_ids_;
  int64_t act_tokens_ = 0, act_rows_ = 0, max_hidden_ = 1;
  bool profile_on_ = false;
  std::map<std::string, double> profile_;
};

}  // namespace ml4
