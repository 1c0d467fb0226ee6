// Cache groups: which layers keep which per-token state, and its size (SYSTEM.md S1/S3).
//
// make_kv_cache_spec reads the LayerSpecs (the model is data) and builds:
//   "latent"  : layers that own a latent cache (kv_source == index), in latent_slot order;
//               KV-sharing consumer layers have no entry.
//   "indexer" : layers with IndexerRole::kOwner, in indexer_slot order (DSA models only).
//   "drafter" : the DSpark drafter's own layers 0..n-1 (bf16 latent, sliding window);
//               it is per request and bounded by the window, so KvCacheSpec::bytes_per_token
//               leaves it out and capacity reports it separately.
// Full ml4 config: 63 x 656 + 44 x 132 = 47,136 B/token (fp8_ds_mla), 42,096 (fp8),
// 78,384 (bf16) (MODEL.md section 1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "kv/kv_cache_dtype.h"
#include "model/model_config.h"

namespace ml4 {

struct CacheGroupSpec {
  enum Kind { kLatent, kIndexer, kDrafter };

  std::string name;
  Kind kind = kLatent;
  // Model layer indices (kLatent, kIndexer) or drafter layer indices (kDrafter);
  // position in this vector = the layer slot.
  std::vector<int> layers;
  int64_t token_bytes_per_layer = 0;
  int page_tokens = kPageTokens;
  int64_t sliding_window = 0;  // 0: full attention (keeps every token)

  int64_t page_bytes_per_layer() const { return token_bytes_per_layer * page_tokens; }
  int64_t bytes_per_token() const {
    return token_bytes_per_layer * static_cast<int64_t>(layers.size());
  }
  bool full_attention() const { return sliding_window == 0; }
};

struct KvCacheSpec {
  KvCacheDtype dtype = KvCacheDtype::kFp8DsMla;
  int kv_lora_rank = 0;
  int rope_dim = 0;
  int indexer_dim = 0;  // 0 without DSA
  std::vector<CacheGroupSpec> groups;

  // Sum over full-attention groups (the sliding-window drafter group is per request).
  int64_t bytes_per_token() const;
  // Index of the first group of that kind, -1 if none.
  int group_index(CacheGroupSpec::Kind kind) const;
};

Result<KvCacheSpec> make_kv_cache_spec(const ModelConfig& cfg, KvCacheDtype dtype);

}  // namespace ml4
