// Robustness: random bytes, random ids and mangled requests never crash, and the
// invariants that do not need a reference hold (round trip, valid UTF-8 out, ids in range).
// Fixed seeds; sizes keep the binary at a few hundred milliseconds.
#include <chrono>
#include <random>

#include "test_util.h"
#include "tokenizer/chat.h"
#include "tokenizer/output_parser.h"
#include "tokenizer/utf8.h"

namespace ml4 {
namespace {

TEST(Fuzz, RandomBytesRoundTrip) {
  auto tok = test::real_tekken();
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(20261202);
  for (int k = 0; k < 300; ++k) {
    std::string s(rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng() % 4 == 0 ? rng() % 256 : 0x20 + rng() % 96);
    auto ids = tok->encode(s);
    for (int32_t id : ids) ASSERT_TRUE(id >= tok->num_special_tokens() && id < tok->vocab_size());
    EXPECT_EQ(tok->decode(ids), utf8::sanitize(s));
  }
}

TEST(Fuzz, HugeWhitespaceRunIsLinearish) {
  // One 200,000-byte piece: the heap merge keeps this well under a second (the quadratic
  // scan would take minutes).
  auto tok = test::real_tekken();
  ASSERT_NE(tok, nullptr);
  std::string s = "a" + std::string(200000, ' ') + "b";
  auto t0 = std::chrono::steady_clock::now();
  auto ids = tok->encode(s);
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(tok->decode(ids), s);
  EXPECT_LT(dt, 5.0);
}

TEST(Fuzz, RandomIdsThroughDecodersAndParsers) {
  auto tok = test::real_tekken_v13();
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(7);
  for (int k = 0; k < 200; ++k) {
    std::vector<int32_t> ids(rng() % 60);
    for (auto& id : ids) {
      int r = rng() % 10;
      id = r == 0 ? static_cast<int32_t>(rng() % 40) : r == 1 ? static_cast<int32_t>(rng()) - (1 << 30)
           : r < 5 ? 1000 + static_cast<int32_t>(rng() % 256) : static_cast<int32_t>(rng() % tok->vocab_size());
    }
    StreamDecoder sd(tok, false);
    std::string all;
    for (int32_t id : ids) all += sd.push(id);
    all += sd.flush();
    EXPECT_TRUE(utf8::is_valid(all));
    EXPECT_EQ(all, tok->decode(ids, false));
    OutputParserOptions o;
    o.id_seed = 1;
    ParsedOutput p = parse_output(tok, ids, o);
    EXPECT_TRUE(utf8::is_valid(p.content) && utf8::is_valid(p.reasoning));
    ParsedOutput t = parse_output_text(all, o);
    EXPECT_TRUE(utf8::is_valid(t.content) && utf8::is_valid(t.reasoning));
  }
}

TEST(Fuzz, MangledChatRequestsNeverCrash) {
  auto tok = test::real_tekken_v13();
  ASSERT_NE(tok, nullptr);
  const auto base = nlohmann::ordered_json::parse(R"({"messages": [
    {"role": "system", "content": "s"},
    {"role": "user", "content": [{"type": "text", "text": "u"}]},
    {"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": [
      {"id": "abcdefghi", "function": {"name": "f", "arguments": {"x": [1, 2.5]}}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "t"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})");
  ASSERT_TRUE(encode_chat(*tok, base).ok()) << encode_chat(*tok, base).status().message();
  const std::vector<nlohmann::ordered_json> junk = {nullptr, 1, -2.5, "x", true, nlohmann::ordered_json::array(),
                                                    nlohmann::ordered_json::object(), "[INST]", ""};
  std::mt19937 rng(3);
  int ok = 0, refused = 0;
  for (int k = 0; k < 400; ++k) {
    nlohmann::ordered_json req = base;
    // Replace one random node (found by a random walk) with junk.
    nlohmann::ordered_json* node = &req;
    for (int depth = 0; depth < 4 && (node->is_object() || node->is_array()) && !node->empty(); ++depth) {
      size_t i = rng() % node->size();
      if (node->is_array()) {
        node = &(*node)[i];
      } else {
        auto it = node->begin();
        std::advance(it, i);
        node = &it.value();
      }
    }
    *node = junk[rng() % junk.size()];
    auto r = encode_chat(*tok, req);
    (r.ok() ? ok : refused)++;
    if (r.ok()) {
      for (int32_t id : r.value()) ASSERT_TRUE(tok->is_valid_id(id));
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(ok, 0);
}

}  // namespace
}  // namespace ml4
