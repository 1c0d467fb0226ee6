// Backend: the op interface the one ML4 forward (runtime/model_forward.h) is written against.
//
// The model program issues these ops in order, once per step, for every backend; a backend
// implements each with its own memory and kernels (runtime/cpu/cpu_backend.h: host vectors
// and the ops/cpu references; runtime/cuda/cuda_backend.h: device buffers and ops/cuda
// kernels on a stream). The split follows vLLM's model files over dispatched ops and
// llama.cpp's one graph builder per architecture run by any backend: per-layer differences
// live in the program (read from the LayerSpec), never in a backend.
//
// Conventions:
//   - Activations are f32, row-major, in backend memory: the pointers of Activations (valid
//     for the step; a device backend keeps them at fixed addresses so graphs can replay).
//     The program passes them around and never dereferences them.
//   - Weights are registered once at load (add_*) in the backend's own format and memory;
//     linears come back as handles (MLA's wkv_b too, as an AbsorbRef), f32 vectors (norm
//     weights, SSMax s, RoPE tables) as backend pointers.
//   - The step itself (token ids, positions, cache slots, block tables, logits rows) is the
//     backend's state, set by its runner before forward(): ops that need it read it there.
//     T below is step_tokens() (a device backend may pad it), R is step_rows().
//   - Sparse selections (the DSA indexer's top-k) live in `selection` buffers the backend
//     holds in its own representation (positions on the CPU, cache slots on the GPU); the
//     program refers to them by index and reads or forces them only on traced steps.
//   - What only a device needs is expressed so the CPU ignores it: segment() / host_sync()
//     (CUDA graph segments and the breaks between them), side() / join_side() (a second
//     stream), timed() (per-piece GPU time). The CPU's defaults run the work at once.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/linear_weight.h"
#include "model/model_config.h"

