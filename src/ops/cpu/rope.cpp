// RoPE: see rope.h for the sources. YaRN (transformers `_compute_yarn_parameters`,
// DeepSeek-V3 `precompute_freqs_cis`):
//   pos_freq_i  = theta^(2i/d), i < d/2
//   corr(rot)   = d * ln(orig / (rot * 2 pi)) / (2 ln theta)
//   low, high   = max(floor(corr(beta_fast)), 0), min(ceil(corr(beta_slow)), d - 1)
//   ramp_i      = clamp((i - low) / (high - low), 0, 1)   (high += 0.001 if equal)
//   inv_freq_i  = (1/pos_freq_i) * (1 - ramp_i) + (1/(factor * pos_freq_i)) * ramp_i
// i.e. high-frequency dims (small i) keep their frequency, low-frequency ones are
// interpolated by `factor`. attention_factor = get_mscale(f, mscale) / get_mscale(f,
// mscale_all_dim) with get_mscale(f, m) = 1 if f <= 1 else 0.1 m ln f + 1; when either
// is 0 (transformers: "if mscale and mscale_all_dim") it is get_mscale(f, 1).
#include "ops/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <utility>

namespace ml4::cpu {
namespace {

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double correction_dim(double rotations, int dim, double base, double max_pos) {
  return dim * std::log(max_pos / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
}

// Pairs (x[a_i], x[b_i]) rotated by pos * inv_freq[i].
template <typename PairIndex>
void rotate(float* x, int64_t n_vec, int rope_dim, int64_t stride, double pos,
            const float* inv_freq, float attn_factor, PairIndex pair) {
  const int half = rope_dim / 2;
  // cos/sin once per frequency, reused over all vectors (heads).
  constexpr int kStack = 128;
  float cs_stack[2 * kStack];
  std::vector<float> cs_heap;
  float* cs = cs_stack;
  if (half > kStack) {
    cs_heap.resize(2 * static_cast<size_t>(half));
    cs = cs_heap.data();
  }
  for (int i = 0; i < half; ++i) {
    const double a = pos * static_cast<double>(inv_freq[i]);
    cs[2 * i] = static_cast<float>(std::cos(a)) * attn_factor;
    cs[2 * i + 1] = static_cast<float>(std::sin(a)) * attn_factor;
  }
  for (int64_t v = 0; v < n_vec; ++v) {
    float* xv = x + v * stride;
    for (int i = 0; i < half; ++i) {
      auto [ia, ib] = pair(i, half);
      const float a = xv[ia], b = xv[ib];
      const float c = cs[2 * i], s = cs[2 * i + 1];
      xv[ia] = a * c - b * s;
      xv[ib] = a * s + b * c;
    }
  }
}

}  // namespace

std::vector<float> rope_inv_freq(double theta, int rope_dim, const YarnConfig& yarn) {
  const int half = rope_dim / 2;
  std::vector<float> out(static_cast<size_t>(std::max(half, 0)));
  const bool use_yarn = yarn.enabled && yarn.factor > 1.0 && yarn.original_max_position_embeddings > 0;
  double low = 0.0, high = 0.0;
  if (use_yarn) {
    const double orig = static_cast<double>(yarn.original_max_position_embeddings);
    low = std::max(std::floor(correction_dim(yarn.beta_fast, rope_dim, theta, orig)), 0.0);
    high = std::min(std::ceil(correction_dim(yarn.beta_slow, rope_dim, theta, orig)),
                    static_cast<double>(rope_dim - 1));
    if (low == high) high += 0.001;
  }
  for (int i = 0; i < half; ++i) {
    const double extrap = 1.0 / std::pow(theta, 2.0 * i / rope_dim);
    double f = extrap;
    if (use_yarn) {
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      const double interp = extrap / yarn.factor;
      f = interp * ramp + extrap * (1.0 - ramp);
    }
    out[i] = static_cast<float>(f);
  }
  return out;
}

float rope_attention_factor(const YarnConfig& yarn) {
  if (!yarn.enabled) return 1.0f;
  if (yarn.mscale != 0.0 && yarn.mscale_all_dim != 0.0)
    return static_cast<float>(yarn_get_mscale(yarn.factor, yarn.mscale) /
                              yarn_get_mscale(yarn.factor, yarn.mscale_all_dim));
  return static_cast<float>(yarn_get_mscale(yarn.factor, 1.0));
}

double lerope_position(int64_t p, const LeRopeConfig& cfg) {
  if (!cfg.enabled || p < cfg.window || cfg.leak <= 0.0) return static_cast<double>(p);
  return static_cast<double>(cfg.window) + static_cast<double>(p - cfg.window) / cfg.leak;
}

float llama4_q_scale(int64_t p, const Llama4Scaling& cfg) {
  if (!cfg.enabled || cfg.original_max_position_embeddings <= 0) return 1.0f;
  const double n = std::floor(static_cast<double>(p) / cfg.original_max_position_embeddings);
  return static_cast<float>(1.0 + cfg.beta * std::log(1.0 + n));
}

void rope_interleaved(float* x, int64_t n_vec, int rope_dim, int64_t stride, double pos,
                      const float* inv_freq, float attn_factor) {
  rotate(x, n_vec, rope_dim, stride, pos, inv_freq, attn_factor,
         [](int i, int) { return std::pair<int, int>(2 * i, 2 * i + 1); });
}

void rope_neox(float* x, int64_t n_vec, int rope_dim, int64_t stride, double pos,
               const float* inv_freq, float attn_factor) {
  rotate(x, n_vec, rope_dim, stride, pos, inv_freq, attn_factor,
         [](int i, int half) { return std::pair<int, int>(i, i + half); });
}

}  // namespace ml4::cpu
