// ModelWeights: every tensor of a checkpoint bound to its place in the model.
//
// Linears stay in their stored format (views into the mapped safetensors; CPU kernels
// decode on the fly). Small vectors (norms, biases, SSMax scales, router gates) are
// converted to f32 once. The MLA up-projection `wkv_b` is also kept decoded and split per
// head into W_UK [H][dn][r] and W_UV [H][dv][r] for the absorbed form (MODEL.md 3.6).
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
  LinearWeight wkv_b;              // [H*(dn+dv), r]
  LinearWeight wo;                 // [dim, H*dv]
  std::vector<float> w_uk;         // [H][dn][r], decoded from wkv_b
  std::vector<float> w_uv;         // [H][dv][r], decoded from wkv_b
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

struct ModelWeights {
  Tensor tok_embeddings;  // [vocab, dim] bf16 or f32
  std::vector<float> norm;  // [dim]
  LinearWeight output;      // [vocab, dim] (a view of tok_embeddings when tied)
  std::vector<LayerWeights> layers;
  // Views into the checkpoint: per-tensor views keep their file mapped; the per-expert
  // slices of HF fused expert tensors do not, so the Checkpoint must outlive these weights
  // (CpuRunner holds both).
};

struct WeightLoadOptions {
  // Re-quantize FP8 routed experts to MXFP4 while loading (SYSTEM.md S1), layer by layer,
  // so at most one layer's experts exist in both formats at once.
  bool experts_to_mxfp4 = false;
};

Result<std::shared_ptr<const ModelWeights>> load_model_weights(const ModelConfig& cfg, const Checkpoint& ckpt,
                                                               const WeightLoadOptions& opts = {});

}  // namespace ml4
