// Expected checkpoint tensors and the native <-> HF name map (see weight_names.h).
//
// HF names follow transformers 5.17 (models/mistral4, deepseek_v3, deepseek_v32) and vLLM's
// MistralLarge3ForCausalLM.remapping (model_executor/models/mistral_large_3.py), which maps
// Mistral native names to the DeepSeek-V3 module tree. Scale names: FP8 block scales are
// `weight_scale_inv` (DeepSeek-V3 / transformers finegrained_fp8 / vLLM), NVFP4 follows
// ModelOpt (`weight_scale` e4m3 per 16, `weight_scale_2` f32 global), MXFP4 `weight_scale`
// (e8m0 per 32).
#include "model/weight_names.h"

#include <map>

namespace ml4 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The scale tensors of linear `n` stored in format f (`experts` > 0: a fused HF expert tensor).
std::vector<ScaleTensor> linear_scales(const std::string& n, int64_t out, int64_t in, LinearFormat f, int64_t experts) {
  std::vector<ScaleTensor> scales;
  const bool fused = experts > 0;
  std::string base = n;
  if (!fused && base.size() > 7 && base.compare(base.size() - 7, 7, ".weight") == 0) base.resize(base.size() - 7);
  auto scale_name = [&](const char* suffix) { return fused ? base + "_" + suffix : base + "." + suffix; };
  auto lead = [&](Shape s) {
    if (fused) s.insert(s.begin(), experts);
    return s;
  };
  switch (f) {
    case LinearFormat::kF32:
    case LinearFormat::kBF16: break;
    case LinearFormat::kFP8Block:
      // transformers' fused FP8 experts use `gate_up_proj_scale_inv`.
      scales.push_back({fused ? base + "_scale_inv" : scale_name(kFp8BlockScaleSuffix),
                        lead({ceil_div(out, kFp8BlockSize), ceil_div(in, kFp8BlockSize)}), DType::kF32});
      break;
    case LinearFormat::kNVFP4:
      scales.push_back({scale_name(kFp4BlockScaleSuffix), lead({out, in / kNvfp4GroupSize}), DType::kF8E4M3});
      scales.push_back({scale_name(kNvfp4GlobalScaleSuffix), fused ? Shape{experts} : Shape{}, DType::kF32});
      break;
    case LinearFormat::kMXFP4:
      scales.push_back({scale_name(kFp4BlockScaleSuffix), lead({out, in / kMxfp4GroupSize}), DType::kE8M0});
      break;
  }
  return scales;
}

class Builder {
 public:
  Builder(const ModelConfig& cfg, CheckpointLayout layout) : cfg_(cfg), hf_(layout == CheckpointLayout::kHF) {}

  std::vector<ExpectedTensor> build() {
    add_param(name("tok_embeddings.weight", "model.embed_tokens.weight"), {cfg_.vocab_size, cfg_.dim}, TensorRole::kEmbedding);
    add_param(name("norm.weight", "model.norm.weight"), {cfg_.dim}, TensorRole::kNorm);
    if (!cfg_.tied_embeddings) add_linear(name("output.weight", "lm_head.weight"), cfg_.vocab_size, cfg_.dim, LinearFormat::kBF16);
    for (const auto& l : cfg_.layers) add_layer(l);
    if (cfg_.drafter.enabled) add_drafter();
    return std::move(out_);
  }

 private:
  std::string name(const std::string& native, const std::string& hf) const { return hf_ ? hf : native; }

  // Linear format implied by the checkpoint's WeightFormat for an ordinary linear.
  LinearFormat dense_format() const {
    return cfg_.weight_format == WeightFormat::kBF16 ? LinearFormat::kBF16 : LinearFormat::kFP8Block;
  }
  LinearFormat expert_format() const {
    switch (cfg_.weight_format) {
      case WeightFormat::kBF16: return LinearFormat::kBF16;
      case WeightFormat::kFP8Block: return LinearFormat::kFP8Block;
      case WeightFormat::kNVFP4Experts: return LinearFormat::kNVFP4;
      case WeightFormat::kMXFP4Experts: return LinearFormat::kMXFP4;
    }
    return LinearFormat::kBF16;
  }

  ExpectedTensor& add_param(const std::string& n, Shape shape, TensorRole role, DType dtype = DType::kBF16) {
    ExpectedTensor t;
    t.name = n;
    t.shape = std::move(shape);
    t.role = role;
    t.format = dtype == DType::kF32 ? LinearFormat::kF32 : LinearFormat::kBF16;
    t.layer = layer_;
    t.drafter = drafter_;
    out_.push_back(std::move(t));
    return out_.back();
  }

