// Attention cores on already-gathered f32 data (MODEL.md 3.5-3.6): the absorbed MLA
// softmax over latent rows and the DSA lightning indexer's scores. The runner gathers
// the rows (all s <= p, or the indexer's top-k) from the paged cache and dequantizes them.
#pragma once

#include <cstdint>

namespace ml4::cpu {

// q_lat [H, r], q_rope [H, dr], c [S, r], kr [S, dr], head_scale [H];
// out_lat [H, r], lse [H] (natural log). For each head h:
//   logit(s) = (q_lat[h].c[s] + q_rope[h].kr[s]) * head_scale[h]
//   out_lat[h] = sum_s softmax(logit)(s) c[s];  lse[h] = log sum_s exp(logit(s)).
// S == 0 gives out_lat = 0 and lse = -inf (the DCP/split combine convention).
void mla_attention(const float* q_lat, const float* q_rope, int H, int r, int dr, const float* c,
                   const float* kr, int64_t S, const float* head_scale, float* out_lat, float* lse);

// The two per-head products around absorbed MLA (MODEL.md 3.6), for T tokens at once,
// parallel over (token, head) pairs so a decode step (T = 1) uses every core, and
// vectorized over r. w_uk / w_uv are W_UK / W_UV from wkv_b, [H, dn, r] / [H, dv, r] f32.
//   mla_absorb_q: q_lat[t, h, :] = W_UK[h]^T q[t, h, 0:dn]   (q rows of qk floats per head,
//     q_lat [T, H, r]); each q_lat element sums over d in order (one FMA per d).
//   mla_apply_uv: o[t, h, :] = W_UV[h] out_lat[t, h, :]      (out_lat [T, H, r], o [T, H, dv]);
//     each element an r-term FMA chain in sequential order (elements' chains interleaved, not
//     lanes of one sum): |error| <= r u sum|w o|. From T = 4 on (a prefill chunk) both tile
//     4 tokens in registers (apply_uv through a per-call transposed W_UV[h]); the bits are
//     the per-token path's (tests/ops/attention_test.cpp). Not a lane-split dot: that order measured 10x
//     the TP-vs-one-process difference on ml4-tiny (tests/parallel/mpi/model_cases.cpp; bf16
//     cache roundings flipping differently), not understood yet.
void mla_absorb_q(const float* w_uk, const float* q, int64_t T, int H, int dn, int qk, int r, float* q_lat);
void mla_apply_uv(const float* w_uv, const float* out_lat, int64_t T, int H, int dv, int r, float* o);

// q [HI, dI], w [HI], k [S, dI]; scores [S] = sum_h w[h] * relu(q[h].k[s]).
void indexer_scores(const float* q, const float* w, int HI, int dI, const float* k, int64_t S,
                    float* scores);

// Decode context parallelism's combine (SYSTEM.md S8), natural-log lse throughout. Part p of n:
// out [rows, cols] at parts + p * part_stride, its lse [rows] right after.
//   merge_attention_parts: out = sum_p exp(lse_p - L) out_p in part order, L = log sum_p
//     exp(lse_p) (m = max_p lse_p first); -inf parts weigh 0; all -inf gives 0.
//   rescale_attention_part: out *= exp(lse - L), L over lse_all [n][rows] (0 where lse = -inf),
//     the term each rank adds in the all-gather + reduce-scatter combine.
void merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols, float* out);
void rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows, int64_t cols);

}  // namespace ml4::cpu
