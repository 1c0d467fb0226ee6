// The OpenAI wire format: request parsing into engine requests, and response building.
//
// Parsing is strict about what it reads (a field of the wrong type or out of range is a 400
// naming the field) and lenient about what it does not (unknown fields are ignored, as the
// OpenAI clients send extras). Field semantics follow the OpenAI API reference and vLLM's
// extensions (vllm/entrypoints/openai/protocol.py: top_k, min_p, repetition_penalty,
// min_tokens, stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output,
// priority). Defaults as vLLM: completions max_tokens 16, chat max_tokens = what is left of
// max_model_len after the prompt.
//
// ChoiceBuilder accumulates one API call's choices from engine outputs and renders the
// final JSON object or the SSE chunks of a stream; the HTTP layer only moves bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "engine/async_engine.h"
#include "engine/engine.h"
#include "engine/sampling_params.h"
#include "engine/text_codec.h"

namespace ml4 {

using ojson = nlohmann::ordered_json;

struct ApiRequest {
  bool chat = false;
  std::string model;
  std::vector<std::vector<int32_t>> prompts;  // completions may batch several prompts
  std::vector<std::string> prompt_texts;      // for echo
  SamplingParams params;                      // max_tokens resolved per prompt later
  std::optional<int> max_tokens;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;
  bool chat_logprobs = false;  // chat: logprobs: true (+ top_logprobs)
  bool return_token_ids = false;  // vLLM extension: token_ids per choice (non-streaming)
  bool tools = false;             // chat: tools given and tool_choice != "none"
  int priority = 0;
};

// Parses /v1/completions (chat = false) or /v1/chat/completions (chat = true).
// kInvalidArgument: a 400 the client can act on.
Result<ApiRequest> parse_api_request(const ojson& body, bool chat, const TextCodec& codec);

// SamplingParams for prompt i with max_tokens resolved.
SamplingParams params_for_prompt(const ApiRequest& req, size_t prompt_index, int64_t max_model_len);

// OpenAI error object; `type` follows the status (invalid_request_error, ...).
ojson error_json(int status, const std::string& message, const std::string& param = "");

class ChoiceBuilder {
 public:
  ChoiceBuilder(const ApiRequest& req, const TextCodec& codec, std::string id, std::string model, int64_t created);
  // Folds one engine output in; returns the SSE "data: ..." events it makes (streaming).
  std::vector<std::string> add(const StreamItem& item);
  // SSE events opening a chat stream (the role delta of every choice).
  std::vector<std::string> stream_start() const;
  // SSE events closing a stream: the usage chunk (when asked) and [DONE].
  std::vector<std::string> stream_end() const;
  // The whole non-streaming response.
  ojson final_json() const;
  // First error any choice finished with ("" if none).
  const std::string& error() const { return error_; }
  int num_choices() const { return static_cast<int>(choices_.size()); }

 private:
  struct Choice {
    std::string text;
    std::vector<TokenLogprob> logprobs;
    std::vector<int32_t> tokens;
    FinishReason finish = FinishReason::kNone;
    std::string stop_reason;
    int64_t completion_tokens = 0;
    int64_t prompt_tokens = 0;
    int64_t cached_tokens = 0;
    // Chat with the model's tokenizer: reasoning and tool calls parsed out of the ids.
    std::unique_ptr<OutputParser> parser;
    ParsedOutput parsed;
  };
  // Chat deltas through the parser: the JSON "delta" object and whether it says anything.
  ojson parsed_delta_json(const ParsedDelta& d) const;
  ojson logprobs_json(const std::vector<TokenLogprob>& lps, size_t text_offset) const;
  ojson usage_json() const;
  std::string event(const ojson& chunk) const;

  const ApiRequest& req_;
  const TextCodec& codec_;
  std::string id_, model_;
  int64_t created_;
  int n_;
  std::vector<Choice> choices_;
  std::string error_;
};

}  // namespace ml4
