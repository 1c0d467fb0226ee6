// `ml4 tokenizer train` output: deterministic, the exact size asked for, loadable by
// mistral-common, and encoded identically by it (trained_golden.json holds mistral-common's
// ids on the two committed trained files; tools/tokenizer/make_goldens.py --ml4).
#include "test_util.h"
#include "tokenizer/base64.h"
#include "tokenizer/chat.h"
#include "tokenizer/trainer.h"

namespace ml4 {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(Trainer, ReproducesCommittedFilesAndMatchesMistralCommon) {
  auto g = test::read_golden("trained_golden.json");
  const std::string corpus = read_file(test::golden_path("train_corpus.txt"));
  ASSERT_FALSE(corpus.empty());
  for (const auto& c : g["cases"]) {
    const std::string file = c["file"].get<std::string>();
    TekkenTrainOptions o;
    for (const auto& t : g["trained"])
      if (t["file"] == file) {
        o.vocab_size = t["vocab_size"].get<int>();
        o.num_special_tokens = t["num_special"].get<int>();
        o.version = t["version"].get<std::string>();
      }
    auto doc = train_tekken_json(corpus, o);
    ASSERT_TRUE(doc.ok()) << doc.status().message();
    EXPECT_EQ(doc.value(), read_file(test::golden_path(file))) << file << " is not reproduced byte for byte";
    auto tok = Tokenizer::load(test::golden_path(file));
    ASSERT_TRUE(tok.ok()) << tok.status().message();
    EXPECT_EQ(tok.value()->vocab_size(), o.vocab_size);
    for (const auto& e : c["encode"]) {
      std::string bytes;
      ASSERT_TRUE(base64_decode(e["bytes_b64"].get<std::string>(), bytes));
      EXPECT_EQ(tok.value()->encode(bytes), e["ids"].get<std::vector<int32_t>>()) << file << " " << e["name"];
    }
    ASSERT_FALSE(c["chat"].empty());
    for (const auto& ch : c["chat"]) {
      auto ids = encode_chat(*tok.value(), ch["request"]);
      ASSERT_TRUE(ids.ok()) << file << " " << ch["name"] << ": " << ids.status().message();
      EXPECT_EQ(ids.value(), ch["ids"].get<std::vector<int32_t>>()) << file << " " << ch["name"];
    }
  }
}

TEST(Trainer, KnownMerges) {
  // "aaabdaaabac" is one pre-split piece. Pair counts: aa 4, ab 2, ... -> merge "aa" first;
  // then "aa"+"a" and "a"+"b" both count 2 and the tie goes to the smaller bytes "aaa".
  TekkenTrainOptions o;
  o.num_special_tokens = 36;
  o.vocab_size = 36 + 256 + 2;
  auto doc = train_tekken_json("aaabdaaabac", o);
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  auto j = nlohmann::json::parse(doc.value());
  ASSERT_EQ(j["vocab"].size(), 258u);
  std::string t256, t257;
  ASSERT_TRUE(base64_decode(j["vocab"][256]["token_bytes"].get<std::string>(), t256));
  ASSERT_TRUE(base64_decode(j["vocab"][257]["token_bytes"].get<std::string>(), t257));
  EXPECT_EQ(t256, "aa");
  EXPECT_EQ(t257, "aaa");
  auto tok = Tokenizer::from_json(j);
  ASSERT_TRUE(tok.ok());
  // "aaab" -> "aaa" + "b": ids are rank + num_special.
  EXPECT_EQ(tok.value()->encode("aaab"), (std::vector<int32_t>{36 + 257, 36 + 'b'}));
}

TEST(Trainer, PadsWhenCorpusRunsOutAndByteLevel) {
  TekkenTrainOptions o;
  o.vocab_size = 512;
  o.num_special_tokens = 100;
  auto doc = train_tekken_json("ab", o);
  ASSERT_TRUE(doc.ok());
  auto tok = Tokenizer::from_json(nlohmann::json::parse(doc.value()));
  ASSERT_TRUE(tok.ok()) << tok.status().message();
  EXPECT_EQ(tok.value()->vocab_size(), 512);
  EXPECT_EQ(tok.value()->encode("abc"), (std::vector<int32_t>{100 + 256, 100 + 'c'}));

  auto bl = Tokenizer::from_json(nlohmann::json::parse(byte_level_tekken_json(1000)));
  ASSERT_TRUE(bl.ok());
  EXPECT_EQ(bl.value()->vocab_size(), 1256);
  EXPECT_EQ(bl.value()->special_id("[THINK]"), 34);
  EXPECT_EQ(bl.value()->encode("hé"), (std::vector<int32_t>{1000 + 'h', 1000 + 0xC3, 1000 + 0xA9}));
  auto v15 = Tokenizer::from_json(nlohmann::json::parse(byte_level_tekken_json(512 - 256, "v15")));
  ASSERT_TRUE(v15.ok()) << v15.status().message();
  EXPECT_EQ(v15.value()->vocab_size(), 512);
  EXPECT_EQ(v15.value()->special_id("[/MODEL_SETTINGS]"), 37);
  auto tiny = Tokenizer::from_json(nlohmann::json::parse(byte_level_tekken_json(3, "v15")));
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny.value()->num_special_tokens(), 38);
}

TEST(Trainer, BadOptionsGiveErrors) {
  TekkenTrainOptions o;
  o.vocab_size = 300;  // 300 - 100 special < 256 bytes
  EXPECT_FALSE(train_tekken_json("x", o).ok());
  o.vocab_size = 1000;
  o.num_special_tokens = 10;  // fewer than the named v13 tokens
  EXPECT_FALSE(train_tekken_json("x", o).ok());
  o.num_special_tokens = 100;
  o.version = "v4";
  EXPECT_FALSE(train_tekken_json("x", o).ok());
}

}  // namespace
}  // namespace ml4
