// See topk.h. One block of 1024 threads per row. Radix select (as in vLLM's/DeepSeek's
// top-k kernels and cub's radix sort, written here from the algorithm, not their code):
// scores map to u32 keys whose unsigned order is the float order (NaN -> key of -inf,
// -0 -> +0, so the order and ties equal ml4::cpu::topk's); four passes over 8-bit digits,
// most significant first, each a shared-memory histogram of the keys that still match the
// chosen prefix, fix one digit of the k-th largest key `thr` and the number `take_eq` of
// keys equal to thr that belong to the top k. A final pass keeps keys > thr and the first
// take_eq keys == thr in position order (the CPU's lower-index tie rule); each thread owns a
// contiguous run of positions, so two block scans of per-thread counts place every selected
// position: the output is in ascending position order and deterministic.
// Rows with length <= k skip the passes: every position is selected. topk_reg_kernel (rows of
// at most 16,384 scores) does the same with the row in registers and 11-bit digits.
#include "ops/cuda/topk.h"
#include "ops/cuda/pdl.cuh"

#include <algorithm>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kv/kv_cache_dtype.h"
#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int64_t kRegMaxLength = 16 * kThreads;  // topk_reg_kernel's longest rows

__device__ __forceinline__ uint32_t order_key(float f) {
  if (isnan(f)) f = -__int_as_float(0x7f800000);
  if (f == 0.0f) f = 0.0f;  // -0 ties with +0
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Writes, in position order from out[off], the positions of [lo, hi) whose keys are above thr
// and the first eq_take whose keys equal it (positions and / or their cache slots).
__device__ __forceinline__ void write_selected(const float* row, int lo, int hi, uint32_t thr, int eq_take,
                                               int32_t* positions, int32_t* slots, const int32_t* bt, int64_t off) {
  for (int i = lo; i < hi; ++i) {
    const uint32_t u = order_key(row[i]);
    bool take = u > thr;
    if (!take && u == thr && eq_take > 0) {
      take = true;
      --eq_take;
    }
    if (take) {
      if (positions) positions[off] = i;
      if (slots) slots[off] = bt[i / kPageTokens] * kPageTokens + i % kPageTokens;
      ++off;
    }
  }
}

// Warp 0 (tid < 32) finds the digit of the rem-th largest key among the keys that match
// prefix: lane l owns bins [8l, 8l + 8), counted from the top. Writes the prefix with the
// digit, the keys still wanted inside that bin, and whether they are the whole bin.
__device__ __forceinline__ void find_digit(const unsigned* hist, uint32_t prefix, int shift, int rem,
                                           uint32_t* s_prefix, int* s_rem, int* s_done) {
  const int tid = threadIdx.x;
  unsigned c[8], tot = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    c[i] = hist[8 * tid + i];
    tot += c[i];
  }
  unsigned incl = tot;  // keys in lanes >= tid (higher digits)
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned v = __shfl_down_sync(0xffffffffu, incl, o);
    if (tid + o < 32) incl += v;
  }
  unsigned above = incl - tot;
  if (above < static_cast<unsigned>(rem) && static_cast<unsigned>(rem) <= incl) {
    for (int i = 7; i >= 0; --i) {
      if (static_cast<unsigned>(rem) <= above + c[i]) {
        *s_prefix = prefix | (static_cast<uint32_t>(8 * tid + i) << shift);
        *s_rem = rem - static_cast<int>(above);
        *s_done = static_cast<unsigned>(rem) - above == c[i];
        break;
      }
      above += c[i];
    }
  }
}

// -1 after the kk selected of row t up to k, and the row's count.
__device__ __forceinline__ void fill_tail(int kk, int k, int64_t t, int32_t* positions, int32_t* slots,
                                          int32_t* counts, int64_t out_stride) {
  for (int i = kk + static_cast<int>(threadIdx.x); i < k; i += kThreads) {
    if (positions) positions[t * out_stride + i] = -1;
    if (slots) slots[t * out_stride + i] = -1;
  }
  if (counts && threadIdx.x == 0) counts[t] = kk;
}

