// Chat request parse, validation and normalization, mirroring mistral-common v1.13
// (protocol/instruct/{messages,chunk,tool_calls,request,validator,normalize}.py); see chat.h.
#include "tokenizer/chat_request.h"

#include <algorithm>
#include <cmath>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/ranges.h>

#include "tokenizer/base64.h"
#include "tokenizer/chat.h"
#include "tokenizer/python_json.h"

namespace ml4::chat_detail {
namespace {
// ---------------------------------------------------------------------------------------
// 1. Parse (ChatCompletionRequest.from_openai and the message/chunk from_openai methods).

// One message for every refusal of a local path: nothing tells a missing file from a
// forbidden one, a directory, a device or an oversized file.
Status local_media_refused(const MediaOptions& media) {
  return invalid_argument(
      "image URL refused: file:// URLs are served only from the directory given by --allowed-local-media-path, "
      "as regular files of at most {} bytes",
      media.max_media_bytes);
}

// file:///abs/path -> /abs/path with %XX decoded (as vLLM's url2pathname); nullopt if malformed.
std::optional<std::string> file_url_path(const std::string& url) {
  std::string rest = url.substr(7);
  if (rest.rfind("localhost/", 0) == 0) rest = rest.substr(9);
  if (rest.empty() || rest[0] != '/') return std::nullopt;
  std::string out;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] != '%') {
      out += rest[i];
      continue;
    }
    if (i + 2 >= rest.size() || !std::isxdigit(static_cast<unsigned char>(rest[i + 1])) ||
        !std::isxdigit(static_cast<unsigned char>(rest[i + 2])))
      return std::nullopt;
    char c = static_cast<char>(std::stoi(rest.substr(i + 1, 2), nullptr, 16));
    if (c == '\0') return std::nullopt;
    out += c;
    i += 2;
  }
  if (out.find('?') != std::string::npos || out.find('#') != std::string::npos) return std::nullopt;
  return out;
}

