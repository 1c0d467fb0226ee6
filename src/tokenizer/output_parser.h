// Parsers for what a Mistral model generates: reasoning, answer and tool calls.
//
// Mistral models write reasoning as [THINK] ... [/THINK] and tool calls either as
// `[TOOL_CALLS]name[ARGS]{json}` (v11+; v11 may add `[CALL_ID]id` before [ARGS]), repeated
// per call, or in the older form `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
// These markers are special tokens, so the parser must see them before detokenization drops
// them: OutputParser takes token ids; TextOutputParser takes text in which special tokens
// are spelled by name (decode(ids, skip_special=false)) for callers that only have text.
//
// Both are one state machine over events (text, marker) fed in whatever chunks arrive; a
// marker split across chunks is held back until it is complete or ruled out, and a UTF-8
// character split across chunks is never emitted in halves. Deltas concatenated over a
// stream equal the whole-text result for every chunking (tests/tokenizer/output_parser_test).
// Reasoning starts only at [THINK]: a model that answers without thinking (for example
// right after a tool result) keeps its answer as content (FIELD-NOTES "forced reasoning
// must not swallow the answer"). The JSON form is emitted when the output ends, since its
// calls are only known once the list is complete.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace ml4 {

struct ToolCallDelta {
  int index = 0;          // which call of this output (0, 1, ...)
  std::string id;         // set on the call's first delta
  std::string name;       // set on the call's first delta
  std::string arguments;  // appended piece of the JSON arguments
};

struct ParsedDelta {
  std::string content;
  std::string reasoning;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
};

struct ParsedToolCall {
  std::string id, name, arguments;
  bool operator==(const ParsedToolCall&) const = default;
};

struct ParsedOutput {
  std::string content;
  std::string reasoning;
  std::vector<ParsedToolCall> tool_calls;
  bool operator==(const ParsedOutput&) const = default;
  // Folds a streamed delta in (how a client rebuilds the message).
  void add(const ParsedDelta& d);
};

struct OutputParserOptions {
  bool parse_reasoning = true;   // off: [THINK] blocks are dropped markers, text is content
  bool parse_tool_calls = true;  // off: tool-call markers are dropped, text is content
  bool starts_in_reasoning = false;  // the prompt already opened [THINK]
  // Ids for calls that carry none ([CALL_ID] absent): 9 alphanumerics from this seed, so
  // the same output always gets the same ids; 0 draws them at random.
  uint64_t id_seed = 0;
};

namespace detail {
enum class Marker { kThink, kEndThink, kToolCalls, kArgs, kCallId, kEos, kOther };
class ParserCore;
}  // namespace detail

// Streaming parser over token ids.
class OutputParser {
 public:
  OutputParser(std::shared_ptr<const Tokenizer> tok, OutputParserOptions options = {});
  ~OutputParser();
  ParsedDelta push(std::span<const int32_t> ids);
  ParsedDelta finish();

 private:
  std::shared_ptr<const Tokenizer> tok_;
  StreamDecoder decoder_;
  std::unique_ptr<detail::ParserCore> core_;
};

// Streaming parser over text with special tokens written by name ("[THINK]", "</s>").
class TextOutputParser {
 public:
  explicit TextOutputParser(OutputParserOptions options = {});
  ~TextOutputParser();
  ParsedDelta push(std::string_view text);
  ParsedDelta finish();

 private:
  std::string held_;  // a possible marker prefix or an incomplete UTF-8 character
  std::unique_ptr<detail::ParserCore> core_;
};

ParsedOutput parse_output(std::shared_ptr<const Tokenizer> tok, std::span<const int32_t> ids,
                          OutputParserOptions options = {});
ParsedOutput parse_output_text(std::string_view text, OutputParserOptions options = {});

}  // namespace ml4
