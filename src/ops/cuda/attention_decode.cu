// Sparse MLA decode over the fp8_ds_mla latent cache (r = 512, dr = 64), bf16 tensor cores:
// the kernel mla_attention picks for MlaMath::kBf16TensorCore + sparse + kFp8DsMla (attention.h;
// chosen in attention.cu by use_decode_kernel). Same function as attention_tc.cu (bf16 operands,
// f32 accumulation and softmax, natural-log lse), a different schedule, and the tile scales are
// folded out of the key tile (below).
//
// Why a second kernel. The generic tc kernel reached 8.3% of HBM copy bandwidth (BENCHMARKS.md):
// every one of its 512 threads fetched 16-byte pieces with a dependent index load each, one
// prefetch stage, and four block-wide barriers per tile with the dequantization in between.
// Per token (topk 2048) the work is 1.34 MB of rows and 2 H 2048 1088 FLOP: at H = 16 (ML4 at
// TP = 4) 53 FLOP/B, so the rows must stream at HBM speed while ~160 TFLOP/s of bf16 mma keep up.
//
// Schedule (FlashMLA's sparse decode, mma.sync instead of wgmma):
//   grid (T, splits, head blocks); the top-k list of token t is cut into `splits` chunks (so
//   B = 1 still fills the SMs; attention.cu merges the partial (out, lse) in split order, so
//   the result is deterministic), and each block takes 64 heads (MT = 4 head tiles of 16; a
//   remainder of H % 64 heads is a second launch with MT = 1..3, MT a template parameter).
//   512 threads: warpgroups 0-1 (warps 0-7) are the consumers, warpgroups 2-3 the producers
//   (warp 8 loads, 9-15 dequantize); setmaxnreg moves registers to the consumers (200 each:
//   MT = 4 keeps 128 f32 accumulators; without it the 4-warp allocation granularity caps all
//   warps at 128).
//   Splits (attention.cu choose_splits): as many as keep T x head blocks x splits within one
//   wave of one block per SM, >= 32 keys each.
//   Producer (warp 8): lane j fetches the slot of key j of every tile kIdxRing - 1 tiles ahead
//     (cp.async into a shared ring, cp.async.wait_group: the first version fetched one tile
//     ahead in a register, so once the ring was not full every tile waited a whole index-load
//     latency), waits until the ring stage is free (mbarrier `empty`), posts the valid-key bit
//     mask and the byte count on the stage's `full` mbarrier, and each lane with a valid slot
//     issues one cp.async.bulk of its whole 656-byte row (global -> shared, completing on
//     `full`). NS ring stages (2..8, as many as the shared memory allows: 2 at 64 heads, 6 at
//     16) keep 40-120 KB of rows in flight per SM.
//   Dequantizers (warps 9-15): wait `full`, turn the stage into a bf16 key tile [32][576] in one
//     of two key buffers (mbarriers `kfull` / `kempty`), copy the tile scales next to it,
//     release the stage. The scales are NOT applied (the fold): an e4m3 byte s.eeee.mmm placed
//     as bf16 bits s.0000eeee.mmm0000 is exactly its value x 2^-120 (exponent bias 7 against
//     127; e4m3 subnormals land on bf16 subnormals alike), so a pair costs ~3.5 integer ops and
//     no scale load, multiply or range test. Bytes pair up as (b0, b2) and (b1, b3) of each
//     32-bit word (the cheapest shifts), so within every 4 latent columns the key tile holds
//     columns 0 2 1 3: the Q tile is stored in the same order and the output store undoes it.
//     Scales per key and 128-column tile c: f32 s * 2^56 (for S) and bf16 s * 2^64 (for P).
//   Consumers (warps 0-7, 200 registers), per tile: wait `kfull`; QK^T with mma.sync m16n8k16
//     over ldmatrix fragments, one 128-column tile (8 k-steps) at a time, each tile's partial
//     dot (q 2^64 . e 2^-120) times s * 2^56 added into the S partials in shared memory (the
//     rope's 4 k-steps add as they are: q_rope is not scaled); KS k-halves: at H = 16 (MT = 1)
//     warp w takes key n-tile w / 2 and k-half w % 2 with its q fragments in registers for the
//     whole kernel; at MT = 4 warp w takes head tile w / 2, k-half w % 2 and all 4 n-tiles;
//     softmax: warp w owns heads w, w+8, ...: lane = key, running max per head in registers,
//     per-lane running sums (reduced once at the end), P as bf16 and the rescale factor to
//     shared memory; PV: warp w owns output columns [64w, 64w+64), inside scale tile w / 2: its
//     P fragments are multiplied (bf16x2) by that tile's s * 2^64 per key, the accumulators
//     (MT x 8 n-tiles x 4 = up to 128 f32 registers) rescaled and P V added with the key tile
//     read by ldmatrix.trans; the output is multiplied by 2^56 / l at the end. Then the key
//     buffer is released (`kempty`). Two named barriers among the consumers per tile.
//   Numerics against the reference (q, keys, P rounded to bf16): S is now q_bf16 . (e s) with
//   e and s exact (one rounding fewer); PV uses bf16(bf16(P) x bf16(s 2^64)) x e, three
//   roundings of 2^-9 per term as before (the earlier key was bf16(e 2^-120) x bf16(s 2^120)
//   rounded again). Magnitudes stay in the f32 normal range for |q| < 2^63, any finite s.
// Shared memory: ring NS x 32 x 656 B, Q and two key tiles at a 1168-byte row stride (ldmatrix
// rows fall on distinct banks), S partials at 40 floats per row (conflict-free float2 writes).
// The split partials use attention.cu's layout ([split][T][H][r] out / l, and m + ln l).
//
// Fragment layouts: PTX ISA "Matrix Fragments for mma.m16n8k16"; mbarrier / cp.async.bulk:
// PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier" and "Data
// Movement: cp.async.bulk" (the same sequence as CUTLASS's PipelineTmaAsync). The fold of the
// per-tile scales out of the dequantized operand follows FlashMLA's FP8 deep dive (2025-09),
// which names the e4m3 -> bf16 conversion as the bound of its FP8 sparse decode kernel.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "kv/latent_layout.h"
#include "ops/cuda/attention_internal.h"

