// The engine's own time per step (scheduling, block tables, the step's inputs, applying the
// runner's output, detokenization), against a runner that costs nothing: it answers every row
// with a device-sampled token at once, and drafts what it will accept. On a GPU serving a small
// model this host work sits between steps the device runs in ~0.3-1 ms, so it is worth knowing.
//
//   engine_overhead_bench [--concurrency 1,8,32,128] [--prompt 512] [--output 256] [--drafts 0,7]
//
// Prints, per (concurrency, drafts): steps, host microseconds per step and per output token.
#include <chrono>
#include <cstdio>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "engine/engine.h"
#include "engine/text_codec.h"
#include "runtime/model_runner.h"

namespace ml4 {
namespace {

class NullRunner : public ModelRunner {
 public:
  NullRunner(int vocab, int64_t blocks, int block_size) {
    cfg_.name = "null";
    cfg_.vocab_size = vocab;
    cfg_.max_position_embeddings = 1 << 20;
    cfg_.drafter.enabled = block_size > 0;
    cfg_.drafter.n_layers = 1;
    cfg_.drafter.block_size = block_size;
    cfg_.drafter.window = 2048;
    groups_ = {{"latent", 64, blocks, 0, 656}, {"indexer", 64, blocks, 0, 132}};
    if (block_size > 0) groups_.push_back({"drafter", 64, blocks, 2048, 256});
  }
  const ModelConfig& config() const override { return cfg_; }
  const std::vector<CacheGroupInfo>& cache_groups() const override { return groups_; }
  bool samples_on_device() const override { return true; }
  bool has_drafter() const override { return cfg_.drafter.enabled; }
  Result<StepOutput> execute(const StepInput& in) override {
    StepOutput out;
    for (const auto& s : in.seqs)
      for (int j = 0; j < s.num_logits; ++j) {
        out.sampled.push_back(kToken);  // drafts are kToken too: every draft is accepted
        out.sampled_logprob.push_back(-0.5f);
      }
    bool all = true;
    for (const auto& s : in.seqs) all = all && (s.num_logits == 0 || s.device_sampling.has_value());
    if (!all) {  // rows the engine samples itself: constant logits favouring kToken
      out.sampled.clear();
      out.sampled_logprob.clear();
      for (const auto& s : in.seqs) {
        std::vector<float> rows(static_cast<size_t>(s.num_logits) * cfg_.vocab_size, 0.0f);
        for (int j = 0; j < s.num_logits; ++j) rows[static_cast<size_t>(j) * cfg_.vocab_size + kToken] = 30.0f;
        out.logits.push_back(std::move(rows));
      }
    }
    return out;
  }
  Result<DraftOutput> draft(const DraftInput& in) override {
    DraftOutput out;
    for (const auto& d : in.seqs) out.tokens.emplace_back(d.num_drafts, kToken);
    return out;
  }
  static constexpr int32_t kToken = 5;

 private:
  ModelConfig cfg_;
  std::vector<CacheGroupInfo> groups_;
};

std::vector<int> ints(const std::string& csv) {
  std::vector<int> v;
  std::stringstream ss(csv);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoi(x));
  return v;
}

}  // namespace
}  // namespace ml4

int main(int argc, char** argv) {
  using namespace ml4;
  CLI::App app{"engine host time per step, against a runner that costs nothing"};
  std::string conc = "1,8,32,128", drafts = "0,7";
  int prompt = 512, output = 256, vocab = 131072;
  app.add_option("--concurrency", conc);
  app.add_option("--drafts", drafts);
  app.add_option("--prompt", prompt);
  app.add_option("--output", output);
  app.add_option("--vocab", vocab);
  CLI11_PARSE(app, argc, argv);
  for (int k : ints(drafts)) {
    for (int c : ints(conc)) {
      const int64_t blocks = static_cast<int64_t>(c) * ((prompt + output + 64 + 63) / 64 + 2) + 64;
      NullRunner runner(vocab, blocks, k > 0 ? 8 : 0);
      ByteTextCodec codec(vocab);
      EngineConfig cfg;
      cfg.scheduler.max_num_seqs = c;
      cfg.scheduler.max_num_batched_tokens = 8192;
      cfg.scheduler.max_model_len = prompt + output + 64;
      if (k > 0) {
        cfg.speculative.method = "dspark";
        cfg.speculative.num_speculative_tokens = k;
      }
      Engine e(&runner, &codec, cfg);
      for (int i = 0; i < c; ++i) {
        std::vector<int32_t> p(prompt);
        for (int t = 0; t < prompt; ++t) p[t] = 3 + (i * 131 + t * 7) % (vocab - 3);
        SamplingParams sp;
        sp.temperature = 0.0;
        sp.max_tokens = output;
        sp.ignore_eos = true;
        if (!e.add_request("r" + std::to_string(i), p, sp).ok()) return 1;
      }
      // Prefill steps first (not timed): once every request has its first token, every step
      // is a decode step of all of them (equal lengths: they finish together).
      std::set<std::string> started;
      int64_t steps = 0, tokens = 0;
      double decode_s = 0.0;
      while (e.has_work()) {
        const bool decoding = static_cast<int>(started.size()) == c;
        const auto t0 = std::chrono::steady_clock::now();
        auto r = e.step();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!r.ok()) {
          std::fprintf(stderr, "%s\n", r.status().message().c_str());
          return 1;
        }
        for (const auto& o : *r) {
          if (!o.new_tokens.empty()) started.insert(o.request_id);
          if (decoding) tokens += static_cast<int64_t>(o.new_tokens.size());
        }
        if (decoding) {
          decode_s += s;
          ++steps;
        }
      }
      std::printf("ENGINE_OVERHEAD concurrency=%d drafts=%d vocab=%d decode_steps=%lld us_per_step=%.1f "
                  "us_per_token=%.2f\n",
                  c, k, vocab, static_cast<long long>(steps), steps > 0 ? decode_s / steps * 1e6 : 0.0,
                  tokens > 0 ? decode_s / tokens * 1e6 : 0.0);
    }
  }
  return 0;
}
