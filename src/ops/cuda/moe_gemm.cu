// See moe_gemm.h. The wgmma operands (K-major e4m3, 128-byte swizzle), the descriptor and the
// MMA are wgmma.cuh's; each k32 step starts 32 bytes further into the rows.
#include "ops/cuda/moe_gemm.h"
#include "ops/cuda/pdl.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <utility>

#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/mbarrier.cuh"
#include "ops/cuda/wgmma.cuh"

namespace ml4::cuda {
namespace {

constexpr int kTileRows = kMoeGemmTileRows;  // A rows per CTA: one m64 per warpgroup, both on the same rows
constexpr int kBRows = 256;                  // B rows per CTA: 128 per warpgroup (two 64-row sub-blocks)
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kAStage = kTileRows * 128, kBStage = kBRows * 128, kStage = kAStage + kBStage;  // 40 KB
constexpr int kSmem = kStages * kStage + 512 + 1024;  // + the quantizing epilogue's [2][64] f32 + alignment slack
                                                       // (swizzle atoms sit on 1024 bytes)

struct GemmArgs {
  const uint8_t* a;
  const float* a_scale;
  const int32_t* a_rows;
  const void* const* w;
  const float* const* ws;
  const void* const* wu;
  const float* const* wus;
  const MoeTile* tiles;
  const int32_t* num_tiles;
  const int32_t* tile_first;  // null: CTA (x, y) = (column, tile); else the group-major order (cta_work)
  int groups;
  float* y;
  int N, K;
  uint8_t* yq;      // specialized gate_up: the hidden rows in e4m3 instead of y (null: y)
  float* yq_scale;  // their scales [rows][N / 128]
  const uint8_t* w_tm;   // specialized: the tensor maps of w and wu (MoeGroupedGemmParams::w_tmap); null: cp.async
  const uint8_t* wu_tm;
};

// Which (tile, column) the CTA with linear index L works on (of ncols columns); false past the
// tile list. With tile_first (the first tile of each group, [groups + 1]) the linear order runs
// group by group, and within a group column by column with the group's tiles adjacent: the
// CTAs reading one expert's slice of B run together (its tiles share it in L2: the weights
// leave DRAM about once, where the column-fastest order read them once per tile, 2.2x at
// 64-row tiles on ml4's 4096-token MoE, ncu), and a group's A tiles stay in L2 across its
// columns. Without: column = L % ncols, tile = L / ncols.
__device__ __forceinline__ bool work_at(const GemmArgs& p, int64_t L, int ncols, int* tile, int* col) {
  const int nt = __ldg(p.num_tiles);
  if (L >= static_cast<int64_t>(nt) * ncols) return false;
  if (p.tile_first == nullptr) {
    *tile = static_cast<int>(L / ncols);
    *col = static_cast<int>(L % ncols);
    return true;
  }
  // The group g with tile_first[g] * ncols <= L < tile_first[g + 1] * ncols (non-empty).
  int lo = 0, hi = p.groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(__ldg(p.tile_first + mid)) * ncols <= L) lo = mid;
    else hi = mid;
  }
  const int f = __ldg(p.tile_first + lo), n = __ldg(p.tile_first + lo + 1) - f;
  const int64_t local = L - static_cast<int64_t>(f) * ncols;
  *col = static_cast<int>(local / n);
  *tile = f + static_cast<int>(local % n);
  return true;
}
// The one-tile-a-CTA kernels: the grid is (columns, tile rows), x fastest (the order the
// hardware starts CTAs in).
__device__ __forceinline__ bool cta_work(const GemmArgs& p, int* tile, int* col) {
  const int64_t L = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  return work_at(p, L, static_cast<int>(gridDim.x), tile, col);
}

// What both kernels' CTAs start from: tile `tile` of the list, output columns from n0 =
// col * cols, the 1024-aligned shared base, thread ids, and the loader's coordinates: this
// thread moves 16-byte chunk c of rows lr + 32 i of each operand, all of them sharing row % 8,
// so one swizzle.
struct CtaTile {
  MoeTile t;
  int nrows, K, N, KB, n0, tid, wg, lane, wwarp, lr, c;
  uint32_t sbase, swz;
  __device__ CtaTile(const GemmArgs& p, int tile, int col, int cols, const uint8_t* smem)
      : t(p.tiles[tile]),
        nrows(t.row1 - t.row0),
        K(p.K),
        N(p.N),
        KB(p.K / 128),
        n0(col * cols),
        tid(threadIdx.x),
        wg(tid >> 7),
        lane(tid & 31),
        wwarp((tid >> 5) & 3),
        lr(tid >> 3),
        c(tid & 7),
        sbase((static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u),
        swz(static_cast<uint32_t>(((tid & 7) ^ ((tid >> 3) & 7)) << 4)) {}
  // The A row permuted row r of the tile reads.
  __device__ int a_source(const GemmArgs& p, int r) const { return p.a_rows ? __ldg(p.a_rows + t.row0 + r) : t.row0 + r; }
};

// Promotion of one m64n128 partial into acc[kOff ..]: acc += d * a_scale * w_scale (columns
// j < 8 are B sub-block 0's); sc: the block's scales {a lo, a hi, w sub-block 0, w sub-block 1}.
template <int kOff, int kAcc>
__device__ __forceinline__ void promote_into(float (&acc)[kAcc], const float (&d)[64], const float (&sc)[4]) {
  const float s00 = sc[0] * sc[2], s01 = sc[0] * sc[3], s10 = sc[1] * sc[2], s11 = sc[1] * sc[3];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float lo = j < 8 ? s00 : s01, hi = j < 8 ? s10 : s11;
    acc[kOff + 4 * j + 0] = fmaf(d[4 * j + 0], lo, acc[kOff + 4 * j + 0]);
    acc[kOff + 4 * j + 1] = fmaf(d[4 * j + 1], lo, acc[kOff + 4 * j + 1]);
    acc[kOff + 4 * j + 2] = fmaf(d[4 * j + 2], hi, acc[kOff + 4 * j + 2]);
    acc[kOff + 4 * j + 3] = fmaf(d[4 * j + 3], hi, acc[kOff + 4 * j + 3]);
  }
}

// cpu::silu_mul: v / (1 + exp(-v)) * u in f32 (one expression for every epilogue: the same bits).
__device__ __forceinline__ float silu_mul(float v, float u) { return v / (1.0f + expf(-v)) * u; }

// Stores one m64n128 accumulator block acc[kOff ..] (this thread's rows r_lo and r_lo + 8 of
// the tile) at output columns col0 ..: gate_up writes silu(gate) * up (gate in columns j < 8,
// up above: 64 output columns), else the 128 columns as they are.
// y: the tile's first output row; scalars rather than CtaTile, which would then live in memory.
template <bool kGateUp, int kOff, int kAcc>
__device__ __forceinline__ void store_block(float* y, int nrows, int N, const float (&acc)[kAcc], int r_lo, int col0) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    if (r >= nrows) continue;
    float* yrow = y + static_cast<int64_t>(r) * N;
    if (kGateUp) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = col0 + 8 * j + 2 * q;
        if (col >= N) continue;  // N is even, so col < N covers col + 1
        const float g0 = acc[kOff + 4 * j + 2 * h], g1 = acc[kOff + 4 * j + 2 * h + 1];
        const float u0 = acc[kOff + 4 * (j + 8) + 2 * h], u1 = acc[kOff + 4 * (j + 8) + 2 * h + 1];
        *reinterpret_cast<float2*>(yrow + col) = make_float2(silu_mul(g0, u0), silu_mul(g1, u1));
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = col0 + 8 * j + 2 * q;
        if (col >= N) continue;
        *reinterpret_cast<float2*>(yrow + col) = make_float2(acc[kOff + 4 * j + 2 * h], acc[kOff + 4 * j + 2 * h + 1]);
      }
    }
  }
}