namespace ml4 {

struct MlpWeights;  // model/model_weights.h
struct DeviceSamplingParams;  // ops/cpu/sampling.h

// A linear weight the backend holds (index into its table).
struct LinearRef {
  int id = -1;
  bool valid() const { return id >= 0; }
};
// A SwiGLU MLP: w2(silu(w1 x) * w3 x).
struct MlpRef {
  LinearRef w1, w2, w3;
  int64_t hidden = 0;  // w1's output features
};
// A layer's routed experts and shared expert(s), held together (a device groups them).
struct MoeRef {
  int id = -1;
};
// Backend::ffn_block's operands: a MoE layer (gate valid: router, its bias, experts) or a dense
// one (dense: its MLP).
struct FfnBlockArgs {
  const float* attn_out = nullptr;  // [T, dim], may be out
  float* residual = nullptr;        // [T, dim]
  const float* norm_w = nullptr;    // [dim]
  float eps = 1e-6f;
  float* a = nullptr;               // [T, dim]: rms(residual) * norm_w (written)
  LinearRef gate;
  const float* router_bias = nullptr;
  MoeRef moe;
  MlpRef dense;
  float* logits = nullptr;   // [T, E]
  int32_t* ids = nullptr;    // [T, K]
  float* weights = nullptr;  // [T, K]
  float* out = nullptr;      // [T, dim]
};
// One layer's MLA up-projection wkv_b [H*(dn+dv), r], read as W_UK [H][dn][r] (head h's rows
// h*(dn+dv) + [0, dn)) and W_UV [H][dv][r] (the next dv rows) by the absorbed form.
struct AbsorbRef {
  int id = -1;
  bool valid() const { return id >= 0; }
};
// An embedding-like table [rows, cols] (bf16 or f32) the backend holds.
struct TableRef {
  int id = -1;
};

// Which paged cache a latent write or an attention read uses: the target's latent group, or
// the DSpark drafter's window group (bf16, MODEL.md section 5).
// kHot: HiSparse's hot pool (offload/hisparse.h), read through the rows set_hot_selection gave.
enum class CacheGroup { kLatent, kDrafter, kHot };

// MlaArgs::selection: -1 dense (every s <= p), >= 0 a selection buffer, kBlockWindow the keys
// select_block_window() chose, kHotSelection the hot rows of set_hot_selection().
constexpr int kDenseSelection = -1;
constexpr int kBlockWindow = -2;
constexpr int kHotSelection = -3;

// One row HiSparse copies from the host pool into a hot layer: the latent row of the step's
// sequence `seq` at `position`, into row `row` of the hot layer's pool.
struct HotLoad {
  int32_t seq = 0;
  int32_t position = 0;
  int32_t row = 0;
};

enum class LinearUse {
  kDefault,
  kRouter,  // the MoE gate: always f32 arithmetic on f32 weights (MODEL.md 3.7)
};

// The step's activation buffers; each at least as large as noted, T = step_tokens(),
// R = step_rows(). Buffers a model does not need (no DSA, no query LoRA) may be null.
struct Activations {
  float* residual = nullptr;    // [T, dim]
  float* a = nullptr;           // [T, dim] the normalized layer input
  float* tmp = nullptr;         // [T, dim] a sub-layer's output
  float* q = nullptr;           // [T, H, dn + dr]
  float* q_latent = nullptr;    // [T, q_lora_rank]
  float* ckv = nullptr;         // [T, r + dr]
  float* c = nullptr;           // [T, r]
  float* q_lat = nullptr;       // [T, H, r]
  float* head_scale = nullptr;  // [T, H]
  float* out_lat = nullptr;     // [T, H, r]
  float* lse = nullptr;         // [T, H]
  float* o = nullptr;           // [T, H, dv]
  float* router = nullptr;      // [T, E]
  int32_t* expert_ids = nullptr;  // [T, K]
  float* expert_wts = nullptr;    // [T, K]
  float* ffn_g = nullptr;       // [T, hidden] dense MLP scratch
  float* ffn_u = nullptr;       // [T, hidden]
  float* iq = nullptr;          // [T, HI, dI] indexer queries
  float* ik = nullptr;          // [T, dI] indexer keys
  float* iw = nullptr;          // [T, HI] indexer head weights
  float* rows = nullptr;        // [R, dim] the logits rows' hidden states
  float* normed = nullptr;      // [R, dim]
  float* logits = nullptr;      // [R, vocab]
  // Tensor parallelism (runtime/model_forward.h): the output head's vocabulary shards
  // gathered over the TP group, [tp][R][vocab / tp], before they are laid out into logits.
  // Needed only when the program runs with a TP group of more than one rank.
  float* logits_parts = nullptr;  // [R, vocab]
  // The DSpark drafter (after Backend::enable_drafter; n = sequences of a draft step):
  float* draft_hidden = nullptr;  // [T, n_targets * dim] the target's hidden states at its target layers
  float* draft_ctx = nullptr;     // [T, dim] rms(fc(...)): the drafter's context rows
  float* markov_x = nullptr;      // [n, dim + r] [slot output ; previous token's embedding]
  float* markov_e = nullptr;      // [n, r]
  float* markov_gi = nullptr;     // [n, 3 r]
  float* markov_gh = nullptr;     // [n, 3 r]
  float* markov_s = nullptr;      // [n, r] the GRU state
  float* markov_logits = nullptr; // [n, vocab] one slot's logits
  int32_t* draft_ids = nullptr;   // [(B - 1), n] the drafted tokens, slot-major
  float* draft_probs = nullptr;   // [(B - 1), n, vocab] their distributions (probabilistic drafts)
};

struct NormArgs {
  const float* x = nullptr;   // [rows, dim], rows x_stride apart (0: dim)
  float* residual = nullptr;  // [rows, dim] or null: when set, residual += x, then normalize residual
  const float* w = nullptr;   // [dim]
  int64_t rows = 0, dim = 0, x_stride = 0;
  float eps = 1e-6f;
  float* y = nullptr;         // [rows, dim] (may alias x, not residual)
};

// Rotation of `heads` vectors per step token, vector j of token t at x + (t * heads + j) *
// stride, elements [offset, offset + dim), at the token's LeRoPE-mapped position.
struct RopeArgs {
  float* x = nullptr;
  int heads = 0, stride = 0, offset = 0, dim = 0;
  const float* inv_freq = nullptr;  // [dim / 2], registered (cpu::rope_inv_freq)
  float attn_factor = 1.0f;         // cpu::rope_attention_factor
  bool neox = false;                // pairs (i, i + dim/2) (the DSA indexer); else (2i, 2i + 1) (MLA)
};

// The MLA query path: rotary on the rope part (when apply_rope), then per head the softmax
// temperature base_scale * llama_4(p) * (SSMax: s_h * ln n), n the keys the token attends:
// the selection's count, or p + 1 when dense (MODEL.md 3.2-3.4).
struct QPathArgs {
  RopeArgs rope;
  bool apply_rope = true;
  double base_scale = 1.0;
  Llama4Scaling llama4;
  const float* ssmax_s = nullptr;  // [H] or null
  int selection = -1;              // -1: dense
  float* head_scale = nullptr;     // [T, H] out
};

// The DSA indexer's query half (MODEL.md 3.5): q [T, HI, dI] rotated (not yet Hadamard'd),
// w [T, HI] head weights (unscaled); Hadamard + FP8 of q, scores sum_h w_h * weight_scale *
// relu(q_h . k_s) over the layer's indexer pages for s <= p, causal top-min(topk, p+1) into
// `selection` (ties to the lower position). record_positions keeps the positions for
// read_selection() (traced steps).
struct IndexerSelectArgs {
  int cache_slot = 0;  // LayerSpec::indexer_slot
  float* q = nullptr;
  float* w = nullptr;
  float weight_scale = 1.0f;  // HI^-0.5 * dI^-0.5
  int selection = 0;
  bool record_positions = false;
  // RoPE of the queries (NeoX, each head's first dims; q_rope->x == q), applied by the backend
  // before their Hadamard + FP8 (CUDA with fused_indexer: in the same kernel); null: q is
  // already rotated or the layer is NoPE.
  const RopeArgs* q_rope = nullptr;
  // The side lane (Backend::side) on which this layer's key half was issued, waited for after
  // the queries' quantization and before the scores read the pages (-1: issued in order).
  int keys_lane = -1;
  // Decode context parallelism: instead of a selection, this rank's candidates over its keys:
  // its local top-min(topk, local keys visible) as scores [T, topk] (f32) followed by their
  // global positions [T, topk] (i32), padded with (-inf, -1); merge_topk_candidates() makes the
  // global selection of every rank's.
  void* candidates = nullptr;
};

// Absorbed MLA over one latent cache slot (MODEL.md 3.6): per token and head,
// logits (q_lat . c_s + q_rope . kr_s) * head_scale over the selection's keys (or all
// s <= p), out_lat = softmax-weighted sum of c_s, lse natural-log.
struct MlaArgs {
  CacheGroup group = CacheGroup::kLatent;
  int cache_slot = 0;            // layer slot the keys are read from
  int selection = -1;            // -1: dense
  const float* q_lat = nullptr;  // [T, H, r]
  const float* q = nullptr;      // [T, H, dn + dr]: the rope part at offset dn
  const float* head_scale = nullptr;
  float* out_lat = nullptr;      // [T, H, r]
  float* lse = nullptr;          // [T, H]
  // H above: the config's n_heads when 0; decode context parallelism attends the DCP group's
  // heads (n_heads x the group's size) over this rank's share of the keys.
  int heads = 0;
};

struct MoeRouteArgs {
  const float* logits = nullptr;  // [T, E] router logits (f32)
  const float* bias = nullptr;    // [E] correction bias or null
  // Test input (ForwardTrace::forced_experts), host memory [T, K]: route to these experts,
  // weighted as the router weighs its own choice.
  const int32_t* forced_host = nullptr;
  int32_t* ids = nullptr;         // [T, K]
  float* weights = nullptr;       // [T, K]
};

class Backend {
 public:
  using Fn = std::function<Status()>;
  virtual ~Backend() = default;

