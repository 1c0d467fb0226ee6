// Mistral instruct chat encoding: an OpenAI-style request to prompt ids, exactly as
// mistral-common's MistralTokenizer.encode_chat_completion (v1.13) produces them.
//
// The pipeline mirrors mistral-common's four stages (1-3 in chat_request.cpp, 4 in chat.cpp):
//   1. parse    ChatCompletionRequest.from_openai (protocol/instruct/{messages,chunk,
//               tool_calls,request}.py): roles, content chunks, tool calls, reasoning fields;
//   2. validate MistralRequestValidatorV5/V11/V13/V15 in "test" mode (validator.py);
//   3. normalize InstructRequestNormalizerV7/V13/V15 (normalize.py): same-role messages
//               merged, tool results ordered by call, settings built (v15);
//   4. encode   InstructTokenizerV7/V11/V13/V15 (tokens/tokenizers/instruct.py).
// Supported: tekken tokenizers of version v7 and later (the tokenizer file decides), system
// prompts, multi-turn, tool definitions, tool calls and results, reasoning ([THINK] chunks,
// `reasoning_content`/`reasoning`), image placeholders from data: / file: URLs (size read
// from the header, see image_header.h), `continue_final_message`, and v15 model settings
// (`reasoning_effort`, `response_format`). Audio is refused with an error.
//
// JSON key order reaches the prompt (tool schemas are serialised with json.dumps), so the
// request should be parsed into nlohmann::ordered_json; the nlohmann::json overload works
// but sees keys sorted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "tokenizer/tokenizer.h"

namespace ml4 {

// Where image bytes may come from (vLLM's --allowed-local-media-path; the size cap is ml4's
// --max-media-bytes, vLLM has only per-modality env limits). data: URLs are always accepted up to
// the cap (checked on the base64 length, before decoding). file:// URLs are refused unless
// allowed_local_media_path names a directory; then only regular files under it (after
// resolving links) of at most max_media_bytes are read. Every refusal of a local path gives the
// same message, so a client cannot tell which files exist.
struct MediaOptions {
  std::string allowed_local_media_path;  // canonical directory; empty: no local files
  size_t max_media_bytes = 20u << 20;    // per image, decoded
};

struct ChatOptions {
  MediaOptions media;
  // Tokenizers before v13 put tool-call ids into the prompt and require 9 alphanumerics
  // (mistral-common refuses anything else). OpenAI clients send ids like "call_abc...":
  // when set, each such id is replaced, consistently across the request, by 9 base-62
  // characters derived from a hash of it. Ids that already conform are kept.
  bool rewrite_tool_call_ids = true;
};

// One image placeholder block in the prompt, in order of appearance.
struct ChatImage {
  std::string file_bytes;  // the decoded image file (PNG, JPEG, ...)
  int width = 0, height = 0;             // as in the file
  int tokens_wide = 0, tokens_high = 0;  // the [IMG] grid: tokens_high rows of tokens_wide
  int32_t first_token = 0;               // index in ids of the block's first token
};

struct ChatEncoding {
  std::vector<int32_t> ids;
  std::vector<ChatImage> images;
  bool ends_with_prefix = false;  // last assistant message continued (no EOS after it)
};

Result<ChatEncoding> encode_chat_full(const Tokenizer& tok, const nlohmann::ordered_json& openai_request,
                                      const ChatOptions& options = {});
Result<std::vector<int32_t>> encode_chat(const Tokenizer& tok, const nlohmann::ordered_json& openai_request,
                                         const ChatOptions& options = {});
Result<std::vector<int32_t>> encode_chat(const Tokenizer& tok, const nlohmann::json& openai_request,
                                         const ChatOptions& options = {});

// A fresh tool-call id of 9 characters from [a-zA-Z0-9] (what Mistral models expect).
std::string make_tool_call_id();
bool is_valid_tool_call_id(std::string_view id);

}  // namespace ml4
