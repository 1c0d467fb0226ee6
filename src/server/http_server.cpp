// OpenAiServer (design in http_server.h).
#include "server/http_server.h"

#include <httplib.h>

#include <chrono>
#include <random>
#include <thread>

#include "core/log.h"
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

// One API call's generation, shared by the content provider and its releaser. Dying
// unfinished (client gone, server stopping) aborts the engine requests.
struct GenerationState {
  AsyncEngine* engine = nullptr;
  std::shared_ptr<OutputStream> stream;
  std::unique_ptr<ApiRequest> req;
  std::unique_ptr<ChoiceBuilder> builder;
  bool started = false;
  bool finished = false;
  std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
  ~GenerationState() {
    if (!finished && engine) engine->abort(stream);
  }
};

}  // namespace

OpenAiServer::OpenAiServer(AsyncEngine* engine, const TextCodec* codec, ServerMetrics* metrics,
                           const ServerOptions& options)
    : engine_(engine), codec_(codec), options_(options), http_(std::make_unique<httplib::Server>()), metrics_(metrics) {
  install_routes();
}

OpenAiServer::~OpenAiServer() { stop(); }

Status OpenAiServer::bind() {
  if (options_.port == 0) {
    port_ = http_->bind_to_any_port(options_.host);
    if (port_ <= 0) return io_error("cannot bind {} on any port", options_.host);
  } else {
    if (!http_->bind_to_port(options_.host, options_.port))
      return io_error("cannot bind {}:{} (in use, or not a local address)", options_.host, options_.port);
    port_ = options_.port;
  }
  return Status::ok();
}

Status OpenAiServer::serve() {
  if (!http_->listen_after_bind()) return io_error("the HTTP listener on port {} failed", port_);
  return Status::ok();
}

void OpenAiServer::stop() {
  if (http_) http_->stop();
}