// The hidden rows' FP8 quantization in the gate_up epilogue (MoeGroupedGemmParams::y_q):
// fp8_act_quant's arithmetic on the same f32 values, s = max(amax, 1e-4) / 448 per row and
// 128 columns, e4m3(v / s) saturated; the scales row-major [rows][N / 128].
__device__ __forceinline__ float fp8_group_scale(float amax) { return fmaxf(amax, 1e-4f) / 448.0f; }
// The max over a quad of lanes (the four threads holding one accumulator row's columns).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
// This thread's 16 values of one row, v[2 j + e] at column 8 j + 2 q + e of the 64 from `row`.
__device__ __forceinline__ void store_quant_row(uint8_t* row, const float (&v)[16], float amax) {
  const float s = fp8_group_scale(amax);
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint16_t lo = __nv_cvt_float_to_fp8(v[2 * j] / s, __NV_SATFINITE, __NV_E4M3);
    const uint16_t hi = __nv_cvt_float_to_fp8(v[2 * j + 1] / s, __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint16_t*>(row + 8 * j + 2 * q) = static_cast<uint16_t>(lo | (hi << 8));
  }
}
// The tall tile's gate_up epilogue: acc holds both halves of the 256-row B tile, output
// columns [col0, col0 + 128), one group, spread over a quad (16 columns each a half and row).
__device__ __forceinline__ void store_block_quant(uint8_t* yq, float* yq_scale, int nrows, int N,
                                                  const float (&acc)[128], int r_lo, int col0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;  // quad-uniform
    float v[2][16];  // half b: column col0 + 64 b + 8 j + 2 q + e at [b][2 j + e]
    float amax = 0.0f;
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          v[b][2 * j + e] = silu_mul(acc[64 * b + 4 * j + 2 * h + e], acc[64 * b + 4 * (j + 8) + 2 * h + e]);
          amax = fmaxf(amax, fabsf(v[b][2 * j + e]));
        }
    amax = quad_max(amax);
    if (r >= nrows) continue;
    uint8_t* const row = yq + static_cast<int64_t>(r) * N + col0;
    store_quant_row(row, v[0], amax);
    store_quant_row(row + 64, v[1], amax);
    if ((threadIdx.x & 3) == 0) yq_scale[static_cast<int64_t>(r) * (N / 128) + col0 / 128] = fp8_group_scale(amax);
  }
}

// One CTA: tile blockIdx.y of the list, output columns [n0, n0 + 128) (gate_up: 64 per
// warpgroup, gate and up of each) or [n0, n0 + 256) (128 per warpgroup).
//
// kOverlap (MoeGroupedGemmParams::overlap): blocks kb and kb + 1 issued into two partial
// accumulators before block kb's is promoted (wait<1>), so the tensor cores run block kb + 1
// while block kb's scales multiply in; the ring then prefetches kStages - 2 blocks ahead (the
// stage of block kb may still be read by its MMAs when block kb + 3's load is issued).
template <bool kGateUp, bool kOverlap>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm_kernel(const GemmArgs p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  int tile, col;
  if (!cta_work(p, &tile, &col)) return;
  extern __shared__ uint8_t smem_raw[];
  const CtaTile ct(p, tile, col, kGateUp ? 128 : 256, smem_raw);
  const MoeTile& t = ct.t;
  const int nrows = ct.nrows, K = ct.K, N = ct.N, KB = ct.KB, n0 = ct.n0, wg = ct.wg, lr = ct.lr, c = ct.c;
  const uint32_t sbase = ct.sbase, swz = ct.swz;
  auto a_source = [&](int r) { return ct.a_source(p, r); };

  // Loader: A rows lr and lr + 32, B rows lr + 32 j (j < 8; B sub-block j / 2).
  const uint8_t* a_src[2];
  bool a_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lr + 32 * i;
    a_ok[i] = r < nrows;
    a_src[i] = p.a + static_cast<int64_t>(a_ok[i] ? a_source(r) : 0) * K + c * 16;
  }
  // B sub-block s: 64 rows of one matrix from row base(s).
  auto b_base = [&](int s) { return kGateUp ? n0 + (s >> 1) * 64 : n0 + s * 64; };
  auto b_mat = [&](int s) {
    return static_cast<const uint8_t*>(kGateUp && (s & 1) ? p.wu[t.group] : p.w[t.group]);
  };
  const uint8_t* b_src[8];
  bool b_ok[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int row = b_base(j >> 1) + (j & 1) * 32 + lr;
    b_ok[j] = row < N;
    b_src[j] = b_mat(j >> 1) + static_cast<int64_t>(b_ok[j] ? row : 0) * K + c * 16;
  }
  auto load = [&](int stage, int kb) {
    const uint32_t st = sbase + stage * kStage;
    const int64_t koff = static_cast<int64_t>(kb) * 128;
#pragma unroll
    for (int i = 0; i < 2; ++i) cp_async16(st + (lr + 32 * i) * 128 + swz, a_src[i] + koff, a_ok[i]);
#pragma unroll
    for (int j = 0; j < 8; ++j) cp_async16(st + kAStage + (lr + 32 * j) * 128 + swz, b_src[j] + koff, b_ok[j]);
  };

  // Scales: this thread's accumulator rows (lo, lo + 8) and its warpgroup's two sub-blocks.
  const int r_lo = ct.wwarp * 16 + (ct.lane >> 2);
  const float* as_ptr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    as_ptr[h] = r < nrows ? p.a_scale + static_cast<int64_t>(a_source(r)) * KB : nullptr;
  }
  const float* bs_ptr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int s = 2 * wg + h, base = b_base(s);
    const float* table = kGateUp && (s & 1) ? p.wus[t.group] : p.ws[t.group];
    bs_ptr[h] = base < N ? table + static_cast<int64_t>(base / 128) * KB : nullptr;
  }

  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = part[i] = 0.0f;  // part: the first MMA of a block ignores it (scale-d 0)
  auto promote = [&](const float (&d)[64], const float (&sc)[4]) { promote_into<0>(acc, d, sc); };
  auto scales = [&](int kb, float (&sc)[4]) {
    sc[0] = as_ptr[0] ? __ldg(as_ptr[0] + kb) : 0.0f;
    sc[1] = as_ptr[1] ? __ldg(as_ptr[1] + kb) : 0.0f;
    sc[2] = bs_ptr[0] ? __ldg(bs_ptr[0] + kb) : 0.0f;
    sc[3] = bs_ptr[1] ? __ldg(bs_ptr[1] + kb) : 0.0f;
  };
  constexpr int kAhead = kOverlap ? kStages - 2 : kStages - 1;  // blocks in flight in the ring
  // Waits for block kb's stage, refills the ring, and issues block kb's MMAs into d.
  auto issue = [&](float (&d)[64], int kb) {
    cp_wait<kAhead - 1>();
    wgmma::fence_proxy_async();  // cp.async wrote through the generic proxy; the tensor cores read next
    __syncthreads();  // stage kb landed for every thread; the stage refilled below is no MMA's any more
    {
      const int j = kb + kAhead;
      if (j < KB) load(j % kStages, j);
      cp_commit();
    }
    const uint32_t a_st = sbase + (kb % kStages) * kStage, b_st = a_st + kAStage + wg * 128 * 128;
    const uint64_t da = wgmma::desc_k_major(a_st), db = wgmma::desc_k_major(b_st);
    wgmma::fence_operands(d);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::m64n128k32_e4m3(d, da + 2 * ks, db + 2 * ks, ks);  // + 32 bytes a k step
    wgmma::commit();
  };
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < KB) load(s, s);
    cp_commit();
  }
  if constexpr (kOverlap) {
    // Two blocks per iteration, both issued, then each promoted once its group is done: block
    // kb's promotion runs under block kb + 1's MMAs (every other promotion hidden). No group
    // may stay in flight across the loop's back edge: ptxas then serializes every wgmma
    // (warning C7514), which a one-block-ahead schedule (promote kb - 1 after issuing kb) hit.
    float part2[64], sa[4], sb[4];
    for (int kb = 0; kb < KB; kb += 2) {
      issue(part, kb);
      scales(kb, sa);
      if (kb + 1 < KB) {
        issue(part2, kb + 1);
        scales(kb + 1, sb);
        wgmma::wait<1>();
        wgmma::fence_operands(part);
        promote(part, sa);
        wgmma::wait<0>();
        wgmma::fence_operands(part2);
        promote(part2, sb);
      } else {
        wgmma::wait<0>();
        wgmma::fence_operands(part);
        promote(part, sa);
      }
    }
  } else {
    for (int kb = 0; kb < KB; ++kb) {
      issue(part, kb);
      float sc[4];  // the scales load while the tensor cores run
      scales(kb, sc);
      wgmma::wait<0>();
      wgmma::fence_operands(part);
      promote(part, sc);
    }
  }
  cp_wait<0>();
  if (kGateUp && p.yq != nullptr) {
    // The hidden rows quantized here (MoeGroupedGemmParams::y_q): the CTA's 128 output columns
    // are one group, 64 a warpgroup; each quad's amax of a row meets the other warpgroup's in
    // shared memory (past the ring).
    float* const red = reinterpret_cast<float*>(smem_raw + (sbase - smem_u32(smem_raw)) + kStages * kStage);
    float v[2][16], amax[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      amax[h] = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          v[h][2 * j + e] = silu_mul(acc[4 * j + 2 * h + e], acc[4 * (j + 8) + 2 * h + e]);
          amax[h] = fmaxf(amax[h], fabsf(v[h][2 * j + e]));
        }
      amax[h] = quad_max(amax[h]);
      if ((threadIdx.x & 3) == 0) red[wg * 64 + r_lo + 8 * h] = amax[h];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r_lo + 8 * h;
      if (r >= nrows) continue;
      store_quant_row(p.yq + static_cast<int64_t>(t.row0 + r) * N + n0 + 64 * wg, v[h], fmaxf(red[r], red[64 + r]));
      if (wg == 0 && (threadIdx.x & 3) == 0) p.yq_scale[static_cast<int64_t>(t.row0 + r) * (N / 128) + n0 / 128] =
          fp8_group_scale(fmaxf(red[r], red[64 + r]));
    }
    return;
  }
  store_block<kGateUp, 0>(p.y + static_cast<int64_t>(t.row0) * N, nrows, N, acc, r_lo, n0 + wg * (kGateUp ? 64 : 128));
}

