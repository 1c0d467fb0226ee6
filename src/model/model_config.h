// ModelConfig and LayerSpec: the model as data.
//
// Loading resolves params.json (Mistral native + the ML4 blocks) or an HF config.json
// (mistral4, deepseek_v3, deepseek_v32) once into this struct (MODEL.md section 2).
// Everything downstream (weights, cache groups, kernels, schedulers) reads LayerSpec;
// no shared code branches on a model name. A new per-layer variant is a new field here.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ml4 {

// YaRN (https://arxiv.org/abs/2309.00071) as DeepSeek-V3 / Mistral 4 apply it.
// params.json: yarn{factor, original_max_position_embeddings, beta (=beta_fast),
// alpha (=beta_slow), apply_scale}; HF: rope_scaling/rope_parameters{type: yarn, factor,
// original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}.
struct YarnConfig {
  bool enabled = false;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // Attention-scale terms (DeepSeek yarn_get_mscale): softmax scale is multiplied by
  // mscale(factor, mscale_all_dim)^2; cos/sin by mscale(factor, mscale)/mscale(factor, mscale_all_dim).
  double mscale = 1.0;
  double mscale_all_dim = 1.0;
  // params.json apply_scale == false means no cos/sin magnitude correction; the loader folds
  // it into mscale = mscale_all_dim (attention factor 1) and leaves this true. The softmax
  // mscale^2 always applies, as in vLLM and transformers.
  bool apply_scale = true;
};

// Mistral 4 query temperature: q *= 1 + beta * log(1 + floor(p / original_max_position_embeddings)).
struct Llama4Scaling {
  bool enabled = false;
  int64_t original_max_position_embeddings = 8192;
  double beta = 0.1;
};

// LeRoPE: p' = p for p < window, window + (p - window) / leak beyond (MODEL.md 3.2).
struct LeRopeConfig {
  bool enabled = false;
  int64_t window = 0;
  double leak = 1.0;
};

enum class RouterScoring { kSoftmax, kSigmoid };

struct MoeConfig {
  int num_experts = 0;            // 0: no MoE anywhere
  int num_experts_per_tok = 0;
  int expert_hidden_dim = 0;
  int first_k_dense_replace = 0;  // layers [0, k) are dense
  int num_shared_experts = 0;
  double routed_scale = 1.0;
  int num_expert_groups = 1;
  int num_expert_groups_per_tok = 1;
  RouterScoring scoring = RouterScoring::kSoftmax;
  bool renormalize = true;            // renormalise the top-k weights to sum 1
  bool has_correction_bias = false;   // DeepSeek-V3 e_score_correction_bias (selection only)
};

// DeepSeek-V3.2 style lightning indexer (MODEL.md 3.5).
struct IndexerConfig {
  int n_heads = 0;  // 0: no DSA; attention covers all s <= p
  int head_dim = 128;
  int rope_head_dim = 64;
  int topk = 2048;
};

// DSpark block drafter (MODEL.md section 5).
struct DrafterConfig {
  bool enabled = false;
  int n_layers = 0;
  int block_size = 16;
  std::vector<int> target_layers;
  int window = 2048;
  int rnn_rank = 512;
};

enum class WeightFormat {
  kBF16,          // everything bf16
  kFP8Block,      // e4m3 + fp32 scales per 128x128 block (`*.weight_scale_inv` / `*.scale`)
  kNVFP4Experts,  // routed experts NVFP4, the rest FP8 block
  kMXFP4Experts,  // routed experts MXFP4, the rest FP8 block
};

enum class CheckpointLayout { kMistral, kHF };

enum class IndexerRole { kNone, kOwner, kReuser };
enum class FfnKind { kDense, kMoe };

// Everything that differs between layers.
struct LayerSpec {
  int index = 0;
  bool rope = true;         // false: NoPE layer (rotates nothing, indexer unrotated too)
  bool ssmax = false;       // logits scaled by s_h * log(n) (MODEL.md 3.3)
  int kv_source = 0;        // == index: owns a latent cache; else reads that layer's
  IndexerRole indexer = IndexerRole::kNone;
  int indexer_source = -1;  // owner: index; reuser: the owner it copies top-k from
  FfnKind ffn = FfnKind::kDense;
  int latent_slot = -1;     // position among latent-cache-owning layers, -1 for consumers
  int indexer_slot = -1;    // position among indexer-owning layers, -1 otherwise

  bool owns_kv() const { return kv_source == index; }
  bool sparse() const { return indexer != IndexerRole::kNone; }
};

struct ModelConfig {
  std::string name;  // informative (logs, /v1/models); never branched on
  CheckpointLayout layout = CheckpointLayout::kMistral;
  // HF config.json model_type this config came from ("" for params.json); selects tensor
  // naming details of the HF layout only (weight_names.h), never the forward.
  std::string hf_model_type;
  // Order of the rope rows in the stored wq / wq_b / wkv_a_with_mqa weights: true is
  // interleaved pairs (native, and HF `rope_interleave: true`); false is HF rotate_half
  // order, which the loader permutes back (weight_names.h hf_rope_row_permutation).
  bool rope_interleave = true;

  int dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double norm_eps = 1e-6;
  bool tied_embeddings = false;

  int q_lora_rank = 0;  // 0: plain `wq`
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  int hidden_dim = 0;  // dense FFN hidden size

  double rope_theta = 10000.0;
  YarnConfig yarn;
  Llama4Scaling llama4_scaling;
  LeRopeConfig lerope;
  MoeConfig moe;
  IndexerConfig indexer;
  DrafterConfig drafter;
  WeightFormat weight_format = WeightFormat::kBF16;

  std::vector<LayerSpec> layers;

  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int num_latent_layers() const;   // layers that own a latent cache
  int num_indexer_layers() const;  // layers that own an indexer
  bool has_dsa() const { return indexer.n_heads > 0; }
  // Softmax scale before SSMax/llama4 factors: qk_head_dim^-0.5 * (yarn mscale^2 if any).
  double softmax_scale() const;
};

}  // namespace ml4
