// See indexer.h. Grid (T, page chunks): a block of 256 threads takes one query token and
// kPagesPerBlock pages of its sequence. The token's q (HI x 128 e4m3) is decoded once into
// shared memory as f32; each page's 64 keys are decoded into shared memory next to it
// (rows padded to 132 floats so that 16-byte reads of 8 different rows hit distinct banks).
// Thread (key = tid % 64, head group g = tid / 64) accumulates the dots of its key with heads
// g, g + 4, ... (up to 16) in registers; the per-head relu * w * q_scale terms are summed in
// head order per group, the 4 groups are then added in a fixed order, so results are
// deterministic run to run.
//
// Cost per (token, key): HI * 128 MACs on f32 cores (64 heads: 16 KFLOP); bytes per key 132.
// IndexerMath::kFp8TensorCore runs the same scores on FP8 mma.sync (indexer_fp8_kernel below).
#include "ops/cuda/indexer.h"
#include "ops/cuda/pdl.cuh"

#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "kv/indexer_layout.h"
#include "kv/kv_cache_dtype.h"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/fp8_groups.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/cuda/wgmma.cuh"

namespace ml4::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPagesPerBlock = 4;
constexpr int kDim = 128;
constexpr int kRow = kDim + 4;  // padded f32 row
constexpr int kHeadsPerThread = kIndexerMaxHeads / 4;
// Steps of at least this many tokens group 4 tokens a block in the FP8 scores kernel (prefill):
// decode-sized steps keep one token a block, whose tokens are mostly of different sequences.
// CudaIndexer.ScoresAndTopkMatchCpu (the same bits both ways) passed on an H100, 2026-12-06;
// attention_bench's causal prefill scores (64 heads): 1.114 -> 1.055 ms at 4096 tokens, 4.387 ->
// 4.084 ms at 8192 (1.06-1.07x: the key reloads were not what bounds the kernel; each page's
// chain of global loads and block barriers is, BENCHMARKS.md "Eleventh session").
constexpr int64_t kGroupTokensFrom = 256;

__device__ __forceinline__ float e4m3_f32(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return static_cast<float>(v);
}

// Decodes 4 packed e4m3 bytes into dst[0..4).
__device__ __forceinline__ void decode4(uint32_t w, float* dst) {
  const float4 f = make_float4(e4m3_f32(w & 0xff), e4m3_f32((w >> 8) & 0xff), e4m3_f32((w >> 16) & 0xff),
                               e4m3_f32(w >> 24));
  *reinterpret_cast<float4*>(dst) = f;
}

