// Hadamard and FP8 group quantization: see quant.h.
//
// The transform is the iterative butterfly (h = 1, 2, 4, ...: (a, b) -> (a + b, a - b)),
// which yields Sylvester ordering H_2n = [[H, H], [H, -H]] exactly as scipy.linalg.hadamard
// and fast_hadamard_transform; the n^-0.5 scale is applied once at the end.
#include "ops/cpu/quant.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/log.h"
#include "core/threads.h"

namespace ml4::cpu {

void hadamard_transform(float* x, int64_t rows, int n) {
  if (n <= 0 || (n & (n - 1)) != 0) {
    ML4_LOG_ERROR("hadamard_transform: n = {} is not a power of two", n);
    return;
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  parallel_for(rows, std::max<int64_t>(1, 8192 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* v = x + r * n;
      for (int h = 1; h < n; h *= 2) {
        for (int i = 0; i < n; i += 2 * h) {
          for (int j = i; j < i + h; ++j) {
            const float a = v[j], c = v[j + h];
            v[j] = a + c;
            v[j + h] = a - c;
          }
        }
      }
      for (int i = 0; i < n; ++i) v[i] *= scale;
    }
  });
}

void quantize_fp8_groups(const float* x, int64_t n, int group, uint8_t* q, float* scales) {
  if (group <= 0) {
    ML4_LOG_ERROR("quantize_fp8_groups: group = {}", group);
    return;
  }
  for (int64_t g0 = 0, gi = 0; g0 < n; g0 += group, ++gi) {
    const int64_t g1 = std::min<int64_t>(n, g0 + group);
    float amax = 0.0f;
    for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(x[i]));
    // DeepSeek-V3 inference/kernel.py act_quant: s = max(amax, 1e-4) / 448; y = x / s.
    const float s = std::max(amax, 1e-4f) / kE4M3Max;
    scales[gi] = s;
    for (int64_t i = g0; i < g1; ++i) q[i] = f32_to_e4m3(x[i] / s);
  }
}

void dequantize_fp8_groups(const uint8_t* q, const float* scales, int64_t n, int group, float* x) {
  if (group <= 0) {
    ML4_LOG_ERROR("dequantize_fp8_groups: group = {}", group);
    return;
  }
  // Group by group: no integer division per value.
  for (int64_t g0 = 0, gi = 0; g0 < n; g0 += group, ++gi) {
    const int64_t g1 = std::min<int64_t>(n, g0 + group);
    const float s = scales[gi];
    for (int64_t i = g0; i < g1; ++i) x[i] = e4m3_to_f32(q[i]) * s;
  }
}

}  // namespace ml4::cpu