namespace ml4::cuda::detail {
namespace {

constexpr int kR = 512, kDr = 64, kD = kR + kDr;
constexpr int kRowBytes = 656;        // latent_token_bytes(kFp8DsMla, 512, 64)
constexpr int kRopeOffset = kR + 16;  // after the 4 f32 tile scales
constexpr int kTiles = kR / 128;      // scale tiles per row
constexpr int kKeys = 32;             // keys per tile
constexpr int kWarps = 8;             // consumer warps
constexpr int kConsumers = 32 * kWarps;
// 2 producer warpgroups (warp 8 loads, warps 9-15 dequantize) at 56 registers, 2 consumer
// warpgroups at 200 (256 x 56 + 256 x 200 = 65536).
constexpr int kThreads = 512;
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 200;
constexpr int kDeqWarps = 7;  // warps 9-15
constexpr int kMaxHeads = 64;
constexpr int kIdxRing = 8;           // tiles of slot indices in flight (the producer's cp.async ring)
constexpr int kQP = kD + 8;           // bf16 row stride of Q and key tiles: 1168 B = 292 words (4 mod 32)
constexpr int kSP = kKeys + 8;        // f32 row stride of S partials
constexpr int kPP = kKeys + 8;        // bf16 row stride of P (80 B)
constexpr int kChunks = kR / 16 + kDr / 8;  // 16-byte pieces of a key row to dequantize: 32 fp8 + 8 rope
constexpr int kTileItems = kKeys * kChunks;  // 1280 per tile
constexpr int kMaxStages = 8;
// Kernel mode bits (decode_mode()).
constexpr int kModeIdxAhead = 1, kModeAsyncLoad = 2, kModeDiagNoMath = 4, kModeDiagNoDequant = 8, kModeSpin = 16;
constexpr bool kDefaultAsyncLoad = false;  // row loads: cp.async.bulk per row (false) or 16-byte cp.async
// Powers of two of the fold: key tile e 2^-120, Q tile q 2^64, S factor s 2^56, P factor s 2^64,
// output 2^56 / l.
constexpr float kQScale = 0x1p64f, kSScale = 0x1p56f, kPScale = 0x1p64f, kOutScale = 0x1p56f;
static_assert(kRowBytes % 16 == 0 && (kKeys * kRowBytes) % 16 == 0, "bulk copies need 16-byte sizes");

struct Smem {
  int raw, full, empty, masks, kfull, kempty, kmask, idx, fs, fb, qs, kb, sp, ps, cs, ls, hs, total;
};

// Byte offsets of the shared-memory regions for MT head tiles and NS ring stages.
__host__ __device__ inline Smem smem_layout(int MT, int NS) {
  const int HB = 16 * MT, KS = (MT == 1 || MT == 4) ? 2 : 1;
  Smem L{};
  int o = 0;
  L.raw = o;
  o += NS * kKeys * kRowBytes;
  L.full = o;
  o += 8 * NS;
  L.empty = o;
  o += 8 * NS;
  L.kfull = o;  // key-tile buffers: dequantized -> consumers
  o += 16;
  L.kempty = o;
  o += 16;
  L.masks = o;
  o += 4 * NS;
  L.kmask = o;
  o += 8;
  o = (o + 15) & ~15;
  L.idx = o;  // slot-index ring [kIdxRing][32] int32
  o += kIdxRing * kKeys * 4;
  L.fs = o;  // S factors [2 buffers][kTiles][32] f32
  o += 2 * kTiles * kKeys * 4;
  L.fb = o;  // P factors [2 buffers][kTiles][32] bf16
  o += 2 * kTiles * kKeys * 2;
  L.qs = o;
  o += HB * kQP * 2;
  L.kb = o;
  o += 2 * kKeys * kQP * 2;
  L.sp = o;
  o += KS * HB * kSP * 4;
  L.ps = o;
  o += HB * kPP * 2;
  L.cs = o;
  o += HB * 4;
  L.ls = o;
  o += HB * 4;
  L.hs = o;
  o += HB * 4;
  L.total = o;
  return L;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` has completed: try_wait (the thread may be suspended
// until the phase completes or a time limit passes) or, with spin, test_wait in a loop
// (ML4_MLA_DECODE_SPIN=1, for comparison: no suspension, issue slots spent polling).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity, bool spin) {
  const uint32_t a = smem_u32(bar);
  uint32_t done = 0;
  if (spin) {
    do {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(a), "r"(parity)
          : "memory");
    } while (!done);
    return;
  }
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// 4-byte asynchronous copy global -> shared, its commit and wait (PTX ISA "cp.async").
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
// Arrives on `bar` once all of this thread's earlier cp.async have landed (pending count not
// raised: the arrival counts towards the barrier's expected count).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Barrier 1 among the 256 consumer threads (barrier 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits)
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t x, __nv_bfloat162 s) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&x), s);
  return *reinterpret_cast<const uint32_t*>(&r);
}
// Latent column held at key/Q tile position p: within each 4 columns the tile holds 0 2 1 3
// (dequant_tile's byte pairing); an involution.
__host__ __device__ __forceinline__ int tile_col(int p) { return (p & ~3) | ((p & 1) << 1) | ((p >> 1) & 1); }
// Bytes b0, b2 / b1, b3 of w as bf16x2 holding each e4m3 value x 2^-120 (sign to bit 15, the
// 7 exponent-mantissa bits to bits 10..4 of each half).
__device__ __forceinline__ uint32_t e4m3_even(uint32_t w) {
  return ((w & 0x00800080u) << 8) | ((w & 0x007F007Fu) << 4);
}
__device__ __forceinline__ uint32_t e4m3_odd(uint32_t w) { return (w & 0x80008000u) | ((w >> 4) & 0x07F007F0u); }

__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// Dequantizes one ring stage (32 raw rows) into a bf16 key tile [32][kQP] (e4m3 x 2^-120, tile
// columns in tile_col order; rope bf16 copied) and the factors fs [kTiles][32] = s 2^56 (f32),
// fb [kTiles][32] = s 2^64 (bf16); invalid keys -> 0. Item = (key, 16-byte piece); NT threads
// share the 1280 items; dtid is this thread's index among them.
template <int NT>
__device__ __forceinline__ void dequant_tile(const uint8_t* rs, __nv_bfloat16* kt, float* fs, __nv_bfloat16* fb,
                                             uint32_t mask, int dtid) {
  constexpr int kIters = (kTileItems + NT - 1) / NT;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int item = dtid + it * NT;
    if (kTileItems % NT == 0 || item < kTileItems) {
      const int key = item / kChunks, c = item % kChunks;
      const uint8_t* row = rs + key * kRowBytes;
      const bool ok = (mask >> key) & 1u;
      if (c < kR / 16) {
        uint4 o0 = make_uint4(0, 0, 0, 0), o1 = o0;
        if (ok) {
          const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * c);
          o0 = make_uint4(e4m3_even(v.x), e4m3_odd(v.x), e4m3_even(v.y), e4m3_odd(v.y));
          o1 = make_uint4(e4m3_even(v.z), e4m3_odd(v.z), e4m3_even(v.w), e4m3_odd(v.w));
        }
        uint4* d = reinterpret_cast<uint4*>(kt + key * kQP + 16 * c);
        d[0] = o0;
        d[1] = o1;
        if (c % 8 == 0) {  // the first piece of a scale tile carries its factors
          const int tile = c / 8;
          const float sc = ok ? *reinterpret_cast<const float*>(row + kR + 4 * tile) : 0.0f;
          fs[tile * kKeys + key] = sc * kSScale;
          fb[tile * kKeys + key] = __float2bfloat16_rn(sc * kPScale);
        }
      } else {
        const int rc = c - kR / 16;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (ok) v = *reinterpret_cast<const uint4*>(row + kRopeOffset + 16 * rc);
        *reinterpret_cast<uint4*>(kt + key * kQP + kR + 8 * rc) = v;
      }
    }
  }
}

// S partials of one 16-head tile against NT key n-tiles over k-steps [K0, K1) (16 columns
// each), one scale tile (8 k-steps; 32..35 the rope) at a time: each tile's dot is multiplied by
// its per-key factor (fs, f32 s 2^56; the rope by 1) and summed into the partial rows in shared
// memory (so: row g, keys 2 tq, 2 tq + 1 of n-tile 0). With one n-tile the sum stays in
// registers until the end; with 4 (MT = 4, whose 128 accumulators leave no room) it is added in
// shared memory tile by tile. afrag(k, a) gives the A fragment of k-step k; kp is the ldmatrix
// address of n-tile 0 at column 0; fs is offset to this thread's keys.
template <int K0, int K1, int NT, class AFrag>
__device__ __forceinline__ void qk_fold(AFrag&& afrag, const __nv_bfloat16* kp, const float* fs, float* so) {
  constexpr int NA = NT == 1 ? 2 : 1;  // accumulator chains per n-tile (two when there is one n-tile)
  constexpr bool kRegSum = NT == 1;
  float c[NT][NA][4], sacc[kRegSum ? NT : 1][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (kRegSum) sacc[nt][e] = 0.0f;
#pragma unroll
      for (int j = 0; j < NA; ++j) c[nt][j][e] = 0.0f;
    }
  }
#pragma unroll
  for (int k = K0; k < K1; k += 2) {
    uint32_t a0[4], a1[4];
    afrag(k, a0);
    afrag(k + 1, a1);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      uint32_t b[4];
      ldmatrix_x4(b, kp + 8 * nt * kQP + 16 * k);  // b0, b1 of step k, then of step k + 1
      mma_bf16(c[nt][0], a0, b[0], b[1]);
      mma_bf16(c[nt][NA - 1], a1, b[2], b[3]);
    }
    if ((k + 2) % 8 == 0 || k + 2 == K1) {
      const int tile = k / 8;  // kTiles: the rope
      const bool first = tile == K0 / 8;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float2 f = make_float2(1.0f, 1.0f);
        if (tile < kTiles) f = *reinterpret_cast<const float2*>(fs + tile * kKeys + 8 * nt);
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          v[e] = NA == 2 ? c[nt][0][e] + c[nt][NA - 1][e] : c[nt][0][e];
#pragma unroll
          for (int j = 0; j < NA; ++j) c[nt][j][e] = 0.0f;
        }
        if constexpr (kRegSum) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[nt][e] = fmaf(v[e], (e & 1) ? f.y : f.x, sacc[nt][e]);
        } else {
          float2* o0 = reinterpret_cast<float2*>(so + 8 * nt);
          float2* o1 = reinterpret_cast<float2*>(so + 8 * kSP + 8 * nt);
          float2 x0 = make_float2(0.0f, 0.0f), x1 = x0;
          if (!first) {
            x0 = *o0;
            x1 = *o1;
          }
          *o0 = make_float2(fmaf(v[0], f.x, x0.x), fmaf(v[1], f.y, x0.y));
          *o1 = make_float2(fmaf(v[2], f.x, x1.x), fmaf(v[3], f.y, x1.y));
        }
      }
    }
  }
  if constexpr (kRegSum) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      *reinterpret_cast<float2*>(so + 8 * nt) = make_float2(sacc[nt][0], sacc[nt][1]);
      *reinterpret_cast<float2*>(so + 8 * kSP + 8 * nt) = make_float2(sacc[nt][2], sacc[nt][3]);
    }
  }
}

template <int MT>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_kernel(const Args a, const int NS, const int h_first, const int mode) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int t = blockIdx.x, split = blockIdx.y;
  const int h0 = h_first + blockIdx.z * kMaxHeads;
  constexpr int HB = 16 * MT;  // heads of this block (the launch picks MT per head block)
  const Smem L = smem_layout(MT, NS);
  uint8_t* raw = smem + L.raw;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L.full);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + L.empty);
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + L.masks);
  uint64_t* kfull = reinterpret_cast<uint64_t*>(smem + L.kfull);
  uint64_t* kempty = reinterpret_cast<uint64_t*>(smem + L.kempty);
  uint32_t* kmask = reinterpret_cast<uint32_t*>(smem + L.kmask);
  int32_t* sidx = reinterpret_cast<int32_t*>(smem + L.idx);
  float* fsb = reinterpret_cast<float*>(smem + L.fs);
  __nv_bfloat16* fbb = reinterpret_cast<__nv_bfloat16*>(smem + L.fb);
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem + L.qs);
  __nv_bfloat16* kb = reinterpret_cast<__nv_bfloat16*>(smem + L.kb);
  float* sp = reinterpret_cast<float*>(smem + L.sp);
  __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(smem + L.ps);
  float* cs = reinterpret_cast<float*>(smem + L.cs);
  float* ls = reinterpret_cast<float*>(smem + L.ls);
  float* hs = reinterpret_cast<float*>(smem + L.hs);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool spin = mode & kModeSpin;

  const int n = a.index_lengths ? min(max(a.index_lengths[t], 0), a.topk) : a.topk;
  const int j0 = split * a.chunk;
  const int j1 = min(n, j0 + a.chunk);
  const int ntiles = j1 > j0 ? (j1 - j0 + kKeys - 1) / kKeys : 0;

  if (tid == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full + s, (mode & kModeAsyncLoad) ? kKeys + 1 : 1);
      mbar_init(empty + s, kDeqWarps);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(kfull + b, kDeqWarps);
      mbar_init(kempty + b, kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= kWarps) {
    // Producer warpgroups: give registers to the consumers; warp 8 loads, warps 9-15 dequantize.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (warp != kWarps) {
      const int dtid = tid - 32 * (kWarps + 1);
      for (int i = 0; i < ntiles; ++i) {
        const int s = i % NS, b = i & 1;
        mbar_wait(full + s, (i / NS) & 1, spin);
        if (i >= 2) mbar_wait(kempty + b, ((i >> 1) - 1) & 1, spin);
        const uint32_t mask = masks[s];
        if (!(mode & kModeDiagNoDequant))
          dequant_tile<32 * kDeqWarps>(raw + s * kKeys * kRowBytes, kb + b * kKeys * kQP, fsb + b * kTiles * kKeys,
                                       fbb + b * kTiles * kKeys, mask, dtid);
        if (dtid == 0) kmask[b] = mask;
        __syncwarp();
        if (lane == 0) {
          mbar_arrive(empty + s);
          mbar_arrive(kfull + b);
        }
      }
      return;
    }
    // Slot indices kIdxRing - 1 tiles ahead: lane j copies entry j of each tile into the ring
    // (one commit group per tile, empty past the end, so wait_group counts tiles) and reads
    // back only its own entry. Without kModeIdxAhead (ML4_MLA_DECODE_IDX_AHEAD=0, for
    // comparison) each tile's indices are fetched when it is issued.
    const bool idx_ahead = mode & kModeIdxAhead, async_load = mode & kModeAsyncLoad;
    const int32_t* idx = a.indices + static_cast<int64_t>(t) * a.indices_stride;
    auto fetch = [&](int tile) {
      const int j = j0 + tile * kKeys + lane;
      if (tile < ntiles && j < j1) cp_async4(sidx + (tile % kIdxRing) * kKeys + lane, idx + j);
      cp_async_commit();
    };
    if (idx_ahead) {
#pragma unroll
      for (int k = 0; k < kIdxRing - 1; ++k) fetch(k);
    }
    for (int i = 0; i < ntiles; ++i) {
      if (idx_ahead) {
        fetch(i + kIdxRing - 1);
        cp_async_wait<kIdxRing - 1>();  // tile i's group is complete
      } else {
        fetch(i);
        cp_async_wait<0>();
      }
      const int j = j0 + i * kKeys + lane;
      int64_t slot = -1;
      if (j < j1) {
        const int64_t v = sidx[(i % kIdxRing) * kKeys + lane];
        if (v >= 0 && v < a.num_slots) slot = v;
      }
      const int s = i % NS;
      if (i >= NS) mbar_wait(empty + s, ((i / NS) - 1) & 1, spin);
      const uint32_t m = __ballot_sync(0xffffffffu, slot >= 0);
      if (async_load) {
        // 16-byte cp.async, half a warp per row (41 pieces: 16 + 16 + 9 per lane group), each
        // lane's copies tracked by one arrive.noinc on `full` (count 33: 32 of those and lane
        // 0's release of the mask).
        if (lane == 0) {
          masks[s] = m;
          mbar_arrive(full + s);
        }
        const int hl = lane & 15, hh = lane >> 4;
        const int32_t slot32 = static_cast<int32_t>(slot);
#pragma unroll 4
        for (int k = 0; k < kKeys / 2; ++k) {
          const int r = 2 * k + hh;
          const int32_t sr = __shfl_sync(0xffffffffu, slot32, r);
          if (sr >= 0) {
            const uint8_t* src = a.cache + static_cast<int64_t>(sr) * kRowBytes + 16 * hl;
            uint8_t* dst = raw + (s * kKeys + r) * kRowBytes + 16 * hl;
            cp_async16(dst, src);
            cp_async16(dst + 256, src + 256);
            if (hl < kRowBytes / 16 - 32) cp_async16(dst + 512, src + 512);
          }
        }
        cp_async_mbar_arrive_noinc(full + s);
      } else {
        if (lane == 0) {
          masks[s] = m;
          mbar_arrive_expect_tx(full + s, static_cast<uint32_t>(__popc(m)) * kRowBytes);
        }
        __syncwarp();
        if (slot >= 0) bulk_g2s(raw + (s * kKeys + lane) * kRowBytes, a.cache + slot * kRowBytes, kRowBytes, full + s);
      }
    }
    cp_async_wait<0>();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));

  // Consumers. q -> bf16 rows (latent x 2^64, in tile_col order), head scales.
  for (int i = tid; i < HB * (kD / 2); i += kConsumers) {
    const int h = i / (kD / 2), v = 2 * (i % (kD / 2));
    const int64_t th = static_cast<int64_t>(t) * a.H + h0 + h;
    uint32_t w;
    if (v < kR) {
      const float* src = a.q_lat + th * kR;
      w = pack_bf16(src[tile_col(v)] * kQScale, src[tile_col(v + 1)] * kQScale);
    } else {
      const float* src = a.q_rope + th * kDr + (v - kR);
      w = pack_bf16(src[0], src[1]);
    }
    *reinterpret_cast<uint32_t*>(qs + h * kQP + v) = w;
  }
  if (tid < HB) hs[tid] = a.head_scale[static_cast<int64_t>(t) * a.H + h0 + tid];
  consumer_sync();  // q and head scales

  const int g = lane >> 2, tq = lane & 3;
  constexpr int KS = (MT == 1 || MT == 4) ? 2 : 1;  // k-splits of QK^T (partial S summed in the softmax)
  constexpr int ksteps = (kD / 16) / KS;  // 36 or 18, even
  constexpr int RW = HB / kWarps;         // softmax rows per warp: 2..8
  const int lrow = (lane & 7) + 8 * ((lane >> 3) & 1);  // A fragments (ldmatrix.x4): row in the 16-row tile
  const int lcol = 8 * (lane >> 4);                     //   and column offset

  // MT = 1: this warp's q fragments (k-half warp % 2, 18 k-steps) live in registers; the QK^T
  // loop then reads only the key tile from shared memory.
  uint32_t qf[MT == 1 ? ksteps : 1][4];
  if constexpr (MT == 1) {
    const __nv_bfloat16* qa = qs + lrow * kQP + lcol + 16 * ksteps * (warp % 2);
#pragma unroll
    for (int k = 0; k < ksteps; ++k) ldmatrix_x4(qf[k], qa + 16 * k);
  }
  float m_run[8], l_run[8];
#pragma unroll
  for (int rr = 0; rr < 8; ++rr) {
    m_run[rr] = -INFINITY;
    l_run[rr] = 0.0f;
  }
  float acc[4][8][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;

  int ctiles = ntiles;
  if (mode & kModeDiagNoMath) {  // diagnostic: the load and dequantization pipeline alone
    for (int i = 0; i < ntiles; ++i) {
      mbar_wait(kfull + (i & 1), (i >> 1) & 1, spin);
      __syncwarp();
      if (lane == 0) mbar_arrive(kempty + (i & 1));
    }
    ctiles = 0;
  }
  for (int i = 0; i < ctiles; ++i) {
    const int b = i & 1;
    const __nv_bfloat16* kt = kb + b * kKeys * kQP;
    const float* fs = fsb + b * kTiles * kKeys;
    const __nv_bfloat16* fb = fbb + b * kTiles * kKeys;
    mbar_wait(kfull + b, (i >> 1) & 1, spin);
    const uint32_t mask = kmask[b];

    // S partials (f32, [KS][HB][kSP]) with the tile scales folded in.
    if constexpr (MT == 4) {
      // Warp w: head tile w / 2, k-half w % 2, all 4 key n-tiles (6 ldmatrix per 8 mma).
      const int mt = warp / 2, ks = warp % 2;
      const __nv_bfloat16* qa = qs + (16 * mt + lrow) * kQP + lcol;
      auto af = [&](int k, uint32_t(&x)[4]) { ldmatrix_x4(x, qa + 16 * k); };
      const __nv_bfloat16* kp = kt + (lane & 7) * kQP + 8 * (lane >> 3);
      float* so = sp + (ks * HB + 16 * mt + g) * kSP + 2 * tq;
      if (ks == 0) {
        qk_fold<0, ksteps, 4>(af, kp, fs + 2 * tq, so);
      } else {
        qk_fold<ksteps, 2 * ksteps, 4>(af, kp, fs + 2 * tq, so);
      }
    } else if constexpr (MT == 1) {
      // Warp w: key n-tile w / 2, k-half w % 2; its q fragments stay in registers (qf).
      const int key0 = 8 * (warp / 2);
      const __nv_bfloat16* kp = kt + (key0 + (lane & 7)) * kQP + 8 * (lane >> 3);
      float* so = sp + ((warp % 2) * HB + g) * kSP + key0 + 2 * tq;
      if (warp % 2 == 0) {
        auto af = [&](int k, uint32_t(&x)[4]) {
#pragma unroll
          for (int e = 0; e < 4; ++e) x[e] = qf[k][e];
        };
        qk_fold<0, ksteps, 1>(af, kp, fs + key0 + 2 * tq, so);
      } else {
        auto af = [&](int k, uint32_t(&x)[4]) {
#pragma unroll
          for (int e = 0; e < 4; ++e) x[e] = qf[k - ksteps][e];
        };
        qk_fold<ksteps, 2 * ksteps, 1>(af, kp, fs + key0 + 2 * tq, so);
      }
    } else {
      // MT = 2, 3: units u = (head tile u / 4, key n-tile u % 4), all 36 k-steps.
      for (int u = warp; u < MT * 4; u += kWarps) {
        const int nt = u % 4, mt = u / 4;
        const __nv_bfloat16* qa = qs + (16 * mt + lrow) * kQP + lcol;
        auto af = [&](int k, uint32_t(&x)[4]) { ldmatrix_x4(x, qa + 16 * k); };
        const __nv_bfloat16* kp = kt + (8 * nt + (lane & 7)) * kQP + 8 * (lane >> 3);
        qk_fold<0, kD / 16, 1>(af, kp, fs + 8 * nt + 2 * tq, sp + (16 * mt + g) * kSP + 8 * nt + 2 * tq);
      }
    }
    consumer_sync();  // S complete

    // Online softmax: warp w, heads w + 8 rr; lane = key.
    const bool kv = (mask >> lane) & 1u;
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
      if (rr < RW) {
        const int h = warp + kWarps * rr;
        float x = sp[h * kSP + lane];
        if (KS == 2) x += sp[(HB + h) * kSP + lane];
        x = kv ? x * hs[h] : -INFINITY;
        float mx = x;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float mn = fmaxf(m_run[rr], mx);
        const float corr = mn == -INFINITY ? 1.0f : __expf(m_run[rr] - mn);  // m_run = -inf -> 0
        const __nv_bfloat16 pb = __float2bfloat16_rn(mn == -INFINITY ? 0.0f : __expf(x - mn));
        l_run[rr] = l_run[rr] * corr + __bfloat162float(pb);  // the sum of the P that PV uses
        m_run[rr] = mn;
        ps[h * kPP + lane] = pb;
        if (lane == 0) cs[h] = corr;
      }
    }
    consumer_sync();  // P and the rescale factors complete

    // O = O * corr + (P s) V over this tile's 32 keys; warp w: tile columns [64w, 64w + 64), in
    // scale tile w / 2.
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt < MT) {
        const float c0 = cs[16 * mt + g], c1 = cs[16 * mt + g + 8];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          acc[mt][nt][0] *= c0;
          acc[mt][nt][1] *= c0;
          acc[mt][nt][2] *= c1;
          acc[mt][nt][3] *= c1;
        }
      }
    }
    const __nv_bfloat16* vb = kt + (lane & 15) * kQP + 64 * warp + 8 * (lane >> 4);
    const __nv_bfloat16* fw = fb + (warp / 2) * kKeys + 2 * tq;
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      // A fragment registers 0, 1 hold keys 16 kk + 2 tq, +1; registers 2, 3 keys + 8, + 9.
      const __nv_bfloat162 s01 = *reinterpret_cast<const __nv_bfloat162*>(fw + 16 * kk);
      const __nv_bfloat162 s89 = *reinterpret_cast<const __nv_bfloat162*>(fw + 16 * kk + 8);
      uint32_t pa[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        if (mt < MT) {
          ldmatrix_x4(pa[mt], ps + (16 * mt + lrow) * kPP + 16 * kk + lcol);
          pa[mt][0] = mul_bf16x2(pa[mt][0], s01);
          pa[mt][1] = mul_bf16x2(pa[mt][1], s01);
          pa[mt][2] = mul_bf16x2(pa[mt][2], s89);
          pa[mt][3] = mul_bf16x2(pa[mt][3], s89);
        }
      }
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, vb + 16 * kk * kQP + 16 * np);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          if (mt < MT) {
            mma_bf16(acc[mt][2 * np], pa[mt], bv[0], bv[1]);
            mma_bf16(acc[mt][2 * np + 1], pa[mt], bv[2], bv[3]);
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(kempty + b);  // this warp is done with the key tile
  }

  // Sums, lse (natural log), normalised output of this split.
  const int64_t base = (static_cast<int64_t>(a.splits > 1 ? split : 0) * a.T + t) * a.H + h0;
#pragma unroll
  for (int rr = 0; rr < 8; ++rr) {
    if (rr < RW) {
      const int h = warp + kWarps * rr;
      float l = l_run[rr];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (lane == 0) {
        ls[h] = l;
        a.lse[base + h] = l > 0.0f ? m_run[rr] + logf(l) : -INFINITY;
      }
    }
  }
  consumer_sync();
  // Accumulator pair (tile positions p, p + 1; p = 64 w + 8 nt + 2 tq) holds latent columns
  // tile_col(p) and tile_col(p) + 2.
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    if (mt < MT) {
      const int r0 = 16 * mt + g, r1 = r0 + 8;
      const float l0 = ls[r0], l1 = ls[r1];
      const float i0 = l0 > 0.0f ? kOutScale / l0 : 0.0f, i1 = l1 > 0.0f ? kOutScale / l1 : 0.0f;
      float* o0 = a.out + (base + r0) * kR;
      float* o1 = a.out + (base + r1) * kR;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int col = tile_col(64 * warp + 8 * nt + 2 * tq);
        o0[col] = acc[mt][nt][0] * i0;
        o0[col + 2] = acc[mt][nt][1] * i0;
        o1[col] = acc[mt][nt][2] * i1;
        o1[col + 2] = acc[mt][nt][3] * i1;
      }
    }
  }
}

// Kernel mode bits from the environment, read once: ML4_MLA_DECODE_IDX_AHEAD=0 turns the index
// look-ahead off; ML4_MLA_DECODE_LOAD=async|bulk picks the row loads; ML4_MLA_DECODE_SPIN=1
// polls the mbarriers with test_wait; ML4_MLA_DECODE_DIAG=1
// skips the consumers' math, =2 also the dequantization (benchmark diagnostics: wrong outputs).
int decode_mode() {
  static const int mode = [] {
    auto env = [](const char* name) -> const char* {
      const char* v = std::getenv(name);
      return v ? v : "";
    };
    int m = 0;
    if (env("ML4_MLA_DECODE_IDX_AHEAD")[0] != '0') m |= kModeIdxAhead;
    const std::string load = env("ML4_MLA_DECODE_LOAD");
    if (load == "async" || (load != "bulk" && kDefaultAsyncLoad)) m |= kModeAsyncLoad;
    if (env("ML4_MLA_DECODE_SPIN")[0] == '1') m |= kModeSpin;
    const char d = env("ML4_MLA_DECODE_DIAG")[0];
    if (d == '1' || d == '2') m |= kModeDiagNoMath;
    if (d == '2') m |= kModeDiagNoDequant;
    return m;
  }();
  return mode;
}

// Ring stages that fit beside the fixed regions for HB heads per block.
// ML4_MLA_DECODE_STAGES=n caps them (for comparison).
int stages_for(int HB, int smem_limit) {
  const int MT = HB / 16;
  static const int cap = [] {
    const char* v = std::getenv("ML4_MLA_DECODE_STAGES");
    return v ? std::clamp(std::atoi(v), 2, kMaxStages) : kMaxStages;
  }();
  int ns = cap;
  while (ns > 2 && smem_layout(MT, ns).total > smem_limit) --ns;
  return ns;
}

}  // namespace

bool mla_decode_supported(int H, int r, int dr, int row_bytes) {
  return r == kR && dr == kDr && row_bytes == kRowBytes && H > 0 && H % 16 == 0 && H <= 128;
}

cudaError_t launch_mla_decode(const Args& a, dim3 grid, cudaStream_t stream) {
  int dev = 0, limit = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  // Head blocks of 64 (MT = 4); a remainder of H % 64 heads runs as its own launch.
  const int full_blocks = a.H / kMaxHeads, rest = a.H % kMaxHeads;
  auto launch = [&](auto kernel, int MT, unsigned zblocks, int h_first) -> cudaError_t {
    const int ns = stages_for(16 * MT, limit);
    const int smem = smem_layout(MT, ns).total;
    if (smem > limit) return cudaErrorInvalidConfiguration;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    kernel<<<dim3(grid.x, grid.y, zblocks), kThreads, smem, stream>>>(a, ns, h_first, decode_mode());
    return cudaGetLastError();
  };
  if (full_blocks > 0) {
    const cudaError_t err = launch(mla_decode_kernel<4>, 4, static_cast<unsigned>(full_blocks), 0);
    if (err != cudaSuccess) return err;
  }
  const int hf = full_blocks * kMaxHeads;
  switch (rest / 16) {
    case 1: return launch(mla_decode_kernel<1>, 1, 1u, hf);
    case 2: return launch(mla_decode_kernel<2>, 2, 1u, hf);
    case 3: return launch(mla_decode_kernel<3>, 3, 1u, hf);
    default: return cudaSuccess;
  }
}

}  // namespace ml4::cuda::detail
