// Chat encoding against mistral-common's encode_chat_completion (goldens made by
// tools/tokenizer/make_goldens.py). The tokenizer variants v7/v11/v13/v15 are the real
// tekken_240911 vocabulary with the special tokens and settings recorded in the golden,
// rebuilt here in memory exactly as the script built them. Ids compare exactly.
#include <map>

#include "test_util.h"
#include "tokenizer/chat.h"
#include "tokenizer/python_json.h"

namespace ml4 {
namespace {

const nlohmann::ordered_json& chat_golden() {
  static const nlohmann::ordered_json g = test::read_golden("chat_golden.json");
  return g;
}

std::shared_ptr<const Tokenizer> variant(const std::string& name) {
  static std::map<std::string, std::shared_ptr<const Tokenizer>> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  const auto& v = chat_golden()["variants"][name];
  nlohmann::json doc = test::real_tekken_doc();
  doc["config"]["version"] = v["version"].get<std::string>();
  doc["special_tokens"] = nlohmann::json::parse(v["special_tokens"].dump());
  doc["image"] = nlohmann::json::parse(v["image"].dump());
  if (v.contains("model_settings_builder"))
    doc["model_settings_builder"] = nlohmann::json::parse(v["model_settings_builder"].dump());
  auto r = Tokenizer::from_json(doc, "tekken_" + name);
  EXPECT_TRUE(r.ok()) << r.status().message();
  auto tok = r.ok() ? r.value() : nullptr;
  cache[name] = tok;
  return tok;
}

TEST(Chat, MatchesMistralCommonAcrossVersions) {
  ChatOptions exact;
  exact.rewrite_tool_call_ids = false;  // mistral-common refuses ids that are not 9 alphanumerics
  int checked = 0, refused = 0;
  for (const auto& c : chat_golden()["cases"]) {
    auto tok = variant(c["variant"].get<std::string>());
    ASSERT_NE(tok, nullptr);
    std::string label = c["name"].get<std::string>() + " @" + c["variant"].get<std::string>();
    auto r = encode_chat(*tok, c["request"], exact);
    if (c.contains("error")) {
      EXPECT_FALSE(r.ok()) << label << " should be refused like mistral-common: " << c["error"];
      ++refused;
      continue;
    }
    ASSERT_TRUE(r.ok()) << label << ": " << r.status().message();
    EXPECT_EQ(r.value(), c["ids"].get<std::vector<int32_t>>()) << label << "\n got: "
                                                               << tok->decode(r.value(), false);
    ++checked;
  }
  EXPECT_GT(checked, 80);
  EXPECT_GT(refused, 10);
}

TEST(Chat, RewritesNonConformingToolCallIdsConsistently) {
  auto tok = variant("v11");
  ASSERT_NE(tok, nullptr);
  auto req = nlohmann::ordered_json::parse(R"({"messages": [
    {"role": "user", "content": "go"},
    {"role": "assistant", "tool_calls": [{"id": "call_Xy-1", "type": "function",
      "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_Xy-1", "content": "ok"}]})");
  auto r = encode_chat_full(*tok, req);
  ASSERT_TRUE(r.ok()) << r.status().message();
  std::string text = tok->decode(r->ids, false);
  // The id appears twice (call and result), rewritten to the same 9 alphanumerics.
  size_t a = text.find("[CALL_ID]"), b = text.find("[TOOL_RESULTS]");
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(b, std::string::npos);
  std::string id1 = text.substr(a + 9, 9), id2 = text.substr(b + 14, 9);
  EXPECT_EQ(id1, id2);
  EXPECT_TRUE(is_valid_tool_call_id(id1)) << id1;
  ChatOptions exact;
  exact.rewrite_tool_call_ids = false;
  EXPECT_FALSE(encode_chat(*tok, req, exact).ok());
}

TEST(Chat, ReportsImagesAndPrefix) {
  for (const auto& c : chat_golden()["cases"]) {
    if (c["name"] != "image_two_sizes" || c["variant"] != "v13") continue;
    auto tok = variant("v13");
    auto r = encode_chat_full(*tok, c["request"]);
    ASSERT_TRUE(r.ok()) << r.status().message();
    ASSERT_EQ(r->images.size(), 2u);
    // 2048x600 scaled by 1024/2048 -> 1024x300 -> 32x10 tokens of 32 px (patch 16, merge 2).
    EXPECT_EQ(r->images[0].width, 2048);
    EXPECT_EQ(r->images[0].tokens_wide, 32);
    EXPECT_EQ(r->images[0].tokens_high, 10);
    EXPECT_EQ(r->ids[r->images[0].first_token], *tok->special_id("[IMG]"));
    EXPECT_FALSE(r->ends_with_prefix);
  }
}

TEST(Chat, BadRequestsGiveErrors) {
  auto tok = variant("v13");
  ASSERT_NE(tok, nullptr);
  for (const char* bad : {R"([])", R"({"messages": []})", R"({"messages": [{"role": "wizard", "content": "x"}]})",
                          R"({"messages": [{"role": "user"}]})",
                          R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]}]})",
                          R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "https://example.com/x.png"}]}]})",
                          R"({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": "AAAA"}]}]})",
                          R"({"messages": [{"role": "user", "content": 5}]})"}) {
    auto r = encode_chat(*tok, nlohmann::ordered_json::parse(bad));
    EXPECT_FALSE(r.ok()) << bad;
  }
  auto v3 = test::real_tekken();  // the shipped file is v3: chat needs v7+
  EXPECT_FALSE(encode_chat(*v3, nlohmann::ordered_json::parse(R"({"messages": [{"role": "user", "content": "x"}]})")).ok());
}

TEST(PythonJson, MatchesJsonDumps) {
  // Expected strings are CPython 3.11 json.dumps(..., ensure_ascii=False).
  EXPECT_EQ(python_float_repr(1e-05), "1e-05");
  EXPECT_EQ(python_float_repr(100.0), "100.0");
  EXPECT_EQ(python_float_repr(1e16), "1e+16");
  EXPECT_EQ(python_float_repr(1e15), "1000000000000000.0");
  EXPECT_EQ(python_float_repr(0.1), "0.1");
  EXPECT_EQ(python_float_repr(-0.0), "-0.0");
  EXPECT_EQ(python_float_repr(123.456), "123.456");
  EXPECT_EQ(python_float_repr(0.0001), "0.0001");
  EXPECT_EQ(python_float_repr(1.5e300), "1.5e+300");
  auto j = nlohmann::ordered_json::parse(R"({"b": [1, 2.5, true, null], "a": "é\n\u0001\"\\", "c": {}})");
  EXPECT_EQ(python_json_dumps(j), "{\"b\": [1, 2.5, true, null], \"a\": \"é\\n\\u0001\\\"\\\\\", \"c\": {}}");
}

}  // namespace
}  // namespace ml4
