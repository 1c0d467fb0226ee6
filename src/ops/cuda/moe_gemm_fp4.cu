// moe_grouped_gemm_fp4 (moe_gemm.h): MoE prefill's grouped GEMMs for NVFP4 / MXFP4 experts
// on Hopper, which has no FP4 matrix units (MODEL.md 4: weights expanded inside the GEMM).
//
// The CTA is moe_gemm.cu's: tile blockIdx.y of moe_permute_gemm's list (64 permuted rows of
// one group), 256 weight rows (2 warpgroups x m64n128; gate_up: 64 gate + the same 64 up rows
// per warpgroup, so the epilogue holds g and u of one element), K in blocks of 64. Per block:
//   A  64 rows x 64 bf16 = 128 bytes a row, cp.async (gathered through a_rows) into a 3-stage
//      ring in the 128-byte swizzle (wgmma.cuh);
//   W  256 rows x 32 bytes of e2m1, cp.async into a 3-stage ring of raw bytes (each thread
//      loads the row it will expand: no barrier between the copy and its reader), then
//      expanded by that thread to bf16 -- e2m1 x its group scale (NVFP4 e4m3 per 16 k, 2 + 4
//      significant bits; MXFP4 2^(e-127) per 32 k) is exact in bf16's 8 -- into one of two
//      bf16 buffers, swizzled as the B descriptor names;
//   then wgmma m64n128k16 bf16 x bf16 -> f32 (4 k steps), asynchronous: while the tensor
//   cores run block kb, the same threads expand block kb + 1 into the other buffer.
// The NVFP4 global scale (an f32 after the e4m3 scales, gemv.h fp4_global_offset) multiplies
// the accumulators in the epilogue; cpu::linear folds it into each weight instead, so the two
// differ by f32 rounding (~1e-7 relative), far below A's bf16 rounding (2^-9 relative per
// element, the accuracy bound the tests argue from).
//
// Shared memory: 2 x 32 KB bf16 B + 3 x (8 KB A + 8 KB raw) + 1 KB alignment = 113 KB, two
// CTAs per SM (228 KB), so one CTA's expansion can run under the other's MMAs. (Deeper rings,
// 4 or 6 stages at one CTA per SM, are compiled for the bench to compare.)
// Deterministic: every output element is one thread's fixed-order sum (tested bit-identical).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/moe_gemm.h"
#include "ops/cuda/wgmma.cuh"
#include "ops/cuda/pdl.cuh"

