// `ml4 proxy`: the P/D router (src/server/proxy.h). Flags follow vLLM's disagg proxy
// (--prefill / --decode, several instances each, taken round-robin).
//   ml4 proxy --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
// SIGINT / SIGTERM stop it (requests in flight are cut; the instances abort them).
#include <csignal>
#include <thread>

#include <fmt/ranges.h>

#include "command.h"
#include "core/log.h"
#include "server/proxy.h"

namespace ml4::cli {
namespace {

std::atomic<int> g_proxy_signal{0};
extern "C" void on_proxy_signal(int sig) { g_proxy_signal = sig; }

Status run_proxy(ProxyOptions o) {
  if (o.api_key.empty())
    if (const char* env = std::getenv("ML4_API_KEY"); env && *env) o.api_key = env;
  ML4_ASSIGN_OR_RETURN(auto proxy, PdProxy::create(o));
  ML4_RETURN_IF_ERROR(proxy->bind());
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGINT, on_proxy_signal);
  std::signal(SIGTERM, on_proxy_signal);
  std::atomic<bool> served{false};
  std::thread watcher([&] {
    while (!served) {
      if (g_proxy_signal.load() != 0) {
        ML4_LOG_INFO("proxy: signal {}, stopping", g_proxy_signal.load());
        proxy->stop();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  ML4_LOG_INFO("proxy: http://{}:{} -> prefill {} / decode {}", o.host, proxy->bound_port(), fmt::join(o.prefill_urls, ", "),
               fmt::join(o.decode_urls, ", "));
  Status st = proxy->serve();
  served = true;
  watcher.join();
  return st;
}

CommandRegistrar reg("proxy", [](CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("proxy", "P/D proxy: each request prefilled on one instance, decoded on another");
  auto o = std::make_shared<ProxyOptions>();
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--prefill", o->prefill_urls, "prefill instances (http://host:port), round-robin")->required();
  cmd->add_option("--decode", o->decode_urls, "decode instances (http://host:port), round-robin")->required();
  cmd->add_option("--api-key", o->api_key, "require 'Authorization: Bearer KEY' and send it on (also $ML4_API_KEY)");
  cmd->add_option("--http-threads", o->http_threads, "concurrent HTTP connections");
  cmd->add_option("--max-body-bytes", o->max_body_bytes, "largest request body (413 above)");
  cmd->add_option("--upstream-timeout", o->upstream_timeout_s, "read timeout of a request to an instance, seconds");
  cmd->callback([o, exit_code] {
    Status s = run_proxy(*o);
    if (!s.ok()) {
      ML4_LOG_ERROR("proxy: {}", s.message());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace ml4::cli
