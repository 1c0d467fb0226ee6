// The tensor-core weight stream (included by gemv.cu only; gemv.h has the public API and says
// why the sums stay f32). bf16, FP8 block and, since 2026-12-05 (sixth session), NVFP4 / MXFP4
// weights.
//
// Block = 8 warps, 128 weight rows (warp w: rows n0 + w*16 .. +16, one mma m16 tile), one
// K slice. A warp "step" covers 16 rows x SK = 4*E k (E = 8 bf16, 16 e4m3 or 32 e2m1 per
// 16-byte load): lane (g, t) = (lane / 4, lane % 4) loads rows n0+g and n0+g+8 at k = kb + E*t.
// Because a dot product does not care which physical k sits at which mma k index, that
// 16-byte chunk is the lane's A fragment for E/4 m16n8k16 mmas (bf16 as it is; e4m3 and
// e2m1 after an exact conversion to bf16), provided the B fragment (the 8 tokens' x) uses the
// same permutation -- and then lane (g, t) needs exactly x[token g][kb + E*t .. + E).
// x is staged per K chunk in shared memory already split into P bf16 parts in per-lane order
// ([step][part][word][lane] uint4: conflict-free 16-byte loads), so one weight load feeds
// P*E/4 mmas. P = 3 (hi + mid + lo = x exactly, 24 bits): every product is exact in f32 and
// the result matches cpu::linear to f32 rounding; FP4 may ask for P = 2 (x to 16 bits,
// relative error <= 2^-17 per element) or P = 1 (x rounded to bf16, <= 2^-9; the production
// choice, CudaRunnerOptions::fp4_x_parts): a 4-bit weight
// carries 4 times the k of an FP8 byte, so at full HBM rate P = 3 would need ~0.9 PFLOP/s of
// mma.sync, more than the tensor cores give (gemv.h: GemvParams::x_parts).
//
// FP4 decoding (exact; as cpu::linear, model/linear_weight.h): the lane's 4-byte word i holds
// elements 8i .. 8i+7 (element j in nibble j: sign, 2 exponent bits, 1 mantissa bit). The
// 3-bit magnitudes index two byte tables (the low and high bytes of bf16 0, 0.5, 1, 1.5, 2, 3,
// 4, 6) through prmt, the pairs (j, j+4) are interleaved into bf16x2 words, and the sign
// bits, which then sit 4 (3 - j) bits below their place in both halves alike, are shifted and
// OR-ed in: 18 integer ops per 8 weights (the kernel's limit: measured on the H100 at ~1.9 TB/s
// of FP4 weights, docs/BENCHMARKS.md "Sixth session"). Then each bf16x2 is multiplied by its group's scale (NVFP4:
// e4m3 per 16 k, MXFP4: 2^(e - 127) per 32 k), exactly: e2m1 x e4m3 has at most 6
// significant bits, a power of two none. The NVFP4 global scale multiplies the f32 result.
// So mma (word i, half h) pairs weights (2h, 2h+4 | 2h+1, 2h+5) with x staged in that order.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/cuda_common.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/gemv_stream.cuh"
#include "ops/cuda/pdl.cuh"

namespace ml4::cuda::gemv_tc {

enum TcFormat : int { kTcBf16 = 0, kTcFp8 = 1, kTcNvFp4 = 2, kTcMxFp4 = 3 };

constexpr int kTcWarps = 8;
constexpr int kTcRows = kTcWarps * 16;   // weight rows per block
constexpr int kTcU = 4;                  // steps per batch (2 x 16-byte loads each)
constexpr int kTcChunkK = 1024;          // k per staged x chunk: 16 KB of shared memory per x part
constexpr int kTcMaxSplit = 16;
constexpr int kTcTokens = 8;             // tokens (mma n) per pass

struct TcArgs : gemv_stream::GroupedArgs {  // grouped: blockIdx.z = slot
  const float* x = nullptr;
  int64_t N = 0, K = 0;
  const uint8_t* w = nullptr;            // single matrix (gemv)
  const float* w_scale = nullptr;        // FP8: f32 block scales; FP4: the scale bytes (gemv.h)
  float* y = nullptr;
  int64_t k_slice = 0;                   // K per blockIdx.y
  int64_t y_slice_stride = 0;            // floats between split-K slices of y
  int rows = 0;                          // gemv: M
  int prefetch = 0;                      // L2 prefetch distance in steps beyond the register batch (0: off)
};

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t v) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);  // exact: e4m3 values are bf16 values
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 b) { return *reinterpret_cast<const uint32_t*>(&b); }

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r =
      __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return bf16x2_bits(r);
}

