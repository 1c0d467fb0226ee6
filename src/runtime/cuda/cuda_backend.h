// CudaBackend: the ops of ops/backend.h on one GPU (SYSTEM.md S4), each an ops/cuda kernel on
// the backend's stream, for the one model program (runtime/model_forward.h).
//
// Memory: weights (bf16, FP8 128x128 blocks or f32, as stored; routers widened to f32), the
// paged KV pools of every cache group, and the step buffers, grown to the largest step seen
// and otherwise kept at fixed addresses so captured graphs stay valid (buffer_generation()
// says when they moved).
//
// Device-only parts of the program's schedule:
//   - segment() / host_sync(): CUDA graph segments and the eager breaks between them (mode):
//       kEager:   run everything;
//       kCapture: record each run of segment() work between breaks as one graph; breaks are
//                 cut points only (the eager run before has produced this step's results);
//       kReplay:  launch the recorded graphs in order and run the breaks eagerly between
//                 them (they write into the same fixed buffers the next graph reads).
//   - side() / wait_lane() / join_side(): the two side streams an indexer owner's DSA chain
//     overlaps on (its query half on lane 0, its key half on lane 1) when every linear involved
//     takes the GEMV (each stream has its own GEMV workspace; cuBLASLt shares one),
//     decode-sized steps that are neither traced nor profiled.
//   - timed(): per-piece GPU milliseconds on eager steps (set_profile).
// Numerics: production (GEMMs with M > 8 on cuBLASLt / our FP8 kernel with bf16 or FP8
// activations, attention on bf16 tensor cores, indexer scores on FP8 tensor cores) or exact
// (every linear on f32 activations through the GEMV, f32 attention and indexer: the CPU's
// arithmetic up to summation order).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "kv/cache_spec.h"
#include "model/model_weights.h"
#include "ops/backend.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/ffn_resident.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/rope_rows.h"
#include "runtime/step_metadata.h"

