// The CUDA-core weight-stream GEMV for small M (included by gemv.cu only; gemv.h has the
// public API). Written for FP8 at M <= 2 (kAuto's use; M = 4 and up measured slower than
// the tensor-core kernel) after a profile of the tensor-core path (docs/BENCHMARKS.md "FP8
// decode GEMV, profiled (engineer gemv3)": 60% of copy in kernel time for wo vs 42%).
//
// Layout: a block of kStWarps warps owns R consecutive weight rows (R * K contiguous bytes:
// DRAM sees long sequential runs) and splits K among its threads: thread t reads 4 weights
// (4 bytes e4m3 / 8 bytes bf16) at quad q = t + i * kStThreads, so one warp instruction
// covers 128 consecutive k of one row (coalesced) and the 4 f32 x it needs are one float4
// at lane stride 16 bytes (coalesced, through L1: x is read straight from global memory,
// no staging, no barrier before the first weight load). All of a thread's loads for one
// batch (kStU quads x R rows) are issued before any is used; the blocks are short and
// many (N / R), so the SMs stay evenly loaded without a split-K workspace. The partial
// sums meet in a fixed order (warp shuffle tree, then warps 0..kStWarps-1 in shared
// memory): bit-deterministic. At M <= 2 (FP8, wide matrices: gemv.cu warp_rows_at) blocks of one
// warp each own R rows instead (quad q = lane + i * 32; its shuffle tree alone): the setup and
// the cross-warp reduction that a four-warp block pays every 2 load batches at K ~ 8k (~1/3 of
// its instructions) are paid once per R x K.
//
// Exact e4m3 decoding, three variants (StConv; measured against each other):
//   kConvF16Int: integer ops build an f16x2 holding two e4m3 values times 2^-8 exactly
//     (sign to bit 15, the 7 magnitude bits to bits 13..7: f16's 5-bit exponent with bias
//     15 vs e4m3's 4-bit with bias 7; e4m3 subnormals land on f16 subnormals), 7 integer
//     ops per 4 weights, then the f16 -> f32 conversion (HADD2.F32); 2^8 goes into the
//     block scale;
//   kConvF16Hw: cvt.rn.f16x2.e4m3x2 (exact) then f16 -> f32 -- the default, measured
//     5-9% faster than kConvF16Int and 8-10% faster than kConvF32Int on the H200;
//   kConvF32Int: the 7 magnitude bits << 20 plus the sign read as an f32 are the value
//     times 2^-120 exactly (subnormals land on f32 subnormals); x is scaled by 2^64 and
//     the block scale by 2^56 so every product stays a normal f32 (exact for |x| < 2^64).
// Every product x * w is exact in f32 and each 4-k partial is summed with f32 FMAs, then
// multiplied by the (power-of-two adjusted) block scale with one f32 FMA: the same
// arithmetic as cpu::linear up to summation order.
#pragma once
#include "ops/cuda/pdl.cuh"

