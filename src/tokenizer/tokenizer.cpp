// Tekken tokenizer (see tokenizer.h for the design and the sources it follows).
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "tokenizer/base64.h"
#include "tokenizer/pretokenizer_regex.h"
#include "tokenizer/utf8.h"

namespace ml4 {
namespace {

// mistral-common Tekkenizer.DEPRECATED_SPECIAL_TOKENS: the special tokens of files from
// before v7 introduced an explicit "special_tokens" list.
constexpr const char* kDeprecatedSpecials[] = {
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]"};

// 64-bit mix over 8-byte words (wyhash-style folding); only needs to spread short keys.
inline uint64_t hash_bytes(const char* p, size_t n) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h = 0x243F6A8885A308D3ull ^ (n * kMul);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w ^ (static_cast<uint64_t>(n) << 56)) * kMul;
  }
  h ^= h >> 32;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  return h;
}

std::string escape_regex_literal(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::strchr("\\^$.|?*+()[]{}-/#", c) != nullptr && c != '\0') out += '\\';
    out += c;
  }
  return out;
}

Result<int> parse_version(const nlohmann::json& cfg) {
  if (!cfg.contains("version") || !cfg["version"].is_string())
    return invalid_argument("config.version missing (expected a string such as \"v13\")");
  std::string v = cfg["version"].get<std::string>();
  if (v.size() < 2 || v[0] != 'v') return invalid_argument("config.version \"{}\" is not of the form vN", v);
  int n = 0;
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i] < '0' || v[i] > '9') return invalid_argument("config.version \"{}\" is not of the form vN", v);
    n = n * 10 + (v[i] - '0');
  }
  static constexpr int kKnown[] = {1, 2, 3, 7, 11, 13, 15};
  if (std::find(std::begin(kKnown), std::end(kKnown), n) == std::end(kKnown))
    return invalid_argument("config.version \"{}\" is not a version mistral-common knows (v1 v2 v3 v7 v11 v13 v15)", v);
  return n;
}

Result<int64_t> get_int(const nlohmann::json& obj, const char* key, const char* where) {
  if (!obj.contains(key) || !obj[key].is_number_integer())
    return invalid_argument("{}.{} missing or not an integer", where, key);
  return obj[key].get<int64_t>();
}

}  // namespace

// Pieces that need byte-pair merging recur (Zipf): a small direct-mapped cache per thread
// keeps their ids. tiktoken has no such cache; it changes speed only, never the ids.
struct PieceCache {
  static constexpr size_t kSize = 1 << 13;
  struct Entry {
    uint64_t hash = 0;
    std::string piece;
    std::vector<int32_t> ids;
  };
  uint64_t owner = 0;
  std::vector<Entry> entries;
};

std::atomic<uint64_t> g_next_instance{1};

Tokenizer::Tokenizer() : instance_id_(g_next_instance.fetch_add(1)) {}
Tokenizer::~Tokenizer() = default;

Result<std::shared_ptr<const Tokenizer>> Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return not_found("tokenizer file {} cannot be opened", path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string text = ss.str();
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return invalid_argument("tokenizer file {}: not valid JSON", path);
  std::string name = path;
  if (auto slash = name.find_last_of('/'); slash != std::string::npos) name = name.substr(slash + 1);
  if (name.size() > 5 && name.ends_with(".json")) name.resize(name.size() - 5);
  auto r = from_json(doc, name);
  if (!r.ok()) return r.status().with_context("tokenizer file " + path);
  return r;
}

Result<std::shared_ptr<const Tokenizer>> Tokenizer::from_json(const nlohmann::json& doc, const std::string& name) {
  std::shared_ptr<Tokenizer> t(new Tokenizer());
  t->name_ = name;
  ML4_RETURN_IF_ERROR(t->init(doc));
  return std::shared_ptr<const Tokenizer>(std::move(t));
}

