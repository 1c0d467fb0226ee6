// Pieces the MoE grouped GEMMs share (moe_gemm.cu: FP8 block; moe_gemm_fp4.cu: NVFP4 /
// MXFP4 expanded to bf16): Hopper's wgmma fences and the shared-memory matrix descriptor.
// Both kernels keep their operands K-major in the 128-byte swizzle (PTX ISA, "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate"): a tile of R rows x 128 bytes is R/8 atoms of
// 8 rows x 128 bytes (1024 bytes, 1024-aligned), the 16-byte chunk c of row r at chunk
// c ^ (r % 8); each 32-byte k step (k32 e4m3, k16 bf16) starts 32 bytes further into the rows
// (descriptor + 2: the address field counts 16 bytes).
#pragma once

#include <cstdint>

namespace ml4::cuda::moe_gemm_detail {

// Shared-memory matrix descriptor: start address, LBO (unused by swizzled K-major operands
// whose k step stays inside the 128-byte row), SBO = 1024 bytes between 8-row atoms,
// layout 1 = 128-byte swizzle.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to the tensor cores.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders the compiler's uses of the accumulators against the asynchronous MMAs (the
// registers are the MMA's outputs only once wgmma.wait_group has returned).
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace ml4::cuda::moe_gemm_detail