#include <cstdint>
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace ml4::cuda::gemv_stream {

constexpr int kStWarps = 4;
constexpr int kStThreads = kStWarps * 32;
// Blocks per SM the registers must allow (M = 1: 128 registers, 16 warps per SM).
constexpr int kStMinBlocks(int m) { return m <= 1 ? 4 : m <= 4 ? 3 : 2; }

constexpr int kStU = 8;  // quads per row per thread in one load batch

enum StConv { kConvF16Int = 0, kConvF16Hw = 1, kConvF32Int = 2 };

// The warp's sum of v in every lane, by the xor-shuffle tree (a fixed order: deterministic).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The grouped-launch fields both GEMV kernels share (offsets != null): one block column per
// slot; slot 0 is the extra (shared) expert when extra_w != null, the others index active[1 + j].
struct GroupedArgs {
  const int32_t* offsets = nullptr;      // [E + 1]
  const int32_t* active = nullptr;       // [1 + E]: count, expert ids
  const int32_t* row_src = nullptr;      // x row of permuted row i, or null (row i)
  const void* const* w_table = nullptr;
  const float* const* s_table = nullptr;
  const void* extra_w = nullptr;
  const float* extra_s = nullptr;
  int extra_rows = 0;
  int64_t extra_x_row0 = 0, extra_y_row0 = 0;
};

// What grouped slot `slot` serves, from one weight set (tables + extra expert): its matrix and
// scales, its rows [r_begin, r_end) and where its x / y rows start. False: an inactive slot
// (block-uniform, so the caller returns before any barrier).
struct SlotWork {
  const uint8_t* w = nullptr;
  const float* w_scale = nullptr;
  int64_t r_begin = 0, r_end = 0, x_off = 0, y_off = 0;
  const int32_t* xmap = nullptr;
};
__device__ __forceinline__ bool grouped_slot(const GroupedArgs& g, int slot, const void* const* w_table,
                                             const float* const* s_table, const void* extra_w, const float* extra_s,
                                             SlotWork* sw) {
  if (extra_w) {
    if (slot == 0) {
      sw->w = static_cast<const uint8_t*>(extra_w);
      sw->w_scale = extra_s;
      sw->r_end = g.extra_rows;
      sw->x_off = g.extra_x_row0;
      sw->y_off = g.extra_y_row0;
      return true;
    }
    --slot;
  }
  if (slot >= g.active[0]) return false;
  const int e = g.active[1 + slot];
  sw->w = static_cast<const uint8_t*>(w_table[e]);
  sw->w_scale = s_table ? s_table[e] : nullptr;
  sw->r_begin = g.offsets[e];
  sw->r_end = g.offsets[e + 1];
  sw->xmap = g.row_src;
  return true;
}

struct StArgs : GroupedArgs {
  const float* x = nullptr;
  int64_t N = 0, K = 0;
  const uint8_t* w = nullptr;
  const float* w_scale = nullptr;
  float* y = nullptr;
  int rows = 0;  // gemv: M
  int64_t prefetch_l2 = 0;  // bytes of its rows a block prefetches before pdl_wait (programmatic launch only; < 0: all)
  // Grouped: blockIdx.y = slot. Second weight set: slots [slots, 2 * slots) use these, writing y2.
  int slots = 0;
  const void* const* w_table2 = nullptr;
  const float* const* s_table2 = nullptr;
  const void* extra_w2 = nullptr;
  const float* extra_s2 = nullptr;
  float* y2 = nullptr;
};

// The block's work, shared by the weight-stream kernels (this one and gemv_fp4.cuh): a plain
// gemv (rows a.rows of x), or grouped slot blockIdx.y (the second weight set's slots write y2).
// False: an inactive slot (block-uniform: the caller returns before any barrier).
__device__ __forceinline__ bool block_work(const StArgs& a, SlotWork* sw, float** y) {
  *y = a.y;
  sw->w = a.w;
  sw->w_scale = a.w_scale;
  sw->r_end = a.rows;
  if (!a.offsets) return true;
  int slot = blockIdx.y;
  const bool second = a.w_table2 && slot >= a.slots;
  if (second) {
    slot -= a.slots;
    *y = a.y2;
  }
  return grouped_slot(a, slot, second ? a.w_table2 : a.w_table, second ? a.s_table2 : a.s_table,
                      second ? a.extra_w2 : a.extra_w, second ? a.extra_s2 : a.extra_s, sw);
}

// The block's weight rows [n0, n0 + R) of a plain gemv (one contiguous range of R * row_bytes)
// into L2, before pdl_wait: the weights are read-only for the whole step, so with programmatic
// launch (pdl.cuh) their fetch overlaps the previous kernel's tail. Only then (a.prefetch_l2 != 0,
// at most that many bytes a block where > 0: GemvStreamConfig::pdl_prefetch_bytes):
// without the overlap an L2 prefetch in this GEMV measured 5-25% slower (docs/BENCHMARKS.md,
// session 3 run A). Grouped launches learn their experts from the routing the previous kernel
// wrote, so they prefetch nothing.
template <int R>
__device__ __forceinline__ void prefetch_rows_l2(const StArgs& a, int64_t row_bytes) {
  if (a.prefetch_l2 == 0 || a.offsets) return;
  const int64_t n0 = blockIdx.x * int64_t{R};
  if (n0 >= a.N) return;
  const char* base = reinterpret_cast<const char*>(a.w) + n0 * row_bytes;
  int64_t bytes = min(int64_t{R}, a.N - n0) * row_bytes;
  if (a.prefetch_l2 > 0) bytes = min(bytes, a.prefetch_l2);
  const int64_t lines = (bytes + 127) / 128;
  for (int64_t i = threadIdx.x; i < lines; i += blockDim.x) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + i * 128));
}

