// Hopper warpgroup MMA (wgmma, sm_90a) helpers: the one copy of the descriptor, fence, commit
// and wait encodings for every wgmma kernel (attention_prefill.cu, moe_gemm.cu, moe_gemm_fp4.cu),
// and the MMA shapes they use. Operands sit in shared memory with the 128-byte swizzle. Layouts
// (PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate", "Shared Memory Matrix
// Layout"; CUTLASS cute/arch/mma_sm90_desc.hpp names the same canonical forms):
//   K-major (A, or B with imm-trans-b 0): a tile of R rows x 128 bytes (64 bf16, 128 e4m3) is R/8
//     atoms of 8 rows x 128 bytes (1024 bytes, 1024-aligned); the 16-byte chunk c of row r sits at
//     chunk c ^ (r % 8). SBO = 1024 (atom to atom along the rows); LBO unused; a k step (k16 bf16,
//     k32 e4m3) is +32 bytes (descriptor + 2: the address field counts 16 bytes).
//   N-major (B with imm-trans-b 1, "((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))"): 64 N-elements
//     contiguous (128 bytes, same swizzle) per K-row, K-rows 128 bytes apart; SBO = bytes between
//     groups of 8 K-rows, LBO = bytes between 64-wide N blocks.
// Accumulators (m64nN f32): d[4j + e] holds row 16 * (warp % 4) + lane / 4 + 8 * (e / 2), column
// 8j + 2 * (lane % 4) + e % 2.
#pragma once

#include <cstdint>

namespace ml4::cuda::wgmma {

// Descriptor of a 128-byte-swizzled operand at shared address addr (1024-aligned atoms):
// start >> 4 (bits 0-13), LBO >> 4 (16-29), SBO >> 4 (32-45), layout 1 = 128-byte swizzle (62-63).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}
// K-major operand: 8-row atoms 1024 bytes apart.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t addr) { return desc_sw128(addr, 16, 1024); }

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy
// (wgmma operand reads) of this thread.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders the compiler's uses of the accumulators against the asynchronous MMAs (the registers
// are the MMA's outputs only once wait has returned).
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The asm operand lists of N f32 accumulators ("+f" constraints) and their register names.
#define ML4_WGMMA_ACC8(d, i)                                                                                \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define ML4_WGMMA_ACC16(d) ML4_WGMMA_ACC8(d, 0), ML4_WGMMA_ACC8(d, 8)
#define ML4_WGMMA_ACC32(d) ML4_WGMMA_ACC16(d), ML4_WGMMA_ACC8(d, 16), ML4_WGMMA_ACC8(d, 24)
#define ML4_WGMMA_ACC64(d) \
  ML4_WGMMA_ACC8(d, 0), ML4_WGMMA_ACC8(d, 8), ML4_WGMMA_ACC8(d, 16), ML4_WGMMA_ACC8(d, 24), ML4_WGMMA_ACC8(d, 32), \
      ML4_WGMMA_ACC8(d, 40), ML4_WGMMA_ACC8(d, 48), ML4_WGMMA_ACC8(d, 56)
#define ML4_WGMMA_ACC128(d) \
  ML4_WGMMA_ACC64(d), ML4_WGMMA_ACC8(d, 64), ML4_WGMMA_ACC8(d, 72), ML4_WGMMA_ACC8(d, 80), ML4_WGMMA_ACC8(d, 88), \
      ML4_WGMMA_ACC8(d, 96), ML4_WGMMA_ACC8(d, 104), ML4_WGMMA_ACC8(d, 112), ML4_WGMMA_ACC8(d, 120)
#define ML4_WGMMA_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define ML4_WGMMA_REGS32 ML4_WGMMA_REGS16 ", " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ML4_WGMMA_REGS64 ML4_WGMMA_REGS32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ML4_WGMMA_REGS128 ML4_WGMMA_REGS64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d[64 x 32] (+)= A[64 x 16] . B[16 x 32]: A and B K-major bf16.
__device__ __forceinline__ void m64n32k16_bf16(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" ML4_WGMMA_REGS16
               "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
               : ML4_WGMMA_ACC16(d)
               : "l"(da), "l"(db), "r"(accumulate));
}

// d[64 x 64] (+)= A[64 x 16] . B[64 x 16]^T: A and B K-major bf16.
__device__ __forceinline__ void m64n64k16_bf16(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" ML4_WGMMA_REGS32
               "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : ML4_WGMMA_ACC32(d)
               : "l"(da), "l"(db), "r"(accumulate));
}

// d[64 x 128] (+)= A[64 x 16] . B[128 x 16]^T: A and B K-major bf16.
__device__ __forceinline__ void m64n128k16_bf16(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" ML4_WGMMA_REGS64
               "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : ML4_WGMMA_ACC64(d)
               : "l"(da), "l"(db), "r"(accumulate));
}

// d[64 x 128] (+)= A[64 x 32] . B[128 x 32]^T: A and B K-major e4m3 (no transpose for 8-bit types).
__device__ __forceinline__ void m64n128k32_e4m3(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" ML4_WGMMA_REGS64 "}, %64, %65, p, 1, 1;\n}\n"
               : ML4_WGMMA_ACC64(d)
               : "l"(da), "l"(db), "r"(accumulate));
}

// d[64 x 64] (+)= A[64 x 32] . B[64 x 32]^T: A and B K-major e4m3.
__device__ __forceinline__ void m64n64k32_e4m3(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" ML4_WGMMA_REGS32 "}, %32, %33, p, 1, 1;\n}\n"
               : ML4_WGMMA_ACC32(d)
               : "l"(da), "l"(db), "r"(accumulate));
}

