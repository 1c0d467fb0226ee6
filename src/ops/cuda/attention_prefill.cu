// Sparse MLA prefill over the fp8_ds_mla latent cache (r = 512, dr = 64) on Hopper wgmma: the
// kernel mla_attention picks for MlaMath::kBf16TensorCore + sparse + kFp8DsMla when the step has
// at least a wave of (token, 64-head block) pairs (attention.cu use_prefill_kernel). Same
// function as attention_tc.cu / attention_decode.cu (q, keys and P rounded to bf16, f32
// accumulation and softmax, natural-log lse, SSMax head_scale per token and head).
//
// Why a third kernel. Prefill is compute-bound: at 4096 tokens (causal, top-k 2048, mean 1536
// keys) a layer is 0.88 TFLOP for 64 heads; the decode kernel (mma.sync, fp8 rows dequantized
// per token in shared memory) ran it at ~132 TFLOP/s. Two things cost it: every token
// dequantizes its own 2048 rows again (the step's cache is only T rows), and mma.sync feeds
// both operands through registers (ldmatrix) where wgmma reads them from shared memory.
//
// Design (FlashMLA's sm90 sparse prefill schedule, written anew; deepseek-ai/FlashMLA):
//   1. Pre-pass: the cache pages the step's indices touch are dequantized once into a bf16
//      scratch [pages x 64][576] in the workspace (e4m3 x tile scale rounded to bf16 in f32, as
//      attention_tc.cu does; rope bf16 copied). A page map (page -> scratch page, in page
//      order: deterministic) is built by marking pages (mark_pages), one block scanning the
//      marks (rank_pages) and dequantizing the listed pages (dequant_pages). The scratch holds
//      at most `scratch_pages` pages (the caller's bound: the step's block-table pages); the
//      workspace is sized for it (mla_prefill_workspace_bytes). The marks are bits, set per
//      block in shared memory and merged once per block (mark_pages says why).
//   2. Main kernel: one CTA per (token, 64-head block), 384 threads = 3 warpgroups. Tokens are
//      taken last first (the longest key lists start first: less tail).
//      Warpgroup 2 (producer, 40 registers after setmaxnreg): per tile of 64 keys, gathers the
//        64 scratch rows with cp.async 16-byte chunks straight into the wgmma layout (9 slabs of
//        [64 keys][128 bytes], 128-byte swizzle), invalid keys zero-filled, and signals the
//        stage's `full` mbarrier (cp.async.mbarrier.arrive.noinc + a plain arrive that
//        publishes the valid flags). Two stages (2 x 72 KB: shared memory holds no third).
//        Each key resolves through its index and then the page map, each load issued a tile
//        ahead of its use.
//      Warpgroups 0, 1 (consumers, 232 registers): Q (64 heads x 576, bf16, swizzled) stays
//        in shared memory (loaded 9 pieces a thread at a time, streaming). Per tile:
//          S = Q K^T: warpgroup w takes keys [32w, 32w + 32): 36 wgmma m64n32k16 (16 f32 each).
//          Softmax: scale by head_scale, mask, row max over the 32 keys (quad shuffles),
//            exchanged through shared memory with the other warpgroup (named barrier), so both
//            hold the same running max; P = exp(s - m) rounded to bf16 to shared memory (the
//            A operand of PV, one swizzled 64 x 64 slab); per-thread partial sums of the
//            bf16 P (the sum matches the P that PV uses, as in the decode kernel).
//          O = O * corr + P V: warpgroup w owns output columns [256w, 256w + 256): 4 wgmma
//            m64n256k16 with V = the key tile's first 512 columns read N-major (no copy):
//            128 f32 accumulators per thread. Then the stage is released (`empty`).
//        Two named barriers per tile among the consumers. The row sums are reduced at the end
//        (quad shuffles, then the two warpgroups in order: deterministic).
//   Costs per 64-key tile: 64 x 64 x (576 + 512) x 2 = 8.9 MFLOP, 73.7 KB of bf16 rows from L2
//   (the step's scratch is T x 1152 bytes: 4.7 MB at 4096 tokens, L2-resident). At 600 TFLOP/s
//   the SMs together pull ~5 TB/s from L2: the second limit after the tensor cores.
// Measured (docs/BENCHMARKS.md "Sparse MLA prefill kernel", H100): 331-344 / 351-356 TFLOP/s at
// ml4-slice-4's 4096 / 8192-token prefill (2.55-2.65 / 5.74-5.82 ms), 2.5x the decode kernel; the
// first version ran at 288 / 301 in the same process (its page marking in L2, Q loaded one piece
// at a time). ML4_MLA_PREFILL_SKIP (below) splits the 4096-token time: S 0.84 ms, PV 0.38, Q load
// 0.19 and output stores 0.27 (1.1 GB of f32 through HBM, nothing beside them on the SM), pre-pass
// 0.07, producer hand-offs 0.08; with no producer, MMA, Q or stores the consumers still take
// 0.87 ms (pre-pass included; ~1 us a tile: the softmax, two barriers and two proxy fences
// between S and PV, the tensor cores idle). Next steps in BENCHMARKS.md.
// Shared memory (227 KB usable): Q 72 KB + 2 key stages 144 KB + P 8 KB + flags: 226 KB.
// One P buffer suffices: P of tile i + 1 is written after the first barrier of tile i + 1,
// which both warpgroups reach only after waiting for their PV of tile i.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>

#include "kv/latent_layout.h"
#include "ops/cuda/attention_internal.h"
#include "ops/cuda/mbarrier.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/wgmma.cuh"

