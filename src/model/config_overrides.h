// Model shapes from a preset or a config file, with key=value overrides (`ml4 make-model
// --preset P --params FILE --set k=v,...`), so benchmarks can build models of any shape.
//
// The overrides edit the config text (params.json or HF config.json) before it is parsed by
// the real loaders, so every check of config_loader applies to the result. Syntax follows
// vLLM's --hf-overrides in spirit, with llama.cpp's --override-kv flatness:
//   KEY=VALUE[,KEY=VALUE...]   KEY: a key path with dots into nested objects (moe.num_experts)
//                              VALUE: JSON (2048, 0.5, true, [3, 7], {"a": 1}, "text") or,
//                              when it does not parse as JSON, a plain string; `null` deletes
//                              the key (the block or option is then absent).
// Commas inside [...], {...} or quotes do not split. A key that the schema does not know is
// an error (a misspelt key would otherwise be ignored by the loader and change nothing):
// params.json top-level keys and `moe` keys are checked against the native schema, the
// ML4 blocks by the loader itself; in an HF config.json only keys already present may be set.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "model/model_config.h"

namespace ml4 {

// Splits "a=1,b=[2,3]" into {"a=1", "b=[2,3]"} (commas inside brackets/braces/quotes kept).
Result<std::vector<std::string>> split_overrides(const std::string& text);

// Applies overrides (each "KEY=VALUE", or several joined by commas) to a config text.
// is_hf: the text is an HF config.json (else params.json). Returns the edited text.
Result<std::string> apply_config_overrides(const std::string& json_text, const std::vector<std::string>& overrides,
                                           bool is_hf);

// Whether a config text is an HF config.json (has "model_type" or "hidden_size") rather
// than a params.json. Invalid JSON is an error.
Result<bool> config_text_is_hf(const std::string& json_text);

// The config a model directory is made from: `params_text` (a params.json / config.json
// text) when not empty, else the preset's text; then the overrides; then the loaders.
// The result's name is the preset's, or "custom" for a file.
Result<ModelConfig> resolve_model_config(const std::string& preset, const std::string& params_text,
                                         const std::vector<std::string>& overrides);

}  // namespace ml4
