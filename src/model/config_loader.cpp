// params.json / config.json -> ModelConfig (see config_loader.h for the design).
//
// Field access goes through small typed readers that check the JSON type before reading,
// so a wrong type is a Status naming the key, never a json exception. Parsing fills the
// global fields and a LayerPlan; build_layers() turns the plan into LayerSpecs and
// validate_model_config() checks the result (the same checks run on hand-built configs).
// HF semantics follow transformers 5.17 (models/mistral4, deepseek_v3, deepseek_v32 and
// modeling_rope_utils._compute_yarn_parameters); the Mistral native keys follow vLLM's
// transformers_utils/configs/mistral.py (yarn beta -> beta_fast, alpha -> beta_slow).
#include "model/config_loader.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/log.h"
#include "model/weight_names.h"

namespace ml4 {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------- typed readers

const char* json_type(const json& v) { return v.type_name(); }

// Absent or null leaves *out unchanged. Integral floats (128.0) are accepted.
Status opt_i64(const json& o, const char* key, int64_t* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return Status::ok();
  if (it->is_number_integer()) {
    *out = it->get<int64_t>();
    return Status::ok();
  }
  if (it->is_number_float()) {
    double d = it->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
      *out = static_cast<int64_t>(d);
      return Status::ok();
    }
  }
  return invalid_argument("\"{}\" must be an integer, found {} {}", key, json_type(*it), it->dump());
}

Status opt_int(const json& o, const char* key, int* out) {
  int64_t v = *out;
  ML4_RETURN_IF_ERROR(opt_i64(o, key, &v));
  if (v < INT32_MIN || v > INT32_MAX) return out_of_range("\"{}\" = {} does not fit in 32 bits", key, v);
  *out = static_cast<int>(v);
  return Status::ok();
}

Status opt_double(const json& o, const char* key, double* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return Status::ok();
  if (!it->is_number()) return invalid_argument("\"{}\" must be a number, found {} {}", key, json_type(*it), it->dump());
  *out = it->get<double>();
  if (!std::isfinite(*out)) return invalid_argument("\"{}\" must be finite", key);
  return Status::ok();
}

Status opt_bool(const json& o, const char* key, bool* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return Status::ok();
  if (!it->is_boolean()) return invalid_argument("\"{}\" must be true or false, found {}", key, it->dump());
  *out = it->get<bool>();
  return Status::ok();
}

Status opt_string(const json& o, const char* key, std::string* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return Status::ok();
  if (!it->is_string()) return invalid_argument("\"{}\" must be a string, found {}", key, it->dump());
  *out = it->get<std::string>();
  return Status::ok();
}

Status opt_int_list(const json& o, const char* key, std::vector<int>* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return Status::ok();
  if (!it->is_array()) return invalid_argument("\"{}\" must be a list of integers, found {}", key, it->dump());
  out->clear();
  for (const auto& e : *it) {
    if (!e.is_number_integer()) return invalid_argument("\"{}\" must be a list of integers, found element {}", key, e.dump());
    int64_t v = e.get<int64_t>();
    if (v < INT32_MIN || v > INT32_MAX) return out_of_range("\"{}\": {} does not fit in 32 bits", key, v);
    out->push_back(static_cast<int>(v));
  }
  return Status::ok();
}

bool has(const json& o, const char* key) {
  auto it = o.find(key);
  return it != o.end() && !it->is_null();
}