namespace ml4::cuda::detail {
namespace {

constexpr int kR = 512, kDr = 64, kD = kR + kDr;
constexpr int kRowBytes = 656;             // latent_token_bytes(kFp8DsMla, 512, 64)
constexpr int kScaleOffset = kR;           // 4 f32 tile scales
constexpr int kRopeOffset = kR + 16;       // 64 bf16
constexpr int kRowBf16Bytes = kD * 2;      // scratch row: 1152 bytes
constexpr int kKeys = 64;                  // keys per tile
constexpr int kHeads = 64;                 // heads per CTA (wgmma M)
constexpr int kSlabs = kD / 64;            // 128-byte column slabs of a row: 9
constexpr int kSlabBytes = 64 * 128;       // [64 rows][128 bytes]
constexpr int kTileBytes = kSlabs * kSlabBytes;  // 73,728
constexpr int kStages = 2;
constexpr int kThreads = 384;
constexpr int kConsumers = 256;
constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // 128 x 40 + 256 x 232 <= 65536
static_assert(kRowBytes == 656 && kD % 64 == 0, "fp8_ds_mla rows of r 512, dr 64");

// Shared-memory byte offsets from the 1024-aligned base.
constexpr int kQOff = 0;
constexpr int kKOff = kQOff + kTileBytes;
constexpr int kPOff = kKOff + kStages * kTileBytes;
constexpr int kRowMaxOff = kPOff + kSlabBytes;   // f32 [2][64]
constexpr int kRowSumOff = kRowMaxOff + 512;      // f32 [2][64]
constexpr int kHsOff = kRowSumOff + 512;          // f32 [64]
constexpr int kValidOff = kHsOff + 256;           // u8 [kStages][64]
constexpr int kBarOff = kValidOff + kStages * kKeys;  // u64 full[kStages], empty[kStages]
constexpr int kSmemUsed = kBarOff + 16 * kStages;
constexpr int kSmemBytes = kSmemUsed + 1024;  // + alignment slack
static_assert(kSmemBytes <= 232448, "fits the 227 KB opt-in shared memory of sm_90");
static_assert(kBarOff % 8 == 0, "mbarriers are 8-byte aligned");

// ML4_MLA_PREFILL_SKIP (a measurement switch, read at each launch; the results are WRONG while
// it is set): a bit mask of pieces left out, to time where a tile's time goes (BENCHMARKS.md).
// kSkipProducer: no producer at all (the consumers do not wait for tiles; valid flags garbage).
constexpr int kSkipExp = 1, kSkipLoads = 2, kSkipS = 4, kSkipPv = 8, kSkipQ = 16, kSkipStores = 32, kSkipPrepass = 64,
              kSkipProducer = 128;

// 16 bytes global -> shared; !valid zero-fills and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
// Named barrier 1 among the 256 consumer threads (0 is __syncthreads).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits)
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float e4m3_f32(uint32_t b) {
  __nv_fp8_e4m3 v;
  v.__x = static_cast<__nv_fp8_storage_t>(b);
  return static_cast<float>(v);
}

// Workspace: [page map: num_pages int32][page bitmap: words uint32][count: 16 bytes][page list:
// cap int32] then, 256-aligned, the scratch [cap][64][576] bf16.
int64_t bitmap_words(int64_t num_pages) { return (num_pages + 31) / 32; }
struct Workspace {
  int32_t* page_map;
  uint32_t* bits;
  int32_t* count;
  int32_t* page_list;
  uint8_t* scratch;
};
size_t scratch_offset(int64_t num_pages, int64_t cap) {
  const size_t head = static_cast<size_t>(num_pages + bitmap_words(num_pages)) * 4 + 16 + static_cast<size_t>(cap) * 4;
  return (head + 255) / 256 * 256;
}
Workspace carve(void* ws, int64_t num_pages, int64_t cap) {
  uint8_t* b = static_cast<uint8_t*>(ws);
  const int64_t head = (num_pages + bitmap_words(num_pages)) * 4;
  Workspace w;
  w.page_map = reinterpret_cast<int32_t*>(b);
  w.bits = reinterpret_cast<uint32_t*>(b + num_pages * 4);
  w.count = reinterpret_cast<int32_t*>(b + head);
  w.page_list = reinterpret_cast<int32_t*>(b + head + 16);
  w.scratch = b + scratch_offset(num_pages, cap);
  return w;
}

// Sets bit p of bits for every page p that a valid index of the step points into. Block b takes
// tokens b, b + grid, ...; its marks collect in a shared-memory copy of the bitmap (when it fits,
// kMarkSmemWords) and reach the global one once per block, as an atomicOr of each non-zero word;
// a bit already set is not set again. (Before, each of the T x topk indices stored to the page's
// word: all of a sequence's indices hit its few dozen pages, and same-address stores serialize
// in L2: 0.33 ms more at 4096 tokens, 0.82 at 8192.)
constexpr int kMarkThreads = 256, kMarkBlocks = 264;  // two blocks per SM (132 SMs on the H100)
constexpr int64_t kMarkSmemWords = 48 * 1024 / 4;      // the default shared-memory limit: 393,216 pages
__global__ void __launch_bounds__(kMarkThreads) mark_pages(const Args a, uint32_t* __restrict__ bits, int64_t words) {
  extern __shared__ uint32_t sbits[];
  const bool local = words <= kMarkSmemWords;
  uint32_t* m = local ? sbits : bits;
  if (local) {
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) sbits[w] = 0;
    __syncthreads();
  }
  for (int64_t t = blockIdx.x; t < a.T; t += gridDim.x) {
    const int n = a.index_lengths ? min(max(a.index_lengths[t], 0), a.topk) : a.topk;
    const int32_t* idx = a.indices + t * a.indices_stride;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const int64_t s = idx[j];
      if (s < 0 || s >= a.num_slots) continue;
      const int64_t pg = s / kPageTokens;
      const uint32_t bit = 1u << (pg & 31);
      if (!(m[pg >> 5] & bit)) atomicOr(m + (pg >> 5), bit);
    }
  }
  if (local) {
    __syncthreads();
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x)
      if (const uint32_t v = sbits[w]) atomicOr(bits + w, v);
  }
}

