// See gemv.h.
#include "ops/cuda/gemv.h"
#include "ops/cuda/pdl.cuh"

#include <algorithm>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/cuda_common.h"
#include "ops/cuda/gemv_fp4.cuh"
#include "ops/cuda/gemv_mma.cuh"
#include "ops/cuda/gemv_stream.cuh"
#include "ops/cuda/gemv_tc.cuh"

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
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
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
    for (int r = 0; r < R; ++r) acc[m][r] = gemv_stream::warp_sum(acc[m][r]);
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
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < S; ++s) acc += ws[s * n + i];
    y[i] = acc;
  }
}

// Rows per warp and K slices for a shape: aim at >= ~16 warps per SM.
// y[i] = sum over the S split-K partials ws[s][i], in slice order (deterministic); S <= 1: nothing.
Status reduce_splits(const float* ws, int S, int64_t n, float* y, cudaStream_t stream) {
  if (S <= 1) return ok_status();
  launch_kernel(splitk_reduce_kernel, static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, stream,
                ws, S, n, y);
  return cuda_status(cudaGetLastError(), "splitk_reduce_kernel");
}

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
  launch_kernel(gemv_kernel<M, R, kFp8>, grid, kWarps * 32, 0, p.stream, p.x, static_cast<int>(p.M), p.N, p.K,
                static_cast<const uint8_t*>(p.w), p.w_scale, out, Ks, p.M * p.N, GemvGroup{});
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

// ---------------------------------------------------------------------------------------
// Tensor-core weight stream (gemv_tc.cuh): launch helpers.
// ---------------------------------------------------------------------------------------
using gemv_tc::TcArgs;

// The grouped fields of p (scales for FP8 and FP4 only).
gemv_stream::GroupedArgs grouped_args(const GroupedGemvParams& p, bool scaled) {
  gemv_stream::GroupedArgs g;
  g.offsets = p.offsets;
  g.active = p.active;
  g.row_src = p.row_src;
  g.w_table = p.w_table;
  g.s_table = scaled ? p.s_table : nullptr;
  g.extra_w = p.extra_w;
  g.extra_s = p.extra_s;
  g.extra_rows = static_cast<int>(p.extra_rows);
  g.extra_x_row0 = p.extra_x_row0;
  g.extra_y_row0 = p.extra_y_row0;
  return g;
}

// Bytes in flight beyond the registers: each lane asks L2 for its weights `prefetch` steps
// ahead of the batch it loads (no register cost; the later load then hits L2). Off by
// default: on the H200 (2026-12-02 17:33 run, gpu_gemm_bench "gemv-tc" vs "gemv-tcnp") the
// prefetch made 51 of 56 decode shapes 5-25% slower, and the grouped MoE decode layer 11%
// slower at T = 64 (gpu_moe_bench "no L2 prefetch").
int g_tc_prefetch = 0;

// ---------------------------------------------------------------------------------------
// CUDA-core weight stream for small M (gemv_stream.cuh): configuration and launch.
// ---------------------------------------------------------------------------------------
GemvStreamConfig g_stream;
constexpr int64_t kStreamBf16MaxRows = 64;

template <int M, int R>
void launch_st_mr(const gemv_stream::StArgs& a, dim3 grid, bool fp8, int conv, cudaStream_t s) {
  using namespace gemv_stream;
  if (!fp8)
    launch_kernel(gemv_stream_kernel<M, R, false, kConvF16Int>, grid, kStThreads, 0, s, a);
  else if (conv == kConvF16Int)
    launch_kernel(gemv_stream_kernel<M, R, true, kConvF16Int>, grid, kStThreads, 0, s, a);
  else if (conv == kConvF32Int)
    launch_kernel(gemv_stream_kernel<M, R, true, kConvF32Int>, grid, kStThreads, 0, s, a);
  else
    launch_kernel(gemv_stream_kernel<M, R, true, kConvF16Hw>, grid, kStThreads, 0, s, a);
}

// Rows per block: 4 (32 loads of 4 bytes in flight per thread) unless that leaves fewer
// than ~16 blocks per SM.
int stream_rows(int64_t N) {
  if (g_stream.rows == 2 || g_stream.rows == 4) return g_stream.rows;
  return N >= int64_t{16} * std::max(sm_count(), 1) ? 4 : 2;
}

