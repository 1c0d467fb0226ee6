// Inner kernels of cpu::linear (linear.cpp): the 8-lane vector type, the exact weight
// decoders, and the register-tiled dot kernels. Internal to src/ops/cpu.
//
// The order contract (what makes linear() batch invariant, tests/ops/linear_test.cpp):
// every output y[m, n] is computed as
//   acc (8 lanes) = 0;  for each 8-element step s of the vector part: acc = fma(X_s, W_s, acc)
//   y = hsum8(acc);     for each k of the tail, in order: y = fma(x_k, w_k, y)
// except bf16 and FP8. bf16 keeps two accumulators, one per half of each 16-element block
// (its lane order below), so a weight row is two independent FMA chains (one chain is
// latency bound at 2 FMAs per 32 bytes, ~28 GB/s on two cores, under the DRAM's rate):
//   acc_e = acc_o = 0;  for each 16-element block b: { acc_e = fma(X_b.even, W_b.even, acc_e);
//                                                     acc_o = fma(X_b.odd, W_b.odd, acc_o) }
//   y = hsum8(acc_e + acc_o);   then the tail as above.
// FP8's vector part is summed per 128-wide scale block b (DeepSeek's FP8 GEMM order, also
// the CUDA backend's), each block as two chains, its even and its odd 8-element steps
// (counted from the block's start):
//   ae = ao = 0; for each block b: { be = bo = 0; for its steps s: (s even ? be : bo) =
//                                      fma(X_s, Q_s, ·);
//                                    ae = fma(be, 256 s_b, ae); ao = fma(bo, 256 s_b, ao) }
//   y = hsum8(ae + ao); then the tail as above
// with Q_s = e4m3 * 2^-8 exactly (F16C decodes e4m3 as an f16 that is 2^-8 times its
// value) and the tail's w_k = e4m3 * s rounded once. Folding the scale per block saves a
// multiply per weight (the FP8 GEMV is bound by decode, not by memory); each x_k q_k is
// still exact inside its FMA, so the error bound is unchanged. The two chains are what one
// 16-lane AVX-512 accumulator holds (lanes 0-7 the even steps, 8-15 the odd), so the
// AVX-512 kernels (chosen at run time) give the AVX2 kernels' bits with one register per
// output and block.
// where the vector part is [0, kv) and the tail [kv, K). X_s / W_s are 8 consecutive
// elements in the format's lane order:
//   f32, FP8, NVFP4, MXFP4: natural order, kv = 8 * floor(K / 8) (the FP8 GEMM path stores
//     each block's even steps before its odd ones: permute_fp8_halves);
//   bf16: within each 16-element block, first the 8 even then the 8 odd elements, kv =
//     16 * floor(K / 16). This is the order in which AVX2 splits 16 bf16 (one 256-bit load)
//     into two f32 vectors with one AND and one shift, with no cross-lane shuffle.
// Every path (the direct GEMV on stored weights, the GEMM on decoded tiles, any M, any
// thread split) follows it, so a row's result never depends on the batch around it.
// Without AVX2 the same arithmetic runs on an emulated vector, so results are identical.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/e4m3_simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ML4_LINEAR_AVX2 1
#endif

