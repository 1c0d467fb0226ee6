// The CUDA-core weight stream for NVFP4 / MXFP4 weights (included by gemv.cu only; gemv.h
// has the public API). gemv_stream.cuh's layout, 8 weights (4 bytes of e2m1) per thread
// unit instead of 4: a block of kStWarps warps owns R consecutive rows and splits K among its
// threads, thread t reading unit q = t + i * kStThreads (one warp instruction covers 256
// consecutive k of a row, coalesced) and the 8 f32 x it needs as two float4; all of a batch's
// loads are issued before any is used; partial sums meet in a fixed order (shuffle tree, then
// the warps in shared memory): bit-deterministic. Any number of rows (tokens): passes of M.
//
// Exact decoding, as cpu::linear (model/linear_weight.h): an e2m1 nibble (sign, 2 exponent
// bits with bias 1, 1 mantissa bit) placed at f16 bits 15 and 11..9 is the value times 2^-14
// exactly (e2m1 subnormals land on f16 subnormals); times 2^14 it is the value again, then
//   NVFP4: (v * e4m3 scale) -- exact in f32, 2 + 4 significant bits -- * global scale: one
//          rounding, the CPU's weight bit for bit;
//   MXFP4: v * 2^(e - 127) (e8m0 255 = NaN), exact.
// The global scale of an NVFP4 weight rides in its scale buffer, as an f32 at byte
// fp4_global_offset(N, K) after the e4m3 scales (linear.h's upload), so every path that
// reaches the scales reaches it too. Products x * w and their sums are f32 FMAs: the CPU's
// arithmetic up to summation order.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "ops/cuda/gemv.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/gemv_stream.cuh"

namespace ml4::cuda::gemv_fp4 {

using gemv_stream::kStThreads;
using gemv_stream::kStWarps;
using gemv_stream::StArgs;
using gemv_stream::SlotWork;

constexpr int kU = 8;  // units (8 weights each) per row per thread in one load batch

// 4 bytes of e2m1 (element 2j in the low nibble of byte j) -> 8 values times 2^-14.
__device__ __forceinline__ void decode8(uint32_t w, float (&f)[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t b = (w >> (8 * j)) & 0xFFu;
    const uint32_t lo = ((b & 7u) << 9) | ((b & 8u) << 12);
    const uint32_t hi = (((b >> 4) & 7u) << 9) | (((b >> 4) & 8u) << 12);
    const float2 v = gemv_stream::h2f2(lo | (hi << 16));
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

__device__ __forceinline__ float e4m3_f32(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(*reinterpret_cast<const __half*>(&h));
}

__device__ __forceinline__ float e8m0_f32(uint8_t code) {
  // 2^(code - 127): code 0 is 2^-127, a subnormal f32; 255 is NaN.
  if (code == 255) return __int_as_float(0x7fc00000);
  if (code == 0) return __int_as_float(0x00400000);
  return __int_as_float(static_cast<int32_t>(code) << 23);
}

// grid: (ceil(N / R), slots). kNv: NVFP4, else MXFP4. M: tokens per pass.
template <int M, int R, bool kNv>
__global__ void __launch_bounds__(kStThreads) gemv_fp4_kernel(const StArgs a) {
  gemv_stream::prefetch_rows_l2<R>(a, a.K / 2);
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int tid = threadIdx.x;
  const int64_t N = a.N, K = a.K;
  float* y;
  SlotWork sw;
  if (!gemv_stream::block_work(a, &sw, &y)) return;
  const int64_t n0 = blockIdx.x * int64_t{R};
  if (n0 >= N || sw.r_begin >= sw.r_end) return;  // block-uniform
  const uint8_t* sc8 = reinterpret_cast<const uint8_t*>(sw.w_scale);
  const float g = kNv ? *reinterpret_cast<const float*>(sc8 + fp4_global_offset(N, K)) : 1.0f;
  constexpr int kGroupUnits = kNv ? 2 : 4;  // units (of 8 k) per scale group (16 / 32 k)
  const int64_t nu = K / 8, ng = K / (kNv ? 16 : 32);
  const int n_my = tid < nu ? static_cast<int>((nu - tid + kStThreads - 1) / kStThreads) : 0;
  const uint32_t* wrow[R];
  const uint8_t* srow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = min(n0 + r, N - 1);  // tail rows: read row N-1, unused
    wrow[r] = reinterpret_cast<const uint32_t*>(sw.w + row * (K / 2));
    srow[r] = sc8 + row * ng;
  }
  __shared__ float red[kStWarps][M * R];

  for (int64_t p0 = sw.r_begin; p0 < sw.r_end; p0 += M) {
    const int mrows = static_cast<int>(min(int64_t{M}, sw.r_end - p0));
    const float4* xr[M];
    gemv_stream::token_rows<M>(a.x, K, sw.xmap, sw.x_off, p0, mrows, xr);
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    const int n_b = (n_my + kU - 1) / kU;
    for (int b = 0; b < n_b; ++b) {
      const int rem = n_my - b * kU;
      const int64_t ob = int64_t{b} * (kU * kStThreads);
      uint32_t wv[kU][R];
      uint8_t sv[kU][R];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t q = tid + ob + u * kStThreads;
          wv[u][r] = u < rem ? __ldcs(wrow[r] + q) : 0u;
          sv[u][r] = u < rem ? __ldg(srow[r] + q / kGroupUnits) : uint8_t{0};
        }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (u >= rem) break;
        const int64_t q = tid + ob + u * kStThreads;
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          decode8(wv[u][r], wf[r]);
          const float s = kNv ? e4m3_f32(sv[u][r]) : e8m0_f32(sv[u][r]);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float v = wf[r][e] * 16384.0f;  // the e2m1 value, exact
            wf[r][e] = kNv ? (v * s) * g : v * s;
          }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (m >= mrows) break;
          const float4 x0 = __ldg(xr[m] + 2 * q), x1 = __ldg(xr[m] + 2 * q + 1);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float d = acc[m][r];
            d = fmaf(x0.x, wf[r][0], d);
            d = fmaf(x0.y, wf[r][1], d);
            d = fmaf(x0.z, wf[r][2], d);
            d = fmaf(x0.w, wf[r][3], d);
            d = fmaf(x1.x, wf[r][4], d);
            d = fmaf(x1.y, wf[r][5], d);
            d = fmaf(x1.z, wf[r][6], d);
            d = fmaf(x1.w, wf[r][7], d);
            acc[m][r] = d;
          }
        }
      }
    }
    gemv_stream::reduce_store<M, R>(acc, red, mrows, n0, N, y + (sw.y_off + p0) * N);
  }
}

}  // namespace ml4::cuda::gemv_fp4
