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
// Rows with length <= k skip the passes: every position is selected.
#include "ops/cuda/topk.h"

#include <cub/block/block_scan.cuh>

#include "kv/kv_cache_dtype.h"
#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint32_t order_key(float f) {
  if (isnan(f)) f = -__int_as_float(0x7f800000);
  if (f == 0.0f) f = 0.0f;  // -0 ties with +0
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kThreads) topk_kernel(const float* __restrict__ scores, int64_t scores_stride,
                                                        const int32_t* __restrict__ lengths, int k,
                                                        int32_t* __restrict__ positions, int32_t* __restrict__ slots,
                                                        int32_t* __restrict__ counts, int64_t out_stride,
                                                        const int32_t* __restrict__ block_table, int64_t bt_stride,
                                                        const int32_t* __restrict__ seq_of_token) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ unsigned hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_rem;
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  const int n = max(lengths[t], 0);
  const int kk = min(k, n);
  const float* row = scores + t * scores_stride;
  const int32_t* bt = slots ? block_table + static_cast<int64_t>(seq_of_token[t]) * bt_stride : nullptr;

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
      for (int i = tid; i < 256; i += kThreads) hist[i] = 0;
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
            if (lane == __ffs(peers) - 1) atomicAdd(&hist[d], static_cast<unsigned>(__popc(peers)));
          }
        }
      }
      __syncthreads();
      if (tid < 32) {
        // Warp 0 finds the digit: lane l owns bins [8l, 8l + 8); counts from the top.
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
              s_prefix = prefix | (static_cast<uint32_t>(8 * tid + i) << shift);
              s_rem = rem - static_cast<int>(above);
              break;
            }
            above += c[i];
          }
        }
      }
      __syncthreads();
      prefix = s_prefix;
      rem = s_rem;
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
    Scan(scan_tmp).ExclusiveSum(eq, eq_before);
    __syncthreads();
    const int eq_take = max(0, min(eq, take_eq - eq_before));
    Scan(scan_tmp).ExclusiveSum(gt + eq_take, take_before);
    int o = take_before, eq_left = eq_take;
    for (int i = lo; i < min(n, lo + seg); ++i) {
      const uint32_t u = order_key(row[i]);
      bool take = u > thr;
      if (!take && u == thr && eq_left > 0) {
        take = true;
        --eq_left;
      }
      if (take) {
        const int64_t off = t * out_stride + o++;
        if (positions) positions[off] = i;
        if (slots) slots[off] = bt[i / kPageTokens] * kPageTokens + i % kPageTokens;
      }
    }
  }
  for (int i = kk + tid; i < k; i += kThreads) {
    if (positions) positions[t * out_stride + i] = -1;
    if (slots) slots[t * out_stride + i] = -1;
  }
  if (counts && tid == 0) counts[t] = kk;
}

}  // namespace

Status topk(const TopkParams& p) {
  if (p.T < 0 || p.k < 0) return invalid_argument("topk: T = {}, k = {}", p.T, p.k);
  const int64_t out_stride = p.out_stride ? p.out_stride : p.k;
  if (out_stride < p.k) return invalid_argument("topk: out_stride {} < k {}", out_stride, p.k);
  if (p.T == 0 || (!p.positions && !p.slots && !p.counts)) return Status::ok();
  if (!p.scores || !p.lengths) return invalid_argument("topk: null scores or lengths");
  if (p.slots && (!p.block_table || !p.seq_of_token || p.block_table_stride <= 0))
    return invalid_argument("topk: slot output needs block_table, block_table_stride and seq_of_token");
  if (p.T > 0x7fffffff) return invalid_argument("topk: T = {} too large", p.T);
  topk_kernel<<<static_cast<unsigned>(p.T), kThreads, 0, p.stream>>>(
      p.scores, p.scores_stride, p.lengths, p.k, p.positions, p.slots, p.counts, out_stride, p.block_table,
      p.block_table_stride, p.seq_of_token);
  return cuda_status(cudaGetLastError(), "topk_kernel");
}

}  // namespace ml4::cuda