Status require(const json& o, const char* key) {
  if (!has(o, key)) return invalid_argument("missing required key \"{}\"", key);
  return Status::ok();
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
  return Status::ok();
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

// ---------------------------------------------------------------- layer plan

struct LayerPlan {
  std::vector<int> nope_layers;
  std::vector<int> ssmax_layers;
  std::map<int, std::vector<int>> kv_sharing;  // source -> consumers
  std::map<int, int> indexer_reuse;             // reuser -> source
  std::optional<std::vector<FfnKind>> ffn;      // explicit per layer, else first_k_dense
};

Status check_layer_index(int l, int n, const std::string& what) {
  if (l < 0 || l >= n) return out_of_range("{}: layer {} out of range [0, {})", what, l, n);
  return Status::ok();
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

// ---------------------------------------------------------------- shared parts

// YaRN magnitude: yarn_get_mscale in DeepSeek-V3 inference/model.py and transformers.
double yarn_mscale(double factor, double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

// Picks `mscale` so that our cos/sin factor mscale(f, mscale) / mscale(f, mscale_all_dim)
// equals the attention factor `a` transformers would use.
Status set_cos_sin_factor(YarnConfig& y, double a) {
  double target = a * yarn_mscale(y.factor, y.mscale_all_dim);
  if (y.factor <= 1.0) {
    if (std::fabs(a - 1.0) > 1e-12) return unimplemented("yarn attention_factor {} with factor <= 1 is not supported", a);
    return Status::ok();
  }
  y.mscale = (target - 1.0) / (0.1 * std::log(y.factor));
  return Status::ok();
}

Status parse_weight_format_native(const json& q, WeightFormat* out) {
  // Mistral: {"qformat_weight": "fp8_e4m3", ...}; this project adds weight_block_size and
  // qformat_experts. Per-tensor FP8 (Mistral's qscale_weight) is not a format ml4 runs.
  if (q.empty()) {
    *out = WeightFormat::kBF16;
    return Status::ok();
  }
  std::string w, experts;
  ML4_RETURN_IF_ERROR(opt_string(q, "qformat_weight", &w));
  ML4_RETURN_IF_ERROR(opt_string(q, "qformat_experts", &experts));
  std::vector<int> block;
  ML4_RETURN_IF_ERROR(opt_int_list(q, "weight_block_size", &block));
  if (w == "bf16" || w.empty()) {
    if (!experts.empty() || !block.empty()) return invalid_argument("quantization: qformat_experts/weight_block_size need qformat_weight \"fp8_e4m3\"");
    if (w.empty()) return invalid_argument("unknown quantization {}: expected qformat_weight \"fp8_e4m3\" or \"bf16\"", q.dump());
    *out = WeightFormat::kBF16;
    return Status::ok();
  }
  if (w != "fp8_e4m3") return invalid_argument("unknown quantization qformat_weight \"{}\" (supported: fp8_e4m3, bf16)", w);
  if (block != std::vector<int>{128, 128}) {
    return unimplemented("quantization: FP8 needs \"weight_block_size\": [128, 128] (block-scaled); per-tensor FP8 is not supported");
  }
  if (experts.empty() || experts == "fp8_e4m3") *out = WeightFormat::kFP8Block;
  else if (experts == "nvfp4") *out = WeightFormat::kNVFP4Experts;
  else if (experts == "mxfp4") *out = WeightFormat::kMXFP4Experts;
  else return invalid_argument("unknown quantization qformat_experts \"{}\" (supported: fp8_e4m3, nvfp4, mxfp4)", experts);
  return Status::ok();
}

Status parse_weight_format_hf(const json& q, WeightFormat* out) {
  std::string method;
  ML4_RETURN_IF_ERROR(opt_string(q, "quant_method", &method));
  if (method == "fp8") {
    std::string fmt_name = "e4m3";
    ML4_RETURN_IF_ERROR(opt_string(q, "fmt", &fmt_name));
    if (fmt_name != "e4m3") return unimplemented("quantization_config: fp8 fmt \"{}\" (only e4m3)", fmt_name);
    std::vector<int> block;
    ML4_RETURN_IF_ERROR(opt_int_list(q, "weight_block_size", &block));
    if (block != std::vector<int>{128, 128}) return unimplemented("quantization_config: fp8 needs weight_block_size [128, 128]");
    *out = WeightFormat::kFP8Block;
  } else if (method == "modelopt") {
    std::string algo;
    ML4_RETURN_IF_ERROR(opt_string(q, "quant_algo", &algo));
    if (algo != "NVFP4") return unimplemented("quantization_config: modelopt quant_algo \"{}\" (only NVFP4)", algo);
    *out = WeightFormat::kNVFP4Experts;
  } else if (method == "mxfp4") {
    *out = WeightFormat::kMXFP4Experts;
  } else {
    return invalid_argument("unknown quantization_config quant_method \"{}\" (supported: fp8, modelopt NVFP4, mxfp4)", method);
  }
  return Status::ok();
}

ojson native_quantization_json(WeightFormat f) {
  ojson q;
  q["qformat_weight"] = "fp8_e4m3";
  q["weight_block_size"] = {128, 128};
  switch (f) {
    case WeightFormat::kBF16: return ojson();
    case WeightFormat::kFP8Block: break;
    case WeightFormat::kNVFP4Experts: q["qformat_experts"] = "nvfp4"; break;
    case WeightFormat::kMXFP4Experts: q["qformat_experts"] = "mxfp4"; break;
  }
  return q;
}

ojson hf_quantization_json(WeightFormat f) {
  ojson q;
  switch (f) {
    case WeightFormat::kBF16: return ojson();
    case WeightFormat::kFP8Block:
      q["quant_method"] = "fp8";
      q["fmt"] = "e4m3";
      q["activation_scheme"] = "dynamic";
      q["weight_block_size"] = {128, 128};
      break;
    case WeightFormat::kNVFP4Experts:
      q["quant_method"] = "modelopt";
      q["quant_algo"] = "NVFP4";
      q["group_size"] = kNvfp4GroupSize;
      break;
    case WeightFormat::kMXFP4Experts:
      q["quant_method"] = "mxfp4";
      break;
  }
  return q;
}

// ---------------------------------------------------------------- params.json

const std::set<std::string> kNativeKeys = {
    "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "norm_eps", "vocab_size",
    "max_position_embeddings", "max_seq_len", "tied_embeddings", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_theta", "yarn", "llama_4_scaling",
    "moe", "quantization", "vision_encoder", "indexer", "kv_sharing", "nope_layer_interval",
    "nope_layers", "ssmax", "lerope", "mtp"};

Status parse_native_moe(const json& m, ModelConfig& cfg, LayerPlan& plan) {
  auto& moe = cfg.moe;
  ML4_RETURN_IF_ERROR(require(m, "num_experts"));
  ML4_RETURN_IF_ERROR(opt_int(m, "num_experts", &moe.num_experts));
  ML4_RETURN_IF_ERROR(opt_int(m, "num_experts_per_tok", &moe.num_experts_per_tok));
  ML4_RETURN_IF_ERROR(opt_int(m, "expert_hidden_dim", &moe.expert_hidden_dim));
  ML4_RETURN_IF_ERROR(opt_int(m, "first_k_dense_replace", &moe.first_k_dense_replace));
  ML4_RETURN_IF_ERROR(opt_int(m, "num_shared_experts", &moe.num_shared_experts));
  ML4_RETURN_IF_ERROR(opt_double(m, "routed_scale", &moe.routed_scale));
  ML4_RETURN_IF_ERROR(opt_int(m, "num_expert_groups", &moe.num_expert_groups));
  ML4_RETURN_IF_ERROR(opt_int(m, "num_expert_groups_per_tok", &moe.num_expert_groups_per_tok));
  int every_n = 1;
  ML4_RETURN_IF_ERROR(opt_int(m, "route_every_n", &every_n));
  if (every_n != 1) return unimplemented("moe.route_every_n = {} (only 1 is supported)", every_n);
  // ML4 extensions (DeepSeek routing in the native schema).
  std::string scoring = "softmax";
  ML4_RETURN_IF_ERROR(opt_string(m, "scoring_func", &scoring));
  if (scoring == "softmax") moe.scoring = RouterScoring::kSoftmax;
  else if (scoring == "sigmoid") moe.scoring = RouterScoring::kSigmoid;
  else return invalid_argument("moe.scoring_func \"{}\" (expected softmax or sigmoid)", scoring);
  ML4_RETURN_IF_ERROR(opt_bool(m, "correction_bias", &moe.has_correction_bias));
  ML4_RETURN_IF_ERROR(opt_bool(m, "norm_topk_prob", &moe.renormalize));
  if (has(m, "dense_layers")) {
    std::vector<int> dense;
    ML4_RETURN_IF_ERROR(opt_int_list(m, "dense_layers", &dense));
    std::vector<FfnKind> kinds(std::max(cfg.n_layers, 0), FfnKind::kMoe);
    for (int l : dense) {
      ML4_RETURN_IF_ERROR(check_layer_index(l, cfg.n_layers, "moe.dense_layers"));
      kinds[l] = FfnKind::kDense;
    }
    plan.ffn = kinds;
  }
  // use_load_balancing_bias / renorm_strategy: read by vLLM's adapter as no-ops; so here.
  return Status::ok();
}

Status parse_native(const json& j, ModelConfig& cfg) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!kNativeKeys.count(it.key())) ML4_LOG_DEBUG("params.json: ignoring unknown key \"{}\"", it.key());
  }
  for (const char* k : {"dim", "n_layers", "n_heads", "vocab_size", "kv_lora_rank", "qk_nope_head_dim",
                        "qk_rope_head_dim", "v_head_dim"}) {
    if (!has(j, k)) {
      if (std::string(k) == "kv_lora_rank") return invalid_argument("missing required key \"kv_lora_rank\": ml4 runs MLA models only");
      return invalid_argument("missing required key \"{}\"", k);
    }
  }
  ML4_RETURN_IF_ERROR(opt_int(j, "dim", &cfg.dim));
  ML4_RETURN_IF_ERROR(opt_int(j, "n_layers", &cfg.n_layers));
  ML4_RETURN_IF_ERROR(opt_int(j, "n_heads", &cfg.n_heads));
  ML4_RETURN_IF_ERROR(opt_int(j, "hidden_dim", &cfg.hidden_dim));
  ML4_RETURN_IF_ERROR(opt_double(j, "norm_eps", &cfg.norm_eps));
  ML4_RETURN_IF_ERROR(opt_int(j, "vocab_size", &cfg.vocab_size));
  cfg.max_position_embeddings = 0;
  ML4_RETURN_IF_ERROR(opt_i64(j, "max_seq_len", &cfg.max_position_embeddings));
  ML4_RETURN_IF_ERROR(opt_i64(j, "max_position_embeddings", &cfg.max_position_embeddings));
  if (cfg.max_position_embeddings == 0) return invalid_argument("missing required key \"max_position_embeddings\" (or \"max_seq_len\")");
  ML4_RETURN_IF_ERROR(opt_bool(j, "tied_embeddings", &cfg.tied_embeddings));
  ML4_RETURN_IF_ERROR(opt_int(j, "q_lora_rank", &cfg.q_lora_rank));
  ML4_RETURN_IF_ERROR(opt_int(j, "kv_lora_rank", &cfg.kv_lora_rank));
  ML4_RETURN_IF_ERROR(opt_int(j, "qk_nope_head_dim", &cfg.qk_nope_head_dim));
  ML4_RETURN_IF_ERROR(opt_int(j, "qk_rope_head_dim", &cfg.qk_rope_head_dim));
  ML4_RETURN_IF_ERROR(opt_int(j, "v_head_dim", &cfg.v_head_dim));
  int head_dim = -1;
  ML4_RETURN_IF_ERROR(opt_int(j, "head_dim", &head_dim));
  if (head_dim != -1 && head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) {
    return invalid_argument("head dims do not add up: head_dim {} != qk_nope_head_dim {} + qk_rope_head_dim {}", head_dim,
                            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim);
  }
  ML4_RETURN_IF_ERROR(opt_double(j, "rope_theta", &cfg.rope_theta));

  ML4_ASSIGN_OR_RETURN(const json* yarn, opt_object(j, "yarn"));
  if (yarn) {
    Status s = [&]() -> Status {
      ML4_RETURN_IF_ERROR(only_keys(*yarn, {"factor", "original_max_position_embeddings", "beta", "alpha", "apply_scale", "mscale", "mscale_all_dim"}, "yarn"));
      auto& y = cfg.yarn;
      y.enabled = true;
      ML4_RETURN_IF_ERROR(require(*yarn, "factor"));
      ML4_RETURN_IF_ERROR(require(*yarn, "original_max_position_embeddings"));
      ML4_RETURN_IF_ERROR(opt_double(*yarn, "factor", &y.factor));
      ML4_RETURN_IF_ERROR(opt_i64(*yarn, "original_max_position_embeddings", &y.original_max_position_embeddings));
      ML4_RETURN_IF_ERROR(opt_double(*yarn, "beta", &y.beta_fast));
      ML4_RETURN_IF_ERROR(opt_double(*yarn, "alpha", &y.beta_slow));
      // vLLM's adapter sets mscale_all_dim = 1 and leaves mscale at its default 1.
      y.mscale = 1.0;
      y.mscale_all_dim = 1.0;
      ML4_RETURN_IF_ERROR(opt_double(*yarn, "mscale", &y.mscale));
      ML4_RETURN_IF_ERROR(opt_double(*yarn, "mscale_all_dim", &y.mscale_all_dim));
      bool apply = true;
      ML4_RETURN_IF_ERROR(opt_bool(*yarn, "apply_scale", &apply));
      // apply_scale false = no cos/sin magnitude correction (vLLM: attention_factor 1.0);
      // the softmax mscale^2 from mscale_all_dim stays, as in vLLM and transformers.
      if (!apply) y.mscale = y.mscale_all_dim;
      y.apply_scale = true;
      return Status::ok();
    }();
    ML4_RETURN_IF_ERROR(s.with_context("yarn"));
  }

  ML4_ASSIGN_OR_RETURN(const json* l4, opt_object(j, "llama_4_scaling"));
  if (l4) {
    Status s = [&]() -> Status {
      ML4_RETURN_IF_ERROR(only_keys(*l4, {"original_max_position_embeddings", "beta"}, "llama_4_scaling"));
      ML4_RETURN_IF_ERROR(require(*l4, "original_max_position_embeddings"));
      ML4_RETURN_IF_ERROR(require(*l4, "beta"));
      cfg.llama4_scaling.enabled = true;
      ML4_RETURN_IF_ERROR(opt_i64(*l4, "original_max_position_embeddings", &cfg.llama4_scaling.original_max_position_embeddings));
      return opt_double(*l4, "beta", &cfg.llama4_scaling.beta);
    }();
    ML4_RETURN_IF_ERROR(s.with_context("llama_4_scaling"));
  }

  LayerPlan plan;
  ML4_ASSIGN_OR_RETURN(const json* moe, opt_object(j, "moe"));
  if (moe) ML4_RETURN_IF_ERROR(parse_native_moe(*moe, cfg, plan).with_context("moe"));

  auto qit = j.find("quantization");
  if (qit != j.end() && !qit->is_null()) {
    if (!qit->is_object()) return invalid_argument("unknown quantization {}: expected an object", qit->dump());
    ML4_RETURN_IF_ERROR(parse_weight_format_native(*qit, &cfg.weight_format));
  }
  ML4_ASSIGN_OR_RETURN(const json* vision, opt_object(j, "vision_encoder"));
  if (vision) ML4_LOG_DEBUG("params.json: vision_encoder present ({} keys), not used yet", vision->size());

  ML4_ASSIGN_OR_RETURN(const json* idx, opt_object(j, "indexer"));
  if (idx) {
    Status s = [&]() -> Status {
      ML4_RETURN_IF_ERROR(only_keys(*idx, {"n_heads", "head_dim", "rope_head_dim", "topk", "reuse"}, "indexer"));
      for (const char* k : {"n_heads", "head_dim", "topk"}) ML4_RETURN_IF_ERROR(require(*idx, k));
      auto& ic = cfg.indexer;
      ic.rope_head_dim = cfg.qk_rope_head_dim;
      ML4_RETURN_IF_ERROR(opt_int(*idx, "n_heads", &ic.n_heads));
      ML4_RETURN_IF_ERROR(opt_int(*idx, "head_dim", &ic.head_dim));
      ML4_RETURN_IF_ERROR(opt_int(*idx, "rope_head_dim", &ic.rope_head_dim));
      ML4_RETURN_IF_ERROR(opt_int(*idx, "topk", &ic.topk));
      if (ic.n_heads <= 0) return invalid_argument("n_heads must be > 0, found {}", ic.n_heads);
      ML4_ASSIGN_OR_RETURN(const json* reuse, opt_object(*idx, "reuse"));
      if (reuse) {
        for (auto it = reuse->begin(); it != reuse->end(); ++it) {
          int layer = 0;
          try {
            size_t pos = 0;
            layer = std::stoi(it.key(), &pos);
            if (pos != it.key().size()) throw std::invalid_argument("trailing");
          } catch (const std::exception&) {
            return invalid_argument("reuse: key \"{}\" is not a layer index", it.key());
          }
          if (!it->is_number_integer()) return invalid_argument("reuse[{}]: source must be a layer index, found {}", layer, it->dump());
          plan.indexer_reuse[layer] = it->get<int>();
        }
      }
      return Status::ok();
    }();
    ML4_RETURN_IF_ERROR(s.with_context("indexer"));
  }

  ML4_ASSIGN_OR_RETURN(const json* kvs, opt_object(j, "kv_sharing"));
  if (kvs) {
    for (auto it = kvs->begin(); it != kvs->end(); ++it) {
      int src = 0;
      try {
        size_t pos = 0;
        src = std::stoi(it.key(), &pos);
        if (pos != it.key().size()) throw std::invalid_argument("trailing");
      } catch (const std::exception&) {
        return invalid_argument("kv_sharing: key \"{}\" is not a layer index", it.key());
      }
      std::vector<int> consumers;
      json wrap = {{"consumers", *it}};
      ML4_RETURN_IF_ERROR(opt_int_list(wrap, "consumers", &consumers).with_context(fmt::format("kv_sharing[{}]", src)));
      plan.kv_sharing[src] = consumers;
    }
  }

  if (has(j, "nope_layer_interval") && has(j, "nope_layers")) {
    return invalid_argument("give nope_layer_interval or nope_layers, not both");
  }
  int interval = 0;
  ML4_RETURN_IF_ERROR(opt_int(j, "nope_layer_interval", &interval));
  if (has(j, "nope_layer_interval")) {
    if (interval < 1) return invalid_argument("nope_layer_interval must be >= 1, found {}", interval);
    for (int i = 0; i < cfg.n_layers; ++i) {
      if (i % interval == interval - 1) plan.nope_layers.push_back(i);
    }
  }
  ML4_RETURN_IF_ERROR(opt_int_list(j, "nope_layers", &plan.nope_layers));

  ML4_ASSIGN_OR_RETURN(const json* ssmax, opt_object(j, "ssmax"));
  if (ssmax) {
    ML4_RETURN_IF_ERROR(only_keys(*ssmax, {"layers"}, "ssmax"));
    ML4_RETURN_IF_ERROR(opt_int_list(*ssmax, "layers", &plan.ssmax_layers).with_context("ssmax"));
  }

  ML4_ASSIGN_OR_RETURN(const json* lerope, opt_object(j, "lerope"));
  if (lerope) {
    Status s = [&]() -> Status {
      ML4_RETURN_IF_ERROR(only_keys(*lerope, {"window", "leak"}, "lerope"));
      ML4_RETURN_IF_ERROR(require(*lerope, "window"));
      ML4_RETURN_IF_ERROR(require(*lerope, "leak"));
      cfg.lerope.enabled = true;
      ML4_RETURN_IF_ERROR(opt_i64(*lerope, "window", &cfg.lerope.window));
      return opt_double(*lerope, "leak", &cfg.lerope.leak);
    }();
    ML4_RETURN_IF_ERROR(s.with_context("lerope"));
  }

  ML4_ASSIGN_OR_RETURN(const json* mtp, opt_object(j, "mtp"));
  if (mtp) {
    Status s = [&]() -> Status {
      ML4_RETURN_IF_ERROR(only_keys(*mtp, {"n_layers", "block_size", "target_layers", "window", "rnn_rank"}, "mtp"));
      for (const char* k : {"n_layers", "target_layers"}) ML4_RETURN_IF_ERROR(require(*mtp, k));
      auto& d = cfg.drafter;
      d.enabled = true;
      ML4_RETURN_IF_ERROR(opt_int(*mtp, "n_layers", &d.n_layers));
      ML4_RETURN_IF_ERROR(opt_int(*mtp, "block_size", &d.block_size));
      ML4_RETURN_IF_ERROR(opt_int_list(*mtp, "target_layers", &d.target_layers));
      ML4_RETURN_IF_ERROR(opt_int(*mtp, "window", &d.window));
      return opt_int(*mtp, "rnn_rank", &d.rnn_rank);
    }();
    ML4_RETURN_IF_ERROR(s.with_context("mtp"));
  }
  return build_layers(cfg, plan);
}