__global__ void __launch_bounds__(kThreads) indexer_scores_kernel(
    const uint8_t* __restrict__ q, const float* __restrict__ q_scale, const float* __restrict__ weights,
    const uint8_t* __restrict__ cache, int64_t num_blocks, const int32_t* __restrict__ block_table,
    int64_t bt_stride, const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ lengths, int HI,
    float w_scale, float* __restrict__ scores, int64_t scores_stride) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ float smem[];
  float* qs = smem;                       // [HI][kRow]
  float* ks = qs + HI * kRow;             // [64][kRow]
  float* wq = ks + kPageTokens * kRow;    // [HI]
  float* red = wq + kIndexerMaxHeads;     // [4][64]
  float* kscale = red + 4 * kPageTokens;  // [64]
  __shared__ int64_t page_id;

  const int64_t t = blockIdx.x;
  const int len = lengths[t];
  const int page0 = blockIdx.y * kPagesPerBlock;
  if (page0 * kPageTokens >= len) return;
  const int tid = threadIdx.x;
  const int seq = seq_of_token[t];

  // q: HI * 128 bytes, as 32-bit words.
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q + t * HI * kDim);
  for (int i = tid; i < HI * kDim / 4; i += kThreads) {
    const int h = i / (kDim / 4), c = i % (kDim / 4);
    decode4(q32[i], qs + h * kRow + 4 * c);
  }
  for (int h = tid; h < HI; h += kThreads) wq[h] = weights[t * HI + h] * w_scale * q_scale[t * HI + h];

  const int key = tid % kPageTokens, g = tid / kPageTokens;
  const int64_t page_bytes = kPageTokens * (kDim + 4);
  for (int pg = page0; pg < page0 + kPagesPerBlock && pg * kPageTokens < len; ++pg) {
    __syncthreads();  // previous page's ks/red/kscale fully consumed
    if (tid == 0) {
      const int64_t b = block_table[seq * bt_stride + pg];
      page_id = (b >= 0 && b < num_blocks) ? b : -1;
    }
    __syncthreads();
    const int64_t b = page_id;
    if (b < 0) {
      // A page outside the cache is a caller bug: score its keys -inf rather than read it.
      if (tid < kPageTokens && pg * kPageTokens + tid < len)
        scores[t * scores_stride + pg * kPageTokens + tid] = -__int_as_float(0x7f800000);
      continue;
    }
    const uint8_t* page = cache + b * page_bytes;
    const uint32_t* k32 = reinterpret_cast<const uint32_t*>(page);
    for (int i = tid; i < kPageTokens * kDim / 4; i += kThreads) {
      const int s = i / (kDim / 4), c = i % (kDim / 4);
      decode4(k32[i], ks + s * kRow + 4 * c);
    }
    if (tid < kPageTokens) kscale[tid] = reinterpret_cast<const float*>(page + kPageTokens * kDim)[tid];
    __syncthreads();

    float acc[kHeadsPerThread];
#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) acc[j] = 0.0f;
    const float* kr = ks + key * kRow;
#pragma unroll 2
    for (int d = 0; d < kDim; d += 4) {
      const float4 kv = *reinterpret_cast<const float4*>(kr + d);
#pragma unroll
      for (int j = 0; j < kHeadsPerThread; ++j) {
        const int h = g + 4 * j;
        if (h < HI) {
          const float4 qv = *reinterpret_cast<const float4*>(qs + h * kRow + d);
          acc[j] = fmaf(qv.x, kv.x, acc[j]);
          acc[j] = fmaf(qv.y, kv.y, acc[j]);
          acc[j] = fmaf(qv.z, kv.z, acc[j]);
          acc[j] = fmaf(qv.w, kv.w, acc[j]);
        }
      }
    }
    float part = 0.0f;
#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) {
      const int h = g + 4 * j;
      if (h < HI) part = fmaf(wq[h], fmaxf(acc[j], 0.0f), part);
    }
    red[g * kPageTokens + key] = part;
    __syncthreads();
    if (tid < kPageTokens) {
      const int s = pg * kPageTokens + tid;
      if (s < len) {
        const float sum = ((red[tid] + red[kPageTokens + tid]) + red[2 * kPageTokens + tid]) + red[3 * kPageTokens + tid];
        scores[t * scores_stride + s] = sum * kscale[tid];
      }
    }
  }
}

// FP8 tensor-core variant: grid (token groups of TQ, chunks of 1..kPagesPerBlock pages), 256
// threads = 8 warps. Per page, S[key][head] = k8 . q8 as mma.sync m16n8k32 e4m3 (A = keys,
// row-major; B = q, "column-major" = q rows as stored). Warp w: key tile w % 4 (16 keys), head
// n-tiles [4 (w / 4), +4) of 8 heads. Fragment layout (PTX ISA, mma.m16n8k32 for 8-bit types): A
// reg i holds 4 consecutive k of row g (+8 for regs 1, 3) at k = 4 tq (+16 for regs 2, 3); B reg
// i holds k = 4 tq (+16) of column g; C as for m16n8k16. Rows padded to 144 B (bank spread).
// TQ = 4 (prefill, IndexerScoresParams::tokens_per_block): the block's tokens of one sequence
// share each page's keys in shared memory and each key fragment feeds the MMAs of all of them
// (with TQ = 1 every token reloads its keys: ~1 GB of key reads a layer at 4096 tokens; sharing
// them gained only 1.06x, the per-page chain of loads and barriers bounds both). Tokens of
// different sequences in a group take turns, one sequence at a time. Per token the MMAs and
// sums run in the same order for any TQ: the same bits. (Its token-group bookkeeping repeats in
// indexer_wgmma_kernel: folded into shared helpers it changed this kernel's SASS, which ran on
// a device as it is.)
constexpr int kRowB = kDim + 16;

