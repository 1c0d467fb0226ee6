// See cpu_backend.h. Each op is the ops/cpu reference applied to the step's tokens.
#include "runtime/cpu/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/threads.h"
#include "kv/latent_layout.h"
#include "ops/cpu/draft_tokens.h"
#include "ops/cpu/ops.h"
#include "ops/cpu/sampling.h"

namespace ml4 {

CpuBackend::CpuBackend(const ModelConfig& cfg, std::shared_ptr<const ModelWeights> weights, PagedKvCache* cache)
    : cfg_(cfg), weights_(std::move(weights)), cache_(cache) {
  latent_group_ = cache_->spec().group_index(CacheGroupSpec::kLatent);
  indexer_group_ = cache_->spec().group_index(CacheGroupSpec::kIndexer);
  drafter_group_ = cache_->spec().group_index(CacheGroupSpec::kDrafter);
}

void CpuBackend::begin_step(const StepMetadata& md, const StepMetadata* write_md) {
  md_ = &md;
  write_md_ = write_md != nullptr ? write_md : &md;
  const ModelConfig& c = cfg_;
  const int64_t T = md.num_tokens(), R = static_cast<int64_t>(md.logits_rows.size());
  const int64_t D = c.dim, H = c.n_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim, r = c.kv_lora_rank,
                dr = c.qk_rope_head_dim;
  const int64_t E = std::max(c.moe.num_experts, 1), K = std::max(c.moe.num_experts_per_tok, 1);
  act_storage_.resize(30);
  auto grow = [&](int i, int64_t n) -> float* {
    auto& v = act_storage_[i];
    if (static_cast<int64_t>(v.size()) < n) v.assign(n, 0.0f);
    return v.data();
  };
  if (T > act_tokens_ || acts_.residual == nullptr) {
    const int64_t n = std::max<int64_t>(T, 1);
    acts_.residual = grow(0, n * D);
    acts_.a = grow(1, n * D);
    acts_.tmp = grow(2, n * D);
    acts_.q = grow(3, n * H * qk);
    acts_.q_latent = grow(4, n * std::max(c.q_lora_rank, 1));
    acts_.ckv = grow(5, n * (r + dr));
    acts_.c = grow(6, n * r);
    acts_.q_lat = grow(7, n * H * r);
    acts_.head_scale = grow(8, n * H);
    acts_.out_lat = grow(9, n * H * r);
    acts_.lse = grow(10, n * H);
    acts_.o = grow(11, n * H * c.v_head_dim);
    acts_.router = grow(12, n * E);
    acts_.expert_wts = grow(13, n * K);
    acts_.ffn_g = grow(14, n * max_hidden_);
    acts_.ffn_u = grow(15, n * max_hidden_);
    if (c.has_dsa()) {
      acts_.iq = grow(16, n * c.indexer.n_heads * c.indexer.head_dim);
      acts_.ik = grow(17, n * c.indexer.head_dim);
      acts_.iw = grow(18, n * c.indexer.n_heads);
    }
    expert_ids_.resize(n * K);
    acts_.expert_ids = expert_ids_.data();
    if (drafter_) {
      const int64_t nt = static_cast<int64_t>(c.drafter.target_layers.size()), rr = c.drafter.rnn_rank;
      const int64_t B = c.drafter.block_size, V = c.vocab_size;
      const int64_t ns = n / std::max<int64_t>(B, 1) + 1;  // sequences of a draft step of n tokens
      acts_.draft_hidden = grow(21, n * nt * D);
      acts_.draft_ctx = grow(22, n * D);
      acts_.markov_x = grow(23, ns * (D + rr));
      acts_.markov_e = grow(24, ns * rr);
      acts_.markov_gi = grow(25, ns * 3 * rr);
      acts_.markov_gh = grow(26, ns * 3 * rr);
      acts_.markov_s = grow(27, ns * rr);
      acts_.markov_logits = grow(28, ns * V);
      acts_.draft_probs = grow(29, (B - 1) * ns * V);
      draft_ids_.resize(B * ns);
      acts_.draft_ids = draft_ids_.data();
    }
    act_tokens_ = n;
  }
  if (R > act_rows_ || acts_.rows == nullptr) {
    const int64_t n = std::max<int64_t>(R, 1);
    acts_.rows = grow(19, 2 * n * D);
    acts_.normed = acts_.rows + n * D;
    acts_.logits = grow(20, 2 * n * c.vocab_size);
    acts_.logits_parts = acts_.logits + n * c.vocab_size;
    act_rows_ = n;
  }
  for (auto& s : selections_) s.assign(T, {});
}

// ---- weights ----

Status CpuBackend::set_embedding(const Tensor& table) {
  embed_ = &table;
  embed_first_ = 0;
  return ok_status();
}

Status CpuBackend::set_embedding_shard(const Tensor& table, int64_t first_id) {
  embed_ = &table;
  embed_first_ = first_id;
  return ok_status();
}

Status CpuBackend::set_activation_dtype(cpu::ActivationDtype a) {
  ML4_RETURN_IF_ERROR(cpu::activation_dtype_supported(a));
  if (!linears_.empty()) return internal_error("set_activation_dtype after weights were added");
  act_ = a;
  return ok_status();
}

Result<LinearRef> CpuBackend::add_linear(const LinearWeight& w, LinearUse use) {
  linears_.push_back(&w);
  linear_act_.push_back(use == LinearUse::kRouter ? cpu::ActivationDtype::kF32 : act_);
  return LinearRef{static_cast<int>(linears_.size()) - 1};
}

Result<MlpRef> CpuBackend::add_mlp(const MlpWeights& m) {
  MlpRef r;
  ML4_ASSIGN_OR_RETURN(r.w1, add_linear(m.w1, LinearUse::kDefault));
  ML4_ASSIGN_OR_RETURN(r.w2, add_linear(m.w2, LinearUse::kDefault));
  ML4_ASSIGN_OR_RETURN(r.w3, add_linear(m.w3, LinearUse::kDefault));
  r.hidden = m.w1.out_features;
  max_hidden_ = std::max(max_hidden_, r.hidden);
  return r;
}

Result<const float*> CpuBackend::add_vector(const std::vector<float>& v) { return v.data(); }

Result<MoeRef> CpuBackend::add_moe(const std::vector<MlpWeights>& experts, const MlpWeights* shared) {
  moes_.push_back({&experts, shared});
  return MoeRef{static_cast<int>(moes_.size()) - 1};
}

Status CpuBackend::reserve_selections(int n) {
  selections_.assign(n, {});
  return ok_status();
}

Status CpuBackend::enable_drafter() {
  if (drafter_group_ < 0) return invalid_argument("the KV cache has no drafter group");
  drafter_ = true;
  act_tokens_ = 0;  // the next step sizes the drafter's buffers
  return ok_status();
}

// ---- ops ----

Status CpuBackend::embedding(float* out) {
  if (embed_first_ == 0 && embed_->dim(0) == cfg_.vocab_size) {
    cpu::embedding_lookup(*embed_, md_->token_ids.data(), step_tokens(), out);
    return ok_status();
  }
  // Vocabulary-parallel: rows of ids outside [first, first + rows) are zero.
  const int64_t D = cfg_.dim, rows = embed_->dim(0);
  for (int64_t t = 0; t < step_tokens(); ++t) {
    const int64_t id = md_->token_ids[t] - embed_first_;
    if (id >= 0 && id < rows) {
      const int32_t local = static_cast<int32_t>(id);
      cpu::embedding_lookup(*embed_, &local, 1, out + t * D);
    } else {
      std::fill(out + t * D, out + (t + 1) * D, 0.0f);
    }
  }
  return ok_status();
}

Status CpuBackend::rms_norm(const NormArgs& p) {
  if (p.residual != nullptr) {
    if (p.x_stride != 0 && p.x_stride != p.dim) return internal_error("rms_norm: a strided x with a residual");
    cpu::add_rms_norm(p.residual, p.x, p.w, p.rows, p.dim, p.eps, p.y);
  } else if (p.x_stride == 0 || p.x_stride == p.dim) {
    cpu::rms_norm(p.x, p.w, p.rows, p.dim, p.eps, p.y);
  } else {
    for (int64_t i = 0; i < p.rows; ++i) cpu::rms_norm(p.x + i * p.x_stride, p.w, 1, p.dim, p.eps, p.y + i * p.dim);
  }
  return ok_status();
}

Status CpuBackend::layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t dim, float eps,
                              float* y) {
  cpu::layer_norm(x, w, b, rows, dim, eps, y);
  return ok_status();
}

