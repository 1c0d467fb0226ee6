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
    pools_.push_back(std::move(p));
    Pool& q = pools_.back();
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
}

void KvBlockManager::list_push_front(Pool& p, int32_t b) {
  p.prev[b] = -1;
  p.next[b] = p.head;
  if (p.head >= 0) p.prev[p.head] = b; else p.tail = b;
  p.head = b;
  p.in_free[b] = 1;
  ++p.num_free;
}

void KvBlockManager::list_push_back(Pool& p, int32_t b) {
  p.next[b] = -1;
  p.prev[b] = p.tail;
  if (p.tail >= 0) p.next[p.tail] = b; else p.head = b;
  p.tail = b;
  p.in_free[b] = 1;
  ++p.num_free;
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
  for (const auto& p : pools_)
    if (p.active) cap = std::min(cap, p.info.num_blocks * p.info.page_tokens);
  return cap == INT64_MAX ? 0 : cap;
}

PrefixHit KvBlockManager::find_cached_prefix(const Request& r) {
  PrefixHit hit;
  hit.blocks.resize(pools_.size());
  hit.hashes.resize(pools_.size());
  // prompt_logprobs needs the logits of every prompt position: no reuse (as vLLM v1).
  if (!prefix_caching_ || pools_.empty() || r.params.prompt_logprobs >= 0) return hit;
  const int64_t limit = r.num_tokens() - 1;  // at least one token is computed for logits
  int64_t best = limit;
  for (size_t g = 0; g < pools_.size() && best > 0; ++g) {
    const Pool& p = pools_[g];
    if (!p.active) continue;
    const int64_t page = p.info.page_tokens;
    uint64_t parent = kRootHash;
    int64_t found = 0;
    for (int64_t i = 0; (i + 1) * page <= best; ++i) {
      uint64_t h = chain_hash(parent, r, i * page, (i + 1) * page);
      auto it = p.cached.find(h);
      if (it == p.cached.end()) break;
      int32_t b = it->second;
      bool same = static_cast<int64_t>(p.tokens[b].size()) == page;
      for (int64_t k = 0; same && k < page; ++k) same = p.tokens[b][k] == r.token_at(i * page + k);
      if (!same) break;
      hit.blocks[g].push_back(b);
      hit.hashes[g].push_back(h);
      parent = h;
      found = (i + 1) * page;
    }
    best = std::min(best, found);
  }
  best = best / lcm_page_ * lcm_page_;
  hit.num_tokens = best;
  for (size_t g = 0; g < pools_.size(); ++g) {
    size_t keep = pools_[g].active ? static_cast<size_t>(best / pools_[g].info.page_tokens) : 0;
    hit.blocks[g].resize(std::min(keep, hit.blocks[g].size()));
    hit.hashes[g].resize(hit.blocks[g].size());
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
    have = std::max(have, first_window_block(pools_[g], r.num_computed));
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
  std::vector<int64_t> need(G, 0);
  for (size_t g = 0; g < G; ++g) {
    const Pool& p = pools_[g];
    if (!p.active) continue;
    int64_t have = static_cast<int64_t>(r.block_tables[g].size());
    int64_t from_free = 0;
    if (use_hit) {
      for (int32_t b : hit->blocks[g]) from_free += p.ref[b] == 0 ? 1 : 0;
      have += static_cast<int64_t>(hit->blocks[g].size());
    }
    have = std::max(have, first_window_block(p, r.num_computed));  // kNoBlock entries are free
    need[g] = from_free + std::max<int64_t>(0, ceil_div(num_tokens, p.info.page_tokens) - have);
    if (need[g] > p.num_free) return false;
  }
  for (size_t g = 0; g < G; ++g) {
    Pool& p = pools_[g];
    if (!p.active) continue;
    if (use_hit) {
      for (size_t i = 0; i < hit->blocks[g].size(); ++i) {
        int32_t b = hit->blocks[g][i];
        if (p.ref[b] == 0) list_remove(p, b);
        ++p.ref[b];
        r.block_tables[g].push_back(b);
        r.block_hashes[g].push_back(hit->hashes[g][i]);
      }
    }
    int64_t target = ceil_div(num_tokens, p.info.page_tokens);
    const int64_t first = first_window_block(p, r.num_computed);
    while (static_cast<int64_t>(r.block_tables[g].size()) < target) {
      if (static_cast<int64_t>(r.block_tables[g].size()) < first) {
        r.block_tables[g].push_back(kNoBlock);
        continue;
      }
      int32_t b = p.head;
      list_remove(p, b);
      drop_hash(p, b);  // evicts a cached block
      p.ref[b] = 1;
      r.block_tables[g].push_back(b);
    }
  }
  return true;
}

void KvBlockManager::free(Request& r) {
  free_tables(r.block_tables);
  for (auto& h : r.block_hashes) h.clear();
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
    auto& table = r.block_tables[g];
    const int64_t first = std::min<int64_t>(first_window_block(p, r.num_computed), table.size());
    for (int64_t i = first - 1; i >= 0 && table[i] != kNoBlock; --i) {
      const int32_t b = table[i];
      if (--p.ref[b] == 0) {
        if (p.has_hash[b]) list_push_back(p, b); else list_push_front(p, b);
      }
      table[i] = kNoBlock;
    }
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
    for (size_t b = 0; b < p.ref.size(); ++b) {
      if (p.ref[b] < 0) return internal_error("group {}: block {} has ref {}", g, b, p.ref[b]);
      if ((p.ref[b] == 0) != (p.in_free[b] != 0))
        return internal_error("group {}: block {} ref {} but in_free {}", g, b, p.ref[b], p.in_free[b]);
    }
    for (const auto& [h, b] : p.cached)
      if (!p.has_hash[b] || p.hash[b] != h) return internal_error("group {}: stale cache entry for block {}", g, b);
  }
  return Status::ok();
}

}  // namespace ml4
