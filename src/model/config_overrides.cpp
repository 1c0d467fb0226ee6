// Config overrides: see config_overrides.h.
#include "model/config_overrides.h"

#include <nlohmann/json.hpp>

#include "model/config_loader.h"
#include "model/presets.h"

namespace ml4 {
namespace {

using ojson = nlohmann::ordered_json;

Result<ojson> parse_object(const std::string& text, const char* what) {
  ojson j = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("{} is not valid JSON", what);
  if (!j.is_object()) return invalid_argument("{} must be a JSON object", what);
  return j;
}

std::vector<std::string> split_path(const std::string& key) {
  std::vector<std::string> parts;
  size_t b = 0;
  for (;;) {
    const size_t e = key.find('.', b);
    parts.push_back(key.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return parts;
}

Status check_known(const ojson& root, const std::vector<std::string>& path, const std::string& key, bool is_hf) {
  if (is_hf) {
    const ojson* node = &root;
    for (const auto& p : path) {
      if (!node->is_object() || !node->contains(p))
        return invalid_argument("--set {}: config.json has no key \"{}\" (only existing keys can be set in an HF config)",
                                key, key);
      node = &(*node)[p];
    }
    return ok_status();
  }
  if (!native_params_keys().count(path[0]))
    return invalid_argument("--set {}: \"{}\" is not a params.json key (known: dim, n_layers, n_heads, moe, yarn, ...; "
                            "see docs/MODEL-FORMAT.md)",
                            key, path[0]);
  if (path[0] == "moe" && path.size() == 2 && !native_moe_keys().count(path[1]))
    return invalid_argument("--set {}: \"{}\" is not a key of the moe block", key, path[1]);
  return ok_status();
}

}  // namespace

Result<std::vector<std::string>> split_overrides(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  bool quoted = false, escaped = false;
  for (char c : text) {
    if (quoted) {
      cur += c;
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') quoted = false;
      continue;
    }
    if (c == '"') quoted = true;
    else if (c == '[' || c == '{') ++depth;
    else if (c == ']' || c == '}') {
      if (--depth < 0) return invalid_argument("--set \"{}\": unbalanced '{}'", text, c);
    } else if (c == ',' && depth == 0) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      continue;
    }
    cur += c;
  }
  if (quoted || depth != 0) return invalid_argument("--set \"{}\": unterminated quote or bracket", text);
  if (!cur.empty()) out.push_back(cur);
  return out;
}

Result<bool> config_text_is_hf(const std::string& json_text) {
  ML4_ASSIGN_OR_RETURN(ojson j, parse_object(json_text, "the config"));
  return j.contains("model_type") || j.contains("hidden_size");
}

Result<std::string> apply_config_overrides(const std::string& json_text, const std::vector<std::string>& overrides,
                                           bool is_hf) {
  ML4_ASSIGN_OR_RETURN(ojson root, parse_object(json_text, is_hf ? "config.json" : "params.json"));
  for (const auto& group : overrides) {
    ML4_ASSIGN_OR_RETURN(std::vector<std::string> items, split_overrides(group));
    for (const auto& item : items) {
      const size_t eq = item.find('=');
      if (eq == std::string::npos || eq == 0)
        return invalid_argument("--set \"{}\": expected KEY=VALUE (e.g. dim=2048,moe.num_experts=32)", item);
      const std::string key = item.substr(0, eq), text = item.substr(eq + 1);
      const std::vector<std::string> path = split_path(key);
      for (const auto& p : path)
        if (p.empty()) return invalid_argument("--set \"{}\": empty component in key \"{}\"", item, key);
      ML4_RETURN_IF_ERROR(check_known(root, path, key, is_hf));
      ojson value = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
      if (value.is_discarded()) value = text;  // a bare word: a string
      ojson* node = &root;
      for (size_t i = 0; i + 1 < path.size(); ++i) {
        ojson& next = (*node)[path[i]];
        if (next.is_null()) next = ojson::object();
        if (!next.is_object())
          return invalid_argument("--set {}: \"{}\" is not an object", key, path[i]);
        node = &next;
      }
      if (value.is_null()) node->erase(path.back());
      else (*node)[path.back()] = value;
    }
  }
  return root.dump(2) + "\n";
}

Result<ModelConfig> resolve_model_config(const std::string& preset, const std::string& params_text,
                                         const std::vector<std::string>& overrides) {
  std::string text;
  bool hf = false;
  if (!params_text.empty()) {
    text = params_text;
    ML4_ASSIGN_OR_RETURN(hf, config_text_is_hf(text));
  } else {
    if (preset.empty()) return invalid_argument("give a --preset or a --params file");
    ML4_ASSIGN_OR_RETURN(text, preset_source_json(preset, &hf));
  }
  if (!overrides.empty()) {
    ML4_ASSIGN_OR_RETURN(text, apply_config_overrides(text, overrides, hf));
  }
  auto r = hf ? parse_hf_config_json(text) : parse_params_json(text);
  const std::string name = params_text.empty() ? preset : "custom";
  if (!r.ok()) return r.status().with_context(fmt::format("model config ({})", name));
  ModelConfig cfg = std::move(r).value();
  cfg.name = name;
  return cfg;
}

}  // namespace ml4
