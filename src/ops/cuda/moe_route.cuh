// The router's top-k of one token by one warp (device code shared by moe.cu's route kernels and
// the resident FFN kernel, ffn_resident.cu): E <= 1024 scores in shared memory, top-k by K
// rounds of a warp argmax (larger score, then lower id: the order cpu::topk defines), so the
// selection is exactly the CPU's whenever the scores are. Softmax sums in f32 here (f64 on the
// CPU): a 1e-7 relative difference in p, which can only swap two experts whose scores tie to
// that precision.
#pragma once

#include <cmath>
#include <cstdint>

namespace ml4::cuda {
namespace {

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;

struct RouteArgs {
  const float* logits;
  int64_t T;
  int E, K, G, keep_groups;
  bool softmax, renorm;
  float routed_scale;
  const float* bias;
  int32_t* ids;
  float* weights;
  const int32_t* forced;  // [T, K] or null
};

__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  // NaN ranks below everything (cpu::topk); then larger value, then lower index.
  const bool an = a != a, bn = b != b;
  if (an != bn) return bn;
  if (an) return ia < ib;
  return a > b || (a == b && ia < ib);
}

__device__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// Token t's routing by one warp: l its E logits, sw the warp's 2E + G floats of shared memory.
__device__ void route_row(const RouteArgs& a, int64_t t, const float* l, float* sw) {
  const int lane = threadIdx.x & 31;
  float* p = sw;
  float* s = p + a.E;
  float* gs = s + a.E;
  const float kNegInf = -INFINITY;
  if (a.softmax) {
    float m = kNegInf;
    for (int e = lane; e < a.E; e += 32) m = fmaxf(m, l[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sum = 0.0f;
    for (int e = lane; e < a.E; e += 32) {
      const float v = expf(l[e] - m);
      p[e] = v;
      sum += v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    for (int e = lane; e < a.E; e += 32) p[e] = p[e] / sum;
  } else {
    for (int e = lane; e < a.E; e += 32) p[e] = 1.0f / (1.0f + expf(-l[e]));
  }
  __syncwarp();
  for (int e = lane; e < a.E; e += 32) s[e] = a.bias ? p[e] + a.bias[e] : p[e];
  __syncwarp();
  if (a.G > 1 && a.keep_groups < a.G) {
    const int per = a.E / a.G;
    for (int g = lane; g < a.G; g += 32) {
      const float* sg = s + g * per;
      float b1 = kNegInf, b2 = kNegInf;
      for (int i = 0; i < per; ++i) {
        if (sg[i] > b1) {
          b2 = b1;
          b1 = sg[i];
        } else if (sg[i] > b2) {
          b2 = sg[i];
        }
      }
      gs[g] = per >= 2 ? b1 + b2 : b1;
    }
    __syncwarp();
    // Keep the best keep_groups groups (ties to the lower group): knock out the rest.
    for (int r = 0; r < a.keep_groups; ++r) {
      float v = kNegInf;
      int i = 0x7fffffff;
      for (int g = lane; g < a.G; g += 32)
        if (gs[g] != INFINITY && better(gs[g], g, v, i)) {
          v = gs[g];
          i = g;
        }
      warp_argmax(v, i);
      if (lane == 0 && i != 0x7fffffff) gs[i] = INFINITY;  // mark kept
      __syncwarp();
    }
    for (int e = lane; e < a.E; e += 32)
      if (gs[e / per] != INFINITY) s[e] = kNegInf;
    __syncwarp();
  }
  double wsum = 0.0;  // f64 as cpu::moe_route
  float wk[kMaxTopK];
  int ik[kMaxTopK];
  for (int k = 0; k < a.K; ++k) {
    float v = kNegInf;
    int i = 0x7fffffff;
    bool first = true;
    for (int e = lane; e < a.E; e += 32) {
      if (s[e] == INFINITY) continue;  // taken (scores are finite or -inf)
      if (first || better(s[e], e, v, i)) {
        v = s[e];
        i = e;
        first = false;
      }
    }
    if (first) v = __int_as_float(0xffc00000);  // lane has nothing: NaN ranks last
    warp_argmax(v, i);
    if (a.forced) i = a.forced[t * a.K + k];  // test input: weights of these experts
    if (lane == 0) s[i] = INFINITY;
    __syncwarp();
    if (k < kMaxTopK) {
      ik[k] = i;
      wk[k] = p[i];
    }
    wsum += static_cast<double>(p[i]);
  }
  if (lane == 0) {
    for (int k = 0; k < a.K; ++k) {
      a.ids[t * a.K + k] = ik[k];
      a.weights[t * a.K + k] = static_cast<float>(static_cast<double>(wk[k]) *
                                                  (a.renorm ? 1.0 / (wsum + 1e-20) : 1.0) *
                                                  static_cast<double>(a.routed_scale));
    }
  }
}

}  // namespace
}  // namespace ml4::cuda