Status CpuBackend::linear(LinearRef w, const float* x, int64_t M, float* y) {
  if (!w.valid() || w.id >= static_cast<int>(linears_.size())) return internal_error("linear: no weight {}", w.id);
  cpu::linear(x, M, *linears_[w.id], y, linear_act_[w.id]);
  return ok_status();
}

Status CpuBackend::timed(const char* label, const Fn& fn) {
  if (!profile_on_) return fn();
  const auto t0 = std::chrono::steady_clock::now();
  Status s = fn();
  profile_[label] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

Status CpuBackend::silu_mul(const float* g, const float* u, int64_t rows, int64_t cols, float* out) {
  cpu::silu_mul(g, u, rows * cols, out);
  return ok_status();
}

Status CpuBackend::rope(const RopeArgs& p) {
  const int64_t T = step_tokens();
  for (int64_t t = 0; t < T; ++t) {
    const double pp = cpu::lerope_position(md_->positions[t], cfg_.lerope);
    float* x = p.x + t * p.heads * p.stride + p.offset;
    if (p.neox) {
      cpu::rope_neox(x, p.heads, p.dim, p.stride, pp, p.inv_freq, p.attn_factor);
    } else {
      cpu::rope_interleaved(x, p.heads, p.dim, p.stride, pp, p.inv_freq, p.attn_factor);
    }
  }
  return ok_status();
}

Status CpuBackend::q_path(const QPathArgs& p) {
  if (p.apply_rope) ML4_RETURN_IF_ERROR(rope(p.rope));
  const int H = p.rope.heads;
  for (int64_t t = 0; t < step_tokens(); ++t) {
    const int64_t pos = md_->positions[t];
    const int64_t S = p.selection != kDenseSelection ? static_cast<int64_t>(selected(p.selection, t).size()) : pos + 1;
    for (int h = 0; h < H; ++h) {
      double sc = p.base_scale * cpu::llama4_q_scale(pos, p.llama4);
      if (p.ssmax_s != nullptr) sc *= p.ssmax_s[h] * std::log(static_cast<double>(S));
      p.head_scale[t * H + h] = static_cast<float>(sc);
    }
  }
  return ok_status();
}

Status CpuBackend::write_latent_rows(const StepMetadata& m, CacheGroup group, int cache_slot, const float* c,
                                     int c_stride, const float* kr, int kr_stride) {
  const auto& slots = m.slots[group_index(group)];
  for (int64_t t = 0; t < m.num_tokens(); ++t) {
    if (slots[t] < 0) continue;
    if (group == CacheGroup::kDrafter) {
      cache_->write_drafter(cache_slot, slots[t], c + t * c_stride, kr + t * kr_stride);
    } else {
      cache_->write_latent(cache_slot, slots[t], c + t * c_stride, kr + t * kr_stride);
    }
  }
  return ok_status();
}

Status CpuBackend::write_indexer_rows(const StepMetadata& m, int cache_slot, float* k) {
  const int dI = cfg_.indexer.head_dim;
  const int64_t T = m.num_tokens();
  cpu::hadamard_transform(k, T, dI);
  const auto& slots = m.slots[indexer_group_];
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) cache_->write_indexer_key(cache_slot, slots[t], k + t * dI);
  return ok_status();
}

Status CpuBackend::latent_cache_write(CacheGroup group, int cache_slot, const float* c, const float* kr,
                                      int kr_stride) {
  return write_latent_rows(*md_, group, cache_slot, c, cfg_.kv_lora_rank, kr, kr_stride);
}

Status CpuBackend::indexer_key_write(int cache_slot, float* k) { return write_indexer_rows(*md_, cache_slot, k); }

Status CpuBackend::latent_cache_write_gathered(CacheGroup group, int cache_slot, const float* c, int c_stride,
                                               const float* kr, int kr_stride) {
  return write_latent_rows(*write_md_, group, cache_slot, c, c_stride, kr, kr_stride);
}

Status CpuBackend::indexer_key_write_gathered(int cache_slot, float* k) {
  return write_indexer_rows(*write_md_, cache_slot, k);
}

