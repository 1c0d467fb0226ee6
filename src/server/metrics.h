// Prometheus metrics with vLLM's names (vllm/v1/metrics/loggers.py), so existing vLLM
// dashboards and `vllm bench`-style scrapers read an ml4 server unchanged.
//
// Histograms are observed from the engine thread through EngineObserver; gauges and
// counters the engine already keeps (running / waiting, KV usage per cache group, prefix
// queries / hits, preemptions, token counters) are read from the AsyncEngine snapshot at
// scrape time, so a scrape never takes the engine lock. Bucket bounds are vLLM's.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/async_engine.h"
#include "engine/engine.h"

namespace ml4 {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  // Appends the _bucket/_sum/_count lines for `name` with `labels` ("k=\"v\"").
  void render(const std::string& name, const std::string& labels, std::string* out) const;
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

class ServerMetrics : public EngineObserver {
 public:
  explicit ServerMetrics(std::string model_name);
  void on_first_token(double queue_time_s, double ttft_s) override;
  void on_token(double inter_token_s) override;
  void on_finished(double e2e_s, FinishReason reason, int64_t prompt_tokens, int64_t gen_tokens) override;
  void on_http_error(int status);

  std::string render(const EngineSnapshot& snap) const;

 private:
  std::string model_name_;
  Histogram ttft_, itl_, e2e_, queue_;
  mutable std::mutex mu_;
  std::map<std::string, int64_t> finished_;  // by finished_reason
  std::map<int, int64_t> http_errors_;       // by status code
};

}  // namespace ml4
