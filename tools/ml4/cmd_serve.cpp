// `ml4 serve`: the OpenAI-compatible server (SYSTEM.md S14, S16), flags named as vLLM's.
//
// With no --model it serves the default model: ml4-tiny (seed 0), built deterministically
// on first start by this same binary's `make-model` into $ML4_DEFAULT_MODEL or
// ~/.cache/ml4/models/ml4-tiny; nothing is downloaded. SIGINT / SIGTERM drain: /health and
// new requests get 503 at once, live ones finish (up to --shutdown-timeout seconds; streams
// still open then end with an error event and [DONE]), then the process exits 0.
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "command.h"
#include "device_options.h"
#include "hisparse_options.h"
#include "spec_options.h"
#include "core/log.h"
#include "engine/async_engine.h"
#include "runtime/cpu/cpu_runner.h"
#include "server/http_server.h"
#include "transfer/kv_connector.h"

namespace ml4::cli {
namespace {

struct ServeOptions {
  std::string model;
  std::string served_model_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  int64_t max_model_len = 0;
  int max_num_seqs = 64;
  int64_t max_num_batched_tokens = 2048;
  std::string kv_cache_dtype = "fp8_ds_mla";
  int64_t kv_cache_memory_bytes = 256ll << 20;
  DeviceOptions dev;
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;
  uint64_t seed = 0;
  std::string api_key;
  size_t max_queue = 512;
  size_t max_body_bytes = 8u << 20;
  double hang_timeout = 60.0;
  double shutdown_timeout = 30.0;
  int http_threads = 256;
  std::string allowed_local_media_path;  // vLLM's flag: file:// images only from here
  size_t max_media_bytes = 20u << 20;    // per image (data: or file:)
  std::string kv_transfer_config;  // P/D (transfer/kv_transfer_config.h)
  double kv_transfer_timeout = 480.0;
  std::string speculative_config;  // DSpark (engine/spec_decode.h)
};

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal = sig; }

std::string default_model_dir() {
  if (const char* env = std::getenv("ML4_DEFAULT_MODEL"); env && *env) return env;
  const char* cache = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::string base = cache && *cache ? cache : std::string(home && *home ? home : ".") + "/.cache";
  return base + "/ml4/models/ml4-tiny";
}

Status ensure_default_model(const std::string& dir) {
  if (std::filesystem::exists(dir + "/params.json")) return ok_status();
  ML4_LOG_INFO("serve: building the default model ml4-tiny (seed 0) in {}", dir);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(dir).parent_path(), ec);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) return io_error("cannot find this executable to run make-model: {}", ec.message());
  const std::string tmp = dir + ".tmp";
  std::filesystem::remove_all(tmp, ec);
  const std::string cmd = "'" + self + "' make-model --preset ml4-tiny --seed 0 --out '" + tmp + "'";
  if (std::system(cmd.c_str()) != 0) return internal_error("'{}' failed", cmd);
  std::filesystem::rename(tmp, dir, ec);  // atomic: a half-written model is never picked up
  if (ec && !std::filesystem::exists(dir + "/params.json")) return io_error("cannot move {} to {}: {}", tmp, dir, ec.message());
  return ok_status();
}