  // `n` ends in ".weight" (per-tensor linears) or is a fused HF expert name (no suffix).
  ExpectedTensor& add_linear(const std::string& n, int64_t out, int64_t in, LinearFormat f, int64_t experts = 0) {
    ExpectedTensor t;
    t.name = n;
    t.shape = experts ? Shape{experts, out, in} : Shape{out, in};
    t.role = experts ? TensorRole::kExpertsLinear : TensorRole::kLinear;
    t.format = f;
    t.layer = layer_;
    t.drafter = drafter_;
    t.scales = linear_scales(n, out, in, f, experts);
    out_.push_back(std::move(t));
    return out_.back();
  }

  // Attention block shared by decoder layers and drafter layers. `p` / `hp`: name prefixes.
  void add_attention(const std::string& p, const std::string& hp, bool owns_kv, LinearFormat f) {
    const int64_t H = cfg_.n_heads, dqk = cfg_.qk_head_dim(), dn = cfg_.qk_nope_head_dim, dv = cfg_.v_head_dim;
    const int64_t r = cfg_.kv_lora_rank, dr = cfg_.qk_rope_head_dim, D = cfg_.dim;
    add_param(name(p + "attention_norm.weight", hp + "input_layernorm.weight"), {D}, TensorRole::kNorm);
    if (cfg_.q_lora_rank > 0) {
      const int64_t q = cfg_.q_lora_rank;
      add_linear(name(p + "attention.wq_a.weight", hp + "self_attn.q_a_proj.weight"), q, D, f);
      add_param(name(p + "attention.q_a_norm.weight", hp + "self_attn.q_a_layernorm.weight"), {q}, TensorRole::kNorm);
      add_linear(name(p + "attention.wq_b.weight", hp + "self_attn.q_b_proj.weight"), H * dqk, q, f);
    } else {
      add_linear(name(p + "attention.wq.weight", hp + "self_attn.q_proj.weight"), H * dqk, D, f);
    }
    if (owns_kv) {
      add_linear(name(p + "attention.wkv_a_with_mqa.weight", hp + "self_attn.kv_a_proj_with_mqa.weight"), r + dr, D, f);
      add_param(name(p + "attention.kv_a_norm.weight", hp + "self_attn.kv_a_layernorm.weight"), {r}, TensorRole::kNorm);
    }
    add_linear(name(p + "attention.wkv_b.weight", hp + "self_attn.kv_b_proj.weight"), H * (dn + dv), r, f);
    add_linear(name(p + "attention.wo.weight", hp + "self_attn.o_proj.weight"), D, H * dv, f);
  }

  void add_swiglu(const std::string& p, const std::string& hp, int64_t hidden, LinearFormat f) {
    const int64_t D = cfg_.dim;
    add_linear(name(p + "w1.weight", hp + "gate_proj.weight"), hidden, D, f);
    add_linear(name(p + "w2.weight", hp + "down_proj.weight"), D, hidden, f);
    add_linear(name(p + "w3.weight", hp + "up_proj.weight"), hidden, D, f);
  }

