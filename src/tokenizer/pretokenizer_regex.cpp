// PCRE2 wrapper for the pre-split regex (see pretokenizer_regex.h).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pretokenizer_regex.h"

#include <pcre2.h>

namespace ml4 {
namespace {

// Unicode White_Space = Z (Zs, Zl, Zp) plus U+0009..U+000D and U+0085 (PropList.txt).
constexpr std::string_view kWhiteSpaceSet = "\\t-\\r\\x{85}\\p{Z}";

// Per-thread match data and JIT stack: a Tokenizer is shared by threads and
// pcre2_match_data must not be. 32 pairs is plenty for a pre-split pattern.
struct ThreadMatchState {
  pcre2_match_data* md = nullptr;
  pcre2_jit_stack* stack = nullptr;
  pcre2_match_context* mctx = nullptr;
  ThreadMatchState() {
    md = pcre2_match_data_create(32, nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    if (stack && mctx) pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(md);
  }
};

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState s;
  return s;
}

}  // namespace

std::string PretokenizerRegex::translate_pattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[i + 1];
      if (e == 's') {
        if (in_class) {
          out += kWhiteSpaceSet;
        } else {
          out += '[';
          out += kWhiteSpaceSet;
          out += ']';
        }
      } else if (e == 'S' && !in_class) {
        out += "[^";
        out += kWhiteSpaceSet;
        out += ']';
      } else {
        out += c;
        out += e;
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Result<std::unique_ptr<PretokenizerRegex>> PretokenizerRegex::compile(std::string_view pattern,
                                                                     bool unicode_whitespace) {
  std::string pat = unicode_whitespace ? translate_pattern(pattern) : std::string(pattern);
  int err = 0;
  PCRE2_SIZE err_off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &err_off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return invalid_argument("pre-split regex does not compile at offset {}: {} (pattern: {})", err_off,
                            reinterpret_cast<const char*>(msg),
                            pattern.size() > 200 ? std::string(pattern.substr(0, 200)) + "..." : std::string(pattern));
  }
  std::unique_ptr<PretokenizerRegex> r(new PretokenizerRegex());
  r->code_ = code;
  r->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return r;
}

PretokenizerRegex::~PretokenizerRegex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool PretokenizerRegex::find(std::string_view subject, size_t start, size_t* match_begin,
                             size_t* match_end) const {
  auto* code = static_cast<pcre2_code*>(code_);
  ThreadMatchState& st = thread_state();
  auto subj = reinterpret_cast<PCRE2_SPTR>(subject.data());
  int rc;
  if (jit_) {
    rc = pcre2_jit_match(code, subj, subject.size(), start, 0, st.md, st.mctx);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // pathological input: let the interpreter try
      rc = pcre2_match(code, subj, subject.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, st.md, nullptr);
  } else {
    rc = pcre2_match(code, subj, subject.size(), start, PCRE2_NO_UTF_CHECK, st.md, nullptr);
  }
  if (rc < 0) return false;
  PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
  *match_begin = ov[0];
  *match_end = ov[1];
  return true;
}

}  // namespace ml4
