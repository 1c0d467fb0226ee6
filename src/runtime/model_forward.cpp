// The one ML4 layer program (see model_forward.h). Step numbers in comments are MODEL.md
// section 3's. Every op goes through the backend; segment() / host_sync() mark what a CUDA
// graph may capture and where it must break (the CPU runs both at once), side() the indexer
// branch a device may overlap with the q / kv projections.
#include "runtime/model_forward.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "core/threads.h"
#include "ops/cpu/rope.h"

namespace ml4 {

Result<std::unique_ptr<ModelForward>> ModelForward::create(const ModelConfig& cfg, const ModelWeights& w, Backend& be,
                                                           const Options& opts) {
  std::unique_ptr<ModelForward> f(new ModelForward(cfg, be));
  f->plan_ = opts.plan;
  f->comms_ = opts.comms;
  if (opts.plan != nullptr && opts.drafter && opts.plan->layout().pcp_size > 1)
    return unimplemented("the DSpark drafter with prefill context parallelism is not supported yet");
  if (opts.plan != nullptr && opts.drafter && opts.plan->layout().dp_size > 1)
    return unimplemented("the DSpark drafter with data parallelism is not supported yet (TP, EP and DCP are)");
  if ((f->tensor_parallel() || f->expert_parallel() || f->context_parallel()) && opts.plan == nullptr)
    return internal_error("a parallel model program needs its parallel plan");
  if (opts.hisparse != nullptr) {
    // TP / EP / DP ranks hold whole latent rows of their sequences, so each runs the policy on
    // its own copy (the same decisions on every TP rank); under DCP a rank holds a shard and its
    // selections are local indices, under PCP the step is a share: not supported yet.
    if (opts.plan != nullptr && (opts.plan->context_shard().sharded() || opts.plan->layout().pcp_size > 1))
      return unimplemented("HiSparse with decode or prefill context parallelism is not supported yet");
    if (!cfg.has_dsa()) return invalid_argument("HiSparse needs a sparse-attention (DSA) model: this one attends every key");
    if (opts.hisparse->layers() != hisparse_hot_layers(cfg))
      return internal_error("HiSparse state has {} layers, the model {} sparse layers", opts.hisparse->layers(), hisparse_hot_layers(cfg));
    if (opts.hisparse->slots() < cfg.indexer.topk)
      return invalid_argument("HiSparse: hot_slots_per_request {} is below the indexer's top-k {} (one decode token's rows)",
                              opts.hisparse->slots(), cfg.indexer.topk);
    f->hisparse_ = opts.hisparse;
    f->hot_layer_.assign(cfg.n_layers, -1);
    int h = 0;
    for (const auto& s : cfg.layers)
      if (s.sparse()) f->hot_layer_[s.index] = h++;
    ML4_RETURN_IF_ERROR(be.hisparse_reserve(h, static_cast<int64_t>(opts.hisparse->regions()) * opts.hisparse->slots()));
  }
  const int L = cfg.n_layers;
  // KV sharing: a consumer reads its source's latent slot (or, as the no-sharing baseline,
  // its own copy written alongside the source's rows).
  f->latent_read_slot_.assign(L, -1);
  f->latent_write_slots_.assign(L, {});
  int extra = cfg.num_latent_layers();
  for (int l = 0; l < L; ++l) {
    const LayerSpec& s = cfg.layers[l];
    if (s.owns_kv()) {
      f->latent_read_slot_[l] = s.latent_slot;
      f->latent_write_slots_[l].push_back(s.latent_slot);
    } else if (opts.duplicate_shared_kv) {
      f->latent_read_slot_[l] = extra;
      f->latent_write_slots_[s.kv_source].push_back(extra++);
    } else {
      f->latent_read_slot_[l] = cfg.layers[s.kv_source].latent_slot;
    }
  }
  f->selection_of_owner_.assign(L, -1);
  if (cfg.has_dsa()) {
    std::vector<bool> has_reuser(L, false);
    for (const auto& s : cfg.layers)
      if (s.indexer == IndexerRole::kReuser) has_reuser[s.indexer_source] = true;
    int next = 1;
    for (const auto& s : cfg.layers)
      if (s.indexer == IndexerRole::kOwner) f->selection_of_owner_[s.index] = has_reuser[s.index] ? next++ : 0;
    f->forced_selection_ = next;
    // Decode context parallelism: each selection has a twin holding this rank's local indices.
    if (f->context_parallel()) f->local_selection_offset_ = next + 1;
    ML4_RETURN_IF_ERROR(be.reserve_selections((next + 1) * (f->context_parallel() ? 2 : 1)));
    f->hisparse_positions_.resize(next + 1);
  }
  ML4_RETURN_IF_ERROR(f->register_weights(w));
  if (opts.drafter) {
    if (w.drafter == nullptr) return invalid_argument("speculative decoding: the model's drafter weights are not loaded");
    ML4_RETURN_IF_ERROR(f->register_drafter(*w.drafter));
  }
  return f;
}

// The registration order of the linears is part of the CUDA backend's synthetic weights
// (each gets the next seed): output, then per layer the q path, wkv_a, wo, the indexer, the FFN.
Status ModelForward::register_weights(const ModelWeights& w) {
  if (tensor_parallel()) {
    ML4_RETURN_IF_ERROR(be_.set_embedding_shard(w.tok_embeddings, plan_->vocab_begin()));
  } else {
    ML4_RETURN_IF_ERROR(be_.set_embedding(w.tok_embeddings));
  }
  ML4_ASSIGN_OR_RETURN(final_norm_, be_.add_vector(w.norm));
  ML4_ASSIGN_OR_RETURN(output_, be_.add_linear(w.output));
  layers_.resize(cfg_.n_layers);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const LayerSpec& spec = cfg_.layers[l];
    const LayerWeights& LW = w.layers[l];
    const AttentionWeights& A = LW.attn;
    LayerRefs& R = layers_[l];
    ML4_ASSIGN_OR_RETURN(R.attn_norm, be_.add_vector(LW.attention_norm));
    ML4_ASSIGN_OR_RETURN(R.ffn_norm, be_.add_vector(LW.ffn_norm));
    if (cfg_.q_lora_rank > 0) {
      ML4_ASSIGN_OR_RETURN(R.wq_a, be_.add_linear(A.wq_a));
      ML4_ASSIGN_OR_RETURN(R.wq_b, be_.add_linear(A.wq_b));
      ML4_ASSIGN_OR_RETURN(R.q_a_norm, be_.add_vector(A.q_a_norm));
    } else {
      ML4_ASSIGN_OR_RETURN(R.wq, be_.add_linear(A.wq));
    }
    if (spec.owns_kv()) {
      ML4_ASSIGN_OR_RETURN(R.wkv_a, be_.add_linear(A.wkv_a));
      ML4_ASSIGN_OR_RETURN(R.kv_a_norm, be_.add_vector(A.kv_a_norm));
    }
    ML4_ASSIGN_OR_RETURN(R.wo, be_.add_linear(A.wo));
    if (spec.indexer == IndexerRole::kOwner) {
      if (!A.indexer) return invalid_argument("layer {}: indexer owner without indexer weights", l);
      const IndexerWeights& I = *A.indexer;
      ML4_ASSIGN_OR_RETURN(R.idx_wq, be_.add_linear(I.wq));
      ML4_ASSIGN_OR_RETURN(R.idx_wk, be_.add_linear(I.wk));
      ML4_ASSIGN_OR_RETURN(R.idx_wproj, be_.add_linear(I.weights_proj));
      ML4_ASSIGN_OR_RETURN(R.idx_knorm_w, be_.add_vector(I.k_norm_weight));
      ML4_ASSIGN_OR_RETURN(R.idx_knorm_b, be_.add_vector(I.k_norm_bias));
    }
    ML4_ASSIGN_OR_RETURN(R.absorb, be_.add_absorb(A.wkv_b));
    if (spec.ssmax) {
      ML4_ASSIGN_OR_RETURN(R.ssmax_s, be_.add_vector(A.ssmax_s));
    }
    const FfnWeights& F = LW.ffn;
    switch (spec.ffn) {
      case FfnKind::kDense: {
        ML4_ASSIGN_OR_RETURN(R.dense, be_.add_mlp(F.dense));
        break;
      }
      case FfnKind::kMoe: {
        ML4_ASSIGN_OR_RETURN(R.gate, be_.add_linear(F.gate, LinearUse::kRouter));
        if (!F.correction_bias.empty()) {
          ML4_ASSIGN_OR_RETURN(R.router_bias, be_.add_vector(F.correction_bias));
        }
        if (expert_parallel()) {  // routed experts reached by dispatch, the shared one locally
          ML4_ASSIGN_OR_RETURN(R.moe, be_.add_moe(F.experts, nullptr));
          if (F.shared != nullptr) {
            ML4_ASSIGN_OR_RETURN(R.shared, be_.add_mlp(*F.shared));
            R.has_shared = true;
          }
        } else {
          ML4_ASSIGN_OR_RETURN(R.moe, be_.add_moe(F.experts, F.shared.get()));
        }
        break;
      }
    }
  }
  rope_tables_[0] = cpu::rope_inv_freq(cfg_.rope_theta, cfg_.qk_rope_head_dim, cfg_.yarn);
  ML4_ASSIGN_OR_RETURN(inv_freq_, be_.add_vector(rope_tables_[0]));
  if (cfg_.has_dsa()) {
    rope_tables_[1] = cpu::rope_inv_freq(cfg_.rope_theta, cfg_.indexer.rope_head_dim, cfg_.yarn);
    ML4_ASSIGN_OR_RETURN(indexer_inv_freq_, be_.add_vector(rope_tables_[1]));
  }
  rope_factor_ = cpu::rope_attention_factor(cfg_.yarn);
  return ok_status();
}

