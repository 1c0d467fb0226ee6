// AsyncEngine: the Engine on its own thread, fed by many callers (HTTP handlers).
//
// Callers submit() one group of requests (the n choices of one API call) and get an
// OutputStream; the loop thread drains the inbox, steps the engine and pushes each
// RequestOutput into its stream. Admission is bounded: at most max_live requests are live
// (queued or running), beyond that submit() answers kResourceExhausted at once (the server
// maps it to 429), and it refuses everything while draining or after the loop died. abort()
// is asynchronous but bounded by one step: the loop applies it before the next step, so a
// disconnected client's blocks are back in the pool within one step.
//
// Health never takes the engine lock: the loop publishes a heartbeat and whether it is in a
// step and since when; health() reads atomics only, so a hung runner cannot hang /health.
// A step that fails or throws kills the loop: every stream gets an error and health() says
// why (SYSTEM.md S17: a fault stops the engine instead of hanging it).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"

namespace ml4 {

struct GenerateRequest {
  std::string request_id;
  std::vector<int32_t> prompt;
  SamplingParams params;
  int priority = 0;
  transfer::KvTransferRequest kv;  // P/D (transfer/kv_connector.h)
};

struct StreamItem {
  int index = 0;  // which request of the submitted group
  RequestOutput out;
};

class OutputStream {
 public:
  explicit OutputStream(std::vector<std::string> ids) : ids_(std::move(ids)), remaining_(ids_.size()) {}
  // The next output, or nullopt after `timeout` with nothing new.
  std::optional<StreamItem> next(std::chrono::milliseconds timeout);
  // True once every request of the group has finished and all outputs were taken.
  bool done();
  const std::vector<std::string>& ids() const { return ids_; }

 private:
  friend class AsyncEngine;
  void push(StreamItem item);

  std::vector<std::string> ids_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StreamItem> items_;
  size_t remaining_;
};

struct EngineSnapshot {
  size_t running = 0;
  size_t waiting = 0;
  struct Group {
    std::string name;
    int64_t total_blocks = 0;
    int64_t free_blocks = 0;
    double usage = 0.0;
  };
  std::vector<Group> groups;
  EngineCounters counters;
  int64_t blocks_held_for_remote = 0;  // P/D producer: blocks kept for consumers
  size_t loading = 0;                  // P/D consumer: requests reading their KV
};

struct EngineHealth {
  bool ok = true;
  std::string reason;
};

class AsyncEngine {
 public:
  struct Options {
    size_t max_live = 512;        // queued + running requests (per request, n counts n)
    double hang_timeout_s = 60.0; // a step longer than this makes health() fail
  };
  AsyncEngine(std::unique_ptr<Engine> engine, const Options& options);
  ~AsyncEngine();

  void start();
  // Stops the loop; requests still live finish with FinishReason::kAbort.
  void stop();
  // Refuses new requests from now on (graceful shutdown waits for idle()).
  void set_draining() { draining_ = true; }

  // Validates (kInvalidArgument), admits (kResourceExhausted when full; kInternal while
  // draining or after the loop died) and queues the group; ids must be unique among live
  // requests.
  Result<std::shared_ptr<OutputStream>> submit(std::vector<GenerateRequest> reqs);
  void abort(const std::shared_ptr<OutputStream>& stream);
  // Wakes the loop now (a KV transfer finished or a hold was released); any thread.
  void wake();

  EngineHealth health() const;
  EngineSnapshot snapshot() const;
  bool draining() const { return draining_.load(); }
  bool idle() const { return num_live_.load() == 0; }
  size_t num_live() const { return num_live_.load(); }
  // Immutable after construction, safe from any thread.
  const Engine& engine() const { return *engine_; }

 private:
  struct Route {
    std::shared_ptr<OutputStream> stream;
    int index = 0;
  };
  void loop();
  void fail_all(const std::string& reason);
  void publish_snapshot();
  static double now_s();

  std::unique_ptr<Engine> engine_;
  Options options_;
  std::thread thread_;

  std::mutex mu_;  // inbox, aborts, stop flag
  std::condition_variable cv_;
  std::vector<std::pair<GenerateRequest, Route>> inbox_;
  std::vector<std::string> abort_inbox_;
  bool stop_ = false;
  bool started_ = false;
  bool woken_ = false;

  std::unordered_map<std::string, Route> routes_;  // loop thread only

  std::atomic<size_t> num_live_{0};
  std::atomic<bool> draining_{false};
  std::atomic<bool> dead_{false};
  std::atomic<bool> in_step_{false};
  std::atomic<double> step_start_{0.0};
  std::atomic<double> heartbeat_{0.0};
  mutable std::mutex dead_mu_;
  std::string dead_reason_;

  mutable std::mutex snap_mu_;
  EngineSnapshot snapshot_;
};

}  // namespace ml4
