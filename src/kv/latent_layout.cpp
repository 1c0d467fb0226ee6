// fp8_ds_mla / fp8 / bf16 latent rows (layout in latent_layout.h).
#include "kv/latent_layout.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/dtype.h"

#include "core/e4m3_simd.h"
#ifdef ML4_E4M3_F16C
#define ML4_LATENT_F16C 1
#endif

namespace ml4 {

namespace {

void store_f32(uint8_t* p, float v) { std::memcpy(p, &v, 4); }
float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
void store_bf16(uint8_t* p, float v) {
  uint16_t h = f32_to_bf16(v);
  std::memcpy(p, &h, 2);
}
float load_bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return bf16_to_f32(h);
}

}  // namespace

size_t latent_token_bytes(KvCacheDtype dtype, int kv_lora_rank, int rope_dim) {
  const size_t r = static_cast<size_t>(kv_lora_rank), dr = static_cast<size_t>(rope_dim);
  switch (dtype) {
    case KvCacheDtype::kFp8DsMla: return r + 4 * (r / kDsMlaTile) + 2 * dr;
    case KvCacheDtype::kFp8: return r + dr;
    case KvCacheDtype::kBf16: return 2 * (r + dr);
  }
  return 0;
}

void encode_latent(KvCacheDtype dtype, const float* c, const float* kr, int r, int dr,
                   float fp8_scale, uint8_t* dst) {
  switch (dtype) {
    case KvCacheDtype::kFp8DsMla: {
      // vLLM concat_and_cache_ds_mla_kernel: tile_scale = max(amax / 448, FLT_MIN), then
      // e4m3(x / tile_scale) with saturation (scaled_convert, __NV_SATFINITE).
      const int tiles = r / kDsMlaTile;
      uint8_t* scales = dst + r;
      for (int t = 0; t < tiles; ++t) {
        const float* x = c + t * kDsMlaTile;
        float amax = 0.0f;
        for (int i = 0; i < kDsMlaTile; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float scale = std::max(amax / kE4M3Max, FLT_MIN);
        for (int i = 0; i < kDsMlaTile; ++i) dst[t * kDsMlaTile + i] = f32_to_e4m3(x[i] / scale);
        store_f32(scales + 4 * t, scale);
      }
      uint8_t* rope = scales + 4 * tiles;
      for (int i = 0; i < dr; ++i) store_bf16(rope + 2 * i, kr[i]);
      return;
    }
    case KvCacheDtype::kFp8: {
      // vLLM concat_and_cache_mla with kv_cache_dtype fp8: e4m3(x / k_scale).
      for (int i = 0; i < r; ++i) dst[i] = f32_to_e4m3(c[i] / fp8_scale);
      for (int i = 0; i < dr; ++i) dst[r + i] = f32_to_e4m3(kr[i] / fp8_scale);
      return;
    }
    case KvCacheDtype::kBf16: {
      for (int i = 0; i < r; ++i) store_bf16(dst + 2 * i, c[i]);
      for (int i = 0; i < dr; ++i) store_bf16(dst + 2 * (r + i), kr[i]);
      return;
    }
  }
}

namespace {

// The reference: every value e4m3_to_f32(code) * scale (one rounding) or a bf16 widened.
void decode_latent_scalar(KvCacheDtype dtype, const uint8_t* src, int r, int dr, float fp8_scale, float* c,
                          float* kr) {
  switch (dtype) {
    case KvCacheDtype::kFp8DsMla: {
      const int tiles = r / kDsMlaTile;
      const uint8_t* scales = src + r;
      for (int t = 0; t < tiles; ++t) {
        const float scale = load_f32(scales + 4 * t);
        for (int i = 0; i < kDsMlaTile; ++i) {
          c[t * kDsMlaTile + i] = e4m3_to_f32(src[t * kDsMlaTile + i]) * scale;
        }
      }
      const uint8_t* rope = scales + 4 * tiles;
      for (int i = 0; i < dr; ++i) kr[i] = load_bf16(rope + 2 * i);
      return;
    }
    case KvCacheDtype::kFp8: {
      for (int i = 0; i < r; ++i) c[i] = e4m3_to_f32(src[i]) * fp8_scale;
      for (int i = 0; i < dr; ++i) kr[i] = e4m3_to_f32(src[r + i]) * fp8_scale;
      return;
    }
    case KvCacheDtype::kBf16: {
      for (int i = 0; i < r; ++i) c[i] = load_bf16(src + 2 * i);
      for (int i = 0; i < dr; ++i) kr[i] = load_bf16(src + 2 * (r + i));
      return;
    }
  }
}

#ifdef ML4_LATENT_F16C
// The vector decode (core/e4m3_simd.h): 2^-8 times each code's value, exactly, times 256 * scale
// (exact while finite): the same real product as code * scale, rounded once. The codes 0x7f /
// 0xff (NaN) are only noted in `probe` (the caller decodes such a row with the table, whose NaNs
// keep their sign); bf16 widens by a 16-bit shift. n values from p.
inline void e4m3_times(const uint8_t* p, int n, __m256 s256, float* out, __m128i& probe) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i lo, hi;
    simd::e4m3x16_to_f16(p + i, lo, hi, probe);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(lo), s256));
    _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(hi), s256));
  }
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(simd::e4m3x8_to_f16(p + i, probe)), s256));
  const float s = _mm256_cvtss_f32(s256) * (1.0f / 256.0f);  // exact: s256 is 256 * scale
  for (; i < n; ++i) out[i] = e4m3_to_f32(p[i]) * s;
}

