// Kernels of linear()'s bf16-activation mode (linear.h ActivationDtype::kBF16; vLLM's
// `--dtype bfloat16`): x rounded to bf16, products with bf16 or FP8 weights summed in f32 by
// AVX512_BF16 dot products (vdpbf16ps), 32 products per instruction where the f32 path does 16
// (and FP8 decodes to bf16 with two byte lookups instead of F16C). Compiled for AVX-512 whatever
// the build's baseline; used only where the CPU has AVX512_BF16 and AVX512_VBMI
// (bf16dot_usable()).
//
// Order contract (tests/ops/linear_bf16dot_test.cpp checks the kernels bit for bit against a
// scalar model of it):
//   x_b = bf16(x): round to nearest even, a subnormal x becomes a signed zero (vcvtneps2bf16).
//   One vdpbf16ps on lane l (0..15) of an f32 accumulator A with word pairs (a, b):
//     A = ftz(fma(a[2l+1], b[2l+1], daz(A))); A = ftz(fma(a[2l], b[2l], A)), subnormal inputs
//     read as zero (measured on Zen 4 over 3.2M random lanes with subnormals in every role:
//     the SDM's definition, products exact, two roundings).
//   bf16 weights: K in steps of 32 (the last zero-padded), one accumulator per output over the
//     steps in order, word 2l / 2l+1 of a step its elements 2l / 2l+1; y = hsum16(A).
//   FP8 weights: each e4m3 value exactly as a bf16 (no scale); K in chunks of 64 (the last
//     zero-padded), a chunk's elements 16L + i (L = 0..3) in vector a (i < 8, word 8L + i) or
//     vector b (i >= 8, word 8L + i - 8) — the byte interleave of vpunpck{l,h}bw. Per
//     128-block: blk = 0, then for its chunks in order dp(blk, a), dp(blk, b); then
//     acc = fma(blk, scale, acc) (plain f32). y = hsum16(acc). NaN codes are NaN.
//   hsum16(v) = hsum8(v[0:8] + v[8:16]) (linear_kernels.h's tree).
#pragma once

#include <cstdint>

#include "ops/cpu/linear_kernels.h"

#if defined(ML4_LINEAR_AVX512)
#define ML4_LINEAR_BF16DOT 1
#define ML4_BF16DOT_FN \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c")))

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own _mm512 helpers
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace ml4::cpu::kernels {

inline bool bf16dot_usable() {
  static const bool ok =
      avx512_usable() && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
  return ok;
}

// x [K] -> bf16 [Kp] (see the contract), zero from K to Kp (Kp a multiple of 16).
ML4_BF16DOT_FN inline void x_to_bf16(const float* x, int64_t K, int64_t Kp, uint16_t* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k)));
    k += 16;
  }
  for (; k < Kp; k += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_setzero_si256());
}

// The FP8 chunk order on x: x_b [Kp] (Kp a multiple of 64) -> per chunk its a words then its
// b words.
ML4_BF16DOT_FN inline void permute_fp8_chunks(const uint16_t* xb, int64_t Kp, uint16_t* out) {
  alignas(64) static constexpr uint16_t kA[32] = {0,  1,  2,  3,  4,  5,  6,  7,  16, 17, 18, 19, 20, 21, 22, 23,
                                                  32, 33, 34, 35, 36, 37, 38, 39, 48, 49, 50, 51, 52, 53, 54, 55};
  const __m512i ia = _mm512_load_si512(kA), ib = _mm512_add_epi16(ia, _mm512_set1_epi16(8));
  for (int64_t c = 0; c < Kp; c += 64) {  // a: words 16L + 0..7, b: 16L + 8..15 of the chunk
    const __m512i lo = _mm512_loadu_si512(xb + c), hi = _mm512_loadu_si512(xb + c + 32);
    _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(lo, ia, hi));
    _mm512_storeu_si512(out + c + 32, _mm512_permutex2var_epi16(lo, ib, hi));
  }
}

ML4_BF16DOT_FN inline float hsum16(__m512 v) {
  return hsum8(Vec8{_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))});
}

