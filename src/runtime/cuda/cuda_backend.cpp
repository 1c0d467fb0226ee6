// The per-layer pieces of CudaRunner's forward (see cuda_runner.h): linears, the DSA indexer,
// MLA attention and the MoE. Each block names the CpuModel step (cpu_model.cpp,
// cpu_attention.cpp) it reproduces.
#include <algorithm>
#include <cmath>

#include "kv/paged_kv_cache.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/cache_write.h"
#include "ops/cuda/cuda_runner.h"
#include "ops/cuda/cuda_runner_internal.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/indexer.h"
#include "ops/cuda/topk.h"

namespace ml4::cuda {

Status CudaRunner::lin(const DeviceLinear& w, const float* x, int64_t M, float* y) {
  const bool gemv_ok = w.format == LinearFormat::kBF16 || w.format == LinearFormat::kFP8Block;
  if (gemv_ok && (opts_.exact_activations || M <= kGemvMaxM)) {
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxM) {
      const int64_t m = std::min<int64_t>(kGemvMaxM, M - m0);
      float* ws = (on_side_ ? buf_->gemv_ws_side : buf_->gemv_ws).as<float>();
      ML4_RETURN_IF_ERROR(gemv({x + m0 * w.K, m, w.N, w.K, w.format, w.weight.data(), w.scale.as<float>(),
                                y + m0 * w.N, ws, stream_})
                              .with_context(w.name));
    }
    return Status::ok();
  }
  return linear_f32(*lt_, w, x, M, y, buf_->lin, stream_).with_context(w.name);
}

Status CudaRunner::mlp(const DeviceMlp& m, const float* x, int64_t M, float* y) {
  MoeScratch& s = buf_->moe;
  const int64_t I = m.w1.N;
  ML4_RETURN_IF_ERROR(lin(m.w1, x, M, s.g.as<float>()));
  ML4_RETURN_IF_ERROR(lin(m.w3, x, M, s.u.as<float>()));
  ML4_RETURN_IF_ERROR(silu_mul({s.g.as<float>(), s.u.as<float>(), M, I, 0, 0, s.g.as<float>(), nullptr, stream_}));
  return lin(m.w2, s.g.as<float>(), M, y);
}

// RoPE of this step's tokens (LeRoPE positions, YaRN factor) on `heads` vectors of `stride`
// floats per token, rotating [offset, offset + dim) of each: the q path's shared fields.
QPathParams CudaRunner::rope_params(float* x, int heads, int stride, int offset, int dim, const float* inv_freq) const {
  QPathParams p;
  p.q = x;
  p.T = step_T_;
  p.H = heads;
  p.head_stride = stride;
  p.rope_offset = offset;
  p.rope_dim = dim;
  p.positions = buf_->pos.as<int64_t>();
  p.inv_freq = inv_freq;
  p.attn_factor = rope_factor_;
  p.lerope = cfg_.lerope;
  p.stream = stream_;
  return p;
}

// cpu_attention.cpp CpuModel::indexer_topk for an indexer owner: this step's keys into the
// indexer pages, then per token the causal top-k of its scores as latent cache slots into
// the layer's top-k buffer (and, when tracing, as positions into trace->topk[l]).
Status CudaRunner::indexer(int l, ForwardTrace* trace) {
  ML4_RETURN_IF_ERROR(indexer_keys(l));
  return indexer_select(l, trace);
}

