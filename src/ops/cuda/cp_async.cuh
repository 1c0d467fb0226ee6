// cp.async (sm_80+) for the kernels that stage 16-byte chunks in shared memory through a
// ring of commit groups: fp8_gemm.cu and moe_gemm.cu.
#pragma once

#include <cstdint>

namespace ml4::cuda {

// 16 bytes from src to shared address dst; !valid zero-fills them and reads nothing (src-size 0).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// The same at shared address dst + kOff (an immediate: one base register serves a row loop).
template <int kOff>
__device__ __forceinline__ void cp_async16_at(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0+%3], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n), "n"(kOff));
}
// 4 bytes from src to shared address dst (through L1: .ca); !valid zero-fills them.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace ml4::cuda
