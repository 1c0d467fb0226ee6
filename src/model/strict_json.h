// Strict JSON for untrusted files (safetensors headers, shard indexes): nlohmann-json
// accepts duplicate keys (the last wins) and any nesting; a checkpoint must not, since a
// duplicate key is a tensor described twice. One parser, the callers word the messages.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace ml4 {

struct StrictJsonMessages {
  std::string what;  // "header", "index": "<what> is not valid JSON", "<what> JSON nests deeper ..."
  // The message for a duplicate `key` in an object opened at `depth` (1: top level).
  std::function<std::string(int depth, const std::string& key)> duplicate;
};

// Parses `text`, refusing duplicate keys in any object and nesting past `max_depth`.
// Errors read "<label>: <message>".
Status parse_strict_json(const std::string& label, std::string_view text, int max_depth,
                         const StrictJsonMessages& messages, nlohmann::json* out);

}  // namespace ml4
