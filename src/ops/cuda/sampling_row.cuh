// The one-block-per-row sampler (1024 threads stream a whole row of logits; see sampling.h
// "Fallback"): radix select by count and by integer weight over order-preserving keys, a
// tie-cut pass and a Gumbel-max pass. Exact for any row; slow (each radix pass is a chain of
// block-wide histogram rounds over 131072 logits: ~0.2 ms per pass on an H200). Used by
// sample_rows without a workspace, and by the multi-block path's final kernel for the rows
// whose candidate set cannot be proven small (sampling.cu). Included by sampling.cu only.
#pragma once

#include <cstdint>

#include "ops/cpu/sampling.h"

namespace ml4::cuda::rowblock {

using sampling::ranks_above;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBins = 2048;  // 11-bit digits
constexpr int kPasses = 3;
__constant__ int kShift[kPasses] = {21, 10, 0};
__constant__ int kBits[kPasses] = {11, 11, 10};

using ull = unsigned long long;

struct Smem {
  uint32_t count[kMaxBins];
  ull mass[kMaxBins];
  float red_v[kWarps];
  int64_t red_i[kWarps];
  double red_d[kWarps];
  ull red_u[kWarps];
  int64_t red_s[kWarps];
  // radix-select state, written by warp 0
  uint32_t prefix;
  ull target;
  ull mass_above;
  uint32_t ties;
  uint32_t take;
  ull bin_mass;
  int64_t id_cut;
};

// The cut: keep keys above `key`, and the `take` lowest ids among the `ties` equal to it.
struct Cut {
  uint32_t key;
  uint32_t take;
  uint32_t ties;
  ull mass;  // integer weight of the kept prefix
};

// Inclusive prefix sums of (a, b) over the warp's lanes, in lane order (integers: exact).
__device__ __forceinline__ void warp_scan2(ull& a, ull& b) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const ull ya = __shfl_up_sync(0xffffffffu, a, o), yb = __shfl_up_sync(0xffffffffu, b, o);
    if (lane >= o) {
      a += ya;
      b += yb;
    }
  }
}

// The 4 logits of group q (ids [4q, 4q + 4)); ids >= V read as NaN. kVec: one float4 load
// (the caller checked the row's alignment and V).
template <bool kVec>
__device__ __forceinline__ void load_quad(const float* __restrict__ row, int64_t V, int64_t q, float (&v)[4]) {
  if (kVec) {
    if (q < ((V + 3) >> 2)) {
      const float4 t = __ldg(reinterpret_cast<const float4*>(row) + q);
      v[0] = t.x;
      v[1] = t.y;
      v[2] = t.z;
      v[3] = t.w;
    } else {
      v[0] = v[1] = v[2] = v[3] = __int_as_float(0x7fc00000);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = 4 * q + j < V ? __ldg(row + 4 * q + j) : __int_as_float(0x7fc00000);
  }
}

// Calls f(v[4], q) for groups q of 4 ids [4q, 4q + 4), with every thread of the block taking
// the same number of trips (warp-collective code inside f sees full warps). Ids >= V hold NaN
// and must be skipped by f. kUnroll groups are loaded before any is processed: one block
// streams a whole row, so its loads in flight (1024 x 4 x 16 B) set its bandwidth.
constexpr int kUnroll = 4;
template <bool kVec, class F>
__device__ __forceinline__ void for_each_group(const float* __restrict__ row, int64_t V, F&& f) {
  const int64_t nq = (V + 3) >> 2;
  for (int64_t q0 = 0; q0 < nq; q0 += kUnroll * kThreads) {
    float v[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load_quad<kVec>(row, V, q0 + u * kThreads + threadIdx.x, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) f(v[u], q0 + u * kThreads + threadIdx.x);
  }
}

__device__ __forceinline__ void block_argmax(Smem& sm, float& v, int64_t& i) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ranks_above(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
  if (lane == 0) {
    sm.red_v[warp] = v;
    sm.red_i[warp] = i;
  }
  __syncthreads();
  v = sm.red_v[0];
  i = sm.red_i[0];
  for (int w = 1; w < kWarps; ++w)
    if (ranks_above(sm.red_v[w], sm.red_i[w], v, i)) {
      v = sm.red_v[w];
      i = sm.red_i[w];
    }
  __syncthreads();
}

// Block sum through one shared slot per warp (red: sm.red_d or sm.red_u), added in warp order.
template <typename T>
__device__ __forceinline__ T block_sum(T* red, T x) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if (lane == 0) red[warp] = x;
  __syncthreads();
  T t = 0;
  for (int w = 0; w < kWarps; ++w) t += red[w];
  __syncthreads();
  return t;
}

// Exclusive prefix sum over the block in thread order.
__device__ __forceinline__ int64_t block_exclusive_scan(Smem& sm, int64_t x) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) sm.red_s[warp] = incl;
  __syncthreads();
  int64_t before = 0;
  for (int w = 0; w < warp; ++w) before += sm.red_s[w];
  __syncthreads();
  return before + incl - x;
}

