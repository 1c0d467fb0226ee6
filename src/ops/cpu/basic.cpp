// Elementwise ops and top-k: see basic.h.
#include "ops/cpu/basic.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "core/log.h"

namespace ml4::cpu {

void softmax_inplace(float* x, int64_t n) {
  if (n <= 0) return;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  if (mx == -std::numeric_limits<float>::infinity()) {
    // Every entry masked: a uniform distribution would invent mass; write zeros.
    std::fill(x, x + n, 0.0f);
    return;
  }
  // The difference and exp in f64: an f32 x - max would carry |x - max| * 2^-24 relative
  // error into exp (1e-6 at a spread of 20); this keeps every output within a few ulp.
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float e = static_cast<float>(std::exp(static_cast<double>(x[i]) - mx));
    x[i] = e;
    sum += e;
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = g[i];
    out[i] = v / (1.0f + std::exp(-v)) * u[i];
  }
}

namespace {
// The rank of a score as an unsigned key whose order is topk's: NaN as -inf, -0 as +0, then the
// IEEE order (sign flipped in, negatives' bits inverted), so a > b as keys iff a ranks higher.
inline uint32_t score_key(float s) {
  const uint32_t u = std::bit_cast<uint32_t>(s), mag = u & 0x7fffffffu;
  const uint32_t ordered = u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
  // NaN: the key of -inf (~0xff800000); +-0: the key of +0.
  return mag > 0x7f800000u ? 0x007fffffu : mag == 0 ? 0x80000000u : ordered;
}
// score_key above the index's complement: distinct for every index, a > b iff a ranks higher
// (ties by lower index).
inline uint64_t rank_key(float s, int64_t i) {
  return (static_cast<uint64_t>(score_key(s)) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(i));
}
}  // namespace

void topk_set(const float* scores, int64_t n, int k, int32_t* idx) {
  const int64_t kk = std::min<int64_t>(std::max(k, 0), std::max<int64_t>(n, 0));
  if (kk == n) {
    std::iota(idx, idx + kk, 0);
    return;
  }
  if (kk == 0) return;
  // The kk-th highest score key (pivot): a histogram of the keys' top 11 bits finds its bucket,
  // a selection among that bucket's keys the key. All keys above it are in, and of those equal
  // to it the lowest indices up to kk (topk's tie rule), all taken in index order.
  constexpr int kBits = 11, kShift = 32 - kBits;
  thread_local std::vector<uint32_t> buf, hist;
  buf.resize(2 * static_cast<size_t>(n));
  hist.assign(size_t{1} << kBits, 0);
  uint32_t* key = buf.data();
  uint32_t* work = key + n;
  for (int64_t i = 0; i < n; ++i) {
    key[i] = score_key(scores[i]);
    ++hist[key[i] >> kShift];
  }
  int64_t above = 0;  // keys in buckets above the pivot's
  uint32_t b = (uint32_t{1} << kBits) - 1;
  while (above + hist[b] < kk) above += hist[b--];
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i)
    if ((key[i] >> kShift) == b) work[m++] = key[i];
  const int64_t r = kk - above;  // 1 <= r <= m
  std::nth_element(work, work + (r - 1), work + m, std::greater<uint32_t>());
  const uint32_t pivot = work[r - 1];
  for (int64_t j = 0; j < m; ++j) above += work[j] > pivot;
  int64_t equal_left = kk - above, c = 0;
  for (int64_t i = 0; i < n; ++i)
    if (key[i] > pivot || (key[i] == pivot && equal_left-- > 0)) idx[c++] = static_cast<int32_t>(i);
}

void topk(const float* scores, int64_t n, int k, int32_t* idx) {
  if (k <= 0) return;
  const int64_t kk = std::min<int64_t>(k, std::max<int64_t>(n, 0));
  // Key: NaN -> -inf, so the order is a strict weak order; ties by lower index.
  auto key = [&](int32_t i) {
    const float s = scores[i];
    return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s;
  };
  auto better = [&](int32_t a, int32_t b) {
    const float ka = key(a), kb = key(b);
    return ka > kb || (ka == kb && a < b);
  };
  if (kk > 0) {
    if (kk <= 64) {
      // Small k (the MoE router): a sorted insertion buffer, one pass, no allocation.
      int64_t len = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int32_t c = static_cast<int32_t>(i);
        if (len == kk && !better(c, idx[len - 1])) continue;
        int64_t j = len < kk ? len++ : kk - 1;
        while (j > 0 && better(c, idx[j - 1])) {
          idx[j] = idx[j - 1];
          --j;
        }
        idx[j] = c;
      }
    } else {
      // better() as one integer compare (rank_key), the index in the key's low half.
      std::vector<uint64_t> all(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) all[i] = rank_key(scores[i], i);
      std::nth_element(all.begin(), all.begin() + (kk - 1), all.end(), std::greater<uint64_t>());
      std::sort(all.begin(), all.begin() + kk, std::greater<uint64_t>());
      for (int64_t j = 0; j < kk; ++j) idx[j] = static_cast<int32_t>(~static_cast<uint32_t>(all[j]));
    }
  }
  for (int64_t i = kk; i < k; ++i) idx[i] = -1;
}

void embedding_lookup(const Tensor& table, const int32_t* ids, int64_t T, float* out) {
  const bool ok_rank = table.rank() == 2;
  const int64_t V = ok_rank ? table.dim(0) : 0, D = ok_rank ? table.dim(1) : 0;
  const bool ok_dtype = table.dtype() == DType::kBF16 || table.dtype() == DType::kF32;
  if (!ok_rank || !ok_dtype || table.empty()) {
    ML4_LOG_ERROR("embedding_lookup: table must be [V, D] bf16 or f32, found {}", table.describe());
    return;  // D unknown: nothing can be written safely
  }
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * D;
    const int64_t id = ids[t];
    if (id < 0 || id >= V) {
      ML4_LOG_ERROR("embedding_lookup: token id {} outside [0, {})", id, V);
      std::fill(o, o + D, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    if (table.dtype() == DType::kF32) {
      const float* row = table.as<float>() + id * D;
      std::copy(row, row + D, o);
    } else {
      const uint16_t* row = table.as<uint16_t>() + id * D;
      for (int64_t d = 0; d < D; ++d) o[d] = bf16_to_f32(row[d]);
    }
  }
}

}  // namespace ml4::cpu
