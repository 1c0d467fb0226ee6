// Test helper shared by tests/engine/device_sampling_test.cpp and tests/cuda/sampling_test.cu:
// the exact f64 distribution a row of logits is drawn from under DeviceSamplingParams, in the
// host Sampler's order of filters (sort by logit, ties by id; top-k; top-p over the renormalised
// top-k probabilities; min-p relative to the top probability).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "runtime/step.h"

namespace ml4::testing {

inline std::vector<double> exact_dist(const std::vector<float>& l, const DeviceSamplingParams& p) {
  const int64_t V = static_cast<int64_t>(l.size());
  std::vector<int32_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  int64_t keep = p.top_k > 0 && p.top_k < V ? p.top_k : V;
  const double m = l[idx[0]];
  std::vector<double> q(keep);
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += q[i] = std::exp((l[idx[i]] - m) / p.temperature);
  for (auto& x : q) x /= sum;
  if (p.top_p < 1.0f) {
    double acc = 0;
    for (int64_t i = 0; i < keep; ++i)
      if ((acc += q[i]) >= p.top_p) {
        keep = i + 1;
        break;
      }
  }
  if (p.min_p > 0.0f) {
    int64_t cut = 1;
    while (cut < keep && q[cut] >= p.min_p * q[0]) ++cut;
    keep = cut;
  }
  std::vector<double> out(V, 0.0);
  double tot = 0;
  for (int64_t i = 0; i < keep; ++i) tot += q[i];
  for (int64_t i = 0; i < keep; ++i) out[idx[i]] = q[i] / tot;
  return out;
}

}  // namespace ml4::testing