// d[64 x N] (+)= A[64 x 32] . B[N x 32]^T for N = 16, 32, ..., 160 (the swapped grouped GEMM's
// token counts): A and B K-major e4m3. The register lists past ML4_WGMMA_REGS64 and the
// specializations, one a line: N, its N / 2 accumulators, their names and operand list, and
// the operand numbers of da, db and accumulate.
#define ML4_WGMMA_REGS8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define ML4_WGMMA_REGS24 ML4_WGMMA_REGS16 ", " "%16, %17, %18, %19, %20, %21, %22, %23"
#define ML4_WGMMA_REGS40 ML4_WGMMA_REGS32 ", " "%32, %33, %34, %35, %36, %37, %38, %39"
#define ML4_WGMMA_REGS48 ML4_WGMMA_REGS40 ", " "%40, %41, %42, %43, %44, %45, %46, %47"
#define ML4_WGMMA_REGS56 ML4_WGMMA_REGS48 ", " "%48, %49, %50, %51, %52, %53, %54, %55"
#define ML4_WGMMA_REGS72 ML4_WGMMA_REGS64 ", " "%64, %65, %66, %67, %68, %69, %70, %71"
#define ML4_WGMMA_REGS80 ML4_WGMMA_REGS72 ", " "%72, %73, %74, %75, %76, %77, %78, %79"
template <int N>
__device__ __forceinline__ void m64nk32_e4m3(float (&d)[N / 2], uint64_t da, uint64_t db, int accumulate);
#define ML4_WGMMA_E4M3_N(N, NR, REGS, IA, IB, IP, ...)                                                                 \
  template <>                                                                                                          \
  __device__ __forceinline__ void m64nk32_e4m3<N>(float (&d)[NR], uint64_t da, uint64_t db, int accumulate) {          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IP ", 0;\n"                                                      \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" REGS "}, %" IA ", %" IB                  \
                 ", p, 1, 1;\n}\n"                                                                                     \
                 : __VA_ARGS__                                                                                         \
                 : "l"(da), "l"(db), "r"(accumulate));                                                                 \
  }
ML4_WGMMA_E4M3_N(16, 8, ML4_WGMMA_REGS8, "8", "9", "10", ML4_WGMMA_ACC8(d, 0))
ML4_WGMMA_E4M3_N(32, 16, ML4_WGMMA_REGS16, "16", "17", "18", ML4_WGMMA_ACC16(d))
ML4_WGMMA_E4M3_N(48, 24, ML4_WGMMA_REGS24, "24", "25", "26", ML4_WGMMA_ACC16(d), ML4_WGMMA_ACC8(d, 16))
ML4_WGMMA_E4M3_N(64, 32, ML4_WGMMA_REGS32, "32", "33", "34", ML4_WGMMA_ACC32(d))
ML4_WGMMA_E4M3_N(80, 40, ML4_WGMMA_REGS40, "40", "41", "42", ML4_WGMMA_ACC32(d), ML4_WGMMA_ACC8(d, 32))
ML4_WGMMA_E4M3_N(96, 48, ML4_WGMMA_REGS48, "48", "49", "50", ML4_WGMMA_ACC32(d), ML4_WGMMA_ACC8(d, 32),
                 ML4_WGMMA_ACC8(d, 40))
ML4_WGMMA_E4M3_N(112, 56, ML4_WGMMA_REGS56, "56", "57", "58", ML4_WGMMA_ACC32(d), ML4_WGMMA_ACC8(d, 32),
                 ML4_WGMMA_ACC8(d, 40), ML4_WGMMA_ACC8(d, 48))
ML4_WGMMA_E4M3_N(128, 64, ML4_WGMMA_REGS64, "64", "65", "66", ML4_WGMMA_ACC64(d))
ML4_WGMMA_E4M3_N(144, 72, ML4_WGMMA_REGS72, "72", "73", "74", ML4_WGMMA_ACC64(d), ML4_WGMMA_ACC8(d, 64))
ML4_WGMMA_E4M3_N(160, 80, ML4_WGMMA_REGS80, "80", "81", "82", ML4_WGMMA_ACC64(d), ML4_WGMMA_ACC8(d, 64),
                 ML4_WGMMA_ACC8(d, 72))
#undef ML4_WGMMA_E4M3_N

// d[64 x 256] (+)= A[64 x 16] . B[16 x 256]: A K-major, B N-major, bf16.
__device__ __forceinline__ void m64n256k16_bf16_bn(float (&d)[128], uint64_t da, uint64_t db, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" ML4_WGMMA_REGS128
               "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
               : ML4_WGMMA_ACC128(d)
               : "l"(da), "l"(db), "r"(accumulate));
}

// d[64 x 256] (+)= A[64 x 16] . B[16 x 256] with A in registers (a[4]: the bf16 pairs of an
// m64n16 accumulator fragment, a[0] row g cols 2t, 2t + 1; a[1] row g + 8; a[2], a[3] the same
// 8 columns on), B N-major bf16. The caller keeps a unchanged (fence_operands) until a wait
// has retired the MMA: the registers are read asynchronously.
__device__ __forceinline__ void m64n256k16_bf16_rs_bn(float (&d)[128], const uint32_t (&a)[4], uint64_t db,
                                                      int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" ML4_WGMMA_REGS128
               "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
               : ML4_WGMMA_ACC128(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

// The u32 form of fence_operands (register A fragments).
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

}  // namespace ml4::cuda::wgmma
