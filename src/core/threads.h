// A fixed pool of worker threads and parallel_for over an index range.
//
// The CPU backend splits matrix rows and attention heads across cores. The pool is
// created once (size from ML4_THREADS, default hardware_concurrency) and reused.
#pragma once

#include <cstdint>
#include <functional>

namespace ml4 {

int num_threads();
// Calls fn(begin, end) on disjoint chunks covering [0, n), chunks of at least `grain`
// items, and returns when all are done. Nested calls run serially on the caller.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace ml4
