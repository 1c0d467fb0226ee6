// Shared helpers for the tokenizer tests: golden paths and one loaded real tekken file.
#pragma once

#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace ml4::test {

inline std::string golden_path(const std::string& name) {
  return std::string(ML4_SOURCE_DIR) + "/tests/golden/tokenizer/" + name;
}

inline nlohmann::ordered_json read_golden(const std::string& name) {
  std::ifstream f(golden_path(name), std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::ordered_json::parse(ss.str());
}

// The tekken.json shipped in the mistral-common wheel (tests/golden/tokenizer/MANIFEST.json).
inline const nlohmann::json& real_tekken_doc() {
  static const nlohmann::json doc = [] {
    std::ifstream f(golden_path("tekken_240911.json"), std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return nlohmann::json::parse(ss.str());
  }();
  return doc;
}

inline std::shared_ptr<const Tokenizer> real_tekken() {
  static const std::shared_ptr<const Tokenizer> tok = [] {
    auto r = Tokenizer::from_json(real_tekken_doc(), "tekken_240911");
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? r.value() : nullptr;
  }();
  return tok;
}

// The real vocabulary as a v13 tokenizer with the think and tool-call special tokens at the
// ranks real v13 files use ([ARGS]=32, [CALL_ID]=33, [THINK]=34, [/THINK]=35).
inline std::shared_ptr<const Tokenizer> real_tekken_v13() {
  static const std::shared_ptr<const Tokenizer> tok = [] {
    static const char* kNames[] = {"<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
                                   "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                                   "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"};
    nlohmann::json doc = real_tekken_doc();
    doc["config"]["version"] = "v13";
    nlohmann::json st = nlohmann::json::array();
    auto add = [&](const std::string& n) {
      st.push_back({{"rank", st.size()}, {"token_str", n}, {"is_control", true}});
    };
    for (const char* n : kNames) add(n);
    for (int i = 20; i < 32; ++i) add("<SPECIAL_" + std::to_string(i) + ">");
    for (const char* n : {"[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"}) add(n);
    doc["special_tokens"] = st;
    auto r = Tokenizer::from_json(doc, "tekken_v13");
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? r.value() : nullptr;
  }();
  return tok;
}

}  // namespace ml4::test
