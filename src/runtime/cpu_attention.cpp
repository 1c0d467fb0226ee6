// MLA attention (absorbed) and the DSA lightning indexer of CpuModel (MODEL.md 3.1-3.6).
//
// Per layer: queries and the latent row are projected for all T tokens at once; the
// latent (c, kr) of KV-owning layers and the indexer key of indexer-owning layers are
// written into the cache pages first; then every token attends over keys read back from
// the pages, so a prefill chunk sees its own tokens exactly as a later decode step will.
// Keys of a sequence are decoded from the pages once per layer and shared by its tokens.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/threads.h"
#include "ops/cpu/ops.h"
#include "runtime/cpu_model.h"

namespace ml4 {
namespace {

// Decoded latent rows [0, n) of one sequence from one layer slot.
struct SeqKeys {
  std::vector<float> c, kr;  // [n, r], [n, dr]
};

}  // namespace

void CpuModel::indexer_topk(int layer, const StepMetadata& md, PagedKvCache& cache, const float* a,
                            const float* q_latent, std::vector<std::vector<int32_t>>& topk) const {
  const LayerSpec& spec = cfg_.layers[layer];
  const IndexerWeights& I = *w_->layers[layer].attn.indexer;
  const int HI = cfg_.indexer.n_heads, dI = cfg_.indexer.head_dim, rd = cfg_.indexer.rope_head_dim;
  const int64_t T = md.num_tokens();
  std::vector<float> q(T * HI * dI), k(T * dI), w(T * HI);
  // DeepSeek-V3.2: q from the query-LoRA latent when there is one, k and weights from x.
  cpu::linear(q_latent != nullptr ? q_latent : a, T, I.wq, q.data());
  cpu::linear(a, T, I.wk, k.data());
  cpu::layer_norm(k.data(), I.k_norm_weight.data(), I.k_norm_bias.data(), T, dI, 1e-6f, k.data());
  cpu::linear(a, T, I.weights_proj, w.data());
  const float wscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(HI)) / std::sqrt(static_cast<double>(dI)));
  for (auto& v : w) v *= wscale;
  // Each head is [rope | nope]; the indexer rotates NeoX-style pairs (unlike MLA).
  if (spec.rope) {
    for (int64_t t = 0; t < T; ++t) {
      const double pp = cpu::lerope_position(md.positions[t], cfg_.lerope);
      cpu::rope_neox(q.data() + t * HI * dI, HI, rd, dI, pp, indexer_inv_freq_.data(), rope_factor_);
      cpu::rope_neox(k.data() + t * dI, 1, rd, dI, pp, indexer_inv_freq_.data(), rope_factor_);
    }
  }
  cpu::hadamard_transform(q.data(), T * HI, dI);
  cpu::hadamard_transform(k.data(), T, dI);
  for (int64_t t = 0; t < T; ++t) cache.write_indexer_key(spec.indexer_slot, md.slots[indexer_group_][t], k.data() + t * dI);
  // q is used as FP8 with one scale per 128 values (DeepSeek act_quant); keys come back
  // from the cache as FP8 with theirs. relu(sq*q.k) = sq*relu(q.k) for sq > 0, so scoring
  // on the dequantized values equals DeepSeek's fp8_index.
  {
    std::vector<uint8_t> q8(q.size());
    std::vector<float> qs(q.size() / 128 + 1);
    for (int64_t row = 0; row < T * HI; ++row) {
      float* qr = q.data() + row * dI;
      cpu::quantize_fp8_groups(qr, dI, 128, q8.data(), qs.data());
      cpu::dequantize_fp8_groups(q8.data(), qs.data(), dI, 128, qr);
    }
  }
  topk.assign(T, {});
  for (size_t si = 0; si < md.seqs.size(); ++si) {
    const auto& seq = md.seqs[si];
    const int64_t n = seq.context_len;
    std::vector<float> keys(n * dI);
    parallel_for(n, 64, [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s)
        cache.read_indexer_key(spec.indexer_slot, md.slot_of(static_cast<int>(si), indexer_group_, s), keys.data() + s * dI);
    });
    parallel_for(seq.num_tokens, 1, [&](int64_t b, int64_t e) {
      std::vector<float> scores;
      for (int64_t i = b; i < e; ++i) {
        const int64_t t = seq.first_token + i;
        const int64_t visible = md.positions[t] + 1;
        scores.resize(visible);
        cpu::indexer_scores(q.data() + t * HI * dI, w.data() + t * HI, HI, dI, keys.data(), visible, scores.data());
        const int kk = static_cast<int>(std::min<int64_t>(cfg_.indexer.topk, visible));
        std::vector<int32_t> idx(kk);
        cpu::topk(scores.data(), visible, kk, idx.data());
        std::sort(idx.begin(), idx.end());
        topk[t] = std::move(idx);
      }
    });
  }
}

