// See sampling.h. argmax_rows: tiles of 4096 logits per block, each logit an order-preserving
// 64-bit key, the row's maximum key over its tiles by one warp: deterministic for any launch.
//
// sample_rows with a workspace (the split path; sampling.h "Design"): four kernels, K1-K3 over
// a grid of (row, block of 4 warps), K4 a block per row; every sum has a fixed partition (a warp-tile of 1024
// logits, whatever B is) and a fixed order, or is over integers, so a row's token and
// logprob are bit-reproducible and do not depend on the batch:
//   K1 stats_kernel: per warp-tile max / argmax and sum exp(l - m_tile) (f64); zeroes the
//      row's histogram and candidate counter for K2 / K3.
//   K2 hist_kernel (rows with top-k or top-p): histogram over bins of (m - l) * 32 (count and
//      integer weight), shared memory per block, then global atomics (integers: exact); the
//      row's last block to finish (a counter) scans it to the row's plan: the bins that are
//      surely kept, the boundary bins whose ids are candidates, or "fallback".
//   K3 scan_kernel (sampled rows), one warp per 256 logits: the Gumbel score of the
//      surely-kept ids (min-p per id), best per warp; candidates appended to the row's list
//      (any order: the final kernel sorts them by (key, id)).
//   K4 final_kernel (one 1024-thread block per row): the row max, the logprob, and the
//      token: greedy; or the best of the tile scores and of the candidates, which are sorted
//      (bitonic, in registers) to apply the rank (top-k) and prefix-mass (top-p) rules
//      exactly; or, for a fallback row, the one-block-per-row sampler (sampling_row.cuh).
// The kept set is a prefix of the order (key descending, id ascending), and the bins are
// monotone in the logit, so "bins before the cut bin" are a prefix too: the cut only has to
// be resolved inside the boundary bin(s), which is what the candidates are.
#include "ops/cuda/sampling.h"
#include "ops/cuda/pdl.cuh"

#include "ops/cpu/sampling.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/sampling_row.cuh"

