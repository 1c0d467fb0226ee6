// ForwardTrace: what one forward decided (the indexer's top-k sets, the routed experts),
// and test input that overrides those decisions. Every backend's runner fills and obeys it
// (ModelRunner::execute_traced), so the golden comparisons run the same way on each.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "model/model_config.h"

namespace ml4 {

// Optional record of what a forward decided, for tests and golden comparisons.
struct ForwardTrace {
  // [layer][token] -> selected key positions (sorted ascending) in sparse layers; empty
  // vector for dense layers.
  std::vector<std::vector<std::vector<int32_t>>> topk;
  // [layer][token][expert slot] -> routed expert ids (routing replay, S15).
  std::vector<std::vector<std::vector<int32_t>>> experts;
  // Input, for golden comparisons (tests/runtime/golden_test.cpp): where forced_topk[layer]
  // is non-empty, that sparse layer attends to forced_topk[layer][token] (this step's
  // tokens) instead of its indexer's choice; `topk` still records the indexer's own sets.
  // This isolates one implementation's near-tie selections from the rest of the forward.
  std::vector<std::vector<std::vector<int32_t>>> forced_topk;
  // Input, likewise: where forced_experts[layer] is non-empty, that MoE layer runs experts
  // forced_experts[layer][token] (num_experts_per_tok ids) weighted as its router would
  // weigh them; `experts` still records the router's own choice.
  std::vector<std::vector<std::vector<int32_t>>> forced_experts;
};

// Forced selections are test input: checked before any index is used. forced_experts rows
// hold num_experts_per_tok ids in [0, num_experts) on MoE layers; forced_topk rows hold at
// most indexer.topk positions in [0, positions[t]]; one row per token of the step.
Status validate_forced_decisions(const ForwardTrace& trace, const ModelConfig& cfg,
                                 const std::vector<int64_t>& positions);

}  // namespace ml4
