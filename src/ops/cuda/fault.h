// Bounded device-side waits and the sticky fault word (SYSTEM.md S17, issue 19).
//
// A resident (persistent) kernel synchronises its blocks across the grid. If one block never
// arrives (a bug, a hardware fault, a block that was never scheduled), an unbounded spin hangs
// the card for every process. Here every wait has a bound: a block that has waited longer
// than the launch's timeout writes a fault record into host-mapped memory (FaultWord) and
// returns; every other waiting block sees the record and returns too, so the kernel ends and
// the stream stays usable. The record is sticky: the first fault wins, later ones leave it as
// it is, and only the host clears it. The host checks it after each launch it waits for (or
// polls it while one runs) and turns it into an error Status that names the wait.
//
// Device side: ops/cuda/fault.cuh (bounded_grid_sync). This file: the host's view, and a probe
// kernel that exercises the barrier with a test-only switch making one block never arrive.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {

enum FaultCode : uint32_t {
  kFaultNone = 0,
  kFaultWaitTimeout = 1,  // a bounded wait ran past its bound
};

// The record, 32 bytes of host-mapped memory. `claim` decides the first fault (atomicCAS);
// its writer fills block / site / waited_us, fences to the system, then sets `code`, so a
// host that sees code != 0 sees the rest.
struct DeviceFault {
  uint32_t code;
  uint32_t claim;
  uint32_t block;      // blockIdx.x of the block whose wait ran out
  uint32_t site;       // which wait (the kernel's own numbering)
  uint64_t waited_us;  // how long it waited
  uint64_t reserved;
};

// Default bound of a device-side wait (the 10 s).
inline constexpr uint64_t kDefaultWaitTimeoutNs = uint64_t{10} * 1000 * 1000 * 1000;

// Owns one DeviceFault in pinned, device-mapped host memory.
class FaultWord {
 public:
  static Result<FaultWord> create();
  DeviceFault* device() const { return static_cast<DeviceFault*>(mem_.data()); }
  // A snapshot (volatile reads: a kernel may be writing it).
  DeviceFault read() const;
  bool raised() const { return read().code != kFaultNone; }
  // OK when no fault is recorded, else an internal error naming the code, block, site and
  // wait, prefixed by `what`.
  Status status(const char* what) const;
  // Host only, while no kernel that may write it runs (tests; an engine stops instead).
  void clear();

 private:
  DeviceBuffer mem_;
};

// The grid barrier's state: 8 bytes of device memory, zeroed before each launch that uses it
// (a faulted launch leaves it mid-round).
struct GridBarrierState {
  unsigned int count;
  unsigned int generation;
};

// The probe: `blocks` co-resident blocks (a cooperative launch, refused by the driver when they
// cannot all be resident, which is what makes a grid barrier safe) run `rounds` rounds; in
// each, every block writes a value, passes the barrier, reads its neighbour's value and checks
// it, and passes the barrier again. never_arrive_block >= 0 is the test switch: that block
// returns before the barrier of round rounds / 2, so the others' waits must run out.
struct BarrierProbe {
  int blocks = 0;  // 0: one per multiprocessor
  int rounds = 100;
  int never_arrive_block = -1;
  uint64_t timeout_ns = kDefaultWaitTimeoutNs;
};

struct BarrierProbeResult {
  int64_t mismatches = 0;  // neighbour values that were not the round's (must be 0)
  int min_rounds = 0;      // rounds completed by the slowest block (all of them when no fault)
  int blocks = 0;
};

// Runs the probe on `stream` and waits for it. The fault (if any) is in `fault`; the result
// comes back either way. An error Status only for a launch or CUDA failure.
Result<BarrierProbeResult> run_barrier_probe(const BarrierProbe& p, const FaultWord& fault, cudaStream_t stream);

}  // namespace ml4::cuda
