// FP8 weights at 1-4 tokens on the tensor cores with f16 arithmetic (included by gemv.cu only;
// gemv.h has the public API: GemvStreamConfig::mma). Written in the twenty-sixth session for
// issue 19 after ncu and the SASS showed the CUDA-core stream (gemv_stream.cuh) spending ~12
// instructions per 4 weights of a row in its loop (21.5 with its setup) and reaching 70-86% of
// copy where the same kernel streams bf16 at 96-101% (docs/BENCHMARKS.md "Twenty-fifth session").
//
// Block = W warps (4, 8 or 16: more where N has few 16-row tiles), 16 weight rows (one mma m16
// tile); the warps split K into contiguous ranges
// of whole 128-k scale blocks and meet once, at the end, in shared memory (fixed order:
// deterministic). A warp works in chunks of 256 k (4 steps of 64 k, 2 scale blocks): lane
// (g, t) = (lane / 4, lane % 4) loads 16 bytes of row g and of row g + 8 at k = k0 + 64 s + 16 t
// for each step s, the next chunk's loads issued before this chunk is used.
//
// The 16 bytes are the lane's A fragments of 4 m16n8k16 mmas: word i (4 e4m3 at k .. k + 3) gives
// (k, k + 1) and (k + 2, k + 3) as f16x2 by cvt.rn.f16x2.e4m3x2 (exact: every e4m3 is an f16),
// the mma's k indices (2t, 2t + 1) and (2t + 8, 2t + 9). A dot product does not care which
// physical k sits at which mma k index, so B uses the same permutation: lane (g, t) needs
// column g's x at k .. k + 16 in natural order, two uint4 of f16x2.
//
// B columns: 2 per token, x = hi + lo in f16 (column 2m: hi, 2m + 1: lo; 8 columns = 4 tokens).
// f16 lacks f32's range, so each warp scales each chunk's x of each token by a power of two,
// 2^S, that puts the chunk's largest |x| in [2^14, 2^15): hi = f16(x 2^S), lo = f16(x 2^S - hi),
// so x keeps 22 significant bits (relative error <= 2^-22) for every element within 2^17 of the
// chunk's largest, and an absolute error <= 2^-25 (scaled) below that, i.e. <= 2^-39 of the
// largest. Every product of an e4m3 and an f16 is exact in the f32 accumulator; each 128-k
// block's accumulator (fresh per block) is added to the row's sum with one f32 FMA times
// (block scale x 2^-S), and hi and lo sum there. So the result is cpu::linear's to f32
// rounding and a 2^-22 change of x: ~1e-7 relative, other bits than the stream kernels.
// (S is clamped to [-113, 126]: a chunk whose largest |x| is below 2^-112 keeps fewer bits.)
//
// Cost per 1 KB of weights and warp (one step): 2 x 16-byte loads, 16 conversions, 8 shifts, 4
// mmas, 2 shared-memory loads for B (lanes g < 2M only) and, once per chunk, the x staging; the
// stream kernel's loop issues ~96. Measured (H100, docs/BENCHMARKS.md "Twenty-sixth session"):
// at one token 6-12% slower than the stream back to back (latency-bound: 16-row blocks are one
// partial wave; a variant with one x scale a warp, x loaded with the weights and two mma chains
// was slower still, twenty-seventh session); at 4 tokens, where its cost does not grow with M,
// 20-38% faster than the stream and 8-17% faster than the bf16-part tensor-core kernel
// (gemv_tc.cuh) but at the widest shape; at 2 tokens the stream's one-warp rows beat it alone
// and in the step (batch 2 2.30 -> 2.22 ms, H100). The default from 3 tokens
// (GemvStreamConfig::mma_min_m).
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "ops/cuda/gemv_stream.cuh"
#include "ops/cuda/pdl.cuh"