// One block of 1024: mark -> scratch page (exclusive scan in page order) or -1; page list; count.
__global__ void __launch_bounds__(1024) rank_pages(const uint32_t* __restrict__ bits, int32_t* __restrict__ map,
                                                   int64_t num_pages, int64_t cap, int32_t* __restrict__ list,
                                                   int32_t* __restrict__ count) {
  __shared__ int32_t warp_sums[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t base_rank = 0;
  for (int64_t p0 = 0; p0 < num_pages; p0 += 1024) {
    const int64_t p = p0 + tid;
    const int m = p < num_pages ? static_cast<int>((bits[p >> 5] >> (p & 31)) & 1) : 0;
    int x = m;  // inclusive warp scan
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = warp_sums[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int64_t rank = base_rank + (warp ? warp_sums[warp - 1] : 0) + x - m;
    if (p < num_pages) {
      const bool kept = m && rank < cap;
      map[p] = kept ? static_cast<int32_t>(rank) : -1;
      if (kept) list[rank] = static_cast<int32_t>(p);
    }
    base_rank += warp_sums[31];
    __syncthreads();
  }
  if (tid == 0) *count = static_cast<int32_t>(std::min<int64_t>(base_rank, cap));
}

// Block b dequantizes listed page b (if b < count): 64 rows x 72 pieces of 8 values.
__global__ void __launch_bounds__(256) dequant_pages(const uint8_t* __restrict__ cache,
                                                     const int32_t* __restrict__ list,
                                                     const int32_t* __restrict__ count, uint8_t* __restrict__ scratch) {
  const int b = blockIdx.x;
  if (b >= *count) return;
  const int64_t page = list[b];
  constexpr int kPieces = kD / 8;  // 64 fp8 pieces + 8 rope pieces
  for (int i = threadIdx.x; i < kPageTokens * kPieces; i += blockDim.x) {
    const int row = i / kPieces, c = i % kPieces;
    const uint8_t* src = cache + (page * kPageTokens + row) * kRowBytes;
    uint4 o;
    if (c < kR / 8) {
      const uint2 v = *reinterpret_cast<const uint2*>(src + 8 * c);
      const float sc = *reinterpret_cast<const float*>(src + kScaleOffset + 4 * (8 * c / kDsMlaTile));
      o.x = pack_bf16(e4m3_f32(v.x & 0xff) * sc, e4m3_f32((v.x >> 8) & 0xff) * sc);
      o.y = pack_bf16(e4m3_f32((v.x >> 16) & 0xff) * sc, e4m3_f32(v.x >> 24) * sc);
      o.z = pack_bf16(e4m3_f32(v.y & 0xff) * sc, e4m3_f32((v.y >> 8) & 0xff) * sc);
      o.w = pack_bf16(e4m3_f32((v.y >> 16) & 0xff) * sc, e4m3_f32(v.y >> 24) * sc);
    } else {
      o = *reinterpret_cast<const uint4*>(src + kRopeOffset + 16 * (c - kR / 8));
    }
    *reinterpret_cast<uint4*>(scratch + (static_cast<int64_t>(b) * kPageTokens + row) * kRowBf16Bytes + 16 * c) = o;
  }
}

// Key j of token t's list: its cache slot (-1 past n) and the slot's scratch row (null for an
// invalid slot or an unlisted page). The producers of both schedules resolve keys so.
struct KeyRows {
  const int32_t* idx;
  int n;
  int64_t num_slots;
  const int32_t* page_map;
  const uint8_t* scratch;
  __device__ __forceinline__ int32_t slot_of(int j) const { return j < n ? idx[j] : -1; }
  __device__ __forceinline__ const uint8_t* row_of_slot(int32_t s) const {
    if (s < 0 || s >= num_slots) return nullptr;
    const int32_t pg = page_map[s / kPageTokens];
    if (pg < 0) return nullptr;
    return scratch + (static_cast<int64_t>(pg) * kPageTokens + s % kPageTokens) * kRowBf16Bytes;
  }
};

// The consumers' prologue: token t's Q for heads [h0, h0 + HB) -> bf16, swizzled at q_smem (rows
// >= HB zero), and the head scales into hs. Each thread's 18 pieces of 8 values are loaded 9 at a
// time (two memory latencies, not 18), streaming (read once: they should not push the indices and
// the scratch out of L2). With a.lat_bf16, q_lat's pieces are bf16 already (16 bytes, copied as
// they are); the rope part is f32 either way.
__device__ __forceinline__ void load_q(const Args& a, int t, int h0, int HB, uint8_t* q_smem, float* hs, int tid) {
  auto q_src = [&](int i) -> const void* {  // piece i = (head, 8-value column block) of Q, or null past HB
    const int h = i / (kD / 8), c = i % (kD / 8);
    const int64_t th = static_cast<int64_t>(t) * a.H + h0 + h;
    if (h >= HB) return nullptr;
    if (c >= kR / 8) return a.q_rope + th * a.q_rope_stride + 8 * (c - kR / 8);
    return a.lat_bf16 ? static_cast<const void*>(reinterpret_cast<const __nv_bfloat16*>(a.q_lat) + th * kR + 8 * c)
                      : static_cast<const void*>(a.q_lat + th * kR + 8 * c);
  };
  auto is_bf16 = [&](int i) { return a.lat_bf16 && i % (kD / 8) < kR / 8; };
  auto q_store = [&](int i, float4 x0, float4 x1) {
    const int h = i / (kD / 8), c = i % (kD / 8);
    const uint4 o = is_bf16(i) ? make_uint4(__float_as_uint(x0.x), __float_as_uint(x0.y), __float_as_uint(x0.z),
                                            __float_as_uint(x0.w))
                               : make_uint4(pack_bf16(x0.x, x0.y), pack_bf16(x0.z, x0.w), pack_bf16(x1.x, x1.y),
                                            pack_bf16(x1.z, x1.w));
    *reinterpret_cast<uint4*>(q_smem + (c / 8) * kSlabBytes + h * 128 + (((c % 8) ^ (h % 8)) << 4)) = o;
  };
  constexpr int kQPieces = kHeads * (kD / 8), kQPerThread = kQPieces / kConsumers, kQBatch = 9;
  static_assert(kQPieces % kConsumers == 0 && kQPerThread % kQBatch == 0, "Q pieces split evenly");
#pragma unroll
  for (int b0 = 0; b0 < kQPerThread; b0 += kQBatch) {
    float4 x[kQBatch][2];
#pragma unroll
    for (int k = 0; k < kQBatch; ++k) {
      const int i = tid + kConsumers * (b0 + k);
      const float4* src = static_cast<const float4*>(q_src(i));
      x[k][0] = src ? __ldcs(src) : make_float4(0, 0, 0, 0);  // bf16 pieces: their 16 bytes, as bits
      x[k][1] = src && !is_bf16(i) ? __ldcs(src + 1) : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kQBatch; ++k) q_store(tid + kConsumers * (b0 + k), x[k][0], x[k][1]);
  }
  if (tid < kHeads) hs[tid] = tid < HB ? a.head_scale[static_cast<int64_t>(t) * a.H + h0 + tid] : 0.0f;
}

// The consumers' epilogue: row sums (quad, then the two warpgroups in order, through sums [2][64]
// in shared memory: deterministic), lse (natural log) by warpgroup 0, the normalised output of
// warpgroup wg's columns [256 wg, 256 wg + 256) (streaming: written once, read by the next op).
__device__ __forceinline__ void write_out(const Args& a, int t, int h0, int HB, const float (&o)[128], float (&l)[2],
                                          const float (&m)[2], float* sums, int wg, int r0, int r1, int tq,
                                          bool stores) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
  }
  if (tq == 0) {
    sums[wg * kHeads + r0] = l[0];
    sums[wg * kHeads + r1] = l[1];
  }
  consumer_sync();
  const float l0 = sums[r0] + sums[kHeads + r0], l1 = sums[r1] + sums[kHeads + r1];
  const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
  const int64_t base = static_cast<int64_t>(t) * a.H + h0;
  if (wg == 0 && tq == 0) {
    if (r0 < HB) a.lse[base + r0] = l0 > 0.0f ? m[0] + logf(l0) : -INFINITY;
    if (r1 < HB) a.lse[base + r1] = l1 > 0.0f ? m[1] + logf(l1) : -INFINITY;
  }
  if (!stores) return;
  if (a.lat_bf16) {  // bf16 out: the same values rounded (RNE), half the bytes
    __nv_bfloat16* out16 = reinterpret_cast<__nv_bfloat16*>(a.out);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = 256 * wg + 8 * j + 2 * tq;
      if (r0 < HB)
        __stcs(reinterpret_cast<unsigned int*>(out16 + (base + r0) * kR + col), pack_bf16(o[4 * j] * inv0, o[4 * j + 1] * inv0));
      if (r1 < HB)
        __stcs(reinterpret_cast<unsigned int*>(out16 + (base + r1) * kR + col),
               pack_bf16(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1));
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = 256 * wg + 8 * j + 2 * tq;
    if (r0 < HB)
      __stcs(reinterpret_cast<float2*>(a.out + (base + r0) * kR + col), make_float2(o[4 * j] * inv0, o[4 * j + 1] * inv0));
    if (r1 < HB)
      __stcs(reinterpret_cast<float2*>(a.out + (base + r1) * kR + col),
             make_float2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1));
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    mla_prefill_kernel(const Args a, const int32_t* __restrict__ page_map, const uint8_t* __restrict__ scratch,
                       const int skip) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
  uint8_t* sgen = smem_raw + (sbase - smem_u32(smem_raw));  // generic pointer of sbase
  float* rowmax = reinterpret_cast<float*>(sgen + kRowMaxOff);
  float* rowsum = reinterpret_cast<float*>(sgen + kRowSumOff);
  float* hs = reinterpret_cast<float*>(sgen + kHsOff);
  uint8_t* valid = sgen + kValidOff;
  const uint32_t full0 = sbase + kBarOff, empty0 = full0 + 8 * kStages;

  const int t = a.T - 1 - static_cast<int>(blockIdx.x);  // longest lists first
  const int h0 = blockIdx.z * kHeads;
  const int HB = min(kHeads, a.H - h0);
  const int tid = threadIdx.x, lane = tid & 31;
  const int n = a.index_lengths ? min(max(a.index_lengths[t], 0), a.topk) : a.topk;
  const int ntiles = (n + kKeys - 1) / kKeys;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 2 * 128);  // 128 cp.async arrivals + 128 plain ones
      mbar_init(empty0 + 8 * s, kConsumers / 32);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (tid >= kConsumers) {
    // Producer warpgroup: thread (kr, c8) moves 16-byte chunk c8 of every 128-byte slab of keys
    // kr + 16 q (q < 4); all its keys share key % 8, hence one swizzle.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (skip & kSkipProducer) return;
    const int ptid = tid - kConsumers, c8 = ptid & 7, kr = ptid >> 3;
    const uint32_t swz = static_cast<uint32_t>((c8 ^ (kr & 7)) << 4);
    const KeyRows keys{a.indices + static_cast<int64_t>(t) * a.indices_stride, n, a.num_slots, page_map, scratch};
    auto slot_of = [&](int j) { return keys.slot_of(j); };
    auto row_of_slot = [&](int32_t s) { return keys.row_of_slot(s); };
    auto row_of = [&](int j) { return row_of_slot(slot_of(j)); };
    // Keys resolve in two dependent loads (index, then page map), each issued a tile before its
    // use: tile i's copies go out, then tile i + 1's rows are resolved from the indices loaded
    // during tile i - 1, and tile i + 2's indices are loaded. (Before, both loads of tile i + 1
    // came after tile i's copies: 0.12 ms of 5.9 at 8192 tokens, 0.02 at 4096.)
    const uint8_t* src[4];
    int32_t next_slot[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      src[q] = ntiles > 0 ? row_of(kr + 16 * q) : nullptr;
      next_slot[q] = slot_of(kKeys + kr + 16 * q);
    }
    for (int i = 0; i < ntiles; ++i) {
      const int st = i % kStages;
      if (i >= kStages) mbar_wait(empty0 + 8 * st, ((i / kStages) - 1) & 1);
      const uint32_t kt = sbase + kKOff + st * kTileBytes;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int key = kr + 16 * q;
        const bool ok = src[q] != nullptr;
        if (c8 == 0) valid[st * kKeys + key] = ok;
        const uint8_t* s0 = ok ? src[q] + 16 * c8 : scratch;
        if (!(skip & kSkipLoads)) {
#pragma unroll
          for (int sl = 0; sl < kSlabs; ++sl) cp_async16(kt + sl * kSlabBytes + key * 128 + swz, s0 + 128 * sl, ok);
        }
      }
      mbar_arrive_cp_async(full0 + 8 * st);
      mbar_arrive(full0 + 8 * st);  // publishes the valid flags (release)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        src[q] = row_of_slot(next_slot[q]);
        next_slot[q] = slot_of((i + 2) * kKeys + kr + 16 * q);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));

  // Consumers: Q and the head scales (load_q).
  if (!(skip & kSkipQ)) {
    load_q(a, t, h0, HB, sgen + kQOff, hs, tid);
  } else if (tid < kHeads) {
    hs[tid] = tid < HB ? a.head_scale[static_cast<int64_t>(t) * a.H + h0 + tid] : 0.0f;
  }
  wgmma::fence_proxy_async();
  consumer_sync();

  const int wg = tid >> 7, wwarp = (tid >> 5) & 3, g = lane >> 2, tq = lane & 3;
  const int r0 = 16 * wwarp + g, r1 = r0 + 8;  // this thread's accumulator rows (heads)
  const float hs0 = hs[r0], hs1 = hs[r1];
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  // Pins the zeroing here: sunk into S(0)'s wgmma group, it made ptxas serialize every wgmma of
  // the kernel (C7515, "non wgmma instructions defining accumulator registers"): each MMA waited
  // for the one before it.
  wgmma::fence_operands(o);
  const uint32_t qb = sbase + kQOff, pb = sbase + kPOff;

  // S = Q K^T over keys [32 wg, 32 wg + 32) of the tile in stage st, issued asynchronously.
  float s[16];
  auto issue_s = [&](int i) {
    const int st = i % kStages;
    if (!(skip & kSkipProducer)) mbar_wait(full0 + 8 * st, (i / kStages) & 1);
    wgmma::fence_proxy_async();  // the cp.async rows, written through the generic proxy
    const uint32_t kt = sbase + kKOff + st * kTileBytes;
    wgmma::fence_operands(s);
    if (!(skip & kSkipS)) {
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < kD / 16; ++k) {
        const uint32_t off = (k / 4) * kSlabBytes + (k % 4) * 32;
        wgmma::m64n32k16_bf16(s, wgmma::desc_k_major(qb + off), wgmma::desc_k_major(kt + wg * 32 * 128 + off), k);
      }
      wgmma::commit();  // fence, MMAs and commit in one branch: no arrive injected by ptxas (C7519)
    }
  };
  if (ntiles > 0) issue_s(0);

  for (int i = 0; i < ntiles; ++i) {
    const int st = i % kStages;
    const uint32_t kt = sbase + kKOff + st * kTileBytes;
    // S(i) done, and PV(i - 1) (committed before it): release that tile's stage.
    wgmma::wait<0>();
    wgmma::fence_operands(s);
    wgmma::fence_operands(o);
    if (i > 0) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
    }

    // Scale, mask, row max of this warpgroup's 32 keys.
    const uint8_t* vf = valid + st * kKeys + 32 * wg;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = 8 * j + 2 * tq;
      const bool v0 = vf[c], v1 = vf[c + 1];
      s[4 * j + 0] = v0 ? s[4 * j + 0] * hs0 : -INFINITY;
      s[4 * j + 1] = v1 ? s[4 * j + 1] * hs0 : -INFINITY;
      s[4 * j + 2] = v0 ? s[4 * j + 2] * hs1 : -INFINITY;
      s[4 * j + 3] = v1 ? s[4 * j + 3] * hs1 : -INFINITY;
      mx0 = fmaxf(mx0, fmaxf(s[4 * j + 0], s[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    if (tq == 0) {
      rowmax[wg * kHeads + r0] = mx0;
      rowmax[wg * kHeads + r1] = mx1;
    }
    consumer_sync();  // both halves' row maxima; both warpgroups done with tile i - 1's P
    const float mn0 = fmaxf(m_run[0], fmaxf(rowmax[r0], rowmax[kHeads + r0]));
    const float mn1 = fmaxf(m_run[1], fmaxf(rowmax[r1], rowmax[kHeads + r1]));
    const float corr0 = mn0 == -INFINITY ? 1.0f : __expf(m_run[0] - mn0);  // m_run = -inf -> 0
    const float corr1 = mn1 == -INFINITY ? 1.0f : __expf(m_run[1] - mn1);
    m_run[0] = mn0;
    m_run[1] = mn1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      auto ex = [&](float x, float m) { return (skip & kSkipExp) ? x : (m == -INFINITY ? 0.0f : __expf(x - m)); };
      const __nv_bfloat162 p01 = __floats2bfloat162_rn(ex(s[4 * j + 0], mn0), ex(s[4 * j + 1], mn0));
      const __nv_bfloat162 p23 = __floats2bfloat162_rn(ex(s[4 * j + 2], mn1), ex(s[4 * j + 3], mn1));
      sum0 += __low2float(p01) + __high2float(p01);
      sum1 += __low2float(p23) + __high2float(p23);
      // P[head][key], key = 32 wg + 8 j + 2 tq: chunk 4 wg + j of the head's 128-byte row.
      const int chunk = 4 * wg + j;
      *reinterpret_cast<__nv_bfloat162*>(sgen + kPOff + r0 * 128 + ((chunk ^ (r0 % 8)) << 4) + 4 * tq) = p01;
      *reinterpret_cast<__nv_bfloat162*>(sgen + kPOff + r1 * 128 + ((chunk ^ (r1 % 8)) << 4) + 4 * tq) = p23;
    }
    l_run[0] = l_run[0] * corr0 + sum0;
    l_run[1] = l_run[1] * corr1 + sum1;
    wgmma::fence_proxy_async();  // P, written through the generic proxy
    consumer_sync();             // P complete

    // O = O * corr + P V, columns [256 wg, 256 wg + 256): slabs 4 wg .. 4 wg + 3 of the tile.
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j + 0] *= corr0;
      o[4 * j + 1] *= corr0;
      o[4 * j + 2] *= corr1;
      o[4 * j + 3] *= corr1;
    }
    wgmma::fence_operands(o);
    if (!(skip & kSkipPv)) {
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        const uint64_t da = wgmma::desc_k_major(pb + kk * 32);
        const uint64_t db = wgmma::desc_sw128(kt + 4 * wg * kSlabBytes + kk * 16 * 128, kSlabBytes, 1024);
        wgmma::m64n256k16_bf16_bn(o, da, db, 1);
      }
      wgmma::commit();
    }
    // The next tile's S queues behind this PV on the tensor cores (no drain between tiles).
    if (i + 1 < ntiles) issue_s(i + 1);
  }
  wgmma::wait<0>();
  wgmma::fence_operands(o);

  write_out(a, t, h0, HB, o, l_run, m_run, rowsum, wg, r0, r1, tq, !(skip & kSkipStores));
}

