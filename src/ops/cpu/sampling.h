// Device sampling: the semantics a runner that samples on its device implements, shared
// (header-only, host + CUDA) by the CUDA kernel (ops/cuda/sampling.cu), the engine's host
// fallback and the tests' fake device runner: the sampling op's reference (ops/cpu).
//
// One row of logits l[0..V) and a DeviceSamplingParams (below):
//   - m = max over the non-NaN logits; NaN ranks below everything (as cpu::topk).
//   - temperature <= 0: the argmax, ties -> lower id.
//   - else s_i = (l_i - m) * (1/T) and weights w_i = exp(s_i) in [0, 1]. Order the ids by
//     (l_i descending, id ascending): every filter keeps a prefix of that order, so the kept
//     set is the shortest of: top_k ids; the smallest prefix whose weight reaches top_p times
//     the top-k weight (vLLM / the host Sampler apply top-p to the top-k renormalised
//     probabilities); the ids with w_i >= min_p (min-p relative to the top probability).
//     Weights are summed as integers (w * 2^40, truncated) so the kernel's block-wide sums are
//     order-independent and bit-reproducible; 2^-40 per id is far below any top-p resolution.
//   - The draw is Gumbel-max (the exponential race): token = argmax over the kept ids of
//     s_i - log(-log(u_i)), with u_i from Philox4x32-10 (Salmon et al., SC'11, "Parallel random
//     numbers: as easy as 1, 2, 3"; constants from Random123) keyed by the request seed, the
//     counter = (id / 4, a domain tag, the 64-bit request counter), lane id % 4. P(token = i)
//     = w_i / sum(w kept), no sort or prefix sum needed, and the token depends only on
//     (logits, params): not on the batch, launch shape or thread count.
//   - logprob = l_tok - m - log(sum_i exp(l_i - m)) over the unmodified logits (the host
//     Sampler's "raw" logprob).
// u_i has 23 random bits in (0, 1) (never 0 or 1): a token whose weight is below ~1e-9 of the
// best one's can never win, a truncation far below anything a test can see.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__CUDACC__)
#define ML4_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define ML4_SAMPLING_HD inline
#endif

namespace ml4 {

// What a runner that samples on its device (ModelRunner::samples_on_device()) needs to draw
// one token from a row of logits. Semantics (this file, the host reference, and
// ops/cuda/sampling.h): temperature <= 0: argmax (ties -> lower id); else
// softmax(logits / temperature) restricted by top_k (0: off), then top_p (1: off, over the
// top-k renormalised probabilities) and min_p (0: off), drawn with a counter-based generator
// keyed by (seed, counter), so a draw depends on nothing else (batch, step, backend state).
// A plain 32-byte struct: the CUDA runner copies an array of them to the device each step.
struct DeviceSamplingParams {
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  int64_t counter = 0;  // the engine passes the index of the token being sampled (output size)
};

}  // namespace ml4