namespace ml4::cuda::gemv_mma {

using gemv_stream::StArgs;

constexpr int kMmaRows = 16;   // weight rows per block
constexpr int kMmaSteps = 4;   // 64-k steps per chunk
constexpr int kMmaChunk = 64 * kMmaSteps;
// Warps per SM the registers must allow (M <= 2: 128 registers, M = 4: 168).
constexpr int kMmaMinWarps(int m) { return m <= 2 ? 16 : 12; }

// Two e4m3 (low 16 bits of v: k, k + 1) -> f16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t f16x2_bits(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// 8 floats of x (already times 2^S) -> their hi and lo f16 parts, 4 f16x2 each.
__device__ __forceinline__ void split8(const float (&f)[8], uint4* hi, uint4* lo) {
  uint32_t h[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    h[i] = f16x2_bits(f[2 * i], f[2 * i + 1]);
    const float2 hf = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
    l[i] = f16x2_bits(f[2 * i] - hf.x, f[2 * i + 1] - hf.y);  // exact differences
  }
  *hi = make_uint4(h[0], h[1], h[2], h[3]);
  *lo = make_uint4(l[0], l[1], l[2], l[3]);
}

// The power of two S that puts amax in [2^14, 2^15) (clamped to [-113, 126]; amax 0: 0).
__device__ __forceinline__ int x_shift(float amax) {
  if (!(amax > 0.0f)) return 0;
  const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFF);  // biased exponent
  return max(-113, min(126, 141 - e));
}

__device__ __forceinline__ float pow2f(int s) { return __uint_as_float(static_cast<uint32_t>(s + 127) << 23); }