inline void bf16_widen(const uint8_t* p, int n, float* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) out[i] = load_bf16(p + 2 * i);
}

// 256 * scale when it is finite (so the product above is exact), else 0 (take the table).
inline float times256(float scale) {
  const float s = scale * 256.0f;
  return std::fabs(s) <= FLT_MAX ? s : 0.0f;
}

bool has_nan_code(__m128i probe) { return _mm_movemask_epi8(_mm_cmpeq_epi8(probe, _mm_set1_epi8(0x7f))) != 0; }
#endif

}  // namespace

void decode_latent(KvCacheDtype dtype, const uint8_t* src, int r, int dr, float fp8_scale,
                   float* c, float* kr) {
#ifdef ML4_LATENT_F16C
  __m128i probe = _mm_setzero_si128();
  switch (dtype) {
    case KvCacheDtype::kFp8DsMla: {
      const int tiles = r / kDsMlaTile;
      const uint8_t* scales = src + r;
      for (int t = 0; t < tiles; ++t) {
        const float s = times256(load_f32(scales + 4 * t));
        if (s == 0.0f) return decode_latent_scalar(dtype, src, r, dr, fp8_scale, c, kr);
        e4m3_times(src + t * kDsMlaTile, kDsMlaTile, _mm256_set1_ps(s), c + t * kDsMlaTile, probe);
      }
      if (has_nan_code(probe)) return decode_latent_scalar(dtype, src, r, dr, fp8_scale, c, kr);
      bf16_widen(scales + 4 * tiles, dr, kr);
      return;
    }
    case KvCacheDtype::kFp8: {
      const float s = times256(fp8_scale);
      if (s == 0.0f) break;
      e4m3_times(src, r, _mm256_set1_ps(s), c, probe);
      e4m3_times(src + r, dr, _mm256_set1_ps(s), kr, probe);
      if (has_nan_code(probe)) break;
      return;
    }
    case KvCacheDtype::kBf16: {
      bf16_widen(src, r, c);
      bf16_widen(src + 2 * r, dr, kr);
      return;
    }
  }
#endif
  decode_latent_scalar(dtype, src, r, dr, fp8_scale, c, kr);
}

}  // namespace ml4