// A one-block radix select's shared state: a histogram of kBins digits, and what the digit
// finder leaves for every thread.
template <int kBins>
struct RadixSmem {
  cub::BlockScan<int, kThreads>::TempStorage scan;
  unsigned hist[kBins];
  uint32_t prefix;
  int rem;
  int done;
};
using RowSmem = RadixSmem<256>;   // topk_row_loop: 8-bit digits
using RegSmem = RadixSmem<2048>;  // topk_reg_kernel: 11-bit digits

// The one-block selection of a row of n scores (any n), positions [lo, lo + seg) a thread.
__device__ __forceinline__ void topk_row_loop(const float* __restrict__ row, int n, int kk, int k, int64_t t,
                                              int32_t* __restrict__ positions, int32_t* __restrict__ slots,
                                              int32_t* __restrict__ counts, int64_t out_stride,
                                              const int32_t* __restrict__ bt, RowSmem& sm) {
  using Scan = cub::BlockScan<int, kThreads>;
  const int tid = threadIdx.x;
  // Thread tid owns the contiguous positions [tid * seg, tid * seg + seg) of the row: loads
  // unrolled 8 deep keep several in flight per thread (a one-load-per-iteration loop was
  // latency-bound at ~25 us per pass for 60k scores), and per-thread counts in position order
  // make the final compaction two block scans instead of one pair per 1024 positions.
  const int seg = (n + kThreads - 1) / kThreads;
  const int lo = tid * seg;
  const int lane = tid & 31;
  uint32_t thr = 0;  // every key >= 0: all selected when kk == n
  int take_eq = n;
  if (kk < n && kk > 0) {
    uint32_t prefix = 0, mask = 0;
    int rem = kk;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kThreads) sm.hist[i] = 0;
      __syncthreads();
      for (int i0 = 0; i0 < seg; i0 += 8) {  // warp-uniform trip count
        uint32_t u8[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int i = lo + i0 + j;
          u8[j] = (i0 + j < seg && i < n) ? order_key(row[i]) : 0u;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int i = lo + i0 + j;
          const bool act = i0 + j < seg && i < n && (u8[j] & mask) == prefix;
          const unsigned am = __ballot_sync(0xffffffffu, act);
          if (act) {
            // Warp-aggregated update: the top-byte bins are few and hot.
            const unsigned d = (u8[j] >> shift) & 0xffu;
            const unsigned peers = __match_any_sync(am, d);
            if (lane == __ffs(peers) - 1) atomicAdd(&sm.hist[d], static_cast<unsigned>(__popc(peers)));
          }
        }
      }
      __syncthreads();
      if (tid < 32) find_digit(sm.hist, prefix, shift, rem, &sm.prefix, &sm.rem, &sm.done);
      __syncthreads();
      prefix = sm.prefix;
      rem = sm.rem;
      mask |= 0xffu << shift;
      __syncthreads();
    }
    thr = prefix;
    take_eq = rem;
  }

  // Compaction in position order: per-thread counts, two scans, then the writes.
  if (kk > 0) {
    int gt = 0, eq = 0;
    for (int i0 = 0; i0 < seg; i0 += 8) {
      uint32_t u8[8];
      bool in[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = lo + i0 + j;
        in[j] = i0 + j < seg && i < n;
        u8[j] = in[j] ? order_key(row[i]) : 0u;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        gt += in[j] && u8[j] > thr;
        eq += in[j] && u8[j] == thr;
      }
    }
    int eq_before, take_before;
    Scan(sm.scan).ExclusiveSum(eq, eq_before);
    __syncthreads();
    const int eq_take = max(0, min(eq, take_eq - eq_before));
    Scan(sm.scan).ExclusiveSum(gt + eq_take, take_before);
    write_selected(row, lo, min(n, lo + seg), thr, eq_take, positions, slots, bt, t * out_stride + take_before);
  }
  fill_tail(kk, k, t, positions, slots, counts, out_stride);
}