// q is used as FP8 with one scale per 128 values (DeepSeek act_quant); keys come back from the
// cache as FP8 with theirs. relu(sq*q.k) = sq*relu(q.k) for sq > 0, so scoring on the
// dequantized values equals DeepSeek's fp8_index.
Status CpuBackend::indexer_select(const IndexerSelectArgs& p) {
  const int HI = cfg_.indexer.n_heads, dI = cfg_.indexer.head_dim;
  const int64_t T = step_tokens();
  if (p.q_rope != nullptr) ML4_RETURN_IF_ERROR(rope(*p.q_rope));
  cpu::hadamard_transform(p.q, T * HI, dI);
  parallel_for(T * HI, 64, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) cpu::round_fp8_groups(p.q + row * dI, dI, 128);
  });
  for (int64_t i = 0; i < T * HI; ++i) p.w[i] *= p.weight_scale;
  // Keys in the indexer group's index space: positions, or this DCP rank's local indices.
  const bool candidates = p.candidates != nullptr;
  const int topk = cfg_.indexer.topk;
  auto& out = selections_[p.selection];
  if (!candidates) out.assign(T, {});
  // Token t's top-k from its scores (the first `visible`): candidates, or the selection.
  auto pick = [&](int64_t t, const float* scores, int64_t visible, std::vector<int32_t>& idx) {
    const int kk = static_cast<int>(std::min<int64_t>(topk, visible));
    if (candidates) {
      idx.resize(kk);
      cpu::topk(scores, visible, kk, idx.data());
      float* cs = static_cast<float*>(p.candidates) + t * topk;
      int32_t* cp = static_cast<int32_t*>(p.candidates) + (T + t) * topk;
      std::fill_n(cs, topk, -std::numeric_limits<float>::infinity());
      std::fill_n(cp, topk, -1);
      for (int j = 0; j < kk; ++j) {
        cs[j] = scores[idx[j]];
        cp[j] = static_cast<int32_t>(md_->sharded(indexer_group_) ? md_->shard.global_index(idx[j]) : idx[j]);
      }
      return;
    }
    // topk's set in index order (what sorting topk's result gave).
    std::vector<int32_t> sel(kk);
    cpu::topk_set(scores, visible, kk, sel.data());
    out[t] = std::move(sel);
  };
  constexpr int64_t kGroup = 64;
  constexpr int64_t kKeyBlock = 16;
  bool one_group = true;
  for (const auto& seq : md_->seqs) one_group = one_group && seq.num_tokens <= kGroup;
  if (one_group) {
    // Every sequence's tokens in one group (decode, drafts, verifies): one parallel region over
    // all sequences' 16-key blocks, each block's keys decoded into the thread's buffer and
    // scored for the sequence's tokens while in L1 (indexer_scores_rows gives each score's bits
    // whatever the key range), then one over all tokens' top-k. Token t's scores at
    // indexer_score_at_[t], indexer_visible_[t] of them.
    const size_t nseq = md_->seqs.size();
    indexer_visible_.resize(T);
    indexer_score_at_.resize(T);
    indexer_seq_needed_.resize(nseq);
    indexer_block_first_.assign(nseq + 1, 0);
    int64_t floats = 0;
    for (size_t si = 0; si < nseq; ++si) {
      const auto& seq = md_->seqs[si];
      const int64_t n = md_->keys(static_cast<int>(si), indexer_group_);
      int64_t needed = 0;
      for (int64_t i = 0; i < seq.num_tokens; ++i) {
        const int64_t t = seq.first_token + i;
        indexer_visible_[t] = std::min(n, md_->visible(t, indexer_group_));
        needed = std::max(needed, indexer_visible_[t]);
      }
      for (int64_t i = 0; i < seq.num_tokens; ++i) indexer_score_at_[seq.first_token + i] = floats + i * needed;
      indexer_seq_needed_[si] = needed;
      floats += seq.num_tokens * needed;
      indexer_block_first_[si + 1] = indexer_block_first_[si] + (needed + kKeyBlock - 1) / kKeyBlock;
    }
    if (indexer_scores_.size() < static_cast<size_t>(floats)) indexer_scores_.resize(floats);
    float* sc = indexer_scores_.data();
    const int64_t* blk_first = indexer_block_first_.data();
    parallel_for(blk_first[nseq], 4, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> kbuf;
      if (kbuf.size() < static_cast<size_t>(kKeyBlock * dI)) kbuf.resize(kKeyBlock * dI);
      int64_t vis[kGroup];
      size_t si = std::upper_bound(blk_first, blk_first + nseq + 1, b) - blk_first - 1;
      for (int64_t u = b; u < e; ++u) {
        while (blk_first[si + 1] <= u) ++si;
        const auto& seq = md_->seqs[si];
        const int seq_i = static_cast<int>(si);
        const int64_t needed = indexer_seq_needed_[si];
        const int64_t s0 = (u - blk_first[si]) * kKeyBlock, s1 = std::min(needed, s0 + kKeyBlock);
        for (int64_t s = s0; s < s1; ++s)
          cache_->read_indexer_key(p.cache_slot, md_->slot_of(seq_i, indexer_group_, s), kbuf.data() + (s - s0) * dI);
        const int64_t t0 = seq.first_token, G = seq.num_tokens;
        for (int64_t i = 0; i < G; ++i) vis[i] = indexer_visible_[t0 + i] - s0;
        cpu::indexer_scores_rows(p.q + t0 * HI * dI, p.w + t0 * HI, G, HI, dI, kbuf.data(), 0, s1 - s0, vis,
                                 sc + indexer_score_at_[t0] + s0, needed);
      }
    });
    parallel_for(T, 1, [&](int64_t b, int64_t e) {
      std::vector<int32_t> idx;
      for (int64_t t = b; t < e; ++t) pick(t, sc + indexer_score_at_[t], indexer_visible_[t], idx);
    });
    return ok_status();
  }
  // Per sequence, tokens in groups of up to kGroup: one parallel pass over the keys scores
  // every token of the group (each key row read once per group; the first group's pass also
  // decodes its keys from the cache), then a pass over the tokens picks each one's top-k.
  for (size_t si = 0; si < md_->seqs.size(); ++si) {
    const auto& seq = md_->seqs[si];
    const int seq_i = static_cast<int>(si);
    const int64_t n = md_->keys(seq_i, indexer_group_);
    indexer_visible_.resize(seq.num_tokens);
    int64_t needed = 0;  // keys any token sees
    for (int64_t i = 0; i < seq.num_tokens; ++i) {
      indexer_visible_[i] = std::min(n, md_->visible(seq.first_token + i, indexer_group_));
      needed = std::max(needed, indexer_visible_[i]);
    }
    if (indexer_keys_.size() < static_cast<size_t>(needed * dI)) indexer_keys_.resize(needed * dI);
    float* keys = indexer_keys_.data();
    for (int64_t g0 = 0; g0 < seq.num_tokens; g0 += kGroup) {
      const int64_t G = std::min(kGroup, seq.num_tokens - g0);
      const int64_t* vis = indexer_visible_.data() + g0;
      const int64_t span = g0 == 0 ? needed : *std::max_element(vis, vis + G);
      if (indexer_scores_.size() < static_cast<size_t>(G * needed)) indexer_scores_.resize(G * needed);
      float* sc = indexer_scores_.data();
      const int64_t t0 = seq.first_token + g0;
      parallel_for(span, 64, [&](int64_t b, int64_t e) {
        if (g0 > 0) {
          cpu::indexer_scores_rows(p.q + t0 * HI * dI, p.w + t0 * HI, G, HI, dI, keys, b, e, vis, sc, needed);
          return;
        }
        // 16 keys at a time decoded and scored while they are in L1.
        for (int64_t s0 = b; s0 < e; s0 += 16) {
          const int64_t s1 = std::min(e, s0 + 16);
          for (int64_t s = s0; s < s1; ++s)
            cache_->read_indexer_key(p.cache_slot, md_->slot_of(seq_i, indexer_group_, s), keys + s * dI);
          cpu::indexer_scores_rows(p.q + t0 * HI * dI, p.w + t0 * HI, G, HI, dI, keys, s0, s1, vis, sc, needed);
        }
      });
      parallel_for(G, 1, [&](int64_t b, int64_t e) {
        std::vector<int32_t> idx;
        for (int64_t i = b; i < e; ++i) pick(t0 + i, sc + i * needed, vis[i], idx);
      });
    }
  }
  return ok_status();
}