Status Tokenizer::init(const nlohmann::json& doc) {
  if (!doc.is_object()) return invalid_argument("tekken document is not a JSON object");
  if (!doc.contains("config") || !doc["config"].is_object()) return invalid_argument("\"config\" object missing");
  const auto& cfg = doc["config"];
  if (!cfg.contains("pattern") || !cfg["pattern"].is_string()) return invalid_argument("config.pattern missing");
  pattern_ = cfg["pattern"].get<std::string>();
  ML4_ASSIGN_OR_RETURN(version_, parse_version(cfg));
  ML4_ASSIGN_OR_RETURN(int64_t vocab_size, get_int(cfg, "default_vocab_size", "config"));
  ML4_ASSIGN_OR_RETURN(int64_t num_special, get_int(cfg, "default_num_special_tokens", "config"));
  if (!doc.contains("vocab") || !doc["vocab"].is_array()) return invalid_argument("\"vocab\" array missing");
  const auto& vocab = doc["vocab"];
  if (num_special < 0 || vocab_size <= num_special)
    return invalid_argument("config: default_vocab_size {} must exceed default_num_special_tokens {}", vocab_size,
                            num_special);
  const int64_t inner = vocab_size - num_special;
  if (inner < 256) return invalid_argument("config: {} regular tokens, need at least the 256 bytes", inner);
  if (static_cast<int64_t>(vocab.size()) < inner)
    return invalid_argument("config: default_vocab_size {} needs {} regular tokens but vocab has {}", vocab_size,
                            inner, vocab.size());
  vocab_size_ = static_cast<int>(vocab_size);
  num_special_ = static_cast<int>(num_special);

  // Special tokens: the file's list (v7+ files), else the 20 deprecated defaults; the rest
  // of [0, num_special) is filled with <SPECIAL_i>, as Tekkenizer.__init__ does.
  special_names_.assign(num_special_, std::string());
  if (doc.contains("special_tokens") && !doc["special_tokens"].is_null()) {
    const auto& st = doc["special_tokens"];
    if (!st.is_array()) return invalid_argument("\"special_tokens\" is not an array");
    for (const auto& s : st) {
      if (!s.is_object() || !s.contains("rank") || !s["rank"].is_number_integer() || !s.contains("token_str") ||
          !s["token_str"].is_string())
        return invalid_argument("special_tokens: each entry needs an integer rank and a token_str");
      int64_t r = s["rank"].get<int64_t>();
      if (r < 0 || r >= num_special_)
        return invalid_argument("special token {} has rank {} outside [0, {})", s["token_str"].get<std::string>(), r,
                                num_special_);
      if (!special_names_[r].empty()) return invalid_argument("special tokens: rank {} defined twice", r);
      special_names_[r] = s["token_str"].get<std::string>();
    }
  } else {
    if (version_ > 7) return invalid_argument("special_tokens missing; a v{} tekken file must list them", version_);
    int n = std::min<int>(num_special_, std::size(kDeprecatedSpecials));
    for (int i = 0; i < n; ++i) special_names_[i] = kDeprecatedSpecials[i];
  }
  std::unordered_map<std::string, int32_t> by_name;
  for (int i = 0; i < num_special_; ++i) {
    if (special_names_[i].empty()) special_names_[i] = fmt::format("<SPECIAL_{}>", i);
    if (!by_name.emplace(special_names_[i], i).second)
      return invalid_argument("special token {} is defined twice", special_names_[i]);
  }
  special_by_name_ = by_name;
  auto sid = [&](const char* n) { auto it = by_name.find(n); return it == by_name.end() ? -1 : it->second; };
  bos_id_ = sid("<s>");
  eos_id_ = sid("</s>");
  pad_id_ = sid("<pad>");
  unk_id_ = sid("<unk>");

  // Regular vocabulary, cut to `inner` ranks (_reload_mergeable_ranks).
  offsets_.assign(inner + 1, 0);
  arena_.clear();
  arena_.reserve(inner * 7);
  for (int64_t r = 0; r < inner; ++r) {
    const auto& e = vocab[r];
    if (!e.is_object() || !e.contains("rank") || !e["rank"].is_number_integer() || e["rank"].get<int64_t>() != r)
      return invalid_argument("vocab[{}]: rank must equal its index", r);
    if (!e.contains("token_bytes") || !e["token_bytes"].is_string())
      return invalid_argument("vocab[{}]: token_bytes missing", r);
    std::string bytes;
    if (!base64_decode(e["token_bytes"].get_ref<const std::string&>(), bytes))
      return invalid_argument("vocab[{}]: token_bytes is not valid base64", r);
    if (bytes.empty()) return invalid_argument("vocab[{}]: empty token", r);
    if (r < 256 && (bytes.size() != 1 || static_cast<unsigned char>(bytes[0]) != r))
      return invalid_argument("vocab[{}]: the first 256 ranks must be the single bytes in order", r);
    arena_ += bytes;
    offsets_[r + 1] = static_cast<uint32_t>(arena_.size());
  }
  size_t cap = 1;
  while (cap < static_cast<size_t>(inner) * 2) cap <<= 1;
  table_.assign(cap, Slot{});
  table_mask_ = cap - 1;
  for (int64_t r = 0; r < inner; ++r) {
    const char* p = arena_.data() + offsets_[r];
    size_t n = offsets_[r + 1] - offsets_[r];
    if (rank_of(p, n) >= 0) return invalid_argument("vocab[{}]: duplicate token bytes", r);
    uint64_t full = hash_bytes(p, n);
    uint64_t h = full & table_mask_;
    while (table_[h].rank1 != 0) h = (h + 1) & table_mask_;
    table_[h] = Slot{static_cast<uint32_t>(full >> 32), static_cast<uint32_t>(r + 1)};
  }

  ML4_ASSIGN_OR_RETURN(regex_, PretokenizerRegex::compile(pattern_));
  std::vector<std::string> names(special_names_.begin(), special_names_.end());
  std::sort(names.begin(), names.end(), [](auto& a, auto& b) { return a.size() > b.size(); });
  std::string alt;
  for (auto& n : names) {
    if (!alt.empty()) alt += '|';
    alt += escape_regex_literal(n);
  }
  ML4_ASSIGN_OR_RETURN(special_regex_, PretokenizerRegex::compile(alt, false));

  const nlohmann::json* img = nullptr;
  if (doc.contains("image") && doc["image"].is_object()) img = &doc["image"];
  else if (doc.contains("multimodal") && doc["multimodal"].is_object()) img = &doc["multimodal"];
  if (img) {
    ImageConfig ic;
    ML4_ASSIGN_OR_RETURN(int64_t ps, get_int(*img, "image_patch_size", "image"));
    ML4_ASSIGN_OR_RETURN(int64_t ms, get_int(*img, "max_image_size", "image"));
    ic.image_patch_size = static_cast<int>(ps);
    ic.max_image_size = static_cast<int>(ms);
    if (img->contains("spatial_merge_size")) {
      ML4_ASSIGN_OR_RETURN(int64_t sm, get_int(*img, "spatial_merge_size", "image"));
      ic.spatial_merge_size = static_cast<int>(sm);
    }
    if (ic.image_patch_size <= 0 || ic.max_image_size <= 0 || ic.spatial_merge_size <= 0)
      return invalid_argument("image: patch size, max image size and merge size must be positive");
    image_ = ic;
  }
  if (doc.contains("model_settings_builder") && !doc["model_settings_builder"].is_null()) {
    if (version_ < 15) return invalid_argument("model_settings_builder needs tokenizer v15 or later, file is v{}", version_);
    model_settings_builder_ = doc["model_settings_builder"];
  }
  return ok_status();
}

