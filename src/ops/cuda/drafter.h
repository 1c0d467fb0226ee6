// Small kernels of the DSpark drafter (MODEL.md section 5) on the GPU, each the twin of a CPU
// op in runtime/cpu/cpu_backend.cpp (the drafter's ops of ops/backend.h):
//   block_embed       : a draft block's input rows (slot 0 the token embedding, slots 1..B-1
//                       the per-slot mask embeddings)
//   block_window_slots: the cache slots each block token attends (the window before the anchor
//                       and the block itself, no causal mask) from a block table
//   gru_update        : torch.nn.GRUCell's update from the two gate projections
//   add_rows, fill    : elementwise
// Shapes in each params struct; row-major.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/status.h"

namespace ml4::cuda {

struct BlockEmbedParams {
  const void* table = nullptr;  // [V, D] bf16 or f32: the token embedding
  DType table_dtype = DType::kBF16;
  int64_t V = 0, D = 0;
  const int32_t* tokens = nullptr;  // [T]: only each block's first token is read
  const float* mask = nullptr;      // [B - 1, D]
  int64_t T = 0;
  int B = 0;                        // block size: token t is slot t % B
  float* out = nullptr;             // [T, D]
  cudaStream_t stream = nullptr;
};
Status block_embed(const BlockEmbedParams& p);

// For block token t (sequence t / B, anchor position anchor_pos[t / B]): the slots of
// positions [max(0, anchor - window), anchor + B) of its sequence's table
// (block_table[seq][pos / 64] * 64 + pos % 64), -1 padded to `stride`; counts[t] the number.
struct BlockWindowParams {
  const int32_t* block_table = nullptr;  // [num_seqs, bt_stride]
  int64_t bt_stride = 0;
  const int64_t* anchor_pos = nullptr;   // [num_seqs]
  int64_t T = 0;
  int B = 0;
  int64_t window = 0;
  int32_t* slots = nullptr;  // [T, stride]
  int64_t stride = 0;        // >= window + B
  int32_t* counts = nullptr; // [T]
  cudaStream_t stream = nullptr;
};
Status block_window_slots(const BlockWindowParams& p);

// s = (1 - z) n + z s with r, z, n from gi + b_ih and gh + b_hh ([rows, 3 r], gates r, z, n).
Status gru_update(const float* gi, const float* gh, const float* b_ih, const float* b_hh, int64_t rows, int64_t r,
                  float* s, cudaStream_t stream);
// y[i, :cols] += x[i, :cols].
Status add_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t rows, int64_t cols,
                cudaStream_t stream);
Status fill_f32(float* x, int64_t n, float value, cudaStream_t stream);

}  // namespace ml4::cuda
