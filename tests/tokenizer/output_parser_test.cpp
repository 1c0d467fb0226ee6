// Output parsing: known answers for each output form, and streaming == whole-text for
// every chunking of the samples (exhaustively for short token sequences; every one- and
// two-cut chunking plus one-unit-per-chunk for the longer ones and for text).
#include "test_util.h"
#include "tokenizer/output_parser.h"
#include "tokenizer/utf8.h"

namespace ml4 {
namespace {

struct Sample {
  const char* name;
  std::vector<std::string> parts;  // "@NAME" is the special token NAME, anything else text
  ParsedOutput want;               // ids of generated calls are not compared
};

std::vector<int32_t> build(const Tokenizer& tok, const std::vector<std::string>& parts) {
  std::vector<int32_t> ids;
  for (const auto& p : parts) {
    if (p[0] == '@') {
      ids.push_back(*tok.special_id(p.substr(1)));
    } else {
      for (int32_t id : tok.encode(p)) ids.push_back(id);
    }
  }
  return ids;
}

std::vector<Sample> samples() {
  return {
      {"reasoning", {"@[THINK]", "Let me think: 2+2.", "@[/THINK]", "It is 4.", "@</s>"},
       {"It is 4.", "Let me think: 2+2.", {}}},
      {"calls_v13", {"Sure.", "@[TOOL_CALLS]", "get_weather", "@[ARGS]", "{\"city\": \"Paris\"}", "@[TOOL_CALLS]",
                     "web_search", "@[ARGS]", "{\"q\": \"x\"}", "@</s>"},
       {"Sure.", "", {{"", "get_weather", "{\"city\": \"Paris\"}"}, {"", "web_search", "{\"q\": \"x\"}"}}}},
      {"call_v11_id", {"@[TOOL_CALLS]", "f", "@[CALL_ID]", "abcDEF123", "@[ARGS]", "{}", "@</s>"},
       {"", "", {{"abcDEF123", "f", "{}"}}}},
      {"calls_json_form", {"@[TOOL_CALLS]", "[{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", "
                                            "\"arguments\": {}, \"id\": \"Q1w2E3r4T\"}]", "@</s>"},
       {"", "", {{"", "f", "{\"a\": 1}"}, {"Q1w2E3r4T", "g", "{}"}}}},
      {"think_then_call", {"@[THINK]", "need tool", "@[/THINK]", "@[TOOL_CALLS]", "f", "@[ARGS]", "{\"a\": \"é🍕\"}"},
       {"", "need tool", {{"", "f", "{\"a\": \"é🍕\"}"}}}},
      {"plain", {"Plain answer with 🍕 and 日本語, no markers."}, {"Plain answer with 🍕 and 日本語, no markers.", "", {}}},
      {"unclosed_think", {"@[THINK]", "still thinking… 🤔"}, {"", "still thinking… 🤔", {}}},
      {"after_eos_ignored", {"done", "@</s>", "garbage"}, {"done", "", {}}},
  };
}

ParsedOutput strip_generated_ids(ParsedOutput o, const ParsedOutput& want) {
  for (size_t i = 0; i < o.tool_calls.size() && i < want.tool_calls.size(); ++i)
    if (want.tool_calls[i].id.empty()) {
      EXPECT_EQ(o.tool_calls[i].id.size(), 9u);
      o.tool_calls[i].id.clear();
    }
  return o;
}

OutputParserOptions opts() {
  OutputParserOptions o;
  o.id_seed = 42;
  return o;
}

ParsedOutput stream_ids(std::shared_ptr<const Tokenizer> tok, const std::vector<int32_t>& ids,
                        const std::vector<size_t>& cuts) {
  OutputParser p(tok, opts());
  ParsedOutput out;
  size_t prev = 0;
  for (size_t c : cuts) {
    out.add(p.push(std::span<const int32_t>(ids).subspan(prev, c - prev)));
    prev = c;
  }
  out.add(p.push(std::span<const int32_t>(ids).subspan(prev)));
  out.add(p.finish());
  return out;
}

ParsedOutput stream_text(const std::string& text, const std::vector<size_t>& cuts) {
  TextOutputParser p(opts());
  ParsedOutput out;
  size_t prev = 0;
  for (size_t c : cuts) {
    out.add(p.push(std::string_view(text).substr(prev, c - prev)));
    prev = c;
  }
  out.add(p.push(std::string_view(text).substr(prev)));
  out.add(p.finish());
  return out;
}

// Every one- and two-cut chunking and the one-unit-per-chunk chunking of [0, n).
std::vector<std::vector<size_t>> cut_sets(size_t n, bool exhaustive) {
  std::vector<std::vector<size_t>> out;
  if (exhaustive) {
    for (uint32_t mask = 0; mask < (1u << (n - 1)); ++mask) {
      std::vector<size_t> c;
      for (size_t i = 1; i < n; ++i)
        if (mask & (1u << (i - 1))) c.push_back(i);
      out.push_back(std::move(c));
    }
    return out;
  }
  for (size_t a = 1; a < n; ++a) {
    out.push_back({a});
    for (size_t b = a + 1; b < n; ++b) out.push_back({a, b});
  }
  std::vector<size_t> all;
  for (size_t i = 1; i < n; ++i) all.push_back(i);
  out.push_back(all);
  return out;
}

TEST(OutputParser, KnownAnswersTokensAndText) {
  auto tok = test::real_tekken_v13();
  ASSERT_NE(tok, nullptr);
  for (const auto& s : samples()) {
    auto ids = build(*tok, s.parts);
    EXPECT_EQ(strip_generated_ids(parse_output(tok, ids, opts()), s.want), s.want) << s.name;
    std::string text = tok->decode(ids, /*skip_special=*/false);
    EXPECT_EQ(strip_generated_ids(parse_output_text(text, opts()), s.want), s.want) << s.name << ": " << text;
  }
}

TEST(OutputParser, StreamingEqualsWholeForEveryChunking) {
  auto tok = test::real_tekken_v13();
  ASSERT_NE(tok, nullptr);
  size_t runs = 0;
  for (const auto& s : samples()) {
    auto ids = build(*tok, s.parts);
    const ParsedOutput whole = parse_output(tok, ids, opts());
    for (const auto& cuts : cut_sets(ids.size(), ids.size() <= 16)) {
      ASSERT_EQ(stream_ids(tok, ids, cuts), whole) << s.name << " cuts " << cuts.size();
      ++runs;
    }
    std::string text = tok->decode(ids, false);
    const ParsedOutput whole_text = parse_output_text(text, opts());
    EXPECT_EQ(whole_text, whole) << s.name;
    for (const auto& cuts : cut_sets(text.size(), false)) {
      ASSERT_EQ(stream_text(text, cuts), whole_text) << s.name << " first cut " << cuts[0];
      ++runs;
    }
  }
  EXPECT_GT(runs, 10000u);
}

TEST(OutputParser, DeltasNeverSplitCharacters) {
  auto tok = test::real_tekken_v13();
  ASSERT_NE(tok, nullptr);
  auto ids = build(*tok, {"@[THINK]", "日本🍕", "@[/THINK]", "é🤔ü"});
  OutputParser p(tok, opts());
  for (int32_t id : ids) {
    ParsedDelta d = p.push(std::span<const int32_t>(&id, 1));
    EXPECT_TRUE(utf8::is_valid(d.content));
    EXPECT_TRUE(utf8::is_valid(d.reasoning));
  }
  // Text split inside a four-byte emoji.
  TextOutputParser tp(opts());
  ParsedDelta a = tp.push("ok \xF0\x9F");
  ParsedDelta b = tp.push("\x8D\x95");
  EXPECT_EQ(a.content, "ok ");
  EXPECT_EQ(b.content, "🍕");
}

TEST(OutputParser, LiteralMarkerTextIsContentAtTokenLevel) {
  // "[THINK]" typed as ordinary text is not the special token: the token parser keeps it.
  auto tok = test::real_tekken_v13();
  ASSERT_NE(tok, nullptr);
  auto ids = tok->encode("use [THINK] tags");
  EXPECT_EQ(parse_output(tok, ids, opts()).content, "use [THINK] tags");
}

TEST(OutputParser, Options) {
  auto tok = test::real_tekken_v13();
  ASSERT_NE(tok, nullptr);
  OutputParserOptions o = opts();
  o.starts_in_reasoning = true;  // the prompt opened [THINK]
  auto ids = build(*tok, {"thinking", "@[/THINK]", "answer"});
  auto r = parse_output(tok, ids, o);
  EXPECT_EQ(r.reasoning, "thinking");
  EXPECT_EQ(r.content, "answer");
  o = opts();
  o.parse_reasoning = false;
  r = parse_output(tok, build(*tok, {"@[THINK]", "a", "@[/THINK]", "b"}), o);
  EXPECT_EQ(r.content, "ab");
  EXPECT_EQ(r.reasoning, "");
  // A malformed JSON-form call stays visible as content.
  r = parse_output_text("[TOOL_CALLS][{\"name\": broken", opts());
  EXPECT_EQ(r.content, "[{\"name\": broken");
  EXPECT_TRUE(r.tool_calls.empty());
}

}  // namespace
}  // namespace ml4
