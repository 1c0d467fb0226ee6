// AsyncEngine (design in async_engine.h).
#include "engine/async_engine.h"

#include <exception>
#include <unordered_set>

#include "core/log.h"

namespace ml4 {

std::optional<StreamItem> OutputStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return !items_.empty(); })) return std::nullopt;
  StreamItem item = std::move(items_.front());
  items_.pop_front();
  return item;
}

bool OutputStream::done() {
  std::lock_guard<std::mutex> lk(mu_);
  return remaining_ == 0 && items_.empty();
}

void OutputStream::push(StreamItem item) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (item.out.finished && remaining_ > 0) --remaining_;
    items_.push_back(std::move(item));
  }
  cv_.notify_all();
}

double AsyncEngine::now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

AsyncEngine::AsyncEngine(std::unique_ptr<Engine> engine, const Options& options)
    : engine_(std::move(engine)), options_(options) {
  publish_snapshot();
}

AsyncEngine::~AsyncEngine() { stop(); }

void AsyncEngine::start() {
  std::lock_guard<std::mutex> lk(mu_);
  if (started_) return;
  started_ = true;
  heartbeat_ = now_s();
  thread_ = std::thread([this] { loop(); });
}

void AsyncEngine::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Whatever is still queued or live ends as aborted; the engine is idle now.
  std::vector<std::pair<GenerateRequest, Route>> pending;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pending.swap(inbox_);
  }
  for (auto& [req, route] : pending) routes_.emplace(req.request_id, route);
  for (auto& [id, route] : routes_) {
    engine_->abort(id);
    StreamItem item;
    item.index = route.index;
    item.out.request_id = id;
    item.out.finished = true;
    item.out.finish_reason = FinishReason::kAbort;
    route.stream->push(std::move(item));
    --num_live_;
  }
  routes_.clear();
}

Result<std::shared_ptr<OutputStream>> AsyncEngine::submit(std::vector<GenerateRequest> reqs) {
  if (reqs.empty()) return invalid_argument("no requests to submit");
  if (dead_) return Status(StatusCode::kInternal, "the engine has stopped: " + health().reason);
  if (draining_) return Status(StatusCode::kInternal, "the server is shutting down");
  for (const auto& r : reqs) {
    ML4_RETURN_IF_ERROR(engine_->check_request(r.prompt, r.params));
    ML4_RETURN_IF_ERROR(engine_->check_kv_transfer(r.prompt, r.params, r.kv));
  }
  // Admission: reserve all n slots at once or none.
  size_t live = num_live_.load();
  do {
    if (live + reqs.size() > options_.max_live)
      return resource_exhausted("the server is at capacity ({} requests queued or running); retry later",
                                options_.max_live);
  } while (!num_live_.compare_exchange_weak(live, live + reqs.size()));

  std::vector<std::string> ids;
  for (const auto& r : reqs) ids.push_back(r.request_id);
  auto stream = std::make_shared<OutputStream>(std::move(ids));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      num_live_ -= reqs.size();
      return Status(StatusCode::kInternal, "the server is shutting down");
    }
    for (size_t i = 0; i < reqs.size(); ++i) inbox_.emplace_back(std::move(reqs[i]), Route{stream, static_cast<int>(i)});
  }
  cv_.notify_all();
  return stream;
}

void AsyncEngine::abort(const std::shared_ptr<OutputStream>& stream) {
  if (!stream) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& id : stream->ids()) abort_inbox_.push_back(id);
  }
  cv_.notify_all();
}

void AsyncEngine::wake() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    woken_ = true;
  }
  cv_.notify_all();
}

// Between steps the loop beats at least every 50 ms; a busy machine can delay a wake-up, so
// silence counts as a hang only well past the step limit.
constexpr double kSilentSlackS = 5.0;

EngineHealth AsyncEngine::health() const {
  EngineHealth h;
  if (dead_) {
    std::lock_guard<std::mutex> lk(dead_mu_);
    h.ok = false;
    h.reason = "engine loop stopped: " + dead_reason_;
    return h;
  }
  const double now = now_s();
  if (in_step_ && now - step_start_.load() > options_.hang_timeout_s) {
    h.ok = false;
    h.reason = fmt::format("engine step running for {:.1f} s (limit {:.1f} s)", now - step_start_.load(),
                           options_.hang_timeout_s);
  } else if (!in_step_ && started_ && now - heartbeat_.load() > options_.hang_timeout_s + kSilentSlackS) {
    h.ok = false;
    h.reason = fmt::format("engine loop silent for {:.1f} s", now - heartbeat_.load());
  }
  return h;
}

