// FP8 e4m3 codes to floats with F16C, exactly: one definition for the CPU kernels
// (ops/cpu/linear_kernels.h) and the KV layouts (kv/latent_layout.cpp, kv/indexer_layout.cpp).
//
// e4m3 s.eeee.mmm placed in an f16 as s.0eeee.mmm0000000 is exactly 2^-8 times the code's value
// (subnormals too, which f16 has), and F16C widens that to an always-normal f32 (an
// f32-subnormal trick would hit the ~100-cycle denormal assist on 1/16 of the codes). Callers
// fold 2^8 into their scale: 256 * scale is exact while finite, so (code / 256) * (256 * scale)
// is the same real product as code * scale, rounded once.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define ML4_E4M3_F16C 1

namespace ml4::simd {

// 8 codes -> 8 f32, 2^-8 times their values; the codes 0x7f / 0xff -> NaN.
inline __m256 e4m3x8_div256(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m256 v = _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(mag, 7), sign));
  const __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
  return _mm256_or_ps(v, _mm256_castsi256_ps(nan));
}

// 16 codes -> two f16 vectors (codes 0-7, 8-15) holding 2^-8 times their values. The codes
// 0x7f / 0xff come out as 480 * 2^-8: `nan_probe` collects max |code| so the caller can tell
// (probe_has_nan) and take the exact path.
inline void e4m3x16_to_f16(const uint8_t* p, __m128i& lo, __m128i& hi, __m128i& nan_probe) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i z = _mm_setzero_si128(), keep = _mm_set1_epi16(static_cast<short>(0xbfff));
  // code in the high half, arithmetic shift by one: sign at bits 15 and 14, magnitude at
  // 13..7; clearing bit 14 leaves sign << 15 | magnitude << 7.
  lo = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(z, b), 1), keep);
  hi = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(z, b), 1), keep);
  nan_probe = _mm_max_epu8(nan_probe, _mm_and_si128(b, _mm_set1_epi8(0x7f)));
}
inline __m128i e4m3x8_to_f16(const uint8_t* p, __m128i& nan_probe) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  nan_probe = _mm_max_epu8(nan_probe, _mm_and_si128(b, _mm_set1_epi8(0x7f)));
  return _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1),
                       _mm_set1_epi16(static_cast<short>(0xbfff)));
}
inline bool probe_has_nan(__m128i nan_probe) {
  return _mm_movemask_epi8(_mm_cmpeq_epi8(nan_probe, _mm_set1_epi8(0x7f))) != 0;
}

}  // namespace ml4::simd

#endif