// ---------------------------------------------------------------- HF config.json

const std::set<std::string> kHfModelTypes = {"mistral4", "deepseek_v3", "deepseek_v32"};

Status parse_hf_rope(const json& j, ModelConfig& cfg) {
  const json* rp = nullptr;
  ML4_ASSIGN_OR_RETURN(const json* params, opt_object(j, "rope_parameters"));
  ML4_ASSIGN_OR_RETURN(const json* scaling, opt_object(j, "rope_scaling"));
  rp = params ? params : scaling;
  ML4_RETURN_IF_ERROR(opt_double(j, "rope_theta", &cfg.rope_theta));
  if (!rp) return Status::ok();
  ML4_RETURN_IF_ERROR(opt_double(*rp, "rope_theta", &cfg.rope_theta));
  std::string type = "default";
  ML4_RETURN_IF_ERROR(opt_string(*rp, "type", &type));
  ML4_RETURN_IF_ERROR(opt_string(*rp, "rope_type", &type));
  if (type == "yarn" || type == "deepseek_yarn") {
    auto& y = cfg.yarn;
    y.enabled = true;
    ML4_RETURN_IF_ERROR(require(*rp, "original_max_position_embeddings"));
    ML4_RETURN_IF_ERROR(opt_i64(*rp, "original_max_position_embeddings", &y.original_max_position_embeddings));
    if (has(*rp, "factor")) {
      ML4_RETURN_IF_ERROR(opt_double(*rp, "factor", &y.factor));
    } else if (y.original_max_position_embeddings > 0) {
      // transformers: factor = max_position_embeddings / original_max_position_embeddings.
      y.factor = static_cast<double>(cfg.max_position_embeddings) / y.original_max_position_embeddings;
    }
    ML4_RETURN_IF_ERROR(opt_double(*rp, "beta_fast", &y.beta_fast));
    ML4_RETURN_IF_ERROR(opt_double(*rp, "beta_slow", &y.beta_slow));
    if (y.beta_fast == 0) y.beta_fast = 32;  // transformers: `or 32` / `or 1`
    if (y.beta_slow == 0) y.beta_slow = 1;
    double mscale = 0, mscale_all_dim = 0;
    ML4_RETURN_IF_ERROR(opt_double(*rp, "mscale", &mscale));
    ML4_RETURN_IF_ERROR(opt_double(*rp, "mscale_all_dim", &mscale_all_dim));
    y.mscale_all_dim = mscale_all_dim;  // softmax mscale^2 only when nonzero (yarn_apply_mscale)
    y.mscale = mscale;
    y.apply_scale = true;
    if (has(*rp, "attention_factor")) {
      double a = 1.0;
      ML4_RETURN_IF_ERROR(opt_double(*rp, "attention_factor", &a));
      ML4_RETURN_IF_ERROR(set_cos_sin_factor(y, a));
    } else if (!(mscale != 0 && mscale_all_dim != 0)) {
      // transformers falls back to attention_factor = get_mscale(factor) on cos/sin.
      ML4_RETURN_IF_ERROR(set_cos_sin_factor(y, yarn_mscale(y.factor, 1.0)));
    }
    bool truncate = true;
    ML4_RETURN_IF_ERROR(opt_bool(*rp, "truncate", &truncate));
    if (!truncate) return unimplemented("rope_parameters.truncate = false is not supported");
  } else if (type != "default") {
    return unimplemented("rope type \"{}\" is not supported (yarn or default)", type);
  }
  if (has(*rp, "llama_4_scaling_beta")) {
    auto& l4 = cfg.llama4_scaling;
    l4.enabled = true;
    ML4_RETURN_IF_ERROR(opt_double(*rp, "llama_4_scaling_beta", &l4.beta));
    l4.enabled = l4.beta != 0.0;  // the HF writer spells "no scaling" as beta 0
    // Mistral4Attention: get_llama_4_attn_scale(..., rope_parameters["original_max_position_embeddings"]).
    ML4_RETURN_IF_ERROR(require(*rp, "original_max_position_embeddings").with_context("llama_4_scaling_beta needs it"));
    ML4_RETURN_IF_ERROR(opt_i64(*rp, "original_max_position_embeddings", &l4.original_max_position_embeddings));
  }
  return Status::ok();
}

