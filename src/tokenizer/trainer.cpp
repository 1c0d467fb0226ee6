// BPE trainer for tekken.json files (see trainer.h).
#include "tokenizer/trainer.h"

#include <algorithm>
#include <map>
#include <queue>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/base64.h"
#include "tokenizer/pretokenizer_regex.h"
#include "tokenizer/utf8.h"

namespace ml4 {

const char* const kTekkenPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

// Named special tokens per version at the ranks Mistral's files use; the rest are fillers.
Result<std::vector<std::string>> special_names(int n, const std::string& version) {
  std::vector<std::string> names = {"<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
                                    "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                                    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"};
  std::vector<std::string> extra;
  if (version == "v7") {
  } else if (version == "v11") {
    extra = {"[ARGS]", "[CALL_ID]"};
  } else if (version == "v13") {
    extra = {"[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"};
  } else if (version == "v15") {
    extra = {"[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]", "[MODEL_SETTINGS]", "[/MODEL_SETTINGS]"};
  } else {
    return invalid_argument("tokenizer version {} not supported for training (v7, v11, v13, v15)", version);
  }
  if (!extra.empty()) {
    for (int i = 20; i < 32; ++i) names.push_back(fmt::format("<SPECIAL_{}>", i));
    for (auto& e : extra) names.push_back(e);
  }
  if (n < static_cast<int>(names.size()))
    return invalid_argument("a {} tokenizer needs at least {} special tokens, got {}", version, names.size(), n);
  for (int i = static_cast<int>(names.size()); i < n; ++i) names.push_back(fmt::format("<SPECIAL_{}>", i));
  return names;
}

std::string make_doc(const std::vector<std::string>& tokens, int num_special, const std::string& version) {
  nlohmann::ordered_json vocab = nlohmann::ordered_json::array();
  for (size_t r = 0; r < tokens.size(); ++r) {
    nlohmann::ordered_json e;
    e["rank"] = r;
    e["token_bytes"] = base64_encode(tokens[r]);
    e["token_str"] = utf8::is_valid(tokens[r]) ? nlohmann::ordered_json(tokens[r]) : nlohmann::ordered_json(nullptr);
    vocab.push_back(std::move(e));
  }
  auto names = special_names(num_special, version).value();
  nlohmann::ordered_json specials = nlohmann::ordered_json::array();
  for (int i = 0; i < num_special; ++i) {
    nlohmann::ordered_json s;
    s["rank"] = i;
    s["token_str"] = names[i];
    s["is_control"] = true;
    specials.push_back(std::move(s));
  }
  nlohmann::ordered_json cfg;
  cfg["pattern"] = kTekkenPattern;
  cfg["num_vocab_tokens"] = tokens.size();
  cfg["default_vocab_size"] = static_cast<int>(tokens.size()) + num_special;
  cfg["default_num_special_tokens"] = num_special;
  cfg["version"] = version;
  nlohmann::ordered_json doc;
  doc["config"] = std::move(cfg);
  doc["vocab"] = std::move(vocab);
  doc["special_tokens"] = std::move(specials);
  if (version == "v15")  // reasoning on demand, as FIELD-NOTES describes for ML4
    doc["model_settings_builder"] = nlohmann::ordered_json::parse(
        R"({"reasoning_effort": {"type": "enum", "accepts_none": true, "default": "none", "values": ["none", "high"]}})");
  return doc.dump();
}

uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t(a) << 32) | b; }

}  // namespace

std::string byte_level_tekken_json(int num_special_tokens, const std::string& version_in) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  std::string version = special_names(1000, version_in).ok() ? version_in : "v13";
  // Too few ids for the version's named tokens: raise to the minimum (20, 34, 36 or 38).
  while (!special_names(num_special_tokens, version).ok()) ++num_special_tokens;
  return make_doc(tokens, num_special_tokens, version);
}

