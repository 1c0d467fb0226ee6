#include "model/model_config.h"

#include <cmath>

namespace ml4 {

int ModelConfig::num_latent_layers() const {
  int n = 0;
  for (const auto& l : layers) n += l.owns_kv() ? 1 : 0;
  return n;
}

int ModelConfig::num_indexer_layers() const {
  int n = 0;
  for (const auto& l : layers) n += l.indexer == IndexerRole::kOwner ? 1 : 0;
  return n;
}

// DeepSeek-V3 inference/model.py: softmax_scale = qk_head_dim^-0.5, times mscale^2 when
// the yarn factor > 1, with mscale = 0.1 * mscale_all_dim * ln(factor) + 1.
double ModelConfig::softmax_scale() const {
  double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (yarn.enabled && yarn.factor > 1.0 && yarn.mscale_all_dim > 0) {
    double m = 0.1 * yarn.mscale_all_dim * std::log(yarn.factor) + 1.0;
    s *= m * m;
  }
  return s;
}

}  // namespace ml4
