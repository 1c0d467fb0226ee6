// OpenAI request parsing and response building (design in openai_protocol.h).
#include "server/openai_protocol.h"

#include <algorithm>
#include <cmath>

namespace ml4 {
namespace {

const char* type_name(const ojson& v) {
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

// Each getter leaves *out alone when the field is absent or null.
Status get_double(const ojson& b, const char* key, double* out) {
  auto it = b.find(key);
  if (it == b.end() || it->is_null()) return ok_status();
  if (!it->is_number()) return invalid_argument("'{}' must be a number, got {}", key, type_name(*it));
  double v = it->get<double>();
  if (!std::isfinite(v)) return invalid_argument("'{}' must be finite", key);
  *out = v;
  return ok_status();
}

Status get_int(const ojson& b, const char* key, int64_t lo, int64_t hi, int64_t* out) {
  auto it = b.find(key);
  if (it == b.end() || it->is_null()) return ok_status();
  if (!it->is_number_integer()) return invalid_argument("'{}' must be an integer, got {}", key, type_name(*it));
  int64_t v = it->is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(it->get<uint64_t>(), INT64_MAX))
                                       : it->get<int64_t>();
  if (v < lo || v > hi) return invalid_argument("'{}' must be in [{}, {}], got {}", key, lo, hi, v);
  *out = v;
  return ok_status();
}

Status get_bool(const ojson& b, const char* key, bool* out) {
  auto it = b.find(key);
  if (it == b.end() || it->is_null()) return ok_status();
  if (!it->is_boolean()) return invalid_argument("'{}' must be a boolean, got {}", key, type_name(*it));
  *out = it->get<bool>();
  return ok_status();
}

Status parse_prompt(const ojson& b, const TextCodec& codec, ApiRequest* r) {
  auto it = b.find("prompt");
  if (it == b.end() || it->is_null()) return invalid_argument("'prompt' is required");
  const ojson& p = *it;
  auto ids_of = [&](const ojson& arr, std::vector<int32_t>* ids) -> Status {
    for (const auto& t : arr) {
      if (!t.is_number_integer()) return invalid_argument("'prompt' token ids must be integers");
      int64_t v = t.get<int64_t>();
      if (v < 0 || v >= codec.vocab_size())
        return invalid_argument("'prompt' token id {} is outside the vocabulary [0, {})", v, codec.vocab_size());
      ids->push_back(static_cast<int32_t>(v));
    }
    return ok_status();
  };
  auto add_text = [&](const std::string& s) -> Status {
    ML4_ASSIGN_OR_RETURN(auto ids, codec.encode(s, true));
    r->prompts.push_back(std::move(ids));
    r->prompt_texts.push_back(s);
    return ok_status();
  };
  if (p.is_string()) return add_text(p.get<std::string>());
  if (!p.is_array() || p.empty()) return invalid_argument("'prompt' must be a string, an array of strings or of token ids");
  if (p[0].is_number_integer()) {
    std::vector<int32_t> ids;
    ML4_RETURN_IF_ERROR(ids_of(p, &ids));
    r->prompt_texts.push_back(codec.decode(ids, false));
    r->prompts.push_back(std::move(ids));
    return ok_status();
  }
  if (p.size() > 64) return invalid_argument("at most 64 prompts per request, got {}", p.size());
  for (const auto& e : p) {
    if (e.is_string()) {
      ML4_RETURN_IF_ERROR(add_text(e.get<std::string>()));
    } else if (e.is_array() && !e.empty()) {
      std::vector<int32_t> ids;
      ML4_RETURN_IF_ERROR(ids_of(e, &ids));
      r->prompt_texts.push_back(codec.decode(ids, false));
      r->prompts.push_back(std::move(ids));
    } else {
      return invalid_argument("'prompt' must be a string, an array of strings or of token ids");
    }
  }
  return ok_status();
}

std::string token_text(const TextCodec& codec, int32_t id) { return sanitize_utf8(codec.token_bytes(id)); }

ojson bytes_json(const std::string& raw) {
  ojson a = ojson::array();
  for (unsigned char c : raw) a.push_back(static_cast<int>(c));
  return a;
}

bool present(const ojson& b, const char* key) {
  auto it = b.find(key);
  return it != b.end() && !it->is_null();
}

// Fields ml4 knows and does not implement: a 400 naming them, never a silent ignore.
Status refuse_unsupported(const ojson& b, bool chat, int n) {
  if (!chat && present(b, "suffix") && !(b["suffix"].is_string() && b["suffix"].get<std::string>().empty()))
    return invalid_argument("'suffix' is not supported (ml4 has no fill-in-the-middle)");
  if (present(b, "best_of")) {
    const ojson& v = b["best_of"];
    if (!v.is_number_integer()) return invalid_argument("'best_of' must be an integer, got {}", type_name(v));
    if (v.get<int64_t>() != 1 && v.get<int64_t>() != n)
      return invalid_argument("'best_of' other than 1 or n is not supported (ml4 returns n independent samples)");
  }
  if (present(b, "use_beam_search") && b["use_beam_search"] != false)
    return invalid_argument("'use_beam_search' is not supported");
  for (const char* key : {"prompt_embeds", "structural_tag", "guided_whitespace_pattern", "logits_processors"})
    if (present(b, key)) return invalid_argument("'{}' is not supported", key);
  if (chat) {
    if (present(b, "functions") || present(b, "function_call"))
      return invalid_argument("'functions' and 'function_call' are not supported: use 'tools' and 'tool_choice'");
    for (const char* key : {"audio", "prediction", "web_search_options"})
      if (present(b, key)) return invalid_argument("'{}' is not supported", key);
    if (present(b, "modalities")) {
      const ojson& m = b["modalities"];
      if (!m.is_array()) return invalid_argument("'modalities' must be an array");
      for (const auto& x : m)
        if (x != "text") return invalid_argument("'modalities': only \"text\" is supported");
    }
  }
  return ok_status();
}

// A JSON schema given as an object (or a string holding one).
Result<std::string> schema_text(const ojson& v, const char* key) {
  if (v.is_object() || v.is_boolean()) return v.dump();
  if (v.is_string()) {
    try {
      ojson parsed = ojson::parse(v.get<std::string>());
      if (parsed.is_object() || parsed.is_boolean()) return parsed.dump();
    } catch (const std::exception&) {
    }
  }
  return invalid_argument("'{}' must be a JSON schema (an object, or a string holding one)", key);
}

Result<std::vector<std::string>> string_list(const ojson& v, const char* key) {
  if (!v.is_array() || v.empty()) return invalid_argument("'{}' must be a non-empty array of strings", key);
  std::vector<std::string> out;
  for (const auto& x : v) {
    if (!x.is_string()) return invalid_argument("'{}' must be a non-empty array of strings", key);
    out.push_back(x.get<std::string>());
  }
  return out;
}

// response_format, structured_outputs and the guided_* fields: at most one constraint.
Status parse_structured(const ojson& b, GrammarSpec* out) {
  int count = 0;
  auto take = [&](GrammarSpec g) {
    ++count;
    *out = std::move(g);
  };
  if (present(b, "response_format")) {
    const ojson& rf = b["response_format"];
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
      return invalid_argument("'response_format' must be an object with a string 'type'");
    const std::string t = rf["type"].get<std::string>();
    if (t == "json_object") {
      take({GrammarSpec::Kind::kJsonObject, "", {}});
    } else if (t == "json_schema") {
      if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
        return invalid_argument("'response_format' of type json_schema needs a 'json_schema' object");
      const ojson& js = rf["json_schema"];
      if (!js.contains("schema")) return invalid_argument("'response_format.json_schema' needs a 'schema'");
      ML4_ASSIGN_OR_RETURN(std::string text, schema_text(js["schema"], "response_format.json_schema.schema"));
      take({GrammarSpec::Kind::kJsonSchema, std::move(text), {}});
    } else if (t != "text") {
      return invalid_argument("'response_format.type' must be text, json_object or json_schema, got '{}'", t);
    }
  }
  bool compact = false;
  if (present(b, "structured_outputs")) {
    const ojson& so = b["structured_outputs"];
    if (!so.is_object()) return invalid_argument("'structured_outputs' must be an object");
    if (present(so, "disable_any_whitespace")) {
      if (!so["disable_any_whitespace"].is_boolean())
        return invalid_argument("'structured_outputs.disable_any_whitespace' must be a boolean");
      compact = so["disable_any_whitespace"].get<bool>();
    }
    for (const auto& [k, v] : so.items()) {
      if (v.is_null()) continue;
      if (k == "json") {
        ML4_ASSIGN_OR_RETURN(std::string text, schema_text(v, "structured_outputs.json"));
        take({GrammarSpec::Kind::kJsonSchema, std::move(text), {}});
      } else if (k == "regex" || k == "grammar") {
        if (!v.is_string()) return invalid_argument("'structured_outputs.{}' must be a string", k);
        take({k == "regex" ? GrammarSpec::Kind::kRegex : GrammarSpec::Kind::kGrammar, v.get<std::string>(), {}});
      } else if (k == "choice") {
        ML4_ASSIGN_OR_RETURN(auto choices, string_list(v, "structured_outputs.choice"));
        take({GrammarSpec::Kind::kChoice, "", std::move(choices)});
      } else if (k == "json_object") {
        if (!v.is_boolean()) return invalid_argument("'structured_outputs.json_object' must be a boolean");
        if (v.get<bool>()) take({GrammarSpec::Kind::kJsonObject, "", {}});
      } else if (k == "disable_any_whitespace" || k == "disable_fallback" || k == "disable_additional_properties" ||
                 k == "backend" || k == "whitespace_pattern") {
        continue;  // backend options: xgrammar's defaults
      } else {
        return invalid_argument("'structured_outputs.{}' is not supported (json, regex, choice, grammar, json_object)", k);
      }
    }
  }
  if (present(b, "guided_json")) {
    ML4_ASSIGN_OR_RETURN(std::string text, schema_text(b["guided_json"], "guided_json"));
    take({GrammarSpec::Kind::kJsonSchema, std::move(text), {}});
  }
  for (const char* key : {"guided_regex", "guided_grammar"}) {
    if (!present(b, key)) continue;
    if (!b[key].is_string()) return invalid_argument("'{}' must be a string", key);
    take({std::string(key) == "guided_regex" ? GrammarSpec::Kind::kRegex : GrammarSpec::Kind::kGrammar,
          b[key].get<std::string>(), {}});
  }
  if (present(b, "guided_choice")) {
    ML4_ASSIGN_OR_RETURN(auto choices, string_list(b["guided_choice"], "guided_choice"));
    take({GrammarSpec::Kind::kChoice, "", std::move(choices)});
  }
  if (count > 1)
    return invalid_argument("at most one structured output constraint per request (response_format, "
                            "structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar)");
  out->any_whitespace = !compact;
  return ok_status();
}

// tool_choice (chat), as vLLM: "none", "auto", "required" or {"type": "function", "function":
// {"name": ...}}; the last two become grammars over the tools' parameter schemas.
Status parse_tool_choice(const ojson& b, ApiRequest* r) {
  std::vector<const ojson*> fns;
  if (present(b, "tools")) {
    if (!b["tools"].is_array()) return invalid_argument("'tools' must be an array");
    for (const auto& t : b["tools"]) {
      if (!t.is_object() || !t.contains("function") || !t["function"].is_object() || !t["function"].contains("name") ||
          !t["function"]["name"].is_string())
        return invalid_argument("each of 'tools' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}");
      fns.push_back(&t["function"]);
    }
  }
  using TC = ApiRequest::ToolChoice;
  r->tool_choice = fns.empty() ? TC::kNone : TC::kAuto;
  if (present(b, "tool_choice")) {
    const ojson& tc = b["tool_choice"];
    if (tc.is_string()) {
      const std::string v = tc.get<std::string>();
      if (v == "none") r->tool_choice = TC::kNone;
      else if (v == "auto") r->tool_choice = TC::kAuto;
      else if (v == "required") r->tool_choice = TC::kRequired;
      else return invalid_argument("'tool_choice' must be none, auto, required or a named function, got '{}'", v);
    } else if (tc.is_object() && tc.contains("type") && tc["type"] == "function" && tc.contains("function") &&
               tc["function"].is_object() && tc["function"].contains("name") && tc["function"]["name"].is_string()) {
      r->tool_choice = TC::kNamed;
      r->tool_name = tc["function"]["name"].get<std::string>();
    } else {
      return invalid_argument("'tool_choice' must be none, auto, required or {{\"type\": \"function\", "
                              "\"function\": {{\"name\": ...}}}}");
    }
  }
  if ((r->tool_choice == TC::kRequired || r->tool_choice == TC::kNamed) && fns.empty())
    return invalid_argument("'tool_choice' {} needs a non-empty 'tools'",
                            r->tool_choice == TC::kRequired ? "\"required\"" : "naming a function");
  if (r->tool_choice == TC::kAuto && fns.empty()) r->tool_choice = TC::kNone;
  auto params_of = [](const ojson& fn) {
    return fn.contains("parameters") && fn["parameters"].is_object()
               ? fn["parameters"]
               : ojson{{"type", "object"}, {"properties", ojson::object()}};
  };
  if (r->tool_choice == TC::kNamed) {
    const ojson* fn = nullptr;
    for (const ojson* f : fns)
      if ((*f)["name"] == r->tool_name) fn = f;
    if (!fn) return invalid_argument("'tool_choice' names function '{}', which is not in 'tools'", r->tool_name);
    r->grammar = {GrammarSpec::Kind::kJsonSchema, params_of(*fn).dump(), {}, false};
  } else if (r->tool_choice == TC::kRequired) {
    // vLLM's _get_json_schema_from_tool: an array of {"name", "parameters"}, one per call.
    ojson any = ojson::array();
    for (const ojson* f : fns)
      any.push_back({{"properties", {{"name", {{"type", "string"}, {"enum", ojson::array({(*f)["name"]})}}},
                                     {"parameters", params_of(*f)}}},
                     {"required", ojson::array({"name", "parameters"})}});
    ojson schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"type", "object"}, {"anyOf", any}}}};
    r->grammar = {GrammarSpec::Kind::kJsonSchema, schema.dump(), {}, false};
  }
  r->tools = r->tool_choice == TC::kAuto;
  return ok_status();
}

}  // namespace

