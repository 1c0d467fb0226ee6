// Byte layout of one token's MLA latent (c [r], kr [dr]) in one layer's cache.
//
//   fp8_ds_mla (vLLM csrc/cache_kernels.cu concat_and_cache_ds_mla_kernel, read by
//     FlashMLA's sparse FP8 kernels):
//       [0, r)              r e4m3 values, tile t = values [128t, 128t+128)
//       [r, r + 4r/128)     one f32 scale per tile: max(amax/448, FLT_MIN), not rounded;
//                           stored value = e4m3(x / scale), saturating RNE
//       [r + 4r/128, +2dr)  dr bf16 rope values (RNE)
//     656 B for r=512, dr=64. r must be a multiple of 128 (checked by make_kv_cache_spec).
//   fp8: r + dr e4m3 values of x / fp8_scale (per-tensor scale, vLLM's k_scale, 1.0 by
//     default): 576 B.
//   bf16: r + dr bf16 values: 1,152 B.
// All multi-byte values are little-endian (the host and the GPU agree).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kv/kv_cache_dtype.h"

namespace ml4 {

// Values per fp8_ds_mla scale tile.
constexpr int kDsMlaTile = 128;

size_t latent_token_bytes(KvCacheDtype dtype, int kv_lora_rank, int rope_dim);

// Writes one token: c [r], kr [dr] -> dst [latent_token_bytes(dtype, r, dr)].
// fp8_scale is used by kFp8 only.
void encode_latent(KvCacheDtype dtype, const float* c, const float* kr, int r, int dr,
                   float fp8_scale, uint8_t* dst);
// Reads one token back, dequantized: c [r], kr [dr].
void decode_latent(KvCacheDtype dtype, const uint8_t* src, int r, int dr, float fp8_scale,
                   float* c, float* kr);

}  // namespace ml4
