// MLA attention on the GPU, absorbed form (MODEL.md 3.6; DeepSeek-V2/V3 "weight absorption",
// FlashMLA's sparse decode), over a layer's paged latent cache (latent_layout.h, any
// KvCacheDtype: fp8_ds_mla 656 B rows, fp8, bf16). For query token t and head h:
//   logit(s) = (q_lat[t,h] . c[s] + q_rope[t,h] . kr[s]) * head_scale[t,h]
//   out_lat[t,h] = sum_s softmax(logit)(s) c[s],   lse[t,h] = ln sum_s exp(logit(s))
// exactly ml4::cpu::mla_attention on the dequantized keys. The log-sum-exp is in the
// NATURAL log (base e), like the CPU reference; a base-2 consumer multiplies by log2(e).
// No valid key gives out_lat = 0 and lse = -inf (the split/DCP combine convention).
//
// Which keys token t sees:
//   sparse (indices != null): the cache slots indices[t, 0 .. n_t), n_t = index_lengths[t] if
//     given, else topk; entries < 0 or >= num_slots are skipped (FlashMLA's -1 padding). This
//     serves decode and prefill alike (every token carries its own top-k list).
//   dense (indices == null): positions [0, lengths[t]) of sequence seq_of_token[t], slot =
//     block_table[seq][s / 64] * 64 + s % 64: the causal variant for models without DSA (for a
//     prefill chunk lengths[t] = p_t + 1 per token).
// Arithmetic is f32 throughout (keys dequantized to f32, f32 dot products and softmax), so
// the result matches the f64-accumulating CPU reference to ~1e-6 relative.
//
// Work is split over the keys (FlashMLA's num_splits / flash-decoding): split i of token t
// writes a partial (out, lse) into the workspace, and a combine kernel merges them in split
// order (deterministic). Pass a workspace of mla_attention_workspace_bytes(p) bytes; a smaller
// (or null) workspace only lowers the number of splits, never fails.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "kv/kv_cache_dtype.h"

namespace ml4::cuda {

// Heads per thread block; more heads run as further blocks (grid.z).
constexpr int kMlaHeadsPerBlock = 64;

// Arithmetic of the two matmuls (QK^T, PV).
//   kF32: f32 CUDA cores, keys dequantized to f32: ~1e-6 relative to the f64-summing CPU
//     reference (the exact path; slow: compute-bound at ~10 TFLOP/s, see docs/BENCHMARKS.md).
//   kBf16TensorCore: q, keys and P rounded to bf16, mma.sync with f32 accumulation, f32
//     softmax (FlashMLA's numerics): ~1e-3 relative. Needs cache dtype fp8_ds_mla or fp8 and
//     (r + dr) % 16 == 0; otherwise the kF32 kernel runs. Sparse fp8_ds_mla attention with
//     r = 512, dr = 64 and H % 16 == 0, H <= 128 runs a dedicated decode kernel
//     (attention_decode.cu, FlashMLA's schedule: see decode_kernel below), same numerics; steps
//     with at least a wave of (token, 64-head block) pairs (prefill) run the wgmma prefill kernel
//     (attention_prefill.cu: the touched rows dequantized once to a bf16 scratch in the
//     workspace; see prefill_kernel below), same numerics.
enum class MlaMath { kF32, kBf16TensorCore };

struct MlaAttentionParams {
  const float* q_lat = nullptr;       // [T, H, r] f32
  const float* q_rope = nullptr;      // [T, H, q_rope_stride] f32, dr used of each row
  int64_t q_rope_stride = 0;          // floats between (t, h) rows of q_rope; 0: dr (multiple of 4)
  const float* head_scale = nullptr;  // [T, H] softmax scale per token and head (SSMax etc.)
  int64_t T = 0;
  int H = 64;
  int r = 512;                        // multiple of 128, <= 512
  int dr = 64;                        // even, <= 64, (r + dr) % 4 == 0
  const void* cache = nullptr;        // [num_slots, latent_token_bytes(dtype, r, dr)]
  int64_t num_slots = 0;
  KvCacheDtype dtype = KvCacheDtype::kFp8DsMla;
  float fp8_scale = 1.0f;             // kFp8 only
  // Sparse.
  const int32_t* indices = nullptr;   // [T, indices_stride] cache slots
  int64_t indices_stride = 0;         // 0: topk
  int topk = 0;                       // entries per row
  const int32_t* index_lengths = nullptr;  // [T] or null (topk)
  // Dense.
  const int32_t* block_table = nullptr;    // [num_seqs, block_table_stride]
  int64_t block_table_stride = 0;
  const int32_t* seq_of_token = nullptr;   // [T]
  const int32_t* lengths = nullptr;        // [T] keys visible to each token
  int max_length = 0;                      // host-side bound on lengths[t]
  // Outputs.
  float* out_lat = nullptr;           // [T, H, r] f32
  float* lse = nullptr;               // [T, H] natural log
  // q_lat and out_lat hold bf16 [T, H, r] at the same addresses (mla_absorb_q_gemm's and
  // mla_apply_uv_gemm's lat_bf16 form): half the bytes of the two through HBM. The prefill kernel
  // only (it rounds q to bf16 anyway, so a q_lat already rounded gives the same out); a step it
  // does not take (mla_attention_runs_prefill) is refused.
  bool lat_bf16 = false;
  // Split-KV.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int num_splits = 0;                 // 0: chosen from T, H and the multiprocessor count
  MlaMath math = MlaMath::kF32;
  // kBf16TensorCore + sparse + fp8_ds_mla + r 512 + dr 64 + H a multiple of 16 (<= 128) runs the
  // dedicated decode kernel (attention_decode.cu: producer warp + bulk-copy ring); false keeps
  // the generic tensor-core kernel (for comparisons).
  bool decode_kernel = true;
  // kBf16TensorCore + sparse + fp8_ds_mla + r 512 + dr 64 (any H) with T * ceil(H / 64) >=
  // prefill_min_blocks (0: the multiprocessor count) runs the wgmma prefill kernel
  // (attention_prefill.cu) when the workspace holds its row scratch
  // (mla_attention_workspace_bytes sizes it); false keeps the kernels above.
  bool prefill_kernel = true;
  // The prefill kernel's schedule: each warpgroup owns a whole 64-key tile of a pair (S by
  // m64n64, its P kept in registers for its PV; attention_prefill.cu "pair schedule") instead
  // of half of every tile (the tile schedule). Same function; P's bf16 rounding differs in
  // warpgroup 0's half.
  bool prefill_pairs = true;
  int64_t prefill_min_blocks = 0;
  // Upper bound on the cache pages (64 slots) the indices point into, sizing the prefill
  // kernel's bf16 scratch (1152 B a slot): the step's block-table pages; 0 = every page of the
  // cache. Keys on pages beyond the bound are skipped, so it must hold.
  int64_t scratch_pages = 0;
  cudaStream_t stream = nullptr;
};

// Workspace for the split count mla_attention would choose for p (0 when it needs none).
size_t mla_attention_workspace_bytes(const MlaAttentionParams& p);
Status mla_attention(const MlaAttentionParams& p);
// Whether mla_attention runs p on the prefill kernel (its shape, p.workspace and the step's size).
bool mla_attention_runs_prefill(const MlaAttentionParams& p);

}  // namespace ml4::cuda
