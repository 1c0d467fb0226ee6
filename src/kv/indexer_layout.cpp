// Indexer key pages (layout in indexer_layout.h).
#include "kv/indexer_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kv/kv_cache_dtype.h"

#include "core/e4m3_simd.h"
#ifdef ML4_E4M3_F16C
#define ML4_INDEXER_F16C 1
#endif

namespace ml4 {

namespace {
// DeepSeek-V3.2 act_quant / vLLM indexer_k_quant_and_cache: amax floored at 1e-4.
constexpr float kIndexerAmaxFloor = 1e-4f;

size_t scale_offset(int dI, int offset_in_page) {
  return static_cast<size_t>(kPageTokens) * dI +
         static_cast<size_t>(offset_in_page) * 4 * indexer_scales_per_token(dI);
}
}  // namespace

size_t indexer_page_bytes(int dI) { return kPageTokens * indexer_token_bytes(dI); }

void encode_indexer_key(const float* k, int dI, uint8_t* page, int offset_in_page) {
  uint8_t* values = page + static_cast<size_t>(offset_in_page) * dI;
  uint8_t* scales = page + scale_offset(dI, offset_in_page);
  const int groups = indexer_scales_per_token(dI);
  for (int g = 0; g < groups; ++g) {
    const int lo = g * kIndexerQuantBlock, hi = std::min(dI, lo + kIndexerQuantBlock);
    float amax = 0.0f;
    for (int i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(k[i]));
    const float scale = std::max(amax, kIndexerAmaxFloor) / kE4M3Max;
    for (int i = lo; i < hi; ++i) values[i] = f32_to_e4m3(k[i] / scale);
    std::memcpy(scales + 4 * g, &scale, 4);
  }
}

void read_indexer_key_raw(const uint8_t* page, int offset_in_page, int dI, uint8_t* values,
                          float* scales) {
  std::memcpy(values, page + static_cast<size_t>(offset_in_page) * dI, dI);
  std::memcpy(scales, page + scale_offset(dI, offset_in_page),
              4 * static_cast<size_t>(indexer_scales_per_token(dI)));
}

// Every value is e4m3 * scale rounded once. The F16C path computes (e4m3 / 256) * (256 * scale)
// (core/e4m3_simd.h: the same real product while 256 * scale is finite; codes 0x7f / 0xff stay NaN).
void decode_indexer_key(const uint8_t* page, int offset_in_page, int dI, float* k) {
  const uint8_t* values = page + static_cast<size_t>(offset_in_page) * dI;
  const uint8_t* scales = page + scale_offset(dI, offset_in_page);
  int i = 0;
#ifdef ML4_INDEXER_F16C
  for (int lo = i; lo < dI; lo += kIndexerQuantBlock) {
    const int hi = std::min(dI, lo + kIndexerQuantBlock);
    if ((hi - lo) % 8 != 0) break;  // the scalar loop below finishes from i
    float scale;
    std::memcpy(&scale, scales + 4 * (lo / kIndexerQuantBlock), 4);
    if (!std::isfinite(scale * 256.0f)) break;  // 256 * scale overflows: the scalar loop's bits
    const __m256 s256 = _mm256_set1_ps(scale * 256.0f);
    for (; i < hi; i += 8) _mm256_storeu_ps(k + i, _mm256_mul_ps(simd::e4m3x8_div256(values + i), s256));
  }
#endif
  for (; i < dI; ++i) {
    float scale;
    std::memcpy(&scale, scales + 4 * (i / kIndexerQuantBlock), 4);
    k[i] = e4m3_to_f32(values[i]) * scale;
  }
}

}  // namespace ml4
