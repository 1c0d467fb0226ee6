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

// A grid-wide barrier for `nblocks` co-resident blocks. Every thread of the block calls it.
// Thread 0 reads the generation, arrives (atomicAdd), and the last arrival resets the count and
// advances the generation; the others spin until it moves, for at most timeout_ns, and stop
// early when any block has recorded a fault (read every 16th spin: it is host memory). Returns false when the barrier was not passed (a
// fault: this block's own timeout or another's): the caller must return from the kernel
// without touching memory the barrier was guarding. The count is reset before the generation
// advances (with a fence between), so a block that sees the new generation and arrives at the
// next barrier finds the count at 0.
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
      unsigned spins = 0;
      while (*gen == mine) {
        // The record is host memory (a bus round trip): looked at every 16th spin only, so a
        // passing barrier does not wait on it.
        if ((++spins & 15u) == 0 && fault_raised(fault)) {
          ok = false;
          break;
        }
        const uint64_t waited = global_ns() - t0;
        if (waited > timeout_ns) {
          raise_fault(fault, kFaultWaitTimeout, site, waited);
          ok = false;
          break;
        }
        __nanosleep(64);
      }
    }
    __threadfence();
    passed = ok ? 1 : 0;
  }
  __syncthreads();
  return passed != 0;
}

}  // namespace ml4::cuda