Status parse_hf(const json& j, ModelConfig& cfg) {
  std::string mt;
  ML4_RETURN_IF_ERROR(require(j, "model_type"));
  ML4_RETURN_IF_ERROR(opt_string(j, "model_type", &mt));
  if (!kHfModelTypes.count(mt)) return unimplemented("model_type \"{}\" is not supported (mistral4, deepseek_v3, deepseek_v32)", mt);
  cfg.hf_model_type = mt;
  cfg.layout = CheckpointLayout::kHF;
  const bool v32 = mt == "deepseek_v32";
  for (const char* k : {"hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "kv_lora_rank",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}) {
    ML4_RETURN_IF_ERROR(require(j, k));
  }
  ML4_RETURN_IF_ERROR(opt_int(j, "hidden_size", &cfg.dim));
  ML4_RETURN_IF_ERROR(opt_int(j, "num_hidden_layers", &cfg.n_layers));
  ML4_RETURN_IF_ERROR(opt_int(j, "num_attention_heads", &cfg.n_heads));
  ML4_RETURN_IF_ERROR(opt_int(j, "intermediate_size", &cfg.hidden_dim));
  ML4_RETURN_IF_ERROR(opt_int(j, "vocab_size", &cfg.vocab_size));
  cfg.max_position_embeddings = 4096;
  ML4_RETURN_IF_ERROR(opt_i64(j, "max_position_embeddings", &cfg.max_position_embeddings));
  ML4_RETURN_IF_ERROR(opt_double(j, "rms_norm_eps", &cfg.norm_eps));
  ML4_RETURN_IF_ERROR(opt_bool(j, "tie_word_embeddings", &cfg.tied_embeddings));
  cfg.q_lora_rank = 0;  // null -> plain q_proj
  ML4_RETURN_IF_ERROR(opt_int(j, "q_lora_rank", &cfg.q_lora_rank));
  ML4_RETURN_IF_ERROR(opt_int(j, "kv_lora_rank", &cfg.kv_lora_rank));
  ML4_RETURN_IF_ERROR(opt_int(j, "qk_nope_head_dim", &cfg.qk_nope_head_dim));
  ML4_RETURN_IF_ERROR(opt_int(j, "qk_rope_head_dim", &cfg.qk_rope_head_dim));
  ML4_RETURN_IF_ERROR(opt_int(j, "v_head_dim", &cfg.v_head_dim));
  int head_dim = -1;
  ML4_RETURN_IF_ERROR(opt_int(j, "head_dim", &head_dim));
  // mistral4 sets head_dim = nope + rope; deepseek_v3/v32 point it at the rope slice.
  if (head_dim != -1 && head_dim != cfg.qk_rope_head_dim && head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) {
    return invalid_argument("head dims do not add up: head_dim {} is neither qk_rope_head_dim {} nor qk_nope_head_dim + qk_rope_head_dim {}",
                            head_dim, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim);
  }
  int kv_heads = cfg.n_heads;
  ML4_RETURN_IF_ERROR(opt_int(j, "num_key_value_heads", &kv_heads));
  if (kv_heads != cfg.n_heads) return unimplemented("num_key_value_heads {} != num_attention_heads {} (MLA has none of its own)", kv_heads, cfg.n_heads);
  std::string act = "silu";
  ML4_RETURN_IF_ERROR(opt_string(j, "hidden_act", &act));
  if (act != "silu") return unimplemented("hidden_act \"{}\" (only silu)", act);
  bool attn_bias = false;
  ML4_RETURN_IF_ERROR(opt_bool(j, "attention_bias", &attn_bias));
  if (attn_bias) return unimplemented("attention_bias = true is not supported");
  cfg.rope_interleave = true;
  if (!v32) ML4_RETURN_IF_ERROR(opt_bool(j, "rope_interleave", &cfg.rope_interleave));
  ML4_RETURN_IF_ERROR(parse_hf_rope(j, cfg));
  if (cfg.llama4_scaling.enabled && mt != "mistral4") {
    return invalid_argument("llama_4_scaling_beta is a mistral4 field; {} does not apply it", mt);
  }

  // MoE: mistral4 routes with softmax; deepseek_v3/v32 with sigmoid + e_score_correction_bias.
  auto& moe = cfg.moe;
  for (const char* k : {"num_local_experts", "num_experts", "n_routed_experts"}) ML4_RETURN_IF_ERROR(opt_int(j, k, &moe.num_experts));
  if (moe.num_experts > 0) {
    moe.first_k_dense_replace = 0;
    moe.num_experts_per_tok = 0;
    ML4_RETURN_IF_ERROR(opt_int(j, "moe_intermediate_size", &moe.expert_hidden_dim));
    ML4_RETURN_IF_ERROR(opt_int(j, "num_experts_per_tok", &moe.num_experts_per_tok));
    ML4_RETURN_IF_ERROR(opt_int(j, "n_shared_experts", &moe.num_shared_experts));
    ML4_RETURN_IF_ERROR(opt_int(j, "first_k_dense_replace", &moe.first_k_dense_replace));
    ML4_RETURN_IF_ERROR(opt_double(j, "routed_scaling_factor", &moe.routed_scale));
    ML4_RETURN_IF_ERROR(opt_int(j, "n_group", &moe.num_expert_groups));
    ML4_RETURN_IF_ERROR(opt_int(j, "topk_group", &moe.num_expert_groups_per_tok));
    ML4_RETURN_IF_ERROR(opt_bool(j, "norm_topk_prob", &moe.renormalize));
    const bool sigmoid = mt != "mistral4";
    moe.scoring = sigmoid ? RouterScoring::kSigmoid : RouterScoring::kSoftmax;
    moe.has_correction_bias = sigmoid;
    std::string scoring;
    ML4_RETURN_IF_ERROR(opt_string(j, "scoring_func", &scoring));
    if (!scoring.empty() && scoring != (sigmoid ? "sigmoid" : "softmax")) {
      return invalid_argument("scoring_func \"{}\": transformers' {} router uses {}", scoring, mt, sigmoid ? "sigmoid" : "softmax");
    }
  }
  LayerPlan plan;
  if (has(j, "mlp_layer_types")) {
    const json& t = j["mlp_layer_types"];
    if (!t.is_array()) return invalid_argument("mlp_layer_types must be a list");
    std::vector<FfnKind> kinds;
    for (const auto& e : t) {
      if (e == "dense") kinds.push_back(FfnKind::kDense);
      else if (e == "sparse") kinds.push_back(FfnKind::kMoe);
      else return invalid_argument("mlp_layer_types: unknown entry {} (dense or sparse)", e.dump());
    }
    plan.ffn = kinds;
  }
  if (v32) {
    auto& ic = cfg.indexer;
    ic.n_heads = 64;  // DeepseekV32Config defaults
    ic.head_dim = 128;
    ic.topk = 2048;
    ML4_RETURN_IF_ERROR(opt_int(j, "index_n_heads", &ic.n_heads));
    ML4_RETURN_IF_ERROR(opt_int(j, "index_head_dim", &ic.head_dim));
    ML4_RETURN_IF_ERROR(opt_int(j, "index_topk", &ic.topk));
    ic.rope_head_dim = cfg.qk_rope_head_dim;  // DeepseekV32Indexer rotates qk_rope_head_dim dims
    if (ic.n_heads <= 0) return invalid_argument("index_n_heads must be > 0, found {}", ic.n_heads);
    if (cfg.q_lora_rank <= 0) return invalid_argument("deepseek_v32 needs q_lora_rank (the indexer reads the query latent)");
  }
  ML4_ASSIGN_OR_RETURN(const json* q, opt_object(j, "quantization_config"));
  if (q) ML4_RETURN_IF_ERROR(parse_weight_format_hf(*q, &cfg.weight_format));
  int mtp_layers = 0;
  ML4_RETURN_IF_ERROR(opt_int(j, "num_nextn_predict_layers", &mtp_layers));
  if (mtp_layers > 0) ML4_LOG_DEBUG("config.json: num_nextn_predict_layers = {} (DeepSeek MTP) is not used", mtp_layers);
  return build_layers(cfg, plan);
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return io_error("{}: cannot open: {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return io_error("{}: read failed", path);
  return ss.str();
}

bool is_interval_pattern(const std::vector<int>& nope, int n, int* interval) {
  if (nope.empty()) return false;
  int k = nope.front() + 1;
  std::vector<int> want;
  for (int i = 0; i < n; ++i) {
    if (i % k == k - 1) want.push_back(i);
  }
  *interval = k;
  return want == nope;
}

}  // namespace

// ---------------------------------------------------------------- public

Status validate_model_config(const ModelConfig& c) {
  auto pos = [](const char* k, int64_t v) -> Status {
    if (v <= 0) return invalid_argument("{} must be > 0, found {}", k, v);
    return Status::ok();
  };
  ML4_RETURN_IF_ERROR(pos("dim", c.dim));
  ML4_RETURN_IF_ERROR(pos("n_layers", c.n_layers));
  ML4_RETURN_IF_ERROR(pos("n_heads", c.n_heads));
  ML4_RETURN_IF_ERROR(pos("vocab_size", c.vocab_size));
  ML4_RETURN_IF_ERROR(pos("max_position_embeddings", c.max_position_embeddings));
  ML4_RETURN_IF_ERROR(pos("kv_lora_rank", c.kv_lora_rank));
  ML4_RETURN_IF_ERROR(pos("qk_rope_head_dim", c.qk_rope_head_dim));
  ML4_RETURN_IF_ERROR(pos("v_head_dim", c.v_head_dim));
  if (c.qk_nope_head_dim < 0) return invalid_argument("qk_nope_head_dim must be >= 0, found {}", c.qk_nope_head_dim);
  if (c.qk_rope_head_dim % 2) return invalid_argument("qk_rope_head_dim {} must be even (rotary pairs)", c.qk_rope_head_dim);
  if (c.q_lora_rank < 0) return invalid_argument("q_lora_rank must be >= 0, found {}", c.q_lora_rank);
  if (!(c.norm_eps > 0)) return invalid_argument("norm_eps must be > 0, found {}", c.norm_eps);
  if (!(c.rope_theta > 0)) return invalid_argument("rope_theta must be > 0, found {}", c.rope_theta);
  if (c.yarn.enabled) {
    if (!(c.yarn.factor > 0)) return invalid_argument("yarn.factor must be > 0, found {}", c.yarn.factor);
    if (c.yarn.original_max_position_embeddings <= 0) return invalid_argument("yarn.original_max_position_embeddings must be > 0");
    if (!(c.yarn.beta_fast > c.yarn.beta_slow)) return invalid_argument("yarn: beta ({}) must exceed alpha ({})", c.yarn.beta_fast, c.yarn.beta_slow);
  }
  if (c.llama4_scaling.enabled && c.llama4_scaling.original_max_position_embeddings <= 0) {
    return invalid_argument("llama_4_scaling.original_max_position_embeddings must be > 0");
  }
  if (c.lerope.enabled) {
    if (c.lerope.window < 0) return invalid_argument("lerope.window must be >= 0, found {}", c.lerope.window);
    if (!(c.lerope.leak >= 1.0)) return invalid_argument("lerope.leak must be >= 1, found {}", c.lerope.leak);
  }
  const auto& ic = c.indexer;
  if (ic.n_heads < 0) return invalid_argument("indexer.n_heads must be >= 0, found {}", ic.n_heads);
  if (c.has_dsa()) {
    if (ic.head_dim <= 0) return invalid_argument("indexer.head_dim must be > 0, found {}", ic.head_dim);
    if (ic.rope_head_dim <= 0 || ic.rope_head_dim > ic.head_dim || ic.rope_head_dim % 2) {
      return invalid_argument("indexer.rope_head_dim {} must be even and in (0, head_dim {}]", ic.rope_head_dim, ic.head_dim);
    }
    if (ic.topk <= 0) return invalid_argument("indexer.topk must be > 0, found {}", ic.topk);
  }
  const auto& m = c.moe;
  if (m.num_experts < 0) return invalid_argument("moe.num_experts must be >= 0, found {}", m.num_experts);
  if (m.num_experts > 0) {
    if (m.num_experts_per_tok < 1 || m.num_experts_per_tok > m.num_experts) {
      return invalid_argument("moe.num_experts_per_tok {} must be in [1, num_experts {}]", m.num_experts_per_tok, m.num_experts);
    }
    if (m.expert_hidden_dim <= 0) return invalid_argument("moe.expert_hidden_dim must be > 0, found {}", m.expert_hidden_dim);
    if (m.num_shared_experts < 0) return invalid_argument("moe.num_shared_experts must be >= 0");
    if (m.num_expert_groups < 1 || m.num_experts % m.num_expert_groups) {
      return invalid_argument("moe.num_expert_groups {} must divide num_experts {}", m.num_expert_groups, m.num_experts);
    }
    if (m.num_expert_groups_per_tok < 1 || m.num_expert_groups_per_tok > m.num_expert_groups) {
      return invalid_argument("moe.num_expert_groups_per_tok {} must be in [1, num_expert_groups {}]", m.num_expert_groups_per_tok, m.num_expert_groups);
    }
    if (m.num_experts_per_tok > m.num_expert_groups_per_tok * (m.num_experts / m.num_expert_groups)) {
      return invalid_argument("moe: top-{} cannot be picked from {} groups of {} experts", m.num_experts_per_tok,
                              m.num_expert_groups_per_tok, m.num_experts / m.num_expert_groups);
    }
    if (m.first_k_dense_replace < 0 || m.first_k_dense_replace > c.n_layers) {
      return out_of_range("moe.first_k_dense_replace {} out of range [0, {}]", m.first_k_dense_replace, c.n_layers);
    }
    if (!(m.routed_scale > 0)) return invalid_argument("moe.routed_scale must be > 0, found {}", m.routed_scale);
  }
  if (c.weight_format == WeightFormat::kNVFP4Experts || c.weight_format == WeightFormat::kMXFP4Experts) {
    int g = c.weight_format == WeightFormat::kNVFP4Experts ? kNvfp4GroupSize : kMxfp4GroupSize;
    if (m.num_experts == 0) return invalid_argument("FP4 expert quantization needs MoE experts");
    if (c.dim % g || m.expert_hidden_dim % g) {
      return invalid_argument("FP4 experts need dim ({}) and expert_hidden_dim ({}) to be multiples of {}", c.dim, m.expert_hidden_dim, g);
    }
  }

  if (static_cast<int>(c.layers.size()) != c.n_layers) {
    return internal_error("{} layer specs for n_layers = {}", c.layers.size(), c.n_layers);
  }
  int latent = 0, indexer = 0;
  for (int i = 0; i < c.n_layers; ++i) {
    const auto& l = c.layers[i];
    if (l.index != i) return internal_error("layer spec {} has index {}", i, l.index);
    if (l.kv_source != i) {
      if (l.kv_source < 0 || l.kv_source >= i) {
        return invalid_argument("kv_sharing: layer {} reads layer {}, which is not an earlier layer", i, l.kv_source);
      }
      const auto& s = c.layers[l.kv_source];
      if (!s.owns_kv()) {
        return invalid_argument("kv_sharing: layer {} reads layer {}, which owns no latent cache (it reads layer {})", i, l.kv_source, s.kv_source);
      }
      if (s.rope != l.rope) {
        return invalid_argument("kv_sharing: layer {} ({}) reads layer {} ({}): the cached rope keys would not match", i,
                                l.rope ? "RoPE" : "NoPE", l.kv_source, s.rope ? "RoPE" : "NoPE");
      }
      if (l.latent_slot != -1) return internal_error("layer {}: KV consumer with latent slot {}", i, l.latent_slot);
    } else if (l.latent_slot != latent++) {
      return internal_error("layer {}: latent slot {} out of order", i, l.latent_slot);
    }
    switch (l.indexer) {
      case IndexerRole::kNone:
        if (c.has_dsa()) return invalid_argument("layer {}: in a DSA model every layer owns or reuses an indexer", i);
        break;
      case IndexerRole::kOwner:
        if (!c.has_dsa()) return invalid_argument("layer {}: indexer owner without an indexer config", i);
        if (l.indexer_source != i) return internal_error("layer {}: indexer owner with source {}", i, l.indexer_source);
        if (l.indexer_slot != indexer++) return internal_error("layer {}: indexer slot {} out of order", i, l.indexer_slot);
        break;
      case IndexerRole::kReuser:
        if (!c.has_dsa()) return invalid_argument("layer {}: indexer reuse without an indexer config", i);
        if (l.indexer_source < 0 || l.indexer_source >= i) {
          return invalid_argument("indexer.reuse: layer {} reuses layer {}, which is not an earlier layer", i, l.indexer_source);
        }
        if (c.layers[l.indexer_source].indexer != IndexerRole::kOwner) {
          return invalid_argument("indexer.reuse: layer {} reuses layer {}, which does not own an indexer", i, l.indexer_source);
        }
        break;
    }
    if (l.ffn == FfnKind::kMoe && m.num_experts == 0) return invalid_argument("layer {}: MoE FFN without moe.num_experts", i);
    if (l.ffn == FfnKind::kDense && c.hidden_dim <= 0) {
      return invalid_argument("layer {} has a dense FFN but hidden_dim is {}", i, c.hidden_dim);
    }
  }
  if (c.drafter.enabled) {
    const auto& d = c.drafter;
    if (d.n_layers < 1) return invalid_argument("mtp.n_layers must be >= 1, found {}", d.n_layers);
    if (d.block_size < 2) return invalid_argument("mtp.block_size must be >= 2, found {}", d.block_size);
    if (d.target_layers.empty()) return invalid_argument("mtp.target_layers is empty");
    for (int t : d.target_layers) ML4_RETURN_IF_ERROR(check_layer_index(t, c.n_layers, "mtp.target_layers"));
    if (d.window <= 0) return invalid_argument("mtp.window must be > 0, found {}", d.window);
    if (d.rnn_rank <= 0) return invalid_argument("mtp.rnn_rank must be > 0, found {}", d.rnn_rank);
  }
  return Status::ok();
}

Result<ModelConfig> parse_params_json(const std::string& json_text) {
  ML4_ASSIGN_OR_RETURN(json j, parse_json_object(json_text, "params.json"));
  ModelConfig cfg;
  cfg.layout = CheckpointLayout::kMistral;
  Status s;
  try {
    s = parse_native(j, cfg);
  } catch (const std::exception& e) {
    s = internal_error("unexpected JSON access error: {}", e.what());
  }
  if (!s.is_ok()) return s.with_context("params.json");
  return cfg;
}

Result<ModelConfig> parse_hf_config_json(const std::string& json_text) {
  ML4_ASSIGN_OR_RETURN(json j, parse_json_object(json_text, "config.json"));
  ModelConfig cfg;
  Status s;
  try {
    s = parse_hf(j, cfg);
  } catch (const std::exception& e) {
    s = internal_error("unexpected JSON access error: {}", e.what());
  }
  if (!s.is_ok()) return s.with_context("config.json");
  return cfg;
}

Result<ModelConfig> load_model_config(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec)) return not_found("model directory {} does not exist", model_dir);
  fs::path params = fs::path(model_dir) / "params.json";
  fs::path hf = fs::path(model_dir) / "config.json";
  bool native = fs::exists(params, ec);
  if (!native && !fs::exists(hf, ec)) return not_found("model directory {} has neither params.json nor config.json", model_dir);
  std::string path = (native ? params : hf).string();
  ML4_ASSIGN_OR_RETURN(std::string text, read_file(path));
  auto r = native ? parse_params_json(text) : parse_hf_config_json(text);
  if (!r.ok()) return Status(r.status().code(), fmt::format("{}: {}", path, r.status().message()));
  ModelConfig cfg = std::move(r).value();
  cfg.name = fs::path(model_dir).filename().string();
  if (cfg.name.empty()) cfg.name = fs::path(model_dir).parent_path().filename().string();
  return cfg;
}

