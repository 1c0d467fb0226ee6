// Maximal-subpart UTF-8 decoding (see utf8.h for why it must match CPython).
#include "tokenizer/utf8.h"

namespace ml4::utf8 {
namespace {

// Valid range of the second byte given the lead byte (Unicode Table 3-7): this is what
// rules out overlongs (E0 80..9F, F0 80..8F), surrogates (ED A0..BF) and > U+10FFFF.
inline bool second_ok(unsigned char lead, unsigned char b) {
  switch (lead) {
    case 0xE0: return b >= 0xA0 && b <= 0xBF;
    case 0xED: return b >= 0x80 && b <= 0x9F;
    case 0xF0: return b >= 0x90 && b <= 0xBF;
    case 0xF4: return b >= 0x80 && b <= 0x8F;
    default: return b >= 0x80 && b <= 0xBF;
  }
}

inline bool is_cont(unsigned char b) { return (b & 0xC0) == 0x80; }

}  // namespace

size_t decode_replace(std::string_view in, std::string& out, bool final) {
  const auto* p = reinterpret_cast<const unsigned char*>(in.data());
  const size_t n = in.size();
  size_t i = 0;
  size_t run = 0;  // start of the current run of valid bytes, copied in bulk
  while (i < n) {
    unsigned char b = p[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    int len = sequence_length(b);
    if (len == 1) {  // stray continuation byte or invalid lead (C0, C1, F5..FF)
      out.append(in.data() + run, i - run);
      out.append(kReplacement);
      run = ++i;
      continue;
    }
    // Count how many bytes of the sequence are well formed.
    size_t good = 1;
    if (i + 1 < n && second_ok(b, p[i + 1])) {
      good = 2;
      while (good < static_cast<size_t>(len) && i + good < n && is_cont(p[i + good])) ++good;
    }
    if (good == static_cast<size_t>(len)) {
      i += len;
      continue;
    }
    if (i + good == n && !final) break;  // may still complete: hold it back
    // Maximal subpart: one U+FFFD for the well-formed prefix, resume at the bad byte.
    out.append(in.data() + run, i - run);
    out.append(kReplacement);
    i += good;
    run = i;
  }
  out.append(in.data() + run, i - run);
  return i;
}

std::string sanitize(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  decode_replace(in, out, true);
  return out;
}

bool is_valid(std::string_view in) {
  const auto* p = reinterpret_cast<const unsigned char*>(in.data());
  const size_t n = in.size();
  size_t i = 0;
  while (i < n) {
    unsigned char b = p[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    int len = sequence_length(b);
    if (len == 1 || i + len > n || !second_ok(b, p[i + 1])) return false;
    for (int k = 2; k < len; ++k)
      if (!is_cont(p[i + k])) return false;
    i += len;
  }
  return true;
}

void append_codepoint(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace ml4::utf8
