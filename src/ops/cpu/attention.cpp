// Attention cores: see attention.h.
//
// mla_attention (mla_attention_heads on each thread's heads) walks the key rows in blocks of
// kBlock, each block's rows given by a MlaKeyBlocks source (rows in memory, or rows the runner
// decodes from the cache into an L1 buffer per block), and, for every head of the
// thread's share, updates an online softmax (FlashAttention: running max m, running
// sum l, output rescaled by exp(m_old - m_new) when the max grows). A block of c
// (kBlock x r f32, 64 KiB at r = 512) is thus read from memory once per thread and
// reused from cache by all its heads, instead of once per head: the logits (latent and rope
// parts in one accumulation, the "logit order" of logit_tile) as 2 heads x 2 keys register
// tiles (AVX-512: 4 x 4, one 16-lane register holding the order's two 8-lane accumulators, 16
// logits' final sums reduced across registers), P x C for 4 heads at a time (MLA's one latent
// row serves every head). Each head's result is bit for bit the head computed alone, and the
// same with AVX-512 or without. Logits and the output are f32 (FMA
// dots); exp is exp_softmax (vectorized, its own bits, not libm's); l is summed in f64;
// lse = m + log(l); the block max and the f64 block sums are vectorized / interleaved over
// heads in ways that keep each head's key order. The CPU runner calls it per token (per
// token x head group), for prefill chunks too, so a token's attention never depends on how
// its prompt was chunked or on the other tokens of its step.
#include "ops/cpu/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ML4_ATTN_AVX2 1
#endif

#include "core/log.h"
#include "core/threads.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/linear_kernels.h"