// x = p0 + p1 + ... + p(P-1): p0 = bf16(x), each next part the bf16 of the remainder (exact
// in f32; 3 parts are x exactly, 24 bits). Eight floats -> P uint4 of 8 bf16, in the order
// kFp4Order asks: (0, 1), (2, 3), ... for bf16 / FP8 weights, (0, 4), (1, 5), (2, 6), (3, 7)
// for FP4 (the decoder's pairs).
template <int P, bool kFp4Order>
__device__ __forceinline__ void split_parts(const float4& a, const float4& b, uint4 (&out)[P]) {
  float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  uint32_t w[P][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int i0 = kFp4Order ? i : 2 * i, i1 = kFp4Order ? i + 4 : 2 * i + 1;
    float r0 = f[i0], r1 = f[i1];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(r0, r1);
      w[p][i] = bf16x2_bits(v);
      if (p + 1 < P) {
        const float2 fv = __bfloat1622float2(v);
        r0 -= fv.x;
        r1 -= fv.y;
      }
    }
  }
#pragma unroll
  for (int p = 0; p < P; ++p) out[p] = make_uint4(w[p][0], w[p][1], w[p][2], w[p][3]);
}

// 8 e2m1 (one word, element j in nibble j) -> 4 bf16x2: (0, 4), (1, 5), (2, 6), (3, 7).
__device__ __forceinline__ void e2m1x8_to_bf16(uint32_t w, uint32_t (&r)[4]) {
  // Low / high bytes of bf16(0, 0.5, 1, 1.5, 2, 3, 4, 6) by 3-bit magnitude code.
  constexpr uint32_t kLo0 = 0xC0800000u, kLo1 = 0xC0804000u, kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;
  const uint32_t m = w & 0x77777777u;              // magnitudes (prmt reads bit 3 as a mode bit)
  const uint32_t s0 = __byte_perm(m, 0, 0x0020);   // nibbles 0 1 4 5
  const uint32_t s1 = __byte_perm(m, 0, 0x0031);   // nibbles 2 3 6 7
  const uint32_t l0 = __byte_perm(kLo0, kLo1, s0), h0 = __byte_perm(kHi0, kHi1, s0);
  const uint32_t l1 = __byte_perm(kLo0, kLo1, s1), h1 = __byte_perm(kHi0, kHi1, s1);
  constexpr uint32_t kSign = 0x80008000u;
  r[0] = __byte_perm(l0, h0, 0x6240) | ((w << 12) & kSign);  // nibbles 0, 4: signs at bits 3, 19
  r[1] = __byte_perm(l0, h0, 0x7351) | ((w << 8) & kSign);   // 1, 5: bits 7, 23
  r[2] = __byte_perm(l1, h1, 0x6240) | ((w << 4) & kSign);   // 2, 6: bits 11, 27
  r[3] = __byte_perm(l1, h1, 0x7351) | (w & kSign);          // 3, 7: bits 15, 31
}

