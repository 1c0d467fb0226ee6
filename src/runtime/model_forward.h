// ModelForward: the ML4 forward of MODEL.md section 3, written once against the LayerSpec
// and run by every backend (ops/backend.h): embedding; per layer RMSNorm, the q path, the
// latent row and its cache write, the DSA indexer with reuse, absorbed MLA over the selected
// or all rows, the fused residual + RMSNorm, the dense or MoE FFN; the final norm and the
// logits rows. Per-layer differences are fields of the spec (RoPE or NoPE, SSMax, KV owner
// or consumer, indexer owner / reuser / none, dense or MoE), never model names.
//
// The program also records the forward's decisions (top-k sets, routed experts) into a
// ForwardTrace and obeys forced ones (forward_trace.h), for every backend alike.
//
// How to add a per-layer feature: a field in LayerSpec (model/model_config.h), its weights
// in ModelWeights and register() below, its steps in the layer program (model_forward.cpp),
// and, only if it needs an operation no backend has, one op in ops/backend.h with its CPU
// reference (runtime/cpu/cpu_backend.cpp) and its CUDA kernel (runtime/cuda/cuda_backend.cpp).
#pragma once

#include <memory>
#include <vector>

#include "core/status.h"
#include "model/model_config.h"
#include "model/model_weights.h"
#include "offload/hisparse.h"
#include "ops/backend.h"
#include "parallel/communicator.h"
#include "parallel/parallel_plan.h"
#include "runtime/forward_trace.h"
#include "runtime/step_metadata.h"

namespace ml4 {

class ModelForward {
 public:
  struct Options {
    // The baseline without KV sharing's memory saving: each consumer layer gets latent layer
    // slot num_latent_layers + k (k-th consumer) holding its own copy of its source's rows
    // (written when the source writes) and reads that copy. The cache must have those slots.
    bool duplicate_shared_kv = false;
    // DSpark (MODEL.md section 5): register the drafter (the weights must carry it) and write
    // the drafter's context K/V for every token each forward processes.
    bool drafter = false;
    // A rank of a parallel group (SYSTEM.md S10; parallel/parallel_plan.h): the weights are
    // the rank's shard and the config its local_config(); the program adds the collectives
    // over `comms` (TP all-reduces after wo, the dense FFN, the MoE and the vocabulary-parallel
    // embedding; the logits' all-gather; expert-parallel dispatch and combine). Null: no such
    // group (a group of one rank given here still runs the collective path). comms.dcp:
    // decode context parallelism, the latent and indexer caches sharded by token
    // (kv/context_shard.h) and attention combined over the group. comms.pcp: prefill context
    // parallelism, the step holding this rank's share of the tokens (runtime/pcp_split.h).
    const ParallelPlan* plan = nullptr;
    ParallelComms comms;
    // HiSparse (SYSTEM.md S12; offload/hisparse.h): the hot buffers' state, owned by the
    // runner; its layers are the spec's sparse layers in order (hot_layer()). The backend's
    // latent group is the host pool. Null: no offload.
    HiSparseState* hisparse = nullptr;
  };

  // Registers every weight the spec names with the backend (and the RoPE tables).
  static Result<std::unique_ptr<ModelForward>> create(const ModelConfig& cfg, const ModelWeights& w, Backend& be,
                                                      const Options& opts);

  // One step over the backend's current step state. md: the host view of the step, needed
  // only when trace forces selections (null otherwise). trace: record / force decisions.
  Status forward(const StepMetadata* md, ForwardTrace* trace);

  // One DSpark draft step over the backend's current step, which the runner laid out as one
  // block of block_size tokens per sequence (token 0 the last accepted token at its position,
  // the rest placeholders at the next positions; logits rows: slots 1..B-1; Activations::
  // draft_ids row 0 holding each sequence's accepted token). Fills draft_ids rows 1..B-1 with
  // the drafts, slot-major, and draft_probs with their distributions when want_probs.
  // params: null for greedy drafts, else [(B - 1) x n] sampling parameters, slot-major.
  // slots: the Markov head runs slots 1..slots only (the most drafts any sequence asked for,
  // <= B - 1; slot j depends on slots < j alone, so the drafts it makes are the first of a
  // full block's); rows of later slots are left as they were.
  Status draft(const DeviceSamplingParams* params, bool want_probs, int slots);

  const ModelConfig& config() const { return cfg_; }
  bool has_drafter() const { return drafter_ != nullptr; }

 private:
  struct LayerRefs {
    const float *attn_norm = nullptr, *ffn_norm = nullptr, *q_a_norm = nullptr, *kv_a_norm = nullptr;
    const float* ssmax_s = nullptr;
    AbsorbRef absorb;
    const float *idx_knorm_w = nullptr, *idx_knorm_b = nullptr, *router_bias = nullptr;
    LinearRef wq, wq_a, wq_b, wkv_a, wo, idx_wq, idx_wk, idx_wproj, gate;
    MlpRef dense;
    MoeRef moe;
    MlpRef shared;  // expert parallelism: the shared expert apart from the routed ones
    bool has_shared = false;
  };