__device__ __forceinline__ void mma_e4m3(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Dynamic shared memory: q [TQ][heads][kRowB], keys [64][kRowB], wq [TQ][heads], kscale [64],
// red [2][TQ][64].
constexpr size_t fp8_smem_bytes(int tq) {
  return static_cast<size_t>(tq) * kIndexerMaxHeads * kRowB + kPageTokens * kRowB +
         4 * (static_cast<size_t>(tq) * kIndexerMaxHeads + kPageTokens + 2 * tq * kPageTokens);
}

template <int TQ>
__global__ void __launch_bounds__(kThreads) indexer_fp8_kernel(
    const uint8_t* __restrict__ q, const float* __restrict__ q_scale, const float* __restrict__ weights,
    const uint8_t* __restrict__ cache, int64_t num_blocks, const int32_t* __restrict__ block_table,
    int64_t bt_stride, const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ lengths, int HI,
    float w_scale, float* __restrict__ scores, int64_t scores_stride, int64_t T, int ppb) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ __align__(16) uint8_t fp8_smem[];
  uint8_t* qs = fp8_smem;
  uint8_t* ks = qs + TQ * kIndexerMaxHeads * kRowB;
  float* wq = reinterpret_cast<float*>(ks + kPageTokens * kRowB);
  float* kscale = wq + TQ * kIndexerMaxHeads;
  float* red = kscale + kPageTokens;  // [2][TQ][64]
  __shared__ int64_t page_id;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TQ;
  const int page0 = blockIdx.y * ppb;
  int lens[TQ], seqs[TQ];
  uint32_t todo = 0;  // the group's tokens with keys in this chunk
#pragma unroll
  for (int i = 0; i < TQ; ++i) {
    const bool in = t0 + i < T;
    lens[i] = in ? lengths[t0 + i] : 0;
    seqs[i] = in ? seq_of_token[t0 + i] : -1;
    if (in && page0 * kPageTokens < lens[i]) todo |= 1u << i;
  }
  if (!todo) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3, mt = warp & 3, hh = warp >> 2;
  const int nt_total = (HI + 7) / 8;
  for (int i = tid; i < TQ * kIndexerMaxHeads * (kDim / 16); i += kThreads) {
    const int tk = i / (kIndexerMaxHeads * (kDim / 16)), h = i / (kDim / 16) % kIndexerMaxHeads, c = i % (kDim / 16);
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (h < HI && ((todo >> tk) & 1)) v = *reinterpret_cast<const uint4*>(q + ((t0 + tk) * HI + h) * kDim + 16 * c);
    *reinterpret_cast<uint4*>(qs + (tk * kIndexerMaxHeads + h) * kRowB + 16 * c) = v;
  }
  for (int i = tid; i < TQ * kIndexerMaxHeads; i += kThreads) {
    const int tk = i / kIndexerMaxHeads, h = i % kIndexerMaxHeads;
    const int64_t th = (t0 + tk) * HI + h;
    wq[i] = h < HI && ((todo >> tk) & 1) ? weights[th] * w_scale * q_scale[th] : 0.0f;
  }
  const int64_t page_bytes = kPageTokens * (kDim + 4);
  while (todo) {
    // The next sequence's tokens in the group (uniform over the block).
    const int seq = seqs[__ffs(todo) - 1];
    uint32_t m = 0;
    int len = 0;
#pragma unroll
    for (int i = 0; i < TQ; ++i)
      if (((todo >> i) & 1) && seqs[i] == seq) {
        m |= 1u << i;
        len = max(len, lens[i]);
      }
    todo &= ~m;
    for (int pg = page0; pg < page0 + ppb && pg * kPageTokens < len; ++pg) {
      __syncthreads();
      if (tid == 0) {
        const int64_t b = block_table[seq * bt_stride + pg];
        page_id = (b >= 0 && b < num_blocks) ? b : -1;
      }
      __syncthreads();
      const int64_t b = page_id;
      if (b < 0) {
        for (int i = tid; i < TQ * kPageTokens; i += kThreads) {
          const int tk = i / kPageTokens, s = pg * kPageTokens + i % kPageTokens;
          if (((m >> tk) & 1) && s < lens[tk]) scores[(t0 + tk) * scores_stride + s] = -__int_as_float(0x7f800000);
        }
        continue;
      }
      const uint8_t* page = cache + b * page_bytes;
      for (int i = tid; i < kPageTokens * (kDim / 16); i += kThreads) {
        const int s = i / (kDim / 16), c = i % (kDim / 16);
        *reinterpret_cast<uint4*>(ks + s * kRowB + 16 * c) = *reinterpret_cast<const uint4*>(page + s * kDim + 16 * c);
      }
      if (tid < kPageTokens) kscale[tid] = reinterpret_cast<const float*>(page + kPageTokens * kDim)[tid];
      __syncthreads();
      float acc[TQ][4][4];
#pragma unroll
      for (int i = 0; i < TQ; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
      const uint8_t* ka = ks + (16 * mt + g) * kRowB + 4 * tq;
#pragma unroll
      for (int k0 = 0; k0 < kDim; k0 += 32) {
        uint32_t a[4];
        a[0] = *reinterpret_cast<const uint32_t*>(ka + k0);
        a[1] = *reinterpret_cast<const uint32_t*>(ka + 8 * kRowB + k0);
        a[2] = *reinterpret_cast<const uint32_t*>(ka + k0 + 16);
        a[3] = *reinterpret_cast<const uint32_t*>(ka + 8 * kRowB + k0 + 16);
#pragma unroll
        for (int i = 0; i < TQ; ++i) {
          if (!((m >> i) & 1)) continue;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int nt = 4 * hh + j;
            if (nt < nt_total) {
              const uint8_t* qb = qs + (i * kIndexerMaxHeads + 8 * nt + g) * kRowB + 4 * tq + k0;
              mma_e4m3(acc[i][j], a, *reinterpret_cast<const uint32_t*>(qb),
                       *reinterpret_cast<const uint32_t*>(qb + 16));
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < TQ; ++i) {
        if (!((m >> i) & 1)) continue;
        const float* w = wq + i * kIndexerMaxHeads;
        float p0 = 0.f, p1 = 0.f;  // key rows 16 mt + g and + 8
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int h = 8 * (4 * hh + j) + 2 * tq;
          if (4 * hh + j < nt_total) {
            p0 = fmaf(w[h], fmaxf(acc[i][j][0], 0.f), p0);
            p0 = fmaf(w[h + 1], fmaxf(acc[i][j][1], 0.f), p0);
            p1 = fmaf(w[h], fmaxf(acc[i][j][2], 0.f), p1);
            p1 = fmaf(w[h + 1], fmaxf(acc[i][j][3], 0.f), p1);
          }
        }
        p0 += __shfl_xor_sync(0xffffffffu, p0, 1);
        p0 += __shfl_xor_sync(0xffffffffu, p0, 2);
        p1 += __shfl_xor_sync(0xffffffffu, p1, 1);
        p1 += __shfl_xor_sync(0xffffffffu, p1, 2);
        if (tq == 0) {
          red[(hh * TQ + i) * kPageTokens + 16 * mt + g] = p0;
          red[(hh * TQ + i) * kPageTokens + 16 * mt + g + 8] = p1;
        }
      }
      __syncthreads();
      for (int i = tid; i < TQ * kPageTokens; i += kThreads) {
        const int tk = i / kPageTokens, key = i % kPageTokens, s = pg * kPageTokens + key;
        if (((m >> tk) & 1) && s < lens[tk])
          scores[(t0 + tk) * scores_stride + s] =
              (red[tk * kPageTokens + key] + red[(TQ + tk) * kPageTokens + key]) * kscale[key];
      }
    }
  }
}

// The wgmma variant (IndexerMath::kFp8Wgmma; first run 2026-12-06 on an H100: 0.476 vs 1.049 ms
// at 4096 tokens x 64 heads, 0.247 vs 0.882 at 32 heads, ml4's).
// Why: indexer_fp8_kernel is latency-bound (~10% of the measured FP8 GEMM rate on a causal
// prefill): every page is a chain of global loads through registers and block barriers with no copy in flight under
// the MMAs, and mma.sync m16n8k32 feeds both operands through registers. Here a block of two
// warpgroups holds 128 query rows, (token, head) pairs of 128 / HI tokens of one group, as the
// wgmma A operand (row r: token r / HI, head r % HI; 128-byte-swizzled K-major e4m3 in shared
// memory), and takes kWgPages key pages of the tokens' sequence through a kWgStages-deep
// cp.async ring (each page 64 keys x 128 B, K-major: the cache's own row layout, swizzled as
// it lands). Per page each warpgroup runs S = Q K^T as 4 wgmma m64n64k32 (32 f32 a thread),
// then relu(S) x w per row, the two rows a thread holds added, the 8 row groups of a warp added
// by shuffles (a warp's 16 rows are one token's heads: HI % 16 == 0), the warps of a token
// added in order through shared memory, times the key's scale. Two block barriers a page.
// Deterministic, but not the bits of indexer_fp8_kernel (another summation order).
constexpr int kWgRows = 128, kWgPages = 16, kWgStages = 4, kWgMaxTokens = kWgRows / 16;
constexpr int kWgKeyBytes = kPageTokens * kDim;                      // 8 KB a stage
constexpr int kWgQOff = 0;                                           // [128 rows][128 B]
constexpr int kWgKOff = kWgQOff + kWgRows * kDim;                    // [stages][64 keys][128 B]
constexpr int kWgScaleOff = kWgKOff + kWgStages * kWgKeyBytes;       // f32 [stages][64]
constexpr int kWgWqOff = kWgScaleOff + kWgStages * kPageTokens * 4;  // f32 [128]
constexpr int kWgRedOff = kWgWqOff + kWgRows * 4;                    // f32 [8 warps][64]
constexpr int kWgSmem = kWgRedOff + 8 * kPageTokens * 4 + 1024;      // + alignment slack

__global__ void __launch_bounds__(kThreads) indexer_wgmma_kernel(
    const uint8_t* __restrict__ q, const float* __restrict__ q_scale, const float* __restrict__ weights,
    const uint8_t* __restrict__ cache, int64_t num_blocks, const int32_t* __restrict__ block_table,
    int64_t bt_stride, const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ lengths, int HI,
    float w_scale, float* __restrict__ scores, int64_t scores_stride, int64_t T) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ uint8_t wg_smem[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  const uint32_t sbase = (raw + 1023u) & ~1023u;
  uint8_t* sgen = wg_smem + (sbase - raw);
  float* kscale = reinterpret_cast<float*>(sgen + kWgScaleOff);
  float* wq = reinterpret_cast<float*>(sgen + kWgWqOff);
  float* red = reinterpret_cast<float*>(sgen + kWgRedOff);
  const int TQ = kWgRows / HI;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TQ;
  const int page0 = blockIdx.y * kWgPages;
  int lens[kWgMaxTokens], seqs[kWgMaxTokens];
  uint32_t todo = 0;  // the group's tokens with keys in this chunk
#pragma unroll
  for (int i = 0; i < kWgMaxTokens; ++i) {
    const bool in = i < TQ && t0 + i < T;
    lens[i] = in ? lengths[t0 + i] : 0;
    seqs[i] = in ? seq_of_token[t0 + i] : -1;
    if (in && page0 * kPageTokens < lens[i]) todo |= 1u << i;
  }
  if (!todo) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3, wg = tid >> 7;
  for (int i = tid; i < kWgRows * (kDim / 16); i += kThreads) {
    const int r = i / (kDim / 16), c = i % (kDim / 16), tk = r / HI, h = r % HI;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (tk < TQ && ((todo >> tk) & 1)) v = *reinterpret_cast<const uint4*>(q + ((t0 + tk) * HI + h) * kDim + 16 * c);
    *reinterpret_cast<uint4*>(sgen + kWgQOff + r * kDim + ((c ^ (r & 7)) << 4)) = v;
  }
  for (int r = tid; r < kWgRows; r += kThreads) {
    const int tk = r / HI;
    const int64_t th = (t0 + tk) * HI + r % HI;
    wq[r] = tk < TQ && ((todo >> tk) & 1) ? weights[th] * w_scale * q_scale[th] : 0.0f;
  }
  wgmma::fence_proxy_async();  // Q, written through the generic proxy (made visible by the barrier below)
  const int64_t page_bytes = kPageTokens * (kDim + 4);
  const int r0 = 16 * warp + g;  // this thread's accumulator rows r0, r0 + 8 (one token's heads)
  while (todo) {
    // The next sequence's tokens in the group (uniform over the block).
    const int seq = seqs[__ffs(todo) - 1];
    uint32_t m = 0;
    int len = 0;
#pragma unroll
    for (int i = 0; i < kWgMaxTokens; ++i)
      if (((todo >> i) & 1) && seqs[i] == seq) {
        m |= 1u << i;
        len = max(len, lens[i]);
      }
    todo &= ~m;
    const int np = min(kWgPages, (len + kPageTokens - 1) / kPageTokens - page0);
    auto page_of = [&](int i) -> int64_t {  // chunk page i's cache block, or -1
      const int64_t b = block_table[seq * bt_stride + page0 + i];
      return (b >= 0 && b < num_blocks) ? b : -1;
    };
    auto load = [&](int i) {  // chunk page i into stage i % kWgStages (zeros for a missing page)
      const int st = i % kWgStages;
      const int64_t b = page_of(i);
      const uint8_t* page = cache + (b < 0 ? 0 : b) * page_bytes;
      for (int x = tid; x < kPageTokens * (kDim / 16); x += kThreads) {
        const int key = x / (kDim / 16), c = x % (kDim / 16);
        cp_async16(sbase + kWgKOff + st * kWgKeyBytes + key * kDim + ((c ^ (key & 7)) << 4),
                   page + key * kDim + 16 * c, b >= 0);
      }
      if (tid < kPageTokens * 4 / 16)
        cp_async16(sbase + kWgScaleOff + st * kPageTokens * 4 + 16 * tid, page + kPageTokens * kDim + 16 * tid, b >= 0);
    };
    __syncthreads();  // Q and wq written; the previous sequence's last reads of the ring and red done
#pragma unroll
    for (int i = 0; i < kWgStages - 1; ++i) {
      if (i < np) load(i);
      cp_commit();
    }
    for (int i = 0; i < np; ++i) {
      const int st = i % kWgStages;
      cp_wait<kWgStages - 2>();    // this thread's copies of page i have landed
      wgmma::fence_proxy_async();  // ... and are visible to the async proxy after the barrier
      __syncthreads();             // every thread's; every thread is done with page i - 1
      if (i + kWgStages - 1 < np) load(i + kWgStages - 1);  // into page i - 1's stage
      cp_commit();
      float acc[32];
      wgmma::fence_operands(acc);
      wgmma::fence();
      const uint32_t qa = sbase + kWgQOff + wg * 64 * kDim, kb = sbase + kWgKOff + st * kWgKeyBytes;
#pragma unroll
      for (int ks = 0; ks < kDim / 32; ++ks)
        wgmma::m64n64k32_e4m3(acc, wgmma::desc_k_major(qa + 32 * ks), wgmma::desc_k_major(kb + 32 * ks), ks);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_operands(acc);
      const float w0 = wq[r0], w1 = wq[r0 + 8];
      float cs[16];  // column 8j + 2tq + e at cs[2j + e]: this thread's two rows
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          cs[2 * j + e] = fmaf(w1, fmaxf(acc[4 * j + 2 + e], 0.0f), w0 * fmaxf(acc[4 * j + e], 0.0f));
#pragma unroll
      for (int d = 4; d <= 16; d <<= 1)  // the warp's 8 row pairs (lanes of one tq)
#pragma unroll
        for (int k = 0; k < 16; ++k) cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], d);
      if (g == 0)
#pragma unroll
        for (int k = 0; k < 16; ++k) red[warp * kPageTokens + 8 * (k / 2) + 2 * tq + (k & 1)] = cs[k];
      __syncthreads();
      const int wpt = HI / 16;  // warps a token
      const bool missing = page_of(i) < 0;
      for (int x = tid; x < TQ * kPageTokens; x += kThreads) {
        const int tk = x / kPageTokens, key = x % kPageTokens, s = (page0 + i) * kPageTokens + key;
        if (!((m >> tk) & 1) || s >= lens[tk]) continue;
        float v = 0.0f;
        for (int ww = 0; ww < wpt; ++ww) v += red[(tk * wpt + ww) * kPageTokens + key];
        scores[(t0 + tk) * scores_stride + s] =
            missing ? -__int_as_float(0x7f800000) : v * kscale[st * kPageTokens + key];
      }
    }
    cp_wait<0>();
  }
}