  // ---- weights, registered once at load ----
  virtual Status set_embedding(const Tensor& table) = 0;  // [vocab, dim] bf16 or f32
  // Vocabulary-parallel embedding (tensor parallelism): table holds the rows of token ids
  // [first_id, first_id + rows); embedding() writes zeros for other ids (the program sums
  // the ranks' rows).
  virtual Status set_embedding_shard(const Tensor& table, int64_t first_id) {
    if (first_id == 0) return set_embedding(table);
    return unimplemented("this backend has no vocabulary-parallel embedding (tensor parallelism)");
  }
  virtual Result<LinearRef> add_linear(const LinearWeight& w, LinearUse use = LinearUse::kDefault) = 0;
  virtual Result<MlpRef> add_mlp(const MlpWeights& m) = 0;
  // v outlives every forward (it belongs to the weights passed at load, or to the program):
  // a host backend may use it in place.
  virtual Result<const float*> add_vector(const std::vector<float>& v) = 0;
  virtual Result<MoeRef> add_moe(const std::vector<MlpWeights>& experts, const MlpWeights* shared) = 0;
  // wkv_b in its stored format (it outlives every forward); the backend keeps what its
  // absorb kernels read (a host backend: the weight itself; a device: its own copy).
  virtual Result<AbsorbRef> add_absorb(const LinearWeight& wkv_b) = 0;
  // Selection buffers 0..n-1 (each [T, topk]).
  virtual Status reserve_selections(int n) = 0;
  // The drafter's buffers (Activations' draft_* and markov_*) are needed from now on.
  virtual Status enable_drafter() = 0;