__global__ void __launch_bounds__(kThreads) topk_kernel(const float* __restrict__ scores, int64_t scores_stride,
                                                        const int32_t* __restrict__ lengths, int k,
                                                        int32_t* __restrict__ positions, int32_t* __restrict__ slots,
                                                        int32_t* __restrict__ counts, int64_t out_stride,
                                                        const int32_t* __restrict__ block_table, int64_t bt_stride,
                                                        const int32_t* __restrict__ seq_of_token) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ RowSmem sm;
  const int64_t t = blockIdx.x;
  const int n = max(lengths[t], 0);
  const int32_t* bt = slots ? block_table + static_cast<int64_t>(seq_of_token[t]) * bt_stride : nullptr;
  topk_row_loop(scores + t * scores_stride, n, min(k, n), k, t, positions, slots, counts, out_stride, bt, sm);
}

// Rows of at most kThreads * V scores (decode-sized steps, the host's longest row): the row is
// read once, V keys a thread in registers (thread tid: positions [V tid, V tid + V), float4
// loads), and every radix pass works on the registers: three passes of 11-bit digits (11, 11,
// 10 bits; plain shared-memory atomics, the 2048 bins spread the hot top digits), no global
// reads after the first. A pass whose digit bin holds exactly the keys still wanted ends the
// passes early (all of them are selected: the same set). One block scan of the packed
// (equal, above) counts places every thread's selected positions. The same output as
// topk_kernel, bit for bit; a longer row (a host that under-counted) takes topk_row_loop.
// gpu_topk_bench on an H200 (2026-12-06), 8192 scores: 12.3 us; 8-bit digits with
// warp-aggregated atomics (four passes, removed) 16.7; topk_kernel 22.9.
template <int V>
__global__ void __launch_bounds__(kThreads) topk_reg_kernel(const float* __restrict__ scores, int64_t scores_stride,
                                                            const int32_t* __restrict__ lengths, int k,
                                                            int32_t* __restrict__ positions,
                                                            int32_t* __restrict__ slots, int32_t* __restrict__ counts,
                                                            int64_t out_stride, const int32_t* __restrict__ block_table,
                                                            int64_t bt_stride, const int32_t* __restrict__ seq_of_token) {
  static_assert(V % 4 == 0 && V <= kPageTokens && kThreads * V < 65536, "float4 loads, one page step, 16-bit counts");
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ union {
    RowSmem loop;
    RegSmem reg;
  } smu;
  RegSmem& sm = smu.reg;
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  const int n = max(lengths[t], 0);
  const int kk = min(k, n);
  const float* row = scores + t * scores_stride;
  const int32_t* bt = slots ? block_table + static_cast<int64_t>(seq_of_token[t]) * bt_stride : nullptr;
  if (n > kThreads * V) {  // block-uniform
    topk_row_loop(row, n, kk, k, t, positions, slots, counts, out_stride, bt, smu.loop);
    return;
  }
  const int lo = tid * V;
  uint32_t u[V];  // 0: no score (every real key is > 0)
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const float4 f = lo + j < n ? __ldg(reinterpret_cast<const float4*>(row + lo + j)) : make_float4(0.f, 0.f, 0.f, 0.f);
      u[j] = lo + j < n ? order_key(f.x) : 0u;
      u[j + 1] = lo + j + 1 < n ? order_key(f.y) : 0u;
      u[j + 2] = lo + j + 2 < n ? order_key(f.z) : 0u;
      u[j + 3] = lo + j + 3 < n ? order_key(f.w) : 0u;
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) u[j] = lo + j < n ? order_key(row[lo + j]) : 0u;
  }
  // The pages of the thread's positions (V <= 64: at most two), loaded under the passes.
  int32_t page_lo = 0, page_hi = 0;
  if (bt != nullptr && lo < n) {
    page_lo = bt[lo / kPageTokens];
    page_hi = bt[(min(lo + V, n) - 1) / kPageTokens];
  }
  uint32_t prefix = 0, mask = 0;  // kk == n: every key matches the empty prefix and is taken
  int rem = n;
  if (kk < n && kk > 0) {
    rem = kk;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
      const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
      const uint32_t dmask = pass == 2 ? 0x3ffu : 0x7ffu;
      for (int i = tid; i < 2048; i += kThreads) sm.hist[i] = 0;
      __syncthreads();
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const bool act = u[j] != 0u && (u[j] & mask) == prefix;
        const unsigned d = (u[j] >> shift) & dmask;
        if (act) atomicAdd(&sm.hist[d], 1u);
      }
      __syncthreads();
      {
        // Thread tid owns bins 2047 - 2 tid and 2046 - 2 tid (from the top); a block scan gives
        // the keys above them.
        const unsigned c0 = sm.hist[2047 - 2 * tid], c1 = sm.hist[2046 - 2 * tid];
        int above;
        Scan(sm.scan).ExclusiveSum(static_cast<int>(c0 + c1), above);
        if (above < rem && rem <= above + static_cast<int>(c0 + c1)) {
          const bool first = rem <= above + static_cast<int>(c0);
          const uint32_t bin = 2048 - (first ? 1 : 2) - 2 * tid;
          const int a = first ? above : above + static_cast<int>(c0);
          sm.prefix = prefix | (bin << shift);
          sm.rem = rem - a;
          sm.done = rem - a == static_cast<int>(first ? c0 : c1);
        }
      }
      __syncthreads();  // the next pass clears hist only after this barrier: its readers are done
      prefix = sm.prefix;
      rem = sm.rem;
      mask |= dmask << shift;
      if (sm.done) break;  // block-uniform; sm.done is next written two barriers on
    }
  }
  if (kk > 0) {
    // Selected: keys whose masked digits are above the prefix, and the first rem (position
    // order) of those equal to it.
    int gt = 0, eq = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const uint32_t m = u[j] & mask;
      gt += u[j] != 0u && m > prefix;
      eq += u[j] != 0u && m == prefix;
    }
    int before;
    Scan(sm.scan).ExclusiveSum((eq << 16) | gt, before);
    const int eq_before = before >> 16, gt_before = before & 0xffff;
    int eq_take = max(0, min(eq, rem - eq_before));
    int64_t off = t * out_stride + gt_before + min(eq_before, rem);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const uint32_t m = u[j] & mask;
      bool take = u[j] != 0u && m > prefix;
      if (!take && u[j] != 0u && m == prefix && eq_take > 0) {
        take = true;
        --eq_take;
      }
      if (take) {
        const int i = lo + j;
        if (positions) positions[off] = i;
        if (slots) slots[off] = (i / kPageTokens == lo / kPageTokens ? page_lo : page_hi) * kPageTokens + i % kPageTokens;
        ++off;
      }
    }
  }
  fill_tail(kk, k, t, positions, slots, counts, out_stride);
}

