// Tokenizer throughput: encode and decode MB/s of a large text on one thread, and encode
// split over threads by lines (how a server encodes many requests at once).
//
//   bench/tokenizer_bench TEKKEN_JSON TEXT_FILE [REPEATS]
// prints one JSON line. tools/tokenizer/bench_reference.py builds TEXT_FILE, runs this and
// mistral-common / tiktoken on the same file in the same run, and checks the token counts
// agree; docs/BENCHMARKS.md ("Tokenizer") records the figures.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TEKKEN_JSON TEXT_FILE [REPEATS]\n", argv[0]);
    return 2;
  }
  const int repeats = argc > 3 ? std::max(1, std::atoi(argv[3])) : 3;
  double t0 = now_s();
  auto tok = ml4::Tokenizer::load(argv[1]);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().message().c_str());
    return 1;
  }
  double load_s = now_s() - t0;
  std::ifstream f(argv[2], std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", argv[2]);
    return 1;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  const double mb = text.size() / 1e6;

  std::vector<int32_t> ids;
  double best_enc = 1e30;
  for (int r = 0; r < repeats; ++r) {
    ids.clear();
    double s = now_s();
    tok.value()->encode_into(text, false, ids);
    best_enc = std::min(best_enc, now_s() - s);
  }
  double best_dec = 1e30;
  size_t dec_bytes = 0;
  for (int r = 0; r < repeats; ++r) {
    double s = now_s();
    dec_bytes = tok.value()->decode(ids).size();
    best_dec = std::min(best_dec, now_s() - s);
  }
  // Many documents at once: split at line ends into one slice per thread.
  const int nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::string_view> parts;
  size_t begin = 0;
  for (int i = 1; i <= nt; ++i) {
    size_t end = i == nt ? text.size() : text.find('\n', text.size() * i / nt);
    if (end == std::string::npos) end = text.size();
    parts.emplace_back(text.data() + begin, end - begin);
    begin = end;
  }
  double s = now_s();
  std::vector<std::thread> th;
  std::vector<size_t> counts(parts.size());
  for (size_t i = 0; i < parts.size(); ++i)
    th.emplace_back([&, i] { counts[i] = tok.value()->encode(parts[i]).size(); });
  for (auto& t : th) t.join();
  double par_s = now_s() - s;

  uint64_t fnv = 1469598103934665603ull;  // FNV-1a over the ids, to compare with Python's
  for (int32_t id : ids) fnv = (fnv ^ static_cast<uint64_t>(id)) * 1099511628211ull;
  std::printf(
      "{\"ids_fnv\": \"%016llx\", \"bytes\": %zu, \"tokens\": %zu, \"load_s\": %.3f, \"encode_mb_s\": %.2f, \"decode_mb_s\": %.2f, "
      "\"threads\": %d, \"encode_parallel_mb_s\": %.2f, \"decoded_bytes\": %zu}\n",
      static_cast<unsigned long long>(fnv), text.size(), ids.size(), load_s, mb / best_enc, mb / best_dec, nt, mb / par_s, dec_bytes);
  return 0;
}