// An MXFP4 e8m0 scale as bf16x2 (both halves): 2^(e - 127) is bf16 exponent field e; 0 is
// 2^-127 (a bf16 subnormal), 255 NaN.
__device__ __forceinline__ uint32_t e8m0_bf16x2(uint32_t e) {
  const uint32_t b = e == 0 ? 0x0040u : e == 255 ? 0x7FC0u : (e << 7);
  return b | (b << 16);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int kFmt> struct TcFmt {
  static constexpr bool kFp4 = kFmt == kTcNvFp4 || kFmt == kTcMxFp4;
  static constexpr int E = kFmt == kTcBf16 ? 8 : kFmt == kTcFp8 ? 16 : 32;  // weights per 16-byte load
  static constexpr int SK = 4 * E;                                          // k per warp step
  static constexpr int H = E / 8;                                           // x words (8 floats) per lane step
  // Weight bytes of elements [0, k) of a row: k * 2, k or k / 2.
  __device__ static int64_t bytes(int64_t k) { return kFmt == kTcBf16 ? 2 * k : kFmt == kTcFp8 ? k : k / 2; }
};

// Scale bits of one step for rows a (low 16 bits) and b (high 16): FP8 the block scale's f32
// bits (one per 128 rows, row a's); NVFP4 the two e4m3 bytes of the lane's two 16-k groups;
// MXFP4 the e8m0 byte of its 32-k group.
template <int kFmt>
__device__ __forceinline__ uint32_t load_scales(const float* w_scale, int64_t N, int64_t K, int64_t n0, int64_t row_a,
                                                int64_t row_b, bool ok_a, bool ok_b, int64_t k_lane) {
  if constexpr (kFmt == kTcFp8) {
    return __float_as_uint(__ldg(w_scale + (n0 / 128) * (K / 128) + k_lane / 128));
  } else if constexpr (kFmt == kTcNvFp4) {
    const uint8_t* s = reinterpret_cast<const uint8_t*>(w_scale);
    const int64_t ng = K / 16;
    const uint32_t a = ok_a ? __ldg(reinterpret_cast<const uint16_t*>(s + row_a * ng + k_lane / 16)) : 0u;
    const uint32_t b = ok_b ? __ldg(reinterpret_cast<const uint16_t*>(s + row_b * ng + k_lane / 16)) : 0u;
    return a | (b << 16);
  } else if constexpr (kFmt == kTcMxFp4) {
    const uint8_t* s = reinterpret_cast<const uint8_t*>(w_scale);
    const int64_t ng = K / 32;
    const uint32_t a = ok_a ? __ldg(s + row_a * ng + k_lane / 32) : 0u;
    const uint32_t b = ok_b ? __ldg(s + row_b * ng + k_lane / 32) : 0u;
    return a | (b << 16);
  } else {
    return 0u;
  }
}

// One step of 16 rows x 4E k for the lane: tacc += A(wa, wb) . x (P parts at xp).
template <int kFmt, int P>
__device__ __forceinline__ void step_mma(float (&tacc)[4], const uint4& wa, const uint4& wb, uint32_t sc,
                                         const uint4* xp) {
  constexpr int H = TcFmt<kFmt>::H;
  if constexpr (TcFmt<kFmt>::kFp4) {
    uint32_t sa[2], sb[2];  // bf16x2 scales of words 0-1 and 2-3 (NVFP4) or all four (MXFP4)
    if constexpr (kFmt == kTcNvFp4) {
      const uint32_t fa = e4m3x2_to_bf16x2(sc & 0xffffu), fb = e4m3x2_to_bf16x2(sc >> 16);
      sa[0] = __byte_perm(fa, 0, 0x1010);
      sa[1] = __byte_perm(fa, 0, 0x3232);
      sb[0] = __byte_perm(fb, 0, 0x1010);
      sb[1] = __byte_perm(fb, 0, 0x3232);
    } else {
      sa[0] = sa[1] = e8m0_bf16x2(sc & 0xffu);
      sb[0] = sb[1] = e8m0_bf16x2((sc >> 16) & 0xffu);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t ra[4], rb[4];
      e2m1x8_to_bf16(word(wa, i), ra);
      e2m1x8_to_bf16(word(wb, i), rb);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        ra[j] = bf16x2_mul(ra[j], sa[i / 2]);
        rb[j] = bf16x2_mul(rb[j], sb[i / 2]);
      }
#pragma unroll
      for (int p = P - 1; p >= 0; --p) {  // smallest part first
        const uint4 xv = xp[(p * H + i) * 32];
#pragma unroll
        for (int h = 0; h < 2; ++h)
          mma_bf16(tacc, ra[2 * h], rb[2 * h], ra[2 * h + 1], rb[2 * h + 1], word(xv, 2 * h), word(xv, 2 * h + 1));
      }
    }
  } else if constexpr (kFmt == kTcFp8) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
#pragma unroll
      for (int qq = 0; qq < 2; ++qq) {
        const int q = 2 * h + qq;  // slice: weight word q, x words 2qq, 2qq+1
        const uint32_t wqa = word(wa, q), wqb = word(wb, q);
        const uint32_t a0 = e4m3x2_to_bf16x2(wqa), a2 = e4m3x2_to_bf16x2(wqa >> 16);
        const uint32_t a1 = e4m3x2_to_bf16x2(wqb), a3 = e4m3x2_to_bf16x2(wqb >> 16);
#pragma unroll
        for (int p = P - 1; p >= 0; --p) {
          const uint4 xv = xp[(p * H + h) * 32];
          mma_bf16(tacc, a0, a1, a2, a3, word(xv, 2 * qq), word(xv, 2 * qq + 1));
        }
      }
    }
  } else {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint32_t a0 = word(wa, 2 * q), a2 = word(wa, 2 * q + 1);
      const uint32_t a1 = word(wb, 2 * q), a3 = word(wb, 2 * q + 1);
#pragma unroll
      for (int p = P - 1; p >= 0; --p) {
        const uint4 xv = xp[p * 32];
        mma_bf16(tacc, a0, a1, a2, a3, word(xv, 2 * q), word(xv, 2 * q + 1));
      }
    }
  }
}

