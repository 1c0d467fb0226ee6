// PretokenizerRegex: the tekken pre-split regex on PCRE2 with JIT.
//
// tiktoken compiles the pattern with the Rust `fancy-regex` crate. Both engines are
// leftmost-first backtrackers, so alternations and the `\s+(?!\S)` look-ahead behave the
// same; the one difference that matters is `\s`: Rust uses the Unicode White_Space property,
// PCRE2 with UCP uses "Z or \t\n\v\f\r", which misses U+0085 (NEL). translate_pattern()
// rewrites `\s`/`\S` to the White_Space set explicitly. PCRE2 10.42 ships Unicode 14 tables
// while the regex crate has Unicode 15+: letters assigned after Unicode 14 may split
// differently (docs/BENCHMARKS.md, "Tokenizer").
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ml4 {

class PretokenizerRegex {
 public:
  static Result<std::unique_ptr<PretokenizerRegex>> compile(std::string_view pattern,
                                                           bool unicode_whitespace = true);
  ~PretokenizerRegex();

  // Finds the next match in `subject` at or after `start`; the subject must be valid
  // UTF-8 (not rechecked). Returns false when there is none.
  bool find(std::string_view subject, size_t start, size_t* match_begin, size_t* match_end) const;

  // `\s` and `\S` spelled as the Unicode White_Space set (see the file comment).
  static std::string translate_pattern(std::string_view pattern);

 private:
  PretokenizerRegex() = default;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

}  // namespace ml4
