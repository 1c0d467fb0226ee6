// See fp8_gemm.h. Fragment layouts follow the PTX ISA's mma.m16n8k32 description for 8-bit
// types: A (16x32, row) is 4 x b32 per lane, reg0 = (row g, k 4t..4t+3), reg1 = (g+8, same
// k), reg2 = (g, 16+4t..), reg3 = (g+8, 16+4t..), g = lane/4, t = lane%4; B (32x8, col) is
// 2 x b32, reg0 = (n g, k 4t..), reg1 = (n g, k 16+4t..); C is (g, 2t..2t+1) and (g+8, ..).
// ldmatrix.x4 hands lane l the 32-bit word l%4 of row l/4 of each of four 8x16-byte
// matrices, which is exactly those registers when the four matrices are the (row, k) and
// (n, k) quarters listed at each call.
#include "ops/cuda/fp8_gemm.h"
#include "ops/cuda/pdl.cuh"

#include <algorithm>

#include <cuda_bf16.h>

#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

constexpr int kRowBytes = 144;  // one staged 128-byte K row + 16 bytes of padding (bank spread)
constexpr int kMaxSplit = 16;

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One CTA: output tile [m0, m0+BM) x [n0, n0+BN), K blocks [kt0, kt1) of this split.
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32)
    fp8_gemm_kernel(const uint8_t* __restrict__ x, const float* __restrict__ xs, int64_t xs_ld,
                    const uint8_t* __restrict__ w, const float* __restrict__ wsc, int64_t ws_ld, void* __restrict__ y,
                    bool y_f32, float* __restrict__ part, int M, int N, int K, int kper) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  constexpr int kThreads = WARPS_M * WARPS_N * 32;
  constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
  constexpr int MI = WM / 16, NI = WN / 8;
  static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile");
  static_assert(BN <= 128 && 128 % BN == 0, "a CTA must see one weight scale per K block");
  constexpr int kStage = (BM + BN) * kRowBytes;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int KT = K / 128;
  const int kt0 = blockIdx.z * kper, kt1 = min(KT, kt0 + kper);
  const int nk = kt1 - kt0;

  auto load = [&](int stage, int kt) {
    const uint32_t st = sbase + stage * kStage;
#pragma unroll 4
    for (int i = tid; i < (BM + BN) * 8; i += kThreads) {
      const int r = i >> 3, c = i & 7;
      const uint8_t* src;
      bool ok;
      if (r < BM) {
        const int gr = m0 + r;
        ok = gr < M;
        src = x + static_cast<int64_t>(ok ? gr : 0) * K + kt * 128 + c * 16;
      } else {
        const int gr = n0 + r - BM;
        ok = gr < N;
        src = w + static_cast<int64_t>(ok ? gr : 0) * K + kt * 128 + c * 16;
      }
      cp_async16(st + r * kRowBytes + c * 16, src, ok);
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load(s, kt0 + s);
    cp_commit();
  }
  const float* wrow = wsc + static_cast<int64_t>(n0 / 128) * ws_ld;
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < nk; ++i) {
    cp_wait<STAGES - 2>();
    __syncthreads();  // stage i landed for every thread; stage i-1 is free to overwrite
    {
      const int j = i + STAGES - 1;
      if (j < nk) load(j % STAGES, kt0 + j);
      cp_commit();
    }
    const int kt = kt0 + i;
    const float wsv = __ldg(wrow + kt);
    float sx[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      const int r = m0 + wm * WM + mi * 16 + g;
      sx[mi][0] = r < M ? __ldg(xs + static_cast<int64_t>(kt) * xs_ld + r) * wsv : 0.0f;
      sx[mi][1] = r + 8 < M ? __ldg(xs + static_cast<int64_t>(kt) * xs_ld + r + 8) * wsv : 0.0f;
    }
    const uint32_t sa = sbase + (i % STAGES) * kStage, sb = sa + BM * kRowBytes;
    float pc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) pc[mi][ni][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        // matrices: (rows 0-7, k 0-15), (rows 8-15, k 0-15), (rows 0-7, k 16-31), (rows 8-15, k 16-31)
        const int row = wm * WM + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = ks * 32 + (lane >> 4) * 16;
        ldsm_x4(sa + row * kRowBytes + col, a[mi][0], a[mi][1], a[mi][2], a[mi][3]);
      }
      uint32_t b[NI][2];
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        // matrices: (n 0-7, k 0-15), (n 0-7, k 16-31), (n 8-15, k 0-15), (n 8-15, k 16-31)
        const int row = wn * WN + nj * 16 + (lane & 7) + (lane >> 4) * 8;
        const int col = ks * 32 + ((lane >> 3) & 1) * 16;
        ldsm_x4(sb + row * kRowBytes + col, b[2 * nj][0], b[2 * nj][1], b[2 * nj + 1][0], b[2 * nj + 1][1]);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma_e4m3(pc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
    // Promotion of this K block's partial sums into the f32 accumulators.
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        acc[mi][ni][0] = fmaf(pc[mi][ni][0], sx[mi][0], acc[mi][ni][0]);
        acc[mi][ni][1] = fmaf(pc[mi][ni][1], sx[mi][0], acc[mi][ni][1]);
        acc[mi][ni][2] = fmaf(pc[mi][ni][2], sx[mi][1], acc[mi][ni][2]);
        acc[mi][ni][3] = fmaf(pc[mi][ni][3], sx[mi][1], acc[mi][ni][3]);
      }
  }
  cp_wait<0>();