EngineSnapshot AsyncEngine::snapshot() const {
  std::lock_guard<std::mutex> lk(snap_mu_);
  return snapshot_;
}

void AsyncEngine::publish_snapshot() {
  EngineSnapshot s;
  s.running = engine_->num_running();
  s.waiting = engine_->num_waiting();
  const auto& b = engine_->blocks();
  for (int g = 0; g < b.num_groups(); ++g)
    s.groups.push_back({b.group(g).name, b.num_total_blocks(g), b.num_free_blocks(g), b.usage(g)});
  s.counters = engine_->counters();
  s.blocks_held_for_remote = engine_->num_blocks_held_for_remote();
  s.loading = engine_->num_loading();
  std::lock_guard<std::mutex> lk(snap_mu_);
  snapshot_ = std::move(s);
}

void AsyncEngine::fail_all(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(dead_mu_);
    dead_reason_ = reason;
  }
  dead_ = true;
  ML4_LOG_ERROR("engine loop stopped: {}", reason);
  for (auto& [id, route] : routes_) {
    engine_->abort(id, FinishReason::kError);
    StreamItem item;
    item.index = route.index;
    item.out.request_id = id;
    item.out.finished = true;
    item.out.finish_reason = FinishReason::kError;
    item.out.error = reason;
    route.stream->push(std::move(item));
    --num_live_;
  }
  routes_.clear();
}

void AsyncEngine::loop() {
  for (;;) {
    std::vector<std::pair<GenerateRequest, Route>> adds;
    std::vector<std::string> aborts;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (!stop_ && inbox_.empty() && abort_inbox_.empty() && !engine_->has_work() && !woken_)
        cv_.wait_for(lk, std::chrono::milliseconds(50));
      woken_ = false;
      if (stop_) return;
      adds.swap(inbox_);
      aborts.swap(abort_inbox_);
    }
    heartbeat_ = now_s();
    for (auto& [req, route] : adds) {
      Status st = engine_->add_request(req.request_id, std::move(req.prompt), req.params, req.priority, 0.0, req.kv);
      if (!st.ok()) {
        StreamItem item;
        item.index = route.index;
        item.out.request_id = req.request_id;
        item.out.finished = true;
        item.out.finish_reason = FinishReason::kError;
        item.out.error = st.message();
        route.stream->push(std::move(item));
        --num_live_;
        continue;
      }
      routes_.emplace(req.request_id, route);
    }
    for (const auto& id : aborts) {
      auto it = routes_.find(id);
      if (it == routes_.end()) continue;
      engine_->abort(id);
      StreamItem item;
      item.index = it->second.index;
      item.out.request_id = id;
      item.out.finished = true;
      item.out.finish_reason = FinishReason::kAbort;
      it->second.stream->push(std::move(item));
      routes_.erase(it);
      --num_live_;
    }
    bool published = false;
    if (engine_->has_work() || engine_->kv_active()) {  // kv: the step polls the connector
      step_start_ = now_s();
      in_step_ = true;
      Result<std::vector<RequestOutput>> res = std::vector<RequestOutput>{};
      try {
        res = engine_->step();
      } catch (const std::exception& e) {
        res = internal_error("engine step threw: {}", e.what());
      } catch (...) {
        res = internal_error("engine step threw an unknown exception");
      }
      in_step_ = false;
      if (!res.ok()) {
        fail_all(res.status().message());
        publish_snapshot();
        return;
      }
      // The snapshot first: a client that reads /metrics after its answer sees this step's state
      // (blocks held for a remote consumer, free blocks), not the previous step's.
      publish_snapshot();
      published = true;
      for (auto& out : res.value()) {
        auto it = routes_.find(out.request_id);
        if (it == routes_.end()) continue;
        const bool finished = out.finished;
        it->second.stream->push({it->second.index, std::move(out)});
        if (finished) {
          routes_.erase(it);
          --num_live_;
        }
      }
    }
    heartbeat_ = now_s();
    if (!published) publish_snapshot();  // no step: the aborts above may have freed blocks
  }
}

}  // namespace ml4