// The half that reads only x: the keys (projection, LayerNorm, RoPE) into the indexer pages
// and the per-head weights.
Status CudaRunner::indexer_keys(int l) {
  const LayerSpec& spec = cfg_.layers[l];
  Layer& L = layers_[l];
  Buffers& b = *buf_;
  const int HI = cfg_.indexer.n_heads, dI = cfg_.indexer.head_dim, rd = cfg_.indexer.rope_head_dim;
  const int64_t T = step_T_;
  float* ik = b.ik.as<float>();
  float* iw = b.iw.as<float>();
  ML4_RETURN_IF_ERROR(lin(L.idx_wk, b.a.as<float>(), T, ik));
  ML4_RETURN_IF_ERROR(layer_norm({ik, L.idx_knorm_w.as<float>(), L.idx_knorm_b.as<float>(), T, dI, 1e-6f, ik, stream_}));
  ML4_RETURN_IF_ERROR(lin(L.idx_wproj, b.a.as<float>(), T, iw));
  if (spec.rope) {  // NeoX pairs on the [rope | nope] head, LeRoPE positions
    QPathParams rp = rope_params(ik, 1, dI, 0, rd, idx_inv_freq_.as<float>());
    rp.neox = true;
    ML4_RETURN_IF_ERROR(q_path(rp));
  }
  IndexerCacheWriteParams wp;
  wp.k = ik;
  wp.slots = b.idx_slots.as<int64_t>();
  wp.T = T;
  wp.dI = dI;
  wp.cache = idx_kv_[spec.indexer_slot].data();
  wp.num_blocks = group_blocks_[indexer_group_];
  wp.stream = stream_;
  return indexer_cache_write(wp);
}

// The half that needs the query latent (DeepSeek-V3.2: q from the query-LoRA latent when
// there is one): the queries, their scores over the pages, the causal top-k.
Status CudaRunner::indexer_select(int l, ForwardTrace* trace) {
  const LayerSpec& spec = cfg_.layers[l];
  Layer& L = layers_[l];
  Buffers& b = *buf_;
  const int HI = cfg_.indexer.n_heads, dI = cfg_.indexer.head_dim, rd = cfg_.indexer.rope_head_dim;
  const int k = cfg_.indexer.topk;
  const int64_t T = step_T_;
  float* iq = b.iq.as<float>();
  float* iw = b.iw.as<float>();
  ML4_RETURN_IF_ERROR(lin(L.idx_wq, cfg_.q_lora_rank > 0 ? b.qlat_in.as<float>() : b.a.as<float>(), T, iq));
  if (spec.rope) {
    QPathParams rp = rope_params(iq, HI, dI, 0, rd, idx_inv_freq_.as<float>());
    rp.neox = true;
    ML4_RETURN_IF_ERROR(q_path(rp));
  }
  ML4_RETURN_IF_ERROR(indexer_query_quant({iq, T * HI, dI, true, b.iq8.data(), b.iqs.as<float>(), stream_}));
  const int64_t maxlen = step_maxlen_;
  // Scores of a chunk of tokens at a time: at most 64 Mi floats (256 MiB) of scores.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(T, (int64_t{64} << 20) / maxlen));
  if (chunk * maxlen > b.scores_cap) {
    ++buffer_generation_;
    ML4_ASSIGN_OR_RETURN(b.scores, DeviceBuffer::alloc(chunk * maxlen * 4));
    b.scores_cap = chunk * maxlen;
  }
  const int buf = topk_buf_[l];
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    IndexerScoresParams sp;
    sp.q = static_cast<const uint8_t*>(b.iq8.data()) + t0 * HI * dI;
    sp.q_scale = b.iqs.as<float>() + t0 * HI;
    sp.weights = iw + t0 * HI;
    sp.weight_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(HI)) / std::sqrt(static_cast<double>(dI)));
    sp.cache = idx_kv_[spec.indexer_slot].data();
    sp.num_blocks = group_blocks_[indexer_group_];
    sp.block_table = b.idx_block_table.as<int32_t>();
    sp.block_table_stride = b.maxb;
    sp.seq_of_token = b.seq_of.as<int32_t>() + t0;
    sp.lengths = b.lengths.as<int32_t>() + t0;
    sp.T = n;
    sp.HI = HI;
    sp.dI = dI;
    sp.max_length = static_cast<int>(maxlen);
    sp.scores = b.scores.as<float>();
    sp.scores_stride = maxlen;
    sp.math = opts_.exact_activations ? IndexerMath::kF32 : IndexerMath::kFp8TensorCore;
    sp.stream = stream_;
    ML4_RETURN_IF_ERROR(timed("attn: (indexer) of which scores",
                              [&] { return indexer_scores(sp).with_context("layer " + std::to_string(l)); }));
    TopkParams tp;
    tp.scores = b.scores.as<float>();
    tp.scores_stride = maxlen;
    tp.lengths = b.lengths.as<int32_t>() + t0;
    tp.T = n;
    tp.k = k;
    tp.positions = trace != nullptr ? b.topk_pos.as<int32_t>() + t0 * k : nullptr;
    tp.slots = b.topk_slots[buf].as<int32_t>() + t0 * k;
    tp.counts = b.topk_counts[buf].as<int32_t>() + t0;
    tp.out_stride = k;
    tp.block_table = b.block_table.as<int32_t>();
    tp.block_table_stride = b.maxb;
    tp.seq_of_token = b.seq_of.as<int32_t>() + t0;
    tp.workspace = b.topk_ws.data();
    tp.workspace_bytes = b.topk_ws_bytes;
    tp.max_length = maxlen;
    tp.stream = stream_;
    ML4_RETURN_IF_ERROR(timed("attn: (indexer) of which top-k", [&] { return topk(tp).with_context("layer " + std::to_string(l)); }));
  }
  if (trace != nullptr) {
    std::vector<int32_t> pos(T * k), cnt(T);
    ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pos.data(), b.topk_pos.data(), pos.size() * 4, cudaMemcpyDeviceToHost, stream_));
    ML4_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(cnt.data(), b.topk_counts[buf].data(), cnt.size() * 4, cudaMemcpyDeviceToHost, stream_));
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    auto& rec = trace->topk[l];
    rec.assign(T, {});
    for (int64_t t = 0; t < T; ++t) rec[t].assign(pos.begin() + t * k, pos.begin() + t * k + cnt[t]);
  }
  return Status::ok();
}

