// DSA lightning-indexer scores on the GPU (MODEL.md 3.5; DeepSeek-V3.2 inference/kernel.py
// fp8_index, vLLM's indexer on the paged cache), for decode and prefill alike: every query
// token t scores the keys of its own sequence at positions s in [0, lengths[t]) (lengths[t] =
// p_t + 1, causal), reading them from the paged indexer cache through the sequence's block
// table:
//   score[t, s] = sum_h w[t, h] * q_scale[t, h] * relu(q8[t, h] . k8[s]) * k_scale[s]
// with q8, k8 the e4m3 values (products and sums in f32). Because q_scale, k_scale > 0 this
// equals ml4::cpu::indexer_scores on the dequantized q and k (relu(a x) = a relu(x), a > 0).
// Only [0, lengths[t]) of each score row is written; the rest of the row is never touched
// (top-k scans stop at the same length).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "ops/cuda/rope_rows.h"

namespace ml4::cuda {

// Heads the kernel handles (DeepSeek-V3.2 and ML4 use 64 and 32; tiny models 4).
constexpr int kIndexerMaxHeads = 64;

// How q8 . k8 is computed.
//   kF32: e4m3 decoded to f32, f32 FMAs (products exact, f32 sums: ~1e-7 relative).
//   kFp8TensorCore: mma.sync m16n8k32 e4m3 x e4m3 -> f32 on the tensor cores, as DeepSeek's
//     fp8_index; Hopper's FP8 tensor-core accumulation keeps fewer bits than f32 (DeepSeek-V3
//     report 3.3.2), so scores differ from kF32 by up to ~1e-4 relative.
// kFp8Wgmma: the kFp8TensorCore scores by wgmma (128 query rows of 128 / HI tokens a block, key
// pages through a cp.async ring; HI a multiple of 16, else it runs kFp8TensorCore). Sums in
// another order than kFp8TensorCore (not the same bits; deterministic): within 1e-3 of the
// summed magnitudes (CudaIndexer.WgmmaScoresAndTopkMatchCpu); 2.2-3.6x the mma.sync kernel on
// a 4096-token prefill (H100, attention_bench). The runner takes it for prefill-sized steps.
enum class IndexerMath { kF32, kFp8TensorCore, kFp8Wgmma };

struct IndexerScoresParams {
  const void* q = nullptr;          // [T, HI, dI] e4m3
  const float* q_scale = nullptr;   // [T, HI] one scale per head (dI == 128)
  const float* weights = nullptr;   // [T, HI] f32
  float weight_scale = 1.0f;        // weights[t, h] * weight_scale (f32, rounded once: as the
                                    // CPU's `w *= 1/sqrt(HI * dI)`) is head h's weight
  const void* cache = nullptr;      // [num_blocks, indexer_page_bytes(dI)] (indexer_layout.h)
  int64_t num_blocks = 0;
  const int32_t* block_table = nullptr;  // [num_seqs, block_table_stride] page ids
  int64_t block_table_stride = 0;
  const int32_t* seq_of_token = nullptr;  // [T] row of block_table for each token
  const int32_t* lengths = nullptr;       // [T] keys visible to each token (p + 1)
  int64_t T = 0;
  int HI = 64;
  int dI = 128;                     // 128 only
  int max_length = 0;               // host-side bound on lengths[t] (grid size)
  float* scores = nullptr;          // [T, scores_stride] f32
  int64_t scores_stride = 0;        // >= max_length
  IndexerMath math = IndexerMath::kF32;
  // kFp8TensorCore: query tokens that share a block's key pages, 1 or 4 (the same bits either
  // way); 0 picks 4 for steps of 256 tokens or more (prefill), else 1.
  int tokens_per_block = 0;
  // kFp8TensorCore: key pages a block takes, 1..4 (the same bits either way); 0 picks the
  // fewest that keep the grid within ~4 blocks a multiprocessor (decode: one page a block, so
  // each block's chain of page loads and barriers runs once).
  int pages_per_block = 0;
  cudaStream_t stream = nullptr;
};
Status indexer_scores(const IndexerScoresParams& p);

// The indexer query's FP8 form for indexer_scores: per row of dI values, the normalized
// Walsh-Hadamard transform (optional), then e4m3 with scale max(amax, 1e-4) / 448 per 128 values.
// Bytes and scales equal ml4::cpu::hadamard_transform + ml4::cpu::quantize_fp8_groups(.., 128, ..)
// (the CPU runner's indexer path, runtime/cpu_attention.cpp), bit for bit.
struct IndexerQueryQuantParams {
  const float* q = nullptr;   // [rows, dI] f32 (rows = T * HI)
  int64_t rows = 0;
  int dI = 128;               // a power of two in [128, 1024]
  bool hadamard = true;
  void* q8 = nullptr;         // [rows, dI] e4m3
  float* scales = nullptr;    // [rows, dI / 128]
  cudaStream_t stream = nullptr;
  // Issue 19's fusion of the query path: RoPE first, in the kernel (q_path's NeoX rotation of
  // each row's first rope_dim values at its token's position, rope.cuh), q read only. rows =
  // T * heads, row r of token r / heads. Off: q is already rotated.
  bool rope = false;
  int heads = 1;
  RopeRows rope_rows;  // with rope (dim <= dI)
};
Status indexer_query_quant(const IndexerQueryQuantParams& p);

}  // namespace ml4::cuda
