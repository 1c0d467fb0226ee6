#include "ops/cuda/context_parallel.h"
#include "ops/cuda/pdl.cuh"

#include <math_constants.h>

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

constexpr int kThreads = 128;

// L = log sum_p exp(lse[p * stride]), the max taken out first; -inf when every part is empty.
__device__ float combined_lse(const float* lse, int n, int64_t stride) {
  float m = -CUDART_INF_F;
  for (int p = 0; p < n; ++p) m = fmaxf(m, lse[p * stride]);
  if (m == -CUDART_INF_F) return m;
  float sum = 0.0f;
  for (int p = 0; p < n; ++p) sum += expf(lse[p * stride] - m);
  return m + logf(sum);
}

__global__ void merge_kernel(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols, float* out) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const float* lse = parts + rows * cols + row;
  const float L = combined_lse(lse, n, part_stride);
  float* o = out + row * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float acc = 0.0f;
    if (L != -CUDART_INF_F) {
      for (int p = 0; p < n; ++p) {
        const float l = lse[p * part_stride];
        if (l == -CUDART_INF_F) continue;
        acc += expf(l - L) * parts[p * part_stride + row * cols + c];
      }
    }
    o[c] = acc;
  }
}

__global__ void rescale_kernel(float* out, const float* lse, const float* lse_all, int n, int64_t rows, int64_t cols) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const float L = combined_lse(lse_all + row, n, rows);
  const float l = lse[row];
  const float w = l == -CUDART_INF_F ? 0.0f : expf(l - L);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[row * cols + c] *= w;
}

}  // namespace

Status merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols, float* out,
                             cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return ok_status();
  if (n < 1) return invalid_argument("merge_attention_parts: {} parts", n);
  launch_kernel(merge_kernel, static_cast<unsigned>(rows), kThreads, 0, stream, parts, n, part_stride, rows, cols, out);
  return cuda_status(cudaGetLastError(), "merge_attention_parts");
}

Status rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows, int64_t cols,
                              cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return ok_status();
  if (n < 1) return invalid_argument("rescale_attention_part: {} parts", n);
  launch_kernel(rescale_kernel, static_cast<unsigned>(rows), kThreads, 0, stream, out, lse, lse_all, n, rows, cols);
  return cuda_status(cudaGetLastError(), "rescale_attention_part");
}

}  // namespace ml4::cuda