Result<std::string> load_local_file(const std::string& url, const MediaOptions& media) {
  namespace fs = std::filesystem;
  if (media.allowed_local_media_path.empty()) return local_media_refused(media);
  auto path = file_url_path(url);
  if (!path) return local_media_refused(media);
  std::error_code ec;
  const fs::path real = fs::canonical(*path, ec);  // resolves every link
  if (ec) return local_media_refused(media);
  const fs::path root(media.allowed_local_media_path);
  auto rel = real.lexically_relative(root);
  if (rel.empty() || *rel.begin() == ".." || rel.is_absolute()) return local_media_refused(media);
  // O_NOFOLLOW | O_NONBLOCK: no link swapped in since canonical(), no FIFO to block on.
  const int fd = ::open(real.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return local_media_refused(media);
  struct stat st{};
  std::string bytes;
  bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) <= media.max_media_bytes;
  if (ok) {
    // Read at most the cap + 1 bytes whatever st_size said (the file may grow meanwhile).
    bytes.resize(std::min<size_t>(static_cast<size_t>(st.st_size), media.max_media_bytes) + 1);
    size_t got = 0;
    while (got < bytes.size()) {
      ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    bytes.resize(got);
    ok = got <= media.max_media_bytes;
  }
  ::close(fd);
  if (!ok) return local_media_refused(media);
  return bytes;
}

Result<std::string> load_image_url(const std::string& url, const MediaOptions& media) {
  if (url.rfind("data:", 0) == 0) {
    size_t comma = url.find(',');
    if (comma == std::string::npos) return invalid_argument("image data URL has no ',' before its payload");
    // The cap applies before decoding: base64 makes 3 bytes of every 4 characters.
    const size_t encoded = url.size() - comma - 1;
    if (encoded / 4 * 3 > media.max_media_bytes + 3)
      return invalid_argument("image data URL too large: {} base64 characters, the limit is {} decoded bytes "
                              "(--max-media-bytes)", encoded, media.max_media_bytes);
    std::string payload;
    payload.reserve(encoded);
    for (char c : std::string_view(url).substr(comma + 1))
      if (!std::isspace(static_cast<unsigned char>(c))) payload += c;
    std::string bytes;
    if (!base64_decode(payload, bytes))
      return invalid_argument("Invalid image data URL {}: payload is not valid base64.", url.substr(0, 64));
    if (bytes.size() > media.max_media_bytes)
      return invalid_argument("image data URL too large: {} bytes, the limit is {} (--max-media-bytes)", bytes.size(),
                              media.max_media_bytes);
    return bytes;
  }
  if (url.rfind("file://", 0) == 0) return load_local_file(url, media);
  return invalid_argument("Unsupported image url scheme {} (ml4 accepts data: and file: URLs)", url.substr(0, 64));
}

Result<Chunk> parse_chunk(const ojson& c, const MediaOptions& media) {
  if (!c.is_object() || !c.contains("type") || !c["type"].is_string())
    return invalid_argument("Content chunk must have a type field.");
  const std::string type = c["type"].get<std::string>();
  Chunk ch;
  if (type == "text") {
    if (!c.contains("text") || !c["text"].is_string()) return invalid_argument("text chunk needs a string \"text\"");
    ch.text = c["text"].get<std::string>();
    return ch;
  }
  if (type == "thinking") {
    if (!c.contains("thinking") || !c["thinking"].is_string())
      return invalid_argument("thinking chunk needs a string \"thinking\"");
    ch.kind = Chunk::Kind::kThink;
    ch.text = c["thinking"].get<std::string>();
    if (c.contains("closed")) {
      if (!c["closed"].is_boolean()) return invalid_argument("thinking chunk: \"closed\" must be a boolean");
      ch.closed = c["closed"].get<bool>();
    }
    return ch;
  }
  if (type == "image_url") {
    if (!c.contains("image_url")) return invalid_argument("image_url chunk needs \"image_url\"");
    const ojson& iu = c["image_url"];
    std::string url;
    if (iu.is_string()) url = iu.get<std::string>();
    else if (iu.is_object() && iu.contains("url") && iu["url"].is_string()) url = iu["url"].get<std::string>();
    else return invalid_argument("image_url must be a string or an object with a string \"url\"");
    ch.kind = Chunk::Kind::kImage;
    ML4_ASSIGN_OR_RETURN(ch.image_bytes, load_image_url(url, media));
    auto size = image_size_from_header(ch.image_bytes);
    if (!size.ok()) return size.status().with_context("Invalid image " + url.substr(0, 64));
    ch.image_size = size.value();
    return ch;
  }
  if (type == "input_audio" || type == "audio_url") return unimplemented("audio content is not supported by ml4");
  return invalid_argument("Unknown content chunk type: {}", type);
}

Result<Content> parse_content(const ojson& raw, const MediaOptions& media) {
  if (raw.is_null()) return Content{};
  if (raw.is_string()) return Content::of_str(raw.get<std::string>());
  if (!raw.is_array()) return invalid_argument("Unknown content type: content must be a string, a list or null");
  std::vector<Chunk> chunks;
  for (const auto& c : raw) {
    ML4_ASSIGN_OR_RETURN(Chunk ch, parse_chunk(c, media));
    chunks.push_back(std::move(ch));
  }
  return Content::of_chunks(std::move(chunks));
}

Result<std::optional<std::string>> optional_string(const ojson& m, const char* key) {
  if (!m.contains(key) || m[key].is_null()) return std::optional<std::string>();
  if (!m[key].is_string()) return invalid_argument("\"{}\" must be a string", key);
  return std::optional<std::string>(m[key].get<std::string>());
}

Result<ToolCall> parse_tool_call(const ojson& tc) {
  if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object())
    return invalid_argument("tool call needs a \"function\" object");
  ToolCall out;
  if (tc.contains("id")) {
    if (!tc["id"].is_string()) return invalid_argument("tool call \"id\" must be a string");
    out.id = tc["id"].get<std::string>();
  }
  const ojson& f = tc["function"];
  if (!f.contains("name") || !f["name"].is_string()) return invalid_argument("tool call function needs a string name");
  out.name = f["name"].get<std::string>();
  // FunctionCall.validate_arguments: a dict is dumped, None becomes "{}".
  if (!f.contains("arguments") || f["arguments"].is_null()) out.arguments = "{}";
  else if (f["arguments"].is_string()) out.arguments = f["arguments"].get<std::string>();
  else if (f["arguments"].is_object()) out.arguments = python_json_dumps(f["arguments"]);
  else return invalid_argument("tool call arguments must be a JSON string or object");
  return out;
}

