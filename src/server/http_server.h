// OpenAiServer: the HTTP face of an AsyncEngine (SYSTEM.md S14), on cpp-httplib.
//
// Routes: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models, /tokenize,
// /detokenize, /health, /metrics, /version. Every error is an OpenAI error object with the
// status that fits: 400 bad input, 401 bad key, 404 unknown model or route, 413 oversized
// body, 429 queue full, 503 draining or engine down, 500 engine failure.
//
// Generation responses go through chunked content providers, for streaming and non-streaming
// alike: the handler thread waits on the request's OutputStream in short slices and writes
// as outputs arrive, so a client that went away is noticed at the next write (SSE comment
// keep-alives while a stream is idle; a leading space, valid JSON whitespace, every second
// while a non-streaming body waits) and its requests are aborted at once, giving their KV
// blocks back within one engine step. A GenerationState that dies unfinished aborts too, so
// no path can leak a live request.
//
// Shutdown (graceful): drain() makes new generation requests 503, waits until the engine is
// idle or the grace period ends, then stops the listener.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "core/status.h"
#include "engine/async_engine.h"
#include "engine/text_codec.h"
#include "server/metrics.h"

namespace httplib {
class Server;
}

namespace ml4 {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (see bound_port())
  std::string served_model_name = "ml4";
  std::string api_key;                 // empty: no auth
  size_t max_body_bytes = 8u << 20;    // request bodies above this get 413
  int http_threads = 256;              // concurrent connections served
  double keepalive_s = 0.25;           // SSE keep-alive / disconnect probe period
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
  // Refuses new work, waits up to grace_s for live requests, then stops serve().
  void drain_and_stop(double grace_s);
  void stop();

 private:
  void install_routes();

  AsyncEngine* engine_;
  const TextCodec* codec_;
  ServerOptions options_;
  std::unique_ptr<httplib::Server> http_;
  ServerMetrics* metrics_;
  std::atomic<uint64_t> next_id_{0};
  int port_ = 0;
};

}  // namespace ml4