Result<ApiRequest> parse_api_request(const ojson& b, bool chat, const TextCodec& codec) {
  if (!b.is_object()) return invalid_argument("the request body must be a JSON object");
  ApiRequest r;
  r.chat = chat;
  if (auto it = b.find("model"); it != b.end() && !it->is_null()) {
    if (!it->is_string()) return invalid_argument("'model' must be a string, got {}", type_name(*it));
    r.model = it->get<std::string>();
  }
  SamplingParams& p = r.params;
  int64_t v = 0;
  ML4_RETURN_IF_ERROR(get_double(b, "temperature", &p.temperature));
  ML4_RETURN_IF_ERROR(get_double(b, "top_p", &p.top_p));
  ML4_RETURN_IF_ERROR(get_double(b, "min_p", &p.min_p));
  ML4_RETURN_IF_ERROR(get_double(b, "frequency_penalty", &p.frequency_penalty));
  ML4_RETURN_IF_ERROR(get_double(b, "presence_penalty", &p.presence_penalty));
  ML4_RETURN_IF_ERROR(get_double(b, "repetition_penalty", &p.repetition_penalty));
  v = p.top_k;
  ML4_RETURN_IF_ERROR(get_int(b, "top_k", -1, 1 << 30, &v));
  p.top_k = static_cast<int>(v);
  v = p.n;
  ML4_RETURN_IF_ERROR(get_int(b, "n", 1, 128, &v));
  p.n = static_cast<int>(v);
  v = p.min_tokens;
  ML4_RETURN_IF_ERROR(get_int(b, "min_tokens", 0, 1 << 30, &v));
  p.min_tokens = static_cast<int>(v);
  v = r.priority;
  ML4_RETURN_IF_ERROR(get_int(b, "priority", -1000000, 1000000, &v));
  r.priority = static_cast<int>(v);
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    int64_t mt = -1;
    ML4_RETURN_IF_ERROR(get_int(b, key, 0, 1 << 30, &mt));
    if (mt >= 0) r.max_tokens = static_cast<int>(mt);
  }
  ML4_RETURN_IF_ERROR(refuse_unsupported(b, chat, p.n));
  if (auto it = b.find("seed"); it != b.end() && !it->is_null()) {
    if (!it->is_number_integer()) return invalid_argument("'seed' must be an integer, got {}", type_name(*it));
    p.seed = it->is_number_unsigned() ? it->get<uint64_t>() : static_cast<uint64_t>(it->get<int64_t>());
  }
  ML4_RETURN_IF_ERROR(get_bool(b, "stream", &r.stream));
  ML4_RETURN_IF_ERROR(get_bool(b, "ignore_eos", &p.ignore_eos));
  ML4_RETURN_IF_ERROR(get_bool(b, "skip_special_tokens", &p.skip_special_tokens));
  ML4_RETURN_IF_ERROR(get_bool(b, "include_stop_str_in_output", &p.include_stop_str_in_output));
  ML4_RETURN_IF_ERROR(get_bool(b, "return_token_ids", &r.return_token_ids));
  if (auto it = b.find("stream_options"); it != b.end() && !it->is_null()) {
    if (!it->is_object()) return invalid_argument("'stream_options' must be an object");
    ML4_RETURN_IF_ERROR(get_bool(*it, "include_usage", &r.include_usage));
    bool continuous = false;
    ML4_RETURN_IF_ERROR(get_bool(*it, "continuous_usage_stats", &continuous));
    r.continuous_usage = continuous && r.include_usage;  // vLLM: both must be set
  }
  if (auto it = b.find("stop"); it != b.end() && !it->is_null()) {
    if (it->is_string()) {
      p.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      for (const auto& s : *it) {
        if (!s.is_string()) return invalid_argument("'stop' must be a string or an array of strings");
        p.stop.push_back(s.get<std::string>());
      }
    } else {
      return invalid_argument("'stop' must be a string or an array of strings, got {}", type_name(*it));
    }
  }
  if (auto it = b.find("stop_token_ids"); it != b.end() && !it->is_null()) {
    if (!it->is_array()) return invalid_argument("'stop_token_ids' must be an array of integers");
    for (const auto& t : *it) {
      if (!t.is_number_integer()) return invalid_argument("'stop_token_ids' must be an array of integers");
      int64_t id = t.get<int64_t>();
      if (id < 0 || id >= codec.vocab_size())
        return invalid_argument("'stop_token_ids': {} is outside the vocabulary [0, {})", id, codec.vocab_size());
      p.stop_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
  if (auto it = b.find("logit_bias"); it != b.end() && !it->is_null()) {
    if (!it->is_object()) return invalid_argument("'logit_bias' must be an object of token id -> bias");
    for (const auto& [k, v] : it->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(k, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != k.size() || k.empty()) return invalid_argument("'logit_bias': key '{}' is not a token id", k);
      if (id < 0 || id >= codec.vocab_size())
        return invalid_argument("'logit_bias': token id {} is outside the vocabulary [0, {})", id, codec.vocab_size());
      if (!v.is_number() || !std::isfinite(v.get<double>()))
        return invalid_argument("'logit_bias': the bias of token {} must be a number", id);
      // Clamped to [-100, 100] as vLLM does (OpenAI documents that range).
      p.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(std::clamp(v.get<double>(), -100.0, 100.0)));
    }
  }
  int64_t plp = -1;
  ML4_RETURN_IF_ERROR(get_int(b, "prompt_logprobs", 0, SamplingParams::kMaxLogprobs, &plp));
  if (plp >= 0) {
    if (r.stream) return invalid_argument("'prompt_logprobs' is not available when 'stream' is true");
    p.prompt_logprobs = static_cast<int>(plp);
    r.prompt_logprobs_field = true;
  }
  ML4_RETURN_IF_ERROR(parse_structured(b, &r.grammar));

  if (chat) {
    ML4_RETURN_IF_ERROR(get_bool(b, "logprobs", &r.chat_logprobs));
    int64_t top = 0;
    ML4_RETURN_IF_ERROR(get_int(b, "top_logprobs", 0, SamplingParams::kMaxLogprobs, &top));
    if (top > 0 && !r.chat_logprobs) return invalid_argument("'top_logprobs' needs 'logprobs': true");
    p.logprobs = r.chat_logprobs ? static_cast<int>(top) : -1;
    const bool constrained = r.grammar.any();
    ML4_RETURN_IF_ERROR(parse_tool_choice(b, &r));
    if (constrained && r.grammar.any() &&
        (r.tool_choice == ApiRequest::ToolChoice::kRequired || r.tool_choice == ApiRequest::ToolChoice::kNamed))
      return invalid_argument("'tool_choice' required or named cannot be combined with another structured output");
    auto it = b.find("messages");
    if (it == b.end() || !it->is_array() || it->empty()) return invalid_argument("'messages' must be a non-empty array");
    ML4_ASSIGN_OR_RETURN(auto ids, codec.encode_chat(b));
    r.prompts.push_back(std::move(ids));
    r.prompt_texts.emplace_back();
  } else {
    int64_t lp = -1;
    ML4_RETURN_IF_ERROR(get_int(b, "logprobs", 0, SamplingParams::kMaxLogprobs, &lp));
    p.logprobs = static_cast<int>(lp);
    ML4_RETURN_IF_ERROR(get_bool(b, "echo", &r.echo));
    ML4_RETURN_IF_ERROR(parse_prompt(b, codec, &r));
    // Echo with logprobs: the prompt tokens' logprobs come from the engine (vLLM does the same).
    if (r.echo && p.logprobs >= 0) p.prompt_logprobs = std::max(p.prompt_logprobs, p.logprobs);
  }
  if (r.max_tokens && *r.max_tokens == 0) {
    if (!r.echo) return invalid_argument("'max_tokens' must be at least 1 (0 is only meaningful with 'echo')");
    r.echo_only = true;  // one token is generated and dropped
    r.max_tokens = 1;
  }
  if (auto it = b.find("truncate_prompt_tokens"); it != b.end() && !it->is_null()) {
    int64_t keep = 0;
    ML4_RETURN_IF_ERROR(get_int(b, "truncate_prompt_tokens", -1, 1 << 30, &keep));
    if (keep == 0) return invalid_argument("'truncate_prompt_tokens' must be -1 or at least 1");
    // vLLM: keep the last `keep` prompt tokens (-1: no limit beyond max_model_len).
    for (size_t i = 0; keep > 0 && i < r.prompts.size(); ++i) {
      auto& ids = r.prompts[i];
      if (static_cast<int64_t>(ids.size()) > keep) {
        ids.erase(ids.begin(), ids.end() - keep);
        if (i < r.prompt_texts.size()) r.prompt_texts[i] = codec.decode(ids, false);
      }
    }
  }
  if (static_cast<int64_t>(r.prompts.size()) * p.n > 128)
    return invalid_argument("prompts x n must be at most 128, got {}", r.prompts.size() * p.n);
  // Range checks for everything but max_tokens (resolved per prompt).
  SamplingParams probe = p;
  probe.max_tokens = std::max(1, probe.min_tokens);
  ML4_RETURN_IF_ERROR(probe.validate(codec.vocab_size()));
  if (r.max_tokens && p.min_tokens > *r.max_tokens)
    return invalid_argument("'min_tokens' ({}) must not exceed 'max_tokens' ({})", p.min_tokens, *r.max_tokens);
  return r;
}

