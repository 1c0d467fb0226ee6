// Attention cores on f32 data (MODEL.md 3.5-3.6): the absorbed MLA softmax over latent rows
// and the DSA lightning indexer's scores. The runner dequantizes the rows (all s <= p, or the
// indexer's top-k) from the paged cache, for MLA a block at a time (MlaKeyBlocks).
#pragma once

#include <cstdint>
#include <vector>

#include "model/linear_weight.h"

namespace ml4::cpu {

// q_lat [H, r], q_rope [H, dr], c [S, r], kr [S, dr], head_scale [H];
// out_lat [H, r], lse [H] (natural log). For each head h:
//   logit(s) = (q_lat[h].c[s] + q_rope[h].kr[s]) * head_scale[h]
//   out_lat[h] = sum_s softmax(logit)(s) c[s];  lse[h] = log sum_s exp(logit(s)).
// S == 0 gives out_lat = 0 and lse = -inf (the DCP/split combine convention).
void mla_attention(const float* q_lat, const float* q_rope, int H, int r, int dr, const float* c,
                   const float* kr, int64_t S, const float* head_scale, float* out_lat, float* lse);

// The keys of mla_attention_heads, kMlaBlock rows at a time (the online softmax's blocks).
constexpr int64_t kMlaBlock = 32;
class MlaKeyBlocks {
 public:
  virtual ~MlaKeyBlocks() = default;
  // Key rows [s0, s0 + n), n <= kMlaBlock: c[j] = row s0 + j of c (r floats), kr[j] = its kr
  // row (dr floats), in the source's memory or decoded into c_buf [kMlaBlock, r] / kr_buf
  // [kMlaBlock, dr] (the calling thread's, reused for every block).
  virtual void rows(int64_t s0, int64_t n, float* c_buf, float* kr_buf, const float** c, const float** kr) const = 0;
};
// Keys already in memory: c [S, r], kr [S, dr].
class MlaKeyRows final : public MlaKeyBlocks {
 public:
  MlaKeyRows(const float* c, const float* kr, int r, int dr) : c_(c), kr_(kr), r_(r), dr_(dr) {}
  void rows(int64_t s0, int64_t n, float*, float*, const float** c, const float** kr) const override {
    for (int64_t j = 0; j < n; ++j) c[j] = c_ + (s0 + j) * r_, kr[j] = kr_ + (s0 + j) * dr_;
  }