namespace ml4::cpu {

// exp(x) for the softmax (x <= 0 there): Cody-Waite reduction by ln 2 and Cephes' expf
// polynomial, every step an explicit FMA, multiply or add, so the scalar and the AVX2 version
// give the same bits (tests/ops/attention_test.cpp); within 1.01 ulp of exp over
// [-87.3, 0] (measured on 4M points), 0 below -87.34 (where exp is under FLT_MIN), NaN stays
// NaN. One exp per (token, head, key) is 11x cheaper vectorized than std::exp's 3.6 ns.
namespace {
namespace expf_poly {
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f, kMin = -87.33654f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace expf_poly
}  // namespace

namespace {
inline float exp_softmax_inline(float x) {
  using namespace expf_poly;
  if (!(x >= kMin)) return x < kMin ? 0.0f : x;  // tiny, -inf: 0; NaN: NaN
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kP0, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float z = r * r;
  const float y = std::fma(p, z, r) + 1.0f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}
}  // namespace

namespace {
#ifdef ML4_ATTN_AVX2
inline __m256 exp_softmax8(__m256 x) {
  using namespace expf_poly;
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kMin), _CMP_LT_OQ);
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  const __m256 z = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, z, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#endif
}  // namespace

namespace {
// p[j] = exp_softmax(p[j] - m) for j < n: 8 at a time, then one at a time (same bits).
inline void exp_shifted_inline(float* p, int64_t n, float m) {
  int64_t j = 0;
#ifdef ML4_ATTN_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, exp_softmax8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv)));
#endif
  for (; j < n; ++j) p[j] = exp_softmax_inline(p[j] - m);
}
}  // namespace

float exp_softmax(float x) { return exp_softmax_inline(x); }
void exp_shifted(float* p, int64_t n, float m) { exp_shifted_inline(p, n, m); }

namespace {

constexpr int64_t kBlock = 32;  // rows of c per online-softmax step


inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef ML4_ATTN_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  __m256 v = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// The logit's dot product: q [q_lat | q_rope] . [c | kr] over two row segments (the latent and
// the rope part lie in different arrays), in one order (the "logit order"): two 8-lane
// accumulators over 16-element steps of segment 0, one 8-step more into the first, the same
// over segment 1 into the same accumulators, then hsum8(acc0 + acc1), then segment 0's scalar
// tail, then segment 1's. A segment: rows of a (lda apart) and of b (ldb apart, or b row v at
// brows[v]), n long; a tile gives RM x RN logits, each loaded row serving RM or RN of them.
struct DotSeg {
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
  int64_t n;
  const float* const* brows = nullptr;
  const float* brow(int64_t v) const { return brows != nullptr ? brows[v] : b + v * ldb; }
  DotSeg at(int64_t u, int64_t v) const {
    return {a + u * lda, lda, brows != nullptr ? nullptr : b + v * ldb, ldb, n, brows != nullptr ? brows + v : nullptr};
  }
};

template <int RM, int RN>
inline void logit_tile(const DotSeg (&s)[2], float* y, int64_t ldy) {
  int64_t tail[2];
#ifdef ML4_ATTN_AVX2
  using namespace kernels;
  Vec8 a0[RM][RN], a1[RM][RN];
  ML4_UNROLL for (int u = 0; u < RM; ++u) ML4_UNROLL for (int v = 0; v < RN; ++v) a0[u][v] = a1[u][v] = zero8();
  const float* bp[2][RN];
  for (int g = 0; g < 2; ++g) ML4_UNROLL for (int v = 0; v < RN; ++v) bp[g][v] = s[g].brow(v);
  ML4_UNROLL for (int g = 0; g < 2; ++g) {
    const float* a = s[g].a;
    const float* const* b = bp[g];
    const int64_t lda = s[g].lda, n = s[g].n;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      Vec8 b0[RN], b1[RN];
      ML4_UNROLL for (int v = 0; v < RN; ++v) b0[v] = load8(b[v] + i), b1[v] = load8(b[v] + i + 8);
      ML4_UNROLL for (int u = 0; u < RM; ++u) {
        const Vec8 x0 = load8(a + u * lda + i), x1 = load8(a + u * lda + i + 8);
        ML4_UNROLL for (int v = 0; v < RN; ++v) a0[u][v] = fma8(x0, b0[v], a0[u][v]), a1[u][v] = fma8(x1, b1[v], a1[u][v]);
      }
    }
    for (; i + 8 <= n; i += 8)
      ML4_UNROLL for (int u = 0; u < RM; ++u) ML4_UNROLL for (int v = 0; v < RN; ++v)
        a0[u][v] = fma8(load8(a + u * lda + i), load8(b[v] + i), a0[u][v]);
    tail[g] = i;
  }
  ML4_UNROLL for (int u = 0; u < RM; ++u)
    ML4_UNROLL for (int v = 0; v < RN; ++v) {
      float t = hsum8(add8(a0[u][v], a1[u][v]));
      for (int g = 0; g < 2; ++g)
        for (int64_t k = tail[g]; k < s[g].n; ++k) t = std::fma(s[g].a[u * s[g].lda + k], bp[g][v][k], t);
      y[u * ldy + v] = t;
    }
#else
  tail[0] = tail[1] = 0;
  ML4_UNROLL for (int u = 0; u < RM; ++u)
    ML4_UNROLL for (int v = 0; v < RN; ++v) {
      float t = 0.0f;
      for (int g = 0; g < 2; ++g)
        for (int64_t k = tail[g]; k < s[g].n; ++k) t = std::fma(s[g].a[u * s[g].lda + k], s[g].brow(v)[k], t);
      y[u * ldy + v] = t;
    }
#endif
}

// y[u * ldy + v] = the logit of a-row u and b-row v for u < rm, v < rn, in 2 x 2 tiles.
void logit_rows(const DotSeg (&s)[2], int64_t rm, int64_t rn, float* y, int64_t ldy) {
  for (int64_t u = 0; u < rm; u += 2)
    for (int64_t v = 0; v < rn; v += 2) {
      const DotSeg t[2] = {s[0].at(u, v), s[1].at(u, v)};
      float* yuv = y + u * ldy + v;
      const bool two_a = u + 1 < rm, two_b = v + 1 < rn;
      if (two_a && two_b) logit_tile<2, 2>(t, yuv, ldy);
      else if (two_a) logit_tile<2, 1>(t, yuv, ldy);
      else if (two_b) logit_tile<1, 2>(t, yuv, ldy);
      else logit_tile<1, 1>(t, yuv, ldy);
    }
}

// o_q[i] = o_q[i] * alpha[q] + sum_j p[q][j] c[j][i] for the NQ (<= 4) rows o_q (c row j at
// c[j]): each c row is loaded once for all of them. NQ is a template argument so the 2 x NQ accumulators stay
// in registers (a run-time row count kept them on the stack: 3x slower).
template <int NQ>
void scale_accumulate_rows_n(float* const* o, const float* alpha, const float* const* p, const float* const* c,
                             int64_t rows, int r) {
  int i = 0;
#ifdef ML4_ATTN_AVX2
  // 16 columns x NQ rows of accumulators; each c row's 16 values loaded once for all rows.
  for (; i + 16 <= r; i += 16) {
    __m256 acc[NQ][2];
    ML4_UNROLL for (int q = 0; q < NQ; ++q) {
      const __m256 a = _mm256_set1_ps(alpha[q]);
      acc[q][0] = _mm256_mul_ps(_mm256_loadu_ps(o[q] + i), a);
      acc[q][1] = _mm256_mul_ps(_mm256_loadu_ps(o[q] + i + 8), a);
    }
    for (int64_t j = 0; j < rows; ++j) {
      const __m256 c0 = _mm256_loadu_ps(c[j] + i), c1 = _mm256_loadu_ps(c[j] + i + 8);
      ML4_UNROLL for (int q = 0; q < NQ; ++q) {
        const __m256 pv = _mm256_set1_ps(p[q][j]);
        acc[q][0] = _mm256_fmadd_ps(pv, c0, acc[q][0]);
        acc[q][1] = _mm256_fmadd_ps(pv, c1, acc[q][1]);
      }
    }
    ML4_UNROLL for (int q = 0; q < NQ; ++q) {
      _mm256_storeu_ps(o[q] + i, acc[q][0]);
      _mm256_storeu_ps(o[q] + i + 8, acc[q][1]);
    }
  }
#endif
  for (; i < r; ++i)
    ML4_UNROLL for (int q = 0; q < NQ; ++q) {
      float acc = o[q][i] * alpha[q];
      for (int64_t j = 0; j < rows; ++j) acc = std::fma(p[q][j], c[j][i], acc);
      o[q][i] = acc;
    }
}

void scale_accumulate_rows(float* const* o, const float* alpha, const float* const* p, int nq, const float* const* c,
                           int64_t rows, int r) {
  switch (nq) {
    case 1: return scale_accumulate_rows_n<1>(o, alpha, p, c, rows, r);
    case 2: return scale_accumulate_rows_n<2>(o, alpha, p, c, rows, r);
    case 3: return scale_accumulate_rows_n<3>(o, alpha, p, c, rows, r);
    default: return scale_accumulate_rows_n<4>(o, alpha, p, c, rows, r);
  }
}

#ifdef ML4_LINEAR_AVX512
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own _mm512 helpers
#pragma GCC diagnostic ignored "-Wuninitialized"
// The 16 reductions hsum8(lo256(a[d]) + hi256(a[d])) of a 4 x 4 tile (d = 4u + v, stored
// at y[u * ldy + v]) done across registers: each level is the same adds of the same lanes as
// the one-register sequence (acc0 + acc1; lo128 + hi128; lanes 0 + 2 and 1 + 3; then (0 + 2)
// + (1 + 3)), 45 instructions for 16 dots instead of ~128.
ML4_AVX512_FN inline __attribute__((always_inline)) void hsum16x16_store(const __m512* a, float* y, int64_t ldy) {
  __m512 v[8], s4[4], t2[2];
  ML4_UNROLL for (int k = 0; k < 8; ++k)  // [acc0 + acc1 of dot 2k | of dot 2k + 1]
    v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  ML4_UNROLL for (int k = 0; k < 4; ++k)  // 128-lane q: dot 4k + q's lo128 + hi128
    s4[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  ML4_UNROLL for (int k = 0; k < 2; ++k)  // 128-lane q: [0+2, 1+3 of dot 8k + q | of dot 8k + 4 + q]
    t2[k] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * k], s4[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s4[2 * k], s4[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // 128-lane q: the dots q, q + 4, q + 8, q + 12.
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(t2[0], t2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(t2[0], t2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane q, element j is dot q + 4j: row j, column q. Transposed, each row is one store.
  __m128 c0 = _mm512_castps512_ps128(d), c1 = _mm512_extractf32x4_ps(d, 1), c2 = _mm512_extractf32x4_ps(d, 2),
         c3 = _mm512_extractf32x4_ps(d, 3);
  _MM_TRANSPOSE4_PS(c0, c1, c2, c3);
  _mm_storeu_ps(y, c0);
  _mm_storeu_ps(y + ldy, c1);
  _mm_storeu_ps(y + 2 * ldy, c2);
  _mm_storeu_ps(y + 3 * ldy, c3);
}

// logit_tile with one 16-lane register per logit: lanes 0-7 are the order's acc0 and lanes
// 8-15 its acc1 (each lane the same FMA chain), the 8-steps into lanes 0-7 only, then
// hsum8(acc0 + acc1) and the scalar tails: the same bits, with twice the registers AVX2 has,
// so RM x RN up to 4 x 4 tiles (8 loads per 16 FMAs instead of 8 per 8).
template <int RM, int RN>
ML4_AVX512_FN void logit_tile_avx512(const DotSeg (&s)[2], float* y, int64_t ldy) {
  __m512 acc[RM][RN];
  ML4_UNROLL for (int u = 0; u < RM; ++u) ML4_UNROLL for (int v = 0; v < RN; ++v) acc[u][v] = _mm512_setzero_ps();
  int64_t tail[2];
  const float* bp[2][RN];
  for (int g = 0; g < 2; ++g) ML4_UNROLL for (int v = 0; v < RN; ++v) bp[g][v] = s[g].brow(v);
  // Both segments unrolled: the accumulators stay in registers from the first FMA to the sums.
  ML4_UNROLL for (int g = 0; g < 2; ++g) {
    const float* a = s[g].a;
    const float* const* b = bp[g];
    const int64_t lda = s[g].lda, n = s[g].n;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 bv[RN];
      ML4_UNROLL for (int v = 0; v < RN; ++v) bv[v] = _mm512_loadu_ps(b[v] + i);
      ML4_UNROLL for (int u = 0; u < RM; ++u) {
        const __m512 av = _mm512_loadu_ps(a + u * lda + i);
        ML4_UNROLL for (int v = 0; v < RN; ++v) acc[u][v] = _mm512_fmadd_ps(av, bv[v], acc[u][v]);
      }
    }
    if (i + 8 <= n) {
      const __mmask16 lo = 0x00FF;
      ML4_UNROLL for (int u = 0; u < RM; ++u) {
        const __m512 av = _mm512_maskz_loadu_ps(lo, a + u * lda + i);
        ML4_UNROLL for (int v = 0; v < RN; ++v)
          acc[u][v] = _mm512_mask3_fmadd_ps(av, _mm512_maskz_loadu_ps(lo, b[v] + i), acc[u][v], lo);
      }
      i += 8;
    }
    tail[g] = i;
  }
  if constexpr (RM == 4 && RN == 4) {
    if (tail[0] == s[0].n && tail[1] == s[1].n) return hsum16x16_store(acc[0], y, ldy);
  }
  ML4_UNROLL for (int u = 0; u < RM; ++u)
    ML4_UNROLL for (int v = 0; v < RN; ++v) {
      const __m256 lo = _mm512_castps512_ps256(acc[u][v]), hi = _mm512_extractf32x8_ps(acc[u][v], 1);
      float t = kernels::hsum8(kernels::add8(kernels::Vec8{lo}, kernels::Vec8{hi}));
      for (int g = 0; g < 2; ++g)
        for (int64_t k = tail[g]; k < s[g].n; ++k) t = std::fma(s[g].a[u * s[g].lda + k], bp[g][v][k], t);
      y[u * ldy + v] = t;
    }
}

template <int RM>
ML4_AVX512_FN void logit_row_tiles_avx512(const DotSeg (&s)[2], int64_t rn, float* y, int64_t ldy) {
  int64_t v = 0;
  for (; v + 4 <= rn; v += 4) {
    const DotSeg t[2] = {s[0].at(0, v), s[1].at(0, v)};
    logit_tile_avx512<RM, 4>(t, y + v, ldy);
  }
  const DotSeg t[2] = {s[0].at(0, v), s[1].at(0, v)};
  switch (rn - v) {
    case 3: return logit_tile_avx512<RM, 3>(t, y + v, ldy);
    case 2: return logit_tile_avx512<RM, 2>(t, y + v, ldy);
    case 1: return logit_tile_avx512<RM, 1>(t, y + v, ldy);
    default: return;
  }
}

// logit_rows in 4 x 4 tiles.
ML4_AVX512_FN void logit_rows_avx512(const DotSeg (&s)[2], int64_t rm, int64_t rn, float* y, int64_t ldy) {
  int64_t u = 0;
  for (; u + 4 <= rm; u += 4) {
    const DotSeg t[2] = {s[0].at(u, 0), s[1].at(u, 0)};
    logit_row_tiles_avx512<4>(t, rn, y + u * ldy, ldy);
  }
  const DotSeg t[2] = {s[0].at(u, 0), s[1].at(u, 0)};
  switch (rm - u) {
    case 3: return logit_row_tiles_avx512<3>(t, rn, y + u * ldy, ldy);
    case 2: return logit_row_tiles_avx512<2>(t, rn, y + u * ldy, ldy);
    case 1: return logit_row_tiles_avx512<1>(t, rn, y + u * ldy, ldy);
    default: return;
  }
}

// scale_accumulate_rows_n with 16-lane registers, 64 columns a pass (NQ x 4 accumulators,
// each c row's 64 values loaded once for the NQ rows), then 16, then the scalar tail: every
// element the same o * alpha and FMA chain over j.
template <int NQ>
ML4_AVX512_FN void scale_accumulate_rows_avx512_n(float* const* o, const float* alpha, const float* const* p,
                                                  const float* const* c, int64_t rows, int r) {
  int i = 0;
  for (; i + 64 <= r; i += 64) {
    __m512 acc[NQ][4];
    ML4_UNROLL for (int q = 0; q < NQ; ++q) {
      const __m512 a = _mm512_set1_ps(alpha[q]);
      ML4_UNROLL for (int k = 0; k < 4; ++k) acc[q][k] = _mm512_mul_ps(_mm512_loadu_ps(o[q] + i + 16 * k), a);
    }
    for (int64_t j = 0; j < rows; ++j) {
      __m512 cv[4];
      ML4_UNROLL for (int k = 0; k < 4; ++k) cv[k] = _mm512_loadu_ps(c[j] + i + 16 * k);
      ML4_UNROLL for (int q = 0; q < NQ; ++q) {
        const __m512 pv = _mm512_set1_ps(p[q][j]);
        ML4_UNROLL for (int k = 0; k < 4; ++k) acc[q][k] = _mm512_fmadd_ps(pv, cv[k], acc[q][k]);
      }
    }
    ML4_UNROLL for (int q = 0; q < NQ; ++q) ML4_UNROLL for (int k = 0; k < 4; ++k)
      _mm512_storeu_ps(o[q] + i + 16 * k, acc[q][k]);
  }
  for (; i + 16 <= r; i += 16) {
    __m512 acc[NQ];
    ML4_UNROLL for (int q = 0; q < NQ; ++q) acc[q] = _mm512_mul_ps(_mm512_loadu_ps(o[q] + i), _mm512_set1_ps(alpha[q]));
    for (int64_t j = 0; j < rows; ++j) {
      const __m512 cv = _mm512_loadu_ps(c[j] + i);
      ML4_UNROLL for (int q = 0; q < NQ; ++q) acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(p[q][j]), cv, acc[q]);
    }
    ML4_UNROLL for (int q = 0; q < NQ; ++q) _mm512_storeu_ps(o[q] + i, acc[q]);
  }
  for (; i < r; ++i)
    ML4_UNROLL for (int q = 0; q < NQ; ++q) {
      float acc = o[q][i] * alpha[q];
      for (int64_t j = 0; j < rows; ++j) acc = std::fma(p[q][j], c[j][i], acc);
      o[q][i] = acc;
    }
}

ML4_AVX512_FN void scale_accumulate_rows_avx512(float* const* o, const float* alpha, const float* const* p, int nq,
                                                const float* const* c, int64_t rows, int r) {
  switch (nq) {
    case 1: return scale_accumulate_rows_avx512_n<1>(o, alpha, p, c, rows, r);
    case 2: return scale_accumulate_rows_avx512_n<2>(o, alpha, p, c, rows, r);
    case 3: return scale_accumulate_rows_avx512_n<3>(o, alpha, p, c, rows, r);
    default: return scale_accumulate_rows_avx512_n<4>(o, alpha, p, c, rows, r);
  }
}
#pragma GCC diagnostic pop
#endif

// The score tiles and P x C of mla_attention: AVX-512 where linear.cpp uses it, else AVX2;
// the same bits either way.
void score_rows(bool wide, const DotSeg (&s)[2], int64_t rm, int64_t rn, float* y, int64_t ldy) {
#ifdef ML4_LINEAR_AVX512
  if (wide) return logit_rows_avx512(s, rm, rn, y, ldy);
#endif
  logit_rows(s, rm, rn, y, ldy);
}

void accumulate_rows(bool wide, float* const* o, const float* alpha, const float* const* p, int nq,
                     const float* const* c, int64_t rows, int r) {
#ifdef ML4_LINEAR_AVX512
  if (wide) return scale_accumulate_rows_avx512(o, alpha, p, nq, c, rows, r);
#endif
  scale_accumulate_rows(o, alpha, p, nq, c, rows, r);
}

}  // namespace

namespace {
// p[j] *= s for j < n; returns max over j of p[j] as the loop bmax = std::max(bmax, p[j]) from
// -inf gives it: NaN skipped, and among equal values the first (which only +0 / -0 tell
// apart: a zero maximum is found again in key order).
inline float scale_and_max(float* p, int64_t n, float s) {
  float bmax = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef ML4_ATTN_AVX2
  if (n >= 8) {
    const __m256 sv = _mm256_set1_ps(s);
    __m256 mv = _mm256_set1_ps(bmax);
    for (; j + 8 <= n; j += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + j), sv);
      _mm256_storeu_ps(p + j, x);
      mv = _mm256_max_ps(x, mv);  // x > mv ? x : mv: a NaN x leaves mv
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    bmax = _mm_cvtss_f32(h);
  }
#endif
  for (; j < n; ++j) {
    p[j] *= s;
    bmax = std::max(bmax, p[j]);
  }
  if (bmax == 0.0f) {
    bmax = -std::numeric_limits<float>::infinity();
    for (j = 0; j < n; ++j) bmax = std::max(bmax, p[j]);
  }
  return bmax;
}

// sum[k] = the f64 sum of p[k][0..n) in order, for k < rows_count; four rows' chains interleaved.
inline void block_sums(const float* const* p, int64_t count, int64_t n, double* sum) {
  int64_t k = 0;
  for (; k + 4 <= count; k += 4) {
    const float *p0 = p[k], *p1 = p[k + 1], *p2 = p[k + 2], *p3 = p[k + 3];
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      s0 += p0[j];
      s1 += p1[j];
      s2 += p2[j];
      s3 += p3[j];
    }
    sum[k] = s0, sum[k + 1] = s1, sum[k + 2] = s2, sum[k + 3] = s3;
  }
  for (; k < count; ++k) {
    double s = 0.0;
    for (int64_t j = 0; j < n; ++j) s += p[k][j];
    sum[k] = s;
  }
}
}  // namespace