// The tall variant (MoeGroupedGemmParams::tall): 128 A rows per CTA, warpgroup wg on rows
// [64 wg, 64 wg + 64) against the whole 256-row B tile, as two m64n128 halves one after the
// other (a half's partial sums promoted before the next half's MMAs: acc 128 + partial 64
// registers a thread). Per 128-wide K block the CTA moves 16 KB of A and 32 KB of B for twice
// the MMAs of the 64-row CTA (8 + 32 KB): half the L2 bytes per FLOP, for tiles that waste
// more rows on experts with few (a tile holds one group's rows).
constexpr int kTallRows = 128;
constexpr int kTallAStage = kTallRows * 128, kTallStage = kTallAStage + kBStage;  // 48 KB
constexpr int kTallStages = 4;
static_assert(kTallRows == kMoeGemmTallTileRows, "moe_gemm.h names the tall tile");
// Issues one half of a tall tile's K block: the 64 A rows of warpgroup wg against B half h (128
// rows) of the stage at a_st, four m64n128k32 MMAs into part (the first one ignores part's old
// values), committed as one group.
__device__ __forceinline__ void tall_half_mma(float (&part)[64], uint32_t a_st, int wg, int h) {
  const uint64_t da = wgmma::desc_k_major(a_st + wg * 64 * 128);
  const uint64_t db = wgmma::desc_k_major(a_st + kTallAStage + h * 128 * 128);
  wgmma::fence_operands(part);
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma::m64n128k32_e4m3(part, da + 2 * ks, db + 2 * ks, ks);
  wgmma::commit();
}
constexpr int kTallSmem = kTallStages * kTallStage + 1024;

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm_tall_kernel(const GemmArgs p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  int tile, col;
  if (!cta_work(p, &tile, &col)) return;
  extern __shared__ uint8_t smem_raw[];
  const CtaTile ct(p, tile, col, kGateUp ? 128 : 256, smem_raw);
  const MoeTile& t = ct.t;
  const int nrows = ct.nrows, K = ct.K, N = ct.N, KB = ct.KB, n0 = ct.n0, wg = ct.wg, lr = ct.lr, c = ct.c;
  const uint32_t sbase = ct.sbase, swz = ct.swz;
  auto a_source = [&](int r) { return ct.a_source(p, r); };

  // Loader: A rows lr + 32 i (i < 4), B rows lr + 32 j (j < 8): B sub-block j / 2 (64 rows:
  // gate_up, half (j / 4) of W1 (j / 2 even) or W3 (odd); else rows 32 j on).
  int a_row[4];  // source rows (ints: registers are short here)
  unsigned a_ok = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = lr + 32 * i;
    if (r < nrows) a_ok |= 1u << i;
    a_row[i] = r < nrows ? a_source(r) : 0;
  }
  // B row of load j: n0 + lr + 32 * b_step(j) (b_step a constant once unrolled).
  auto b_step = [](int j) { return kGateUp ? (j >> 2) * 2 + (j & 1) : j; };
  auto b_row = [&](int j) { return n0 + lr + 32 * b_step(j); };
  const uint8_t* const w0 = static_cast<const uint8_t*>(p.w[t.group]);
  const uint8_t* const w1 = kGateUp ? static_cast<const uint8_t*>(p.wu[t.group]) : w0;
  unsigned b_ok = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (b_row(j) < N) b_ok |= 1u << j;
#pragma unroll
  for (int h = 0; h < 2; ++h)  // bits 8, 9: half h's scale row exists (its first row < N)
    if ((kGateUp ? n0 + 64 * h : n0 + 128 * h) < N) b_ok |= 1u << (8 + h);
  const int64_t b_off = static_cast<int64_t>(n0 + lr) * K, k32 = static_cast<int64_t>(32) * K;
  // Shared rows lr + 32 i sit 4 KiB apart: one base register, the rest immediates.
  auto load = [&](int stage, int kb) {
    const uint32_t st = sbase + stage * kTallStage + lr * 128 + swz;
    const int64_t koff = static_cast<int64_t>(kb) * 128 + c * 16;
    auto a_load = [&](auto i) {
      cp_async16_at<i * 4096>(st, p.a + static_cast<int64_t>(a_row[i]) * K + koff, (a_ok >> i) & 1u);
    };
    auto b_load = [&](auto j) {
      const bool ok = (b_ok >> j) & 1u;
      const uint8_t* m = kGateUp && ((j >> 1) & 1) ? w1 : w0;
      cp_async16_at<kTallAStage + j * 4096>(st, m + (ok ? b_off + b_step(j) * k32 : 0) + koff, ok);
    };
    [&]<int... I>(std::integer_sequence<int, I...>) { (a_load(std::integral_constant<int, I>{}), ...); }(
        std::make_integer_sequence<int, 4>{});
    [&]<int... J>(std::integer_sequence<int, J...>) { (b_load(std::integral_constant<int, J>{}), ...); }(
        std::make_integer_sequence<int, 8>{});
  };

  // Scales: this thread's accumulator rows (64 wg + lo, + 8) and, per half h, the two B
  // sub-blocks' scale rows (gate_up: W1 and W3 at columns n0 + 64 h; else both 128-row
  // blocks' one row, n0 + 128 h).
  const int r_lo = wg * 64 + ct.wwarp * 16 + (ct.lane >> 2);
  int as_row[2];  // the A scale rows (-1: past the tile), as ints: registers are short here
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    as_row[h] = r < nrows ? a_source(r) : -1;
  }
  const float* const ws0 = p.ws[t.group];
  const float* const ws1 = kGateUp ? p.wus[t.group] : ws0;
  auto scales = [&](int kb, int h, float (&sc)[4]) {
    const int base = kGateUp ? n0 + 64 * h : n0 + 128 * h;
    sc[0] = as_row[0] >= 0 ? __ldg(p.a_scale + static_cast<int64_t>(as_row[0]) * KB + kb) : 0.0f;
    sc[1] = as_row[1] >= 0 ? __ldg(p.a_scale + static_cast<int64_t>(as_row[1]) * KB + kb) : 0.0f;
    const bool ok = (b_ok >> (8 + h)) & 1u;
    sc[2] = ok ? __ldg(ws0 + static_cast<int64_t>(base / 128) * KB + kb) : 0.0f;
    if (kGateUp)
      sc[3] = ok ? __ldg(ws1 + static_cast<int64_t>(base / 128) * KB + kb) : 0.0f;
    else
      sc[3] = sc[2];  // both 64-row sub-blocks of a half in one 128-row scale block
  };

  float acc[128], part[64];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) part[i] = 0.0f;
  constexpr int kAhead = kTallStages - 1;
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < KB) load(s, s);
    cp_commit();
  }
  for (int kb = 0; kb < KB; ++kb) {
    cp_wait<kAhead - 1>();
    wgmma::fence_proxy_async();  // cp.async wrote through the generic proxy; the tensor cores read next
    __syncthreads();  // stage kb landed for every thread; the stage refilled below is no MMA's any more
    {
      const int j = kb + kAhead;
      if (j < KB) load(j % kTallStages, j);
      cp_commit();
    }
    const uint32_t a_st = sbase + (kb % kTallStages) * kTallStage;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tall_half_mma(part, a_st, wg, h);
      float sc[4];  // the scales load while the tensor cores run
      scales(kb, h, sc);
      wgmma::wait<0>();
      wgmma::fence_operands(part);
      if (h == 0)  // acc half h (sub-block 2h in columns j < 8, 2h + 1 above)
        promote_into<0>(acc, part, sc);
      else
        promote_into<64>(acc, part, sc);
    }
  }
  cp_wait<0>();
  float* const y = p.y + static_cast<int64_t>(t.row0) * N;
  store_block<kGateUp, 0>(y, nrows, N, acc, r_lo, n0);
  store_block<kGateUp, 64>(y, nrows, N, acc, r_lo, n0 + (kGateUp ? 64 : 128));
}

