// tekken.json -> tokenizer.json (model/hf_tokenizer.h): the structure transformers and
// llama.cpp read, checked on the real tekken_240911.json and a trained vocabulary. The
// token-for-token parity with tekken is checked by tests/model/test_hf_tokenizer.py
// through transformers itself.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <set>

#include "model/hf_tokenizer.h"

namespace ml4 {
namespace {

using json = nlohmann::json;

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

struct Case {
  const char* file;
  int64_t vocab, specials;
};

TEST(HfTokenizer, ShippedTekkenFiles) {
  for (const Case c : {Case{"tekken_240911.json", 131072, 1000}, Case{"tekken_trained_v15_512.json", 512, -1}}) {
    SCOPED_TRACE(c.file);
    const std::string text = read_text(std::string(ML4_SOURCE_DIR) + "/tests/golden/tokenizer/" + c.file);
    ASSERT_FALSE(text.empty());
    const json tekken = json::parse(text);
    const int64_t S = tekken["config"]["default_num_special_tokens"].get<int64_t>();
    if (c.specials >= 0) EXPECT_EQ(S, c.specials);
    auto r = hf_tokenizer_from_tekken(text, 4096);
    ASSERT_TRUE(r.ok()) << r.status().message();
    const json tok = json::parse(r->tokenizer_json);
    const json& vocab = tok["model"]["vocab"];
    // Every id in [0, vocab) exactly once.
    std::set<int64_t> ids;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) ids.insert(it.value().get<int64_t>());
    EXPECT_EQ(static_cast<int64_t>(ids.size()), c.vocab);
    EXPECT_EQ(*ids.begin(), 0);
    EXPECT_EQ(*ids.rbegin(), c.vocab - 1);
    // Specials first, as added tokens; <s> = 1 and the BOS template.
    ASSERT_EQ(static_cast<int64_t>(tok["added_tokens"].size()), S);
    EXPECT_EQ(tok["added_tokens"][1]["content"], "<s>");
    EXPECT_EQ(vocab["<s>"], 1);
    EXPECT_EQ(tok["post_processor"]["special_tokens"]["<s>"]["ids"][0], 1);
    // Byte-level symbols: the 256 single bytes at ids S..S+255 (rank = byte), GPT-2 map.
    EXPECT_EQ(vocab["!"], S + '!');
    EXPECT_EQ(vocab["\xC4\xA0"], S + ' ');   // U+0120 'Ġ' is the space byte
    EXPECT_EQ(vocab["\xC4\x8A"], S + '\n');  // U+010A 'Ċ' is the newline byte
    EXPECT_EQ(vocab["\xC4\x80"], S + 0);     // U+0100 is byte 0
    // One merge per regular multi-byte token (all of Mistral's are two lower ranks).
    EXPECT_EQ(r->merges, c.vocab - S - 256);
    EXPECT_EQ(static_cast<int64_t>(tok["model"]["merges"].size()), r->merges);
    EXPECT_EQ(tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"], tekken["config"]["pattern"]);
    EXPECT_TRUE(tok["model"]["ignore_merges"].get<bool>());
    const json tc = json::parse(r->tokenizer_config_json);
    EXPECT_EQ(tc["tokenizer_class"], "PreTrainedTokenizerFast");
    EXPECT_EQ(tc["bos_token"], "<s>");
    EXPECT_EQ(tc["eos_token"], "</s>");
    EXPECT_EQ(tc["model_max_length"], 4096);
  }
}

TEST(HfTokenizer, BadTekkenIsAnError) {
  EXPECT_FALSE(hf_tokenizer_from_tekken("not json", 8).ok());
  EXPECT_FALSE(hf_tokenizer_from_tekken(R"({"config": {}})", 8).ok());
  const std::string no_vocab =
      R"({"config": {"pattern": "x", "default_vocab_size": 300, "default_num_special_tokens": 10}, "vocab": []})";
  auto r = hf_tokenizer_from_tekken(no_vocab, 8);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("fewer than"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace ml4
