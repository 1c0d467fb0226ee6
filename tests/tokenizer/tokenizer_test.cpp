// Tekken encoding and decoding against mistral-common's ids (goldens made by
// tools/tokenizer/make_goldens.py; versions in tests/golden/tokenizer/MANIFEST.json).
// Ids are integers: every comparison is exact.
#include <random>

#include "test_util.h"
#include "tokenizer/base64.h"
#include "tokenizer/utf8.h"

namespace ml4 {
namespace {

using test::read_golden;
using test::real_tekken;

TEST(Tokenizer, LoadsRealTekken) {
  auto tok = real_tekken();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 131072);
  EXPECT_EQ(tok->num_special_tokens(), 1000);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->special_id("[INST]"), 3);
  EXPECT_EQ(tok->special_id("<SPECIAL_999>"), 999);
  EXPECT_FALSE(tok->special_id("[THINK]").has_value());  // a v3 file has no think tokens
  EXPECT_TRUE(tok->is_special(999));
  EXPECT_FALSE(tok->is_special(1000));
  ASSERT_TRUE(tok->image_config().has_value());
  EXPECT_EQ(tok->image_config()->image_patch_size, 16);
}

TEST(Tokenizer, EncodeMatchesMistralCommon) {
  auto tok = real_tekken();
  ASSERT_NE(tok, nullptr);
  auto g = read_golden("encode_golden.json");
  ASSERT_GT(g["encode"].size(), 50u);
  for (const auto& c : g["encode"]) {
    std::string bytes;
    ASSERT_TRUE(base64_decode(c["bytes_b64"].get<std::string>(), bytes));
    std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok->encode(bytes), want) << "case " << c["name"];
  }
}

TEST(Tokenizer, DecodeMatchesMistralCommon) {
  auto tok = real_tekken();
  ASSERT_NE(tok, nullptr);
  auto g = read_golden("encode_golden.json");
  for (const auto& c : g["decode"]) {
    std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok->decode(ids, true), c["ignore"].get<std::string>());
    EXPECT_EQ(tok->decode(ids, false), c["keep"].get<std::string>());
  }
}

// Round trip: decoding the ids of valid UTF-8 text gives the text back.
TEST(Tokenizer, RoundTripsValidText) {
  auto tok = real_tekken();
  ASSERT_NE(tok, nullptr);
  auto g = read_golden("encode_golden.json");
  for (const auto& c : g["encode"]) {
    std::string bytes;
    ASSERT_TRUE(base64_decode(c["bytes_b64"].get<std::string>(), bytes));
    EXPECT_EQ(tok->decode(tok->encode(bytes)), utf8::sanitize(bytes)) << c["name"];
  }
}

// The concatenated stream equals the one-shot decode for every golden id sequence, with
// and without special tokens, and no chunk ever holds a broken character.
TEST(StreamDecoder, EqualsDecodeAndNeverSplitsCharacters) {
  auto tok = real_tekken();
  ASSERT_NE(tok, nullptr);
  auto g = read_golden("encode_golden.json");
  std::vector<std::vector<int32_t>> seqs;
  for (const auto& c : g["decode"]) seqs.push_back(c["ids"].get<std::vector<int32_t>>());
  for (const auto& c : g["encode"]) seqs.push_back(c["ids"].get<std::vector<int32_t>>());
  for (bool skip : {true, false}) {
    for (const auto& ids : seqs) {
      StreamDecoder sd(tok, skip);
      std::string all;
      for (int32_t id : ids) {
        std::string piece = sd.push(id);
        EXPECT_TRUE(utf8::is_valid(piece));
        all += piece;
      }
      all += sd.flush();
      EXPECT_EQ(all, tok->decode(ids, skip));
    }
  }
}

TEST(Tokenizer, SpecialTokensOnlyWhenAllowed) {
  auto tok = real_tekken();
  ASSERT_NE(tok, nullptr);
  const std::string text = "a[INST]b</s>";
  std::vector<int32_t> plain = tok->encode(text);
  for (int32_t id : plain) EXPECT_FALSE(tok->is_special(id));
  std::vector<int32_t> want = tok->encode("a");
  want.push_back(3);
  for (int32_t id : tok->encode("b")) want.push_back(id);
  want.push_back(2);
  EXPECT_EQ(tok->encode(text, /*allow_special=*/true), want);
  EXPECT_EQ(tok->decode(want, false), text);
}

TEST(Tokenizer, ToleratesIdsOutsideVocabulary) {
  auto tok = real_tekken();
  ASSERT_NE(tok, nullptr);
  std::vector<int32_t> ids = tok->encode("ok");
  ids.insert(ids.begin(), -5);
  ids.push_back(1 << 30);
  EXPECT_EQ(tok->decode(ids), "ok");
}

TEST(Utf8, MaximalSubpartReplacement) {
  // Expected strings are CPython's bytes.decode("utf-8", "replace").
  EXPECT_EQ(utf8::sanitize("\xe2\x82"), "\xEF\xBF\xBD");
  EXPECT_EQ(utf8::sanitize("\xed\xa0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8::sanitize("\xf0\x9f\x98x"), "\xEF\xBF\xBDx");
  EXPECT_EQ(utf8::sanitize("a\xc0\xaf" "b"), "a\xEF\xBF\xBD\xEF\xBF\xBD" "b");
  std::string out;
  EXPECT_EQ(utf8::decode_replace("ab\xf0\x9f", out, false), 2u);  // holds back a prefix
  EXPECT_EQ(out, "ab");
}

TEST(Tokenizer, BadFilesGiveErrors) {
  auto missing = Tokenizer::load("/nonexistent/tekken.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);

  nlohmann::json doc = {{"config", {{"pattern", "\\w+"}, {"default_vocab_size", 300},
                                    {"default_num_special_tokens", 10}, {"version", "v7"}}},
                        {"vocab", nlohmann::json::array()}};
  auto few = Tokenizer::from_json(doc);
  ASSERT_FALSE(few.ok());
  EXPECT_NE(few.status().message().find("regular tokens"), std::string::npos) << few.status().message();

  // Ranks 256..299 are the two-byte tokens "az", "bz", ...; rank 289 is made to repeat rank 288 below.
  for (int i = 0; i < 300; ++i) {
    std::string b = i < 256 ? std::string(1, char(i)) : std::string{char('0' + (i - 256)), 'z'};
    doc["vocab"].push_back({{"rank", i}, {"token_bytes", base64_encode(b)}, {"token_str", nullptr}});
  }
  doc["config"]["version"] = "v99";
  EXPECT_FALSE(Tokenizer::from_json(doc).ok());
  doc["config"]["version"] = "v13";  // v13 needs an explicit special token list
  EXPECT_FALSE(Tokenizer::from_json(doc).ok());
  doc["config"]["version"] = "v7";
  doc["config"]["pattern"] = "(unclosed";
  auto bad_re = Tokenizer::from_json(doc);
  ASSERT_FALSE(bad_re.ok());
  EXPECT_NE(bad_re.status().message().find("regex"), std::string::npos);
  doc["config"]["pattern"] = "\\w+";
  ASSERT_TRUE(Tokenizer::from_json(doc).ok()) << Tokenizer::from_json(doc).status().message();
  doc["vocab"][289]["token_bytes"] = doc["vocab"][288]["token_bytes"];  // 290 regular ranks
  auto dup = Tokenizer::from_json(doc);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("duplicate"), std::string::npos) << dup.status().message();
}

}  // namespace
}  // namespace ml4
