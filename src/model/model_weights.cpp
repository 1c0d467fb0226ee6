// Binds checkpoint tensors to ModelWeights. Names are written here in the Mistral native
// form (MODEL.md section 2) and translated for HF checkpoints with hf_name_from_native();
// HF mistral4 checkpoints hold routed experts fused ([E, 2I, H] gate_up, [E, H, I] down),
// which are sliced into per-expert views. Every tensor read is recorded: a checkpoint
// tensor nobody read is "unknown", a tensor the spec needs that is absent is "missing".
#include "model/model_weights.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "model/quant.h"
#include "model/weight_memory.h"
#include "model/weight_names.h"

namespace ml4 {
namespace {

class Binder {
 public:
  Binder(const ModelConfig& cfg, const Checkpoint& ckpt) : cfg_(cfg), ckpt_(ckpt) {}

  Result<std::string> resolve(const std::string& native) const {
    if (cfg_.layout == CheckpointLayout::kMistral) return native;
    return hf_name_from_native(native);
  }

  bool has(const std::string& native) const {
    auto n = resolve(native);
    return n.ok() && ckpt_.contains(n.value());
  }

  Result<Tensor> raw(const std::string& native) {
    ML4_ASSIGN_OR_RETURN(std::string name, resolve(native));
    if (!ckpt_.contains(name)) return not_found("missing tensor {}", name);
    used_.insert(name);
    return ckpt_.get(name);
  }

  // A vector of `n` values stored as f32/bf16/f16, returned as f32.
  Result<std::vector<float>> vec(const std::string& native, int64_t n) {
    ML4_ASSIGN_OR_RETURN(Tensor t, raw(native));
    std::string name = resolve(native).value();
    if (t.rank() != 1 || t.dim(0) != n)
      return invalid_argument("tensor {}: expected [{}], found {}", name, n, t.describe());
    if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16 && t.dtype() != DType::kF16)
      return invalid_argument("tensor {}: expected f32/bf16/f16, found {}", name, t.describe());
    Tensor f = to_f32(t);
    return std::vector<float>(f.as<float>(), f.as<float>() + n);
  }

  // `base` without the ".weight" suffix; the stored dtype decides the format.
  Result<LinearWeight> linear(const std::string& base, int64_t N, int64_t K) {
    const std::string wname = base + ".weight";
    ML4_ASSIGN_OR_RETURN(Tensor w, raw(wname));
    return linear_from(base, w, N, K);
  }

  Result<LinearWeight> linear_from(const std::string& base, const Tensor& w, int64_t N, int64_t K) {
    auto resolved = resolve(base + ".weight");
    const std::string name = resolved.ok() ? resolved.value() : base + ".weight";
    switch (w.dtype()) {
      case DType::kF32:
        return make_linear_weight(name, LinearFormat::kF32, N, K, w);
      case DType::kBF16:
        return make_linear_weight(name, LinearFormat::kBF16, N, K, w);
      case DType::kF8E4M3: {
        ML4_ASSIGN_OR_RETURN(Tensor s, raw(base + "." + kFp8BlockScaleSuffix));
        return make_linear_weight(name, LinearFormat::kFP8Block, N, K, w, s);
      }
      case DType::kU8:
      case DType::kF4E2M1x2: {
        ML4_ASSIGN_OR_RETURN(Tensor s, raw(base + "." + kFp4BlockScaleSuffix));
        if (s.dtype() == DType::kF8E4M3) {
          ML4_ASSIGN_OR_RETURN(Tensor g, raw(base + "." + kNvfp4GlobalScaleSuffix));
          if (g.numel() != 1 || g.dtype() != DType::kF32)
            return invalid_argument("tensor {}.{}: expected one f32, found {}", base, kNvfp4GlobalScaleSuffix, g.describe());
          return make_linear_weight(name, LinearFormat::kNVFP4, N, K, w, s, g.as<float>()[0]);
        }
        return make_linear_weight(name, LinearFormat::kMXFP4, N, K, w, s);
      }
      default:
        return invalid_argument("tensor {}: dtype {} is not a weight format", name, dtype_name(w.dtype()));
    }
  }

