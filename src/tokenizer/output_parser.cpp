// Reasoning / tool-call output parsing (see output_parser.h).
#include "tokenizer/output_parser.h"

#include <random>
#include <unordered_map>

#include "tokenizer/python_json.h"
#include "tokenizer/utf8.h"

namespace ml4 {
namespace detail {
namespace {

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

class ParserCore {
 public:
  explicit ParserCore(const OutputParserOptions& o) : opt_(o) {
    if (o.starts_in_reasoning && o.parse_reasoning) st_ = State::kReasoning;
    seed_ = o.id_seed ? o.id_seed : std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32);
  }

  void text(std::string_view s, ParsedDelta& d) {
    if (s.empty()) return;
    switch (st_) {
      case State::kContent: d.content += s; break;
      case State::kReasoning: d.reasoning += s; break;
      case State::kToolName:
        name_ += s;
        if (!json_form_decided_) {
          std::string t = trim(name_);
          if (!t.empty()) {
            json_form_decided_ = true;
            if (t[0] == '[' || t[0] == '{') st_ = State::kJson;
          }
        }
        if (st_ == State::kJson) {
          json_ = std::move(name_);
          name_.clear();
        }
        break;
      case State::kCallId: id_ += s; break;
      case State::kArgs: args(s, d); break;
      case State::kJson: json_ += s; break;
      case State::kDone: break;
    }
  }

  void marker(Marker m, ParsedDelta& d) {
    if (st_ == State::kDone) return;
    if (m == Marker::kEos) {
      finish(d);
      st_ = State::kDone;
      return;
    }
    switch (st_) {
      case State::kContent:
        if (m == Marker::kThink && opt_.parse_reasoning) st_ = State::kReasoning;
        else if (m == Marker::kToolCalls && opt_.parse_tool_calls) begin_call();
        break;
      case State::kReasoning:
        if (m == Marker::kEndThink) st_ = State::kContent;
        break;
      case State::kToolName:
        if (m == Marker::kCallId) st_ = State::kCallId;
        else if (m == Marker::kArgs) start_args(d);
        break;
      case State::kCallId:
        if (m == Marker::kArgs) start_args(d);
        break;
      case State::kArgs:
        if (m == Marker::kToolCalls) begin_call();
        break;
      case State::kJson:
        if (m == Marker::kToolCalls) {
          emit_json(d);
          begin_call();
        }
        break;
      case State::kDone: break;
    }
  }

  void finish(ParsedDelta& d) {
    switch (st_) {
      case State::kToolName:
      case State::kCallId:
        if (!trim(name_).empty()) {  // a call whose [ARGS] never came: no arguments
          start_args(d);
          args("{}", d);
        }
        break;
      case State::kJson: emit_json(d); break;
      default: break;
    }
    st_ = State::kDone;
  }

 private:
  enum class State { kContent, kReasoning, kToolName, kCallId, kArgs, kJson, kDone };

  void begin_call() {
    st_ = State::kToolName;
    name_.clear();
    id_.clear();
    json_.clear();
    json_form_decided_ = false;
  }

  std::string next_id() {
    static constexpr char kAlnum[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    uint64_t h = splitmix64(seed_ + static_cast<uint64_t>(next_index_));
    std::string id(9, 'a');
    for (char& c : id) {
      c = kAlnum[h % 62];
      h /= 62;
    }
    return id;
  }

  void start_args(ParsedDelta& d) {
    ToolCallDelta t;
    t.index = next_index_;
    std::string id = trim(id_);
    t.id = id.empty() ? next_id() : id;
    t.name = trim(name_);
    d.tool_calls.push_back(std::move(t));
    ++next_index_;
    st_ = State::kArgs;
  }

  void args(std::string_view s, ParsedDelta& d) {
    int idx = next_index_ - 1;
    if (d.tool_calls.empty() || d.tool_calls.back().index != idx) {
      ToolCallDelta t;
      t.index = idx;
      d.tool_calls.push_back(std::move(t));
    }
    d.tool_calls.back().arguments += s;
  }

  // The pre-v11 form: [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...].
  void emit_json(ParsedDelta& d) {
    nlohmann::ordered_json j;
    std::string raw = std::move(json_);
    json_.clear();
    if (!python_json_loads(raw, j) || !(j.is_array() || j.is_object())) {
      d.content += raw;  // not a call after all: keep the text
      st_ = State::kContent;
      return;
    }
    if (j.is_object()) j = nlohmann::ordered_json::array({j});
    for (const auto& c : j) {
      if (!c.is_object() || !c.contains("name") || !c["name"].is_string()) continue;
      name_ = c["name"].get<std::string>();
      id_ = c.contains("id") && c["id"].is_string() && is_valid_id(c["id"].get<std::string>()) ? c["id"].get<std::string>() : "";
      start_args(d);
      if (!c.contains("arguments") || c["arguments"].is_null()) args("{}", d);
      else if (c["arguments"].is_string()) args(c["arguments"].get<std::string>(), d);
      else args(python_json_dumps(c["arguments"]), d);
    }
    st_ = State::kArgs;
  }

  static bool is_valid_id(const std::string& id) {
    return !id.empty() && std::all_of(id.begin(), id.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)); });
  }