Status run_serve(ServeOptions o) {
  if (o.model.empty()) {
    o.model = default_model_dir();
    ML4_RETURN_IF_ERROR(ensure_default_model(o.model));
  }
  if (o.served_model_name.empty()) o.served_model_name = std::filesystem::path(o.model).filename().string();
  if (o.served_model_name.empty()) o.served_model_name = o.model;
  if (o.api_key.empty())
    if (const char* env = std::getenv("ML4_API_KEY"); env && *env) o.api_key = env;

  if (o.max_model_len < 0) return invalid_argument("--max-model-len must be positive");
  RunnerOptions ro;
  ro.kv_cache_dtype = o.kv_cache_dtype;
  ro.kv_cache_bytes = o.kv_cache_memory_bytes;
  ro.max_model_len = o.max_model_len;
  ML4_ASSIGN_OR_RETURN(SpeculativeConfig spec, speculative_runner_options(o.speculative_config, o.model, o.max_num_seqs, &ro));
  ML4_ASSIGN_OR_RETURN(const bool hisparse, hisparse_runner_options(o.kv_transfer_config, o.max_num_seqs, &ro));
  ML4_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner, load_runner_on(o.dev, o.model, ro));
  if (o.max_model_len > runner->config().max_position_embeddings)
    return invalid_argument("--max-model-len {} exceeds the model's max_position_embeddings {}", o.max_model_len,
                            runner->config().max_position_embeddings);
  ML4_ASSIGN_OR_RETURN(std::unique_ptr<TextCodec> codec, make_text_codec(o.model, runner->config().vocab_size));
  MediaOptions media;
  media.max_media_bytes = o.max_media_bytes;
  if (!o.allowed_local_media_path.empty()) {
    std::error_code fec;
    auto dir = std::filesystem::canonical(o.allowed_local_media_path, fec);
    if (fec || !std::filesystem::is_directory(dir))
      return invalid_argument("--allowed-local-media-path {}: not an existing directory", o.allowed_local_media_path);
    media.allowed_local_media_path = dir.string();
  }
  codec->set_media_options(media);

  EngineConfig ec;
  ec.scheduler.max_num_seqs = o.max_num_seqs;
  ec.scheduler.max_num_batched_tokens = o.max_num_batched_tokens;
  ec.scheduler.max_model_len = o.max_model_len > 0 ? o.max_model_len : runner->config().max_position_embeddings;
  ec.scheduler.enable_chunked_prefill = o.enable_chunked_prefill;
  ec.enable_prefix_caching = o.enable_prefix_caching;
  ec.seed = o.seed;
  ec.speculative = spec;
  if (ec.scheduler.max_num_seqs < 1 || ec.scheduler.max_num_batched_tokens < 1)
    return invalid_argument("--max-num-seqs and --max-num-batched-tokens must be positive");
  ML4_RETURN_IF_ERROR(Engine::check_speculation(*runner, ec));
  // P/D: the connector registers the runner's KV pages; it outlives the engine.
  std::unique_ptr<transfer::KvConnector> connector;
  if (!o.kv_transfer_config.empty() && !hisparse) {
    ML4_ASSIGN_OR_RETURN(transfer::KvTransferConfig kc, transfer::parse_kv_transfer_config(o.kv_transfer_config));
    if (!(o.kv_transfer_timeout > 0)) return invalid_argument("--kv-transfer-timeout must be positive");
    kc.timeout_s = o.kv_transfer_timeout;
    if (kc.kv_ip.empty()) kc.kv_ip = o.host == "0.0.0.0" || o.host == "::" ? "127.0.0.1" : o.host;
    auto made = transfer::KvConnector::create(kc, runner->kv_regions(), runner->cache_groups(),
                                              [r = runner.get()] { r->bind_thread(); });
    if (!made.ok()) return made.status().with_context("--kv-transfer-config");
    connector = std::move(made).value();
  }
  auto engine = std::make_unique<Engine>(runner.get(), codec.get(), ec);
  engine->set_kv_connector(connector.get());
  ServerMetrics metrics(o.served_model_name);
  engine->set_observer(&metrics);
  AsyncEngine::Options ao;
  ao.max_live = o.max_queue;
  ao.hang_timeout_s = o.hang_timeout;
  AsyncEngine async(std::move(engine), ao);

  ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.served_model_name = o.served_model_name;
  so.api_key = o.api_key;
  so.max_body_bytes = o.max_body_bytes;
  so.http_threads = o.http_threads;
  so.kv_connector = connector.get();
  if (connector) so.kv_host = connector->config().kv_ip;
  OpenAiServer server(&async, codec.get(), &metrics, so);
  // The connector's thread wakes the engine loop when a load finishes or a hold is released;
  // unhooked before the loop goes away.
  struct Unhook {
    transfer::KvConnector* c;
    ~Unhook() {
      if (c) c->set_wakeup(nullptr);
    }
  } unhook{connector.get()};
  if (connector) connector->set_wakeup([&async] { async.wake(); });
  ML4_RETURN_IF_ERROR(server.bind());
  async.start();

  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::atomic<bool> served{false};
  std::thread watcher([&] {
    while (!served) {
      if (g_signal.load() != 0) {
        ML4_LOG_INFO("serve: signal {}, draining (up to {} s)", g_signal.load(), o.shutdown_timeout);
        server.drain_and_stop(o.shutdown_timeout);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  ML4_LOG_INFO("serve: {} as '{}' on http://{}:{} (max_model_len {}, tokenizer {})", o.model, o.served_model_name,
               o.host, server.bound_port(), async.engine().max_model_len(), codec->name());
  Status st = server.serve();
  served = true;
  watcher.join();
  async.stop();
  ML4_LOG_INFO("serve: stopped");
  return st;
}

CommandRegistrar reg("serve", [](CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server");
  auto o = std::make_shared<ServeOptions>();
  cmd->add_option("--model", o->model, "model directory (default: ml4-tiny, built on first start)");
  cmd->add_option("--served-model-name", o->served_model_name, "name in the API (default: the directory name)");
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--max-model-len", o->max_model_len, "longest prompt + output, tokens");
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "sequences per step")->check(CLI::PositiveNumber);
  cmd->add_option("--max-num-batched-tokens", o->max_num_batched_tokens, "token budget per step")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "fp8_ds_mla, fp8 or bf16");
  o->dev.kv_bytes_option = cmd->add_option("--kv-cache-memory-bytes", o->kv_cache_memory_bytes,
                                           "KV cache budget in bytes (cuda: overrides --gpu-memory-utilization)");
  add_device_options(cmd, &o->dev);
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o->enable_prefix_caching,
                "prefix caching (default on)");
  cmd->add_flag("--enable-chunked-prefill,!--no-enable-chunked-prefill", o->enable_chunked_prefill,
                "chunked prefill (default on)");
  cmd->add_option("--seed", o->seed, "seed for requests that bring none");
  cmd->add_option("--api-key", o->api_key, "require 'Authorization: Bearer KEY' (also $ML4_API_KEY)");
  cmd->add_option("--max-queue", o->max_queue, "queued + running requests before 429");
  cmd->add_option("--max-body-bytes", o->max_body_bytes, "largest request body (413 above)");
  cmd->add_option("--allowed-local-media-path", o->allowed_local_media_path,
                  "serve file:// image URLs from this directory only (default: refuse them all)");
  cmd->add_option("--max-media-bytes", o->max_media_bytes, "largest image, data: or file: (400 above)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--hang-timeout", o->hang_timeout, "a step longer than this fails /health, seconds");
  cmd->add_option("--shutdown-timeout", o->shutdown_timeout, "grace period for live requests on SIGTERM, seconds");
  cmd->add_option("--http-threads", o->http_threads, "concurrent HTTP connections");
  cmd->add_option("--kv-transfer-config", o->kv_transfer_config,
                  "P/D: JSON, e.g. '{\"kv_connector\":\"UcxConnector\",\"kv_role\":\"kv_producer\"}' "
                  "(kv_producer | kv_consumer | kv_both); HiSparse host KV offload: "
                  "'{\"kv_connector\":\"HiSparseConnector\",\"kv_connector_extra_config\":{\"host_pool_gb\":G,"
                  "\"hot_slots_per_request\":S}}'");
  cmd->add_option("--kv-transfer-timeout", o->kv_transfer_timeout,
                  "P/D: seconds a producer holds KV blocks for a consumer, and a consumer waits for a load");
  cmd->add_option("--speculative-config", o->speculative_config,
                  "DSpark speculative decoding: JSON, e.g. '{\"method\":\"dspark\",\"num_speculative_tokens\":7,"
                  "\"draft_sample_method\":\"greedy\"}' (or \"probabilistic\")");
  cmd->callback([o, exit_code] {
    Status s = run_serve(*o);
    if (!s.ok()) {
      ML4_LOG_ERROR("serve: {}", s.message());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace ml4::cli