void mla_attention_heads(const float* q_lat, const float* q_rope, int64_t ld_rope, int nh, int r, int dr, int64_t S,
                         const MlaKeyBlocks& keys, const float* head_scale, float* out_lat, float* lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  static_assert(kBlock == kMlaBlock);
  const bool wide = linear_uses_avx512();
  // The thread's scratch, kept across calls: per head m, l, a block's logits, alpha, the rows
  // taking mass; a block of decoded key rows.
  struct Scratch {
    std::vector<float> m, pl, alpha, c, kr;
    std::vector<double> l, bsum;
    std::vector<int> head;
    std::vector<float*> orow;
    std::vector<const float*> prow;
  };
  thread_local Scratch sc;
  if (sc.m.size() < static_cast<size_t>(nh)) {
    sc.m.resize(nh), sc.alpha.resize(nh), sc.l.resize(nh), sc.bsum.resize(nh), sc.head.resize(nh);
    sc.orow.resize(nh), sc.prow.resize(nh);
    sc.pl.resize(static_cast<size_t>(nh) * kBlock);
  }
  if (sc.c.size() < static_cast<size_t>(kBlock * r)) sc.c.resize(kBlock * r);
  if (sc.kr.size() < static_cast<size_t>(kBlock * dr)) sc.kr.resize(kBlock * dr);
  float* m = sc.m.data();
  double* l = sc.l.data();
  float* pl = sc.pl.data();
  float* alpha = sc.alpha.data();
  std::fill_n(m, nh, kNegInf);
  std::fill_n(l, nh, 0.0);
  // Per block: every head's logits as 2 heads x 2 keys tiles (the logit order), then the heads
  // that take mass accumulate 4 at a time, each c row loaded once for all 4. Every (head,
  // element) sees the same operations in the same order as one head alone.
  std::fill(out_lat, out_lat + static_cast<int64_t>(nh) * r, 0.0f);
  for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
    const int64_t rows = std::min(kBlock, S - s0);
    const float *cb[kBlock], *kb[kBlock];
    keys.rows(s0, rows, sc.c.data(), sc.kr.data(), cb, kb);
    const DotSeg segs[2] = {{q_lat, r, nullptr, 0, r, cb}, {q_rope, ld_rope, nullptr, 0, dr, kb}};
    score_rows(wide, segs, nh, rows, pl, kBlock);
    // Per head: scale, block max, running max, alpha and the exps; then the block sums of the
    // heads taking mass, four f64 chains interleaved (each still summed in key order).
    int64_t active = 0;
    for (int64_t h = 0; h < nh; ++h) {
      float* p = pl + h * kBlock;
      const float bmax = scale_and_max(p, rows, head_scale[h]);
      const float mh = m[h];
      const float m_new = std::max(mh, bmax);
      if (m_new == kNegInf) continue;  // everything so far is -inf: nothing to add
      const float a = mh == kNegInf ? 0.0f : exp_softmax_inline(mh - m_new);
      exp_shifted_inline(p, rows, m_new);
      m[h] = m_new;
      sc.head[active] = static_cast<int>(h), sc.orow[active] = out_lat + h * r, sc.prow[active] = p, alpha[active] = a;
      ++active;
    }
    block_sums(sc.prow.data(), active, rows, sc.bsum.data());
    for (int64_t k = 0; k < active; ++k) {
      double& lh = l[sc.head[k]];
      lh = lh * alpha[k] + sc.bsum[k];
    }
    for (int64_t k = 0; k < active; k += 4)
      accumulate_rows(wide, sc.orow.data() + k, alpha + k, sc.prow.data() + k,
                      static_cast<int>(std::min<int64_t>(4, active - k)), cb, rows, r);
  }
  for (int64_t h = 0; h < nh; ++h) {
    const double lh = l[h];
    float* o = out_lat + h * r;
    if (lh <= 0.0) {  // S == 0 (or all logits -inf): no mass
      std::fill(o, o + r, 0.0f);
      lse[h] = kNegInf;
      continue;
    }
    const float inv = static_cast<float>(1.0 / lh);
    for (int i = 0; i < r; ++i) o[i] *= inv;
    lse[h] = static_cast<float>(m[h] + std::log(lh));
  }
}