namespace ml4::cuda {
namespace {

using sampling::ranks_above;
using ull = unsigned long long;

// ---- argmax (argmax_rows): tiles of 4096 logits, 64-bit keys ---------------------------

constexpr int kArgThreads = 256, kArgTile = 4096, kArgPerThread = kArgTile / kArgThreads;

// Order-preserving key: larger value first, then the lower id; NaN below every number (key
// 0 in the value half) and -0 equal to +0, as sampling::ranks_above ranks them.
__device__ __forceinline__ ull argmax_key(float v, int64_t i) {
  uint32_t u = __float_as_uint(v);
  uint32_t o = 0;
  if (v == v) {
    if (u == 0x80000000u) u = 0;
    o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  return (static_cast<ull>(o) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

__device__ __forceinline__ ull warp_max_key(ull k) {
  for (int o = 16; o > 0; o >>= 1) {
    const ull other = __shfl_xor_sync(0xFFFFFFFFu, k, o);
    k = other > k ? other : k;
  }
  return k;
}

template <bool kVec>
__global__ void __launch_bounds__(kArgThreads)
    argmax_tile_kernel(const float* __restrict__ a, int64_t a_stride, const float* __restrict__ b, int64_t b_stride,
                       int64_t V, ull* __restrict__ part) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t row = blockIdx.y, t0 = static_cast<int64_t>(blockIdx.x) * kArgTile;
  const int64_t end = t0 + kArgTile < V ? t0 + kArgTile : V;
  const float* ra = a + row * a_stride;
  const float* rb = b != nullptr ? b + row * b_stride : nullptr;
  ull best = 0;
  if constexpr (kVec) {  // V, the strides and the pointers multiples of 4 floats: whole float4s
    float4 x[kArgPerThread / 4];
#pragma unroll
    for (int u = 0; u < kArgPerThread / 4; ++u) {
      const int64_t j = t0 + (static_cast<int64_t>(u) * kArgThreads + threadIdx.x) * 4;
      x[u] = j < end ? *reinterpret_cast<const float4*>(ra + j) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (rb != nullptr) {
#pragma unroll
      for (int u = 0; u < kArgPerThread / 4; ++u) {
        const int64_t j = t0 + (static_cast<int64_t>(u) * kArgThreads + threadIdx.x) * 4;
        if (j < end) {
          const float4 y = *reinterpret_cast<const float4*>(rb + j);
          x[u].x += y.x;
          x[u].y += y.y;
          x[u].z += y.z;
          x[u].w += y.w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kArgPerThread / 4; ++u) {
      const int64_t j = t0 + (static_cast<int64_t>(u) * kArgThreads + threadIdx.x) * 4;
      if (j < end) {
        const ull k0 = argmax_key(x[u].x, j), k1 = argmax_key(x[u].y, j + 1);
        const ull k2 = argmax_key(x[u].z, j + 2), k3 = argmax_key(x[u].w, j + 3);
        const ull m01 = k0 > k1 ? k0 : k1, m23 = k2 > k3 ? k2 : k3, m = m01 > m23 ? m01 : m23;
        best = m > best ? m : best;
      }
    }
  } else {
    for (int64_t j = t0 + threadIdx.x; j < end; j += kArgThreads) {
      const float v = rb != nullptr ? ra[j] + rb[j] : ra[j];
      const ull k = argmax_key(v, j);
      best = k > best ? k : best;
    }
  }
  best = warp_max_key(best);
  __shared__ ull warp_best[kArgThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x < 32) {
    ull k = threadIdx.x < kArgThreads / 32 ? warp_best[threadIdx.x] : 0;
    k = warp_max_key(k);
    if (threadIdx.x == 0) part[row * gridDim.x + blockIdx.x] = k;
  }
}

// One warp per row over its tiles' keys; every row has at least one logit, so the maximum
// key names a real id.
__global__ void argmax_final_kernel(const ull* __restrict__ part, int tiles, int32_t* __restrict__ out) {
  pdl_wait();
  pdl_launch_dependents();
  const ull* p = part + static_cast<int64_t>(blockIdx.x) * tiles;
  ull k = 0;
  for (int i = threadIdx.x; i < tiles; i += 32) k = p[i] > k ? p[i] : k;
  k = warp_max_key(k);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(k & 0xFFFFFFFFu));
}

// ---- the drafter's sampled drafts (draft_rows) -------------------------------------------
//
// Per row, over the same 4096-logit tiles as the split argmax: K1 argmax_tile_kernel (the
// best id's key per tile); K2 the row's best id and max, then per tile sum of e_i =
// exp((l_i - m) / T) in f64 (min-p: e_i kept when >= min_p or i = best); K3 the row's sum
// (tile sums in tile order), q_i = f32(e_i / sum) written, per tile the f64 sum of the q_i
// and the last id with q_i > 0; K4 one warp per row: total = the tile sums in order, target =
// u total (u as draw_from_weights draws it), the tile where the running sum first exceeds it,
// then inside it lane j's 128 ids (sum, warp prefix, and a sequential scan of the crossing
// lane); no crossing (rounding at the very end) -> the last id with q > 0, as the host.

struct DraftWs {
  ull* keys;
  double* esum;
  double* qsum;
  int* lastpos;
};

__host__ __device__ inline DraftWs draft_ws(void* base, int64_t B, int tiles) {
  char* p = static_cast<char*>(base);
  DraftWs w;
  const size_t n = static_cast<size_t>(B) * tiles;
  w.keys = reinterpret_cast<ull*>(p);
  w.esum = reinterpret_cast<double*>(p + n * 8);
  w.qsum = reinterpret_cast<double*>(p + n * 16);
  w.lastpos = reinterpret_cast<int*>(p + n * 24);
  return w;
}

// The block's largest key (every thread gets it).
__device__ __forceinline__ ull block_max_key(ull k) {
  __shared__ ull red[32];
  k = warp_max_key(k);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = k;
  __syncthreads();
  if (threadIdx.x < 32) {
    ull v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0;
    v = warp_max_key(v);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const ull best = red[0];
  __syncthreads();
  return best;
}

__device__ __forceinline__ int64_t key_id(ull key) {
  return static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(key & 0xFFFFFFFFu));
}

// The row's best id from its tiles' keys (every thread gets it).
__device__ __forceinline__ int64_t draft_best(const ull* keys, int tiles) {
  ull k = 0;
  for (int i = threadIdx.x; i < tiles; i += blockDim.x) k = keys[i] > k ? keys[i] : k;
  return key_id(block_max_key(k));
}

// e_i of sampling::row_distribution: exp((l_i - m) / T), 0 where min-p drops it and outside
// the row's top-k / top-p cut (rowblock::KeptCut; off: every id).
__device__ __forceinline__ double draft_weight(float l, int64_t i, double m, const DeviceSamplingParams& P,
                                               int64_t best, const rowblock::KeptCut& cut) {
  if (!cut.keeps(l, i)) return 0.0;
  const double e = exp((static_cast<double>(l) - m) / P.temperature);
  if (sampling::min_p_on(P) && i != best && !(e >= static_cast<double>(sampling::min_p_value(P)))) return 0.0;
  return e;
}

// Block sum of one double per thread, in a fixed order (warp shuffles, then the warps in order).
__device__ __forceinline__ double block_sum_f64(double v) {
  __shared__ double red[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += red[w];
  __syncthreads();
  return s;  // thread 0's value
}

// What K2 and K3 share: the block's row, tile range, parameters and the row's best id.
struct DraftTile {
  int tiles;
  int64_t row, best, t0, end;
  DraftWs w;
  DeviceSamplingParams P;
  const float* l;
  rowblock::KeptCut cut;
  __device__ DraftTile(const float* logits, int64_t V, const DeviceSamplingParams* params, void* ws,
                       const rowblock::KeptCut* cuts)
      : tiles(static_cast<int>(gridDim.x)),
        row(blockIdx.y),
        best(0),
        t0(static_cast<int64_t>(blockIdx.x) * kArgTile),
        end(0),
        w(draft_ws(ws, gridDim.y, static_cast<int>(gridDim.x))),
        P(params[blockIdx.y]),
        l(logits + static_cast<int64_t>(blockIdx.y) * V),
        cut(cuts != nullptr ? cuts[blockIdx.y] : rowblock::KeptCut{}) {
    end = t0 + kArgTile < V ? t0 + kArgTile : V;
    best = draft_best(w.keys + row * tiles, tiles);
  }
};

__global__ void __launch_bounds__(kArgThreads)
    draft_esum_kernel(const float* __restrict__ logits, int64_t V, const DeviceSamplingParams* __restrict__ params,
                      void* ws, const rowblock::KeptCut* __restrict__ cuts) {
  pdl_wait();
  pdl_launch_dependents();
  const DraftTile d(logits, V, params, ws, cuts);
  if (sampling::greedy(d.P)) return;
  const double m = d.l[d.best];
  double acc = 0.0;
  for (int64_t i = d.t0 + threadIdx.x; i < d.end; i += kArgThreads) acc += draft_weight(d.l[i], i, m, d.P, d.best, d.cut);
  const double s = block_sum_f64(acc);
  if (threadIdx.x == 0) d.w.esum[d.row * d.tiles + blockIdx.x] = s;
}

__global__ void __launch_bounds__(kArgThreads)
    draft_probs_kernel(const float* __restrict__ logits, int64_t V, const DeviceSamplingParams* __restrict__ params,
                       float* __restrict__ probs, void* ws, const rowblock::KeptCut* __restrict__ cuts) {
  pdl_wait();
  pdl_launch_dependents();
  const DraftTile d(logits, V, params, ws, cuts);
  const int tiles = d.tiles;
  const int64_t row = d.row, best = d.best, t0 = d.t0, end = d.end;
  const DraftWs& w = d.w;
  const DeviceSamplingParams& P = d.P;
  const float* l = d.l;
  float* q = probs + row * V;
  __shared__ int last;
  if (threadIdx.x == 0) last = -1;
  __syncthreads();
  double acc = 0.0;
  int mylast = -1;
  if (sampling::greedy(P)) {
    for (int64_t i = t0 + threadIdx.x; i < end; i += kArgThreads) q[i] = i == best ? 1.0f : 0.0f;
  } else {
    double sum = 0.0;
    for (int t = 0; t < tiles; ++t) sum += w.esum[row * tiles + t];
    const double m = l[best];
    for (int64_t i = t0 + threadIdx.x; i < end; i += kArgThreads) {
      const float v = static_cast<float>(draft_weight(l[i], i, m, P, best, d.cut) / sum);
      q[i] = v;
      if (v > 0.0f) {
        acc += v;
        mylast = static_cast<int>(i);
      }
    }
  }
  if (mylast >= 0) atomicMax(&last, mylast);
  const double s = block_sum_f64(acc);
  if (threadIdx.x == 0) {
    w.qsum[row * tiles + blockIdx.x] = s;
    w.lastpos[row * tiles + blockIdx.x] = last;
  }
}

// The top-k / top-p cuts of sampled rows (rowblock::row_kept_cut), one 1024-thread block a
// row: draft rows r (params[r]) and the verifier's rows (sequence blockIdx.x, row blockIdx.y).
template <bool kVec>
__global__ void __launch_bounds__(rowblock::kThreads, 1)
    draft_cut_kernel(const float* __restrict__ logits, int64_t V, const DeviceSamplingParams* __restrict__ params,
                     rowblock::KeptCut* __restrict__ cuts) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ rowblock::Smem sm;
  const DeviceSamplingParams P = params[blockIdx.x];
  const rowblock::KeptCut c = rowblock::row_kept_cut<kVec>(sm, logits + static_cast<int64_t>(blockIdx.x) * V, V, P);
  if (threadIdx.x == 0) cuts[blockIdx.x] = c;
}

template <bool kVec>
__global__ void __launch_bounds__(rowblock::kThreads, 1)
    verify_cut_kernel(const float* __restrict__ logits, int64_t V, const VerifySeq* __restrict__ seqs,
                      rowblock::KeptCut* __restrict__ cuts) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ rowblock::Smem sm;
  const VerifySeq& s = seqs[blockIdx.x];
  const int64_t j = blockIdx.y;
  if (j > s.k) return;
  const rowblock::KeptCut c = rowblock::row_kept_cut<kVec>(sm, logits + (s.row0 + j) * V, V, s.params);
  if (threadIdx.x == 0) cuts[s.row0 + j] = c;
}

constexpr int kDrawLaneIds = kArgTile / 32;  // 128 ids per lane inside the crossing tile

__global__ void draft_draw_kernel(const float* __restrict__ probs, int64_t V, const DeviceSamplingParams* __restrict__ params,
                                  int32_t* __restrict__ ids, void* ws, int tiles) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x;
  const DraftWs w = draft_ws(ws, gridDim.x, tiles);
  const DeviceSamplingParams P = params[row];
  if (sampling::greedy(P)) {
    const int64_t best = draft_best(w.keys + row * tiles, tiles);
    if (lane == 0) ids[row] = static_cast<int32_t>(best);
    return;
  }
  // u exactly as sampling::draw_from_weights draws it.
  const sampling::Philox4 r = sampling::draw_group(P.seed, P.counter, 0xFFFFFFFFu);
  const double u = static_cast<double>((static_cast<uint64_t>(r.v[0]) << 21) ^ (r.v[1] >> 11)) * 0x1.0p-53;
  double total = 0.0;
  int lastpos = -1;
  for (int t = 0; t < tiles; ++t) {
    total += w.qsum[row * tiles + t];
    lastpos = max(lastpos, w.lastpos[row * tiles + t]);
  }
  const double target = u * total;
  double acc = 0.0;
  int tile = -1;
  for (int t = 0; t < tiles; ++t) {
    const double next = acc + w.qsum[row * tiles + t];
    if (next > target) {
      tile = t;
      break;
    }
    acc = next;
  }
  int32_t token = lastpos < 0 ? 0 : lastpos;
  if (tile >= 0) {
    // The tile's last positive id unless a lane crosses (a crossing lost to rounding between
    // the tile's block-reduced sum and its lanes' sums).
    if (w.lastpos[row * tiles + tile] >= 0) token = w.lastpos[row * tiles + tile];
    const float* q = probs + row * V;
    const int64_t i0 = static_cast<int64_t>(tile) * kArgTile + static_cast<int64_t>(lane) * kDrawLaneIds;
    const int64_t i1 = i0 + kDrawLaneIds < V ? i0 + kDrawLaneIds : V;
    double mine = 0.0;
    for (int64_t i = i0; i < i1; ++i)
      if (q[i] > 0.0f) mine += q[i];
    double before = mine;  // inclusive prefix over the lanes
    for (int o = 1; o < 32; o <<= 1) {
      const double v = __shfl_up_sync(0xFFFFFFFFu, before, o);
      if (lane >= o) before += v;
    }
    before -= mine;  // exclusive
    const bool crosses = acc + before + mine > target && mine > 0.0;
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, crosses);
    if (ballot != 0u) {
      const int first = __ffs(ballot) - 1;
      if (lane == first) {
        double a = acc + before;
        for (int64_t i = i0; i < i1; ++i) {
          if (!(q[i] > 0.0f)) continue;
          a += q[i];
          token = static_cast<int32_t>(i);
          if (a > target) break;
        }
      }
      token = __shfl_sync(0xFFFFFFFFu, token, first);
    }
  }
  if (lane == 0) ids[row] = token;
}

// ---- one block per row (no workspace) --------------------------------------------------

// ---- DSpark verification on the device (verify_rows) -------------------------------------
//
// One 1024-thread block per verifying sequence, its rows in order as verify_drafts walks them:
// per row the argmax (keys, as the host's ranks_above), one pass for sum e_i (row_distribution's
// weights: temperature, min-p) and sum exp(l_i - m) (the logprob), both f64 in a fixed order;
// the acceptance test on the draft's p / q; on rejection (or for the bonus) an inverse-CDF draw
// over the residual max(p - q, 0) (or p), each thread summing a contiguous run of ids, the
// runs' sums scanned in thread order, and the thread whose run crosses u * total scanning it.

constexpr int kVerifyThreads = 1024;

// Thread 0's block_sum_f64, to every thread.
__device__ __forceinline__ double block_total_f64(double v) {
  __shared__ double total;
  const double s = block_sum_f64(v);
  if (threadIdx.x == 0) total = s;
  __syncthreads();
  const double r = total;
  __syncthreads();
  return r;
}

// sampling.h draw semantics over weights w(i) >= 0 for ids [0, V): the first id whose running
// sum (id order) exceeds u * total; where rounding leaves no crossing, the last id with weight
// > 0. -1 when no weight is positive. Every thread gets the id.
template <typename Weight>
__device__ int64_t block_draw(int64_t V, double u, Weight w) {
  __shared__ double warp_tot[32];
  __shared__ int crossing;
  __shared__ unsigned long long last_any;
  __shared__ long long chosen;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
  const int64_t per = (V + blockDim.x - 1) / blockDim.x;
  const int64_t i0 = min(V, static_cast<int64_t>(tid) * per), i1 = min(V, i0 + per);
  if (tid == 0) {
    crossing = INT_MAX;
    last_any = 0;
    chosen = -1;
  }
  double mine = 0.0;
  int64_t last = -1;
  for (int64_t i = i0; i < i1; ++i) {
    const double x = w(i);
    if (x > 0.0) {
      mine += x;
      last = i;
    }
  }
  // Inclusive scan of the runs' sums in thread order: within warps, then over the warp totals.
  double incl = mine;
  for (int o = 1; o < 32; o <<= 1) {
    const double v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_tot[wid] = incl;
  __syncthreads();
  double before = 0.0, total = 0.0;
  for (int k = 0; k < nw; ++k) {
    if (k < wid) before += warp_tot[k];
    total += warp_tot[k];
  }
  incl += before;
  const double excl = incl - mine;
  if (last >= 0) atomicMax(&last_any, static_cast<unsigned long long>(last + 1));
  const double target = u * total;
  if (mine > 0.0 && incl > target) atomicMin(&crossing, tid);
  __syncthreads();
  if (tid == crossing) {
    double a = excl;
    int64_t tok = last;
    for (int64_t i = i0; i < i1; ++i) {
      const double x = w(i);
      if (!(x > 0.0)) continue;
      a += x;
      tok = i;
      if (a > target) break;
    }
    chosen = tok;
  }
  __syncthreads();
  const int64_t out = chosen >= 0 ? static_cast<int64_t>(chosen) : static_cast<int64_t>(last_any) - 1;
  __syncthreads();
  return out;
}

__global__ void __launch_bounds__(kVerifyThreads)
    verify_rows_kernel(const float* __restrict__ logits, int64_t V, const float* __restrict__ q,
                       const int32_t* __restrict__ drafts, const VerifySeq* __restrict__ seqs,
                       int32_t* __restrict__ tokens, float* __restrict__ logprobs, int32_t* __restrict__ accepted,
                       const rowblock::KeptCut* __restrict__ cuts) {
  pdl_wait();
  pdl_launch_dependents();
  const VerifySeq s = seqs[blockIdx.x];
  const DeviceSamplingParams& P = s.params;
  int j = 0;
  for (; j <= s.k; ++j) {
    const float* l = logits + (s.row0 + j) * V;
    const rowblock::KeptCut cut = cuts[s.row0 + j];
    ull key = 0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const ull c = argmax_key(l[i], i);
      key = c > key ? c : key;
    }
    const int64_t best = key_id(block_max_key(key));
    const double m = l[best];
    double e = 0.0, z = 0.0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const float li = l[i];
      e += draft_weight(li, i, m, P, best, cut);
      if (li == li) z += exp(static_cast<double>(li) - m);
    }
    const double esum = block_total_f64(e), lsum = block_total_f64(z);
    const sampling::VerifyUniforms u = sampling::verify_uniforms(P.seed, P.counter + j);
    auto p_of = [&](int64_t i) { return draft_weight(l[i], i, m, P, best, cut) / esum; };
    int64_t t = -1;
    if (j < s.k) {
      const int32_t d = drafts[s.draft0 + j];
      const float* qr = s.q0 >= 0 ? q + (s.q0 + j) * V : nullptr;
      const double qd = qr != nullptr ? static_cast<double>(qr[d]) : 1.0;
      if (qd > 0.0 && p_of(d) / qd >= u.accept) {
        if (threadIdx.x == 0) {
          tokens[s.out0 + j] = d;
          logprobs[s.out0 + j] = static_cast<float>(static_cast<double>(l[d]) - m - log(lsum));
        }
        continue;
      }
      // Rejected: the residual max(p - q, 0) (one-hot q: p without the draft).
      t = block_draw(V, u.draw, [&](int64_t i) {
        const double p = p_of(i);
        return qr != nullptr ? fmax(0.0, p - static_cast<double>(qr[i])) : (i == d ? 0.0 : p);
      });
    }
    if (t < 0) t = block_draw(V, u.draw, p_of);  // the bonus (p), or a residual of 0 (p == q)
    if (t < 0) t = 0;                            // no positive weight: the host's draw gives 0
    if (threadIdx.x == 0) {
      tokens[s.out0 + j] = static_cast<int32_t>(t);
      logprobs[s.out0 + j] = static_cast<float>(static_cast<double>(l[t]) - m - log(lsum));
    }
    break;
  }
  if (threadIdx.x == 0) accepted[blockIdx.x] = j;  // the drafts before the emitted token
  for (int i = j + 1 + static_cast<int>(threadIdx.x); i <= s.k; i += blockDim.x) {
    tokens[s.out0 + i] = -1;
    logprobs[s.out0 + i] = 0.0f;
  }
}

template <bool kVec>
__global__ void __launch_bounds__(rowblock::kThreads, 1)
    row_kernel(const float* __restrict__ logits, int64_t V, int64_t stride, const DeviceSamplingParams* __restrict__ params,
               int32_t* __restrict__ tokens, float* __restrict__ logprobs) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ rowblock::Smem sm;
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * stride;
  const DeviceSamplingParams P = params[blockIdx.x];
  float m;
  double lse;
  const int64_t token = rowblock::sample_row<kVec>(sm, row, V, P, logprobs != nullptr, &m, &lse);
  if (threadIdx.x == 0) {
    tokens[blockIdx.x] = static_cast<int32_t>(token);
    if (logprobs)
      logprobs[blockIdx.x] = static_cast<float>(static_cast<double>(row[token]) - static_cast<double>(m) - log(lse));
  }
}

// ---- the split path ----------------------------------------------------------------------

constexpr int kTile = 1024;  // logits per warp-tile of K1 / K2 (lane L: groups of 4 at 32 j + L, j < 8)
constexpr int kSub = 256;    // logits per warp of K3 (2 groups a lane: the Gumbel draws are its cost)
constexpr int kTileWarps = 4;  // warp-tiles per block of K1-K3 (B = 1: 32 blocks per row)
constexpr int kSplitThreads = kTileWarps * 32;
constexpr int kBins = 2048;
constexpr float kBinScale = 32.0f;  // bins of 1/32 logit below the max; the last bin takes the rest
constexpr int kCap = 2048;          // candidates K4 sorts (two per thread)
constexpr int kFinalThreads = 1024;
constexpr int kFinalWarps = kFinalThreads / 32;
constexpr int kHeader = 128;
static_assert(kCap == 2 * kFinalThreads, "K4 holds two candidates per thread");

struct TileStat {
  float m;       // max over the tile (NaN ranks below everything)
  int32_t id;    // its id (lowest among ties)
  double sum;    // sum exp(l - m) over the tile's non-NaN ids; 0 when m is NaN or -inf
};
struct TileBest {
  float score;  // best Gumbel score of the tile's surely-kept ids (NaN: none)
  int32_t id;   // INT32_MAX: none
};

enum : int32_t { kModeAll = 0, kModeK = 1, kModeP = 2, kModeKP = 3, kModeFallback = 4 };

// What K3 decided for a row (every block of the row computes the same; block 0 stores it).
struct RowPlan {
  int32_t mode;    // kModeAll: no top-k / top-p cut, every id is decided per tile
  int32_t b_sure;  // ids in bins < b_sure are kept (min-p aside)
  int32_t b_cand;  // ids in bins [b_sure, b_cand] are candidates
  uint32_t n;      // how many candidates (from the histogram)
  ull count_above;  // ids in bins < b_sure
  ull mass_above;   // their integer weight
  ull target;       // top-p target (kModeP; kModeKP computes it in K4)
};

// Workspace of one row: [cand_count u32, k2_done u32 | RowPlan] (kHeader B), histogram counts
// [kBins] u32, masses [kBins] u64, candidates [kCap] u64, TileStat [T], TileBest [4 T] (one per
// K3 warp of kSub logits).
__host__ __device__ constexpr size_t row_ws_bytes(int64_t T) {
  return (static_cast<size_t>(kHeader + kBins * 12 + kCap * 8 + 48 * T) + 255) & ~static_cast<size_t>(255);
}

struct RowWs {
  unsigned* cand_count;
  unsigned* k2_done;  // K2 blocks of the row done (the last one makes the plan)
  RowPlan* plan;
  unsigned* hcount;
  ull* hmass;
  ull* cand;
  TileStat* stat;
  TileBest* best;
};

__device__ __forceinline__ RowWs row_ws(char* ws, int64_t row, int64_t T) {
  char* b = ws + row * row_ws_bytes(T);
  RowWs w;
  w.cand_count = reinterpret_cast<unsigned*>(b);
  w.k2_done = reinterpret_cast<unsigned*>(b + 4);
  w.plan = reinterpret_cast<RowPlan*>(b + 16);
  w.hcount = reinterpret_cast<unsigned*>(b + kHeader);
  w.hmass = reinterpret_cast<ull*>(b + kHeader + kBins * 4);
  w.cand = reinterpret_cast<ull*>(b + kHeader + kBins * 12);
  w.stat = reinterpret_cast<TileStat*>(b + kHeader + kBins * 12 + kCap * 8);
  w.best = reinterpret_cast<TileBest*>(b + kHeader + kBins * 12 + kCap * 8 + 16 * T);
  return w;
}

// The bin of a non-NaN logit l <= m (m finite): monotone non-increasing in l, so the ids of
// the bins before any bin are a prefix of the (key descending, id ascending) order.
__device__ __forceinline__ int bin_of(float l, float m) {
  return static_cast<int>(fminf((m - l) * kBinScale, static_cast<float>(kBins - 1)));
}

// (order key, id) packed so that a larger value ranks first: ties on the key to the lower id.
__device__ __forceinline__ ull cand_key(float l, int64_t id) {
  return (static_cast<ull>(sampling::order_key(l)) << 32) | (0xffffffffull - static_cast<ull>(id));
}

// J groups of 4 logits per lane: lane L gets the groups q = q0 + 32 j + L (ids 4q..4q+3); ids
// >= V read as NaN. A warp-tile t of K1 / K2 is q0 = 256 t, J = 8; a K3 warp u is q0 = 64 u, J = 2.
template <bool kVec, int J>
__device__ __forceinline__ void load_groups(const float* __restrict__ row, int64_t V, int64_t q0, float (&v)[J][4]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < J; ++j) rowblock::load_quad<kVec>(row, V, q0 + j * 32 + lane, v[j]);
}

