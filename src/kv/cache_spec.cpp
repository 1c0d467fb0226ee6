// Cache groups from the LayerSpecs (design in cache_spec.h).
#include "kv/cache_spec.h"

#include "kv/indexer_layout.h"
#include "kv/latent_layout.h"

namespace ml4 {

int64_t KvCacheSpec::bytes_per_token() const {
  int64_t n = 0;
  for (const auto& g : groups) n += g.full_attention() ? g.bytes_per_token() : 0;
  return n;
}

int KvCacheSpec::group_index(CacheGroupSpec::Kind kind) const {
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].kind == kind) return static_cast<int>(i);
  }
  return -1;
}

Result<KvCacheSpec> make_kv_cache_spec(const ModelConfig& cfg, KvCacheDtype dtype) {
  const int r = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim;
  if (r <= 0 || dr < 0) {
    return invalid_argument("kv cache: kv_lora_rank {} and qk_rope_head_dim {} must be > 0 and >= 0",
                            r, dr);
  }
  if (dtype == KvCacheDtype::kFp8DsMla && r % kDsMlaTile != 0) {
    return invalid_argument(
        "kv cache dtype fp8_ds_mla needs kv_lora_rank to be a multiple of {} (it is {}); "
        "use --kv-cache-dtype fp8 or bf16",
        kDsMlaTile, r);
  }
  if (cfg.layers.size() != static_cast<size_t>(cfg.n_layers)) {
    return invalid_argument("kv cache: config has n_layers {} but {} LayerSpecs", cfg.n_layers,
                            cfg.layers.size());
  }

  KvCacheSpec spec;
  spec.dtype = dtype;
  spec.kv_lora_rank = r;
  spec.rope_dim = dr;

  CacheGroupSpec latent;
  latent.name = "latent";
  latent.kind = CacheGroupSpec::kLatent;
  latent.token_bytes_per_layer = static_cast<int64_t>(latent_token_bytes(dtype, r, dr));
  CacheGroupSpec indexer;
  indexer.name = "indexer";
  indexer.kind = CacheGroupSpec::kIndexer;

  for (size_t i = 0; i < cfg.layers.size(); ++i) {
    const LayerSpec& l = cfg.layers[i];
    if (l.index != static_cast<int>(i)) {
      return invalid_argument("kv cache: LayerSpec {} has index {}", i, l.index);
    }
    if (l.owns_kv()) {
      if (l.latent_slot != static_cast<int>(latent.layers.size())) {
        return invalid_argument("kv cache: layer {} owns a latent cache and should have latent_slot {}, has {}",
                                i, latent.layers.size(), l.latent_slot);
      }
      latent.layers.push_back(l.index);
    } else if (l.kv_source < 0 || l.kv_source >= l.index || !cfg.layers[l.kv_source].owns_kv()) {
      return invalid_argument("kv cache: layer {} reads the latent cache of layer {}, which is not an earlier owner",
                              i, l.kv_source);
    }
    if (l.indexer == IndexerRole::kOwner) {
      if (!cfg.has_dsa()) {
        return invalid_argument("kv cache: layer {} owns an indexer but the model has no indexer heads", i);
      }
      if (l.indexer_slot != static_cast<int>(indexer.layers.size())) {
        return invalid_argument("kv cache: layer {} owns an indexer and should have indexer_slot {}, has {}",
                                i, indexer.layers.size(), l.indexer_slot);
      }
      indexer.layers.push_back(l.index);
    }
  }
  if (latent.layers.empty()) return invalid_argument("kv cache: no layer owns a latent cache");
  spec.groups.push_back(std::move(latent));

  if (cfg.has_dsa()) {
    const int dI = cfg.indexer.head_dim;
    if (dI <= 0) return invalid_argument("kv cache: indexer head_dim {} must be > 0", dI);
    spec.indexer_dim = dI;
    indexer.token_bytes_per_layer = static_cast<int64_t>(indexer_token_bytes(dI));
    if (!indexer.layers.empty()) spec.groups.push_back(std::move(indexer));
  }

  if (cfg.drafter.enabled) {
    if (cfg.drafter.n_layers <= 0 || cfg.drafter.window <= 0) {
      return invalid_argument("kv cache: drafter needs n_layers > 0 and window > 0 (has {} and {})",
                              cfg.drafter.n_layers, cfg.drafter.window);
    }
    // MODEL.md section 5: the drafter's context K/V is bf16 in a sliding window.
    CacheGroupSpec drafter;
    drafter.name = "drafter";
    drafter.kind = CacheGroupSpec::kDrafter;
    for (int i = 0; i < cfg.drafter.n_layers; ++i) drafter.layers.push_back(i);
    drafter.token_bytes_per_layer =
        static_cast<int64_t>(latent_token_bytes(KvCacheDtype::kBf16, r, dr));
    drafter.sliding_window = cfg.drafter.window;
    spec.groups.push_back(std::move(drafter));
  }
  return spec;
}

}  // namespace ml4
