// StepMetadata: the per-token view of one step, built once from the engine's StepInput
// (STYLE.md rule 2: one plain struct, passed by const&).
//
// Tokens of all sequences are flattened in order; every token knows its sequence, its
// absolute position and its cache slot in each group (slot = block * page + offset, the
// FlashMLA/vLLM slot_mapping convention). Building validates everything that comes from
// outside: token ids in the vocabulary, block tables that cover the positions, block ids
// in range; a bad step is rejected before any cache byte is written.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
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

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  // Slot of position `pos` of sequence `seq` in cache group `group`.
  int64_t slot_of(int seq, int group, int64_t pos) const {
    const auto& bt = seqs[seq].step->block_tables[group];
    return static_cast<int64_t>(bt[pos / page_tokens_[group]]) * page_tokens_[group] + pos % page_tokens_[group];
  }

  std::vector<int> page_tokens_;  // per group
};

// only_group >= 0: only that group's tables must cover the step (a DSpark draft step, which
// touches only the drafter group); else every full-attention group's must.
Result<StepMetadata> build_step_metadata(const StepInput& in, const std::vector<CacheGroupInfo>& groups,
                                         int vocab_size, int64_t max_model_len, int only_group = -1);

}  // namespace ml4