// grid (rows), block dI / 2: the butterflies of ml4::cpu::hadamard_transform (pairs (j, j + h),
// h = 1, 2, 4, ..., then * n^-0.5 as the host rounds it), then per-128 amax and e4m3 (the same
// operations as cache_write.cu's indexer key path, which is byte-identical to the CPU encoder).
// With p.rope (the fused query path), the row's first rope_dim values are rotated first, in
// shared memory, as q_path_kernel rotates them.
__global__ void query_quant_kernel(const float* __restrict__ q, int dI, bool hadamard, float hscale,
                                   uint8_t* __restrict__ q8, float* __restrict__ scales, IndexerQueryQuantParams p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ float v[];  // [dI], then [rope_dim] of (cos, sin) pairs with p.rope
  __shared__ unsigned gmax[8];
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, half = dI / 2, G = dI / kDim;
  v[tid] = q[row * dI + tid];
  v[tid + half] = q[row * dI + tid + half];
  if (p.rope) rope_row(v, v + dI, p.rope_rows, row / p.heads);
  const Fp8GroupPair f = hadamard_fp8_groups(v, gmax, dI, hadamard, hscale);
  q8[row * dI + tid] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(f.x0 / f.s0, __NV_SATFINITE, __NV_E4M3));
  q8[row * dI + tid + half] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(f.x1 / f.s1, __NV_SATFINITE, __NV_E4M3));
  if (tid < G) scales[row * G + tid] = fp8_group_scale(gmax, tid);
}