template <bool kVec>
__device__ __forceinline__ void load_tile(const float* __restrict__ row, int64_t V, int64_t t, float (&v)[8][4]) {
  load_groups<kVec, 8>(row, V, t * (kTile / 4), v);
}

// The lane's j-th group of warp-tile t.
__device__ __forceinline__ int64_t group_of(int64_t t, int j) { return t * (kTile / 4) + j * 32 + (threadIdx.x & 31); }

// Every lane ends with the same (value, id): ranks_above is a total order on distinct ids.
__device__ __forceinline__ void warp_argmax(float& v, int64_t& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ranks_above(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// The block's best (value, id). ranks_above is a total order on distinct ids, so the result does
// not depend on the order of the comparisons: the warps' results meet in a scan (NW <= 4) or
// in warp 0's shuffle tree (NW > 4: one step of five instead of a 32-long chain in every thread).
template <int NW>
__device__ __forceinline__ void block_argmax(float& v, int64_t& i, float* sv, int64_t* si) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_argmax(v, i);
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  if constexpr (NW > 4) {
    if (warp == 0) {
      float wv = lane < NW ? sv[lane] : __int_as_float(0x7fc00000);
      int64_t wi = lane < NW ? si[lane] : INT64_MAX;
      warp_argmax(wv, wi);
      if (lane == 0) {
        sv[0] = wv;
        si[0] = wi;
      }
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
  } else {
    v = sv[0];
    i = si[0];
    for (int w = 1; w < NW; ++w)
      if (ranks_above(sv[w], si[w], v, i)) {
        v = sv[w];
        i = si[w];
      }
  }
  __syncthreads();
}

// The row's max and its id from K1's tile stats (any order: a total order).
template <int NW>
__device__ __forceinline__ void row_max(const RowWs& w, int64_t T, float& m, int64_t& mi, float* sv, int64_t* si) {
  m = __int_as_float(0x7fc00000);
  mi = INT64_MAX;
  for (int64_t t = threadIdx.x; t < T; t += NW * 32) {
    const TileStat s = w.stat[t];
    if (ranks_above(s.m, s.id, m, mi)) {
      m = s.m;
      mi = s.id;
    }
  }
  block_argmax<NW>(m, mi, sv, si);
}

// Exclusive prefix sums of (a, b) over the block in thread order, and the totals. sa / sb: NW
// entries (NW + 1 when NW > 4).
template <int NW>
__device__ __forceinline__ void block_scan2(ull a, ull b, ull* ea, ull* eb, ull* ta, ull* tb, ull* sa, ull* sb) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  ull ia = a, ib = b;
  rowblock::warp_scan2(ia, ib);
  if (lane == 31) {
    sa[warp] = ia;
    sb[warp] = ib;
  }
  __syncthreads();
  ull pa = 0, pb = 0, qa = 0, qb = 0;
  if constexpr (NW > 4) {
    // Warp 0 scans the NW warp totals (integers: any order gives the same sums); slot NW holds
    // the block's totals (sa / sb have NW + 1 entries).
    if (warp == 0) {
      const ull wa = lane < NW ? sa[lane] : 0ull, wb = lane < NW ? sb[lane] : 0ull;
      ull xa = wa, xb = wb;
      rowblock::warp_scan2(xa, xb);
      __syncwarp();
      if (lane < NW) {
        sa[lane] = xa - wa;  // exclusive
        sb[lane] = xb - wb;
      }
      if (lane == 31) {
        sa[NW] = xa;
        sb[NW] = xb;
      }
    }
    __syncthreads();
    pa = sa[warp];
    pb = sb[warp];
    qa = sa[NW];
    qb = sb[NW];
  } else {
    for (int w = 0; w < NW; ++w) {
      if (w < warp) {
        pa += sa[w];
        pb += sb[w];
      }
      qa += sa[w];
      qb += sb[w];
    }
  }
  __syncthreads();
  *ea = pa + ia - a;
  *eb = pb + ib - b;
  *ta = qa;
  *tb = qb;
}

// K1: tile stats; zeroes the row's histogram and candidate counter.
template <bool kVec>
__global__ void __launch_bounds__(kSplitThreads)
    stats_kernel(const float* __restrict__ logits, int64_t V, int64_t stride, char* __restrict__ ws, int64_t T) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t r = blockIdx.x;
  const RowWs w = row_ws(ws, r, T);
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kSplitThreads + threadIdx.x; i < kBins;
       i += static_cast<int64_t>(gridDim.y) * kSplitThreads) {
    w.hcount[i] = 0;
    w.hmass[i] = 0;
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) {
    *w.cand_count = 0;
    *w.k2_done = 0;
  }
  const int64_t t = static_cast<int64_t>(blockIdx.y) * kTileWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const float* row = logits + r * stride;
  float v[8][4];
  load_tile<kVec>(row, V, t, v);
  // The max by an fmaxf tree (NaN is ignored: it ranks below everything; ids >= V read as
  // NaN), then the lowest id holding it (any id when the tile is all NaN): short dependency
  // chains, where a ranks_above scan would be one chain of 32 (latency-bound at small B).
  float mc[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    mc[c] = v[0][c];
#pragma unroll
    for (int j = 1; j < 8; ++j) mc[c] = fmaxf(mc[c], v[j][c]);
  }
  float mv = fmaxf(fmaxf(mc[0], mc[1]), fmaxf(mc[2], mc[3]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mv = fmaxf(mv, __shfl_xor_sync(0xffffffffu, mv, o));
  int lo_id = INT32_MAX;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t id = 4 * group_of(t, j) + c;
      if (id < V && (v[j][c] == mv || mv != mv)) lo_id = min(lo_id, static_cast<int>(id));
    }
  const int mi = __reduce_min_sync(0xffffffffu, lo_id);
  // sum exp(l - m_tile): four independent f64 chains, added in a fixed order.
  double sc[4] = {0.0, 0.0, 0.0, 0.0};
  if (mv == mv && mv != -INFINITY) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (v[j][c] == v[j][c]) sc[c] += static_cast<double>(expf(v[j][c] - mv));
  }
  double s = (sc[0] + sc[1]) + (sc[2] + sc[3]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) w.stat[t] = TileStat{mv, mi, s};
}