  void add_layer(const LayerSpec& l) {
    layer_ = l.index;
    const std::string p = fmt::format("layers.{}.", l.index);
    const std::string hp = fmt::format("model.layers.{}.", l.index);
    const LinearFormat f = dense_format();
    const int64_t D = cfg_.dim;
    add_attention(p, hp, l.owns_kv(), f);
    if (l.ssmax) {
      add_param(name(p + "attention.ssmax_s", hp + "self_attn.ssmax_s"), {cfg_.n_heads}, TensorRole::kSsmaxScale, DType::kF32);
    }
    if (l.indexer == IndexerRole::kOwner) {
      const auto& ic = cfg_.indexer;
      const int64_t in = cfg_.q_lora_rank > 0 ? cfg_.q_lora_rank : D;  // DeepSeek-V3.2: from the q latent
      add_linear(name(p + "attention.indexer.wq.weight", hp + "self_attn.indexer.wq_b.weight"), int64_t{ic.n_heads} * ic.head_dim, in, f);
      add_linear(name(p + "attention.indexer.wk.weight", hp + "self_attn.indexer.wk.weight"), ic.head_dim, D, f);
      add_param(name(p + "attention.indexer.k_norm.weight", hp + "self_attn.indexer.k_norm.weight"), {ic.head_dim}, TensorRole::kNorm, DType::kF32);
      add_param(name(p + "attention.indexer.k_norm.bias", hp + "self_attn.indexer.k_norm.bias"), {ic.head_dim}, TensorRole::kNormBias, DType::kF32);
      // Unquantized in vLLM and kept in fp32 by transformers (_keep_in_fp32_modules).
      add_linear(name(p + "attention.indexer.weights_proj.weight", hp + "self_attn.indexer.weights_proj.weight"), ic.n_heads, D, LinearFormat::kBF16);
    }
    add_param(name(p + "ffn_norm.weight", hp + "post_attention_layernorm.weight"), {D}, TensorRole::kNorm);
    if (l.ffn == FfnKind::kDense) {
      add_swiglu(p + "feed_forward.", hp + "mlp.", cfg_.hidden_dim, f);
    } else {
      const auto& m = cfg_.moe;
      const int64_t E = m.num_experts, I = m.expert_hidden_dim;
      add_param(name(p + "gate.weight", hp + "mlp.gate.weight"), {E, D}, TensorRole::kRouterGate);
      if (m.has_correction_bias) {
        add_param(name(p + "gate.e_score_correction_bias", hp + "mlp.gate.e_score_correction_bias"), {E}, TensorRole::kCorrectionBias, DType::kF32);
      }
      const LinearFormat ef = expert_format();
      if (hf_ && hf_fused_experts(cfg_)) {
        add_linear(hp + "mlp.experts.gate_up_proj", 2 * I, D, ef, E).routed_expert = true;
        add_linear(hp + "mlp.experts.down_proj", D, I, ef, E).routed_expert = true;
      } else {
        for (int64_t e = 0; e < E; ++e) {
          size_t first = out_.size();
          add_swiglu(fmt::format("{}experts.{}.", p, e), fmt::format("{}mlp.experts.{}.", hp, e), I, ef);
          for (size_t k = first; k < out_.size(); ++k) {
            out_[k].expert = static_cast<int>(e);
            out_[k].routed_expert = true;
          }
        }
      }
      if (m.num_shared_experts > 0) add_swiglu(p + "shared_experts.", hp + "mlp.shared_experts.", I * m.num_shared_experts, f);
    }
    layer_ = -1;
  }

  // DSpark drafter (MODEL.md section 5); names defined by this project, the same in both
  // layouts, all bf16 (the drafter is small). See docs/MODEL-FORMAT.md.
  void add_drafter() {
    drafter_ = true;
    const bool hf = hf_;
    hf_ = false;  // drafter names are the same in both layouts
    const auto& d = cfg_.drafter;
    const int64_t D = cfg_.dim, r = d.rnn_rank, V = cfg_.vocab_size;
    const std::string p = "mtp_dspark.";
    add_linear(p + "fc.weight", D, D * static_cast<int64_t>(d.target_layers.size()), LinearFormat::kBF16);
    add_param(p + "fc_norm.weight", {D}, TensorRole::kNorm);
    add_param(p + "mask_embed", {d.block_size - 1, D}, TensorRole::kEmbedding);
    for (int i = 0; i < d.n_layers; ++i) {
      const std::string lp = fmt::format("{}layers.{}.", p, i);
      add_attention(lp, lp, /*owns_kv=*/true, LinearFormat::kBF16);
      add_param(lp + "ffn_norm.weight", {D}, TensorRole::kNorm);
      add_linear(lp + "feed_forward.w1.weight", cfg_.hidden_dim, D, LinearFormat::kBF16);
      add_linear(lp + "feed_forward.w2.weight", D, cfg_.hidden_dim, LinearFormat::kBF16);
      add_linear(lp + "feed_forward.w3.weight", cfg_.hidden_dim, D, LinearFormat::kBF16);
    }
    add_param(p + "norm.weight", {D}, TensorRole::kNorm);
    // Markov head: a GRU cell (torch.nn.GRUCell layout) over [slot output ; previous draft
    // token embedding], its state projected to a logit bias.
    add_param(p + "markov.embed.weight", {V, r}, TensorRole::kEmbedding);
    add_linear(p + "markov.weight_ih", 3 * r, D + r, LinearFormat::kBF16);
    add_linear(p + "markov.weight_hh", 3 * r, r, LinearFormat::kBF16);
    add_param(p + "markov.bias_ih", {3 * r}, TensorRole::kNormBias);
    add_param(p + "markov.bias_hh", {3 * r}, TensorRole::kNormBias);
    add_linear(p + "markov.out.weight", V, r, LinearFormat::kBF16);
    drafter_ = false;
    hf_ = hf;
  }