// The warp-specialized persistent variant (MoeGroupedGemmParams::specialized): the tall
// kernel's tile (128 A rows x 256 B rows a 128-wide K block, 48 KB a stage) and its sums in its
// order (so its bits), with the loads taken off the MMA warps:
//   warpgroup 2 (the producer) moves every stage with cp.async (and B by TMA) and posts it on
//     the stage's `full` mbarrier (cp.async.mbarrier.arrive.noinc and the TMA's transaction
//     bytes: the barrier completes when the copies have landed), after the stage's `empty`
//     barrier says all 8 consumer warps are done with its previous contents;
//   warpgroups 0 and 1 (the consumers) each take 64 of the rows against both B halves: MMAs of
//     half 0 into the partial accumulator, wait, promote, then half 1. No block-wide barrier
//     between them, so one warpgroup's promotion (the CUDA cores) runs while the other's MMAs
//     hold the tensor cores, where the tall kernel's two warpgroups promoted at the same time
//     with the tensor cores idle. A tile of at most 64 rows leaves warpgroup 1 without MMAs
//     (it still releases the stages).
// Registers: a consumer thread holds 128 accumulators and a 64-register partial; ptxas gives
// a 384-thread block's code 168 a thread, and compiles the code after setmaxnreg within the
// new bound, so the producer gives registers up (setmaxnreg.dec) for the consumers' raise.
// Persistent: the grid is one CTA a multiprocessor; each CTA takes its first work item (a
// linear index of work_at's order) from blockIdx.x and every later one from a global counter
// (work_counter, zeroed before the launch), so the items start in their order across the
// grid as CTAs free up -- the order the hardware gives a one-item-a-CTA grid. (A static stride
// over the items let the CTAs drift apart: an expert's two tiles of one weight slice then ran
// at different times and the slice came from DRAM twice, 1.6x the weight bytes, ncu.) The
// producer takes the items (fetching the next one's index under the current one's loads) and
// posts each one's rows and columns with the stage of its first K block, and every block's
// scales with its stage (so the consumers read nothing from global memory but through the
// tensor cores' operands); it runs ahead into the next item while the consumers store, so the
// ring never drains. B moves by TMA where the tables hold tensor maps (w_tm), one thread
// issuing four boxes a stage.
constexpr int kWsThreads = 384, kWsConsumers = 256;
constexpr int kWsStages = 4;
constexpr int kWsBarOff = kWsStages * kTallStage;        // full[kWsStages], empty[kWsStages]
constexpr int kWsInfoOff = kWsBarOff + 16 * kWsStages;   // int32 [kWsStages][4]: the item a stage starts
constexpr int kWsNextOff = kWsInfoOff + 16 * kWsStages;  // int32 next[2]: the producer's item broadcast
constexpr int kWsScaleOff = kWsNextOff + 16;             // f32 [kWsStages][128 + 4]: a stage's scales
constexpr int kWsScaleFloats = 128 + 4;                  // the A rows', then B's {half 0: 2, half 1: 2}
constexpr int kWsSmem = kWsScaleOff + kWsStages * kWsScaleFloats * 4 + 1024;
constexpr int kWsProducerRegs = 72, kWsConsumerRegs = 216;  // 128 x 72 + 256 x 216 = 384 x 168
static_assert(128 * kWsProducerRegs + 256 * kWsConsumerRegs <= 384 * 168, "the block's registers");
static_assert(kWsSmem <= 232448, "fits the 227 KB opt-in shared memory of sm_90");

// The persistent kernels' producer warpgroup, at the start of its work item `item`: the item's
// tile and column (its index published in next[item & 1] before the barrier; the one after
// fetched from work_counter here, under this item's loads -- every thread has read the slot it
// overwrites before the barrier). False past the list, after posting the end mark (rows -1) in
// the stage the next item would have started in, once the consumers are done with it.
template <int kRing>
__device__ __forceinline__ bool producer_item(const GemmArgs& p, int item, int ncols, int pt, volatile int32_t* next,
                                              volatile int32_t* info, int32_t* work_counter, uint32_t full0,
                                              uint32_t empty0, uint32_t it, int* tile, int* col) {
  asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the producer warpgroup: next[item & 1] written
  const int L = next[item & 1];
  if (pt == 0) next[(item + 1) & 1] = static_cast<int32_t>(gridDim.x) + atomicAdd(work_counter, 1);
  if (work_at(p, L, ncols, tile, col)) return true;
  const int st = static_cast<int>(it % kRing);
  if (it >= kRing) mbar_wait(empty0 + 8 * st, ((it / kRing) - 1) & 1);
  if (pt == 0) {
    info[4 * st + 1] = -1;
    mbar_arrive(full0 + 8 * st);
  }
  mbar_arrive(full0 + 8 * st);
  return false;
}

