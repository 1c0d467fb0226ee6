// See requant.h.
#include "ops/cuda/requant.h"
#include "ops/cuda/pdl.cuh"

#include <algorithm>
#include <climits>
#include <utility>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

__device__ __forceinline__ double e4m3_f64(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return static_cast<double>(__half2float(*reinterpret_cast<const __half*>(&h)));  // exact
}

// model/quant.cpp e2m1_from_f64: ties to even by '>' where the even neighbour is below.
__device__ __forceinline__ uint32_t e2m1_code(double v) {
  const double a = fabs(v);
  const uint32_t code = (a > 0.25) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0);
  return (signbit(v) ? 8u : 0u) | code;
}

// One thread per (row, 32-group).
__global__ void requant_kernel(const uint8_t* __restrict__ w, const float* __restrict__ scale, int64_t N, int64_t K,
                               int64_t kb, uint8_t* __restrict__ out_w, uint8_t* __restrict__ out_s,
                               unsigned long long* __restrict__ first_bad) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t groups = K / 32;
  for (int64_t gid = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; gid < N * groups;
       gid += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = gid / groups, j = gid % groups;
    const double s = scale[(n / 128) * kb + (j * 32) / 128];
    const uint4* src = reinterpret_cast<const uint4*>(w + n * K + j * 32);
    const uint4 b0 = src[0], b1 = src[1];
    const uint32_t words[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
    double x[32];
    double amax = 0.0;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      x[i] = e4m3_f64(static_cast<uint8_t>(words[i / 4] >> (8 * (i % 4)))) * s;
      if (!isfinite(x[i])) {
        atomicMin(first_bad, static_cast<unsigned long long>(n * K + j * 32 + i));
        x[i] = 0.0;
      }
      amax = fmax(amax, fabs(x[i]));
    }
    int e = 0;
    if (amax > 0.0) e = min(max(ilogb(amax) - 2, -127), 127);
    out_s[n * groups + j] = static_cast<uint8_t>(e + 127);
    const double inv = scalbn(1.0, -e);
    uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const uint32_t byte = e2m1_code(x[i] * inv) | (e2m1_code(x[i + 1] * inv) << 4);
      packed[i / 8] |= byte << (8 * ((i / 2) % 4));
    }
    *reinterpret_cast<uint4*>(out_w + n * (K / 2) + j * 16) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

}  // namespace

Result<DeviceLinear> requantize_fp8_to_mxfp4_device(const DeviceLinear& fp8, cudaStream_t stream) {
  if (fp8.format != LinearFormat::kFP8Block)
    return invalid_argument("{}: requantize to MXFP4 needs an FP8 block weight, got {}", fp8.name,
                            linear_format_name(fp8.format));
  const int64_t N = fp8.N, K = fp8.K;
  if (K % 128 != 0 || N <= 0) return invalid_argument("{}: FP8 weight [{}, {}] (K % 128 == 0)", fp8.name, N, K);
  DeviceLinear d;
  d.name = fp8.name;
  d.format = LinearFormat::kMXFP4;
  d.N = N;
  d.K = K;
  ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(N * K / 2));
  ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(N * (K / 32)));
  ML4_ASSIGN_OR_RETURN(DeviceBuffer flag, DeviceBuffer::alloc(sizeof(unsigned long long)));
  const unsigned long long none = ULLONG_MAX;
  ML4_RETURN_IF_ERROR(flag.upload(&none, sizeof(none)));
  const int64_t work = N * (K / 32);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((work + 255) / 256, 65535));
  launch_kernel(requant_kernel, blocks, 256, 0, stream, fp8.weight.as<uint8_t>(), fp8.scale.as<float>(), N, K, K / 128,
                d.weight.as<uint8_t>(), d.scale.as<uint8_t>(), flag.as<unsigned long long>());
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "requant_kernel"));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  unsigned long long bad = none;
  ML4_RETURN_IF_ERROR(flag.download(&bad, sizeof(bad)));
  if (bad != none)
    return invalid_argument("tensor {}: element ({}, {}) is not finite (a NaN e4m3 code or a non-finite block "
                            "scale): corrupt FP8 weight?",
                            fp8.name, bad / K, bad % K);
  return Result<DeviceLinear>(std::move(d));
}

}  // namespace ml4::cuda