// Adds (1, w) to digit d's bin for every lane with `on`; lanes with equal digits are summed
// in registers first (the top digits of real logits are few: contention otherwise). All 32
// lanes must call. w <= 2^40 is summed as two 20-bit halves (32 lanes: < 2^25 each).
__device__ __forceinline__ void hist_add(Smem& sm, bool on, uint32_t d, ull w) {
  const unsigned grp = __match_any_sync(0xffffffffu, on ? d : 0xffffffffu);
  if (!on) return;
  const unsigned hi = __reduce_add_sync(grp, static_cast<unsigned>(w >> 20));
  const unsigned lo = __reduce_add_sync(grp, static_cast<unsigned>(w & 0xfffffull));
  if ((threadIdx.x & 31) == static_cast<unsigned>(__ffs(grp) - 1)) {
    atomicAdd(&sm.count[d], static_cast<uint32_t>(__popc(grp)));
    const ull tot = (static_cast<ull>(hi) << 20) + lo;
    if (tot) atomicAdd(&sm.mass[d], tot);
  }
}

// Radix select over the row in (key descending, id ascending) order: the shortest prefix
// whose count (by_mass false) or integer weight (true) reaches `target`.
template <bool kVec>
__device__ Cut radix_select(Smem& sm, const float* __restrict__ row, int64_t V, float m, float inv_t, bool by_mass,
                            ull target) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    sm.prefix = 0;
    sm.target = target;
    sm.mass_above = 0;
  }
  for (int p = 0; p < kPasses; ++p) {
    const int shift = kShift[p], bits = kBits[p], nb = 1 << bits;
    for (int b = threadIdx.x; b < nb; b += kThreads) {
      sm.count[b] = 0;
      sm.mass[b] = 0;
    }
    __syncthreads();
    const uint32_t prefix = sm.prefix;
    const int high = shift + bits;
    for_each_group<kVec>(row, V, [&](const float* v, int64_t q) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t key = sampling::order_key(v[j]);
        const bool on = 4 * q + j < V && (high >= 32 || (key >> high) == (prefix >> high));
        const ull w = on ? sampling::fixed_weight(expf((v[j] - m) * inv_t)) : 0ull;
        hist_add(sm, on, (key >> shift) & (nb - 1), w);
      }
    });
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane L owns bins [nb - (L + 1) * per, nb - L * per), walked from the top.
      const int per = nb / 32;
      const int top = nb - 1 - lane * per;
      ull c = 0, ms = 0;
      for (int b = top; b > top - per; --b) {
        c += sm.count[b];
        ms += sm.mass[b];
      }
      ull ci = c, mi = ms;
      warp_scan2(ci, mi);
      const ull total_c = __shfl_sync(0xffffffffu, ci, 31), total_m = __shfl_sync(0xffffffffu, mi, 31);
      ull tgt = sm.target;
      // Clamp (rounding cannot make the target exceed the total, but never select nothing).
      if (by_mass ? tgt > total_m : tgt > total_c) tgt = by_mass ? total_m : total_c;
      const bool reach = ci > 0 && (by_mass ? mi >= tgt : ci >= tgt);
      const unsigned ball = __ballot_sync(0xffffffffu, reach);
      const int f = ball ? __ffs(ball) - 1 : 31;
      if (lane == f) {
        ull ce = ci - c, me = mi - ms;
        int pick = top - per + 1;
        for (int b = top; b > top - per; --b) {
          const ull nc = ce + sm.count[b], nm = me + sm.mass[b];
          if (nc > 0 && (by_mass ? nm >= tgt : nc >= tgt)) {
            pick = b;
            break;
          }
          ce = nc;
          me = nm;
        }
        sm.prefix = prefix | (static_cast<uint32_t>(pick) << shift);
        sm.target = tgt - (by_mass ? me : ce);
        sm.mass_above += me;
        sm.ties = sm.count[pick];
        sm.bin_mass = sm.mass[pick];
      }
    }
    __syncthreads();
  }
  Cut cut;
  cut.key = sm.prefix;
  cut.ties = sm.ties;
  const ull w_t = cut.ties ? sm.bin_mass / cut.ties : 0;  // every tie has the same weight
  const ull rem = sm.target;
  ull take;
  if (!by_mass) take = rem;
  else take = w_t ? (rem + w_t - 1) / w_t : cut.ties;
  if (take < 1) take = 1;
  if (take > cut.ties) take = cut.ties;
  cut.take = static_cast<uint32_t>(take);
  cut.mass = sm.mass_above + take * w_t;
  __syncthreads();
  return cut;
}