// ---- The pair schedule (MlaAttentionParams::prefill_pairs; FlashMLA's sm90 sparse prefill
// order, deepseek-ai/FlashMLA csrc/sm90/prefill/sparse, read for the schedule, written anew).
// Why: the tile schedule above splits every 64-key tile between the warpgroups (S m64n32 each,
// both reading all of Q: 1.5x the shared-memory operand bytes of m64n64) and runs both
// softmaxes at once between two barriers, the tensor cores idle (~1 us a tile, BENCHMARKS.md).
// Here warpgroup w owns key tile 2p + w of pair p (buffer Kw): S = Q Kw^T by m64n64k16, P kept
// in registers as the A operand of its local PV (wgmma with A from registers), and the other
// warpgroup's P read from shared memory for the remote PV. Warpgroup 0 owns output columns
// [0, 256), warpgroup 1 [256, 512): V's left half (slabs 0-3) of K0 is warpgroup 0's local V,
// the right half (slabs 4-7) warpgroup 1's remote V, and the other way round for K1.
//   Per pair (named barriers A-D carry the running max and the P tiles one way each):
//     wg 0: S0 done -> mask, m0 = max(m, rowmax S0), O, l *= e^(m - m0), P0 = e^(S0 - m0)
//           -> max to smem, arrive A -> PV: O += P0 V0[:, :256] (registers) -> wait, K0 left
//           half free -> sync B (wg 1's max m') -> P0 e^(m0 - m') to smem (over K0's RoPE
//           slab, dead after S0) -> arrive C -> sync D -> O, l *= e^(m0 - m') -> PV: O += P1
//           V1[:, :256] (smem) -> S0 of the next pair, its left half as soon as the producer
//           refilled it -> K1 left half free when the remote PV retires.
//     wg 1: S1 (right half first) done -> mask -> sync A -> m' = max(m0, rowmax S1), O, l *=
//           e^(m - m'), P1 = e^(S1 - m') -> max to smem, arrive B -> PV: O += P1 V1[:, 256:]
//           (registers) -> P1 to smem -> sync C -> PV: O += P0' V0[:, 256:] -> arrive D ->
//           K1 right half free, then K0 right half free as the PVs retire.
//   Warpgroup 0's softmax runs while warpgroup 1's S is on the tensor cores and the other way
//   round. Producer: per pair K0 left, K1 right, K0 right, K1 left, each half behind its own
//   free / ready mbarriers, so a half refills as soon as its last reader retires.
// Numerics: q, keys and P in bf16, f32 softmax and accumulation, as above; the row sums add the
// bf16 P. Warpgroup 0's local PV uses P0 rounded at m0 and then scaled in f32, the remote one
// P0 scaled then rounded: the two column halves differ by the bf16 rounding of P0.
// Measured (H100, attention_bench, 2026-12-06; docs/BENCHMARKS.md "Eleventh session"): 2.311 /
// 5.211 ms at ml4-slice-4's 4096 / 8192-token prefill, 379 / 392 TFLOP/s, 1.13 / 1.11x the tile
// schedule (predicted ~1.45x); FlashMLA reports 640 on an H800 with bf16 q and out through TMA.
// Shared memory: Q 72 KB, K0, K1 72 KB each, P1 8 KB (P0 sits in K0's RoPE slab), flags.
constexpr int kPairQOff = 0;
constexpr int kPairK0Off = kPairQOff + kTileBytes;
constexpr int kPairK1Off = kPairK0Off + kTileBytes;
constexpr int kPairP1Off = kPairK1Off + kTileBytes;
constexpr int kPairP0Off = kPairK0Off + 8 * kSlabBytes;  // K0's RoPE slab
constexpr int kPairHsOff = kPairP1Off + kSlabBytes;      // f32 [64]
constexpr int kPairMaxOff = kPairHsOff + 256;            // f32 [64]
constexpr int kPairSumOff = kPairMaxOff + 256;           // f32 [2][64]
constexpr int kPairValidOff = kPairSumOff + 512;         // u8 [2][64]
constexpr int kPairBarOff = kPairValidOff + 2 * kKeys;   // u64 ready[2 bufs][2 halves], free[2][2]
constexpr int kPairSmemBytes = kPairBarOff + 8 * 8 + 1024;
static_assert(kPairSmemBytes <= 232448, "fits the 227 KB opt-in shared memory of sm_90");
static_assert(kPairBarOff % 8 == 0, "mbarriers are 8-byte aligned");
// Named barriers (0 is __syncthreads, 1 consumer_sync).
constexpr int kBarMax0 = 2, kBarMax1 = 3, kBarP0 = 4, kBarP1 = 5;
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kConsumers) : "memory");
}
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kConsumers) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1)
    mla_prefill_pairs_kernel(const Args a, const int32_t* __restrict__ page_map, const uint8_t* __restrict__ scratch) {
  pdl_wait();
  pdl_launch_dependents();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
  uint8_t* sgen = smem_raw + (sbase - smem_u32(smem_raw));
  float* hs = reinterpret_cast<float*>(sgen + kPairHsOff);
  float* smax = reinterpret_cast<float*>(sgen + kPairMaxOff);
  float* ssum = reinterpret_cast<float*>(sgen + kPairSumOff);
  uint8_t* valid = sgen + kPairValidOff;
  // ready(b, h) / free_(b, h): buffer b (K0, K1), half h (0: slabs 0-3, 1: slabs 4-8).
  auto ready = [&](int b, int h) { return sbase + kPairBarOff + 8 * (2 * b + h); };
  auto free_ = [&](int b, int h) { return sbase + kPairBarOff + 32 + 8 * (2 * b + h); };
  auto kbuf = [&](int b) { return sbase + (b ? kPairK1Off : kPairK0Off); };

  const int t = a.T - 1 - static_cast<int>(blockIdx.x);  // longest lists first
  const int h0 = blockIdx.z * kHeads;
  const int HB = min(kHeads, a.H - h0);
  const int tid = threadIdx.x, lane = tid & 31;
  const int n = a.index_lengths ? min(max(a.index_lengths[t], 0), a.topk) : a.topk;
  const int npairs = (n + 2 * kKeys - 1) / (2 * kKeys);

  if (tid == 0) {
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h) {
        mbar_init(ready(b, h), 2 * 128);  // 128 cp.async arrivals + 128 plain ones
        mbar_init(free_(b, h), 4);        // one per warp of the releasing warpgroup
      }
    mbar_init_fence();
  }
  __syncthreads();

  if (tid >= kConsumers) {
    // Producer: thread (kr, c8) moves 16-byte chunk c8 of each 128-byte slab of keys kr + 16 q.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    const int ptid = tid - kConsumers, c8 = ptid & 7, kr = ptid >> 3;
    const uint32_t swz = static_cast<uint32_t>((c8 ^ (kr & 7)) << 4);
    const KeyRows keys{a.indices + static_cast<int64_t>(t) * a.indices_stride, n, a.num_slots, page_map, scratch};
    auto slot_of = [&](int j) { return keys.slot_of(j); };
    auto row_of_slot = [&](int32_t s) { return keys.row_of_slot(s); };
    // Rows of the pair being copied (resolved one pair ahead), slots of the pair after it.
    const uint8_t* src[2][4];
    int32_t next_slot[2][4];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        src[b][q] = row_of_slot(slot_of(b * kKeys + kr + 16 * q));
        next_slot[b][q] = slot_of((2 + b) * kKeys + kr + 16 * q);
      }
    auto copy_half = [&](int p, int b, int h) {
      if (p > 0) mbar_wait(free_(b, h), (p - 1) & 1);
      const uint32_t kt = kbuf(b);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int key = kr + 16 * q;
        const bool ok = src[b][q] != nullptr;
        if (h == b && c8 == 0) valid[b * kKeys + key] = ok;  // with the buffer's first half
        const uint8_t* s0 = ok ? src[b][q] + 16 * c8 : scratch;
#pragma unroll
        for (int sl = h ? 4 : 0; sl < (h ? kSlabs : 4); ++sl)
          cp_async16(kt + sl * kSlabBytes + key * 128 + swz, s0 + 128 * sl, ok);
      }
      mbar_arrive_cp_async(ready(b, h));
      mbar_arrive(ready(b, h));  // publishes the valid flags (release)
    };
    for (int p = 0; p < npairs; ++p) {
      copy_half(p, 0, 0);
      copy_half(p, 1, 1);
      copy_half(p, 0, 1);
      copy_half(p, 1, 0);
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          src[b][q] = row_of_slot(next_slot[b][q]);
          next_slot[b][q] = slot_of((2 * p + 4 + b) * kKeys + kr + 16 * q);
        }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));

  load_q(a, t, h0, HB, sgen + kPairQOff, hs, tid);
  wgmma::fence_proxy_async();
  consumer_sync();

  const int wg = tid >> 7, wwarp = (tid >> 5) & 3, g = lane >> 2, tq = lane & 3;
  const int r0 = 16 * wwarp + g, r1 = r0 + 8;
  const float hs0 = hs[r0], hs1 = hs[r1];
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  wgmma::fence_operands(o);  // pinned here (C7515, as in the tile kernel)
  const uint32_t qb = sbase + kPairQOff, kb = kbuf(wg);
  float s[32];
  uint32_t pa[16];  // P as bf16 pairs: the A fragments of the local PV (4 per k16 step)

  // S += Q Kw^T over slabs [sl0, sl1) of this warpgroup's buffer once its half is ready.
  auto issue_s = [&](int p, int h, bool first) {
    mbar_wait(ready(wg, h), p & 1);
    wgmma::fence_proxy_async();  // the cp.async rows, written through the generic proxy
    wgmma::fence_operands(s);
    wgmma::fence();
#pragma unroll
    for (int k = h ? 16 : 0; k < (h ? kD / 16 : 16); ++k) {
      const uint32_t off = (k / 4) * kSlabBytes + (k % 4) * 32;
      wgmma::m64n64k16_bf16(s, wgmma::desc_k_major(qb + off), wgmma::desc_k_major(kb + off),
                            first && k == (h ? 16 : 0) ? 0 : 1);
    }
    wgmma::commit();
  };
  // Scales and masks S, returns this thread's two rows' maxima over the tile (quad-reduced). The
  // tile kernel runs the same loop over its 4 column groups; a shared helper left the tile
  // kernel's SASS as it was but changed this kernel's, which ran on a device as it is.
  auto mask_max = [&](float& mx0, float& mx1) {
    const uint8_t* vf = valid + wg * kKeys;
    mx0 = -INFINITY;
    mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = 8 * j + 2 * tq;
      const bool v0 = vf[c], v1 = vf[c + 1];
      s[4 * j + 0] = v0 ? s[4 * j + 0] * hs0 : -INFINITY;
      s[4 * j + 1] = v1 ? s[4 * j + 1] * hs0 : -INFINITY;
      s[4 * j + 2] = v0 ? s[4 * j + 2] * hs1 : -INFINITY;
      s[4 * j + 3] = v1 ? s[4 * j + 3] * hs1 : -INFINITY;
      mx0 = fmaxf(mx0, fmaxf(s[4 * j + 0], s[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
#pragma unroll
    for (int d = 1; d <= 2; d <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, d));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, d));
    }
  };
  auto rescale = [&](float c0, float c1) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j + 0] *= c0;
      o[4 * j + 1] *= c0;
      o[4 * j + 2] *= c1;
      o[4 * j + 3] *= c1;
    }
    l_run[0] *= c0;
    l_run[1] *= c1;
  };
  auto corr = [](float m_old, float m_new) { return m_new == -INFINITY ? 1.0f : __expf(m_old - m_new); };
  // P = e^(S - m) in s (f32) and pa (bf16); adds the bf16 values to the row sums.
  auto exp_rows = [&](float m0, float m1) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float m = (j & 1) ? m1 : m0;
      const float x0 = m == -INFINITY ? 0.0f : __expf(s[2 * j] - m);
      const float x1 = m == -INFINITY ? 0.0f : __expf(s[2 * j + 1] - m);
      const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
      pa[j] = *reinterpret_cast<const uint32_t*>(&v);
      s[2 * j] = x0;
      s[2 * j + 1] = x1;
      l_run[j & 1] += __low2float(v) + __high2float(v);
    }
  };
  // Stores P (bf16 pairs pv[16], this thread's fragment) as the K-major A operand at sp.
  auto store_p = [&](uint32_t sp_off, const uint32_t (&pv)[16]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // keys 8j + 2tq, 8j + 2tq + 1: chunk j of the head's row
      *reinterpret_cast<uint32_t*>(sgen + sp_off + r0 * 128 + ((j ^ (r0 % 8)) << 4) + 4 * tq) = pv[2 * j];
      *reinterpret_cast<uint32_t*>(sgen + sp_off + r1 * 128 + ((j ^ (r1 % 8)) << 4) + 4 * tq) = pv[2 * j + 1];
    }
  };
  // O += P V over V columns [256 c, 256 c + 256) of buffer vb: P from registers (local) or
  // shared memory at sp (remote).
  auto pv_local = [&](uint32_t vb, int c) {
    wgmma::fence_operands(o);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t f[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wgmma::m64n256k16_bf16_rs_bn(o, f, wgmma::desc_sw128(vb + 4 * c * kSlabBytes + kk * 16 * 128, kSlabBytes, 1024),
                                   1);
    }
    wgmma::commit();
  };
  auto pv_remote = [&](uint32_t vb, int c, uint32_t sp) {
    wgmma::fence_operands(o);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
      wgmma::m64n256k16_bf16_bn(o, wgmma::desc_k_major(sp + kk * 32),
                                wgmma::desc_sw128(vb + 4 * c * kSlabBytes + kk * 16 * 128, kSlabBytes, 1024), 1);
    wgmma::commit();
  };
  auto release = [&](int b, int h) {
    __syncwarp();
    if (lane == 0) mbar_arrive(free_(b, h));
  };

  if (wg == 0) {
    if (npairs > 0) {
      issue_s(0, 0, true);
      issue_s(0, 1, false);
      wgmma::wait<0>();
      wgmma::fence_operands(s);
    }
    for (int p = 0; p < npairs; ++p) {
      float mx0, mx1;
      mask_max(mx0, mx1);
      const float m0 = fmaxf(m_run[0], mx0), m1 = fmaxf(m_run[1], mx1);
      rescale(corr(m_run[0], m0), corr(m_run[1], m1));
      exp_rows(m0, m1);
      if (tq == 0) {
        smax[r0] = m0;
        smax[r1] = m1;
      }
      named_arrive(kBarMax0);
      pv_local(kbuf(0), 0);  // O[:, :256] += P0 V0[:, :256]
      wgmma::wait<0>();
      wgmma::fence_operands(o);
      wgmma::fence_operands(pa);
      release(0, 0);
      named_sync(kBarMax1);  // warpgroup 1's max m' (>= m0)
      const float f0 = corr(m0, smax[r0]), f1 = corr(m1, smax[r1]);
      m_run[0] = smax[r0];
      m_run[1] = smax[r1];
      uint32_t p0[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(s[2 * j] * ((j & 1) ? f1 : f0), s[2 * j + 1] * ((j & 1) ? f1 : f0));
        p0[j] = *reinterpret_cast<const uint32_t*>(&v);
      }
      store_p(kPairP0Off, p0);
      wgmma::fence_proxy_async();
      named_arrive(kBarP0);
      named_sync(kBarP1);  // P1 in shared memory
      rescale(f0, f1);
      pv_remote(kbuf(1), 0, sbase + kPairP1Off);  // O[:, :256] += P1 V1[:, :256]
      if (p + 1 < npairs) {
        issue_s(p + 1, 0, true);
        wgmma::wait<1>();  // the remote PV retired: K1's left half is free
        release(1, 0);
        issue_s(p + 1, 1, false);
        wgmma::wait<0>();
        wgmma::fence_operands(s);
      } else {
        wgmma::wait<0>();
        release(1, 0);
      }
      wgmma::fence_operands(o);
    }
  } else {
    for (int p = 0; p < npairs; ++p) {
      issue_s(p, 1, true);
      issue_s(p, 0, false);
      wgmma::wait<0>();
      wgmma::fence_operands(s);
      float mx0, mx1;
      mask_max(mx0, mx1);
      named_sync(kBarMax0);  // warpgroup 0's m0 = max(m, its tile)
      const float m0 = fmaxf(smax[r0], mx0), m1 = fmaxf(smax[r1], mx1);
      rescale(corr(m_run[0], m0), corr(m_run[1], m1));
      m_run[0] = m0;
      m_run[1] = m1;
      exp_rows(m0, m1);
      if (tq == 0) {
        smax[r0] = m0;
        smax[r1] = m1;
      }
      named_arrive(kBarMax1);
      pv_local(kbuf(1), 1);  // O[:, 256:] += P1 V1[:, 256:]
      store_p(kPairP1Off, pa);
      named_sync(kBarP0);  // P0 (at m') in K0's RoPE slab
      pv_remote(kbuf(0), 1, sbase + kPairP0Off);  // O[:, 256:] += P0 V0[:, 256:]
      wgmma::fence_proxy_async();                 // P1, written through the generic proxy
      named_arrive(kBarP1);
      wgmma::wait<1>();
      wgmma::fence_operands(pa);
      release(1, 1);
      wgmma::wait<0>();
      wgmma::fence_operands(o);
      release(0, 1);
    }
  }

  write_out(a, t, h0, HB, o, l_run, m_run, ssum, wg, r0, r1, tq, true);
}