Status CpuBackend::merge_topk_candidates(const void* candidates, int n, int selection, int local_selection) {
  const int64_t T = step_tokens();
  const int topk = cfg_.indexer.topk;
  auto& global = selections_[selection];
  auto& local = selections_[local_selection];
  global.assign(T, {});
  local.assign(T, {});
  parallel_for(T, 1, [&](int64_t b, int64_t e) {
    std::vector<int32_t> pos, idx;
    std::vector<float> scores;
    std::vector<std::pair<int32_t, float>> cands;
    for (int64_t t = b; t < e; ++t) {
      cands.clear();
      for (int p = 0; p < n; ++p) {
        const float* cs = static_cast<const float*>(candidates) + (2 * p * T + t) * topk;
        const int32_t* cp = static_cast<const int32_t*>(candidates) + ((2 * p + 1) * T + t) * topk;
        for (int j = 0; j < topk; ++j)
          if (cp[j] >= 0) cands.emplace_back(cp[j], cs[j]);
      }
      // In position order, so cpu::topk's lower-index tie rule is DCP 1's lower-position rule.
      std::sort(cands.begin(), cands.end());
      pos.resize(cands.size());
      scores.resize(cands.size());
      for (size_t i = 0; i < cands.size(); ++i) pos[i] = cands[i].first, scores[i] = cands[i].second;
      const int kk = static_cast<int>(std::min<int64_t>({topk, md_->positions[t] + 1, static_cast<int64_t>(pos.size())}));
      idx.resize(kk);
      cpu::topk(scores.data(), static_cast<int64_t>(scores.size()), kk, idx.data());
      auto& g = global[t];
      for (int j = 0; j < kk; ++j) g.push_back(pos[idx[j]]);
      std::sort(g.begin(), g.end());
      for (int32_t gp : g)
        if (md_->shard.holds(gp)) local[t].push_back(static_cast<int32_t>(md_->shard.local_index(gp)));
    }
  });
  return ok_status();
}

Status CpuBackend::merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols,
                                         float* out) {
  cpu::merge_attention_parts(parts, n, part_stride, rows, cols, out);
  return ok_status();
}

Status CpuBackend::rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows,
                                          int64_t cols) {
  cpu::rescale_attention_part(out, lse, lse_all, n, rows, cols);
  return ok_status();
}

Result<std::vector<std::vector<int32_t>>> CpuBackend::read_selection(int selection) {
  return selections_[selection];
}

Status CpuBackend::set_selection(int selection, const std::vector<std::vector<int32_t>>& positions) {
  selections_[selection] = positions;
  return ok_status();
}

// wkv_b as stored, plus (bf16 / FP8 on AVX-512) the decode kernels' layout of it; the jobs and
// the one summation order of both products are in ops/cpu/attention.h.
Result<AbsorbRef> CpuBackend::add_absorb(const LinearWeight& wkv_b) {
  ML4_RETURN_IF_ERROR(cpu::validate_linear_weight(wkv_b));
  ML4_RETURN_IF_ERROR(check_wkv_b_shape(cfg_, wkv_b));
  absorbs_.push_back(&wkv_b);
  absorb_layout_.push_back(cpu::layout_absorb(wkv_b, cfg_.n_heads, cfg_.qk_nope_head_dim, cfg_.v_head_dim));
  return AbsorbRef{static_cast<int>(absorbs_.size()) - 1};
}

Status CpuBackend::mla_absorb_q(AbsorbRef a, const float* q, float* q_lat) {
  if (!a.valid() || a.id >= static_cast<int>(absorbs_.size())) return internal_error("mla_absorb_q: no wkv_b {}", a.id);
  cpu::mla_absorb_q(*absorbs_[a.id], q, step_tokens(), cfg_.n_heads, cfg_.qk_nope_head_dim, cfg_.v_head_dim,
                    cfg_.qk_nope_head_dim + cfg_.qk_rope_head_dim, cfg_.kv_lora_rank, q_lat, &absorb_layout_[a.id]);
  return ok_status();
}

namespace {
// Cache rows are read in a scattered order (a selection; pages), each a miss once the weights
// have streamed through the caches: rows this far ahead are prefetched while one is decoded.
constexpr int64_t kRowPrefetch = 16;
inline void prefetch_bytes(const uint8_t* p, size_t n) {
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + n - 1;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; a <= last; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a));
}

// Decodes cache rows rows[0, n) (decode_latent) to c + j r / kr + j dr, prefetching the row
// kRowPrefetch ahead while it is one of the `avail` rows listed (a later call decodes the rest).
inline void decode_rows(const uint8_t* const* rows, int64_t n, int64_t avail, size_t row_bytes, KvCacheDtype dtype,
                        float scale, int r, int dr, float* c, float* kr) {
  for (int64_t j = 0; j < n; ++j) {
    if (j + kRowPrefetch < avail) prefetch_bytes(rows[j + kRowPrefetch], row_bytes);
    decode_latent(dtype, rows[j], r, dr, scale, c + j * r, kr + j * dr);
  }
}

// A token's keys read from their cache rows (row s at rows[s], S of them) a block at a time,
// each row decoded (decode_latent) into the kernel's block buffer.
class CacheKeyBlocks final : public cpu::MlaKeyBlocks {
 public:
  CacheKeyBlocks(const uint8_t* const* rows, int64_t S, size_t row_bytes, KvCacheDtype dtype, float scale, int r, int dr)
      : rows_(rows), S_(S), row_bytes_(row_bytes), dtype_(dtype), scale_(scale), r_(r), dr_(dr) {}
  void rows(int64_t s0, int64_t n, float* c_buf, float* kr_buf, const float** c, const float** kr) const override {
    decode_rows(rows_ + s0, n, S_ - s0, row_bytes_, dtype_, scale_, r_, dr_, c_buf, kr_buf);
    for (int64_t j = 0; j < n; ++j) c[j] = c_buf + j * r_, kr[j] = kr_buf + j * dr_;
  }

