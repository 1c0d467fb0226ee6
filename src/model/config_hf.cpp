// HF config.json (mistral4, deepseek_v3, deepseek_v32) <-> ModelConfig.
//
// Semantics follow transformers 5.17: models/mistral4 (softmax routing, llama-4 scaling
// read from rope_parameters), models/deepseek_v3 and deepseek_v32 (sigmoid routing with
// e_score_correction_bias, the v32 indexer on every layer), and
// modeling_rope_utils._compute_yarn_parameters for the YaRN attention factor. The field map
// is in docs/MODEL-FORMAT.md section 2.
#include <cmath>
#include <map>
#include <set>

#include "core/log.h"
#include "model/config_json.h"
#include "model/config_loader.h"
#include "model/weight_names.h"

namespace ml4 {
namespace {

using namespace config_json;

// Picks `mscale` so that our cos/sin factor mscale(f, mscale) / mscale(f, mscale_all_dim)
// equals the attention factor `a` transformers would use.
Status set_cos_sin_factor(YarnConfig& y, double a) {
  double target = a * yarn_mscale(y.factor, y.mscale_all_dim);
  if (y.factor <= 1.0) {
    if (std::fabs(a - 1.0) > 1e-12) return unimplemented("yarn attention_factor {} with factor <= 1 is not supported", a);
    return ok_status();
  }
  y.mscale = (target - 1.0) / (0.1 * std::log(y.factor));
  return ok_status();
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
  return ok_status();
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

const std::set<std::string> kHfModelTypes = {"mistral4", "deepseek_v3", "deepseek_v32"};

Status parse_hf_rope(const json& j, ModelConfig& cfg) {
  const json* rp = nullptr;
  ML4_ASSIGN_OR_RETURN(const json* params, opt_object(j, "rope_parameters"));
  ML4_ASSIGN_OR_RETURN(const json* scaling, opt_object(j, "rope_scaling"));
  rp = params ? params : scaling;
  ML4_RETURN_IF_ERROR(opt_double(j, "rope_theta", &cfg.rope_theta));
  if (!rp) return ok_status();
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
  return ok_status();
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
  ML4_RETURN_IF_ERROR(opt_ints(j, {{"hidden_size", &cfg.dim},
                                   {"num_hidden_layers", &cfg.n_layers},
                                   {"num_attention_heads", &cfg.n_heads},
                                   {"intermediate_size", &cfg.hidden_dim},
                                   {"vocab_size", &cfg.vocab_size}}));
  cfg.max_position_embeddings = 4096;
  ML4_RETURN_IF_ERROR(opt_i64(j, "max_position_embeddings", &cfg.max_position_embeddings));
  ML4_RETURN_IF_ERROR(opt_double(j, "rms_norm_eps", &cfg.norm_eps));
  ML4_RETURN_IF_ERROR(opt_bool(j, "tie_word_embeddings", &cfg.tied_embeddings));
  cfg.q_lora_rank = 0;  // null -> plain q_proj
  ML4_RETURN_IF_ERROR(opt_ints(j, {{"q_lora_rank", &cfg.q_lora_rank},
                                   {"kv_lora_rank", &cfg.kv_lora_rank},
                                   {"qk_nope_head_dim", &cfg.qk_nope_head_dim},
                                   {"qk_rope_head_dim", &cfg.qk_rope_head_dim},
                                   {"v_head_dim", &cfg.v_head_dim}}));
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
    ML4_RETURN_IF_ERROR(opt_ints(j, {{"moe_intermediate_size", &moe.expert_hidden_dim},
                                     {"num_experts_per_tok", &moe.num_experts_per_tok},
                                     {"n_shared_experts", &moe.num_shared_experts},
                                     {"first_k_dense_replace", &moe.first_k_dense_replace}}));
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
    ML4_RETURN_IF_ERROR(opt_ints(j, {{"index_n_heads", &ic.n_heads}, {"index_head_dim", &ic.head_dim}, {"index_topk", &ic.topk}}));
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

}  // namespace

Result<ModelConfig> parse_hf_config_json(const std::string& json_text) {
  ML4_ASSIGN_OR_RETURN(json j, parse_json_object(json_text, "config.json"));
  ModelConfig cfg;
  Status s;
  try {
    s = parse_hf(j, cfg);
  } catch (const std::exception& e) {
    s = internal_error("unexpected JSON access error: {}", e.what());
  }
  if (!s.ok()) return s.with_context("config.json");
  return cfg;
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
  if (why.empty()) return ok_status();
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