template <bool kGateUp>
__global__ void __launch_bounds__(kWsThreads, 1) grouped_gemm_ws_kernel(const GemmArgs p, const int ncols,
                                                                        int32_t* __restrict__ work_counter) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
  uint8_t* const sgen = smem_raw + (sbase - smem_u32(smem_raw));  // generic pointer of sbase
  // info[4 st ..]: {first row, rows (-1: no more items), first output column} of the item whose
  // first K block stage st holds, written by the producer with that stage.
  volatile int32_t* const info = reinterpret_cast<int32_t*>(sgen + kWsInfoOff);
  volatile int32_t* const next = reinterpret_cast<int32_t*>(sgen + kWsNextOff);
  const float* const sscale = reinterpret_cast<const float*>(sgen + kWsScaleOff);
  const uint32_t full0 = sbase + kWsBarOff, empty0 = full0 + 8 * kWsStages;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kWsStages; ++s) {
      mbar_init(full0 + 8 * s, 129);                 // a cp.async arrival per producer thread + thread 0's
                                                     // (with TMA: the expect_tx one)
      mbar_init(empty0 + 8 * s, kWsConsumers / 32);  // one per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int K = p.K, N = p.N, KB = K / 128, cols = kGateUp ? 128 : 256;

  if (tid >= kWsConsumers) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProducerRegs));
    // Thread (lr, c) moves 16-byte chunk c of A rows lr + 16 i (i < 8) and, by cp.async, B rows
    // lr + 16 j (j < 16); all of them share row % 8, so one swizzle. B row 16 j + lr of the stage
    // is row lr + 16 (j % 4) of 64-row sub-block j / 4 (the tall kernel's layout: gate_up
    // sub-blocks W1, W3, W1, W3 at columns n0, n0, n0 + 64, n0 + 64; else rows n0 + 16 j + lr).
    // Thread pt also moves A row pt's scale of the block, threads 64-67 B's four.
    const int pt = tid - kWsConsumers, lr = pt >> 3, c = pt & 7;
    const bool tma = p.w_tm != nullptr;
    const uint32_t swz = static_cast<uint32_t>((c ^ (lr & 7)) << 4);
    auto b_row = [](int j) { return kGateUp ? (j >> 3) * 64 + 16 * (j & 3) : 16 * j; };  // from n0 + lr
    if (pt == 0) next[0] = static_cast<int32_t>(blockIdx.x);
    uint32_t it = 0;  // K blocks issued so far, over all work items: stage it % kWsStages
    for (int item = 0;; ++item) {
      int tile = 0, col = 0;
      if (!producer_item<kWsStages>(p, item, ncols, pt, next, info, work_counter, full0, empty0, it, &tile, &col))
        break;
      const MoeTile t = p.tiles[tile];
      const int nrows = t.row1 - t.row0, n0 = col * cols;
      int a_row[8];  // source rows, -1 past the tile
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = lr + 16 * i;
        a_row[i] = r < nrows ? (p.a_rows ? __ldg(p.a_rows + t.row0 + r) : t.row0 + r) : -1;
      }
      const float* const as_src =
          p.a_scale +
          (pt < nrows ? static_cast<int64_t>(p.a_rows ? __ldg(p.a_rows + t.row0 + pt) : t.row0 + pt) * KB : 0);
      // B's scale q = 2 h + e (pt = 64 + q): half h's sub-block e (gate_up: W1 / W3 of the
      // 128-row block at n0 + 64 h; else the block at n0 + 128 h, twice), 0 past N.
      const int q = pt - 64, bbase = kGateUp ? n0 + 64 * (q >> 1) : n0 + 128 * (q >> 1);
      const float* const bs_src = (q >= 0 && q < 4 && bbase < N)
                                      ? (kGateUp && (q & 1) ? p.wus[t.group] : p.ws[t.group]) +
                                            static_cast<int64_t>(bbase / 128) * KB
                                      : nullptr;
      const int64_t b_off = static_cast<int64_t>(n0 + lr) * K + c * 16;
      const uint8_t* const w0 = static_cast<const uint8_t*>(p.w[t.group]) + b_off;
      const uint8_t* const w1 = kGateUp ? static_cast<const uint8_t*>(p.wu[t.group]) + b_off : w0;
      const int brows = N - n0 - lr;  // B row b_row(j) exists while below this
      for (int kb = 0; kb < KB; ++kb, ++it) {
        const int st = static_cast<int>(it % kWsStages);
        if (it >= kWsStages) mbar_wait(empty0 + 8 * st, ((it / kWsStages) - 1) & 1);
        const uint32_t dst = sbase + st * kTallStage + lr * 128 + swz;
        const int koff = kb * 128 + c * 16;
        if (tma) {
          // B as four 64-row boxes, sub-block q at 8 KB q of the B stage: gate_up W1, W3, W1, W3
          // at rows n0, n0, n0 + 64, n0 + 64 (b_row's layout); else rows n0 + 64 q. The
          // arrival that expects their bytes comes first, so the phase cannot end before them.
          if (pt == 0) {
            if (kb == 0) {
              info[4 * st] = t.row0;
              info[4 * st + 1] = nrows;
              info[4 * st + 2] = n0;
            }
            const uint32_t bar = full0 + 8 * st, bdst = sbase + st * kTallStage + kTallAStage;
            mbar_arrive_expect_tx(bar, kBStage);  // also releases info to the consumers' wait
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              const uint8_t* tm = (kGateUp && (b & 1) ? p.wu_tm : p.w_tm) + t.group * kMoeTensorMapBytes;
              tma_load_2d(bdst + b * 8192, tm, kb * 128, kGateUp ? n0 + 64 * (b >> 1) : n0 + 64 * b, bar);
            }
          }
        } else {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const bool ok = b_row(j) < brows;
            const uint8_t* m = kGateUp && ((j >> 2) & 1) ? w1 : w0;
            cp_async16(dst + kTallAStage + j * 2048, m + (ok ? static_cast<int64_t>(b_row(j)) * K + kb * 128 : 0), ok);
          }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
          cp_async16(dst + i * 2048, p.a + (a_row[i] >= 0 ? static_cast<int64_t>(a_row[i]) * K + koff : 0),
                     a_row[i] >= 0);
        const uint32_t sc_dst = sbase + kWsScaleOff + st * (kWsScaleFloats * 4);
        cp_async4(sc_dst + 4 * pt, as_src + kb, pt < nrows);
        if (q >= 0 && q < 4) cp_async4(sc_dst + 4 * (128 + q), bs_src ? bs_src + kb : p.a_scale, bs_src != nullptr);
        mbar_arrive_cp_async(full0 + 8 * st);
        if (pt == 0 && !tma) {
          if (kb == 0) {
            info[4 * st] = t.row0;
            info[4 * st + 1] = nrows;
            info[4 * st + 2] = n0;
          }
          mbar_arrive(full0 + 8 * st);  // releases info to the consumers' wait (acquire)
        }
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWsConsumerRegs));

  const int wg = tid >> 7, wwarp = (tid >> 5) & 3, lane = tid & 31;
  const int r_lo = wg * 64 + wwarp * 16 + (lane >> 2);  // this thread's accumulator rows r_lo, r_lo + 8
  float acc[128], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) part[i] = 0.0f;  // the first MMA of a block ignores it (scale-d 0)
  wgmma::fence_operands(part);
  // One arrival of this warp on the stage's `empty` barrier. An idle warpgroup arrives only
  // after the stage's full phase: each warp then arrives once per phase of `empty`, never early
  // into the next one.
  auto release = [&](int st) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * st);
  };
  uint32_t it = 0;
  for (;;) {
    const int st0 = static_cast<int>(it % kWsStages);
    mbar_wait(full0 + 8 * st0, (it / kWsStages) & 1);
    const int row0 = info[4 * st0], nrows = info[4 * st0 + 1], n0 = info[4 * st0 + 2];
    if (nrows < 0) break;
    const bool active = wg * 64 < nrows;  // warpgroup-uniform
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < KB; ++kb, ++it) {
      const int st = static_cast<int>(it % kWsStages);
      if (kb > 0) mbar_wait(full0 + 8 * st, (it / kWsStages) & 1);  // also when idle: see release
      if (active) {
        // The block's scales, staged with it (the tall kernel's values: rows past the tile
        // and B blocks past N read 0): {a lo, a hi, half h's two B sub-blocks}.
        const float* const sc = sscale + st * kWsScaleFloats;
        const float a_lo = sc[r_lo], a_hi = sc[r_lo + 8];
        const float sc0[4] = {a_lo, a_hi, sc[128], sc[129]};
        const float sc1[4] = {a_lo, a_hi, sc[130], sc[131]};
        wgmma::fence_proxy_async();  // cp.async wrote A through the generic proxy; the tensor cores read next
        const uint32_t a_st = sbase + st * kTallStage;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          tall_half_mma(part, a_st, wg, h);
          wgmma::wait<0>();
          wgmma::fence_operands(part);
          if (h == 0) {
            promote_into<0>(acc, part, sc0);
          } else {
            release(st);  // the stage's last MMA of this warp is done: the producer may refill it
            promote_into<64>(acc, part, sc1);
          }
        }
      } else {
        release(st);
      }
    }
    if (kGateUp && p.yq != nullptr) {
      // The whole quad holds a row's group, and both of its rows are in or out together
      // (warpgroup-uniform active): the shuffles see every lane.
      if (active)
        store_block_quant(p.yq + static_cast<int64_t>(row0) * N, p.yq_scale + static_cast<int64_t>(row0) * (N / 128),
                          nrows, N, acc, r_lo, n0);
    } else if (active) {
      float* const y = p.y + static_cast<int64_t>(row0) * N;
      store_block<kGateUp, 0>(y, nrows, N, acc, r_lo, n0);
      store_block<kGateUp, 64>(y, nrows, N, acc, r_lo, n0 + (kGateUp ? 64 : 128));
    }
  }
}

// The swapped variant (MoeGroupedGemmParams::swap): tokens as the MMA's N. The other kernels
// put a tile's rows in wgmma's M, which comes in 64s: an expert of 130 rows runs 192 rows of
// MMAs (at ml4's 4096-token prefill the routed experts average 128 rows, and about a fifth of
// the MMA rows computed zeros). Here the weights are M (each warpgroup 64 weight rows) and the
// tile's tokens N, in steps of 16 up to kSwapRows, so an expert's rows take one tile and MMAs
// for at most 15 rows more. Both warpgroups always have work (they split the weights, not the
// rows), and share the token tile.
//   Tile: 128 weight rows x up to 160 tokens, K in 128-byte blocks. gate_up: the weight rows
//   interleave W1 and W3 by 8 (16-row slab s = rows n0 + 8 s .. of W1, then of W3), so a
//   thread's accumulator rows r and r + 8 are gate and up of one output column: 64 output
//   columns a tile. Down: W rows n0 .. n0 + 127 (128 output columns).
//   Stages: the weights by TMA (gate_up: 16 boxes of 8 rows, MoeExpertTables::t1s / t3s; down:
//   2 of 64), the tokens by cp.async (gathered through a_rows), the scales beside them; a
//   producer warpgroup as in the specialized kernel, persistent, items from work_counter.
//   Promotion: acc += partial * (a_scale[token] * w_scale), the other kernels' product and
//   order; the hidden rows leave as f32 (no quantizing epilogue: a 128-column group spans two
//   tiles).
constexpr int kSwapRows = kMoeGemmSwapTileRows;
constexpr int kSwapWStage = 128 * 128;                     // 128 weight rows x 128 bytes of K
constexpr int kSwapStage = kSwapWStage + kSwapRows * 128;  // + the tokens: 36 KB
constexpr int kSwapStages = 5;
constexpr int kSwapBarOff = kSwapStages * kSwapStage;          // full[kSwapStages], empty[kSwapStages]
constexpr int kSwapInfoOff = kSwapBarOff + 16 * kSwapStages;   // int32 [kSwapStages][4]: as the specialized kernel's
constexpr int kSwapNextOff = kSwapInfoOff + 16 * kSwapStages;  // int32 next[2]
constexpr int kSwapScaleOff = kSwapNextOff + 16;               // f32 [kSwapStages][kSwapScaleFloats]
constexpr int kSwapScaleFloats = kSwapRows + 4;                // the tokens', then the weights' {W1 or W, W3}
constexpr int kSwapSmem = kSwapScaleOff + kSwapStages * kSwapScaleFloats * 4 + 1024;
static_assert(kSwapStage % 1024 == 0 && kSwapRows % 16 == 0 && kSwapRows <= 160, "the swapped tile");
static_assert(kSwapSmem <= 232448, "fits the 227 KB opt-in shared memory of sm_90");