  // A linear another rank holds (expert parallelism): its tensors count as read.
  void skip_linear(const std::string& base) {
    for (const char* suffix : {"weight", kFp8BlockScaleSuffix, kFp4BlockScaleSuffix, kNvfp4GlobalScaleSuffix}) {
      auto n = resolve(base + "." + suffix);
      if (n.ok() && ckpt_.contains(n.value())) used_.insert(n.value());
    }
  }

  Status check_all_used() const {
    for (const auto& n : ckpt_.names()) {
      // The DSpark drafter's tensors belong to the drafter runner (S7), not the target.
      if (cfg_.drafter.enabled && n.rfind("mtp_dspark.", 0) == 0) continue;
      if (!used_.count(n)) return invalid_argument("unknown tensor {} (not part of this model's layer spec)", n);
    }
    return ok_status();
  }

  const ModelConfig& cfg_;
  const Checkpoint& ckpt_;
  std::set<std::string> used_;
};

// HF checkpoints with `rope_interleave: false` store each rope segment in rotate_half order:
// stored row j of a segment holds interleaved (native) row perm[j]
// (hf_rope_row_permutation). Rows [offset, offset + dr) of every `group`-row block of `w`
// are put back in native order. Unquantized weights (bf16, f32) keep their format (rows are
// independent, so moving their bytes is exact and the model runs the same kernels as on the
// native layout, bit for bit); block-quantized ones become an owned f32 weight (exact: every
// stored format decodes exactly to f32), since a scale block may span moved and kept rows.
LinearWeight unpermute_rope_rows(const LinearWeight& w, int64_t group, int64_t offset, int dr) {
  const std::vector<int> perm = hf_rope_row_permutation(dr, false);
  const int64_t K = w.in_features;
  if (w.format == LinearFormat::kBF16 || w.format == LinearFormat::kF32) {
    const size_t row = static_cast<size_t>(K) * dtype_size(w.weight.dtype());
    Tensor t(w.weight.dtype(), w.weight.shape());
    const auto* s = static_cast<const uint8_t*>(w.weight.data());
    auto* d = static_cast<uint8_t*>(t.mutable_data());
    std::copy(s, s + w.weight.nbytes(), d);
    for (int64_t g = 0; g < w.out_features / group; ++g)
      for (int j = 0; j < dr; ++j)
        std::copy_n(s + (g * group + offset + j) * row, row, d + (g * group + offset + perm[j]) * row);
    LinearWeight o = w;
    o.weight = t;
    return o;
  }
  std::vector<float> src = dequantize_linear(w);
  Tensor t(DType::kF32, {w.out_features, K});
  float* dst = t.mutable_as<float>();
  std::copy(src.begin(), src.end(), dst);
  for (int64_t g = 0; g < w.out_features / group; ++g)
    for (int j = 0; j < dr; ++j)
      std::copy_n(src.data() + (g * group + offset + j) * K, K, dst + (g * group + offset + perm[j]) * K);
  LinearWeight o = w;
  o.format = LinearFormat::kF32;
  o.weight = t;
  o.scale = Tensor();
  o.global_scale = 1.0f;
  return o;
}

// A [rows, cols] slice of a fused [E, R, C] tensor (HF fused experts), as a view.
Tensor slice_rows(const Tensor& t, int64_t e, int64_t row0, int64_t rows) {
  const int64_t R = t.dim(1), C = t.dim(2);
  const size_t esz = dtype_size(t.dtype());
  const uint8_t* base = static_cast<const uint8_t*>(t.data()) + (static_cast<size_t>(e) * R + row0) * C * esz;
  return Tensor::view(t.dtype(), {rows, C}, base, nullptr);
}

// [begin, begin + count) of a dimension of `total`; the whole of it when count < 0.
struct Range {
  int64_t begin = 0, count = 0;
};
Range pick(int64_t begin, int64_t count, int64_t total) { return count < 0 ? Range{0, total} : Range{begin, count}; }

// A SwiGLU MLP's hidden slice: w1 / w3 rows, w2 columns.
Status slice_mlp(MlpWeights& m, Range r) {
  ML4_ASSIGN_OR_RETURN(m.w1, slice_linear_rows(m.w1, r.begin, r.count));
  ML4_ASSIGN_OR_RETURN(m.w3, slice_linear_rows(m.w3, r.begin, r.count));
  ML4_ASSIGN_OR_RETURN(m.w2, slice_linear_cols(m.w2, r.begin, r.count));
  return ok_status();
}

Status requantize_expert(LinearWeight& w) {
  if (w.format != LinearFormat::kFP8Block) return ok_status();
  ML4_ASSIGN_OR_RETURN(w, requantize_fp8_to_mxfp4(w));
  return ok_status();
}

Status load_layer(const ModelConfig& cfg, int l, Binder& b, LayerWeights& LW, const WeightLoadOptions& opts) {
  const LayerSpec& spec = cfg.layers[l];
  const std::string p = fmt::format("layers.{}.", l);
  const int64_t D = cfg.dim, H = cfg.n_heads, dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim;
  const int64_t dv = cfg.v_head_dim, r = cfg.kv_lora_rank;
  static const WeightShard kWhole;
  const WeightShard& S = opts.shard != nullptr ? *opts.shard : kWhole;
  const Range hr = pick(S.head_begin, S.heads, H);  // this rank's heads
  ML4_ASSIGN_OR_RETURN(LW.attention_norm, b.vec(p + "attention_norm.weight", D));
  ML4_ASSIGN_OR_RETURN(LW.ffn_norm, b.vec(p + "ffn_norm.weight", D));
  AttentionWeights& A = LW.attn;
  const std::string pa = p + "attention.";
  if (cfg.q_lora_rank > 0) {
    ML4_ASSIGN_OR_RETURN(A.wq_a, b.linear(pa + "wq_a", cfg.q_lora_rank, D));
    ML4_ASSIGN_OR_RETURN(A.q_a_norm, b.vec(pa + "q_a_norm.weight", cfg.q_lora_rank));
    ML4_ASSIGN_OR_RETURN(A.wq_b, b.linear(pa + "wq_b", H * (dn + dr), cfg.q_lora_rank));
    ML4_ASSIGN_OR_RETURN(A.wq_b, slice_linear_rows(A.wq_b, hr.begin * (dn + dr), hr.count * (dn + dr)));
  } else {
    ML4_ASSIGN_OR_RETURN(A.wq, b.linear(pa + "wq", H * (dn + dr), D));
    ML4_ASSIGN_OR_RETURN(A.wq, slice_linear_rows(A.wq, hr.begin * (dn + dr), hr.count * (dn + dr)));
  }
  if (spec.owns_kv()) {
    ML4_ASSIGN_OR_RETURN(A.wkv_a, b.linear(pa + "wkv_a_with_mqa", r + dr, D));
    ML4_ASSIGN_OR_RETURN(A.kv_a_norm, b.vec(pa + "kv_a_norm.weight", r));
  }
  if (!cfg.rope_interleave) {
    LinearWeight& wq = cfg.q_lora_rank > 0 ? A.wq_b : A.wq;
    wq = unpermute_rope_rows(wq, dn + dr, dn, static_cast<int>(dr));
    if (spec.owns_kv()) A.wkv_a = unpermute_rope_rows(A.wkv_a, r + dr, r, static_cast<int>(dr));
  }
  ML4_ASSIGN_OR_RETURN(A.wkv_b, b.linear(pa + "wkv_b", H * (dn + dv), r));
  ML4_ASSIGN_OR_RETURN(A.wkv_b, slice_linear_rows(A.wkv_b, hr.begin * (dn + dv), hr.count * (dn + dv)));
  ML4_ASSIGN_OR_RETURN(A.wo, b.linear(pa + "wo", D, H * dv));
  ML4_ASSIGN_OR_RETURN(A.wo, slice_linear_cols(A.wo, hr.begin * dv, hr.count * dv));
  if (spec.ssmax) {
    ML4_ASSIGN_OR_RETURN(A.ssmax_s, b.vec(pa + "ssmax_s", H));
    A.ssmax_s = std::vector<float>(A.ssmax_s.begin() + hr.begin, A.ssmax_s.begin() + hr.begin + hr.count);
  }
  if (spec.indexer == IndexerRole::kOwner) {
    auto I = std::make_unique<IndexerWeights>();
    const std::string pi = pa + "indexer.";
    const int64_t HI = cfg.indexer.n_heads, dI = cfg.indexer.head_dim;
    const int64_t qin = cfg.q_lora_rank > 0 ? cfg.q_lora_rank : D;
    ML4_ASSIGN_OR_RETURN(I->wq, b.linear(pi + "wq", HI * dI, qin));
    ML4_ASSIGN_OR_RETURN(I->wk, b.linear(pi + "wk", dI, D));
    ML4_ASSIGN_OR_RETURN(I->k_norm_weight, b.vec(pi + "k_norm.weight", dI));
    ML4_ASSIGN_OR_RETURN(I->k_norm_bias, b.vec(pi + "k_norm.bias", dI));
    ML4_ASSIGN_OR_RETURN(I->weights_proj, b.linear(pi + "weights_proj", HI, D));
    A.indexer = std::move(I);
  }
  FfnWeights& F = LW.ffn;
  switch (spec.ffn) {
    case FfnKind::kDense: {
      const int64_t I = cfg.hidden_dim;
      ML4_ASSIGN_OR_RETURN(F.dense.w1, b.linear(p + "feed_forward.w1", I, D));
      ML4_ASSIGN_OR_RETURN(F.dense.w2, b.linear(p + "feed_forward.w2", D, I));
      ML4_ASSIGN_OR_RETURN(F.dense.w3, b.linear(p + "feed_forward.w3", I, D));
      ML4_RETURN_IF_ERROR(slice_mlp(F.dense, pick(S.dense_begin, S.dense, I)));
      break;
    }
    case FfnKind::kMoe: {
      const int64_t E = cfg.moe.num_experts, I = cfg.moe.expert_hidden_dim;
      const Range er = pick(S.expert_begin, S.experts, E);  // the routed experts this rank holds
      const Range eh = pick(S.expert_hidden_begin, S.expert_hidden, I);
      auto mine = [&](int64_t e) { return e >= er.begin && e < er.begin + er.count; };
      ML4_ASSIGN_OR_RETURN(F.gate, b.linear(p + "gate", E, D));
      if (cfg.moe.has_correction_bias) {
        ML4_ASSIGN_OR_RETURN(F.correction_bias, b.vec(p + "gate.e_score_correction_bias", E));
      }
      F.experts.resize(er.count);
      if (cfg.layout == CheckpointLayout::kHF && hf_fused_experts(cfg)) {
        const std::string pe = fmt::format("model.layers.{}.mlp.experts.", l);
        if (!b.ckpt_.contains(pe + "gate_up_proj") || !b.ckpt_.contains(pe + "down_proj"))
          return not_found("missing tensor {}gate_up_proj / down_proj", pe);
        b.used_.insert(pe + "gate_up_proj");
        b.used_.insert(pe + "down_proj");
        ML4_ASSIGN_OR_RETURN(Tensor gu, b.ckpt_.get(pe + "gate_up_proj"));
        ML4_ASSIGN_OR_RETURN(Tensor dw, b.ckpt_.get(pe + "down_proj"));
        if (gu.shape() != Shape{E, 2 * I, D} || dw.shape() != Shape{E, D, I})
          return invalid_argument("tensor {}gate_up_proj/down_proj: expected [{}, {}, {}] and [{}, {}, {}], found {} and {}",
                                  pe, E, 2 * I, D, E, D, I, gu.describe(), dw.describe());
        for (int64_t e = er.begin; e < er.begin + er.count; ++e) {
          const std::string pn = fmt::format("{}{}", pe, e);
          MlpWeights& X = F.experts[e - er.begin];
          ML4_ASSIGN_OR_RETURN(X.w1, b.linear_from(pn + ".gate", slice_rows(gu, e, 0, I), I, D));
          ML4_ASSIGN_OR_RETURN(X.w3, b.linear_from(pn + ".up", slice_rows(gu, e, I, I), I, D));
          ML4_ASSIGN_OR_RETURN(X.w2, b.linear_from(pn + ".down", slice_rows(dw, e, 0, D), D, I));
        }
      } else {
        for (int64_t e = 0; e < E; ++e) {
          const std::string pe = fmt::format("{}experts.{}.", p, e);
          if (!mine(e)) {  // another rank's expert (EP): its tensors are never touched
            for (const char* w : {"w1", "w2", "w3"}) b.skip_linear(pe + w);
            continue;
          }
          MlpWeights& X = F.experts[e - er.begin];
          ML4_ASSIGN_OR_RETURN(X.w1, b.linear(pe + "w1", I, D));
          ML4_ASSIGN_OR_RETURN(X.w2, b.linear(pe + "w2", D, I));
          ML4_ASSIGN_OR_RETURN(X.w3, b.linear(pe + "w3", I, D));
        }
      }
      for (auto& X : F.experts) ML4_RETURN_IF_ERROR(slice_mlp(X, eh));
      if (opts.experts_to_mxfp4) {
        for (auto& e : F.experts) {
          ML4_RETURN_IF_ERROR(requantize_expert(e.w1));
          ML4_RETURN_IF_ERROR(requantize_expert(e.w2));
          ML4_RETURN_IF_ERROR(requantize_expert(e.w3));
        }
      }
      if (cfg.moe.num_shared_experts > 0) {
        const int64_t IS = I * cfg.moe.num_shared_experts;
        auto Sh = std::make_unique<MlpWeights>();
        ML4_ASSIGN_OR_RETURN(Sh->w1, b.linear(p + "shared_experts.w1", IS, D));
        ML4_ASSIGN_OR_RETURN(Sh->w2, b.linear(p + "shared_experts.w2", D, IS));
        ML4_ASSIGN_OR_RETURN(Sh->w3, b.linear(p + "shared_experts.w3", IS, D));
        ML4_RETURN_IF_ERROR(slice_mlp(*Sh, pick(S.shared_begin, S.shared, IS)));
        F.shared = std::move(Sh);
      }
      break;
    }
  }
  return ok_status();
}

// MODEL.md section 5: the drafter's own weights (all bf16 in the checkpoints ml4 writes; any
// stored format loads). Its attention is the target's MLA shape, owning its (window) cache.
Status load_drafter(const ModelConfig& cfg, Binder& b, DrafterWeights& W, const WeightShard& S) {
  const auto& d = cfg.drafter;
  const int64_t D = cfg.dim, H = cfg.n_heads, dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim;
  const int64_t dv = cfg.v_head_dim, r = cfg.kv_lora_rank, R = d.rnn_rank, V = cfg.vocab_size;
  const std::string p = "mtp_dspark.";
  // Under TP its layers split as the target's do (heads, FFN hidden); the rest is replicated.
  const Range hr = pick(S.head_begin, S.heads, H);
  // Drafter names are the same in both layouts.
  ModelConfig native = cfg;
  native.layout = CheckpointLayout::kMistral;
  Binder nb(native, b.ckpt_);
  ML4_ASSIGN_OR_RETURN(W.fc, nb.linear(p + "fc", D, D * static_cast<int64_t>(d.target_layers.size())));
  ML4_ASSIGN_OR_RETURN(W.fc_norm, nb.vec(p + "fc_norm.weight", D));
  {
    ML4_ASSIGN_OR_RETURN(Tensor m, nb.raw(p + "mask_embed"));
    if (m.shape() != Shape{d.block_size - 1, D})
      return invalid_argument("tensor {}mask_embed: expected [{}, {}], found {}", p, d.block_size - 1, D, m.describe());
    Tensor f = to_f32(m);
    W.mask_embed.assign(f.as<float>(), f.as<float>() + f.numel());
  }
  W.layers.resize(d.n_layers);
  for (int i = 0; i < d.n_layers; ++i) {
    const std::string lp = fmt::format("{}layers.{}.", p, i);
    DrafterLayerWeights& L = W.layers[i];
    ML4_ASSIGN_OR_RETURN(L.attention_norm, nb.vec(lp + "attention_norm.weight", D));
    ML4_ASSIGN_OR_RETURN(L.ffn_norm, nb.vec(lp + "ffn_norm.weight", D));
    AttentionWeights& A = L.attn;
    const std::string pa = lp + "attention.";
    if (cfg.q_lora_rank > 0) {
      ML4_ASSIGN_OR_RETURN(A.wq_a, nb.linear(pa + "wq_a", cfg.q_lora_rank, D));
      ML4_ASSIGN_OR_RETURN(A.q_a_norm, nb.vec(pa + "q_a_norm.weight", cfg.q_lora_rank));
      ML4_ASSIGN_OR_RETURN(A.wq_b, nb.linear(pa + "wq_b", H * (dn + dr), cfg.q_lora_rank));
      ML4_ASSIGN_OR_RETURN(A.wq_b, slice_linear_rows(A.wq_b, hr.begin * (dn + dr), hr.count * (dn + dr)));
    } else {
      ML4_ASSIGN_OR_RETURN(A.wq, nb.linear(pa + "wq", H * (dn + dr), D));
      ML4_ASSIGN_OR_RETURN(A.wq, slice_linear_rows(A.wq, hr.begin * (dn + dr), hr.count * (dn + dr)));
    }
    ML4_ASSIGN_OR_RETURN(A.wkv_a, nb.linear(pa + "wkv_a_with_mqa", r + dr, D));
    ML4_ASSIGN_OR_RETURN(A.kv_a_norm, nb.vec(pa + "kv_a_norm.weight", r));
    ML4_ASSIGN_OR_RETURN(A.wkv_b, nb.linear(pa + "wkv_b", H * (dn + dv), r));
    ML4_ASSIGN_OR_RETURN(A.wkv_b, slice_linear_rows(A.wkv_b, hr.begin * (dn + dv), hr.count * (dn + dv)));
    ML4_ASSIGN_OR_RETURN(A.wo, nb.linear(pa + "wo", D, H * dv));
    ML4_ASSIGN_OR_RETURN(A.wo, slice_linear_cols(A.wo, hr.begin * dv, hr.count * dv));
    ML4_ASSIGN_OR_RETURN(L.ffn.w1, nb.linear(lp + "feed_forward.w1", cfg.hidden_dim, D));
    ML4_ASSIGN_OR_RETURN(L.ffn.w2, nb.linear(lp + "feed_forward.w2", D, cfg.hidden_dim));
    ML4_ASSIGN_OR_RETURN(L.ffn.w3, nb.linear(lp + "feed_forward.w3", cfg.hidden_dim, D));
    ML4_RETURN_IF_ERROR(slice_mlp(L.ffn, pick(S.dense_begin, S.dense, cfg.hidden_dim)));
  }
  ML4_ASSIGN_OR_RETURN(W.norm, nb.vec(p + "norm.weight", D));
  ML4_ASSIGN_OR_RETURN(W.markov_embed, nb.raw(p + "markov.embed.weight"));
  if (W.markov_embed.shape() != Shape{V, R} ||
      (W.markov_embed.dtype() != DType::kBF16 && W.markov_embed.dtype() != DType::kF32))
    return invalid_argument("tensor {}markov.embed.weight: expected [{}, {}] bf16/f32, found {}", p, V, R,
                            W.markov_embed.describe());
  {
    ML4_ASSIGN_OR_RETURN(Tensor ih, nb.raw(p + "markov.weight_ih"));
    ML4_ASSIGN_OR_RETURN(W.markov_ih, nb.linear_from(p + "markov.weight_ih", ih, 3 * R, D + R));
    ML4_ASSIGN_OR_RETURN(Tensor hh, nb.raw(p + "markov.weight_hh"));
    ML4_ASSIGN_OR_RETURN(W.markov_hh, nb.linear_from(p + "markov.weight_hh", hh, 3 * R, R));
  }
  ML4_ASSIGN_OR_RETURN(W.markov_bias_ih, nb.vec(p + "markov.bias_ih", 3 * R));
  ML4_ASSIGN_OR_RETURN(W.markov_bias_hh, nb.vec(p + "markov.bias_hh", 3 * R));
  ML4_ASSIGN_OR_RETURN(W.markov_out, nb.linear(p + "markov.out", V, R));
  for (const auto& n : nb.used_) b.used_.insert(n);
  return ok_status();
}

}  // namespace