#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m0 + wm * WM + mi * 16 + g + h * 8;
        const int c = n0 + wn * WN + ni * 8 + 2 * t;
        if (r >= M || c >= N) continue;  // N is even, so c < N covers c + 1
        const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
        if (part) {
          *reinterpret_cast<float2*>(part + (static_cast<int64_t>(blockIdx.z) * M + r) * N + c) = make_float2(v0, v1);
        } else if (y_f32) {
          *reinterpret_cast<float2*>(static_cast<float*>(y) + static_cast<int64_t>(r) * N + c) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(y) + static_cast<int64_t>(r) * N + c) =
              __floats2bfloat162_rn(v0, v1);
        }
      }
}

// y = sum over the S split partials, in slice order (deterministic). Two outputs per thread.
__global__ void split_reduce_kernel(const float* __restrict__ part, int S, int64_t MN, void* __restrict__ y,
                                    bool y_f32) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) * 2;
  if (i >= MN) return;
  float2 s = *reinterpret_cast<const float2*>(part + i);
  for (int z = 1; z < S; ++z) {
    const float2 v = *reinterpret_cast<const float2*>(part + z * MN + i);
    s.x += v.x;
    s.y += v.y;
  }
  if (y_f32) {
    *reinterpret_cast<float2*>(static_cast<float*>(y) + i) = s;
  } else {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(y) + i) = __floats2bfloat162_rn(s.x, s.y);
  }
}

template <typename T>
__global__ void transpose_out_kernel(const T* __restrict__ t, int64_t ld_t, int64_t N, int64_t M, T* __restrict__ y) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ T tile[32][33];
  const int64_t m0 = blockIdx.x * int64_t{32}, n0 = blockIdx.y * int64_t{32};
  for (int j = threadIdx.y; j < 32; j += blockDim.y) {
    const int64_t n = n0 + j, m = m0 + threadIdx.x;
    if (n < N && m < M) tile[j][threadIdx.x] = t[n * ld_t + m];
  }
  __syncthreads();
  for (int j = threadIdx.y; j < 32; j += blockDim.y) {
    const int64_t m = m0 + j, n = n0 + threadIdx.x;
    if (n < N && m < M) y[m * N + n] = tile[threadIdx.x][j];
  }
}

struct Config {
  int bm, bn;
};

Config pick(int64_t M) {
  if (M <= 16) return {16, 128};
  if (M <= 64) return {64, 64};
  return {128, 128};
}

// Split factor and K blocks per split for this shape, given the workspace available.
void plan_split(int64_t M, int64_t N, int64_t K, size_t ws_bytes, int* S, int* kper) {
  const Config c = pick(M);
  const int64_t KT = K / 128;
  const int64_t tiles = ((N + c.bn - 1) / c.bn) * ((M + c.bm - 1) / c.bm);
  const int64_t target = 2 * std::max(sm_count(), 1);  // two CTAs per SM hide the load latency
  int64_t s = 1;
  if (tiles < target) s = std::min<int64_t>({KT, kMaxSplit, (target + tiles - 1) / tiles});
  const int64_t per_split = M * N * 4;
  s = std::min<int64_t>(s, static_cast<int64_t>(ws_bytes / static_cast<size_t>(per_split)));
  if (s <= 1) {
    *S = 1;
    *kper = static_cast<int>(KT);
    return;
  }
  const int64_t kp = (KT + s - 1) / s;
  *kper = static_cast<int>(kp);
  *S = static_cast<int>((KT + kp - 1) / kp);
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
Status launch(const Fp8GemmParams& p, int S, int kper, float* part) {
  constexpr int kSmem = STAGES * (BM + BN) * kRowBytes;
  auto kernel = fp8_gemm_kernel<BM, BN, WARPS_M, WARPS_N, STAGES>;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  ML4_RETURN_IF_ERROR(cuda_status(attr, "cudaFuncSetAttribute(fp8_gemm_kernel)"));
  const dim3 grid(static_cast<unsigned>((p.N + BN - 1) / BN), static_cast<unsigned>((p.M + BM - 1) / BM),
                  static_cast<unsigned>(S));
  launch_kernel(kernel, grid, WARPS_M * WARPS_N * 32, kSmem, p.stream, static_cast<const uint8_t*>(p.x), p.x_scale,
                p.x_scale_ld ? p.x_scale_ld : p.M, static_cast<const uint8_t*>(p.w), p.w_scale,
                p.w_scale_ld ? p.w_scale_ld : p.K / 128, p.y, p.y_dtype == DType::kF32, part, static_cast<int>(p.M),
                static_cast<int>(p.N), static_cast<int>(p.K), kper);
  return cuda_status(cudaGetLastError(), "fp8_gemm_kernel");
}

}  // namespace

