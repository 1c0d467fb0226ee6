// ModelWeights: every tensor of a checkpoint bound to its place in the model.
//
// Linears stay in their stored format (views into the mapped safetensors; CPU kernels
// decode on the fly). Small vectors (norms, biases, SSMax scales, router gates) are
// converted to f32 once. The MLA up-projection `wkv_b` stays as stored too; the absorbed form
// (MODEL.md 3.6) reads it as W_UK [H][dn][r] and W_UV [H][dv][r] (split_wkv_b below for a
// device that wants them apart).
//
// Loading checks the checkpoint against expected_tensors() (weight_names.h): a missing
// tensor, an unknown tensor, or a wrong dtype or shape is an error naming the tensor.
// The Mistral-native and HF layouts load into the same struct.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/checkpoint.h"
#include "model/linear_weight.h"
#include "model/model_config.h"
#include "model/weight_shard.h"

namespace ml4 {

struct IndexerWeights {
  LinearWeight wq;            // [HI*dI, q_lora_rank or dim]
  LinearWeight wk;            // [dI, dim]
  std::vector<float> k_norm_weight, k_norm_bias;  // [dI]
  LinearWeight weights_proj;  // [HI, dim]
};

struct AttentionWeights {
  LinearWeight wq;                 // [H*(dn+dr), dim] (no query LoRA)
  LinearWeight wq_a, wq_b;         // query LoRA: [q_lora, dim], [H*(dn+dr), q_lora]
  std::vector<float> q_a_norm;     // [q_lora]
  LinearWeight wkv_a;              // [r+dr, dim]; KV owners only
  std::vector<float> kv_a_norm;    // [r]; KV owners only
  LinearWeight wkv_b;              // [H*(dn+dv), r]: W_UK / W_UV (split_wkv_b)
  LinearWeight wo;                 // [dim, H*dv]
  std::vector<float> ssmax_s;      // [H]; SSMax layers only
  std::unique_ptr<IndexerWeights> indexer;  // indexer owners only
};

struct MlpWeights {
  LinearWeight w1, w2, w3;  // gate [I, dim], down [dim, I], up [I, dim]
};

struct FfnWeights {
  MlpWeights dense;                  // dense layers
  LinearWeight gate;                 // [E, dim] router (bf16/f32 stored, run in f32)
  std::vector<float> correction_bias;  // [E] or empty
  std::vector<MlpWeights> experts;   // [E]
  std::unique_ptr<MlpWeights> shared;  // all shared experts as one MLP (hidden n_shared*I)
};

struct LayerWeights {
  std::vector<float> attention_norm, ffn_norm;  // [dim]
  AttentionWeights attn;
  FfnWeights ffn;
};

// The DSpark block drafter (MODEL.md section 5; tensors `mtp_dspark.*`, docs/MODEL-FORMAT.md).
struct DrafterLayerWeights {
  std::vector<float> attention_norm, ffn_norm;  // [dim]
  AttentionWeights attn;                        // wq (or the query LoRA), wkv_a, wkv_b (W_UK / W_UV), wo
  MlpWeights ffn;                               // dense SwiGLU of hidden_dim
};
struct DrafterWeights {
  LinearWeight fc;                   // [dim, n_targets * dim]
  std::vector<float> fc_norm;        // [dim]
  std::vector<float> mask_embed;     // [block_size - 1, dim]: slots 1..B-1
  std::vector<DrafterLayerWeights> layers;
  std::vector<float> norm;           // [dim]
  Tensor markov_embed;               // [vocab, rnn_rank] bf16/f32: the previous draft token's embedding
  LinearWeight markov_ih;            // [3 r, dim + r] GRU input weights (gates r, z, n: torch.nn.GRUCell)
  LinearWeight markov_hh;            // [3 r, r]
  std::vector<float> markov_bias_ih, markov_bias_hh;  // [3 r]
  LinearWeight markov_out;           // [vocab, r]: the logit bias
};

struct ModelWeights {
  Tensor tok_embeddings;  // [vocab, dim] bf16 or f32
  std::vector<float> norm;  // [dim]
  LinearWeight output;      // [vocab, dim] (a view of tok_embeddings when tied)
  std::vector<LayerWeights> layers;
  std::unique_ptr<DrafterWeights> drafter;  // WeightLoadOptions::load_drafter on a model with `mtp`
  // Views into the checkpoint: per-tensor views keep their file mapped; the per-expert
  // slices of HF fused expert tensors do not, so the Checkpoint must outlive these weights
  // (CpuRunner holds both).
};

struct WeightCopyReport;  // model/weight_memory.h

struct WeightLoadOptions {
  // Re-quantize FP8 routed experts to MXFP4 while loading (SYSTEM.md S1), layer by layer,
  // so at most one layer's experts exist in both formats at once.
  bool experts_to_mxfp4 = false;
  // Load the DSpark drafter's tensors (speculative decoding); otherwise they are ignored.
  bool load_drafter = false;
  // A rank of a parallel group (weight_shard.h): bind only its slices; the result has the
  // rank's local shapes (heads, hidden sizes, vocabulary rows, its routed experts only, in
  // order from shard->expert_begin). Null: the whole model.
  const WeightShard* shard = nullptr;
  // Copy every linear into anonymous huge-page memory at the end (model/weight_memory.h,
  // `--no-mmap`); the report, when asked for, says how much and how long.
  bool copy_linears = false;
  WeightCopyReport* copy_report = nullptr;
};

Result<std::shared_ptr<const ModelWeights>> load_model_weights(const ModelConfig& cfg, const Checkpoint& ckpt,
                                                               const WeightLoadOptions& opts = {});

// W_UK [H][dn][r] and W_UV [H][dv][r] of wkv_b [H*(dn+dv), r] (H: its rows / (dn + dv)), each
// element the value dequantize_linear gives it: what a device's absorb kernels read. Empty
// when wkv_b is invalid or not a whole number of heads.
// wkv_b's shape against the (rank's) config: [n_heads * (dn + dv), kv_lora_rank], or an error
// naming both (what Backend::add_absorb checks on every backend).
Status check_wkv_b_shape(const ModelConfig& cfg, const LinearWeight& wkv_b);

struct WkvbSplit {
  std::vector<float> w_uk, w_uv;
};
WkvbSplit split_wkv_b(const LinearWeight& wkv_b, int dn, int dv);

}  // namespace ml4