// ---- Multi-block path (see topk.h). Per row the workspace holds kWsWords + 2 * splits words:
// [0, 2048) the global histogram of the current pass, [2048, 2051) the pass tickets,
// [2052] prefix, [2053] mask, [2054] rem (the selection state the last block of a pass leaves),
// then (gt, eq) per block. Rows are cut into `splits` chunks of ceil(n / splits) rounded up to
// 32 positions, so the blocks cover [0, n) whatever the host thought the longest row was.
constexpr int kMbThreads = 512;
constexpr int kBins = 2048;
constexpr int kWsWords = 2056;
constexpr int kMbUnroll = 8;

struct MbArgs {
  const float* scores;
  int64_t stride;
  const int32_t* lengths;
  int k;
  uint32_t* ws;
  int64_t row_words;
};

struct MbRow {
  int n, kk, lo, hi;
  const float* row;
  uint32_t* w;
};

__device__ __forceinline__ MbRow mb_row(const MbArgs& a) {
  MbRow r;
  const int64_t t = blockIdx.x;
  r.n = max(a.lengths[t], 0);
  r.kk = min(a.k, r.n);
  const int chunk = ((r.n + static_cast<int>(gridDim.y) - 1) / static_cast<int>(gridDim.y) + 31) & ~31;
  r.lo = min(r.n, static_cast<int>(blockIdx.y) * chunk);
  r.hi = min(r.n, r.lo + chunk);
  r.row = a.scores + t * a.stride;
  r.w = a.ws + t * a.row_words;
  return r;
}

