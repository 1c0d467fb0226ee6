// JSON field readers and the layer resolver (see config_json.h).
#include "model/config_json.h"

#include <cmath>

#include "model/config_loader.h"

namespace ml4::config_json {

const char* json_type(const json& v) { return v.type_name(); }

// Absent or null leaves *out unchanged. Integral floats (128.0) are accepted.
Status opt_i64(const json& o, const char* key, int64_t* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return ok_status();
  if (it->is_number_integer()) {
    *out = it->get<int64_t>();
    return ok_status();
  }
  if (it->is_number_float()) {
    double d = it->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
      *out = static_cast<int64_t>(d);
      return ok_status();
    }
  }
  return invalid_argument("\"{}\" must be an integer, found {} {}", key, json_type(*it), it->dump());
}

Status opt_int(const json& o, const char* key, int* out) {
  int64_t v = *out;
  ML4_RETURN_IF_ERROR(opt_i64(o, key, &v));
  if (v < INT32_MIN || v > INT32_MAX) return out_of_range("\"{}\" = {} does not fit in 32 bits", key, v);
  *out = static_cast<int>(v);
  return ok_status();
}

Status opt_ints(const json& o, std::initializer_list<std::pair<const char*, int*>> fields) {
  for (const auto& [key, out] : fields) ML4_RETURN_IF_ERROR(opt_int(o, key, out));
  return ok_status();
}

Status opt_double(const json& o, const char* key, double* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return ok_status();
  if (!it->is_number()) return invalid_argument("\"{}\" must be a number, found {} {}", key, json_type(*it), it->dump());
  *out = it->get<double>();
  if (!std::isfinite(*out)) return invalid_argument("\"{}\" must be finite", key);
  return ok_status();
}

Status opt_bool(const json& o, const char* key, bool* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return ok_status();
  if (!it->is_boolean()) return invalid_argument("\"{}\" must be true or false, found {}", key, it->dump());
  *out = it->get<bool>();
  return ok_status();
}

Status opt_string(const json& o, const char* key, std::string* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return ok_status();
  if (!it->is_string()) return invalid_argument("\"{}\" must be a string, found {}", key, it->dump());
  *out = it->get<std::string>();
  return ok_status();
}

Status opt_int_list(const json& o, const char* key, std::vector<int>* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return ok_status();
  if (!it->is_array()) return invalid_argument("\"{}\" must be a list of integers, found {}", key, it->dump());
  out->clear();
  for (const auto& e : *it) {
    if (!e.is_number_integer()) return invalid_argument("\"{}\" must be a list of integers, found element {}", key, e.dump());
    int64_t v = e.get<int64_t>();
    if (v < INT32_MIN || v > INT32_MAX) return out_of_range("\"{}\": {} does not fit in 32 bits", key, v);
    out->push_back(static_cast<int>(v));
  }
  return ok_status();
}

bool has(const json& o, const char* key) {
  auto it = o.find(key);
  return it != o.end() && !it->is_null();
}

Status require(const json& o, const char* key) {
  if (!has(o, key)) return invalid_argument("missing required key \"{}\"", key);
  return ok_status();
}

// An optional nested object: absent/null -> nullptr; anything but an object is an error.
Result<const json*> opt_object(const json& o, const char* key) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return static_cast<const json*>(nullptr);
  if (!it->is_object()) return invalid_argument("\"{}\" must be an object, found {}", key, it->dump());
  return &*it;
}

// ML4-defined blocks reject unknown keys: a misspelt key would silently change numerics.
Status only_keys(const json& o, const std::set<std::string>& allowed, const char* block) {
  for (auto it = o.begin(); it != o.end(); ++it) {
    if (!allowed.count(it.key())) return invalid_argument("{}: unknown key \"{}\"", block, it.key());
  }
  return ok_status();
}

Result<json> parse_json_object(const std::string& text, const char* what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    return invalid_argument("{}: not valid JSON: {}", what, e.what());
  }
  if (!j.is_object()) return invalid_argument("{}: top level must be a JSON object, found {}", what, json_type(j));
  return j;
}

Status check_layer_index(int l, int n, const std::string& what) {
  if (l < 0 || l >= n) return out_of_range("{}: layer {} out of range [0, {})", what, l, n);
  return ok_status();
}