  // ---- how work is issued; the CPU's defaults run it at once ----
  // Work that only launches device work (capturable into a graph segment).
  virtual Status segment(const Fn& fn) { return fn(); }
  // Work that reads device results back or uploads host data: it ends the segment and runs
  // eagerly between replayed segments (into buffers the next segment reads).
  virtual Status host_sync(const Fn& fn) { return fn(); }
  // Ends the step's last segment.
  virtual Status finish_forward() { return ok_status(); }
  virtual Status timed(const char* label, const Fn& fn) { return fn(); }
  // Side queues (lanes 0 and 1, in order each): side(fn, lane) issues fn on that lane, after
  // everything issued so far on the main queue; wait_lane(lane), called inside fn of another
  // lane, makes that queue wait for everything issued so far on `lane`; join_side() makes the
  // main queue wait for everything issued on both. Only worth it (and only allowed) when
  // can_overlap says the linears involved may run concurrently. No nesting.
  static constexpr int kSideLanes = 2;
  virtual bool can_overlap(std::initializer_list<LinearRef> linears) const { return false; }
  virtual Status side(const Fn& fn, int lane = 0) { return fn(); }
  virtual Status wait_lane(int lane) { return ok_status(); }
  virtual Status join_side() { return ok_status(); }

  // ---- the step ----
  virtual const Activations& acts() const = 0;
  virtual int64_t step_tokens() const = 0;
  virtual int64_t step_rows() const = 0;
  // True when the step's logits rows are its tokens in order (every token asks for logits:
  // decoding, DSpark's verification), so the final norm can write the rows itself.
  virtual bool rows_are_tokens() const { return false; }

