// See fault.h.
#include "ops/cuda/fault.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/cuda/fault.cuh"

namespace ml4::cuda {

Result<FaultWord> FaultWord::create() {
  FaultWord w;
  ML4_ASSIGN_OR_RETURN(w.mem_, DeviceBuffer::alloc_host_mapped(sizeof(DeviceFault)));
  w.clear();
  return std::move(w);  // nvcc (C++17) needs the move into Result
}

DeviceFault FaultWord::read() const {
  const volatile DeviceFault* v = device();
  DeviceFault f;
  f.code = v->code;
  f.claim = v->claim;
  f.block = v->block;
  f.site = v->site;
  f.waited_us = v->waited_us;
  f.reserved = v->reserved;
  return f;
}

Status FaultWord::status(const char* what) const {
  const DeviceFault f = read();
  if (f.code == kFaultNone) return ok_status();
  if (f.code == kFaultWaitTimeout)
    return internal_error("{}: device fault: block {} waited {:.3f} s at wait site {} and gave up (a block never arrived)",
                          what, f.block, static_cast<double>(f.waited_us) * 1e-6, f.site);
  return internal_error("{}: device fault: code {} (block {}, site {})", what, f.code, f.block, f.site);
}

void FaultWord::clear() { std::memset(mem_.data(), 0, sizeof(DeviceFault)); }

namespace {

constexpr int kProbeThreads = 128;

// Round r: block b writes r * blocks + b to data[b]; barrier (site 2r); reads data[(b + 1) %
// blocks] and counts a mismatch; barrier (site 2r + 1) so nobody overwrites a value before its
// reader has read it. The test switch: never_arrive returns before round rounds / 2's first
// barrier.
__global__ void __launch_bounds__(kProbeThreads)
    barrier_probe_kernel(GridBarrierState* bar, DeviceFault* fault, uint64_t timeout_ns, int rounds, int never_arrive,
                         int* data, unsigned long long* mismatches, int* done) {
  const unsigned n = gridDim.x;
  const int b = static_cast<int>(blockIdx.x);
  int r = 0;
  for (; r < rounds; ++r) {
    if (b == never_arrive && r == rounds / 2) break;
    if (threadIdx.x == 0) {
      *reinterpret_cast<volatile int*>(&data[b]) = r * static_cast<int>(n) + b;
      __threadfence();
    }
    if (!bounded_grid_sync(bar, n, fault, timeout_ns, static_cast<uint32_t>(2 * r))) break;
    if (threadIdx.x == 0) {
      const int nb = (b + 1) % static_cast<int>(n);
      const int got = *reinterpret_cast<volatile int*>(&data[nb]);
      if (got != r * static_cast<int>(n) + nb) atomicAdd(mismatches, 1ull);
    }
    if (!bounded_grid_sync(bar, n, fault, timeout_ns, static_cast<uint32_t>(2 * r + 1))) break;
  }
  if (threadIdx.x == 0) done[b] = r;
}

}  // namespace

Result<BarrierProbeResult> run_barrier_probe(const BarrierProbe& p, const FaultWord& fault, cudaStream_t stream) {
  int per_sm = 0;
  ML4_RETURN_IF_ERROR(cuda_status(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, barrier_probe_kernel, kProbeThreads, 0), "occupancy"));
  const int most = per_sm * sm_count();
  const int blocks = p.blocks > 0 ? p.blocks : sm_count();
  if (blocks <= 0 || blocks > most || p.rounds <= 0 || p.never_arrive_block >= blocks)
    return invalid_argument("barrier probe: {} blocks (1..{} co-resident), {} rounds, never-arrive block {}", blocks,
                            most, p.rounds, p.never_arrive_block);
  ML4_ASSIGN_OR_RETURN(DeviceBuffer bar, DeviceBuffer::alloc(sizeof(GridBarrierState)));
  ML4_ASSIGN_OR_RETURN(DeviceBuffer data, DeviceBuffer::alloc(sizeof(int) * blocks));
  ML4_ASSIGN_OR_RETURN(DeviceBuffer mism, DeviceBuffer::alloc(sizeof(unsigned long long)));
  ML4_ASSIGN_OR_RETURN(DeviceBuffer done, DeviceBuffer::alloc(sizeof(int) * blocks));
  ML4_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(bar.data(), 0, bar.bytes(), stream), "probe memset"));
  ML4_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(data.data(), 0xFF, data.bytes(), stream), "probe memset"));
  ML4_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(mism.data(), 0, mism.bytes(), stream), "probe memset"));
  ML4_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(done.data(), 0, done.bytes(), stream), "probe memset"));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kProbeThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  ML4_RETURN_IF_ERROR(cuda_status(
      cudaLaunchKernelEx(&cfg, barrier_probe_kernel, bar.as<GridBarrierState>(), fault.device(), p.timeout_ns, p.rounds,
                         p.never_arrive_block, data.as<int>(), mism.as<unsigned long long>(), done.as<int>()),
      "barrier_probe_kernel"));
  ML4_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream), "barrier_probe_kernel"));
  BarrierProbeResult r;
  r.blocks = blocks;
  unsigned long long m = 0;
  ML4_RETURN_IF_ERROR(mism.download(&m, sizeof(m)));
  r.mismatches = static_cast<int64_t>(m);
  std::vector<int> d(static_cast<size_t>(blocks));
  ML4_RETURN_IF_ERROR(done.download(d.data(), d.size() * sizeof(int)));
  r.min_rounds = *std::min_element(d.begin(), d.end());
  return r;
}

}  // namespace ml4::cuda
