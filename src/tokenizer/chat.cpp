// Mistral chat encoding, stage 4 (InstructTokenizerV7/V11/V13/V15, tokens/tokenizers/
// instruct.py) and the public entry points; stages 1-3 are in chat_request.cpp (see chat.h).
// Python truthiness ("if message.content:") is spelled out with Content::truthy().
#include "tokenizer/chat.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "tokenizer/chat_request.h"
#include "tokenizer/python_json.h"

namespace ml4 {
namespace {

using namespace chat_detail;  // NOLINT: this file is the other half of chat_request.cpp

// ---------------------------------------------------------------------------------------
// 4. Encode (InstructTokenizerV7/V11/V13/V15).

class Encoder {
 public:
  Encoder(const Tokenizer& tok, int v) : tok_(tok), v_(v) {}

  Status init() {
    for (auto [ptr, name] : {std::pair{&inst_, "[INST]"}, {&end_inst_, "[/INST]"}, {&tools_, "[AVAILABLE_TOOLS]"},
                             {&end_tools_, "[/AVAILABLE_TOOLS]"}, {&results_, "[TOOL_RESULTS]"},
                             {&end_results_, "[/TOOL_RESULTS]"}, {&calls_, "[TOOL_CALLS]"},
                             {&system_, "[SYSTEM_PROMPT]"}, {&end_system_, "[/SYSTEM_PROMPT]"},
                             {&tool_content_, "[TOOL_CONTENT]"}}) {
      auto id = tok_.special_id(name);
      if (!id) return invalid_argument("tokenizer {} lacks the special token {} needed for chat", tok_.name(), name);
      *ptr = *id;
    }
    if (tok_.bos_id() < 0 || tok_.eos_id() < 0) return invalid_argument("tokenizer has no <s> or </s>");
    if (v_ >= 11) {
      for (auto [ptr, name] : {std::pair{&args_, "[ARGS]"}, {&call_id_, "[CALL_ID]"}}) {
        auto id = tok_.special_id(name);
        if (!id) return invalid_argument("tokenizer v{} lacks {}", v_, name);
        *ptr = *id;
      }
    }
    think_ = tok_.special_id("[THINK]").value_or(-1);
    end_think_ = tok_.special_id("[/THINK]").value_or(-1);
    if (v_ >= 15) {
      auto a = tok_.special_id("[MODEL_SETTINGS]"), b = tok_.special_id("[/MODEL_SETTINGS]");
      if (!a || !b) return invalid_argument("tokenizer v15 lacks [MODEL_SETTINGS] / [/MODEL_SETTINGS]");
      settings_ = *a;
      end_settings_ = *b;
    }
    return ok_status();
  }

  void text(const std::string& s) { tok_.encode_into(s, false, out_.ids); }
  void id(int32_t i) { out_.ids.push_back(i); }

  Status think(const Chunk& c) {
    if (v_ < 13) return invalid_argument("Think not implemented for tokenizer < V13.");
    if (think_ < 0 || end_think_ < 0) return invalid_argument("think tokens are not available for this tokenizer.");
    id(think_);
    text(c.text);
    if (c.closed) id(end_think_);
    return ok_status();
  }

  // ImageEncoder._image_to_num_tokens and __call__ (tokens/tokenizers/image.py).
  Status image(const Chunk& c) {
    const auto& ic = tok_.image_config();
    if (!ic) return invalid_argument("this tokenizer has no image config: images are not supported");
    auto img = tok_.special_id("[IMG]"), brk = tok_.special_id("[IMG_BREAK]"), end = tok_.special_id("[IMG_END]");
    if (!img || !brk || !end) return invalid_argument("tokenizer lacks [IMG] / [IMG_BREAK] / [IMG_END]");
    double w = c.image_size.width, h = c.image_size.height;
    double ratio = std::max(h / ic->max_image_size, w / ic->max_image_size);
    if (ratio > 1) {  // Python round(): half to even, which nearbyint does by default
      w = std::max(std::nearbyint(w / ratio), 1.0);
      h = std::max(std::nearbyint(h / ratio), 1.0);
    }
    const int step = ic->image_patch_size * ic->spatial_merge_size;
    int wt = (static_cast<int>(w) - 1) / step + 1, ht = (static_cast<int>(h) - 1) / step + 1;
    ChatImage ci;
    ci.file_bytes = c.image_bytes;
    ci.width = c.image_size.width;
    ci.height = c.image_size.height;
    ci.tokens_wide = wt;
    ci.tokens_high = ht;
    ci.first_token = static_cast<int32_t>(out_.ids.size());
    for (int y = 0; y < ht; ++y) {
      for (int x = 0; x < wt; ++x) id(*img);
      id(y + 1 == ht ? *end : *brk);
    }
    out_.images.push_back(std::move(ci));
    return ok_status();
  }

