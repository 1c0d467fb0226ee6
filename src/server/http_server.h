// OpenAiServer: the HTTP face of an AsyncEngine (SYSTEM.md S14), on cpp-httplib.
//
// Routes: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models, /tokenize,
// /detokenize, /health, /ping, /metrics, /version, /openapi.json. Every error is an OpenAI error
// object with the status that fits: 400 bad input, 401 bad key, 404 unknown model or route, 405
// wrong method, 413 oversized body, 429 queue full, 503 draining or engine down, 500 engine
// failure.
//
// Request bodies: every request passes a pre-routing check before one byte of its body is read:
// an unknown route (404), a wrong method (405), duplicate or non-numeric Content-Length,
// Content-Length with Transfer-Encoding, a Transfer-Encoding other than chunked (400), a
// Content-Length above the limit (413 from the header). POST bodies are then read through
// httplib's content reader, counting bytes as they arrive whatever the framing, so a chunked
// body is cut at the limit with 413 too. Whenever a body is left unread the answer closes the
// connection (a content provider that reports failure after writing the whole answer is the
// only way httplib 0.11 offers), so the rest of a hostile body is never parsed as a request.
//
// Generation responses go through chunked content providers, for streaming and non-streaming
// alike: the handler thread waits on the request's OutputStream in short slices and writes
// as outputs arrive, so a client that went away is noticed at the next write (SSE comment
// keep-alives while a stream is idle; a leading space, valid JSON whitespace, every second
// while a non-streaming body waits) and its requests are aborted at once, giving their KV
// blocks back within one engine step. A GenerationState that dies unfinished aborts too, so
// no path can leak a live request.
//
// Shutdown (SIGTERM, drain_and_stop): /health and /ping turn 503 at once and every new request
// but /metrics gets 503; responses in flight run on until done or until the grace period ends.
// At the deadline each open stream gets an error event and `data: [DONE]`, each waiting
// non-streaming body an error object, their engine requests are aborted, and only then does
// the listener stop: no connection is cut mid-answer.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "core/status.h"
#include "engine/async_engine.h"
#include "engine/structured_output.h"
#include "engine/text_codec.h"
#include "server/kv_transfer_params.h"
#include "server/metrics.h"

namespace httplib {
class Server;
}

namespace ml4 {

struct ApiRequest;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (see bound_port())
  std::string served_model_name = "ml4";
  std::string api_key;                 // empty: no auth
  size_t max_body_bytes = 8u << 20;    // request bodies above this get 413
  int http_threads = 256;              // concurrent connections served
  double keepalive_s = 0.25;           // SSE keep-alive / disconnect probe period
  // P/D (kv_transfer_params.h): the engine's connector, or null; the host consumers reach
  // this server's side channel at (the port is the bound one).
  transfer::KvConnector* kv_connector = nullptr;
  std::string kv_host = "127.0.0.1";
};

class OpenAiServer {
 public:
  // `metrics` must be the engine's observer too (set before the engine started).
  OpenAiServer(AsyncEngine* engine, const TextCodec* codec, ServerMetrics* metrics, const ServerOptions& options);
  ~OpenAiServer();

  // Binds the socket; errors (port in use, bad host) come back here.
  Status bind();
  int bound_port() const { return port_; }
  // Serves until stop(); call after bind().
  Status serve();
  // Refuses new work, waits up to grace_s for live requests, ends what is still open with an
  // error event, then stops serve().
  void drain_and_stop(double grace_s);
  void stop();
  bool draining() const { return draining_.load(); }
  // Generation responses still being written.
  int active_responses() const { return active_.load(); }

 private:
  void install_routes();
  // Compiles the request's grammar (structured outputs, tool_choice) into its params.
  Status prepare_structured_output(ApiRequest* ar);

  AsyncEngine* engine_;
  const TextCodec* codec_;
  ServerOptions options_;
  std::unique_ptr<httplib::Server> http_;
  ServerMetrics* metrics_;
  std::unique_ptr<StructuredOutputCompiler> structured_;
  std::unique_ptr<KvPeerLoader> kv_loader_;  // P/D consumer
  std::atomic<uint64_t> next_id_{0};
  std::atomic<bool> draining_{false};  // SIGTERM seen: new requests 503
  std::atomic<bool> expired_{false};   // grace period over: open responses end with an error
  std::atomic<int> active_{0};
  int port_ = 0;
};

}  // namespace ml4
