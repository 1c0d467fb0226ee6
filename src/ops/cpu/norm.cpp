// Norms: see norm.h. RMSNorm follows Mistral/DeepSeek `RMSNorm` (x * rsqrt(mean(x^2) +
// eps) * weight, all in f32 there; here the mean of squares is an f64 sum).
#include "ops/cpu/norm.h"

#include <cmath>

#include "core/threads.h"

namespace ml4::cpu {
namespace {

void rms_row(const float* x, const float* w, int64_t dim, float eps, float* y) {
  double ss = 0.0;
  for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
  for (int64_t i = 0; i < dim; ++i) y[i] = x[i] * inv * w[i];
}

int64_t grain_rows(int64_t dim) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1)); }

}  // namespace

void rms_norm(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y) {
  parallel_for(rows, grain_rows(dim), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_row(x + r * dim, w, dim, eps, y + r * dim);
  });
}

void add_rms_norm(float* residual, const float* x, const float* w, int64_t rows, int64_t dim,
                  float eps, float* y) {
  parallel_for(rows, grain_rows(dim), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* res = residual + r * dim;
      const float* xr = x + r * dim;
      for (int64_t i = 0; i < dim; ++i) res[i] += xr[i];
      rms_row(res, w, dim, eps, y + r * dim);
    }
  });
}

void layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t dim,
                float eps, float* y) {
  parallel_for(rows, grain_rows(dim), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      double sum = 0.0;
      for (int64_t i = 0; i < dim; ++i) sum += xr[i];
      const double mean = sum / static_cast<double>(dim);
      double var = 0.0;  // two-pass: no cancellation when |mean| >> std
      for (int64_t i = 0; i < dim; ++i) var += (xr[i] - mean) * (xr[i] - mean);
      var /= static_cast<double>(dim);
      const double inv = 1.0 / std::sqrt(var + eps);
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>((xr[i] - mean) * inv) * w[i];
        yr[i] = b ? v + b[i] : v;
      }
    }
  });
}

}  // namespace ml4::cpu