template <int kFmt, int P>
__global__ void __launch_bounds__(kTcWarps * 32, 2) gemv_tc_kernel(const TcArgs a) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  using F = TcFmt<kFmt>;
  constexpr int E = F::E, SK = F::SK, H = F::H;
  constexpr int PW = P * H;            // uint4 per lane per step
  constexpr int kSteps = kTcChunkK / SK;
  extern __shared__ uint4 xs[];        // [kSteps][P][H][32]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t N = a.N, K = a.K;

  // Which matrix and which rows this block serves.
  gemv_stream::SlotWork sw;
  sw.w = a.w;
  sw.w_scale = a.w_scale;
  sw.r_end = a.rows;
  if (a.offsets && !gemv_stream::grouped_slot(a, blockIdx.z, a.w_table, a.s_table, a.extra_w, a.extra_s, &sw)) return;
  const uint8_t* w = sw.w;
  const float* w_scale = sw.w_scale;
  const int64_t r_begin = sw.r_begin, r_end = sw.r_end, x_off = sw.x_off, y_off = sw.y_off;
  const int32_t* xmap = sw.xmap;
  const int64_t n0 = blockIdx.x * int64_t{kTcRows} + warp * 16;
  const bool warp_on = n0 < N;
  const int64_t row_a = n0 + g, row_b = n0 + g + 8;
  const int64_t k_begin = blockIdx.y * a.k_slice, k_end = min(K, k_begin + a.k_slice);
  if (k_begin >= k_end) return;  // block-uniform
  const int n_steps = static_cast<int>((k_end - k_begin + SK - 1) / SK);
  const int n_batches = (n_steps + kTcU - 1) / kTcU;
  const uint8_t* wa_ptr = w + F::bytes(row_a * K + k_begin + int64_t{E} * t);
  const uint8_t* wb_ptr = w + F::bytes(row_b * K + k_begin + int64_t{E} * t);
  const int64_t step_bytes = F::bytes(SK);
  const bool ok_a = warp_on && row_a < N, ok_b = warp_on && row_b < N;
  float gscale = 1.0f;  // NVFP4: the global scale after the e4m3 scales (gemv.h fp4_global_offset)
  if constexpr (kFmt == kTcNvFp4)
    gscale = *reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(w_scale) + fp4_global_offset(N, K));
  float* ybase = a.y + blockIdx.y * a.y_slice_stride;

  uint4 wa[kTcU], wb[kTcU];
  uint32_t sc[kTcU];
  auto load_batch = [&](int b, uint4 (&la)[kTcU], uint4 (&lb)[kTcU], uint32_t (&ls)[kTcU]) {
#pragma unroll
    for (int u = 0; u < kTcU; ++u) {
      const int st = b * kTcU + u;
      const int64_t k = k_begin + int64_t{st} * SK + int64_t{E} * t;
      const bool in = st < n_steps && k < k_end;
      la[u] = (in && ok_a) ? __ldcs(reinterpret_cast<const uint4*>(wa_ptr + st * step_bytes)) : make_uint4(0, 0, 0, 0);
      lb[u] = (in && ok_b) ? __ldcs(reinterpret_cast<const uint4*>(wb_ptr + st * step_bytes)) : make_uint4(0, 0, 0, 0);
      if constexpr (kFmt != kTcBf16)
        ls[u] = (st < n_steps && warp_on) ? load_scales<kFmt>(w_scale, N, K, n0, row_a, row_b, ok_a && in, ok_b && in, k)
                                          : 0u;
      const int sp = st + a.prefetch;
      if (a.prefetch > 0 && sp < n_steps && k + int64_t{a.prefetch} * SK < k_end) {
        if (ok_a) prefetch_l2(wa_ptr + sp * step_bytes);
        if (ok_b) prefetch_l2(wb_ptr + sp * step_bytes);
      }
    }
  };

  for (int64_t p0 = r_begin; p0 < r_end; p0 += kTcTokens) {
    const int mrows = static_cast<int>(min(int64_t{kTcTokens}, r_end - p0));
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    load_batch(0, wa, wb, sc);
    for (int c0 = 0; c0 < n_steps; c0 += kSteps) {  // x chunk: steps [c0, c0 + kSteps)
      const int cs = min(kSteps, n_steps - c0);
      __syncthreads();  // the previous chunk's readers are done
      for (int u = tid; u < cs * 32 * H; u += kTcWarps * 32) {
        const int j = u / (32 * H), rem = u % (32 * H), h = rem / 32, l = rem % 32;
        const int tok = l >> 2;
        const int64_t k = k_begin + int64_t{c0 + j} * SK + int64_t{E} * (l & 3) + 8 * h;
        float4 f0 = make_float4(0, 0, 0, 0), f1 = f0;
        if (tok < mrows && k < k_end) {
          const int64_t i = p0 + tok;
          const int64_t xr = xmap ? int64_t{xmap[i]} : x_off + i;
          const float4* src = reinterpret_cast<const float4*>(a.x + xr * K + k);
          f0 = __ldg(src);
          f1 = __ldg(src + 1);
        }
        uint4 parts[P];
        split_parts<P, F::kFp4>(f0, f1, parts);
        uint4* dst = xs + (j * PW + h) * 32 + l;
#pragma unroll
        for (int p = 0; p < P; ++p) dst[p * H * 32] = parts[p];
      }
      __syncthreads();
      const int b_end = (c0 + cs + kTcU - 1) / kTcU;
      for (int b = c0 / kTcU; b < b_end; ++b) {
        uint4 na[kTcU], nb[kTcU];
        uint32_t ns[kTcU];
        load_batch(b + 1 < n_batches ? b + 1 : n_batches, na, nb, ns);  // past the end: all guarded off
#pragma unroll
        for (int u = 0; u < kTcU; ++u) {
          const int st = b * kTcU + u;
          if (st >= c0 + cs) break;
          // One partial per step, added with an f32 add (FP8: times its block scale): the mma
          // accumulator does not round like an f32 add (on the H200, one accumulator over
          // K = 6144 drifted to 2e-5 relative against cpu::linear; per-step partials keep it
          // at ~1e-6).
          float tacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          step_mma<kFmt, P>(tacc, wa[u], wb[u], sc[u], xs + (st - c0) * PW * 32 + lane);
          if constexpr (kFmt == kTcFp8) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] = fmaf(tacc[i], __uint_as_float(sc[u]), acc[i]);
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] += tacc[i];
          }
        }