namespace ml4::cuda {
namespace {

constexpr int kTileRows = kMoeGemmTileRows;  // A rows per CTA (both warpgroups' m64)
constexpr int kBRows = 256;                  // weight rows per CTA: 128 per warpgroup
constexpr int kKBlock = 64;                  // k per stage: 128 bytes of bf16, one swizzle row
constexpr int kDefaultStages = 3;  // the ring depth; 4 and 6 are there for the bench (MoeGroupedGemmFp4Params::stages)
constexpr int kThreads = 256;
constexpr int kAStage = kTileRows * kKBlock * 2;  // 8 KB
constexpr int kRawStage = kBRows * kKBlock / 2;   // 8 KB of e2m1
constexpr int kBBuf = kBRows * kKBlock * 2;       // 32 KB of bf16
constexpr int smem_bytes(int stages) { return 2 * kBBuf + stages * (kAStage + kRawStage) + 1024; }
static_assert(kThreads == kBRows, "one thread expands one weight row");
static_assert(2 * (smem_bytes(kDefaultStages) + 1024) <= 228 * 1024,
              "two CTAs per SM (H100 / H200: 228 KB, 1 KB reserved per CTA)");

// 8 e2m1 (element j in nibble j: sign, 2 exponent bits of bias 1, 1 mantissa bit) -> 4 bf16x2
// in k order: (0, 1), (2, 3), (4, 5), (6, 7). The nibbles are first reordered 0 2 4 6 1 3 5 7
// so that gemv_tc.cuh's table decode, whose pairs are (j, j + 4), yields adjacent pairs: the
// 3-bit magnitudes index the low / high bytes of bf16 0, 0.5, 1, 1.5, 2, 3, 4, 6 through prmt
// and the sign bits are OR-ed into place.
__device__ __forceinline__ void e2m1x8_to_bf16_pairs(uint32_t w0, uint32_t (&r)[4]) {
  const uint32_t lo = w0 & 0x0F0F0F0Fu, hi = (w0 >> 4) & 0x0F0F0F0Fu;  // even / odd elements
  const uint32_t w = __byte_perm(lo | (lo >> 4), hi | (hi >> 4), 0x6420);
  constexpr uint32_t kLo0 = 0xC0800000u, kLo1 = 0xC0804000u, kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;
  const uint32_t m = w & 0x77777777u;  // prmt reads a selector's bit 3 as a mode bit
  const uint32_t s0 = __byte_perm(m, 0, 0x0020), s1 = __byte_perm(m, 0, 0x0031);
  const uint32_t l0 = __byte_perm(kLo0, kLo1, s0), h0 = __byte_perm(kHi0, kHi1, s0);
  const uint32_t l1 = __byte_perm(kLo0, kLo1, s1), h1 = __byte_perm(kHi0, kHi1, s1);
  constexpr uint32_t kSign = 0x80008000u;
  r[0] = __byte_perm(l0, h0, 0x6240) | ((w << 12) & kSign);
  r[1] = __byte_perm(l0, h0, 0x7351) | ((w << 8) & kSign);
  r[2] = __byte_perm(l1, h1, 0x6240) | ((w << 4) & kSign);
  r[3] = __byte_perm(l1, h1, 0x7351) | (w & kSign);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r =
      __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Two e4m3 scales (low 16 bits) -> bf16x2, exact (e4m3 values are bf16 values).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t v) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// e8m0 -> bf16 bits: 2^(e - 127) is bf16 exponent field e; 0 is 2^-127 (a bf16 subnormal),
// 255 NaN (gemv_tc.cuh's e8m0_bf16x2).
__device__ __forceinline__ uint32_t e8m0_to_bf16(uint32_t e) { return e == 0 ? 0x0040u : e == 255 ? 0x7FC0u : (e << 7); }

struct Fp4Args {
  const uint8_t* a;
  const int32_t* a_rows;
  const void* const* w;
  const float* const* ws;
  const void* const* wu;
  const float* const* wus;
  const MoeTile* tiles;
  const int32_t* num_tiles;
  float* y;
  __nv_bfloat16* yb;
  int N, K;
};

template <bool kGateUp, bool kNv, int kStages>
__global__ void __launch_bounds__(kThreads, 2) grouped_gemm_fp4_kernel(const Fp4Args p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  if (static_cast<int>(blockIdx.y) >= __ldg(p.num_tiles)) return;
  const MoeTile t = p.tiles[blockIdx.y];
  const int nrows = t.row1 - t.row0, K = p.K, N = p.N, KB = K / kKBlock;
  const int n0 = blockIdx.x * (kGateUp ? 128 : 256);
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t sbase = (raw_addr + 1023u) & ~1023u;
  uint8_t* const sm = smem_raw + (sbase - raw_addr);
  // [bf16 B x 2 | A x kStages | raw W x kStages], each region on 1024 bytes.
  const uint32_t sB = sbase, sA = sB + 2 * kBBuf, sR = sA + kStages * kAStage;
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, wwarp = (tid >> 5) & 3;

  // A loader: 16-byte chunk c of rows lr and lr + 32 (one swizzle for both).
  const int lr = tid >> 3, c = tid & 7;
  const uint32_t swz = static_cast<uint32_t>((c ^ (lr & 7)) << 4);
  auto a_source = [&](int r) { return p.a_rows ? __ldg(p.a_rows + t.row0 + r) : t.row0 + r; };
  const uint8_t* a_src[2];
  bool a_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lr + 32 * i;
    a_ok[i] = r < nrows;
    a_src[i] = p.a + static_cast<int64_t>(a_ok[i] ? a_source(r) : 0) * (2 * K) + c * 16;
  }
  // W: this thread's row, B row tid = sub-block s (64 rows of one matrix) row tid % 64.
  const int s = tid >> 6;
  const int row = (kGateUp ? n0 + (s >> 1) * 64 : n0 + s * 64) + (tid & 63);
  const bool up = kGateUp && (s & 1);
  const bool b_ok = row < N;
  const uint8_t* b_src = static_cast<const uint8_t*>(up ? p.wu[t.group] : p.w[t.group]) +
                         static_cast<int64_t>(b_ok ? row : 0) * (K / 2);
  const uint8_t* s_src = reinterpret_cast<const uint8_t*>(up ? p.wus[t.group] : p.ws[t.group]) +
                         static_cast<int64_t>(b_ok ? row : 0) * (K / (kNv ? 16 : 32));
  const uint32_t rflip = static_cast<uint32_t>((tid >> 2) & 1);  // raw chunks swapped on alternate quads: no bank conflicts