Result<Message> parse_message(const ojson& m, const MediaOptions& media) {
  if (!m.is_object()) return invalid_argument("each message must be a JSON object");
  std::string role = m.contains("role") && m["role"].is_string() ? m["role"].get<std::string>() : "";
  Message msg;
  if (role == "user" || role == "system" || role == "developer") {
    msg.role = role == "user" ? Role::kUser : Role::kSystem;
    if (!m.contains("content")) return invalid_argument("{} message needs \"content\"", role);
    ML4_ASSIGN_OR_RETURN(msg.content, parse_content(m["content"], media));
    if (msg.content.is_null) return invalid_argument("{} message content must not be null", role);
    for (const auto& c : msg.content.chunks)
      if (msg.role == Role::kSystem && c.kind == Chunk::Kind::kImage)
        return invalid_argument("ImageURLChunk cannot be used in system message.");
      else if (msg.role == Role::kUser && c.kind == Chunk::Kind::kThink)
        return invalid_argument("ThinkChunk cannot be used in user message.");
    return msg;
  }
  if (role == "assistant") {
    msg.role = Role::kAssistant;
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      if (!m["tool_calls"].is_array()) return invalid_argument("tool_calls must be a list");
      msg.tool_calls.emplace();
      for (const auto& tc : m["tool_calls"]) {
        ML4_ASSIGN_OR_RETURN(ToolCall t, parse_tool_call(tc));
        msg.tool_calls->push_back(std::move(t));
      }
    }
    if (m.contains("content")) {
      ML4_ASSIGN_OR_RETURN(msg.content, parse_content(m["content"], media));
    }
    for (const auto& c : msg.content.chunks)
      if (c.kind == Chunk::Kind::kImage) return invalid_argument("ImageURLChunk cannot be used in assistant message.");
    // reasoning_content / reasoning become a leading closed ThinkChunk.
    ML4_ASSIGN_OR_RETURN(auto rc, optional_string(m, "reasoning_content"));
    ML4_ASSIGN_OR_RETURN(auto r, optional_string(m, "reasoning"));
    if (rc && r && *rc != *r) return invalid_argument("`reasoning_content` and `reasoning` should be equal.");
    std::optional<std::string> thinking = rc ? rc : r;
    if (thinking) {
      for (const auto& c : msg.content.chunks)
        if (c.kind == Chunk::Kind::kThink)
          return invalid_argument("Message cannot have both thinking chunks in `content` and a top-level "
                                  "`reasoning` or `reasoning_content` field.");
      Chunk think;
      think.kind = Chunk::Kind::kThink;
      think.text = *thinking;
      std::vector<Chunk> chunks{think};
      if (msg.content.is_str) {
        Chunk t;
        t.text = msg.content.str;
        chunks.push_back(t);
      } else {
        for (auto& c : msg.content.chunks) chunks.push_back(std::move(c));
      }
      msg.content = Content::of_chunks(std::move(chunks));
    }
    return msg;
  }
  if (role == "tool") {
    msg.role = Role::kTool;
    if (!m.contains("content")) return invalid_argument("tool message needs \"content\"");
    ML4_ASSIGN_OR_RETURN(msg.content, parse_content(m["content"], media));
    if (msg.content.is_null) return invalid_argument("tool message content must not be null");
    for (const auto& c : msg.content.chunks)
      if (c.kind == Chunk::Kind::kThink) return invalid_argument("ThinkChunk cannot be used in tool message.");
    if (!m.contains("tool_call_id")) return invalid_argument("tool message needs \"tool_call_id\"");
    ML4_ASSIGN_OR_RETURN(msg.tool_call_id, optional_string(m, "tool_call_id"));
    ML4_ASSIGN_OR_RETURN(msg.name, optional_string(m, "name"));
    return msg;
  }
  return invalid_argument("Unknown message role: {}", role.empty() ? "(missing)" : role);
}