Status ModelForward::register_drafter(const DrafterWeights& w) {
  auto d = std::make_unique<DrafterRefs>();
  ML4_RETURN_IF_ERROR(be_.enable_drafter());
  ML4_ASSIGN_OR_RETURN(d->fc, be_.add_linear(w.fc));
  ML4_ASSIGN_OR_RETURN(d->fc_norm, be_.add_vector(w.fc_norm));
  ML4_ASSIGN_OR_RETURN(d->mask, be_.add_vector(w.mask_embed));
  ML4_ASSIGN_OR_RETURN(d->norm, be_.add_vector(w.norm));
  d->layers.resize(w.layers.size());
  for (size_t j = 0; j < w.layers.size(); ++j) {
    const DrafterLayerWeights& L = w.layers[j];
    DraftLayerRefs& R = d->layers[j];
    ML4_ASSIGN_OR_RETURN(R.attn_norm, be_.add_vector(L.attention_norm));
    ML4_ASSIGN_OR_RETURN(R.ffn_norm, be_.add_vector(L.ffn_norm));
    if (cfg_.q_lora_rank > 0) {
      ML4_ASSIGN_OR_RETURN(R.wq_a, be_.add_linear(L.attn.wq_a));
      ML4_ASSIGN_OR_RETURN(R.wq_b, be_.add_linear(L.attn.wq_b));
      ML4_ASSIGN_OR_RETURN(R.q_a_norm, be_.add_vector(L.attn.q_a_norm));
    } else {
      ML4_ASSIGN_OR_RETURN(R.wq, be_.add_linear(L.attn.wq));
    }
    ML4_ASSIGN_OR_RETURN(R.wkv_a, be_.add_linear(L.attn.wkv_a));
    ML4_ASSIGN_OR_RETURN(R.kv_a_norm, be_.add_vector(L.attn.kv_a_norm));
    ML4_ASSIGN_OR_RETURN(R.wo, be_.add_linear(L.attn.wo));
    ML4_ASSIGN_OR_RETURN(R.absorb, be_.add_absorb(L.attn.wkv_b));
    ML4_ASSIGN_OR_RETURN(R.ffn, be_.add_mlp(L.ffn));
  }
  ML4_ASSIGN_OR_RETURN(d->markov_embed, be_.add_table(w.markov_embed));
  ML4_ASSIGN_OR_RETURN(d->markov_ih, be_.add_linear(w.markov_ih));
  ML4_ASSIGN_OR_RETURN(d->markov_hh, be_.add_linear(w.markov_hh));
  ML4_ASSIGN_OR_RETURN(d->markov_out, be_.add_linear(w.markov_out));
  ML4_ASSIGN_OR_RETURN(d->markov_b_ih, be_.add_vector(w.markov_bias_ih));
  ML4_ASSIGN_OR_RETURN(d->markov_b_hh, be_.add_vector(w.markov_bias_hh));
  d->target_slot.assign(cfg_.n_layers, -1);
  for (size_t i = 0; i < cfg_.drafter.target_layers.size(); ++i) {
    const int l = cfg_.drafter.target_layers[i];
    if (l < 0 || l >= cfg_.n_layers) return invalid_argument("mtp.target_layers: layer {} outside [0, {})", l, cfg_.n_layers);
    d->target_slot[l] = static_cast<int>(i);
  }
  drafter_ = std::move(d);
  return ok_status();
}

// The residual stream after layer l (h_l: the residual holds it once the next fused add ran)
// into its column block of draft_hidden.
Status ModelForward::capture_hidden(int l) {
  if (drafter_ == nullptr || l < 0 || drafter_->target_slot[l] < 0) return ok_status();
  const Activations& x = be_.acts();
  const int64_t D = cfg_.dim, n = static_cast<int64_t>(cfg_.drafter.target_layers.size());
  return be_.segment([&] {
    return be_.copy_rows(x.residual, D, x.draft_hidden + drafter_->target_slot[l] * D, n * D, be_.step_tokens(), D);
  });
}

// MODEL.md 5: ctx = rms(fc(concat_l h_l)); each draft layer writes the K/V of ctx (its own
// wkv_a, kv_a_norm, RoPE at the token's position) into its drafter cache slot.
Status ModelForward::drafter_context() {
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens(), D = cfg_.dim;
  const int n = static_cast<int>(cfg_.drafter.target_layers.size());
  const int r = cfg_.kv_lora_rank, dr = cfg_.qk_rope_head_dim;
  const float eps = static_cast<float>(cfg_.norm_eps);
  return be_.segment([&] {
    return be_.timed("drafter context", [&]() -> Status {
      ML4_RETURN_IF_ERROR(be_.linear(drafter_->fc, x.draft_hidden, T, x.draft_ctx));
      ML4_RETURN_IF_ERROR(be_.rms_norm({x.draft_ctx, nullptr, drafter_->fc_norm, T, D, 0, eps, x.draft_ctx}));
      (void)n;
      for (size_t j = 0; j < drafter_->layers.size(); ++j) {
        const DraftLayerRefs& L = drafter_->layers[j];
        ML4_RETURN_IF_ERROR(be_.linear(L.wkv_a, x.draft_ctx, T, x.ckv));
        ML4_RETURN_IF_ERROR(be_.rms_norm({x.ckv, nullptr, L.kv_a_norm, T, r, r + dr, eps, x.c}));
        ML4_RETURN_IF_ERROR(be_.rope(rope_args(x.ckv, 1, r + dr, r, dr, inv_freq_)));
        ML4_RETURN_IF_ERROR(be_.latent_cache_write(CacheGroup::kDrafter, static_cast<int>(j), x.c, x.ckv + r, r + dr));
      }
      return ok_status();
    });
  });
}

