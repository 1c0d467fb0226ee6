// Paged host storage (design in paged_kv_cache.h).
#include "kv/paged_kv_cache.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "kv/indexer_layout.h"
#include "kv/latent_layout.h"

namespace ml4 {

PagedKvCache::PagedKvCache(const KvCacheSpec& spec, std::vector<int64_t> num_blocks,
                           float fp8_scale)
    : spec_(spec), num_blocks_(std::move(num_blocks)), fp8_scale_(fp8_scale) {
  num_blocks_.resize(spec_.groups.size(), 0);
  latent_group_ = spec_.group_index(CacheGroupSpec::kLatent);
  indexer_group_ = spec_.group_index(CacheGroupSpec::kIndexer);
  drafter_group_ = spec_.group_index(CacheGroupSpec::kDrafter);
  storage_.resize(spec_.groups.size());
  for (size_t g = 0; g < spec_.groups.size(); ++g) {
    if (num_blocks_[g] < 0) num_blocks_[g] = 0;
    const auto& gs = spec_.groups[g];
    storage_[g].assign(static_cast<size_t>(num_blocks_[g]) * gs.layers.size() *
                           static_cast<size_t>(gs.page_bytes_per_layer()),
                       0);
  }
}

Result<PagedKvCache> PagedKvCache::create(const KvCacheSpec& spec, std::vector<int64_t> num_blocks,
                                          float fp8_scale) {
  if (num_blocks.size() != spec.groups.size()) {
    return invalid_argument("paged kv cache: {} block counts for {} cache groups", num_blocks.size(),
                            spec.groups.size());
  }
  for (size_t g = 0; g < num_blocks.size(); ++g) {
    if (num_blocks[g] < 0) {
      return invalid_argument("paged kv cache: group {} has {} blocks", spec.groups[g].name,
                              num_blocks[g]);
    }
  }
  if (!(fp8_scale > 0.0f)) return invalid_argument("paged kv cache: fp8 scale {} must be > 0", fp8_scale);
  return PagedKvCache(spec, std::move(num_blocks), fp8_scale);
}

size_t PagedKvCache::size_bytes() const {
  size_t n = 0;
  for (const auto& s : storage_) n += s.size();
  return n;
}

Status PagedKvCache::check_slot(int group, int layer_slot, int64_t slot) const {
  if (group < 0 || group >= num_groups()) {
    return out_of_range("kv cache group {} (there are {})", group, num_groups());
  }
  const auto& gs = spec_.groups[group];
  if (layer_slot < 0 || layer_slot >= static_cast<int>(gs.layers.size())) {
    return out_of_range("kv cache group {}: layer slot {} (it has {})", gs.name, layer_slot, gs.layers.size());
  }
  if (slot < 0 || slot >= num_slots(group)) {
    return out_of_range("kv cache group {}: token slot {} (it has {} = {} blocks x {})", gs.name, slot,
                        num_slots(group), num_blocks_[group], kPageTokens);
  }
  return ok_status();
}

uint8_t* PagedKvCache::page(int group, int layer_slot, int64_t block) {
  return const_cast<uint8_t*>(std::as_const(*this).page(group, layer_slot, block));
}

const uint8_t* PagedKvCache::page(int group, int layer_slot, int64_t block) const {
  assert(group >= 0 && group < num_groups());
  const auto& gs = spec_.groups[group];
  assert(layer_slot >= 0 && layer_slot < static_cast<int>(gs.layers.size()));
  assert(block >= 0 && block < num_blocks_[group]);
  const size_t index = static_cast<size_t>(layer_slot) * num_blocks_[group] + block;
  return storage_[group].data() + index * static_cast<size_t>(gs.page_bytes_per_layer());
}

const uint8_t* PagedKvCache::token_ptr(int group, int layer_slot, int64_t slot) const {
  assert(slot >= 0);
  const uint8_t* p = page(group, layer_slot, slot / kPageTokens);
  return p + (slot % kPageTokens) * spec_.groups[group].token_bytes_per_layer;
}

uint8_t* PagedKvCache::token_ptr(int group, int layer_slot, int64_t slot) {
  return const_cast<uint8_t*>(std::as_const(*this).token_ptr(group, layer_slot, slot));
}

void PagedKvCache::write_latent(int layer_slot, int64_t slot, const float* c, const float* kr) {
  encode_latent(spec_.dtype, c, kr, spec_.kv_lora_rank, spec_.rope_dim, fp8_scale_,
                token_ptr(latent_group_, layer_slot, slot));
}

void PagedKvCache::read_latent(int layer_slot, int64_t slot, float* c, float* kr) const {
  decode_latent(spec_.dtype, token_ptr(latent_group_, layer_slot, slot), spec_.kv_lora_rank,
                spec_.rope_dim, fp8_scale_, c, kr);
}

void PagedKvCache::write_drafter(int drafter_layer, int64_t slot, const float* c, const float* kr) {
  encode_latent(KvCacheDtype::kBf16, c, kr, spec_.kv_lora_rank, spec_.rope_dim, 1.0f,
                token_ptr(drafter_group_, drafter_layer, slot));
}

void PagedKvCache::read_drafter(int drafter_layer, int64_t slot, float* c, float* kr) const {
  decode_latent(KvCacheDtype::kBf16, token_ptr(drafter_group_, drafter_layer, slot),
                spec_.kv_lora_rank, spec_.rope_dim, 1.0f, c, kr);
}

void PagedKvCache::write_indexer_key(int idx_slot, int64_t slot, const float* k) {
  assert(slot >= 0);
  encode_indexer_key(k, spec_.indexer_dim, page(indexer_group_, idx_slot, slot / kPageTokens),
                     static_cast<int>(slot % kPageTokens));
}

void PagedKvCache::read_indexer_key(int idx_slot, int64_t slot, float* k) const {
  assert(slot >= 0);
  decode_indexer_key(page(indexer_group_, idx_slot, slot / kPageTokens),
                     static_cast<int>(slot % kPageTokens), spec_.indexer_dim, k);
}

void PagedKvCache::read_indexer_key_raw(int idx_slot, int64_t slot, uint8_t* values,
                                        float* scales) const {
  assert(slot >= 0);
  ml4::read_indexer_key_raw(page(indexer_group_, idx_slot, slot / kPageTokens),
                            static_cast<int>(slot % kPageTokens), spec_.indexer_dim, values, scales);
}

int64_t PagedKvCache::window_blocks(const CacheGroupSpec& g) {
  if (g.full_attention()) return 0;
  return (g.sliding_window + g.page_tokens - 1) / g.page_tokens + 1;
}

std::vector<int64_t> PagedKvCache::blocks_for_budget(const KvCacheSpec& spec, int64_t bytes,
                                                     int64_t max_requests) {
  std::vector<int64_t> blocks(spec.groups.size(), 0);
  if (bytes <= 0) return blocks;
  int64_t left = bytes;
  int64_t full_block_bytes = 0;  // one block in every full-attention group, all its layers
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const auto& gs = spec.groups[g];
    const int64_t per_block = gs.page_bytes_per_layer() * static_cast<int64_t>(gs.layers.size());
    if (gs.full_attention()) {
      full_block_bytes += per_block;
    } else if (max_requests > 0) {
      const int64_t want = max_requests * window_blocks(gs);
      const int64_t fit = per_block > 0 ? std::min(want, left / per_block) : want;
      blocks[g] = fit;
      left -= fit * per_block;
    }
  }
  if (full_block_bytes <= 0) return blocks;
  const int64_t n = left / full_block_bytes;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    if (spec.groups[g].full_attention()) blocks[g] = n;
  }
  return blocks;
}

}  // namespace ml4
