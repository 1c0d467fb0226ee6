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

}  // namespace ml4::test