ML4_BF16DOT_FN inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// bf16 weights: y[i * ldy + j] for RM activation rows (xb, ldx apart, zero-padded to a
// multiple of 32) x RN weight rows (w, ldw apart, K elements each).
template <int RM, int RN>
ML4_BF16DOT_FN inline void dot_tile_bf16dot(const uint16_t* xb, int64_t ldx, const uint16_t* w, int64_t ldw,
                                             int64_t K, float* y, int64_t ldy) {
  __m512 acc[RM][RN];
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[RN];
    ML4_UNROLL for (int j = 0; j < RN; ++j) wv[j] = _mm512_loadu_si512(w + j * ldw + k);
    ML4_UNROLL for (int i = 0; i < RM; ++i) {
      const __m512i xv = _mm512_loadu_si512(xb + i * ldx + k);
      ML4_UNROLL for (int j = 0; j < RN; ++j) acc[i][j] = dp(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512i wv[RN];
    ML4_UNROLL for (int j = 0; j < RN; ++j) wv[j] = _mm512_maskz_loadu_epi16(m, w + j * ldw + k);
    ML4_UNROLL for (int i = 0; i < RM; ++i) {
      const __m512i xv = _mm512_loadu_si512(xb + i * ldx + k);
      ML4_UNROLL for (int j = 0; j < RN; ++j) acc[i][j] = dp(acc[i][j], xv, wv[j]);
    }
  }
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) y[i * ldy + j] = hsum16(acc[i][j]);
}

// e4m3 magnitude (0..127) -> the low and high bytes of its value as bf16 (0x7f: NaN), as the
// four 64-byte tables vpermi2b reads.
struct E4m3Bf16Tables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
};
const E4m3Bf16Tables& e4m3_bf16_tables();

// 64 e4m3 bytes (the first n, the rest read as 0) -> vectors a and b of the chunk order.
ML4_BF16DOT_FN inline void e4m3x64_bf16(const uint8_t* q, int64_t n, const E4m3Bf16Tables& t, __m512i& a,
                                        __m512i& b) {
  const __m512i v = n >= 64 ? _mm512_loadu_si512(q) : _mm512_maskz_loadu_epi8((1ull << n) - 1, q);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), v, _mm512_load_si512(t.lo + 64));
  const __m512i hi = _mm512_ternarylogic_epi32(
      _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), v, _mm512_load_si512(t.hi + 64)), v,
      _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // hi | (v & 0x80): the sign
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// FP8 weights read directly: RM activation rows (xp: x_b in the chunk order, ldx apart, Kp
// = K rounded up to 64) x one weight row q (K bytes; srow its scale row).
template <int RM>
ML4_BF16DOT_FN inline void dot_row_fp8_bf16dot(const uint16_t* xp, int64_t ldx, const uint8_t* q, const float* srow,
                                               int64_t K, const E4m3Bf16Tables& t, float* y, int64_t ldy) {
  __m512 acc[RM];
  ML4_UNROLL for (int i = 0; i < RM; ++i) acc[i] = _mm512_setzero_ps();
  int64_t b0 = 0;
  // Two whole blocks at a time, their chains interleaved (one block's four dependent dot
  // products are latency bound), folded into acc in block order as below.
  for (; b0 + 256 <= K; b0 += 256) {
    __m512 blk[2][RM];
    ML4_UNROLL for (int g = 0; g < 2; ++g) ML4_UNROLL for (int i = 0; i < RM; ++i) blk[g][i] = _mm512_setzero_ps();
    ML4_UNROLL for (int c = 0; c < 128; c += 64) {
      __m512i a[2], b[2];
      ML4_UNROLL for (int g = 0; g < 2; ++g) e4m3x64_bf16(q + b0 + 128 * g + c, 64, t, a[g], b[g]);
      ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int g = 0; g < 2; ++g) {
        const uint16_t* xc = xp + i * ldx + b0 + 128 * g + c;
        blk[g][i] = dp(blk[g][i], _mm512_loadu_si512(xc), a[g]);
      }
      ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int g = 0; g < 2; ++g) {
        const uint16_t* xc = xp + i * ldx + b0 + 128 * g + c;
        blk[g][i] = dp(blk[g][i], _mm512_loadu_si512(xc + 32), b[g]);
      }
    }
    ML4_UNROLL for (int g = 0; g < 2; ++g) {
      const __m512 sv = _mm512_set1_ps(srow[b0 / 128 + g]);
      ML4_UNROLL for (int i = 0; i < RM; ++i) acc[i] = _mm512_fmadd_ps(blk[g][i], sv, acc[i]);
    }
  }
  for (; b0 < K; b0 += 128) {
    __m512 blk[RM];
    ML4_UNROLL for (int i = 0; i < RM; ++i) blk[i] = _mm512_setzero_ps();
    for (int64_t c = b0; c < b0 + 128 && c < K; c += 64) {
      __m512i a, b;
      e4m3x64_bf16(q + c, K - c, t, a, b);
      ML4_UNROLL for (int i = 0; i < RM; ++i) {
        blk[i] = dp(blk[i], _mm512_loadu_si512(xp + i * ldx + c), a);
        blk[i] = dp(blk[i], _mm512_loadu_si512(xp + i * ldx + c + 32), b);
      }
    }
    const __m512 sv = _mm512_set1_ps(srow[b0 / 128]);
    ML4_UNROLL for (int i = 0; i < RM; ++i) acc[i] = _mm512_fmadd_ps(blk[i], sv, acc[i]);
  }
  ML4_UNROLL for (int i = 0; i < RM; ++i) y[i * ldy] = hsum16(acc[i]);
}