namespace ml4::cpu::kernels {

// ---------------------------------------------------------------------------------------
// Vec8: 8 f32 lanes.
#ifdef ML4_LINEAR_AVX2
struct Vec8 {
  __m256 v;
};
inline Vec8 zero8() { return {_mm256_setzero_ps()}; }
inline Vec8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store8(float* p, Vec8 a) { _mm256_storeu_ps(p, a.v); }
inline Vec8 fma8(Vec8 a, Vec8 b, Vec8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec8 add8(Vec8 a, Vec8 b) { return {_mm256_add_ps(a.v, b.v)}; }
// ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))
inline float hsum8(Vec8 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
struct Vec8 {
  float v[8];
};
inline Vec8 zero8() { return Vec8{}; }
inline Vec8 load8(const float* p) {
  Vec8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i];
  return r;
}
inline void store8(float* p, Vec8 a) {
  for (int i = 0; i < 8; ++i) p[i] = a.v[i];
}
inline Vec8 fma8(Vec8 a, Vec8 b, Vec8 c) {
  for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline Vec8 add8(Vec8 a, Vec8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline float hsum8(Vec8 a) {
  float t[4];
  for (int i = 0; i < 4; ++i) t[i] = a.v[i] + a.v[i + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}
#endif

#define ML4_UNROLL _Pragma("GCC unroll 16")

// ---------------------------------------------------------------------------------------
// acc[i][j] = 0, then acc[i][j] = fma(x row i [k..k+8), w row j [k..k+8), acc[i][j]) for
// k = k0, k0 + 8, ... < k1: the register tile every f32 dot below is made of.
template <int RM, int RN>
inline void fma_steps(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k0, int64_t k1,
                      Vec8 (&acc)[RM][RN]) {
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) acc[i][j] = zero8();
  for (int64_t k = k0; k < k1; k += 8) {
    Vec8 wv[RN];
    ML4_UNROLL for (int j = 0; j < RN; ++j) wv[j] = load8(w + j * ldw + k);
    ML4_UNROLL for (int i = 0; i < RM; ++i) {
      const Vec8 xv = load8(x + i * ldx + k);
      ML4_UNROLL for (int j = 0; j < RN; ++j) acc[i][j] = fma8(xv, wv[j], acc[i][j]);
    }
  }
}

// f32 dot tile: y[i*ldy + j] = dot(x row i, w row j) for i < RM, j < RN, by the contract
// with vector part [0, kv) (x and w already in lane order there) and tail [kv, K).
template <int RM, int RN>
inline void dot_tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kv, int64_t K, float* y,
                         int64_t ldy) {
  Vec8 acc[RM][RN];
  fma_steps<RM, RN>(x, ldx, w, ldw, 0, kv, acc);
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float s = hsum8(acc[i][j]);
      for (int64_t k = kv; k < K; ++k) s = std::fma(x[i * ldx + k], w[j * ldw + k], s);
      y[i * ldy + j] = s;
    }
}

// The same over bf16 rows decoded to f32 in halves order (the GEMM path; see
// decode_bf16_halves): [0, kv/2) the even halves of the 16-blocks in block order, [kv/2, kv)
// the odd halves, then the tail. x is in the same order (permute_bf16_halves). One pass per
// half keeps the register tile at RM x RN and reads each half once.
template <int RM, int RN>
inline void dot_tile_f32_pairs(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kv, int64_t K,
                               float* y, int64_t ldy) {
  const int64_t h = kv / 2;
  alignas(32) float even[RM][RN][8];
  Vec8 acc[RM][RN];
  fma_steps<RM, RN>(x, ldx, w, ldw, 0, h, acc);
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) store8(even[i][j], acc[i][j]);
  fma_steps<RM, RN>(x, ldx, w, ldw, h, kv, acc);
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float s = hsum8(add8(load8(even[i][j]), acc[i][j]));
      for (int64_t k = kv; k < K; ++k) s = std::fma(x[i * ldx + k], w[j * ldw + k], s);
      y[i * ldy + j] = s;
    }
}

