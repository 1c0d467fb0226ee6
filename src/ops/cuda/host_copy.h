// Many small copies between mapped host memory and device buffers as one kernel launch
// (issue 19: a decode step's host share). A decode step's metadata (token ids, positions,
// slots, block tables, rows, sampling parameters) went up as ten-odd cudaMemcpyAsync calls from
// pageable vectors, each a driver call on the host and a copy on the card, in series before
// the forward; written into pinned, device-mapped host memory instead (DeviceBuffer::
// alloc_host_mapped), one launch reads every segment over the bus and writes it where the
// forward's graph expects it (CudaRunnerOptions::mapped_step_io; the sampler then writes its
// tokens into mapped memory itself).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"

namespace ml4::cuda {

struct CopySegment {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t bytes = 0;  // a multiple of 4; src and dst 4-byte aligned
};

constexpr int kMaxCopySegments = 16;

struct CopySegments {
  CopySegment seg[kMaxCopySegments];
  int n = 0;
  // Appends one (no-op for 0 bytes); false when full or misaligned.
  bool add(const void* src, void* dst, int64_t bytes);
};

// One block a segment; nothing when n is 0.
Status copy_segments(const CopySegments& s, cudaStream_t stream);

}  // namespace ml4::cuda
