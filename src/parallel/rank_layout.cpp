#include "parallel/rank_layout.h"

#include <fmt/format.h>

namespace ml4 {

Status ParallelConfig::validate() const {
  if (tensor_parallel_size < 1) return invalid_argument("--tensor-parallel-size must be >= 1, got {}", tensor_parallel_size);
  if (data_parallel_size < 1) return invalid_argument("--data-parallel-size must be >= 1, got {}", data_parallel_size);
  if (data_parallel_size > 1 && !enable_expert_parallel)
    return invalid_argument(
        "--data-parallel-size {} needs --enable-expert-parallel: data parallelism runs attention per DP rank and "
        "the experts expert-parallel over all ranks (DP attention + EP); experts TP-sharded over DP ranks are not "
        "supported",
        data_parallel_size);
  const int pcp = prefill_context_parallel_size;
  if (pcp < 1) return invalid_argument("--prefill-context-parallel-size must be >= 1, got {}", pcp);
  if (pcp > 1 && (data_parallel_size > 1 || enable_expert_parallel))
    return invalid_argument(
        "--prefill-context-parallel-size {} with data or expert parallelism is not supported yet (TP and DCP are)", pcp);
  const int dcp = decode_context_parallel_size;
  if (dcp < 1) return invalid_argument("--decode-context-parallel-size must be >= 1, got {}", dcp);
  if (tensor_parallel_size % dcp != 0)
    return invalid_argument(
        "--decode-context-parallel-size {} must divide --tensor-parallel-size {}: DCP shards the KV cache over the "
        "TP ranks that would otherwise hold copies of it",
        dcp, tensor_parallel_size);
  if (dcp_kv_cache_interleave_size < 1)
    return invalid_argument("--dcp-kv-cache-interleave-size must be >= 1, got {}", dcp_kv_cache_interleave_size);
  if (dcp_comm_backend != "a2a" && dcp_comm_backend != "ag_rs")
    return invalid_argument("--dcp-comm-backend must be a2a or ag_rs, got \"{}\"", dcp_comm_backend);
  return ok_status();
}

Result<RankLayout> RankLayout::make(const ParallelConfig& config, int world_size, int world_rank) {
  ML4_RETURN_IF_ERROR(config.validate());
  if (world_size != config.world_size())
    return invalid_argument(
        "{} processes were started but --tensor-parallel-size {} x --data-parallel-size {} x "
        "--prefill-context-parallel-size {} needs {} (mpirun -np {})",
        world_size, config.tensor_parallel_size, config.data_parallel_size, config.prefill_context_parallel_size,
        config.world_size(), config.world_size());
  if (world_rank < 0 || world_rank >= world_size)
    return internal_error("rank {} outside a world of {}", world_rank, world_size);
  RankLayout L;
  L.config = config;
  L.world_size = world_size;
  L.world_rank = world_rank;
  L.tp_size = config.tensor_parallel_size;
  L.dp_size = config.data_parallel_size;
  L.pcp_size = config.prefill_context_parallel_size;
  L.tp_rank = L.tp_rank_of(world_rank);
  L.pcp_rank = L.pcp_rank_of(world_rank);
  L.dp_rank = L.dp_rank_of(world_rank);
  const int tp_first = world_rank - L.tp_rank;
  for (int t = 0; t < L.tp_size; ++t) L.tp_group.push_back(tp_first + t);
  for (int d = 0; d < L.dp_size; ++d) L.dp_group.push_back(L.replica_leader(d) + L.pcp_rank * L.tp_size + L.tp_rank);
  for (int q = 0; q < L.pcp_size; ++q) L.pcp_group.push_back(L.replica_leader(L.dp_rank) + q * L.tp_size + L.tp_rank);
  if (config.enable_expert_parallel) {
    L.ep_size = world_size;
    L.ep_rank = world_rank;
    for (int r = 0; r < world_size; ++r) L.ep_group.push_back(r);
  } else {
    L.ep_group = {world_rank};
  }
  L.dcp_size = config.decode_context_parallel_size;
  L.dcp_rank = L.tp_rank % L.dcp_size;
  for (int d = 0; d < L.dcp_size; ++d) L.dcp_group.push_back(world_rank - L.dcp_rank + d);
  return L;
}

std::string RankLayout::describe() const {
  std::string s = fmt::format("parallel layout: world {} = dp {} x tp {}{}, expert parallel {}{}{}\n", world_size, dp_size,
                              tp_size, pcp_size > 1 ? fmt::format(" x pcp {}", pcp_size) : std::string(),
                              config.enable_expert_parallel ? "on" : "off",
                              config.enable_expert_parallel ? fmt::format(" (ep {})", ep_size) : "",
                              (dcp_size > 1 ? fmt::format(", decode context parallel {} (interleave {}, {})", dcp_size,
                                                          config.dcp_kv_cache_interleave_size, config.dcp_comm_backend)
                                            : std::string()) +
                                  (pcp_size > 1 ? fmt::format(", prefill context parallel {}", pcp_size) : std::string()));
  for (int r = 0; r < world_size; ++r) {
    s += fmt::format("  rank {}: dp {} tp {}", r, dp_rank_of(r), tp_rank_of(r));
    if (pcp_size > 1) s += fmt::format(" pcp {}", pcp_rank_of(r));
    if (config.enable_expert_parallel) s += fmt::format(" ep {}", r);
    if (dcp_size > 1) s += fmt::format(" dcp {}", tp_rank_of(r) % dcp_size);
    if (r == 0) s += "  (API server, engine, scheduler)";
    s += "\n";
  }
  return s;
}

}  // namespace ml4
