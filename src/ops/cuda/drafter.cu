// See drafter.h. The GRU is evaluated in f64 like the CPU reference (a few hundred values per
// row: the cost is nothing next to the Markov head's output GEMV).
#include "ops/cuda/drafter.h"
#include "ops/cuda/pdl.cuh"

#include <cuda_bf16.h>

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void block_embed_kernel(const T* __restrict__ table, int64_t V, int64_t D, const int32_t* __restrict__ tokens,
                                   const float* __restrict__ mask, int B, float* __restrict__ out) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int slot = static_cast<int>(t % B);
  float* o = out + t * D;
  if (slot > 0) {
    const float* m = mask + static_cast<int64_t>(slot - 1) * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) o[d] = m[d];
    return;
  }
  const int32_t id = tokens[t];
  const bool ok = id >= 0 && id < V;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float v;
    if (!ok) {
      v = __int_as_float(0x7fc00000);
    } else if constexpr (sizeof(T) == 4) {
      v = table[id * D + d];
    } else {
      v = __bfloat162float(table[id * D + d]);
    }
    o[d] = v;
  }
}

__global__ void block_window_kernel(BlockWindowParams p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int64_t seq = t / p.B;
  const int64_t anchor = p.anchor_pos[seq];
  const int64_t lo = anchor - p.window > 0 ? anchor - p.window : 0;
  const int64_t n = anchor + p.B - lo;
  const int32_t* bt = p.block_table + seq * p.bt_stride;
  int32_t* out = p.slots + t * p.stride;
  for (int64_t i = threadIdx.x; i < p.stride; i += blockDim.x) {
    int32_t v = -1;
    if (i < n) {
      const int64_t pos = lo + i;
      const int32_t b = bt[pos / 64];
      v = b < 0 ? -1 : static_cast<int32_t>(b * 64 + pos % 64);
    }
    out[i] = v;
  }
  if (threadIdx.x == 0) p.counts[t] = static_cast<int32_t>(n);
}

__global__ void gru_kernel(const float* __restrict__ gi, const float* __restrict__ gh, const float* __restrict__ b_ih,
                           const float* __restrict__ b_hh, int64_t rows, int64_t r, float* __restrict__ s) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * r) return;
  const int64_t row = i / r, k = i % r;
  const float* a = gi + row * 3 * r;
  const float* h = gh + row * 3 * r;
  const double rg = 1.0 / (1.0 + exp(-(static_cast<double>(a[k]) + b_ih[k] + h[k] + b_hh[k])));
  const double zg = 1.0 / (1.0 + exp(-(static_cast<double>(a[r + k]) + b_ih[r + k] + h[r + k] + b_hh[r + k])));
  const double ng = tanh(static_cast<double>(a[2 * r + k]) + b_ih[2 * r + k] + rg * (h[2 * r + k] + b_hh[2 * r + k]));
  s[i] = static_cast<float>((1.0 - zg) * ng + zg * s[i]);
}

__global__ void add_rows_kernel(float* y, int64_t ys, const float* x, int64_t xs, int64_t rows, int64_t cols) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t row = i / cols, c = i % cols;
  y[row * ys + c] += x[row * xs + c];
}

__global__ void fill_kernel(float* x, int64_t n, float v) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = v;
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

Status block_embed(const BlockEmbedParams& p) {
  if (p.T <= 0) return ok_status();
  if (p.B < 1 || p.D <= 0) return invalid_argument("block_embed: B {} D {}", p.B, p.D);
  switch (p.table_dtype) {
    case DType::kF32:
      launch_kernel(block_embed_kernel<float>, static_cast<unsigned>(p.T), kThreads, 0, p.stream,
                    static_cast<const float*>(p.table), p.V, p.D, p.tokens, p.mask, p.B, p.out);
      break;
    case DType::kBF16:
      launch_kernel(block_embed_kernel<__nv_bfloat16>, static_cast<unsigned>(p.T), kThreads, 0, p.stream,
                    static_cast<const __nv_bfloat16*>(p.table), p.V, p.D, p.tokens, p.mask, p.B, p.out);
      break;
    default:
      return invalid_argument("block_embed: table dtype {} (bf16 or f32)", dtype_name(p.table_dtype));
  }
  return cuda_status(cudaGetLastError(), "block_embed_kernel");
}

Status block_window_slots(const BlockWindowParams& p) {
  if (p.T <= 0) return ok_status();
  if (p.stride < p.window + p.B) return invalid_argument("block_window_slots: stride {} < window {} + B {}", p.stride, p.window, p.B);
  launch_kernel(block_window_kernel, static_cast<unsigned>(p.T), kThreads, 0, p.stream, p);
  return cuda_status(cudaGetLastError(), "block_window_kernel");
}

Status gru_update(const float* gi, const float* gh, const float* b_ih, const float* b_hh, int64_t rows, int64_t r,
                  float* s, cudaStream_t stream) {
  if (rows * r <= 0) return ok_status();
  launch_kernel(gru_kernel, blocks_for(rows * r), kThreads, 0, stream, gi, gh, b_ih, b_hh, rows, r, s);
  return cuda_status(cudaGetLastError(), "gru_kernel");
}

Status add_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t rows, int64_t cols,
                cudaStream_t stream) {
  if (rows * cols <= 0) return ok_status();
  launch_kernel(add_rows_kernel, blocks_for(rows * cols), kThreads, 0, stream, y, y_stride, x, x_stride, rows, cols);
  return cuda_status(cudaGetLastError(), "add_rows_kernel");
}

Status fill_f32(float* x, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return ok_status();
  launch_kernel(fill_kernel, blocks_for(n), kThreads, 0, stream, x, n, value);
  return cuda_status(cudaGetLastError(), "fill_kernel");
}

}  // namespace ml4::cuda
