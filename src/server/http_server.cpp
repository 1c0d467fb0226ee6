// OpenAiServer (design in http_server.h).
#include "server/http_server.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "core/log.h"
#include "server/http_body.h"
#include "server/http_listen.h"
#include "server/openapi.h"
#include "server/openai_protocol.h"

namespace ml4 {
namespace {

using namespace std::chrono_literals;

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string random_hex(int n) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* kHex = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = kHex[rng() & 15];
  return s;
}

int http_status_for(const Status& st) {
  switch (st.code()) {
    case StatusCode::kOk: return 200;
    case StatusCode::kInvalidArgument: return 400;
    case StatusCode::kOutOfRange: return 400;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kResourceExhausted: return 429;
    case StatusCode::kUnimplemented: return 400;
    case StatusCode::kInternal: return 500;
    case StatusCode::kIo: return 500;
  }
  return 500;
}

// The routes and their methods (HEAD goes with GET, as httplib serves it).
struct Route {
  const char* path;
  bool get, post;
};
constexpr Route kRoutes[] = {
    {"/health", true, false},     {"/ping", true, true},         {"/version", true, false},
    {"/metrics", true, false},    {"/openapi.json", true, false}, {"/v1/models", true, false},
    {"/tokenize", false, true},   {"/detokenize", false, true},  {"/v1/completions", false, true},
    {"/v1/chat/completions", false, true}, {"/kv_transfer/metadata", true, false},  // P/D side channel
};

const Route* find_route(const std::string& path) {
  for (const auto& r : kRoutes)
    if (path == r.path) return &r;
  return nullptr;
}

// One API call's generation, shared by the content provider and its releaser. Dying
// unfinished (client gone, server stopping) aborts the engine requests.
struct GenerationState {
  std::atomic<int>* active = nullptr;  // the server's count of responses being written
  AsyncEngine* engine = nullptr;
  std::shared_ptr<OutputStream> stream;
  std::unique_ptr<ApiRequest> req;
  std::unique_ptr<ChoiceBuilder> builder;
  bool started = false;
  bool finished = false;
  std::optional<transfer::RemoteKvSource> kv_source;  // P/D producer: the held blocks
  std::string kv_host;  // where consumers reach this server (kv_transfer_params.h)
  int kv_port = 0;
  std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
  ~GenerationState() {
    if (!finished && engine) engine->abort(stream);
    if (active) --*active;
  }
};

}  // namespace

OpenAiServer::OpenAiServer(AsyncEngine* engine, const TextCodec* codec, ServerMetrics* metrics,
                           const ServerOptions& options)
    : engine_(engine),
      codec_(codec),
      options_(options),
      http_(std::make_unique<httplib::Server>()),
      metrics_(metrics),
      structured_(std::make_unique<StructuredOutputCompiler>(*codec, engine->engine().vocab_size())) {
  if (options_.kv_connector != nullptr && options_.kv_connector->consumer())
    kv_loader_ = std::make_unique<KvPeerLoader>(options_.kv_connector, options_.api_key);
  // Streams write small events: without TCP_NODELAY Nagle holds each until the client's
  // delayed ACK (~40 ms on Linux), which showed up as TTFT (uvicorn, vLLM's server, sets it too).
  http_->set_tcp_nodelay(true);
  install_routes();
}

OpenAiServer::~OpenAiServer() { stop(); }

Status OpenAiServer::prepare_structured_output(ApiRequest* ar) {
  if (!ar->grammar.any()) return ok_status();
  ML4_ASSIGN_OR_RETURN(ar->params.structured, structured_->compile(ar->grammar));
  return ok_status();
}

Status OpenAiServer::bind() {
  ML4_ASSIGN_OR_RETURN(port_, bind_http(*http_, options_.host, options_.port));
  return ok_status();
}

Status OpenAiServer::serve() {
  if (!http_->listen_after_bind()) return io_error("the HTTP listener on port {} failed", port_);
  return ok_status();
}

void OpenAiServer::stop() {
  if (http_) http_->stop();
}

