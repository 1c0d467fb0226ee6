// Attention cores: see attention.h.
//
// mla_attention walks the gathered rows in blocks of kBlock and, for every head of the
// thread's share, updates an online softmax (FlashAttention: running max m, running
// sum l, output rescaled by exp(m_old - m_new) when the max grows). A block of c
// (kBlock x r f32, 64 KiB at r = 512) is thus read from memory once per thread and
// reused from cache by all its heads, instead of once per head: the logits as 2 heads x 2
// keys register tiles, P x C for 4 heads at a time (MLA's one latent row serves every head).
// Each head's result is bit for bit the head computed alone. Logits and the output are f32
// (AVX2 FMA dots); l is summed in f64; lse = m + log(l). The CPU runner calls it per token,
// for prefill chunks too, so a token's attention never depends on how its prompt was chunked.
#include "ops/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ML4_ATTN_AVX2 1
#endif

#include "core/threads.h"
#include "ops/cpu/linear_kernels.h"

namespace ml4::cpu {
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

// dot(a row, b row) for RM rows of a (lda apart) x RN rows of b (ldb apart), each in dot()'s
// exact order (two accumulators over 16-element steps, one 8-step more into the first,
// hsum8(acc0 + acc1), the scalar tail), so a tile gives every element's dot() bits while
// each loaded row serves RM or RN dots.
template <int RM, int RN>
inline void dot_tile_as_dot(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t n, float* y, int64_t ldy) {
#ifdef ML4_ATTN_AVX2
  using namespace kernels;
  Vec8 a0[RM][RN], a1[RM][RN];
  ML4_UNROLL for (int u = 0; u < RM; ++u) ML4_UNROLL for (int v = 0; v < RN; ++v) a0[u][v] = a1[u][v] = zero8();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Vec8 b0[RN], b1[RN];
    ML4_UNROLL for (int v = 0; v < RN; ++v) b0[v] = load8(b + v * ldb + i), b1[v] = load8(b + v * ldb + i + 8);
    ML4_UNROLL for (int u = 0; u < RM; ++u) {
      const Vec8 x0 = load8(a + u * lda + i), x1 = load8(a + u * lda + i + 8);
      ML4_UNROLL for (int v = 0; v < RN; ++v) a0[u][v] = fma8(x0, b0[v], a0[u][v]), a1[u][v] = fma8(x1, b1[v], a1[u][v]);
    }
  }
  for (; i + 8 <= n; i += 8)
    ML4_UNROLL for (int u = 0; u < RM; ++u) ML4_UNROLL for (int v = 0; v < RN; ++v)
      a0[u][v] = fma8(load8(a + u * lda + i), load8(b + v * ldb + i), a0[u][v]);
  for (int u = 0; u < RM; ++u)
    for (int v = 0; v < RN; ++v) {
      float t = hsum8(add8(a0[u][v], a1[u][v]));
      for (int64_t k = i; k < n; ++k) t = std::fma(a[u * lda + k], b[v * ldb + k], t);
      y[u * ldy + v] = t;
    }
#else
  for (int u = 0; u < RM; ++u)
    for (int v = 0; v < RN; ++v) y[u * ldy + v] = dot(a + u * lda, b + v * ldb, n);
#endif
}

// y[u * ldy + v] = dot(a row u, b row v) for u < rm, v < rn, in 2 x 2 tiles.
void dot_rows_as_dot(const float* a, int64_t lda, int64_t rm, const float* b, int64_t ldb, int64_t rn, int64_t n,
                     float* y, int64_t ldy) {
  for (int64_t u = 0; u < rm; u += 2)
    for (int64_t v = 0; v < rn; v += 2) {
      const float* au = a + u * lda;
      const float* bv = b + v * ldb;
      float* yuv = y + u * ldy + v;
      const bool two_a = u + 1 < rm, two_b = v + 1 < rn;
      if (two_a && two_b) dot_tile_as_dot<2, 2>(au, lda, bv, ldb, n, yuv, ldy);
      else if (two_a) dot_tile_as_dot<2, 1>(au, lda, bv, ldb, n, yuv, ldy);
      else if (two_b) dot_tile_as_dot<1, 2>(au, lda, bv, ldb, n, yuv, ldy);
      else dot_tile_as_dot<1, 1>(au, lda, bv, ldb, n, yuv, ldy);
    }
}