  OutputParserOptions opt_;
  State st_ = State::kContent;
  std::string name_, id_, json_;
  bool json_form_decided_ = false;
  int next_index_ = 0;
  uint64_t seed_ = 0;
};

}  // namespace detail

using detail::Marker;

namespace {

struct MarkerName {
  std::string_view name;
  Marker kind;
};
constexpr MarkerName kMarkers[] = {{"[THINK]", Marker::kThink},       {"[/THINK]", Marker::kEndThink},
                                   {"[TOOL_CALLS]", Marker::kToolCalls}, {"[ARGS]", Marker::kArgs},
                                   {"[CALL_ID]", Marker::kCallId},     {"</s>", Marker::kEos}};

}  // namespace

void ParsedOutput::add(const ParsedDelta& d) {
  content += d.content;
  reasoning += d.reasoning;
  for (const auto& t : d.tool_calls) {
    if (t.index >= static_cast<int>(tool_calls.size())) tool_calls.resize(t.index + 1);
    auto& c = tool_calls[t.index];
    if (!t.id.empty()) c.id = t.id;
    if (!t.name.empty()) c.name = t.name;
    c.arguments += t.arguments;
  }
}

// ---- token ids ----------------------------------------------------------------------------

OutputParser::OutputParser(std::shared_ptr<const Tokenizer> tok, OutputParserOptions options)
    : tok_(tok), decoder_(tok, /*skip_special=*/true), core_(std::make_unique<detail::ParserCore>(options)) {}
OutputParser::~OutputParser() = default;

ParsedDelta OutputParser::push(std::span<const int32_t> ids) {
  ParsedDelta d;
  for (int32_t id : ids) {
    core_->text(decoder_.push(id), d);  // for a special token: the bytes it ends
    if (!tok_->is_special(id)) continue;
    Marker kind = Marker::kOther;
    if (id == tok_->eos_id()) {
      kind = Marker::kEos;
    } else {
      std::string_view name = tok_->token_bytes(id);
      for (const auto& m : kMarkers)
        if (m.name == name) kind = m.kind;
    }
    if (kind != Marker::kOther) core_->marker(kind, d);
  }
  return d;
}

ParsedDelta OutputParser::finish() {
  ParsedDelta d;
  core_->text(decoder_.flush(), d);
  core_->finish(d);
  return d;
}

// ---- text with markers --------------------------------------------------------------------

TextOutputParser::TextOutputParser(OutputParserOptions options)
    : core_(std::make_unique<detail::ParserCore>(options)) {}
TextOutputParser::~TextOutputParser() = default;

ParsedDelta TextOutputParser::push(std::string_view text) {
  ParsedDelta d;
  held_ += text;
  size_t pos = 0;
  while (true) {
    size_t best = std::string::npos;
    const MarkerName* which = nullptr;
    for (const auto& m : kMarkers) {
      size_t f = held_.find(m.name, pos);
      if (f < best) {
        best = f;
        which = &m;
      }
    }
    if (!which) break;
    std::string txt;
    utf8::decode_replace(std::string_view(held_).substr(pos, best - pos), txt, true);
    core_->text(txt, d);
    core_->marker(which->kind, d);
    pos = best + which->name.size();
  }
  // Hold back the longest tail that may still grow into a marker.
  size_t keep = 0;
  for (const auto& m : kMarkers)
    for (size_t k = std::min(m.name.size() - 1, held_.size() - pos); k > keep; --k)
      if (held_.compare(held_.size() - k, k, m.name, 0, k) == 0) {
        keep = k;
        break;
      }
  std::string_view ready = std::string_view(held_).substr(pos, held_.size() - pos - keep);
  std::string txt;
  size_t used = utf8::decode_replace(ready, txt, false);
  core_->text(txt, d);
  held_ = held_.substr(pos + used);
  return d;
}

ParsedDelta TextOutputParser::finish() {
  ParsedDelta d;
  std::string txt;
  utf8::decode_replace(held_, txt, true);
  held_.clear();
  core_->text(txt, d);
  core_->finish(d);
  return d;
}

ParsedOutput parse_output(std::shared_ptr<const Tokenizer> tok, std::span<const int32_t> ids,
                          OutputParserOptions options) {
  OutputParser p(std::move(tok), options);
  ParsedOutput out;
  out.add(p.push(ids));
  out.add(p.finish());
  return out;
}

ParsedOutput parse_output_text(std::string_view text, OutputParserOptions options) {
  TextOutputParser p(options);
  ParsedOutput out;
  out.add(p.push(text));
  out.add(p.finish());
  return out;
}

}  // namespace ml4
