// Structured outputs (engine/structured_output.h) and prompt logprobs through the Engine.
//   - the grammar compiler (xgrammar) on the byte codec: a regex, a compact JSON schema and a
//     choice list (with quotes, backslashes and a newline, so the EBNF escaping is exercised)
//     drive fresh random logits through the sampler's mask until the grammar ends; the text
//     must match the regex / parse and satisfy the schema / equal one choice;
//   - bad schemas, regexes and grammars are clear errors;
//   - the same through the Engine on the FakeRunner: every output matches and finishes "stop"
//     (the grammar lets EOS through only at its end), also batched with unconstrained requests;
//   - prompt_logprobs through the Engine with chunked prefill equal an f64 log_softmax of the
//     FakeRunner's logits computed directly, and a second identical prompt (which would be a
//     prefix-cache hit) gets the same values.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/fake_runner.h"
#include "engine/sampler.h"
#include "engine/structured_output.h"

namespace ml4 {
namespace {

using testing::FakeRunner;
constexpr int kVocab = 1300;  // byte codec: specials < 1000, bytes 1000..1255, unused above

uint32_t fresh_seed() { return std::random_device{}(); }

std::shared_ptr<const StructuredOutput> compile_or_die(const StructuredOutputCompiler& c, const GrammarSpec& g) {
  auto r = c.compile(g);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? r.value() : nullptr;
}

// Samples under the grammar from fresh random logits until it terminates; returns the text.
std::string run_matcher(const StructuredOutput& so, const ByteTextCodec& codec, std::mt19937& rng, int max_steps,
                        bool* terminated) {
  auto m = so.new_matcher();
  std::vector<uint32_t> mask(bitmask_words(kVocab));
  Request r;
  r.params.temperature = 1.0;
  r.rng.seed(rng());
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::string text;
  *terminated = false;
  for (int step = 0; step < max_steps; ++step) {
    std::vector<float> logits(kVocab);
    for (auto& x : logits) x = d(rng);
    m->fill_bitmask(mask.data());
    const int32_t t = Sampler::sample(r, logits.data(), kVocab, codec.eos_id(), mask.data());
    EXPECT_TRUE(bitmask_allows(mask.data(), t));
    EXPECT_TRUE(m->accept(t)) << "token " << t;
    if (m->terminated()) {
      EXPECT_EQ(t, codec.eos_id());
      *terminated = true;
      break;
    }
    text += codec.token_bytes(t);
  }
  return text;
}

void require_xgrammar() {
  ASSERT_TRUE(StructuredOutputCompiler::available())
      << "ml4 was built without xgrammar: run scripts/setup.sh and reconfigure";
}

TEST(StructuredOutput, RegexSchemaAndChoiceConstrainRandomLogits) {
  require_xgrammar();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ByteTextCodec codec(kVocab);
  StructuredOutputCompiler c(codec, kVocab);

  const std::string re = "[0-9]{3}-[a-z]{2,4}(x|yz)?";
  auto rx = compile_or_die(c, {GrammarSpec::Kind::kRegex, re, {}});
  ASSERT_TRUE(rx);
  for (int i = 0; i < 10; ++i) {
    bool done = false;
    std::string s = run_matcher(*rx, codec, rng, 64, &done);
    EXPECT_TRUE(done) << s;
    EXPECT_TRUE(std::regex_match(s, std::regex(re))) << s;
  }

  const nlohmann::json schema = {
      {"type", "object"},
      {"properties",
       {{"ok", {{"type", "boolean"}}},
        {"color", {{"enum", {"red", "green", "blue"}}}},
        {"n", {{"type", "integer"}, {"minimum", 0}, {"maximum", 9}}}}},
      {"required", {"ok", "color", "n"}},
      {"additionalProperties", false}};
  GrammarSpec js{GrammarSpec::Kind::kJsonSchema, schema.dump(), {}, false};
  auto jg = compile_or_die(c, js);
  ASSERT_TRUE(jg);
  for (int i = 0; i < 10; ++i) {
    bool done = false;
    std::string s = run_matcher(*jg, codec, rng, 200, &done);
    ASSERT_TRUE(done) << s;
    auto v = nlohmann::json::parse(s, nullptr, false);
    ASSERT_FALSE(v.is_discarded()) << s;
    ASSERT_TRUE(v.is_object()) << s;
    EXPECT_EQ(v.size(), 3u) << s;
    EXPECT_TRUE(v["ok"].is_boolean()) << s;
    EXPECT_TRUE(v["color"] == "red" || v["color"] == "green" || v["color"] == "blue") << s;
    EXPECT_TRUE(v["n"].is_number_integer() && v["n"] >= 0 && v["n"] <= 9) << s;
  }

  const std::vector<std::string> choices = {"say \"hi\"", "back\\slash", "two\nlines", "plain"};
  auto cg = compile_or_die(c, {GrammarSpec::Kind::kChoice, "", choices});
  ASSERT_TRUE(cg);
  std::set<std::string> seen;
  for (int i = 0; i < 24; ++i) {
    bool done = false;
    std::string s = run_matcher(*cg, codec, rng, 32, &done);
    EXPECT_TRUE(done);
    EXPECT_NE(std::find(choices.begin(), choices.end(), s), choices.end()) << s;
    seen.insert(s);
  }
  EXPECT_GE(seen.size(), 2u);  // random logits reach more than one choice

  bool done = false;
  auto any_json = compile_or_die(c, {GrammarSpec::Kind::kJsonObject, "", {}});
  ASSERT_TRUE(any_json);
  // json_object from random logits need not end within a bound; what it emits is a JSON
  // object prefix: it starts with '{' (after optional whitespace).
  std::string s = run_matcher(*any_json, codec, rng, 40, &done);
  auto first = s.find_first_not_of(" \t\n\r");
  ASSERT_NE(first, std::string::npos) << s;
  EXPECT_EQ(s[first], '{') << s;
}

TEST(StructuredOutput, BadSpecsAreClearErrors) {
  require_xgrammar();
  ByteTextCodec codec(kVocab);
  StructuredOutputCompiler c(codec, kVocab);
  auto bad_schema = c.compile({GrammarSpec::Kind::kJsonSchema, R"({"type": "no-such-type"})", {}});
  ASSERT_FALSE(bad_schema.ok());
  EXPECT_NE(bad_schema.status().message().find("JSON schema"), std::string::npos) << bad_schema.status().message();
  auto bad_regex = c.compile({GrammarSpec::Kind::kRegex, "([a-z", {}});
  ASSERT_FALSE(bad_regex.ok());
  EXPECT_NE(bad_regex.status().message().find("regex"), std::string::npos);
  auto bad_ebnf = c.compile({GrammarSpec::Kind::kGrammar, "root ::= undefined_rule", {}});
  EXPECT_FALSE(bad_ebnf.ok());
  auto empty = c.compile({GrammarSpec::Kind::kChoice, "", {}});
  EXPECT_FALSE(empty.ok());
  // The compiler still works after errors.
  EXPECT_TRUE(c.compile({GrammarSpec::Kind::kRegex, "ab+", {}}).ok());
}

EngineConfig config(int max_seqs, int64_t budget, bool prefix = true) {
  EngineConfig c;
  c.scheduler.max_num_seqs = max_seqs;
  c.scheduler.max_num_batched_tokens = budget;
  c.scheduler.max_model_len = 512;
  c.enable_prefix_caching = prefix;
  return c;
}

std::vector<int32_t> random_prompt(std::mt19937& rng, int len) {
  std::uniform_int_distribution<int32_t> d(1000, 1255);
  std::vector<int32_t> p(len);
  for (auto& t : p) t = d(rng);
  return p;
}

// Three ways to draw a constrained row: the host Sampler (a runner that cannot mask), the
// runner's device sampler with the grammar's bitmask in SeqStep::allowed_tokens (the CUDA
// runner's path), and that runner returning logits anyway (the engine masks the same way and
// draws with the device contract on the host). Every constrained request must end with a
// match in each; the last two must give the same text token for token (same seed, same
// counter, same mask).
TEST(StructuredOutput, EngineFinishesEveryConstrainedRequestWithAMatch) {
  require_xgrammar();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  ByteTextCodec codec(kVocab);
  StructuredOutputCompiler c(codec, kVocab);
  const std::string re = "(cat|dog)s? [0-9]{1,3}";
  auto rx = compile_or_die(c, {GrammarSpec::Kind::kRegex, re, {}});
  ASSERT_TRUE(rx);
  enum Mode { kHostSampler, kDeviceMasks, kDeviceMasksFallback };
  std::map<std::string, std::string> texts[3];
  for (Mode mode : {kHostSampler, kDeviceMasks, kDeviceMasksFallback}) {
    SCOPED_TRACE(::testing::Message() << "mode " << mode);
    std::mt19937 rng(seed);
    FakeRunner runner(kVocab, FakeRunner::two_groups(512));
    runner.device_sampling_ = true;
    runner.token_masks_ = mode != kHostSampler;
    runner.logits_anyway_ = mode == kDeviceMasksFallback;
    Engine e(&runner, &codec, config(16, 64));
    for (int i = 0; i < 12; ++i) {
      SamplingParams p;
      p.temperature = i % 3 == 0 ? 0.0 : 1.0;
      p.seed = rng();
      p.max_tokens = 40;
      if (i % 4 != 3) p.structured = rx;  // every 4th runs unconstrained in the same batch
      ASSERT_TRUE(e.add_request("r" + std::to_string(i), random_prompt(rng, 5 + i), p).ok());
    }
    std::map<std::string, std::string>& text = texts[mode];
    std::map<std::string, RequestOutput> last;
    for (int s = 0; s < 2000 && e.has_work(); ++s) {
      auto out = e.step();
      ASSERT_TRUE(out.ok()) << out.status().message();
      for (auto& o : out.value()) {
        text[o.request_id] += o.new_text;
        last[o.request_id] = o;
      }
    }
    ASSERT_FALSE(e.has_work());
    for (int i = 0; i < 12; ++i) {
      const std::string id = "r" + std::to_string(i);
      if (i % 4 == 3) continue;
      EXPECT_EQ(last[id].finish_reason, FinishReason::kStop) << id << ": " << text[id];
      EXPECT_TRUE(std::regex_match(text[id], std::regex(re))) << id << ": " << text[id];
    }
    if (mode == kHostSampler) EXPECT_EQ(runner.masked_rows_, 0);  // no mask to a runner that cannot apply it
    else EXPECT_GT(runner.masked_rows_, 40);                       // constrained rows went with their mask
    EXPECT_EQ(e.blocks().num_free_blocks(0), e.blocks().num_total_blocks(0));
  }
  EXPECT_EQ(texts[kDeviceMasks], texts[kDeviceMasksFallback]);
}

// The FakeRunner's logits row after `tokens` (its formula, in the test).
std::vector<float> fake_row(const std::vector<int32_t>& tokens, size_t upto) {
  uint64_t h = 0x1234567ull;
  for (size_t q = 0; q <= upto; ++q) h = FakeRunner::mix(h ^ static_cast<uint64_t>(tokens[q]));
  std::vector<float> row(kVocab);
  for (int v = 0; v < kVocab; ++v)
    row[v] = static_cast<float>((FakeRunner::mix(h ^ (static_cast<uint64_t>(v) << 32)) >> 40) / double(1 << 24) * 8.0 - 4.0);
  return row;
}

TEST(PromptLogprobs, ChunkedPrefillMatchesDirectLogSoftmaxAndSkipsThePrefixCache) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ByteTextCodec codec(kVocab);
  FakeRunner runner(kVocab, FakeRunner::two_groups(512));
  Engine e(&runner, &codec, config(8, 16));  // budget 16: a 45-token prompt takes 3 chunks
  const auto prompt = random_prompt(rng, 45);
  SamplingParams p;
  p.temperature = 0.0;
  p.max_tokens = 3;
  p.ignore_eos = true;
  p.prompt_logprobs = 3;
  std::map<std::string, std::vector<TokenLogprob>> got;
  for (const std::string id : {"a", "b"}) {  // b: same prompt after a finished (a full prefix hit otherwise)
    ASSERT_TRUE(e.add_request(id, prompt, p).ok());
    for (int s = 0; s < 100 && e.has_work(); ++s) {
      auto out = e.step();
      ASSERT_TRUE(out.ok()) << out.status().message();
      for (auto& o : out.value())
        if (!o.prompt_logprobs.empty()) {
          EXPECT_TRUE(got[o.request_id].empty()) << "prompt logprobs sent twice";
          got[o.request_id] = o.prompt_logprobs;
        }
    }
  }
  for (const std::string id : {"a", "b"}) {
    const auto& lps = got[id];
    ASSERT_EQ(lps.size(), prompt.size() - 1) << id;
    for (size_t q = 1; q < prompt.size(); ++q) {
      const auto row = fake_row(prompt, q - 1);
      double mx = *std::max_element(row.begin(), row.end()), s = 0;
      for (float x : row) s += std::exp(double(x) - mx);
      const TokenLogprob& lp = lps[q - 1];
      EXPECT_EQ(lp.token, prompt[q]);
      EXPECT_NEAR(lp.logprob, row[prompt[q]] - mx - std::log(s), 1e-5) << id << " position " << q;
      int64_t rank = 1;
      for (float x : row) rank += x > row[prompt[q]] ? 1 : 0;
      EXPECT_EQ(lp.rank, rank);
      ASSERT_EQ(lp.top.size(), 3u);
      EXPECT_EQ(lp.top[0].first, std::max_element(row.begin(), row.end()) - row.begin());
    }
  }
}

}  // namespace
}  // namespace ml4
