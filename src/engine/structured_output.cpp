// Structured outputs on xgrammar (design in structured_output.h).
#include "engine/structured_output.h"

#include <mutex>

#include "engine/text_codec.h"

#if defined(ML4_WITH_XGRAMMAR)
#include <xgrammar/xgrammar.h>
#endif

namespace ml4 {

std::string choice_grammar(const std::vector<std::string>& choices) {
  std::string g = "root ::= ";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i) g += " | ";
    g += '"';
    for (unsigned char c : choices[i]) {
      if (c == '"' || c == '\\') {
        g += '\\';
        g += static_cast<char>(c);
      } else if (c < 0x20 || c == 0x7f) {
        g += fmt::format("\\u{:04x}", c);
      } else {
        g += static_cast<char>(c);
      }
    }
    g += '"';
  }
  return g;
}

#if defined(ML4_WITH_XGRAMMAR)

namespace {

class XgMatcher : public GrammarMatcher {
 public:
  XgMatcher(const xgrammar::CompiledGrammar& g, int vocab) : m_(g), vocab_(vocab) {}
  void fill_bitmask(uint32_t* words) override {
    int64_t shape[1] = {bitmask_words(vocab_)};
    DLTensor t{};
    t.data = words;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = DLDataType{kDLInt, 32, 1};
    t.shape = shape;
    m_.FillNextTokenBitmask(&t);
  }
  bool accept(int32_t token) override { return m_.AcceptToken(token); }
  bool terminated() const override { return m_.IsTerminated(); }

 private:
  xgrammar::GrammarMatcher m_;
  int vocab_;
};

class XgOutput : public StructuredOutput {
 public:
  XgOutput(xgrammar::CompiledGrammar g, int vocab) : g_(std::move(g)), vocab_(vocab) {}
  std::unique_ptr<GrammarMatcher> new_matcher() const override { return std::make_unique<XgMatcher>(g_, vocab_); }
  int vocab_size() const override { return vocab_; }

 private:
  xgrammar::CompiledGrammar g_;
  int vocab_;
};

}  // namespace

struct StructuredOutputCompiler::Impl {
  const TextCodec& codec;
  int vocab;
  std::once_flag once;
  std::unique_ptr<xgrammar::GrammarCompiler> compiler;

  Impl(const TextCodec& c, int v) : codec(c), vocab(v) {}

  // The tokenizer table costs a pass over the vocabulary: made at the first compile.
  xgrammar::GrammarCompiler& get() {
    std::call_once(once, [this] {
      std::vector<std::string> encoded(static_cast<size_t>(codec.vocab_size()));
      for (int i = 0; i < codec.vocab_size(); ++i)
        if (!codec.is_special(i)) encoded[i] = codec.token_bytes(i);  // "" marks a special id
      xgrammar::TokenizerInfo info(encoded, xgrammar::VocabType::RAW, vocab, std::vector<int32_t>{codec.eos_id()});
      // Two threads: the machines ml4's CI runs on have two cores; compiles are cached.
      compiler = std::make_unique<xgrammar::GrammarCompiler>(info, 2, true, 256ll << 20);
    });
    return *compiler;
  }
};

StructuredOutputCompiler::StructuredOutputCompiler(const TextCodec& codec, int vocab_size)
    : impl_(std::make_unique<Impl>(codec, vocab_size)) {}
StructuredOutputCompiler::~StructuredOutputCompiler() = default;
bool StructuredOutputCompiler::available() { return true; }

Result<std::shared_ptr<const StructuredOutput>> StructuredOutputCompiler::compile(const GrammarSpec& spec) const {
  const char* what = "grammar";
  try {
    xgrammar::GrammarCompiler& c = impl_->get();
    std::optional<xgrammar::CompiledGrammar> g;
    switch (spec.kind) {
      case GrammarSpec::Kind::kNone: return invalid_argument("no grammar to compile");
      case GrammarSpec::Kind::kJsonObject:
        // Any JSON object (OpenAI's json_object), as vLLM asks xgrammar for it: the builtin JSON
        // grammar would also take arrays and scalars.
        g = c.CompileJSONSchema(R"({"type": "object"})", spec.any_whitespace);
        break;
      case GrammarSpec::Kind::kJsonSchema:
        what = "JSON schema";
        g = c.CompileJSONSchema(spec.text, spec.any_whitespace);
        break;
      case GrammarSpec::Kind::kRegex:
        what = "regex";
        g = c.CompileRegex(spec.text);
        break;
      case GrammarSpec::Kind::kChoice:
        what = "choice";
        if (spec.choices.empty()) return invalid_argument("the choice list is empty");
        g = c.CompileGrammar(choice_grammar(spec.choices));
        break;
      case GrammarSpec::Kind::kGrammar:
        what = "grammar";
        g = c.CompileGrammar(spec.text);
        break;
    }
    return std::shared_ptr<const StructuredOutput>(std::make_shared<XgOutput>(std::move(*g), impl_->vocab));
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (msg.size() > 600) msg = msg.substr(0, 600) + "...";
    return invalid_argument("invalid {} for structured output: {}", what, msg);
  }
}

#else  // !ML4_WITH_XGRAMMAR

struct StructuredOutputCompiler::Impl {};
StructuredOutputCompiler::StructuredOutputCompiler(const TextCodec&, int) {}
StructuredOutputCompiler::~StructuredOutputCompiler() = default;
bool StructuredOutputCompiler::available() { return false; }
Result<std::shared_ptr<const StructuredOutput>> StructuredOutputCompiler::compile(const GrammarSpec&) const {
  return invalid_argument(
      "structured outputs (response_format, guided_*, tool_choice required / named) need ml4 built with xgrammar: "
      "run scripts/setup.sh and rebuild");
}

#endif

}  // namespace ml4