// One radix pass: digit bits [shift, shift + bits) of the keys that match the state's prefix.
__global__ void __launch_bounds__(kMbThreads) topk_mb_pass_kernel(MbArgs a, int pass) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  using Scan = cub::BlockScan<unsigned, kMbThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ unsigned hist[kBins];
  __shared__ bool s_last;
  const MbRow r = mb_row(a);
  if (r.kk == r.n || r.kk == 0) return;  // the whole row (or nothing) is selected: no passes
  const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, bits = pass == 2 ? 10 : 11;
  const uint32_t dmask = (1u << bits) - 1u;
  uint32_t prefix = 0, mask = 0;
  unsigned rem = static_cast<unsigned>(r.kk);
  if (pass > 0) {  // the previous pass's last block wrote these before that kernel ended
    prefix = r.w[2052];
    mask = r.w[2053];
    rem = r.w[2054];
  }
  const int tid = threadIdx.x, lane = tid & 31;
  for (int i = tid; i < kBins; i += kMbThreads) hist[i] = 0;
  __syncthreads();
  for (int base = r.lo; base < r.hi; base += kMbThreads * kMbUnroll) {  // block-uniform trip count
    uint32_t u[kMbUnroll];
#pragma unroll
    for (int j = 0; j < kMbUnroll; ++j) {
      const int i = base + j * kMbThreads + tid;
      u[j] = i < r.hi ? order_key(r.row[i]) : 0u;
    }
#pragma unroll
    for (int j = 0; j < kMbUnroll; ++j) {
      const int i = base + j * kMbThreads + tid;
      const bool act = i < r.hi && (u[j] & mask) == prefix;
      const unsigned am = __ballot_sync(0xffffffffu, act);
      if (act) {  // warp-aggregated: the top digits of real scores are few and hot
        const unsigned d = (u[j] >> shift) & dmask;
        const unsigned peers = __match_any_sync(am, d);
        if (lane == __ffs(peers) - 1) atomicAdd(&hist[d], static_cast<unsigned>(__popc(peers)));
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < kBins; i += kMbThreads)
    if (hist[i]) atomicAdd(&r.w[i], hist[i]);
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&r.w[2048 + pass], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // The last block: the row's histogram is complete. Thread tid owns the 4 bins counted from
  // the top [4 tid, 4 tid + 4) (bin kBins - 1 - j for the j-th from the top); a scan gives the
  // keys above each thread's bins, and one thread finds the digit holding the rem-th key.
  unsigned c[4], tot = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int bin = kBins - 1 - (4 * tid + j);
    c[j] = bin <= static_cast<int>(dmask) ? __ldcg(&r.w[bin]) : 0u;
    tot += c[j];
  }
  __syncthreads();
  for (int i = tid; i < kBins; i += kMbThreads) r.w[i] = 0;  // clean for the next pass
  unsigned above;
  Scan(scan_tmp).ExclusiveSum(tot, above);
  if (above < rem && rem <= above + tot) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (rem <= above + c[j]) {
        const uint32_t bin = static_cast<uint32_t>(kBins - 1 - (4 * tid + j));
        r.w[2052] = prefix | (bin << shift);
        r.w[2053] = mask | (dmask << shift);
        r.w[2054] = rem - above;
        break;
      }
      above += c[j];
    }
  }
}

// Threshold key and how many of its ties to take (every key is > 0: NaN maps to -inf's key).
__device__ __forceinline__ void mb_threshold(const MbRow& r, uint32_t* thr, int* take_eq) {
  if (r.kk == r.n) {
    *thr = 0;
    *take_eq = r.n;
  } else {
    *thr = r.w[2052];
    *take_eq = static_cast<int>(r.w[2054]);
  }
}