void mla_attention(const float* q_lat, const float* q_rope, int H, int r, int dr, const float* c,
                   const float* kr, int64_t S, const float* head_scale, float* out_lat, float* lse) {
  // Split heads evenly over the threads: every thread then streams c once.
  const int64_t grain = std::max<int64_t>(1, (H + num_threads() - 1) / num_threads());
  const MlaKeyRows keys(c, kr, r, dr);
  parallel_for(H, grain, [&](int64_t h0, int64_t h1) {
    mla_attention_heads(q_lat + h0 * r, q_rope + h0 * dr, dr, static_cast<int>(h1 - h0), r, dr, S, keys,
                        head_scale + h0, out_lat + h0 * r, lse + h0);
  });
}

// Both products below keep one order per output element (an FMA chain over the summed index,
// in order, from 0), whatever T is: the token-tiled paths (T >= kTokTile, a prefill chunk)
// hold several tokens' outputs in registers and read each weight row once per tile; the
// per-token paths (decode) vectorize one token's outputs. Same bits either way.
namespace {
constexpr int64_t kTokTile = 4;

#ifdef ML4_ATTN_AVX2
// out[t][0:16) = sum over k < n of a[t][k] * b[k * ldb + 0:16), for the kTokTile rows a[t]
// (the first nt stored): each output an FMA chain over k in order from 0, the 4 x 16 outputs
// in 8 registers, each b row read once for the 4 rows.
void fma_rows_x16(const float* const* a, const float* b, int64_t ldb, int n, float* const* out, int64_t nt) {
  __m256 acc[kTokTile][2];
  ML4_UNROLL for (auto& v : acc) v[0] = v[1] = _mm256_setzero_ps();
  for (int k = 0; k < n; ++k) {
    const float* bk = b + k * ldb;
    const __m256 b0 = _mm256_loadu_ps(bk), b1 = _mm256_loadu_ps(bk + 8);
    ML4_UNROLL for (int t = 0; t < kTokTile; ++t) {
      const __m256 at = _mm256_set1_ps(a[t][k]);
      acc[t][0] = _mm256_fmadd_ps(at, b0, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(at, b1, acc[t][1]);
    }
  }
  for (int64_t t = 0; t < nt; ++t) {
    _mm256_storeu_ps(out[t], acc[t][0]);
    _mm256_storeu_ps(out[t] + 8, acc[t][1]);
  }
}
#endif
}  // namespace

namespace {
// MLA's up-projection wkv_b [H*(dn+dv), r] as stored; head h's W_UK rows are h*(dn+dv) + [0, dn),
// its W_UV rows h*(dn+dv) + dn + [0, dv). rows() gives rows [n0, n1) x columns [k0, k1) as f32
// (each element the value dequantize_linear gives it): a view of an f32 wkv_b, else decoded
// into the calling thread's buffer.
struct UpProjection {
  const LinearWeight& w;
  int dn, dv;
  struct Rows {
    const float* p;
    int64_t ld;
  };
  Rows rows(int64_t n0, int64_t n1, int64_t k0, int64_t k1) const {
    const int64_t K = w.in_features;
    if (w.format == LinearFormat::kF32) return {w.weight.as<float>() + n0 * K + k0, K};
    thread_local std::vector<float> b;
    if (b.size() < static_cast<size_t>((n1 - n0) * (k1 - k0))) b.resize(static_cast<size_t>((n1 - n0) * (k1 - k0)));
    decode_weight_block(w, n0, n1, k0, k1, b.data(), k1 - k0);
    return {b.data(), k1 - k0};
  }
  int64_t uk_row(int64_t h) const { return h * (dn + dv); }
  int64_t uv_row(int64_t h) const { return h * (dn + dv) + dn; }
};

// Checks wkv_b against the shapes (false: out is NaN, the reason logged).
bool up_projection_ok(const LinearWeight& w, int H, int dn, int dv, int r, float* out, int64_t n) {
  Status st = validate_linear_weight(w);
  if (st.ok() && (w.out_features != static_cast<int64_t>(H) * (dn + dv) || w.in_features != r))
    st = invalid_argument("{}: wkv_b is [{}, {}], the heads need [{}, {}]", w.name, w.out_features, w.in_features,
                          static_cast<int64_t>(H) * (dn + dv), r);
  if (st.ok()) return true;
  ML4_LOG_ERROR("mla: {}", st.message());
  std::fill(out, out + n, std::numeric_limits<float>::quiet_NaN());
  return false;
}

#ifdef ML4_LINEAR_AVX512
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own _mm512 helpers
#pragma GCC diagnostic ignored "-Wuninitialized"
using kernels::e4m3x16_div256;
using kernels::has_nan_code;

// 16 weights at p as f32: FP8 (the e4m3 bytes times the scale s256 / 256, one rounding, as
// dequantize_linear) or bf16 (exact; s256 unused).
template <bool kFp8>
ML4_AVX512_FN inline __m512 weights16(const void* p, __m512 s256, __m128i& probe) {
  if constexpr (kFp8) {
    return _mm512_mul_ps(e4m3x16_div256(static_cast<const uint8_t*>(p), probe), s256);
  } else {
    const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// One token's q_lat[j0, j0 + 128) = sum over d of q[d] * W_UK[d][j0 + j], from the chunk's
// rows (row d at w + d * 128 elements, FP8 scale times 256 s256[d]): 8 registers of 16
// columns, each lane an FMA chain over d from 0 (the per-token path's order). False on a NaN
// code (nothing written).
template <bool kFp8, typename E>
ML4_AVX512_FN bool absorb_uk_avx512(const E* w, const float* s256, const float* q, int dn, float* ql) {
  __m512 acc[8];
  ML4_UNROLL for (auto& a : acc) a = _mm512_setzero_ps();
  __m128i probe = _mm_setzero_si128();
  for (int d = 0; d < dn; ++d) {
    const __m512 qb = _mm512_set1_ps(q[d]), sv = _mm512_set1_ps(kFp8 ? s256[d] : 1.0f);
    const E* row = w + d * 128;
    ML4_UNROLL for (int c = 0; c < 8; ++c)
      acc[c] = _mm512_fmadd_ps(qb, weights16<kFp8>(row + 16 * c, sv, probe), acc[c]);
  }
  if (kFp8 && has_nan_code(probe)) return false;
  ML4_UNROLL for (int c = 0; c < 8; ++c) _mm512_storeu_ps(ql + 16 * c, acc[c]);
  return true;
}

// One token's o[d0, d0 + 16 NV) = sum over j of W_UV[d][j] * ol[j] from the transposed rows
// (row j at wt + j * ldw, lanes d; FP8 scales s256 + (j / 128) * ldw): NV registers, each lane
// an FMA chain over j from 0. False on a NaN code.
template <bool kFp8, int NV, typename E>
ML4_AVX512_FN bool apply_uv_avx512(const E* wt, int64_t ldw, const float* s256, const float* ol, int r, float* o) {
  __m512 acc[NV];
  ML4_UNROLL for (auto& a : acc) a = _mm512_setzero_ps();
  __m128i probe = _mm_setzero_si128();
  for (int j0 = 0; j0 < r; j0 += 128) {
    __m512 sv[NV];
    ML4_UNROLL for (int c = 0; c < NV; ++c)
      sv[c] = kFp8 ? _mm512_loadu_ps(s256 + (j0 / 128) * ldw + 16 * c) : _mm512_set1_ps(1.0f);
    const int j1 = std::min(r, j0 + 128);
    for (int j = j0; j < j1; ++j) {
      const __m512 xb = _mm512_set1_ps(ol[j]);
      const E* row = wt + static_cast<int64_t>(j) * ldw;
      ML4_UNROLL for (int c = 0; c < NV; ++c)
        acc[c] = _mm512_fmadd_ps(weights16<kFp8>(row + 16 * c, sv[c], probe), xb, acc[c]);
    }
  }
  if (kFp8 && has_nan_code(probe)) return false;
  ML4_UNROLL for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
  return true;
}
#pragma GCC diagnostic pop
#endif

// Whether layout_absorb may lay wkv_b out for the decode kernels: AVX-512 here, and bf16, or
// FP8 with every scale * 256 finite (so (v / 256) * (s * 256) rounds exactly as v * s).
bool decode_kernels_ok(const LinearWeight& w) {
  if (!linear_uses_avx512()) return false;
  if (w.format == LinearFormat::kBF16) return true;
  if (w.format != LinearFormat::kFP8Block) return false;
  const float* s = w.scale.as<float>();
  for (int64_t i = 0; i < w.scale.numel(); ++i)
    if (!std::isfinite(s[i] * 256.0f)) return false;
  return true;
}

// A decode step (T < kTokTile) runs the decode kernels when wkv_b was laid out for them at
// load (which checked the format and scales) and AVX-512 is still allowed.
bool use_decode_kernels(const AbsorbLayout* lay, int64_t T) {
  return lay != nullptr && !lay->empty() && T < kTokTile && linear_uses_avx512();
}

constexpr int64_t kColChunk = 128;   // W_UK columns per job (one FP8 scale block)
constexpr int64_t kTokGroup = 64;    // tokens per W_UK job (its decoded columns reused by all)
}  // namespace

void mla_absorb_q(const LinearWeight& wkv_b, const float* q, int64_t T, int H, int dn, int dv, int qk, int r,
                  float* q_lat, const AbsorbLayout* lay) {
  if (!up_projection_ok(wkv_b, H, dn, dv, r, q_lat, T * H * r)) return;
  const UpProjection up{wkv_b, dn, dv};
  // Jobs: (head, 128-column chunk, group of 64 tokens); each decodes its W_UK[h][:, chunk]
  // once. Per element the order is the same whatever the job shape: an FMA chain over d.
  const int64_t chunks = (r + kColChunk - 1) / kColChunk, groups = (T + kTokGroup - 1) / kTokGroup;
  [[maybe_unused]] const bool fused = use_decode_kernels(lay, T);
  parallel_for(H * chunks * groups, 1, [&](int64_t b, int64_t e) {
    for (int64_t job = b; job < e; ++job) {
      // Chunks of one head are consecutive jobs, so a thread reads whole rows of wkv_b.
      const int64_t c = job % chunks, h = (job / chunks) % H, g = job / (H * chunks);
      const int64_t j0 = c * kColChunk, j1 = std::min<int64_t>(r, j0 + kColChunk), cw = j1 - j0;
      const int64_t ta = g * kTokGroup, tb = std::min<int64_t>(T, ta + kTokGroup);
#ifdef ML4_LINEAR_AVX512
      if (fused) {
        const int64_t at = (h * chunks + c) * dn;
        bool ok = true;
        for (int64_t t = ta; t < tb && ok; ++t) {
          const float* qt = q + (t * H + h) * qk;
          float* qlt = q_lat + (t * H + h) * r + j0;
          ok = lay->bf16() ? absorb_uk_avx512<false>(lay->uk16.data() + at * kColChunk, nullptr, qt, dn, qlt)
                           : absorb_uk_avx512<true>(lay->uk8.data() + at * kColChunk, lay->uk_s256.data() + at, qt, dn, qlt);
        }
        if (ok) continue;  // else (a NaN code) the path below, which decodes NaN as NaN
      }
#endif
      const auto W = up.rows(up.uk_row(h), up.uk_row(h) + dn, j0, j1);
#ifdef ML4_ATTN_AVX2
      if (T >= kTokTile && cw % 16 == 0) {
        // 4 tokens x 16 columns of q_lat in 8 registers, one W_UK row read per d.
        for (int64_t t0 = ta; t0 < tb; t0 += kTokTile) {
          const int64_t nt = std::min<int64_t>(kTokTile, tb - t0);
          const float* qn[kTokTile];
          float* ql[kTokTile];
          for (int64_t t = 0; t < kTokTile; ++t) {
            const int64_t tt = t0 + std::min<int64_t>(t, nt - 1);  // a short tile repeats its last token
            qn[t] = q + (tt * H + h) * qk;
            ql[t] = q_lat + (tt * H + h) * r + j0;
          }
          for (int64_t j = 0; j < cw; j += 16) {
            float* qlj[kTokTile];
            for (int64_t t = 0; t < kTokTile; ++t) qlj[t] = ql[t] + j;
            fma_rows_x16(qn, W.p + j, W.ld, dn, qlj, nt);
          }
        }
        continue;
      }
#endif
      for (int64_t t = ta; t < tb; ++t) {
        float* ql = q_lat + (t * H + h) * r + j0;
        const float* qn = q + (t * H + h) * qk;
        std::fill(ql, ql + cw, 0.0f);
        for (int d = 0; d < dn; ++d) {
          const float qv = qn[d];
          const float* wr = W.p + static_cast<int64_t>(d) * W.ld;
          int64_t j = 0;
#ifdef ML4_ATTN_AVX2
          const __m256 qb = _mm256_set1_ps(qv);
          for (; j + 8 <= cw; j += 8)
            _mm256_storeu_ps(ql + j, _mm256_fmadd_ps(qb, _mm256_loadu_ps(wr + j), _mm256_loadu_ps(ql + j)));
#endif
          for (; j < cw; ++j) ql[j] = std::fma(qv, wr[j], ql[j]);
        }
      }
    }
  });
}

AbsorbLayout layout_absorb(const LinearWeight& wkv_b, int H, int dn, int dv) {
  AbsorbLayout u;
  const int64_t r = wkv_b.in_features;
  if (dv % 16 != 0 || r % 128 != 0 || wkv_b.out_features != static_cast<int64_t>(H) * (dn + dv) ||
      !validate_linear_weight(wkv_b).ok() || !decode_kernels_ok(wkv_b))
    return u;
  const int64_t rb = r / 128;
  // uk: (h, c, d, i) <- row h*(dn+dv) + d, column 128 c + i; uv: (h, j, d) <- row h*(dn+dv) + dn + d, column j.
  auto lay_out = [&](const auto* q, auto& uk, auto& uv) {
    uk.resize(static_cast<size_t>(H) * r * dn);
    uv.resize(static_cast<size_t>(H) * r * dv);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < dn; ++d)
        for (int64_t c = 0; c < rb; ++c)
          std::copy_n(q + (h * (dn + dv) + d) * r + 128 * c, 128, uk.data() + ((h * rb + c) * dn + d) * 128);
      for (int64_t d = 0; d < dv; ++d)
        for (int64_t j = 0; j < r; ++j) uv[(h * r + j) * dv + d] = q[(h * (dn + dv) + dn + d) * r + j];
    }
  };
  if (wkv_b.format == LinearFormat::kBF16) {
    lay_out(wkv_b.weight.as<uint16_t>(), u.uk16, u.uv16);
    return u;
  }
  lay_out(wkv_b.weight.as<uint8_t>(), u.uk8, u.uv8);
  const float* sc = wkv_b.scale.as<float>();
  u.uk_s256.resize(static_cast<size_t>(H) * rb * dn);
  u.uv_s256.resize(static_cast<size_t>(H) * rb * dv);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < rb; ++c) {
      for (int64_t d = 0; d < dn; ++d)
        u.uk_s256[(h * rb + c) * dn + d] = sc[((h * (dn + dv) + d) / kFp8BlockSize) * rb + c] * 256.0f;
      for (int64_t d = 0; d < dv; ++d)
        u.uv_s256[(h * rb + c) * dv + d] = sc[((h * (dn + dv) + dn + d) / kFp8BlockSize) * rb + c] * 256.0f;
    }
  return u;
}