namespace ml4::sampling {

constexpr uint32_t kCounterTag = 0x4d4c3453u;  // "ML4S": separates these draws from other uses
constexpr float kWeightScale = 1099511627776.0f;  // 2^40

struct Philox4 {
  uint32_t v[4];
};

// Philox4x32-10 (Random123's philox4x32_R with R = 10).
ML4_SAMPLING_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
#if defined(__CUDA_ARCH__)
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
#else
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0, p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
#endif
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The four uniforms for ids [4q, 4q + 4) of the draw keyed by (seed, counter).
ML4_SAMPLING_HD Philox4 draw_group(uint64_t seed, int64_t counter, uint32_t q) {
  const uint64_t c = static_cast<uint64_t>(counter);
  return philox4x32_10(q, kCounterTag, static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// DSpark's verifier (engine/spec_decode.h verify_drafts, and its device version,
// ops/cuda/sampling.h verify_rows): two 53-bit uniforms in [0, 1) per decided token, keyed by
// the request's seed and the output index of that token under a tag of their own.
constexpr uint32_t kVerifyTag = 0x4d4c3456u;  // "ML4V"
struct VerifyUniforms {
  double accept = 0.0;  // the acceptance test's u
  double draw = 0.0;    // the inverse-CDF draw of a correction or bonus token
};
ML4_SAMPLING_HD double unit53(uint32_t hi, uint32_t lo) {
  const uint64_t bits = (static_cast<uint64_t>(hi) << 21) ^ (lo >> 11);
  return static_cast<double>(bits & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
}
ML4_SAMPLING_HD VerifyUniforms verify_uniforms(uint64_t seed, int64_t index) {
  const uint64_t c = static_cast<uint64_t>(index);
  const Philox4 r = philox4x32_10(0u, kVerifyTag, static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32),
                                  static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  VerifyUniforms u;
  u.accept = unit53(r.v[0], r.v[1]);
  u.draw = unit53(r.v[2], r.v[3]);
  return u;
}

// Gumbel noise -log(-log(u)), u = (x >> 9 + 0.5) / 2^23 in (0, 1): exact in f32.
ML4_SAMPLING_HD float gumbel(uint32_t x) {
  const float u = (static_cast<float>(x >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

ML4_SAMPLING_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

ML4_SAMPLING_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// Order-preserving key: larger float -> larger key; NaN -> 0 (below -inf).
ML4_SAMPLING_HD uint32_t order_key(float f) {
  if (f != f) return 0u;
  const uint32_t b = float_bits(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

ML4_SAMPLING_HD float key_float(uint32_t k) { return bits_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// w * 2^40 truncated; NaN -> 0.
ML4_SAMPLING_HD uint64_t fixed_weight(float w) { return w > 0.0f ? static_cast<uint64_t>(w * kWeightScale) : 0ull; }

// (a, ia) ranks above (b, ib): larger value, then lower id; NaN below everything.
ML4_SAMPLING_HD bool ranks_above(float a, int64_t ia, float b, int64_t ib) {
  const bool an = a != a, bn = b != b;
  if (an != bn) return bn;
  if (an) return ia < ib;
  return a > b || (a == b && ia < ib);
}

// top-p target: the kept prefix is the shortest whose integer weight reaches this.
ML4_SAMPLING_HD uint64_t top_p_target(float top_p, uint64_t topk_mass) {
  return static_cast<uint64_t>(static_cast<double>(top_p) * static_cast<double>(topk_mass));
}

// Which device-sampling fields are active for a row of V ids.
ML4_SAMPLING_HD bool greedy(const DeviceSamplingParams& p) { return !(p.temperature > 0.0f); }
ML4_SAMPLING_HD bool top_k_on(const DeviceSamplingParams& p, int64_t V) { return p.top_k > 0 && p.top_k < V; }
ML4_SAMPLING_HD bool top_p_on(const DeviceSamplingParams& p) { return p.top_p < 1.0f; }
ML4_SAMPLING_HD bool min_p_on(const DeviceSamplingParams& p) { return p.min_p > 0.0f; }
ML4_SAMPLING_HD float min_p_value(const DeviceSamplingParams& p) { return p.min_p < 1.0f ? p.min_p : 1.0f; }

// The host reference of the whole contract above, for the engine's fallback (a runner that
// samples on its device returned logits), the fake device runner and the tests. O(V) plus a
// sort of the top-k ids, or of a growing top prefix (1024, x4) until it holds the top-p mass.
// Returns the token; *logprob when given.
inline int32_t sample_row_reference(const float* l, int64_t V, const DeviceSamplingParams& p,
                                    float* logprob = nullptr) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (ranks_above(l[i], i, l[best], best)) best = i;
  const float m = l[best];
  int64_t token = best;
  if (!greedy(p) && m == m) {
    const float inv_t = 1.0f / p.temperature;
    auto weight = [&](int64_t i) { return fixed_weight(expf((l[i] - m) * inv_t)); };
    auto before = [&](int32_t a, int32_t b) {
      const uint32_t ka = order_key(l[a]), kb = order_key(l[b]);
      return ka > kb || (ka == kb && a < b);
    };
    std::vector<int32_t> idx;
    int64_t keep = V;  // a prefix of idx when idx is not empty, else every id
    auto sort_prefix = [&](int64_t n) {
      if (idx.empty()) {
        idx.resize(static_cast<size_t>(V));
        std::iota(idx.begin(), idx.end(), 0);
      }
      if (n < V) std::nth_element(idx.begin(), idx.begin() + n, idx.end(), before);
      std::sort(idx.begin(), idx.begin() + n, before);
    };
    uint64_t zk = 0;
    if (top_k_on(p, V)) {
      keep = p.top_k;
      sort_prefix(keep);
      for (int64_t i = 0; i < keep; ++i) zk += weight(idx[i]);
    } else if (top_p_on(p)) {
      for (int64_t i = 0; i < V; ++i) zk += weight(i);
    }
    if (top_p_on(p)) {
      const uint64_t target = top_p_target(p.top_p, zk);
      for (int64_t n = std::min<int64_t>(keep, 1024);; n = std::min<int64_t>(keep, 4 * n)) {
        if (!top_k_on(p, V)) sort_prefix(n);
        uint64_t acc = 0;
        int64_t cut = -1;
        for (int64_t i = 0; i < n && cut < 0; ++i)
          if ((acc += weight(idx[i])) >= target) cut = i + 1;
        if (cut > 0 || n == keep) {
          if (cut > 0) keep = cut;
          break;
        }
      }
    }
    float best_score = std::numeric_limits<float>::quiet_NaN();
    token = INT64_MAX;
    for (int64_t j = 0; j < keep; ++j) {
      const int64_t i = idx.empty() ? j : idx[j];
      const float s = (l[i] - m) * inv_t;
      if (min_p_on(p) && !(expf(s) >= min_p_value(p))) continue;
      const Philox4 r = draw_group(p.seed, p.counter, static_cast<uint32_t>(i >> 2));
      const float score = s + gumbel(r.v[i & 3]);
      if (ranks_above(score, i, best_score, token)) {
        best_score = score;
        token = i;
      }
    }
    if (token == INT64_MAX) token = best;
  }
  if (logprob) {
    double sum = 0.0;
    for (int64_t i = 0; i < V; ++i)
      if (l[i] == l[i]) sum += std::exp(static_cast<double>(l[i]) - m);
    *logprob = static_cast<float>(static_cast<double>(l[token]) - m - std::log(sum));
  }
  return static_cast<int32_t>(token);
}

// The distribution a row is drawn from under p (the filters in the host Sampler's order: sort
// by logit, ties by id; top-k; top-p over the renormalised top-k probabilities; min-p relative
// to the top probability), in f64; greedy rows (temperature <= 0) put 1 on the argmax. The
// speculative decoding verifier works on these (engine/spec_decode.h): what it emits is drawn
// from exactly this distribution (sample_row_reference's integer weights differ from it by at
// most 2^-40 per id). O(V) unless top-k or top-p is on (then the row is sorted): min-p alone
// keeps exactly the ids whose probability is at least min_p times the top one, which needs no
// order (this is the drafter's and the verifier's common case, once per drafted row).
inline void row_distribution(const float* l, int64_t V, const DeviceSamplingParams& p, double* out) {
  std::fill(out, out + V, 0.0);
  if (greedy(p) || (!top_k_on(p, V) && !top_p_on(p))) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (ranks_above(l[i], i, l[best], best)) best = i;
    if (greedy(p)) {
      out[best] = 1.0;
      return;
    }
    const double m = l[best];
    double sum = 0.0;
    for (int64_t i = 0; i < V; ++i) sum += out[i] = std::exp((l[i] - m) / p.temperature);
    if (min_p_on(p)) {  // out[best] = exp(0) = 1: keep out[i] >= min_p * out[best]
      const double floor_p = min_p_value(p);
      sum = 0.0;
      for (int64_t i = 0; i < V; ++i) {
        if (i != best && !(out[i] >= floor_p)) out[i] = 0.0;
        sum += out[i];
      }
    }
    for (int64_t i = 0; i < V; ++i) out[i] /= sum;
    return;
  }
  std::vector<int32_t> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return ranks_above(l[a], a, l[b], b); });
  int64_t keep = top_k_on(p, V) ? p.top_k : V;
  const double m = l[idx[0]];
  std::vector<double> q(static_cast<size_t>(keep));
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += q[i] = std::exp((l[idx[i]] - m) / p.temperature);
  for (auto& x : q) x /= sum;
  if (top_p_on(p)) {
    double acc = 0;
    for (int64_t i = 0; i < keep; ++i)
      if ((acc += q[i]) >= p.top_p) {
        keep = i + 1;
        break;
      }
  }
  if (min_p_on(p)) {
    int64_t cut = 1;
    while (cut < keep && q[cut] >= min_p_value(p) * q[0]) ++cut;
    keep = cut;
  }
  double tot = 0;
  for (int64_t i = 0; i < keep; ++i) tot += q[i];
  for (int64_t i = 0; i < keep; ++i) out[idx[i]] = q[i] / tot;
}

// A draw from weights w[0..V) (>= 0, not necessarily summing to 1): the first id whose running
// sum, in f64 and id order, exceeds u * total, with u a 53-bit uniform from the Philox stream
// keyed (seed, counter) at group 0xFFFFFFFF (past any row's Gumbel groups, i >> 2 < 2^30). For
// the drafter's probabilistic drafts: the token is drawn from exactly the q the verifier is
// given (the float row), in O(V) with one uniform, where Gumbel-max costs two logs per id.
inline int32_t draw_from_weights(const float* w, int64_t V, uint64_t seed, int64_t counter) {
  const Philox4 r = draw_group(seed, counter, 0xFFFFFFFFu);
  const double u = static_cast<double>((static_cast<uint64_t>(r.v[0]) << 21) ^ (r.v[1] >> 11)) * 0x1.0p-53;
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += w[i] > 0.0f ? w[i] : 0.0f;
  const double target = u * total;
  double acc = 0.0;
  int64_t last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!(w[i] > 0.0f)) continue;
    acc += w[i];
    last = i;
    if (acc > target) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);  // rounding at the very end of the sum
}

}  // namespace ml4::sampling