Result<std::string> train_tekken_json(std::string_view corpus_in, const TekkenTrainOptions& o) {
  ML4_RETURN_IF_ERROR(special_names(o.num_special_tokens, o.version).status());
  const int inner = o.vocab_size - o.num_special_tokens;
  if (inner < 256)
    return invalid_argument("vocab_size {} leaves {} regular tokens after {} special tokens; need at least 256",
                            o.vocab_size, inner, o.num_special_tokens);
  std::string corpus = utf8::sanitize(corpus_in);
  ML4_ASSIGN_OR_RETURN(auto re, PretokenizerRegex::compile(kTekkenPattern));

  // Unique pieces with their counts, in sorted order so training is deterministic.
  std::map<std::string, int64_t> piece_count;
  size_t pos = 0, b, e;
  while (pos < corpus.size() && re->find(corpus, pos, &b, &e)) {
    if (e == b) {
      pos = b + 1;
      continue;
    }
    ++piece_count[corpus.substr(b, e - b)];
    pos = e;
  }
  std::vector<std::vector<uint32_t>> words;
  std::vector<int64_t> freq;
  for (auto& [p, c] : piece_count) {
    std::vector<uint32_t> w(p.begin(), p.end());
    for (auto& s : w) s &= 0xFF;
    words.push_back(std::move(w));
    freq.push_back(c);
  }

  std::vector<std::string> tokens;
  for (int i = 0; i < 256; ++i) tokens.emplace_back(1, static_cast<char>(i));
  std::unordered_map<std::string, uint32_t> token_id;
  for (uint32_t i = 0; i < 256; ++i) token_id[tokens[i]] = i;

  std::unordered_map<uint64_t, int64_t> count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> where;
  auto add_word = [&](uint32_t wi, int64_t sign) {
    const auto& w = words[wi];
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      uint64_t k = pair_key(w[i], w[i + 1]);
      count[k] += sign * freq[wi];
      if (sign > 0) where[k].push_back(wi);
    }
  };
  for (uint32_t wi = 0; wi < words.size(); ++wi) add_word(wi, +1);

  // Max-heap on (count, then merged bytes ascending); stale entries are skipped on pop.
  struct Entry {
    int64_t count;
    uint64_t key;
    std::string merged;
  };
  auto worse = [](const Entry& x, const Entry& y) {
    if (x.count != y.count) return x.count < y.count;
    return x.merged > y.merged;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(worse)> heap(worse);
  auto push = [&](uint64_t k) {
    auto it = count.find(k);
    if (it == count.end() || it->second <= 0) return;
    heap.push({it->second, k, tokens[k >> 32] + tokens[k & 0xFFFFFFFF]});
  };
  for (auto& [k, c] : count) push(k);

  std::vector<uint32_t> stamp(words.size(), 0);
  uint32_t round = 0;
  while (static_cast<int>(tokens.size()) < inner && !heap.empty()) {
    Entry top = heap.top();
    heap.pop();
    auto it = count.find(top.key);
    if (it == count.end() || it->second != top.count) continue;  // stale
    const uint32_t a = top.key >> 32, bb = top.key & 0xFFFFFFFF;
    uint32_t c;
    auto existing = token_id.find(top.merged);
    if (existing != token_id.end()) {
      c = existing->second;  // (ab)c and a(bc) give the same bytes: reuse the token
    } else {
      c = static_cast<uint32_t>(tokens.size());
      tokens.push_back(top.merged);
      token_id.emplace(top.merged, c);
    }
    ++round;
    std::vector<uint64_t> touched;
    std::vector<uint32_t> list = std::move(where[top.key]);
    where.erase(top.key);
    for (uint32_t wi : list) {
      if (stamp[wi] == round) continue;
      stamp[wi] = round;
      auto& w = words[wi];
      bool has = false;
      for (size_t i = 0; i + 1 < w.size(); ++i)
        if (w[i] == a && w[i + 1] == bb) has = true;
      if (!has) continue;
      // Pairs that lose counts need fresh heap entries too, not just the new pairs.
      for (size_t i = 0; i + 1 < w.size(); ++i) touched.push_back(pair_key(w[i], w[i + 1]));
      add_word(wi, -1);
      std::vector<uint32_t> nw;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == a && w[i + 1] == bb) {
          nw.push_back(c);
          ++i;
        } else {
          nw.push_back(w[i]);
        }
      }
      w = std::move(nw);
      add_word(wi, +1);
      for (size_t i = 0; i + 1 < w.size(); ++i) touched.push_back(pair_key(w[i], w[i + 1]));
    }
    count.erase(top.key);
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (uint64_t k : touched) push(k);
  }
  // Corpus exhausted: unreachable fillers keep the vocabulary at the requested size.
  for (int i = 0; static_cast<int>(tokens.size()) < inner; ++i) tokens.push_back("\xFF" + std::to_string(i));
  return make_doc(tokens, o.num_special_tokens, o.version);
}

}  // namespace ml4