// One draft layer's attention over the block: its queries and its own K/V from the block's
// rows (the block's K/V written at the block's positions of the drafter cache, where the
// next forward's context rows will overwrite them), absorbed MLA over the window + block
// without a causal mask, plain softmax scale (no llama_4 temperature, no SSMax).
Status ModelForward::draft_attention(int j) {
  const DraftLayerRefs& L = drafter_->layers[j];
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens();
  const int H = cfg_.n_heads, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim;
  const int r = cfg_.kv_lora_rank, qk = dn + dr;
  const float eps = static_cast<float>(cfg_.norm_eps);
  if (cfg_.q_lora_rank > 0) {
    ML4_RETURN_IF_ERROR(be_.linear(L.wq_a, x.a, T, x.q_latent));
    ML4_RETURN_IF_ERROR(be_.rms_norm({x.q_latent, nullptr, L.q_a_norm, T, cfg_.q_lora_rank, 0, eps, x.q_latent}));
    ML4_RETURN_IF_ERROR(be_.linear(L.wq_b, x.q_latent, T, x.q));
  } else {
    ML4_RETURN_IF_ERROR(be_.linear(L.wq, x.a, T, x.q));
  }
  ML4_RETURN_IF_ERROR(be_.linear(L.wkv_a, x.a, T, x.ckv));
  ML4_RETURN_IF_ERROR(be_.rms_norm({x.ckv, nullptr, L.kv_a_norm, T, r, r + dr, eps, x.c}));
  ML4_RETURN_IF_ERROR(be_.rope(rope_args(x.ckv, 1, r + dr, r, dr, inv_freq_)));
  ML4_RETURN_IF_ERROR(be_.latent_cache_write(CacheGroup::kDrafter, j, x.c, x.ckv + r, r + dr));
  ML4_RETURN_IF_ERROR(be_.mla_absorb_q(L.absorb, x.q, x.q_lat));
  QPathArgs qp;
  qp.rope = rope_args(x.q, H, qk, dn, dr, inv_freq_);
  qp.base_scale = cfg_.softmax_scale();
  qp.selection = kBlockWindow;
  qp.head_scale = x.head_scale;
  ML4_RETURN_IF_ERROR(be_.q_path(qp));
  MlaArgs ma;
  ma.group = CacheGroup::kDrafter;
  ma.cache_slot = j;
  ma.selection = kBlockWindow;
  ma.q_lat = x.q_lat;
  ma.q = x.q;
  ma.head_scale = x.head_scale;
  ma.out_lat = x.out_lat;
  ma.lse = x.lse;
  ML4_RETURN_IF_ERROR(be_.mla_attention(ma));
  ML4_RETURN_IF_ERROR(be_.mla_apply_uv(L.absorb, x.out_lat, x.o));
  return be_.linear(L.wo, x.o, T, x.tmp);
}

Status ModelForward::draft(const DeviceSamplingParams* params, bool want_probs, int slots) {
  if (drafter_ == nullptr) return invalid_argument("this model program has no drafter (speculative decoding is off)");
  if (slots < 1 || slots >= cfg_.drafter.block_size)
    return invalid_argument("draft of {} slots, the block has {}", slots, cfg_.drafter.block_size - 1);
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens(), R = be_.step_rows(), D = cfg_.dim, V = cfg_.vocab_size;
  const int64_t B = cfg_.drafter.block_size, r = cfg_.drafter.rnn_rank;
  const float eps = static_cast<float>(cfg_.norm_eps);
  if (T % B != 0 || R != T / B * (B - 1))
    return internal_error("draft step of {} tokens / {} logits rows is not blocks of {}", T, R, B);
  const int64_t n = T / B;
  if (tensor_parallel()) {
    // The anchors' embeddings through the vocabulary-parallel lookup (rows of other ranks' ids
    // are zero until the all-reduce), then the mask rows into slots 1..B-1 of every block.
    ML4_RETURN_IF_ERROR(be_.segment([&] { return be_.embedding(x.residual); }));
    ML4_RETURN_IF_ERROR(tp_all_reduce(x.residual, T * D));
    ML4_RETURN_IF_ERROR(be_.segment([&]() -> Status {
      for (int64_t j = 1; j < B; ++j)
        ML4_RETURN_IF_ERROR(be_.copy_rows(drafter_->mask + (j - 1) * D, 0, x.residual + j * D, B * D, n, D));
      return be_.select_block_window(CacheGroup::kDrafter, cfg_.drafter.window);
    }));
  } else {
    ML4_RETURN_IF_ERROR(be_.segment([&]() -> Status {
      ML4_RETURN_IF_ERROR(be_.block_embed(drafter_->mask, x.residual));
      return be_.select_block_window(CacheGroup::kDrafter, cfg_.drafter.window);
    }));
  }
  // Under TP the draft layers hold the rank's heads and FFN slice, as the target's do: wo and
  // w2 are followed by the TP all-reduce, and the logits by the vocabulary all-gather.
  for (size_t j = 0; j < drafter_->layers.size(); ++j) {
    const DraftLayerRefs& L = drafter_->layers[j];
    ML4_RETURN_IF_ERROR(be_.segment([&]() -> Status {
      ML4_RETURN_IF_ERROR(
          be_.rms_norm({j == 0 ? x.residual : x.tmp, j == 0 ? nullptr : x.residual, L.attn_norm, T, D, 0, eps, x.a}));
      return be_.timed("draft: attention", [&] { return draft_attention(static_cast<int>(j)); });
    }));
    ML4_RETURN_IF_ERROR(tp_all_reduce(x.tmp, T * D));
    ML4_RETURN_IF_ERROR(be_.segment([&]() -> Status {
      ML4_RETURN_IF_ERROR(be_.rms_norm({x.tmp, x.residual, L.ffn_norm, T, D, 0, eps, x.a}));
      return be_.timed("draft: ffn", [&] { return mlp(L.ffn, x.a, T, x.tmp); });
    }));
    ML4_RETURN_IF_ERROR(tp_all_reduce(x.tmp, T * D));
  }
  // o = norm(h) for slots 1..B-1, base logits through the target's output head.
  ML4_RETURN_IF_ERROR(be_.segment([&] {
    return be_.timed("draft: norm + lm_head", [&]() -> Status {
      ML4_RETURN_IF_ERROR(be_.rms_norm({x.tmp, x.residual, drafter_->norm, T, D, 0, eps, x.a}));
      ML4_RETURN_IF_ERROR(be_.gather_logits_rows(x.a, x.normed));
      return logits();
    });
  }));
  // The Markov head, slot by slot: s_j = GRU([o_j ; embed(t_{j-1})], s_{j-1}), s_0 = 0, t_0 the
  // accepted token; slot j's logits = base_j + out(s_j); t_j drawn from them.
  return be_.segment([&] {
    return be_.timed("draft: markov head", [&]() -> Status {
      ML4_RETURN_IF_ERROR(be_.fill(x.markov_s, n * r, 0.0f));
      for (int64_t j = 1; j <= slots; ++j) {
        ML4_RETURN_IF_ERROR(be_.timed("draft: markov (of which) GRU", [&]() -> Status {
          ML4_RETURN_IF_ERROR(be_.gather_table_rows(drafter_->markov_embed, x.draft_ids + (j - 1) * n, n, x.markov_e));
          ML4_RETURN_IF_ERROR(be_.copy_rows(x.normed + (j - 1) * D, (B - 1) * D, x.markov_x, D + r, n, D));
          ML4_RETURN_IF_ERROR(be_.copy_rows(x.markov_e, r, x.markov_x + D, D + r, n, r));
          ML4_RETURN_IF_ERROR(be_.linear(drafter_->markov_ih, x.markov_x, n, x.markov_gi));
          ML4_RETURN_IF_ERROR(be_.linear(drafter_->markov_hh, x.markov_s, n, x.markov_gh));
          return be_.gru_update(x.markov_gi, x.markov_gh, drafter_->markov_b_ih, drafter_->markov_b_hh, n, r,
                                x.markov_s);
        }));
        ML4_RETURN_IF_ERROR(be_.timed("draft: markov (of which) out projection", [&] {
          return be_.linear(drafter_->markov_out, x.markov_s, n, x.markov_logits);
        }));
        ML4_RETURN_IF_ERROR(be_.timed("draft: markov (of which) add + choose", [&] {
          return be_.choose_tokens(x.markov_logits, n, params != nullptr ? params + (j - 1) * n : nullptr,
                                   x.draft_ids + j * n, want_probs ? x.draft_probs + (j - 1) * n * V : nullptr,
                                   x.logits + (j - 1) * V, (B - 1) * V);
        }));
      }
      return ok_status();
    });
  });
}

RopeArgs ModelForward::rope_args(float* x, int heads, int stride, int offset, int dim, const float* inv_freq) const {
  RopeArgs r;
  r.x = x;
  r.heads = heads;
  r.stride = stride;
  r.offset = offset;
  r.dim = dim;
  r.inv_freq = inv_freq;
  r.attn_factor = rope_factor_;
  return r;
}