Result<ojson> parse_tool(const ojson& t) {
  if (!t.is_object()) return invalid_argument("each tool must be a JSON object");
  if (t.contains("type") && !(t["type"].is_string() && t["type"].get<std::string>() == "function"))
    return invalid_argument("tool type must be \"function\"");
  if (!t.contains("function") || !t["function"].is_object()) return invalid_argument("tool needs a \"function\" object");
  const ojson& f = t["function"];
  if (!f.contains("name") || !f["name"].is_string()) return invalid_argument("tool function needs a string name");
  ojson fn = ojson::object();
  fn["name"] = f["name"];
  fn["description"] = "";
  if (f.contains("description") && !f["description"].is_null()) {
    if (!f["description"].is_string()) return invalid_argument("tool description must be a string");
    fn["description"] = f["description"];
  }
  fn["parameters"] = ojson::object();
  if (f.contains("parameters") && !f["parameters"].is_null()) {
    if (!f["parameters"].is_object()) return invalid_argument("tool parameters must be a JSON object");
    fn["parameters"] = f["parameters"];
  }
  ojson tool = ojson::object();
  tool["type"] = "function";
  tool["function"] = std::move(fn);
  return tool;
}

}  // namespace

Result<Request> parse_request(const ojson& req, const MediaOptions& media) {
  if (!req.is_object()) return invalid_argument("the request must be a JSON object");
  if (!req.contains("messages") || !req["messages"].is_array()) return invalid_argument("\"messages\" must be a list");
  Request r;
  for (const auto& m : req["messages"]) {
    auto msg = parse_message(m, media);
    if (!msg.ok()) return msg.status().with_context(fmt::format("messages[{}]", r.messages.size()));
    r.messages.push_back(std::move(msg).value());
  }
  if (req.contains("tools") && !req["tools"].is_null()) {
    if (!req["tools"].is_array()) return invalid_argument("\"tools\" must be a list");
    r.tools.emplace();
    for (const auto& t : req["tools"]) {
      ML4_ASSIGN_OR_RETURN(ojson tool, parse_tool(t));
      r.tools->push_back(std::move(tool));
    }
  }
  if (req.contains("continue_final_message") && !req["continue_final_message"].is_null()) {
    if (!req["continue_final_message"].is_boolean()) return invalid_argument("continue_final_message must be a boolean");
    if (req["continue_final_message"].get<bool>()) {
      if (r.messages.empty() || r.messages.back().role != Role::kAssistant)
        return invalid_argument("continue_final_message=True requires final message to be an assistant.");
      r.messages.back().prefix = true;
    }
  }
  if (req.contains("reasoning_effort") && !req["reasoning_effort"].is_null()) {
    static const std::set<std::string> kEfforts = {"none", "minimal", "low", "medium", "high", "xhigh", "max"};
    if (!req["reasoning_effort"].is_string() || !kEfforts.count(req["reasoning_effort"].get<std::string>()))
      return invalid_argument("reasoning_effort must be one of none, minimal, low, medium, high, xhigh, max");
    r.reasoning_effort = req["reasoning_effort"].get<std::string>();
  }
  if (req.contains("response_format") && !req["response_format"].is_null()) {
    const ojson& rf = req["response_format"];
    if (!rf.is_object()) return invalid_argument("response_format must be an object");
    if (rf.contains("type")) {
      std::string t = rf["type"].is_string() ? rf["type"].get<std::string>() : "";
      if (t != "text" && t != "json_object" && t != "json_schema")
        return invalid_argument("response_format.type must be text, json_object or json_schema");
      r.response_format_type = t;
    }
    if (r.response_format_type == "json_schema") {
      if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
        return invalid_argument("Response format `json_schema` must define the schema");
      const ojson& js = rf["json_schema"];
      if (!js.contains("name") || !js["name"].is_string()) return invalid_argument("json_schema needs a name");
      if (!js.contains("schema") || !js["schema"].is_object()) return invalid_argument("json_schema needs a schema object");
      r.response_schema = js["schema"];
    }
  }
  return r;
}