void CpuModel::attention(int layer, const StepMetadata& md, PagedKvCache& cache, const float* a, float* out,
                         std::vector<std::vector<std::vector<int32_t>>>& topk_by_layer,
                         const std::vector<std::vector<int32_t>>* forced_topk) const {
  const LayerSpec& spec = cfg_.layers[layer];
  const AttentionWeights& W = w_->layers[layer].attn;
  const int H = cfg_.n_heads, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dv = cfg_.v_head_dim;
  const int r = cfg_.kv_lora_rank, qk = dn + dr;
  const int64_t T = md.num_tokens();
  const float eps = static_cast<float>(cfg_.norm_eps);

  // 1. Queries (with or without the query LoRA).
  std::vector<float> q(T * H * qk), q_latent;
  if (cfg_.q_lora_rank > 0) {
    q_latent.resize(T * cfg_.q_lora_rank);
    cpu::linear(a, T, W.wq_a, q_latent.data());
    cpu::rms_norm(q_latent.data(), W.q_a_norm.data(), T, cfg_.q_lora_rank, eps, q_latent.data());
    cpu::linear(q_latent.data(), T, W.wq_b, q.data());
  } else {
    cpu::linear(a, T, W.wq, q.data());
  }
  // 2. Rotary on the rope part of q (interleaved pairs), LeRoPE-mapped positions.
  if (spec.rope) {
    for (int64_t t = 0; t < T; ++t) {
      const double pp = cpu::lerope_position(md.positions[t], cfg_.lerope);
      cpu::rope_interleaved(q.data() + t * H * qk + dn, H, dr, qk, pp, inv_freq_.data(), rope_factor_);
    }
  }
  // 3./4. Latent row, written into this layer's pages (owners only).
  if (spec.owns_kv()) {
    std::vector<float> ckv(T * (r + dr));
    cpu::linear(a, T, W.wkv_a, ckv.data());
    std::vector<float> c(r);
    for (int64_t t = 0; t < T; ++t) {
      float* row = ckv.data() + t * (r + dr);
      cpu::rms_norm(row, W.kv_a_norm.data(), 1, r, eps, c.data());
      float* kr = row + r;
      if (spec.rope) {
        const double pp = cpu::lerope_position(md.positions[t], cfg_.lerope);
        cpu::rope_interleaved(kr, 1, dr, dr, pp, inv_freq_.data(), rope_factor_);
      }
      for (int slot : latent_write_slots_[layer]) cache.write_latent(slot, md.slots[latent_group_][t], c.data(), kr);
    }
  }
  // 5. Sparse selection.
  switch (spec.indexer) {
    case IndexerRole::kNone:
      break;
    case IndexerRole::kOwner:
      indexer_topk(layer, md, cache, a, q_latent.empty() ? nullptr : q_latent.data(), topk_by_layer[layer]);
      break;
    case IndexerRole::kReuser:
      topk_by_layer[layer] = topk_by_layer[spec.indexer_source];
      break;
  }
  const bool sparse = spec.sparse();
  const auto& topk = sparse && forced_topk != nullptr ? *forced_topk : topk_by_layer[layer];

  // 6. Absorbed attention over keys read back from the source layer's pages.
  const int src_slot = latent_read_slot_[layer];
  const double base_scale = cfg_.softmax_scale();
  std::vector<float> o(T * H * dv);
  for (size_t si = 0; si < md.seqs.size(); ++si) {
    const auto& seq = md.seqs[si];
    const int64_t n = seq.context_len;
    SeqKeys keys;
    keys.c.resize(n * r);
    keys.kr.resize(n * dr);
    parallel_for(n, 64, [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s)
        cache.read_latent(src_slot, md.slot_of(static_cast<int>(si), latent_group_, s), keys.c.data() + s * r,
                          keys.kr.data() + s * dr);
    });
    parallel_for(seq.num_tokens, 1, [&](int64_t b, int64_t e) {
      std::vector<float> q_lat(H * r), q_rope(H * dr), head_scale(H), out_lat(H * r), lse(H);
      std::vector<float> cg, krg;
      for (int64_t i = b; i < e; ++i) {
        const int64_t t = seq.first_token + i;
        const int64_t p = md.positions[t];
        const float* qt = q.data() + t * H * qk;
        // Keys: the indexer's top-k, or every s <= p.
        const float* cp = keys.c.data();
        const float* krp = keys.kr.data();
        int64_t S = p + 1;
        if (sparse) {
          const auto& sel = topk[t];
          S = static_cast<int64_t>(sel.size());
          cg.resize(S * r);
          krg.resize(S * dr);
          for (int64_t j = 0; j < S; ++j) {
            std::copy_n(keys.c.data() + sel[j] * int64_t{r}, r, cg.data() + j * r);
            std::copy_n(keys.kr.data() + sel[j] * int64_t{dr}, dr, krg.data() + j * dr);
          }
          cp = cg.data();
          krp = krg.data();
        }
        // q_lat[h] = W_UK[h]^T q_nope[h]  ([dn] x [dn, r] -> [r]).
        for (int h = 0; h < H; ++h) {
          float* ql = q_lat.data() + h * r;
          std::fill(ql, ql + r, 0.0f);
          const float* qn = qt + h * qk;
          const float* wuk = W.w_uk.data() + static_cast<int64_t>(h) * dn * r;
          for (int d = 0; d < dn; ++d) {
            const float qv = qn[d];
            const float* wr = wuk + static_cast<int64_t>(d) * r;
            for (int j = 0; j < r; ++j) ql[j] += qv * wr[j];
          }
          std::copy_n(qt + h * qk + dn, dr, q_rope.data() + h * dr);
          // Temperature: softmax scale, Mistral 4 llama_4_scaling, SSMax s_h*log(n).
          double sc = base_scale * cpu::llama4_q_scale(p, cfg_.llama4_scaling);
          if (spec.ssmax) sc *= W.ssmax_s[h] * std::log(static_cast<double>(S));
          head_scale[h] = static_cast<float>(sc);
        }
        cpu::mla_attention(q_lat.data(), q_rope.data(), H, r, dr, cp, krp, S, head_scale.data(), out_lat.data(),
                           lse.data());
        // o_h = W_UV[h] out_lat[h]  ([dv, r] x [r]).
        for (int h = 0; h < H; ++h) {
          const float* wuv = W.w_uv.data() + static_cast<int64_t>(h) * dv * r;
          const float* ol = out_lat.data() + h * r;
          float* oh = o.data() + (t * H + h) * dv;
          for (int d = 0; d < dv; ++d) {
            const float* wr = wuv + static_cast<int64_t>(d) * r;
            float acc = 0.0f;
            for (int j = 0; j < r; ++j) acc += wr[j] * ol[j];
            oh[d] = acc;
          }
        }
      }
    });
  }
  cpu::linear(o.data(), T, W.wo, out);
}

}  // namespace ml4
