// HiSparse on `serve` and `generate` (SYSTEM.md S12; offload/hisparse.h): the connector vLLM's
// offload connectors use, --kv-transfer-config '{"kv_connector":"HiSparseConnector",
// "kv_connector_extra_config":{"host_pool_gb":G,"hot_slots_per_request":S}}'. The host pool
// (G GiB) holds the latent KV of every admitted request; --kv-cache-memory-bytes (or the GPU
// memory fraction) is the device side: the indexer cache, the drafter's windows and
// max_num_seqs x the hot buffers (S rows per request and sparse layer; default 2 x top-k).
#pragma once

#include <algorithm>
#include <string>

#include "core/status.h"
#include "offload/hisparse.h"
#include "runtime/model_runner.h"

namespace ml4::cli {

// True (and ro->hisparse filled) when the config names the HiSparse connector; false when it
// names another connector (P/D) or is empty.
inline Result<bool> hisparse_runner_options(const std::string& kv_transfer_config, int64_t max_num_seqs,
                                            RunnerOptions* ro) {
  if (kv_transfer_config.empty() || !is_hisparse_connector(kv_transfer_config)) return false;
  ML4_ASSIGN_OR_RETURN(ro->hisparse, parse_hisparse_config(kv_transfer_config));
  ro->max_num_seqs = std::max(ro->max_num_seqs, max_num_seqs);  // one hot-buffer region per running sequence
  return true;
}

}  // namespace ml4::cli
