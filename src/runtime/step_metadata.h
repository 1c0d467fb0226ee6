// StepMetadata: the per-token view of one step, built once from the engine's StepInput
// (STYLE.md rule 2: one plain struct, passed by const&).
//
// Tokens of all sequences are flattened in order; every token knows its sequence, its
// absolute position and its cache slot in each group (slot = block * page + offset, the
// FlashMLA/vLLM slot_mapping convention). Building validates everything that comes from
// outside: token ids in the vocabulary, block tables that cover the positions, block ids
// in range; a bad step is rejected before any cache byte is written.
//
// Decode context parallelism (kv/context_shard.h): in a cache group the runner reports with
// context_shards N > 1, a rank holds only its shard of each sequence's tokens, and that
// group's cache indices are local: slots[g][t] is -1 for a token another rank holds, keys(seq,
// g) and visible(t, g) count the local keys, slot_of() takes a local index and the group's
// physical page (page_tokens / N). Other groups (the drafter's window) stay per position.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "kv/cache_spec.h"
#include "kv/context_shard.h"
#include "runtime/model_runner.h"
#include "runtime/step.h"

namespace ml4 {

struct StepMetadata {
  struct Seq {
    const SeqStep* step = nullptr;  // the engine's description (block tables)
    int64_t first_token = 0;        // index of its first token in the flat arrays
    int64_t num_tokens = 0;
    int64_t start_pos = 0;
    int64_t context_len = 0;        // start_pos + num_tokens: keys visible to its last token
  };
  std::vector<int32_t> token_ids;             // [T]
  std::vector<int64_t> positions;             // [T]
  std::vector<int32_t> seq_of_token;          // [T]
  std::vector<std::vector<int64_t>> slots;    // [group][T]
  std::vector<Seq> seqs;
  std::vector<int64_t> logits_rows;           // flat token indices whose logits are returned
  // Prefill context parallelism (runtime/pcp_split.h): this metadata holds one rank's share of
  // a step whose K/V every rank of the group writes (the runner's write metadata holds the
  // whole step); pcp_rows: rows per rank in the all-gather of the share's K/V; pcp_gather:
  // for each token of the whole step, its row in the gathered [ranks][pcp_rows] buffer.
  int64_t pcp_rows = 0;
  std::vector<int32_t> pcp_gather;

  ContextShard shard;                         // this rank's share of the sharded groups

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  bool sharded(int group) const { return sharded_[group] != 0; }
  // Keys of sequence `seq` in group `group`'s cache index space (its context, or this rank's
  // share of it), and the keys visible to token t (positions <= its own).
  int64_t keys(int seq, int group) const {
    return sharded(group) ? shard.local_count(seqs[seq].context_len) : seqs[seq].context_len;
  }
  int64_t visible(int64_t t, int group) const {
    return sharded(group) ? shard.local_count(positions[t] + 1) : positions[t] + 1;
  }
  // Slot of cache index `index` (a position; a local index in a sharded group) of sequence
  // `seq` in cache group `group`.
  int64_t slot_of(int seq, int group, int64_t index) const {
    const auto& bt = seqs[seq].step->block_tables[group];
    return static_cast<int64_t>(bt[index / page_tokens_[group]]) * page_tokens_[group] + index % page_tokens_[group];
  }

  std::vector<int> page_tokens_;  // per group: tokens of one physical page
  std::vector<char> sharded_;     // per group
};

// only_group >= 0: only that group's tables must cover the step (a DSpark draft step, which
// touches only the drafter group); else every full-attention group's must. shard: this
// rank's place in its DCP group; its size must equal the context_shards of every sharded group.
Result<StepMetadata> build_step_metadata(const StepInput& in, const std::vector<CacheGroupInfo>& groups,
                                         int vocab_size, int64_t max_model_len, int only_group = -1,
                                         const ContextShard& shard = {});

// Decode context parallelism: the latent and indexer groups of `spec` (groups[g] describes
// spec.groups[g]) become sharded over shard.size ranks: their engine block covers size pages.
// The drafter's window group stays whole on every rank. The interleave must divide a page.
Status shard_cache_groups(const KvCacheSpec& spec, const ContextShard& shard, std::vector<CacheGroupInfo>* groups);

}  // namespace ml4