 private:
  const float *c_, *kr_;
  int r_, dr_;
};
// mla_attention for nh heads on the calling thread (no parallel_for inside): q_lat [nh, r],
// head h's rope query at q_rope + h * ld_rope, head_scale [nh], out_lat [nh, r], lse [nh], keys
// from `keys` a block at a time. Each head's result is bit for bit mla_attention's for that head
// over the same key values, however the heads are split between calls (the runner splits a step
// over tokens x head groups and decodes a token's selected keys block by block into L1).
void mla_attention_heads(const float* q_lat, const float* q_rope, int64_t ld_rope, int nh, int r, int dr, int64_t S,
                         const MlaKeyBlocks& keys, const float* head_scale, float* out_lat, float* lse);

// The softmax's exp (mla_attention): exp(x) within 1.01 ulp on [-87.3, 0], 0 below -87.34,
// NaN for NaN; exp_shifted(p, n, m) sets p[j] = exp_softmax(p[j] - m), vectorized, the same
// bits as the scalar function.
float exp_softmax(float x);
void exp_shifted(float* p, int64_t n, float m);

// The two per-head products around absorbed MLA (MODEL.md 3.6), for T tokens at once. W_UK /
// W_UV are read from wkv_b [H*(dn+dv), r] in its stored format (model/linear_weight.h; head
// h's W_UK rows h*(dn+dv) + [0, dn), its W_UV rows the next dv), each element the value
// dequantize_linear gives it: decoded per job into the thread's buffer (a view for f32), so a
// decode step reads wkv_b's own bytes (FP8: a quarter of an f32 copy's).
//   mla_absorb_q: q_lat[t, h, :] = W_UK[h]^T q[t, h, 0:dn]   (q rows of qk floats per head,
//     q_lat [T, H, r]); each q_lat element sums over d in order (one FMA per d). Jobs: (head,
//     128 columns, 64 tokens).
//   mla_apply_uv: o[t, h, :] = W_UV[h] out_lat[t, h, :]      (out_lat [T, H, r], o [T, H, dv]);
//     each element an r-term FMA chain in sequential order (elements' chains interleaved, not
//     lanes of one sum): |error| <= r u sum|w o|. Jobs: (head, 8 rows); from T = 4 on, heads.
//   From T = 4 on (a prefill chunk) both tile 4 tokens in registers (apply_uv through a per-call
//     transposed W_UV[h]); the bits are the per-token path's (tests/ops/attention_test.cpp).
//     Not a lane-split dot: that order measured 10x the TP-vs-one-process difference on
//     ml4-tiny (tests/parallel/mpi/model_cases.cpp; bf16 cache roundings flipping
//     differently), not understood yet.
//   bf16 / FP8 wkv_b on a CPU with AVX-512, decode steps (T < 4): both decode the stored elements
//     in registers (FP8: each weight rounded once, v * s, as dequantize_linear), from a copy laid
//     out for the kernels (AbsorbLayout, the stored element size): W_UK in 128-column chunks,
//     each chunk's dn rows contiguous (a job streams one block), and W_UV transposed, so that 16
//     outputs are the 16 lanes of one register, each still its own chain over j. Same bits.
// A wkv_b of another shape, or invalid, writes NaN and logs why.
//
// wkv_b's bf16 or e4m3 elements laid out for the decode kernels (FP8: with each weight's block
// scale times 256): made at load when wkv_b is bf16 or FP8, the CPU has AVX-512, r % 128 == 0,
// dv % 16 == 0 and (FP8) every scale * 256 is finite; else empty (the kernels read wkv_b).
struct AbsorbLayout {
  std::vector<uint8_t> uk8, uv8;       // FP8, as uk16 / uv16
  std::vector<uint16_t> uk16, uv16;    // bf16: uk [H][r / 128][dn][128] = W_UK[h][d][128 c + i];
                                       // uv [H][r][dv] = W_UV[h][d][j] at (h, j, d)
  std::vector<float> uk_s256;          // FP8: [H][r / 128][dn]
  std::vector<float> uv_s256;          // FP8: [H][r / 128][dv]
  bool bf16() const { return !uk16.empty(); }
  bool empty() const { return uk8.empty() && uk16.empty(); }
};
AbsorbLayout layout_absorb(const LinearWeight& wkv_b, int H, int dn, int dv);

void mla_absorb_q(const LinearWeight& wkv_b, const float* q, int64_t T, int H, int dn, int dv, int qk, int r,
                  float* q_lat, const AbsorbLayout* layout = nullptr);
void mla_apply_uv(const LinearWeight& wkv_b, const float* out_lat, int64_t T, int H, int dn, int dv, int r, float* o,
                  const AbsorbLayout* layout = nullptr);

// q [HI, dI], w [HI], k [S, dI]; scores [S] = sum_h w[h] * relu(q[h].k[s]).
void indexer_scores(const float* q, const float* w, int HI, int dI, const float* k, int64_t S,
                    float* scores);

// indexer_scores for T tokens against one key array k [S, dI], keys [s0, s1) only (the caller
// splits the keys over threads; no parallel_for inside): token t (q + t HI dI, w + t HI) gets
// scores[t * ld + s] for s in [s0, min(s1, visible[t])), bit for bit what indexer_scores gives
// (each dot in dot()'s order, acc = fma(w[h], relu(dot), acc) over h in order); nothing else is
// written. Keys are taken in blocks of 16 for every token, so a step of several tokens reads each
// key row from memory once.
void indexer_scores_rows(const float* q, const float* w, int64_t T, int HI, int dI, const float* k, int64_t s0,
                         int64_t s1, const int64_t* visible, float* scores, int64_t ld);

// Decode context parallelism's combine (SYSTEM.md S8), natural-log lse throughout. Part p of n:
// out [rows, cols] at parts + p * part_stride, its lse [rows] right after.
//   merge_attention_parts: out = sum_p exp(lse_p - L) out_p in part order, L = log sum_p
//     exp(lse_p) (m = max_p lse_p first); -inf parts weigh 0; all -inf gives 0.
//   rescale_attention_part: out *= exp(lse - L), L over lse_all [n][rows] (0 where lse = -inf),
//     the term each rank adds in the all-gather + reduce-scatter combine.
void merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols, float* out);
void rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows, int64_t cols);

}  // namespace ml4::cpu