 private:
  const uint8_t* const* rows_;
  int64_t S_;
  size_t row_bytes_;
  KvCacheDtype dtype_;
  float scale_;
  int r_, dr_;
};

// A token's keys `sel` among rows decoded once for the step: index i's row is row[i] of c / kr.
class DecodedKeyRows final : public cpu::MlaKeyBlocks {
 public:
  DecodedKeyRows(const float* c, const float* kr, const int32_t* row, const int32_t* sel, int r, int dr)
      : c_(c), kr_(kr), row_(row), sel_(sel), r_(r), dr_(dr) {}
  void rows(int64_t s0, int64_t n, float*, float*, const float** c, const float** kr) const override {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = row_[sel_[s0 + j]];
      c[j] = c_ + k * r_, kr[j] = kr_ + k * dr_;
    }
  }

 private:
  const float *c_, *kr_;
  const int32_t *row_, *sel_;
  int r_, dr_;
};
}  // namespace

// A token's keys are decoded from their cache rows block by block inside the kernel, so they
// stay in L1 for the logits and P x C. Where a sequence's tokens read its keys many times over
// (a prefill chunk: at least kSharedReads reads per key), its keys are decoded once instead (one
// parallel pass): dense attention's [0, n) (each token reads a prefix), a selection's union
// over the tokens; the kernel then reads the f32 rows from there (L2 or memory, which at a few
// reads per key costs more than decoding them again). Then one parallel region over (token,
// head group); few tokens split their heads so that every thread has work. Each head's result
// is bit for bit the same however the work is split and wherever its key rows lie
// (cpu::mla_attention_heads).
Status CpuBackend::mla_attention(const MlaArgs& p) {
  constexpr int64_t kSharedReads = 16;
  const int H = p.heads > 0 ? p.heads : cfg_.n_heads, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, r = cfg_.kv_lora_rank;
  const int qk = dn + dr;
  const int g = group_index(p.group);
  const bool hot = p.group == CacheGroup::kHot, dense = p.selection == kDenseSelection;
  const bool drafter = p.group == CacheGroup::kDrafter;
  const KvCacheDtype dtype = drafter ? KvCacheDtype::kBf16 : cache_->spec().dtype;
  const float scale = drafter ? 1.0f : cache_->fp8_scale();
  const size_t tb = cache_->spec().groups[latent_group_].token_bytes_per_layer;
  const uint8_t* hot_rows = hot ? hot_[p.cache_slot].data() : nullptr;
  auto row_of = [&](int si, int64_t index) -> const uint8_t* {
    return hot ? hot_rows + index * tb : cache_->row(g, p.cache_slot, md_->slot_of(si, g, index));
  };
  // Per sequence: its keys decoded once (rows from mla_first_[si]: dense index i at row i, a
  // selection's index i at row mla_row_[mla_map_first_[si] + i]; mla_shared_[si]) or not.
  const int ns = static_cast<int>(md_->seqs.size());
  mla_first_.assign(ns + 1, 0);
  mla_map_first_.assign(ns, -1);
  mla_shared_.assign(ns, 0);
  mla_row_.clear();
  mla_index_.clear();  // (sequence, index) of each decoded row
  for (int si = 0; si < ns; ++si) {
    const auto& seq = md_->seqs[si];
    const int64_t first = mla_first_[si];
    int64_t reads = 0;
    for (int64_t i = 0; i < seq.num_tokens; ++i) {
      const int64_t t = seq.first_token + i;
      reads += dense ? md_->visible(t, g) : static_cast<int64_t>(selected(p.selection, t).size());
    }
    const int64_t n = hot ? hot_rows_ : md_->keys(si, g);
    if (reads < kSharedReads * n) {
      mla_first_[si + 1] = first;
      continue;
    }
    mla_shared_[si] = 1;
    if (dense) {
      for (int64_t i = 0; i < n; ++i) mla_index_.push_back({si, i});
    } else {
      int64_t span = 0;
      for (int64_t i = 0; i < seq.num_tokens; ++i)
        for (int32_t k : selected(p.selection, seq.first_token + i)) span = std::max<int64_t>(span, int64_t{k} + 1);
      const int64_t m0 = static_cast<int64_t>(mla_row_.size());
      mla_map_first_[si] = m0;
      mla_row_.resize(m0 + span, -1);
      int32_t* row = mla_row_.data() + m0;
      for (int64_t i = 0; i < seq.num_tokens; ++i)
        for (int32_t k : selected(p.selection, seq.first_token + i))
          if (row[k] < 0) {
            row[k] = static_cast<int32_t>(static_cast<int64_t>(mla_index_.size()) - first);
            mla_index_.push_back({si, k});
          }
    }
    mla_first_[si + 1] = static_cast<int64_t>(mla_index_.size());
  }
  const int64_t decoded = static_cast<int64_t>(mla_index_.size());
  const size_t row_bytes = drafter ? latent_token_bytes(KvCacheDtype::kBf16, r, dr) : tb;
  if (decoded > 0) {
    if (mla_keys_c_.size() < static_cast<size_t>(decoded * r)) mla_keys_c_.resize(decoded * r);
    if (mla_keys_kr_.size() < static_cast<size_t>(decoded * dr)) mla_keys_kr_.resize(decoded * dr);
    ML4_RETURN_IF_ERROR(timed("attn: (MLA kernel) of which key decode", [&] {
      parallel_for(decoded, 32, [&](int64_t b, int64_t e) {
        thread_local std::vector<const uint8_t*> rows;
        rows.resize(e - b);
        for (int64_t k = b; k < e; ++k) rows[k - b] = row_of(mla_index_[k].first, mla_index_[k].second);
        decode_rows(rows.data(), e - b, e - b, row_bytes, dtype, scale, r, dr, mla_keys_c_.data() + b * r,
                    mla_keys_kr_.data() + b * dr);
      });
      return ok_status();
    }));
  }
  // Work units: (token, head group), tokens in sequence order.
  mla_tokens_.clear();
  for (int si = 0; si < ns; ++si)
    for (int64_t i = 0; i < md_->seqs[si].num_tokens; ++i) mla_tokens_.push_back({si, md_->seqs[si].first_token + i});
  const int64_t T = static_cast<int64_t>(mla_tokens_.size());
  if (T == 0) return ok_status();
  const int64_t want = std::clamp<int64_t>((num_threads() + T - 1) / T, 1, H);
  const int64_t hp = (H + want - 1) / want, groups = (H + hp - 1) / hp;
  parallel_for(T * groups, 1, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const auto [si, t] = mla_tokens_[u / groups];
      const int64_t h0 = (u % groups) * hp, nh = std::min<int64_t>(H - h0, hp);
      const float* ql = p.q_lat + (t * H + h0) * r;
      const float* qr = p.q + (t * H + h0) * qk + dn;
      const float* hs = p.head_scale + t * H + h0;
      float* ol = p.out_lat + (t * H + h0) * r;
      float* lse = p.lse + t * H + h0;
      const std::vector<int32_t>* sel = dense ? nullptr : &selected(p.selection, t);
      const int64_t S = dense ? md_->visible(t, g) : static_cast<int64_t>(sel->size());
      if (mla_shared_[si] != 0) {
        const float* c = mla_keys_c_.data() + mla_first_[si] * r;
        const float* kr = mla_keys_kr_.data() + mla_first_[si] * dr;
        if (dense) {
          const cpu::MlaKeyRows keys(c, kr, r, dr);
          cpu::mla_attention_heads(ql, qr, qk, static_cast<int>(nh), r, dr, S, keys, hs, ol, lse);
        } else {
          const DecodedKeyRows keys(c, kr, mla_row_.data() + mla_map_first_[si], sel->data(), r, dr);
          cpu::mla_attention_heads(ql, qr, qk, static_cast<int>(nh), r, dr, S, keys, hs, ol, lse);
        }
        continue;
      }
      thread_local std::vector<const uint8_t*> rows;
      rows.resize(S);
      for (int64_t k = 0; k < S; ++k) rows[k] = row_of(si, dense ? k : (*sel)[k]);
      for (int64_t k = 0; k < std::min(S, kRowPrefetch); ++k) prefetch_bytes(rows[k], row_bytes);
      const CacheKeyBlocks keys(rows.data(), S, row_bytes, dtype, scale, r, dr);
      cpu::mla_attention_heads(ql, qr, qk, static_cast<int>(nh), r, dr, S, keys, hs, ol, lse);
    }
  });
  return ok_status();
}

