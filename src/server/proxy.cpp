// PdProxy (design in proxy.h).
#include "server/proxy.h"

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/log.h"
#include "server/http_body.h"
#include "server/http_listen.h"
#include "server/openai_protocol.h"

namespace ml4 {
namespace {

using namespace std::chrono_literals;

// One HTTP POST to an instance on its own thread; the answer's body comes through a queue
// piece by piece, so the proxy writes it on as it arrives and can cancel it (closing the
// connection) when its own client is gone.
class Leg {
 public:
  Leg(const PdProxy::Backend& b, std::string path, std::string body, httplib::Headers headers, double timeout_s)
      : cli_(std::make_unique<httplib::Client>(b.host, b.port)) {
    cli_->set_connection_timeout(5, 0);
    const auto t = static_cast<time_t>(timeout_s);
    cli_->set_read_timeout(t, 0);
    cli_->set_write_timeout(t, 0);
    thread_ = std::thread([this, path = std::move(path), body = std::move(body), headers = std::move(headers)] {
      httplib::Request req;
      req.method = "POST";
      req.path = path;
      req.headers = headers;
      req.set_header("Content-Type", "application/json");
      req.body = body;
      req.response_handler = [this](const httplib::Response& r) {
        std::lock_guard<std::mutex> lk(mu_);
        status_ = r.status;
        content_type_ = r.get_header_value("Content-Type");
        cv_.notify_all();
        return !cancelled_.load();
      };
      req.content_receiver = [this](const char* data, size_t n, uint64_t, uint64_t) {
        if (cancelled_) return false;
        std::lock_guard<std::mutex> lk(mu_);
        chunks_.emplace_back(data, n);
        cv_.notify_all();
        return true;
      };
      auto res = cli_->send(req);
      std::lock_guard<std::mutex> lk(mu_);
      if (!res) {
        error_ = httplib::to_string(res.error());
        if (status_ != 0) error_ = "the answer was cut off (" + error_ + ")";
      }
      ended_ = true;
      cv_.notify_all();
    });
  }
  ~Leg() {
    cancel();
    if (thread_.joinable()) thread_.join();
  }

  void cancel() {
    bool ended;
    {
      std::lock_guard<std::mutex> lk(mu_);
      ended = ended_;
    }
    if (!ended && !cancelled_.exchange(true)) cli_->stop();
  }
  // True once the status line arrived or the call failed.
  bool wait_headers(std::chrono::milliseconds t) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, t, [&] { return status_ != 0 || ended_; });
  }
  bool wait_end(std::chrono::milliseconds t) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, t, [&] { return ended_; });
  }
  int status() {
    std::lock_guard<std::mutex> lk(mu_);
    return status_;
  }
  std::string error() {
    std::lock_guard<std::mutex> lk(mu_);
    return error_;
  }
  std::string content_type() {
    std::lock_guard<std::mutex> lk(mu_);
    return content_type_;
  }
  std::optional<std::string> next(std::chrono::milliseconds t) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!cv_.wait_for(lk, t, [&] { return !chunks_.empty() || ended_; }) || chunks_.empty()) return std::nullopt;
    std::string c = std::move(chunks_.front());
    chunks_.pop_front();
    return c;
  }
  // True when the call ended and every piece was taken.
  bool drained() {
    std::lock_guard<std::mutex> lk(mu_);
    return ended_ && chunks_.empty();
  }
  std::string read_all() {
    wait_end(std::chrono::hours(24));
    std::lock_guard<std::mutex> lk(mu_);
    std::string s;
    for (auto& c : chunks_) s += c;
    chunks_.clear();
    return s;
  }

 private:
  std::unique_ptr<httplib::Client> cli_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> cancelled_{false};
  bool ended_ = false;
  int status_ = 0;
  std::string error_, content_type_;
  std::deque<std::string> chunks_;
};

std::string random_hex(int n) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* kHex = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = kHex[rng() & 15];
  return s;
}

// The message inside an instance's error body, or the body itself.
std::string error_message(const std::string& body) {
  try {
    auto j = nlohmann::json::parse(body);
    if (j.contains("error") && j["error"].contains("message")) return j["error"]["message"].get<std::string>();
  } catch (const std::exception&) {
  }
  return body.substr(0, 300);
}

std::string sse_error(int status, const std::string& message) {
  return "data: " + error_json(status, message).dump() + "\n\ndata: [DONE]\n\n";
}

