// parallel_for (core/threads.h): every index exactly once, for any n / grain, back-to-back
// regions (workers spinning), regions after a pause (workers asleep, woken), nested calls,
// and regions started from several threads at once (serialised by the pool).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "core/threads.h"

namespace ml4 {
namespace {

// Runs one region over [0, n) and checks that each index was visited exactly once and
// that every chunk respected the grain (except the last).
void check_cover(int64_t n, int64_t grain) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  std::atomic<int64_t> short_chunks{0};
  parallel_for(n, grain, [&](int64_t b, int64_t e) {
    ASSERT_LE(0, b);
    ASSERT_LT(b, e);
    ASSERT_LE(e, n);
    if (e - b < grain && e != n) short_chunks.fetch_add(1);
    for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
  });
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " grain=" << grain << " i=" << i;
  EXPECT_EQ(short_chunks.load(), 0) << "n=" << n << " grain=" << grain;
}

TEST(Threads, EveryIndexOnce) {
  EXPECT_GE(num_threads(), 1);
  for (int64_t n : {1, 2, 3, 7, 64, 1000, 100003})
    for (int64_t grain : {1, 3, 64, 5000}) check_cover(n, grain);
  parallel_for(0, 1, [](int64_t, int64_t) { FAIL() << "called for n = 0"; });
}

// Thousands of short regions back to back (the decode pattern), with sums to check.
TEST(Threads, ManyShortRegions) {
  std::mt19937 rng(7);
  for (int r = 0; r < 5000; ++r) {
    const int64_t n = 1 + rng() % 300;
    std::atomic<int64_t> sum{0};
    parallel_for(n, 1 + rng() % 8, [&](int64_t b, int64_t e) {
      int64_t s = 0;
      for (int64_t i = b; i < e; ++i) s += i;
      sum.fetch_add(s);
    });
    ASSERT_EQ(sum.load(), n * (n - 1) / 2) << "region " << r;
  }
}

// After a pause longer than the spin, workers sleep; the next region must still run
// everything (woken workers or the caller alone).
TEST(Threads, RegionsAfterIdle) {
  for (int r = 0; r < 4; ++r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    check_cover(4096, 16);
  }
}

// A parallel_for inside a chunk runs serially on that thread and covers its range.
TEST(Threads, NestedRunsInline) {
  std::vector<std::atomic<int>> hits(64 * 64);
  parallel_for(64, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const auto self = std::this_thread::get_id();
      parallel_for(64, 1, [&](int64_t b2, int64_t e2) {
        EXPECT_EQ(std::this_thread::get_id(), self);
        for (int64_t j = b2; j < e2; ++j) hits[i * 64 + j].fetch_add(1);
      });
    }
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

// Several application threads (an engine and a server, say) calling at once.
TEST(Threads, ConcurrentCallers) {
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&, c] {
      for (int r = 0; r < 300; ++r) {
        const int64_t n = 100 + 37 * c + r;
        std::atomic<int64_t> sum{0};
        parallel_for(n, 2, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) sum.fetch_add(i + 1);
        });
        if (sum.load() != n * (n + 1) / 2) failures.fetch_add(1);
      }
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace ml4