// x rows of the token group [p0, p0 + mrows) (rows past mrows repeat the last, unused): row
// xmap[i] of the permuted order, else x_off + i.
template <int M>
__device__ __forceinline__ void token_rows(const float* x, int64_t K, const int32_t* xmap, int64_t x_off, int64_t p0,
                                           int mrows, const float4* (&xr)[M]) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int64_t i = p0 + min(m, mrows - 1);
    const int64_t row = xmap ? int64_t{xmap[i]} : x_off + i;
    xr[m] = reinterpret_cast<const float4*>(x + row * K);
  }
}

// A token group's sums: every thread's acc[M][R] -> store(m, r, v) for m < mrows and n0 + r < N,
// by a shuffle tree in each warp and then the warps in order in shared memory
// (bit-deterministic). red is free again when it returns.
template <int M, int R, typename Store>
__device__ __forceinline__ void reduce_store_to(const float (&acc)[M][R], float (&red)[kStWarps][M * R], int mrows,
                                                int64_t n0, int64_t N, Store store) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[m][r]);
      if (lane == 0) red[warp][m * R + r] = v;
    }
  __syncthreads();
  if (tid < M * R) {
    const int m = tid / R, r = tid % R;
    if (m < mrows && n0 + r < N) {
      float v = red[0][tid];
#pragma unroll
      for (int ww = 1; ww < kStWarps; ++ww) v += red[ww][tid];
      store(m, r, v);
    }
  }
  __syncthreads();  // red is reused by the next token group
}

// y_rows[m * N + n0 + r].
template <int M, int R>
__device__ __forceinline__ void reduce_store(const float (&acc)[M][R], float (&red)[kStWarps][M * R], int mrows,
                                             int64_t n0, int64_t N, float* y_rows) {
  reduce_store_to<M, R>(acc, red, mrows, n0, N, [&](int m, int r, float v) { y_rows[m * N + n0 + r] = v; });
}

// Block-scale multiplier that undoes each decoding's power-of-two offset.
template <int kConv>
constexpr float conv_mul() {
  return kConv == kConvF16Int ? 256.0f : kConv == kConvF32Int ? 72057594037927936.0f /* 2^56 */ : 1.0f;
}

__device__ __forceinline__ float2 h2f2(uint32_t v) {
  __half2 h;
  *reinterpret_cast<uint32_t*>(&h) = v;
  return __half22float2(h);
}

// 4 e4m3 (k order: byte 0..3) -> 4 f32, times 2^-8 / 1 / 2^-120 by kConv.
template <int kConv>
__device__ __forceinline__ void decode4(uint32_t w, float (&f)[4]) {
  if constexpr (kConv == kConvF16Int) {
    const uint32_t p02 = ((w << 7) & 0x3F803F80u) | ((w << 8) & 0x80008000u);  // bytes 0, 2
    const uint32_t p13 = ((w >> 1) & 0x3F803F80u) | (w & 0x80008000u);         // bytes 1, 3
    const float2 a = h2f2(p02), b = h2f2(p13);
    f[0] = a.x;
    f[1] = b.x;
    f[2] = a.y;
    f[3] = b.y;
  } else if constexpr (kConv == kConvF16Hw) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    f[0] = a.x;
    f[1] = a.y;
    f[2] = b.x;
    f[3] = b.y;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      f[i] = __int_as_float((static_cast<int32_t>(w << (24 - 8 * i)) >> 4) & static_cast<int32_t>(0x87F00000u));
  }
}

