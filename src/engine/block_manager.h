// KvBlockManager: which KV blocks each request owns, per cache group, with prefix caching.
//
// The runner owns the page memory of every cache group (latent, indexer, later the drafter
// window); this class owns the ids. Each group is a separate pool with its own page size and
// block count. A block is ref-counted: a request holds one ref per block in its table, a
// prefix-cache hit shares a block between requests.
//
// Prefix caching (vLLM v1 kv_cache_manager / block_pool design): every full block gets a
// hash chained over token ids, h_i = H(h_{i-1}, tokens of block i), so a hash names the whole
// prefix. Full blocks are registered in a per-group hash -> block map; when the last ref
// drops they stay in the map but go back to the free list, at its tail (evicted last), while
// blocks with no hash go to its head. Allocation pops the head and evicts whatever hash it
// carried. A hit must exist in *every* group (the forward needs all of them), and the hit
// length is a multiple of every group's page size and leaves at least one prompt token to
// compute (the step needs logits). Stored tokens are compared on a hit, so a 64-bit hash
// collision can never return another prompt's KV.
//
// Accounting is exact: allocate() first computes, per group, the blocks it would take off
// the free list (new blocks plus hit blocks whose ref is 0, which sit in the free list) and
// changes nothing unless every group has them; free counts are therefore never negative and
// return to their start when every request is gone (tested).
//
// A sliding-window group the runner gave no blocks (the drafter when speculation is off)
// is inactive: its tables stay empty and it takes no part in admission or prefix hits.
// An active sliding-window group (the drafter's window, MODEL.md section 5) holds only the
// blocks a later step can read. The DSpark drafter reads [anchor - window, anchor) where the
// anchor is the first token the target has not processed, so after a step that ends at e a
// position below min(e, tokens known) - window is never read again: allocate() gives such
// blocks back before it takes new ones and takes none for them (their table entries are
// kNoBlock, -1: the runner writes no context there and reads none), and
// release_outside_window() does the same after each step. A request's window therefore never
// spans more than window + draft block positions, however long its prefill chunks are. A
// prefix hit in such a group needs only the blocks of the window before the hit's end
// (vLLM's sliding-window cache hit): the hit is the longest prefix, a multiple of every page,
// that the full-attention groups hold whole and the window group holds over its last
// `window` positions. P/D transfer allocates blocks for num_external_tokens the same way as
// a prefill.
//
// Speculative decoding (engine/spec_decode.h): a verification step's tables cover the last
// token plus its drafts; afterwards trim() gives back every block past the accepted tokens,
// and extend_windows() makes the window groups cover the next draft block.
// Data parallelism (runtime/parallel_runner.h): when the runner's groups come in
// CacheGroupInfo::partitions ranges (one per DP rank), a request takes all its blocks from one
// range: the one of its prefix-cache hit, else the range with the most free blocks; a hit is
// cut where its chain leaves that range; capacity is one range's. Scheduling is unchanged:
// a request that finds its range full preempts as it would on one rank.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "engine/request.h"
#include "runtime/model_runner.h"

namespace ml4 {

constexpr int32_t kNoBlock = -1;  // a table entry released by a sliding-window group

struct PrefixHit {
  int64_t num_tokens = 0;                     // tokens whose KV is reused
  std::vector<std::vector<int32_t>> blocks;   // per group
  std::vector<std::vector<uint64_t>> hashes;  // per group
};

class KvBlockManager {
 public:
  KvBlockManager(std::vector<CacheGroupInfo> groups, bool enable_prefix_caching);

  int num_groups() const { return static_cast<int>(pools_.size()); }
  const CacheGroupInfo& group(int g) const { return pools_[g].info; }
  int64_t num_free_blocks(int g) const { return pools_[g].num_free; }
  int64_t num_total_blocks(int g) const { return pools_[g].info.num_blocks; }
  bool active(int g) const { return pools_[g].active; }
  int64_t num_free_blocks_total() const;
  double usage(int g) const;
  // Tokens one sequence can hold when it has the whole cache.
  int64_t capacity_tokens() const;
  bool prefix_caching() const { return prefix_caching_; }

