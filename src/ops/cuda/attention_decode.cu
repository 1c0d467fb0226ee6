// Sparse MLA decode over the fp8_ds_mla latent cache (r = 512, dr = 64), bf16 tensor cores:
// the kernel mla_attention picks for MlaMath::kBf16TensorCore + sparse + kFp8DsMla (attention.h;
// chosen in attention.cu by use_decode_kernel). Same function and numerics as attention_tc.cu
// (q, keys and P rounded to bf16, f32 accumulation and softmax, natural-log lse, FlashMLA's
// rounding), a different schedule.
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
//   Producer: per tile of 32 keys, lane j loads slot j (one coalesced 128-byte index load,
//     issued a tile ahead so its latency hides behind the ring wait), waits until the ring
//     stage is free (mbarrier `empty`), posts the valid-key bit mask and the byte count on the
//     stage's `full` mbarrier, and each lane with a valid slot issues one cp.async.bulk of its
//     whole 656-byte row (global -> shared, completing on `full`). NS ring stages (2..8, as
//     many as the shared memory allows: 2 at 64 heads, 6 at 16) keep 40-120 KB of rows in
//     flight per SM, above the ~23 KB that 70% of HBM bandwidth needs per SM at ~1 us latency.
//   Dequantizers (warps 9-15, "WS"): wait `full`, turn the stage into a bf16 key tile [32][576]
//     (e4m3 x tile scale with integer ops and one bf16x2 multiply, rope copied, invalid keys
//     zeroed) in one of two key buffers (mbarriers `kfull` / `kempty`), release the stage.
//   Consumers (warps 0-7, 200 registers), per tile: wait `kfull`; QK^T with mma.sync m16n8k16
//     over ldmatrix fragments, partial S (KS k-halves) to shared memory: at H = 16 (MT = 1) warp
//     w takes key n-tile w / 2 and k-half w % 2 with its q fragments held in registers for the
//     whole kernel; at MT = 4 warp w takes head tile w / 2, k-half w % 2 and all 4 n-tiles
//     (384 B of ldmatrix per mma); softmax: warp w owns heads w, w+8, ...: lane = key, running
//     max per head in registers, per-lane running sums (reduced once at the end), P as bf16 and
//     the rescale factor to shared memory; PV: warp w owns output columns [64w, 64w+64) for all
//     heads, rescales its accumulators (MT x 8 n-tiles x 4 = up to 128 f32 registers) and adds
//     P V with the key tile read by ldmatrix.trans; then releases the key buffer (`kempty`).
//     Two named barriers among the consumers per tile; the producers never wait on them.
//   ML4_MLA_DECODE_WS=0 selects the first version (consumers dequantize themselves, 384 threads,
//     three barriers per tile): kept for comparison (docs/BENCHMARKS.md).
//   Tried and measured slower (git b0bc461..e22c813, BENCHMARKS.md "Session 3"): folding the
//   tile scales out of the key tile (bit-level e4m3 -> bf16 x 2^-120, scales applied to S per
//   128-column tile and to P per column tile; more accurate, but 7% slower at H = 16 and 17% at
//   H = 64) and fetching the slot indices 7 tiles ahead (no change): this schedule is not bound
//   by the dequantization's instruction count nor by the index loads.
// Shared memory: ring NS x 32 x 656 B, Q and two key tiles at a 1168-byte row stride (ldmatrix
// rows fall on distinct banks), S partials at 40 floats per row (conflict-free float2 writes).
// The split partials use attention.cu's layout ([split][T][H][r] out / l, and m + ln l).
//
// Fragment layouts: PTX ISA "Matrix Fragments for mma.m16n8k16"; mbarrier / cp.async.bulk:
// PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier" and "Data
// Movement: cp.async.bulk" (the same sequence as CUTLASS's PipelineTmaAsync).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "kv/latent_layout.h"
#include "ops/cuda/attention_internal.h"
#include "ops/cuda/mbarrier.cuh"
#include "ops/cuda/pdl.cuh"