  // ---- ops ----
  virtual Status embedding(float* out) = 0;  // out[t] = table[token t]
  virtual Status rms_norm(const NormArgs& p) = 0;
  virtual Status layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t dim, float eps,
                            float* y) = 0;
  virtual Status linear(LinearRef w, const float* x, int64_t M, float* y) = 0;  // y[M, N] = x[M, K] W^T
  virtual Status silu_mul(const float* g, const float* u, int64_t rows, int64_t cols, float* out) = 0;
  virtual Status rope(const RopeArgs& p) = 0;
  virtual Status q_path(const QPathArgs& p) = 0;
  // The step's latent rows (c [T, r], kr [T, dr] kr_stride apart) into a layer slot of a
  // group at the step's slots of that group (tokens without a slot are skipped).
  virtual Status latent_cache_write(CacheGroup group, int cache_slot, const float* c, const float* kr,
                                    int kr_stride) = 0;
  // The latent row's path into a layer slot of the latent group after wkv_a, ckv [T, r + dr] =
  // [c | kr]: c = RMSNorm(c) (w, eps) into `c`, kr rotated in place when `rope` (ckv's rope
  // part: x ckv, one head of r + dr, offset r), then latent_cache_write(kLatent, cache_slot, c,
  // ckv + r, r + dr). A backend may fuse the three (CUDA: CudaBackendOptions::fused_indexer).
  virtual Status latent_key_path(float* ckv, int r, int dr, const float* w, float eps, const RopeArgs* rope,
                                 int cache_slot, float* c) {
    ML4_RETURN_IF_ERROR(rms_norm({ckv, nullptr, w, step_tokens(), r, r + dr, eps, c}));
    if (rope != nullptr) ML4_RETURN_IF_ERROR(this->rope(*rope));
    return latent_cache_write(CacheGroup::kLatent, cache_slot, c, ckv + r, r + dr);
  }
  // The step's indexer keys k [T, dI] (rotated): Hadamard + FP8 into an indexer layer slot
  // (k may be overwritten).
  virtual Status indexer_key_write(int cache_slot, float* k) = 0;
  // The indexer's key half after its projection k [T, dim]: LayerNorm (w, b, eps), RoPE when
  // `rope` (NeoX, on k), then indexer_key_write. A backend may fuse the three (CUDA:
  // CudaBackendOptions::fused_indexer); k's contents afterwards are unspecified.
  virtual Status indexer_key_path(float* k, int64_t dim, const float* w, const float* b, float eps,
                                  const RopeArgs* rope, int cache_slot) {
    ML4_RETURN_IF_ERROR(layer_norm(k, w, b, step_tokens(), dim, eps, k));
    if (rope != nullptr) ML4_RETURN_IF_ERROR(this->rope(*rope));
    return indexer_key_write(cache_slot, k);
  }
  // Prefill context parallelism (runtime/pcp_split.h): the same two writes for rows of the
  // whole step (every PCP rank's tokens, gathered, in the runner's write metadata order), where
  // the step itself holds only this rank's share.
  virtual Status latent_cache_write_gathered(CacheGroup group, int cache_slot, const float* c, int c_stride,
                                             const float* kr, int kr_stride) {
    return unimplemented("this backend has no latent_cache_write_gathered (prefill context parallelism)");
  }
  virtual Status indexer_key_write_gathered(int cache_slot, float* k) {
    return unimplemented("this backend has no indexer_key_write_gathered (prefill context parallelism)");
  }
  virtual Status indexer_select(const IndexerSelectArgs& p) = 0;
  // Traced steps: a selection as key positions per step token (sorted ascending), and
  // forcing one (rows validated by the caller).
  virtual Result<std::vector<std::vector<int32_t>>> read_selection(int selection) = 0;
  virtual Status set_selection(int selection, const std::vector<std::vector<int32_t>>& positions) = 0;
  // q_lat[t, h] = W_UK[h]^T q_nope[t, h]; o[t, h] = W_UV[h] out_lat[t, h] (AbsorbRef above).
  virtual Status mla_absorb_q(AbsorbRef a, const float* q, float* q_lat) = 0;
  virtual Status mla_attention(const MlaArgs& p) = 0;
  virtual Status mla_apply_uv(AbsorbRef a, const float* out_lat, float* o) = 0;
  virtual Status moe_route(const MoeRouteArgs& p) = 0;
  // The router's f32 logits (gate over x, step_tokens() rows, into logits) and their routing
  // into ids / weights [T, K]. The default is linear + moe_route; a backend may fuse the two
  // (the CUDA decode router, CudaRunnerOptions::fused_router).
  virtual Status moe_router(LinearRef gate, const float* x, const float* bias, float* logits, int32_t* ids,
                            float* weights) {
    if (Status st = linear(gate, x, step_tokens(), logits); !st.ok()) return st.with_context("router");
    return moe_route({logits, bias, nullptr, ids, weights});
  }
  // The FFN norm (n: residual += n.x, n.y = rms(residual) * n.w) and then moe_router over n.y.
  // A backend may run both in one launch (the CUDA decode router, CudaRunnerOptions::
  // fused_ffn_norm) with the same results. moe: the layer's experts when moe_experts(moe, n.y)
  // follows in the same segment (else {}): a backend may start the shared expert as soon as
  // the norm is done, beside the router, and moe_experts then waits for it (the CUDA decode
  // path, CudaRunnerOptions::shared_expert_lane), with the same results.
  virtual Status norm_moe_router(const NormArgs& n, MoeRef moe, LinearRef gate, const float* bias, float* logits,
                                 int32_t* ids, float* weights) {
    if (Status st = rms_norm(n); !st.ok()) return st;
    return moe_router(gate, n.y, bias, logits, ids, weights);
  }
  // out[T, dim] = sum_k w[t, k] expert_{ids[t, k]}(x[t]) + shared(x[t]).
  virtual Status moe_experts(MoeRef moe, const float* x, const int32_t* ids, const float* weights, float* out) = 0;
  // False when moe_experts must read device results back (then the program issues it
  // through host_sync).
  virtual bool moe_experts_capturable(MoeRef moe) const { return true; }
  // The FFN half of a layer as one launch (issue 19, `--decode-backend latency_specialized`):
  // residual += attn_out, then out = ffn(rms(residual) * norm_w), the FFN a MoE layer's router
  // (its logits, ids and weights written as moe_router writes them) and experts, or a dense
  // layer's MLP. A backend that can run this step's block so says (the CUDA resident kernel:
  // ops/cuda/ffn_resident.h, steps of 1..4 tokens); the program runs the ops one by one
  // otherwise. The same results as rms_norm + moe_router + moe_experts (or the MLP's linears).
  virtual bool ffn_block_fused(const FfnBlockArgs& a) const { return false; }
  virtual Status ffn_block(const FfnBlockArgs& a) { return unimplemented("ffn_block: not fused on this backend"); }
  virtual Result<std::vector<int32_t>> read_ints(const int32_t* p, int64_t n) = 0;
  // out[i] = x[logits row i] for the step's R logits rows (rows of dim).
  virtual Status gather_logits_rows(const float* x, float* out) = 0;