// The id of the take-th lowest id whose key equals `key` (threads own contiguous id ranges).
__device__ int64_t tie_cut(Smem& sm, const float* __restrict__ row, int64_t V, uint32_t key, uint32_t take) {
  const int64_t chunk = (V + kThreads - 1) / kThreads;
  const int64_t lo = threadIdx.x * chunk, hi = min(V, lo + chunk);
  if (threadIdx.x == 0) sm.id_cut = INT64_MAX;  // read after the scan's barriers
  int64_t n = 0;
  for (int64_t i = lo; i < hi; ++i) n += sampling::order_key(row[i]) == key;
  const int64_t before = block_exclusive_scan(sm, n);
  if (before < take && take <= before + n) {
    int64_t need = take - before;
    for (int64_t i = lo; i < hi; ++i)
      if (sampling::order_key(row[i]) == key && --need == 0) {
        sm.id_cut = i;
        break;
      }
  }
  __syncthreads();
  const int64_t r = sm.id_cut;
  __syncthreads();
  return r;
}

// The kept prefix of a row under top-k / top-p (ranks (key descending, id ascending); the
// sampler's integer weights): keep keys above `key`, and ids <= id_cut among those equal to it.
// on false: no cut (every id kept, min-p aside).
struct KeptCut {
  bool on = false;
  uint32_t key = 0;
  int64_t id_cut = INT64_MAX;
  __device__ __forceinline__ bool keeps(float l, int64_t id) const {
    if (!on) return true;
    const uint32_t k = sampling::order_key(l);
    return k > key || (k == key && id <= id_cut);
  }
};

// Steps 3-5 of sample_row: the cut for a sampled row with max m (finite or not, not NaN).
// z_all: the row's integer weight total (needed when top-p is on without top-k).
template <bool kVec>
__device__ KeptCut kept_cut(Smem& sm, const float* __restrict__ row, int64_t V, const DeviceSamplingParams& P, float m,
                            float inv_t, bool k_on, bool p_on, ull z_all) {
  KeptCut kc;
  Cut cut{};
  ull zk = z_all;
  if (k_on) {
    cut = radix_select<kVec>(sm, row, V, m, inv_t, false, static_cast<ull>(P.top_k));
    kc.on = true;
    zk = cut.mass;
  }
  if (p_on) {
    const Cut cp = radix_select<kVec>(sm, row, V, m, inv_t, true, sampling::top_p_target(P.top_p, zk));
    if (!kc.on || cp.key > cut.key || (cp.key == cut.key && cp.take < cut.take)) cut = cp;
    kc.on = true;
  }
  kc.key = cut.key;
  if (kc.on && cut.take < cut.ties) kc.id_cut = tie_cut(sm, row, V, cut.key, cut.take);
  return kc;
}

// The integer weight total of a row (non-NaN ids), every thread gets it.
template <bool kVec>
__device__ ull weight_total(Smem& sm, const float* __restrict__ row, int64_t V, float m, float inv_t) {
  ull z = 0;
  for_each_group<kVec>(row, V, [&](const float* v, int64_t q) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * q + j < V && v[j] == v[j]) z += sampling::fixed_weight(expf((v[j] - m) * inv_t));
  });
  return block_sum(sm.red_u, z);
}