void mla_apply_uv(const LinearWeight& wkv_b, const float* out_lat, int64_t T, int H, int dn, int dv, int r, float* o,
                  const AbsorbLayout* lay) {
  if (!up_projection_ok(wkv_b, H, dn, dv, r, o, T * H * dv)) return;
  const UpProjection up{wkv_b, dn, dv};
#ifdef ML4_ATTN_AVX2
  if (T >= kTokTile && dv % 16 == 0) {
    // Per head: W_UV[h] transposed once ([r, dv], the thread's scratch), then 4 tokens x 16
    // outputs in 8 registers, one transposed row read per j: the lanes are outputs, each its
    // own FMA chain over j in order, as in the per-token path below.
    parallel_for(H, 1, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> wt_buf;
      wt_buf.resize(static_cast<size_t>(r) * dv);
      float* wt = wt_buf.data();
      for (int64_t h = b; h < e; ++h) {
        const auto W = up.rows(up.uv_row(h), up.uv_row(h) + dv, 0, r);
        for (int d = 0; d < dv; ++d)
          for (int j = 0; j < r; ++j) wt[static_cast<int64_t>(j) * dv + d] = W.p[d * W.ld + j];
        for (int64_t t0 = 0; t0 < T; t0 += kTokTile) {
          const int64_t nt = std::min<int64_t>(kTokTile, T - t0);
          const float* ol[kTokTile];
          for (int64_t t = 0; t < kTokTile; ++t) ol[t] = out_lat + ((t0 + std::min<int64_t>(t, nt - 1)) * H + h) * r;
          for (int d = 0; d < dv; d += 16) {
            float* oh[kTokTile];
            for (int64_t t = 0; t < kTokTile; ++t) oh[t] = o + ((t0 + std::min<int64_t>(t, nt - 1)) * H + h) * dv + d;
            fma_rows_x16(ol, wt + d, dv, r, oh, nt);  // fma(x, w, acc) == fma(w, x, acc) bit for bit
          }
        }
      }
    });
    return;
  }