size_t fp8_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0 || K < 128) return 0;
  int S = 1, kper = 1;
  plan_split(M, N, K, ~size_t{0} / 2, &S, &kper);
  return S > 1 ? static_cast<size_t>(S) * M * N * 4 : 0;
}

Status fp8_block_gemm(const Fp8GemmParams& p) {
  if (p.M <= 0 || p.N <= 0 || p.K <= 0) return invalid_argument("fp8 gemm: bad shape M={} N={} K={}", p.M, p.N, p.K);
  if (p.K % 128 != 0 || p.N % 16 != 0)
    return invalid_argument("fp8 gemm: K={} must be a multiple of 128 and N={} of 16", p.K, p.N);
  if (p.M > (int64_t{1} << 30) || p.N > (int64_t{1} << 30) || p.K > (int64_t{1} << 30))
    return invalid_argument("fp8 gemm: shape M={} N={} K={} too large", p.M, p.N, p.K);
  if (p.y_dtype != DType::kBF16 && p.y_dtype != DType::kF32)
    return invalid_argument("fp8 gemm: output dtype {} (bf16 or f32)", dtype_name(p.y_dtype));
  if (!p.x || !p.w || !p.y || !p.x_scale || !p.w_scale) return invalid_argument("fp8 gemm: null pointer");
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.w)) & 15u)
    return invalid_argument("fp8 gemm: x and w must be 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(p.y) & 7u) return invalid_argument("fp8 gemm: y must be 8-byte aligned");
  if (p.x_scale_ld != 0 && p.x_scale_ld < p.M)
    return invalid_argument("fp8 gemm: x_scale_ld {} < M {}", p.x_scale_ld, p.M);
  if (p.w_scale_ld != 0 && p.w_scale_ld < p.K / 128)
    return invalid_argument("fp8 gemm: w_scale_ld {} < K/128 {}", p.w_scale_ld, p.K / 128);
  int S = 1, kper = 1;
  plan_split(p.M, p.N, p.K, p.workspace ? p.workspace_bytes : 0, &S, &kper);
  float* part = S > 1 ? static_cast<float*>(p.workspace) : nullptr;
  if (part && (reinterpret_cast<uintptr_t>(part) & 7u)) return invalid_argument("fp8 gemm: workspace misaligned");
  const Config c = pick(p.M);
  if (c.bm == 16) {
    ML4_RETURN_IF_ERROR((launch<16, 128, 1, 4, 4>(p, S, kper, part)));
  } else if (c.bm == 64) {
    ML4_RETURN_IF_ERROR((launch<64, 64, 2, 2, 4>(p, S, kper, part)));
  } else {
    ML4_RETURN_IF_ERROR((launch<128, 128, 2, 4, 3>(p, S, kper, part)));
  }
  if (!part) return ok_status();
  const int64_t MN = p.M * p.N, threads = 256, blocks = (MN / 2 + threads - 1) / threads;
  launch_kernel(split_reduce_kernel, static_cast<unsigned>(blocks), static_cast<unsigned>(threads), 0, p.stream, part,
                S, MN, p.y, p.y_dtype == DType::kF32);
  return cuda_status(cudaGetLastError(), "split_reduce_kernel");
}

Status transpose_out(const void* t, int64_t ld_t, int elem_bytes, int64_t N, int64_t M, void* y,
                     cudaStream_t stream) {
  if (M <= 0 || N <= 0 || ld_t < M) return invalid_argument("transpose_out: bad shape N={} M={} ld={}", N, M, ld_t);
  if ((N + 31) / 32 > 65535) return invalid_argument("transpose_out: N={} too large", N);
  const dim3 grid(static_cast<unsigned>((M + 31) / 32), static_cast<unsigned>((N + 31) / 32)), block(32, 8);
  if (elem_bytes == 4) {
    launch_kernel(transpose_out_kernel<float>, grid, block, 0, stream, static_cast<const float*>(t), ld_t, N, M,
                  static_cast<float*>(y));
  } else if (elem_bytes == 2) {
    launch_kernel(transpose_out_kernel<uint16_t>, grid, block, 0, stream, static_cast<const uint16_t*>(t), ld_t, N, M,
                  static_cast<uint16_t*>(y));
  } else {
    return invalid_argument("transpose_out: element size {}", elem_bytes);
  }
  return cuda_status(cudaGetLastError(), "transpose_out_kernel");
}

}  // namespace ml4::cuda