// The row's argmax (value and id; id INT64_MAX for an empty row), every thread gets it.
template <bool kVec>
__device__ void row_argmax(Smem& sm, const float* __restrict__ row, int64_t V, float* m, int64_t* id) {
  float mv = __int_as_float(0x7fc00000);
  int64_t mi = INT64_MAX;
  for_each_group<kVec>(row, V, [&](const float* v, int64_t q) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * q + j < V && ranks_above(v[j], 4 * q + j, mv, mi)) {
        mv = v[j];
        mi = 4 * q + j;
      }
  });
  block_argmax(sm, mv, mi);
  *m = mv;
  *id = mi;
}

// The top-k / top-p cut of a row as sample_row draws from it, alone (the drafter's sampled
// drafts and DSpark's verifier, sampling.cu): off for greedy rows, rows without top-k and
// top-p, and rows whose max is NaN. The same for every thread.
template <bool kVec>
__device__ KeptCut row_kept_cut(Smem& sm, const float* __restrict__ row, int64_t V, const DeviceSamplingParams& P) {
  const bool k_on = sampling::top_k_on(P, V), p_on = sampling::top_p_on(P);
  if (sampling::greedy(P) || (!k_on && !p_on)) return KeptCut{};
  float m;
  int64_t mi;
  row_argmax<kVec>(sm, row, V, &m, &mi);
  if (!(m == m)) return KeptCut{};
  const float inv_t = 1.0f / P.temperature;
  const ull z_all = p_on && !k_on ? weight_total<kVec>(sm, row, V, m, inv_t) : 0ull;
  return kept_cut<kVec>(sm, row, V, P, m, inv_t, k_on, p_on, z_all);
}

// Samples one row with the whole block (blockDim.x == kThreads). want_lse: also the f64
// sum_i exp(l_i - m) for the logprob. Returns the token (the argmax when greedy); *m_out
// and *lse_out get the row max and the sum (0 unless want_lse).
template <bool kVec>
__device__ int64_t sample_row(Smem& sm, const float* __restrict__ row, int64_t V, const DeviceSamplingParams& P,
                              bool want_lse, float* m_out, double* lse_out) {
  // 1. argmax
  float m;
  int64_t mi;
  row_argmax<kVec>(sm, row, V, &m, &mi);
  *m_out = m;
  int64_t token = mi == INT64_MAX ? 0 : mi;
  const bool sample = !sampling::greedy(P) && m == m;
  const float inv_t = sample ? 1.0f / P.temperature : 1.0f;
  const bool k_on = sample && sampling::top_k_on(P, V), p_on = sample && sampling::top_p_on(P);

  // 2. sums
  double lse_sum = 0.0;
  ull z_all = 0;
  if (want_lse || (p_on && !k_on)) {
    double s = 0.0;
    ull z = 0;
    for_each_group<kVec>(row, V, [&](const float* v, int64_t q) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (4 * q + j < V && v[j] == v[j]) {
          if (want_lse) s += static_cast<double>(expf(v[j] - m));
          if (p_on) z += sampling::fixed_weight(expf((v[j] - m) * inv_t));
        }
    });
    lse_sum = block_sum(sm.red_d, s);
    z_all = block_sum(sm.red_u, z);
  }
  *lse_out = lse_sum;

  if (sample) {
    // 3-5. the kept prefix
    const KeptCut cut = kept_cut<kVec>(sm, row, V, P, m, inv_t, k_on, p_on, z_all);
    // 6. Gumbel-max over the kept ids
    const bool mp_on = sampling::min_p_on(P);
    const float min_p = sampling::min_p_value(P);
    float bv = __int_as_float(0x7fc00000);
    int64_t bi = INT64_MAX;
    for_each_group<kVec>(row, V, [&](const float* v, int64_t q) {
      const sampling::Philox4 r = sampling::draw_group(P.seed, P.counter, static_cast<uint32_t>(q));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t id = 4 * q + j;
        if (id >= V) continue;
        bool kept = cut.keeps(v[j], id);
        const float s = (v[j] - m) * inv_t;
        if (mp_on && !(expf(s) >= min_p)) kept = false;
        if (!kept) continue;  // only kept ids compete (as the host reference)
        const float score = s + sampling::gumbel(r.v[j]);
        if (ranks_above(score, id, bv, bi)) {
          bv = score;
          bi = id;
        }
      }
    });
    block_argmax(sm, bv, bi);
    if (bi != INT64_MAX) token = bi;  // none kept (an infinite max): the argmax, as the host reference
  }
  return token;
}

}  // namespace ml4::cuda::rowblock
