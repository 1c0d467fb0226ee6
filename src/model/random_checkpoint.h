// make_model(): writes a model directory with random weights for a preset (the body of
// `ml4 make-model`, also used by tests).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ml4 {

struct MakeModelOptions {
  std::string preset;       // a preset name; may be empty when params_text is given
  std::string params_text;  // a params.json / config.json text used instead of the preset's
  std::vector<std::string> overrides;  // "KEY=VALUE[,...]" (model/config_overrides.h)
  std::string out_dir;
  uint64_t seed = 0;
  std::string weight_dtype = "bf16";  // bf16 | fp8 | nvfp4 | mxfp4
  std::string layout = "default";     // native | hf | both (HF in OUT/hf) | merged (one dir) | default
  std::string hf_model_type;          // empty: the config's own, else "mistral4"
  int64_t max_shard_bytes = int64_t{4} << 30;
  std::string tokenizer_json;         // written as tekken.json when not empty
};

Status make_model(const MakeModelOptions& o);

}  // namespace ml4