// ---------------------------------------------------------------------------------------
// bf16 direct tile on stored weights (GEMV, small M). x is in bf16 lane order (see
// permute_bf16_order); w rows are the stored bf16 rows.
inline float bf16_scalar(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

#ifdef ML4_LINEAR_AVX2
// 16 bf16 -> (even elements, odd elements) as f32, exactly.
inline void bf16x16_split(const uint16_t* p, Vec8& even, Vec8& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even.v = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd.v = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#else
inline void bf16x16_split(const uint16_t* p, Vec8& even, Vec8& odd) {
  for (int i = 0; i < 8; ++i) {
    even.v[i] = bf16_scalar(p[2 * i]);
    odd.v[i] = bf16_scalar(p[2 * i + 1]);
  }
}
#endif

// RM x RN x 2 accumulators: linear() uses 1 x 1 (M = 1) and 1 x 4 (M = 2..4).
template <int RM, int RN>
inline void dot_tile_bf16(const float* xp, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t kv, int64_t K,
                          float* y, int64_t ldy) {
  Vec8 ae[RM][RN], ao[RM][RN];
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) ae[i][j] = ao[i][j] = zero8();
  for (int64_t k = 0; k < kv; k += 16) {
    Vec8 we[RN], wo[RN];
    ML4_UNROLL for (int j = 0; j < RN; ++j) bf16x16_split(w + j * ldw + k, we[j], wo[j]);
    ML4_UNROLL for (int i = 0; i < RM; ++i) {
      const Vec8 xe = load8(xp + i * ldx + k);
      ML4_UNROLL for (int j = 0; j < RN; ++j) ae[i][j] = fma8(xe, we[j], ae[i][j]);
    }
    ML4_UNROLL for (int i = 0; i < RM; ++i) {
      const Vec8 xo = load8(xp + i * ldx + k + 8);
      ML4_UNROLL for (int j = 0; j < RN; ++j) ao[i][j] = fma8(xo, wo[j], ao[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float s = hsum8(add8(ae[i][j], ao[i][j]));
      for (int64_t k = kv; k < K; ++k) s = std::fma(xp[i * ldx + k], bf16_scalar(w[j * ldw + k]), s);
      y[i * ldy + j] = s;
    }
}

// src [K] natural -> dst [K] in bf16 lane order (16-blocks as evens then odds; tail as is).
inline void permute_bf16_order(const float* src, int64_t K, float* dst) {
  const int64_t kv = K / 16 * 16;
  for (int64_t b = 0; b < kv; b += 16)
    for (int i = 0; i < 8; ++i) {
      dst[b + i] = src[b + 2 * i];
      dst[b + 8 + i] = src[b + 2 * i + 1];
    }
  for (int64_t k = kv; k < K; ++k) dst[k] = src[k];
}

// src [K] natural -> dst [K] in halves order: the even elements of every 16-block in block
// order, then the odd ones, then the tail as is (the bf16 GEMM path's order).
inline void permute_bf16_halves(const float* src, int64_t K, float* dst) {
  const int64_t kv = K / 16 * 16, h = kv / 2;
  for (int64_t b = 0; b < kv; b += 16)
    for (int i = 0; i < 8; ++i) {
      dst[b / 2 + i] = src[b + 2 * i];
      dst[h + b / 2 + i] = src[b + 2 * i + 1];
    }
  for (int64_t k = kv; k < K; ++k) dst[k] = src[k];
}

// bf16 row -> f32 in halves order (exactly).
inline void decode_bf16_halves(const uint16_t* src, int64_t K, float* dst) {
  const int64_t kv = K / 16 * 16, h = kv / 2;
  for (int64_t b = 0; b < kv; b += 16) {
    Vec8 e, o;
    bf16x16_split(src + b, e, o);
    store8(dst + b / 2, e);
    store8(dst + h + b / 2, o);
  }
  for (int64_t k = kv; k < K; ++k) dst[k] = bf16_scalar(src[k]);
}

// ---------------------------------------------------------------------------------------
// FP8 e4m3 (see the contract above for the order).
#ifdef ML4_LINEAR_AVX2
// The e4m3 decode (core/e4m3_simd.h): 2^-8 times the codes' values, exactly.
using simd::e4m3x16_to_f16;
using simd::e4m3x8_to_f16;
using simd::e4m3x8_div256;
using simd::probe_has_nan;
inline Vec8 f16x8(__m128i h) { return {_mm256_cvtph_ps(h)}; }
inline Vec8 set8(float v) { return {_mm256_set1_ps(v)}; }
#else
inline Vec8 set8(float v) {
  Vec8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = v;
  return r;
}
#endif

// The FP8 GEMM path's order: within each 128-block of the vector part, the even 8-element
// steps (counted from the block's start) in order, then the odd ones; the tail as is.
// Position of step s of a block of S steps: even s at s / 2, odd s at (S + 1) / 2 + s / 2.
inline int64_t fp8_halves_step(int64_t s, int64_t S) { return (s % 2 == 0) ? s / 2 : (S + 1) / 2 + s / 2; }

// src [K] natural -> dst [K] in the FP8 GEMM path's order.
inline void permute_fp8_halves(const float* src, int64_t K, float* dst) {
  const int64_t kv = K / 8 * 8;
  for (int64_t b0 = 0; b0 < kv; b0 += 128) {
    const int64_t S = (std::min<int64_t>(b0 + 128, kv) - b0) / 8;
    for (int64_t s = 0; s < S; ++s)
      for (int i = 0; i < 8; ++i) dst[b0 + 8 * fp8_halves_step(s, S) + i] = src[b0 + 8 * s + i];
  }
  for (int64_t k = kv; k < K; ++k) dst[k] = src[k];
}


// Decodes one stored FP8 row for the GEMM path, in its order: [0, kv) as e4m3 * 2^-8 (exact;
// NaN codes NaN), [kv, K) as e4m3 * s rounded once (lut: the e4m3 table, srow: the row's
// scales).
inline void decode_fp8_gemm_row(const uint8_t* q, int64_t K, const float* srow, const float* lut, float* out) {
  const int64_t kv = K / 8 * 8;
  for (int64_t b0 = 0; b0 < kv; b0 += 128) {
    const int64_t S = (std::min<int64_t>(b0 + 128, kv) - b0) / 8;
    for (int64_t s = 0; s < S; ++s) {
      const uint8_t* qs = q + b0 + 8 * s;
      float* o = out + b0 + 8 * fp8_halves_step(s, S);
#ifdef ML4_LINEAR_AVX2
      _mm256_storeu_ps(o, e4m3x8_div256(qs));
#else
      for (int i = 0; i < 8; ++i) o[i] = lut[qs[i]] * 0x1p-8f;
#endif
    }
  }
  for (int64_t k = kv; k < K; ++k) out[k] = lut[q[k]] * srow[k / 128];
}

// GEMM tile on rows decoded by decode_fp8_gemm_row, x in the same order
// (permute_fp8_halves). s256[j]: row j's scale row, times 256.
template <int RM, int RN>
inline void dot_tile_fp8_decoded(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* const* s256,
                                 int64_t K, float* y, int64_t ldy) {
  const int64_t kv = K / 8 * 8;
  Vec8 ae[RM][RN], ao[RM][RN];
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) ae[i][j] = ao[i][j] = zero8();
  for (int64_t b0 = 0; b0 < kv; b0 += 128) {
    const int64_t b1 = b0 + 128 < kv ? b0 + 128 : kv;
    const int64_t h = b0 + 8 * (((b1 - b0) / 8 + 1) / 2);  // end of the even steps
    Vec8 blk[RM][RN];
    fma_steps<RM, RN>(x, ldx, w, ldw, b0, h, blk);
    ML4_UNROLL for (int j = 0; j < RN; ++j) {
      const Vec8 sv = set8(s256[j][b0 / 128]);
      ML4_UNROLL for (int i = 0; i < RM; ++i) ae[i][j] = fma8(blk[i][j], sv, ae[i][j]);
    }
    fma_steps<RM, RN>(x, ldx, w, ldw, h, b1, blk);
    ML4_UNROLL for (int j = 0; j < RN; ++j) {
      const Vec8 sv = set8(s256[j][b0 / 128]);
      ML4_UNROLL for (int i = 0; i < RM; ++i) ao[i][j] = fma8(blk[i][j], sv, ao[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float s = hsum8(add8(ae[i][j], ao[i][j]));
      for (int64_t k = kv; k < K; ++k) s = std::fma(x[i * ldx + k], w[j * ldw + k], s);
      y[i * ldy + j] = s;
    }
}

// FP8 direct tile (GEMV, small M) on the stored rows: RN rows of one 128-row scale group
// (srow: its scale row; s256: the same times 256). Returns false when a weight byte is a
// NaN code; the caller then recomputes the tile through decode_fp8_gemm_row, which makes it
// NaN as e4m3 defines (same order, so the result is the GEMM path's).
template <int RM, int RN>
inline bool dot_tile_fp8(const float* x, int64_t ldx, const uint8_t* q, int64_t ldq, const float* srow,
                         const float* s256, const float* lut, int64_t K, float* y, int64_t ldy) {
  const int64_t kv = K / 8 * 8;
  Vec8 ae[RM][RN], ao[RM][RN];
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) ae[i][j] = ao[i][j] = zero8();
#ifdef ML4_LINEAR_AVX2
  __m128i probe = _mm_setzero_si128();
#endif
  for (int64_t b0 = 0; b0 < kv; b0 += 128) {
    const int64_t b1 = b0 + 128 < kv ? b0 + 128 : kv;
    Vec8 be[RM][RN], bo[RM][RN];  // the block's even and odd steps
    ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) be[i][j] = bo[i][j] = zero8();
    int64_t k = b0;
#ifdef ML4_LINEAR_AVX2
    for (; k + 16 <= b1; k += 16) {
      Vec8 w0[RN], w1[RN];
      ML4_UNROLL for (int j = 0; j < RN; ++j) {
        __m128i lo, hi;
        e4m3x16_to_f16(q + j * ldq + k, lo, hi, probe);
        w0[j] = f16x8(lo);
        w1[j] = f16x8(hi);
      }
      ML4_UNROLL for (int i = 0; i < RM; ++i) {
        const Vec8 xv = load8(x + i * ldx + k);
        ML4_UNROLL for (int j = 0; j < RN; ++j) be[i][j] = fma8(xv, w0[j], be[i][j]);
      }
      ML4_UNROLL for (int i = 0; i < RM; ++i) {
        const Vec8 xv = load8(x + i * ldx + k + 8);
        ML4_UNROLL for (int j = 0; j < RN; ++j) bo[i][j] = fma8(xv, w1[j], bo[i][j]);
      }
    }
    if (k < b1) {  // one even step left (a block of an odd number of steps)
      Vec8 w0[RN];
      ML4_UNROLL for (int j = 0; j < RN; ++j) w0[j] = f16x8(e4m3x8_to_f16(q + j * ldq + k, probe));
      ML4_UNROLL for (int i = 0; i < RM; ++i) {
        const Vec8 xv = load8(x + i * ldx + k);
        ML4_UNROLL for (int j = 0; j < RN; ++j) be[i][j] = fma8(xv, w0[j], be[i][j]);
      }
    }
#else
    for (; k < b1; k += 8) {
      Vec8 w0[RN];
      for (int j = 0; j < RN; ++j)
        for (int l = 0; l < 8; ++l) w0[j].v[l] = lut[q[j * ldq + k + l]] * 0x1p-8f;
      const bool even = (k - b0) / 8 % 2 == 0;
      for (int i = 0; i < RM; ++i) {
        const Vec8 xv = load8(x + i * ldx + k);
        for (int j = 0; j < RN; ++j) {
          Vec8& a = even ? be[i][j] : bo[i][j];
          a = fma8(xv, w0[j], a);
        }
      }
    }
#endif
    const Vec8 sv = set8(s256[b0 / 128]);
    ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) {
      ae[i][j] = fma8(be[i][j], sv, ae[i][j]);
      ao[i][j] = fma8(bo[i][j], sv, ao[i][j]);
    }
  }
#ifdef ML4_LINEAR_AVX2
  if (probe_has_nan(probe)) return false;
#endif
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float s = hsum8(add8(ae[i][j], ao[i][j]));
      for (int64_t k = kv; k < K; ++k) s = std::fma(x[i * ldx + k], lut[q[j * ldq + k]] * srow[k / 128], s);
      y[i * ldy + j] = s;
    }
  return true;
}

// ---------------------------------------------------------------------------------------
// AVX-512 (compiled for it whatever the build's baseline, used only where the CPU has it:
// linear.cpp asks avx512_usable()). The same arithmetic as the AVX2 tiles above, so every
// result bit is the same; tests/ops/linear_test.cpp checks both paths against each other.
#if defined(ML4_LINEAR_AVX2) && defined(__GNUC__) && defined(__x86_64__)
#define ML4_LINEAR_AVX512 1
#define ML4_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

inline bool avx512_usable() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

// 16 e4m3 bytes -> f32 v / 256 (exact; the f16 trick below, 16 at a time), the magnitudes
// max-ed into probe (a NaN code shows as 0x7f; has_nan_code tells). The MLA absorb kernels'
// decode (attention.cpp).
ML4_AVX512_FN inline __m512 e4m3x16_div256(const uint8_t* p, __m128i& probe) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  probe = _mm_max_epu8(probe, _mm_and_si128(b, _mm_set1_epi8(0x7f)));
  return _mm512_cvtph_ps(
      _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(static_cast<short>(0xbfff))));
}
// 32 e4m3 codes -> two 16-lane f32 vectors of 2^-8 times their values (codes 0-15, 16-31) by
// sign extension (sign at bits 15 and 14, magnitude at 13..7 after << 7; clearing bit 14 leaves
// sign << 15 | magnitude << 7, the f16 that is 2^-8 times the code's value); `probe` collects
// max |code| (0x7f: a NaN code).
ML4_AVX512_FN __attribute__((always_inline)) inline void e4m3x32_div256(const uint8_t* p, __m256i& probe, __m512& w0, __m512& w1) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  probe = _mm256_max_epu8(probe, _mm256_and_si256(b, _mm256_set1_epi8(0x7f)));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                                     _mm512_set1_epi16(static_cast<short>(0xbfff)));
  w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
