// Prefill context parallelism (SYSTEM.md S9): which tokens of a step each rank of a PCP group
// runs, with the load balance of the DualChunkSwap split.
//
// A sequence's chunk of n tokens with n >= 2P and at most one logits row is cut into 2P
// near-equal pieces; rank r runs pieces r and 2P - 1 - r, so the causal attention work (which
// grows along the chunk) is even over the ranks, and the last piece, with the logits row, is
// rank 0's. Shorter chunks (decode tokens, small prefill tails) and verification chunks (more
// than one logits row) run on rank 0 whole. Every rank then holds logits only where rank 0
// does: rank 0 returns every logits row of the step.
//
// The K/V of every token of the step are written by every rank (the cache is whole on each
// PCP rank; DCP may shard it): each rank computes its tokens' latent and indexer rows, the
// group all-gathers them into a fixed [P][pcp_rows] buffer (pcp_rows: the most tokens any rank
// runs), and the rows are put back in step order through StepMetadata::pcp_gather before the
// cache write (ModelForward).
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "runtime/step_metadata.h"

namespace ml4 {

// Token indices (in `all`'s flat order, ascending) that PCP rank `rank` of `size` runs.
std::vector<int64_t> pcp_tokens(const StepMetadata& all, int size, int rank);

// The rank's StepMetadata: its tokens, one Seq per run of consecutive tokens (context_len the
// sequence's whole context, so the keys other ranks write this step are read), its logits
// rows, and the gather index of the whole step. `all` must outlive it.
StepMetadata pcp_step_metadata(const StepMetadata& all, int size, int rank);

}  // namespace ml4