  // Longest reusable cached prefix of the request's tokens (prompt + output so far).
  // Counts toward the prefix-cache query/hit statistics.
  PrefixHit find_cached_prefix(const Request& r);
  // Makes the request's tables cover `num_tokens` tokens, taking `hit`'s blocks first (only
  // for a request that holds none). Returns false and changes nothing when any group lacks
  // free blocks.
  bool allocate(Request& r, int64_t num_tokens, const PrefixHit* hit = nullptr);
  // Blocks `allocate(r, num_tokens)` would take off the free lists, per group.
  std::vector<int64_t> blocks_needed(const Request& r, int64_t num_tokens) const;
  // Drops the request's refs; its registered blocks stay cached until evicted; then the
  // release hook, if any, hears of it (the runner's per-sequence state, ModelRunner::release).
  void free(Request& r);
  void set_release_hook(std::function<void(int64_t seq_id)> hook) { release_hook_ = std::move(hook); }
  // The same for tables detached from their request (P/D: blocks held for a remote
  // consumer, or written by reads that outlived their request); clears them.
  void free_tables(std::vector<std::vector<int32_t>>& tables);
  // Sliding-window groups: releases the blocks wholly before r.num_computed - window.
  void release_outside_window(Request& r);
  // Gives back, in every group, the blocks wholly at or past position `num_tokens` (drafts the
  // verifier rejected; they hold no registered prefix).
  void trim(Request& r, int64_t num_tokens);
  // Makes every active sliding-window group's table cover `num_tokens` tokens (a draft block
  // past the computed tokens); false and no change when a group lacks free blocks.
  bool extend_windows(Request& r, int64_t num_tokens);
  // Registers the full blocks among tokens [0, r.num_computed) for reuse.
  void cache_full_blocks(Request& r);
  // Drops every cached hash whose block is free (e.g. after a weight update).
  void reset_prefix_cache();

  int64_t prefix_queries() const { return queries_; }  // tokens looked up
  int64_t prefix_hits() const { return hits_; }        // tokens found

  // Consistency of refs, free lists and hash maps; for tests and debug builds.
  Status check_invariants() const;

 private:
  struct Pool {
    CacheGroupInfo info;
    bool active = true;
    std::vector<int32_t> ref;
    std::vector<int32_t> prev, next;  // intrusive doubly linked free list
    std::vector<uint8_t> in_free;
    std::vector<uint8_t> has_hash;
    std::vector<uint64_t> hash;
    std::vector<std::vector<int32_t>> tokens;  // the block's tokens while it has a hash
    std::unordered_map<uint64_t, int32_t> cached;
    int32_t head = -1, tail = -1;
    int64_t num_free = 0;
    // Data parallelism: free blocks per partition (blocks [k part_size, (k + 1) part_size)).
    int64_t part_size = 0;
    std::vector<int64_t> part_free;
  };
  static void list_remove(Pool& p, int32_t b);
  static void list_push_front(Pool& p, int32_t b);
  static void list_push_back(Pool& p, int32_t b);
  static void drop_hash(Pool& p, int32_t b);
  // First block index a sliding-window group still needs for a request at `num_computed`.
  static int64_t first_window_block(const Pool& p, int64_t num_computed);
  // First block index a step that makes the request's tables cover `num_tokens` must hold.
  static int64_t first_needed_block(const Pool& p, const Request& r, int64_t num_tokens);
  // Drops the request's refs on table entries [0, first), leaving kNoBlock.
  static void release_before(Pool& p, std::vector<int32_t>& table, int64_t first);
  static void release_block(Pool& p, int32_t b);
  static uint64_t chain_hash(uint64_t parent, const Request& r, int64_t begin, int64_t end);
  // Data parallelism: the partition a request's new blocks come from, the free blocks there,
  // and the first free block of it (the free list's head without partitions).
  int partition_for(const Request& r, const PrefixHit* hit) const;
  int64_t free_in(const Pool& p, int part) const { return partitions_ > 1 ? p.part_free[part] : p.num_free; }
  int32_t free_head(const Pool& p, int part) const;

  std::vector<Pool> pools_;
  std::function<void(int64_t)> release_hook_;
  int partitions_ = 1;  // CacheGroupInfo::partitions
  bool prefix_caching_;
  int64_t lcm_page_ = 1;
  int64_t queries_ = 0, hits_ = 0;
};

}  // namespace ml4