ML4_AVX512_FN inline bool has_nan_code(__m128i probe) {
  return _mm_movemask_epi8(_mm_cmpeq_epi8(probe, _mm_set1_epi8(0x7f))) != 0;
}

// FP8 GEMV: RM activation rows (1..4, ldx apart) x one weight row (dot_tile_fp8<RM, 1>'s
// result; y[i * ldy]). 32 weights per step, decoded once for all RM rows (e4m3x32_div256), one
// 16-lane accumulator per block and activation row (lanes 0-7: the block's even 8-steps, 8-15: its
// odd ones). One row at a time keeps one sequential weight stream per thread. Returns false
// when a weight byte is a NaN code (the caller takes the exact path).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own _mm512 extract helpers
#pragma GCC diagnostic ignored "-Wuninitialized"
template <int RM>
ML4_AVX512_FN inline bool dot_row_fp8_avx512(const float* x, int64_t ldx, const uint8_t* q, const float* srow,
                                             const float* s256, const float* lut, int64_t K, float* y, int64_t ldy) {
  const int64_t kv = K / 8 * 8;
  const __m512i keep = _mm512_set1_epi16(static_cast<short>(0xbfff));
  const __m256i m7f = _mm256_set1_epi8(0x7f);
  __m512 acc[RM];  // lanes 0-7: ae, 8-15: ao
  ML4_UNROLL for (int i = 0; i < RM; ++i) acc[i] = _mm512_setzero_ps();
  __m256i probe = _mm256_setzero_si256();
  for (int64_t b0 = 0; b0 < kv; b0 += 128) {
    const int64_t b1 = b0 + 128 < kv ? b0 + 128 : kv;
    __m512 blk[RM];
    ML4_UNROLL for (int i = 0; i < RM; ++i) blk[i] = _mm512_setzero_ps();
    int64_t k = b0;
    for (; k + 32 <= b1; k += 32) {
      __m512 w0, w1;
      e4m3x32_div256(q + k, probe, w0, w1);
      ML4_UNROLL for (int i = 0; i < RM; ++i) blk[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k), w0, blk[i]);
      ML4_UNROLL for (int i = 0; i < RM; ++i) blk[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k + 16), w1, blk[i]);
    }
    if (k + 16 <= b1) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
      probe = _mm256_max_epu8(probe, _mm256_and_si256(_mm256_zextsi128_si256(b), m7f));
      const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm512_castsi512_si256(keep));
      const __m512 w0 = _mm512_cvtph_ps(h);
      ML4_UNROLL for (int i = 0; i < RM; ++i) blk[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k), w0, blk[i]);
      k += 16;
    }
    if (k < b1) {  // one even step left
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
      probe = _mm256_max_epu8(probe, _mm256_and_si256(_mm256_zextsi128_si256(b), m7f));
      const __m256 w0 = _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm512_castsi512_si128(keep)));
      ML4_UNROLL for (int i = 0; i < RM; ++i) {
        const __m256 lo = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), w0, _mm512_castps512_ps256(blk[i]));
        blk[i] = _mm512_insertf32x8(blk[i], lo, 0);
      }
    }
    const __m512 sv = _mm512_set1_ps(s256[b0 / 128]);
    ML4_UNROLL for (int i = 0; i < RM; ++i) acc[i] = _mm512_fmadd_ps(blk[i], sv, acc[i]);
  }
  if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(probe, m7f)) != 0) return false;
  for (int i = 0; i < RM; ++i) {
    float s = hsum8(Vec8{_mm256_add_ps(_mm512_castps512_ps256(acc[i]), _mm512_extractf32x8_ps(acc[i], 1))});
    for (int64_t k = kv; k < K; ++k) s = std::fma(x[i * ldx + k], lut[q[k]] * srow[k / 128], s);
    y[i * ldy] = s;
  }
  return true;
}

