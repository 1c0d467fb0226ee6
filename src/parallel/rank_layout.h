// RankLayout: which part of the model each process of a parallel group runs (SYSTEM.md S10).
//
// Ranks are processes (one per GPU, or CPU ranks), numbered by the launcher (MPI). The layout
// is vLLM's: world size = data_parallel_size x tensor_parallel_size, TP innermost, so
//   world rank = dp_rank * tp + tp_rank,
// the TP group of a rank is the tp consecutive ranks of its DP replica, its DP group the ranks
// with the same tp_rank, and, with --enable-expert-parallel, the EP group is the whole world
// (EP size = dp x tp, ep_rank = world rank), as vLLM's FusedMoEParallelConfig makes it.
// Prefill context parallelism (SYSTEM.md S9, --prefill-context-parallel-size P) adds ranks, as
// vLLM's does: world = dp x pcp x tp, TP innermost, then PCP; the PCP group of a rank is the
// ranks with its dp and tp ranks. Each PCP rank runs its share of a prompt's tokens with the
// whole TP shard of the weights (runtime/pcp_split.h).
// Decode context parallelism (SYSTEM.md S8, --decode-context-parallel-size N) reuses the TP
// ranks, as vLLM's does: N must divide tp, and the DCP groups are runs of N consecutive ranks
// of a TP group (dcp_rank = tp_rank % N). The latent and indexer caches, replicated over the TP
// group without it, are sharded by token over each DCP group (kv/context_shard.h).
//
// Choices where the issue is silent (docs/PARALLEL.md): data parallelism needs expert
// parallelism (DP attention + EP experts, the seed's "DP4/EP"); vLLM's alternative without EP
// (experts TP-sharded over dp x tp with tokens gathered over DP) is not built.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace ml4 {

// The user's request, spelled as vLLM's flags.
struct ParallelConfig {
  int tensor_parallel_size = 1;   // --tensor-parallel-size / -tp
  int data_parallel_size = 1;     // --data-parallel-size / -dp
  bool enable_expert_parallel = false;  // --enable-expert-parallel
  int decode_context_parallel_size = 1;  // --decode-context-parallel-size / -dcp
  int dcp_kv_cache_interleave_size = 1;  // --dcp-kv-cache-interleave-size: tokens per run on one rank
  std::string dcp_comm_backend = "a2a";  // --dcp-comm-backend a2a | ag_rs: how partials are combined
  int prefill_context_parallel_size = 1;  // --prefill-context-parallel-size / -pcp
  int world_size() const { return tensor_parallel_size * data_parallel_size * prefill_context_parallel_size; }
  bool parallel() const { return world_size() > 1; }
  Status validate() const;
};

struct RankLayout {
  ParallelConfig config;
  int world_size = 1, world_rank = 0;
  int tp_size = 1, tp_rank = 0;
  int dp_size = 1, dp_rank = 0;
  int ep_size = 1, ep_rank = 0;  // 1 / 0 without expert parallelism
  int dcp_size = 1, dcp_rank = 0;
  int pcp_size = 1, pcp_rank = 0;
  // World ranks of this rank's groups, in group-rank order (group rank i = element i).
  std::vector<int> tp_group, dp_group, ep_group, dcp_group, pcp_group;

  // The layout of world rank `rank` of `world` processes; world must equal config.world_size().
  static Result<RankLayout> make(const ParallelConfig& config, int world_size, int world_rank);
  // The whole layout, one line per rank ("rank 3: dp 1 tp 1 ep 3"), printed at start-up.
  std::string describe() const;
  // The TP, PCP and DP rank of any world rank (world rank = (dp * pcp + pcp_rank) * tp + tp_rank),
  // and the world rank of DP replica d's first rank.
  int tp_rank_of(int world_rank) const { return world_rank % tp_size; }
  int pcp_rank_of(int world_rank) const { return (world_rank / tp_size) % pcp_size; }
  int dp_rank_of(int world_rank) const { return world_rank / (tp_size * pcp_size); }
  int replica_leader(int dp) const { return dp * tp_size * pcp_size; }
};

}  // namespace ml4
