// KvBlockManager (design in block_manager.h).
#include "engine/block_manager.h"

#include <algorithm>
#include <numeric>

namespace ml4 {
namespace {

// splitmix64 finalizer (Steele et al., "Fast splittable pseudorandom number generators").
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
constexpr uint64_t kRootHash = 0x6D6C345F6B760001ull;  // the empty prefix

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

KvBlockManager::KvBlockManager(std::vector<CacheGroupInfo> groups, bool enable_prefix_caching)
    : prefix_caching_(enable_prefix_caching) {
  for (auto& info : groups) {
    Pool p;
    p.info = info;
    p.active = !(info.sliding_window > 0 && info.num_blocks <= 0);
    size_t n = static_cast<size_t>(std::max<int64_t>(0, info.num_blocks));
    p.ref.assign(n, 0);
    p.prev.assign(n, -1);
    p.next.assign(n, -1);
    p.in_free.assign(n, 0);
    p.has_hash.assign(n, 0);
    p.hash.assign(n, 0);
    p.tokens.resize(n);
    partitions_ = std::max(partitions_, info.partitions);
    pools_.push_back(std::move(p));
    Pool& q = pools_.back();
    q.part_size = std::max<int64_t>(1, static_cast<int64_t>(n) / std::max(1, info.partitions));
    q.part_free.assign(std::max(1, info.partitions), 0);
    for (size_t b = 0; b < n; ++b) list_push_back(q, static_cast<int32_t>(b));
    if (q.active) lcm_page_ = std::lcm(lcm_page_, static_cast<int64_t>(std::max(1, info.page_tokens)));
  }
}

void KvBlockManager::list_remove(Pool& p, int32_t b) {
  int32_t pv = p.prev[b], nx = p.next[b];
  if (pv >= 0) p.next[pv] = nx; else p.head = nx;
  if (nx >= 0) p.prev[nx] = pv; else p.tail = pv;
  p.prev[b] = p.next[b] = -1;
  p.in_free[b] = 0;
  --p.num_free;
  --p.part_free[std::min<int64_t>(b / p.part_size, p.part_free.size() - 1)];
}

void KvBlockManager::list_push_front(Pool& p, int32_t b) {
  p.prev[b] = -1;
  p.next[b] = p.head;
  if (p.head >= 0) p.prev[p.head] = b; else p.tail = b;
  p.head = b;
  p.in_free[b] = 1;
  ++p.num_free;
  ++p.part_free[std::min<int64_t>(b / p.part_size, p.part_free.size() - 1)];
}

void KvBlockManager::list_push_back(Pool& p, int32_t b) {
  p.next[b] = -1;
  p.prev[b] = p.tail;
  if (p.tail >= 0) p.next[p.tail] = b; else p.head = b;
  p.tail = b;
  p.in_free[b] = 1;
  ++p.num_free;
  ++p.part_free[std::min<int64_t>(b / p.part_size, p.part_free.size() - 1)];
}

void KvBlockManager::drop_hash(Pool& p, int32_t b) {
  if (!p.has_hash[b]) return;
  auto it = p.cached.find(p.hash[b]);
  if (it != p.cached.end() && it->second == b) p.cached.erase(it);
  p.has_hash[b] = 0;
  p.tokens[b].clear();
  p.tokens[b].shrink_to_fit();
}

uint64_t KvBlockManager::chain_hash(uint64_t parent, const Request& r, int64_t begin, int64_t end) {
  uint64_t h = mix64(parent ^ static_cast<uint64_t>(end - begin));
  for (int64_t i = begin; i < end; ++i) h = mix64(h ^ static_cast<uint32_t>(r.token_at(i)));
  return h;
}

int64_t KvBlockManager::first_window_block(const Pool& p, int64_t num_computed) {
  if (p.info.sliding_window <= 0) return 0;
  const int64_t lo = num_computed - p.info.sliding_window;  // positions below lo are never read again
  return lo > 0 ? lo / p.info.page_tokens : 0;
}

int64_t KvBlockManager::first_needed_block(const Pool& p, const Request& r, int64_t num_tokens) {
  if (p.info.sliding_window <= 0) return 0;
  const int64_t end = std::min(num_tokens, r.num_tokens());  // the earliest later anchor
  return std::max(first_window_block(p, r.num_computed), first_window_block(p, end));
}

void KvBlockManager::release_block(Pool& p, int32_t b) {
  if (--p.ref[b] == 0) {
    if (p.has_hash[b]) list_push_back(p, b); else list_push_front(p, b);
  }
}

void KvBlockManager::release_before(Pool& p, std::vector<int32_t>& table, int64_t first) {
  const int64_t n = std::min<int64_t>(first, static_cast<int64_t>(table.size()));
  for (int64_t i = n - 1; i >= 0 && table[i] != kNoBlock; --i) {
    release_block(p, table[i]);
    table[i] = kNoBlock;
  }
}

int KvBlockManager::partition_for(const Request& r, const PrefixHit* hit) const {
  if (partitions_ <= 1) return 0;
  if (r.kv_partition >= 0) return r.kv_partition;
  if (hit != nullptr)
    for (size_t g = 0; g < hit->blocks.size(); ++g)
      for (int32_t b : hit->blocks[g])
        if (b != kNoBlock) return static_cast<int>(b / pools_[g].part_size);
  int best = 0;
  for (const auto& p : pools_) {
    if (!p.active || p.info.sliding_window > 0) continue;
    for (int k = 1; k < partitions_; ++k)
      if (p.part_free[k] > p.part_free[best]) best = k;
    break;
  }
  return best;
}

int32_t KvBlockManager::free_head(const Pool& p, int part) const {
  int32_t b = p.head;
  if (partitions_ > 1)
    while (b >= 0 && b / p.part_size != part) b = p.next[b];
  return b;
}

int64_t KvBlockManager::num_free_blocks_total() const {
  int64_t s = 0;
  for (const auto& p : pools_) s += p.num_free;
  return s;
}

double KvBlockManager::usage(int g) const {
  const Pool& p = pools_[g];
  if (p.info.num_blocks <= 0) return 0.0;
  return 1.0 - static_cast<double>(p.num_free) / static_cast<double>(p.info.num_blocks);
}

int64_t KvBlockManager::capacity_tokens() const {
  int64_t cap = INT64_MAX;
  for (const auto& p : pools_)  // a window group holds a window per request, whatever its length
    if (p.active && p.info.sliding_window <= 0)
      cap = std::min(cap, p.info.num_blocks / std::max(1, partitions_) * p.info.page_tokens);
  return cap == INT64_MAX ? 0 : cap;
}

PrefixHit KvBlockManager::find_cached_prefix(const Request& r) {
  PrefixHit hit;
  hit.blocks.resize(pools_.size());
  hit.hashes.resize(pools_.size());
  // prompt_logprobs needs the logits of every prompt position: no reuse (as vLLM v1).
  if (!prefix_caching_ || pools_.empty() || r.params.prompt_logprobs >= 0) return hit;
  const int64_t limit = r.num_tokens() - 1;  // at least one token is computed for logits
  int part = partitions_ > 1 ? r.kv_partition : 0;  // a hit stays within one DP partition
  // The cached run of a group: for block i, the block holding it (or -1) and its chain hash.
  auto lookup = [&](const Pool& p, int64_t upto, std::vector<int32_t>* blocks, std::vector<uint64_t>* hashes,
                    bool stop_at_miss) {
    const int64_t page = p.info.page_tokens;
    uint64_t parent = kRootHash;
    for (int64_t i = 0; (i + 1) * page <= upto; ++i) {
      const uint64_t h = chain_hash(parent, r, i * page, (i + 1) * page);
      int32_t b = -1;
      auto it = p.cached.find(h);
      if (it != p.cached.end()) {
        b = it->second;
        bool same = static_cast<int64_t>(p.tokens[b].size()) == page;
        for (int64_t k = 0; same && k < page; ++k) same = p.tokens[b][k] == r.token_at(i * page + k);
        if (!same) b = -1;
        if (b >= 0 && partitions_ > 1) {
          const int pb = static_cast<int>(b / p.part_size);
          if (part < 0) part = pb;
          if (pb != part) b = -1;
        }
      }
      if (b < 0 && stop_at_miss) break;
      blocks->push_back(b);
      hashes->push_back(h);
      parent = h;
    }
  };
  // Full-attention groups: the chain from position 0, up to the first miss.
  int64_t best = limit;
  for (size_t g = 0; g < pools_.size() && best > 0; ++g) {
    const Pool& p = pools_[g];
    if (!p.active || p.info.sliding_window > 0) continue;
    lookup(p, best, &hit.blocks[g], &hit.hashes[g], true);
    best = std::min(best, static_cast<int64_t>(hit.blocks[g].size()) * p.info.page_tokens);
  }
  // Sliding-window groups: every block may be missing except the window's before the end.
  std::vector<size_t> windowed;
  for (size_t g = 0; g < pools_.size(); ++g) {
    const Pool& p = pools_[g];
    if (!p.active || p.info.sliding_window <= 0) continue;
    windowed.push_back(g);
    lookup(p, best, &hit.blocks[g], &hit.hashes[g], false);
  }
  auto window_ok = [&](int64_t len) {
    for (size_t g : windowed) {
      const Pool& p = pools_[g];
      const int64_t last = len / p.info.page_tokens;  // blocks [first, last) must be cached
      for (int64_t i = first_window_block(p, len); i < last; ++i)
        if (i >= static_cast<int64_t>(hit.blocks[g].size()) || hit.blocks[g][i] < 0) return false;
    }
    return true;
  };
  best = best / lcm_page_ * lcm_page_;
  while (best > 0 && !window_ok(best)) best -= lcm_page_;
  hit.num_tokens = best;
  for (size_t g = 0; g < pools_.size(); ++g) {
    const Pool& p = pools_[g];
    const size_t keep = p.active ? static_cast<size_t>(best / p.info.page_tokens) : 0;
    hit.blocks[g].resize(std::min(keep, hit.blocks[g].size()));
    hit.hashes[g].resize(hit.blocks[g].size());
    if (p.info.sliding_window > 0)  // blocks before the window are not taken
      for (int64_t i = 0; i < std::min<int64_t>(first_window_block(p, best), hit.blocks[g].size()); ++i)
        hit.blocks[g][i] = kNoBlock;
  }
  queries_ += r.num_tokens();
  hits_ += best;
  return hit;
}

std::vector<int64_t> KvBlockManager::blocks_needed(const Request& r, int64_t num_tokens) const {
  std::vector<int64_t> need(pools_.size(), 0);
  for (size_t g = 0; g < pools_.size(); ++g) {
    if (!pools_[g].active) continue;
    int64_t have = g < r.block_tables.size() ? static_cast<int64_t>(r.block_tables[g].size()) : 0;
    have = std::max(have, first_needed_block(pools_[g], r, num_tokens));
    need[g] = std::max<int64_t>(0, ceil_div(num_tokens, pools_[g].info.page_tokens) - have);
  }
  return need;
}

bool KvBlockManager::allocate(Request& r, int64_t num_tokens, const PrefixHit* hit) {
  const size_t G = pools_.size();
  if (r.block_tables.size() != G) {
    r.block_tables.resize(G);
    r.block_hashes.resize(G);
  }
  const bool use_hit = hit != nullptr && hit->num_tokens > 0;
  const int part = partition_for(r, use_hit ? hit : nullptr);
  // Window groups first give back what no later step reads (valid whether or not the
  // allocation below succeeds).
  std::vector<int64_t> first(G, 0);
  for (size_t g = 0; g < G; ++g) {
    Pool& p = pools_[g];
    if (!p.active) continue;
    first[g] = first_needed_block(p, r, num_tokens);
    if (p.info.sliding_window > 0) release_before(p, r.block_tables[g], first[g]);
  }
  std::vector<int64_t> need(G, 0);
  for (size_t g = 0; g < G; ++g) {
    const Pool& p = pools_[g];
    if (!p.active) continue;
    int64_t have = static_cast<int64_t>(r.block_tables[g].size());
    int64_t from_free = 0;
    if (use_hit) {
      for (size_t i = 0; i < hit->blocks[g].size(); ++i) {
        const int32_t b = hit->blocks[g][i];
        if (b != kNoBlock && have + static_cast<int64_t>(i) >= first[g]) from_free += p.ref[b] == 0 ? 1 : 0;
      }
      have += static_cast<int64_t>(hit->blocks[g].size());
    }
    have = std::max(have, first[g]);  // kNoBlock entries are free
    need[g] = from_free + std::max<int64_t>(0, ceil_div(num_tokens, p.info.page_tokens) - have);
    if (need[g] > free_in(p, part)) return false;
  }
  for (size_t g = 0; g < G; ++g) {
    Pool& p = pools_[g];
    if (!p.active) continue;
    auto& table = r.block_tables[g];
    if (use_hit) {
      for (size_t i = 0; i < hit->blocks[g].size(); ++i) {
        const int32_t b = hit->blocks[g][i];
        if (b == kNoBlock || static_cast<int64_t>(table.size()) < first[g]) {
          table.push_back(kNoBlock);
        } else {
          if (p.ref[b] == 0) list_remove(p, b);
          ++p.ref[b];
          table.push_back(b);
        }
        r.block_hashes[g].push_back(hit->hashes[g][i]);
      }
    }
    const int64_t target = ceil_div(num_tokens, p.info.page_tokens);
    while (static_cast<int64_t>(table.size()) < target) {
      if (static_cast<int64_t>(table.size()) < first[g]) {
        table.push_back(kNoBlock);
        continue;
      }
      int32_t b = free_head(p, part);
      list_remove(p, b);
      drop_hash(p, b);  // evicts a cached block
      p.ref[b] = 1;
      table.push_back(b);
    }
  }
  if (partitions_ > 1) r.kv_partition = part;
  return true;
}

bool KvBlockManager::extend_windows(Request& r, int64_t num_tokens) {
  const size_t G = std::min(pools_.size(), r.block_tables.size());
  std::vector<int64_t> need(G, 0);
  for (size_t g = 0; g < G; ++g) {
    const Pool& p = pools_[g];
    if (!p.active || p.info.sliding_window <= 0) continue;
    const int64_t have = std::max<int64_t>(r.block_tables[g].size(), first_window_block(p, r.num_computed));
    need[g] = std::max<int64_t>(0, ceil_div(num_tokens, p.info.page_tokens) - have);
    if (need[g] > free_in(p, std::max(0, r.kv_partition))) return false;
  }
  for (size_t g = 0; g < G; ++g) {
    Pool& p = pools_[g];
    if (need[g] == 0) continue;
    auto& table = r.block_tables[g];
    const int64_t first = first_window_block(p, r.num_computed);
    while (static_cast<int64_t>(table.size()) < ceil_div(num_tokens, p.info.page_tokens)) {
      if (static_cast<int64_t>(table.size()) < first) {
        table.push_back(kNoBlock);
        continue;
      }
      int32_t b = free_head(p, std::max(0, r.kv_partition));
      list_remove(p, b);
      drop_hash(p, b);
      p.ref[b] = 1;
      table.push_back(b);
    }
  }
  return true;
}

void KvBlockManager::trim(Request& r, int64_t num_tokens) {
  for (size_t g = 0; g < r.block_tables.size() && g < pools_.size(); ++g) {
    Pool& p = pools_[g];
    auto& table = r.block_tables[g];
    const size_t keep = static_cast<size_t>(ceil_div(std::max<int64_t>(0, num_tokens), p.info.page_tokens));
    while (table.size() > keep) {
      if (table.back() != kNoBlock) release_block(p, table.back());
      table.pop_back();
    }
    if (g < r.block_hashes.size() && r.block_hashes[g].size() > keep) r.block_hashes[g].resize(keep);
  }
}

void KvBlockManager::free(Request& r) {
  free_tables(r.block_tables);
  for (auto& h : r.block_hashes) h.clear();
  r.kv_partition = -1;  // placed again at its next allocation (after a preemption)
  if (release_hook_) release_hook_(r.seq_id);
}

void KvBlockManager::free_tables(std::vector<std::vector<int32_t>>& tables) {
  for (size_t g = 0; g < tables.size() && g < pools_.size(); ++g) {
    Pool& p = pools_[g];
    auto& table = tables[g];
    // Reverse order: a sequence's tail blocks are the least likely to be shared, so they
    // are evicted first (they end up nearer the head among the hashed blocks).
    for (auto it = table.rbegin(); it != table.rend(); ++it) {
      int32_t b = *it;
      if (b == kNoBlock) continue;
      if (--p.ref[b] == 0) {
        if (p.has_hash[b]) list_push_back(p, b); else list_push_front(p, b);
      }
    }
    table.clear();
  }
}

void KvBlockManager::cache_full_blocks(Request& r) {
  if (!prefix_caching_) return;
  for (size_t g = 0; g < r.block_tables.size() && g < pools_.size(); ++g) {
    Pool& p = pools_[g];
    if (!p.active) continue;
    const int64_t page = p.info.page_tokens;
    const int64_t full = std::min<int64_t>(r.num_computed / page, r.block_tables[g].size());
    auto& hashes = r.block_hashes[g];
    for (int64_t i = static_cast<int64_t>(hashes.size()); i < full; ++i) {
      uint64_t parent = i == 0 ? kRootHash : hashes[i - 1];
      uint64_t h = chain_hash(parent, r, i * page, (i + 1) * page);
      hashes.push_back(h);
      int32_t b = r.block_tables[g][i];
      if (b == kNoBlock || p.has_hash[b] || p.cached.count(h)) continue;  // already cached (maybe elsewhere)
      p.has_hash[b] = 1;
      p.hash[b] = h;
      p.tokens[b].resize(page);
      for (int64_t k = 0; k < page; ++k) p.tokens[b][k] = r.token_at(i * page + k);
      p.cached[h] = b;
    }
  }
}

void KvBlockManager::release_outside_window(Request& r) {
  for (size_t g = 0; g < r.block_tables.size() && g < pools_.size(); ++g) {
    Pool& p = pools_[g];
    if (!p.active || p.info.sliding_window <= 0) continue;
    release_before(p, r.block_tables[g], first_window_block(p, r.num_computed));
  }
}

void KvBlockManager::reset_prefix_cache() {
  for (auto& p : pools_)
    for (size_t b = 0; b < p.ref.size(); ++b)
      if (p.ref[b] == 0) drop_hash(p, static_cast<int32_t>(b));
}

Status KvBlockManager::check_invariants() const {
  for (size_t g = 0; g < pools_.size(); ++g) {
    const Pool& p = pools_[g];
    int64_t n = 0;
    for (int32_t b = p.head; b >= 0; b = p.next[b]) {
      if (p.ref[b] != 0) return internal_error("group {}: block {} is free with ref {}", g, b, p.ref[b]);
      if (++n > p.info.num_blocks) return internal_error("group {}: free list has a cycle", g);
    }
    if (n != p.num_free) return internal_error("group {}: free list holds {}, count says {}", g, n, p.num_free);
    std::vector<int64_t> part(p.part_free.size(), 0);
    for (int32_t b = p.head; b >= 0; b = p.next[b]) ++part[std::min<int64_t>(b / p.part_size, part.size() - 1)];
    if (part != p.part_free) return internal_error("group {}: free counts per partition are off", g);
    for (size_t b = 0; b < p.ref.size(); ++b) {
      if (p.ref[b] < 0) return internal_error("group {}: block {} has ref {}", g, b, p.ref[b]);
      if ((p.ref[b] == 0) != (p.in_free[b] != 0))
        return internal_error("group {}: block {} ref {} but in_free {}", g, b, p.ref[b], p.in_free[b]);
    }
    for (const auto& [h, b] : p.cached)
      if (!p.has_hash[b] || p.hash[b] != h) return internal_error("group {}: stale cache entry for block {}", g, b);
  }
  return ok_status();
}

}  // namespace ml4
