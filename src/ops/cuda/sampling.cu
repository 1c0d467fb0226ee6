// See sampling.h. One block per row; each thread scans a strided slice, then a
// shared-memory tree keeps (larger value, lower index): deterministic for any launch.
#include "ops/cuda/sampling.h"

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

__device__ __forceinline__ bool better(float a, int64_t ia, float b, int64_t ib) {
  const bool an = a != a, bn = b != b;
  if (an != bn) return bn;
  if (an) return ia < ib;
  return a > b || (a == b && ia < ib);
}

__global__ void argmax_kernel(const float* __restrict__ logits, int64_t V, int32_t* __restrict__ out) {
  __shared__ float sv[256];
  __shared__ int64_t si[256];
  const float* l = logits + blockIdx.x * V;
  float v = __int_as_float(0x7fc00000);
  int64_t i = INT64_MAX;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
    if (better(l[j], j, v, i)) {
      v = l[j];
      i = j;
    }
  sv[threadIdx.x] = v;
  si[threadIdx.x] = i;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s && better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x])) {
      sv[threadIdx.x] = sv[threadIdx.x + s];
      si[threadIdx.x] = si[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(si[0] == INT64_MAX ? 0 : si[0]);
}

}  // namespace

Status argmax_rows(const float* logits, int64_t B, int64_t V, int32_t* out, cudaStream_t stream) {
  if (B < 0 || V <= 0 || V > INT32_MAX) return invalid_argument("argmax_rows: bad shape B={} V={}", B, V);
  if (B == 0) return Status::ok();
  if (!logits || !out) return invalid_argument("argmax_rows: null pointer");
  argmax_kernel<<<static_cast<unsigned>(B), 256, 0, stream>>>(logits, V, out);
  return cuda_status(cudaGetLastError(), "argmax_kernel");
}

}  // namespace ml4::cuda