namespace ml4::cuda::detail {
namespace {

constexpr int kR = 512, kDr = 64, kD = kR + kDr;
constexpr int kRowBytes = 656;        // latent_token_bytes(kFp8DsMla, 512, 64)
constexpr int kRopeOffset = kR + 16;  // after the 4 f32 tile scales
constexpr int kKeys = 32;             // keys per tile
constexpr int kWarps = 8;             // consumer warps
constexpr int kConsumers = 32 * kWarps;
// Threads and setmaxnreg budgets: WS (warp-specialized dequantization): 2 producer warpgroups
// (warp 8 loads, warps 9-15 dequantize) at 56 registers, 2 consumer warpgroups at 200
// (256 x 56 + 256 x 200 = 65536); otherwise 1 producer warpgroup (warp 8 loads) at 40 and the
// consumers dequantize themselves at 232 (128 x 40 + 256 x 232 <= 65536).
template <bool WS> constexpr int kThreadsOf = WS ? 512 : 384;
template <bool WS> constexpr int kProducerRegsOf = WS ? 56 : 40;
template <bool WS> constexpr int kConsumerRegsOf = WS ? 200 : 232;
constexpr int kDeqWarpsWs = 7;  // warps 9-15
constexpr int kMaxHeads = 64;
constexpr int kQP = kD + 8;           // bf16 row stride of Q and key tiles: 1168 B = 292 words (4 mod 32)
constexpr int kSP = kKeys + 8;        // f32 row stride of S partials
constexpr int kPP = kKeys + 8;        // bf16 row stride of P (80 B)
constexpr int kChunks = kR / 16 + kDr / 8;  // 16-byte pieces of a key row to dequantize: 32 fp8 + 8 rope
constexpr int kTileItems = kKeys * kChunks;  // 1280 per tile
constexpr int kMaxStages = 8;
static_assert(kRowBytes % 16 == 0 && (kKeys * kRowBytes) % 16 == 0, "bulk copies need 16-byte sizes");

struct Smem {
  int raw, full, empty, masks, kfull, kempty, kmask, qs, kb, sp, ps, cs, ls, hs, total;
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
  L.kfull = o;  // key-tile buffers (WS): dequantized -> consumers
  o += 16;
  L.kempty = o;
  o += 16;
  L.masks = o;
  o += 4 * NS;
  L.kmask = o;
  o += 8;
  o = (o + 15) & ~15;
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

// Barrier 1 among the 256 consumer threads (barrier 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits)
  return *reinterpret_cast<const uint32_t*>(&v);
}
// Two e4m3 bytes (low byte first) x scale -> bf16x2 through f32 (the exact path, for tile scales
// >= 2^7 whose 2^120 multiple would overflow below).
__device__ __forceinline__ uint32_t dequant2_f32(uint32_t two, float sc) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
  return pack_bf16(f.x * sc, f.y * sc);
}
// Four e4m3 bytes of w x scale -> two bf16x2 words, on the integer and bf16 FMA pipes (the
// conversion instructions run at 16 per clock per SM, a quarter of these). An e4m3 byte
// s.eeee.mmm placed as bf16 bits s.0000eeee.mmm0000 is exactly its value times 2^-120 (bias 7
// against 127; e4m3 subnormals become bf16 subnormals alike), so one bf16x2 multiply by
// s2 = bf16(scale * 2^120) dequantizes two values: a bf16-rounded product of a bf16-rounded
// scale (two roundings of 2^-9 where the f32 path has one).
__device__ __forceinline__ void dequant4(uint32_t w, __nv_bfloat162 s2, uint32_t& lo, uint32_t& hi) {
  const uint32_t t0 = __byte_perm(w, 0u, 0x1404);  // b1 << 24 | b0 << 8
  const uint32_t t1 = __byte_perm(w, 0u, 0x3424);  // b3 << 24 | b2 << 8
  uint32_t r0 = ((t0 >> 4) & 0x07F007F0u) | (t0 & 0x80008000u);
  uint32_t r1 = ((t1 >> 4) & 0x07F007F0u) | (t1 & 0x80008000u);
  const __nv_bfloat162 x0 = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&r0), s2);
  const __nv_bfloat162 x1 = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&r1), s2);
  lo = *reinterpret_cast<const uint32_t*>(&x0);
  hi = *reinterpret_cast<const uint32_t*>(&x1);
}

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

