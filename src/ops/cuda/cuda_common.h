// Shared plumbing of the CUDA backend: CUDA return codes -> Status, device presence,
// an owning device buffer, and random fills used by tests and benchmarks.
//
// Every fallible call of the backend returns a Status (STYLE.md rule 6): a CUDA error
// becomes kInternal with the call's text and cudaGetErrorString, never an abort. Code in
// this folder is compiled as C++17 by nvcc (fmt's consteval format strings do not pass
// nvcc in C++20 mode), so headers here stay C++17-clean.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include <cuda_runtime.h>

#include "core/status.h"

namespace ml4::cuda {

Status cuda_status(cudaError_t err, const char* what);

// True when the CUDA runtime sees at least one device (tests GTEST_SKIP otherwise).
bool device_available();

// Multiprocessor count of the current device (cached after the first call; 0 if none).
int sm_count();

// The GPU milliseconds of what fn enqueues on `stream`: events before and after, then a wait
// for the second. fn's failure is the result's.
Result<double> stream_ms(cudaStream_t stream, const std::function<Status()>& fn);

// True when p sits on a 16-byte boundary (the float4 / uint4 paths of the kernels).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Programmatic dependent launch for our kernels (pdl.cuh), process-wide: each CudaRunner step
// sets its CudaRunnerOptions::programmatic_launch. Read at each launch, so a captured graph
// keeps the setting it was captured with.
void set_programmatic_launch(bool on);
bool programmatic_launch();

// Owns one cudaMalloc'd allocation; moves, never copies.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  static Result<DeviceBuffer> alloc(size_t bytes);
  // Pinned, device-mapped host memory (cudaHostAlloc), at one address for host and device.
  static Result<DeviceBuffer> alloc_host_mapped(size_t bytes);

  void* data() const { return ptr_; }
  template <typename T> T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  bool empty() const { return ptr_ == nullptr; }
  bool host() const { return host_; }

  Status upload(const void* host, size_t bytes, size_t offset = 0);
  Status download(void* host, size_t bytes, size_t offset = 0) const;
  Status fill_bytes(uint8_t value);  // cudaMemset: 0xFF poisons f32/bf16 with NaN

 private:
  void release();
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool host_ = false;
};

// Fills n values with a counter-based hash of (seed, i) mapped to uniform [lo, hi), in
// place on the device (benchmarks: random data, never zeros; METHOD.md).
Status fill_uniform_f32(float* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s);
Status fill_uniform_bf16(void* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s);
// e4m3 bytes of uniform values in [lo, hi) (rounded RNE, saturating).
Status fill_uniform_e4m3(void* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s);

}  // namespace ml4::cuda

#define ML4_CUDA_RETURN_IF_ERROR(expr) ML4_RETURN_IF_ERROR(::ml4::cuda::cuda_status((expr), #expr))
