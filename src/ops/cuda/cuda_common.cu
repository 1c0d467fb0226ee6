// See cuda_common.h.
#include "ops/cuda/cuda_common.h"

#include "ops/cuda/pdl.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cstring>
#include <utility>

namespace ml4::cuda {

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ok_status();
  return internal_error("CUDA error {} ({}) in {}", static_cast<int>(err), cudaGetErrorString(err),
                        what);
}

Result<double> stream_ms(cudaStream_t stream, const std::function<Status()>& fn) {
  struct Events {
    cudaEvent_t start = nullptr, end = nullptr;
    ~Events() {
      if (start) cudaEventDestroy(start);
      if (end) cudaEventDestroy(end);
    }
  } ev;
  ML4_CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev.start));
  ML4_CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev.end));
  ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.start, stream));
  ML4_RETURN_IF_ERROR(fn());
  ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.end, stream));
  ML4_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ev.end));
  float ms = 0.0f;
  ML4_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, ev.start, ev.end));
  return static_cast<double>(ms);
}

bool device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

namespace {
std::atomic<bool> g_programmatic_launch{false};
}  // namespace

void set_programmatic_launch(bool on) { g_programmatic_launch.store(on, std::memory_order_relaxed); }
bool programmatic_launch() { return g_programmatic_launch.load(std::memory_order_relaxed); }

int sm_count() {
  static int cached = -1;
  if (cached < 0) {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      n = 0;
    }
    cached = n;
  }
  return cached;
}

void DeviceBuffer::release() {
  if (ptr_) host_ ? cudaFreeHost(ptr_) : cudaFree(ptr_);
  ptr_ = nullptr;
}
DeviceBuffer::~DeviceBuffer() { release(); }
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), host_(std::exchange(o.host_, false)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    release();
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    host_ = std::exchange(o.host_, false);
  }
  return *this;
}

// Pinned host memory mapped into the device's address space: with unified addressing the
// host pointer is the device pointer, so kernels read and write it over the bus (HiSparse's
// host pool, offload/hisparse.h).
Result<DeviceBuffer> DeviceBuffer::alloc_host_mapped(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return std::move(b);
  cudaError_t e = cudaHostAlloc(&b.ptr_, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    b.ptr_ = nullptr;
    return resource_exhausted("cudaHostAlloc of {} bytes (pinned host memory) failed: {}", bytes, cudaGetErrorString(e));
  }
  void* dev = nullptr;
  e = cudaHostGetDevicePointer(&dev, b.ptr_, 0);
  if (e != cudaSuccess || dev != b.ptr_) {
    cudaGetLastError();
    cudaFreeHost(b.ptr_);
    b.ptr_ = nullptr;
    return unimplemented("pinned host memory is not addressable by the device at its host address (no unified addressing)");
  }
  b.bytes_ = bytes;
  b.host_ = true;
  return std::move(b);
}

Result<DeviceBuffer> DeviceBuffer::alloc(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return std::move(b);
  cudaError_t e = cudaMalloc(&b.ptr_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    b.ptr_ = nullptr;
    return resource_exhausted("cudaMalloc of {} bytes failed: {}", bytes, cudaGetErrorString(e));
  }
  b.bytes_ = bytes;
  return std::move(b);
}

Status DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  if (offset + bytes > bytes_)
    return out_of_range("upload of {} bytes at {} into a {}-byte buffer", bytes, offset, bytes_);
  return cuda_status(cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice),
                     "DeviceBuffer::upload");
}

Status DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  if (offset + bytes > bytes_)
    return out_of_range("download of {} bytes at {} from a {}-byte buffer", bytes, offset, bytes_);
  return cuda_status(cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost),
                     "DeviceBuffer::download");
}

Status DeviceBuffer::fill_bytes(uint8_t value) {
  if (!ptr_) return ok_status();
  if (host_) {
    std::memset(ptr_, value, bytes_);
    return ok_status();
  }
  return cuda_status(cudaMemset(ptr_, value, bytes_), "DeviceBuffer::fill_bytes");
}

namespace {

// splitmix64 of (seed, i): a counter-based generator, so every element is independent of
// the launch shape.
__device__ __forceinline__ float uniform01(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

template <typename T>
__global__ void fill_uniform_kernel(T* x, int64_t n, uint64_t seed, float lo, float hi) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = lo + (hi - lo) * uniform01(seed, static_cast<uint64_t>(i));
    if constexpr (std::is_same_v<T, float>) {
      x[i] = v;
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      x[i] = __float2bfloat16_rn(v);
    } else {
      x[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

template <typename T>
Status launch_fill(T* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s) {
  if (n <= 0) return ok_status();
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 8192);
  launch_kernel(fill_uniform_kernel<T>, static_cast<int>(blocks), threads, 0, s, x, n, seed, lo, hi);
  return cuda_status(cudaGetLastError(), "fill_uniform_kernel");
}

}  // namespace

Status fill_uniform_f32(float* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s) {
  return launch_fill(x, n, seed, lo, hi, s);
}
Status fill_uniform_bf16(void* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s) {
  return launch_fill(static_cast<__nv_bfloat16*>(x), n, seed, lo, hi, s);
}
Status fill_uniform_e4m3(void* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s) {
  return launch_fill(static_cast<__nv_fp8_storage_t*>(x), n, seed, lo, hi, s);
}

}  // namespace ml4::cuda
