// HiSparse (SYSTEM.md S12): the latent KV of every admitted request in a host pool, and in
// device memory only a hot buffer per request and attention layer.
//
// Sparse attention reads only the top-k rows of each query, so the latent cache group (the
// "host pool": pinned, device-mapped memory on CUDA) holds every token of every admitted
// request, and the device keeps, per request and per layer that attends a selection, a hot
// buffer of S rows with LRU replacement (SGLang's sparsity2 and SparseServe keep the same
// shape of working set; FIELD-NOTES "Host offload for sparse attention"). Each step, each
// layer's selection is diffed against what its hot buffer holds; only the missing rows are
// copied from the host pool (a gather reading host memory through UVA on CUDA), and attention
// reads the hot rows through a remapped index list in the selection's own order, so the
// attention kernel and its summation order are unchanged and outputs equal those without
// offload bit for bit.
//
// What stays on the device: the indexer K cache (the indexer scans every key of every query:
// offloading it would move the whole cache over the bus each step), the activations, and
// the hot buffers. KV-sharing consumers read their source's host rows (no second copy) and
// keep hot buffers of their own, since their selections differ (ML4's 9 consumers of layer
// 35). Indexer reusers likewise: the owner's selection over their own (or their source's) rows.
//
// Writes of new tokens go to the host pool only, before the layer's attention; the layer's
// rows are fetched after the write in the same queue, so a row read in a step is the one
// written. A step that starts before positions the hot buffers hold (the verifier rejected
// drafts, which the next step overwrites) first forgets those positions.
//
// A sequence whose selections in one step cover more distinct rows than its hot buffer (a
// long prefill chunk: each token has its own top-k) cannot be served from it: such a layer
// reads the host pool directly for the whole step (the same bytes; PCIe speed on CUDA). The
// hot path is the decode steps', where the working set is one top-k per sequence.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/status.h"
#include "kv/cache_spec.h"

namespace ml4 {

struct HiSparseConfig {
  bool enabled = false;
  // Bytes of the host pool (the latent cache group of every admitted request).
  int64_t host_pool_bytes = 0;
  // Rows of one hot buffer (per request and attention layer); 0: twice the indexer's top-k
  // (the seed's config: 4,096 for top-k 2,048).
  int hot_slots_per_request = 0;
};

// `--kv-transfer-config '{"kv_connector":"HiSparseConnector","kv_connector_extra_config":
// {"host_pool_gb":G,"hot_slots_per_request":S}}'` (the connector shape vLLM uses for its
// offload connectors). Unknown keys, a non-positive pool and S < 1 are refused.
Result<HiSparseConfig> parse_hisparse_config(const std::string& kv_transfer_config);
// True when the JSON names the HiSparse connector (so the P/D connector parser is not asked).
bool is_hisparse_connector(const std::string& kv_transfer_config);

// One hot buffer: S rows, each holding one position's latent row, least recently used first out.
class HotBuffer {
 public:
  explicit HotBuffer(int slots);
  int slots() const { return static_cast<int>(pos_of_.size()); }
  int resident() const { return resident_; }
  // Makes every position of `wanted` (distinct, at most slots()) resident: rows[i] is the row
  // of wanted[i]; rows evicted are the least recently used ones not among `wanted`; each
  // position that was not resident is appended to `loads` as (position, row).
  void touch(const std::vector<int32_t>& wanted, int32_t* rows, std::vector<std::pair<int32_t, int32_t>>* loads);
  // Forgets every position >= pos (its host row is about to be rewritten).
  void forget_from(int64_t pos);

 private:
  void unlink(int32_t row);
  void push_mru(int32_t row);
  // position -> row: open addressing, linear probing, backward-shift deletion (no tombstones),
  // at most half full: a decode step looks up every selected position of every sparse layer,
  // so this is the host's hot loop (std::unordered_map cost ~5x more per lookup).
  int32_t find(int32_t pos) const;
  void insert(int32_t pos, int32_t row);
  void erase(int32_t pos);
  size_t home(int32_t pos) const { return (static_cast<uint32_t>(pos) * 0x9E3779B1u) >> shift_; }
  std::vector<int32_t> keys_, vals_;  // keys_ -1: empty
  int shift_ = 32;
  int resident_ = 0;
  std::vector<int32_t> pos_of_;       // row -> position, -1 when free
  std::vector<int32_t> prev_, next_;  // LRU list: head_ least recent
  int32_t head_ = -1, tail_ = -1;
};

// The hot buffers of every request: `regions` requests at a time (RunnerOptions::
// max_num_seqs), `layers` hot layers each (the layers that attend a selection). Row r of hot
// layer l of region g is row g * slots + r of that layer's device pool.
class HiSparseState {
 public:
  HiSparseState(int layers, int regions, int slots);
  int layers() const { return layers_; }
  int regions() const { return regions_; }
  int slots() const { return slots_; }
  int regions_in_use() const { return static_cast<int>(region_of_.size()); }
  int64_t resident_rows() const;

  // The region of a sequence, taken at its first step; an error when all are in use.
  Result<int> region(int64_t seq_id);
  // The sequence is gone (finished, aborted, preempted): its region and rows are free.
  void release(int64_t seq_id);
  // Before a step of `seq_id` starting at `start_pos` that writes through `end_pos`: rows at
  // or past start_pos that an earlier step saw are forgotten in every layer.
  Status begin_seq_step(int64_t seq_id, int64_t start_pos, int64_t end_pos);
  HotBuffer& buffer(int region, int layer) { return buffers_[static_cast<size_t>(region) * layers_ + layer]; }

  // Counters (metrics, tests).
  int64_t hits = 0, loads = 0, direct_layers = 0, hot_layers = 0;

 private:
  int layers_, regions_, slots_;
  std::vector<HotBuffer> buffers_;
  std::unordered_map<int64_t, int> region_of_;
  std::vector<int64_t> written_;  // per region: positions written by its steps so far
  std::vector<int> free_;
};

// Layers that attend a selection (LayerSpec::sparse()): each has a hot buffer per request.
int hisparse_hot_layers(const ModelConfig& cfg);

// The memory plan (SYSTEM.md S12): the latent group (every KV-owning layer, consumers bind to
// their source's rows) in a host pool of config.host_pool_bytes; the device budget holds the
// drafter's windows (as PagedKvCache::blocks_for_budget), max_num_seqs regions of hot
// buffers, and the indexer cache. Full-attention groups get equal block counts (the engine
// admits by tokens), the largest both sides hold.
struct HiSparseSizing {
  int layers = 0, regions = 0, slots = 0;
  int64_t hot_bytes = 0;
  std::vector<int64_t> blocks;  // per spec group
};
Result<HiSparseSizing> hisparse_sizing(const ModelConfig& cfg, const KvCacheSpec& spec, const HiSparseConfig& config,
                                       int64_t device_bytes, int64_t max_num_seqs, bool drafter);

}  // namespace ml4
