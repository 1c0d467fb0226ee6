// ContextShard: which tokens of a sequence one rank of a decode-context-parallel group holds
// (SYSTEM.md S8, vLLM's DCP layout).
//
// With N ranks and interleave I, token i lives on rank (i / I) % N at local index
// (i / (N I)) I + i % I: runs of I consecutive tokens go round the ranks. A rank's tokens keep
// their order, so "the keys visible to position p" are a prefix of its local indices
// (local_count(p + 1) of them), and a sparse selection of global positions maps to local
// indices one by one. The engine's block of the sharded cache groups covers N pages, one per
// rank (the same block id on every rank): page_tokens x N tokens, so a rank's pool of B blocks
// holds N times the tokens of an unsharded one, exactly. N = 1 is the identity.
#pragma once

#include <algorithm>
#include <cstdint>

namespace ml4 {

struct ContextShard {
  int size = 1;        // N: ranks of the DCP group
  int rank = 0;        // this rank
  int interleave = 1;  // I

  bool sharded() const { return size > 1; }
  int owner(int64_t i) const { return static_cast<int>((i / interleave) % size); }
  bool holds(int64_t i) const { return owner(i) == rank; }
  int64_t local_index(int64_t i) const { return (i / (static_cast<int64_t>(size) * interleave)) * interleave + i % interleave; }
  int64_t global_index(int64_t j) const {
    return ((j / interleave) * size + rank) * interleave + j % interleave;
  }
  // Tokens of positions [0, n) this rank holds.
  int64_t local_count(int64_t n) const {
    const int64_t round = static_cast<int64_t>(size) * interleave;
    const int64_t rest = n % round - static_cast<int64_t>(rank) * interleave;
    return (n / round) * interleave + std::clamp<int64_t>(rest, 0, interleave);
  }
};

}  // namespace ml4