  // ---- parallelism (parallel/communicator.h; runtime/model_forward.h) ----
  // The queue the ops run on, for a device communicator to issue its collectives on
  // (cudaStream_t on CUDA); null where ops complete on return (the CPU).
  virtual void* queue() const { return nullptr; }
  // Backend memory of at least `bytes`, one buffer per slot, at a fixed address until a
  // larger request for that slot (expert-parallel dispatch buffers).
  virtual Result<void*> scratch(int slot, int64_t bytes) {
    return unimplemented("this backend has no scratch buffers (expert parallelism)");
  }
  // bytes from host memory into backend memory.
  virtual Status upload(void* dst, const void* src_host, int64_t bytes) {
    return unimplemented("this backend has no upload (expert parallelism)");
  }
  // dst[i, :] = src[idx[i], :] and dst[idx[i], :] += src[i, :] for rows of `cols` floats,
  // idx [n] in backend memory (the scatter's idx has no repeats).
  virtual Status gather_rows_at(const float* src, const int32_t* idx, int64_t n, int64_t cols, float* dst) {
    return unimplemented("this backend has no gather_rows (expert parallelism)");
  }
  virtual Status scatter_add_rows_at(const float* src, const int32_t* idx, int64_t n, int64_t cols, float* dst) {
    return unimplemented("this backend has no scatter_add_rows (expert parallelism)");
  }
  // Routed experts over n given rows (tokens another rank dispatched here), K slots each:
  // out[i] = sum_k w[i, k] expert_{ids[i, k]}(x[i]); ids index the experts `moe` was
  // registered with, ids < 0 are skipped; the shared expert is not applied.
  virtual Status moe_experts_rows(MoeRef moe, const float* x, int64_t n, const int32_t* ids, const float* weights,
                                  float* out) {
    return unimplemented("this backend has no moe_experts_rows (expert parallelism)");
  }