#pragma unroll
        for (int u = 0; u < kTcU; ++u) {
          wa[u] = na[u];
          wb[u] = nb[u];
          sc[u] = ns[u];
        }
      }
    }
    // C fragment: (row g | g+8, tokens 2t, 2t+1).
    if (warp_on) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = 2 * t + (i & 1);
        const int64_t row = (i < 2) ? row_a : row_b;
        if (tok < mrows && row < N) ybase[(y_off + p0 + tok) * N + row] = acc[i] * gscale;
      }
    }
  }
}

inline TcFormat tc_format(LinearFormat f) {
  switch (f) {
    case LinearFormat::kFP8Block: return kTcFp8;
    case LinearFormat::kNVFP4: return kTcNvFp4;
    case LinearFormat::kMXFP4: return kTcMxFp4;
    default: return kTcBf16;
  }
}

// k per warp step (the split-K unit).
inline int64_t tc_step_k(TcFormat f) { return f == kTcBf16 ? 32 : f == kTcFp8 ? 64 : 128; }

// Split-K: the S (1..16) that minimizes the weight stream's time over the fraction of block
// slots busy in its last wave (2 blocks of 8 warps per SM), plus the partial sums' round trip
// and the reduce launch (~1 us, counted as 4 MB).
inline int tc_split(int64_t M, int64_t N, int64_t K, TcFormat f, bool have_ws, int64_t* Ks) {
  const int64_t unit = f == kTcBf16 ? 32 : 128;  // FP8: whole 128-k scale blocks
  const int64_t nb = (N + kTcRows - 1) / kTcRows, slots = int64_t{2} * std::max(sm_count(), 1);
  const double wbytes = static_cast<double>(N) * K * (f == kTcBf16 ? 2.0 : f == kTcFp8 ? 1.0 : 0.5);
  int best = 1;
  double best_cost = 1e300;
  for (int S = 1; S <= (have_ws ? kTcMaxSplit : 1); ++S) {
    const int64_t ks = ((K + S - 1) / S + unit - 1) / unit * unit;
    if ((K + ks - 1) / ks != S) continue;
    if (S > 1 && ks < 256) break;
    const int64_t blocks = nb * S, waves = (blocks + slots - 1) / slots;
    const double util = static_cast<double>(blocks) / static_cast<double>(waves * slots);
    const double cost = wbytes / util + (S > 1 ? 8.0 * S * M * N + 4e6 : 0.0);
    if (cost < best_cost) {
      best_cost = cost;
      best = S;
    }
  }
  *Ks = ((K + best - 1) / best + unit - 1) / unit * unit;
  return best;
}