Result<std::shared_ptr<const ModelWeights>> load_model_weights(const ModelConfig& cfg, const Checkpoint& ckpt,
                                                               const WeightLoadOptions& opts) {
  auto W = std::make_shared<ModelWeights>();
  Binder b(cfg, ckpt);
  const int64_t D = cfg.dim, V = cfg.vocab_size;
  ML4_ASSIGN_OR_RETURN(W->tok_embeddings, b.raw("tok_embeddings.weight"));
  if (W->tok_embeddings.shape() != Shape{V, D} ||
      (W->tok_embeddings.dtype() != DType::kBF16 && W->tok_embeddings.dtype() != DType::kF32))
    return invalid_argument("tensor {}: expected [{}, {}] bf16/f32, found {}", b.resolve("tok_embeddings.weight").value(), V,
                            D, W->tok_embeddings.describe());
  ML4_ASSIGN_OR_RETURN(W->norm, b.vec("norm.weight", D));
  // Vocabulary-parallel embedding and output: this rank's rows only.
  const Range vr = opts.shard != nullptr ? pick(opts.shard->vocab_begin, opts.shard->vocab, V) : Range{0, V};
  W->tok_embeddings = slice_tensor_rows(W->tok_embeddings, vr.begin, vr.count);
  if (cfg.tied_embeddings) {
    ML4_ASSIGN_OR_RETURN(W->output, b.linear_from("tok_embeddings", W->tok_embeddings, vr.count, D));
  } else {
    ML4_ASSIGN_OR_RETURN(W->output, b.linear("output", V, D));
    ML4_ASSIGN_OR_RETURN(W->output, slice_linear_rows(W->output, vr.begin, vr.count));
  }
  W->layers.resize(cfg.n_layers);
  for (int l = 0; l < cfg.n_layers; ++l) ML4_RETURN_IF_ERROR(load_layer(cfg, l, b, W->layers[l], opts));
  if (opts.load_drafter) {
    static const WeightShard kWhole;
    if (!cfg.drafter.enabled) return invalid_argument("the model has no DSpark drafter (no `mtp` block in params.json)");
    W->drafter = std::make_unique<DrafterWeights>();
    ML4_RETURN_IF_ERROR(load_drafter(cfg, b, *W->drafter, opts.shard != nullptr ? *opts.shard : kWhole)
                            .with_context("DSpark drafter"));
  }
  ML4_RETURN_IF_ERROR(b.check_all_used());
  if (opts.copy_linears) {
    ML4_ASSIGN_OR_RETURN(WeightCopyReport rep, copy_linears_to_memory(*W));
    if (opts.copy_report != nullptr) *opts.copy_report = rep;
  }
  return std::shared_ptr<const ModelWeights>(std::move(W));
}

