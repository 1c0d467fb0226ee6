// Model configuration loaders: params.json (Mistral native + the ML4 blocks) and HF
// config.json (mistral4, deepseek_v3, deepseek_v32) -> ModelConfig with a resolved LayerSpec
// per layer, and the writers back to both layouts.
//
// Design: each loader reads its schema into ModelConfig's global fields plus a "layer plan"
// (NoPE set, SSMax set, KV sharing, indexer reuse, dense/MoE pattern), then one shared
// resolver turns the plan into ModelConfig::layers and validates everything with messages
// that name the offending key and value. Downstream code reads only LayerSpec
// (MODEL.md section 2); nothing here is keyed on a model name. The exact schemas and the
// HF <-> native field map are in docs/MODEL-FORMAT.md.
#pragma once

#include <set>
#include <string>

#include "core/status.h"
#include "model/model_config.h"

namespace ml4 {

// Mistral native params.json plus the ML4 blocks (indexer, kv_sharing, nope_layer_interval /
// nope_layers, ssmax, lerope, mtp). Unknown top-level keys are ignored (logged at debug).
Result<ModelConfig> parse_params_json(const std::string& json_text);

// Hugging Face config.json with model_type mistral4, deepseek_v3 or deepseek_v32
// (transformers 5.17 field names; rope_parameters or the older rope_scaling + rope_theta).
Result<ModelConfig> parse_hf_config_json(const std::string& json_text);

// A model directory: params.json when present, else config.json. Errors name the file.
Result<ModelConfig> load_model_config(const std::string& model_dir);

// Serializes to params.json text; parse_params_json of the result gives the same config.
std::string params_json_from_config(const ModelConfig& cfg);

// Serializes to an HF config.json for `model_type` (mistral4, deepseek_v3, deepseek_v32).
// Call check_hf_representable first: fields the HF schema cannot hold are dropped here.
std::string hf_config_json_from_config(const ModelConfig& cfg, std::string model_type);

// OK when transformers' `model_type` computes the same function as `cfg` (no ML4-only
// features, routing and indexer shape that model_type implements); otherwise an error
// listing every reason.
Status check_hf_representable(const ModelConfig& cfg, const std::string& model_type);

// The top-level keys params.json may hold (Mistral's native schema plus the ML4 blocks),
// and the keys of its `moe` block: what `--set` overrides are checked against.
const std::set<std::string>& native_params_keys();
const std::set<std::string>& native_moe_keys();

// Re-runs the layer resolver's checks on an already built config (used after edits).
Status validate_model_config(const ModelConfig& cfg);

}  // namespace ml4