int32_t Tokenizer::rank_of(const char* p, size_t n) const { return rank_of_hashed(p, n, hash_bytes(p, n)); }

int32_t Tokenizer::rank_of_hashed(const char* p, size_t n, uint64_t full) const {
  const uint32_t tag = static_cast<uint32_t>(full >> 32);
  uint64_t h = full & table_mask_;
  while (true) {
    const Slot s = table_[h];
    if (s.rank1 == 0) return -1;
    if (s.tag == tag) {
      uint32_t r = s.rank1 - 1;
      uint32_t b = offsets_[r], e = offsets_[r + 1];
      if (e - b == n && std::memcmp(arena_.data() + b, p, n) == 0) return static_cast<int32_t>(r);
    }
    h = (h + 1) & table_mask_;
  }
}

std::optional<int32_t> Tokenizer::special_id(std::string_view name) const {
  auto it = special_by_name_.find(std::string(name));
  if (it == special_by_name_.end()) return std::nullopt;
  return it->second;
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size_) return {};
  if (id < num_special_) return special_names_[id];
  int32_t r = id - num_special_;
  return std::string_view(arena_.data() + offsets_[r], offsets_[r + 1] - offsets_[r]);
}

// tiktoken `_byte_pair_merge` (byte_pair_merge below): repeatedly merge the adjacent pair whose concatenation has
// the lowest rank (leftmost among equal ranks) until no pair is in the vocabulary.
void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const uint64_t h = hash_bytes(piece.data(), piece.size());
  if (int32_t r = rank_of_hashed(piece.data(), piece.size(), h); r >= 0) {
    out.push_back(r + num_special_);
    return;
  }
  thread_local PieceCache cache;
  if (cache.owner != instance_id_) {
    cache.owner = instance_id_;
    cache.entries.assign(PieceCache::kSize, {});
  }
  PieceCache::Entry& e = cache.entries[(h ^ (h >> 29)) & (PieceCache::kSize - 1)];
  if (e.hash == h && e.piece == piece) {
    out.insert(out.end(), e.ids.begin(), e.ids.end());
    return;
  }
  size_t before = out.size();
  byte_pair_merge(piece, out);
  if (piece.size() <= 64) {
    e.hash = h;
    e.piece.assign(piece);
    e.ids.assign(out.begin() + before, out.end());
  }
}