  auto load = [&](int kb) {
    const int slot = kb % kStages;
    const uint32_t as = sA + slot * kAStage, rs = sR + slot * kRawStage + tid * 32;
#pragma unroll
    for (int i = 0; i < 2; ++i) cp_async16(as + (lr + 32 * i) * 128 + swz, a_src[i] + int64_t{kb} * 128, a_ok[i]);
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) cp_async16(rs + ((h ^ rflip) << 4), b_src + int64_t{kb} * 32 + h * 16, b_ok);
  };
  // The scale bytes of block kb: NVFP4 4 e4m3 (16 k each), MXFP4 2 e8m0 (32 k each).
  auto load_scale = [&](int kb) -> uint32_t {
    if (!b_ok || kb >= KB) return 0u;
    return kNv ? __ldg(reinterpret_cast<const uint32_t*>(s_src) + kb)
               : static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(s_src) + kb));
  };
  // Raw block in ring slot `slot` -> bf16 buffer `buf`, row tid, chunk i (k 8i .. 8i + 7) at
  // chunk i ^ (tid % 8).
  auto expand = [&](int slot, int buf, uint32_t sc) {
    const uint8_t* rp = sm + (sR - sbase) + slot * kRawStage + tid * 32;
    const uint4 q0 = *reinterpret_cast<const uint4*>(rp + (rflip << 4));
    const uint4 q1 = *reinterpret_cast<const uint4*>(rp + ((1u ^ rflip) << 4));
    const uint32_t words[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    uint32_t scale[4];  // bf16x2, both halves one group's scale
    if constexpr (kNv) {
      const uint32_t p01 = e4m3x2_to_bf16x2(sc), p23 = e4m3x2_to_bf16x2(sc >> 16);
      scale[0] = __byte_perm(p01, 0, 0x1010);
      scale[1] = __byte_perm(p01, 0, 0x3232);
      scale[2] = __byte_perm(p23, 0, 0x1010);
      scale[3] = __byte_perm(p23, 0, 0x3232);
    } else {
      const uint32_t e0 = e8m0_to_bf16(sc & 0xFFu), e1 = e8m0_to_bf16((sc >> 8) & 0xFFu);
      scale[0] = scale[1] = e0 | (e0 << 16);
      scale[2] = scale[3] = e1 | (e1 << 16);
    }
    uint8_t* bp = sm + (sB - sbase) + buf * kBBuf + tid * 128;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t r[4];
      e2m1x8_to_bf16_pairs(words[i], r);
      const uint32_t sv = scale[i / 2];  // NVFP4: group i / 2; MXFP4: scale[0..1] / [2..3] = group i / 4
#pragma unroll
      for (int e = 0; e < 4; ++e) r[e] = bf16x2_mul(r[e], sv);
      *reinterpret_cast<uint4*>(bp + ((i ^ (tid & 7)) << 4)) = make_uint4(r[0], r[1], r[2], r[3]);
    }
  };

  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < KB) load(st);
    cp_commit();
  }
  uint32_t sc_n1 = load_scale(1), sc_n2 = load_scale(2);  // the scales of blocks kb + 1, kb + 2
  {
    const uint32_t sc0 = load_scale(0);
    cp_wait<kStages - 2>();  // block 0 landed (this thread's copies)
    expand(0, 0, sc0);
  }
  wgmma::fence_proxy_async();  // cp.async and st.shared wrote through the generic proxy; the tensor cores read next
  __syncthreads();
  for (int kb = 0; kb < KB; ++kb) {
    {
      const int j = kb + kStages - 1;  // ring slot of block kb - 1: its MMAs and expansion are done
      if (j < KB) load(j);
      cp_commit();
    }
    const uint32_t sc_n3 = load_scale(kb + 3);
    const uint64_t da = wgmma::desc_k_major(sA + (kb % kStages) * kAStage);
    const uint64_t db = wgmma::desc_k_major(sB + (kb & 1) * kBBuf + wg * 128 * 128);
    wgmma::fence_operands(acc);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::m64n128k16_bf16(acc, da + 2 * ks, db + 2 * ks, 1);  // + 32 bytes a k step
    wgmma::commit();
    // Under the MMAs: block kb + 1 into the other buffer (read by block kb - 1's MMAs, waited on).
    cp_wait<kStages - 2>();
    if (kb + 1 < KB) expand((kb + 1) % kStages, (kb + 1) & 1, sc_n1);
    sc_n1 = sc_n2;
    sc_n2 = sc_n3;
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
    wgmma::fence_proxy_async();
    __syncthreads();
  }
  cp_wait<0>();

  const float gw = kNv ? *reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(p.ws[t.group]) +
                                                          fp4_global_offset(N, K))
                       : 1.0f;
  const float gu = kNv && kGateUp ? *reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(p.wus[t.group]) +
                                                                    fp4_global_offset(N, K))
                                  : 1.0f;
  const int q = lane & 3, r_lo = wwarp * 16 + (lane >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    if (r >= nrows) continue;
    const int64_t yrow = static_cast<int64_t>(t.row0 + r) * N;
    if constexpr (kGateUp) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = n0 + wg * 64 + 8 * j + 2 * q;
        if (col >= N) continue;  // N is even, so col < N covers col + 1
        const float g0 = acc[4 * j + 2 * h] * gw, g1 = acc[4 * j + 2 * h + 1] * gw;
        const float u0 = acc[4 * (j + 8) + 2 * h] * gu, u1 = acc[4 * (j + 8) + 2 * h + 1] * gu;
        // cpu::silu_mul: v / (1 + exp(-v)) * u in f32, then bf16 (the down projection's A).
        *reinterpret_cast<__nv_bfloat162*>(p.yb + yrow + col) =
            __floats2bfloat162_rn(g0 / (1.0f + expf(-g0)) * u0, g1 / (1.0f + expf(-g1)) * u1);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = n0 + wg * 128 + 8 * j + 2 * q;
        if (col >= N) continue;
        *reinterpret_cast<float2*>(p.y + yrow + col) =
            make_float2(acc[4 * j + 2 * h] * gw, acc[4 * j + 2 * h + 1] * gw);
      }
    }
  }
}