// Streaming request: both legs inside the response (proxy.h).
struct StreamJob {
  std::shared_ptr<Leg> prefill, decode;
  bool ended = false;
};

}  // namespace

Result<PdProxy::Backend> parse_backend_url(const std::string& url) {
  const std::string prefix = "http://";
  if (url.rfind(prefix, 0) != 0) return invalid_argument("'{}': instance URLs look like http://host:port", url);
  std::string rest = url.substr(prefix.size());
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || rest.find('/') != std::string::npos)
    return invalid_argument("'{}': instance URLs look like http://host:port", url);
  PdProxy::Backend b;
  b.url = url;
  b.host = rest.substr(0, colon);
  try {
    size_t used = 0;
    b.port = std::stoi(rest.substr(colon + 1), &used);
    if (used != rest.size() - colon - 1 || b.port < 1 || b.port > 65535) throw std::out_of_range(url);
  } catch (const std::exception&) {
    return invalid_argument("'{}': the port must be a number in [1, 65535]", url);
  }
  return b;
}

Result<std::unique_ptr<PdProxy>> PdProxy::create(const ProxyOptions& options) {
  if (options.prefill_urls.empty() || options.decode_urls.empty())
    return invalid_argument("the proxy needs at least one --prefill and one --decode instance");
  std::unique_ptr<PdProxy> p(new PdProxy(options));
  for (const auto& u : options.prefill_urls) {
    ML4_ASSIGN_OR_RETURN(Backend b, parse_backend_url(u));
    p->prefill_.push_back(b);
  }
  for (const auto& u : options.decode_urls) {
    ML4_ASSIGN_OR_RETURN(Backend b, parse_backend_url(u));
    p->decode_.push_back(b);
  }
  p->install_routes();
  return p;
}

PdProxy::PdProxy(ProxyOptions options) : options_(std::move(options)), http_(std::make_unique<httplib::Server>()) {}

PdProxy::~PdProxy() { stop(); }

Status PdProxy::bind() {
  ML4_ASSIGN_OR_RETURN(port_, bind_http(*http_, options_.host, options_.port));
  return ok_status();
}

Status PdProxy::serve() {
  if (!http_->listen_after_bind()) return io_error("the HTTP listener on port {} failed", port_);
  return ok_status();
}

void PdProxy::stop() {
  if (http_) http_->stop();
}