int skip_mask() {
  const char* v = std::getenv("ML4_MLA_PREFILL_SKIP");
  return v ? std::atoi(v) : 0;
}

int64_t cap_pages(int64_t num_slots, int64_t T, int topk, int64_t scratch_pages) {
  const int64_t num_pages = (num_slots + kPageTokens - 1) / kPageTokens;
  int64_t cap = scratch_pages > 0 ? std::min(scratch_pages, num_pages) : num_pages;
  return std::max<int64_t>(1, std::min(cap, T * std::max(topk, 1)));
}

}  // namespace

bool mla_prefill_supported(int r, int dr, int row_bytes) { return r == kR && dr == kDr && row_bytes == kRowBytes; }

size_t mla_prefill_smem_bytes() { return std::max(kSmemBytes, kPairSmemBytes); }

size_t mla_prefill_workspace_bytes(int64_t num_slots, int64_t T, int topk, int64_t scratch_pages) {
  const int64_t num_pages = (num_slots + kPageTokens - 1) / kPageTokens;
  const int64_t cap = cap_pages(num_slots, T, topk, scratch_pages);
  return scratch_offset(num_pages, cap) + static_cast<size_t>(cap) * kPageTokens * kRowBf16Bytes;
}

cudaError_t launch_mla_prefill(const Args& a, void* workspace, int64_t scratch_pages, bool pairs, cudaStream_t stream) {
  const int64_t num_pages = (a.num_slots + kPageTokens - 1) / kPageTokens;
  const int64_t cap = cap_pages(a.num_slots, a.T, a.topk, scratch_pages);
  const Workspace w = carve(workspace, num_pages, cap);
  const int skip = skip_mask();
  cudaError_t e = cudaSuccess;
  if (!(skip & kSkipPrepass)) {
    const int64_t words = bitmap_words(num_pages);
    e = cudaMemsetAsync(w.bits, 0, static_cast<size_t>(words) * 4, stream);
    if (e != cudaSuccess) return e;
    const size_t smem = words <= kMarkSmemWords ? static_cast<size_t>(words) * 4 : 0;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(a.T, kMarkBlocks));
    if (a.T > 0) mark_pages<<<blocks, kMarkThreads, smem, stream>>>(a, w.bits, words);
    rank_pages<<<1, 1024, 0, stream>>>(w.bits, w.page_map, num_pages, cap, w.page_list, w.count);
    dequant_pages<<<static_cast<unsigned>(cap), 256, 0, stream>>>(a.cache, w.page_list, w.count, w.scratch);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  const dim3 grid(static_cast<unsigned>(a.T), 1, static_cast<unsigned>((a.H + kHeads - 1) / kHeads));
  if (pairs) {
    e = cudaFuncSetAttribute(mla_prefill_pairs_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPairSmemBytes);
    if (e != cudaSuccess) return e;
    launch_kernel(mla_prefill_pairs_kernel, grid, kThreads, kPairSmemBytes, stream, a,
                  static_cast<const int32_t*>(w.page_map), static_cast<const uint8_t*>(w.scratch));
    return cudaGetLastError();
  }
  e = cudaFuncSetAttribute(mla_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return e;
  launch_kernel(mla_prefill_kernel, grid, kThreads, kSmemBytes, stream, a, static_cast<const int32_t*>(w.page_map),
                static_cast<const uint8_t*>(w.scratch), skip);
  return cudaGetLastError();
}

}  // namespace ml4::cuda::detail