Status ModelForward::mlp(const MlpRef& m, const float* x, int64_t M, float* y) {
  const Activations& a = be_.acts();
  ML4_RETURN_IF_ERROR(be_.linear(m.w1, x, M, a.ffn_g));
  ML4_RETURN_IF_ERROR(be_.linear(m.w3, x, M, a.ffn_u));
  ML4_RETURN_IF_ERROR(be_.silu_mul(a.ffn_g, a.ffn_u, M, m.hidden, a.ffn_g));
  return be_.linear(m.w2, a.ffn_g, M, y);
}

// 5. The indexer's key half (reads only the layer input): keys [rope | nope] through
// LayerNorm and NeoX RoPE into the indexer pages (Hadamard + FP8 there), and the head weights.
Status ModelForward::indexer_keys(int l) {
  const LayerSpec& spec = cfg_.layers[l];
  const LayerRefs& L = layers_[l];
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens();
  const int dI = cfg_.indexer.head_dim;
  ML4_RETURN_IF_ERROR(be_.linear(L.idx_wk, x.a, T, x.ik));
  ML4_RETURN_IF_ERROR(be_.linear(L.idx_wproj, x.a, T, x.iw));
  RopeArgs r = rope_args(x.ik, 1, dI, 0, cfg_.indexer.rope_head_dim, indexer_inv_freq_);
  r.neox = true;
  if (!prefill_context_parallel())
    return be_.indexer_key_path(x.ik, dI, L.idx_knorm_w, L.idx_knorm_b, 1e-6f, spec.rope ? &r : nullptr,
                                spec.indexer_slot);
  ML4_RETURN_IF_ERROR(be_.layer_norm(x.ik, L.idx_knorm_w, L.idx_knorm_b, T, dI, 1e-6f, x.ik));
  if (spec.rope) ML4_RETURN_IF_ERROR(be_.rope(r));
  ML4_ASSIGN_OR_RETURN(float* all, pcp_gather_rows(x.ik, dI));
  return be_.indexer_key_write_gathered(spec.indexer_slot, all);
}

// Prefill context parallelism (runtime/pcp_split.h): rows [T, width] of this rank's tokens,
// all-gathered over the PCP group into a fixed [ranks][pcp_rows] buffer and put in the whole
// step's order (StepMetadata::pcp_gather): [step tokens, width] in backend scratch.
Result<float*> ModelForward::pcp_gather_rows(const float* rows, int64_t width) {
  Communicator& c = *comms_.pcp;
  const int64_t T = be_.step_tokens(), M = pcp_rows_;
  ML4_ASSIGN_OR_RETURN(void* send, be_.scratch(kPcpSend, std::max<int64_t>(M, 1) * width * 4));
  ML4_ASSIGN_OR_RETURN(void* recv, be_.scratch(kPcpRecv, std::max<int64_t>(c.size() * M, 1) * width * 4));
  ML4_ASSIGN_OR_RETURN(void* all, be_.scratch(kPcpAll, std::max<int64_t>(pcp_step_tokens_, 1) * width * 4));
  if (T > 0) ML4_RETURN_IF_ERROR(be_.copy_rows(rows, width, static_cast<float*>(send), width, T, width));
  ML4_RETURN_IF_ERROR(be_.timed("pcp all-gather", [&] { return c.all_gather(send, recv, M * width * 4); }));
  if (pcp_step_tokens_ > 0)
    ML4_RETURN_IF_ERROR(be_.gather_rows_at(static_cast<float*>(recv), pcp_index_, pcp_step_tokens_, width,
                                           static_cast<float*>(all)));
  return static_cast<float*>(all);
}

// 5. The query half (DeepSeek-V3.2: q from the query-LoRA latent when there is one): the
// queries, their scores over the pages, the causal top-k into the owner's selection.
Status ModelForward::indexer_select(int l, ForwardTrace* trace, int keys_lane) {
  const LayerSpec& spec = cfg_.layers[l];
  const LayerRefs& L = layers_[l];
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens();
  const int HI = cfg_.indexer.n_heads, dI = cfg_.indexer.head_dim;
  ML4_RETURN_IF_ERROR(be_.linear(L.idx_wq, cfg_.q_lora_rank > 0 ? x.q_latent : x.a, T, x.iq));
  RopeArgs r = rope_args(x.iq, HI, dI, 0, cfg_.indexer.rope_head_dim, indexer_inv_freq_);
  r.neox = true;
  IndexerSelectArgs s;
  if (spec.rope) s.q_rope = &r;  // the backend rotates them before their quantization
  s.cache_slot = spec.indexer_slot;
  s.q = x.iq;
  s.w = x.iw;
  s.weight_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(HI)) / std::sqrt(static_cast<double>(dI)));
  s.selection = selection_of_owner_[l];
  s.record_positions = trace != nullptr || hisparse_ != nullptr;
  s.keys_lane = keys_lane;
  if (context_parallel()) {
    // Each rank's top-k over its keys (scores then positions, one buffer), gathered in one
    // exchange, merged into the exact global top-k.
    Communicator& c = *comms_.dcp;
    const int64_t bytes = 2 * T * cfg_.indexer.topk * 4;
    ML4_ASSIGN_OR_RETURN(void* mine, be_.scratch(kDcpCandidates, bytes));
    ML4_ASSIGN_OR_RETURN(void* all, be_.scratch(kDcpAllCandidates, c.size() * bytes));
    s.candidates = mine;
    ML4_RETURN_IF_ERROR(be_.indexer_select(s));
    ML4_RETURN_IF_ERROR(c.all_gather(mine, all, bytes));
    ML4_RETURN_IF_ERROR(be_.merge_topk_candidates(all, c.size(), s.selection, s.selection + local_selection_offset_));
  } else {
    ML4_RETURN_IF_ERROR(be_.indexer_select(s));
  }
  if (trace != nullptr) {
    ML4_ASSIGN_OR_RETURN(trace->topk[l], be_.read_selection(s.selection));
  }
  return ok_status();
}

// 5. Which keys the layer attends: its own indexer's (computed here unless the side branch
// did), its source's (reusers), or forced ones (traced steps); -1 for dense layers.
Status ModelForward::select_keys(int l, const StepMetadata* md, ForwardTrace* trace, bool forked, int* selection) {
  const LayerSpec& spec = cfg_.layers[l];
  *selection = -1;
  if (!spec.sparse()) return ok_status();
  const bool owner = spec.indexer == IndexerRole::kOwner;
  if (forked) {
    ML4_RETURN_IF_ERROR(be_.join_side());
  } else if (owner) {
    ML4_RETURN_IF_ERROR(be_.timed("attn: indexer + top-k", [&]() -> Status {
      ML4_RETURN_IF_ERROR(indexer_keys(l));
      return indexer_select(l, trace);
    }));
  }
  const int src = owner ? l : spec.indexer_source;
  if (trace != nullptr && src != l) trace->topk[l] = trace->topk[src];
  const bool forced = trace != nullptr && l < static_cast<int>(trace->forced_topk.size()) && !trace->forced_topk[l].empty();
  if (forced) {  // test input, validated in forward()
    ML4_RETURN_IF_ERROR(be_.set_selection(forced_selection_, trace->forced_topk[l]));
    if (context_parallel()) {  // this rank's local indices of the forced positions
      std::vector<std::vector<int32_t>> local(trace->forced_topk[l].size());
      for (size_t t = 0; t < local.size(); ++t)
        for (int32_t p : trace->forced_topk[l][t])
          if (md->shard.holds(p)) local[t].push_back(static_cast<int32_t>(md->shard.local_index(p)));
      ML4_RETURN_IF_ERROR(be_.set_selection(forced_selection_ + local_selection_offset_, local));
    }
    *selection = forced_selection_;
  } else {
    *selection = selection_of_owner_[src];
  }
  return ok_status();
}

