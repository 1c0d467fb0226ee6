// KV cache element formats and the page size every cache group uses.
//
// `--kv-cache-dtype` values as vLLM spells them (FIELD-NOTES "Cache formats"):
//   fp8_ds_mla (default, "auto"): per-128 tile scaled e4m3 latent + bf16 rope, 656 B/token
//   fp8: e4m3 latent and rope with one per-tensor scale (vLLM k_scale), 576 B/token
//   bf16: 1,152 B/token
// The indexer K cache has one format (e4m3 + f32 scale per 128 values) whatever this says.
#pragma once

#include <string_view>

#include "core/status.h"

namespace ml4 {

enum class KvCacheDtype { kFp8DsMla, kFp8, kBf16 };

// Tokens per page (block) in every group: FlashMLA's sparse kernels and vLLM's indexer
// cache use 64 on CUDA (FIELD-NOTES "Cache formats").
constexpr int kPageTokens = 64;

// Accepts "fp8_ds_mla", "fp8", "bf16" and "auto" (-> fp8_ds_mla).
Result<KvCacheDtype> parse_kv_cache_dtype(std::string_view s);
const char* kv_cache_dtype_name(KvCacheDtype d);

}  // namespace ml4