template <bool kGateUp, bool kNv, int kStages>
Status launch(const Fp4Args& a, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = smem_bytes(kStages);
  static const cudaError_t attr = cudaFuncSetAttribute(grouped_gemm_fp4_kernel<kGateUp, kNv, kStages>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  ML4_RETURN_IF_ERROR(cuda_status(attr, "cudaFuncSetAttribute(grouped_gemm_fp4_kernel)"));
  launch_kernel(grouped_gemm_fp4_kernel<kGateUp, kNv, kStages>, grid, kThreads, kSmem, stream, a);
  return cuda_status(cudaGetLastError(), "grouped_gemm_fp4_kernel");
}

template <int kStages>
Status launch_stages(const MoeGroupedGemmFp4Params& p, const Fp4Args& a, dim3 grid) {
  if (p.gate_up)
    return p.nvfp4 ? launch<true, true, kStages>(a, grid, p.stream) : launch<true, false, kStages>(a, grid, p.stream);
  return p.nvfp4 ? launch<false, true, kStages>(a, grid, p.stream) : launch<false, false, kStages>(a, grid, p.stream);
}

}  // namespace

namespace {
template <int kStages>
int ctas_per_sm() {
  constexpr int kSmem = smem_bytes(kStages);
  auto kernel = grouped_gemm_fp4_kernel<true, true, kStages>;
  int n = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, kSmem) != cudaSuccess)
    return 0;
  return n;
}
}  // namespace

int moe_grouped_gemm_fp4_ctas_per_sm(int stages) {
  switch (stages == 0 ? kDefaultStages : stages) {
    case 3: return ctas_per_sm<3>();
    case 4: return ctas_per_sm<4>();
    case 6: return ctas_per_sm<6>();
  }
  return 0;
}

Status moe_grouped_gemm_fp4(const MoeGroupedGemmFp4Params& p) {
  if (p.N <= 0 || p.K <= 0 || p.N % 16 != 0 || p.K % kKBlock != 0 || p.N > (int64_t{1} << 30) ||
      p.K > (int64_t{1} << 30))
    return invalid_argument("moe_grouped_gemm_fp4: N={} (a multiple of 16) K={} (a multiple of 64)", p.N, p.K);
  if (!p.a || !p.w || !p.w_scale || !p.tiles || !p.num_tiles || (p.gate_up ? !p.y_bf16 : !p.y) ||
      (p.gate_up && (!p.w_up || !p.w_up_scale)))
    return invalid_argument("moe_grouped_gemm_fp4: null pointer");
  if (reinterpret_cast<uintptr_t>(p.a) & 15u)
    return invalid_argument("moe_grouped_gemm_fp4: A must be 16-byte aligned");
  if (p.max_tiles <= 0) return ok_status();
  if (p.max_tiles > 65535) return invalid_argument("moe_grouped_gemm_fp4: {} tiles (at most 65535)", p.max_tiles);
  const Fp4Args a{static_cast<const uint8_t*>(p.a), p.a_rows, p.w, p.w_scale, p.w_up, p.w_up_scale, p.tiles,
                  p.num_tiles, p.y, static_cast<__nv_bfloat16*>(p.y_bf16), static_cast<int>(p.N),
                  static_cast<int>(p.K)};
  const int cols = p.gate_up ? 128 : 256;
  const dim3 grid(static_cast<unsigned>((p.N + cols - 1) / cols), static_cast<unsigned>(p.max_tiles));
  switch (p.stages == 0 ? kDefaultStages : p.stages) {
    case 3: return launch_stages<3>(p, a, grid);
    case 4: return launch_stages<4>(p, a, grid);
    case 6: return launch_stages<6>(p, a, grid);
  }
  return invalid_argument("moe_grouped_gemm_fp4: stages {} (0, 3, 4 or 6)", p.stages);
}

}  // namespace ml4::cuda
