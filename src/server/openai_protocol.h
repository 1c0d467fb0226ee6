// The OpenAI wire format: request parsing into engine requests, and response building.
//
// Parsing is strict about what it reads (a field of the wrong type or out of range is a 400
// naming the field), refuses the fields ml4 knows but does not implement (suffix, best_of > n,
// beam search, functions / function_call, audio, prediction, ...: 400 rather than silently
// ignored), and is lenient about fields it does not know (ignored, as vLLM does, since the
// OpenAI clients send extras). Field semantics follow the OpenAI API reference and vLLM's
// extensions (vllm/entrypoints/openai/protocol.py: top_k, min_p, repetition_penalty,
// min_tokens, stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output,
// priority, prompt_logprobs, truncate_prompt_tokens, structured_outputs and the guided_*
// fields). Defaults as vLLM: completions max_tokens 16, chat max_tokens = what is left of
// max_model_len after the prompt.
//
// Structured outputs: response_format (json_object, json_schema), structured_outputs {json,
// regex, choice, grammar, json_object}, guided_json / guided_regex / guided_choice /
// guided_grammar: at most one per request, parsed into ApiRequest::grammar and compiled by
// the server (engine/structured_output.h). tool_choice "required" and a named function are
// grammars too, as in vLLM (serving_chat.py): a named function constrains the output to its
// parameters' schema and the text becomes that call's arguments; "required" constrains it to a
// JSON array of {"name", "parameters"} objects, one per call.
//
// Echo (completions): the prompt text leads each choice, streamed or not; with logprobs the
// prompt tokens carry their logprobs (the first null), as vLLM computes them (prompt_logprobs =
// logprobs). max_tokens 0 with echo returns the prompt alone (one token is generated and
// dropped, as vLLM does).
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
#include "engine/structured_output.h"
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
  bool tools = false;             // chat: the model's tool calls are parsed (tool_choice auto)
  int priority = 0;
  bool continuous_usage = false;  // stream_options.continuous_usage_stats: usage in every chunk
  bool echo_only = false;         // echo with max_tokens 0: the prompt, no completion
  bool prompt_logprobs_field = false;  // vLLM's prompt_logprobs asked: returned as that field
  GrammarSpec grammar;            // structured output (compiled by the server)
  enum class ToolChoice { kAuto, kNone, kRequired, kNamed };
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_name;          // kNamed
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
  // SSE events ending a stream that cannot finish (shutdown deadline): an error event, [DONE].
  std::vector<std::string> stream_abort(const std::string& message) const;
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
    std::vector<TokenLogprob> prompt_logprobs;  // prompt positions 1.. (engine order)
    bool echoed = false;                        // streaming: the prompt went out
    bool named_sent = false;                    // streaming, named tool: the call's header went out
    FinishReason finish = FinishReason::kNone;
    std::string stop_reason;
    int32_t stop_token = -1;
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
  // Completions echo with logprobs: the prompt's entries (first null) then the output's.
  ojson echo_logprobs_json(const Choice& c, size_t prompt_index, const std::vector<TokenLogprob>& out_lps,
                           bool with_prompt, size_t text_offset) const;
  ojson prompt_logprobs_json(const std::vector<TokenLogprob>& lps) const;
  ojson stop_reason_json(const std::string& reason, int32_t token) const;
  // tool_choice named / required: the tool calls the constrained text stands for.
  ojson forced_tool_calls(const std::string& text) const;
  ojson usage_json() const;
  std::string event(const ojson& chunk) const;
  bool forced_tools() const;

  const ApiRequest& req_;
  const TextCodec& codec_;
  std::string id_, model_;
  int64_t created_;
  int n_;
  std::vector<Choice> choices_;
  std::string error_;
};

}  // namespace ml4