// Steps 1-6 of one layer; out [T, dim] = wo(concat_h o_h).
Status ModelForward::attention(int l, const StepMetadata* md, ForwardTrace* trace, float* out) {
  const LayerSpec& spec = cfg_.layers[l];
  const LayerRefs& L = layers_[l];
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens();
  const int H = cfg_.n_heads, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim;
  const int r = cfg_.kv_lora_rank, qk = dn + dr;
  const float eps = static_cast<float>(cfg_.norm_eps);
  // An indexer owner's branches on the side queues: keys at once (lane 1), queries once the q
  // latent is normalized (lane 0), then the latent row (lane 1, after the keys); joined before
  // the q path, which needs the top-k counts (SSMax's n).
  // (Not under DCP: its indexer exchanges candidates over the group, on the main queue.)
  const bool fork = trace == nullptr && hisparse_ == nullptr && spec.indexer == IndexerRole::kOwner && !context_parallel() &&
                    be_.can_overlap({L.wq, L.wq_a, L.wq_b, L.wkv_a, L.idx_wq, L.idx_wk, L.idx_wproj});
  // The two halves run side by side; the scores wait for the keys (IndexerSelectArgs::keys_lane).
  if (fork) ML4_RETURN_IF_ERROR(be_.side([&] { return indexer_keys(l); }, 1));
  auto fork_select = [&]() -> Status {
    if (!fork) return ok_status();
    return be_.side([&] { return indexer_select(l, nullptr, 1); }, 0);
  };
  // 3./4. The latent row (c, rotated kr) into the layer's pages (KV owners only). Forked: on the
  // key lane after the indexer's key half, issued right after the query lane's fork (whose
  // scores wait for the key half only: the lane's event is recorded before this is issued) and
  // before the q projection, so that it waits for neither (it reads only x.a); the join before
  // the q path orders it before the attention. Otherwise on the main queue after the queries.
  auto kv = [&] { return be_.timed("attn: kv projection + cache write", [&]() -> Status {
    ML4_RETURN_IF_ERROR(be_.linear(L.wkv_a, x.a, T, x.ckv));
    const RopeArgs kr_rope = rope_args(x.ckv, 1, r + dr, r, dr, inv_freq_);
    const std::vector<int>& slots = latent_write_slots_[l];
    if (!prefill_context_parallel() && !slots.empty()) {  // normalized, rotated, written: one call
      ML4_RETURN_IF_ERROR(be_.latent_key_path(x.ckv, r, dr, L.kv_a_norm, eps, spec.rope ? &kr_rope : nullptr,
                                              slots[0], x.c));
      for (size_t i = 1; i < slots.size(); ++i)
        ML4_RETURN_IF_ERROR(be_.latent_cache_write(CacheGroup::kLatent, slots[i], x.c, x.ckv + r, r + dr));
      return ok_status();
    }
    ML4_RETURN_IF_ERROR(be_.rms_norm({x.ckv, nullptr, L.kv_a_norm, T, r, r + dr, eps, x.c}));
    if (spec.rope) ML4_RETURN_IF_ERROR(be_.rope(kr_rope));
    if (!prefill_context_parallel()) return ok_status();  // no slot to write
    // Every PCP rank writes the whole step's rows: [c | kr] of this rank's tokens, gathered.
    ML4_RETURN_IF_ERROR(be_.copy_rows(x.c, r, x.ckv, r + dr, T, r));
    ML4_ASSIGN_OR_RETURN(float* all, pcp_gather_rows(x.ckv, r + dr));
    for (int slot : slots)
      ML4_RETURN_IF_ERROR(be_.latent_cache_write_gathered(CacheGroup::kLatent, slot, all, r + dr, all + r, r + dr));
    return ok_status();
  }); };
  auto fork_kv = [&]() -> Status { return fork && spec.owns_kv() ? be_.side(kv, 1) : ok_status(); };
  // 1. Queries (with or without the query LoRA).
  ML4_RETURN_IF_ERROR(be_.timed("attn: q projection", [&]() -> Status {
    if (cfg_.q_lora_rank > 0) {
      ML4_RETURN_IF_ERROR(be_.linear(L.wq_a, x.a, T, x.q_latent));
      ML4_RETURN_IF_ERROR(be_.rms_norm({x.q_latent, nullptr, L.q_a_norm, T, cfg_.q_lora_rank, 0, eps, x.q_latent}));
      ML4_RETURN_IF_ERROR(fork_select());
      ML4_RETURN_IF_ERROR(fork_kv());
      return be_.linear(L.wq_b, x.q_latent, T, x.q);
    }
    ML4_RETURN_IF_ERROR(fork_select());
    ML4_RETURN_IF_ERROR(fork_kv());
    return be_.linear(L.wq, x.a, T, x.q);
  }));
  if (spec.owns_kv() && !fork) ML4_RETURN_IF_ERROR(kv());
  // 6a. W_UK absorption of the nope part (the q path below touches only the rope part).
  ML4_RETURN_IF_ERROR(be_.timed("attn: W_UK absorption", [&] { return be_.mla_absorb_q(L.absorb, x.q, x.q_lat); }));
  // 5. The keys attended.
  int selection = -1;
  ML4_RETURN_IF_ERROR(select_keys(l, md, trace, fork, &selection));
  // 2. + 6. (temperature): RoPE on the rope part, head scales (softmax scale, llama_4,
  // SSMax s_h ln n).
  QPathArgs qp;
  qp.rope = rope_args(x.q, H, qk, dn, dr, inv_freq_);
  qp.apply_rope = spec.rope;
  qp.base_scale = cfg_.softmax_scale();
  qp.llama4 = cfg_.llama4_scaling;
  qp.ssmax_s = spec.ssmax ? L.ssmax_s : nullptr;
  qp.selection = selection;
  qp.head_scale = x.head_scale;
  ML4_RETURN_IF_ERROR(be_.timed("attn: q path", [&] { return be_.q_path(qp); }));
  // 6b. Absorbed attention over the keys read back from the (source layer's) pages.
  MlaArgs ma;
  ma.cache_slot = latent_read_slot_[l];
  ma.selection = selection;
  ma.q_lat = x.q_lat;
  ma.q = x.q;
  ma.head_scale = x.head_scale;
  ma.out_lat = x.out_lat;
  ma.lse = x.lse;
  if (hisparse_ != nullptr && selection >= 0) {
    bool hot = false;
    ML4_RETURN_IF_ERROR(be_.timed("attn: HiSparse diff + loads", [&] { return hisparse_rows(l, *md, trace, selection, &hot); }));
    if (hot) {
      ma.group = CacheGroup::kHot;
      ma.cache_slot = hot_layer_[l];
      ma.selection = kHotSelection;
    }
  }
  if (context_parallel()) {
    ML4_RETURN_IF_ERROR(be_.timed("attn: DCP attention", [&] {
      return context_parallel_attention(ma).with_context("layer " + std::to_string(l));
    }));
  } else {
    ML4_RETURN_IF_ERROR(be_.timed("attn: MLA kernel", [&] { return be_.mla_attention(ma).with_context("layer " + std::to_string(l)); }));
  }
  ML4_RETURN_IF_ERROR(be_.timed("attn: W_UV", [&] { return be_.mla_apply_uv(L.absorb, x.out_lat, x.o); }));
  return be_.timed("attn: o projection", [&] { return be_.linear(L.wo, x.o, T, out); });
}