// Dequantizes one ring stage (32 raw rows) into a bf16 key tile [32][kQP]: item = (key, 16-byte
// piece): 16 e4m3 -> 16 bf16 (tile scale applied), or 8 rope bf16 copied; invalid keys -> 0.
// NT threads share the 1280 items; dtid is this thread's index among them.
template <int NT>
__device__ __forceinline__ void dequant_tile(const uint8_t* rs, __nv_bfloat16* kt, uint32_t mask, int dtid) {
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
          const float sc = *reinterpret_cast<const float*>(row + kR + 4 * (c / 8));
          if (sc < 128.0f) {
            const __nv_bfloat162 s2 = __float2bfloat162_rn(sc * 0x1p120f);
            dequant4(v.x, s2, o0.x, o0.y);
            dequant4(v.y, s2, o0.z, o0.w);
            dequant4(v.z, s2, o1.x, o1.y);
            dequant4(v.w, s2, o1.z, o1.w);
          } else {
            o0 = make_uint4(dequant2_f32(v.x, sc), dequant2_f32(v.x >> 16, sc), dequant2_f32(v.y, sc),
                            dequant2_f32(v.y >> 16, sc));
            o1 = make_uint4(dequant2_f32(v.z, sc), dequant2_f32(v.z >> 16, sc), dequant2_f32(v.w, sc),
                            dequant2_f32(v.w >> 16, sc));
          }
        }
        uint4* d = reinterpret_cast<uint4*>(kt + key * kQP + 16 * c);
        d[0] = o0;
        d[1] = o1;
      } else {
        const int rc = c - kR / 16;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (ok) v = *reinterpret_cast<const uint4*>(row + kRopeOffset + 16 * rc);
        *reinterpret_cast<uint4*>(kt + key * kQP + kR + 8 * rc) = v;
      }
    }
  }
}