SamplingParams params_for_prompt(const ApiRequest& req, size_t i, int64_t max_model_len) {
  SamplingParams p = req.params;
  const int64_t left = max_model_len - static_cast<int64_t>(req.prompts[i].size());
  if (req.max_tokens) p.max_tokens = *req.max_tokens;
  else p.max_tokens = static_cast<int>(std::max<int64_t>(1, req.chat ? left : std::min<int64_t>(16, left)));
  return p;
}

ojson error_json(int status, const std::string& message, const std::string& param) {
  std::string type = "invalid_request_error";
  if (status == 401) type = "authentication_error";
  else if (status == 404) type = "not_found_error";
  else if (status == 429) type = "rate_limit_error";
  else if (status == 503) type = "service_unavailable";
  else if (status >= 500) type = "internal_server_error";
  ojson e = {{"message", sanitize_utf8(message)}, {"type", type}, {"param", nullptr}, {"code", status}};
  if (!param.empty()) e["param"] = param;
  return ojson{{"error", e}};
}

ChoiceBuilder::ChoiceBuilder(const ApiRequest& req, const TextCodec& codec, std::string id, std::string model,
                             int64_t created)
    : req_(req), codec_(codec), id_(std::move(id)), model_(std::move(model)), created_(created), n_(req.params.n) {
  choices_.resize(req.prompts.size() * n_);
  for (size_t i = 0; i < choices_.size(); ++i) {
    choices_[i].prompt_tokens = static_cast<int64_t>(req.prompts[i / n_].size());
    // Stop strings act on text, which the id-level parser does not see: keep plain text then.
    // A forced tool choice's text is the calls' JSON: no parser either.
    if (req.chat && req.params.stop.empty() && !forced_tools()) {
      OutputParserOptions po;
      po.parse_tool_calls = req.tools;
      choices_[i].parser = codec.make_output_parser(po);
    }
  }
}