// FP8 rows decoded once (e4m3x64_bf16's a and b words per chunk, Kp words a row, ldw apart):
// RM activation rows x RN weight rows; srows[j]: row j's scale row.
template <int RM, int RN>
ML4_BF16DOT_FN inline void dot_tile_fp8_bf16dot(const uint16_t* xp, int64_t ldx, const uint16_t* w, int64_t ldw,
                                                const float* const* srows, int64_t K, float* y, int64_t ldy) {
  __m512 acc[RM][RN];
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < K; b0 += 128) {
    __m512 blk[RM][RN];
    ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) blk[i][j] = _mm512_setzero_ps();
    for (int64_t c = b0; c < b0 + 128 && c < K; c += 64)
      for (int64_t h = c; h < c + 64; h += 32) {  // the chunk's a words, then its b words
        __m512i wv[RN];
        ML4_UNROLL for (int j = 0; j < RN; ++j) wv[j] = _mm512_loadu_si512(w + j * ldw + h);
        ML4_UNROLL for (int i = 0; i < RM; ++i) {
          const __m512i xv = _mm512_loadu_si512(xp + i * ldx + h);
          ML4_UNROLL for (int j = 0; j < RN; ++j) blk[i][j] = dp(blk[i][j], xv, wv[j]);
        }
      }
    ML4_UNROLL for (int j = 0; j < RN; ++j) {
      const __m512 sv = _mm512_set1_ps(srows[j][b0 / 128]);
      ML4_UNROLL for (int i = 0; i < RM; ++i) acc[i][j] = _mm512_fmadd_ps(blk[i][j], sv, acc[i][j]);
    }
  }
  ML4_UNROLL for (int i = 0; i < RM; ++i) ML4_UNROLL for (int j = 0; j < RN; ++j) y[i * ldy + j] = hsum16(acc[i][j]);
}

// One FP8 row decoded for dot_tile_fp8_bf16dot (Kp words).
ML4_BF16DOT_FN inline void decode_fp8_bf16dot_row(const uint8_t* q, int64_t K, const E4m3Bf16Tables& t,
                                                  uint16_t* out) {
  for (int64_t c = 0; c < K; c += 64) {
    __m512i a, b;
    e4m3x64_bf16(q + c, K - c, t, a, b);
    _mm512_storeu_si512(out + c, a);
    _mm512_storeu_si512(out + c + 32, b);
  }
}

}  // namespace ml4::cpu::kernels

#pragma GCC diagnostic pop
#endif