// FP8 at M = 1: blocks of one warp, each streaming its own 4 rows over the whole of K (one
// setup and no cross-warp reduction per 4 rows, where a block of four warps sharing 4 rows pays
// both every 2 load batches at K ~ 8k: ~1/3 of the kernel's instructions). Measured on the H200
// (docs/BENCHMARKS.md "Twenty-fifth session"): 2-14% faster back to back at N >= 5632, 40-60%
// slower at N = 576 / 1536 (too few warps to fill the card), so by default (warp_rows 1) only
// where 4 rows a block would be chosen (N >= 16 blocks an SM); 2: at every N.
bool warp_rows_at(int64_t N) {
  return g_stream.warp_rows == 2 || (g_stream.warp_rows == 1 && stream_rows(N) == 4);
}

// The f16 mma kernel's warps a block (they split K): GemvStreamConfig::mma_warps, or by the
// number of 16-row blocks: the fewest of 4, 8, 16 that make >= 8 warps an SM (16 only at M <= 2,
// its shared memory).
int mma_warps(int64_t blocks, int m) {
  const int cap = m <= 2 ? 16 : 8;
  if (g_stream.mma_warps == 4 || g_stream.mma_warps == 8 || g_stream.mma_warps == 16)
    return std::min(g_stream.mma_warps, cap);
  const int64_t target = int64_t{8} * std::max(sm_count(), 1);
  for (int w : {4, 8}) if (blocks * w >= target) return w;
  return cap;
}

// Whether the f16 mma kernel may take these weights: FP8 unless x_parts < 0 (the exact mode
// keeps x whole), and the most tokens the stream launch then takes (kAuto's and grouped_gemv's
// bound: `base`, max_m or grouped_max_rows, or the mma kernel's).
bool mma_ok(bool fp8, int x_parts) { return fp8 && x_parts >= 0; }
int stream_max_rows(int base, bool mma) { return std::max(base, mma ? g_stream.mma : 0); }

// mt: tokens (1, 2, or more: passes of 4; the kernel stops at the real count). mma: mma_ok.
Status launch_stream(const gemv_stream::StArgs& a, int mt, unsigned slots, bool fp8, bool mma, cudaStream_t s) {
  const int R = stream_rows(a.N);
  const dim3 grid(static_cast<unsigned>((a.N + R - 1) / R), slots, 1);
  const int conv = g_stream.conv;
  auto go = [&](auto m_tag) {
    constexpr int M = decltype(m_tag)::value;
    if (fp8 && mma && M <= g_stream.mma && M >= g_stream.mma_min_m) {  // the tensor cores, f16 (gemv_mma.cuh)
      const int64_t tiles = (a.N + gemv_mma::kMmaRows - 1) / gemv_mma::kMmaRows;
      const int W = mma_warps(tiles * slots, M);
      const dim3 grid(static_cast<unsigned>(tiles), slots, 1);
      if constexpr (M <= 2) {  // 16 warps' stages fit only at M <= 2
        if (W == 16) {
          launch_kernel(gemv_mma::gemv_mma_kernel<M, 16>, grid, 16 * 32, 0, s, a);
          return;
        }
      }
      if (W >= 8)
        launch_kernel(gemv_mma::gemv_mma_kernel<M, 8>, grid, 8 * 32, 0, s, a);
      else
        launch_kernel(gemv_mma::gemv_mma_kernel<M, 4>, grid, 4 * 32, 0, s, a);
      return;
    }
    if constexpr (M <= 2) {  // FP8 at one or two tokens (warp_rows_max_m): each warp its own 4 rows (warp_rows_at)
      if (fp8 && conv == gemv_stream::kConvF16Hw && M <= g_stream.warp_rows_max_m && warp_rows_at(a.N)) {
        launch_kernel(gemv_stream::gemv_stream_kernel<M, 4, true, gemv_stream::kConvF16Hw, 32>,
                      dim3(static_cast<unsigned>((a.N + 3) / 4), slots, 1), 32, 0, s, a);
        return;
      }
    }
    R == 2 ? launch_st_mr<M, 2>(a, grid, fp8, conv, s) : launch_st_mr<M, 4>(a, grid, fp8, conv, s);
  };
  if (mt <= 1)
    go(std::integral_constant<int, 1>{});
  else if (mt <= 2)
    go(std::integral_constant<int, 2>{});
  else  // 3..8 tokens: passes of 4 (the CUDA-core stream's cost grows with M; 8 was measured 2-4x the
    go(std::integral_constant<int, 4>{});  // tensor-core kernel at M = 8 and is not built)
  return cuda_status(cudaGetLastError(), "gemv_stream_kernel");
}