// dot_row_fp8_avx512<1> for RN weight rows at once (rows q + j * K, one scale group: s256),
// each row's operations exactly that kernel's (same bits per row); interleaving the RN
// independent FMA chains hides their latency where K is short (rows of a small K are
// adjacent, so this is still one sequential stream). Needs K % 32 == 0. ok[j]: row j had no
// NaN code (else the caller takes the exact path for it).
template <int RN>
ML4_AVX512_FN inline void dot_rows_fp8_avx512_m1(const float* x, const uint8_t* q, const float* s256, int64_t K,
                                                 float* y, bool* ok) {
  const __m256i m7f = _mm256_set1_epi8(0x7f);
  __m512 acc[RN];
  __m256i probe[RN];
  ML4_UNROLL for (int j = 0; j < RN; ++j) acc[j] = _mm512_setzero_ps(), probe[j] = _mm256_setzero_si256();
  for (int64_t b0 = 0; b0 < K; b0 += 128) {
    const int64_t b1 = b0 + 128 < K ? b0 + 128 : K;
    __m512 blk[RN];
    ML4_UNROLL for (int j = 0; j < RN; ++j) blk[j] = _mm512_setzero_ps();
    for (int64_t k = b0; k < b1; k += 32) {
      const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
      ML4_UNROLL for (int j = 0; j < RN; ++j) {
        __m512 w0, w1;
        e4m3x32_div256(q + j * K + k, probe[j], w0, w1);
        blk[j] = _mm512_fmadd_ps(x0, w0, blk[j]);
        blk[j] = _mm512_fmadd_ps(x1, w1, blk[j]);
      }
    }
    const __m512 sv = _mm512_set1_ps(s256[b0 / 128]);
    ML4_UNROLL for (int j = 0; j < RN; ++j) acc[j] = _mm512_fmadd_ps(blk[j], sv, acc[j]);
  }
  ML4_UNROLL for (int j = 0; j < RN; ++j) {
    ok[j] = _mm256_movemask_epi8(_mm256_cmpeq_epi8(probe[j], m7f)) == 0;
    y[j] = hsum8(Vec8{_mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1))});
  }
}

#pragma GCC diagnostic pop
#endif

}  // namespace ml4::cpu::kernels