// HiSparse (offload/hisparse.h): per sequence, the distinct positions its tokens select in
// this layer are made resident in its hot buffer (LRU), the misses loaded from the host pool,
// and each token's list rewritten as hot-pool rows in the selection's own order.
Status ModelForward::hisparse_rows(int l, const StepMetadata& md, const ForwardTrace* trace, int selection, bool* hot) {
  const LayerSpec& spec = cfg_.layers[l];
  const bool forced = trace != nullptr && l < static_cast<int>(trace->forced_topk.size()) && !trace->forced_topk[l].empty();
  const std::vector<std::vector<int32_t>>* sel = nullptr;
  if (forced) {
    sel = &trace->forced_topk[l];
  } else {
    auto& cached = hisparse_positions_[selection];
    if (spec.indexer == IndexerRole::kOwner) {
      ML4_ASSIGN_OR_RETURN(cached, be_.read_selection(selection));
    }
    sel = &cached;
  }
  const int64_t T = md.num_tokens();
  if (static_cast<int64_t>(sel->size()) != T)
    return internal_error("HiSparse: layer {} selection has {} rows for {} tokens", l, sel->size(), T);
  HiSparseState& hs = *hisparse_;
  const int S = hs.slots(), k = cfg_.indexer.topk, h = hot_layer_[l];
  const int64_t n = static_cast<int64_t>(md.seqs.size());
  // Every sequence's working set first: one that overflows its buffer sends the layer to the
  // host pool before any buffer changes. A one-token sequence's selection is already sorted
  // and distinct (positions ascending), so most decode steps skip the sort.
  std::vector<std::vector<int32_t>> wanted(n);
  std::vector<char> overflow(n, 0);
  parallel_for(n, 1, [&](int64_t b, int64_t e) {
    for (int64_t si = b; si < e; ++si) {
      const auto& seq = md.seqs[si];
      auto& w = wanted[si];
      for (int64_t t = seq.first_token; t < seq.first_token + seq.num_tokens; ++t) w.insert(w.end(), (*sel)[t].begin(), (*sel)[t].end());
      if (seq.num_tokens > 1 || std::adjacent_find(w.begin(), w.end(), std::greater_equal<int32_t>()) != w.end()) {
        std::sort(w.begin(), w.end());
        w.erase(std::unique(w.begin(), w.end()), w.end());
      }
      overflow[si] = static_cast<int>(w.size()) > S;
    }
  });
  if (std::find(overflow.begin(), overflow.end(), 1) != overflow.end()) {
    ++hs.direct_layers;
    *hot = false;
    return ok_status();
  }
  std::vector<int32_t> rows(T * k, -1), counts(T, 0);
  std::vector<int> regions(n);
  for (int64_t si = 0; si < n; ++si) {  // assigned at the step's start: lookups only below
    ML4_ASSIGN_OR_RETURN(regions[si], hs.region(md.seqs[si].step->seq_id));
  }
  std::vector<std::vector<HotLoad>> seq_loads(n);
  parallel_for(n, 1, [&](int64_t b, int64_t e) {
    std::vector<int32_t> wanted_rows;
    std::vector<std::pair<int32_t, int32_t>> misses;
    for (int64_t si = b; si < e; ++si) {
      const auto& seq = md.seqs[si];
      const auto& w = wanted[si];
      wanted_rows.resize(w.size());
      misses.clear();
      hs.buffer(regions[si], h).touch(w, wanted_rows.data(), &misses);
      const int32_t base = regions[si] * S;
      for (const auto& [pos, row] : misses) seq_loads[si].push_back(HotLoad{static_cast<int32_t>(si), pos, base + row});
      for (int64_t t = seq.first_token; t < seq.first_token + seq.num_tokens; ++t) {
        const auto& row = (*sel)[t];
        counts[t] = static_cast<int32_t>(row.size());
        for (size_t j = 0; j < row.size(); ++j) {
          const size_t at = std::lower_bound(w.begin(), w.end(), row[j]) - w.begin();
          rows[t * k + j] = base + wanted_rows[at];
        }
      }
    }
  });
  std::vector<HotLoad> loads;
  for (int64_t si = 0; si < n; ++si) {
    hs.loads += static_cast<int64_t>(seq_loads[si].size());
    hs.hits += static_cast<int64_t>(wanted[si].size() - seq_loads[si].size());
    loads.insert(loads.end(), seq_loads[si].begin(), seq_loads[si].end());
  }
  ++hs.hot_layers;
  if (!loads.empty()) ML4_RETURN_IF_ERROR(be_.hisparse_load_rows(latent_read_slot_[l], h, loads));
  ML4_RETURN_IF_ERROR(be_.set_hot_selection(rows.data(), counts.data()));
  *hot = true;
  return ok_status();
}

// Decode context parallelism (SYSTEM.md S8), vLLM's scheme: the DCP ranks (runs of a TP
// group) hold disjoint shares of every sequence's keys, so each rank attends the queries of
// every head of the group over its share and the partials are merged by log-sum-exp (natural
// log, MlaArgs::lse's base): all-to-all of (out, lse) per head owner then a local merge (a2a),
// or an all-gather of lse, a local rescale and a reduce-scatter sum (ag_rs). ma: this rank's
// heads' arguments (selection: the global one, whose local twin is read here).
Status ModelForward::context_parallel_attention(MlaArgs ma) {
  Communicator& c = *comms_.dcp;
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens();
  const int N = c.size(), H = cfg_.n_heads, HG = H * N;
  const int r = cfg_.kv_lora_rank, qk = cfg_.qk_nope_head_dim + cfg_.qk_rope_head_dim;
  // 1. The group's queries: per rank [T][q_lat H r | q H qk | scale H], all-gathered, laid out
  // [T, HG, .] with rank p's heads at p H.
  const int64_t w = static_cast<int64_t>(H) * (r + qk + 1);
  ML4_ASSIGN_OR_RETURN(void* sendv, be_.scratch(kDcpSend, std::max<int64_t>(T * w, T * H * (r + 1) * N) * 4));
  ML4_ASSIGN_OR_RETURN(void* recvv, be_.scratch(kDcpRecv, std::max<int64_t>(N * T * w, T * H * (r + 1) * N) * 4));
  ML4_ASSIGN_OR_RETURN(void* qv, be_.scratch(kDcpQueries, T * HG * (r + qk + 1) * 4));
  ML4_ASSIGN_OR_RETURN(void* ov, be_.scratch(kDcpOut, T * HG * (r + 1 + N) * 4));
  float* send = static_cast<float*>(sendv);
  float* recv = static_cast<float*>(recvv);
  float* q_lat = static_cast<float*>(qv);
  float* q = q_lat + T * HG * r;
  float* scale = q + T * HG * qk;
  float* out = static_cast<float*>(ov);
  float* lse = out + T * HG * r;
  float* lse_all = lse + T * HG;
  ML4_RETURN_IF_ERROR(be_.timed("attn: DCP query all-gather", [&]() -> Status {
    if (T > 0) {
      ML4_RETURN_IF_ERROR(be_.copy_rows(ma.q_lat, H * r, send, w, T, H * r));
      ML4_RETURN_IF_ERROR(be_.copy_rows(ma.q, H * qk, send + H * r, w, T, H * qk));
      ML4_RETURN_IF_ERROR(be_.copy_rows(ma.head_scale, H, send + H * (r + qk), w, T, H));
    }
    ML4_RETURN_IF_ERROR(c.all_gather(send, recv, T * w * 4));
    for (int p = 0; p < N && T > 0; ++p) {
      const float* src = recv + p * T * w;
      ML4_RETURN_IF_ERROR(be_.copy_rows(src, w, q_lat + p * H * r, HG * r, T, H * r));
      ML4_RETURN_IF_ERROR(be_.copy_rows(src + H * r, w, q + p * H * qk, HG * qk, T, H * qk));
      ML4_RETURN_IF_ERROR(be_.copy_rows(src + H * (r + qk), w, scale + p * H, HG, T, H));
    }
    return ok_status();
  }));
  // 2. Every head of the group over this rank's keys (a rank without any of a query's keys
  // gives out 0, lse -inf).
  MlaArgs local = ma;
  if (local.selection >= 0) local.selection += local_selection_offset_;
  local.heads = HG;
  local.q_lat = q_lat;
  local.q = q;
  local.head_scale = scale;
  local.out_lat = out;
  local.lse = lse;
  ML4_RETURN_IF_ERROR(be_.timed("attn: DCP local attention", [&] { return be_.mla_attention(local); }));
  // 3. The combine, into this rank's heads' out_lat [T, H, r].
  return be_.timed("attn: DCP combine", [&]() -> Status {
    if (plan_->dcp_all_to_all()) {
      const int64_t part = T * H * (r + 1);  // [T, H, r] out then [T, H] lse, for each head owner
      for (int p = 0; p < N && T > 0; ++p) {
        ML4_RETURN_IF_ERROR(be_.copy_rows(out + p * H * r, HG * r, send + p * part, H * r, T, H * r));
        ML4_RETURN_IF_ERROR(be_.copy_rows(lse + p * H, HG, send + p * part + T * H * r, H, T, H));
      }
      ML4_RETURN_IF_ERROR(c.all_to_all(send, recv, part * 4));
      return T > 0 ? be_.merge_attention_parts(recv, N, part, T * H, r, x.out_lat) : ok_status();
    }
    ML4_RETURN_IF_ERROR(c.all_gather(lse, lse_all, T * HG * 4));
    if (T > 0) ML4_RETURN_IF_ERROR(be_.rescale_attention_part(out, lse, lse_all, N, T * HG, r));
    for (int p = 0; p < N && T > 0; ++p)
      ML4_RETURN_IF_ERROR(be_.copy_rows(out + p * H * r, HG * r, send + p * T * H * r, H * r, T, H * r));
    return c.reduce_scatter_sum(send, x.out_lat, T * H * r);
  });
}