int pow2_tokens(int64_t m) { return m <= 1 ? 1 : m <= 2 ? 2 : m <= 4 ? 4 : 8; }

bool is_fp4(LinearFormat f) { return f == LinearFormat::kNVFP4 || f == LinearFormat::kMXFP4; }

// GemvParams::x_parts: 0 (or out of range) is 3, the exact split.
int x_parts(int parts) { return parts == 1 || parts == 2 ? parts : 3; }

// NVFP4 / MXFP4 (gemv_fp4.cuh): mt tokens per pass (1, 2, 4 or 8; any number of rows).
Status launch_fp4(const gemv_stream::StArgs& a, int mt, unsigned slots, bool nv, cudaStream_t s) {
  using gemv_fp4::gemv_fp4_kernel;
  const int R = stream_rows(a.N);
  const dim3 grid(static_cast<unsigned>((a.N + R - 1) / R), slots, 1);
  auto go = [&](auto m_tag) {
    constexpr int M = decltype(m_tag)::value;
    if (nv)
      R == 2 ? launch_kernel(gemv_fp4_kernel<M, 2, true>, grid, gemv_stream::kStThreads, 0, s, a)
             : launch_kernel(gemv_fp4_kernel<M, 4, true>, grid, gemv_stream::kStThreads, 0, s, a);
    else
      R == 2 ? launch_kernel(gemv_fp4_kernel<M, 2, false>, grid, gemv_stream::kStThreads, 0, s, a)
             : launch_kernel(gemv_fp4_kernel<M, 4, false>, grid, gemv_stream::kStThreads, 0, s, a);
  };
  if (mt <= 1)
    go(std::integral_constant<int, 1>{});
  else if (mt <= 2)
    go(std::integral_constant<int, 2>{});
  else if (mt <= 4)
    go(std::integral_constant<int, 4>{});
  else
    go(std::integral_constant<int, 8>{});
  return cuda_status(cudaGetLastError(), "gemv_fp4_kernel");
}

}  // namespace

