// Shared fixtures for runtime tests: preset models written once per test binary into a
// temporary directory, and helpers that run a sequence through a CpuRunner.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "model/random_checkpoint.h"
#include "runtime/cpu/cpu_runner.h"

namespace ml4::testing {

// Writes `preset` (seed, dtype, layout) once per process and returns its directory.
inline std::string test_model(const std::string& preset, uint64_t seed = 7, const std::string& dtype = "bf16",
                              const std::string& layout = "default") {
  // Removed at exit: each model is tens of MB.
  static std::map<std::string, std::string>& made = *[] {
    static std::map<std::string, std::string> m;
    std::atexit([] {
      std::error_code ec;
      for (const auto& [k, d] : m) std::filesystem::remove_all(d, ec);
    });
    return &m;
  }();
  const std::string key = fmt::format("{}-s{}-{}-{}", preset, seed, dtype, layout);
  auto it = made.find(key);
  if (it != made.end()) return it->second;
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("ml4-test-{}-{}", ::getpid(), key)).string();
  MakeModelOptions o;
  o.preset = preset;
  o.out_dir = dir;
  o.seed = seed;
  o.weight_dtype = dtype;
  o.layout = layout;
  Status s = make_model(o);
  EXPECT_TRUE(s.ok()) << s.message();
  made[key] = dir;
  return dir;
}

inline std::unique_ptr<CpuRunner> load_runner(const std::string& dir, const std::string& kv = "bf16",
                                              bool duplicate_shared_kv = false) {
  RunnerOptions ro;
  ro.kv_cache_dtype = kv;
  ro.kv_cache_bytes = 64ll << 20;
  auto r = CpuRunner::load(dir, ro, duplicate_shared_kv);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : nullptr;
}

// A SeqStep over blocks [first_block, first_block + n) of every full-attention group.
inline SeqStep seq_step(const ModelRunner& r, int64_t seq_id, std::vector<int32_t> tokens, int64_t start_pos,
                        int first_block, int n_blocks, int num_logits) {
  SeqStep s;
  s.seq_id = seq_id;
  s.tokens = std::move(tokens);
  s.start_pos = start_pos;
  s.num_logits = num_logits;
  for (const auto& g : r.cache_groups()) {
    std::vector<int32_t> bt;
    if (g.sliding_window == 0)
      for (int b = 0; b < n_blocks; ++b) bt.push_back(first_block + b);
    s.block_tables.push_back(bt);
  }
  return s;
}

inline double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (static_cast<double>(a[i]) - ref[i]) * (static_cast<double>(a[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

inline int argmax(const std::vector<float>& v, size_t off, size_t n) {
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (v[off + i] > v[off + best]) best = i;
  return static_cast<int>(best);
}

}  // namespace ml4::testing