std::string params_json_from_config(const ModelConfig& c) {
  ojson j;
  j["dim"] = c.dim;
  j["n_layers"] = c.n_layers;
  j["n_heads"] = c.n_heads;
  j["head_dim"] = c.qk_head_dim();
  j["hidden_dim"] = c.hidden_dim;
  j["norm_eps"] = c.norm_eps;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tied_embeddings"] = c.tied_embeddings;
  if (c.q_lora_rank > 0) j["q_lora_rank"] = c.q_lora_rank;
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  j["rope_theta"] = c.rope_theta;
  if (c.yarn.enabled) {
    j["yarn"] = {{"factor", c.yarn.factor},
                 {"original_max_position_embeddings", c.yarn.original_max_position_embeddings},
                 {"beta", c.yarn.beta_fast},
                 {"alpha", c.yarn.beta_slow},
                 {"apply_scale", true},
                 {"mscale", c.yarn.mscale},
                 {"mscale_all_dim", c.yarn.mscale_all_dim}};
  }
  if (c.llama4_scaling.enabled) {
    j["llama_4_scaling"] = {{"original_max_position_embeddings", c.llama4_scaling.original_max_position_embeddings},
                            {"beta", c.llama4_scaling.beta}};
  }
  if (c.moe.num_experts > 0) {
    const auto& m = c.moe;
    ojson mo = {{"num_experts", m.num_experts},
                {"num_experts_per_tok", m.num_experts_per_tok},
                {"expert_hidden_dim", m.expert_hidden_dim},
                {"first_k_dense_replace", m.first_k_dense_replace},
                {"num_shared_experts", m.num_shared_experts},
                {"routed_scale", m.routed_scale},
                {"num_expert_groups", m.num_expert_groups},
                {"num_expert_groups_per_tok", m.num_expert_groups_per_tok}};
    if (m.scoring == RouterScoring::kSigmoid) mo["scoring_func"] = "sigmoid";
    if (m.has_correction_bias) mo["correction_bias"] = true;
    if (!m.renormalize) mo["norm_topk_prob"] = false;
    bool first_k = true;
    std::vector<int> dense;
    for (const auto& l : c.layers) {
      if (l.ffn == FfnKind::kDense) dense.push_back(l.index);
      first_k &= (l.ffn == FfnKind::kDense) == (l.index < m.first_k_dense_replace);
    }
    if (!first_k) mo["dense_layers"] = dense;
    j["moe"] = mo;
  }
  if (c.weight_format != WeightFormat::kBF16) j["quantization"] = native_quantization_json(c.weight_format);
  if (c.has_dsa()) {
    ojson reuse = ojson::object();
    for (const auto& l : c.layers) {
      if (l.indexer == IndexerRole::kReuser) reuse[std::to_string(l.index)] = l.indexer_source;
    }
    ojson idx = {{"n_heads", c.indexer.n_heads}, {"head_dim", c.indexer.head_dim},
                 {"rope_head_dim", c.indexer.rope_head_dim}, {"topk", c.indexer.topk}};
    if (!reuse.empty()) idx["reuse"] = reuse;
    j["indexer"] = idx;
  }
  std::map<int, std::vector<int>> sharing;
  std::vector<int> nope, ssmax;
  for (const auto& l : c.layers) {
    if (!l.owns_kv()) sharing[l.kv_source].push_back(l.index);
    if (!l.rope) nope.push_back(l.index);
    if (l.ssmax) ssmax.push_back(l.index);
  }
  if (!sharing.empty()) {
    ojson kv = ojson::object();
    for (const auto& [src, list] : sharing) kv[std::to_string(src)] = list;
    j["kv_sharing"] = kv;
  }
  int interval = 0;
  if (is_interval_pattern(nope, c.n_layers, &interval)) j["nope_layer_interval"] = interval;
  else if (!nope.empty()) j["nope_layers"] = nope;
  if (!ssmax.empty()) j["ssmax"] = {{"layers", ssmax}};
  if (c.lerope.enabled) j["lerope"] = {{"window", c.lerope.window}, {"leak", c.lerope.leak}};
  if (c.drafter.enabled) {
    const auto& d = c.drafter;
    j["mtp"] = {{"n_layers", d.n_layers}, {"block_size", d.block_size}, {"target_layers", d.target_layers},
                {"window", d.window}, {"rnn_rank", d.rnn_rank}};
  }
  return j.dump(2) + "\n";
}

