// Internal to the chat encoder: the request model and mistral-common's first three stages
// (parse, validate, normalize). chat.cpp does the fourth, encoding; see chat.h for the design.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "tokenizer/chat.h"
#include "tokenizer/image_header.h"
#include "tokenizer/tokenizer.h"

namespace ml4::chat_detail {

using ojson = nlohmann::ordered_json;

enum class Role { kSystem, kUser, kAssistant, kTool };

inline const char* role_name(Role r) {
  switch (r) {
    case Role::kSystem: return "system";
    case Role::kUser: return "user";
    case Role::kAssistant: return "assistant";
    case Role::kTool: return "tool";
  }
  return "?";
}

struct Chunk {
  enum class Kind { kText, kImage, kThink };
  Kind kind = Kind::kText;
  std::string text;  // text, or thinking
  bool closed = true;
  std::string image_bytes;
  ImageSize image_size;
};

// str | list[ContentChunk] | None
struct Content {
  bool is_null = true;
  bool is_str = false;
  std::string str;
  std::vector<Chunk> chunks;
  static Content of_str(std::string s) { Content c; c.is_null = false; c.is_str = true; c.str = std::move(s); return c; }
  static Content of_chunks(std::vector<Chunk> v) { Content c; c.is_null = false; c.chunks = std::move(v); return c; }
  bool truthy() const { return is_str ? !str.empty() : (!is_null && !chunks.empty()); }
};

struct ToolCall {
  std::string id = "null";
  std::string name;
  std::string arguments;
};

struct Message {
  Role role = Role::kUser;
  Content content;
  std::optional<std::vector<ToolCall>> tool_calls;
  std::optional<std::string> tool_call_id;
  std::optional<std::string> name;
  bool prefix = false;
};

struct Request {
  std::vector<Message> messages;
  std::optional<std::vector<ojson>> tools;  // each already in Tool.model_dump form
  std::optional<std::string> reasoning_effort;
  std::string response_format_type = "text";
  ojson response_schema;  // json_schema.schema when type == json_schema
};

inline bool valid_function_name(const std::string& s) {  // ^[a-zA-Z0-9_-]{1,64}$
  if (s.empty() || s.size() > 64) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; });
}

// The v15 model settings built from the request (ModelSettings).
struct Settings {
  std::optional<std::string> reasoning_effort;
  ojson json_schema;  // null when absent
  bool none() const { return !reasoning_effort && json_schema.is_null(); }
};

// ChatCompletionRequest.from_openai and the message / chunk from_openai methods.
Result<Request> parse_request(const ojson& req, const MediaOptions& media = {});
// A 9-character base-62 id derived from a hash of `id` (ChatOptions::rewrite_tool_call_ids).
std::string rewrite_id(const std::string& id);
// MistralRequestValidatorV5/V11/V13/V15 in ValidationMode.test, for tokenizer version `v`.
Status validate(const Request& r, int v);
// InstructRequestNormalizerV7/V13/V15: same-role messages merged, tool results ordered.
std::vector<Message> normalize(const Request& r, int v);
// ModelSettingsBuilder.build_settings (v15).
Result<Settings> build_settings(const Tokenizer& tok, const Request& r);

}  // namespace ml4::chat_detail
