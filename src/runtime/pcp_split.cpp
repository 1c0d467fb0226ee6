#include "runtime/pcp_split.h"

#include <algorithm>

namespace ml4 {

std::vector<int64_t> pcp_tokens(const StepMetadata& all, int size, int rank) {
  std::vector<int64_t> out;
  std::vector<int64_t> logits_per_seq(all.seqs.size(), 0);
  for (int64_t row : all.logits_rows) ++logits_per_seq[all.seq_of_token[row]];
  for (size_t si = 0; si < all.seqs.size(); ++si) {
    const auto& s = all.seqs[si];
    const int64_t n = s.num_tokens, pieces = 2 * static_cast<int64_t>(size);
    if (size == 1 || n < pieces || logits_per_seq[si] > 1) {
      if (rank == 0)
        for (int64_t i = 0; i < n; ++i) out.push_back(s.first_token + i);
      continue;
    }
    for (int64_t piece : {static_cast<int64_t>(rank), pieces - 1 - rank})
      for (int64_t i = piece * n / pieces; i < (piece + 1) * n / pieces; ++i) out.push_back(s.first_token + i);
  }
  std::sort(out.begin(), out.end());
  return out;
}

StepMetadata pcp_step_metadata(const StepMetadata& all, int size, int rank) {
  StepMetadata md;
  md.shard = all.shard;
  md.page_tokens_ = all.page_tokens_;
  md.sharded_ = all.sharded_;
  md.slots.assign(all.slots.size(), {});
  const std::vector<int64_t> mine = pcp_tokens(all, size, rank);
  std::vector<char> is_logits(all.num_tokens(), 0);
  for (int64_t row : all.logits_rows) is_logits[row] = 1;
  int prev_seq = -1;
  int64_t prev_token = -2;
  for (int64_t t : mine) {
    const int si = all.seq_of_token[t];
    if (si != prev_seq || t != prev_token + 1) {  // a new run
      StepMetadata::Seq run = all.seqs[si];
      run.first_token = md.num_tokens();
      run.num_tokens = 0;
      run.start_pos = all.positions[t];
      md.seqs.push_back(run);
    }
    const int64_t local = md.num_tokens();
    md.seqs.back().num_tokens++;
    md.token_ids.push_back(all.token_ids[t]);
    md.positions.push_back(all.positions[t]);
    md.seq_of_token.push_back(static_cast<int32_t>(md.seqs.size() - 1));
    for (size_t g = 0; g < all.slots.size(); ++g) md.slots[g].push_back(all.slots[g][t]);
    if (is_logits[t]) md.logits_rows.push_back(local);
    prev_seq = si;
    prev_token = t;
  }
  // Every rank's share, for the gather index.
  std::vector<std::vector<int64_t>> shares(size);
  for (int q = 0; q < size; ++q) {
    shares[q] = q == rank ? mine : pcp_tokens(all, size, q);
    md.pcp_rows = std::max<int64_t>(md.pcp_rows, static_cast<int64_t>(shares[q].size()));
  }
  md.pcp_gather.assign(all.num_tokens(), -1);
  for (int q = 0; q < size; ++q)
    for (size_t j = 0; j < shares[q].size(); ++j)
      md.pcp_gather[shares[q][j]] = static_cast<int32_t>(q * md.pcp_rows + static_cast<int64_t>(j));
  return md;
}

}  // namespace ml4