// 7. MoE: the FFN norm, then the f32 router and its top-k (one launch where the backend fuses
// them, Backend::norm_moe_router); on traced steps the router's choice read back and
// forced experts applied (a host round trip); then the routed and shared experts.
Status ModelForward::moe(int l, ForwardTrace* trace, const NormArgs& norm, float* out) {
  const LayerRefs& L = layers_[l];
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens();
  const int K = cfg_.moe.num_experts_per_tok;
  // The experts follow in the same segment unless a trace reads the router's choice back or
  // expert parallelism dispatches them.
  const MoeRef same_segment = trace == nullptr && !expert_parallel() ? L.moe : MoeRef{};
  ML4_RETURN_IF_ERROR(be_.segment([&] {
    return be_.timed("ffn norm + moe router", [&]() -> Status {
      return be_.norm_moe_router(norm, same_segment, L.gate, L.router_bias, x.router, x.expert_ids, x.expert_wts);
    });
  }));
  if (trace != nullptr) {
    ML4_RETURN_IF_ERROR(be_.host_sync([&]() -> Status {
      ML4_ASSIGN_OR_RETURN(std::vector<int32_t> ids, be_.read_ints(x.expert_ids, T * K));
      auto& rec = trace->experts[l];
      rec.assign(T, {});
      for (int64_t t = 0; t < T; ++t) rec[t].assign(ids.begin() + t * K, ids.begin() + (t + 1) * K);
      if (l >= static_cast<int>(trace->forced_experts.size()) || trace->forced_experts[l].empty()) return ok_status();
      for (int64_t t = 0; t < T; ++t) std::copy_n(trace->forced_experts[l][t].begin(), K, ids.begin() + t * K);
      return be_.moe_route({x.router, L.router_bias, ids.data(), x.expert_ids, x.expert_wts});
    }));
  }
  if (expert_parallel()) return moe_expert_parallel(l, out);
  auto experts = [&] {
    return be_.timed("moe experts", [&] { return be_.moe_experts(L.moe, x.a, x.expert_ids, x.expert_wts, out); });
  };
  ML4_RETURN_IF_ERROR(be_.moe_experts_capturable(L.moe) ? be_.segment(experts) : be_.host_sync(experts));
  // Tensor parallelism: each rank ran every expert's (and the shared expert's) hidden slice.
  return tp_all_reduce(out, T * cfg_.dim);
}

Status ModelForward::tp_all_reduce(float* x, int64_t n) {
  if (!tensor_parallel()) return ok_status();
  return be_.segment([&] { return be_.timed("tp all-reduce", [&] { return comms_.tp->all_reduce_sum(x, n); }); });
}

// 7. under expert parallelism (DeepEP's dispatch / combine shape, over the EP communicator):
// each rank sends each of its tokens once to every rank that holds one of its K experts, with
// the K expert ids local to that rank (-1 for experts elsewhere) and the router weights; the
// owner runs its experts over what it received and sends back one weighted sum per token; the
// sender adds the answers up (in rank order, i.e. expert order) and then the shared expert.
// Under TP the tokens are the same on every TP rank, so each dispatches its 1/t of them
// (ParallelPlan::dispatch_range) and the TP all-reduce at the end, which also sums the TP-split
// shared expert, assembles the rest. The host computes the routing tables from the expert
// ids read back, which on a device ends the graph segment (as the MoE expert loop does).
Status ModelForward::moe_expert_parallel(int l, float* out) {
  const LayerRefs& L = layers_[l];
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens(), D = cfg_.dim;
  const int K = cfg_.moe.num_experts_per_tok;
  Communicator& ep = *comms_.ep;
  const int P = ep.size();
  ML4_RETURN_IF_ERROR(be_.host_sync([&] {
    return be_.timed("moe experts (expert parallel)", [&]() -> Status {
      ML4_ASSIGN_OR_RETURN(std::vector<int32_t> ids, be_.read_ints(x.expert_ids, T * K));
      const auto [t0, t1] = plan_->dispatch_range(T);
      std::vector<std::vector<int32_t>> tok(P), lid(P);
      std::vector<int> owner(K);
      for (int64_t t = t0; t < t1; ++t) {
        for (int k = 0; k < K; ++k) {
          const int32_t e = ids[t * K + k];
          if (e < 0 || e >= cfg_.moe.num_experts) return internal_error("layer {}: routed expert {} out of range", l, e);
          owner[k] = plan_->expert_owner(e);
        }
        for (int d = 0; d < P; ++d) {
          bool any = false;
          for (int k = 0; k < K; ++k) any |= owner[k] == d;
          if (!any) continue;
          tok[d].push_back(static_cast<int32_t>(t));
          for (int k = 0; k < K; ++k) lid[d].push_back(owner[k] == d ? ids[t * K + k] - plan_->expert_begin_of(d) : -1);
        }
      }
      std::vector<int64_t> send_n(P), recv_n;
      std::vector<int32_t> send_tok, send_ids;
      for (int d = 0; d < P; ++d) {
        send_n[d] = static_cast<int64_t>(tok[d].size());
        send_tok.insert(send_tok.end(), tok[d].begin(), tok[d].end());
        send_ids.insert(send_ids.end(), lid[d].begin(), lid[d].end());
      }
      ML4_RETURN_IF_ERROR(ep.exchange_counts(send_n, &recv_n));
      int64_t ns = 0, nr = 0;
      for (int d = 0; d < P; ++d) ns += send_n[d], nr += recv_n[d];
      auto bytes_of = [](const std::vector<int64_t>& n, int64_t row) {
        std::vector<int64_t> b(n.size());
        for (size_t i = 0; i < n.size(); ++i) b[i] = n[i] * row;
        return b;
      };
      const int64_t fD = D * 4, fK = K * 4;
      ML4_ASSIGN_OR_RETURN(void* idx, be_.scratch(0, ns * 4));
      ML4_ASSIGN_OR_RETURN(void* sids, be_.scratch(1, ns * fK));
      ML4_ASSIGN_OR_RETURN(void* sx, be_.scratch(2, ns * fD));
      ML4_ASSIGN_OR_RETURN(void* sw, be_.scratch(3, ns * fK));
      ML4_ASSIGN_OR_RETURN(void* rx, be_.scratch(4, nr * fD));
      ML4_ASSIGN_OR_RETURN(void* rids, be_.scratch(5, nr * fK));
      ML4_ASSIGN_OR_RETURN(void* rw, be_.scratch(6, nr * fK));
      ML4_ASSIGN_OR_RETURN(void* ry, be_.scratch(7, nr * fD));
      ML4_ASSIGN_OR_RETURN(void* sy, be_.scratch(8, ns * fD));
      auto* idx_i = static_cast<int32_t*>(idx);
      ML4_RETURN_IF_ERROR(be_.upload(idx, send_tok.data(), ns * 4));
      ML4_RETURN_IF_ERROR(be_.upload(sids, send_ids.data(), ns * fK));
      ML4_RETURN_IF_ERROR(be_.gather_rows_at(x.a, idx_i, ns, D, static_cast<float*>(sx)));
      ML4_RETURN_IF_ERROR(be_.gather_rows_at(x.expert_wts, idx_i, ns, K, static_cast<float*>(sw)));
      // Dispatch: rows, their local expert ids and weights.
      ML4_RETURN_IF_ERROR(ep.all_to_all_v(sx, bytes_of(send_n, fD), rx, bytes_of(recv_n, fD)));
      ML4_RETURN_IF_ERROR(ep.all_to_all_v(sids, bytes_of(send_n, fK), rids, bytes_of(recv_n, fK)));
      ML4_RETURN_IF_ERROR(ep.all_to_all_v(sw, bytes_of(send_n, fK), rw, bytes_of(recv_n, fK)));
      ML4_RETURN_IF_ERROR(be_.moe_experts_rows(L.moe, static_cast<float*>(rx), nr, static_cast<int32_t*>(rids),
                                               static_cast<float*>(rw), static_cast<float*>(ry)));
      // Combine: one weighted sum back per dispatched token, added in rank order.
      ML4_RETURN_IF_ERROR(ep.all_to_all_v(ry, bytes_of(recv_n, fD), sy, bytes_of(send_n, fD)));
      ML4_RETURN_IF_ERROR(be_.fill(out, T * D, 0.0f));
      ML4_RETURN_IF_ERROR(be_.scatter_add_rows_at(static_cast<float*>(sy), idx_i, ns, D, out));
      if (L.has_shared) {
        ML4_ASSIGN_OR_RETURN(void* sh, be_.scratch(9, T * fD));
        ML4_RETURN_IF_ERROR(mlp(L.shared, x.a, T, static_cast<float*>(sh)));
        ML4_RETURN_IF_ERROR(be_.add_rows(out, D, static_cast<float*>(sh), D, T, D));
      }
      return ok_status();
    });
  }));
  return tp_all_reduce(out, T * D);
}