// o_q[i] = o_q[i] * alpha[q] + sum_j p[q][j] c[j][i] for the NQ (<= 4) rows o_q: each c row
// is loaded once for all of them. NQ is a template argument so the 2 x NQ accumulators stay
// in registers (a run-time row count kept them on the stack: 3x slower).
template <int NQ>
void scale_accumulate_rows_n(float* const* o, const float* alpha, const float* const* p, const float* c,
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
      const __m256 c0 = _mm256_loadu_ps(c + j * r + i), c1 = _mm256_loadu_ps(c + j * r + i + 8);
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
      for (int64_t j = 0; j < rows; ++j) acc = std::fma(p[q][j], c[j * r + i], acc);
      o[q][i] = acc;
    }
}

void scale_accumulate_rows(float* const* o, const float* alpha, const float* const* p, int nq, const float* c,
                           int64_t rows, int r) {
  switch (nq) {
    case 1: return scale_accumulate_rows_n<1>(o, alpha, p, c, rows, r);
    case 2: return scale_accumulate_rows_n<2>(o, alpha, p, c, rows, r);
    case 3: return scale_accumulate_rows_n<3>(o, alpha, p, c, rows, r);
    default: return scale_accumulate_rows_n<4>(o, alpha, p, c, rows, r);
  }
}

}  // namespace