bool CudaRunner::overlap_indexer(int l, ForwardTrace* trace) const {
  const LayerSpec& spec = cfg_.layers[l];
  if (side_stream_ == nullptr || !opts_.overlap_indexer || trace != nullptr || (profile_ != nullptr && mode_ == Mode::kEager) ||
      !spec.sparse() || spec.indexer != IndexerRole::kOwner)
    return false;
  // Only the GEMV may run on both streams at once (each has its own workspace); cuBLASLt
  // shares one workspace and scratch.
  const Layer& L = layers_[l];
  auto gemv = [&](const DeviceLinear& w) {
    return (w.format == LinearFormat::kBF16 || w.format == LinearFormat::kFP8Block) &&
           (opts_.exact_activations || step_T_ <= kGemvMaxM);
  };
  const bool q_ok = cfg_.q_lora_rank > 0 ? gemv(L.wq_a) && gemv(L.wq_b) : gemv(L.wq);
  return q_ok && (!spec.owns_kv() || gemv(L.wkv_a)) && gemv(L.idx_wq) && gemv(L.idx_wk) && gemv(L.idx_wproj);
}

// cpu_attention.cpp CpuModel::attention steps 1-6.
Status CudaRunner::attention(int l, const StepMetadata* md, float* out, ForwardTrace* trace) {
  const LayerSpec& spec = cfg_.layers[l];
  Layer& L = layers_[l];
  Buffers& b = *buf_;
  const int H = cfg_.n_heads, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dv = cfg_.v_head_dim;
  const int r = cfg_.kv_lora_rank, qk = dn + dr;
  const int64_t T = step_T_;
  const float eps = static_cast<float>(cfg_.norm_eps);
  float* q = b.q.as<float>();
  // The indexer branch (overlap_indexer): keys from x at once, queries once the q latent is
  // normalized; joined before the q path, which needs the top-k counts (SSMax).
  const bool fork = overlap_indexer(l, trace);
  if (fork) {
    ++overlapped_layers_;
    ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_fork_, stream_));
    ML4_RETURN_IF_ERROR(on_side([&]() -> Status {
      ML4_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ev_fork_, 0));
      return indexer_keys(l);
    }));
  }
  auto fork_select = [&]() -> Status {
    if (!fork) return Status::ok();
    ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_qlat_, stream_));
    return on_side([&]() -> Status {
      ML4_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ev_qlat_, 0));
      ML4_RETURN_IF_ERROR(indexer_select(l, nullptr));
      return cuda_status(cudaEventRecord(ev_join_, stream_), "indexer join");
    });
  };
  // 1. Queries.
  ML4_RETURN_IF_ERROR(timed("attn: q projection", [&]() -> Status {
    if (cfg_.q_lora_rank > 0) {
      ML4_RETURN_IF_ERROR(lin(L.wq_a, b.a.as<float>(), T, b.qlat_in.as<float>()));
      ML4_RETURN_IF_ERROR(rms_norm({b.qlat_in.as<float>(), nullptr, L.q_a_norm.as<float>(), T, cfg_.q_lora_rank,
                                    eps, b.qlat_in.as<float>(), nullptr, stream_}));
      ML4_RETURN_IF_ERROR(fork_select());
      return lin(L.wq_b, b.qlat_in.as<float>(), T, q);
    }
    ML4_RETURN_IF_ERROR(fork_select());
    return lin(L.wq, b.a.as<float>(), T, q);
  }));
  // 3./4. Latent row into the pages (owners).
  if (spec.owns_kv()) ML4_RETURN_IF_ERROR(timed("attn: kv projection + cache write", [&]() -> Status {
    float* ckv = b.ckv.as<float>();
    ML4_RETURN_IF_ERROR(lin(L.wkv_a, b.a.as<float>(), T, ckv));
    RmsNormParams np{ckv, nullptr, L.kv_a_norm.as<float>(), T, r, eps, b.c.as<float>(), nullptr, stream_};
    np.x_stride = r + dr;
    ML4_RETURN_IF_ERROR(rms_norm(np));
    if (spec.rope) ML4_RETURN_IF_ERROR(q_path(rope_params(ckv, 1, r + dr, r, dr, inv_freq_.as<float>())));
    for (int slot : latent_write_slots_[l]) {
      LatentCacheWriteParams w;
      w.c = b.c.as<float>();
      w.kr = ckv + r;
      w.kr_stride = r + dr;
      w.slots = b.slots.as<int64_t>();
      w.T = T;
      w.r = r;
      w.dr = dr;
      w.dtype = spec_.dtype;
      w.cache = kv_[slot].data();
      w.num_slots = num_blocks_ * kPageTokens;
      w.stream = stream_;
      ML4_RETURN_IF_ERROR(latent_cache_write(w));
    }
    return Status::ok();
  }));
  // 6a. W_UK absorption of the nope part (the q path below touches only the rope part).
  MlaAbsorbParams ab;
  ab.T = T;
  ab.H = H;
  ab.dn = dn;
  ab.dv = dv;
  ab.r = r;
  ab.q = q;
  ab.q_stride = qk;
  ab.q_offset = 0;
  ab.w_uk = L.w_uk.as<float>();
  ab.q_lat = b.q_lat.as<float>();
  ab.lat = b.out_lat.as<float>();
  ab.w_uv = L.w_uv.as<float>();
  ab.o = b.o.as<float>();
  ab.stream = stream_;
  ML4_RETURN_IF_ERROR(timed("attn: W_UK absorption", [&] { return mla_absorb_q(ab); }));
  // 5. DSA: the keys this layer attends to (its own indexer's, its source's, or forced).
  const int32_t* sel_slots = nullptr;
  const int32_t* sel_counts = nullptr;
  const int k = cfg_.indexer.topk;
  if (spec.sparse()) {
    if (fork) {
      ML4_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ev_join_, 0));
    } else if (spec.indexer == IndexerRole::kOwner) {
      ML4_RETURN_IF_ERROR(timed("attn: indexer + top-k", [&] { return indexer(l, trace); }));
    }
    const int src = spec.indexer == IndexerRole::kOwner ? l : spec.indexer_source;
    if (trace != nullptr && src != l) trace->topk[l] = trace->topk[src];
    const bool forced = trace != nullptr && l < static_cast<int>(trace->forced_topk.size()) &&
                        !trace->forced_topk[l].empty();
    if (forced) {  // test input, validated: positions -> latent slots, -1 padded
      std::vector<int32_t> sl(T * k, -1), cnt(T);
      for (int64_t t = 0; t < T; ++t) {
        const auto& row = trace->forced_topk[l][t];
        const int si = md->seq_of_token[t];
        for (size_t j = 0; j < row.size(); ++j)
          sl[t * k + j] = static_cast<int32_t>(md->slot_of(si, latent_group_, row[j]));
        cnt[t] = static_cast<int32_t>(row.size());
      }
      ML4_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(b.forced_slots.data(), sl.data(), sl.size() * 4, cudaMemcpyHostToDevice, stream_));
      ML4_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(b.forced_counts.data(), cnt.data(), cnt.size() * 4, cudaMemcpyHostToDevice, stream_));
      ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));  // the host vectors die here
      sel_slots = b.forced_slots.as<int32_t>();
      sel_counts = b.forced_counts.as<int32_t>();
    } else {
      sel_slots = b.topk_slots[topk_buf_[src]].as<int32_t>();
      sel_counts = b.topk_counts[topk_buf_[src]].as<int32_t>();
    }
  }
  // 2. + 6. (temperature): RoPE on the rope part, head scales (SSMax's n: keys attended).
  QPathParams qp = rope_params(q, H, qk, dn, dr, inv_freq_.as<float>());
  qp.apply_rope = spec.rope;
  qp.base_scale = cfg_.softmax_scale();
  qp.llama4 = cfg_.llama4_scaling;
  qp.ssmax_s = spec.ssmax ? L.ssmax_s.as<float>() : nullptr;
  qp.n_keys = sel_counts;
  qp.head_scale = b.head_scale.as<float>();
  ML4_RETURN_IF_ERROR(timed("attn: q path", [&] { return q_path(qp); }));
  // 6b. Absorbed attention over the pages.
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(b.q_rope.data(), dr * 4, q + dn, qk * 4, dr * 4, T * H,
                                             cudaMemcpyDeviceToDevice, stream_));
  MlaAttentionParams ap;
  ap.q_lat = b.q_lat.as<float>();
  ap.q_rope = b.q_rope.as<float>();
  ap.head_scale = b.head_scale.as<float>();
  ap.T = T;
  ap.H = H;
  ap.r = r;
  ap.dr = dr;
  ap.cache = kv_[latent_read_slot_[l]].data();
  ap.num_slots = num_blocks_ * kPageTokens;
  ap.dtype = spec_.dtype;
  if (sel_slots != nullptr) {
    ap.indices = sel_slots;
    ap.indices_stride = k;
    ap.topk = k;
    ap.index_lengths = sel_counts;
  } else {
    ap.block_table = b.block_table.as<int32_t>();
    ap.block_table_stride = b.maxb;
    ap.seq_of_token = b.seq_of.as<int32_t>();
    ap.lengths = b.lengths.as<int32_t>();
    ap.max_length = static_cast<int>(step_maxlen_);
  }
  ap.out_lat = b.out_lat.as<float>();
  ap.lse = b.lse.as<float>();
  ap.math = opts_.exact_activations ? MlaMath::kF32 : MlaMath::kBf16TensorCore;
  ap.stream = stream_;
  const size_t need = mla_attention_workspace_bytes(ap);
  if (need > b.attn_ws_bytes) {
    ++buffer_generation_;
    ML4_ASSIGN_OR_RETURN(b.attn_ws, DeviceBuffer::alloc(need));
    b.attn_ws_bytes = need;
  }
  ap.workspace = b.attn_ws.data();
  ap.workspace_bytes = b.attn_ws_bytes;
  ML4_RETURN_IF_ERROR(
      timed("attn: MLA kernel", [&] { return mla_attention(ap).with_context("layer " + std::to_string(l)); }));
  ML4_RETURN_IF_ERROR(timed("attn: W_UV", [&] { return mla_apply_uv(ab); }));
  return timed("attn: o projection", [&] { return lin(L.wo, b.o.as<float>(), T, out); });
}