Status check_hf_representable(const ModelConfig& c, const std::string& mt) {
  std::vector<std::string> why;
  if (!kHfModelTypes.count(mt)) {
    why.push_back(fmt::format("model_type \"{}\" is not one of mistral4, deepseek_v3, deepseek_v32", mt));
  }
  int consumers = 0, nope = 0, ssmax = 0, reusers = 0;
  for (const auto& l : c.layers) {
    consumers += !l.owns_kv();
    nope += !l.rope;
    ssmax += l.ssmax;
    reusers += l.indexer == IndexerRole::kReuser;
  }
  if (consumers) why.push_back(fmt::format("{} KV-sharing consumer layers", consumers));
  if (nope) why.push_back(fmt::format("{} NoPE layers", nope));
  if (ssmax) why.push_back(fmt::format("{} SSMax layers", ssmax));
  if (reusers) why.push_back(fmt::format("{} indexer-reusing layers", reusers));
  if (c.lerope.enabled) why.push_back("LeRoPE");
  if (c.drafter.enabled) why.push_back("the DSpark drafter (mtp)");
  const bool v32 = mt == "deepseek_v32";
  if (c.has_dsa() && !v32) why.push_back(fmt::format("an indexer (DSA), which only deepseek_v32 has"));
  if (v32) {
    if (!c.has_dsa()) why.push_back("no indexer (deepseek_v32 runs one on every layer)");
    if (c.q_lora_rank <= 0) why.push_back("no query LoRA (the deepseek_v32 indexer reads the query latent)");
    if (c.has_dsa() && c.indexer.rope_head_dim != c.qk_rope_head_dim) {
      why.push_back(fmt::format("indexer rope_head_dim {} != qk_rope_head_dim {}", c.indexer.rope_head_dim, c.qk_rope_head_dim));
    }
  }
  if (c.moe.num_experts > 0) {
    bool sigmoid = mt != "mistral4";
    if ((c.moe.scoring == RouterScoring::kSigmoid) != sigmoid) {
      why.push_back(fmt::format("{} routing, but {} uses {}", c.moe.scoring == RouterScoring::kSigmoid ? "sigmoid" : "softmax", mt,
                                sigmoid ? "sigmoid" : "softmax"));
    }
    if (c.moe.has_correction_bias != sigmoid) {
      why.push_back(fmt::format("correction bias {}, but {} {}", c.moe.has_correction_bias ? "present" : "absent", mt,
                                sigmoid ? "always has one" : "has none"));
    }
  }
  if (c.llama4_scaling.enabled) {
    if (mt != "mistral4") why.push_back(fmt::format("llama_4_scaling, which {} does not apply", mt));
    else if (!c.yarn.enabled) why.push_back("llama_4_scaling without yarn (mistral4 reads its original length from the yarn parameters)");
    else if (c.yarn.original_max_position_embeddings != c.llama4_scaling.original_max_position_embeddings) {
      why.push_back(fmt::format("llama_4_scaling original length {} != yarn original length {} (mistral4 uses one value for both)",
                                c.llama4_scaling.original_max_position_embeddings, c.yarn.original_max_position_embeddings));
    }
  }
  if (!c.yarn.apply_scale) why.push_back("yarn.apply_scale = false");
  if (mt != "deepseek_v32" && c.moe.num_experts > 0) {
    for (const auto& l : c.layers) {
      if ((l.ffn == FfnKind::kDense) != (l.index < c.moe.first_k_dense_replace)) {
        why.push_back(fmt::format("dense/MoE layers not of the first_k_dense_replace form (layer {})", l.index));
        break;
      }
    }
  }
  if (why.empty()) return Status::ok();
  std::string msg = fmt::format("config cannot be written as HF {}:", mt);
  for (size_t i = 0; i < why.size(); ++i) msg += (i ? "; " : " ") + why[i];
  return invalid_argument("{}", msg);
}

