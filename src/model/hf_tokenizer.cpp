// tekken.json -> tokenizer.json / tokenizer_config.json: see hf_tokenizer.h.
#include "model/hf_tokenizer.h"

#include <array>
#include <limits>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace ml4 {
namespace {

using ojson = nlohmann::ordered_json;

// mistral-common Tekkenizer.DEPRECATED_SPECIAL_TOKENS (files before v7 carry no list).
constexpr const char* kDeprecatedSpecials[] = {
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]"};

bool base64_decode(const std::string& in, std::string& out) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const int v = val(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return true;
}

// GPT-2 bytes_to_unicode: each byte to one printable code point, as UTF-8.
const std::array<std::string, 256>& byte_symbols() {
  static const std::array<std::string, 256> table = [] {
    std::array<int, 256> cp{};
    std::array<bool, 256> direct{};
    for (int b = '!'; b <= '~'; ++b) direct[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) cp[b] = direct[b] ? b : 256 + n++;
    std::array<std::string, 256> t;
    for (int b = 0; b < 256; ++b) {
      const int c = cp[b];
      std::string s;
      if (c < 0x80) {
        s.push_back(static_cast<char>(c));
      } else {
        s.push_back(static_cast<char>(0xC0 | (c >> 6)));
        s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      }
      t[b] = s;
    }
    return t;
  }();
  return table;
}

std::string to_symbols(const std::string& bytes) {
  std::string s;
  for (unsigned char b : bytes) s += byte_symbols()[b];
  return s;
}

// tiktoken's _byte_pair_merge restricted to ranks < max_rank: the parts `token` ends in.
std::vector<std::string> bpe_parts(const std::unordered_map<std::string, int64_t>& ranks, const std::string& token,
                                   int64_t max_rank) {
  std::vector<std::string> parts;
  for (char c : token) parts.emplace_back(1, c);
  for (;;) {
    int64_t best = std::numeric_limits<int64_t>::max();
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = ranks.find(parts[i] + parts[i + 1]);
      if (it != ranks.end() && it->second < max_rank && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == std::numeric_limits<int64_t>::max()) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  return parts;
}

Result<int64_t> get_int(const ojson& o, const char* key) {
  if (!o.contains(key) || !o[key].is_number_integer()) return invalid_argument("tekken config.{} missing or not an integer", key);
  return o[key].get<int64_t>();
}

}  // namespace

Result<HfTokenizerFiles> hf_tokenizer_from_tekken(const std::string& tekken_json, int64_t model_max_length) {
  const ojson doc = ojson::parse(tekken_json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return invalid_argument("tekken.json is not a JSON object");
  if (!doc.contains("config") || !doc["config"].is_object()) return invalid_argument("tekken.json: \"config\" missing");
  const ojson& cfg = doc["config"];
  if (!cfg.contains("pattern") || !cfg["pattern"].is_string()) return invalid_argument("tekken.json: config.pattern missing");
  ML4_ASSIGN_OR_RETURN(const int64_t vocab_size, get_int(cfg, "default_vocab_size"));
  ML4_ASSIGN_OR_RETURN(const int64_t num_special, get_int(cfg, "default_num_special_tokens"));
  if (num_special < 0 || vocab_size <= num_special + 255)
    return invalid_argument("tekken.json: default_vocab_size {} leaves fewer than 256 regular tokens after {} special",
                            vocab_size, num_special);
  const int64_t inner = vocab_size - num_special;
  if (!doc.contains("vocab") || !doc["vocab"].is_array() || static_cast<int64_t>(doc["vocab"].size()) < inner)
    return invalid_argument("tekken.json: vocab holds fewer than the {} regular tokens the config asks for", inner);

  // Special tokens at ids [0, num_special).
  std::vector<std::string> specials(static_cast<size_t>(num_special));
  if (doc.contains("special_tokens") && doc["special_tokens"].is_array()) {
    for (const auto& s : doc["special_tokens"]) {
      if (!s.is_object() || !s.contains("rank") || !s["rank"].is_number_integer() || !s.contains("token_str") ||
          !s["token_str"].is_string())
        return invalid_argument("tekken.json: special_tokens entries need an integer rank and a token_str");
      const int64_t r = s["rank"].get<int64_t>();
      if (r < 0 || r >= num_special) return invalid_argument("tekken.json: special token rank {} out of range", r);
      specials[r] = s["token_str"].get<std::string>();
    }
  } else {
    for (int64_t i = 0; i < num_special && i < static_cast<int64_t>(std::size(kDeprecatedSpecials)); ++i)
      specials[i] = kDeprecatedSpecials[i];
  }
  for (int64_t i = 0; i < num_special; ++i)
    if (specials[i].empty()) specials[i] = fmt::format("<SPECIAL_{}>", i);

  // Regular tokens (cut to `inner` ranks, as Tekkenizer does) and their merges.
  std::vector<std::string> bytes(static_cast<size_t>(inner));
  std::unordered_map<std::string, int64_t> ranks;
  ranks.reserve(static_cast<size_t>(inner) * 2);
  for (int64_t r = 0; r < inner; ++r) {
    const auto& e = doc["vocab"][r];
    if (!e.is_object() || !e.contains("token_bytes") || !e["token_bytes"].is_string() ||
        !base64_decode(e["token_bytes"].get<std::string>(), bytes[r]) || bytes[r].empty())
      return invalid_argument("tekken.json: vocab[{}] has no valid token_bytes", r);
    if (!ranks.emplace(bytes[r], r).second) return invalid_argument("tekken.json: vocab[{}] repeats a token", r);
  }
  ojson vocab = ojson::object();
  std::unordered_map<std::string, int64_t> used;
  for (int64_t i = 0; i < num_special; ++i) {
    vocab[specials[i]] = i;
    used.emplace(specials[i], i);
  }
  ojson merges = ojson::array();
  for (int64_t r = 0; r < inner; ++r) {
    const std::string sym = to_symbols(bytes[r]);
    // A regular token spelled like a special name keeps the special's entry in `vocab`;
    // its id stays reachable through merges (never happens with Mistral's files).
    if (!used.count(sym)) {
      vocab[sym] = r + num_special;
      used.emplace(sym, r + num_special);
    }
    if (bytes[r].size() < 2) continue;
    // A token that is not the merge of two lower-ranked ones gets no merge (as in
    // transformers' converter); with ignore_merges it is still found as a whole pre-token.
    const std::vector<std::string> parts = bpe_parts(ranks, bytes[r], r);
    if (parts.size() == 2) merges.push_back(to_symbols(parts[0]) + " " + to_symbols(parts[1]));
  }

  auto find_special = [&](const char* name) -> std::string {
    for (const auto& s : specials)
      if (s == name) return s;
    return "";
  };
  const std::string bos = find_special("<s>"), eos = find_special("</s>"), unk = find_special("<unk>"),
                    pad = find_special("<pad>");

  ojson added = ojson::array();
  for (int64_t i = 0; i < num_special; ++i)
    added.push_back({{"id", i}, {"content", specials[i]}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  ojson post = nullptr;
  if (!bos.empty()) {
    const int64_t bos_id = used.at(bos);
    post = {{"type", "TemplateProcessing"},
            {"single", {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"pair",
             {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
              {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
              {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
            {"special_tokens", {{bos, {{"id", bos}, {"ids", {bos_id}}, {"tokens", {bos}}}}}}};
  }
  ojson tok = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", cfg["pattern"]}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}}},
      {"post_processor", post},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", true},
        {"vocab", vocab},
        {"merges", merges}}}};
  ojson tc = {{"tokenizer_class", "PreTrainedTokenizerFast"},
              {"model_max_length", model_max_length},
              {"clean_up_tokenization_spaces", false},
              {"add_bos_token", !bos.empty()},
              {"add_eos_token", false}};
  if (!bos.empty()) tc["bos_token"] = bos;
  if (!eos.empty()) tc["eos_token"] = eos;
  if (!unk.empty()) tc["unk_token"] = unk;
  if (!pad.empty()) tc["pad_token"] = pad;
  HfTokenizerFiles out;
  out.tokenizer_json = tok.dump(1) + "\n";
  out.tokenizer_config_json = tc.dump(2) + "\n";
  out.merges = static_cast<int64_t>(merges.size());
  return out;
}

}  // namespace ml4