// The row's plan from its histogram (block-wide; every thread returns the same plan).
// Called by the last K2 block of a row with a top-k or top-p cut and a finite max.
__device__ RowPlan make_plan(const RowWs& w, const DeviceSamplingParams& P, bool k_on, bool p_on, RowPlan* sp,
                             ull* sa, ull* sb) {
  constexpr int kPer = kBins / kSplitThreads;
  const int b0 = threadIdx.x * kPer;
  unsigned c[kPer];
  ull ms[kPer];
  ull lc = 0, lm = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    c[i] = __ldcg(w.hcount + b0 + i);  // other blocks' atomics: from L2
    ms[i] = __ldcg(w.hmass + b0 + i);
    lc += c[i];
    lm += ms[i];
  }
  ull ec, em, tc, tm;
  block_scan2<kTileWarps>(lc, lm, &ec, &em, &tc, &tm, sa, sb);
  // top-k at or above the non-NaN count keeps every id that can win: no cut.
  const bool k_eff = k_on && static_cast<ull>(P.top_k) < tc;
  const int32_t mode = k_eff ? (p_on ? kModeKP : kModeK) : (p_on ? kModeP : kModeAll);
  if (threadIdx.x == 0) *sp = RowPlan{mode == kModeAll ? kModeAll : kModeFallback, kBins, -1, 0, 0, 0, 0};
  __syncthreads();
  // K2 weighs the bins only for top-p alone (mass_by_bin); a row with top-k at or above its
  // non-NaN count and top-p has no weights: the fallback (rows of NaN logits only).
  if (mode != kModeAll && !(mode == kModeP && k_on)) {
    // The cut bin: the first whose inclusive count (top-k) or weight (top-p alone) reaches
    // the target; exactly one thread's range holds it.
    const bool by_mass = mode == kModeP;
    const ull tgt = by_mass ? sampling::top_p_target(P.top_p, tm) : static_cast<ull>(P.top_k);
    const ull ev = by_mass ? em : ec, lv = by_mass ? lm : lc;
    if (ev + lv >= tgt && (threadIdx.x == 0 || ev < tgt)) {
      ull ac = ec, am = em;
      int b = -1;
      for (int i = 0; i < kPer; ++i) {
        if ((by_mass ? am + ms[i] : ac + c[i]) >= tgt) {
          b = b0 + i;
          break;
        }
        ac += c[i];
        am += ms[i];
      }
      if (b >= 0) {
        RowPlan p{mode, 0, b, 0, 0, 0, 0};
        if (mode == kModeKP) {
          p.n = static_cast<uint32_t>(ac + c[b - b0]);  // every id in bins 0..b
        } else {
          p.b_sure = b;
          p.n = c[b - b0];
          p.count_above = ac;
          p.mass_above = am;
          p.target = tgt;
        }
        if (p.n > static_cast<uint32_t>(kCap)) p.mode = kModeFallback;
        *sp = p;
      }
    }
  }
  __syncthreads();
  return *sp;
}