#endif
#ifdef ML4_LINEAR_AVX512
  if (use_decode_kernels(lay, T)) {
    // Jobs: (head, 128 outputs), 16 outputs a register. A NaN code anywhere sends the whole
    // call down the path below (which decodes NaN as NaN).
    const int64_t parts = (dv + 127) / 128, rb = (r + 127) / 128;
    std::vector<uint8_t> nan_job(H * parts, 0);  // one writer per job
    parallel_for(H * parts, 1, [&](int64_t b, int64_t e) {
      for (int64_t job = b; job < e; ++job) {
        const int64_t h = job % H, d0 = (job / H) * 128, n = std::min<int64_t>(128, dv - d0);
        const float* s = lay->bf16() ? nullptr : lay->uv_s256.data() + h * rb * dv + d0;
        for (int64_t t = 0; t < T; ++t) {
          const float* ol = out_lat + (t * H + h) * r;
          float* oh = o + (t * H + h) * dv + d0;
          bool ok = false;
          auto run = [&](auto nv) {
            constexpr int NV = decltype(nv)::value;
            ok = lay->bf16() ? apply_uv_avx512<false, NV>(lay->uv16.data() + h * r * dv + d0, dv, s, ol, r, oh)
                             : apply_uv_avx512<true, NV>(lay->uv8.data() + h * r * dv + d0, dv, s, ol, r, oh);
          };
          switch (n / 16) {
            case 1: run(std::integral_constant<int, 1>{}); break;
            case 2: run(std::integral_constant<int, 2>{}); break;
            case 3: run(std::integral_constant<int, 3>{}); break;
            case 4: run(std::integral_constant<int, 4>{}); break;
            case 5: run(std::integral_constant<int, 5>{}); break;
            case 6: run(std::integral_constant<int, 6>{}); break;
            case 7: run(std::integral_constant<int, 7>{}); break;
            default: run(std::integral_constant<int, 8>{}); break;
          }
          if (!ok) nan_job[job] = 1;
        }
      }
    });
    bool any = false;
    for (uint8_t v : nan_job) any = any || v != 0;
    if (!any) return;
  }
