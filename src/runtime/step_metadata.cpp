#include "runtime/step_metadata.h"

namespace ml4 {

Result<StepMetadata> build_step_metadata(const StepInput& in, const std::vector<CacheGroupInfo>& groups,
                                         int vocab_size, int64_t max_model_len, int only_group,
                                         const ContextShard& shard) {
  StepMetadata md;
  md.shard = shard;
  const int ngroups = static_cast<int>(groups.size());
  md.page_tokens_.resize(ngroups);
  md.sharded_.resize(ngroups);
  for (int g = 0; g < ngroups; ++g) {
    const int n = groups[g].context_shards;
    if (n > 1 && (n != shard.size || groups[g].page_tokens % n != 0))
      return internal_error("cache group {} is sharded {} ways, the step's shard {} ways", groups[g].name, n, shard.size);
    md.page_tokens_[g] = groups[g].page_tokens / n;
    md.sharded_[g] = n > 1;
  }
  md.slots.resize(ngroups);
  for (size_t si = 0; si < in.seqs.size(); ++si) {
    const SeqStep& s = in.seqs[si];
    auto where = [&](const std::string& what) {
      return fmt::format("step seq {} (id {}): {}", si, s.seq_id, what);
    };
    if (s.tokens.empty()) return invalid_argument("{}", where("no tokens"));
    if (s.start_pos < 0) return invalid_argument("{}", where("negative start_pos"));
    if (s.num_logits < 0 || s.num_logits > static_cast<int>(s.tokens.size()))
      return invalid_argument("{}", where(fmt::format("num_logits {} outside [0, {}]", s.num_logits, s.tokens.size())));
    const int64_t end = s.start_pos + static_cast<int64_t>(s.tokens.size());
    if (max_model_len > 0 && end > max_model_len)
      return out_of_range("{}", where(fmt::format("context {} exceeds max_model_len {}", end, max_model_len)));
    if (static_cast<int>(s.block_tables.size()) != ngroups)
      return invalid_argument("{}", where(fmt::format("{} block tables for {} cache groups", s.block_tables.size(), ngroups)));
    for (int g = 0; g < ngroups; ++g) {
      const auto& bt = s.block_tables[g];
      const int64_t page = groups[g].page_tokens;
      // Full-attention groups must cover the step (all of them, or only_group); a
      // sliding-window group may hold kNoBlock (-1) for pages it released or never took (the
      // engine takes none for positions no later draft reads), and gives a slot where its
      // table covers a token: a token without one gets no drafter context.
      const bool sliding = groups[g].sliding_window != 0;
      const bool must_cover = only_group >= 0 ? g == only_group : !sliding;
      if (must_cover && static_cast<int64_t>(bt.size()) * page < end)
        return invalid_argument("{}", where(fmt::format("group {} block table covers {} tokens, needs {}",
                                                        groups[g].name, bt.size() * page, end)));
      for (size_t i = 0; i < bt.size(); ++i) {
        const int32_t b = bt[i];
        if (sliding && b == -1) continue;  // released or never taken
        if (b < 0 || b >= groups[g].num_blocks)
          return out_of_range("{}", where(fmt::format("group {} block id {} outside [0, {})", groups[g].name, b, groups[g].num_blocks)));
      }
    }
    StepMetadata::Seq seq;
    seq.step = &s;
    seq.first_token = md.num_tokens();
    seq.num_tokens = static_cast<int64_t>(s.tokens.size());
    seq.start_pos = s.start_pos;
    seq.context_len = end;
    md.seqs.push_back(seq);
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      int32_t id = s.tokens[i];
      if (id < 0 || id >= vocab_size)
        return invalid_argument("{}", where(fmt::format("token id {} outside the vocabulary [0, {})", id, vocab_size)));
      md.token_ids.push_back(id);
      md.positions.push_back(s.start_pos + static_cast<int64_t>(i));
      md.seq_of_token.push_back(static_cast<int32_t>(si));
    }
    for (int64_t i = seq.num_tokens - s.num_logits; i < seq.num_tokens; ++i) md.logits_rows.push_back(seq.first_token + i);
  }
  for (int g = 0; g < ngroups; ++g) {
    md.slots[g].resize(md.num_tokens(), -1);
    for (int64_t t = 0; t < md.num_tokens(); ++t) {
      const auto& bt = md.seqs[md.seq_of_token[t]].step->block_tables[g];
      const int64_t pos = md.positions[t];
      if (md.sharded(g) && !shard.holds(pos)) continue;  // another DCP rank's token
      const int64_t index = md.sharded(g) ? shard.local_index(pos) : pos;
      const int64_t b = index / md.page_tokens_[g];
      if (b < static_cast<int64_t>(bt.size()) && bt[b] >= 0) md.slots[g][t] = md.slot_of(md.seq_of_token[t], g, index);
    }
  }
  return md;
}

Status shard_cache_groups(const KvCacheSpec& spec, const ContextShard& shard, std::vector<CacheGroupInfo>* groups) {
  if (!shard.sharded()) return ok_status();
  for (size_t g = 0; g < spec.groups.size() && g < groups->size(); ++g) {
    const auto kind = spec.groups[g].kind;
    if (kind != CacheGroupSpec::kLatent && kind != CacheGroupSpec::kIndexer) continue;
    CacheGroupInfo& info = (*groups)[g];
    if (info.page_tokens % shard.interleave != 0)
      return invalid_argument("--dcp-kv-cache-interleave-size {} must divide the {}-token KV page", shard.interleave,
                              info.page_tokens);
    info.page_tokens *= shard.size;
    info.context_shards = shard.size;
  }
  return ok_status();
}

}  // namespace ml4