// One item's K loop, promotion and stores on a tile of N / 16 x 16 token rows (nrows of them
// real): this warpgroup's 64 weight rows of each stage against the stage's first N tokens.
template <bool kGateUp, int N>
__device__ __forceinline__ void swap_item(const GemmArgs& p, uint32_t sbase, const float* sscale, uint32_t full0,
                                          uint32_t empty0, uint32_t& it, int row0, int nrows, int n0) {
  constexpr int J = N / 8;  // accumulator column groups: d[4 j + e] at token 8 j + 2 q + (e & 1)
  const int KB = p.K / 128, wg = threadIdx.x >> 7, wwarp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int q = lane & 3;
  // Each token count its own arrays (one set of 80 + 80 shared by every case made ptxas
  // serialize the MMAs, C7511, for some sets of cases).
  float acc[N / 2], part[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = part[i] = 0.0f;  // the first MMA of a block ignores part (scale-d 0)
  for (int kb = 0; kb < KB; ++kb, ++it) {
    const int st = static_cast<int>(it % kSwapStages);
    if (kb > 0) mbar_wait(full0 + 8 * st, (it / kSwapStages) & 1);
    const float* const sc = sscale + st * kSwapScaleFloats;
    const uint32_t w_st = sbase + st * kSwapStage;
    wgmma::fence_proxy_async();  // cp.async wrote the tokens through the generic proxy
    const uint64_t da = wgmma::desc_k_major(w_st + wg * 64 * 128), db = wgmma::desc_k_major(w_st + kSwapWStage);
    wgmma::fence_operands(part);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::m64nk32_e4m3<N>(part, da + 2 * ks, db + 2 * ks, ks);
    wgmma::commit();
    const float sw_lo = sc[kSwapRows], sw_hi = kGateUp ? sc[kSwapRows + 1] : sw_lo;  // rows r (gate) and r + 8 (up)
    wgmma::wait<0>();
    wgmma::fence_operands(part);
    // The tokens' scales of this thread's columns, from the stage: released after them.
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const float2 sa = *reinterpret_cast<const float2*>(sc + 8 * j + 2 * q);
      acc[4 * j + 0] = fmaf(part[4 * j + 0], sa.x * sw_lo, acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(part[4 * j + 1], sa.y * sw_lo, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(part[4 * j + 2], sa.x * sw_hi, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(part[4 * j + 3], sa.y * sw_hi, acc[4 * j + 3]);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * st);  // this warp's MMAs and reads of the stage are done
  }
  const int N_out = p.N;
  if (kGateUp) {
    const int col = n0 + 8 * (4 * wg + wwarp) + (lane >> 2);
    if (col >= N_out) return;
    float* const y = p.y + static_cast<int64_t>(row0) * N_out + col;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 8 * j + 2 * q + e;
        if (t < nrows) y[static_cast<int64_t>(t) * N_out] = silu_mul(acc[4 * j + e], acc[4 * j + 2 + e]);
      }
  } else {
    const int col = n0 + 64 * wg + 16 * wwarp + (lane >> 2);
    float* const y = p.y + static_cast<int64_t>(row0) * N_out + col;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 8 * j + 2 * q + (e & 1);
        if (t < nrows && col + 8 * (e >> 1) < N_out) y[static_cast<int64_t>(t) * N_out + 8 * (e >> 1)] = acc[4 * j + e];
      }
  }
}

template <bool kGateUp>
__global__ void __launch_bounds__(kWsThreads, 1) grouped_gemm_swap_kernel(const GemmArgs p, const int ncols,
                                                                          int32_t* __restrict__ work_counter) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
  uint8_t* const sgen = smem_raw + (sbase - smem_u32(smem_raw));
  volatile int32_t* const info = reinterpret_cast<int32_t*>(sgen + kSwapInfoOff);
  volatile int32_t* const next = reinterpret_cast<int32_t*>(sgen + kSwapNextOff);
  const float* const sscale = reinterpret_cast<const float*>(sgen + kSwapScaleOff);
  const uint32_t full0 = sbase + kSwapBarOff, empty0 = full0 + 8 * kSwapStages;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kSwapStages; ++s) {
      mbar_init(full0 + 8 * s, 129);                 // a cp.async arrival per producer thread + thread 0's expect_tx
      mbar_init(empty0 + 8 * s, kWsConsumers / 32);  // one per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int K = p.K, KB = K / 128, cols = kGateUp ? 64 : 128;

  if (tid >= kWsConsumers) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProducerRegs));
    // Thread (lr, c) moves 16-byte chunk c of token rows lr + 16 i (i < kSwapRows / 16), all
    // sharing row % 8, so one swizzle; the scales of token rows pt and pt + 128; threads 64 and
    // 65 the weights' (gate_up: W1's and W3's block of rows n0; else W's).
    const int pt = tid - kWsConsumers, lr = pt >> 3, c = pt & 7;
    const uint32_t swz = static_cast<uint32_t>((c ^ (lr & 7)) << 4);
    if (pt == 0) next[0] = static_cast<int32_t>(blockIdx.x);
    uint32_t it = 0;
    for (int item = 0;; ++item) {
      int tile = 0, col = 0;
      if (!producer_item<kSwapStages>(p, item, ncols, pt, next, info, work_counter, full0, empty0, it, &tile, &col))
        break;
      const MoeTile t = p.tiles[tile];
      const int nrows = t.row1 - t.row0, n0 = col * cols;
      constexpr int kRowsPer = kSwapRows / 16;
      int a_row[kRowsPer];  // source rows, -1 past the tile
#pragma unroll
      for (int i = 0; i < kRowsPer; ++i) {
        const int r = lr + 16 * i;
        a_row[i] = r < nrows ? (p.a_rows ? __ldg(p.a_rows + t.row0 + r) : t.row0 + r) : -1;
      }
      auto src_row = [&](int r) { return p.a_rows ? __ldg(p.a_rows + t.row0 + r) : t.row0 + r; };
      const float* const as0 = p.a_scale + (pt < nrows ? static_cast<int64_t>(src_row(pt)) * KB : 0);
      const int r1 = pt + 128;
      const float* const as1 = p.a_scale + (r1 < nrows && r1 < kSwapRows ? static_cast<int64_t>(src_row(r1)) * KB : 0);
      const float* const ws_src = (pt == 64 || (kGateUp && pt == 65))
                                      ? (pt == 65 ? p.wus[t.group] : p.ws[t.group]) +
                                            static_cast<int64_t>(n0 / 128) * KB
                                      : nullptr;
      for (int kb = 0; kb < KB; ++kb, ++it) {
        const int st = static_cast<int>(it % kSwapStages);
        if (it >= kSwapStages) mbar_wait(empty0 + 8 * st, ((it / kSwapStages) - 1) & 1);
        const uint32_t st_base = sbase + st * kSwapStage, bar = full0 + 8 * st;
        if (pt == 0) {
          if (kb == 0) {
            info[4 * st] = t.row0;
            info[4 * st + 1] = nrows;
            info[4 * st + 2] = n0;
          }
          mbar_arrive_expect_tx(bar, kSwapWStage);  // also releases info to the consumers' wait
          if (kGateUp) {
#pragma unroll
            for (int b = 0; b < 16; ++b)  // slab b / 2: W1 (b even) or W3 rows n0 + 8 (b / 2), 1 KB each
              tma_load_2d(st_base + b * 1024, (b & 1 ? p.wu_tm : p.w_tm) + t.group * kMoeTensorMapBytes, kb * 128,
                          n0 + 8 * (b >> 1), bar);
          } else {
#pragma unroll
            for (int b = 0; b < 2; ++b)
              tma_load_2d(st_base + b * 8192, p.w_tm + t.group * kMoeTensorMapBytes, kb * 128, n0 + 64 * b, bar);
          }
        }
        const uint32_t dst = st_base + kSwapWStage + lr * 128 + swz;
        const int koff = kb * 128 + c * 16;
#pragma unroll
        for (int i = 0; i < kRowsPer; ++i)
          cp_async16(dst + i * 2048, p.a + (a_row[i] >= 0 ? static_cast<int64_t>(a_row[i]) * K + koff : 0),
                     a_row[i] >= 0);
        const uint32_t sc_dst = sbase + kSwapScaleOff + st * (kSwapScaleFloats * 4);
        cp_async4(sc_dst + 4 * pt, as0 + kb, pt < nrows);
        if (r1 < kSwapRows) cp_async4(sc_dst + 4 * r1, as1 + kb, r1 < nrows);
        if (ws_src != nullptr) cp_async4(sc_dst + 4 * (kSwapRows + pt - 64), ws_src + kb, true);
        mbar_arrive_cp_async(bar);  // with thread 0's expect_tx arrival, the 129
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWsConsumerRegs));
  uint32_t it = 0;
  for (;;) {
    const int st0 = static_cast<int>(it % kSwapStages);
    mbar_wait(full0 + 8 * st0, (it / kSwapStages) & 1);
    const int row0 = info[4 * st0], nrows = info[4 * st0 + 1], n0 = info[4 * st0 + 2];
    if (nrows < 0) break;
    switch ((nrows + 15) >> 4) {
      case 1: swap_item<kGateUp, 16>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      case 2: swap_item<kGateUp, 32>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      case 3: swap_item<kGateUp, 48>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      case 4: swap_item<kGateUp, 64>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      case 5: swap_item<kGateUp, 80>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      case 6: swap_item<kGateUp, 96>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      case 7: swap_item<kGateUp, 112>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      case 8: swap_item<kGateUp, 128>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      case 9: swap_item<kGateUp, 144>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
      default: swap_item<kGateUp, 160>(p, sbase, sscale, full0, empty0, it, row0, nrows, n0); break;
    }
  }
}

