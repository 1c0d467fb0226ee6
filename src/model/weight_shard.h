// WeightShard: the part of a checkpoint one rank of a parallel group loads (SYSTEM.md S10).
//
// Made by the parallel plan (parallel/parallel_plan.h) and read by load_model_weights, which
// binds only these slices: rows of a column-parallel linear (wq / wq_b and wkv_b by head, the
// dense and shared-expert w1 / w3, each routed expert's w1 / w3 under TP), columns of a
// row-parallel one (wo by head, w2), vocabulary rows of tok_embeddings and output, and, under
// expert parallelism, only this rank's routed experts. Row slices stay views into the mapped
// file (pages of other shards are never touched); column slices are copied out of it.
// Everything else (norms, the query and KV down-projections, the indexer, the router) is
// replicated. A slice must cut quantization blocks whole (FP8 128 x 128, NVFP4 16, MXFP4 32
// along the input), as vLLM requires; the loader names the tensor when one does not.
#pragma once

#include <cstdint>

namespace ml4 {

struct WeightShard {
  // [begin, begin + count) of each split dimension; count < 0: the whole dimension.
  int64_t head_begin = 0, heads = -1;                    // attention heads
  int64_t vocab_begin = 0, vocab = -1;                   // embedding / output rows
  int64_t dense_begin = 0, dense = -1;                   // dense FFN hidden
  int64_t expert_hidden_begin = 0, expert_hidden = -1;   // each routed expert's hidden (TP without EP)
  int64_t shared_begin = 0, shared = -1;                 // the shared experts' hidden
  int64_t expert_begin = 0, experts = -1;                // routed experts held (EP)
  bool whole() const {
    return heads < 0 && vocab < 0 && dense < 0 && expert_hidden < 0 && shared < 0 && experts < 0;
  }
};

}  // namespace ml4

#include "core/status.h"
#include "core/tensor.h"
#include "model/linear_weight.h"

namespace ml4 {

// Rows [row0, row0 + rows) of a 2-D tensor: a view keeping t's bytes alive.
Tensor slice_tensor_rows(const Tensor& t, int64_t row0, int64_t rows);
// Rows [row0, row0 + rows) of w (output features): views that keep w's storage alive.
// FP8 block weights need row0 % 128 == 0 and rows % 128 == 0 (or the slice ending at N).
Result<LinearWeight> slice_linear_rows(const LinearWeight& w, int64_t row0, int64_t rows);
// Columns [col0, col0 + cols) (input features): an owned copy. FP8 block weights need 128-column
// blocks whole, NVFP4 / MXFP4 their 16 / 32-value scale groups.
Result<LinearWeight> slice_linear_cols(const LinearWeight& w, int64_t col0, int64_t cols);

}  // namespace ml4
