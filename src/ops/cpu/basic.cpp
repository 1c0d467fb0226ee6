// Elementwise ops and top-k: see basic.h.
#include "ops/cpu/basic.h"

#include <algorithm>
#include <cmath>
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
      std::vector<int32_t> all(static_cast<size_t>(n));
      std::iota(all.begin(), all.end(), 0);
      std::nth_element(all.begin(), all.begin() + (kk - 1), all.end(), better);
      std::sort(all.begin(), all.begin() + kk, better);
      std::copy(all.begin(), all.begin() + kk, idx);
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