// CpuModel::ffn, MoE part in three pieces so the graph capture can cut around the two that
// read device results back: the router and its top-k (capturable), the traced/forced
// decisions (host round trip), the experts (capturable on the grouped decode path; the
// expert loop reads the per-expert row counts back).
Status CudaRunner::moe_route_step(int l, int64_t T) {
  Layer& L = layers_[l];
  Buffers& b = *buf_;
  ML4_RETURN_IF_ERROR(
      linear_f32(*lt_, L.gate, b.a.as<float>(), T, b.router.as<float>(), b.lin, stream_).with_context("router"));
  return moe_route({b.router.as<float>(), T, cfg_.moe, L.bias.empty() ? nullptr : L.bias.as<float>(),
                    b.ids.as<int32_t>(), b.wts.as<float>(), nullptr, stream_});
}

Status CudaRunner::moe_trace(int l, int64_t T, ForwardTrace* trace) {
  Layer& L = layers_[l];
  Buffers& b = *buf_;
  const int K = cfg_.moe.num_experts_per_tok;
  // The router's own choice, then (test input) forced experts.
  std::vector<int32_t> ids(T * K);
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids.data(), b.ids.data(), ids.size() * 4, cudaMemcpyDeviceToHost, stream_));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  auto& rec = trace->experts[l];
  rec.assign(T, {});
  for (int64_t t = 0; t < T; ++t) rec[t].assign(ids.begin() + t * K, ids.begin() + (t + 1) * K);
  if (l < static_cast<int>(trace->forced_experts.size()) && !trace->forced_experts[l].empty()) {
    for (int64_t t = 0; t < T; ++t) std::copy_n(trace->forced_experts[l][t].begin(), K, ids.begin() + t * K);
    ML4_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(b.forced_ids.data(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream_));
    MoeRouteParams rp{b.router.as<float>(), T, cfg_.moe, L.bias.empty() ? nullptr : L.bias.as<float>(),
                      b.ids.as<int32_t>(), b.wts.as<float>(), b.forced_ids.as<int32_t>(), stream_};
    ML4_RETURN_IF_ERROR(moe_route(rp));
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  }
  return Status::ok();
}

