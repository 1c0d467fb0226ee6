#include "offload/hisparse.h"

#include "kv/paged_kv_cache.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

namespace ml4 {

bool is_hisparse_connector(const std::string& kv_transfer_config) {
  const auto j = nlohmann::json::parse(kv_transfer_config, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  const auto it = j.find("kv_connector");
  return it != j.end() && it->is_string() && it->get<std::string>() == "HiSparseConnector";
}

Result<HiSparseConfig> parse_hisparse_config(const std::string& kv_transfer_config) {
  const auto j = nlohmann::json::parse(kv_transfer_config, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return invalid_argument("--kv-transfer-config: not a JSON object");
  for (const auto& e : j.items()) {
    if (e.key() != "kv_connector" && e.key() != "kv_connector_extra_config" && e.key() != "kv_role")
      return invalid_argument("--kv-transfer-config: unknown field '{}' for HiSparseConnector", e.key());
  }
  if (!is_hisparse_connector(kv_transfer_config))
    return invalid_argument("--kv-transfer-config: kv_connector must be \"HiSparseConnector\"");
  if (auto it = j.find("kv_role"); it != j.end() && !(it->is_string() && it->get<std::string>() == "kv_both"))
    return invalid_argument("--kv-transfer-config: HiSparseConnector's kv_role can only be \"kv_both\"");
  HiSparseConfig c;
  c.enabled = true;
  const auto it = j.find("kv_connector_extra_config");
  if (it == j.end() || !it->is_object())
    return invalid_argument("--kv-transfer-config: HiSparseConnector needs kv_connector_extra_config {{\"host_pool_gb\": G}}");
  for (const auto& e : it->items()) {
    if (e.key() == "host_pool_gb") {
      if (!e.value().is_number() || !(e.value().get<double>() > 0) || e.value().get<double>() > 1e6)
        return invalid_argument("--kv-transfer-config: host_pool_gb must be a number in (0, 1e6] (GiB)");
      c.host_pool_bytes = static_cast<int64_t>(std::llround(e.value().get<double>() * 1073741824.0));
    } else if (e.key() == "hot_slots_per_request") {
      if (!e.value().is_number_integer() || e.value().get<int64_t>() < 1 || e.value().get<int64_t>() > (1 << 20))
        return invalid_argument("--kv-transfer-config: hot_slots_per_request must be an integer in [1, 1048576]");
      c.hot_slots_per_request = e.value().get<int>();
    } else {
      return invalid_argument("--kv-transfer-config: unknown kv_connector_extra_config field '{}' for HiSparseConnector "
                              "(known: host_pool_gb, hot_slots_per_request)",
                              e.key());
    }
  }
  if (c.host_pool_bytes <= 0) return invalid_argument("--kv-transfer-config: HiSparseConnector needs host_pool_gb");
  return c;
}

HotBuffer::HotBuffer(int slots) : pos_of_(slots, -1), prev_(slots), next_(slots) {
  size_t cap = 2;
  shift_ = 31;
  while (cap < 2 * static_cast<size_t>(std::max(slots, 1))) cap *= 2, --shift_;
  keys_.assign(cap, -1);
  vals_.assign(cap, -1);
  // Every row starts free, in row order from the LRU end.
  for (int32_t r = 0; r < slots; ++r) push_mru(r);
}

int32_t HotBuffer::find(int32_t pos) const {
  const size_t mask = keys_.size() - 1;
  for (size_t i = home(pos);; i = (i + 1) & mask) {
    if (keys_[i] == pos) return vals_[i];
    if (keys_[i] < 0) return -1;
  }
}

void HotBuffer::insert(int32_t pos, int32_t row) {
  const size_t mask = keys_.size() - 1;
  size_t i = home(pos);
  while (keys_[i] >= 0) i = (i + 1) & mask;
  keys_[i] = pos;
  vals_[i] = row;
  ++resident_;
}

void HotBuffer::erase(int32_t pos) {
  const size_t mask = keys_.size() - 1;
  size_t i = home(pos);
  while (keys_[i] != pos) {
    if (keys_[i] < 0) return;
    i = (i + 1) & mask;
  }
  // Backward shift: move later entries of the probe run into the hole when their home allows.
  for (size_t j = (i + 1) & mask; keys_[j] >= 0; j = (j + 1) & mask) {
    const size_t h = home(keys_[j]);
    if (((j - h) & mask) >= ((j - i) & mask)) {  // h is not in (i, j]: the entry may move to i
      keys_[i] = keys_[j];
      vals_[i] = vals_[j];
      i = j;
    }
  }
  keys_[i] = -1;
  vals_[i] = -1;
  --resident_;
}

void HotBuffer::unlink(int32_t row) {
  const int32_t p = prev_[row], n = next_[row];
  (p >= 0 ? next_[p] : head_) = n;
  (n >= 0 ? prev_[n] : tail_) = p;
}

void HotBuffer::push_mru(int32_t row) {
  prev_[row] = tail_;
  next_[row] = -1;
  (tail_ >= 0 ? next_[tail_] : head_) = row;
  tail_ = row;
}

void HotBuffer::touch(const std::vector<int32_t>& wanted, int32_t* rows, std::vector<std::pair<int32_t, int32_t>>* loads) {
  // Hits move to the MRU end first, so the misses' victims, taken from the LRU end, are rows
  // not wanted by this call (at most slots() - hits of them are needed, and that many exist).
  thread_local std::vector<size_t> misses;
  misses.clear();
  for (size_t i = 0; i < wanted.size(); ++i) {
    const int32_t row = find(wanted[i]);
    if (row < 0) {
      misses.push_back(i);
      continue;
    }
    rows[i] = row;
    unlink(row);
    push_mru(row);
  }
  for (size_t i : misses) {
    const int32_t row = head_;
    if (pos_of_[row] >= 0) erase(pos_of_[row]);
    pos_of_[row] = wanted[i];
    insert(wanted[i], row);
    unlink(row);
    push_mru(row);
    rows[i] = row;
    loads->emplace_back(wanted[i], row);
  }
}

void HotBuffer::forget_from(int64_t pos) {
  for (int32_t r = 0; r < slots(); ++r) {
    if (pos_of_[r] < pos) continue;
    erase(pos_of_[r]);
    pos_of_[r] = -1;
    unlink(r);  // a free row is the first to be taken
    prev_[r] = -1;
    next_[r] = head_;
    (head_ >= 0 ? prev_[head_] : tail_) = r;
    head_ = r;
  }
}

HiSparseState::HiSparseState(int layers, int regions, int slots)
    : layers_(layers), regions_(regions), slots_(slots), written_(regions, 0) {
  buffers_.reserve(static_cast<size_t>(layers) * regions);
  for (int i = 0; i < layers * regions; ++i) buffers_.emplace_back(slots);
  for (int g = regions - 1; g >= 0; --g) free_.push_back(g);
}

int64_t HiSparseState::resident_rows() const {
  int64_t n = 0;
  for (const auto& b : buffers_) n += b.resident();
  return n;
}

Result<int> HiSparseState::region(int64_t seq_id) {
  if (auto it = region_of_.find(seq_id); it != region_of_.end()) return it->second;
  if (free_.empty())
    return resource_exhausted("HiSparse: every one of the {} hot-buffer regions is in use (seq {}); "
                              "the engine runs at most max_num_seqs sequences",
                              regions_, seq_id);
  const int g = free_.back();
  free_.pop_back();
  region_of_[seq_id] = g;
  written_[g] = 0;
  return g;
}

void HiSparseState::release(int64_t seq_id) {
  const auto it = region_of_.find(seq_id);
  if (it == region_of_.end()) return;
  const int g = it->second;
  for (int l = 0; l < layers_; ++l) buffer(g, l).forget_from(0);
  written_[g] = 0;
  free_.push_back(g);
  region_of_.erase(it);
}

Status HiSparseState::begin_seq_step(int64_t seq_id, int64_t start_pos, int64_t end_pos) {
  ML4_ASSIGN_OR_RETURN(int g, region(seq_id));
  if (start_pos < written_[g])
    for (int l = 0; l < layers_; ++l) buffer(g, l).forget_from(start_pos);
  written_[g] = end_pos;
  return ok_status();
}

int hisparse_hot_layers(const ModelConfig& cfg) {
  int n = 0;
  for (const auto& s : cfg.layers) n += s.sparse() ? 1 : 0;
  return n;
}

Result<HiSparseSizing> hisparse_sizing(const ModelConfig& cfg, const KvCacheSpec& spec, const HiSparseConfig& config,
                                       int64_t device_bytes, int64_t max_num_seqs, bool drafter) {
  if (!cfg.has_dsa()) return invalid_argument("HiSparse needs a sparse-attention (DSA) model: this one attends every key");
  HiSparseSizing z;
  z.layers = hisparse_hot_layers(cfg);
  z.regions = static_cast<int>(std::max<int64_t>(max_num_seqs, 1));
  z.slots = config.hot_slots_per_request > 0 ? config.hot_slots_per_request : 2 * cfg.indexer.topk;
  if (z.slots < cfg.indexer.topk)
    return invalid_argument("HiSparse: hot_slots_per_request {} is below the indexer's top-k {} (one decode token's rows)",
                            z.slots, cfg.indexer.topk);
  const int g_lat = spec.group_index(CacheGroupSpec::kLatent);
  z.hot_bytes = static_cast<int64_t>(z.layers) * z.regions * z.slots * spec.groups[g_lat].token_bytes_per_layer;
  z.blocks.assign(spec.groups.size(), 0);
  int64_t left = device_bytes - z.hot_bytes;
  if (left <= 0)
    return invalid_argument("HiSparse: the hot buffers ({} layers x {} requests x {} rows = {} MiB) do not fit the device "
                            "KV budget of {} MiB; lower hot_slots_per_request or --max-num-seqs",
                            z.layers, z.regions, z.slots, z.hot_bytes >> 20, device_bytes >> 20);
  const int64_t windows = drafter ? z.regions : 0;
  int64_t device_block_bytes = 0, host_block_bytes = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const auto& gs = spec.groups[g];
    const int64_t per_block = gs.page_bytes_per_layer() * static_cast<int64_t>(gs.layers.size());
    if (gs.kind == CacheGroupSpec::kLatent) {
      host_block_bytes += per_block;
    } else if (gs.full_attention()) {
      device_block_bytes += per_block;
    } else if (windows > 0) {
      const int64_t fit = std::min(windows * PagedKvCache::window_blocks(gs), per_block > 0 ? left / per_block : 0);
      z.blocks[g] = fit;
      left -= fit * per_block;
    }
  }
  int64_t n = host_block_bytes > 0 ? config.host_pool_bytes / host_block_bytes : 0;
  if (n <= 0)
    return invalid_argument("HiSparse: the host pool of {} bytes holds no block of {} tokens ({} bytes over the latent "
                            "layers); raise host_pool_gb",
                            config.host_pool_bytes, kPageTokens, host_block_bytes);
  if (device_block_bytes > 0) n = std::min(n, left / device_block_bytes);
  if (n <= 0)
    return invalid_argument("HiSparse: after the hot buffers the device KV budget holds no indexer block ({} bytes); "
                            "raise the KV budget or lower hot_slots_per_request / --max-num-seqs",
                            device_block_bytes);
  for (size_t g = 0; g < spec.groups.size(); ++g)
    if (spec.groups[g].full_attention()) z.blocks[g] = n;
  return z;
}

}  // namespace ml4