__device__ __forceinline__ void decode4_bf16(uint2 w, float (&f)[4]) {
  f[0] = __uint_as_float(w.x << 16);
  f[1] = __uint_as_float(w.x & 0xFFFF0000u);
  f[2] = __uint_as_float(w.y << 16);
  f[3] = __uint_as_float(w.y & 0xFFFF0000u);
}

// How the x rows are read: kXLdg, read-only for the whole kernel (__ldg); kXPlain, a plain load
// (written earlier in the same kernel before a grid barrier, or in shared memory).
enum XLoad { kXLdg = 0, kXPlain = 1 };

template <int kX>
__device__ __forceinline__ float4 load_x(const float4* p) {
  if constexpr (kX == kXLdg) return __ldg(p);
  else return *p;
}

// One block's work: weight rows [n0, n0 + R) (n0 < N) of w against the x rows of tokens
// [r_begin, r_end) (r_begin < r_end), M at a time; each sum goes to store(p, r, v) for token
// row p and weight row n0 + r. The arithmetic of every sum depends on neither M nor R.
// kT: the threads that share the rows, the block's kStThreads (partial sums meet in shared
// memory) or one warp (warp_rows: blocks of one warp, sums by shuffles alone; another per-thread
// k order, so other bits than kStThreads).
template <int M, int R, bool kFp8, int kConv, int kX, int kT = kStThreads, typename Store>
__device__ __forceinline__ void stream_rows(const uint8_t* w, const float* w_scale, int64_t N, int64_t K, int64_t n0,
                                            const float* x, const int32_t* xmap, int64_t x_off, int64_t r_begin,
                                            int64_t r_end, float (&red)[kStWarps][M * R], Store store) {
  using LoadT = std::conditional_t<kFp8, uint32_t, uint2>;
  constexpr int U = kStU;
  constexpr int64_t kEb = kFp8 ? 1 : 2;
  constexpr float kMul = kFp8 ? conv_mul<kConv>() : 1.0f;
  const int tid = threadIdx.x;
  const int64_t nq = K / 4;  // quads per row
  const int n_my = tid < nq ? static_cast<int>((nq - tid + kT - 1) / kT) : 0;
  const float* srow = kFp8 ? w_scale + (n0 / 128) * (K / 128) : nullptr;
  const LoadT* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    wrow[r] = reinterpret_cast<const LoadT*>(w + (min(n0 + r, N - 1) * K) * kEb);  // tail rows: read row N-1, unused

  for (int64_t p0 = r_begin; p0 < r_end; p0 += M) {
    const int mrows = static_cast<int>(min(int64_t{M}, r_end - p0));
    const float4* xr[M];
    token_rows<M>(x, K, xmap, x_off, p0, mrows, xr);
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    // Batch b = quads i in [b * U, (b + 1) * U) of this thread, all R rows.
    // Addresses: per-thread bases plus a per-batch offset; within a batch every load is an
    // immediate offset (u * kT elements) from them.
    auto load = [&](int b, LoadT (&wv)[U][R], float (&sc)[U]) {
      const int rem = n_my - b * U;  // quads left in this batch
      const int64_t ob = int64_t{b} * (U * kT);
      auto src = [&](int r) -> const LoadT* { return wrow[r] + tid + ob; };
      auto ld = [&](const LoadT* p) -> LoadT { return __ldcs(p); };
      const float* ps = kFp8 ? srow + (tid >> 5) + int64_t{b} * (U * kT / 32) : nullptr;  // k/128 = q/32
      if (rem >= U) {  // a full batch (every batch when K % 512 == 0): no predicates
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const LoadT* pw = src(r);
#pragma unroll
          for (int u = 0; u < U; ++u) wv[u][r] = ld(pw + u * kT);
        }
        if constexpr (kFp8) {
#pragma unroll
          for (int u = 0; u < U; ++u) sc[u] = __ldg(ps + u * (kT / 32)) * kMul;
        }
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const LoadT* pw = src(r);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (u < rem) {
              wv[u][r] = ld(pw + u * kT);
            } else {
              if constexpr (kFp8) wv[u][r] = 0u; else wv[u][r] = make_uint2(0u, 0u);
            }
          }
        }
        if constexpr (kFp8) {
#pragma unroll
          for (int u = 0; u < U; ++u) sc[u] = u < rem ? __ldg(ps + u * (kT / 32)) * kMul : 0.0f;
        }
      }
    };
    auto compute = [&](int b, const LoadT (&wv)[U][R], const float (&sc)[U]) {
      const int rem = n_my - b * U;
      const int64_t ob = int64_t{b} * (U * kT);
      constexpr bool kEarlyX = M <= 2;  // the batch's x loads issued together (registers allow at M <= 2)
      float4 xe[kEarlyX ? U : 1][kEarlyX ? M : 1];
      if constexpr (kEarlyX) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float4* px = xr[m] + tid + ob;
#pragma unroll
          for (int u = 0; u < U; ++u)
            xe[u][m] = u < rem && m < mrows ? load_x<kX>(px + u * kT) : make_float4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u >= rem) break;
        float wf[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if constexpr (kFp8) decode4<kConv>(wv[u][r], wf[r]); else decode4_bf16(wv[u][r], wf[r]);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (m >= mrows) break;
          float4 xv;
          if constexpr (kEarlyX) xv = xe[u][m]; else xv = load_x<kX>(xr[m] + tid + ob + u * kT);
          if constexpr (kFp8 && kConv == kConvF32Int) {
            constexpr float k64 = 18446744073709551616.0f;  // 2^64
            xv.x *= k64;
            xv.y *= k64;
            xv.z *= k64;
            xv.w *= k64;
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float d = xv.x * wf[r][0];
            d = fmaf(xv.y, wf[r][1], d);
            d = fmaf(xv.z, wf[r][2], d);
            d = fmaf(xv.w, wf[r][3], d);
            if constexpr (kFp8) acc[m][r] = fmaf(d, sc[u], acc[m][r]); else acc[m][r] += d;
          }
        }
      }
    };
    // One batch at a time: all of its loads issued, then used. Measured slower on the H200
    // (docs/BENCHMARKS.md "FP8 decode GEMV, profiled"): two register buffers of 4 quads (the
    // next batch in flight while this one is used: fewer bytes in flight per warp than 8 at
    // once), and a block's rows bulk-copied (cp.async.bulk) into shared memory first (the
    // whole tile's latency exposed before any arithmetic).
    const int n_b = (n_my + U - 1) / U;
    for (int b = 0; b < n_b; ++b) {
      LoadT wv[U][R];
      float sc[U];
      load(b, wv, sc);
      compute(b, wv, sc);
    }
    if constexpr (kT == 32) {  // one warp: its shuffle tree alone
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float v = warp_sum(acc[m][r]);
          if (tid == 0 && m < mrows && n0 + r < N) store(p0 + m, r, v);
        }
    } else {
      reduce_store_to<M, R>(acc, red, mrows, n0, N, [&](int m, int r, float v) { store(p0 + m, r, v); });
    }
  }
}