Status check_wkv_b_shape(const ModelConfig& cfg, const LinearWeight& wkv_b) {
  const int64_t rows = static_cast<int64_t>(cfg.n_heads) * (cfg.qk_nope_head_dim + cfg.v_head_dim);
  if (wkv_b.out_features == rows && wkv_b.in_features == cfg.kv_lora_rank) return ok_status();
  return invalid_argument("{}: wkv_b is [{}, {}], {} heads need [{}, {}]", wkv_b.name, wkv_b.out_features,
                          wkv_b.in_features, cfg.n_heads, rows, cfg.kv_lora_rank);
}

WkvbSplit split_wkv_b(const LinearWeight& wkv_b, int dn, int dv) {
  const int64_t r = wkv_b.in_features, H = wkv_b.out_features / (dn + dv);
  std::vector<float> full = dequantize_linear(wkv_b);
  WkvbSplit s;
  if (H <= 0 || static_cast<int64_t>(full.size()) != H * (dn + dv) * r) return s;  // invalid: empty
  s.w_uk.resize(static_cast<size_t>(H * dn * r));
  s.w_uv.resize(static_cast<size_t>(H * dv * r));
  for (int64_t h = 0; h < H; ++h) {
    const float* head = full.data() + h * (dn + dv) * r;
    std::copy_n(head, dn * r, s.w_uk.data() + h * dn * r);
    std::copy_n(head + dn * r, dv * r, s.w_uv.data() + h * dv * r);
  }
  return s;
}

}  // namespace ml4
