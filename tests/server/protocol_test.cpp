// OpenAI protocol pieces without a socket: request parsing (types, ranges, defaults),
// response building (chat with reasoning and tool calls parsed from ids, streaming deltas
// that add up to the whole message), Prometheus histogram rendering, and the bench
// statistics (percentiles against numpy's "linear" definition).
#include <gtest/gtest.h>

#include "server/bench_client.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "tokenizer/base64.h"
#include "tokenizer/tokenizer.h"

namespace ml4 {
namespace {

// The byte-level tekken.json `ml4 make-model` writes (v7 specials, then the 256 bytes).
std::shared_ptr<const Tokenizer> tiny_tokenizer() {
  const std::vector<std::string> named = {"<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                          "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
                                          "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                                          "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
                                          "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"};
  nlohmann::json specials = nlohmann::json::array(), vocab = nlohmann::json::array();
  for (int i = 0; i < 256; ++i)
    specials.push_back({{"rank", i}, {"token_str", i < (int)named.size() ? named[i] : "<SPECIAL_" + std::to_string(i) + ">"},
                        {"is_control", true}});
  for (int b = 0; b < 256; ++b)
    vocab.push_back({{"rank", b}, {"token_bytes", base64_encode(std::string(1, static_cast<char>(b)))}, {"token_str", nullptr}});
  nlohmann::json doc = {{"config",
                         {{"pattern", R"([^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
                          {"num_vocab_tokens", 256},
                          {"default_vocab_size", 512},
                          {"default_num_special_tokens", 256},
                          {"version", "v7"}}},
                        {"vocab", vocab},
                        {"special_tokens", specials}};
  auto t = Tokenizer::from_json(doc);
  EXPECT_TRUE(t.ok()) << t.status().message();
  return t.value();
}

std::vector<int32_t> ids_of(const Tokenizer& tok, const std::string& text_with_markers) {
  return tok.encode(text_with_markers, /*allow_special=*/true);
}

TEST(Protocol, ParsesAndRejectsFields) {
  TekkenTextCodec codec(tiny_tokenizer());
  auto ok = parse_api_request(ojson::parse(R"({"prompt":"hi","n":2,"stop":["a","b"],"logprobs":3,
      "temperature":0.5,"top_k":5,"seed":7,"stream":true,"stream_options":{"include_usage":true}})"), false, codec);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->params.n, 2);
  EXPECT_EQ(ok->params.stop.size(), 2u);
  EXPECT_EQ(ok->params.logprobs, 3);
  EXPECT_EQ(*ok->params.seed, 7u);
  EXPECT_TRUE(ok->include_usage);
  EXPECT_EQ(ok->prompts[0].front(), codec.bos_id());
  EXPECT_EQ(params_for_prompt(*ok, 0, 100).max_tokens, 16);  // completions default
  auto chat = parse_api_request(ojson::parse(R"({"messages":[{"role":"user","content":"hi"}]})"), true, codec);
  ASSERT_TRUE(chat.ok()) << chat.status().message();
  EXPECT_EQ(params_for_prompt(*chat, 0, 100).max_tokens, 100 - static_cast<int>(chat->prompts[0].size()));
  for (const char* bad : {R"({"prompt":"x","temperature":"hot"})", R"({"prompt":"x","n":0})",
                          R"({"prompt":"x","max_tokens":1.5})", R"({"prompt":[1,9999]})", R"({"prompt":"x","stop":3})",
                          R"({"prompt":"x","top_p":2})", R"({"max_tokens":3})", R"({"prompt":"x","logit_bias":{"99999999":2}})",
                          R"({"prompt":"x","logit_bias":{"a":2}})", R"({"prompt":"x","suffix":"y"})",
                          R"({"prompt":"x","guided_regex":"a","guided_choice":["b"]})",
                          R"({"prompt":"x","max_tokens":0})"}) {
    auto r = parse_api_request(ojson::parse(bad), false, codec);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(parse_api_request(ojson::parse(R"({"messages":[{"role":"user","content":"hi"}],"top_logprobs":2})"),
                                 true, codec).ok());
  // logit_bias: ids in the vocabulary, biases clamped to [-100, 100] (vLLM).
  auto lb = parse_api_request(ojson::parse(R"({"prompt":"x","logit_bias":{"5":250,"7":-3.5}})"), false, codec);
  ASSERT_TRUE(lb.ok()) << lb.status().message();
  ASSERT_EQ(lb->params.logit_bias.size(), 2u);
  EXPECT_EQ(lb->params.logit_bias[0], std::make_pair(int32_t{5}, 100.0f));
  EXPECT_EQ(lb->params.logit_bias[1], std::make_pair(int32_t{7}, -3.5f));
  // echo with max_tokens 0: the prompt alone, one token generated and dropped; echo with
  // logprobs asks the engine for the prompt's logprobs.
  auto echo = parse_api_request(ojson::parse(R"({"prompt":"x","echo":true,"max_tokens":0,"logprobs":2})"), false, codec);
  ASSERT_TRUE(echo.ok()) << echo.status().message();
  EXPECT_TRUE(echo->echo_only);
  EXPECT_EQ(params_for_prompt(*echo, 0, 100).max_tokens, 1);
  EXPECT_EQ(echo->params.prompt_logprobs, 2);
}

TEST(Protocol, ChatParsesReasoningAndToolCallsFromIds) {
  auto tok = tiny_tokenizer();
  TekkenTextCodec codec(tok);
  auto req = parse_api_request(ojson::parse(R"({"messages":[{"role":"user","content":"weather?"}],
      "tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]})"), true, codec);
  ASSERT_TRUE(req.ok()) << req.status().message();
  EXPECT_TRUE(req->tools);
  const auto ids = ids_of(*tok, R"([THINK]sunny?[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>)");
  // Whole, and streamed in 3-token pieces: the deltas must rebuild the same message.
  ChoiceBuilder whole(*req, codec, "id", "m", 0);
  StreamItem item;
  item.out.new_tokens = ids;
  item.out.finished = true;
  item.out.finish_reason = FinishReason::kStop;
  whole.add(item);
  ojson msg = whole.final_json()["choices"][0];
  EXPECT_EQ(msg["finish_reason"], "tool_calls");
  EXPECT_EQ(msg["message"]["reasoning_content"], "sunny?");
  EXPECT_TRUE(msg["message"]["content"].is_null());
  ASSERT_EQ(msg["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(ojson::parse(msg["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>())["city"], "Paris");

  req->stream = true;
  ChoiceBuilder streamed(*req, codec, "id", "m", 0);
  std::string reasoning, args, name;
  for (size_t i = 0; i < ids.size(); i += 3) {
    StreamItem piece;
    piece.out.new_tokens.assign(ids.begin() + i, ids.begin() + std::min(ids.size(), i + 3));
    piece.out.finished = i + 3 >= ids.size();
    piece.out.finish_reason = piece.out.finished ? FinishReason::kStop : FinishReason::kNone;
    for (const auto& ev : streamed.add(piece)) {
      ojson j = ojson::parse(ev.substr(6));
      const auto& d = j["choices"][0]["delta"];
      if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
      if (d.contains("tool_calls"))
        for (const auto& tc : d["tool_calls"]) {
          if (tc["function"].contains("name")) name += tc["function"]["name"].get<std::string>();
          args += tc["function"]["arguments"].get<std::string>();
        }
    }
  }
  EXPECT_EQ(reasoning, "sunny?");
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(args, msg["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>());
}

TEST(Protocol, ErrorJsonShape) {
  ojson e = error_json(404, "The model `x` does not exist.");
  EXPECT_EQ(e["error"]["code"], 404);
  EXPECT_EQ(e["error"]["type"], "not_found_error");
  EXPECT_EQ(error_json(429, "full")["error"]["type"], "rate_limit_error");
}

TEST(Metrics, HistogramBucketsAreCumulative) {
  Histogram h({0.1, 1.0, 10.0});
  for (double v : {0.05, 0.1, 0.5, 2.0, 20.0}) h.observe(v);
  std::string out;
  h.render("x", "m=\"a\"", &out);
  // Prometheus buckets are "le": 0.1 holds 0.05 and 0.1.
  EXPECT_NE(out.find("x_bucket{m=\"a\",le=\"0.1\"} 2\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{m=\"a\",le=\"1\"} 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{m=\"a\",le=\"10\"} 4\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{m=\"a\",le=\"+Inf\"} 5\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_count{m=\"a\"} 5\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_sum{m=\"a\"} 22.65"), std::string::npos) << out;
}

TEST(BenchStats, PercentilesMatchNumpyLinear) {
  // numpy.percentile(range(1, 11), [50, 90, 99]) == [5.5, 9.1, 9.91]
  LatencyStats s = latency_stats({10, 3, 1, 2, 4, 5, 6, 7, 8, 9});
  EXPECT_DOUBLE_EQ(s.mean, 5.5);
  EXPECT_DOUBLE_EQ(s.median, 5.5);
  EXPECT_NEAR(s.p90, 9.1, 1e-12);
  EXPECT_NEAR(s.p99, 9.91, 1e-12);
  EXPECT_EQ(latency_stats({}).mean, 0.0);
}

}  // namespace
}  // namespace ml4
