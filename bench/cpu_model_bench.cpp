// Whole-model CPU speed, the way llama-bench measures it (so the two print comparable
// figures from the same model; docs/BENCHMARKS.md "CPU backend"):
//   ppN: one step over a prompt of N random tokens from an empty cache (prefill, the whole
//        prompt as one chunk), tokens/s = N / step time;
//   tgN: N decode steps of one token each, starting from an empty cache, tokens/s = N /
//        total time (llama-bench's tg: no prompt, the context grows from 0 to N).
//   vN:  after an unmeasured prompt of --ctx tokens, 16 steps of N tokens each per run (the
//        runs continue the sequence: the context grows by 16 N a run), with logits for all N rows (a speculative verification of N - 1 drafts; v1 is plain decoding
//        at that context); prints ms per step, so v8 / v1 is what a verify step costs in
//        plain steps.
// Each test runs --reps times after one unmeasured warm-up run and prints mean and stddev of
// the per-run tokens/s (llama-bench's avg_ts / stddev_ts). Weight bytes per decode token
// (all linears touched by one token: attention, dense FFN or top-k + shared experts, the
// output head; embeddings are one row) are printed with the achieved GB/s, so the figure can
// be held against bench/stream_bench's read bandwidth. The load average is printed before
// and after each test: the dev machine is shared.
//
//   cpu_model_bench --model DIR [-p 64,512] [-n 64,128] [-v 1,8] [--ctx 512] [-r 3] [--kv-cache-dtype fp8_ds_mla] [--profile 1]
//                   [--dtype auto|bfloat16]   (the linears' activations: ml4 serve --dtype)
//                   [--weights auto|mmap|copy] (where the linears live: ml4 serve --mmap / --no-mmap)
//
// --profile 1: after each test, the wall time per piece of the forward (the program's timed()
// labels, summed over the measured runs; nested labels count in both) as PROFILE lines.
//
// Output (one line per test):
//   CPUBENCH model=DIR test=tg128 threads=2 tok_s=12.34 stddev=0.21 weight_gb_per_tok=1.14 gb_s=14.1 load=1.2-1.5
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/threads.h"
#include "model/checkpoint.h"
#include "model/weight_names.h"
#include "runtime/cpu/cpu_runner.h"

namespace {

using Clock = std::chrono::steady_clock;

double loadavg() {
  std::ifstream f("/proc/loadavg");
  double a = -1;
  f >> a;
  return a;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  size_t b = 0;
  while (b < s.size()) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    if (e > b && std::atoi(s.substr(b, e - b).c_str()) > 0) v.push_back(std::atoi(s.substr(b, e - b).c_str()));  // 0: none (llama-bench's -p 0)
    b = e + 1;
  }
  return v;
}

// Bytes of the linear weights one decode token reads (routed experts: top-k of them), each
// in the format its stored dtype says (an FP8 checkpoint may hold an FP8 or a bf16 head).
double weight_bytes_per_token(const ml4::ModelConfig& cfg, const ml4::Checkpoint& ck) {
  using namespace ml4;
  double bytes = 0;
  const double share = cfg.moe.num_experts > 0 ? double(cfg.moe.num_experts_per_tok) / cfg.moe.num_experts : 1.0;
  for (const ExpectedTensor& t : expected_tensors(cfg, CheckpointLayout::kMistral)) {
    if (t.drafter || (t.role != TensorRole::kLinear && t.role != TensorRole::kRouterGate)) continue;
    LinearFormat f = t.format;
    if (ck.layout() == CheckpointLayout::kMistral && ck.contains(t.name)) {
      const DType d = ck.get(t.name).value().dtype();
      if (d == DType::kF8E4M3) f = LinearFormat::kFP8Block;
      else if (d == DType::kBF16) f = LinearFormat::kBF16;
      else if (d == DType::kF32) f = LinearFormat::kF32;
    }
    double b = 0;
    switch (f) {
      case LinearFormat::kF32: b = 4.0 * t.numel(); break;
      case LinearFormat::kBF16: b = 2.0 * t.numel(); break;
      case LinearFormat::kFP8Block: b = 1.0 * t.numel() + 4.0 * std::ceil(t.shape[0] / 128.0) * std::ceil(t.shape[1] / 128.0); break;
      case LinearFormat::kNVFP4: b = 0.5 * t.numel() + t.numel() / 16.0; break;
      case LinearFormat::kMXFP4: b = 0.5 * t.numel() + t.numel() / 32.0; break;
    }
    bytes += t.routed_expert ? b * share : b;
  }
  return bytes;
}

