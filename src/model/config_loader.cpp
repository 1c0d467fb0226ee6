// params.json -> ModelConfig and back, validation, and model directories (see
// config_loader.h for the design; config_hf.cpp holds the HF config.json side and
// config_json.h the shared typed readers and layer resolver).
//
// Parsing fills the global fields and a LayerPlan; build_layers() turns the plan into
// LayerSpecs and validate_model_config() checks the result (the same checks run on
// hand-built configs). The Mistral native keys follow vLLM's
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

#include "core/log.h"
#include "model/config_json.h"
#include "model/linear_weight.h"

namespace ml4 {
namespace {

using namespace config_json;

Status parse_weight_format_native(const json& q, WeightFormat* out) {
  // Mistral: {"qformat_weight": "fp8_e4m3", ...}; this project adds weight_block_size and
  // qformat_experts. Per-tensor FP8 (Mistral's qscale_weight) is not a format ml4 runs.
  if (q.empty()) {
    *out = WeightFormat::kBF16;
    return ok_status();
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
    return ok_status();
  }
  if (w != "fp8_e4m3") return invalid_argument("unknown quantization qformat_weight \"{}\" (supported: fp8_e4m3, bf16)", w);
  if (block != std::vector<int>{128, 128}) {
    return unimplemented("quantization: FP8 needs \"weight_block_size\": [128, 128] (block-scaled); per-tensor FP8 is not supported");
  }
  if (experts.empty() || experts == "fp8_e4m3") *out = WeightFormat::kFP8Block;
  else if (experts == "nvfp4") *out = WeightFormat::kNVFP4Experts;
  else if (experts == "mxfp4") *out = WeightFormat::kMXFP4Experts;
  else return invalid_argument("unknown quantization qformat_experts \"{}\" (supported: fp8_e4m3, nvfp4, mxfp4)", experts);
  return ok_status();
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

const std::set<std::string> kNativeKeys = {
    "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "norm_eps", "vocab_size", "activation",
    "max_position_embeddings", "max_seq_len", "tied_embeddings", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_theta", "yarn", "llama_4_scaling",
    "moe", "quantization", "vision_encoder", "indexer", "kv_sharing", "nope_layer_interval",
    "nope_layers", "ssmax", "lerope", "mtp"};

const std::set<std::string> kNativeMoeKeys = {
    "num_experts", "num_experts_per_tok", "expert_hidden_dim", "first_k_dense_replace", "num_shared_experts",
    "routed_scale", "num_expert_groups", "num_expert_groups_per_tok", "route_every_n", "scoring_func",
    "correction_bias", "norm_topk_prob", "dense_layers", "use_load_balancing_bias", "renorm_strategy",
    "expert_parallel", "expert_model_parallel"};

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
  return ok_status();
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
  std::string activation = "silu";
  ML4_RETURN_IF_ERROR(opt_string(j, "activation", &activation));
  if (activation != "silu") return unimplemented("\"activation\": \"{}\" (ml4 runs SwiGLU, \"silu\")", activation);
  ML4_RETURN_IF_ERROR(opt_ints(j, {{"dim", &cfg.dim},
                                   {"n_layers", &cfg.n_layers},
                                   {"n_heads", &cfg.n_heads},
                                   {"hidden_dim", &cfg.hidden_dim},
                                   {"vocab_size", &cfg.vocab_size}}));
  ML4_RETURN_IF_ERROR(opt_double(j, "norm_eps", &cfg.norm_eps));
  cfg.max_position_embeddings = 0;
  ML4_RETURN_IF_ERROR(opt_i64(j, "max_seq_len", &cfg.max_position_embeddings));
  ML4_RETURN_IF_ERROR(opt_i64(j, "max_position_embeddings", &cfg.max_position_embeddings));
  if (cfg.max_position_embeddings == 0) return invalid_argument("missing required key \"max_position_embeddings\" (or \"max_seq_len\")");
  ML4_RETURN_IF_ERROR(opt_bool(j, "tied_embeddings", &cfg.tied_embeddings));
  ML4_RETURN_IF_ERROR(opt_ints(j, {{"q_lora_rank", &cfg.q_lora_rank},
                                   {"kv_lora_rank", &cfg.kv_lora_rank},
                                   {"qk_nope_head_dim", &cfg.qk_nope_head_dim},
                                   {"qk_rope_head_dim", &cfg.qk_rope_head_dim},
                                   {"v_head_dim", &cfg.v_head_dim}}));
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
      return ok_status();
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
      return ok_status();
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

Status validate_model_config(const ModelConfig& c) {
  auto pos = [](const char* k, int64_t v) -> Status {
    if (v <= 0) return invalid_argument("{} must be > 0, found {}", k, v);
    return ok_status();
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
  return ok_status();
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
  if (!s.ok()) return s.with_context("params.json");
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

const std::set<std::string>& native_params_keys() { return kNativeKeys; }
const std::set<std::string>& native_moe_keys() { return kNativeMoeKeys; }

std::string params_json_from_config(const ModelConfig& c) {
  // Every key of Mistral's native schema (as Mistral's own params.json files and the two
  // readers of them, vLLM's transformers_utils/configs/mistral.py and llama.cpp's
  // conversion/mistral.py, spell it), then the ML4 blocks. MLA has one KV head per query
  // head, so n_kv_heads = n_heads (what vLLM's adapter maps to num_key_value_heads).
  ojson j;
  j["dim"] = c.dim;
  j["n_layers"] = c.n_layers;
  j["head_dim"] = c.qk_head_dim();
  j["hidden_dim"] = c.hidden_dim;
  j["n_heads"] = c.n_heads;
  j["n_kv_heads"] = c.n_heads;
  j["rope_theta"] = c.rope_theta;
  j["norm_eps"] = c.norm_eps;
  j["vocab_size"] = c.vocab_size;
  j["tied_embeddings"] = c.tied_embeddings;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["max_seq_len"] = c.max_position_embeddings;
  j["activation"] = "silu";
  if (c.q_lora_rank > 0) j["q_lora_rank"] = c.q_lora_rank;
  else j["q_lora_rank"] = nullptr;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["v_head_dim"] = c.v_head_dim;
  if (c.yarn.enabled) {
    // Mistral's five keys; mscale / mscale_all_dim (ML4) only when they differ from what
    // those imply (1 and 1), since vLLM's adapter refuses keys it does not know here.
    j["yarn"] = {{"factor", c.yarn.factor},
                 {"original_max_position_embeddings", c.yarn.original_max_position_embeddings},
                 {"beta", c.yarn.beta_fast},
                 {"alpha", c.yarn.beta_slow},
                 {"apply_scale", true}};
    if (c.yarn.mscale != 1.0 || c.yarn.mscale_all_dim != 1.0) {
      j["yarn"]["mscale"] = c.yarn.mscale;
      j["yarn"]["mscale_all_dim"] = c.yarn.mscale_all_dim;
    }
  }
  if (c.llama4_scaling.enabled) {
    j["llama_4_scaling"] = {{"original_max_position_embeddings", c.llama4_scaling.original_max_position_embeddings},
                            {"beta", c.llama4_scaling.beta}};
  }
  if (c.moe.num_experts > 0) {
    const auto& m = c.moe;
    ojson mo = {{"route_every_n", 1},
                {"first_k_dense_replace", m.first_k_dense_replace},
                {"num_experts", m.num_experts},
                {"num_experts_per_tok", m.num_experts_per_tok},
                {"num_expert_groups", m.num_expert_groups},
                {"num_expert_groups_per_tok", m.num_expert_groups_per_tok},
                {"routed_scale", m.routed_scale},
                {"expert_hidden_dim", m.expert_hidden_dim},
                {"num_shared_experts", m.num_shared_experts}};
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

}  // namespace ml4