// Per block: keys above and equal to the threshold in its chunk.
__global__ void __launch_bounds__(kMbThreads) topk_mb_count_kernel(MbArgs a) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  using Reduce = cub::BlockReduce<int, kMbThreads>;
  __shared__ typename Reduce::TempStorage red_tmp;
  const MbRow r = mb_row(a);
  if (r.kk == 0) return;
  uint32_t thr;
  int take_eq;
  mb_threshold(r, &thr, &take_eq);
  int gt = 0, eq = 0;
  for (int base = r.lo; base < r.hi; base += kMbThreads * kMbUnroll) {
    uint32_t u[kMbUnroll];
#pragma unroll
    for (int j = 0; j < kMbUnroll; ++j) {
      const int i = base + j * kMbThreads + threadIdx.x;
      u[j] = i < r.hi ? order_key(r.row[i]) : 0u;
    }
#pragma unroll
    for (int j = 0; j < kMbUnroll; ++j) {
      gt += u[j] > thr;
      eq += u[j] == thr;  // padding keys are 0 and thr > 0 unless the whole row is taken
    }
  }
  if (thr == 0) eq = 0;
  const int g = Reduce(red_tmp).Sum(gt);
  __syncthreads();
  const int e = Reduce(red_tmp).Sum(eq);
  if (threadIdx.x == 0) {
    r.w[kWsWords + 2 * blockIdx.y] = static_cast<uint32_t>(g);
    r.w[kWsWords + 2 * blockIdx.y + 1] = static_cast<uint32_t>(e);
  }
}

// Per block: its selected positions, in order, at the offset the blocks before it leave.
__global__ void __launch_bounds__(kMbThreads) topk_mb_write_kernel(MbArgs a, int32_t* __restrict__ positions,
                                                                    int32_t* __restrict__ slots,
                                                                    int32_t* __restrict__ counts, int64_t out_stride,
                                                                    const int32_t* __restrict__ block_table,
                                                                    int64_t bt_stride,
                                                                    const int32_t* __restrict__ seq_of_token) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  using Scan = cub::BlockScan<int, kMbThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int s_gt_before, s_eq_before;
  const MbRow r = mb_row(a);
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  if (blockIdx.y == 0) {
    for (int i = r.kk + tid; i < a.k; i += kMbThreads) {
      if (positions) positions[t * out_stride + i] = -1;
      if (slots) slots[t * out_stride + i] = -1;
    }
    if (counts && tid == 0) counts[t] = r.kk;
  }
  if (r.kk == 0) return;
  uint32_t thr;
  int take_eq;
  mb_threshold(r, &thr, &take_eq);
  if (tid == 0) {
    int g = 0, e = 0;
    for (unsigned b = 0; b < blockIdx.y; ++b) {
      g += static_cast<int>(r.w[kWsWords + 2 * b]);
      e += static_cast<int>(r.w[kWsWords + 2 * b + 1]);
    }
    s_gt_before = g;
    s_eq_before = e;
  }
  __syncthreads();
  const int eq_block_take = max(0, take_eq - s_eq_before);  // ties this block may still take
  const int base_off = s_gt_before + min(s_eq_before, take_eq);
  // Thread tid owns the contiguous positions [lo + tid * seg, + seg) of the chunk.
  const int seg = (r.hi - r.lo + kMbThreads - 1) / kMbThreads;
  const int lo = r.lo + tid * seg, hi = min(r.hi, lo + seg);
  int gt = 0, eq = 0;
  for (int i = lo; i < hi; ++i) {
    const uint32_t u = order_key(r.row[i]);
    gt += u > thr;
    eq += u == thr && thr != 0;
  }
  int eq_before, take_before;
  Scan(scan_tmp).ExclusiveSum(eq, eq_before);
  __syncthreads();
  const int eq_take = max(0, min(eq, eq_block_take - eq_before));
  Scan(scan_tmp).ExclusiveSum(gt + eq_take, take_before);
  const int32_t* bt = slots ? block_table + static_cast<int64_t>(seq_of_token[t]) * bt_stride : nullptr;
  write_selected(r.row, lo, hi, thr, eq_take, positions, slots, bt, t * out_stride + base_off + take_before);
}

// Keys a thread of topk_reg_kernel holds for rows of at most max_length scores (0: too long,
// or the longest row is not known).
int reg_keys(int64_t max_length) {
  if (max_length <= 0 || max_length > kRegMaxLength) return 0;
  return static_cast<int>((max_length + 4 * kThreads - 1) / (4 * kThreads)) * 4;
}

}  // namespace