// HiSparse (offload/hisparse.h) with a bounded host "device" pool: the whole policy (diff,
// LRU, loads, remapped rows) runs as on the GPU, so CI tests it.
Status CpuBackend::hisparse_reserve(int layers, int64_t rows) {
  const size_t tb = cache_->spec().groups[latent_group_].token_bytes_per_layer;
  hot_.assign(layers, std::vector<uint8_t>(rows * tb));
  hot_rows_ = rows;
  return ok_status();
}

int64_t CpuBackend::hot_pool_bytes() const {
  int64_t n = 0;
  for (const auto& h : hot_) n += static_cast<int64_t>(h.size());
  return n;
}

Status CpuBackend::hisparse_load_rows(int latent_slot, int hot_layer, const std::vector<HotLoad>& loads) {
  const size_t tb = cache_->spec().groups[latent_group_].token_bytes_per_layer;
  for (const HotLoad& h : loads) {
    if (h.row < 0 || h.row >= hot_rows_) return internal_error("HiSparse: hot row {} outside [0, {})", h.row, hot_rows_);
    const int64_t slot = md_->slot_of(h.seq, latent_group_, h.position);
    const uint8_t* src = cache_->page(latent_group_, latent_slot, slot / kPageTokens) + (slot % kPageTokens) * tb;
    std::memcpy(hot_[hot_layer].data() + h.row * tb, src, tb);
  }
  return ok_status();
}

Status CpuBackend::set_hot_selection(const int32_t* rows, const int32_t* counts) {
  const int64_t T = step_tokens();
  const int k = cfg_.indexer.topk;
  hot_selection_.resize(T);
  for (int64_t t = 0; t < T; ++t) hot_selection_[t].assign(rows + t * k, rows + t * k + counts[t]);
  return ok_status();
}

Status CpuBackend::mla_apply_uv(AbsorbRef a, const float* out_lat, float* o) {
  if (!a.valid() || a.id >= static_cast<int>(absorbs_.size())) return internal_error("mla_apply_uv: no wkv_b {}", a.id);
  cpu::mla_apply_uv(*absorbs_[a.id], out_lat, step_tokens(), cfg_.n_heads, cfg_.qk_nope_head_dim, cfg_.v_head_dim,
                    cfg_.kv_lora_rank, o, &absorb_layout_[a.id]);
  return ok_status();
}

Status CpuBackend::moe_route(const MoeRouteArgs& p) {
  const int64_t T = step_tokens();
  const int E = cfg_.moe.num_experts, K = cfg_.moe.num_experts_per_tok;
  if (p.forced_host == nullptr) {
    cpu::moe_route(p.logits, T, cfg_.moe, p.bias, p.ids, p.weights);
    return ok_status();
  }
  // Forced experts, weighted as moe_route weighs its own choice (router probability,
  // renormalised, times routed_scale).
  std::vector<float> prob(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = p.logits + t * E;
    if (cfg_.moe.scoring == RouterScoring::kSoftmax) {
      std::copy(l, l + E, prob.begin());
      cpu::softmax_inplace(prob.data(), E);
    } else {
      for (int e = 0; e < E; ++e) prob[e] = 1.0f / (1.0f + std::exp(-l[e]));
    }
    const int32_t* forced = p.forced_host + t * K;
    double sum = 0.0;
    for (int k = 0; k < K; ++k) sum += prob[forced[k]];
    const double norm = cfg_.moe.renormalize ? 1.0 / (sum + 1e-20) : 1.0;
    for (int k = 0; k < K; ++k) {
      p.ids[t * K + k] = forced[k];
      p.weights[t * K + k] = static_cast<float>(prob[forced[k]] * norm * cfg_.moe.routed_scale);
    }
  }
  return ok_status();
}

// SwiGLU MLP: w2(silu(w1 x) * w3 x).
void CpuBackend::mlp(const MlpWeights& m, const float* x, int64_t T, float* out) {
  const int64_t I = m.w1.out_features;
  std::vector<float> g(T * I), u(T * I);
  cpu::linear(x, T, m.w1, g.data(), act_);
  cpu::linear(x, T, m.w3, u.data(), act_);
  cpu::silu_mul(g.data(), u.data(), T * I, g.data());
  cpu::linear(g.data(), T, m.w2, out, act_);
}