// Hash-derived 9-character id (see ChatOptions::rewrite_tool_call_ids).
std::string rewrite_id(const std::string& id) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (unsigned char c : id) h = (h ^ c) * 1099511628211ull;
  static constexpr char kAlnum[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string out(9, 'a');
  for (int i = 0; i < 9; ++i) {
    out[i] = kAlnum[h % 62];
    h /= 62;
    if (i == 4) h ^= (h << 29) ^ 0x9E3779B97F4A7C15ull;
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// 2. Validate (MistralRequestValidatorV5/V11/V13/V15, ValidationMode.test).

Status validate(const Request& r, int v) {
  const auto& ms = r.messages;
  if (ms.empty()) return invalid_argument("Conversation must have at least one message");
  if (ms.size() == 1 && ms[0].role != Role::kUser && ms[0].role != Role::kSystem)
    return invalid_argument("Conversation must start with a user message or system message");
  if (ms.size() > 1 && ms.back().role == Role::kAssistant && !ms.back().prefix)
    return invalid_argument("Expected last role User or Tool (or Assistant with prefix) for serving but got assistant");
  for (size_t i = 1; i < ms.size(); ++i) {
    Role p = ms[i - 1].role, c = ms[i].role;
    bool ok = (p == Role::kSystem && c != Role::kTool) || (p == Role::kUser && c != Role::kTool) ||
              (p == Role::kAssistant && c != Role::kSystem) || (p == Role::kTool && c != Role::kSystem);
    if (!ok) return invalid_argument("Unexpected role '{}' after role '{}'", role_name(c), role_name(p));
  }
  // Tool calls followed by as many tool results (v7: by count; v11+: by id).
  if (v < 11) {
    int expected = 0;
    for (size_t i = 1; i < ms.size(); ++i) {
      if (ms[i].role == Role::kTool) {
        --expected;
      } else if (ms[i].role == Role::kAssistant) {
        if (expected != 0) return invalid_argument("Not the same number of function calls and responses");
        if (ms[i].tool_calls) expected = static_cast<int>(ms[i].tool_calls->size());
      }
    }
  } else {
    std::set<std::string> expected, observed;
    for (size_t i = 1; i < ms.size(); ++i) {
      if (ms[i].role == Role::kTool) {
        std::string id = ms[i].tool_call_id.value_or("");
        if (observed.count(id)) return invalid_argument("Duplicate tool call id {} in tool results", id);
        if (!expected.count(id)) return invalid_argument("Unexpected tool call id {} in tool results", id);
        observed.insert(id);
      } else if (ms[i].role == Role::kAssistant) {
        if (expected.size() != observed.size())
          return invalid_argument("Not the same number of function calls and responses");
        expected.clear();
        observed.clear();
        if (ms[i].tool_calls)
          for (const auto& tc : *ms[i].tool_calls)
            if (!expected.insert(tc.id).second)
              return invalid_argument("Duplicate tool call id {} in assistant message", tc.id);
      }
    }
  }
  auto check_id = [&](const std::string& id, bool is_call) -> Status {
    if (v >= 13) {
      if (id.empty() || id == "null")
        return invalid_argument("Tool call id must be a non-empty string other than 'null' for tokenizer version 13 or newer.");
      return ok_status();
    }
    if (is_call && id == "null")
      return invalid_argument("Tool call id 'null' is only allowed for the last assistant message in finetuning mode.");
    if (!is_valid_tool_call_id(id))
      return invalid_argument("Tool call id was {} but must be a-z, A-Z, 0-9, with a length of 9.", id);
    return ok_status();
  };
  for (size_t i = 0; i < ms.size(); ++i) {
    const Message& m = ms[i];
    for (const auto& c : m.content.chunks) {
      bool think = c.kind == Chunk::Kind::kThink, image = c.kind == Chunk::Kind::kImage;
      if (m.role == Role::kAssistant && think && v < 11)
        return invalid_argument("Unexpected content chunk types in assistant message: ['ThinkChunk']");
      if (m.role == Role::kSystem && think && v >= 15)
        return invalid_argument("Unexpected content chunk types in system message: ['ThinkChunk']");
      if (m.role == Role::kTool && image && v < 15)
        return invalid_argument("Unexpected content chunk types in tool message: ['ImageURLChunk']");
    }
    if (m.role == Role::kAssistant) {
      if (m.tool_calls)
        for (const auto& tc : *m.tool_calls) {
          ML4_RETURN_IF_ERROR(check_id(tc.id, true));
          if (!valid_function_name(tc.name))
            return invalid_argument("Function name was {} but must be a-z, A-Z, 0-9, or contain underscores and "
                                    "dashes, with a maximum length of 64.", tc.name);
        }
      if (m.prefix && i + 1 != ms.size())
        return invalid_argument("Assistant message with prefix True must be last message");
    } else if (m.role == Role::kTool) {
      if (m.name && !valid_function_name(*m.name))
        return invalid_argument("Function name was {} but must be a-z, A-Z, 0-9, or contain underscores and dashes, "
                                "with a maximum length of 64.", *m.name);
      if (!m.tool_call_id) return invalid_argument("Tool call id has to be defined.");
      ML4_RETURN_IF_ERROR(check_id(*m.tool_call_id, false));
    }
  }
  if (r.tools)
    for (const auto& t : *r.tools) {
      std::string name = t["function"]["name"].get<std::string>();
      if (!valid_function_name(name))
        return invalid_argument("Function name was {} but must be a-z, A-Z, 0-9, or contain underscores and dashes, "
                                "with a maximum length of 64.", name);
    }
  if (v < 15 && r.reasoning_effort)
    return invalid_argument("reasoning_effort='{}' is not supported for this model", *r.reasoning_effort);
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// 3. Normalize (InstructRequestNormalizerV7/V13/V15).

namespace {

// _aggregate_content_chunks_impl: text pieces joined, other chunks kept in place.
Content aggregate(const std::vector<const Content*>& contents, const std::string& msg_join,
                  const std::string& chunk_join) {
  std::vector<Chunk> all;
  std::string cur;
  bool cur_nonempty = false;
  auto flush = [&] {
    if (cur_nonempty) {
      Chunk t;
      t.text = cur;
      all.push_back(std::move(t));
      cur.clear();
      cur_nonempty = false;
    }
  };
  for (const Content* c : contents) {
    bool needs_new_msg_sep = cur_nonempty;
    if (!c->truthy()) continue;
    if (c->is_str) {
      cur += (needs_new_msg_sep ? msg_join : std::string()) + c->str;
      cur_nonempty = true;
      continue;
    }
    for (const Chunk& ch : c->chunks) {
      if (ch.kind == Chunk::Kind::kText) {
        if (ch.text.empty()) continue;
        cur += (!cur_nonempty ? std::string() : needs_new_msg_sep ? msg_join : chunk_join) + ch.text;
        cur_nonempty = true;
        needs_new_msg_sep = false;
      } else {
        flush();
        all.push_back(ch);
      }
    }
  }
  if (all.empty()) return Content::of_str(cur);
  flush();
  return Content::of_chunks(std::move(all));
}

// _normalize_json_content: "" / None -> "{}", JSON re-dumped, anything else kept.
std::string normalize_json_content(const std::string& s) {
  if (s.empty()) return "{}";
  ojson j;
  if (python_json_loads(s, j)) return python_json_dumps(j);
  return s;
}


}  // namespace

// ModelSettingsBuilder.build_settings (model_settings_builder.py).
Result<Settings> build_settings(const Tokenizer& tok, const Request& r) {
  Settings s;
  const auto& b = tok.model_settings_builder();
  if (b.is_null()) return invalid_argument("model_settings_builder must not be None for InstructRequestNormalizerV15");
  if (b.contains("reasoning_effort") && !b["reasoning_effort"].is_null()) {
    const auto& fb = b["reasoning_effort"];
    std::optional<std::string> value = r.reasoning_effort;
    if (!value && fb.contains("default") && fb["default"].is_string()) value = fb["default"].get<std::string>();
    if (!value) return invalid_argument("reasoning_effort should be set for this model.");
    std::vector<std::string> values;
    if (fb.contains("values") && fb["values"].is_array())
      for (const auto& x : fb["values"]) values.push_back(x.get<std::string>());
    if (values.empty()) return invalid_argument("reasoning_effort not supported for this model.");
    if (std::find(values.begin(), values.end(), *value) == values.end())
      return invalid_argument("reasoning_effort should be one of {}, got {}.", fmt::join(values, ", "), *value);
    s.reasoning_effort = value;
  }
  if (b.contains("json_schema") && !b["json_schema"].is_null()) {
    if (r.response_format_type == "json_schema") s.json_schema = r.response_schema;
    else if (r.response_format_type == "json_object")
      s.json_schema = ojson::parse(R"({"anyOf": [{"type": "object"}, {"type": "array"}]})");
  }
  return s;
}

std::vector<Message> normalize(const Request& r, int v) {
  const std::string msg_join = "\n\n", chunk_join = v >= 15 ? "" : "\n\n";
  std::vector<Message> out;
  std::vector<std::string> latest_call_ids;
  size_t i = 0;
  while (i < r.messages.size()) {
    size_t j = i;
    while (j < r.messages.size() && r.messages[j].role == r.messages[i].role) ++j;
    Role role = r.messages[i].role;
    std::vector<const Content*> contents;
    for (size_t k = i; k < j; ++k) contents.push_back(&r.messages[k].content);
    if (role == Role::kUser) {
      Message m;
      m.role = Role::kUser;
      m.content = aggregate(contents, msg_join, chunk_join);
      out.push_back(std::move(m));
    } else if (role == Role::kSystem) {
      for (size_t k = i; k < j; ++k) {
        Message m;
        m.role = Role::kSystem;
        m.content = aggregate({&r.messages[k].content}, msg_join, chunk_join);
        out.push_back(std::move(m));
      }
    } else if (role == Role::kAssistant) {
      Message m;
      m.role = Role::kAssistant;
      m.content = aggregate(contents, msg_join, chunk_join);
      std::vector<ToolCall> calls;
      for (size_t k = i; k < j; ++k) {
        if (r.messages[k].tool_calls)
          for (ToolCall tc : *r.messages[k].tool_calls) {
            tc.arguments = normalize_json_content(tc.arguments);
            calls.push_back(std::move(tc));
          }
        m.prefix |= r.messages[k].prefix;
      }
      if (!calls.empty()) m.tool_calls = std::move(calls);
      if (m.tool_calls)
        for (const auto& tc : *m.tool_calls) latest_call_ids.push_back(tc.id);
      out.push_back(std::move(m));
    } else {  // tool results, ordered by the calls that asked for them (v11+)
      std::vector<Message> tools;
      for (size_t k = i; k < j; ++k) {
        Message m;
        m.role = Role::kTool;
        m.content = aggregate({&r.messages[k].content}, msg_join, chunk_join);
        m.tool_call_id = r.messages[k].tool_call_id;
        m.name = r.messages[k].name;
        tools.push_back(std::move(m));
      }
      if (v >= 11) {  // get_normalizer: v11 and v13 both use InstructRequestNormalizerV13
        std::map<std::string, size_t> call_idx, result_idx;
        for (size_t k = 0; k < latest_call_ids.size(); ++k) call_idx.emplace(latest_call_ids[k], k);
        for (size_t k = 0; k < tools.size(); ++k) result_idx[tools[k].tool_call_id.value_or("null")] = k;
        auto key = [&](const Message& m) {
          auto it = call_idx.find(m.tool_call_id.value_or("null"));
          double a = it == call_idx.end() ? INFINITY : static_cast<double>(it->second);
          return std::make_pair(a, result_idx[m.tool_call_id.value_or("null")]);
        };
        std::stable_sort(tools.begin(), tools.end(), [&](const Message& a, const Message& b) { return key(a) < key(b); });
      }
      latest_call_ids.clear();
      for (auto& m : tools) out.push_back(std::move(m));
    }
    i = j;
  }
  return out;
}

}  // namespace ml4::chat_detail
