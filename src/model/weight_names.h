// Every tensor a complete checkpoint holds, by name, logical shape, role and stored format,
// in the Mistral native or the Hugging Face layout; and the name map between the two.
//
// Design: expected_tensors() walks ModelConfig::layers (never a model name), so the loader,
// `ml4 make-model` and the capacity/parameter accounting all agree on one list. Shapes are
// logical [out, in] for linears ([experts, out, in] for HF fused expert tensors); a
// quantized linear also lists its scale tensors with their stored shapes. Which tensors a
// layer has follows its LayerSpec: a KV consumer has no wkv_a_with_mqa / kv_a_norm (it reads
// its source's latent cache), an indexer reuser has no indexer tensors, an SSMax layer has
// `attention.ssmax_s`. Names, formats and the HF map are documented in docs/MODEL-FORMAT.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"
#include "model/linear_weight.h"
#include "model/model_config.h"

namespace ml4 {

enum class TensorRole {
  kLinear,          // [out, in] weight of a linear layer
  kExpertsLinear,   // [experts, out, in]: HF fused routed experts (mistral4 layout)
  kNorm,            // RMSNorm / LayerNorm weight [dim]
  kNormBias,        // bias vectors: LayerNorm (indexer k_norm), the drafter's GRU
  kEmbedding,       // token embeddings [vocab, dim], drafter mask embeddings
  kRouterGate,      // MoE router [experts, dim], always bf16 and run in fp32
  kCorrectionBias,  // DeepSeek-V3 e_score_correction_bias [experts], f32
  kSsmaxScale,      // SSMax per-head s_h [n_heads], f32
};

const char* tensor_role_name(TensorRole r);

struct ScaleTensor {
  std::string name;
  Shape shape;  // stored shape
  DType dtype = DType::kF32;
};

struct ExpectedTensor {
  std::string name;
  Shape shape;  // logical
  TensorRole role = TensorRole::kLinear;
  // Linears: the format implied by the config's WeightFormat. Others: kBF16 or kF32
  // (the dtype the writer uses; loaders accept bf16 or f32 for them).
  LinearFormat format = LinearFormat::kBF16;
  std::vector<ScaleTensor> scales;  // empty unless quantized
  int layer = -1;         // decoder layer, -1 for global tensors
  int expert = -1;        // routed expert index (per-expert names), -1 otherwise
  bool routed_expert = false;  // a routed expert's weight (per-expert or fused)
  bool drafter = false;        // part of the DSpark drafter (mtp_dspark.*)

  int64_t numel() const { return shape_numel(shape); }
  // The dtype of the main tensor as stored (e4m3 for FP8, packed e2m1 bytes for FP4).
  DType stored_dtype() const;
  // The stored shape (FP4 packs two values per byte along `in`).
  Shape stored_shape() const;
};

// Every tensor of a complete checkpoint in `layout`'s naming, in a stable order
// (globals, then layer by layer, then the drafter). HF layouts follow transformers 5.17:
// mistral4 stores routed experts fused (`mlp.experts.gate_up_proj` [E, 2I, H],
// `mlp.experts.down_proj` [E, H, I]); deepseek_v3/v32 per expert (`mlp.experts.E.gate_proj`),
// which transformers fuses at load.
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& cfg, CheckpointLayout layout);

// Linear t (one of expected_tensors()) stored in format f instead: its scale tensors follow
// f (`ml4 quantize --output-tensor-type fp8` stores `output` FP8; the loaders take any
// linear in the format its stored dtype says).
ExpectedTensor stored_as(const ExpectedTensor& t, LinearFormat f);

// Whether HF names use fused expert tensors for this config (true for hf_model_type mistral4).
bool hf_fused_experts(const ModelConfig& cfg);

// Mistral native name -> HF name (and back). Per-expert names only; fused HF expert tensors
// have no one-to-one native name (native_name_from_hf returns an error for them). Scale
// suffixes (.weight_scale_inv, .weight_scale, .weight_scale_2) map with their weight.
Result<std::string> hf_name_from_native(const std::string& native_name);
Result<std::string> native_name_from_hf(const std::string& hf_name);

// Scale tensor suffixes by format (documented in docs/MODEL-FORMAT.md).
inline constexpr const char* kFp8BlockScaleSuffix = "weight_scale_inv";   // f32 [N/128, K/128]
inline constexpr const char* kFp4BlockScaleSuffix = "weight_scale";       // e4m3 / e8m0
inline constexpr const char* kNvfp4GlobalScaleSuffix = "weight_scale_2";  // f32 []

// The HF writer stores MLA rope rows in interleaved-pair order and writes
// `rope_interleave: true`, so transformers (apply_rotary_pos_emb_interleave) computes
// MODEL.md 3.2 on the same bytes as the native layout: no permutation.
inline constexpr bool kHfWriteRopeInterleave = true;

// For an HF config with rope_interleave == false (rotate_half on rope dims), the row of the
// interleaved (native) order that stored row j holds: perm[j] for j in [0, rope_dim).
// Loading such weights applies it to the rope rows of wq / wq_b (per head) and of
// wkv_a_with_mqa; with interleave == true it is the identity.
std::vector<int> hf_rope_row_permutation(int rope_dim, bool rope_interleave);

// Sums of numel over expected_tensors (excluding drafter tensors unless asked).
struct ParamCounts {
  int64_t total = 0;          // every parameter of the decoder (embeddings and head included)
  // Per token, embeddings and head excluded: routed experts count num_experts_per_tok /
  // num_experts of their parameters, everything else fully.
  int64_t active = 0;
  int64_t embeddings = 0;     // tok_embeddings + output (not counted twice when tied)
  int64_t drafter = 0;        // mtp_dspark.*
};
ParamCounts count_parameters(const ModelConfig& cfg);

}  // namespace ml4