// 8 tokens x P bf16 parts x 2 bytes per k of the staged chunk (<= 48 KB: no opt-in).
inline size_t tc_smem(int parts) { return size_t{kTcChunkK} * 16 * parts; }

template <int kFmt, int P>
void launch_tc_fp(const TcArgs& a, dim3 grid, cudaStream_t stream) {
  launch_kernel(gemv_tc_kernel<kFmt, P>, grid, kTcWarps * 32, tc_smem(P), stream, a);
}

// Blocks of 128 rows over a.N x gy (split-K slices) x gz (grouped slots). parts: x parts for
// FP4 (1, 2 or 3); bf16 and FP8 always take 3 (exact). (Tried 2026-12-05 on the H100 and
// removed: 4 k-phases of 32-row blocks for launches with few blocks, 3-5% slower at batch 1;
// staging FP4's whole K slice at once (100 KB), 3-8% slower at batch 8 and 64.)
inline Status launch_tc(const TcArgs& a, unsigned gy, unsigned gz, TcFormat f, int parts, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.N + kTcRows - 1) / kTcRows), gy, gz);
  switch (f) {
    case kTcBf16: launch_tc_fp<kTcBf16, 3>(a, grid, stream); break;
    case kTcFp8: launch_tc_fp<kTcFp8, 3>(a, grid, stream); break;
    case kTcNvFp4:
      parts == 1 ? launch_tc_fp<kTcNvFp4, 1>(a, grid, stream)
      : parts == 2 ? launch_tc_fp<kTcNvFp4, 2>(a, grid, stream)
                   : launch_tc_fp<kTcNvFp4, 3>(a, grid, stream);
      break;
    case kTcMxFp4:
      parts == 1 ? launch_tc_fp<kTcMxFp4, 1>(a, grid, stream)
      : parts == 2 ? launch_tc_fp<kTcMxFp4, 2>(a, grid, stream)
                   : launch_tc_fp<kTcMxFp4, 3>(a, grid, stream);
      break;
  }
  return cuda_status(cudaGetLastError(), "gemv_tc_kernel");
}

}  // namespace ml4::cuda::gemv_tc
