// Small elementwise / reduction ops of the CPU backend: softmax, SwiGLU's silu*up,
// top-k selection, and the embedding gather.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace ml4::cpu {

// x = softmax(x): max-subtracted, the sum in f64. n == 0 is a no-op.
void softmax_inplace(float* x, int64_t n);

// out[i] = silu(g[i]) * u[i], silu(v) = v / (1 + exp(-v)). out may alias g or u.
void silu_mul(const float* g, const float* u, int64_t n, float* out);

// The k highest scores' indices, in descending score order. Ties go to the lower index
// (so the result is deterministic and matches a stable sort); NaN ranks below
// everything. k > n fills idx[n..k) with -1; k <= 0 writes nothing.
void topk(const float* scores, int64_t n, int k, int32_t* idx);

// The same indices as topk(scores, n, k), in ascending index order (k > n: the n indices, no
// -1 filler; idx needs min(k, n) entries).
void topk_set(const float* scores, int64_t n, int k, int32_t* idx);

// out[t] = table[ids[t]] as f32; table is [V, D] bf16 or f32. An id outside [0, V) or
// another table dtype is a caller bug (the engine validates ids at admission): that row
// is written as NaN and logged, never read out of bounds.
void embedding_lookup(const Tensor& table, const int32_t* ids, int64_t T, float* out);

}  // namespace ml4::cpu
