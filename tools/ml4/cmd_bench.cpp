// `ml4 bench serve`: load against any OpenAI-compatible server (src/server/bench_client.h);
// prints vLLM's result table and optionally writes the figures as JSON.
// `ml4 bench step`: the CUDA runner's decode step on a full-width preset against its
// roofline (src/runtime/cuda/step_bench.h; the same as bench/gpu_decode_step_bench).
#include <cstdio>
#include <fstream>
#include <memory>
#include <tuple>
#include <vector>

#include "command.h"
#include "core/log.h"
#include "server/bench_client.h"
#if defined(ML4_WITH_CUDA)
#include "runtime/cuda/step_bench.h"
#endif

namespace ml4::cli {
namespace {

CommandRegistrar reg("bench", [](CLI::App& app, int* exit_code) {
  auto* bench = app.add_subcommand("bench", "benchmarks");
  bench->require_subcommand(1);
  auto* serve = bench->add_subcommand("serve", "serving load: TTFT, TPOT, ITL, E2EL, throughput");
  auto o = std::make_shared<BenchOptions>();
  auto result_file = std::make_shared<std::string>();
  auto host = std::make_shared<std::string>();
  auto port = std::make_shared<int>(0);
  serve->add_option("--base-url", o->base_url, "server root, e.g. http://127.0.0.1:8000");
  serve->add_option("--host", *host, "server host (with --port, instead of --base-url)");
  serve->add_option("--port", *port, "server port");
  serve->add_option("--endpoint", o->endpoint, "/v1/completions or /v1/chat/completions");
  serve->add_option("--model", o->model, "model name (default: the server's first)");
  serve->add_option("--api-key", o->api_key, "bearer token");
  serve->add_option("--dataset", o->dataset, "random, or a .jsonl file of {\"prompt\": ..., \"output_len\": ...}");
  serve->add_option("--random-input-len,--input-len", o->input_len, "prompt tokens (random dataset)");
  serve->add_option("--random-output-len,--output-len", o->output_len, "max_tokens per request");
  serve->add_option("--random-range-ratio", o->range_ratio, "lengths uniform in len*(1 -+ ratio)");
  serve->add_option("--num-prompts", o->num_prompts, "requests to send");
  serve->add_option("--max-concurrency", o->max_concurrency, "requests in flight at most (0: no cap)");
  serve->add_option("--request-rate", o->request_rate, "Poisson arrivals per second (0: all at once)");
  serve->add_option("--num-warmups", o->num_warmups, "requests sent first, not measured");
  serve->add_option("--seed", o->seed, "prompt and arrival seed");
  serve->add_option("--timeout", o->timeout_s, "per-request timeout, seconds");
  serve->add_flag("!--no-ignore-eos", o->ignore_eos, "let requests stop at EOS (default: ignore_eos, exact lengths)");
  serve->add_option("--temperature", o->temperature, "sampling temperature (default 0: greedy, as vllm bench serve)")
      ->check(CLI::Range(0.0, 100.0));
  serve->add_option("--top-p", o->top_p, "nucleus sampling (1: off)")->check(CLI::Range(0.0, 1.0));
  serve->add_option("--top-k", o->top_k, "top-k sampling (-1: off)");
  serve->add_flag("!--no-progress", o->progress, "no progress bar");
  serve->add_option("--result-file,--save-result", *result_file, "write the figures as JSON here");
  serve->callback([o, result_file, host, port, exit_code] {
    if (!host->empty() || *port != 0)
      o->base_url = fmt::format("http://{}:{}", host->empty() ? "127.0.0.1" : *host, *port == 0 ? 8000 : *port);
    auto s = run_bench(*o);
    if (!s.ok()) {
      ML4_LOG_ERROR("bench serve: {}", s.status().message());
      *exit_code = 1;
      return;
    }
    std::fputs(format_bench_table(s.value()).c_str(), stdout);
    if (!result_file->empty()) {
      std::ofstream f(*result_file);
      f << bench_json(s.value()).dump(2) << "\n";
      if (!f) {
        ML4_LOG_ERROR("bench serve: cannot write {}", *result_file);
        *exit_code = 1;
        return;
      }
    }
    if (s->failed > 0) *exit_code = 2;
  });

  auto* step = bench->add_subcommand("step", "CUDA decode step of a full-width preset vs its roofline (synthetic weights)");
  auto so = std::make_shared<std::tuple<std::string, std::vector<int>, std::vector<int64_t>, double, bool, int, double>>(
      "ml4-slice-4", std::vector<int>{1, 8, 32, 64}, std::vector<int64_t>{8192, 61440}, 4253.0, true, 0, 20.0);
  step->add_option("--preset", std::get<0>(*so), "model preset (ml4-slice-N, ml4-tiny, ...)");
  step->add_option("--batch", std::get<1>(*so), "batch sizes")->delimiter(',')->check(CLI::PositiveNumber);
  step->add_option("--ctx", std::get<2>(*so), "context lengths")->delimiter(',')->check(CLI::PositiveNumber);
  step->add_option("--copy-gbps", std::get<3>(*so), "measured HBM copy bandwidth, GB/s (the roofline)")
      ->check(CLI::PositiveNumber);
  step->add_flag("!--no-extras", std::get<4>(*so), "only the STEP lines");
  step->add_option("--hisparse-slots", std::get<5>(*so),
                   "instead: HiSparse's decode-step overhead with hot buffers of this many rows (HISPARSE lines)")
      ->check(CLI::NonNegativeNumber);
  step->add_option("--kv-gib", std::get<6>(*so), "device KV budget, GiB")->check(CLI::PositiveNumber);
  auto experts = std::make_shared<std::string>("fp8");
  step->add_option("--experts", *experts, "routed experts' format on the synthetic model")
      ->check(CLI::IsMember({"fp8", "nvfp4", "mxfp4", "fp8-to-mxfp4"}));
  step->callback([so, experts, exit_code] {
#if defined(ML4_WITH_CUDA)
    ml4::cuda::StepBenchOptions o;
    o.preset = std::get<0>(*so);
    o.batches = std::get<1>(*so);
    o.contexts = std::get<2>(*so);
    o.copy_gbps = std::get<3>(*so);
    o.extras = std::get<4>(*so);
    o.hisparse_slots = std::get<5>(*so);
    o.kv_cache_bytes = static_cast<int64_t>(std::get<6>(*so) * (1ll << 30));
    o.experts = *experts;
    *exit_code = o.hisparse_slots > 0 ? ml4::cuda::run_hisparse_step_bench(o) : ml4::cuda::run_step_bench(o);
#else
    (void)so;
    (void)experts;
    ML4_LOG_ERROR("bench step: this ml4 was built without the CUDA backend (cmake -DML4_CUDA=ON)");
    *exit_code = 1;
#endif
  });
});

}  // namespace
}  // namespace ml4::cli
