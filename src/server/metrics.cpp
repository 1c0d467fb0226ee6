// ServerMetrics (design in metrics.h).
#include "server/metrics.h"

#include <algorithm>

#include <fmt/format.h>

namespace ml4 {
namespace {

// vLLM v1 bucket bounds (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kItlBuckets = {0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3,  0.4, 0.5,
                                         0.75, 1.0,   2.5,  5.0,   7.5,  10.0, 20.0, 40.0, 80.0};
const std::vector<double> kRequestBuckets = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                                             30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

std::string fmt_double(double v) { return fmt::format("{}", v); }

}  // namespace

void Histogram::observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  std::lock_guard<std::mutex> lk(mu_);
  ++counts_[i];
  sum_ += v;
  ++count_;
}

uint64_t Histogram::count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return count_;
}

void Histogram::render(const std::string& name, const std::string& labels, std::string* out) const {
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    *out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, fmt_double(bounds_[i]), cum);
  }
  cum += counts_.back();
  *out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, cum);
  *out += fmt::format("{}_sum{{{}}} {}\n", name, labels, fmt_double(sum_));
  *out += fmt::format("{}_count{{{}}} {}\n", name, labels, count_);
}

ServerMetrics::ServerMetrics(std::string model_name)
    : model_name_(std::move(model_name)),
      ttft_(kTtftBuckets),
      itl_(kItlBuckets),
      e2e_(kRequestBuckets),
      queue_(kRequestBuckets) {}

void ServerMetrics::on_first_token(double queue_time_s, double ttft_s) {
  queue_.observe(std::max(0.0, queue_time_s));
  ttft_.observe(ttft_s);
}

void ServerMetrics::on_token(double inter_token_s) { itl_.observe(inter_token_s); }

void ServerMetrics::on_finished(double e2e_s, FinishReason reason, int64_t, int64_t) {
  e2e_.observe(e2e_s);
  std::lock_guard<std::mutex> lk(mu_);
  ++finished_[finish_reason_name(reason)];
}

void ServerMetrics::on_http_error(int status) {
  std::lock_guard<std::mutex> lk(mu_);
  ++http_errors_[status];
}