Status grouped_gemv(const GroupedGemvParams& p) {
  if (p.rows < 0 || p.N <= 0 || p.K <= 0) return invalid_argument("grouped_gemv: bad shape N={} K={}", p.N, p.K);
  const bool fp4 = is_fp4(p.format), fp8 = p.format == LinearFormat::kFP8Block, scaled = fp8 || fp4;
  if (!scaled && p.format != LinearFormat::kBF16)
    return invalid_argument("grouped_gemv: weight format {}", linear_format_name(p.format));
  if (p.K % (fp4 ? 32 : fp8 ? 128 : 8) != 0) return invalid_argument("grouped_gemv: K={} alignment", p.K);
  if (fp4 && !p.offsets) return unimplemented("grouped_gemv: row mode for {} weights", linear_format_name(p.format));
  if (p.offsets) {  // expert-grouped: each active expert's weights read once per 8 of its rows
    if (!p.active || !p.x || !p.y || !p.w_table || (scaled && !p.s_table) || p.max_active < 0 ||
        p.max_active > 65535 || (p.extra_w && scaled && !p.extra_s) || p.extra_rows < 0)
      return invalid_argument("grouped_gemv: bad grouped arguments");
    if (reinterpret_cast<uintptr_t>(p.x) & 15u) return invalid_argument("grouped_gemv: x must be 16-byte aligned");
    const int slots = p.max_active + (p.extra_w ? 1 : 0);
    if (slots == 0) return ok_status();
    if (p.w_table2 &&
        (!p.y2 || (scaled && !p.s_table2) || (p.extra_w && !p.extra_w2) || (p.extra_w2 && scaled && !p.extra_s2)))
      return invalid_argument("grouped_gemv: bad second weight set");
    // The CUDA-core weight streams (FP4 on request: the exact stream; FP8, or bf16 on request,
    // for few rows per expert).
    const bool fp4_stream = fp4 && (p.x_parts < 0 || p.impl == GemvImpl::kStream || p.impl == GemvImpl::kCudaCore);
    const bool mma = mma_ok(fp8, p.x_parts);
    // Not in the exact mode (x_parts < 0): there FP8 and bf16 take the tensor cores whatever the
    // rows an expert, so a token's sums do not depend on the step (batch invariance).
    if (fp4_stream || (!fp4 && p.x_parts >= 0 && p.max_expert_rows > 0 &&
                       p.max_expert_rows <= stream_max_rows(g_stream.grouped_max_rows, mma) &&
                       (fp8 || p.impl == GemvImpl::kStream ||
                        (p.format == LinearFormat::kBF16 && g_stream.bf16_stream == 2)) &&
                       p.impl != GemvImpl::kTensorCore)) {
      gemv_stream::StArgs a;
      static_cast<gemv_stream::GroupedArgs&>(a) = grouped_args(p, scaled);
      a.x = p.x;
      a.N = p.N;
      a.K = p.K;
      a.y = p.y;
      a.slots = slots;
      a.w_table2 = p.w_table2;
      a.s_table2 = scaled ? p.s_table2 : nullptr;
      a.extra_w2 = p.extra_w2;
      a.extra_s2 = p.extra_s2;
      a.y2 = p.y2;
      const unsigned grid_y = static_cast<unsigned>(slots * (p.w_table2 ? 2 : 1));
      const int mt = p.max_expert_rows > 0 ? pow2_tokens(p.max_expert_rows) : 8;
      if (fp4) return launch_fp4(a, mt, grid_y, p.format == LinearFormat::kNVFP4, p.stream).with_context("grouped_gemv");
      return launch_stream(a, mt, grid_y, fp8, mma, p.stream).with_context("grouped_gemv");
    }
    if (p.w_table2) {  // tensor-core path: one launch per weight set
      GroupedGemvParams q = p;
      q.w_table2 = nullptr;
      ML4_RETURN_IF_ERROR(grouped_gemv(q));
      q.w_table = p.w_table2;
      q.s_table = p.s_table2;
      q.extra_w = p.extra_w2;
      q.extra_s = p.extra_s2;
      q.y = p.y2;
      return grouped_gemv(q);
    }
    TcArgs a;
    static_cast<gemv_stream::GroupedArgs&>(a) = grouped_args(p, scaled);
    a.x = p.x;
    a.N = p.N;
    a.K = p.K;
    a.y = p.y;
    a.k_slice = p.K;
    a.prefetch = g_tc_prefetch;
    return gemv_tc::launch_tc(a, 1, static_cast<unsigned>(slots), gemv_tc::tc_format(p.format), x_parts(p.x_parts),
                              p.stream)
        .with_context("grouped_gemv");
  }
  if (p.rows == 0) return ok_status();
  if (p.rows > 65535) return invalid_argument("grouped_gemv: {} rows (at most 65535)", p.rows);
  if (!p.x || !p.y || !p.row_expert || !p.w_table || (fp8 && !p.s_table)) return invalid_argument("grouped_gemv: null pointer");
  GemvGroup g{p.row_expert, p.row_src, p.w_table, fp8 ? p.s_table : nullptr};
  const int R = p.N >= 2048 ? 4 : 1;
  const dim3 grid(static_cast<unsigned>((p.N + kWarps * R - 1) / (kWarps * R)), 1, static_cast<unsigned>(p.rows));
  const int64_t Ks = p.K;
  auto go = [&](auto kern) {
    launch_kernel(kern, grid, kWarps * 32, 0, p.stream, p.x, 1, p.N, p.K, nullptr, nullptr, p.y, Ks, 0, g);
  };
  if (fp8) {
    R == 4 ? go(gemv_kernel<1, 4, true>) : go(gemv_kernel<1, 1, true>);
  } else {
    R == 4 ? go(gemv_kernel<1, 4, false>) : go(gemv_kernel<1, 1, false>);
  }
  return cuda_status(cudaGetLastError(), "grouped gemv_kernel");
}

int64_t gemv_workspace_floats(int64_t M, int64_t N, int64_t K) { return int64_t{gemv_tc::kTcMaxSplit} * M * N; }

void gemv_set_l2_prefetch(int steps) { g_tc_prefetch = std::max(steps, 0); }

void gemv_set_stream_config(const GemvStreamConfig& c) { g_stream = c; }
GemvStreamConfig gemv_stream_config() { return g_stream; }