  Status chunks(const std::vector<Chunk>& cs) {
    for (const Chunk& c : cs) {
      switch (c.kind) {
        case Chunk::Kind::kText: text(c.text); break;
        case Chunk::Kind::kThink: ML4_RETURN_IF_ERROR(think(c)); break;
        case Chunk::Kind::kImage: ML4_RETURN_IF_ERROR(image(c)); break;
      }
    }
    return ok_status();
  }

  Status content(const Content& c) {
    if (c.is_str) {
      text(c.str);
      return ok_status();
    }
    return chunks(c.chunks);
  }

  Status user(const Message& m, const Request& r, const Settings& settings, bool is_first, bool is_last) {
    bool here = v_ >= 13 ? is_first : is_last;
    if (here && r.tools && !r.tools->empty()) {
      id(tools_);
      ojson arr = ojson::array();
      for (const auto& t : *r.tools) arr.push_back(t);
      text(python_json_dumps(arr));
      id(end_tools_);
    }
    if (here && v_ >= 15 && !settings.none()) {
      ojson s = ojson::object();  // keys sorted: json_schema < reasoning_effort
      if (!settings.json_schema.is_null()) s["json_schema"] = settings.json_schema;
      if (settings.reasoning_effort) s["reasoning_effort"] = *settings.reasoning_effort;
      id(settings_);
      text(python_json_dumps(s));
      id(end_settings_);
    }
    id(inst_);
    if (m.content.is_str) {
      text(m.content.str);
    } else {
      // _maybe_put_image_first: [text..., image] becomes [image, text...].
      std::vector<Chunk> cs = m.content.chunks;
      if (cs.size() >= 2 && cs.back().kind == Chunk::Kind::kImage &&
          std::all_of(cs.begin(), cs.end() - 1, [](const Chunk& c) { return c.kind == Chunk::Kind::kText; }))
        std::rotate(cs.begin(), cs.end() - 1, cs.end());
      ML4_RETURN_IF_ERROR(chunks(cs));
    }
    id(end_inst_);
    return ok_status();
  }

  Status tool_result(const Message& m) {
    id(results_);
    if (v_ < 13) {
      if (!m.content.is_str) return invalid_argument("tool message content must be text for tokenizer < v15");
      text(m.tool_call_id.value_or(""));
      id(tool_content_);
    }
    ML4_RETURN_IF_ERROR(content(m.content));
    id(end_results_);
    return ok_status();
  }

  Status assistant(const Message& m) {
    bool has_calls = m.tool_calls && !m.tool_calls->empty();
    if (!m.content.truthy() && !has_calls) return invalid_argument("Invalid assistant message: no content and no tool calls");
    if (m.content.truthy()) {
      if (m.content.is_str) {
        std::string s = m.content.str;
        while (!s.empty() && s.back() == ' ') s.pop_back();  // rstrip(" ")
        text(s);
      } else {
        ML4_RETURN_IF_ERROR(chunks(m.content.chunks));
      }
    }
    if (has_calls) {
      auto parsed_args = [](const std::string& a) {
        ojson j;
        if (python_json_loads(a, j)) return j;
        return ojson(a);
      };
      if (v_ < 11) {  // one JSON list after [TOOL_CALLS]
        ojson arr = ojson::array();
        for (const auto& tc : *m.tool_calls) {
          ojson o = ojson::object();
          o["name"] = tc.name;
          o["arguments"] = parsed_args(tc.arguments);
          if (!tc.id.empty() && tc.id != "null") o["id"] = tc.id;
          arr.push_back(std::move(o));
        }
        id(calls_);
        text(python_json_dumps(arr));
      } else {
        for (const auto& tc : *m.tool_calls) {
          id(calls_);
          text(tc.name);
          if (v_ < 13 && !tc.id.empty() && tc.id != "null") {
            id(call_id_);
            text(tc.id);
          }
          id(args_);
          text(python_json_dumps(parsed_args(tc.arguments)));
        }
      }
    }
    if (!m.prefix) id(tok_.eos_id());
    return ok_status();
  }

