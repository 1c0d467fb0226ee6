// Internal to src/model: the JSON field readers and the layer resolver shared by the
// params.json loader (config_loader.cpp) and the HF config.json loader (config_hf.cpp).
//
// Readers check the JSON type before reading, so a wrong type is a Status naming the key,
// never a json exception. Absent or null leaves the output unchanged (the caller's default).
#pragma once

#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "model/model_config.h"

namespace ml4::config_json {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

Status opt_i64(const json& o, const char* key, int64_t* out);  // integral floats accepted
Status opt_int(const json& o, const char* key, int* out);
// opt_int over a list of (key, output) pairs, in order; the first error wins.
Status opt_ints(const json& o, std::initializer_list<std::pair<const char*, int*>> fields);
Status opt_double(const json& o, const char* key, double* out);
Status opt_bool(const json& o, const char* key, bool* out);
Status opt_string(const json& o, const char* key, std::string* out);
Status opt_int_list(const json& o, const char* key, std::vector<int>* out);
bool has(const json& o, const char* key);  // present and not null
Status require(const json& o, const char* key);
// An optional nested object: absent/null -> nullptr; anything but an object is an error.
Result<const json*> opt_object(const json& o, const char* key);
// ML4-defined blocks reject unknown keys: a misspelt key would silently change numerics.
Status only_keys(const json& o, const std::set<std::string>& allowed, const char* block);
Result<json> parse_json_object(const std::string& text, const char* what);

// What a schema says about individual layers, before resolution into LayerSpecs.
struct LayerPlan {
  std::vector<int> nope_layers;
  std::vector<int> ssmax_layers;
  std::map<int, std::vector<int>> kv_sharing;  // source -> consumers
  std::map<int, int> indexer_reuse;             // reuser -> source
  std::optional<std::vector<FfnKind>> ffn;      // explicit per layer, else first_k_dense
};

Status check_layer_index(int l, int n, const std::string& what);

// Fills cfg.layers from the plan and cfg's global fields (indexer, moe), assigns cache slots
// and runs validate_model_config.
Status build_layers(ModelConfig& cfg, const LayerPlan& plan);

// YaRN magnitude: yarn_get_mscale in DeepSeek-V3 inference/model.py and transformers.
double yarn_mscale(double factor, double m);

}  // namespace ml4::config_json