// K2: the histogram of a row with a top-k or top-p cut.
template <bool kVec>
__global__ void __launch_bounds__(kSplitThreads)
    hist_kernel(const float* __restrict__ logits, int64_t V, int64_t stride,
                const DeviceSamplingParams* __restrict__ params, char* __restrict__ ws, int64_t T) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  // Counts, and the integer weights (<= 2^40) as three 14-bit-or-less pieces in 32-bit bins:
  // a block sums <= 4096 ids, so no piece overflows (2^12 * 2^14 < 2^32), and 32-bit shared
  // atomics are native where 64-bit adds are compare-and-swap loops.
  __shared__ unsigned hc[kBins], h2[kBins], h1[kBins], h0[kBins];
  static_assert(kTileWarps * kTile <= 4096, "weight pieces would overflow");
  __shared__ float sv[kTileWarps];
  __shared__ int64_t si[kTileWarps];
  __shared__ ull sa[kTileWarps], sb[kTileWarps];
  __shared__ RowPlan splan;
  __shared__ bool last;
  const int64_t r = blockIdx.x;
  const DeviceSamplingParams P = params[r];
  if (sampling::greedy(P)) return;
  const bool k_on = sampling::top_k_on(P, V), p_on = sampling::top_p_on(P);
  if (!k_on && !p_on) return;
  // The warp's tile, loaded beside the tile stats row_max reads (neither depends on the other).
  const int64_t t = static_cast<int64_t>(blockIdx.y) * kTileWarps + (threadIdx.x >> 5);
  float v[8][4];
  if (t < T) load_tile<kVec>(logits + r * stride, V, t, v);
  const RowWs w = row_ws(ws, r, T);
  float m;
  int64_t mi;
  row_max<kTileWarps>(w, T, m, mi, sv, si);
  if (!isfinite(m)) return;  // K3 plans the fallback
  const float inv_t = 1.0f / P.temperature;
  // Weights per bin only where the plan cuts by weight (top-p without top-k): with top-k the cut
  // is by count and K4 weighs the candidates itself.
  const bool mass_by_bin = p_on && !k_on;
  for (int i = threadIdx.x; i < kBins; i += kSplitThreads) {
    hc[i] = 0;
    if (mass_by_bin) h2[i] = h1[i] = h0[i] = 0;
  }
  __syncthreads();
  if (t < T) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float x = v[j][c];
        if (4 * group_of(t, j) + c < V && x == x) {
          const int b = bin_of(x, m);
          atomicAdd(&hc[b], 1u);
          if (mass_by_bin) {
            const ull wt = sampling::fixed_weight(expf((x - m) * inv_t));
            const unsigned p2 = static_cast<unsigned>(wt >> 28), p1 = static_cast<unsigned>(wt >> 14) & 0x3fffu,
                           p0 = static_cast<unsigned>(wt) & 0x3fffu;
            if (p2) atomicAdd(&h2[b], p2);
            if (p1) atomicAdd(&h1[b], p1);
            if (p0) atomicAdd(&h0[b], p0);
          }
        }
      }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += kSplitThreads) {
    if (hc[i]) atomicAdd(&w.hcount[i], hc[i]);
    if (mass_by_bin) {
      const ull mass = (static_cast<ull>(h2[i]) << 28) + (static_cast<ull>(h1[i]) << 14) + h0[i];
      if (mass) atomicAdd(&w.hmass[i], mass);
    }
  }
  // The last block of the row to finish makes the plan (CUDA samples' threadFenceReduction).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(w.k2_done, 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const RowPlan pl = make_plan(w, P, k_on, p_on, &splan, sa, sb);
  if (threadIdx.x == 0) *w.plan = pl;
}

