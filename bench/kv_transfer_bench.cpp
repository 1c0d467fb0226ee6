// kv_transfer_bench: P/D KV transfer bandwidth between two processes on one host (issue 16).
//
// The KV of a `--tokens` prompt of `--preset` (default: 32k tokens of ml4-slice-4, fp8_ds_mla)
// laid out as the runner lays it out (one region per cache group and layer slot, 64-token
// pages), in host memory (--device cpu: UCX moves it with cma) or GPU memory (--device cuda,
// CUDA builds: cuda_ipc / cuda_copy). A forked producer registers its regions and answers
// notifications; the consumer reads every block, as a decode instance pulling a whole prompt
// does, and the time includes the producer's answer (what a load waits for). Two shapes:
// "contiguous" (consecutive block ids: one read per region, what a fresh pool gives) and
// "per-block" (one read per block and region: the worst case, scattered ids).
//
// The bound printed beside it is this machine's local copy bandwidth for the same bytes,
// measured in the same run (memcpy, or cudaMemcpy device to device): a transfer reads and
// writes each byte once, as a copy does.
//   kv_transfer_bench [--preset ml4-slice-4] [--tokens 32768] [--device cpu|cuda]
//                     [--kv-cache-dtype fp8_ds_mla] [--iters 5]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kv/cache_spec.h"
#include "model/presets.h"
#include "transfer/transfer_agent.h"

#if defined(ML4_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using namespace ml4;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string preset = "ml4-slice-4";
  int64_t tokens = 32768;
  std::string device = "cpu";
  std::string kv_dtype = "fp8_ds_mla";
  int iters = 5;
};

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "kv_transfer_bench: %s\n", msg.c_str());
  std::exit(1);
}

// The agent's thread must have the device's context current (transfer::make_ucx_agent).
std::function<void()> bind_device(bool device) {
  if (!device) return {};
#if defined(ML4_WITH_CUDA)
  int dev = 0;
  cudaGetDevice(&dev);
  return [dev] { cudaSetDevice(dev); };
#else
  return {};
#endif
}

void* alloc(uint64_t bytes, bool device, uint8_t fill) {
  if (device) {
#if defined(ML4_WITH_CUDA)
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) die("cudaMalloc failed");
    cudaMemset(p, fill, bytes);
    cudaDeviceSynchronize();
    return p;
#else
    die("--device cuda: this build has no CUDA backend");
#endif
  }
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  std::memset(p, fill, bytes);  // resident before timing
  return p;
}

uint8_t first_byte(const void* p, bool device) {
#if defined(ML4_WITH_CUDA)
  if (device) {
    uint8_t b = 0;
    cudaMemcpy(&b, p, 1, cudaMemcpyDeviceToHost);
    return b;
  }
#endif
  return *static_cast<const uint8_t*>(p);
}

