#include "core/threads.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace ml4 {
namespace {

thread_local bool t_in_pool = false;

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
    size_ = n;
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int size() const { return size_; }

  void run(int64_t chunks, const std::function<void(int64_t)>& task) {
    std::unique_lock<std::mutex> run_lock(run_mu_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lk(mu_);
      task_ = &task;
      next_ = 0;
      total_ = chunks;
      done_ = 0;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return done_ == total_; });
    task_ = nullptr;
  }

 private:
  void work() {
    t_in_pool = true;
    for (;;) {
      int64_t i;
      const std::function<void(int64_t)>* task;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (task_ == nullptr || next_ >= total_) break;
        i = next_++;
        task = task_;
      }
      (*task)(i);
      std::lock_guard<std::mutex> lk(mu_);
      if (++done_ == total_) done_cv_.notify_all();
    }
    t_in_pool = false;
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (generation_ != seen && task_ != nullptr); });
        if (stop_) return;
        seen = generation_;
      }
      work();
    }
  }

  std::vector<std::thread> workers_;
  int size_ = 1;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t next_ = 0, total_ = 0, done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

int configured_threads() {
  if (const char* e = std::getenv("ML4_THREADS")) {
    int n = std::atoi(e);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  static Pool p(configured_threads());
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int threads = num_threads();
  if (t_in_pool || threads == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  int64_t chunks = std::min<int64_t>((n + grain - 1) / grain, threads * 4);
  int64_t per = (n + chunks - 1) / chunks;
  chunks = (n + per - 1) / per;
  pool().run(chunks, [&](int64_t c) {
    int64_t b = c * per, e = std::min(n, b + per);
    if (b < e) fn(b, e);
  });
}

}  // namespace ml4