namespace ml4::cuda {

// Tokens up to which MoE layers take the grouped decode path (moe_experts_forward_grouped:
// each selected expert's weights read once per 8 of its rows, no host synchronization,
// capturable); larger steps take the grouped GEMMs (FP8, NVFP4 or MXFP4 experts,
// moe_experts_forward_gemm) or, with grouped_moe_gemm off, loop over experts.
constexpr int64_t kGroupedMoeMaxTokens = 128;

// Steps of this many tokens or more score the indexer by the wgmma kernel
// (CudaBackendOptions::indexer_wgmma): it fills 128 query rows a block, a decode step a few.
constexpr int64_t kIndexerWgmmaFromTokens = 256;

struct CudaBackendOptions {
  bool exact_activations = false;
  bool overlap_indexer = true;
  bool grouped_moe_gemm = true;   // CudaRunnerOptions::grouped_moe_gemm
  bool moe_gemm_overlap = true;   // CudaRunnerOptions::moe_gemm_overlap
  bool moe_gemm_tall = false;     // CudaRunnerOptions::moe_gemm_tall
  bool moe_gemm_group_major = true;  // CudaRunnerOptions::moe_gemm_group_major
  bool moe_gemm_specialized = true;   // CudaRunnerOptions::moe_gemm_specialized
  bool moe_gemm_swap = false;         // CudaRunnerOptions::moe_gemm_swap
  bool moe_gemm_swap_down = false;    // CudaRunnerOptions::moe_gemm_swap_down
  bool moe_quant_epilogue = true;     // CudaRunnerOptions::moe_quant_epilogue
  bool absorb_gemm = true;        // CudaRunnerOptions::absorb_gemm
  int64_t absorb_gemm_min_tokens = 64;
  bool fp4_weights = true;        // CudaRunnerOptions::fp4_weights
  int fp4_x_parts = 1;            // CudaRunnerOptions::fp4_x_parts (exact_activations: -1, the stream)
  bool fused_router = true;       // CudaRunnerOptions::fused_router
  bool fused_ffn_norm = false;    // CudaRunnerOptions::fused_ffn_norm
  bool shared_expert_lane = true;   // CudaRunnerOptions::shared_expert_lane
  int64_t shared_expert_lane_min_bytes = int64_t{16} << 20;  // CudaRunnerOptions::shared_expert_lane_min_bytes
  bool fused_indexer = true;   // CudaRunnerOptions::fused_indexer
  // Sparse MLA steps of a wave of tokens or more (prefill) on the wgmma prefill kernel
  // (ops/cuda/attention_prefill.cu; MlaAttentionParams::prefill_kernel). ML4_MLA_PREFILL=0 turns
  // it off (A/B against the decode kernel in `ml4 bench step`).
  bool mla_prefill_kernel = true;
  // Its pair schedule (MlaAttentionParams::prefill_pairs); ML4_MLA_PREFILL_PAIRS=0 takes the
  // tile schedule.
  bool mla_prefill_pairs = true;
  // The indexer's FP8 scores of steps of kIndexerWgmmaFromTokens tokens or more (prefill) by the
  // wgmma kernel (IndexerMath::kFp8Wgmma: 2.2-3.6x the mma.sync kernel at 4096 tokens on an
  // H100, CudaIndexer.WgmmaScoresAndTopkMatchCpu); decode-sized steps keep mma.sync.
  // ML4_INDEXER_WGMMA=0 turns it off.
  bool indexer_wgmma = true;
  // The MLA latents of prefill steps in bf16 (issue 18): a step the sparse prefill kernel takes
  // absorbs W_UK as a bf16 GEMM straight into bf16 q_lat and writes bf16 out_lat, which W_UV
  // reads as a bf16 GEMM (MlaAbsorbParams::lat_bf16, MlaAttentionParams::lat_bf16): half the
  // bytes of both through HBM. The kernel rounds q to bf16 anyway; what changes is q's nope part
  // and W_UK / W_UV rounded to bf16 (not TF32) before their products, and out_lat rounded to
  // bf16 before W_UV (the o projection then quantizes to FP8). W_UK's absorption is deferred to
  // mla_attention, which knows whether the prefill kernel takes the step (else it runs the f32
  // form there). Needs absorb_gemm; bf16 copies of W_UK / W_UV are made at add_absorb when on.
  // ML4_MLA_LATENT_BF16=0 turns it off.
  bool mla_latent_bf16 = true;
  // RunnerOptions::experts_to_mxfp4: routed FP8 experts re-quantized to MXFP4 on the device
  // as they are uploaded (ops/cuda/requant.h); needs fp4_weights.
  bool experts_to_mxfp4 = false;
  // A TP rank (parallel/parallel_plan.h): holds Activations::logits_parts for the logits'
  // all-gather.
  bool tensor_parallel = false;
  // The resident FFN kernel's device waits (set_resident_ffn) end after this long; its blocks a
  // multiprocessor (FfnResidentParams::blocks_per_sm; ML4_RESIDENT_BLOCKS=3 for A/B runs).
  uint64_t resident_wait_timeout_ns = 10'000'000'000ull;
  int resident_blocks_per_sm = 0;
};

struct GraphExec {
  explicit GraphExec(cudaGraphExec_t e) : exec(e) {}
  GraphExec(GraphExec&& o) noexcept : exec(o.exec) { o.exec = nullptr; }
  GraphExec(const GraphExec&) = delete;
  ~GraphExec() {
    if (exec) cudaGraphExecDestroy(exec);
  }
  operator cudaGraphExec_t() const { return exec; }
  cudaGraphExec_t exec = nullptr;
};

class CudaBackend : public Backend {
 public:
  // synthetic_seed != 0: linears and the embedding are made on the device (speed runs).
  static Result<std::unique_ptr<CudaBackend>> create(const ModelConfig& cfg, const CudaBackendOptions& opts,
                                                     uint64_t synthetic_seed, int64_t max_model_len);
  ~CudaBackend() override;