struct Sequence {
  std::vector<std::vector<int32_t>> tables;  // per group: blocks 0..n-1 (the bench owns the whole pool)
};

}  // namespace

int main(int argc, char** argv) {
  std::string model, kv_dtype = "fp8_ds_mla", dtype = "auto", weights = "auto";
  std::vector<int> pp = {64, 512}, tg = {64, 128}, vs;
  int reps = 3, ctx = 512;
  constexpr int kVerifySteps = 16;
  bool profile = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--model" || a == "-m") model = argv[i + 1];
    else if (a == "-p") pp = parse_list(argv[i + 1]);
    else if (a == "-n") tg = parse_list(argv[i + 1]);
    else if (a == "-v") vs = parse_list(argv[i + 1]);
    else if (a == "--ctx") ctx = std::atoi(argv[i + 1]);
    else if (a == "-r") reps = std::atoi(argv[i + 1]);
    else if (a == "--kv-cache-dtype") kv_dtype = argv[i + 1];
    else if (a == "--dtype") dtype = argv[i + 1];
    else if (a == "--weights") weights = argv[i + 1];
    else if (a == "--profile") profile = std::atoi(argv[i + 1]) != 0;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (model.empty() || reps <= 0) {
    std::fprintf(stderr, "usage: cpu_model_bench --model DIR [-p 64,512] [-n 64,128] [-v 1,8] [--ctx 512] [-r 3] [--kv-cache-dtype D] [--dtype auto|bfloat16] [--weights auto|mmap|copy]\n");
    return 2;
  }
  const int max_tokens = std::max({pp.empty() ? 0 : *std::max_element(pp.begin(), pp.end()),
                                   tg.empty() ? 0 : *std::max_element(tg.begin(), tg.end()),
                                   vs.empty() ? 0 : ctx + (reps + 1) * kVerifySteps * *std::max_element(vs.begin(), vs.end())});
  ml4::RunnerOptions opts;
  opts.kv_cache_dtype = kv_dtype;
  opts.dtype = dtype;
  opts.weight_memory = weights == "mmap" ? ml4::WeightMemory::kMapped
                       : weights == "copy" ? ml4::WeightMemory::kCopy
                                           : ml4::WeightMemory::kAuto;
  opts.kv_cache_bytes = 64ll << 20;
  opts.max_model_len = max_tokens + 64;
  auto runner = ml4::CpuRunner::load(model, opts);
  if (!runner.ok()) {
    std::fprintf(stderr, "cpu_model_bench: %s\n", runner.status().message().c_str());
    return 1;
  }
  auto& r = *runner.value();
  const ml4::ModelConfig& cfg = r.config();
  auto ck = ml4::Checkpoint::open(model);
  if (!ck.ok()) {
    std::fprintf(stderr, "cpu_model_bench: %s\n", ck.status().message().c_str());
    return 1;
  }
  const double wbytes = weight_bytes_per_token(cfg, ck.value());
  std::printf("# model %s: %d layers, dim %d, vocab %d, threads %d, %.3f GB of weights per decode token, kv %s\n",
              model.c_str(), cfg.n_layers, cfg.dim, cfg.vocab_size, ml4::num_threads(), wbytes / 1e9, kv_dtype.c_str());
  // Block tables: blocks 0.. of every group (one sequence at a time).
  std::vector<std::vector<int32_t>> tables;
  for (const auto& g : r.cache_groups()) {
    if (g.sliding_window != 0 && g.num_blocks == 0) {  // the drafter's window, off without speculation
      tables.emplace_back();
      continue;
    }
    const int64_t need = (max_tokens + g.page_tokens) / g.page_tokens;
    if (need > g.num_blocks) {
      std::fprintf(stderr, "cpu_model_bench: KV group %s has %lld blocks, needs %lld\n", g.name.c_str(),
                   static_cast<long long>(g.num_blocks), static_cast<long long>(need));
      return 1;
    }
    std::vector<int32_t> t(need);
    for (int64_t b = 0; b < need; ++b) t[b] = static_cast<int32_t>(b);
    tables.push_back(t);
  }
  std::mt19937 rng(42);
  const int lo = std::min(1000, cfg.vocab_size / 2);
  auto random_tokens = [&](int n) {
    std::vector<int32_t> v(n);
    for (auto& t : v) t = lo + static_cast<int32_t>(rng() % (cfg.vocab_size - lo));
    return v;
  };
  auto step = [&](std::vector<int32_t> tokens, int64_t start, int logits = 1) {
    ml4::StepInput in;
    ml4::SeqStep s;
    s.seq_id = 1;
    s.tokens = std::move(tokens);
    s.start_pos = start;
    s.block_tables = tables;
    s.num_logits = logits;
    in.seqs.push_back(std::move(s));
    auto out = r.execute(in);
    if (!out.ok()) {
      std::fprintf(stderr, "cpu_model_bench: step failed: %s\n", out.status().message().c_str());
      std::exit(1);
    }
  };
  auto report = [&](const std::string& test, std::vector<double> ts, double l0, bool decode) {
    double mean = 0, var = 0;
    for (double v : ts) mean += v;
    mean /= ts.size();
    for (double v : ts) var += (v - mean) * (v - mean);
    const double sd = ts.size() > 1 ? std::sqrt(var / (ts.size() - 1)) : 0.0;
    std::printf("CPUBENCH model=%s test=%s threads=%d dtype=%s tok_s=%.2f stddev=%.2f", model.c_str(), test.c_str(),
                ml4::num_threads(), dtype.c_str(), mean, sd);
    if (test[0] == 'v') std::printf(" ctx=%d ms_per_step=%.3f", ctx, 1e3 * std::atof(test.c_str() + 1) / mean);
    if (decode) std::printf(" weight_gb_per_tok=%.3f gb_s=%.2f", wbytes / 1e9, wbytes * mean / 1e9);
    std::printf(" load=%.2f-%.2f\n", l0, loadavg());
    if (profile) {
      double total = 0;
      const double n = std::atof(test.c_str() + (test[0] == 'v' ? 1 : 2)) * (test[0] == 'v' ? kVerifySteps : 1);
      for (double v : ts) total += n / v;  // n tokens at v tokens/s
      for (const auto& [label, sec] : r.backend().profile())
        std::printf("PROFILE test=%s piece=\"%s\" ms_per_run=%.3f share=%.1f%%\n", test.c_str(), label.c_str(),
                    1e3 * sec / ts.size(), 100.0 * sec / total);
      r.backend().set_profile(false);
    }
    std::fflush(stdout);
  };
  for (int n : pp) {
    const double l0 = loadavg();
    std::vector<double> ts;
    for (int rep = -1; rep < reps; ++rep) {
      if (rep == 0 && profile) r.backend().set_profile(true);  // after the warm-up
      auto toks = random_tokens(n);
      const auto t0 = Clock::now();
      step(toks, 0);
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (rep >= 0) ts.push_back(n / s);
    }
    report("pp" + std::to_string(n), ts, l0, false);
  }
  for (int n : tg) {
    const double l0 = loadavg();
    std::vector<double> ts;
    for (int rep = -1; rep < reps; ++rep) {
      if (rep == 0 && profile) r.backend().set_profile(true);  // after the warm-up
      auto toks = random_tokens(n);
      const auto t0 = Clock::now();
      for (int i = 0; i < n; ++i) step({toks[i]}, i);
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (rep >= 0) ts.push_back(n / s);
    }
    report("tg" + std::to_string(n), ts, l0, true);
  }
  for (int n : vs) {
    const double l0 = loadavg();
    std::vector<double> ts;
    step(random_tokens(ctx), 0);  // the prompt, not measured
    int64_t pos = ctx;
    for (int rep = -1; rep < reps; ++rep) {
      if (rep == 0 && profile) r.backend().set_profile(true);  // after the warm-up
      const auto t0 = Clock::now();
      for (int i = 0; i < kVerifySteps; ++i, pos += n) step(random_tokens(n), pos, n);
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (rep >= 0) ts.push_back(static_cast<double>(n) * kVerifySteps / s);
    }
    report("v" + std::to_string(n), ts, l0, false);
  }
  return 0;
}