Status build_layers(ModelConfig& cfg, const LayerPlan& plan) {
  const int n = cfg.n_layers;
  if (n <= 0) return invalid_argument("n_layers must be > 0, found {}", n);
  if (n > 100000) return out_of_range("n_layers = {} is absurd", n);
  cfg.layers.assign(n, LayerSpec{});
  for (int i = 0; i < n; ++i) {
    auto& l = cfg.layers[i];
    l.index = i;
    l.kv_source = i;
    l.indexer = cfg.has_dsa() ? IndexerRole::kOwner : IndexerRole::kNone;
    l.indexer_source = cfg.has_dsa() ? i : -1;
  }
  for (int l : plan.nope_layers) {
    ML4_RETURN_IF_ERROR(check_layer_index(l, n, "nope_layers"));
    cfg.layers[l].rope = false;
  }
  for (int l : plan.ssmax_layers) {
    ML4_RETURN_IF_ERROR(check_layer_index(l, n, "ssmax.layers"));
    cfg.layers[l].ssmax = true;
  }
  std::set<int> consumers;
  for (const auto& [src, list] : plan.kv_sharing) {
    ML4_RETURN_IF_ERROR(check_layer_index(src, n, "kv_sharing source"));
    if (list.empty()) return invalid_argument("kv_sharing: source layer {} has an empty consumer list", src);
    for (int c : list) {
      ML4_RETURN_IF_ERROR(check_layer_index(c, n, fmt::format("kv_sharing[{}]", src)));
      if (!consumers.insert(c).second) return invalid_argument("kv_sharing: layer {} is listed as a consumer more than once", c);
      cfg.layers[c].kv_source = src;
    }
  }
  if (!plan.indexer_reuse.empty() && !cfg.has_dsa()) {
    return invalid_argument("indexer reuse is given but the model has no indexer (indexer.n_heads = 0)");
  }
  for (const auto& [l, src] : plan.indexer_reuse) {
    ML4_RETURN_IF_ERROR(check_layer_index(l, n, "indexer.reuse"));
    ML4_RETURN_IF_ERROR(check_layer_index(src, n, fmt::format("indexer.reuse[{}]", l)));
    cfg.layers[l].indexer = IndexerRole::kReuser;
    cfg.layers[l].indexer_source = src;
  }
  if (plan.ffn) {
    if (static_cast<int>(plan.ffn->size()) != n) {
      return invalid_argument("per-layer FFN list has {} entries for {} layers", plan.ffn->size(), n);
    }
    for (int i = 0; i < n; ++i) cfg.layers[i].ffn = (*plan.ffn)[i];
    int k = 0;
    while (k < n && cfg.layers[k].ffn == FfnKind::kDense) ++k;
    cfg.moe.first_k_dense_replace = k;
  } else {
    if (cfg.moe.num_experts > 0 && (cfg.moe.first_k_dense_replace < 0 || cfg.moe.first_k_dense_replace > n)) {
      return out_of_range("moe.first_k_dense_replace {} out of range [0, {}]", cfg.moe.first_k_dense_replace, n);
    }
    for (int i = 0; i < n; ++i) {
      bool moe = cfg.moe.num_experts > 0 && i >= cfg.moe.first_k_dense_replace;
      cfg.layers[i].ffn = moe ? FfnKind::kMoe : FfnKind::kDense;
    }
  }
  // An MoE block whose layers are all dense (vLLM's MLA adapter and our HF writer spell a
  // dense model that way) is no MoE: normalise so both spellings give one config.
  bool any_moe = false;
  for (const auto& l : cfg.layers) any_moe |= l.ffn == FfnKind::kMoe;
  if (!any_moe) cfg.moe = MoeConfig{};
  int latent = 0, indexer = 0;
  for (auto& l : cfg.layers) {
    l.latent_slot = l.owns_kv() ? latent++ : -1;
    l.indexer_slot = l.indexer == IndexerRole::kOwner ? indexer++ : -1;
  }
  return validate_model_config(cfg);
}

double yarn_mscale(double factor, double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

}  // namespace ml4::config_json