template <int MT, bool WS>
__global__ void __launch_bounds__(kThreadsOf<WS>, 1) mla_decode_kernel(const Args a, const int NS, const int h_first) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
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
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem + L.qs);
  __nv_bfloat16* kb = reinterpret_cast<__nv_bfloat16*>(smem + L.kb);
  float* sp = reinterpret_cast<float*>(smem + L.sp);
  __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(smem + L.ps);
  float* cs = reinterpret_cast<float*>(smem + L.cs);
  float* ls = reinterpret_cast<float*>(smem + L.ls);
  float* hs = reinterpret_cast<float*>(smem + L.hs);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const int n = a.index_lengths ? min(max(a.index_lengths[t], 0), a.topk) : a.topk;
  const int j0 = split * a.chunk;
  const int j1 = min(n, j0 + a.chunk);
  const int ntiles = j1 > j0 ? (j1 - j0 + kKeys - 1) / kKeys : 0;

  if (tid == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, WS ? kDeqWarpsWs : kWarps);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(kfull + b, kDeqWarpsWs);
      mbar_init(kempty + b, kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= kWarps) {
    // Producer warpgroup(s): give registers to the consumers; warp 8 loads; with WS warps 9-15
    // dequantize, else 9-11 leave.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegsOf<WS>));
    if (warp != kWarps) {
      if constexpr (WS) {
        const int dtid = tid - 32 * (kWarps + 1);
        for (int i = 0; i < ntiles; ++i) {
          const int s = i % NS, b = i & 1;
          mbar_wait(full + s, (i / NS) & 1);
          if (i >= 2) mbar_wait(kempty + b, ((i >> 1) - 1) & 1);
          const uint32_t mask = masks[s];
          dequant_tile<32 * kDeqWarpsWs>(raw + s * kKeys * kRowBytes, kb + b * kKeys * kQP, mask, dtid);
          if (dtid == 0) kmask[b] = mask;
          __syncwarp();
          if (lane == 0) {
            mbar_arrive(empty + s);
            mbar_arrive(kfull + b);
          }
        }
      }
      return;
    }
    const int32_t* idx = a.indices + static_cast<int64_t>(t) * a.indices_stride;
    auto slot_of = [&](int j) -> int64_t {
      if (j >= j1) return -1;
      const int64_t s = idx[j];
      return (s >= 0 && s < a.num_slots) ? s : -1;
    };
    int64_t next = ntiles > 0 ? slot_of(j0 + lane) : -1;
    for (int i = 0; i < ntiles; ++i) {
      const int64_t slot = next;
      if (i + 1 < ntiles) next = slot_of(j0 + (i + 1) * kKeys + lane);
      const int s = i % NS;
      if (i >= NS) mbar_wait(empty + s, ((i / NS) - 1) & 1);
      const uint32_t m = __ballot_sync(0xffffffffu, slot >= 0);
      if (lane == 0) {
        masks[s] = m;
        mbar_arrive_expect_tx(full + s, static_cast<uint32_t>(__popc(m)) * kRowBytes);
      }
      __syncwarp();
      if (slot >= 0) bulk_g2s(raw + (s * kKeys + lane) * kRowBytes, a.cache + slot * kRowBytes, kRowBytes, full + s);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegsOf<WS>));

  // Consumers. q -> bf16 rows, head scales. By float4 (q_lat / q_rope 16-byte aligned:
  // use_decode_kernel), kQBatch loads a thread issued before any is converted and stored: two
  // floats a thread a pass, each load after the previous shared store, took ~72 L2 round trips
  // at 64 heads, most of the kernel's ~20 us at batch 1 (ncu: 38% of stalls on L1TEX, 26% issue).
  {
    constexpr int kQ4 = kD / 4, kQBatch = 8;  // float4s a head row (kR % 4 == 0: none straddles)
    const int n4 = HB * kQ4;
    for (int base = tid; base < n4; base += kQBatch * kConsumers) {
      float4 q4[kQBatch];
#pragma unroll
      for (int b = 0; b < kQBatch; ++b) {
        const int i = base + b * kConsumers;
        if (i < n4) {
          const int h = i / kQ4, v = 4 * (i % kQ4);
          const int64_t th = static_cast<int64_t>(t) * a.H + h0 + h;
          q4[b] = *reinterpret_cast<const float4*>(v < kR ? a.q_lat + th * kR + v : a.q_rope + th * a.q_rope_stride + (v - kR));
        }
      }
#pragma unroll
      for (int b = 0; b < kQBatch; ++b) {
        const int i = base + b * kConsumers;
        if (i < n4) {
          const int h = i / kQ4, v = 4 * (i % kQ4);
          *reinterpret_cast<uint2*>(qs + h * kQP + v) = make_uint2(pack_bf16(q4[b].x, q4[b].y), pack_bf16(q4[b].z, q4[b].w));
        }
      }
    }
  }
  if (tid < HB) hs[tid] = a.head_scale[static_cast<int64_t>(t) * a.H + h0 + tid];
  if constexpr (WS) consumer_sync();  // q and head scales (without WS the first tile's barrier)

  const int g = lane >> 2, tq = lane & 3;
  constexpr int KS = (MT == 1 || MT == 4) ? 2 : 1;  // k-splits of QK^T (partial S summed in the softmax)
  constexpr int nunits = MT * 4 * KS;
  constexpr int ksteps = (kD / 16) / KS;  // 36 or 18, even
  constexpr int RW = HB / kWarps;         // softmax rows per warp: 2..8
  const int lrow = (lane & 7) + 8 * ((lane >> 3) & 1);  // A fragments (ldmatrix.x4): row in the 16-row tile
  const int lcol = 8 * (lane >> 4);                     //   and column offset

  // MT = 1: this warp's q fragments (k-half warp % 2, 18 k-steps) live in registers; the QK^T
  // loop then reads only the key tile from shared memory (the q re-reads were a third of the
  // per-tile shared-memory traffic at H = 16).
  uint32_t qf[MT == 1 ? ksteps : 1][4];
  if constexpr (MT == 1) {
    if constexpr (!WS) consumer_sync();  // q in shared memory
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

  for (int i = 0; i < ntiles; ++i) {
    __nv_bfloat16* kt = kb + (i & 1) * kKeys * kQP;
    uint32_t mask;
    if constexpr (WS) {
      mbar_wait(kfull + (i & 1), (i >> 1) & 1);
      mask = kmask[i & 1];
    } else {
      const int s = i % NS;
      mbar_wait(full + s, (i / NS) & 1);
      mask = masks[s];  // read before the stage is released
      dequant_tile<kConsumers>(raw + s * kKeys * kRowBytes, kt, mask, tid);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);
      consumer_sync();  // key tile (and, at i = 0, q and head scales) complete
    }

    // S partials (f32, [KS][HB][kSP]), per head-tile count: MT = 4 and 1 below; MT = 2: warp w
    // takes key n-tile w % 4 and head tile w / 4; MT = 3: units u = (head tile, n-tile).
    if constexpr (MT == 4) {
      // Warp w: head tile w / 2, k-half w % 2, all 4 key n-tiles: 6 ldmatrix per 8 mma (384 B
      // of shared memory per mma; the q re-reads dominate otherwise).
      float c[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
      const int mt = warp / 2, ks = warp % 2;
      const __nv_bfloat16* qa = qs + (16 * mt + lrow) * kQP + lcol + 16 * ksteps * ks;
      const __nv_bfloat16* kp = kt + (lane & 7) * kQP + 8 * (lane >> 3) + 16 * ksteps * ks;
#pragma unroll 3
      for (int k = 0; k < ksteps; k += 2) {
        uint32_t a0[4], a1[4];
        ldmatrix_x4(a0, qa + 16 * k);
        ldmatrix_x4(a1, qa + 16 * (k + 1));
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          uint32_t b[4];
          ldmatrix_x4(b, kp + 8 * nt * kQP + 16 * k);
          mma_bf16(c[nt], a0, b[0], b[1]);
          mma_bf16(c[nt], a1, b[2], b[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        float* o = sp + (ks * HB + 16 * mt + g) * kSP + 8 * nt + 2 * tq;
        *reinterpret_cast<float2*>(o) = make_float2(c[nt][0], c[nt][1]);
        *reinterpret_cast<float2*>(o + 8 * kSP) = make_float2(c[nt][2], c[nt][3]);
      }
    } else if constexpr (MT == 2) {
      constexpr int MPW = MT / 2;
      const int nt = warp % 4;
      float c[MPW][2][4];
#pragma unroll
      for (int j = 0; j < MPW; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[j][0][e] = c[j][1][e] = 0.0f;
      const __nv_bfloat16* kp = kt + (8 * nt + (lane & 7)) * kQP + 8 * (lane >> 3);
      const __nv_bfloat16* qa = qs + (16 * (warp / 4) + lrow) * kQP + lcol;
#pragma unroll 6
      for (int k = 0; k < kD / 16; k += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, kp + 16 * k);  // d [16k, 16k + 32): b0, b1 of step k, then of step k + 1
#pragma unroll
        for (int j = 0; j < MPW; ++j) {
          uint32_t a0[4], a1[4];
          ldmatrix_x4(a0, qa + 32 * j * kQP + 16 * k);
          ldmatrix_x4(a1, qa + 32 * j * kQP + 16 * (k + 1));
          mma_bf16(c[j][0], a0, b[0], b[1]);
          mma_bf16(c[j][1], a1, b[2], b[3]);
        }
      }
#pragma unroll
      for (int j = 0; j < MPW; ++j) {
        float* o = sp + (16 * (warp / 4 + 2 * j) + g) * kSP + 8 * nt + 2 * tq;
        *reinterpret_cast<float2*>(o) = make_float2(c[j][0][0] + c[j][1][0], c[j][0][1] + c[j][1][1]);
        *reinterpret_cast<float2*>(o + 8 * kSP) = make_float2(c[j][0][2] + c[j][1][2], c[j][0][3] + c[j][1][3]);
      }
    } else if constexpr (MT == 1) {
      // Warp w: key n-tile w / 2, k-half w % 2; its q fragments stay in registers (qf).
      float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
      const __nv_bfloat16* kp = kt + (8 * (warp / 2) + (lane & 7)) * kQP + 8 * (lane >> 3) + 16 * ksteps * (warp % 2);
#pragma unroll
      for (int k = 0; k < ksteps; k += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, kp + 16 * k);
        mma_bf16(c0, qf[k], b[0], b[1]);
        mma_bf16(c1, qf[k + 1], b[2], b[3]);
      }
      float* o = sp + ((warp % 2) * HB + g) * kSP + 8 * (warp / 2) + 2 * tq;
      *reinterpret_cast<float2*>(o) = make_float2(c0[0] + c1[0], c0[1] + c1[1]);
      *reinterpret_cast<float2*>(o + 8 * kSP) = make_float2(c0[2] + c1[2], c0[3] + c1[3]);
    } else {
      for (int u = warp; u < nunits; u += kWarps) {
        const int ks = u % KS, nt = (u / KS) % 4, mt = u / (4 * KS);
        float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
        const __nv_bfloat16* qa = qs + (16 * mt + lrow) * kQP + lcol;
        const __nv_bfloat16* kp = kt + (8 * nt + (lane & 7)) * kQP + 8 * (lane >> 3);
        const int kbeg = ks * ksteps;
#pragma unroll
        for (int k = 0; k < ksteps; k += 2) {
          uint32_t a0[4], a1[4], b[4];
          ldmatrix_x4(a0, qa + 16 * (kbeg + k));
          ldmatrix_x4(a1, qa + 16 * (kbeg + k + 1));
          ldmatrix_x4(b, kp + 16 * (kbeg + k));
          mma_bf16(c0, a0, b[0], b[1]);
          mma_bf16(c1, a1, b[2], b[3]);
        }
        float* o = sp + (ks * HB + 16 * mt + g) * kSP + 8 * nt + 2 * tq;
        *reinterpret_cast<float2*>(o) = make_float2(c0[0] + c1[0], c0[1] + c1[1]);
        *reinterpret_cast<float2*>(o + 8 * kSP) = make_float2(c0[2] + c1[2], c0[3] + c1[3]);
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

    // O = O * corr + P V over this tile's 32 keys; warp w: columns [64w, 64w + 64).
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
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t pa[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        if (mt < MT) ldmatrix_x4(pa[mt], ps + (16 * mt + lrow) * kPP + 16 * kk + lcol);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vb + 16 * kk * kQP + 16 * np);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          if (mt < MT) {
            mma_bf16(acc[mt][2 * np], pa[mt], b[0], b[1]);
            mma_bf16(acc[mt][2 * np + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }
    if constexpr (WS) {
      __syncwarp();
      if (lane == 0) mbar_arrive(kempty + (i & 1));  // this warp is done with the key tile
    }
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
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    if (mt < MT) {
      const int r0 = 16 * mt + g, r1 = r0 + 8;
      const float l0 = ls[r0], l1 = ls[r1];
      const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int col = 64 * warp + 8 * nt + 2 * tq;
        *reinterpret_cast<float2*>(a.out + (base + r0) * kR + col) =
            make_float2(acc[mt][nt][0] * i0, acc[mt][nt][1] * i0);
        *reinterpret_cast<float2*>(a.out + (base + r1) * kR + col) =
            make_float2(acc[mt][nt][2] * i1, acc[mt][nt][3] * i1);
      }
    }
  }
}

// Ring stages that fit beside the fixed regions for HB heads per block.
int stages_for(int HB, int smem_limit) {
  const int MT = HB / 16;
  int ns = kMaxStages;
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
  static const bool ws = [] {
    const char* v = std::getenv("ML4_MLA_DECODE_WS");
    return !(v && v[0] == '0');
  }();
  // Head blocks of 64 (MT = 4); a remainder of H % 64 heads runs as its own launch.
  const int full_blocks = a.H / kMaxHeads, rest = a.H % kMaxHeads;
  auto launch = [&](auto kernel, int MT, int threads, unsigned zblocks, int h_first) -> cudaError_t {
    const int ns = stages_for(16 * MT, limit);
    const int smem = smem_layout(MT, ns).total;
    if (smem > limit) return cudaErrorInvalidConfiguration;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    launch_kernel(kernel, dim3(grid.x, grid.y, zblocks), threads, smem, stream, a, ns, h_first);
    return cudaGetLastError();
  };
  auto run = [&](auto ws_tag) -> cudaError_t {
    constexpr bool W = decltype(ws_tag)::value;
    constexpr int T = kThreadsOf<W>;
    if (full_blocks > 0) {
      const cudaError_t err = launch(mla_decode_kernel<4, W>, 4, T, static_cast<unsigned>(full_blocks), 0);
      if (err != cudaSuccess) return err;
    }
    const int hf = full_blocks * kMaxHeads;
    switch (rest / 16) {
      case 1: return launch(mla_decode_kernel<1, W>, 1, T, 1u, hf);
      case 2: return launch(mla_decode_kernel<2, W>, 2, T, 1u, hf);
      case 3: return launch(mla_decode_kernel<3, W>, 3, T, 1u, hf);
      default: return cudaSuccess;
    }
  };
  return ws ? run(std::true_type{}) : run(std::false_type{});
}

}  // namespace ml4::cuda::detail
