// TextCodec helpers, the byte fallback codec and the incremental detokenizer (design in
// text_codec.h).
#include "engine/text_codec.h"

#include <filesystem>

#include "core/log.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace ml4 {
namespace {

constexpr const char* kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Length of the valid UTF-8 sequence at s[i], 0 when invalid, -1 when valid so far but cut
// off by the end of the string (RFC 3629 section 4 table).
int utf8_seq_len(const std::string& s, size_t i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  int len;
  unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k < len; ++k) {
    if (i + k >= s.size()) return -1;
    unsigned char b = static_cast<unsigned char>(s[i + k]);
    unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return 0;
  }
  return len;
}

std::string message_text(const nlohmann::ordered_json& content) {
  if (content.is_string()) return content.get<std::string>();
  std::string out;
  if (content.is_array()) {
    for (const auto& part : content) {
      if (part.is_object() && part.value("type", "") == "text" && part.contains("text") &&
          part["text"].is_string())
        out += part["text"].get<std::string>();
    }
  }
  return out;
}

}  // namespace

size_t utf8_complete_prefix(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    int len = utf8_seq_len(s, i);
    if (len < 0) return i;
    i += len == 0 ? 1 : len;
  }
  return i;
}

std::string sanitize_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    int len = utf8_seq_len(s, i);
    if (len <= 0) {
      out += kReplacement;
      ++i;
    } else {
      out.append(s, i, len);
      i += len;
    }
  }
  return out;
}

std::string TextCodec::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (skip_special && is_special(id)) continue;
    bytes += token_bytes(id);
  }
  return sanitize_utf8(bytes);
}

std::string ByteTextCodec::token_bytes(int32_t id) const {
  if (id >= kNumSpecial && id < kNumSpecial + 256) return std::string(1, static_cast<char>(id - kNumSpecial));
  switch (id) {
    case 0: return "<unk>";
    case 1: return "<s>";
    case 2: return "</s>";
    case 3: return "[INST]";
    case 4: return "[/INST]";
    case 17: return "[SYSTEM_PROMPT]";
    case 18: return "[/SYSTEM_PROMPT]";
    default: return fmt::format("<SPECIAL_{}>", id);
  }
}

Result<std::vector<int32_t>> ByteTextCodec::encode(const std::string& text, bool add_bos) const {
  if (vocab_size_ < kNumSpecial + 256)
    return invalid_argument("byte codec needs a vocabulary of at least {} ids, the model has {}",
                            kNumSpecial + 256, vocab_size_);
  std::vector<int32_t> ids;
  ids.reserve(text.size() + 1);
  if (add_bos) ids.push_back(bos_id());
  for (unsigned char c : text) ids.push_back(kNumSpecial + c);
  return ids;
}

// Mistral instruct layout (mistral-common, tokens v7+): <s>[SYSTEM_PROMPT]..[/SYSTEM_PROMPT]
// [INST]user[/INST]assistant</s>[INST]...[/INST]; tools are not supported by this fallback.
Result<std::vector<int32_t>> ByteTextCodec::encode_chat(const nlohmann::ordered_json& request) const {
  if (!request.is_object() || !request.contains("messages"))
    return invalid_argument("'messages' is required");
  const auto& messages = request["messages"];
  if (!messages.is_array() || messages.empty())
    return invalid_argument("'messages' must be a non-empty array");
  std::vector<int32_t> ids{bos_id()};
  auto append = [&](const std::string& text) -> Status {
    ML4_ASSIGN_OR_RETURN(auto t, encode(text, false));
    ids.insert(ids.end(), t.begin(), t.end());
    return ok_status();
  };
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      return invalid_argument("messages[{}]: must be an object with a string 'role'", i);
    std::string role = m["role"].get<std::string>();
    if (m.contains("content") && !m["content"].is_null() && !m["content"].is_string() &&
        !m["content"].is_array())
      return invalid_argument("messages[{}].content: must be a string or an array of parts", i);
    std::string text = m.contains("content") ? message_text(m["content"]) : "";
    if (role == "system" || role == "developer") {
      ids.push_back(17);
      ML4_RETURN_IF_ERROR(append(text));
      ids.push_back(18);
    } else if (role == "user" || role == "tool") {
      ids.push_back(3);
      ML4_RETURN_IF_ERROR(append(text));
      ids.push_back(4);
    } else if (role == "assistant") {
      ML4_RETURN_IF_ERROR(append(text));
      ids.push_back(eos_id());
    } else {
      return invalid_argument("messages[{}].role: unknown role '{}'", i, role);
    }
  }
  return ids;
}

int TekkenTextCodec::vocab_size() const { return tok_->vocab_size(); }
int32_t TekkenTextCodec::bos_id() const { return tok_->bos_id(); }
int32_t TekkenTextCodec::eos_id() const { return tok_->eos_id(); }
bool TekkenTextCodec::is_special(int32_t id) const { return tok_->is_special(id); }
std::string TekkenTextCodec::token_bytes(int32_t id) const { return std::string(tok_->token_bytes(id)); }
std::string TekkenTextCodec::name() const { return tok_->name(); }

Result<std::vector<int32_t>> TekkenTextCodec::encode(const std::string& text, bool add_bos) const {
  std::vector<int32_t> ids;
  if (add_bos) ids.push_back(tok_->bos_id());
  tok_->encode_into(text, false, ids);
  return ids;
}

Result<std::vector<int32_t>> TekkenTextCodec::encode_chat(const nlohmann::ordered_json& request) const {
  return ::ml4::encode_chat(*tok_, request, chat_options_);
}

Result<std::unique_ptr<TextCodec>> make_text_codec(const std::string& model_dir, int vocab_size) {
  const std::string path = model_dir + "/tekken.json";
  if (std::filesystem::exists(path)) {
    ML4_ASSIGN_OR_RETURN(std::shared_ptr<const Tokenizer> tok, Tokenizer::load(path));
    if (tok->vocab_size() > vocab_size)
      return invalid_argument("{}: tokenizer has {} ids, the model only {}", path, tok->vocab_size(), vocab_size);
    return std::unique_ptr<TextCodec>(std::make_unique<TekkenTextCodec>(tok));
  }
  if (vocab_size < ByteTextCodec::kNumSpecial + 256)
    return invalid_argument("{} has no tekken.json and its vocabulary ({}) is too small for the byte codec", model_dir,
                            vocab_size);
  ML4_LOG_WARN("{} has no tekken.json: using the byte-level fallback codec", model_dir);
  return std::unique_ptr<TextCodec>(std::make_unique<ByteTextCodec>(vocab_size));
}

std::string IncrementalDetokenizer::push(const TextCodec& codec, int32_t id, bool skip_special) {
  if (skip_special && codec.is_special(id)) return "";
  pending_ += codec.token_bytes(id);
  size_t n = utf8_complete_prefix(pending_);
  std::string out = sanitize_utf8(pending_.substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string IncrementalDetokenizer::flush() {
  std::string out = sanitize_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace ml4