// K3: the surely-kept ids' best Gumbel score per warp of kSub logits, and the candidates.
template <bool kVec>
__global__ void __launch_bounds__(kSplitThreads)
    scan_kernel(const float* __restrict__ logits, int64_t V, int64_t stride,
                const DeviceSamplingParams* __restrict__ params, char* __restrict__ ws, int64_t T) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ float sv[kTileWarps];
  __shared__ int64_t si[kTileWarps];
  const int64_t r = blockIdx.x;
  const DeviceSamplingParams P = params[r];
  if (sampling::greedy(P)) return;
  const RowWs w = row_ws(ws, r, T);
  // The warp's logits and K2's plan, loaded beside the tile stats row_max reads (none depends on
  // another; ids >= V read as NaN).
  const int64_t u = static_cast<int64_t>(blockIdx.y) * kTileWarps + (threadIdx.x >> 5);
  float v[2][4];
  load_groups<kVec, 2>(logits + r * stride, V, u * (kSub / 4), v);
  const RowPlan k2_plan = *w.plan;
  float m;
  int64_t mi;
  row_max<kTileWarps>(w, T, m, mi, sv, si);
  if (m != m) return;  // every logit NaN: K4 returns the argmax
  const bool k_on = sampling::top_k_on(P, V), p_on = sampling::top_p_on(P);
  RowPlan pl{kModeAll, kBins, -1, 0, 0, 0, 0};
  if (k_on || p_on) {
    if (isfinite(m)) pl = k2_plan;  // K2's last block
    else pl.mode = kModeFallback;
  }
  if (!((k_on || p_on) && isfinite(m)) && blockIdx.y == 0 && threadIdx.x == 0) *w.plan = pl;
  if (pl.mode == kModeFallback) return;
  if (4 * u * (kSub / 4) >= V) return;
  const float inv_t = 1.0f / P.temperature;
  const bool mp_on = sampling::min_p_on(P), all = pl.mode == kModeAll;
  const float min_p = sampling::min_p_value(P);
  float bv = __int_as_float(0x7fc00000);
  int64_t bi = INT64_MAX;
  // No cut: every id needs its draw (computed up front, independent: ILP across the groups).
  sampling::Philox4 rnd[2];
  if (all) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      rnd[j] = sampling::draw_group(P.seed, P.counter, static_cast<uint32_t>(u * (kSub / 4) + j * 32 + (threadIdx.x & 31)));
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t q = u * (kSub / 4) + j * 32 + (threadIdx.x & 31);
    bool have = all;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t id = 4 * q + c;
      const float x = v[j][c];
      if (id >= V) continue;
      if (!all) {
        if (x != x) continue;
        const int b = bin_of(x, m);
        if (b > pl.b_cand) continue;
        if (b >= pl.b_sure) {
          const unsigned k = atomicAdd(w.cand_count, 1u);
          if (k < static_cast<unsigned>(kCap)) w.cand[k] = cand_key(x, id);
          continue;
        }
      }
      const float s = (x - m) * inv_t;
      if (mp_on && !(expf(s) >= min_p)) continue;  // only kept ids compete
      if (!have) {
        rnd[j] = sampling::draw_group(P.seed, P.counter, static_cast<uint32_t>(q));
        have = true;
      }
      const float score = s + sampling::gumbel(rnd[j].v[c]);
      if (ranks_above(score, id, bv, bi)) {
        bv = score;
        bi = id;
      }
    }
  }
  warp_argmax(bv, bi);
  if ((threadIdx.x & 31) == 0) w.best[u] = TileBest{bv, bi == INT64_MAX ? INT32_MAX : static_cast<int32_t>(bi)};
}

// Bitonic sort, descending, of the block's keys in registers: thread t holds positions t
// (x[0]) and t + 1024 (x[1], used when N > 1024); N a power of two in [64, 2048]. Distances
// below 32 exchange through warp shuffles, larger ones through a (shared memory, two
// barriers); positions >= N sort among themselves (pads).
__device__ void bitonic_desc(ull (&x)[2], int N, ull* a) {
  const int t = threadIdx.x;
  const bool two = N > kFinalThreads;
  for (int k = 2; k <= N; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      ull y0, y1 = 0;
      if (j == kFinalThreads) {
        y0 = x[1];
        y1 = x[0];
      } else if (j >= 32) {
        a[t] = x[0];
        if (two) a[t + kFinalThreads] = x[1];
        __syncthreads();
        y0 = a[t ^ j];
        if (two) y1 = a[(t + kFinalThreads) ^ j];
        __syncthreads();
      } else {
        y0 = __shfl_xor_sync(0xffffffffu, x[0], j);
        if (two) y1 = __shfl_xor_sync(0xffffffffu, x[1], j);
      }
      // Position i keeps the larger key when it is the lower index of its pair in a
      // descending run, or the upper index in an ascending one.
      {
        const int i = t;
        const bool keep_max = ((i & k) == 0) == ((i & j) == 0);
        x[0] = keep_max ? (x[0] > y0 ? x[0] : y0) : (x[0] < y0 ? x[0] : y0);
      }
      if (two) {
        const int i = t + kFinalThreads;
        const bool keep_max = ((i & k) == 0) == ((i & j) == 0);
        x[1] = keep_max ? (x[1] > y1 ? x[1] : y1) : (x[1] < y1 ? x[1] : y1);
      }
    }
}

struct FinalSmem {
  union {
    rowblock::Smem legacy;
    ull keys[kCap];
  } u;
  float sv[kFinalWarps];
  int64_t si[kFinalWarps];
  double sd[kFinalWarps];
  ull sa[kFinalWarps + 1], sb[kFinalWarps + 1];  // block_scan2: the warps' prefixes, then the totals
  ull zk;
};

// K4: one block per row: logprob, then the token.
template <bool kVec>
__global__ void __launch_bounds__(kFinalThreads, 1)
    final_kernel(const float* __restrict__ logits, int64_t V, int64_t stride,
                 const DeviceSamplingParams* __restrict__ params, int32_t* __restrict__ tokens,
                 float* __restrict__ logprobs, char* __restrict__ ws, int64_t T) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ FinalSmem sm;
  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x;
  const RowWs w = row_ws(ws, r, T);
  const float* row = logits + r * stride;
  const int64_t U = (V + kSub - 1) / kSub;
  // Every load that depends on nothing else here, issued together (one round trip to L2 instead
  // of a chain of them): the row's parameters, this thread's first tile stat and tile best, the
  // plan, the candidate count and this thread's two candidate slots (stale beyond the count:
  // unused). What a row does not use (a greedy row's plan) is read and ignored.
  const DeviceSamplingParams P = params[r];
  TileStat st0{};
  if (tid < T) st0 = w.stat[tid];
  TileBest b0{};
  if (tid < U) b0 = w.best[tid];
  const RowPlan pl0 = *w.plan;
  const unsigned cand_count = *w.cand_count;
  const ull c0 = w.cand[tid], c1 = w.cand[tid + kFinalThreads];
  auto stat = [&](int64_t t) { return t == tid ? st0 : w.stat[t]; };
  // The row's max and its id (row_max, from the loads above).
  float m = __int_as_float(0x7fc00000);
  int64_t mi = INT64_MAX;
  for (int64_t t = tid; t < T; t += kFinalThreads) {
    const TileStat st = stat(t);
    if (ranks_above(st.m, st.id, m, mi)) {
      m = st.m;
      mi = st.id;
    }
  }
  block_argmax<kFinalWarps>(m, mi, sm.sv, sm.si);
  int64_t token = mi == INT64_MAX ? 0 : mi;
  if (logprobs) {
    // sum_t sum_t * exp(m_t - m) in f64, tiles in a fixed order (warp sums here, thread 0
    // adds them in warp order at the end).
    double s = 0.0;
    for (int64_t t = tid; t < T; t += kFinalThreads) {
      const TileStat st = stat(t);
      if (st.sum > 0.0) s += st.sum * exp(static_cast<double>(st.m) - static_cast<double>(m));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) sm.sd[threadIdx.x >> 5] = s;
    __syncthreads();
  }
  if (!sampling::greedy(P) && m == m) {
    const RowPlan pl = pl0;
    if (pl.mode == kModeFallback) {
      float m2;
      double unused;
      token = rowblock::sample_row<kVec>(sm.u.legacy, row, V, P, false, &m2, &unused);
    } else {
      float bv = __int_as_float(0x7fc00000);
      int64_t bi = INT64_MAX;
      for (int64_t t = tid; t < U; t += kFinalThreads) {
        const TileBest b = t == tid ? b0 : w.best[t];
        const int64_t id = b.id == INT32_MAX ? INT64_MAX : b.id;
        if (ranks_above(b.score, id, bv, bi)) {
          bv = b.score;
          bi = id;
        }
      }
      const int n = static_cast<int>(min(min(pl.n, cand_count), static_cast<unsigned>(kCap)));
      if (pl.mode != kModeAll && n > 0) {
        int N = 64;
        while (N < n) N <<= 1;
        const int t = threadIdx.x;
        ull x[2];
        x[0] = t < n ? c0 : 0ull;
        x[1] = t + kFinalThreads < n ? c1 : 0ull;
        bitonic_desc(x, N, sm.u.keys);
        // Thread t now holds sorted positions t and t + 1024.
        const float inv_t = 1.0f / P.temperature;
        float s[2];
        ull wt[2];
        int64_t id[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = t + e * kFinalThreads;
          wt[e] = 0;
          s[e] = 0.0f;
          id[e] = 0;
          if (j < n) {
            id[e] = static_cast<int64_t>(0xffffffffull - (x[e] & 0xffffffffull));
            s[e] = (sampling::key_float(static_cast<uint32_t>(x[e] >> 32)) - m) * inv_t;
            wt[e] = sampling::fixed_weight(expf(s[e]));
          }
        }
        // Exclusive prefix weights in position order: positions < 1024 first.
        ull e0, e1, t0, t1;
        block_scan2<kFinalWarps>(wt[0], wt[1], &e0, &e1, &t0, &t1, sm.sa, sm.sb);
        const ull excl[2] = {e0, t0 + e1};
        const bool k_rule = pl.mode == kModeK || pl.mode == kModeKP;
        const bool p_rule = pl.mode == kModeP || pl.mode == kModeKP;
        ull target = pl.target;
        if (pl.mode == kModeKP) {
          // Top-p applies to the top-k weight: the candidates are every id of bins 0..b_cand,
          // at least top_k of them.
          const int last = min(n, P.top_k) - 1;
          if (t == last % kFinalThreads) sm.zk = last < kFinalThreads ? excl[0] + wt[0] : excl[1] + wt[1];
          __syncthreads();
          target = sampling::top_p_target(P.top_p, sm.zk);
        }
        const bool mp_on = sampling::min_p_on(P);
        const float min_p = sampling::min_p_value(P);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = t + e * kFinalThreads;
          if (j < n) {
            const ull rank = pl.count_above + static_cast<ull>(j);
            bool kept = !k_rule || rank < static_cast<ull>(P.top_k);
            if (p_rule && !(rank == 0 || pl.mass_above + excl[e] < target)) kept = false;
            if (mp_on && !(expf(s[e]) >= min_p)) kept = false;
            if (kept) {
              const sampling::Philox4 rnd =
                  sampling::draw_group(P.seed, P.counter, static_cast<uint32_t>(id[e] >> 2));
              const float score = s[e] + sampling::gumbel(rnd.v[id[e] & 3]);
              if (ranks_above(score, id[e], bv, bi)) {
                bv = score;
                bi = id[e];
              }
            }
          }
        }
      }
      block_argmax<kFinalWarps>(bv, bi, sm.sv, sm.si);
      if (bi != INT64_MAX) token = bi;  // none kept (an infinite max): the argmax, as the host reference
    }
  }
  if (threadIdx.x == 0) {
    tokens[r] = static_cast<int32_t>(token);
    if (logprobs) {
      double lse = 0.0;
      for (int i = 0; i < kFinalWarps; ++i) lse += sm.sd[i];
      // The argmax's logit is m (a +-0 aside, which changes nothing here): no load.
      const float lt = token == mi ? m : row[token];
      logprobs[r] = static_cast<float>(static_cast<double>(lt) - static_cast<double>(m) - log(lse));
    }
  }
}

