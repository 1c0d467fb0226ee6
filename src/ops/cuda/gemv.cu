// See gemv.h.
#include "ops/cuda/gemv.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

constexpr int kWarps = 8;     // warps per block
constexpr int kUnroll = 4;    // 16-byte weight loads in flight per row
constexpr int kMaxSplit = 8;

// Elements per 16-byte load: 8 bf16 or 16 e4m3.
template <bool kFp8> struct Elems { static constexpr int value = kFp8 ? 16 : 8; };

__device__ __forceinline__ void decode8_bf16(const uint4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ void decode16_e4m3(const uint4& v, float* f) {
  const __nv_fp8x2_storage_t* b = reinterpret_cast<const __nv_fp8x2_storage_t*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(b[i], __NV_E4M3);
    const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&hr));
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

struct GemvGroup {
  const int32_t* row_expert = nullptr;
  const int32_t* row_src = nullptr;
  const void* const* w_table = nullptr;
  const float* const* s_table = nullptr;
};

// grid: (ceil(N / (kWarps * R)), S). Slice s covers k in [s*Ks, min(K, (s+1)*Ks)).
template <int M, int R, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(const float* __restrict__ x, int m_rows, int64_t N,
                                                            int64_t K, const uint8_t* __restrict__ w,
                                                            const float* __restrict__ w_scale, float* __restrict__ y,
                                                            int64_t Ks, int64_t slice_stride,
                                                            const GemvGroup group = GemvGroup{}) {
  if (group.row_expert) {  // grouped: grid.z = row i, its own expert's weights (M = 1)
    const int64_t i = blockIdx.z;
    const int e = group.row_expert[i];
    w = static_cast<const uint8_t*>(group.w_table[e]);
    w_scale = group.s_table ? group.s_table[e] : nullptr;
    x += (group.row_src ? int64_t{group.row_src[i]} : i) * K;
    y += i * N;
  }
  constexpr int E = Elems<kFp8>::value;
  constexpr int64_t kEb = kFp8 ? 1 : 2;  // bytes per weight element
  const int lane = threadIdx.x & 31;
  const int64_t n0 = (blockIdx.x * int64_t{kWarps} + (threadIdx.x >> 5)) * R;
  if (n0 >= N) return;
  const int64_t k_begin = blockIdx.y * Ks, k_end = min(K, k_begin + Ks);
  const int64_t kb128 = K / 128;
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

  // One "step" = 32 lanes x E elements; kUnroll steps per iteration.
  for (int64_t kk = k_begin + int64_t{lane} * E; kk < k_end; kk += int64_t{32} * E * kUnroll) {
    uint4 wv[kUnroll][R];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = kk + int64_t{u} * 32 * E;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (k < k_end && n0 + r < N)
          wv[u][r] = __ldg(reinterpret_cast<const uint4*>(w + ((n0 + r) * K + k) * kEb));
        else
          wv[u][r] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = kk + int64_t{u} * 32 * E;
      if (k >= k_end) break;
      // Decode the R rows' weights once, then stream x row by row (E floats each).
      float wf[R][E];
      float sc[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (kFp8) {
          decode16_e4m3(wv[u][r], wf[r]);
          sc[r] = (n0 + r < N) ? __ldg(w_scale + ((n0 + r) / 128) * kb128 + k / 128) : 0.0f;
        } else {
          decode8_bf16(wv[u][r], wf[r]);
          sc[r] = 1.0f;
        }
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (m >= m_rows) break;
        float xv[E];
        const float4* xp = reinterpret_cast<const float4*>(x + m * K + k);
#pragma unroll
        for (int j = 0; j < E / 4; ++j) {
          const float4 t = __ldg(xp + j);
          xv[4 * j] = t.x;
          xv[4 * j + 1] = t.y;
          xv[4 * j + 2] = t.z;
          xv[4 * j + 3] = t.w;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float d = 0.0f;
#pragma unroll
          for (int j = 0; j < E; ++j) d = fmaf(xv[j], wf[r][j], d);
          acc[m][r] = fmaf(d, sc[r], acc[m][r]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      acc[m][r] = v;
    }
  if (lane == 0) {
    float* out = y + blockIdx.y * slice_stride;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (m < m_rows && n0 + r < N) out[m * N + n0 + r] = acc[m][r];
  }
}

__global__ void splitk_reduce_kernel(const float* __restrict__ ws, int S, int64_t n, float* __restrict__ y) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < S; ++s) acc += ws[s * n + i];
    y[i] = acc;
  }
}

// Rows per warp and K slices for a shape: aim at >= ~16 warps per SM.
void choose(int64_t N, int64_t K, int64_t step, int* R, int* S) {
  const int64_t target = int64_t{16} * std::max(sm_count(), 1);
  *R = (N / 4 >= target) ? 4 : 1;
  const int64_t warps = (N + *R - 1) / *R;
  int s = 1;
  while (s < kMaxSplit && warps * s < target && K / (s * 2) >= step * kUnroll) s *= 2;
  *S = s;
}