bool ChoiceBuilder::forced_tools() const {
  return req_.tool_choice == ApiRequest::ToolChoice::kNamed || req_.tool_choice == ApiRequest::ToolChoice::kRequired;
}

ojson ChoiceBuilder::parsed_delta_json(const ParsedDelta& d) const {
  ojson delta = ojson::object();
  if (!d.content.empty()) delta["content"] = d.content;
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.tool_calls.empty()) {
    ojson calls = ojson::array();
    for (const auto& tc : d.tool_calls) {
      ojson c = {{"index", tc.index}};
      ojson fn = ojson::object();
      if (!tc.id.empty()) {
        c["id"] = tc.id;
        c["type"] = "function";
      }
      if (!tc.name.empty()) fn["name"] = tc.name;
      fn["arguments"] = tc.arguments;
      c["function"] = fn;
      calls.push_back(c);
    }
    delta["tool_calls"] = calls;
  }
  return delta;
}

std::string ChoiceBuilder::event(const ojson& chunk) const {
  return "data: " + chunk.dump(-1, ' ', false, ojson::error_handler_t::replace) + "\n\n";
}

ojson ChoiceBuilder::stop_reason_json(const std::string& reason, int32_t token) const {
  if (token >= 0) return token;  // a stop_token_ids entry: the id, as vLLM
  return reason.empty() ? ojson(nullptr) : ojson(reason);
}

