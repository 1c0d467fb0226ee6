// A serving load generator for any OpenAI-compatible server (`ml4 bench serve`), measuring
// what vLLM's `vllm bench serve` (vllm/benchmarks/serve.py) measures, with the same
// definitions so the numbers compare:
//   TTFT  time from sending a request to its first content token;
//   ITL   gaps between consecutive content chunks of a stream;
//   TPOT  (latency - TTFT) / (output tokens - 1), per request;
//   E2EL  request latency; throughput = requests or tokens / benchmark duration.
// Speculative decoding, as vllm bench serve reads it: the server's vllm:spec_decode_*
// counters from /metrics before and after the measured requests; the differences give the
// acceptance rate (accepted / draft tokens), the mean acceptance length (1 + accepted /
// drafts) and per-position acceptance (accepted at position j / drafts). A server without
// those counters prints no such block.
// Prompts: "random" (token ids drawn from the server's own tokenization of an English
// sample via /tokenize, so any tokenizer gets exact input lengths; plain words when the
// server has no /tokenize) or a JSONL dataset with "prompt" (and optional "output_len").
// Arrivals: all at once, or a Poisson process at --request-rate (seeded); --max-concurrency
// caps requests in flight. Warm-up requests run first and are not counted.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace ml4 {

struct BenchOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "/v1/completions";  // or /v1/chat/completions
  std::string model;                          // empty: the first of /v1/models
  std::string api_key;
  std::string dataset = "random";             // "random" or a .jsonl path
  int input_len = 128;
  int output_len = 128;
  double range_ratio = 0.0;                   // lengths uniform in [len*(1-r), len*(1+r)]
  int num_prompts = 100;
  int max_concurrency = 0;                    // 0: unbounded
  double request_rate = 0.0;                  // req/s, 0: all at once
  int num_warmups = 0;
  uint64_t seed = 0;
  bool ignore_eos = true;
  double temperature = 0.0;                   // vllm bench serve's default: greedy
  double top_p = 1.0;
  int top_k = -1;                             // -1: not sent
  double timeout_s = 600.0;
  bool progress = true;
};

struct RequestResult {
  bool ok = false;
  std::string error;
  int prompt_tokens = 0;
  int output_tokens = 0;
  double ttft = 0.0;
  double latency = 0.0;
  std::vector<double> itl;
};

struct LatencyStats {
  double mean = 0, median = 0, p90 = 0, p99 = 0, min = 0, max = 0;
};

// Deltas of the server's speculative decoding counters over the measured requests.
struct SpecDecodeStats {
  double num_drafts = 0, draft_tokens = 0, accepted_tokens = 0;
  std::vector<double> accepted_per_pos;
  double acceptance_rate() const { return draft_tokens > 0 ? accepted_tokens / draft_tokens : 0.0; }
  double acceptance_length() const { return num_drafts > 0 ? 1.0 + accepted_tokens / num_drafts : 1.0; }
};

// The vllm:spec_decode_* counters of a Prometheus text page (summed over label sets); nullopt
// when it has none.
std::optional<SpecDecodeStats> parse_spec_decode_metrics(const std::string& text);

struct BenchSummary {
  BenchOptions options;
  std::string model;
  int completed = 0;
  int failed = 0;
  double duration_s = 0.0;
  int64_t total_input = 0;
  int64_t total_output = 0;
  std::vector<int> input_lens, output_lens;  // per completed request, as the server counted them
  double request_throughput = 0.0;
  double output_throughput = 0.0;
  double total_throughput = 0.0;
  int max_concurrency_seen = 0;
  LatencyStats ttft_ms, tpot_ms, itl_ms, e2el_ms;
  std::vector<std::string> errors;  // first few
  std::optional<SpecDecodeStats> spec;  // the server speculates
};

Result<BenchSummary> run_bench(const BenchOptions& o);
std::string format_bench_table(const BenchSummary& s);
nlohmann::json bench_json(const BenchSummary& s);
LatencyStats latency_stats(std::vector<double> v_ms);

}  // namespace ml4