template <int M, int R, bool kFp8>
void launch(const GemvParams& p, int S, float* out, int64_t Ks) {
  const dim3 grid(static_cast<unsigned>((p.N + kWarps * R - 1) / (kWarps * R)), static_cast<unsigned>(S));
  gemv_kernel<M, R, kFp8><<<grid, kWarps * 32, 0, p.stream>>>(p.x, static_cast<int>(p.M), p.N, p.K,
                                                              static_cast<const uint8_t*>(p.w), p.w_scale, out, Ks,
                                                              p.M * p.N);
}

template <int M>
void launch_m(const GemvParams& p, int R, int S, float* out, int64_t Ks) {
  const bool fp8 = p.format == LinearFormat::kFP8Block;
  if (R == 4) {
    fp8 ? launch<M, 4, true>(p, S, out, Ks) : launch<M, 4, false>(p, S, out, Ks);
  } else {
    fp8 ? launch<M, 1, true>(p, S, out, Ks) : launch<M, 1, false>(p, S, out, Ks);
  }
}

}  // namespace

Status grouped_gemv(const GroupedGemvParams& p) {
  if (p.rows < 0 || p.N <= 0 || p.K <= 0) return invalid_argument("grouped_gemv: bad shape N={} K={}", p.N, p.K);
  const bool fp8 = p.format == LinearFormat::kFP8Block;
  if (!fp8 && p.format != LinearFormat::kBF16)
    return invalid_argument("grouped_gemv: weight format {} (bf16 or fp8 block)", linear_format_name(p.format));
  if (p.K % (fp8 ? 128 : 8) != 0) return invalid_argument("grouped_gemv: K={} alignment", p.K);
  if (p.rows == 0) return Status::ok();
  if (p.rows > 65535) return invalid_argument("grouped_gemv: {} rows (at most 65535)", p.rows);
  if (!p.x || !p.y || !p.row_expert || !p.w_table || (fp8 && !p.s_table)) return invalid_argument("grouped_gemv: null pointer");
  GemvGroup g{p.row_expert, p.row_src, p.w_table, fp8 ? p.s_table : nullptr};
  const int R = p.N >= 2048 ? 4 : 1;
  const dim3 grid(static_cast<unsigned>((p.N + kWarps * R - 1) / (kWarps * R)), 1, static_cast<unsigned>(p.rows));
  const int64_t Ks = p.K;
  auto go = [&](auto kern) {
    kern<<<grid, kWarps * 32, 0, p.stream>>>(p.x, 1, p.N, p.K, nullptr, nullptr, p.y, Ks, 0, g);
  };
  if (fp8) {
    R == 4 ? go(gemv_kernel<1, 4, true>) : go(gemv_kernel<1, 1, true>);
  } else {
    R == 4 ? go(gemv_kernel<1, 4, false>) : go(gemv_kernel<1, 1, false>);
  }
  return cuda_status(cudaGetLastError(), "grouped gemv_kernel");
}

int64_t gemv_workspace_floats(int64_t M, int64_t N, int64_t K) { return int64_t{kMaxSplit} * M * N; }

Status gemv(const GemvParams& p) {
  if (p.M <= 0 || p.M > kGemvMaxM || p.N <= 0 || p.K <= 0)
    return invalid_argument("gemv: M={} (1..{}) N={} K={}", p.M, kGemvMaxM, p.N, p.K);
  const bool fp8 = p.format == LinearFormat::kFP8Block;
  if (!fp8 && p.format != LinearFormat::kBF16)
    return invalid_argument("gemv: weight format {} (bf16 or fp8 block)", linear_format_name(p.format));
  const int64_t step = fp8 ? 16 : 8;
  if (p.K % (fp8 ? 128 : 8) != 0) return invalid_argument("gemv: K={} must be a multiple of {}", p.K, fp8 ? 128 : 8);
  if (!p.x || !p.w || !p.y || (fp8 && !p.w_scale)) return invalid_argument("gemv: null pointer");
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.w)) & 15u)
    return invalid_argument("gemv: x and w must be 16-byte aligned");
  int R = 1, S = 1;
  choose(p.N, p.K, step, &R, &S);
  if (!p.workspace) S = 1;
  // Slices are whole multiples of one warp step so every 16-byte load stays in one slice.
  const int64_t unit = 32 * step;
  const int64_t Ks = ((p.K + S - 1) / S + unit - 1) / unit * unit;
  S = static_cast<int>((p.K + Ks - 1) / Ks);
  float* out = S > 1 ? p.workspace : p.y;
  const int Mt = p.M <= 1 ? 1 : p.M <= 2 ? 2 : p.M <= 4 ? 4 : 8;
  switch (Mt) {
    case 1: launch_m<1>(p, R, S, out, Ks); break;
    case 2: launch_m<2>(p, R, S, out, Ks); break;
    case 4: launch_m<4>(p, R, S, out, Ks); break;
    default: launch_m<8>(p, R, S, out, Ks); break;
  }
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "gemv_kernel"));
  if (S > 1) {
    const int64_t n = p.M * p.N;
    splitk_reduce_kernel<<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, p.stream>>>(
        p.workspace, S, n, p.y);
    ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "splitk_reduce_kernel"));
  }
  return Status::ok();
}

}  // namespace ml4::cuda