// The logits rows: each TP rank's vocabulary shard [R, V/t] into its part of logits_parts,
// all-gathered ([t][R][V/t]), then laid out as [R, V].
Status ModelForward::logits() {
  const Activations& x = be_.acts();
  const int64_t R = be_.step_rows();
  if (!tensor_parallel()) return be_.linear(output_, x.normed, R, x.logits);
  if (x.logits_parts == nullptr) return internal_error("tensor parallelism: the backend has no logits_parts buffer");
  const int t = comms_.tp->size();
  const int64_t V = cfg_.vocab_size, Vl = V / t;
  float* mine = x.logits_parts + comms_.tp->rank() * R * Vl;
  ML4_RETURN_IF_ERROR(be_.linear(output_, x.normed, R, mine));
  ML4_RETURN_IF_ERROR(be_.timed("tp all-gather logits", [&] {
    return comms_.tp->all_gather(mine, x.logits_parts, R * Vl * static_cast<int64_t>(sizeof(float)));
  }));
  for (int j = 0; j < t; ++j) ML4_RETURN_IF_ERROR(be_.copy_rows(x.logits_parts + j * R * Vl, Vl, x.logits + j * Vl, V, R, Vl));
  return ok_status();
}

Status ModelForward::forward(const StepMetadata* md, ForwardTrace* trace) {
  if (prefill_context_parallel()) {
    if (md == nullptr) return internal_error("prefill context parallelism needs the step's metadata");
    pcp_rows_ = md->pcp_rows;
    pcp_step_tokens_ = static_cast<int64_t>(md->pcp_gather.size());
    const int64_t bytes = std::max<int64_t>(pcp_step_tokens_, 1) * 4;
    ML4_ASSIGN_OR_RETURN(void* idx, be_.scratch(kPcpIndex, bytes));
    if (pcp_step_tokens_ > 0) ML4_RETURN_IF_ERROR(be_.upload(idx, md->pcp_gather.data(), pcp_step_tokens_ * 4));
    pcp_index_ = static_cast<const int32_t*>(idx);
  }
  const Activations& x = be_.acts();
  const int64_t T = be_.step_tokens(), R = be_.step_rows(), D = cfg_.dim;
  const float eps = static_cast<float>(cfg_.norm_eps);
  if (hisparse_ != nullptr) {
    if (md == nullptr) return internal_error("HiSparse needs the step's host metadata");
    for (const auto& s : md->seqs)
      ML4_RETURN_IF_ERROR(hisparse_->begin_seq_step(s.step->seq_id, s.start_pos, s.start_pos + s.num_tokens));
  }
  if (trace != nullptr) {
    if (md == nullptr) return internal_error("a traced forward needs the step's host metadata");
    trace->topk.assign(cfg_.n_layers, {});
    trace->experts.assign(cfg_.n_layers, {});
    ML4_RETURN_IF_ERROR(validate_forced_decisions(*trace, cfg_, md->positions));
  }
  ML4_RETURN_IF_ERROR(be_.segment([&] { return be_.timed("embedding", [&] { return be_.embedding(x.residual); }); }));
  ML4_RETURN_IF_ERROR(tp_all_reduce(x.residual, T * D));  // vocabulary-parallel rows
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const LayerRefs& L = layers_[l];
    // a = rms(residual), the previous layer's FFN output added into the residual first.
    ML4_RETURN_IF_ERROR(be_.segment([&] {
      return be_.rms_norm({l == 0 ? x.residual : x.tmp, l == 0 ? nullptr : x.residual, L.attn_norm, T, D, 0, eps, x.a});
    }));
    ML4_RETURN_IF_ERROR(capture_hidden(l - 1));
    // Traced steps read decisions back (and upload forced ones) inside the layer, and so
    // does HiSparse (the selections, to diff against the hot buffers).
    if (trace != nullptr || hisparse_ != nullptr) {
      ML4_RETURN_IF_ERROR(be_.host_sync([&] { return attention(l, md, trace, x.tmp); }));
    } else {
      ML4_RETURN_IF_ERROR(be_.segment([&] { return attention(l, nullptr, nullptr, x.tmp); }));
    }
    ML4_RETURN_IF_ERROR(tp_all_reduce(x.tmp, T * D));  // wo is row-parallel
    // The FFN half as one launch where the backend can (the latency-specialised decode path;
    // not with a trace, which reads the routing back, nor split over ranks).
    FfnBlockArgs fb;
    fb.attn_out = x.tmp;
    fb.residual = x.residual;
    fb.norm_w = L.ffn_norm;
    fb.eps = eps;
    fb.a = x.a;
    if (cfg_.layers[l].ffn == FfnKind::kMoe) {
      fb.gate = L.gate;
      fb.router_bias = L.router_bias;
      fb.moe = L.moe;
      fb.logits = x.router;
      fb.ids = x.expert_ids;
      fb.weights = x.expert_wts;
    } else {
      fb.dense = L.dense;
    }
    fb.out = x.tmp;
    if (trace == nullptr && !tensor_parallel() && !expert_parallel() && be_.ffn_block_fused(fb)) {
      ML4_RETURN_IF_ERROR(be_.segment([&] { return be_.timed("ffn block (resident)", [&] { return be_.ffn_block(fb); }); }));
      continue;
    }
    // residual += attention output, a = rms(residual): its own call before a dense MLP, the
    // router's before the experts (a backend may run it inside the router's launch).
    const NormArgs ffn_norm{x.tmp, x.residual, L.ffn_norm, T, D, 0, eps, x.a};
    switch (cfg_.layers[l].ffn) {
      case FfnKind::kDense:
        ML4_RETURN_IF_ERROR(be_.segment([&] { return be_.rms_norm(ffn_norm); }));
        ML4_RETURN_IF_ERROR(be_.segment([&] { return be_.timed("dense ffn", [&] { return mlp(L.dense, x.a, T, x.tmp); }); }));
        ML4_RETURN_IF_ERROR(tp_all_reduce(x.tmp, T * D));  // w2 is row-parallel
        break;
      case FfnKind::kMoe:
        ML4_RETURN_IF_ERROR(moe(l, trace, ffn_norm, x.tmp));
        break;
    }
  }
  // residual += the last FFN output, normalized into a (unused: only the rows matter), or
  // straight into the rows when they are the step's tokens in order (a decode step: saves the
  // gather and a second norm of the same values).
  const bool rows_are_tokens = R > 0 && be_.rows_are_tokens() && !prefill_context_parallel();
  if (R > 0 || drafter_ != nullptr) {
    ML4_RETURN_IF_ERROR(be_.segment([&] {
      return be_.rms_norm({x.tmp, x.residual, final_norm_, T, D, 0, eps, rows_are_tokens ? x.normed : x.a});
    }));
  }
  if (drafter_ != nullptr) {
    ML4_RETURN_IF_ERROR(capture_hidden(cfg_.n_layers - 1));
    ML4_RETURN_IF_ERROR(drafter_context());
  }
  if (R > 0) {
    ML4_RETURN_IF_ERROR(be_.segment([&] {
      return be_.timed("final norm + lm_head", [&]() -> Status {
        if (!rows_are_tokens) {
          ML4_RETURN_IF_ERROR(be_.gather_logits_rows(x.residual, x.rows));
          ML4_RETURN_IF_ERROR(be_.rms_norm({x.rows, nullptr, final_norm_, R, D, 0, eps, x.normed}));
        }
        return logits();
      });
    }));
  }
  return be_.finish_forward();
}

}  // namespace ml4