Status gemv(const GemvParams& p) {
  const bool fp4 = is_fp4(p.format), fp8 = p.format == LinearFormat::kFP8Block;
  // FP4 takes any number of rows (its weight stream runs passes of up to 8).
  if (p.M <= 0 || p.M > (fp4 ? int64_t{1} << 30 : kGemvMaxM) || p.N <= 0 || p.K <= 0)
    return invalid_argument("gemv: M={} (1..{}) N={} K={}", p.M, fp4 ? int64_t{1} << 30 : kGemvMaxM, p.N, p.K);
  if (!fp4 && !fp8 && p.format != LinearFormat::kBF16)
    return invalid_argument("gemv: weight format {}", linear_format_name(p.format));
  const int64_t step = fp8 ? 16 : 8, k_align = fp4 ? 32 : fp8 ? 128 : 8;
  if (p.K % k_align != 0) return invalid_argument("gemv: K={} must be a multiple of {}", p.K, k_align);
  if (!p.x || !p.w || !p.y || ((fp8 || fp4) && !p.w_scale)) return invalid_argument("gemv: null pointer");
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.w)) & 15u)
    return invalid_argument("gemv: x and w must be 16-byte aligned");
  const bool fp4_stream = fp4 && (p.x_parts < 0 || p.impl == GemvImpl::kStream || p.impl == GemvImpl::kCudaCore);
  // BF16 at M <= max_m takes the stream too: for a few rows (the indexer's head weights, 32 x
  // dim) the tensor-core path split K 16 ways plus a reduction launch (5.6 + 2.2 us on the
  // H200 in the ml4-slice-4 decode step); at any N it streams at 95-101% of copy back to back
  // where gemv_tc reaches 71-87% (H100, M = 1 and 2; docs/BENCHMARKS.md "Twenty-seventh
  // session"; bf16_stream 0 keeps the wide ones on gemv_tc). Not in the exact mode (x_parts < 0):
  // there FP8 and BF16 take gemv_tc at every M and N, its split-K count chosen as for 8 rows, so
  // a token's sums do not depend on how many rows share its launch (batch invariance: each
  // token is its own mma column; x in three exact bf16 parts, f32 sums).
  const bool exact = !fp4 && p.x_parts < 0 && p.impl == GemvImpl::kAuto;
  const bool bf16_streams = p.format == LinearFormat::kBF16 && (g_stream.bf16_stream >= 1 || p.N <= kStreamBf16MaxRows);
  const bool mma = mma_ok(fp8, p.x_parts);
  if (fp4_stream || (!fp4 && (p.impl == GemvImpl::kStream ||
                              (p.impl == GemvImpl::kAuto && !exact && (fp8 || bf16_streams) &&
                               p.M <= stream_max_rows(g_stream.max_m, mma))))) {
    gemv_stream::StArgs a;
    a.x = p.x;
    a.N = p.N;
    a.K = p.K;
    a.w = static_cast<const uint8_t*>(p.w);
    a.w_scale = p.w_scale;
    a.y = p.y;
    a.rows = static_cast<int>(p.M);
    a.prefetch_l2 = programmatic_launch() ? g_stream.pdl_prefetch_bytes : 0;  // only where it can overlap (pdl.cuh)
    if (fp4) return launch_fp4(a, pow2_tokens(p.M), 1, p.format == LinearFormat::kNVFP4, p.stream);
    return launch_stream(a, pow2_tokens(p.M), 1, fp8, mma, p.stream);
  }
  // FP4 always takes the tensor cores here (any M: passes of 8 tokens; split-K only with a
  // workspace and M <= 8, the workspace's size).
  const bool tc = fp4 || exact || p.impl == GemvImpl::kTensorCore || (p.impl == GemvImpl::kAuto && p.workspace != nullptr);
  if (tc) {
    int64_t Ks = 0;
    const gemv_tc::TcFormat tf = gemv_tc::tc_format(p.format);
    // The exact mode's split does not depend on M (S at 8 rows <= S at fewer: the workspace fits).
    const int S = gemv_tc::tc_split(exact ? kGemvMaxM : p.M, p.N, p.K, tf, p.workspace != nullptr && p.M <= kGemvMaxM, &Ks);
    TcArgs a;
    a.x = p.x;
    a.N = p.N;
    a.K = p.K;
    a.w = static_cast<const uint8_t*>(p.w);
    a.w_scale = p.w_scale;
    a.y = S > 1 ? p.workspace : p.y;
    a.k_slice = Ks;
    a.y_slice_stride = p.M * p.N;
    a.rows = static_cast<int>(p.M);
    a.prefetch = g_tc_prefetch;
    ML4_RETURN_IF_ERROR(gemv_tc::launch_tc(a, static_cast<unsigned>(S), 1, tf, x_parts(p.x_parts), p.stream));
    return reduce_splits(p.workspace, S, p.M * p.N, p.y, p.stream);
  }
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
  return reduce_splits(p.workspace, S, p.M * p.N, p.y, p.stream);
}

}  // namespace ml4::cuda