// The same merge order with a heap and a linked list: O(n log n) instead of O(n^2), for long
// pieces (a 100 KB run of spaces is one piece). The heap orders pairs by (rank, position),
// so it pops exactly the pair the linear scan would pick: lowest rank, leftmost on ties.
void Tokenizer::byte_pair_merge_long(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  std::vector<uint32_t> next(n), prev(n), version(n, 0);
  std::vector<uint8_t> alive(n, 1);
  for (size_t i = 0; i < n; ++i) {
    next[i] = static_cast<uint32_t>(i + 1);  // n = end
    prev[i] = i == 0 ? kNone : static_cast<uint32_t>(i - 1);
  }
  auto pair_rank = [&](uint32_t i) -> uint32_t {  // part i merged with its successor
    uint32_t j = next[i];
    if (j >= n) return kNone;
    uint32_t end = next[j];
    int32_t r = rank_of(piece.data() + i, end - i);
    return r < 0 ? kNone : static_cast<uint32_t>(r);
  };
  struct Item {
    uint32_t rank, pos, version;
    bool operator>(const Item& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
  for (uint32_t i = 0; i + 1 < n; ++i)
    if (uint32_t r = pair_rank(i); r != kNone) heap.push({r, i, 0});
  while (!heap.empty()) {
    Item it = heap.top();
    heap.pop();
    uint32_t i = it.pos;
    if (!alive[i] || it.version != version[i]) continue;  // stale
    uint32_t j = next[i];
    alive[j] = 0;
    next[i] = next[j];
    if (next[j] < n) prev[next[j]] = i;
    ++version[i];
    if (uint32_t r = pair_rank(i); r != kNone) heap.push({r, i, version[i]});
    if (prev[i] != kNone) {
      uint32_t p = prev[i];
      ++version[p];
      if (uint32_t r = pair_rank(p); r != kNone) heap.push({r, p, version[p]});
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) out.push_back(rank_of(piece.data() + i, next[i] - i) + num_special_);
}

void Tokenizer::byte_pair_merge(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  if (n > 128) {
    byte_pair_merge_long(piece, out);
    return;
  }
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  thread_local std::vector<uint32_t> start, rank;
  start.resize(n + 1);
  rank.resize(n + 1);
  for (size_t i = 0; i <= n; ++i) start[i] = static_cast<uint32_t>(i);
  size_t parts = n + 1;  // parts[i] covers bytes [start[i], start[i+1])
  auto pair_rank = [&](size_t i) -> uint32_t {  // rank of parts i and i+1 merged
    if (i + 2 >= parts) return kNone;
    int32_t r = rank_of(piece.data() + start[i], start[i + 2] - start[i]);
    return r < 0 ? kNone : static_cast<uint32_t>(r);
  };
  for (size_t i = 0; i + 1 < parts; ++i) rank[i] = pair_rank(i);
  rank[parts - 1] = kNone;
  while (parts > 2) {
    uint32_t best = kNone;
    size_t bi = 0;
    for (size_t i = 0; i + 2 < parts; ++i)
      if (rank[i] < best) {
        best = rank[i];
        bi = i;
      }
    if (best == kNone) break;
    // Merge parts bi and bi+1: drop boundary bi+1.
    std::memmove(&start[bi + 1], &start[bi + 2], (parts - bi - 2) * sizeof(uint32_t));
    std::memmove(&rank[bi + 1], &rank[bi + 2], (parts - bi - 2) * sizeof(uint32_t));
    --parts;
    rank[bi] = pair_rank(bi);
    if (bi > 0) rank[bi - 1] = pair_rank(bi - 1);
  }
  for (size_t i = 0; i + 1 < parts; ++i) {
    int32_t r = rank_of(piece.data() + start[i], start[i + 1] - start[i]);
    out.push_back(r + num_special_);  // every part is a vocabulary entry by construction
  }
}

void Tokenizer::encode_ordinary(std::string_view s, std::vector<int32_t>& out) const {
  size_t pos = 0;
  size_t b, e;
  while (pos < s.size() && regex_->find(s, pos, &b, &e)) {
    if (e == b) {  // an empty match cannot produce a token; step over one character
      pos = b + utf8::sequence_length(static_cast<unsigned char>(s[b]));
      continue;
    }
    encode_piece(s.substr(b, e - b), out);
    pos = e;
  }
}

void Tokenizer::encode_into(std::string_view text, bool allow_special, std::vector<int32_t>& out) const {
  std::string fixed;
  if (!utf8::is_valid(text)) {
    fixed = utf8::sanitize(text);
    text = fixed;
  }
  if (!allow_special) {
    encode_ordinary(text, out);
    return;
  }
  size_t pos = 0, b, e;
  while (pos < text.size() && special_regex_->find(text, pos, &b, &e) && e > b) {
    encode_ordinary(text.substr(pos, b - pos), out);
    auto id = special_id(text.substr(b, e - b));
    out.push_back(*id);
    pos = e;
  }
  encode_ordinary(text.substr(pos), out);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  encode_into(text, allow_special, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string out, run;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size_) continue;
    if (id < num_special_) {
      utf8::decode_replace(run, out, true);
      run.clear();
      if (!skip_special) out += special_names_[id];
      continue;
    }
    run += token_bytes(id);
  }
  utf8::decode_replace(run, out, true);
  return out;
}

StreamDecoder::StreamDecoder(std::shared_ptr<const Tokenizer> tok, bool skip_special)
    : tok_(std::move(tok)), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  std::string out;
  if (!tok_->is_valid_id(id)) return out;
  if (tok_->is_special(id)) {
    // A special token ends a run of bytes, as in Tokenizer::decode.
    utf8::decode_replace(pending_, out, true);
    pending_.clear();
    if (!skip_special_) out += tok_->token_bytes(id);
    return out;
  }
  pending_ += tok_->token_bytes(id);
  size_t used = utf8::decode_replace(pending_, out, false);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::push(std::span<const int32_t> ids) {
  std::string out;
  for (int32_t id : ids) out += push(id);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  utf8::decode_replace(pending_, out, true);
  pending_.clear();
  return out;
}

}  // namespace ml4
