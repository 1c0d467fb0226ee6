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

// q [HI, dI], w [HI], k [S, dI]; scores [S] = sum_h w[h] * relu(q[h].k[s]).
void indexer_scores(const float* q, const float* w, int HI, int dI, const float* k, int64_t S,
                    float* scores);

}  // namespace ml4::cpu