  // ---- Backend ----
  Status set_embedding(const Tensor& table) override;
  Status set_embedding_shard(const Tensor& table, int64_t first_id) override;
  void* queue() const override { return stream_; }
  Result<LinearRef> add_linear(const LinearWeight& w, LinearUse use) override;
  Result<MlpRef> add_mlp(const MlpWeights& m) override;
  Result<const float*> add_vector(const std::vector<float>& v) override;
  Result<MoeRef> add_moe(const std::vector<MlpWeights>& experts, const MlpWeights* shared) override;
  Result<AbsorbRef> add_absorb(const LinearWeight& wkv_b) override;
  Status reserve_selections(int n) override;
  Status enable_drafter() override;
  Status segment(const Fn& fn) override;
  Status host_sync(const Fn& fn) override;
  Status finish_forward() override;
  Status timed(const char* label, const Fn& fn) override;
  bool can_overlap(std::initializer_list<LinearRef> linears) const override;
  Status side(const Fn& fn, int lane = 0) override;
  Status wait_lane(int lane) override;
  Status join_side() override;
  const Activations& acts() const override { return acts_; }
  int64_t step_tokens() const override { return step_T_; }
  int64_t step_rows() const override { return step_R_; }
  bool rows_are_tokens() const override { return rows_are_tokens_; }
  Status embedding(float* out) override;
  Status rms_norm(const NormArgs& p) override;
  Status layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t dim, float eps,
                    float* y) override;
  Status linear(LinearRef w, const float* x, int64_t M, float* y) override;
  Status silu_mul(const float* g, const float* u, int64_t rows, int64_t cols, float* out) override;
  Status rope(const RopeArgs& p) override;
  Status q_path(const QPathArgs& p) override;
  Status latent_cache_write(CacheGroup group, int cache_slot, const float* c, const float* kr, int kr_stride) override;
  // Decode context parallelism's combines (ops/cuda/context_parallel.h). The rest of DCP on
  // CUDA ranks (candidates, sharded metadata, MlaArgs::heads) is not built: the runner refuses it.
  Status merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols,
                               float* out) override;
  Status rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows,
                                int64_t cols) override;
  Status indexer_key_write(int cache_slot, float* k) override;
  Status latent_key_path(float* ckv, int r, int dr, const float* w, float eps, const RopeArgs* rope, int cache_slot,
                         float* c) override;
  Status indexer_key_path(float* k, int64_t dim, const float* w, const float* b, float eps, const RopeArgs* rope,
                          int cache_slot) override;
  Status indexer_select(const IndexerSelectArgs& p) override;
  Result<std::vector<std::vector<int32_t>>> read_selection(int selection) override;
  Status set_selection(int selection, const std::vector<std::vector<int32_t>>& positions) override;
  Status mla_absorb_q(AbsorbRef a, const float* q, float* q_lat) override;
  Status mla_attention(const MlaArgs& p) override;
  Status mla_apply_uv(AbsorbRef a, const float* out_lat, float* o) override;
  Status moe_route(const MoeRouteArgs& p) override;
  Status norm_moe_router(const NormArgs& n, MoeRef moe, LinearRef gate, const float* bias, float* logits,
                         int32_t* ids, float* weights) override;
  Status moe_router(LinearRef gate, const float* x, const float* bias, float* logits, int32_t* ids,
                    float* weights) override;
  Status moe_experts(MoeRef moe, const float* x, const int32_t* ids, const float* weights, float* out) override;
  bool ffn_block_fused(const FfnBlockArgs& a) const override;
  Status ffn_block(const FfnBlockArgs& a) override;
  bool moe_experts_capturable(MoeRef moe) const override;
  Result<std::vector<int32_t>> read_ints(const int32_t* p, int64_t n) override;
  Status gather_logits_rows(const float* x, float* out) override;
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
  // The runner's draft parameters for this draft (host, slot-major, `count` rows), copied to
  // the device buffer the device draws read (a graph replay too); choose_tokens draws on the
  // device the rows whose `params` point into this array. null: none (host draws).
  Status stage_draft_params(const DeviceSamplingParams* params, int64_t count);
  Status hisparse_reserve(int layers, int64_t rows) override;
  Status hisparse_load_rows(int latent_slot, int hot_layer, const std::vector<HotLoad>& loads) override;
  Status set_hot_selection(const int32_t* rows, const int32_t* counts) override;

  // ---- the runner's side ----
  // The KV pools: one buffer per (group, layer slot) of blocks[group] pages; host_latent:
  // the latent group in pinned, device-mapped host memory (HiSparse's host pool).
  Status allocate_kv(const KvCacheSpec& spec, const std::vector<int64_t>& blocks, bool host_latent = false);
  int64_t hot_bytes() const { return hot_bytes_; }
  int64_t host_kv_bytes() const { return host_kv_bytes_; }
  // Step buffers for T tokens, R logits rows, S block-table rows of maxb entries.
  Status ensure_buffers(int64_t T, int64_t R, int64_t S, int64_t maxb);
  enum class Mode { kEager, kCapture, kReplay };
  // The next forward's launch shape (padded), graph mode and segments (kCapture: filled;
  // kReplay: launched), and its host metadata (traced steps only; else null). bucket_T: the
  // token count of the step's graph bucket whether or not it runs graphed (0: T); choices of
  // numerics that depend on the step's size read it, so a step computes the same way eagerly
  // and in a graph.
  // rows_are_tokens: the step's R logits rows are its T tokens in order (R == T, the padded
  // counts equal), so row t of the normed rows is token t's (Backend::rows_are_tokens).
  void begin_forward(int64_t T, int64_t R, int64_t maxlen, Mode mode, std::vector<GraphExec>* segments,
                     const StepMetadata* md, int64_t bucket_T = 0, bool rows_are_tokens = false);

  // Step buffers, grown to the largest step seen (fixed addresses between steps of a size).
  struct Buffers {
    int64_t T = 0, R = 0, bt_cap = 0, maxb = 0;
    int64_t bt_rows = 0;  // this step's block-table rows (bt_cap: the buffers' high-water mark)
    DeviceBuffer residual, a, tmp, q, qlat_in, ckv, c, q_lat, head_scale, out_lat, lse, o;
    DeviceBuffer router, router_counter, ids, wts, rows, normed, logits;
    DeviceBuffer logits_parts;  // tensor parallelism only
    DeviceBuffer tok, pos, slots, seq_of, lengths, block_table, row_idx, attn_ws, gemv_ws, gemv_ws_side[kSideLanes];
    size_t attn_ws_bytes = 0;
    // DSA: indexer q/k/weights, q in e4m3 + scales, key slots, scores for a chunk of tokens,
    // per-selection top-k slots and counts, traced positions.
    DeviceBuffer iq, ik, iw, iq8, iqs, idx_slots, idx_block_table, scores, topk_pos, topk_ws;
    std::vector<DeviceBuffer> topk_slots, topk_counts;
    DeviceBuffer forced_ids;
    DeviceBuffer samp_params, samp_tokens, samp_logprobs, samp_ws, samp_mask;  // device sampling, samp_cap rows
    int64_t samp_cap = 0;
    // DSpark: each token's drafter slot; a draft step's drafter block table and anchors, its
    // block-window slots [T, window_stride] and counts, the drafter's activations, and the
    // Markov head's sampling buffers.
    DeviceBuffer drafter_slots, drafter_block_table, draft_anchor_pos, window_slots, window_counts;
    int64_t window_cap = 0, window_stride = 0;
    DeviceBuffer draft_hidden, draft_ctx, markov_x, markov_e, markov_gi, markov_gh, markov_s, markov_logits,
        draft_ids, draft_probs, draft_samp_params, draft_samp_logprobs, draft_samp_ws;
    int64_t scores_cap = 0;
    size_t topk_ws_bytes = 0;
    LinearScratch lin;
    MoeScratch moe;
  };
  Buffers& buffers() { return *buf_; }
  cudaStream_t stream() const { return stream_; }
  uint64_t buffer_generation() const { return buffer_generation_; }
  int latent_group() const { return latent_group_; }
  int indexer_group() const { return indexer_group_; }
  const std::vector<int64_t>& group_blocks() const { return group_blocks_; }
  // The pages of a group's layer slot (null when out of range).
  const DeviceBuffer* kv_pool(int group, int layer_slot) const;

  int64_t weight_bytes() const { return weight_bytes_; }
  int64_t routed_expert_bytes() const { return routed_expert_bytes_; }
  // The token embedding table's bytes (in weight_bytes; a step reads one row a token of it).
  int64_t embedding_bytes() const { return static_cast<int64_t>(embed_.bytes()); }
  // experts_to_mxfp4: seconds spent re-quantizing, and the most device bytes held beyond the
  // result while doing it (one FP8 matrix at a time).
  double requant_seconds() const { return requant_seconds_; }
  int64_t requant_transient_bytes() const { return requant_transient_bytes_; }
  int64_t kv_bytes() const { return kv_bytes_; }
  int64_t overlapped_layers() const { return overlapped_layers_; }
  int64_t fused_ffn_norms() const { return fused_ffn_norms_; }  // norm_moe_router calls run fused
  int64_t shared_lane_runs() const { return shared_lane_runs_; }  // shared experts started on their lane
  void set_overlap_indexer(bool on) { opts_.overlap_indexer = on; }
  void set_absorb_gemm(bool on) { opts_.absorb_gemm = on; }
  void set_fused_router(bool on) { opts_.fused_router = on; }
  void set_fused_ffn_norm(bool on) { opts_.fused_ffn_norm = on; }
  void set_shared_expert_lane(bool on) { opts_.shared_expert_lane = on; }
  void set_fp4_x_parts(int parts) { opts_.fp4_x_parts = parts; }
  void set_moe_gemm_overlap(bool on) { opts_.moe_gemm_overlap = on; }
  void set_moe_gemm_tall(bool on) { opts_.moe_gemm_tall = on; }
  void set_moe_gemm_group_major(bool on) { opts_.moe_gemm_group_major = on; }
  void set_moe_gemm_specialized(bool on) { opts_.moe_gemm_specialized = on; }
  void set_moe_gemm_swap(bool on) { opts_.moe_gemm_swap = on; }
  void set_moe_gemm_swap_down(bool on) { opts_.moe_gemm_swap_down = on; }
  void set_moe_quant_epilogue(bool on) { opts_.moe_quant_epilogue = on; }
  void set_mla_prefill_pairs(bool on) { opts_.mla_prefill_pairs = on; }
  void set_mla_latent_bf16(bool on) { opts_.mla_latent_bf16 = on; }
  void set_fp8_row_out(bool on) { lt_->set_fp8_row_out(on); }  // LtGemm::set_fp8_row_out
  bool fp8_row_out() const { return lt_->fp8_row_out(); }
  bool mla_latent_bf16() const { return opts_.mla_latent_bf16; }
  // Attention calls that ran on bf16 latents (mla_latent_bf16) since creation (tests).
  int64_t latent_bf16_attentions() const { return latent_bf16_attentions_; }
  void set_indexer_wgmma(bool on) { opts_.indexer_wgmma = on; }
  void set_fused_indexer(bool on) { opts_.fused_indexer = on; }
  void set_grouped_moe_gemm(bool on) {  // the next step reserves (or drops) the path's buffers
    opts_.grouped_moe_gemm = on;
    if (buf_) buf_->T = 0;
  }
  void set_profile(std::map<std::string, double>* p) { profile_ = p; }
  // `--decode-backend latency_specialized` (issue 19): steps of 1..4 tokens run each layer's
  // FFN half as one resident kernel (ops/cuda/ffn_resident.h) whose waits write `fault` (the
  // runner's fault word). The first call that turns it on allocates the kernel's scratch and
  // grid-barrier state; after every layer is registered.
  Status set_resident_ffn(bool on, DeviceFault* fault);
  // Tests: the kernel's block that never arrives at its first barrier (-1: none), and the bound
  // of its waits.
  int64_t resident_ffn_launches() const { return resident_launches_; }
  // ML4_RESIDENT_TRACE=1 (set before set_resident_ffn): the last eager step's per-layer phase
  // timestamps, [layer][ffn_resident_max_blocks()][kTracePoints] (FfnResidentParams::trace).
  Result<std::vector<uint64_t>> resident_trace() const;
  void set_resident_fault_test(int never_arrive_block, uint64_t timeout_ns) {
    resident_never_arrive_ = never_arrive_block;
    opts_.resident_wait_timeout_ns = timeout_ns;
  }
  Status fill_kv_synthetic(uint64_t seed);
  bool drafter_enabled() const { return drafter_; }
  int drafter_group() const { return drafter_group_; }

 private:
  struct Moe {
    std::vector<DeviceMlp> experts;
    std::unique_ptr<DeviceMlp> shared;
    std::unique_ptr<MoeExpertTables> tables;
  };
  CudaBackend() = default;
  Status lin(const DeviceLinear& w, const float* x, int64_t M, float* y);
  Result<DeviceLinear> make_linear(const LinearWeight& w);
  QPathParams rope_params(const RopeArgs& r) const;
  RopeRows rope_rows(const RopeArgs& r) const;  // the same rotation for a fused kernel (rope_rows.h)
  const int32_t* selection_counts(int selection) const;
  bool moe_grouped(const Moe& m) const;
  bool shared_lane(MoeRef moe) const;  // norm_moe_router starts moe's shared expert on the low lane
  Status fork_low();                   // the low lane waits for what stream_ has issued
  Status join_low();                   // stream_ waits for the low lane, if it has work open
  bool router_fused(LinearRef gate) const;  // moe_router runs router_route (fused_router)
  bool router_kernel_takes(LinearRef gate, int64_t T) const;  // router_route takes this gate at T tokens
  RouterRouteParams router_params(LinearRef gate, const float* x, const float* bias, float* logits, int32_t* ids,
                                  float* weights) const;
  bool absorb_as_gemm() const;  // this step's absorption takes the batched GEMMs
  // W_UK's absorption now: the batched GEMMs' f32 or bf16 form (q_lat then holds bf16), or the
  // kernel.
  Status absorb_q_now(AbsorbRef a, const float* q, float* q_lat, bool bf16);
  // A W_UK absorption mla_absorb_q deferred (mla_latent_bf16), run in f32 form before anything
  // but mla_attention reads its q_lat.
  Status flush_absorb();
  bool moe_gemm(const Moe& m) const;
  // The resident kernel's operands for this step's block; false when it does not take them.
  bool resident_ffn_params(const FfnBlockArgs& a, FfnResidentParams* p) const;
  void point_activations();
  Status end_segment();

  ModelConfig cfg_;
  CudaBackendOptions opts_;
  KvCacheDtype kv_dtype_ = KvCacheDtype::kFp8DsMla;
  int latent_group_ = 0, indexer_group_ = -1, drafter_group_ = -1;
  bool drafter_ = false;
  std::vector<std::pair<DeviceBuffer, DType>> tables_;  // [table] device copy, its dtype
  std::vector<int64_t> table_rows_, table_cols_v_;
  int64_t max_model_len_ = 0;
  int64_t num_blocks_ = 0;  // latent group
  std::vector<std::vector<DeviceBuffer>> kv_;  // [group][layer slot] pages
  std::vector<int64_t> group_blocks_;
  // HiSparse: the hot pool [layer][hot_rows_ rows], the step's hot rows [T, topk] and
  // counts [T], the loads' (pool row, hot row) pairs.
  std::vector<DeviceBuffer> hot_;
  int hot_layers_ = 0;
  int64_t hot_rows_ = 0, hot_bytes_ = 0, host_kv_bytes_ = 0;
  Status allocate_hot_pool();
  DeviceBuffer hot_sel_rows_, hot_sel_counts_, hot_src_, hot_dst_;
  int num_selections_ = 0;
  std::vector<DeviceLinear> linears_;
  std::vector<bool> router_;  // [linear] f32 router: never the GEMV
  std::vector<Moe> moes_;
  std::vector<DeviceBuffer> vectors_;
  std::vector<std::pair<const float*, const float*>> absorbs_;  // (W_UK, W_UV) per add_absorb, in vectors_
  std::vector<std::pair<DeviceBuffer, DeviceBuffer>> absorbs16_;  // their bf16 copies (mla_latent_bf16)
  // mla_latent_bf16's state within a layer: the absorption mla_absorb_q deferred (q_lat == null:
  // none), and the out_lat buffer mla_attention left holding bf16 for mla_apply_uv (or null).
  struct PendingAbsorb {
    AbsorbRef a;
    const float* q = nullptr;
    float* q_lat = nullptr;
  };
  PendingAbsorb pending_absorb_;
  const float* lat_out_bf16_ = nullptr;
  int64_t latent_bf16_attentions_ = 0;
  DeviceBuffer embed_;
  DType embed_dtype_ = DType::kBF16;
  int64_t max_in_ = 0, max_hidden_ = 0;
  std::unique_ptr<LtGemm> lt_;
  int64_t embed_rows_ = 0;
  int64_t embed_first_ = -1;  // vocabulary-parallel: the first id the table holds (-1: whole)
  std::unique_ptr<Buffers> buf_;
  DeviceBuffer resident_hidden_, resident_barrier_, resident_counters_, resident_routing_;
  int64_t resident_hidden_floats_ = 0;
  DeviceFault* resident_fault_ = nullptr;
  bool resident_on_ = false;
  int64_t resident_launches_ = 0;
  DeviceBuffer resident_trace_;
  int64_t resident_trace_layer_ = 0;
  int resident_never_arrive_ = -1;
  Activations acts_;
  cudaStream_t stream_ = nullptr;
  // The indexer's branches: a stream per side lane (0: the queries, 1: the keys), the events
  // side() waits on (two, alternating), an event per lane for wait_lane() / join_side(), and
  // the lane stream_ currently is (-1: the main stream; lin() then uses that lane's GEMV
  // workspace).
  cudaStream_t side_streams_[kSideLanes] = {nullptr, nullptr};
  cudaEvent_t ev_side_[2] = {nullptr, nullptr}, ev_lane_[kSideLanes] = {nullptr, nullptr};
  int side_calls_ = 0;
  int on_lane_ = -1;
  bool lane_used_[kSideLanes] = {false, false};
  int64_t overlapped_layers_ = 0;
  int64_t fused_ffn_norms_ = 0;
  // The low lane: a stream at the least priority for work that only fills what the main chain
  // leaves (shared_expert_lane's shared experts); the events of its fork from stream_ [0] and of
  // its end [1]; whether it has work stream_ has not joined (join_low: the next fork, the MoE's
  // combine, or the segment's end); the MoE whose shared expert it runs (-1: none), for that
  // MoE's moe_experts.
  cudaStream_t low_stream_ = nullptr;
  cudaEvent_t ev_low_[2] = {nullptr, nullptr};
  bool low_open_ = false;
  int shared_pending_ = -1;
  int64_t shared_lane_runs_ = 0;
  int64_t weight_bytes_ = 0, kv_bytes_ = 0, routed_expert_bytes_ = 0;
  double requant_seconds_ = 0.0;
  int64_t requant_transient_bytes_ = 0;
  uint64_t synthetic_seed_ = 0;
  uint64_t synthetic_counter_ = 0;
  int routers_ = 0;  // routers registered (synthetic seeds follow the MoE layer index)
  // This step's launch shape (padded in graph mode) and host metadata (traced steps).
  int64_t step_T_ = 0, step_R_ = 0, step_maxlen_ = 1;
  bool rows_are_tokens_ = false;
  int64_t bucket_T_ = 0;  // begin_forward's bucket_T
  const DeviceSamplingParams* staged_params_ = nullptr;  // stage_draft_params
  int64_t staged_count_ = 0;
  const StepMetadata* md_ = nullptr;
  // Bumped whenever a step buffer is reallocated: captured graphs hold old addresses.
  uint64_t buffer_generation_ = 0;
  Mode mode_ = Mode::kEager;
  std::vector<GraphExec>* segments_ = nullptr;
  bool in_segment_ = false;
  size_t next_graph_ = 0;
  std::map<std::string, double>* profile_ = nullptr;
};

}  // namespace ml4::cuda