bool CudaRunner::moe_grouped(const Layer& L, int64_t T) const {
  return L.tables != nullptr && (opts_.exact_activations || T <= kGroupedMoeMaxTokens);
}

Status CudaRunner::moe_experts(int l, int64_t T, float* out) {
  Layer& L = layers_[l];
  Buffers& b = *buf_;
  const float* x = b.a.as<float>();
  const int K = cfg_.moe.num_experts_per_tok;
  const int64_t D = cfg_.dim;
  if (moe_grouped(L, T)) {  // exact mode runs larger steps through it in chunks
    for (int64_t t0 = 0; t0 < T; t0 += kGroupedMoeMaxTokens) {
      const int64_t n = std::min<int64_t>(kGroupedMoeMaxTokens, T - t0);
      ML4_RETURN_IF_ERROR(moe_experts_forward_grouped(*L.tables, L.shared.get(), x + t0 * D, n,
                                                      b.ids.as<int32_t>() + t0 * K, b.wts.as<float>() + t0 * K, K,
                                                      out + t0 * D, b.moe, stream_));
    }
    return Status::ok();
  }
  return moe_experts_forward(*lt_, L.experts, L.shared.get(), x, T, D, b.ids.as<int32_t>(), b.wts.as<float>(), K, out,
                             b.moe, stream_);
}

}  // namespace ml4::cuda
