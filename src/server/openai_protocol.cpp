// OpenAI request parsing and response building (design in openai_protocol.h).
#include "server/openai_protocol.h"

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
  if (it == b.end() || it->is_null()) return Status::ok();
  if (!it->is_number()) return invalid_argument("'{}' must be a number, got {}", key, type_name(*it));
  double v = it->get<double>();
  if (!std::isfinite(v)) return invalid_argument("'{}' must be finite", key);
  *out = v;
  return Status::ok();
}

Status get_int(const ojson& b, const char* key, int64_t lo, int64_t hi, int64_t* out) {
  auto it = b.find(key);
  if (it == b.end() || it->is_null()) return Status::ok();
  if (!it->is_number_integer()) return invalid_argument("'{}' must be an integer, got {}", key, type_name(*it));
  int64_t v = it->is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(it->get<uint64_t>(), INT64_MAX))
                                       : it->get<int64_t>();
  if (v < lo || v > hi) return invalid_argument("'{}' must be in [{}, {}], got {}", key, lo, hi, v);
  *out = v;
  return Status::ok();
}

Status get_bool(const ojson& b, const char* key, bool* out) {
  auto it = b.find(key);
  if (it == b.end() || it->is_null()) return Status::ok();
  if (!it->is_boolean()) return invalid_argument("'{}' must be a boolean, got {}", key, type_name(*it));
  *out = it->get<bool>();
  return Status::ok();
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
    return Status::ok();
  };
  auto add_text = [&](const std::string& s) -> Status {
    ML4_ASSIGN_OR_RETURN(auto ids, codec.encode(s, true));
    r->prompts.push_back(std::move(ids));
    r->prompt_texts.push_back(s);
    return Status::ok();
  };
  if (p.is_string()) return add_text(p.get<std::string>());
  if (!p.is_array() || p.empty()) return invalid_argument("'prompt' must be a string, an array of strings or of token ids");
  if (p[0].is_number_integer()) {
    std::vector<int32_t> ids;
    ML4_RETURN_IF_ERROR(ids_of(p, &ids));
    r->prompt_texts.push_back(codec.decode(ids, false));
    r->prompts.push_back(std::move(ids));
    return Status::ok();
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
  return Status::ok();
}

std::string token_text(const TextCodec& codec, int32_t id) { return sanitize_utf8(codec.token_bytes(id)); }