#endif
  // Jobs: (head, 8 output rows), each decoding its 8 W_UV rows once for all T tokens.
  const int64_t octs = (dv + 7) / 8;
  parallel_for(H * octs, 1, [&](int64_t b, int64_t e) {
    for (int64_t job = b; job < e; ++job) {
      const int64_t h = job % H, d0 = (job / H) * 8, d1 = std::min<int64_t>(dv, d0 + 8);
      const auto W = up.rows(up.uv_row(h) + d0, up.uv_row(h) + d1, 0, r);
      for (int64_t t = 0; t < T; ++t) {
        const float* ol = out_lat + (t * H + h) * r;
        float* oh = o + (t * H + h) * dv;
        if (d1 - d0 == 8) {
          // 8 outputs at once: 8 independent chains (one chain is FMA-latency bound), each still
          // summed in its own sequential order, so the result is the same as one at a time.
          const float* w0 = W.p;
          const int64_t ld = W.ld;
          float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, a4 = 0.0f, a5 = 0.0f, a6 = 0.0f, a7 = 0.0f;
          for (int j = 0; j < r; ++j) {
            const float x = ol[j];
            a0 = std::fma(w0[j], x, a0);
            a1 = std::fma(w0[ld + j], x, a1);
            a2 = std::fma(w0[2 * ld + j], x, a2);
            a3 = std::fma(w0[3 * ld + j], x, a3);
            a4 = std::fma(w0[4 * ld + j], x, a4);
            a5 = std::fma(w0[5 * ld + j], x, a5);
            a6 = std::fma(w0[6 * ld + j], x, a6);
            a7 = std::fma(w0[7 * ld + j], x, a7);
          }
          oh[d0] = a0, oh[d0 + 1] = a1, oh[d0 + 2] = a2, oh[d0 + 3] = a3;
          oh[d0 + 4] = a4, oh[d0 + 5] = a5, oh[d0 + 6] = a6, oh[d0 + 7] = a7;
          continue;
        }
        for (int64_t d = d0; d < d1; ++d) {
          const float* wr = W.p + (d - d0) * W.ld;
          float acc = 0.0f;
          for (int j = 0; j < r; ++j) acc = std::fma(wr[j], ol[j], acc);
          oh[d] = acc;
        }
      }
    }
  });
}

