// Structured outputs: grammar-constrained sampling (OpenAI response_format json_object /
// json_schema, vLLM's structured_outputs / guided_json / guided_regex / guided_choice /
// guided_grammar, and tool_choice "required" or a named function).
//
// The grammar engine is xgrammar (github.com/mlc-ai/xgrammar, Apache-2.0), the one vLLM,
// SGLang and TensorRT-LLM use: its C++ core is built from the sdist it publishes on PyPI
// (scripts/setup.sh unpacks it, CMakeLists.txt compiles cpp/*.cc into ml4_xgrammar: about 30
// files, no dependency beyond the header-only picojson and dlpack it ships). A build without
// it still runs: available() is false and every compile() answers a clear error (400).
//
// The flow, as vLLM v1's (vllm/v1/structured_output/backend_xgrammar.py):
//   - StructuredOutputCompiler holds xgrammar's TokenizerInfo (each id's bytes; special ids
//     as "" so no text can produce them; EOS as the stop token) and a GrammarCompiler with its
//     cache. It is made once per server from the TextCodec and compiles a GrammarSpec in the
//     HTTP handler's thread, so a bad schema is a 400 before the request reaches the engine.
//   - The compiled grammar rides in SamplingParams::structured (shared, immutable); the
//     engine makes one GrammarMatcher per request when it is added.
//   - Each step the engine asks the matcher for the allowed-token bitmask of the next token
//     (ceil(V / 32) words, bit i % 32 of word i / 32 set when id i may come next) and the
//     sampler (engine/sampler.h) masks the logits with it before anything else; the sampled
//     token is then accepted. EOS is allowed only where the grammar can end, and accepting it
//     terminates the matcher, which finishes the request (finish_reason "stop").
//   - Rows with a grammar are never sampled on the device until the runner uploads the mask
//     (ops/cuda/sampling.h takes an optional bitmask; runtime/step.h has no field for it yet).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace ml4 {

class TextCodec;

struct GrammarSpec {
  enum class Kind { kNone, kJsonObject, kJsonSchema, kRegex, kChoice, kGrammar };
  Kind kind = Kind::kNone;
  std::string text;                  // the JSON schema (serialised), the regex, or the EBNF grammar
  std::vector<std::string> choices;  // kChoice
  // kJsonSchema: any JSON whitespace between tokens (vLLM's default), else the compact form
  // (structured_outputs.disable_any_whitespace; ml4 also uses it for tool_choice arguments,
  // where a model cannot run on in spaces).
  bool any_whitespace = true;
  bool any() const { return kind != Kind::kNone; }
};

// Words of a bitmask over `vocab` ids.
inline int bitmask_words(int vocab) { return (vocab + 31) / 32; }
inline bool bitmask_allows(const uint32_t* words, int32_t id) { return (words[id >> 5] >> (id & 31)) & 1u; }
// Sets every logit the bitmask does not allow to -inf (what the device's apply_token_bitmask
// does to a row before it samples).
inline void mask_disallowed(float* row, int vocab, const uint32_t* words) {
  for (int v = 0; v < vocab; ++v)
    if (!bitmask_allows(words, v)) row[v] = -std::numeric_limits<float>::infinity();
}

// One request's position in its grammar. Engine thread only.
class GrammarMatcher {
 public:
  virtual ~GrammarMatcher() = default;
  // Writes the allowed next tokens into `words` (bitmask_words(vocab) words).
  virtual void fill_bitmask(uint32_t* words) = 0;
  // Advances over `token`; false when the grammar does not allow it (nothing changes then).
  virtual bool accept(int32_t token) = 0;
  // The grammar ended and its stop token (EOS) was accepted.
  virtual bool terminated() const = 0;
};

// A compiled grammar; immutable, shared by every request (and choice) that uses it.
class StructuredOutput {
 public:
  virtual ~StructuredOutput() = default;
  virtual std::unique_ptr<GrammarMatcher> new_matcher() const = 0;
  virtual int vocab_size() const = 0;
};

class StructuredOutputCompiler {
 public:
  // `vocab_size` is the model's (logit rows), which may exceed the tokenizer's; ids past the
  // tokenizer are never allowed.
  StructuredOutputCompiler(const TextCodec& codec, int vocab_size);
  ~StructuredOutputCompiler();
  // True when ml4 was built with xgrammar.
  static bool available();
  // kInvalidArgument for a bad schema / regex / grammar, with xgrammar's message.
  Result<std::shared_ptr<const StructuredOutput>> compile(const GrammarSpec& spec) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// EBNF for a choice among literal strings (vLLM's choice_as_grammar): root ::= "a" | "b".
std::string choice_grammar(const std::vector<std::string>& choices);

}  // namespace ml4
