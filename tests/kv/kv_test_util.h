// Shared helpers for tests/kv: random inputs with a wide exponent range, and the e4m3
// round-trip bound.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "model/model_config.h"

namespace ml4::kv_test {

// A LayerSpec list built by hand (no presets): layers in `consumers` read the latent cache
// of `kv_source_of_consumers`; layer i owns an indexer when owns_indexer(i), otherwise
// reuses the nearest preceding owner. Slots are numbered in layer order.
template <typename OwnsIndexer>
inline ModelConfig hand_built_config(int n_layers, int r, int dr, int dI,
                                     const std::vector<int>& consumers, int kv_source_of_consumers,
                                     OwnsIndexer owns_indexer) {
  ModelConfig cfg;
  cfg.name = "hand-built";
  cfg.n_layers = n_layers;
  cfg.kv_lora_rank = r;
  cfg.qk_rope_head_dim = dr;
  cfg.qk_nope_head_dim = 128;
  cfg.indexer.n_heads = dI > 0 ? 32 : 0;
  cfg.indexer.head_dim = dI;
  int latent = 0, idx = 0, last_owner = -1;
  for (int i = 0; i < n_layers; ++i) {
    LayerSpec l;
    l.index = i;
    bool consumer = false;
    for (int c : consumers) consumer |= c == i;
    l.kv_source = consumer ? kv_source_of_consumers : i;
    l.latent_slot = consumer ? -1 : latent++;
    if (dI > 0) {
      if (owns_indexer(i)) {
        l.indexer = IndexerRole::kOwner;
        l.indexer_source = i;
        l.indexer_slot = idx++;
        last_owner = i;
      } else {
        l.indexer = IndexerRole::kReuser;
        l.indexer_source = last_owner;
      }
    }
    cfg.layers.push_back(l);
  }
  return cfg;
}

// The full ml4 shape (MODEL.md section 1): 72 layers, r=512, dr=64, dI=128; layers
// 39, 43, ..., 71 read layer 35's latent (63 owners); 44 indexer owners (here: the first 11
// of every 18 layers, a placement chosen for the test; only the count matters for bytes);
// DSpark drafter with 3 layers and a 2,048-token window.
inline ModelConfig ml4_like_config() {
  std::vector<int> consumers;
  for (int i = 39; i <= 71; i += 4) consumers.push_back(i);
  ModelConfig cfg = hand_built_config(72, 512, 64, 128, consumers, 35, [](int i) { return i % 18 < 11; });
  cfg.drafter.enabled = true;
  cfg.drafter.n_layers = 3;
  cfg.drafter.window = 2048;
  return cfg;
}

// Values sign * m * 2^e with m in [1, 2) and e in [emin, emax]: a tile's amax then sits
// well above most values, so some land in e4m3's subnormal range after scaling.
inline std::vector<float> wide_random(std::mt19937& rng, int n, int emin = -12, int emax = 3) {
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  std::uniform_int_distribution<int> e(emin, emax);
  std::vector<float> v(n);
  for (auto& x : v) x = (rng() & 1 ? -1.0f : 1.0f) * std::ldexp(m(rng), e(rng));
  return v;
}

// Bound on |decode(encode(x)) - x| for x quantized as e4m3(x / s) * s.
// e4m3 has 3 mantissa bits: for normals (|x/s| >= 2^-6) half an ulp is 2^-4 of the value;
// below that the spacing is 2^-9 so the absolute error is <= 2^-10 * s. The f32 divide and
// multiply add at most ~2 * 2^-24 relative, covered by the 2^-20 |x| term.
inline double e4m3_bound(double x, double s) {
  return std::max(std::ldexp(std::fabs(x), -4), std::ldexp(s, -10)) + std::ldexp(std::fabs(x), -20);
}

}  // namespace ml4::kv_test
