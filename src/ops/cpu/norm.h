// Normalizations on f32 rows: RMSNorm (MODEL.md 3: every `rms(...)`), the fused
// residual-add + RMSNorm that layers chain through (nano-vllm's (hidden, residual) pairs),
// and LayerNorm with weight and bias (the DSA indexer's key norm, MODEL.md 3.5).
//
// Sums of squares are accumulated in f64: rows are at most a few thousand wide, the cost
// is negligible next to the matmuls, and the result is then correctly rounded to f32.
#pragma once

#include <cstdint>

namespace ml4::cpu {

// y = x / sqrt(mean(x^2) + eps) * w, per row of `dim`. y may alias x.
void rms_norm(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y);

// residual += x; y = rms_norm(residual). y may alias x (not residual).
void add_rms_norm(float* residual, const float* x, const float* w, int64_t rows, int64_t dim,
                  float eps, float* y);

// y = (x - mean) / sqrt(var + eps) * w + b (biased variance, as torch.nn.LayerNorm).
// b may be null (no bias). y may alias x.
void layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t dim,
                float eps, float* y);

}  // namespace ml4::cpu
