// PdProxy: `ml4 proxy`, the router of prefill/decode disaggregation (SYSTEM.md S11), as
// vLLM's disagg proxy for the NixlConnector (tests/v1/kv_connector/nixl_integration/
// toy_proxy_server.py): an OpenAI server that sends each /v1/completions or
// /v1/chat/completions request
//   1. to a prefill instance with max_tokens 1, stream false and
//      kv_transfer_params {do_remote_decode: true} (the same X-Request-Id on both legs);
//   2. then to a decode instance with the kv_transfer_params the prefill answered,
// and passes the decode answer through, streamed as it arrives. Instances of each side are
// taken round-robin. Nothing is retried on another side: a request whose prefill or decode
// fails gets the error (502 naming the instance when one cannot be reached or answers
// without kv_transfer_params); a prefill leg is never replaced by a local prefill.
//
// Cancellation: each leg runs on its own thread with its own client, its body fed to the
// response as it comes; when the client goes away (a write fails) the leg's connection is
// closed, which the instance notices at its next write and aborts the request: during
// the decode leg that also frees the prefill instance's blocks (the consumer tells it).
// Streaming requests run both legs inside the response, writing SSE comments while the
// prefill runs, so a client leaving during the prefill aborts it too; their errors come
// as an SSE error event (the status line is already sent). Non-streaming requests run the
// prefill leg before answering, so its errors keep their status.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace httplib {
class Server;
}

namespace ml4 {

struct ProxyOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port
  std::vector<std::string> prefill_urls, decode_urls;  // http://host:port
  std::string api_key;       // required from clients (empty: none) and sent to the instances
  int http_threads = 256;
  size_t max_body_bytes = 8u << 20;   // request bodies above this get 413 (as ml4 serve)
  double upstream_timeout_s = 600.0;  // read timeout of a leg
};

class PdProxy {
 public:
  static Result<std::unique_ptr<PdProxy>> create(const ProxyOptions& options);
  ~PdProxy();

  Status bind();
  int bound_port() const { return port_; }
  Status serve();
  void stop();

  struct Backend {
    std::string url, host;
    int port = 0;
  };

 private:
  explicit PdProxy(ProxyOptions options);
  void install_routes();

  ProxyOptions options_;
  std::vector<Backend> prefill_, decode_;
  std::unique_ptr<httplib::Server> http_;
  std::atomic<uint64_t> next_prefill_{0}, next_decode_{0}, next_id_{0};
  int port_ = 0;

  // /metrics
  std::atomic<int64_t> requests_{0}, failed_{0}, prefill_errors_{0}, decode_errors_{0}, client_aborts_{0};
};

// "http://host:port" -> Backend; anything else is an error naming the URL.
Result<PdProxy::Backend> parse_backend_url(const std::string& url);

}  // namespace ml4
