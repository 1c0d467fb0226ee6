// Cache writes of the CUDA backend: the MLA latent row (c, kr) of each new token into its
// layer's paged latent cache, and the DSA indexer key into its paged indexer cache.
//
// Latent cache of one layer: num_slots rows of latent_token_bytes(dtype, r, dr) bytes,
// contiguous ([num_blocks, 64, token_bytes], slot = block * 64 + offset, as vLLM's
// slot_mapping and FlashMLA's paged layout). Row bytes are identical to ml4::encode_latent
// (src/kv/latent_layout.cpp) for every KvCacheDtype: fp8_ds_mla (vLLM
// concat_and_cache_ds_mla_kernel: per-128 tile scale max(amax/448, FLT_MIN), e4m3(x/scale)
// saturating RNE, bf16 rope), fp8 (x / fp8_scale) and bf16.
//
// Indexer cache of one layer: num_blocks pages of indexer_page_bytes(dI) (indexer_layout.h,
// vLLM indexer_k_quant_and_cache): the key is Hadamard-transformed first (optional; the same
// butterfly order and n^-0.5 multiply as ml4::cpu::hadamard_transform, so the f32 values and
// hence the bytes are identical), then e4m3 with scale max(amax, 1e-4)/448 per 128 values.
//
// Slots < 0 are skipped (padded tokens, vLLM's convention); a slot >= num_slots is a caller
// bug: it is skipped too (never written out of bounds). The host side checks shapes only.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/status.h"
#include "kv/kv_cache_dtype.h"
#include "ops/cuda/rope_rows.h"

namespace ml4::cuda {

struct LatentCacheWriteParams {
  const void* c = nullptr;    // [T, r] c_dtype (kF32 or kBF16), rows c_stride elements apart
  const void* kr = nullptr;   // [T, dr] kr_dtype (kF32 or kBF16), rows kr_stride elements apart
  DType c_dtype = DType::kF32;
  DType kr_dtype = DType::kF32;
  int64_t c_stride = 0;       // 0: r
  int64_t kr_stride = 0;      // 0: dr
  const int64_t* slots = nullptr;  // [T] cache slot of each token, < 0: skip
  int64_t T = 0;
  int r = 512, dr = 64;       // r a multiple of 128 for fp8_ds_mla; r, dr even
  KvCacheDtype dtype = KvCacheDtype::kFp8DsMla;
  float fp8_scale = 1.0f;     // kFp8 only
  void* cache = nullptr;      // [num_slots, latent_token_bytes(dtype, r, dr)] bytes
  int64_t num_slots = 0;
  cudaStream_t stream = nullptr;
};
Status latent_cache_write(const LatentCacheWriteParams& p);

// The latent row's path into the cache, one kernel (issue 19's decode fusions): ckv [T,
// ckv_stride] holds [c | kr] (wkv_a's output); c = RMSNorm(c) * norm_w into `c` (when set),
// kr rotated in place (interleaved pairs, or NeoX), then latent_cache_write of (c, kr) to
// each token's slot. The same bytes as rms_norm + q_path's rotation + latent_cache_write.
struct LatentKeyPathParams {
  float* ckv = nullptr;               // [T, ckv_stride] f32, 16-byte aligned rows
  int64_t ckv_stride = 0;             // >= r + dr
  float* c = nullptr;                 // [T, r] f32 or null
  const float* norm_w = nullptr;      // [r]
  float eps = 1e-6f;
  bool rope = true;                   // LayerSpec::rope (NoPE layers skip it)
  bool neox = false;                  // pairs (i, i + dr / 2); else (2i, 2i + 1) (MLA)
  RopeRows rope_rows;                 // with rope: dim == dr
  const int64_t* slots = nullptr;     // [T], < 0: skip the write
  int64_t T = 0;
  int r = 512, dr = 64;               // r a multiple of 4 (of 128 for fp8_ds_mla), r <= 1024; dr even, <= 256
  KvCacheDtype dtype = KvCacheDtype::kFp8DsMla;
  float fp8_scale = 1.0f;             // kFp8 only
  void* cache = nullptr;              // [num_slots, latent_token_bytes(dtype, r, dr)] bytes
  int64_t num_slots = 0;
  cudaStream_t stream = nullptr;
};
Status latent_key_path(const LatentKeyPathParams& p);

struct IndexerCacheWriteParams {
  const void* k = nullptr;    // [T, dI] k_dtype (kF32 or kBF16), rows k_stride elements apart
  DType k_dtype = DType::kF32;
  int64_t k_stride = 0;       // 0: dI
  const int64_t* slots = nullptr;  // [T], < 0: skip
  int64_t T = 0;
  int dI = 128;               // 128 (one scale per token; the layout allows more, this kernel not)
  bool hadamard = true;       // apply the normalized Walsh-Hadamard transform before quantizing
  void* cache = nullptr;      // [num_blocks, indexer_page_bytes(dI)] bytes
  int64_t num_blocks = 0;
  cudaStream_t stream = nullptr;
};
Status indexer_cache_write(const IndexerCacheWriteParams& p);

// The indexer's key half after its projection, one kernel per step (issue 19's decode fusion):
// per token, LayerNorm of k (f64 mean and variance, cpu::layer_norm / layer_norm's formula),
// NeoX RoPE of its first rope_dim values when `rope` (q_path's angles and rotation, rope.cuh),
// then indexer_cache_write's Hadamard + e4m3 into the page. The same f32 values as the three
// launches (layer_norm, q_path, indexer_cache_write) but for the order of LayerNorm's f64 sums,
// so the same bytes (a differing byte needs an f64 sum-order difference, ~1e-16, to move an f32
// rounding). dI = 128 (ML4's indexer); k is read only.
struct IndexerKeyPathParams {
  const float* k = nullptr;          // [T, dI] f32: the wk projection
  int64_t T = 0;
  int dI = 128;
  const float* ln_w = nullptr;       // [dI]
  const float* ln_b = nullptr;       // [dI] or null
  float eps = 1e-6f;
  bool rope = true;                  // LayerSpec::rope (NoPE layers skip it)
  RopeRows rope_rows;                // with rope: the rotation (dim <= dI)
  const int64_t* slots = nullptr;    // [T], < 0: skip
  void* cache = nullptr;             // [num_blocks, indexer_page_bytes(dI)] bytes
  int64_t num_blocks = 0;
  cudaStream_t stream = nullptr;
};
Status indexer_key_path(const IndexerKeyPathParams& p);

}  // namespace ml4::cuda
