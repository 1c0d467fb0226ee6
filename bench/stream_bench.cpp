// STREAM-like memory bandwidth probe: the ceiling for CPU decode (issue 22).
//
// Decode streams every active weight once per token, so its bound is how fast this machine
// reads DRAM. This harness measures that with its own threads (not the ml4 pool, so the
// figure does not depend on the code it bounds):
//   read   sum += a[i]                 (the decode pattern: 1 stream in, nothing out)
//   copy   c[i] = a[i]                 (STREAM Copy; 2 streams, counted as 2 x bytes)
//   triad  a[i] = b[i] + s * c[i]      (STREAM Triad; 3 streams)
// Arrays are 16x the L3 by default (never cache-resident), touched once before timing
// (first-touch page faults are not bandwidth), 8 independent AVX2 accumulators per thread
// (the read loop is bound by loads, not by add latency). Each kernel runs `--reps` times
// per thread count; it prints the best (STREAM reports the best too: the least disturbed
// run) and the median, and the load average before and after, since the dev machine is
// shared.
//
// Pages: each array is an anonymous mapping advised MADV_NOHUGEPAGE (4k: what a std::vector
// gets where transparent_hugepage is "madvise") or MADV_HUGEPAGE (huge: 2 MiB pages, what the
// CPU backend's weights get, model/weight_memory.h). Both are printed: the huge-page figure is
// the ceiling for decode.
//
//   stream_bench [--mib 512] [--reps 10] [--threads 1,2] [--pages 4k,huge]
//
// Output, one line per (pages, kernel, threads):
//   STREAM kernel=read threads=2 pages=huge mib=512 best_gbs=17.1 median_gbs=15.9 loadavg=3.1
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

double loadavg() {
  std::ifstream f("/proc/loadavg");
  double a = -1;
  f >> a;
  return a;
}

float read_kernel(const float* a, int64_t b, int64_t e) {
  int64_t i = b;
#if defined(__AVX2__)
  __m256 s[8];
  for (auto& v : s) v = _mm256_setzero_ps();
  for (; i + 64 <= e; i += 64)
    for (int j = 0; j < 8; ++j) s[j] = _mm256_add_ps(s[j], _mm256_loadu_ps(a + i + 8 * j));
  __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])),
                           _mm256_add_ps(_mm256_add_ps(s[4], s[5]), _mm256_add_ps(s[6], s[7])));
  float lanes[8];
  _mm256_storeu_ps(lanes, t);
  float r = 0;
  for (float v : lanes) r += v;
#else
  float r = 0;
#endif
  for (; i < e; ++i) r += a[i];
  return r;
}

void copy_kernel(const float* a, float* c, int64_t b, int64_t e) { std::memcpy(c + b, a + b, (e - b) * sizeof(float)); }

void triad_kernel(float* a, const float* b_, const float* c, float s, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) a[i] = b_[i] + s * c[i];
}

// Runs fn(begin, end) on `threads` threads over [0, n) once, returns seconds.
template <typename F>
double run_parallel(int threads, int64_t n, F&& fn) {
  std::vector<std::thread> ts;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  const int64_t per = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t)
    ts.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      fn(std::min(n, t * per), std::min(n, (t + 1) * per));
    });
  while (ready.load() < threads - 1) std::this_thread::yield();
  auto t0 = Clock::now();
  go.store(true, std::memory_order_release);
  fn(0, std::min(n, per));
  for (auto& t : ts) t.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// An anonymous array of n floats, advised for 4 KiB or 2 MiB pages; first touch is the caller's.
struct Array {
  void* map = nullptr;
  size_t len = 0;
  float* data = nullptr;
  Array(int64_t n, bool huge) {
    const size_t page = size_t{2} << 20;
    len = static_cast<size_t>(n) * sizeof(float) + page;
    map = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
      std::perror("stream_bench: mmap");
      std::exit(1);
    }
    auto* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(map) + page - 1) & ~(page - 1));
    madvise(p, static_cast<size_t>(n) * sizeof(float), huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    data = reinterpret_cast<float*>(p);
  }
  ~Array() { munmap(map, len); }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
};

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t mib = 512;
  int reps = 10;
  std::vector<int> threads = {1, 2};
  std::vector<std::string> pages = {"4k", "huge"};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--mib")) mib = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--threads")) threads = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--pages")) {
      pages.clear();
      for (std::string l = argv[i + 1]; !l.empty();) {
        const size_t c = l.find(',');
        pages.push_back(l.substr(0, c));
        l = c == std::string::npos ? "" : l.substr(c + 1);
      }
    } else {
      std::fprintf(stderr, "usage: stream_bench [--mib N] [--reps N] [--threads 1,2] [--pages 4k,huge]\n");
      return 2;
    }
  }
  if (mib <= 0 || reps <= 0 || threads.empty()) {
    std::fprintf(stderr, "stream_bench: --mib and --reps must be positive\n");
    return 2;
  }
  const int64_t n = mib * (int64_t{1} << 20) / 4;
  std::printf("# stream_bench: %lld MiB per array, %d reps, hardware threads %u, loadavg %.2f\n",
              static_cast<long long>(mib), reps, std::thread::hardware_concurrency(), loadavg());
  std::vector<float> sink(64);
  struct Kernel {
    const char* name;
    int streams;
  };
  for (const std::string& pg : pages) {
    if (pg != "4k" && pg != "huge") {
      std::fprintf(stderr, "stream_bench: --pages takes 4k and/or huge, not %s\n", pg.c_str());
      return 2;
    }
    Array A(n, pg == "huge"), B(n, pg == "huge"), C(n, pg == "huge");
    float *a = A.data, *b = B.data, *c = C.data;
    for (int64_t i = 0; i < n; ++i) {  // first touch, outside the timing
      a[i] = 1.0f;
      b[i] = 2.0f;
      c[i] = 0.5f;
    }
    for (const Kernel k : {Kernel{"read", 1}, Kernel{"copy", 2}, Kernel{"triad", 3}}) {
      for (int t : threads) {
        if (t <= 0) continue;
        const double l0 = loadavg();
        std::vector<double> gbs;
        for (int r = 0; r < reps; ++r) {
          double s = 0;
          if (k.streams == 1) {
            s = run_parallel(t, n, [&](int64_t b0, int64_t e0) { sink[(b0 / 4096) % 64] += read_kernel(a, b0, e0); });
          } else if (k.streams == 2) {
            s = run_parallel(t, n, [&](int64_t b0, int64_t e0) { copy_kernel(a, c, b0, e0); });
          } else {
            s = run_parallel(t, n, [&](int64_t b0, int64_t e0) { triad_kernel(a, b, c, 0.5f, b0, e0); });
          }
          gbs.push_back(static_cast<double>(k.streams) * n * 4 / s / 1e9);
        }
        std::sort(gbs.begin(), gbs.end());
        std::printf("STREAM kernel=%s threads=%d pages=%s mib=%lld best_gbs=%.2f median_gbs=%.2f worst_gbs=%.2f "
                    "loadavg=%.2f-%.2f\n",
                    k.name, t, pg.c_str(), static_cast<long long>(mib), gbs.back(), gbs[gbs.size() / 2], gbs.front(),
                    l0, loadavg());
      }
    }
  }
  float total = 0;
  for (float v : sink) total += v;
  return total == -1.0f ? 1 : 0;  // keeps the read loop's result alive
}
