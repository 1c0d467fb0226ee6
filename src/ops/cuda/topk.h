// Causal top-k of the indexer scores by radix select (one thread block per query row): the
// k_t = min(k, lengths[t]) highest scores among [0, lengths[t]) of row t, never reading past
// lengths[t] (padding is never scanned).
//
// Semantics equal ml4::cpu::topk on the same row (NaN ranks as -inf, -0 == +0, ties go to the
// lower position), but indices come out in ascending position order (what the attention
// kernel and ml4::CpuModel's sorted lists use), followed by -1 up to k. Outputs, either or both:
//   positions [T, out_stride]: the selected positions s;
//   slots     [T, out_stride]: cache slots block_table[seq][s / 64] * 64 + s % 64 (FlashMLA's
//             sparse indices), for the attention kernel to read directly;
//   counts    [T]: k_t.
// Method: four 8-bit radix passes over order-preserving u32 keys find the k-th largest key
// and how many of its ties to take; a block-wide scan then compacts in position order.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"

namespace ml4::cuda {

struct TopkParams {
  const float* scores = nullptr;    // [T, scores_stride]
  int64_t scores_stride = 0;
  const int32_t* lengths = nullptr; // [T] valid length of each row (>= 0)
  int64_t T = 0;
  int k = 2048;
  int32_t* positions = nullptr;     // [T, out_stride] or null
  int32_t* slots = nullptr;         // [T, out_stride] or null (needs block_table)
  int32_t* counts = nullptr;        // [T] or null
  int64_t out_stride = 0;           // 0: k
  const int32_t* block_table = nullptr;  // [num_seqs, block_table_stride]
  int64_t block_table_stride = 0;
  const int32_t* seq_of_token = nullptr; // [T]
  cudaStream_t stream = nullptr;
};
Status topk(const TopkParams& p);

}  // namespace ml4::cuda
