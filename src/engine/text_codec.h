// TextCodec: the one seam between the engine/server and a tokenizer (text <-> ids, chat).
//
// The engine needs only per-token bytes (for streaming detokenization and stop strings),
// EOS, and a vocabulary size; the server also needs encode and the chat template. Keeping
// them behind this small interface lets the tekken tokenizer (src/tokenizer) plug in with a
// one-line change in make_text_codec(). Until a model ships a usable tekken.json,
// ByteTextCodec is the fallback: it uses tekken's id layout (1000 special ids, then the 256
// single-byte ranks at ids 1000..1255, tekken.json "default_num_special_tokens"), so its
// ids are real tekken ids for byte-level text.
//
// IncrementalDetokenizer turns a token stream into UTF-8 text without ever emitting half a
// code point: bytes are held back until they complete a valid sequence (the same rule as
// vLLM's incremental detokenizer / Hugging Face DecodeStream).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "tokenizer/chat.h"
#include "tokenizer/output_parser.h"

namespace ml4 {

class TextCodec {
 public:
  virtual ~TextCodec() = default;
  virtual int vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual bool is_special(int32_t id) const = 0;
  // Raw bytes of one token (may be part of a UTF-8 sequence); a special token gives its name.
  virtual std::string token_bytes(int32_t id) const = 0;
  virtual Result<std::vector<int32_t>> encode(const std::string& text, bool add_bos) const = 0;
  // An OpenAI chat request (messages, tools, ...) -> prompt ids, generation prompt included.
  virtual Result<std::vector<int32_t>> encode_chat(const nlohmann::ordered_json& request) const = 0;
  // A name for /v1/models and logs.
  virtual std::string name() const = 0;
  // Where chat images may come from (set once, before serving; see tokenizer/chat.h).
  virtual void set_media_options(const MediaOptions& media) {}
  // Streaming parser for reasoning and tool calls over output ids; null when the codec has
  // no such markers (the byte fallback).
  virtual std::unique_ptr<OutputParser> make_output_parser(const OutputParserOptions& options) const {
    return nullptr;
  }

  // Whole-sequence decode; invalid UTF-8 bytes become U+FFFD.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const;
};

// Byte-level fallback with tekken's id layout. Mistral instruct control tokens are the
// tekken special ids: <s>=1, </s>=2, [INST]=3, [/INST]=4, [SYSTEM_PROMPT]=17, [/SYSTEM_PROMPT]=18.
class ByteTextCodec : public TextCodec {
 public:
  static constexpr int32_t kNumSpecial = 1000;
  explicit ByteTextCodec(int vocab_size) : vocab_size_(vocab_size) {}
  int vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return 1; }
  int32_t eos_id() const override { return 2; }
  bool is_special(int32_t id) const override { return id < kNumSpecial || id >= kNumSpecial + 256; }
  std::string token_bytes(int32_t id) const override;
  Result<std::vector<int32_t>> encode(const std::string& text, bool add_bos) const override;
  Result<std::vector<int32_t>> encode_chat(const nlohmann::ordered_json& request) const override;
  std::string name() const override { return "byte-fallback"; }

 private:
  int vocab_size_;
};

// The model's tekken.json through src/tokenizer (mistral-common compatible ids and chat).
class TekkenTextCodec : public TextCodec {
 public:
  explicit TekkenTextCodec(std::shared_ptr<const Tokenizer> tok) : tok_(std::move(tok)) {}
  int vocab_size() const override;
  int32_t bos_id() const override;
  int32_t eos_id() const override;
  bool is_special(int32_t id) const override;
  std::string token_bytes(int32_t id) const override;
  Result<std::vector<int32_t>> encode(const std::string& text, bool add_bos) const override;
  Result<std::vector<int32_t>> encode_chat(const nlohmann::ordered_json& request) const override;
  std::string name() const override;
  std::unique_ptr<OutputParser> make_output_parser(const OutputParserOptions& options) const override {
    return std::make_unique<OutputParser>(tok_, options);
  }
  void set_media_options(const MediaOptions& media) override { chat_options_.media = media; }

 private:
  std::shared_ptr<const Tokenizer> tok_;
  ChatOptions chat_options_;
};

// Picks the model's tokenizer when one is usable, else the byte fallback.
Result<std::unique_ptr<TextCodec>> make_text_codec(const std::string& model_dir, int vocab_size);

class IncrementalDetokenizer {
 public:
  // Appends one token; returns the text that became complete (maybe empty).
  std::string push(const TextCodec& codec, int32_t id, bool skip_special);
  // At the end of a sequence: whatever is held back, invalid bytes as U+FFFD.
  std::string flush();

 private:
  std::string pending_;
};

// Length of the longest prefix of `s` that is complete, valid UTF-8, treating an invalid
// byte as complete (it is replaced later); a trailing incomplete sequence is excluded.
size_t utf8_complete_prefix(const std::string& s);
// Replaces invalid UTF-8 with U+FFFD so JSON encoding never fails.
std::string sanitize_utf8(const std::string& s);

}  // namespace ml4
