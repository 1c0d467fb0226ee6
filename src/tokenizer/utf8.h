// UTF-8 helpers for the tokenizer: lossy decoding that matches Python exactly.
//
// mistral-common works on Python `str`, so any byte string reaching it has first been
// decoded with `bytes.decode("utf-8", errors="replace")`, and tiktoken's `decode` does the
// same to token bytes. Python replaces each *maximal subpart* of an ill-formed sequence
// with one U+FFFD (Unicode 15, section 3.9, "U+FFFD Substitution of Maximal Subparts";
// CPython Objects/stringlib/codecs.h). Doing the same here makes our ids and our decoded
// text byte-identical to the reference on malformed input, and lets a streaming decoder
// hold back only a prefix that can still become a valid character.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ml4::utf8 {

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Appends the lossy decoding of `in` to `out`, in Python's errors="replace" form.
// When `final` is false, a trailing incomplete sequence that could still become valid is
// not consumed. Returns the number of bytes of `in` consumed.
size_t decode_replace(std::string_view in, std::string& out, bool final);

// The lossy decoding of the whole of `in`.
std::string sanitize(std::string_view in);

// True when `in` is well-formed UTF-8 (no surrogates, no overlongs, <= U+10FFFF).
bool is_valid(std::string_view in);

// Length of the sequence started by lead byte `b` (1 for ASCII and for invalid leads).
inline int sequence_length(unsigned char b) {
  if (b < 0xC2) return 1;
  if (b < 0xE0) return 2;
  if (b < 0xF0) return 3;
  if (b < 0xF5) return 4;
  return 1;
}

// Appends code point `cp` encoded as UTF-8.
void append_codepoint(std::string& out, char32_t cp);

}  // namespace ml4::utf8