void indexer_scores(const float* q, const float* w, int HI, int dI, const float* k, int64_t S,
                    float* scores) {
  parallel_for(S, 64, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const float* ks = k + s * dI;
      float acc = 0.0f;
      // One fused multiply-add per head, spelled out: the same bits whether or not the
      // compiler contracts (indexer_scores_rows does the same).
      for (int h = 0; h < HI; ++h) acc = std::fma(w[h], std::max(0.0f, dot(q + h * dI, ks, dI)), acc);
      scores[s] = acc;
    }
  });
}

void indexer_scores_rows(const float* q, const float* w, int64_t T, int HI, int dI, const float* k, int64_t s0,
                         int64_t s1, const int64_t* visible, float* scores, int64_t ld) {
  // Keys per block: their rows stay in L1 while every token's heads pass over them. A token's
  // HI x m dots are score_rows tiles of one segment (the logit order with an empty second
  // segment is dot()'s order: 16-steps into two 8-lane accumulators, an 8-step into the first,
  // hsum8(acc0 + acc1), the scalar tail), AVX-512 or AVX2 with the same bits.
  constexpr int64_t kKeys = 16;
  const bool wide = linear_uses_avx512();
  float d_small[64 * kKeys];
  std::vector<float> d_big(HI > 64 ? static_cast<size_t>(HI) * kKeys : 0);
  float* d = HI > 64 ? d_big.data() : d_small;
  for (int64_t sb = s0; sb < s1; sb += kKeys) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t m = std::min({kKeys, s1 - sb, visible[t] - sb});
      if (m <= 0) continue;
      const float* qt = q + t * HI * dI;
      const float* wt = w + t * HI;
      const float* kb = k + sb * dI;
      const DotSeg segs[2] = {{qt, dI, kb, dI, dI}, {qt, dI, kb, dI, 0}};
      score_rows(wide, segs, HI, m, d, kKeys);
      // As indexer_scores: acc = fma(w[h], max(0, dot), acc) over h in order, from 0.
      float* out = scores + t * ld + sb;
      int64_t j = 0;
#ifdef ML4_ATTN_AVX2
      const __m256 zero = _mm256_setzero_ps();
      for (; j + 8 <= m; j += 8) {
        __m256 acc = _mm256_setzero_ps();
        // max_ps(x, 0) = x > 0 ? x : 0 = std::max(0.0f, x), NaN included.
        for (int h = 0; h < HI; ++h)
          acc = _mm256_fmadd_ps(_mm256_set1_ps(wt[h]), _mm256_max_ps(_mm256_loadu_ps(d + h * kKeys + j), zero),
                                acc);
        _mm256_storeu_ps(out + j, acc);
      }
#endif
      for (; j < m; ++j) {
        float acc = 0.0f;
        for (int h = 0; h < HI; ++h) acc = std::fma(wt[h], std::max(0.0f, d[h * kKeys + j]), acc);
        out[j] = acc;
      }
    }
  }
}

namespace {
// L = log sum_p exp(lse[p * stride]) with the max taken out; -inf when every part is empty.
float combined_lse(const float* lse, int n, int64_t stride) {
  float m = -std::numeric_limits<float>::infinity();
  for (int p = 0; p < n; ++p) m = std::max(m, lse[p * stride]);
  if (m == -std::numeric_limits<float>::infinity()) return m;
  float sum = 0.0f;
  for (int p = 0; p < n; ++p) sum += std::exp(lse[p * stride] - m);
  return m + std::log(sum);
}
}  // namespace

void merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols, float* out) {
  parallel_for(rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const float* lse = parts + rows * cols + row;
      const float L = combined_lse(lse, n, part_stride);
      float* o = out + row * cols;
      std::fill_n(o, cols, 0.0f);
      if (L == -std::numeric_limits<float>::infinity()) continue;
      for (int p = 0; p < n; ++p) {
        const float l = lse[p * part_stride];
        if (l == -std::numeric_limits<float>::infinity()) continue;
        const float w = std::exp(l - L);
        const float* x = parts + p * part_stride + row * cols;
        for (int64_t c = 0; c < cols; ++c) o[c] += w * x[c];
      }
    }
  });
}

void rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows, int64_t cols) {
  parallel_for(rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const float L = combined_lse(lse_all + row, n, rows);
      const float l = lse[row];
      const float w = l == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(l - L);
      float* o = out + row * cols;
      for (int64_t c = 0; c < cols; ++c) o[c] *= w;
    }
  });
}

}  // namespace ml4::cpu