  // ---- decode context parallelism (SYSTEM.md S8; runtime/model_forward.h) ----
  // The DCP ranks' indexer candidates (IndexerSelectArgs::candidates), gathered: n of them one
  // after the other. Makes the exact causal top-min(topk, p + 1) of them by score, ties to the
  // lower position (NaN last), which is the selection of one rank holding every key:
  // `selection` gets its global positions (SSMax's counts, traces), `local_selection` this
  // rank's cache indices of those it holds (none: an empty row, which attention gives
  // out 0, lse -inf).
  virtual Status merge_topk_candidates(const void* candidates, int n, int selection, int local_selection) {
    return unimplemented("this backend has no merge_topk_candidates (decode context parallelism)");
  }
  // Attention partials over disjoint key sets, lse in natural log (the base of MlaArgs::lse,
  // one base everywhere): part p's out [rows, cols] at parts + p * part_stride and its lse
  // [rows] right after it. out = sum_p exp(lse_p - L) out_p (in part order), L = log sum_p
  // exp(lse_p); an empty part (lse -inf) weighs 0, all empty gives 0.
  virtual Status merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols,
                                       float* out) {
    return unimplemented("this backend has no merge_attention_parts (decode context parallelism)");
  }
  // The all-gather + reduce-scatter combine's half: out [rows, cols] *= exp(lse - L) per row,
  // L = log sum_p exp(lse_all[p][row]) over the n parts' lse [n][rows] (out 0 where lse -inf).
  virtual Status rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows,
                                        int64_t cols) {
    return unimplemented("this backend has no rescale_attention_part (decode context parallelism)");
  }

  // ---- HiSparse (SYSTEM.md S12; offload/hisparse.h) ----
  // The hot pool: `layers` hot layers of `rows` latent rows each (the latent group's token
  // format), in backend memory; mla_attention reads it as CacheGroup::kHot, cache_slot the
  // hot layer, selection kHotSelection.
  virtual Status hisparse_reserve(int layers, int64_t rows) {
    return unimplemented("this backend has no HiSparse hot pool");
  }
  // Copies the rows `loads` names from the latent group's layer slot `latent_slot` (the host
  // pool) into hot layer `hot_layer`, in the queue's order (after the step's cache writes).
  virtual Status hisparse_load_rows(int latent_slot, int hot_layer, const std::vector<HotLoad>& loads) {
    return unimplemented("this backend has no HiSparse hot pool");
  }
  // The rows attention reads for each step token: rows [T, topk] (hot-pool rows, in the
  // selection's order, -1 past counts[t]) and counts [T], host memory read by the call.
  virtual Status set_hot_selection(const int32_t* rows, const int32_t* counts) {
    return unimplemented("this backend has no HiSparse hot pool");
  }

  // ---- the DSpark drafter's ops (MODEL.md section 5) ----
  virtual Result<TableRef> add_table(const Tensor& t) = 0;
  // out[i] = table[ids[i]] as f32 (ids in backend memory), n rows.
  virtual Status gather_table_rows(TableRef t, const int32_t* ids, int64_t n, float* out) = 0;
  // dst[i, :cols] = src[i, :cols], rows src_stride / dst_stride floats apart.
  virtual Status copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                           int64_t cols) = 0;
  // y[i, :cols] += x[i, :cols], rows y_stride / x_stride floats apart.
  virtual Status add_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t rows, int64_t cols) = 0;
  virtual Status fill(float* x, int64_t n, float value) = 0;
  // The draft block's input rows: out[t] = the token embedding of the step's token t when t is
  // its sequence's first token (slot 0, the last accepted token), else mask[slot - 1]
  // (mask [B - 1, dim], slots counted from the sequence's first token).
  virtual Status block_embed(const float* mask, float* out) = 0;
  // Each token of a step sequence attends, without a causal mask, the keys of `group` at
  // positions [max(0, start_pos - window), start_pos + num_tokens) of its sequence: the
  // selection kBlockWindow.
  virtual Status select_block_window(CacheGroup group, int64_t window) = 0;
  // A GRU cell's update (torch.nn.GRUCell, gates r, z, n) from gi = W_ih x and gh = W_hh s
  // (without biases) [rows, 3 r]: r = sig(gi_r + b_ih_r + gh_r + b_hh_r), z likewise,
  // n = tanh(gi_n + b_ih_n + r (gh_n + b_hh_n)), s = (1 - z) n + z s; s [rows, r] in place.
  virtual Status gru_update(const float* gi, const float* gh, const float* b_ih, const float* b_hh, int64_t rows,
                            int64_t r, float* s) = 0;
  // One token per row of logits [rows, V]: the argmax (ties to the lower id) when params is
  // null, else a draw with params[row] (ops/cpu/sampling.h semantics). ids [rows] in backend
  // memory; probs [rows, V] when non-null: the distribution each row was drawn from
  // (sampling::row_distribution: the filters at the draw's temperature), or, for greedy
  // (params null), softmax(logits): the drafter's own distribution (diagnostics and tests; a
  // greedy draft is verified as one-hot). base [rows, V], rows base_stride floats apart, or
  // null: the rows chosen from are logits + base (the f32 sums add_rows forms), which a
  // backend may write into logits or, fusing the add into the choice, never store.
  virtual Status choose_tokens(float* logits, int64_t rows, const DeviceSamplingParams* params, int32_t* ids,
                               float* probs, const float* base, int64_t base_stride) = 0;
};

}  // namespace ml4