void mla_attention(const float* q_lat, const float* q_rope, int H, int r, int dr, const float* c,
                   const float* kr, int64_t S, const float* head_scale, float* out_lat, float* lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // Split heads evenly over the threads: every thread then streams c once.
  const int64_t grain = std::max<int64_t>(1, (H + num_threads() - 1) / num_threads());
  parallel_for(H, grain, [&](int64_t h0, int64_t h1) {
    const int64_t nh = h1 - h0;
    std::vector<float> m(nh, kNegInf);
    std::vector<double> l(nh, 0.0);
    // Per block: every head's logits as 2 heads x 2 keys tiles (dot()'s bits), then the heads
    // that take mass accumulate 4 at a time, each c row loaded once for all 4. Every (head,
    // element) sees the same operations in the same order as one head alone.
    std::vector<float> pl(nh * kBlock), pr(nh * kBlock), alpha(nh);
    std::vector<float*> orow(nh);
    std::vector<const float*> prow(nh);
    for (int64_t h = h0; h < h1; ++h) std::fill(out_lat + h * r, out_lat + (h + 1) * r, 0.0f);
    for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
      const int64_t rows = std::min(kBlock, S - s0);
      const float* cb = c + s0 * r;
      const float* kb = kr + s0 * dr;
      dot_rows_as_dot(q_lat + h0 * r, r, nh, cb, r, rows, r, pl.data(), kBlock);
      dot_rows_as_dot(q_rope + h0 * dr, dr, nh, kb, dr, rows, dr, pr.data(), kBlock);
      int64_t active = 0;
      for (int64_t h = h0; h < h1; ++h) {
        float* p = pl.data() + (h - h0) * kBlock;
        const float* pq = pr.data() + (h - h0) * kBlock;
        float bmax = kNegInf;
        for (int64_t j = 0; j < rows; ++j) {
          p[j] = (p[j] + pq[j]) * head_scale[h];
          bmax = std::max(bmax, p[j]);
        }
        float& mh = m[h - h0];
        const float m_new = std::max(mh, bmax);
        if (m_new == kNegInf) continue;  // everything so far is -inf: nothing to add
        const float a = mh == kNegInf ? 0.0f : std::exp(mh - m_new);
        double bsum = 0.0;
        for (int64_t j = 0; j < rows; ++j) {
          p[j] = std::exp(p[j] - m_new);
          bsum += p[j];
        }
        l[h - h0] = l[h - h0] * a + bsum;
        mh = m_new;
        orow[active] = out_lat + h * r, prow[active] = p, alpha[active] = a;
        ++active;
      }
      for (int64_t k = 0; k < active; k += 4)
        scale_accumulate_rows(orow.data() + k, alpha.data() + k, prow.data() + k,
                              static_cast<int>(std::min<int64_t>(4, active - k)), cb, rows, r);
    }
    for (int64_t h = h0; h < h1; ++h) {
      const double lh = l[h - h0];
      float* o = out_lat + h * r;
      if (lh <= 0.0) {  // S == 0 (or all logits -inf): no mass
        std::fill(o, o + r, 0.0f);
        lse[h] = kNegInf;
        continue;
      }
      const float inv = static_cast<float>(1.0 / lh);
      for (int i = 0; i < r; ++i) o[i] *= inv;
      lse[h] = static_cast<float>(m[h - h0] + std::log(lh));
    }
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

void mla_absorb_q(const float* w_uk, const float* q, int64_t T, int H, int dn, int qk, int r, float* q_lat) {
#ifdef ML4_ATTN_AVX2
  if (T >= kTokTile && r % 16 == 0) {
    // Per head: 4 tokens x 16 columns of q_lat in 8 registers, one W_UK row read per d.
    const int64_t tiles = (T + kTokTile - 1) / kTokTile;
    parallel_for(H * tiles, 1, [&](int64_t b, int64_t e) {
      for (int64_t job = b; job < e; ++job) {
        const int64_t h = job % H, t0 = (job / H) * kTokTile, nt = std::min<int64_t>(kTokTile, T - t0);
        const float* wuk = w_uk + h * dn * r;
        const float* qn[kTokTile];
        float* ql[kTokTile];
        for (int64_t t = 0; t < kTokTile; ++t) {
          const int64_t tt = t0 + std::min<int64_t>(t, nt - 1);  // a short tile repeats its last token
          qn[t] = q + (tt * H + h) * qk;
          ql[t] = q_lat + (tt * H + h) * r;
        }
        for (int j = 0; j < r; j += 16) {
          float* qlj[kTokTile];
          for (int64_t t = 0; t < kTokTile; ++t) qlj[t] = ql[t] + j;
          fma_rows_x16(qn, wuk + j, r, dn, qlj, nt);
        }
      }
    });
    return;
  }
#endif
  parallel_for(T * H, 1, [&](int64_t b, int64_t e) {
    for (int64_t th = b; th < e; ++th) {
      const int64_t h = th % H;
      float* ql = q_lat + th * r;
      const float* qn = q + th * qk;
      const float* wuk = w_uk + h * dn * r;
      std::fill(ql, ql + r, 0.0f);
      for (int d = 0; d < dn; ++d) {
        const float qv = qn[d];
        const float* wr = wuk + static_cast<int64_t>(d) * r;
        int j = 0;
#ifdef ML4_ATTN_AVX2
        const __m256 qb = _mm256_set1_ps(qv);
        for (; j + 8 <= r; j += 8)
          _mm256_storeu_ps(ql + j, _mm256_fmadd_ps(qb, _mm256_loadu_ps(wr + j), _mm256_loadu_ps(ql + j)));
#endif
        for (; j < r; ++j) ql[j] = std::fma(qv, wr[j], ql[j]);
      }
    }
  });
}

void mla_apply_uv(const float* w_uv, const float* out_lat, int64_t T, int H, int dv, int r, float* o) {
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
        const float* wuv = w_uv + h * dv * r;
        for (int d = 0; d < dv; ++d)
          for (int j = 0; j < r; ++j) wt[static_cast<int64_t>(j) * dv + d] = wuv[static_cast<int64_t>(d) * r + j];
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
  parallel_for(T * H, 1, [&](int64_t b, int64_t e) {
    for (int64_t th = b; th < e; ++th) {
      const float* wuv = w_uv + (th % H) * dv * r;
      const float* ol = out_lat + th * r;
      float* oh = o + th * dv;
      int d = 0;
      // 8 outputs at once: 8 independent chains (one chain is FMA-latency bound), each still
      // summed in its own sequential order, so the result is the same as one at a time.
      for (; d + 8 <= dv; d += 8) {
        const float* w0 = wuv + static_cast<int64_t>(d) * r;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, a4 = 0.0f, a5 = 0.0f, a6 = 0.0f, a7 = 0.0f;
        for (int j = 0; j < r; ++j) {
          const float x = ol[j];
          a0 = std::fma(w0[j], x, a0);
          a1 = std::fma(w0[r + j], x, a1);
          a2 = std::fma(w0[2 * r + j], x, a2);
          a3 = std::fma(w0[3 * r + j], x, a3);
          a4 = std::fma(w0[4 * r + j], x, a4);
          a5 = std::fma(w0[5 * r + j], x, a5);
          a6 = std::fma(w0[6 * r + j], x, a6);
          a7 = std::fma(w0[7 * r + j], x, a7);
        }
        oh[d] = a0, oh[d + 1] = a1, oh[d + 2] = a2, oh[d + 3] = a3;
        oh[d + 4] = a4, oh[d + 5] = a5, oh[d + 6] = a6, oh[d + 7] = a7;
      }
      for (; d < dv; ++d) {
        const float* wr = wuv + static_cast<int64_t>(d) * r;
        float acc = 0.0f;
        for (int j = 0; j < r; ++j) acc = std::fma(wr[j], ol[j], acc);
        oh[d] = acc;
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
      for (int h = 0; h < HI; ++h) acc += w[h] * std::max(0.0f, dot(q + h * dI, ks, dI));
      scores[s] = acc;
    }
  });
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