std::string ServerMetrics::render(const EngineSnapshot& snap) const {
  const std::string ml = fmt::format("model_name=\"{}\"", model_name_);
  std::string o;
  auto family = [&](const char* name, const char* type, const char* help) {
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.");
  o += fmt::format("vllm:num_requests_running{{{}}} {}\n", ml, snap.running);
  family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.");
  o += fmt::format("vllm:num_requests_waiting{{{}}} {}\n", ml, snap.waiting);

  // One series as in vLLM (one block pool there). ml4 has a pool per cache group and admission
  // needs room in every one, so the single figure is the fullest group's; each group's own
  // usage is ml4:kv_cache_usage_perc{cache_group=...}.
  double fullest = 0.0;
  for (const auto& g : snap.groups) fullest = std::max(fullest, g.usage);
  family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage (the fullest cache group).");
  o += fmt::format("vllm:kv_cache_usage_perc{{{}}} {}\n", ml, fmt_double(fullest));
  family("ml4:kv_cache_usage_perc", "gauge", "KV-cache usage per cache group. 1 means 100 percent usage.");
  for (const auto& g : snap.groups)
    o += fmt::format("ml4:kv_cache_usage_perc{{{},cache_group=\"{}\"}} {}\n", ml, g.name, fmt_double(g.usage));
  family("ml4:kv_cache_free_blocks", "gauge", "Free KV blocks per cache group.");
  for (const auto& g : snap.groups)
    o += fmt::format("ml4:kv_cache_free_blocks{{{},cache_group=\"{}\"}} {}\n", ml, g.name, g.free_blocks);

  const EngineCounters& c = snap.counters;
  family("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.");
  o += fmt::format("vllm:prefix_cache_queries_total{{{}}} {}\n", ml, c.prefix_queries);
  family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.");
  o += fmt::format("vllm:prefix_cache_hits_total{{{}}} {}\n", ml, c.prefix_hits);
  family("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions from the engine.");
  o += fmt::format("vllm:num_preemptions_total{{{}}} {}\n", ml, c.preemptions);
  family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.");
  o += fmt::format("vllm:prompt_tokens_total{{{}}} {}\n", ml, c.prompt_tokens);
  family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.");
  o += fmt::format("vllm:generation_tokens_total{{{}}} {}\n", ml, c.generation_tokens);
  if (!c.spec.accepted_per_pos.empty()) {  // speculative decoding on (vLLM registers these only then)
    family("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.");
    o += fmt::format("vllm:spec_decode_num_drafts_total{{{}}} {}\n", ml, c.spec.num_drafts);
    family("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.");
    o += fmt::format("vllm:spec_decode_num_draft_tokens_total{{{}}} {}\n", ml, c.spec.num_draft_tokens);
    family("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.");
    o += fmt::format("vllm:spec_decode_num_accepted_tokens_total{{{}}} {}\n", ml, c.spec.num_accepted_tokens);
    family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted tokens per draft position.");
    for (size_t j = 0; j < c.spec.accepted_per_pos.size(); ++j)
      o += fmt::format("vllm:spec_decode_num_accepted_tokens_per_pos_total{{{},position=\"{}\"}} {}\n", ml, j,
                       c.spec.accepted_per_pos[j]);
    family("ml4:engine_draft_seconds_total", "counter", "Wall time in the drafter's forward (of the engine steps').");
    o += fmt::format("ml4:engine_draft_seconds_total{{{}}} {}\n", ml, fmt_double(c.draft_seconds));
    family("ml4:spec_decode_window_misses_total", "counter",
           "Drafts not proposed because the drafter window cache had no free block.");
    o += fmt::format("ml4:spec_decode_window_misses_total{{{}}} {}\n", ml, c.spec_window_misses);
  }
  if (c.hisparse.on) {  // HiSparse host KV offload (SYSTEM.md S12)
    family("ml4:hisparse_hot_rows_hit_total", "counter", "Selected KV rows found in the hot buffers.");
    o += fmt::format("ml4:hisparse_hot_rows_hit_total{{{}}} {}\n", ml, c.hisparse.hits);
    family("ml4:hisparse_rows_loaded_total", "counter", "KV rows copied from the host pool into the hot buffers.");
    o += fmt::format("ml4:hisparse_rows_loaded_total{{{}}} {}\n", ml, c.hisparse.loads);
    family("ml4:hisparse_layer_steps_total", "counter",
           "Sparse layer-steps by where attention read: the hot buffers, or the host pool directly (overflow).");
    o += fmt::format("ml4:hisparse_layer_steps_total{{{},read=\"hot\"}} {}\n", ml, c.hisparse.hot_layers);
    o += fmt::format("ml4:hisparse_layer_steps_total{{{},read=\"host\"}} {}\n", ml, c.hisparse.direct_layers);
    family("ml4:hisparse_regions_in_use", "gauge", "Requests holding hot buffers.");
    o += fmt::format("ml4:hisparse_regions_in_use{{{}}} {}\n", ml, c.hisparse.regions_in_use);
    family("ml4:hisparse_resident_rows", "gauge", "KV rows resident in the hot buffers.");
    o += fmt::format("ml4:hisparse_resident_rows{{{}}} {}\n", ml, c.hisparse.resident_rows);
  }
  family("ml4:engine_step_seconds_total", "counter", "Wall time in engine steps (scheduling, forward, sampling).");
  o += fmt::format("ml4:engine_step_seconds_total{{{}}} {}\n", ml, fmt_double(c.step_seconds));
  family("ml4:engine_forward_seconds_total", "counter", "Wall time in the model runner's forward.");
  o += fmt::format("ml4:engine_forward_seconds_total{{{}}} {}\n", ml, fmt_double(c.forward_seconds));
  family("ml4:engine_steps_total", "counter", "Engine steps run.");
  o += fmt::format("ml4:engine_steps_total{{{}}} {}\n", ml, c.steps);
  family("ml4:engine_batched_tokens_total", "counter", "Tokens fed to the model, summed over steps.");
  o += fmt::format("ml4:engine_batched_tokens_total{{{}}} {}\n", ml, c.batched_tokens);
  {
    std::lock_guard<std::mutex> lk(mu_);
    family("vllm:request_success_total", "counter", "Count of finished requests by finish reason.");
    for (const char* r : {"stop", "length", "abort", "error"}) {
      auto it = finished_.find(r);
      o += fmt::format("vllm:request_success_total{{{},finished_reason=\"{}\"}} {}\n", ml, r,
                       it == finished_.end() ? 0 : it->second);
    }
    family("ml4:http_errors_total", "counter", "Error responses by HTTP status.");
    for (const auto& [code, n] : http_errors_)
      o += fmt::format("ml4:http_errors_total{{{},status=\"{}\"}} {}\n", ml, code, n);
  }
  family("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.");
  ttft_.render("vllm:time_to_first_token_seconds", ml, &o);
  family("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.");
  itl_.render("vllm:inter_token_latency_seconds", ml, &o);
  family("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.");
  e2e_.render("vllm:e2e_request_latency_seconds", ml, &o);
  family("vllm:request_queue_time_seconds", "histogram", "Histogram of time spent in WAITING phase for request.");
  queue_.render("vllm:request_queue_time_seconds", ml, &o);
  return o;
}

}  // namespace ml4