ojson ChoiceBuilder::logprobs_json(const std::vector<TokenLogprob>& lps, size_t text_offset) const {
  if (req_.chat) {
    ojson content = ojson::array();
    for (const auto& lp : lps) {
      std::string raw = codec_.token_bytes(lp.token);
      ojson top = ojson::array();
      for (const auto& [id, l] : lp.top) {
        std::string rb = codec_.token_bytes(id);
        top.push_back({{"token", sanitize_utf8(rb)}, {"logprob", l}, {"bytes", bytes_json(rb)}});
      }
      content.push_back({{"token", sanitize_utf8(raw)}, {"logprob", lp.logprob}, {"bytes", bytes_json(raw)}, {"top_logprobs", top}});
    }
    return ojson{{"content", content}};
  }
  ojson tokens = ojson::array(), token_lps = ojson::array(), tops = ojson::array(), offsets = ojson::array();
  size_t off = text_offset;
  for (const auto& lp : lps) {
    std::string t = token_text(codec_, lp.token);
    tokens.push_back(t);
    token_lps.push_back(lp.logprob);
    // As vLLM: the top N, and the chosen token too (so logprobs 0 still names it).
    ojson top = ojson::object();
    for (const auto& [id, l] : lp.top) top[token_text(codec_, id)] = l;
    if (!top.contains(t)) top[t] = lp.logprob;
    tops.push_back(top);
    offsets.push_back(off);
    off += t.size();
  }
  return ojson{{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

ojson ChoiceBuilder::echo_logprobs_json(const Choice& c, size_t prompt_index, const std::vector<TokenLogprob>& out_lps,
                                        bool with_prompt, size_t text_offset) const {
  ojson tokens = ojson::array(), token_lps = ojson::array(), tops = ojson::array(), offsets = ojson::array();
  size_t off = text_offset;
  if (with_prompt) {
    const std::vector<int32_t>& prompt = req_.prompts[prompt_index];
    for (size_t q = 0; q < prompt.size(); ++q) {
      std::string t = token_text(codec_, prompt[q]);
      tokens.push_back(t);
      offsets.push_back(off);
      off += t.size();
      if (q == 0 || q - 1 >= c.prompt_logprobs.size()) {
        token_lps.push_back(nullptr);
        tops.push_back(nullptr);
        continue;
      }
      const TokenLogprob& lp = c.prompt_logprobs[q - 1];
      token_lps.push_back(lp.logprob);
      ojson top = ojson::object();
      for (const auto& [id, l] : lp.top) {
        if (static_cast<int>(top.size()) >= std::max(0, req_.params.logprobs)) break;
        top[token_text(codec_, id)] = l;
      }
      if (!top.contains(t)) top[t] = lp.logprob;
      tops.push_back(top);
    }
  }
  ojson rest = logprobs_json(out_lps, off);
  for (auto& x : rest["tokens"]) tokens.push_back(x);
  for (auto& x : rest["token_logprobs"]) token_lps.push_back(x);
  for (auto& x : rest["top_logprobs"]) tops.push_back(x);
  for (auto& x : rest["text_offset"]) offsets.push_back(x);
  return ojson{{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

ojson ChoiceBuilder::prompt_logprobs_json(const std::vector<TokenLogprob>& lps) const {
  // vLLM's shape: one entry per prompt token, null for the first, else {id: {logprob, rank,
  // decoded_token}} holding the prompt token and the top N.
  ojson out = ojson::array({nullptr});
  for (const auto& lp : lps) {
    ojson e = ojson::object();
    e[std::to_string(lp.token)] = {{"logprob", lp.logprob}, {"rank", lp.rank},
                                   {"decoded_token", token_text(codec_, lp.token)}};
    int64_t rank = 1;
    for (const auto& [id, l] : lp.top) {
      if (!e.contains(std::to_string(id)))
        e[std::to_string(id)] = {{"logprob", l}, {"rank", rank}, {"decoded_token", token_text(codec_, id)}};
      ++rank;
    }
    out.push_back(e);
  }
  return out;
}

ojson ChoiceBuilder::forced_tool_calls(const std::string& text) const {
  ojson calls = ojson::array();
  if (req_.tool_choice == ApiRequest::ToolChoice::kNamed) {
    calls.push_back({{"id", make_tool_call_id()}, {"type", "function"},
                     {"function", {{"name", req_.tool_name}, {"arguments", text}}}});
    return calls;
  }
  // "required": the grammar made a JSON array of {"name", "parameters"}; a cut-off text
  // (max_tokens) parses as nothing and yields no calls.
  try {
    ojson arr = ojson::parse(text);
    if (arr.is_array())
      for (const auto& c : arr)
        if (c.is_object() && c.contains("name") && c["name"].is_string())
          calls.push_back({{"id", make_tool_call_id()}, {"type", "function"},
                           {"function", {{"name", c["name"]}, {"arguments", c.contains("parameters") ? c["parameters"].dump() : "{}"}}}});
  } catch (const std::exception&) {
  }
  return calls;
}

std::vector<std::string> ChoiceBuilder::add(const StreamItem& item) {
  std::vector<std::string> events;
  if (item.index < 0 || item.index >= static_cast<int>(choices_.size())) return events;
  Choice& c = choices_[item.index];
  const RequestOutput& o = item.out;
  const size_t prompt_index = static_cast<size_t>(item.index / n_);
  ParsedDelta pd;
  if (c.parser) {
    pd = c.parser->push(o.new_tokens);
    if (o.finished) {
      ParsedDelta tail = c.parser->finish();
      pd.content += tail.content;
      pd.reasoning += tail.reasoning;
      pd.tool_calls.insert(pd.tool_calls.end(), tail.tool_calls.begin(), tail.tool_calls.end());
    }
    c.parsed.add(pd);
  }
  if (!o.prompt_logprobs.empty()) c.prompt_logprobs = o.prompt_logprobs;
  const size_t offset_before = c.text.size() + (req_.echo ? req_.prompt_texts[prompt_index].size() : 0);
  c.text += o.new_text;
  c.tokens.insert(c.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
  c.logprobs.insert(c.logprobs.end(), o.new_logprobs.begin(), o.new_logprobs.end());
  c.completion_tokens = std::max(c.completion_tokens, o.completion_tokens);
  c.cached_tokens = std::max(c.cached_tokens, o.cached_tokens);
  if (o.finished) {
    c.finish = o.finish_reason;
    c.stop_reason = o.stop_reason;
    c.stop_token = o.stop_token;
    if (o.finish_reason == FinishReason::kError && error_.empty()) error_ = o.error.empty() ? "engine error" : o.error;
  }
  if (!req_.stream) return events;
  const bool echo_now = req_.echo && !c.echoed;
  // Without a parser, a step that produced no text yet (held-back bytes) sends nothing.
  if (!c.parser && !echo_now && o.new_text.empty() && o.new_logprobs.empty() && !o.finished) return events;
  ojson choice;
  choice["index"] = item.index;
  const bool want_lp = req_.params.logprobs >= 0 && (!o.new_logprobs.empty() || echo_now);
  const bool ended = o.finished && o.finish_reason != FinishReason::kError;
  if (req_.chat && forced_tools()) {
    ojson delta = ojson::object();
    if (req_.tool_choice == ApiRequest::ToolChoice::kNamed) {
      // As vLLM: the call's id and name first, then its arguments as they are generated.
      ojson call = {{"index", 0}};
      if (!c.named_sent) {
        c.named_sent = true;
        call["id"] = make_tool_call_id();
        call["type"] = "function";
        call["function"] = {{"name", req_.tool_name}, {"arguments", o.new_text}};
      } else {
        call["function"] = {{"arguments", o.new_text}};
      }
      delta["tool_calls"] = ojson::array({call});
    } else if (ended) {
      // "required": the array is parsed whole at the end, each call sent complete.
      ojson calls = forced_tool_calls(c.text);
      for (size_t k = 0; k < calls.size(); ++k) calls[k]["index"] = k;
      if (!calls.empty()) delta["tool_calls"] = calls;
    } else if (o.new_logprobs.empty()) {
      return events;
    }
    choice["delta"] = delta;
    choice["logprobs"] = want_lp ? logprobs_json(o.new_logprobs, 0) : ojson(nullptr);
  } else if (req_.chat && c.parser) {
    if (pd.empty() && o.new_logprobs.empty() && !o.finished) return events;
    choice["delta"] = parsed_delta_json(pd);
    choice["logprobs"] = want_lp ? logprobs_json(o.new_logprobs, 0) : ojson(nullptr);
  } else if (req_.chat) {
    ojson delta = ojson::object();
    if (!o.new_text.empty() || !o.finished) delta["content"] = o.new_text;
    choice["delta"] = delta;
    choice["logprobs"] = want_lp ? logprobs_json(o.new_logprobs, 0) : ojson(nullptr);
  } else {
    // Completions: echo puts the prompt (and its logprobs) in the choice's first chunk; with
    // max_tokens 0 the generated token is dropped.
    const std::string& prompt_text = req_.echo ? req_.prompt_texts[prompt_index] : std::string();
    static const std::vector<TokenLogprob> kNone;
    const std::vector<TokenLogprob>& lps = req_.echo_only ? kNone : o.new_logprobs;
    choice["text"] = (echo_now ? prompt_text : std::string()) + (req_.echo_only ? std::string() : o.new_text);
    if (!want_lp) choice["logprobs"] = nullptr;
    else if (echo_now) choice["logprobs"] = echo_logprobs_json(c, prompt_index, lps, true, 0);
    else choice["logprobs"] = logprobs_json(lps, offset_before);
    c.echoed = true;
  }
  const bool called = (c.parser && !c.parsed.tool_calls.empty() && o.finish_reason == FinishReason::kStop) ||
                      (req_.tool_choice == ApiRequest::ToolChoice::kRequired && o.finish_reason == FinishReason::kStop);
  choice["finish_reason"] = ended ? ojson(called ? "tool_calls" : finish_reason_name(o.finish_reason)) : ojson(nullptr);
  if (ended) choice["stop_reason"] = stop_reason_json(o.stop_reason, o.stop_token);
  ojson chunk = {{"id", id_},
                 {"object", req_.chat ? "chat.completion.chunk" : "text_completion"},
                 {"created", created_},
                 {"model", model_},
                 {"choices", ojson::array({choice})}};
  if (req_.continuous_usage) {
    const int64_t done = req_.echo_only ? 0 : c.completion_tokens;
    chunk["usage"] = {{"prompt_tokens", c.prompt_tokens}, {"completion_tokens", done},
                      {"total_tokens", c.prompt_tokens + done}};
  }
  events.push_back(event(chunk));
  if (o.finished && o.finish_reason == FinishReason::kError)
    events.push_back(event(error_json(500, o.error.empty() ? "engine error" : o.error)));
  return events;
}

std::vector<std::string> ChoiceBuilder::stream_start() const {
  std::vector<std::string> events;
  if (!req_.chat) return events;
  for (size_t i = 0; i < choices_.size(); ++i) {
    ojson choice = {{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                    {"finish_reason", nullptr}};
    ojson chunk = {{"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", model_},
                   {"choices", ojson::array({choice})}};
    if (req_.continuous_usage)
      chunk["usage"] = {{"prompt_tokens", choices_[i].prompt_tokens}, {"completion_tokens", 0},
                        {"total_tokens", choices_[i].prompt_tokens}};
    events.push_back(event(chunk));
  }
  return events;
}

ojson ChoiceBuilder::usage_json() const {
  int64_t prompt = 0, completion = 0, cached = 0;
  for (size_t i = 0; i < choices_.size(); ++i) {
    if (i % n_ == 0) {
      prompt += choices_[i].prompt_tokens;
      cached += choices_[i].cached_tokens;
    }
    completion += req_.echo_only ? 0 : choices_[i].completion_tokens;
  }
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

std::vector<std::string> ChoiceBuilder::stream_end() const {
  std::vector<std::string> events;
  if (req_.include_usage) {
    ojson chunk = {{"id", id_},
                   {"object", req_.chat ? "chat.completion.chunk" : "text_completion"},
                   {"created", created_},
                   {"model", model_},
                   {"choices", ojson::array()},
                   {"usage", usage_json()}};
    events.push_back(event(chunk));
  }
  events.push_back("data: [DONE]\n\n");
  return events;
}

std::vector<std::string> ChoiceBuilder::stream_abort(const std::string& message) const {
  return {event(error_json(503, message)), "data: [DONE]\n\n"};
}

ojson ChoiceBuilder::final_json() const {
  ojson choices = ojson::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    const size_t prompt_index = i / n_;
    ojson choice;
    choice["index"] = i;
    const bool want_lp = req_.params.logprobs >= 0;
    if (req_.chat && forced_tools()) {
      ojson calls = forced_tool_calls(c.text);
      ojson msg = {{"role", "assistant"}, {"content", req_.tool_choice == ApiRequest::ToolChoice::kNamed ? ojson("") : ojson(nullptr)}};
      msg["tool_calls"] = calls;
      choice["message"] = msg;
      choice["logprobs"] = want_lp ? logprobs_json(c.logprobs, 0) : ojson(nullptr);
    } else if (req_.chat && c.parser) {
      ojson msg = {{"role", "assistant"}};
      msg["content"] = c.parsed.content.empty() && !c.parsed.tool_calls.empty() ? ojson(nullptr) : ojson(c.parsed.content);
      if (!c.parsed.reasoning.empty()) msg["reasoning_content"] = c.parsed.reasoning;
      if (!c.parsed.tool_calls.empty()) {
        ojson calls = ojson::array();
        for (const auto& tc : c.parsed.tool_calls)
          calls.push_back({{"id", tc.id}, {"type", "function"}, {"function", {{"name", tc.name}, {"arguments", tc.arguments}}}});
        msg["tool_calls"] = calls;
      }
      choice["message"] = msg;
      choice["logprobs"] = want_lp ? logprobs_json(c.logprobs, 0) : ojson(nullptr);
    } else if (req_.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      choice["logprobs"] = want_lp ? logprobs_json(c.logprobs, 0) : ojson(nullptr);
    } else {
      static const std::vector<TokenLogprob> kNone;
      const std::string prompt_text = req_.echo ? req_.prompt_texts[prompt_index] : std::string();
      choice["text"] = prompt_text + (req_.echo_only ? std::string() : c.text);
      const std::vector<TokenLogprob>& lps = req_.echo_only ? kNone : c.logprobs;
      if (!want_lp) choice["logprobs"] = nullptr;
      else if (req_.echo) choice["logprobs"] = echo_logprobs_json(c, prompt_index, lps, true, 0);
      else choice["logprobs"] = logprobs_json(lps, 0);
      if (req_.prompt_logprobs_field) choice["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs);
    }
    const bool called = (c.parser && !c.parsed.tool_calls.empty() && c.finish == FinishReason::kStop) ||
                        (req_.tool_choice == ApiRequest::ToolChoice::kRequired && c.finish == FinishReason::kStop);
    choice["finish_reason"] = c.finish == FinishReason::kNone ? ojson(nullptr)
                              : req_.echo_only                ? ojson("length")
                              : called                        ? ojson("tool_calls")
                                                              : ojson(finish_reason_name(c.finish));
    choice["stop_reason"] = req_.echo_only ? ojson(nullptr) : stop_reason_json(c.stop_reason, c.stop_token);
    if (req_.return_token_ids) {
      choice["token_ids"] = req_.echo_only ? std::vector<int32_t>{} : c.tokens;
      choice["prompt_token_ids"] = req_.prompts[prompt_index];
    }
    choices.push_back(choice);
  }
  ojson out = {{"id", id_},
               {"object", req_.chat ? "chat.completion" : "text_completion"},
               {"created", created_},
               {"model", model_},
               {"choices", choices},
               {"usage", usage_json()}};
  // Chat: vLLM puts prompt_logprobs at the top level (the prompt is shared by the choices).
  if (req_.chat && req_.prompt_logprobs_field && !choices_.empty())
    out["prompt_logprobs"] = prompt_logprobs_json(choices_[0].prompt_logprobs);
  return out;
}

}  // namespace ml4