void CpuBackend::mlps(const std::vector<MlpJob>& jobs) {
  // One region over the concatenated rows of several linears, in quads (4 weight rows; a
  // linear's rows start at a quad, so FP8 scale groups never split a GEMV tile). Each output
  // is linear_rows' for its rows whatever the split (cpu::linear's bits).
  auto region = [this](const std::vector<MlpPart>& parts) {
    auto& first = mlps_first_;  // first quad of each part
    first.assign(parts.size() + 1, 0);
    for (size_t i = 0; i < parts.size(); ++i) first[i + 1] = first[i] + (parts[i].w->out_features + 3) / 4;
    parallel_for(first.back(), 1, [&](int64_t b, int64_t e) {
      for (size_t i = 0; i < parts.size(); ++i) {
        const int64_t lo = std::max(b, first[i]), hi = std::min(e, first[i + 1]);
        if (lo >= hi) continue;
        const MlpPart& p = parts[i];
        const int64_t N = p.w->out_features;
        cpu::linear_rows(p.x, p.rows, *p.w, (lo - first[i]) * 4, std::min(N, (hi - first[i]) * 4), p.y, act_);
      }
    });
  };
  int64_t total = 0;  // hidden floats of all jobs
  for (const MlpJob& j : jobs) total += j.rows * j.w->w1.out_features;
  if (static_cast<int64_t>(mlps_g_.size()) < total) mlps_g_.resize(total), mlps_u_.resize(total);
  mlps_up_.clear();
  mlps_down_.clear();
  int64_t off = 0;
  for (const MlpJob& j : jobs) {
    float* g = mlps_g_.data() + off;
    float* u = mlps_u_.data() + off;
    mlps_up_.push_back({&j.w->w1, j.x, j.rows, g});
    mlps_up_.push_back({&j.w->w3, j.x, j.rows, u});
    mlps_down_.push_back({&j.w->w2, g, j.rows, j.out});
    off += j.rows * j.w->w1.out_features;
  }
  region(mlps_up_);
  cpu::silu_mul(mlps_g_.data(), mlps_u_.data(), total, mlps_g_.data());
  region(mlps_down_);
}

Status CpuBackend::moe_experts(MoeRef moe, const float* x, const int32_t* ids, const float* weights, float* out) {
  const Moe& M = moes_[moe.id];
  const int64_t T = step_tokens(), D = cfg_.dim;
  const int E = cfg_.moe.num_experts, K = cfg_.moe.num_experts_per_tok;
  std::fill(out, out + T * D, 0.0f);
  // Group token rows by expert (a stable counting sort: token order within an expert) so
  // each expert's weights are decoded once per step.
  auto& first = moe_first_;
  first.assign(E + 1, 0);
  for (int64_t i = 0; i < T * K; ++i) ++first[ids[i] + 1];
  for (int e = 0; e < E; ++e) first[e + 1] += first[e];
  moe_rows_.resize(T * K);
  {
    auto& next = mlps_first_;  // scratch: the next free row of each expert
    next.assign(first.begin(), first.end() - 1);
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) moe_rows_[next[ids[t * K + k]]++] = {t, weights[t * K + k]};
  }
  // Each active expert on its rows (gathered), then the shared expert on all; combined in
  // that order (expert by expert, then the shared output) on both paths. A step of up to
  // kMlpsMaxTokens tokens runs all experts through mlps() (two parallel regions); a larger
  // prefill chunk one expert at a time, reusing one pair of buffers (all experts' rows at
  // once would hold T x k x dim floats twice). Each output is the same on both paths
  // (linear_rows and linear give the same bits for the same rows).
  constexpr int64_t kMlpsMaxTokens = 64;
  auto add_expert = [&](int e, const float* ys) {
    for (int64_t i = first[e]; i < first[e + 1]; ++i) {
      float* o = out + moe_rows_[i].first * D;
      const float wt = moe_rows_[i].second;
      const float* y = ys + (i - first[e]) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += wt * y[d];
    }
  };
  auto gather = [&](int e, float* xs) {
    for (int64_t i = first[e]; i < first[e + 1]; ++i)
      std::copy(x + moe_rows_[i].first * D, x + (moe_rows_[i].first + 1) * D, xs + (i - first[e]) * D);
  };
  if (M.shared != nullptr && static_cast<int64_t>(moe_sh_.size()) < T * D) moe_sh_.resize(T * D);
  float* sh = moe_sh_.data();
  if (T <= kMlpsMaxTokens) {
    if (static_cast<int64_t>(moe_xs_.size()) < T * K * D) moe_xs_.resize(T * K * D), moe_ys_.resize(T * K * D);
    moe_jobs_.clear();
    for (int e = 0; e < E; ++e) {
      const int64_t n = first[e + 1] - first[e];
      if (n == 0) continue;
      gather(e, moe_xs_.data() + first[e] * D);
      moe_jobs_.push_back({&(*M.experts)[e], moe_xs_.data() + first[e] * D, n, moe_ys_.data() + first[e] * D});
    }
    if (M.shared != nullptr) moe_jobs_.push_back({M.shared, x, T, sh});
    mlps(moe_jobs_);
    for (int e = 0; e < E; ++e)
      if (first[e + 1] > first[e]) add_expert(e, moe_ys_.data() + first[e] * D);
  } else {
    std::vector<float> xs, ys;
    for (int e = 0; e < E; ++e) {
      const int64_t n = first[e + 1] - first[e];
      if (n == 0) continue;
      xs.resize(n * D);
      ys.resize(n * D);
      gather(e, xs.data());
      mlp((*M.experts)[e], xs.data(), n, ys.data());
      add_expert(e, ys.data());
    }
    if (M.shared != nullptr) mlp(*M.shared, x, T, sh);
  }
  if (M.shared != nullptr)
    for (int64_t i = 0; i < T * D; ++i) out[i] += sh[i];
  return ok_status();
}

// ---- parallelism ----

Result<void*> CpuBackend::scratch(int slot, int64_t bytes) {
  if (slot < 0) return internal_error("scratch: slot {}", slot);
  if (static_cast<int>(scratch_.size()) <= slot) scratch_.resize(slot + 1);
  auto& b = scratch_[slot];
  // Whole floats, never empty: a pointer into it is valid even for zero rows.
  const int64_t want = std::max<int64_t>(bytes, 16);
  if (static_cast<int64_t>(b.size()) < want) b.assign(want, 0);
  return static_cast<void*>(b.data());
}

Status CpuBackend::upload(void* dst, const void* src_host, int64_t bytes) {
  if (bytes > 0) std::memcpy(dst, src_host, bytes);
  return ok_status();
}

Status CpuBackend::gather_rows_at(const float* src, const int32_t* idx, int64_t n, int64_t cols, float* dst) {
  for (int64_t i = 0; i < n; ++i) std::copy_n(src + static_cast<int64_t>(idx[i]) * cols, cols, dst + i * cols);
  return ok_status();
}

