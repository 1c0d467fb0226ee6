// Paged host storage for every cache group: per group, per layer slot, num_blocks pages.
//
// Memory of group g, layer slot l, block b starts at
//   base_g + (l * num_blocks_g + b) * page_bytes_per_layer(g)
// so one layer's pages are contiguous ([num_blocks, 64, token_bytes] as vLLM/FlashMLA
// lay a layer's cache out). A token slot is block * 64 + offset (FlashMLA/vLLM
// slot_mapping convention). Latent pages are 64 rows of latent_token_bytes; indexer pages
// follow indexer_layout.h. Accessors check bounds with assert (internal indices computed by
// the engine; CMake's Release flags keep asserts on); create() validates user-sized input.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "kv/cache_spec.h"

namespace ml4 {

class PagedKvCache {
 public:
  // num_blocks has one entry per spec group; see create() for a checked construction.
  PagedKvCache(const KvCacheSpec& spec, std::vector<int64_t> num_blocks, float fp8_scale = 1.0f);
  static Result<PagedKvCache> create(const KvCacheSpec& spec, std::vector<int64_t> num_blocks,
                                     float fp8_scale = 1.0f);

  const KvCacheSpec& spec() const { return spec_; }
  int num_groups() const { return static_cast<int>(spec_.groups.size()); }
  int64_t num_blocks(int group) const { return num_blocks_[group]; }
  int64_t num_slots(int group) const { return num_blocks_[group] * kPageTokens; }
  size_t size_bytes() const;
  float fp8_scale() const { return fp8_scale_; }

  // Out-of-range error naming the group, for checking slot mappings at a boundary (the
  // accessors below only assert).
  Status check_slot(int group, int layer_slot, int64_t slot) const;

  uint8_t* page(int group, int layer_slot, int64_t block);
  const uint8_t* page(int group, int layer_slot, int64_t block) const;

  // Latent group; layer_slot = LayerSpec::latent_slot.
  void write_latent(int layer_slot, int64_t slot, const float* c, const float* kr);
  void read_latent(int layer_slot, int64_t slot, float* c, float* kr) const;
  // Indexer group; idx_slot = LayerSpec::indexer_slot. k [indexer_dim].
  void write_indexer_key(int idx_slot, int64_t slot, const float* k);
  void read_indexer_key(int idx_slot, int64_t slot, float* k) const;
  void read_indexer_key_raw(int idx_slot, int64_t slot, uint8_t* values, float* scales) const;
  // The bytes of one token's row in any group (what read_latent / read_drafter decode).
  const uint8_t* row(int group, int layer_slot, int64_t slot) const { return token_ptr(group, layer_slot, slot); }
  // Drafter group (bf16 latent); drafter_layer in [0, drafter.n_layers).
  void write_drafter(int drafter_layer, int64_t slot, const float* c, const float* kr);
  void read_drafter(int drafter_layer, int64_t slot, float* c, float* kr) const;

  // Splits `bytes` so every full-attention group gets the same number of blocks (token
  // slots = blocks * 64), the largest count whose total fits. The drafter group first
  // receives max_requests * (ceil(window/64) + 1) blocks (a window may straddle one extra
  // page), taken from the budget; the result never exceeds `bytes` and is all zeros when
  // nothing fits.
  static std::vector<int64_t> blocks_for_budget(const KvCacheSpec& spec, int64_t bytes,
                                                int64_t max_requests = 0);
  // Blocks one request needs in a sliding-window group.
  static int64_t window_blocks(const CacheGroupSpec& g);

 private:
  uint8_t* token_ptr(int group, int layer_slot, int64_t slot);
  const uint8_t* token_ptr(int group, int layer_slot, int64_t slot) const;

  KvCacheSpec spec_;
  std::vector<int64_t> num_blocks_;
  float fp8_scale_ = 1.0f;
  int latent_group_ = -1;
  int indexer_group_ = -1;
  int drafter_group_ = -1;
  std::vector<std::vector<uint8_t>> storage_;  // one buffer per group
};

}  // namespace ml4