int topk_choose_splits(int64_t T, int64_t max_length) {
  // One block per row is ~22 us at 8k scores, ~100 us at 60k and ~0.8 ms at 256k (measured,
  // BENCHMARKS.md): its passes are latency chains. With ~4096 positions per block and at most
  // two waves of blocks the multi-block path is ~35 us from 16k to 256k; below 4 blocks per
  // row its extra launches do not pay. Rows of at most kRegMaxLength scores stay in one block's
  // registers (topk_reg_kernel): one read of the row, no global reads in the passes.
  constexpr int64_t kChunk = 4096, kMaxBlocks = 264;
  if (T <= 0 || max_length <= kRegMaxLength) return 1;
  const int64_t s = std::min(max_length / kChunk, kMaxBlocks / T);
  return s >= 4 ? static_cast<int>(s) : 1;
}

size_t topk_workspace_bytes(int64_t T, int splits) {
  return static_cast<size_t>(std::max<int64_t>(T, 0)) * (kWsWords + 2 * static_cast<size_t>(std::max(splits, 1))) * 4;
}

size_t topk_max_workspace_bytes(int64_t max_T, int64_t max_length) {
  size_t most = 0;
  for (int64_t T = 1; T <= max_T; ++T) {
    const int s = topk_choose_splits(T, max_length);
    if (s == 1) break;  // fewer splits for every larger T, and then one block per row
    most = std::max(most, topk_workspace_bytes(T, s));
  }
  return most;
}

Status topk(const TopkParams& p) {
  if (p.T < 0 || p.k < 0) return invalid_argument("topk: T = {}, k = {}", p.T, p.k);
  const int64_t out_stride = p.out_stride ? p.out_stride : p.k;
  if (out_stride < p.k) return invalid_argument("topk: out_stride {} < k {}", out_stride, p.k);
  if (p.T == 0 || (!p.positions && !p.slots && !p.counts)) return ok_status();
  if (!p.scores || !p.lengths) return invalid_argument("topk: null scores or lengths");
  if (p.slots && (!p.block_table || !p.seq_of_token || p.block_table_stride <= 0))
    return invalid_argument("topk: slot output needs block_table, block_table_stride and seq_of_token");
  if (p.T > 0x7fffffff) return invalid_argument("topk: T = {} too large", p.T);
  if (p.splits < 0) return invalid_argument("topk: splits = {}", p.splits);
  const int splits = p.splits > 0 ? p.splits : topk_choose_splits(p.T, p.max_length);
  if (splits > 1 && p.workspace != nullptr && p.workspace_bytes >= topk_workspace_bytes(p.T, splits)) {
    if (splits > 65535 || p.T > 65535) return invalid_argument("topk: T = {} x splits = {} too large", p.T, splits);
    MbArgs a{p.scores, p.scores_stride, p.lengths, p.k, static_cast<uint32_t*>(p.workspace), kWsWords + 2 * splits};
    ML4_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.workspace, 0, topk_workspace_bytes(p.T, splits), p.stream));
    const dim3 grid(static_cast<unsigned>(p.T), static_cast<unsigned>(splits));
    for (int pass = 0; pass < 3; ++pass) launch_kernel(topk_mb_pass_kernel, grid, kMbThreads, 0, p.stream, a, pass);
    launch_kernel(topk_mb_count_kernel, grid, kMbThreads, 0, p.stream, a);
    launch_kernel(topk_mb_write_kernel, grid, kMbThreads, 0, p.stream, a, p.positions, p.slots, p.counts, out_stride,
                  p.block_table, p.block_table_stride, p.seq_of_token);
    return cuda_status(cudaGetLastError(), "topk multi-block kernels");
  }
  const int v = reg_keys(p.max_length);
  auto kernel = v == 4    ? topk_reg_kernel<4>
                : v == 8  ? topk_reg_kernel<8>
                : v == 12 ? topk_reg_kernel<12>
                : v == 16 ? topk_reg_kernel<16>
                          : topk_kernel;
  launch_kernel(kernel, static_cast<unsigned>(p.T), kThreads, 0, p.stream, p.scores, p.scores_stride, p.lengths, p.k,
                p.positions, p.slots, p.counts, out_stride, p.block_table, p.block_table_stride, p.seq_of_token);
  return cuda_status(cudaGetLastError(), "topk_kernel");
}

}  // namespace ml4::cuda
