// --speculative-config for `serve` and `generate` (vLLM's flag, engine/spec_decode.h): parsed
// and checked against the model's config before the runner loads, so a bad config or a model
// without a drafter is refused at start-up with the reason; then the runner is asked to load
// the drafter and to size the drafter's window cache for max_num_seqs requests.
#pragma once

#include <string>

#include "core/status.h"
#include "engine/spec_decode.h"
#include "model/config_loader.h"
#include "runtime/model_runner.h"

namespace ml4 {

inline Result<SpeculativeConfig> speculative_runner_options(const std::string& json_text, const std::string& model_dir,
                                                            int64_t max_num_seqs, RunnerOptions* ro) {
  if (json_text.empty()) return SpeculativeConfig{};
  ML4_ASSIGN_OR_RETURN(SpeculativeConfig spec, parse_speculative_config(json_text));
  ML4_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(model_dir));
  ML4_RETURN_IF_ERROR(check_speculative_config(spec, cfg));
  ro->drafter = true;
  ro->max_num_seqs = drafter_runner_seqs(max_num_seqs, cfg);
  return spec;
}

}  // namespace ml4