  Status system(const Message& m) {
    id(system_);
    ML4_RETURN_IF_ERROR(content(m.content));
    id(end_system_);
    return ok_status();
  }

  ChatEncoding& out() { return out_; }

 private:
  const Tokenizer& tok_;
  int v_;
  ChatEncoding out_;
  int32_t inst_ = -1, end_inst_ = -1, tools_ = -1, end_tools_ = -1, results_ = -1, end_results_ = -1, calls_ = -1,
          system_ = -1, end_system_ = -1, tool_content_ = -1, args_ = -1, call_id_ = -1, think_ = -1,
          end_think_ = -1, settings_ = -1, end_settings_ = -1;
};


}  // namespace

bool is_valid_tool_call_id(std::string_view id) {
  return id.size() == 9 &&
         std::all_of(id.begin(), id.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; });
}

std::string make_tool_call_id() {
  static constexpr char kAlnum[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id(9, 'a');
  for (char& c : id) c = kAlnum[rng() % 62];
  return id;
}

Result<ChatEncoding> encode_chat_full(const Tokenizer& tok, const nlohmann::ordered_json& openai_request,
                                      const ChatOptions& options) {
  const int v = tok.version();
  if (v < 7) return unimplemented("chat encoding needs a tekken tokenizer of version v7 or later, this one is v{}", v);
  ML4_ASSIGN_OR_RETURN(Request req, parse_request(openai_request, options.media));
  if (options.rewrite_tool_call_ids && v < 13) {
    auto fix = [](std::string& id) {
      if (id != "null" && !is_valid_tool_call_id(id)) id = rewrite_id(id);
    };
    for (auto& m : req.messages) {
      if (m.tool_calls)
        for (auto& tc : *m.tool_calls) fix(tc.id);
      if (m.tool_call_id) fix(*m.tool_call_id);
    }
  }
  ML4_RETURN_IF_ERROR(validate(req, v));
  std::vector<Message> msgs = normalize(req, v);
  Settings settings;
  if (v >= 15) {
    ML4_ASSIGN_OR_RETURN(settings, build_settings(tok, req));
  }

  Encoder enc(tok, v);
  ML4_RETURN_IF_ERROR(enc.init());
  int first_user = -1, last_user = -1;
  for (size_t i = 0; i < msgs.size(); ++i)
    if (msgs[i].role == Role::kUser) {
      if (first_user < 0) first_user = static_cast<int>(i);
      last_user = static_cast<int>(i);
    }
  enc.id(tok.bos_id());
  for (size_t i = 0; i < msgs.size(); ++i) {
    const Message& m = msgs[i];
    Status st;
    switch (m.role) {
      case Role::kUser: st = enc.user(m, req, settings, static_cast<int>(i) == first_user, static_cast<int>(i) == last_user); break;
      case Role::kTool: st = enc.tool_result(m); break;
      case Role::kAssistant: st = enc.assistant(m); break;
      case Role::kSystem: st = enc.system(m); break;
    }
    if (!st.ok()) return st.with_context(fmt::format("message {} ({})", i, role_name(m.role)));
  }
  enc.out().ends_with_prefix = !msgs.empty() && msgs.back().role == Role::kAssistant && msgs.back().prefix;
  return std::move(enc.out());
}

Result<std::vector<int32_t>> encode_chat(const Tokenizer& tok, const nlohmann::ordered_json& openai_request,
                                         const ChatOptions& options) {
  ML4_ASSIGN_OR_RETURN(ChatEncoding e, encode_chat_full(tok, openai_request, options));
  return std::move(e.ids);
}

Result<std::vector<int32_t>> encode_chat(const Tokenizer& tok, const nlohmann::json& openai_request,
                                         const ChatOptions& options) {
  return encode_chat(tok, nlohmann::ordered_json::parse(openai_request.dump()), options);
}

}  // namespace ml4