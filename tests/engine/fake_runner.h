// FakeRunner: a ModelRunner whose logits are a pure function of the token history *as read
// back from its paged KV cache* through the block tables the engine passes.
//
// Each cache group is a page array of cells {token, position}. execute() writes every new
// token into its cell in every group, then, for each logits row at position p, reads cells
// 0..p through the block tables of every group, checks each cell holds the position it
// should (else the engine handed out a wrong or stale block) and hashes the tokens into a
// logits row. So a scheduling, block-table or prefix-cache bug changes the output or fails
// the step, while a correct engine gives the same tokens alone, batched, preempted or with a
// prefix hit: exactly the invariants the tests check. A sliding-window group is read only
// within its window, so released (-1) blocks before it are fine and missing ones inside fail.
//
// With device_sampling_ set it also plays a runner that samples on its device: it says so
// (samples_on_device()) and, when every sequence with logits carries device_sampling, returns
// StepOutput::sampled drawn by the host reference of the device contract
// (ops/cpu/sampling.h) instead of the logits, as the CUDA runner does with its kernel.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "ops/cpu/sampling.h"
#include "runtime/model_runner.h"

namespace ml4::testing {

class FakeRunner : public ModelRunner {
 public:
  struct Cell {
    int32_t token = -1;
    int64_t pos = -1;
  };

  FakeRunner(int vocab, std::vector<CacheGroupInfo> groups) : groups_(std::move(groups)) {
    config_.name = "fake";
    config_.vocab_size = vocab;
    config_.max_position_embeddings = 1 << 20;
    for (const auto& g : groups_) pages_.emplace_back(static_cast<size_t>(g.num_blocks * g.page_tokens));
  }
  static std::vector<CacheGroupInfo> two_groups(int64_t blocks, int page = 4) {
    return {{"latent", page, blocks, 0, 656}, {"indexer", page, blocks, 0, 132}};
  }

  const ModelConfig& config() const override { return config_; }
  const std::vector<CacheGroupInfo>& cache_groups() const override { return groups_; }
  bool samples_on_device() const override { return device_sampling_; }

  Result<StepOutput> execute(const StepInput& in) override {
    ++steps_;
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_.load()));
    if (fail_) return internal_error("fake runner: injected failure");
    StepOutput out;
    for (const auto& s : in.seqs) {
      if (s.block_tables.size() != groups_.size())
        return internal_error("seq {}: {} block tables for {} groups", s.seq_id, s.block_tables.size(), groups_.size());
      for (size_t i = 0; i < s.tokens.size(); ++i) {
        int64_t pos = s.start_pos + static_cast<int64_t>(i);
        for (size_t g = 0; g < groups_.size(); ++g) {
          Cell* c = cell(g, s.block_tables[g], pos);
          if (!c) return internal_error("seq {}: group {} has no block for position {}", s.seq_id, g, pos);
          *c = {s.tokens[i], pos};
        }
      }
      std::vector<float> rows;
      const int64_t end = s.start_pos + static_cast<int64_t>(s.tokens.size());
      for (int64_t p = end - s.num_logits; p < end; ++p) {
        uint64_t h = 0x1234567ull;
        for (int64_t q = 0; q <= p; ++q) {
          int32_t tok = -1;
          for (size_t g = 0; g < groups_.size(); ++g) {
            const int64_t w = groups_[g].sliding_window;
            if (w > 0 && q <= p - w) continue;  // outside the window: never read (may be released)
            Cell* c = cell(g, s.block_tables[g], q);
            if (!c || c->pos != q)
              return internal_error("seq {}: group {} position {} holds stale KV", s.seq_id, g, q);
            if (tok >= 0 && c->token != tok) return internal_error("seq {}: groups disagree at {}", s.seq_id, q);
            tok = c->token;
          }
          h = mix(h ^ static_cast<uint64_t>(tok));
        }
        for (int v = 0; v < config_.vocab_size; ++v)
          rows.push_back(static_cast<float>((mix(h ^ (static_cast<uint64_t>(v) << 32)) >> 40) / double(1 << 24) * 8.0 - 4.0));
      }
      out.logits.push_back(std::move(rows));
    }
    bool all_device = device_sampling_ && !logits_anyway_;
    int64_t with_logits = 0;
    for (const auto& s : in.seqs) {
      if (s.num_logits > 0 && !s.device_sampling) all_device = false;
      with_logits += s.num_logits > 0;
      device_rows_ += s.device_sampling.has_value();
    }
    if (all_device && with_logits > 0) {
      for (size_t i = 0; i < in.seqs.size(); ++i) {
        const auto& s = in.seqs[i];
        int32_t tok = -1;
        float lp = 0.0f;
        if (s.num_logits > 0) tok = sampling::sample_row_reference(out.logits[i].data(), config_.vocab_size, *s.device_sampling, &lp);
        out.sampled.push_back(tok);
        out.sampled_logprob.push_back(lp);
      }
      out.logits.clear();
      ++device_steps_;
    }
    return out;
  }

  static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

  std::atomic<int> delay_ms_{0};
  std::atomic<bool> fail_{false};
  std::atomic<int64_t> steps_{0};
  bool device_sampling_ = false;  // play a runner that samples on its device
  bool logits_anyway_ = false;    // ... that still returns logits (the engine's fallback)
  int64_t device_rows_ = 0;       // sequences that carried device_sampling
  int64_t device_steps_ = 0;      // steps answered with StepOutput::sampled

 private:
  Cell* cell(size_t g, const std::vector<int32_t>& table, int64_t pos) {
    const int64_t page = groups_[g].page_tokens;
    const int64_t bi = pos / page;
    if (bi >= static_cast<int64_t>(table.size())) return nullptr;
    const int32_t b = table[bi];
    if (b < 0 || b >= groups_[g].num_blocks) return nullptr;
    return &pages_[g][static_cast<size_t>(b * page + pos % page)];
  }

  ModelConfig config_;
  std::vector<CacheGroupInfo> groups_;
  std::vector<std::vector<Cell>> pages_;
};

}  // namespace ml4::testing
