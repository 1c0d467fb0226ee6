// See host_copy.h.
#include "ops/cuda/host_copy.h"

#include <cstdint>

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {

bool CopySegments::add(const void* src, void* dst, int64_t bytes) {
  if (bytes == 0) return true;
  if (n >= kMaxCopySegments || bytes < 0 || bytes % 4 != 0 || reinterpret_cast<uintptr_t>(src) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(dst) % 4 != 0)
    return false;
  seg[n++] = CopySegment{src, dst, bytes};
  return true;
}

namespace {

// Block b copies segment b: 16-byte words where both ends allow it (the bus moves whole
// transactions), else 4-byte words.
__global__ void copy_segments_kernel(CopySegments s) {
  const CopySegment g = s.seg[blockIdx.x];
  const bool wide = g.bytes % 16 == 0 && reinterpret_cast<uintptr_t>(g.src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(g.dst) % 16 == 0;
  if (wide) {
    const int4* src = static_cast<const int4*>(g.src);
    int4* dst = static_cast<int4*>(g.dst);
    for (int64_t i = threadIdx.x; i < g.bytes / 16; i += blockDim.x) dst[i] = src[i];
  } else {
    const int32_t* src = static_cast<const int32_t*>(g.src);
    int32_t* dst = static_cast<int32_t*>(g.dst);
    for (int64_t i = threadIdx.x; i < g.bytes / 4; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

Status copy_segments(const CopySegments& s, cudaStream_t stream) {
  if (s.n <= 0) return ok_status();
  copy_segments_kernel<<<s.n, 256, 0, stream>>>(s);
  return cuda_status(cudaGetLastError(), "copy_segments");
}

}  // namespace ml4::cuda
