// Byte layout of the DSA indexer key cache (MODEL.md 3.5, FIELD-NOTES "Cache formats").
//
// One page holds kPageTokens (64) keys of dI values, page-major as vLLM's
// indexer_k_quant_and_cache writes them:
//   [0, 64 dI)                    token t's e4m3 values at t * dI
//   [64 dI, 64 dI + 64 * 4 G)     token t's G = ceil(dI/128) f32 scales at 64 dI + t * 4G
// Scale per 128 values = max(amax, 1e-4) / 448 (DeepSeek-V3.2 inference/kernel.py act_quant),
// not rounded to a power of two; value = e4m3(x / scale), saturating RNE.
// 132 B/token for dI = 128.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ml4 {

constexpr int kIndexerQuantBlock = 128;

inline int indexer_scales_per_token(int dI) {
  return (dI + kIndexerQuantBlock - 1) / kIndexerQuantBlock;
}
inline size_t indexer_token_bytes(int dI) {
  return static_cast<size_t>(dI) + 4 * static_cast<size_t>(indexer_scales_per_token(dI));
}
size_t indexer_page_bytes(int dI);

// Quantizes k [dI] into token `offset_in_page` of `page`.
void encode_indexer_key(const float* k, int dI, uint8_t* page, int offset_in_page);
// Dequantized read: k [dI].
void decode_indexer_key(const uint8_t* page, int offset_in_page, int dI, float* k);
// Raw read, for kernels that multiply in fp8: values [dI] e4m3, scales [ceil(dI/128)].
void read_indexer_key_raw(const uint8_t* page, int offset_in_page, int dI, uint8_t* values,
                          float* scales);

}  // namespace ml4
