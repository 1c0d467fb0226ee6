// Tokenizer: Mistral's tekken.json (tiktoken-style byte-level BPE) with special tokens.
//
// The file format and the algorithm follow mistral-common (mistral_common/tokens/tokenizers/
// tekken.py) and tiktoken (src/lib.rs, `_byte_pair_merge`), and the ids are tested to be
// identical to theirs (tests/tokenizer/, goldens made by tools/tokenizer/make_goldens.py):
//   * ids [0, num_special) are special tokens; regular token r has id r + num_special;
//     the regular vocabulary is cut to default_vocab_size - default_num_special_tokens;
//   * text is pre-split with the file's own regex (PCRE2 with JIT; `\s` is rewritten to
//     Unicode White_Space so PCRE2 agrees with the Rust regex crate tiktoken uses);
//   * each piece is one token when it is in the vocabulary, otherwise byte pairs are merged
//     lowest rank first (leftmost on ties), exactly as tiktoken does;
//   * plain text never yields a special token: "[INST]" in a user message is five regular
//     tokens. `allow_special` opts in to matching special-token strings in the text;
//   * input that is not valid UTF-8 is first decoded the way Python's
//     bytes.decode("utf-8", "replace") does, since mistral-common only ever sees a `str`;
//   * decoding joins token bytes and replaces broken UTF-8 per run of regular tokens, as
//     tekken's `_decode_all` does; StreamDecoder yields the same text piece by piece and
//     never emits a partial character.
// A Tokenizer is immutable after load and safe to share between threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace ml4 {

class PretokenizerRegex;

// The image section of a tekken.json (Pixtral): what decides the [IMG] placeholder grid.
struct ImageConfig {
  int image_patch_size = 0;
  int max_image_size = 0;
  int spatial_merge_size = 1;
};

class Tokenizer {
 public:
  // Loads a tekken.json file. Errors name the file and the offending field.
  static Result<std::shared_ptr<const Tokenizer>> load(const std::string& tekken_json_path);
  // The same from an already parsed document (tests build variants in memory).
  static Result<std::shared_ptr<const Tokenizer>> from_json(const nlohmann::json& doc,
                                                            const std::string& name = "tekken");
  ~Tokenizer();

  // Regular-token ids for `text`; with `allow_special`, special-token strings present in
  // the text ("[INST]", "</s>") become their ids. Never adds BOS/EOS.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = false) const;
  // Appends to `out` (no allocation per call for callers that reuse the vector).
  void encode_into(std::string_view text, bool allow_special, std::vector<int32_t>& out) const;

  // Text of `ids`; special tokens dropped (skip_special) or written as their names.
  // Broken UTF-8 inside a run of regular tokens becomes U+FFFD, as in mistral-common.
  // Ids outside the vocabulary are skipped.
  std::string decode(std::span<const int32_t> ids, bool skip_special = true) const;

  // Raw bytes of a regular token, or the name of a special token; empty when out of range.
  std::string_view token_bytes(int32_t id) const;

  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  int32_t pad_id() const { return pad_id_; }
  int32_t unk_id() const { return unk_id_; }
  int vocab_size() const { return vocab_size_; }
  int num_special_tokens() const { return num_special_; }
  bool is_special(int32_t id) const { return id >= 0 && id < num_special_; }
  bool is_valid_id(int32_t id) const { return id >= 0 && id < vocab_size_; }
  std::optional<int32_t> special_id(std::string_view name) const;
  // Tokenizer version number from config.version ("v13" -> 13).
  int version() const { return version_; }
  const std::string& pattern() const { return pattern_; }
  const std::string& name() const { return name_; }
  const std::optional<ImageConfig>& image_config() const { return image_; }
  // The raw "model_settings_builder" section (v15+), null when absent.
  const nlohmann::json& model_settings_builder() const { return model_settings_builder_; }

 private:
  Tokenizer();
  Status init(const nlohmann::json& doc);
  void encode_ordinary(std::string_view valid_utf8, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  int32_t rank_of(const char* p, size_t n) const;  // -1 when absent
  int32_t rank_of_hashed(const char* p, size_t n, uint64_t hash) const;
  void byte_pair_merge(std::string_view piece, std::vector<int32_t>& out) const;
  void byte_pair_merge_long(std::string_view piece, std::vector<int32_t>& out) const;

  uint64_t instance_id_ = 0;  // keys the per-thread piece cache (tokenizer.cpp)
  std::string name_;
  std::string pattern_;
  int version_ = 0;
  int vocab_size_ = 0;
  int num_special_ = 0;
  int32_t bos_id_ = -1, eos_id_ = -1, pad_id_ = -1, unk_id_ = -1;
  std::vector<std::string> special_names_;  // [num_special]
  std::unordered_map<std::string, int32_t> special_by_name_;
  // Regular vocabulary: bytes of rank r are arena_[offsets_[r], offsets_[r + 1]).
  std::string arena_;
  std::vector<uint32_t> offsets_;
  // Open-addressing hash table from bytes to rank: each slot holds 32 more bits of the hash
  // (a tag that rules out almost every mismatch without touching the arena) and rank + 1,
  // 0 = empty.
  struct Slot {
    uint32_t tag = 0;
    uint32_t rank1 = 0;
  };
  std::vector<Slot> table_;
  uint64_t table_mask_ = 0;
  std::unique_ptr<PretokenizerRegex> regex_;
  std::unique_ptr<PretokenizerRegex> special_regex_;  // alternation of special names
  std::optional<ImageConfig> image_;
  nlohmann::json model_settings_builder_;
};

// Incremental detokenizer: push ids as they are sampled, get the text that is final.
// A character whose bytes span several tokens is emitted once complete; the
// concatenation of every push() and the final flush() equals Tokenizer::decode of all ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(std::shared_ptr<const Tokenizer> tok, bool skip_special = true);
  std::string push(int32_t id);
  std::string push(std::span<const int32_t> ids);
  // Ends the stream: pending bytes that never completed a character become U+FFFD.
  std::string flush();

 private:
  std::shared_ptr<const Tokenizer> tok_;
  bool skip_special_;
  std::string pending_;  // bytes of an incomplete character (at most 3)
};

}  // namespace ml4