size_t smem_bytes(int HI) {
  return sizeof(float) * (static_cast<size_t>(HI) * kRow + kPageTokens * kRow + kIndexerMaxHeads + 4 * kPageTokens +
                          kPageTokens);
}

}  // namespace

Status indexer_scores(const IndexerScoresParams& p) {
  if (p.dI != kDim) return invalid_argument("indexer_scores: dI = {} (only 128 is supported)", p.dI);
  if (p.HI <= 0 || p.HI > kIndexerMaxHeads)
    return invalid_argument("indexer_scores: HI = {} (1..{})", p.HI, kIndexerMaxHeads);
  if (p.T < 0 || p.max_length < 0) return invalid_argument("indexer_scores: T = {}, max_length = {}", p.T, p.max_length);
  if (p.scores_stride < p.max_length)
    return invalid_argument("indexer_scores: scores_stride {} < max_length {}", p.scores_stride, p.max_length);
  if (p.T == 0 || p.max_length == 0) return ok_status();
  if (!p.q || !p.q_scale || !p.weights || !p.cache || !p.block_table || !p.seq_of_token || !p.lengths || !p.scores)
    return invalid_argument("indexer_scores: null pointer");
  if (p.num_blocks <= 0 || p.block_table_stride <= 0)
    return invalid_argument("indexer_scores: num_blocks = {}, block_table_stride = {}", p.num_blocks,
                            p.block_table_stride);
  if (p.T > 0x7fffffff) return invalid_argument("indexer_scores: T = {} too large", p.T);
  const int pages = (p.max_length + kPageTokens - 1) / kPageTokens;
  if (pages > p.block_table_stride)
    return invalid_argument("indexer_scores: max_length {} needs {} pages, block table has {}", p.max_length, pages,
                            p.block_table_stride);
  const int chunks = (pages + kPagesPerBlock - 1) / kPagesPerBlock;
  if (chunks > 65535) return invalid_argument("indexer_scores: max_length {} too large", p.max_length);
  const dim3 grid(static_cast<unsigned>(p.T), static_cast<unsigned>(chunks));
  if (p.math == IndexerMath::kFp8Wgmma && p.HI % 16 == 0) {
    ML4_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(indexer_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWgSmem));
    const int tq = kWgRows / p.HI;
    const dim3 g(static_cast<unsigned>((p.T + tq - 1) / tq), static_cast<unsigned>((pages + kWgPages - 1) / kWgPages));
    launch_kernel(indexer_wgmma_kernel, g, kThreads, kWgSmem, p.stream, static_cast<const uint8_t*>(p.q), p.q_scale,
                  p.weights, static_cast<const uint8_t*>(p.cache), p.num_blocks, p.block_table, p.block_table_stride,
                  p.seq_of_token, p.lengths, p.HI, p.weight_scale, p.scores, p.scores_stride, p.T);
    return cuda_status(cudaGetLastError(), "indexer_wgmma_kernel");
  }
  if (p.math != IndexerMath::kF32) {  // kFp8TensorCore, or kFp8Wgmma at an HI it does not take
    const int tq = p.tokens_per_block > 0 ? p.tokens_per_block : p.T >= kGroupTokensFrom ? 4 : 1;
    if (tq != 1 && tq != 4) return invalid_argument("indexer_scores: tokens_per_block = {} (1 or 4)", tq);
    auto kernel = tq == 4 ? indexer_fp8_kernel<4> : indexer_fp8_kernel<1>;
    const size_t smem = fp8_smem_bytes(tq);
    ML4_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const int64_t groups = (p.T + tq - 1) / tq;
    // Decode (ml4-slice-4 at 8k context, H100): 32 blocks of 4 pages took 16 us, a chain of
    // four page loads and barriers each; 4 blocks a multiprocessor of 132 is ~528.
    int ppb = p.pages_per_block;
    if (ppb == 0) ppb = static_cast<int>(std::clamp<int64_t>((groups * pages + 527) / 528, 1, kPagesPerBlock));
    if (ppb < 1 || ppb > kPagesPerBlock)
      return invalid_argument("indexer_scores: pages_per_block = {} (1..{})", ppb, kPagesPerBlock);
    const int fp8_chunks = (pages + ppb - 1) / ppb;
    if (fp8_chunks > 65535) return invalid_argument("indexer_scores: max_length {} too large", p.max_length);
    const dim3 g(static_cast<unsigned>(groups), static_cast<unsigned>(fp8_chunks));
    launch_kernel(kernel, g, kThreads, smem, p.stream, static_cast<const uint8_t*>(p.q), p.q_scale, p.weights,
                  static_cast<const uint8_t*>(p.cache), p.num_blocks, p.block_table, p.block_table_stride,
                  p.seq_of_token, p.lengths, p.HI, p.weight_scale, p.scores, p.scores_stride, p.T, ppb);
    return cuda_status(cudaGetLastError(), "indexer_fp8_kernel");
  }
  const size_t smem = smem_bytes(p.HI);
  ML4_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(indexer_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  launch_kernel(indexer_scores_kernel, grid, kThreads, smem, p.stream, static_cast<const uint8_t*>(p.q), p.q_scale,
                p.weights, static_cast<const uint8_t*>(p.cache), p.num_blocks, p.block_table, p.block_table_stride,
                p.seq_of_token, p.lengths, p.HI, p.weight_scale, p.scores, p.scores_stride);
  return cuda_status(cudaGetLastError(), "indexer_scores_kernel");
}