ojson bytes_json(const std::string& raw) {
  ojson a = ojson::array();
  for (unsigned char c : raw) a.push_back(static_cast<int>(c));
  return a;
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
    ML4_RETURN_IF_ERROR(get_int(b, key, 1, 1 << 30, &mt));
    if (mt > 0) r.max_tokens = static_cast<int>(mt);
  }
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
  if (auto it = b.find("logit_bias"); it != b.end() && !it->is_null() && !it->empty())
    return invalid_argument("'logit_bias' is not supported");

  if (chat) {
    ML4_RETURN_IF_ERROR(get_bool(b, "logprobs", &r.chat_logprobs));
    int64_t top = 0;
    ML4_RETURN_IF_ERROR(get_int(b, "top_logprobs", 0, SamplingParams::kMaxLogprobs, &top));
    if (top > 0 && !r.chat_logprobs) return invalid_argument("'top_logprobs' needs 'logprobs': true");
    p.logprobs = r.chat_logprobs ? static_cast<int>(top) : -1;
    if (auto t = b.find("tools"); t != b.end() && !t->is_null()) {
      if (!t->is_array()) return invalid_argument("'tools' must be an array");
      r.tools = !t->empty() && !(b.contains("tool_choice") && b["tool_choice"] == "none");
    }
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
    if (r.stream && r.echo) r.echo = false;  // echo applies to the non-streaming body only
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
    if (req.echo) choices_[i].text = req.prompt_texts[i / n_];
    // Stop strings act on text, which the id-level parser does not see: keep plain text then.
    if (req.chat && req.params.stop.empty()) {
      OutputParserOptions po;
      po.parse_tool_calls = req.tools;
      choices_[i].parser = codec.make_output_parser(po);
    }
  }
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
    ojson top = ojson::object();
    for (const auto& [id, l] : lp.top) top[token_text(codec_, id)] = l;
    tops.push_back(req_.params.logprobs > 0 ? top : ojson(nullptr));
    offsets.push_back(off);
    off += t.size();
  }
  return ojson{{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

std::vector<std::string> ChoiceBuilder::add(const StreamItem& item) {
  std::vector<std::string> events;
  if (item.index < 0 || item.index >= static_cast<int>(choices_.size())) return events;
  Choice& c = choices_[item.index];
  const RequestOutput& o = item.out;
  const size_t offset_before = c.text.size();
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
  c.text += o.new_text;
  c.tokens.insert(c.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
  c.logprobs.insert(c.logprobs.end(), o.new_logprobs.begin(), o.new_logprobs.end());
  c.completion_tokens = std::max(c.completion_tokens, o.completion_tokens);
  c.cached_tokens = std::max(c.cached_tokens, o.cached_tokens);
  if (o.finished) {
    c.finish = o.finish_reason;
    c.stop_reason = o.stop_reason;
    if (o.finish_reason == FinishReason::kError && error_.empty()) error_ = o.error.empty() ? "engine error" : o.error;
  }
  if (!req_.stream) return events;
  // Without a parser, a step that produced no text yet (held-back bytes) sends nothing.
  if (!c.parser && o.new_text.empty() && o.new_logprobs.empty() && !o.finished) return events;
  ojson choice;
  choice["index"] = item.index;
  const bool want_lp = req_.params.logprobs >= 0 && !o.new_logprobs.empty();
  if (req_.chat && c.parser) {
    if (pd.empty() && o.new_logprobs.empty() && !o.finished) return events;
    choice["delta"] = parsed_delta_json(pd);
    choice["logprobs"] = want_lp ? logprobs_json(o.new_logprobs, 0) : ojson(nullptr);
  } else if (req_.chat) {
    ojson delta = ojson::object();
    if (!o.new_text.empty() || !o.finished) delta["content"] = o.new_text;
    choice["delta"] = delta;
    choice["logprobs"] = want_lp ? logprobs_json(o.new_logprobs, 0) : ojson(nullptr);
  } else {
    choice["text"] = o.new_text;
    choice["logprobs"] = want_lp ? logprobs_json(o.new_logprobs, offset_before) : ojson(nullptr);
  }
  const bool ended = o.finished && o.finish_reason != FinishReason::kError;
  const bool called = c.parser && !c.parsed.tool_calls.empty() && o.finish_reason == FinishReason::kStop;
  choice["finish_reason"] = ended ? ojson(called ? "tool_calls" : finish_reason_name(o.finish_reason)) : ojson(nullptr);
  if (ended && !o.stop_reason.empty()) choice["stop_reason"] = o.stop_reason;
  ojson chunk = {{"id", id_},
                 {"object", req_.chat ? "chat.completion.chunk" : "text_completion"},
                 {"created", created_},
                 {"model", model_},
                 {"choices", ojson::array({choice})}};
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
    events.push_back(event({{"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", model_},
                            {"choices", ojson::array({choice})}}));
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
    completion += choices_[i].completion_tokens;
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

ojson ChoiceBuilder::final_json() const {
  ojson choices = ojson::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    ojson choice;
    choice["index"] = i;
    const bool want_lp = req_.params.logprobs >= 0;
    if (req_.chat && c.parser) {
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
      choice["text"] = c.text;
      const size_t base = req_.echo ? req_.prompt_texts[i / n_].size() : 0;
      choice["logprobs"] = want_lp ? logprobs_json(c.logprobs, base) : ojson(nullptr);
    }
    const bool called = c.parser && !c.parsed.tool_calls.empty() && c.finish == FinishReason::kStop;
    choice["finish_reason"] = c.finish == FinishReason::kNone ? ojson(nullptr)
                              : called                        ? ojson("tool_calls")
                                                              : ojson(finish_reason_name(c.finish));
    choice["stop_reason"] = c.stop_reason.empty() ? ojson(nullptr) : ojson(c.stop_reason);
    if (req_.return_token_ids) {
      choice["token_ids"] = c.tokens;
      choice["prompt_token_ids"] = req_.prompts[i / n_];
    }
    choices.push_back(choice);
  }
  return {{"id", id_},
          {"object", req_.chat ? "chat.completion" : "text_completion"},
          {"created", created_},
          {"model", model_},
          {"choices", choices},
          {"usage", usage_json()}};
}

}  // namespace ml4