std::string hf_config_json_from_config(const ModelConfig& c, std::string mt) {
  static const std::map<std::string, std::string> kArch = {{"mistral4", "Mistral4ForCausalLM"},
                                                          {"deepseek_v3", "DeepseekV3ForCausalLM"},
                                                          {"deepseek_v32", "DeepseekV32ForCausalLM"}};
  ojson j;
  auto arch = kArch.find(mt);
  j["architectures"] = {arch == kArch.end() ? mt : arch->second};
  j["model_type"] = mt;
  j["hidden_size"] = c.dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_heads;
  j["intermediate_size"] = c.hidden_dim;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.norm_eps;
  j["tie_word_embeddings"] = c.tied_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  if (c.q_lora_rank > 0) j["q_lora_rank"] = c.q_lora_rank;
  else j["q_lora_rank"] = nullptr;
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  if (mt != "deepseek_v32") j["rope_interleave"] = kHfWriteRopeInterleave;
  ojson rp;
  if (c.yarn.enabled) {
    rp["rope_type"] = "yarn";
    rp["rope_theta"] = c.rope_theta;
    rp["factor"] = c.yarn.factor;
    rp["original_max_position_embeddings"] = c.yarn.original_max_position_embeddings;
    rp["beta_fast"] = c.yarn.beta_fast;
    rp["beta_slow"] = c.yarn.beta_slow;
    // Both written explicitly: with either missing transformers scales cos/sin by
    // get_mscale(factor) instead of the ratio this config means.
    double ms = c.yarn.mscale, msad = c.yarn.mscale_all_dim;
    if (ms != 0 && msad != 0) {
      rp["mscale"] = ms;
      rp["mscale_all_dim"] = msad;
    } else {
      rp["mscale"] = ms == 0 ? 1.0 : ms;
      rp["mscale_all_dim"] = msad;
      rp["attention_factor"] = yarn_mscale(c.yarn.factor, ms) / yarn_mscale(c.yarn.factor, msad);
    }
  } else {
    rp["rope_type"] = "default";
    rp["rope_theta"] = c.rope_theta;
  }
  if (mt == "mistral4") {
    if (c.llama4_scaling.enabled) rp["llama_4_scaling_beta"] = c.llama4_scaling.beta;
    else rp["llama_4_scaling_beta"] = 0.0;  // Mistral4Attention always applies it; beta 0 is identity
    if (!c.yarn.enabled) rp["original_max_position_embeddings"] = c.llama4_scaling.original_max_position_embeddings;
    rp["partial_rotary_factor"] = static_cast<double>(c.qk_rope_head_dim) / c.qk_head_dim();
  }
  j["rope_parameters"] = rp;
  if (c.moe.num_experts > 0) {
    const auto& m = c.moe;
    j["n_routed_experts"] = m.num_experts;
    j["moe_intermediate_size"] = m.expert_hidden_dim;
    j["num_experts_per_tok"] = m.num_experts_per_tok;
    j["n_shared_experts"] = m.num_shared_experts;
    j["first_k_dense_replace"] = m.first_k_dense_replace;
    j["routed_scaling_factor"] = m.routed_scale;
    j["n_group"] = m.num_expert_groups;
    j["topk_group"] = m.num_expert_groups_per_tok;
    j["norm_topk_prob"] = m.renormalize;
    if (mt != "mistral4") {
      j["scoring_func"] = "sigmoid";
      j["topk_method"] = "noaux_tc";
    }
    bool first_k = true;
    ojson types = ojson::array();
    for (const auto& l : c.layers) {
      types.push_back(l.ffn == FfnKind::kDense ? "dense" : "sparse");
      first_k &= (l.ffn == FfnKind::kDense) == (l.index < m.first_k_dense_replace);
    }
    if (!first_k || mt == "deepseek_v32") j["mlp_layer_types"] = types;
  } else {
    // No routed experts: every layer dense (transformers builds MoE from first_k_dense_replace on).
    j["first_k_dense_replace"] = c.n_layers;
    j["n_routed_experts"] = 1;
    j["moe_intermediate_size"] = c.hidden_dim;
    j["num_experts_per_tok"] = 1;
    j["n_shared_experts"] = 0;
    j["n_group"] = 1;
    j["topk_group"] = 1;
    if (mt == "deepseek_v32") j["mlp_layer_types"] = std::vector<std::string>(c.n_layers, "dense");
  }
  if (mt == "deepseek_v32") {
    j["index_n_heads"] = c.indexer.n_heads;
    j["index_head_dim"] = c.indexer.head_dim;
    j["index_topk"] = c.indexer.topk;
  }
  if (mt == "deepseek_v3") j["num_nextn_predict_layers"] = 0;  // no DeepSeek MTP weights
  if (c.weight_format != WeightFormat::kBF16) j["quantization_config"] = hf_quantization_json(c.weight_format);
  j["dtype"] = "bfloat16";
  return j.dump(2) + "\n";
}

}  // namespace ml4