// Per-group row counts (cursor zeroed before): a block's ids counted in shared memory first.
__global__ void count_kernel(const int32_t* __restrict__ ids, int64_t n, int E, int32_t* __restrict__ cursor) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int e = ids[i];
    if (static_cast<unsigned>(e) < static_cast<unsigned>(E)) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (hist[e]) atomicAdd(&cursor[e], hist[e]);
}

// One block: offsets from the counts (the shared group last, T rows), cursors reset to the
// offsets, and the tile list.
// One tile list over the groups' rows (offsets, [G + 1]): tiles of tile_rows rows, each group's
// first tile in first_tile ([G + 1], shared memory) and, when given, tile_first.
__device__ void plan_tiles(const int32_t* offsets, int G, MoeTile* __restrict__ tiles, int32_t* __restrict__ num_tiles,
                           int64_t max_tiles, int tile_rows, int32_t* __restrict__ tile_first, int32_t* first_tile) {
  if (threadIdx.x == 0) {
    int32_t nt = 0;
    for (int g = 0; g < G; ++g) {
      first_tile[g] = nt;
      nt += (offsets[g + 1] - offsets[g] + tile_rows - 1) / tile_rows;
    }
    first_tile[G] = nt;
    *num_tiles = static_cast<int32_t>(nt < max_tiles ? nt : max_tiles);  // the bound holds; min guards the grid
  }
  __syncthreads();
  if (tile_first != nullptr)
    for (int g = threadIdx.x; g <= G; g += blockDim.x) tile_first[g] = first_tile[g];
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    const int32_t r0 = offsets[g], r1 = offsets[g + 1];
    for (int32_t i = first_tile[g]; i < first_tile[g + 1] && i < max_tiles; ++i) {
      const int32_t a = r0 + (i - first_tile[g]) * tile_rows;
      tiles[i] = MoeTile{g, a, min(a + tile_rows, r1), 0};
    }
  }
  __syncthreads();  // first_tile is reused by the next list
}

__global__ void plan_kernel(int32_t* __restrict__ cursor, int E, int G, int64_t T, int32_t* __restrict__ offsets,
                            MoeTile* __restrict__ tiles, int32_t* __restrict__ num_tiles, int64_t max_tiles,
                            int tile_rows, int32_t* __restrict__ tile_first, MoeTile* __restrict__ tiles2,
                            int32_t* __restrict__ num_tiles2, int64_t max_tiles2, int tile_rows2,
                            int32_t* __restrict__ tile_first2) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ int32_t first_tile[];  // [G + 1]
  if (threadIdx.x == 0) {
    int32_t off = 0;
    for (int g = 0; g < G; ++g) {
      offsets[g] = off;
      off += g < E ? cursor[g] : static_cast<int32_t>(T);
    }
    offsets[G] = off;
  }
  __syncthreads();
  plan_tiles(offsets, G, tiles, num_tiles, max_tiles, tile_rows, tile_first, first_tile);
  if (tiles2 != nullptr) plan_tiles(offsets, G, tiles2, num_tiles2, max_tiles2, tile_rows2, tile_first2, first_tile);
  for (int g = threadIdx.x; g < E; g += blockDim.x) cursor[g] = offsets[g];
}

__global__ void scatter_kernel(const int32_t* __restrict__ ids, int64_t n, int K, int E, int64_t T, bool shared_slot,
                               int32_t* __restrict__ cursor, int32_t* __restrict__ perm_token,
                               int32_t* __restrict__ inv) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int e = ids[i];
    if (static_cast<unsigned>(e) >= static_cast<unsigned>(E)) continue;
    const int32_t pos = atomicAdd(&cursor[e], 1);
    perm_token[pos] = static_cast<int32_t>(i / K);
    inv[i] = pos;
  }
  if (shared_slot)
    for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < T; t += int64_t{gridDim.x} * blockDim.x)
      perm_token[n + t] = static_cast<int32_t>(t);
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::clamp<int64_t>((n + 255) / 256, 1, 1024)); }

}  // namespace

Status moe_permute_gemm(const MoePermuteGemmParams& p) {
  if (p.T < 0 || p.K <= 0 || p.E <= 0 || p.E > 8192) return invalid_argument("moe_permute_gemm: bad shape");
  if (!p.ids || !p.cursor || !p.offsets || !p.perm_token || !p.inv || !p.tiles || !p.num_tiles)
    return invalid_argument("moe_permute_gemm: null pointer");
  const int64_t n = p.T * p.K;
  const int G = p.E + (p.shared_slot ? 1 : 0);
  if (p.tile_rows != kMoeGemmTileRows && p.tile_rows != kMoeGemmTallTileRows && p.tile_rows != kMoeGemmSwapTileRows)
    return invalid_argument("moe_permute_gemm: tiles of {} rows ({}, {} or {})", p.tile_rows, kMoeGemmTileRows,
                            kMoeGemmTallTileRows, kMoeGemmSwapTileRows);
  if (p.max_tiles < moe_gemm_max_tiles(n + (p.shared_slot ? p.T : 0), G, p.tile_rows))
    return invalid_argument("moe_permute_gemm: {} tiles of room, {} needed at most", p.max_tiles,
                            moe_gemm_max_tiles(n + (p.shared_slot ? p.T : 0), G, p.tile_rows));
  if (p.tiles2 != nullptr) {
    if (!p.num_tiles2) return invalid_argument("moe_permute_gemm: tiles2 without num_tiles2");
    if (p.tile_rows2 != kMoeGemmTileRows && p.tile_rows2 != kMoeGemmTallTileRows && p.tile_rows2 != kMoeGemmSwapTileRows)
      return invalid_argument("moe_permute_gemm: second list of {}-row tiles", p.tile_rows2);
    if (p.max_tiles2 < moe_gemm_max_tiles(n + (p.shared_slot ? p.T : 0), G, p.tile_rows2))
      return invalid_argument("moe_permute_gemm: {} tiles of room in the second list, {} needed at most", p.max_tiles2,
                              moe_gemm_max_tiles(n + (p.shared_slot ? p.T : 0), G, p.tile_rows2));
  }
  if (n + p.T >= (int64_t{1} << 31)) return invalid_argument("moe_permute_gemm: {} rows", n + p.T);
  ML4_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.cursor, 0, (p.E + 1) * sizeof(int32_t), p.stream));
  if (n > 0) {
    launch_kernel(count_kernel, blocks_for(n), 256, p.E * sizeof(int32_t), p.stream, p.ids, n, p.E, p.cursor);
    ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "count_kernel"));
  }
  launch_kernel(plan_kernel, 1, 256, (G + 1) * sizeof(int32_t), p.stream, p.cursor, p.E, G, p.T, p.offsets, p.tiles,
                p.num_tiles, p.max_tiles, p.tile_rows, p.tile_first, p.tiles2, p.num_tiles2, p.max_tiles2, p.tile_rows2,
                p.tile_first2);
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "plan_kernel"));
  if (n == 0) return ok_status();
  launch_kernel(scatter_kernel, blocks_for(n), 256, 0, p.stream, p.ids, n, p.K, p.E, p.T, p.shared_slot, p.cursor,
                p.perm_token, p.inv);
  return cuda_status(cudaGetLastError(), "scatter_kernel");
}

