#include "ops/cuda/hisparse.h"
#include "ops/cuda/pdl.cuh"

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

constexpr int kWarps = 8;  // rows per block

template <typename V>
__global__ void hot_gather_kernel(HotGatherParams p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= p.n) return;
  const int64_t s = p.src[i];
  const int32_t d = p.dst[i];
  if (s < 0 || s >= p.pool_rows || d < 0 || d >= p.hot_rows) return;
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const V* from = reinterpret_cast<const V*>(p.pool + s * p.row_bytes);
  V* to = reinterpret_cast<V*>(p.hot + static_cast<int64_t>(d) * p.row_bytes);
  for (int64_t w = threadIdx.x % 32; w < words; w += 32) to[w] = from[w];
}

}  // namespace

Status hot_gather(const HotGatherParams& p) {
  if (p.n == 0) return ok_status();
  if (p.pool == nullptr || p.hot == nullptr || p.src == nullptr || p.dst == nullptr || p.row_bytes <= 0)
    return invalid_argument("hot_gather: null buffer or empty rows");
  const unsigned blocks = static_cast<unsigned>((p.n + kWarps - 1) / kWarps);
  const bool wide = p.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.pool) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.hot) % 16 == 0;
  if (wide) {
    launch_kernel(hot_gather_kernel<uint4>, blocks, kWarps * 32, 0, p.stream, p);
  } else {
    launch_kernel(hot_gather_kernel<uint8_t>, blocks, kWarps * 32, 0, p.stream, p);
  }
  return cuda_status(cudaGetLastError(), "hot_gather");
}

}  // namespace ml4::cuda