void PdProxy::install_routes() {
  httplib::Server& s = *http_;
  const int threads = std::max(8, options_.http_threads);
  s.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // Bodies as the OpenAI server bounds them (server/http_body.h): framing checked before a
  // byte is read, the body read under the limit, an unread body never parsed as a request.
  const size_t limit = options_.max_body_bytes;
  s.set_payload_max_length(limit);
  s.set_read_timeout(30, 0);
  s.set_write_timeout(30, 0);
  s.set_pre_routing_handler([limit](const httplib::Request& req, httplib::Response& res) {
    const Framing f = check_framing(req, limit);
    if (f.status == 0) return httplib::Server::HandlerResponse::Unhandled;
    respond_and_close(res, f.status, error_json(f.status, f.message).dump());
    return httplib::Server::HandlerResponse::Handled;
  });

  auto send_error = [](httplib::Response& res, int status, const std::string& msg) {
    res.status = status;
    res.set_content(error_json(status, msg).dump(), "application/json");
  };
  auto authorized = [this, send_error](const httplib::Request& req, httplib::Response& res) {
    if (options_.api_key.empty() || req.get_header_value("Authorization") == "Bearer " + options_.api_key) return true;
    send_error(res, 401, "invalid or missing API key");
    return false;
  };
  auto upstream_headers = [this](const std::string& request_id) {
    httplib::Headers h{{"X-Request-Id", request_id}};
    if (!options_.api_key.empty()) h.emplace("Authorization", "Bearer " + options_.api_key);
    return h;
  };

  s.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("", "text/plain"); });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    std::string o;
    auto counter = [&](const char* name, const char* help, int64_t v) {
      o += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, v);
    };
    counter("ml4:proxy_requests_total", "Generation requests routed.", requests_.load());
    counter("ml4:proxy_failed_requests_total", "Requests that ended in an error.", failed_.load());
    counter("ml4:proxy_prefill_errors_total", "Prefill legs that failed.", prefill_errors_.load());
    counter("ml4:proxy_decode_errors_total", "Decode legs that failed.", decode_errors_.load());
    counter("ml4:proxy_client_aborts_total", "Requests whose client went away.", client_aborts_.load());
    res.set_content(o, "text/plain; version=0.0.4; charset=utf-8");
  });
  s.Get("/v1/models", [this, authorized, send_error, upstream_headers](const httplib::Request& req,
                                                                       httplib::Response& res) {
    if (!authorized(req, res)) return;
    const Backend& b = decode_[next_decode_++ % decode_.size()];
    httplib::Client cli(b.host, b.port);
    cli.set_connection_timeout(5, 0);
    auto r = cli.Get("/v1/models", upstream_headers("models"));
    if (!r) return send_error(res, 502, fmt::format("decode instance {}: {}", b.url, httplib::to_string(r.error())));
    res.status = r->status;
    res.set_content(r->body, "application/json");
  });

  auto generate = [this, authorized, send_error, upstream_headers](const char* path) {
    return [this, path, authorized, send_error, upstream_headers](
               const httplib::Request& hreq, httplib::Response& res, const httplib::ContentReader& reader) {
      std::string text;
      const int st = read_body(check_framing(hreq, options_.max_body_bytes), reader, options_.max_body_bytes, &text);
      if (st != 0) {
        const std::string msg = st == 413 ? fmt::format("request body too large (limit {} bytes)", options_.max_body_bytes)
                                          : std::string("the request body could not be read (bad chunked framing?)");
        return respond_and_close(res, st, error_json(st, msg).dump());
      }
      if (!authorized(hreq, res)) return;
      ++requests_;
      ojson body;
      try {
        body = ojson::parse(text);
      } catch (const std::exception& e) {
        ++failed_;
        return send_error(res, 400, std::string("invalid JSON body: ") + e.what());
      }
      if (!body.is_object()) {
        ++failed_;
        return send_error(res, 400, "the request body must be a JSON object");
      }
      if (body.contains("n") && !(body["n"].is_number_integer() && body["n"].get<int64_t>() == 1)) {
        ++failed_;
        return send_error(res, 400, "the P/D proxy serves n = 1 only (one prefill per choice is not supported)");
      }
      if (auto p = body.find("prompt"); p != body.end() && p->is_array() && !p->empty() && !(*p)[0].is_number_integer() &&
                                         p->size() > 1) {
        ++failed_;
        return send_error(res, 400, "the P/D proxy serves one prompt per request");
      }
      const bool stream = body.value("stream", false) == true;
      ojson pre_body = body;
      pre_body["max_tokens"] = 1;
      pre_body.erase("max_completion_tokens");
      pre_body.erase("min_tokens");
      pre_body["stream"] = false;
      pre_body.erase("stream_options");
      pre_body["kv_transfer_params"] = {{"do_remote_decode", true}};
      const std::string request_id = fmt::format("pd-{}{}", random_hex(16), next_id_++);
      const Backend pb = prefill_[next_prefill_++ % prefill_.size()];
      const Backend db = decode_[next_decode_++ % decode_.size()];
      const double timeout = options_.upstream_timeout_s;

      // After the prefill leg: the decode leg's body, or an error (status, message).
      auto decode_body = [this, body, pb](Leg& pre, int* status, std::string* err) -> std::optional<std::string> {
        const std::string answer = pre.read_all();
        if (pre.status() == 0 || !pre.error().empty()) {
          *status = 502;
          *err = fmt::format("prefill instance {}: {}", pb.url, pre.error().empty() ? "no answer" : pre.error());
          return std::nullopt;
        }
        if (pre.status() != 200) {
          *status = pre.status();
          *err = fmt::format("prefill instance {}: {}", pb.url, error_message(answer));
          return std::nullopt;
        }
        ojson j;
        try {
          j = ojson::parse(answer);
        } catch (const std::exception& e) {
          *status = 502;
          *err = fmt::format("prefill instance {} answered no JSON: {}", pb.url, e.what());
          return std::nullopt;
        }
        if (j.contains("error")) {
          *status = 502;
          *err = fmt::format("prefill instance {}: {}", pb.url, error_message(answer));
          return std::nullopt;
        }
        auto kv = j.find("kv_transfer_params");
        if (kv == j.end() || !kv->is_object()) {
          *status = 502;
          *err = fmt::format(
              "prefill instance {} answered without kv_transfer_params (is it started with --kv-transfer-config "
              "kv_role kv_producer?)",
              pb.url);
          return std::nullopt;
        }
        ojson d = body;
        d["kv_transfer_params"] = *kv;
        return d.dump();
      };

      if (!stream) {
        Leg pre(pb, path, pre_body.dump(), upstream_headers(request_id), timeout);
        int status = 0;
        std::string err;
        auto dbody = decode_body(pre, &status, &err);
        if (!dbody) {
          ++failed_;
          ++prefill_errors_;
          return send_error(res, status, err);
        }
        auto dec = std::make_shared<Leg>(db, path, *dbody, upstream_headers(request_id), timeout);
        while (!dec->wait_headers(1s)) {
        }
        if (dec->status() == 0) {
          ++failed_;
          ++decode_errors_;
          return send_error(res, 502, fmt::format("decode instance {}: {}", db.url, dec->error()));
        }
        if (dec->status() != 200) {
          ++failed_;
          ++decode_errors_;
          res.status = dec->status();
          res.set_content(dec->read_all(), "application/json");
          return;
        }
        // The decode instance writes whitespace while it works and its JSON at the end; if
        // it dies before the JSON, the body so far is blank and an error object completes it.
        auto blank = std::make_shared<bool>(true);
        res.set_chunked_content_provider(
            "application/json",
            [this, dec, blank, db](size_t, httplib::DataSink& sink) {
              if (auto c = dec->next(250ms)) {
                if (c->find_first_not_of(" \r\n\t") != std::string::npos) *blank = false;
                if (!sink.write(c->data(), c->size())) {
                  ++client_aborts_;
                  dec->cancel();
                  return false;
                }
                return true;
              }
              if (dec->drained()) {
                if (!dec->error().empty()) {
                  ++decode_errors_;
                  ++failed_;
                  if (*blank) {
                    const std::string e =
                        error_json(502, fmt::format("decode instance {}: {}", db.url, dec->error())).dump();
                    if (!sink.write(e.data(), e.size())) return false;
                  }
                }
                sink.done();
              }
              return true;
            },
            [dec](bool ok) {
              if (!ok) dec->cancel();
            });
        return;
      }

      // Streaming: both legs inside the response; SSE comments keep probing the client.
      auto job = std::make_shared<StreamJob>();
      job->prefill = std::make_shared<Leg>(pb, path, pre_body.dump(), upstream_headers(request_id), timeout);
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [this, job, decode_body, db, path, request_id, timeout, upstream_headers](size_t, httplib::DataSink& sink) {
            static const std::string kPing = ": keep-alive\n\n";
            auto fail = [&](int status, const std::string& msg) {
              ++failed_;
              const std::string e = sse_error(status, msg);
              job->ended = true;
              if (sink.write(e.data(), e.size())) sink.done();
              return true;
            };
            auto ping = [&] {
              if (sink.write(kPing.data(), kPing.size())) return true;
              ++client_aborts_;
              if (job->prefill) job->prefill->cancel();
              if (job->decode) job->decode->cancel();
              return false;
            };
            if (job->ended) return true;
            if (!job->decode) {
              if (!job->prefill->wait_end(250ms)) return ping();
              int status = 0;
              std::string err;
              auto dbody = decode_body(*job->prefill, &status, &err);
              if (!dbody) {
                ++prefill_errors_;
                return fail(status, err);
              }
              job->decode = std::make_shared<Leg>(db, path, *dbody, upstream_headers(request_id), timeout);
              return true;
            }
            Leg& dec = *job->decode;
            if (!dec.wait_headers(250ms)) return ping();
            if (dec.status() != 200) {
              ++decode_errors_;
              if (dec.status() == 0) return fail(502, fmt::format("decode instance {}: {}", db.url, dec.error()));
              return fail(dec.status(), fmt::format("decode instance {}: {}", db.url, error_message(dec.read_all())));
            }
            if (auto c = dec.next(250ms)) {
              if (!sink.write(c->data(), c->size())) {
                ++client_aborts_;
                dec.cancel();
                return false;
              }
              return true;
            }
            if (dec.drained()) {
              if (!dec.error().empty()) {
                ++decode_errors_;
                return fail(502, fmt::format("decode instance {}: {}", db.url, dec.error()));
              }
              job->ended = true;
              sink.done();
            }
            return true;
          },
          [job](bool ok) {
            if (!ok) {
              if (job->prefill) job->prefill->cancel();
              if (job->decode) job->decode->cancel();
            }
          });
    };
  };
  s.Post("/v1/completions", generate("/v1/completions"));
  s.Post("/v1/chat/completions", generate("/v1/chat/completions"));
}

}  // namespace ml4