Status CpuBackend::scatter_add_rows_at(const float* src, const int32_t* idx, int64_t n, int64_t cols, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    float* d = dst + static_cast<int64_t>(idx[i]) * cols;
    const float* x = src + i * cols;
    for (int64_t j = 0; j < cols; ++j) d[j] += x[j];
  }
  return ok_status();
}

// As moe_experts over explicit rows; the k-sum runs in the same order (expert by expert,
// adding w * y into the row) so a token's routed output is the one moe_experts computes.
Status CpuBackend::moe_experts_rows(MoeRef moe, const float* x, int64_t n, const int32_t* ids, const float* weights,
                                    float* out) {
  const Moe& M = moes_[moe.id];
  const int64_t D = cfg_.dim;
  const int K = cfg_.moe.num_experts_per_tok;
  const int E = static_cast<int>(M.experts->size());
  std::fill(out, out + n * D, 0.0f);
  std::vector<std::vector<std::pair<int64_t, float>>> rows(E);
  for (int64_t t = 0; t < n; ++t)
    for (int k = 0; k < K; ++k) {
      const int32_t e = ids[t * K + k];
      if (e < 0) continue;
      if (e >= E) return internal_error("moe_experts_rows: expert {} of {} held here", e, E);
      rows[e].push_back({t, weights[t * K + k]});
    }
  std::vector<float> xs, ys;
  for (int e = 0; e < E; ++e) {
    const auto& r = rows[e];
    if (r.empty()) continue;
    const int64_t m = static_cast<int64_t>(r.size());
    xs.resize(m * D);
    ys.resize(m * D);
    for (int64_t i = 0; i < m; ++i) std::copy(x + r[i].first * D, x + (r[i].first + 1) * D, xs.begin() + i * D);
    mlp((*M.experts)[e], xs.data(), m, ys.data());
    for (int64_t i = 0; i < m; ++i) {
      float* o = out + r[i].first * D;
      const float wt = r[i].second;
      for (int64_t d = 0; d < D; ++d) o[d] += wt * ys[i * D + d];
    }
  }
  return ok_status();
}

Result<std::vector<int32_t>> CpuBackend::read_ints(const int32_t* p, int64_t n) {
  return std::vector<int32_t>(p, p + n);
}

Status CpuBackend::gather_logits_rows(const float* x, float* out) {
  const int64_t D = cfg_.dim;
  for (size_t i = 0; i < md_->logits_rows.size(); ++i)
    std::copy(x + md_->logits_rows[i] * D, x + (md_->logits_rows[i] + 1) * D, out + i * D);
  return ok_status();
}

// ---- the DSpark drafter's ops ----

Result<TableRef> CpuBackend::add_table(const Tensor& t) {
  if (t.rank() != 2 || (t.dtype() != DType::kBF16 && t.dtype() != DType::kF32))
    return invalid_argument("table: expected a [rows, cols] bf16/f32 tensor, found {}", t.describe());
  tables_.push_back(&t);
  return TableRef{static_cast<int>(tables_.size()) - 1};
}

Status CpuBackend::gather_table_rows(TableRef t, const int32_t* ids, int64_t n, float* out) {
  cpu::embedding_lookup(*tables_[t.id], ids, n, out);
  return ok_status();
}

Status CpuBackend::copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                             int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) std::copy_n(src + i * src_stride, cols, dst + i * dst_stride);
  return ok_status();
}

Status CpuBackend::add_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) y[i * y_stride + j] += x[i * x_stride + j];
  return ok_status();
}

Status CpuBackend::fill(float* x, int64_t n, float value) {
  std::fill(x, x + n, value);
  return ok_status();
}

Status CpuBackend::block_embed(const float* mask, float* out) {
  const int64_t D = cfg_.dim;
  if (embed_first_ != 0 || embed_->dim(0) != cfg_.vocab_size)
    return internal_error("block_embed needs the whole embedding (the program embeds draft blocks itself under TP)");
  for (const auto& seq : md_->seqs) {
    cpu::embedding_lookup(*embed_, md_->token_ids.data() + seq.first_token, 1, out + seq.first_token * D);
    for (int64_t i = 1; i < seq.num_tokens; ++i) std::copy_n(mask + (i - 1) * D, D, out + (seq.first_token + i) * D);
  }
  return ok_status();
}

Status CpuBackend::select_block_window(CacheGroup group, int64_t window) {
  const int g = group_index(group);
  window_.assign(step_tokens(), {});
  for (size_t si = 0; si < md_->seqs.size(); ++si) {
    const auto& seq = md_->seqs[si];
    const int64_t lo = std::max<int64_t>(0, seq.start_pos - window);
    std::vector<int32_t> keys;
    for (int64_t s = lo; s < seq.context_len; ++s) {
      const auto& bt = seq.step->block_tables[g];
      const int64_t b = s / kPageTokens;
      if (b >= static_cast<int64_t>(bt.size()) || bt[b] < 0)
        return invalid_argument("seq {}: drafter block table does not cover position {}", seq.step->seq_id, s);
      keys.push_back(static_cast<int32_t>(s));
    }
    for (int64_t i = 0; i < seq.num_tokens; ++i) window_[seq.first_token + i] = keys;
  }
  return ok_status();
}

Status CpuBackend::gru_update(const float* gi, const float* gh, const float* b_ih, const float* b_hh, int64_t rows,
                              int64_t r, float* s) {
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  for (int64_t i = 0; i < rows; ++i) {
    const float* a = gi + i * 3 * r;
    const float* h = gh + i * 3 * r;
    float* st = s + i * r;
    for (int64_t k = 0; k < r; ++k) {
      const double rg = sig(static_cast<double>(a[k]) + b_ih[k] + h[k] + b_hh[k]);
      const double zg = sig(static_cast<double>(a[r + k]) + b_ih[r + k] + h[r + k] + b_hh[r + k]);
      const double ng = std::tanh(static_cast<double>(a[2 * r + k]) + b_ih[2 * r + k] + rg * (h[2 * r + k] + b_hh[2 * r + k]));
      st[k] = static_cast<float>((1.0 - zg) * ng + zg * st[k]);
    }
  }
  return ok_status();
}

Status CpuBackend::choose_tokens(float* logits, int64_t rows, const DeviceSamplingParams* params, int32_t* ids,
                                 float* probs, const float* base, int64_t base_stride) {
  if (base != nullptr) ML4_RETURN_IF_ERROR(add_rows(logits, cfg_.vocab_size, base, base_stride, rows, cfg_.vocab_size));
  cpu::choose_draft_tokens(logits, rows, cfg_.vocab_size, params, ids, probs);
  return ok_status();
}

}  // namespace ml4
