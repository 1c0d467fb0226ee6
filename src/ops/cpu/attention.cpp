// Attention cores: see attention.h. The MLA core is FlashMLA's contract on gathered
// rows: logits, one f64-free max-subtracted softmax in f32 with the normalizer summed in
// f64, out and lse per head. Heads are split across threads.
#include "ops/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/threads.h"

namespace ml4::cpu {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void mla_attention(const float* q_lat, const float* q_rope, int H, int r, int dr, const float* c,
                   const float* kr, int64_t S, const float* head_scale, float* out_lat, float* lse) {
  parallel_for(H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> logit(static_cast<size_t>(std::max<int64_t>(S, 0)));
    for (int64_t h = h0; h < h1; ++h) {
      float* o = out_lat + h * r;
      std::fill(o, o + r, 0.0f);
      if (S <= 0) {
        lse[h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float* ql = q_lat + h * r;
      const float* qr = q_rope + h * dr;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) {
        logit[s] = (dot(ql, c + s * r, r) + dot(qr, kr + s * dr, dr)) * head_scale[h];
        mx = std::max(mx, logit[s]);
      }
      double sum = 0.0;
      for (int64_t s = 0; s < S; ++s) {
        logit[s] = std::exp(logit[s] - mx);
        sum += logit[s];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int64_t s = 0; s < S; ++s) {
        const float p = logit[s] * inv;
        const float* cs = c + s * r;
        for (int i = 0; i < r; ++i) o[i] += p * cs[i];
      }
      lse[h] = static_cast<float>(mx + std::log(sum));
    }
  });
}

void indexer_scores(const float* q, const float* w, int HI, int dI, const float* k, int64_t S,
                    float* scores) {
  parallel_for(S, 64, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const float* ks = k + s * dI;
      float acc = 0.0f;
      for (int h = 0; h < HI; ++h) acc += w[h] * std::max(0.0f, dot(q + h * dI, ks, dI));
      scores[s] = acc;
    }
  });
}

}  // namespace ml4::cpu