Status moe_weight_tensor_maps(const void* const* w, int n, int64_t N, int64_t K, void* out, int box_rows) {
  static_assert(sizeof(CUtensorMap) == kMoeTensorMapBytes, "moe_gemm.h's tensor map size");
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return unimplemented("moe_weight_tensor_maps: the driver has no cuTensorMapEncodeTiled");
  if (N <= 0 || K <= 0 || K % 128 != 0 || box_rows < 1 || box_rows > 256)
    return invalid_argument("moe_weight_tensor_maps: N={} K={} box rows {}", N, K, box_rows);
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(N)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K)};  // bytes between rows
  const cuuint32_t box[2] = {128, static_cast<cuuint32_t>(box_rows)}, elem[2] = {1, 1};
  for (int i = 0; i < n; ++i) {
    CUtensorMap* m = static_cast<CUtensorMap*>(out) + i;
    const CUresult r = encode(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(w[i]), dims, strides, box, elem,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return internal_error("cuTensorMapEncodeTiled: error {} for matrix {}", static_cast<int>(r), i);
  }
  return ok_status();
}

Status moe_grouped_gemm(const MoeGroupedGemmParams& p) {
  if (p.N <= 0 || p.K <= 0 || p.N % 16 != 0 || p.K % 128 != 0 || p.N > (int64_t{1} << 30) || p.K > (int64_t{1} << 30))
    return invalid_argument("moe_grouped_gemm: N={} (a multiple of 16) K={} (a multiple of 128)", p.N, p.K);
  if (!p.a || !p.a_scale || !p.w || !p.w_scale || !p.tiles || !p.num_tiles || !p.y ||
      (p.gate_up && (!p.w_up || !p.w_up_scale)))
    return invalid_argument("moe_grouped_gemm: null pointer");
  if (reinterpret_cast<uintptr_t>(p.a) & 15u) return invalid_argument("moe_grouped_gemm: A must be 16-byte aligned");
  if (p.max_tiles <= 0) return ok_status();
  if (p.max_tiles > 65535) return invalid_argument("moe_grouped_gemm: {} tiles (at most 65535)", p.max_tiles);
  if (p.tile_first != nullptr && (p.groups <= 0 || p.groups > 8193))
    return invalid_argument("moe_grouped_gemm: {} groups with tile_first", p.groups);
  const GemmArgs a{static_cast<const uint8_t*>(p.a), p.a_scale, p.a_rows, p.w, p.w_scale, p.w_up, p.w_up_scale,
                   p.tiles,
                   p.num_tiles,
                   p.tile_first,
                   p.groups,
                   p.y,
                   static_cast<int>(p.N),
                   static_cast<int>(p.K),
                   static_cast<uint8_t*>(p.y_q),
                   p.y_q_scale,
                   static_cast<const uint8_t*>(p.w_tmap),
                   static_cast<const uint8_t*>(p.w_up_tmap)};
  if (p.specialized && p.w_tmap != nullptr && p.gate_up && p.w_up_tmap == nullptr)
    return invalid_argument("moe_grouped_gemm: gate_up with w_tmap needs w_up_tmap");
  const int cols = p.gate_up ? 128 : 256;
  const int ncols = static_cast<int>((p.N + cols - 1) / cols);
  if (p.y_q != nullptr && (p.tall || !p.gate_up || p.N % 128 != 0 || p.y_q_scale == nullptr))
    return invalid_argument("moe_grouped_gemm: y_q needs gate_up, N % 128 == 0 (N={}), y_q_scale and not tall", p.N);
  const int sms = std::max(sm_count(), 1);  // the persistent kernels' grid
  if (p.swap) {
    if (p.w_tmap == nullptr || (p.gate_up && p.w_up_tmap == nullptr) || p.y_q != nullptr || p.work_counter == nullptr)
      return invalid_argument("moe_grouped_gemm: swap needs the weights' tensor maps, a work_counter and no y_q");
    auto kernel = p.gate_up ? grouped_gemm_swap_kernel<true> : grouped_gemm_swap_kernel<false>;
    static const cudaError_t swap_attr[2] = {
        cudaFuncSetAttribute(grouped_gemm_swap_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSwapSmem),
        cudaFuncSetAttribute(grouped_gemm_swap_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSwapSmem)};
    ML4_RETURN_IF_ERROR(cuda_status(swap_attr[p.gate_up], "cudaFuncSetAttribute(grouped_gemm_swap_kernel)"));
    ML4_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.work_counter, 0, sizeof(int32_t), p.stream));
    const int swap_cols = static_cast<int>((p.N + (p.gate_up ? 63 : 127)) / (p.gate_up ? 64 : 128));
    const int64_t items = p.max_tiles * swap_cols;
    launch_kernel(kernel, static_cast<unsigned>(std::min<int64_t>(sms, items)), kWsThreads, kSwapSmem, p.stream, a,
                  swap_cols, p.work_counter);
    return cuda_status(cudaGetLastError(), "grouped_gemm_swap_kernel");
  }
  if (p.specialized) {
    auto kernel = p.gate_up ? grouped_gemm_ws_kernel<true> : grouped_gemm_ws_kernel<false>;
    static const cudaError_t ws_attr[2] = {
        cudaFuncSetAttribute(grouped_gemm_ws_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kWsSmem),
        cudaFuncSetAttribute(grouped_gemm_ws_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kWsSmem)};
    ML4_RETURN_IF_ERROR(cuda_status(ws_attr[p.gate_up], "cudaFuncSetAttribute(grouped_gemm_ws_kernel)"));
    if (p.work_counter == nullptr) return invalid_argument("moe_grouped_gemm: specialized needs a work_counter");
    ML4_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.work_counter, 0, sizeof(int32_t), p.stream));
    const int64_t items = p.max_tiles * ncols;  // an upper bound: CTAs past *num_tiles * ncols find no work
    launch_kernel(kernel, static_cast<unsigned>(std::min<int64_t>(sms, items)), kWsThreads, kWsSmem, p.stream, a,
                  ncols, p.work_counter);
    return cuda_status(cudaGetLastError(), "grouped_gemm_ws_kernel");
  }
  const dim3 grid(static_cast<unsigned>(ncols), static_cast<unsigned>(p.max_tiles));
  if (p.tall) {
    if (p.overlap) return invalid_argument("moe_grouped_gemm: tall tiles have no overlap variant");
    auto kernel = p.gate_up ? grouped_gemm_tall_kernel<true> : grouped_gemm_tall_kernel<false>;
    static const cudaError_t tall_attr[2] = {
        cudaFuncSetAttribute(grouped_gemm_tall_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kTallSmem),
        cudaFuncSetAttribute(grouped_gemm_tall_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kTallSmem)};
    ML4_RETURN_IF_ERROR(cuda_status(tall_attr[p.gate_up], "cudaFuncSetAttribute(grouped_gemm_tall_kernel)"));
    launch_kernel(kernel, grid, kThreads, kTallSmem, p.stream, a);
    return cuda_status(cudaGetLastError(), "grouped_gemm_tall_kernel");
  }
  auto kernel = p.gate_up ? (p.overlap ? grouped_gemm_kernel<true, true> : grouped_gemm_kernel<true, false>)
                          : (p.overlap ? grouped_gemm_kernel<false, true> : grouped_gemm_kernel<false, false>);
  static const cudaError_t attr[4] = {
      cudaFuncSetAttribute(grouped_gemm_kernel<false, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
      cudaFuncSetAttribute(grouped_gemm_kernel<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
      cudaFuncSetAttribute(grouped_gemm_kernel<true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
      cudaFuncSetAttribute(grouped_gemm_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem)};
  ML4_RETURN_IF_ERROR(cuda_status(attr[2 * p.gate_up + p.overlap], "cudaFuncSetAttribute(grouped_gemm_kernel)"));
  launch_kernel(kernel, grid, kThreads, kSmem, p.stream, a);
  return cuda_status(cudaGetLastError(), "grouped_gemm_kernel");
}

}  // namespace ml4::cuda