// grid: (ceil(N / R), slots), kT threads a block (kT = 32: blocks of one warp). M: tokens per
// pass (runtime mrows <= M).
template <int M, int R, bool kFp8, int kConv, int kT = kStThreads>
__global__ void __launch_bounds__(kT, kStMinBlocks(M) * (kStThreads / kT)) gemv_stream_kernel(const StArgs a) {
  constexpr int64_t kEb = kFp8 ? 1 : 2;
  prefetch_rows_l2<R>(a, a.K * kEb);
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t N = a.N;

  float* y;
  SlotWork sw;
  if (!block_work(a, &sw, &y)) return;
  const int64_t r_begin = sw.r_begin, r_end = sw.r_end, y_off = sw.y_off;
  const int64_t n0 = blockIdx.x * int64_t{R};
  if (n0 >= N || r_begin >= r_end) return;  // block-uniform
  __shared__ float red[kStWarps][M * R];
  stream_rows<M, R, kFp8, kConv, kXLdg, kT>(sw.w, sw.w_scale, N, a.K, n0, a.x, sw.xmap, sw.x_off, r_begin, r_end,
                                            red, [&](int64_t p, int r, float v) { y[(y_off + p) * N + n0 + r] = v; });
}

}  // namespace ml4::cuda::gemv_stream
