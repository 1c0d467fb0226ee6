// Causal top-k of the indexer scores by radix select (one thread block per query row): the
// k_t = min(k, lengths[t]) highest scores among [0, lengths[t]) of row t, never selecting past
// lengths[t] (padding is never scanned; the register kernel reads 16-byte-aligned rows by whole
// float4s and ignores the up to 3 scores past lengths[t] in the last one, so such a row must be
// readable up to lengths[t] rounded up to 4: true whenever scores_stride % 4 == 0).
//
// Semantics equal ml4::cpu::topk on the same row (NaN ranks as -inf, -0 == +0, ties go to the
// lower position), but indices come out in ascending position order (what the attention
// kernel and ml4::CpuModel's sorted lists use), followed by -1 up to k. Outputs, either or both:
//   positions [T, out_stride]: the selected positions s;
//   slots     [T, out_stride]: cache slots block_table[seq][s / 64] * 64 + s % 64 (FlashMLA's
//             sparse indices), for the attention kernel to read directly;
//   counts    [T]: k_t.
// Method: four 8-bit radix passes over order-preserving u32 keys find the k-th largest key
// and how many of its ties to take; a block-wide scan then compacts in position order. When
// max_length (the longest row) is known and at most 16,384, each thread holds its 4-16 keys in
// registers: the row is read once, three passes of 11-bit digits touch no global memory
// (decode-sized rows), and a pass whose bin holds exactly the keys still wanted ends them.
// Long rows at small T (decode at long context) take a multi-block path when the caller gives
// a workspace: each row is cut into `splits` chunks, one block each; three radix passes (11,
// 11, 10 bits) add per-block histograms into the row's global histogram, and the last block of
// each pass to finish (an atomic ticket) picks the digit; then every block counts its keys
// above / equal to the threshold and writes its selected positions at the offset the blocks
// before it leave. Same result as the one-block kernel, bit for bit.
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
  // Multi-block path: a device workspace of at least topk_workspace_bytes(T, splits) bytes
  // (zeroed by topk itself). splits: 0 chooses from max_length (the longest row, known on the
  // host) and T; 1 forces one block per row. Without a workspace: one block per row.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int splits = 0;
  int64_t max_length = 0;  // >= every lengths[t], or 0 (unknown): picks the kernel and splits
  cudaStream_t stream = nullptr;
};
Status topk(const TopkParams& p);
// The split count topk picks for T rows of at most max_length scores (1: one block per row).
int topk_choose_splits(int64_t T, int64_t max_length);
size_t topk_workspace_bytes(int64_t T, int splits);
// The most workspace topk's own choice needs for any T <= max_T rows of <= max_length scores
// (0: it never leaves one block per row).
size_t topk_max_workspace_bytes(int64_t max_T, int64_t max_length);

}  // namespace ml4::cuda
