// The OpenAPI description (see openapi.h). Written as data, not generated: each schema says
// what openai_protocol.cpp accepts, with the same bounds.
#include "server/openapi.h"

#include <nlohmann/json.hpp>

namespace ml4 {
namespace {

using json = nlohmann::ordered_json;

json integer(int64_t lo, int64_t hi) { return {{"type", "integer"}, {"minimum", lo}, {"maximum", hi}}; }
json number(double lo, double hi) { return {{"type", "number"}, {"minimum", lo}, {"maximum", hi}}; }
json boolean() { return {{"type", "boolean"}}; }
json string() { return {{"type", "string"}}; }
json array_of(json items) { return {{"type", "array"}, {"items", std::move(items)}}; }
json ref(const std::string& name) { return {{"$ref", "#/components/schemas/" + name}}; }
json stop_string() { return {{"type", "string"}, {"minLength", 1}, {"maxLength", 256}}; }

// Fields both generation endpoints take (OpenAI's and vLLM's extensions).
json sampling_properties() {
  return {
      {"model", string()},
      {"max_tokens", integer(0, 1 << 30)},
      {"temperature", number(0, 100)},
      {"top_p", {{"type", "number"}, {"exclusiveMinimum", 0}, {"maximum", 1}}},
      {"top_k", integer(-1, 1 << 30)},
      {"min_p", number(0, 1)},
      {"n", integer(1, 128)},
      {"seed", integer(INT64_MIN, INT64_MAX)},
      {"stream", boolean()},
      {"stream_options",
       {{"type", "object"}, {"properties", {{"include_usage", boolean()}, {"continuous_usage_stats", boolean()}}}}},
      {"stop", {{"oneOf", json::array({stop_string(), {{"type", "array"}, {"maxItems", 16}, {"items", stop_string()}}})}}},
      {"stop_token_ids", array_of(integer(0, 1 << 30))},
      {"presence_penalty", number(-2, 2)},
      {"frequency_penalty", number(-2, 2)},
      {"repetition_penalty", {{"type", "number"}, {"minimum", 1e-6}, {"maximum", 2}}},
      {"logit_bias",
       {{"type", "object"}, {"propertyNames", {{"pattern", "^[0-9]{1,9}$"}}}, {"additionalProperties", number(-100, 100)}}},
      {"min_tokens", integer(0, 1 << 30)},
      {"ignore_eos", boolean()},
      {"skip_special_tokens", boolean()},
      {"include_stop_str_in_output", boolean()},
      {"prompt_logprobs", integer(0, 20)},
      {"priority", integer(-1000000, 1000000)},
      {"return_token_ids", boolean()},
      {"truncate_prompt_tokens", integer(-1, 1 << 30)},
      {"response_format", ref("ResponseFormat")},
      {"structured_outputs", ref("StructuredOutputs")},
      {"guided_json", {{"type", "object"}}},
      {"guided_regex", string()},
      {"guided_choice", array_of(string())},
      {"guided_grammar", string()},
  };
}

json build() {
  json error = {{"type", "object"},
                {"required", json::array({"error"})},
                {"properties",
                 {{"error",
                   {{"type", "object"},
                    {"properties",
                     {{"message", string()}, {"type", string()}, {"param", {{"type", {"string", "null"}}}},
                      {"code", {{"type", "integer"}}}}}}}}}};
  json completion = sampling_properties();
  json ids = {{"type", "array"}, {"minItems", 1}, {"items", integer(0, 1 << 30)}};
  completion["prompt"] = {{"oneOf", json::array({string(), {{"type", "array"}, {"minItems", 1}, {"items", string()}}, ids,
                                                 {{"type", "array"}, {"minItems", 1}, {"items", ids}}})}};
  completion["echo"] = boolean();
  completion["logprobs"] = integer(0, 20);
  completion["suffix"] = {{"type", "string"}, {"description", "refused: ml4 has no fill-in-the-middle (400)"}};
  completion["best_of"] = {{"type", "integer"}, {"description", "1 or n; anything else is refused (400)"}};

  json chat = sampling_properties();
  chat["messages"] = {{"type", "array"}, {"minItems", 1}, {"items", ref("ChatMessage")}};
  chat["max_completion_tokens"] = integer(0, 1 << 30);
  chat["logprobs"] = boolean();
  chat["top_logprobs"] = integer(0, 20);
  chat["tools"] = array_of(ref("Tool"));
  chat["tool_choice"] = {
      {"oneOf", json::array({{{"type", "string"}, {"enum", {"none", "auto", "required"}}},
                             {{"type", "object"},
                              {"required", json::array({"type", "function"})},
                              {"properties",
                               {{"type", {{"type", "string"}, {"enum", json::array({"function"})}}},
                                {"function", {{"type", "object"}, {"properties", {{"name", string()}}}}}}}}})}};
  chat["reasoning_effort"] = {{"type", "string"}, {"enum", {"none", "minimal", "low", "medium", "high"}}};
  chat["continue_final_message"] = boolean();

  json part = {{"type", "object"},
               {"required", json::array({"type"})},
               {"properties",
                {{"type", {{"type", "string"}, {"enum", {"text", "image_url"}}}},
                 {"text", string()},
                 {"image_url", {{"type", "object"}, {"properties", {{"url", string()}}}}}}}};
  json message = {
      {"type", "object"},
      {"required", json::array({"role", "content"})},
      {"properties",
       {{"role", {{"type", "string"}, {"enum", {"system", "developer", "user", "assistant", "tool"}}}},
        {"content", {{"oneOf", json::array({string(), array_of(part), {{"type", "null"}}})}}},
        {"name", string()},
        {"tool_call_id", string()},
        {"tool_calls", array_of({{"type", "object"},
                                 {"properties",
                                  {{"id", string()},
                                   {"type", {{"type", "string"}, {"enum", json::array({"function"})}}},
                                   {"function",
                                    {{"type", "object"}, {"properties", {{"name", string()}, {"arguments", string()}}}}}}}})},
        {"reasoning_content", string()}}}};
  json tool = {{"type", "object"},
               {"required", json::array({"type", "function"})},
               {"properties",
                {{"type", {{"type", "string"}, {"enum", json::array({"function"})}}},
                 {"function",
                  {{"type", "object"},
                   {"required", json::array({"name"})},
                   {"properties",
                    {{"name", {{"type", "string"}, {"pattern", "^[a-zA-Z0-9_-]{1,64}$"}}},
                     {"description", string()},
                     {"parameters", {{"type", "object"}}}}}}}}}};
  json response_format = {
      {"type", "object"},
      {"required", json::array({"type"})},
      {"properties",
       {{"type", {{"type", "string"}, {"enum", {"text", "json_object", "json_schema"}}}},
        {"json_schema",
         {{"type", "object"},
          {"required", json::array({"name", "schema"})},
          {"properties", {{"name", string()}, {"schema", {{"type", "object"}}}, {"strict", boolean()}}}}}}}};
  json structured = {{"type", "object"},
                     {"properties",
                      {{"json", {{"type", "object"}}},
                       {"regex", string()},
                       {"choice", array_of(string())},
                       {"grammar", string()},
                       {"json_object", boolean()}}}};
  json tokenize = {{"oneOf", json::array({{{"type", "object"},
                                           {"required", json::array({"prompt"})},
                                           {"properties",
                                            {{"model", string()},
                                             {"prompt", string()},
                                             {"add_special_tokens", boolean()},
                                             {"return_token_strs", boolean()}}}},
                                          {{"type", "object"},
                                           {"required", json::array({"messages"})},
                                           {"properties",
                                            {{"model", string()},
                                             {"messages", {{"type", "array"}, {"minItems", 1}, {"items", ref("ChatMessage")}}},
                                             {"return_token_strs", boolean()}}}}})}};
  json detokenize = {{"type", "object"},
                     {"required", json::array({"tokens"})},
                     {"properties", {{"model", string()}, {"tokens", array_of(integer(0, 1 << 30))}}}};

  auto body = [](const std::string& schema) {
    return json{{"required", true}, {"content", {{"application/json", {{"schema", ref(schema)}}}}}};
  };
  json errors = {{"description", "an OpenAI error object"},
                 {"content", {{"application/json", {{"schema", ref("ErrorResponse")}}}}}};
  auto op = [&](const std::string& summary, const std::string& id, const std::string& schema) {
    json o = {{"summary", summary}, {"operationId", id}};
    if (!schema.empty()) o["requestBody"] = body(schema);
    o["responses"] = {{"200", {{"description", "OK"}}}, {"default", errors}};
    return o;
  };
  json paths = {
      {"/v1/completions", {{"post", op("Text completion (JSON or SSE)", "completions", "CompletionRequest")}}},
      {"/v1/chat/completions", {{"post", op("Chat completion (JSON or SSE)", "chat", "ChatCompletionRequest")}}},
      {"/v1/models", {{"get", op("The served model", "models", "")}}},
      {"/tokenize", {{"post", op("Text or messages to token ids", "tokenize", "TokenizeRequest")}}},
      {"/detokenize", {{"post", op("Token ids to text", "detokenize", "DetokenizeRequest")}}},
      {"/health", {{"get", op("200 while the engine serves, 503 once it stops or shuts down", "health", "")}}},
      {"/ping", {{"get", op("Same as /health", "ping", "")}, {"post", op("Same as /health", "ping_post", "")}}},
      {"/version", {{"get", op("Server version", "version", "")}}},
      {"/metrics", {{"get", op("Prometheus metrics (vLLM names)", "metrics", "")}}},
      {"/openapi.json", {{"get", op("This document", "openapi", "")}}},
  };
  return {{"openapi", "3.1.0"},
          {"info", {{"title", "ml4 OpenAI-compatible server"}, {"version", "0.1"}}},
          {"paths", paths},
          {"components",
           {{"schemas",
             {{"CompletionRequest", {{"type", "object"}, {"required", json::array({"prompt"})}, {"properties", completion}}},
              {"ChatCompletionRequest", {{"type", "object"}, {"required", json::array({"messages"})}, {"properties", chat}}},
              {"ChatMessage", message},
              {"Tool", tool},
              {"ResponseFormat", response_format},
              {"StructuredOutputs", structured},
              {"TokenizeRequest", tokenize},
              {"DetokenizeRequest", detokenize},
              {"ErrorResponse", error}}}}}};
}

}  // namespace

const std::string& openapi_json() {
  static const std::string doc = build().dump();
  return doc;
}

}  // namespace ml4