Status indexer_query_quant(const IndexerQueryQuantParams& p) {
  if (p.rows < 0) return invalid_argument("indexer_query_quant: rows = {}", p.rows);
  if (p.dI < kDim || p.dI > 1024 || (p.dI & (p.dI - 1)) != 0)
    return invalid_argument("indexer_query_quant: dI = {} (a power of two in [128, 1024])", p.dI);
  if (p.rows == 0) return ok_status();
  if (!p.q || !p.q8 || !p.scales) return invalid_argument("indexer_query_quant: null pointer");
  const RopeRows& r = p.rope_rows;
  if (p.rope && (p.heads <= 0 || p.rows % p.heads != 0 || r.dim <= 0 || r.dim > p.dI || r.dim % 2 != 0 ||
                 !r.positions || !r.inv_freq))
    return invalid_argument("indexer_query_quant: rope over {} rows of {} heads, dim {} of {}", p.rows, p.heads, r.dim,
                            p.dI);
  if (p.rows > 0x7fffffff) return invalid_argument("indexer_query_quant: rows = {} too large", p.rows);
  // The CPU reference's n^-0.5, rounded to f32 the same way (ops/cpu/quant.cpp).
  const float hscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.dI)));
  const size_t smem = (p.dI + (p.rope ? r.dim : 0)) * sizeof(float);
  launch_kernel(query_quant_kernel, static_cast<unsigned>(p.rows), p.dI / 2, smem, p.stream, p.q, p.dI, p.hadamard,
                hscale, static_cast<uint8_t*>(p.q8), p.scales, p);
  return cuda_status(cudaGetLastError(), "query_quant_kernel");
}

}  // namespace ml4::cuda
