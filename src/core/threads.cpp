// The worker pool behind parallel_for: see threads.h.
//
// Design (issue 22: decode at the bandwidth limit, yet graceful under CPU contention):
//   - A region is published as one 64-bit word `state_` = generation | chunk count | next
//     chunk. Threads claim chunks by CAS on that word, so a claim can never land in a
//     different region than the one it read (the generation is part of the word), and the
//     task pointer is read only after a successful claim (the caller cannot return, and so
//     cannot publish a new task, while a claimed chunk is unfinished).
//   - The caller works too and claims chunks like any worker: a worker the OS has not
//     scheduled simply claims nothing, and the caller does its share. This is what kept ml4
//     at 3-13 tok/s where a fixed split with a barrier (llama.cpp) fell to ~1 tok/s on a
//     loaded machine: nobody waits for a thread that has not started.
//   - Waiting is spin-then-sleep, both for idle workers (next region) and for the caller
//     (chunks claimed by others). A decode step runs a few hundred short regions with a
//     few microseconds of serial work between them; a condition-variable wake costs
//     10-50 us on this VM, so workers spin for kSpinMicros first (with `pause`), then sleep.
//     On a loaded machine the spin is bounded, so an idle worker gives its core back.
//   - No allocation per region: the callable is passed by reference (FnRef), not wrapped
//     in a std::function (whose small buffer is too small for parallel_for's wrapper).
#include "core/threads.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ML4_CPU_RELAX() _mm_pause()
#else
#define ML4_CPU_RELAX() std::this_thread::yield()
#endif

namespace ml4 {
namespace {

thread_local bool t_in_pool = false;

// How long an idle thread polls before it sleeps (microseconds): longer than the serial
// gaps between the regions of a decode step, short enough to give the core back quickly
// to other processes. ML4_THREAD_SPIN_US overrides it (0: sleep at once).
int64_t spin_micros() {
  if (const char* e = std::getenv("ML4_THREAD_SPIN_US")) {
    const long v = std::atol(e);
    if (v >= 0) return v;
  }
  return 100;
}

// A non-owning reference to a callable void(int64_t): what std::function does, without
// the allocation.
class FnRef {
 public:
  template <typename F>
  explicit FnRef(const F& f) : obj_(&f), call_([](const void* o, int64_t i) { (*static_cast<const F*>(o))(i); }) {}
  void operator()(int64_t i) const { call_(obj_, i); }

 private:
  const void* obj_;
  void (*call_)(const void*, int64_t);
};

// state_ layout: [63:40] generation, [39:20] chunk count, [19:0] next chunk.
constexpr int kChunkBits = 20;
constexpr uint64_t kChunkMask = (uint64_t{1} << kChunkBits) - 1;
constexpr int64_t kMaxChunks = int64_t{1} << (kChunkBits - 1);
inline uint64_t gen_of(uint64_t s) { return s >> (2 * kChunkBits); }
inline int64_t total_of(uint64_t s) { return static_cast<int64_t>((s >> kChunkBits) & kChunkMask); }
inline int64_t next_of(uint64_t s) { return static_cast<int64_t>(s & kChunkMask); }

class Pool {
 public:
  explicit Pool(int n) : size_(n), spin_(std::chrono::microseconds(spin_micros())) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int size() const { return size_; }

  void run(int64_t chunks, FnRef task) {
    std::lock_guard<std::mutex> one_region(run_mu_);  // one parallel region at a time
    task_ = &task;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = gen_of(state_.load(std::memory_order_relaxed)) + 1;
    state_.store((gen << (2 * kChunkBits)) | (static_cast<uint64_t>(chunks) << kChunkBits), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    const bool was_in_pool = t_in_pool;
    t_in_pool = true;
    work(gen);
    t_in_pool = was_in_pool;
    // Wait for chunks other threads claimed.
    if (done_.load(std::memory_order_acquire) != chunks) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; done_.load(std::memory_order_acquire) != chunks; ++i) {
        ML4_CPU_RELAX();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() - t0 > spin_) {
          std::unique_lock<std::mutex> lk(mu_);
          caller_sleeping_.store(true, std::memory_order_seq_cst);
          done_cv_.wait(lk, [&] { return done_.load(std::memory_order_seq_cst) == chunks; });
          caller_sleeping_.store(false, std::memory_order_relaxed);
          break;
        }
      }
    }
    task_ = nullptr;
  }

 private:
  // Claims and runs chunks of region `gen` until none is left.
  void work(uint64_t gen) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      int64_t i;
      do {
        if (gen_of(s) != gen) return;
        i = next_of(s);
        if (i >= total_of(s)) return;
      } while (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire));
      (*task_)(i);
      const int64_t total = total_of(s);
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == total &&
          caller_sleeping_.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_all();
      }
    }
  }

  void loop() {
    t_in_pool = true;
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = gen_of(state_.load(std::memory_order_acquire));
      if (gen == seen) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; gen == seen; ++i) {
          ML4_CPU_RELAX();
          gen = gen_of(state_.load(std::memory_order_acquire));
          if (gen == seen && (i & 63) == 63 && std::chrono::steady_clock::now() - t0 > spin_) {
            std::unique_lock<std::mutex> lk(mu_);
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            cv_.wait(lk, [&] {
              return stop_.load() || gen_of(state_.load(std::memory_order_seq_cst)) != seen;
            });
            sleepers_.fetch_sub(1, std::memory_order_relaxed);
            gen = gen_of(state_.load(std::memory_order_acquire));
          }
          if (stop_.load(std::memory_order_relaxed)) return;
        }
      }
      if (stop_.load(std::memory_order_relaxed)) return;
      seen = gen;
      work(gen);
    }
  }

  const int size_;
  const std::chrono::steady_clock::duration spin_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<bool> stop_{false};
  const FnRef* task_ = nullptr;
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
  // floor(n / grain) chunks at most, so each holds >= grain items (n > grain here).
  int64_t chunks = std::min<int64_t>({n / grain, int64_t{threads} * 4, kMaxChunks});
  int64_t per = (n + chunks - 1) / chunks;
  chunks = (n + per - 1) / per;
  auto body = [&](int64_t c) {
    int64_t b = c * per, e = std::min(n, b + per);
    if (b < e) fn(b, e);
  };
  pool().run(chunks, FnRef(body));
}

}  // namespace ml4