  const ModelConfig& cfg_;
  bool hf_;
  int layer_ = -1;
  bool drafter_ = false;
  std::vector<ExpectedTensor> out_;
};

// ------------------------------------------------------------------ name map

// Module paths inside a decoder layer: native -> HF (after "layers.N." / "model.layers.N.").
const std::vector<std::pair<std::string, std::string>>& layer_modules() {
  static const std::vector<std::pair<std::string, std::string>> m = {
      {"attention_norm", "input_layernorm"},
      {"attention.wq", "self_attn.q_proj"},
      {"attention.wq_a", "self_attn.q_a_proj"},
      {"attention.q_a_norm", "self_attn.q_a_layernorm"},
      {"attention.wq_b", "self_attn.q_b_proj"},
      {"attention.wkv_a_with_mqa", "self_attn.kv_a_proj_with_mqa"},
      {"attention.kv_a_norm", "self_attn.kv_a_layernorm"},
      {"attention.wkv_b", "self_attn.kv_b_proj"},
      {"attention.wo", "self_attn.o_proj"},
      {"attention.indexer.wq", "self_attn.indexer.wq_b"},
      {"attention.indexer.wk", "self_attn.indexer.wk"},
      {"attention.indexer.k_norm", "self_attn.indexer.k_norm"},
      {"attention.indexer.weights_proj", "self_attn.indexer.weights_proj"},
      {"attention.ssmax_s", "self_attn.ssmax_s"},
      {"ffn_norm", "post_attention_layernorm"},
      {"feed_forward.w1", "mlp.gate_proj"},
      {"feed_forward.w2", "mlp.down_proj"},
      {"feed_forward.w3", "mlp.up_proj"},
      {"gate", "mlp.gate"},
      {"gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias"},
      {"shared_experts.w1", "mlp.shared_experts.gate_proj"},
      {"shared_experts.w2", "mlp.shared_experts.down_proj"},
      {"shared_experts.w3", "mlp.shared_experts.up_proj"},
  };
  return m;
}

const std::vector<std::pair<std::string, std::string>>& global_modules() {
  static const std::vector<std::pair<std::string, std::string>> m = {
      {"tok_embeddings", "model.embed_tokens"}, {"norm", "model.norm"}, {"output", "lm_head"}};
  return m;
}

const std::vector<std::string>& leaves() {
  static const std::vector<std::string> l = {"weight", "bias", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale"};
  return l;
}

// "12.rest" -> (12, "rest"); false if no leading layer number.
bool split_index(const std::string& s, int64_t* idx, std::string* rest) {
  size_t dot = s.find('.');
  if (dot == 0 || dot == std::string::npos) return false;
  for (size_t i = 0; i < dot; ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
  }
  if (dot > 9) return false;
  *idx = std::stoll(s.substr(0, dot));
  *rest = s.substr(dot + 1);
  return true;
}

// Maps `path` (module path + optional leaf) through `table` (from -> to, direction chosen
// by the caller). Exact parameter names are tried first, then module + known leaf.
bool map_path(const std::string& path, const std::vector<std::pair<std::string, std::string>>& table, bool forward,
              std::string* out) {
  for (const auto& [a, b] : table) {
    const std::string& from = forward ? a : b;
    const std::string& to = forward ? b : a;
    if (path == from) {
      *out = to;
      return true;
    }
  }
  for (const auto& leaf : leaves()) {
    if (path.size() > leaf.size() + 1 && path.compare(path.size() - leaf.size() - 1, leaf.size() + 1, "." + leaf) == 0) {
      std::string module = path.substr(0, path.size() - leaf.size() - 1);
      for (const auto& [a, b] : table) {
        if (module == (forward ? a : b)) {
          *out = (forward ? b : a) + "." + leaf;
          return true;
        }
      }
    }
  }
  return false;
}

bool map_expert(const std::string& rest, bool forward, std::string* out) {
  static const std::vector<std::pair<std::string, std::string>> w = {{"w1", "gate_proj"}, {"w2", "down_proj"}, {"w3", "up_proj"}};
  const std::string prefix = forward ? "experts." : "mlp.experts.";
  if (rest.compare(0, prefix.size(), prefix) != 0) return false;
  int64_t e = 0;
  std::string tail;
  if (!split_index(rest.substr(prefix.size()), &e, &tail)) return false;
  std::string mapped;
  if (!map_path(tail, w, forward, &mapped)) return false;
  *out = fmt::format("{}{}.{}", forward ? "mlp.experts." : "experts.", e, mapped);
  return true;
}

}  // namespace

