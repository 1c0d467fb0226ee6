// Device side of ops/cuda/fault.h: the clock, the sticky fault record and a grid barrier whose
// waits are bounded. For kernels whose blocks are all resident at once (a cooperative launch).
#pragma once

#include <cstdint>

#include "ops/cuda/fault.h"

namespace ml4::cuda {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool fault_raised(const DeviceFault* f) {
  return *reinterpret_cast<const volatile uint32_t*>(&f->code) != kFaultNone;
}

// Records a fault unless one is recorded already (the first one wins and stays).
__device__ __forceinline__ void raise_fault(DeviceFault* f, uint32_t code, uint32_t site, uint64_t waited_ns) {
  if (atomicCAS(&f->claim, 0u, 1u) != 0u) return;
  volatile DeviceFault* v = f;
  v->block = blockIdx.x;
  v->site = site;
  v->waited_us = waited_ns / 1000;
  __threadfence_system();
  v->code = code;
  __threadfence_system();
}

// How long a waiting block looks only at the barrier before it also polls the fault record
// (host memory: each look is a bus round trip), and its longest sleep between looks.
inline constexpr uint64_t kFaultPollAfterNs = 20000;
inline constexpr unsigned kMaxSpinSleepNs = 1024;

// A grid-wide barrier for `nblocks` co-resident blocks. Every thread of the block calls it.
// Thread 0 reads the generation, arrives (atomicAdd), and the last arrival resets the count and
// advances the generation; the others spin until it moves, for at most timeout_ns, and stop
// early when any block has recorded a fault. The spin backs off (sleeps of 32 ns doubling to
// kMaxSpinSleepNs) and polls the fault record only after kFaultPollAfterNs, every 16th look:
// with hundreds of blocks looking at one L2 line and at host memory without pause, the
// blocks still working crawled (the resident FFN kernel, issue 19: an ml4 MoE layer took 4.8
// ms, its warps waiting at barriers 72% of their cycles; 0.33 ms with the back-off;
// docs/BENCHMARKS.md). Returns false when the barrier was not passed (a fault: this block's
// own timeout or another's): the caller must return from the kernel without touching memory
// the barrier was guarding. The count is reset before the generation advances (with a fence
// between), so a block that sees the new generation and arrives at the next barrier finds the
// count at 0.
__device__ __forceinline__ bool bounded_grid_sync(GridBarrierState* bar, unsigned nblocks, DeviceFault* fault,
                                                  uint64_t timeout_ns, uint32_t site) {
  __shared__ int passed;
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* gen = &bar->generation;
    const unsigned mine = *gen;
    __threadfence();
    bool ok = true;
    if (atomicAdd(&bar->count, 1u) + 1 == nblocks) {
      atomicExch(&bar->count, 0u);
      __threadfence();
      atomicAdd(&bar->generation, 1u);
    } else {
      const uint64_t t0 = global_ns();
      unsigned spins = 0, sleep_ns = 32;
      while (*gen == mine) {
        const uint64_t waited = global_ns() - t0;
        if (waited > timeout_ns) {
          raise_fault(fault, kFaultWaitTimeout, site, waited);
          ok = false;
          break;
        }
        if (waited > kFaultPollAfterNs && (++spins & 15u) == 0 && fault_raised(fault)) {
          ok = false;
          break;
        }
        __nanosleep(sleep_ns);
        sleep_ns = min(2 * sleep_ns, kMaxSpinSleepNs);
      }
    }
    __threadfence();
    passed = ok ? 1 : 0;
  }
  __syncthreads();
  return passed != 0;
}

}  // namespace ml4::cuda