void OpenAiServer::drain_and_stop(double grace_s) {
  engine_->set_draining();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  while (!engine_->idle() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
  // Give providers a moment to write their last events.
  std::this_thread::sleep_for(100ms);
  stop();
}

void OpenAiServer::install_routes() {
  httplib::Server& s = *http_;
  const int threads = std::max(8, options_.http_threads);
  s.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  s.set_payload_max_length(options_.max_body_bytes);
  s.set_read_timeout(30, 0);
  s.set_write_timeout(30, 0);
  s.set_keep_alive_max_count(1000);

  auto send_error = [this](httplib::Response& res, int status, const std::string& msg) {
    res.status = status;
    res.set_content(error_json(status, msg).dump(), "application/json");
    metrics_->on_http_error(status);
  };
  auto authorized = [this, send_error](const httplib::Request& req, httplib::Response& res) {
    if (options_.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + options_.api_key) return true;
    send_error(res, 401, "invalid or missing API key");
    return false;
  };

  s.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
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

  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    EngineHealth h = engine_->health();
    if (h.ok) {
      res.status = 200;
      res.set_content("", "text/plain");
    } else {
      res.status = 503;
      res.set_content(error_json(503, h.reason).dump(), "application/json");
    }
  });
  s.Get("/version", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"version":"ml4-0.1"})", "application/json");
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_->render(engine_->snapshot()), "text/plain; version=0.0.4; charset=utf-8");
  });
  s.Get("/v1/models", [this, authorized](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    ojson m = {{"id", options_.served_model_name}, {"object", "model"}, {"created", unix_now()},
               {"owned_by", "ml4"}, {"root", options_.served_model_name}, {"parent", nullptr},
               {"max_model_len", engine_->engine().max_model_len()}};
    res.set_content(ojson({{"object", "list"}, {"data", ojson::array({m})}}).dump(), "application/json");
  });

  auto parse_body = [send_error](const httplib::Request& req, httplib::Response& res, ojson* body) {
    try {
      *body = ojson::parse(req.body);
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

  s.Post("/tokenize", [this, parse_body, send_error](const httplib::Request& req, httplib::Response& res) {
    ojson body;
    if (!parse_body(req, res, &body)) return;
    Result<std::vector<int32_t>> ids = std::vector<int32_t>{};
    if (body.contains("messages")) {
      ids = codec_->encode_chat(body);
    } else if (body.contains("prompt") && body["prompt"].is_string()) {
      bool add_special = !body.contains("add_special_tokens") || body["add_special_tokens"].is_boolean() == false ||
                         body["add_special_tokens"].get<bool>();
      ids = codec_->encode(body["prompt"].get<std::string>(), add_special);
    } else {
      return send_error(res, 400, "'prompt' (a string) or 'messages' is required");
    }
    if (!ids.ok()) return send_error(res, http_status_for(ids.status()), ids.status().message());
    ojson out = {{"count", ids.value().size()}, {"max_model_len", engine_->engine().max_model_len()},
                 {"tokens", ids.value()}};
    res.set_content(out.dump(), "application/json");
  });
  s.Post("/detokenize", [this, parse_body, send_error](const httplib::Request& req, httplib::Response& res) {
    ojson body;
    if (!parse_body(req, res, &body)) return;
    if (!body.contains("tokens") || !body["tokens"].is_array())
      return send_error(res, 400, "'tokens' must be an array of token ids");
    std::vector<int32_t> ids;
    for (const auto& t : body["tokens"]) {
      if (!t.is_number_integer()) return send_error(res, 400, "'tokens' must be an array of token ids");
      int64_t v = t.get<int64_t>();
      if (v < 0 || v >= codec_->vocab_size())
        return send_error(res, 400, fmt::format("token id {} is outside the vocabulary [0, {})", v, codec_->vocab_size()));
      ids.push_back(static_cast<int32_t>(v));
    }
    res.set_content(ojson({{"prompt", codec_->decode(ids, false)}}).dump(), "application/json");
  });

  auto generate = [this, parse_body, send_error, authorized](bool chat) {
    return [this, chat, parse_body, send_error, authorized](const httplib::Request& hreq, httplib::Response& res) {
      if (!authorized(hreq, res)) return;
      if (engine_->draining()) return send_error(res, 503, "the server is shutting down");
      if (!engine_->health().ok) return send_error(res, 503, "the engine is down: " + engine_->health().reason);
      ojson body;
      if (!parse_body(hreq, res, &body)) return;
      Result<ApiRequest> parsed = parse_api_request(body, chat, *codec_);
      if (!parsed.ok()) return send_error(res, http_status_for(parsed.status()), parsed.status().message());
      auto state = std::make_shared<GenerationState>();
      state->req = std::make_unique<ApiRequest>(std::move(parsed).value());
      ApiRequest& ar = *state->req;
      if (!ar.model.empty() && ar.model != options_.served_model_name)
        return send_error(res, 404, fmt::format("The model `{}` does not exist.", ar.model));
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
      state->stream = submitted.value();
      state->builder = std::make_unique<ChoiceBuilder>(ar, *codec_, id, options_.served_model_name, unix_now());
      const auto slice = std::chrono::milliseconds(static_cast<int>(options_.keepalive_s * 1000));
      if (ar.stream) {
        res.set_header("Cache-Control", "no-cache");
        res.set_chunked_content_provider(
            "text/event-stream",
            [state, slice](size_t, httplib::DataSink& sink) {
              auto write_all = [&](const std::vector<std::string>& events) {
                for (const auto& e : events)
                  if (!sink.write(e.data(), e.size())) return false;
                return true;
              };
              if (!state->started) {
                state->started = true;
                if (!write_all(state->builder->stream_start())) return false;
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
            [state, slice](size_t, httplib::DataSink& sink) {
              auto item = state->stream->next(slice);
              if (item) {
                state->builder->add(*item);
                while (auto more = state->stream->next(0ms)) state->builder->add(*more);
              }
              if (state->stream->done()) {
                state->finished = true;
                std::string out = state->builder->error().empty()
                                      ? state->builder->final_json().dump(-1, ' ', false, ojson::error_handler_t::replace)
                                      : error_json(500, state->builder->error()).dump();
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
  s.Post("/v1/completions", generate(false));
  s.Post("/v1/chat/completions", generate(true));
}

}  // namespace ml4