Status check_args(const char* what, const float* logits, int64_t B, int64_t V, const DeviceSamplingParams* params,
                  const int32_t* tokens) {
  if (B < 0 || B > INT32_MAX || V <= 0 || V > INT32_MAX)
    return invalid_argument("{}: bad shape B={} V={}", what, B, V);
  if (B > 0 && (!logits || !params || !tokens)) return invalid_argument("{}: null pointer", what);
  return ok_status();
}

}  // namespace

size_t argmax_rows_workspace_bytes(int64_t B, int64_t V) {
  if (B <= 0 || V <= 0) return 0;
  return static_cast<size_t>(B) * static_cast<size_t>((V + kArgTile - 1) / kArgTile) * sizeof(ull);
}

Status argmax_rows(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t B, int64_t V,
                         int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (B < 0 || B > 65535 || V <= 0 || V > INT32_MAX || a_stride < V || (b != nullptr && b_stride < V))
    return invalid_argument("argmax_rows: bad shape B={} V={} strides {} {}", B, V, a_stride, b_stride);
  if (B == 0) return ok_status();
  if (!a || !out || !workspace) return invalid_argument("argmax_rows: null pointer");
  if (workspace_bytes < argmax_rows_workspace_bytes(B, V) || reinterpret_cast<uintptr_t>(workspace) % 8 != 0)
    return invalid_argument("argmax_rows: workspace of {} bytes, {} needed (8-byte aligned)", workspace_bytes,
                            argmax_rows_workspace_bytes(B, V));
  const auto al = [](const float* p, int64_t stride) {
    return p == nullptr || (reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride % 4 == 0);
  };
  const bool vec = V % 4 == 0 && al(a, a_stride) && al(b, b_stride);
  const int tiles = static_cast<int>((V + kArgTile - 1) / kArgTile);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(B));
  ull* part = static_cast<ull*>(workspace);
  if (vec)
    launch_kernel(argmax_tile_kernel<true>, grid, kArgThreads, 0, stream, a, a_stride, b, b_stride, V, part);
  else
    launch_kernel(argmax_tile_kernel<false>, grid, kArgThreads, 0, stream, a, a_stride, b, b_stride, V, part);
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "argmax_tile_kernel"));
  launch_kernel(argmax_final_kernel, static_cast<unsigned>(B), 32, 0, stream, static_cast<const ull*>(part), tiles, out);
  return cuda_status(cudaGetLastError(), "argmax_final_kernel");
}

bool needs_kept_cut(const DeviceSamplingParams& p, int64_t V) {
  return !sampling::greedy(p) && (sampling::top_k_on(p, V) || sampling::top_p_on(p));
}

namespace {
// draft_rows' workspace: DraftWs's tiles (28 B each), then 16-byte aligned, a KeptCut a row.
size_t draft_tiles_bytes(int64_t B, int64_t V) {
  return (static_cast<size_t>(B) * static_cast<size_t>((V + kArgTile - 1) / kArgTile) * 28 + 15) & ~size_t{15};
}
}  // namespace

size_t draft_rows_workspace_bytes(int64_t B, int64_t V) {
  if (B <= 0 || V <= 0) return 0;
  return draft_tiles_bytes(B, V) + static_cast<size_t>(B) * sizeof(rowblock::KeptCut);
}

Status draft_rows(const float* logits, int64_t B, int64_t V, const DeviceSamplingParams* params, int32_t* ids,
                  float* probs, void* workspace, size_t workspace_bytes, cudaStream_t stream, bool cuts) {
  if (B < 0 || B > 65535 || V <= 0 || V > INT32_MAX) return invalid_argument("draft_rows: bad shape B={} V={}", B, V);
  if (B == 0) return ok_status();
  if (!logits || !params || !ids || !probs || !workspace) return invalid_argument("draft_rows: null pointer");
  if (workspace_bytes < draft_rows_workspace_bytes(B, V) || reinterpret_cast<uintptr_t>(workspace) % 8 != 0)
    return invalid_argument("draft_rows: workspace of {} bytes, {} needed (8-byte aligned)", workspace_bytes,
                            draft_rows_workspace_bytes(B, V));
  const int tiles = static_cast<int>((V + kArgTile - 1) / kArgTile);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(B));
  const DraftWs w = draft_ws(workspace, B, tiles);
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  if (vec)
    launch_kernel(argmax_tile_kernel<true>, grid, kArgThreads, 0, stream, logits, V, nullptr, int64_t{0}, V, w.keys);
  else
    launch_kernel(argmax_tile_kernel<false>, grid, kArgThreads, 0, stream, logits, V, nullptr, int64_t{0}, V, w.keys);
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "draft_rows argmax_tile_kernel"));
  rowblock::KeptCut* cut = nullptr;
  if (cuts) {
    cut = reinterpret_cast<rowblock::KeptCut*>(static_cast<char*>(workspace) + draft_tiles_bytes(B, V));
    if (vec)
      launch_kernel(draft_cut_kernel<true>, static_cast<unsigned>(B), rowblock::kThreads, 0, stream, logits, V, params, cut);
    else
      launch_kernel(draft_cut_kernel<false>, static_cast<unsigned>(B), rowblock::kThreads, 0, stream, logits, V, params, cut);
    ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "draft_cut_kernel"));
  }
  launch_kernel(draft_esum_kernel, grid, kArgThreads, 0, stream, logits, V, params, workspace,
                static_cast<const rowblock::KeptCut*>(cut));
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "draft_esum_kernel"));
  launch_kernel(draft_probs_kernel, grid, kArgThreads, 0, stream, logits, V, params, probs, workspace,
                static_cast<const rowblock::KeptCut*>(cut));
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "draft_probs_kernel"));
  launch_kernel(draft_draw_kernel, static_cast<unsigned>(B), 32, 0, stream, static_cast<const float*>(probs), V, params,
                ids, workspace, tiles);
  return cuda_status(cudaGetLastError(), "draft_draw_kernel");
}

