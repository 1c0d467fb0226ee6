// HiSparse's gather (SYSTEM.md S12; offload/hisparse.h): latent rows from the host pool
// (pinned, device-mapped memory) into a hot layer's rows in device memory, read by the kernel
// through unified addressing. Only the rows a step misses move, scattered over the pool, so
// a kernel reading them where they lie beats staging them for the copy engines (SparseServe's
// FlashH2D; FIELD-NOTES "Host offload for sparse attention"); bench/hisparse_gather_bench.cu
// measures both.
//
// One warp per row, 16-byte loads when the row size allows (656, 576 and 1,152 B rows all
// do). A pair out of range is skipped (the host side checks them before the upload).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"

namespace ml4::cuda {

struct HotGatherParams {
  const uint8_t* pool = nullptr;   // [pool_rows, row_bytes] host memory (mapped)
  uint8_t* hot = nullptr;          // [hot_rows, row_bytes] device memory
  const int64_t* src = nullptr;    // [n] pool rows
  const int32_t* dst = nullptr;    // [n] hot rows
  int64_t n = 0;
  int64_t row_bytes = 0;
  int64_t pool_rows = 0, hot_rows = 0;
  cudaStream_t stream = nullptr;
};

Status hot_gather(const HotGatherParams& p);

}  // namespace ml4::cuda
