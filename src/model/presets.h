// Built-in model shapes (MODEL.md section 7). Each preset is written as params.json or
// config.json text and parsed through the real loaders, so the presets exercise the same
// code path as a model directory. The choices that MODEL.md leaves open are documented in
// docs/MODEL-FORMAT.md ("Presets").
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "model/model_config.h"

namespace ml4 {

// "ml4", "ml4-slice-N" (1 <= N <= 72), "ml4-tiny", "mistral4-tiny", "dsv32-tiny".
Result<ModelConfig> preset_config(const std::string& name);

// The names preset_config accepts ("ml4-slice-N" listed once, as a pattern).
std::vector<std::string> preset_names();

// The text preset_config parses: params.json for ml4*, config.json for the HF presets.
// `*is_hf` (optional) is set to whether the text is an HF config.json.
Result<std::string> preset_source_json(const std::string& name, bool* is_hf = nullptr);

}  // namespace ml4
