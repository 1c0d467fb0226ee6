// Hadamard and FP8 group quantization: see quant.h.
//
// The transform is the iterative butterfly (h = 1, 2, 4, ...: (a, b) -> (a + b, a - b)),
// which yields Sylvester ordering H_2n = [[H, H], [H, -H]] exactly as scipy.linalg.hadamard
// and fast_hadamard_transform; the n^-0.5 scale is applied once at the end.
#include "ops/cpu/quant.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/log.h"
#include "core/threads.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ML4_QUANT_AVX2 1
#endif

namespace ml4::cpu {

void hadamard_transform(float* x, int64_t rows, int n) {
  if (n <= 0 || (n & (n - 1)) != 0) {
    ML4_LOG_ERROR("hadamard_transform: n = {} is not a power of two", n);
    return;
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  parallel_for(rows, std::max<int64_t>(1, 8192 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* v = x + r * n;
#ifdef ML4_QUANT_AVX2
      // The same butterflies (a + c, a - c of the same pairs, level by level) 8 lanes at a
      // time: levels 1, 2, 4 inside a register (a and c lanes moved into place, the sums and
      // differences blended), levels >= 8 between registers, then the same multiply.
      if (n >= 8) {
        for (int i = 0; i < n; i += 8) {
          __m256 y = _mm256_loadu_ps(v + i);
          y = _mm256_blend_ps(_mm256_add_ps(_mm256_moveldup_ps(y), _mm256_movehdup_ps(y)),
                              _mm256_sub_ps(_mm256_moveldup_ps(y), _mm256_movehdup_ps(y)), 0xAA);
          __m256 a = _mm256_permute_ps(y, _MM_SHUFFLE(1, 0, 1, 0)), c = _mm256_permute_ps(y, _MM_SHUFFLE(3, 2, 3, 2));
          y = _mm256_blend_ps(_mm256_add_ps(a, c), _mm256_sub_ps(a, c), 0xCC);
          a = _mm256_permute2f128_ps(y, y, 0x00), c = _mm256_permute2f128_ps(y, y, 0x11);
          y = _mm256_blend_ps(_mm256_add_ps(a, c), _mm256_sub_ps(a, c), 0xF0);
          _mm256_storeu_ps(v + i, y);
        }
        for (int h = 8; h < n; h *= 2)
          for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j += 8) {
              const __m256 a = _mm256_loadu_ps(v + j), c = _mm256_loadu_ps(v + j + h);
              _mm256_storeu_ps(v + j, _mm256_add_ps(a, c));
              _mm256_storeu_ps(v + j + h, _mm256_sub_ps(a, c));
            }
        const __m256 sv = _mm256_set1_ps(scale);
        for (int i = 0; i < n; i += 8) _mm256_storeu_ps(v + i, _mm256_mul_ps(_mm256_loadu_ps(v + i), sv));
        continue;
      }
#endif
      for (int h = 1; h < n; h *= 2) {
        for (int i = 0; i < n; i += 2 * h) {
          for (int j = i; j < i + h; ++j) {
            const float a = v[j], c = v[j + h];
            v[j] = a + c;
            v[j + h] = a - c;
          }
        }
      }
      for (int i = 0; i < n; ++i) v[i] *= scale;
    }
  });
}

void quantize_fp8_groups(const float* x, int64_t n, int group, uint8_t* q, float* scales) {
  if (group <= 0) {
    ML4_LOG_ERROR("quantize_fp8_groups: group = {}", group);
    return;
  }
  for (int64_t g0 = 0, gi = 0; g0 < n; g0 += group, ++gi) {
    const int64_t g1 = std::min<int64_t>(n, g0 + group);
    float amax = 0.0f;
    for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(x[i]));
    // DeepSeek-V3 inference/kernel.py act_quant: s = max(amax, 1e-4) / 448; y = x / s.
    const float s = std::max(amax, 1e-4f) / kE4M3Max;
    scales[gi] = s;
    for (int64_t i = g0; i < g1; ++i) q[i] = f32_to_e4m3(x[i] / s);
  }
}

void dequantize_fp8_groups(const uint8_t* q, const float* scales, int64_t n, int group, float* x) {
  if (group <= 0) {
    ML4_LOG_ERROR("dequantize_fp8_groups: group = {}", group);
    return;
  }
  // The reference (tests; round_fp8_groups is the fast path): kept plain.
  for (int64_t i = 0; i < n; ++i) x[i] = e4m3_to_f32(q[i]) * scales[i / group];
}

#ifdef ML4_QUANT_AVX2
namespace {
// f32_to_e4m3 of 8 values (its branches as blends, NaN first, then saturation, subnormals,
// normals), the codes as int32 lanes.
inline __m256i e4m3_codes(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  // normals: (a + 0x7ffff + ((a >> 20) & 1)) >> 20, less 120 << 3, at most 0x7e
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7ffff)),
                       _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1))),
      20);
  __m256i code = _mm256_min_epi32(_mm256_sub_epi32(r, _mm256_set1_epi32(120 << 3)), _mm256_set1_epi32(0x7e));
  // subnormals (a < 2^-6): |y| * 512 + 2^23 - 2^23 (the product is exact)
  const __m256 mag = _mm256_castsi256_ps(a);
  const __m256 big = _mm256_add_ps(_mm256_mul_ps(mag, _mm256_set1_ps(512.0f)), _mm256_set1_ps(8388608.0f));
  const __m256i sub = _mm256_cvttps_epi32(_mm256_sub_ps(big, _mm256_set1_ps(8388608.0f)));
  code = _mm256_blendv_epi8(code, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), a));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7e), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43dfffff)));
  code = _mm256_or_si256(code, sign);
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
}
}  // namespace
#endif

void round_fp8_groups(float* x, int64_t n, int group) {
  if (group <= 0) {
    ML4_LOG_ERROR("round_fp8_groups: group = {}", group);
    return;
  }
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    const int64_t g1 = std::min<int64_t>(n, g0 + group);
    int64_t i = g0;
    float amax = 0.0f;
#ifdef ML4_QUANT_AVX2
    // max_ps(|x|, m) = |x| > m ? |x| : m = std::max(m, |x|): NaN is passed over as there.
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m8 = _mm256_setzero_ps();
    for (; i + 8 <= g1; i += 8) m8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), m8);
    alignas(32) float m[8];
    _mm256_store_ps(m, m8);
    for (float v : m) amax = std::max(amax, v);
#endif
    for (; i < g1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = std::max(amax, 1e-4f) / kE4M3Max;
    i = g0;
#ifdef ML4_QUANT_AVX2
    const __m256 sv = _mm256_set1_ps(s);
    for (; i + 8 <= g1; i += 8) {
      const __m256i code = e4m3_codes(_mm256_div_ps(_mm256_loadu_ps(x + i), sv));
      _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_i32gather_ps(detail::kE4M3Table.data(), code, 4), sv));
    }
#endif
    for (; i < g1; ++i) x[i] = e4m3_to_f32(f32_to_e4m3(x[i] / s)) * s;
  }
}

}  // namespace ml4::cpu