void OpenAiServer::drain_and_stop(double grace_s) {
  draining_ = true;
  engine_->set_draining();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  while ((!engine_->idle() || active_.load() > 0) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(20ms);
  if (active_.load() > 0 || !engine_->idle()) {
    // Open responses end with an error event (their providers see expired_ within one
    // keep-alive slice) and abort their requests; wait for them to be written.
    ML4_LOG_WARN("serve: shutdown timeout reached with {} responses open; ending them with an error", active_.load());
    expired_ = true;
    const auto last = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (active_.load() > 0 && std::chrono::steady_clock::now() < last) std::this_thread::sleep_for(10ms);
  }
  stop();
}

void OpenAiServer::install_routes() {
  httplib::Server& s = *http_;
  const int threads = std::max(8, options_.http_threads);
  s.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // Bodies are read (and bounded) by read_body; this is httplib's own bound for any path
  // that would read one without it.
  s.set_payload_max_length(options_.max_body_bytes);
  s.set_read_timeout(30, 0);
  s.set_write_timeout(30, 0);
  s.set_keep_alive_max_count(1000);

  auto send_error = [this](httplib::Response& res, int status, const std::string& msg) {
    res.status = status;
    res.set_content(error_json(status, msg).dump(), "application/json");
    metrics_->on_http_error(status);
  };
  auto error_and_close = [this](httplib::Response& res, int status, const std::string& msg) {
    respond_and_close(res, status, error_json(status, msg).dump());
    metrics_->on_http_error(status);
  };
  auto authorized = [this, send_error](const httplib::Request& req, httplib::Response& res) {
    if (options_.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + options_.api_key) return true;
    send_error(res, 401, "invalid or missing API key");
    return false;
  };

  // Everything but a known route with its method, and a body within the limit, is answered
  // here, before a byte of the body is read (see the header).
  auto gate = [this, error_and_close](const httplib::Request& req, httplib::Response& res) -> bool {
    const Framing f = check_framing(req, options_.max_body_bytes);
    auto refuse = [&](int status, const std::string& msg) {
      if (f.has_body) error_and_close(res, status, msg);
      else {
        res.status = status;
        res.set_content(error_json(status, msg).dump(), "application/json");
        metrics_->on_http_error(status);
      }
      return true;
    };
    if (f.status != 0) {
      error_and_close(res, f.status, f.message);
      return true;
    }
    const Route* route = find_route(req.path);
    if (!route) return refuse(404, "no route " + req.method + " " + req.path);
    const bool get_like = req.method == "GET" || req.method == "HEAD";
    if (!(get_like && route->get) && !(req.method == "POST" && route->post)) {
      res.set_header("Allow", route->get && route->post ? "GET, HEAD, POST" : route->get ? "GET, HEAD" : "POST");
      return refuse(405, fmt::format("method {} not allowed on {}", req.method, req.path));
    }
    if (get_like && f.has_body) return refuse(400, "a GET request carries no body");
    if (draining_ && req.path != "/metrics") return refuse(503, "the server is shutting down");
    return false;
  };
  s.set_pre_routing_handler([gate](const httplib::Request& req, httplib::Response& res) {
    return gate(req, res) ? httplib::Server::HandlerResponse::Handled : httplib::Server::HandlerResponse::Unhandled;
  });
  // Expect: 100-continue: refuse before the client sends the body at all.
  s.set_expect_100_continue_handler([gate](const httplib::Request& req, httplib::Response& res) {
    return gate(req, res) ? res.status : 100;
  });

  s.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty() || res.has_header("Content-Type")) return;  // answered already
    std::string msg = res.status == 404   ? "no route " + req.method + " " + req.path
                      : res.status == 413 ? fmt::format("request body too large (limit {} bytes)", options_.max_body_bytes)
                      : res.status == 405 ? "method not allowed"
                                          : fmt::format("HTTP error {}", res.status);
    res.set_content(error_json(res.status, msg).dump(), "application/json");
    metrics_->on_http_error(res.status);
  });
  s.set_exception_handler([send_error](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, 500, what);
  });

  auto health = [this](const httplib::Request&, httplib::Response& res) {
    EngineHealth h = engine_->health();
    if (draining_) h = {false, "the server is shutting down"};
    if (h.ok) {
      res.status = 200;
      res.set_content("", "text/plain");
    } else {
      res.status = 503;
      res.set_content(error_json(503, h.reason).dump(), "application/json");
    }
  };
  s.Get("/health", health);
  s.Get("/ping", health);
  s.Post("/ping", [health, this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
    std::string body;
    const int st = read_body(check_framing(req, options_.max_body_bytes), reader, options_.max_body_bytes, &body);
    if (st != 0) return respond_and_close(res, st, error_json(st, st == 413 ? "request body too large" : "bad body").dump());
    health(req, res);
  });
  s.Get("/version", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"version":"ml4-0.1"})", "application/json");
  });
  s.Get("/openapi.json", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(openapi_json(), "application/json");
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    const EngineSnapshot snap = engine_->snapshot();
    std::string body = metrics_->render(snap);
    if (options_.kv_connector != nullptr)
      body += render_kv_transfer_metrics(*options_.kv_connector, options_.served_model_name, snap.blocks_held_for_remote);
    res.set_content(body, "text/plain; version=0.0.4; charset=utf-8");
  });
  // P/D side channel: the producer's connector metadata (kv_transfer_params.h).
  s.Get("/kv_transfer/metadata", [this, authorized, send_error](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    if (options_.kv_connector == nullptr || !options_.kv_connector->producer())
      return send_error(res, 404, "this server is not a KV producer (--kv-transfer-config kv_role kv_producer)");
    res.set_content(options_.kv_connector->metadata(), "application/octet-stream");
  });
  s.Get("/v1/models", [this, authorized](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    ojson m = {{"id", options_.served_model_name}, {"object", "model"}, {"created", unix_now()},
               {"owned_by", "ml4"}, {"root", options_.served_model_name}, {"parent", nullptr},
               {"max_model_len", engine_->engine().max_model_len()}};
    res.set_content(ojson({{"object", "list"}, {"data", ojson::array({m})}}).dump(), "application/json");
  });

  auto parse_body = [send_error](const std::string& text, httplib::Response& res, ojson* body) {
    try {
      *body = ojson::parse(text);
    } catch (const std::exception& e) {
      send_error(res, 400, std::string("invalid JSON body: ") + e.what());
      return false;
    }
    if (!body->is_object()) {
      send_error(res, 400, "the request body must be a JSON object");
      return false;
    }
    return true;
  };
  auto model_ok = [this, send_error](const ojson& body, httplib::Response& res) {
    auto it = body.find("model");
    if (it == body.end() || it->is_null()) return true;
    if (!it->is_string()) {
      send_error(res, 400, "'model' must be a string");
      return false;
    }
    if (it->get<std::string>() == options_.served_model_name) return true;
    send_error(res, 404, fmt::format("The model `{}` does not exist.", it->get<std::string>()));
    return false;
  };
  // A POST route: the body is read under the limit, then parsed as a JSON object.
  using BodyHandler = std::function<void(const httplib::Request&, const ojson&, httplib::Response&)>;
  auto post = [this, &s, parse_body, error_and_close, authorized](const char* path, BodyHandler handler) {
    s.Post(path, [this, path, parse_body, error_and_close, authorized, handler](
                     const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
      std::string text;
      const int st = read_body(check_framing(req, options_.max_body_bytes), reader, options_.max_body_bytes, &text);
      if (st == 413)
        return error_and_close(res, 413, fmt::format("request body too large (limit {} bytes)", options_.max_body_bytes));
      if (st != 0) return error_and_close(res, st, "the request body could not be read (bad chunked framing?)");
      // The key guards /v1 (as vLLM's middleware); /tokenize and /detokenize stay open.
      if (std::string_view(path).rfind("/v1/", 0) == 0 && !authorized(req, res)) return;
      ojson body;
      if (!parse_body(text, res, &body)) return;
      handler(req, body, res);
    });
  };

  post("/tokenize", [this, send_error, model_ok](const httplib::Request&, const ojson& body, httplib::Response& res) {
    if (!model_ok(body, res)) return;
    bool want_strs = false;
    if (auto it = body.find("return_token_strs"); it != body.end() && !it->is_null()) {
      if (!it->is_boolean()) return send_error(res, 400, "'return_token_strs' must be a boolean");
      want_strs = it->get<bool>();
    }
    Result<std::vector<int32_t>> ids = std::vector<int32_t>{};
    if (body.contains("messages")) {
      ids = codec_->encode_chat(body);
    } else if (body.contains("prompt") && body["prompt"].is_string()) {
      bool add_special = true;
      if (auto it = body.find("add_special_tokens"); it != body.end() && !it->is_null()) {
        if (!it->is_boolean()) return send_error(res, 400, "'add_special_tokens' must be a boolean");
        add_special = it->get<bool>();
      }
      ids = codec_->encode(body["prompt"].get<std::string>(), add_special);
    } else {
      return send_error(res, 400, "'prompt' (a string) or 'messages' is required");
    }
    if (!ids.ok()) return send_error(res, http_status_for(ids.status()), ids.status().message());
    ojson out = {{"count", ids.value().size()}, {"max_model_len", engine_->engine().max_model_len()},
                 {"tokens", ids.value()}, {"token_strs", nullptr}};
    if (want_strs) {
      ojson strs = ojson::array();
      for (int32_t id : ids.value()) strs.push_back(sanitize_utf8(codec_->token_bytes(id)));
      out["token_strs"] = strs;
    }
    res.set_content(out.dump(), "application/json");
  });
  post("/detokenize", [this, send_error, model_ok](const httplib::Request&, const ojson& body, httplib::Response& res) {
    if (!model_ok(body, res)) return;
    if (!body.contains("tokens") || !body["tokens"].is_array())
      return send_error(res, 400, "'tokens' must be an array of token ids");
    std::vector<int32_t> ids;
    for (const auto& t : body["tokens"]) {
      if (!t.is_number_integer()) return send_error(res, 400, "'tokens' must be an array of token ids");
      int64_t v = t.is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(t.get<uint64_t>(), INT64_MAX))
                                         : t.get<int64_t>();
      if (v < 0 || v >= codec_->vocab_size())
        return send_error(res, 400, fmt::format("token id {} is outside the vocabulary [0, {})", v, codec_->vocab_size()));
      ids.push_back(static_cast<int32_t>(v));
    }
    res.set_content(ojson({{"prompt", codec_->decode(ids, false)}}).dump(), "application/json");
  });

  auto generate = [this, send_error](bool chat) {
    return [this, chat, send_error](const httplib::Request&, const ojson& body, httplib::Response& res) {
      if (draining_ || engine_->draining()) return send_error(res, 503, "the server is shutting down");
      if (!engine_->health().ok) return send_error(res, 503, "the engine is down: " + engine_->health().reason);
      Result<ApiRequest> parsed = parse_api_request(body, chat, *codec_);
      if (!parsed.ok()) return send_error(res, http_status_for(parsed.status()), parsed.status().message());
      auto state = std::make_shared<GenerationState>();
      state->req = std::make_unique<ApiRequest>(std::move(parsed).value());
      ApiRequest& ar = *state->req;
      if (!ar.model.empty() && ar.model != options_.served_model_name)
        return send_error(res, 404, fmt::format("The model `{}` does not exist.", ar.model));
      if (Status st = prepare_structured_output(&ar); !st.ok())
        return send_error(res, http_status_for(st), st.message());
      Result<transfer::KvTransferRequest> kv = parse_kv_transfer_params(body);
      if (!kv.ok()) return send_error(res, 400, kv.status().message());
      if (kv->do_remote_decode || kv->remote_prefill) {
        if (ar.prompts.size() != 1 || ar.params.n != 1)
          return send_error(res, 400, "kv_transfer_params: one prompt and n = 1 per request");
        if (kv->do_remote_decode && ar.stream)
          return send_error(res, 400, "kv_transfer_params: do_remote_decode answers with stream: false");
        if (kv->remote_prefill) {
          if (!kv_loader_)
            return send_error(res, 400,
                              "kv_transfer_params: do_remote_prefill needs a server started with --kv-transfer-config "
                              "kv_role kv_consumer or kv_both");
          Status st = kv_loader_->ensure(*kv->remote_prefill);
          if (!st.ok()) return send_error(res, 502, st.message());
        }
      }
      const std::string id = fmt::format("{}-{}{}", chat ? "chatcmpl" : "cmpl", random_hex(16), next_id_++);
      std::vector<GenerateRequest> reqs;
      for (size_t p = 0; p < ar.prompts.size(); ++p) {
        for (int j = 0; j < ar.params.n; ++j) {
          GenerateRequest g;
          g.request_id = fmt::format("{}-{}", id, p * ar.params.n + j);
          g.prompt = ar.prompts[p];
          g.params = params_for_prompt(ar, p, engine_->engine().max_model_len());
          // n > 1 with a seed: choice j uses seed + j, so choices differ yet reproduce.
          if (g.params.seed) g.params.seed = *g.params.seed + static_cast<uint64_t>(j);
          g.priority = ar.priority;
          g.kv = kv.value();
          reqs.push_back(std::move(g));
        }
      }
      auto submitted = engine_->submit(std::move(reqs));
      if (!submitted.ok()) {
        const Status& st = submitted.status();
        int code = st.code() == StatusCode::kResourceExhausted ? 429
                   : st.code() == StatusCode::kInvalidArgument ? 400 : 503;
        if (code == 429) res.set_header("Retry-After", "1");
        return send_error(res, code, st.message());
      }
      state->engine = engine_;
      state->kv_host = options_.kv_host;
      state->kv_port = port_;
      state->stream = submitted.value();
      state->active = &active_;
      ++active_;
      state->builder = std::make_unique<ChoiceBuilder>(ar, *codec_, id, options_.served_model_name, unix_now());
      const auto slice = std::chrono::milliseconds(static_cast<int>(options_.keepalive_s * 1000));
      std::atomic<bool>* expired = &expired_;
      if (ar.stream) {
        res.set_header("Cache-Control", "no-cache");
        res.set_chunked_content_provider(
            "text/event-stream",
            [state, slice, expired](size_t, httplib::DataSink& sink) {
              auto write_all = [&](const std::vector<std::string>& events) {
                for (const auto& e : events)
                  if (!sink.write(e.data(), e.size())) return false;
                return true;
              };
              if (!state->started) {
                state->started = true;
                if (!write_all(state->builder->stream_start())) return false;
              }
              if (expired->load() && !state->stream->done()) {
                // Shutdown deadline: an error event and [DONE], never a cut connection.
                state->finished = true;
                state->engine->abort(state->stream);
                if (!write_all(state->builder->stream_abort("the server shut down before the request finished")))
                  return false;
                sink.done();
                return true;
              }
              auto item = state->stream->next(slice);
              if (!item) {
                static const std::string kPing = ": keep-alive\n\n";
                return sink.write(kPing.data(), kPing.size());
              }
              if (!write_all(state->builder->add(*item))) return false;
              while (auto more = state->stream->next(0ms))
                if (!write_all(state->builder->add(*more))) return false;
              if (state->stream->done()) {
                state->finished = true;
                if (!write_all(state->builder->stream_end())) return false;
                sink.done();
              }
              return true;
            },
            [state](bool success) {
              if (!success && !state->finished) {
                state->finished = true;
                state->engine->abort(state->stream);
              }
            });
      } else {
        res.set_chunked_content_provider(
            "application/json",
            [state, slice, expired](size_t, httplib::DataSink& sink) {
              if (expired->load() && !state->stream->done()) {
                state->finished = true;
                state->engine->abort(state->stream);
                const std::string out = error_json(503, "the server shut down before the request finished").dump();
                if (!sink.write(out.data(), out.size())) return false;
                sink.done();
                return true;
              }
              auto take = [&](const StreamItem& it) {
                if (it.out.kv_source) state->kv_source = it.out.kv_source;  // P/D producer
                state->builder->add(it);
              };
              auto item = state->stream->next(slice);
              if (item) {
                take(*item);
                while (auto more = state->stream->next(0ms)) take(*more);
              }
              if (state->stream->done()) {
                state->finished = true;
                std::string out;
                if (!state->builder->error().empty()) {
                  out = error_json(500, state->builder->error()).dump();
                } else {
                  ojson j = state->builder->final_json();
                  if (state->kv_source) {
                    state->kv_source->host = state->kv_host;
                    state->kv_source->port = state->kv_port;
                    j["kv_transfer_params"] = kv_transfer_params_json(*state->kv_source);
                  }
                  out = j.dump(-1, ' ', false, ojson::error_handler_t::replace);
                }
                if (!sink.write(out.data(), out.size())) return false;
                sink.done();
                return true;
              }
              // Probe the connection about once a second: leading whitespace is valid JSON.
              auto now = std::chrono::steady_clock::now();
              if (now - state->last_write > 1s) {
                state->last_write = now;
                return sink.write(" ", 1);
              }
              return true;
            },
            [state](bool success) {
              if (!success && !state->finished) {
                state->finished = true;
                state->engine->abort(state->stream);
              }
            });
      }
    };
  };
  post("/v1/completions", generate(false));
  post("/v1/chat/completions", generate(true));
}

}  // namespace ml4