const char* tensor_role_name(TensorRole r) {
  switch (r) {
    case TensorRole::kLinear: return "linear";
    case TensorRole::kExpertsLinear: return "experts_linear";
    case TensorRole::kNorm: return "norm";
    case TensorRole::kNormBias: return "norm_bias";
    case TensorRole::kEmbedding: return "embedding";
    case TensorRole::kRouterGate: return "router_gate";
    case TensorRole::kCorrectionBias: return "correction_bias";
    case TensorRole::kSsmaxScale: return "ssmax_scale";
  }
  return "?";
}

DType ExpectedTensor::stored_dtype() const {
  switch (format) {
    case LinearFormat::kF32: return DType::kF32;
    case LinearFormat::kBF16: return DType::kBF16;
    case LinearFormat::kFP8Block: return DType::kF8E4M3;
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4: return DType::kF4E2M1x2;
  }
  return DType::kBF16;
}

Shape ExpectedTensor::stored_shape() const {
  Shape s = shape;
  if ((format == LinearFormat::kNVFP4 || format == LinearFormat::kMXFP4) && !s.empty()) s.back() /= 2;
  return s;
}

bool hf_fused_experts(const ModelConfig& cfg) { return cfg.hf_model_type == "mistral4"; }

std::vector<ExpectedTensor> expected_tensors(const ModelConfig& cfg, CheckpointLayout layout) {
  return Builder(cfg, layout).build();
}

ExpectedTensor stored_as(const ExpectedTensor& t, LinearFormat f) {
  ExpectedTensor r = t;
  const bool fused = t.shape.size() == 3;
  r.format = f;
  r.scales = linear_scales(t.name, t.shape[fused ? 1 : 0], t.shape[fused ? 2 : 1], f, fused ? t.shape[0] : 0);
  return r;
}

Result<std::string> hf_name_from_native(const std::string& n) {
  if (n.compare(0, 11, "mtp_dspark.") == 0) return n;
  std::string out;
  if (map_path(n, global_modules(), true, &out)) return out;
  int64_t layer = 0;
  std::string rest;
  if (n.compare(0, 7, "layers.") == 0 && split_index(n.substr(7), &layer, &rest)) {
    if (map_path(rest, layer_modules(), true, &out) || map_expert(rest, true, &out)) {
      return fmt::format("model.layers.{}.{}", layer, out);
    }
  }
  return not_found("no HF name for native tensor \"{}\"", n);
}

Result<std::string> native_name_from_hf(const std::string& n) {
  if (n.compare(0, 11, "mtp_dspark.") == 0) return n;
  std::string out;
  if (map_path(n, global_modules(), false, &out)) return out;
  int64_t layer = 0;
  std::string rest;
  if (n.compare(0, 13, "model.layers.") == 0 && split_index(n.substr(13), &layer, &rest)) {
    if (rest.compare(0, 24, "mlp.experts.gate_up_proj") == 0 || rest.compare(0, 21, "mlp.experts.down_proj") == 0) {
      return invalid_argument("HF tensor \"{}\" holds all experts fused; it has no single native name", n);
    }
    if (map_path(rest, layer_modules(), false, &out) || map_expert(rest, false, &out)) {
      return fmt::format("layers.{}.{}", layer, out);
    }
  }
  return not_found("no native name for HF tensor \"{}\"", n);
}

std::vector<int> hf_rope_row_permutation(int rope_dim, bool rope_interleave) {
  std::vector<int> perm(rope_dim);
  for (int j = 0; j < rope_dim; ++j) {
    if (rope_interleave) perm[j] = j;
    else perm[j] = j < rope_dim / 2 ? 2 * j : 2 * (j - rope_dim / 2) + 1;
  }
  return perm;
}

ParamCounts count_parameters(const ModelConfig& cfg) {
  ParamCounts c;
  const double active_frac = cfg.moe.num_experts > 0 ? static_cast<double>(cfg.moe.num_experts_per_tok) / cfg.moe.num_experts : 0;
  double routed = 0;
  for (const auto& t : expected_tensors(cfg, CheckpointLayout::kMistral)) {
    if (t.drafter) {
      c.drafter += t.numel();
      continue;
    }
    c.total += t.numel();
    if (t.name == "tok_embeddings.weight" || t.name == "output.weight") {
      c.embeddings += t.numel();
    } else if (t.routed_expert) {
      routed += static_cast<double>(t.numel());
    } else {
      c.active += t.numel();
    }
  }
  c.active += static_cast<int64_t>(routed * active_frac + 0.5);
  return c;
}

}  // namespace ml4