// grid: (ceil(N / 16), slots), W * 32 threads. M: tokens per pass (1, 2 or 4; runtime mrows <= M).
template <int M, int W>
__global__ void __launch_bounds__(W * 32, kMmaMinWarps(M) / W > 0 ? kMmaMinWarps(M) / W : 1)
    gemv_mma_kernel(const StArgs a) {
  constexpr int C = 2 * M;  // B columns in use
  static_assert(W * kMmaSteps * 2 * C * 4 * 16 <= 32 * 1024, "stage: at most 32 KB");
  gemv_stream::prefetch_rows_l2<kMmaRows>(a, a.K);
  pdl_wait();
  pdl_launch_dependents();
  const int64_t N = a.N, K = a.K;
  float* y;
  gemv_stream::SlotWork sw;
  if (!gemv_stream::block_work(a, &sw, &y)) return;
  const int64_t r_begin = sw.r_begin, r_end = sw.r_end;
  const int64_t n0 = blockIdx.x * int64_t{kMmaRows};
  if (n0 >= N || r_begin >= r_end) return;  // block-uniform

  // Per warp: [step][half][column][t] uint4 (16 f16: column c's x at k0 + 64 step + 16 t + 8 half).
  __shared__ uint4 stage[W][kMmaSteps][2][C][4];
  __shared__ float red[W][M][kMmaRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t nb = K / 128;  // scale blocks per row
  const int64_t kb_begin = warp * nb / W, kb_end = (warp + 1) * nb / W;
  const int64_t k_begin = kb_begin * 128, k_end = kb_end * 128;
  const int nch = static_cast<int>((k_end - k_begin + kMmaChunk - 1) / kMmaChunk);
  const uint8_t* wa = sw.w + min(n0 + g, N - 1) * K + 16 * t;  // tail rows: row N - 1, unused
  const uint8_t* wb = sw.w + min(n0 + g + 8, N - 1) * K + 16 * t;
  const float* srow = sw.w_scale + (n0 / 128) * nb;
  uint4(*st)[2][C][4] = stage[warp];
  // This lane's 8 x of a chunk: k0 + 8 lane, staged at [lane / 8][lane % 2][c][(lane / 2) % 4].
  const int s_st = lane >> 3, h_st = lane & 1, t_st = (lane >> 1) & 3;

  for (int64_t p0 = r_begin; p0 < r_end; p0 += M) {
    const int mrows = static_cast<int>(min(int64_t{M}, r_end - p0));
    const float* xr[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int64_t i = p0 + min(m, mrows - 1);
      xr[m] = a.x + (sw.xmap ? int64_t{sw.xmap[i]} : sw.x_off + i) * K;
    }
    float tot0 = 0.0f, tot1 = 0.0f;  // rows g and g + 8, token t
    auto load_w = [&](int c, uint4 (&w)[kMmaSteps][2]) {
      const int64_t k0 = k_begin + int64_t{c} * kMmaChunk;
#pragma unroll
      for (int s = 0; s < kMmaSteps; ++s) {
        if (k0 + 64 * s < k_end) {
          w[s][0] = __ldcs(reinterpret_cast<const uint4*>(wa + k0 + 64 * s));
          w[s][1] = __ldcs(reinterpret_cast<const uint4*>(wb + k0 + 64 * s));
        }
      }
    };
    auto run = [&](int c, const uint4 (&w)[kMmaSteps][2]) {
      const int64_t k0 = k_begin + int64_t{c} * kMmaChunk;
      const bool half_chunk = k0 + 128 >= k_end;  // the range's last chunk may hold one scale block
      // Stage x: each token's 256 values of this chunk, 8 a lane, scaled and split.
      float inv_t = 1.0f;
      float sc0 = __ldg(srow + k0 / 128), sc1 = half_chunk ? 0.0f : __ldg(srow + k0 / 128 + 1);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float f[8];
        if (m < mrows && !(half_chunk && lane >= 16)) {
          const float4* px = reinterpret_cast<const float4*>(xr[m] + k0 + 8 * lane);
          const float4 u = __ldg(px), v = __ldg(px + 1);
          f[0] = u.x, f[1] = u.y, f[2] = u.z, f[3] = u.w, f[4] = v.x, f[5] = v.y, f[6] = v.z, f[7] = v.w;
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) f[i] = 0.0f;
        }
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const int S = x_shift(amax);
        const float scale = pow2f(S);
        if (t == m) inv_t = pow2f(-S);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] *= scale;
        split8(f, &st[s_st][h_st][2 * m][t_st], &st[s_st][h_st][2 * m + 1][t_st]);
      }
      __syncwarp();
      sc0 *= inv_t;
      sc1 *= inv_t;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < kMmaSteps; ++s) {
        if (s >= 2 && half_chunk) break;
        uint4 b0 = make_uint4(0, 0, 0, 0), b1 = b0;
        if (g < C) {
          b0 = st[s][0][g][t];
          b1 = st[s][1][g][t];
        }
        const uint32_t ra[4] = {w[s][0].x, w[s][0].y, w[s][0].z, w[s][0].w};
        const uint32_t rb[4] = {w[s][1].x, w[s][1].y, w[s][1].z, w[s][1].w};
        const uint32_t bw[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          mma_f16(acc, e4m3x2_f16x2(ra[i]), e4m3x2_f16x2(rb[i]), e4m3x2_f16x2(ra[i] >> 16),
                  e4m3x2_f16x2(rb[i] >> 16), bw[2 * i], bw[2 * i + 1]);
        if (s & 1) {  // a 128-k scale block done: hi + lo times its scale
          const float sc = s == 1 ? sc0 : sc1;
          tot0 = fmaf(acc[0] + acc[1], sc, tot0);
          tot1 = fmaf(acc[2] + acc[3], sc, tot1);
          acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
        }
      }
      __syncwarp();  // the stage is rewritten by the next chunk
    };
    uint4 w0[kMmaSteps][2], w1[kMmaSteps][2];
    if (nch > 0) load_w(0, w0);
    for (int c = 0; c < nch; c += 2) {
      if (c + 1 < nch) load_w(c + 1, w1);
      run(c, w0);
      if (c + 1 >= nch) break;
      if (c + 2 < nch) load_w(c + 2, w0);
      run(c + 1, w1);
    }
    if (t < M) {
      red[warp][t][g] = tot0;
      red[warp][t][g + 8] = tot1;
    }
    __syncthreads();
    if (threadIdx.x < M * kMmaRows) {
      const int m = threadIdx.x / kMmaRows, r = threadIdx.x % kMmaRows;
      if (m < mrows && n0 + r < N) {
        float v = red[0][m][r];
#pragma unroll
        for (int ww = 1; ww < W; ++ww) v += red[ww][m][r];
        y[(sw.y_off + p0 + m) * N + n0 + r] = v;
      }
    }
    __syncthreads();  // red is reused by the next token group
  }
}

}  // namespace ml4::cuda::gemv_mma
