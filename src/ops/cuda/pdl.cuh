// Programmatic dependent launch (PDL: Hopper, CUDA >= 12.3; issue 19, "each kernel issues its
// weight loads before waiting on its predecessor").
//
// A kernel started by launch_kernel() while programmatic_launch() is on may begin as soon as
// every block of the kernel before it on the stream has called pdl_launch_dependents() (or
// exited), instead of after that kernel's last block has drained: the next kernel's launch,
// block scheduling and prologue overlap the tail of the previous one. pdl_wait() then blocks
// until the previous grid has completed and its memory is visible. The rule for every kernel
// launched through launch_kernel(): call pdl_wait() before touching any memory another kernel
// of the step writes or reads; loads of read-only data (the weights) may come before it. Kernels here call
// pdl_wait() first and pdl_launch_dependents() right after it, so at most one kernel waits
// ahead of the one running. Without the attribute (switch off, or a non-PDL predecessor such as
// a cuBLASLt GEMM or a copy), both instructions are no-ops and the stream orders as usual.
// Stream capture records the attribute as a programmatic graph edge, so graphs keep it.
// Measured on the H200 (docs/BENCHMARKS.md, fifth session): 1.01x at batch 1 and 8, 0.92x at
// batch 64 on ml4-slice-4, so CudaRunnerOptions::programmatic_launch is off by default.
#pragma once
#include <utility>

#include <cuda_runtime.h>

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// `kernel<<<grid, block, smem, stream>>>(args...)`, with the PDL attribute when the switch is on.
template <typename... P, typename... A>
cudaError_t launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic_launch() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

}  // namespace ml4::cuda