double copy_bound_gbs(const std::vector<uint64_t>& sizes, bool device) {
  uint64_t biggest = *std::max_element(sizes.begin(), sizes.end()), total = 0;
  for (auto s : sizes) total += s;
  void* a = alloc(biggest, device, 1);
  void* b = alloc(biggest, device, 2);
  double best = 1e30;
  for (int it = 0; it < 5; ++it) {
    const auto t0 = Clock::now();
    for (auto s : sizes) {
#if defined(ML4_WITH_CUDA)
      if (device) {
        cudaMemcpy(b, a, s, cudaMemcpyDeviceToDevice);
        continue;
      }
#endif
      std::memcpy(b, a, s);
    }
#if defined(ML4_WITH_CUDA)
    if (device) cudaDeviceSynchronize();
#endif
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return total / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--preset") a.preset = v;
    else if (k == "--tokens") a.tokens = std::stoll(v);
    else if (k == "--device") a.device = v;
    else if (k == "--kv-cache-dtype") a.kv_dtype = v;
    else if (k == "--iters") a.iters = std::stoi(v);
    else die("unknown flag " + k);
  }
  const bool device = a.device == "cuda";
  auto cfg = preset_config(a.preset);
  if (!cfg.ok()) die(cfg.status().message());
  auto dt = parse_kv_cache_dtype(a.kv_dtype);
  if (!dt.ok()) die(dt.status().message());
  auto spec = make_kv_cache_spec(*cfg, *dt);
  if (!spec.ok()) die(spec.status().message());
  const int64_t blocks = (a.tokens + 63) / 64;
  std::vector<uint64_t> sizes, block_bytes;
  for (const auto& g : spec->groups) {
    if (!g.full_attention()) continue;
    for (size_t s = 0; s < g.layers.size(); ++s) {
      sizes.push_back(static_cast<uint64_t>(g.page_bytes_per_layer() * blocks));
      block_bytes.push_back(static_cast<uint64_t>(g.page_bytes_per_layer()));
    }
  }
  uint64_t total = 0;
  for (auto s : sizes) total += s;
  if (!transfer::ucx_available()) die("this build has no UCX (scripts/setup.sh, then configure again)");

  int md_pipe[2], end_pipe[2];
  if (pipe(md_pipe) != 0 || pipe(end_pipe) != 0) die("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) die("fork failed");
  if (pid == 0) {  // producer
    close(md_pipe[0]);
    close(end_pipe[1]);
    std::vector<transfer::MemoryRegion> regions;
    for (size_t r = 0; r < sizes.size(); ++r)
      regions.push_back({alloc(sizes[r], device, static_cast<uint8_t>(r * 7 + 3)), sizes[r], device});
    auto agent = transfer::make_ucx_agent("bench-producer", bind_device(device));
    if (!agent.ok()) die(agent.status().message());
    if (!(*agent)->register_memory(regions).ok()) die("register failed");
    (*agent)->set_notification_handler([](const std::string&) { return std::string("ok"); });
    std::string md = (*agent)->local_metadata().value();
    uint64_t n = md.size();
    if (write(md_pipe[1], &n, 8) != 8 || write(md_pipe[1], md.data(), n) != static_cast<ssize_t>(n)) die("pipe write");
    char c;
    while (read(end_pipe[0], &c, 1) > 0) {
    }
    _exit(0);
  }
  close(md_pipe[1]);
  close(end_pipe[0]);
  uint64_t n = 0;
  if (read(md_pipe[0], &n, 8) != 8) die("no metadata from the producer");
  std::string md(n, '\0');
  for (uint64_t got = 0; got < n;) {
    ssize_t r = read(md_pipe[0], md.data() + got, n - got);
    if (r <= 0) die("short metadata");
    got += r;
  }
  std::vector<transfer::MemoryRegion> regions;
  for (size_t r = 0; r < sizes.size(); ++r) regions.push_back({alloc(sizes[r], device, 0), sizes[r], device});
  auto agent = transfer::make_ucx_agent("bench-consumer", bind_device(device));
  if (!agent.ok()) die(agent.status().message());
  if (!(*agent)->register_memory(regions).ok()) die("register failed");
  auto peer = (*agent)->load_peer(md);
  if (!peer.ok()) die(peer.status().message());

  auto run = [&](const std::vector<transfer::ReadOp>& ops) {
    std::vector<double> times;
    for (int it = 0; it < a.iters; ++it) {
      const auto t0 = Clock::now();
      auto x = (*agent)->post_read(*peer, ops, "done");
      if (!x.ok()) die(x.status().message());
      transfer::XferStatus st;
      while ((st = (*agent)->status(*x)).state == transfer::XferState::kPending) std::this_thread::yield();
      if (st.state != transfer::XferState::kDone) die("transfer failed: " + st.error);
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      (*agent)->release(*x);
    }
    std::sort(times.begin(), times.end());
    for (size_t r = 0; r < regions.size(); ++r)
      if (first_byte(regions[r].base, device) != static_cast<uint8_t>(r * 7 + 3)) die("wrong bytes after the read");
    return times;
  };
  std::vector<transfer::ReadOp> contiguous, per_block;
  for (size_t r = 0; r < sizes.size(); ++r) {
    contiguous.push_back({static_cast<int>(r), 0, static_cast<int>(r), 0, sizes[r]});
    for (int64_t b = 0; b < blocks; ++b)
      per_block.push_back({static_cast<int>(r), b * block_bytes[r], static_cast<int>(r), b * block_bytes[r], block_bytes[r]});
  }
  auto tc = run(contiguous);
  auto tb = run(per_block);
  const double bound = copy_bound_gbs(sizes, device);
  close(end_pipe[1]);
  int status = 0;
  waitpid(pid, &status, 0);
  std::printf("kv_transfer_bench: %s, %lld tokens, %s, %zu regions, %.1f MiB (%s memory, %s)\n", a.preset.c_str(),
              static_cast<long long>(a.tokens), a.kv_dtype.c_str(), sizes.size(), total / 1048576.0,
              device ? "device" : "host", (*agent)->describe().c_str());
  auto line = [&](const char* name, const std::vector<double>& t, size_t ops) {
    std::printf("  %-10s %6zu reads: best %.3f ms = %.2f GB/s, median %.3f ms = %.2f GB/s\n", name, ops, t.front() * 1e3,
                total / t.front() / 1e9, t[t.size() / 2] * 1e3, total / t[t.size() / 2] / 1e9);
  };
  line("contiguous", tc, contiguous.size());
  line("per-block", tb, per_block.size());
  std::printf("  bound: local copy of the same bytes (%s) %.2f GB/s; contiguous reaches %.0f%%\n",
              device ? "cudaMemcpy D2D" : "memcpy", bound, 100.0 * (total / tc.front() / 1e9) / bound);
  return 0;
}