bool verify_rows_supported(const DeviceSamplingParams& p, int64_t) { return !sampling::greedy(p); }

size_t verify_rows_workspace_bytes(int64_t rows) {
  return rows > 0 ? static_cast<size_t>(rows) * sizeof(rowblock::KeptCut) : 0;
}

Status verify_rows(const float* logits, int64_t V, const float* q, const int32_t* drafts, const VerifySeq* seqs,
                   int64_t n, int max_k, int32_t* tokens, float* logprobs, int32_t* accepted, void* workspace,
                   size_t workspace_bytes, int64_t rows, cudaStream_t stream) {
  if (n < 0 || n > 65535 || V <= 0 || V > INT32_MAX || max_k < 0 || max_k > 65534 || rows < 0)
    return invalid_argument("verify_rows: bad shape n={} V={} max_k={} rows={}", n, V, max_k, rows);
  if (n == 0) return ok_status();
  if (!logits || !drafts || !seqs || !tokens || !logprobs || !accepted || !workspace)
    return invalid_argument("verify_rows: null pointer");
  if (workspace_bytes < verify_rows_workspace_bytes(rows) || reinterpret_cast<uintptr_t>(workspace) % 8 != 0)
    return invalid_argument("verify_rows: workspace of {} bytes, {} needed (8-byte aligned)", workspace_bytes,
                            verify_rows_workspace_bytes(rows));
  auto* cuts = static_cast<rowblock::KeptCut*>(workspace);
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(max_k + 1));
  if (V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0)
    launch_kernel(verify_cut_kernel<true>, grid, rowblock::kThreads, 0, stream, logits, V, seqs, cuts);
  else
    launch_kernel(verify_cut_kernel<false>, grid, rowblock::kThreads, 0, stream, logits, V, seqs, cuts);
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "verify_cut_kernel"));
  launch_kernel(verify_rows_kernel, static_cast<unsigned>(n), kVerifyThreads, 0, stream, logits, V, q, drafts, seqs,
                tokens, logprobs, accepted, static_cast<const rowblock::KeptCut*>(cuts));
  return cuda_status(cudaGetLastError(), "verify_rows_kernel");
}

Status sample_rows(const float* logits, int64_t B, int64_t V, const DeviceSamplingParams* params, int32_t* tokens,
                   float* logprobs, cudaStream_t stream, int64_t row_stride) {
  ML4_RETURN_IF_ERROR(check_args("sample_rows", logits, B, V, params, tokens));
  if (B == 0) return ok_status();
  const int64_t stride = row_stride < 0 ? V : row_stride;
  const bool vec = V % 4 == 0 && stride % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  if (vec)
    launch_kernel(row_kernel<true>, static_cast<unsigned>(B), rowblock::kThreads, 0, stream, logits, V, stride, params,
                  tokens, logprobs);
  else
    launch_kernel(row_kernel<false>, static_cast<unsigned>(B), rowblock::kThreads, 0, stream, logits, V, stride, params,
                  tokens, logprobs);
  return cuda_status(cudaGetLastError(), "sample_rows row_kernel");
}

size_t sample_rows_workspace_bytes(int64_t B, int64_t V) {
  if (B <= 0 || V <= 0) return 0;
  return static_cast<size_t>(B) * row_ws_bytes((V + kTile - 1) / kTile);
}

namespace {
template <bool kVec>
Status launch_split(const float* logits, int64_t B, int64_t V, int64_t stride, const DeviceSamplingParams* params,
                    int32_t* tokens, float* logprobs, char* ws, cudaStream_t stream) {
  const int64_t T = (V + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(B), static_cast<unsigned>((T + kTileWarps - 1) / kTileWarps));
  launch_kernel(stats_kernel<kVec>, grid, kSplitThreads, 0, stream, logits, V, stride, ws, T);
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "sample_rows stats_kernel"));
  launch_kernel(hist_kernel<kVec>, grid, kSplitThreads, 0, stream, logits, V, stride, params, ws, T);
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "sample_rows hist_kernel"));
  const int64_t U = (V + kSub - 1) / kSub;
  const dim3 grid3(static_cast<unsigned>(B), static_cast<unsigned>((U + kTileWarps - 1) / kTileWarps));
  launch_kernel(scan_kernel<kVec>, grid3, kSplitThreads, 0, stream, logits, V, stride, params, ws, T);
  ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "sample_rows scan_kernel"));
  launch_kernel(final_kernel<kVec>, static_cast<unsigned>(B), kFinalThreads, 0, stream, logits, V, stride, params,
                tokens, logprobs, ws, T);
  return cuda_status(cudaGetLastError(), "sample_rows final_kernel");
}
}  // namespace

Status sample_rows(const float* logits, int64_t B, int64_t V, const DeviceSamplingParams* params, int32_t* tokens,
                   float* logprobs, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   int64_t row_stride) {
  ML4_RETURN_IF_ERROR(check_args("sample_rows", logits, B, V, params, tokens));
  if (B == 0) return ok_status();
  const size_t need = sample_rows_workspace_bytes(B, V);
  if (!workspace || workspace_bytes < need || reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return invalid_argument("sample_rows: workspace {} B at {} (need {} B, 256-aligned)", workspace_bytes,
                            workspace, need);
  if ((V + kSub - 1) / kSub > 65535LL * kTileWarps) return invalid_argument("sample_rows: V={} too large", V);
  const int64_t stride = row_stride < 0 ? V : row_stride;
  const bool vec = V % 4 == 0 && stride % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  char* ws = static_cast<char*>(workspace);
  return vec ? launch_split<true>(logits, B, V, stride, params, tokens, logprobs, ws, stream)
             : launch_split<false>(logits, B, V, stride, params, tokens, logprobs, ws, stream);
}

namespace {
// One thread per mask word: the word's 32 logits get -inf where its bits are clear.
__global__ void bitmask_kernel(float* __restrict__ logits, int64_t V, int64_t stride, int64_t words,
                               const uint32_t* __restrict__ allowed) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t r = blockIdx.x;
  const int64_t w = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (w >= words) return;
  uint32_t clear = ~allowed[r * words + w];
  if (clear == 0u) return;
  float* row = logits + r * stride;
  const int64_t base = w * 32;
  while (clear != 0u) {
    const int b = __ffs(clear) - 1;
    clear &= clear - 1u;
    if (base + b < V) row[base + b] = -INFINITY;
  }
}
}  // namespace

Status apply_token_bitmask(float* logits, int64_t B, int64_t V, const uint32_t* allowed, cudaStream_t stream,
                           int64_t row_stride) {
  if (B < 0 || B > 65535LL * 1024 || V <= 0 || V > INT32_MAX)
    return invalid_argument("apply_token_bitmask: bad shape B={} V={}", B, V);
  if (B == 0) return ok_status();
  if (!logits || !allowed) return invalid_argument("apply_token_bitmask: null pointer");
  const int64_t stride = row_stride < 0 ? V : row_stride;
  if (stride < V) return invalid_argument("apply_token_bitmask: row stride {} < V {}", stride, V);
  const int64_t words = (V + 31) / 32;
  const dim3 grid(static_cast<unsigned>(B), static_cast<unsigned>((words + 255) / 256));
  launch_kernel(bitmask_kernel, grid, 256, 0, stream, logits, V, stride, words, allowed);
  return cuda_status(cudaGetLastError(), "apply_token_bitmask");
}

Status sample_rows_split_plans(const void* workspace, int64_t B, int64_t V, SplitPlan* plans) {
  if (B <= 0 || V <= 0 || !workspace || !plans) return invalid_argument("sample_rows_split_plans: bad arguments");
  static_assert(static_cast<int32_t>(SplitPlan::kFallback) == kModeFallback, "plan codes");
  const size_t rb = row_ws_bytes((V + kTile - 1) / kTile);
  for (int64_t b = 0; b < B; ++b)
    ML4_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(plans + b, static_cast<const char*>(workspace) + b * rb + 16, 4, cudaMemcpyDeviceToHost));
  return ok_status();
}

}  // namespace ml4::cuda
