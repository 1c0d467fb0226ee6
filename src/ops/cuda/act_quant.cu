// See act_quant.h. One warp per (row, group): each lane holds group/32 values in
// registers (read once from memory), the amax is a warp shuffle reduction, and the lane
// writes its quantized bytes. Groups of 128 are DeepSeek's; the template covers 32..1024.
#include "ops/cuda/act_quant.h"
#include "ops/cuda/pdl.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

template <typename T> __device__ __forceinline__ float load_f(const T* p);
template <> __device__ __forceinline__ float load_f<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_f<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

template <typename T, int kPer>
__global__ void act_quant_kernel(const T* __restrict__ x, int64_t x_stride, int64_t M, int64_t rows, int64_t K,
                                 int group, int64_t n_groups, uint8_t* __restrict__ q, float* __restrict__ scale,
                                 bool group_major) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >> 5;
  if (warp >= rows * n_groups) return;
  const int64_t row = warp / n_groups, g = warp % n_groups;
  const int64_t k0 = g * group;
  const int64_t k1 = min(K, k0 + group);
  float v[kPer];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t k = k0 + i * 32 + lane;
    v[i] = k < k1 && row < M ? load_f(x + row * x_stride + k) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = fmaxf(amax, 1e-4f) / 448.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t k = k0 + i * 32 + lane;
    if (k < k1) q[row * K + k] = __nv_cvt_float_to_fp8(v[i] / s, __NV_SATFINITE, __NV_E4M3);
  }
  if (lane == 0) scale[group_major ? g * rows + row : row * n_groups + g] = s;
}

template <typename T, int kPer>
Status launch(const Fp8ActQuantParams& p, int64_t n_groups) {
  const int64_t rows = p.rows_out ? p.rows_out : p.M;
  const int64_t warps = rows * n_groups;
  const int threads = 256;
  const int64_t blocks = (warps * 32 + threads - 1) / threads;
  if (blocks > (int64_t{1} << 31) - 1) return invalid_argument("fp8_act_quant: {} groups is too many", warps);
  launch_kernel(act_quant_kernel<T, kPer>, static_cast<unsigned>(blocks), threads, 0, p.stream,
                static_cast<const T*>(p.x), p.x_stride ? p.x_stride : p.K, p.M, rows, p.K, p.group, n_groups,
                static_cast<uint8_t*>(p.q), p.scale, p.scale_layout == ScaleLayout::kGroupMajor);
  return cuda_status(cudaGetLastError(), "act_quant_kernel");
}

template <typename T>
Status dispatch(const Fp8ActQuantParams& p, int64_t n_groups) {
  switch (p.group / 32) {
    case 1: return launch<T, 1>(p, n_groups);
    case 2: return launch<T, 2>(p, n_groups);
    case 4: return launch<T, 4>(p, n_groups);
    case 8: return launch<T, 8>(p, n_groups);
    case 16: return launch<T, 16>(p, n_groups);
    case 32: return launch<T, 32>(p, n_groups);
    default: return invalid_argument("fp8_act_quant: group {} (32, 64, 128, 256, 512 or 1024)", p.group);
  }
}

}  // namespace

Status fp8_act_quant(const Fp8ActQuantParams& p) {
  if (p.M < 0 || p.K <= 0) return invalid_argument("fp8_act_quant: bad shape M={} K={}", p.M, p.K);
  if (p.group <= 0 || p.group % 32 != 0 || p.group > 1024 || (p.group & (p.group - 1)) != 0)
    return invalid_argument("fp8_act_quant: group {} (32, 64, 128, 256, 512 or 1024)", p.group);
  if (p.x_stride != 0 && p.x_stride < p.K) return invalid_argument("fp8_act_quant: stride {} < K {}", p.x_stride, p.K);
  if (p.rows_out != 0 && p.rows_out < p.M)
    return invalid_argument("fp8_act_quant: rows_out {} < M {}", p.rows_out, p.M);
  if (p.M == 0) return ok_status();
  if (!p.x || !p.q || !p.scale) return invalid_argument("fp8_act_quant: null pointer");
  const int64_t n_groups = (p.K + p.group - 1) / p.group;
  switch (p.x_dtype) {
    case DType::kF32: return dispatch<float>(p, n_groups);
    case DType::kBF16: return dispatch<__nv_bfloat16>(p, n_groups);
    default: return invalid_argument("fp8_act_quant: input dtype {} (f32 or bf16)", dtype_name(p.x_dtype));
  }
}

}  // namespace ml4::cuda