  struct DraftLayerRefs {
    const float *attn_norm = nullptr, *ffn_norm = nullptr, *q_a_norm = nullptr, *kv_a_norm = nullptr;
    AbsorbRef absorb;
    LinearRef wq, wq_a, wq_b, wkv_a, wo;
    MlpRef ffn;
  };
  struct DrafterRefs {
    LinearRef fc;
    const float *fc_norm = nullptr, *mask = nullptr, *norm = nullptr;
    std::vector<DraftLayerRefs> layers;
    TableRef markov_embed;
    LinearRef markov_ih, markov_hh, markov_out;
    const float *markov_b_ih = nullptr, *markov_b_hh = nullptr;
    std::vector<int> target_slot;  // [target layer] its column block in draft_hidden, or -1
  };

  ModelForward(const ModelConfig& cfg, Backend& be) : cfg_(cfg), be_(be) {}
  Status register_weights(const ModelWeights& w);
  Status register_drafter(const DrafterWeights& w);
  Status capture_hidden(int l);
  Status drafter_context();
  Status draft_attention(int j);
  Status attention(int l, const StepMetadata* md, ForwardTrace* trace, float* out);
  Status indexer_keys(int l);
  Status indexer_select(int l, ForwardTrace* trace, int keys_lane = -1);  // keys_lane: IndexerSelectArgs
  Status select_keys(int l, const StepMetadata* md, ForwardTrace* trace, bool forked, int* selection);
  // HiSparse: the layer's selection diffed against its hot buffers, the missing rows loaded,
  // and the remapped rows set; *hot false when a sequence's rows overflow its hot buffer (the
  // layer then reads the host pool directly).
  Status hisparse_rows(int l, const StepMetadata& md, const ForwardTrace* trace, int selection, bool* hot);
  Status mlp(const MlpRef& m, const float* x, int64_t M, float* y);
  Status moe(int l, ForwardTrace* trace, const NormArgs& norm, float* out);
  // Parallelism: a sum over the TP group (no-op on one rank), the expert-parallel MoE, and
  // the logits from the ranks' vocabulary shards.
  // A group given (even of one rank: the single-GPU check of the NCCL path) runs its path.
  bool tensor_parallel() const { return comms_.tp != nullptr; }
  bool context_parallel() const { return comms_.dcp != nullptr; }
  Status context_parallel_attention(MlaArgs ma);
  bool prefill_context_parallel() const { return comms_.pcp != nullptr; }
  Result<float*> pcp_gather_rows(const float* rows, int64_t width);
  // Backend::scratch slots of the DCP and PCP paths (0 .. 9 are expert parallelism's).
  enum : int {
    kDcpCandidates = 10, kDcpAllCandidates, kDcpSend, kDcpRecv, kDcpQueries, kDcpOut,
    kPcpIndex, kPcpSend, kPcpRecv, kPcpAll
  };
  bool expert_parallel() const { return comms_.ep != nullptr; }
  Status tp_all_reduce(float* x, int64_t n);
  Status moe_expert_parallel(int l, float* out);
  Status logits();
  RopeArgs rope_args(float* x, int heads, int stride, int offset, int dim, const float* inv_freq) const;

  ModelConfig cfg_;
  Backend& be_;
  std::vector<LayerRefs> layers_;
  LinearRef output_;
  const float* final_norm_ = nullptr;
  std::vector<float> rope_tables_[2];        // host copies of the two tables below
  const float* inv_freq_ = nullptr;          // MLA rope [dr / 2]
  const float* indexer_inv_freq_ = nullptr;  // indexer rope [indexer rope dims / 2]
  float rope_factor_ = 1.0f;
  std::vector<int> latent_read_slot_;                 // [layer] the latent slot attention reads
  std::vector<std::vector<int>> latent_write_slots_;  // [layer] the slots its rows are written to
  // Top-k buffers: an indexer owner whose sets a reuser reads keeps its own; the other owners
  // share buffer 0. The last buffer holds forced selections (traced steps).
  std::vector<int> selection_of_owner_;
  int forced_selection_ = -1;
  int local_selection_offset_ = 0;  // DCP: selection s's local twin is s + this
  // PCP, per step: rows per rank in the K/V all-gather, tokens of the whole step, the gather
  // index (backend memory).
  int64_t pcp_rows_ = 0, pcp_step_tokens_ = 0;
  const int32_t* pcp_index_ = nullptr;
  std::unique_ptr<DrafterRefs> drafter_;
  // HiSparse: state, hot layer of each model layer (-1: dense), the host copy of each
  // selection buffer's positions (read after its owner's indexer, used by its reusers).
  HiSparseState* hisparse_ = nullptr;
  std::vector<int> hot_layer_;
  std::vector<std::vector<std::vector<int32_t>>> hisparse_positions_;
  const ParallelPlan* plan_ = nullptr;
  ParallelComms comms_;
};

}  // namespace ml4
