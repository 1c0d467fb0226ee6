// FakeRunner: a ModelRunner whose logits are a pure function of the token history *as read
// back from its paged KV cache* through the block tables the engine passes.
//
// Each cache group is a page array of cells {token, position}. execute() writes every new
// token into its cell in every group, then, for each logits row at position p, reads cells
// 0..p through the block tables of every group, checks each cell holds the position it
// should (else the engine handed out a wrong or stale block) and hashes the tokens into a
// logits row. So a scheduling, block-table or prefix-cache bug changes the output or fails
// the step, while a correct engine gives the same tokens alone, batched, preempted or with a
// prefix hit: exactly the invariants the tests check. A sliding-window group (the drafter's
// window) is written where its table has a block (the engine takes none for positions no later
// draft reads; the runner contract, step.h) and read only within its window before a chunk's
// last position, so released (-1) blocks before it are fine and missing ones inside fail.
//
// With enable_drafter() it also plays a DSpark runner (has_drafter(), draft()): draft() checks
// that the drafter group's table covers [anchor - window, anchor + block) and that every
// context cell of the window holds what the target wrote there, writes junk into the block's
// own cells (as the real drafter writes the block's K/V at its positions; a later read of a
// junk cell fails the step), and proposes the target's own next tokens under a perturbation
// (draft logits = target logits + `noise` x a hash of the history), greedy or drawn with the
// device-sampling contract, with the exact distribution q it drew from.
//
// With device_sampling_ set it also plays a runner that samples on its device: it says so
// (samples_on_device()) and, when every sequence with logits carries device_sampling, returns
// StepOutput::sampled drawn by the host reference of the device contract
// (ops/cpu/sampling.h) instead of the logits, as the CUDA runner does with its kernel (one
// token per row for a sequence verifying drafts greedily).
// With device_verification_ too it verifies random requests' drafts itself (SeqStep::device_verify,
// verifies_on_device() for random rows, top-k / top-p too, as the CUDA runner): q kept from draft()
// (DraftSeq::keep_probs) per sequence until it is drafted again or released, the rows and the
// uniforms of engine/spec_decode.h verify_drafts, results in StepOutput::verified.
// With token_masks_ too it applies SeqStep::allowed_tokens (grammar bitmasks) before the draw,
// as the CUDA runner's apply_token_bitmask does; a mask sent to a runner that did not say it
// applies masks is an error.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include <map>

#include "engine/sampler.h"
#include "engine/spec_decode.h"
#include "engine/structured_output.h"
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

  // Groups for a DSpark-capable fake: latent + indexer (blocks each) and a drafter window.
  static std::vector<CacheGroupInfo> drafter_groups(int64_t blocks, int64_t window_blocks, int64_t window, int page = 4) {
    auto g = two_groups(blocks, page);
    g.push_back({"drafter", page, window_blocks, window, 100});
    return g;
  }
  void enable_drafter(int block_size, double noise) {
    config_.drafter.enabled = true;
    config_.drafter.n_layers = 1;
    config_.drafter.block_size = block_size;
    for (const auto& g : groups_)
      if (g.sliding_window > 0) config_.drafter.window = static_cast<int>(g.sliding_window);
    noise_ = noise;
  }

  const ModelConfig& config() const override { return config_; }
  const std::vector<CacheGroupInfo>& cache_groups() const override { return groups_; }
  bool samples_on_device() const override { return device_sampling_; }
  bool applies_token_masks() const override { return token_masks_; }
  bool has_drafter() const override { return config_.drafter.enabled; }
  bool verifies_on_device(const DeviceSamplingParams& p) const override {
    return device_sampling_ && device_verification_ && !sampling::greedy(p);
  }
  void release(int64_t seq_id) override { kept_q_.erase(seq_id); }

  // The target's logits row after `history` (tokens at positions 0..p): a pure function.
  static std::vector<float> target_row(const std::vector<int32_t>& history, int vocab) {
    uint64_t h = 0x1234567ull;
    for (int32_t t : history) h = mix(h ^ static_cast<uint64_t>(t));
    return row_of(h, vocab);
  }

  // The fake drafter's logits after `history`: the target's plus noise x U(-1/2, 1/2) per id.
  static std::vector<float> draft_row(const std::vector<int32_t>& history, int vocab, double noise) {
    std::vector<float> l = target_row(history, vocab);
    uint64_t h = 0xD7AF7ull;
    for (int32_t t : history) h = mix(h ^ static_cast<uint64_t>(t));
    for (int v = 0; v < vocab; ++v)
      l[v] += static_cast<float>(noise * ((mix(h ^ (static_cast<uint64_t>(v) << 32)) >> 40) / double(1 << 24) - 0.5));
    return l;
  }

  Result<DraftOutput> draft(const DraftInput& in) override {
    if (!has_drafter()) return unimplemented("fake runner: no drafter");
    ++draft_calls_;
    const int B = config_.drafter.block_size;
    const int V = config_.vocab_size;
    int dg = -1, lg = -1;
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g].sliding_window > 0) dg = static_cast<int>(g);
      else if (lg < 0) lg = static_cast<int>(g);
    }
    const int64_t W = groups_[dg].sliding_window;
    DraftOutput out;
    for (const auto& d : in.seqs) {
      if (d.num_drafts < 1 || d.num_drafts > B - 1) return invalid_argument("fake draft: num_drafts {}", d.num_drafts);
      if (d.block_tables.size() != groups_.size()) return internal_error("fake draft: {} tables", d.block_tables.size());
      // The window of context the target wrote, and the block's own rows.
      std::vector<int32_t> history;
      for (int64_t q = 0; q < d.anchor_pos; ++q) {
        Cell* c = cell(lg, d.block_tables[lg], q);
        if (!c || c->pos != q) return internal_error("fake draft seq {}: latent position {} missing", d.seq_id, q);
        history.push_back(c->token);
      }
      for (int64_t q = std::max<int64_t>(0, d.anchor_pos - W); q < d.anchor_pos + B; ++q) {
        Cell* c = cell(dg, d.block_tables[dg], q);
        if (!c) return internal_error("fake draft seq {}: drafter table does not cover position {}", d.seq_id, q);
        if (q < d.anchor_pos && (c->pos != q || c->token != history[q]))
          return internal_error("fake draft seq {}: drafter context at {} is stale", d.seq_id, q);
        if (q >= d.anchor_pos) *c = {-7, q};  // the block's K/V: junk until the target overwrites it
      }
      history.push_back(d.anchor_token);
      std::vector<int32_t> toks;
      std::vector<float> probs;
      for (int j = 0; j < d.num_drafts; ++j) {
        const std::vector<float> l = draft_row(history, V, noise_);
        int32_t t = 0;
        std::vector<double> q(V);
        if (d.sampling) {
          DeviceSamplingParams p = *d.sampling;
          p.counter += j;
          t = sampling::sample_row_reference(l.data(), V, p);
          sampling::row_distribution(l.data(), V, p, q.data());
        } else {
          DeviceSamplingParams p;
          p.temperature = 0.0f;
          t = sampling::sample_row_reference(l.data(), V, p);
          q[t] = 1.0;
        }
        toks.push_back(t);
        if (in.want_probs || d.keep_probs) probs.insert(probs.end(), q.begin(), q.end());
        history.push_back(t);
      }
      if (d.keep_probs) {
        if (!d.sampling || !verifies_on_device(*d.sampling))
          return invalid_argument("fake draft seq {}: keep_probs for drafts it cannot verify", d.seq_id);
        kept_q_[d.seq_id] = {toks, std::move(probs)};
        probs.clear();
      } else {
        kept_q_.erase(d.seq_id);
      }
      out.tokens.push_back(std::move(toks));
      if (in.want_probs) out.probs.push_back(std::move(probs));
    }
    return out;
  }

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
          if (!c && groups_[g].sliding_window > 0) continue;  // no block: no drafter context
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
            if (w > 0 && (q <= p - w || p != end - 1)) continue;  // outside the window: never read (may be released)
            Cell* c = cell(g, s.block_tables[g], q);
            if (!c || c->pos != q)
              return internal_error("seq {}: group {} position {} holds stale KV", s.seq_id, g, q);
            if (tok >= 0 && c->token != tok) return internal_error("seq {}: groups disagree at {}", s.seq_id, q);
            tok = c->token;
          }
          h = mix(h ^ static_cast<uint64_t>(tok));
        }
        const std::vector<float> row = row_of(h, config_.vocab_size);
        rows.insert(rows.end(), row.begin(), row.end());
      }
      out.logits.push_back(std::move(rows));
    }
    // DSpark verification of random requests (SeqStep::device_verify), before any row is
    // replaced by a draw: the host verifier over the same rows, q as kept.
    for (size_t i = 0; i < in.seqs.size(); ++i) {
      const auto& s = in.seqs[i];
      if (s.device_verify == SeqStep::DeviceVerify::kNo) continue;
      if (out.verified.empty()) out.verified.resize(in.seqs.size());
      const int k = s.num_logits - 1;
      if (!s.device_sampling || !verifies_on_device(*s.device_sampling) || k < 1 ||
          static_cast<int>(s.tokens.size()) < s.num_logits)
        return invalid_argument("seq {}: device verification this runner cannot do", s.seq_id);
      const std::vector<int32_t> drafts(s.tokens.end() - k, s.tokens.end());
      const float* q = nullptr;
      if (s.device_verify == SeqStep::DeviceVerify::kKeptQ) {
        auto it = kept_q_.find(s.seq_id);
        if (it == kept_q_.end() || it->second.tokens.size() < drafts.size() ||
            !std::equal(drafts.begin(), drafts.end(), it->second.tokens.begin()))
          return internal_error("seq {}: no kept q for these drafts", s.seq_id);
        q = it->second.probs.data();
      }
      const int V = config_.vocab_size;
      const VerifyResult v = verify_drafts(out.logits[i].data(), V, drafts, q, *s.device_sampling,
                                           s.device_sampling->seed, s.device_sampling->counter);
      StepOutput::Verified& o = out.verified[i];
      o.accepted = v.accepted;
      o.tokens = v.tokens;
      for (size_t j = 0; j < v.tokens.size(); ++j)
        o.logprobs.push_back(Sampler::prompt_logprob(out.logits[i].data() + j * V, V, v.tokens[j], 0).logprob);
      kept_q_.erase(s.seq_id);
      ++device_verified_seqs_;
    }
    bool all_device = device_sampling_ && !logits_anyway_;
    int64_t with_logits = 0;
    for (const auto& s : in.seqs) {
      if (s.num_logits > 0 && !s.device_sampling) all_device = false;
      with_logits += s.num_logits > 0;
      device_rows_ += s.device_sampling.has_value();
      masked_rows_ += !s.allowed_tokens.empty();
      if (!s.allowed_tokens.empty() && (!token_masks_ || !s.device_sampling ||
                                        s.allowed_tokens.size() != static_cast<size_t>(bitmask_words(config_.vocab_size))))
        return invalid_argument("seq {}: a token mask this runner cannot apply", s.seq_id);
    }
    if (all_device && with_logits > 0) {
      // One entry per sequence (-1 without rows) where every sequence has at most one row, as
      // the contract allows; else one per row (verifying sequences: 1 + k greedy rows).
      bool per_row = false;
      for (const auto& s : in.seqs) per_row = per_row || s.num_logits > 1;
      for (size_t i = 0; i < in.seqs.size(); ++i) {
        const auto& s = in.seqs[i];
        if (s.num_logits > 1 && !sampling::greedy(*s.device_sampling) && s.device_verify == SeqStep::DeviceVerify::kNo)
          return invalid_argument("seq {}: device sampling of {} rows that are not greedy", s.seq_id, s.num_logits);
        if (s.num_logits == 0 && !per_row) {
          out.sampled.push_back(-1);
          out.sampled_logprob.push_back(0.0f);
        }
        for (int j = 0; j < s.num_logits; ++j) {
          float lp = 0.0f;
          float* row = out.logits[i].data() + static_cast<size_t>(j) * config_.vocab_size;
          if (!s.allowed_tokens.empty()) mask_disallowed(row, config_.vocab_size, s.allowed_tokens.data());
          out.sampled.push_back(sampling::sample_row_reference(row, config_.vocab_size, *s.device_sampling, &lp));
          out.sampled_logprob.push_back(lp);
        }
        if (s.num_logits > 1) device_verify_rows_ += s.num_logits;
      }
      out.logits.clear();
      ++device_steps_;
    }
    return out;
  }

  static std::vector<float> row_of(uint64_t h, int vocab) {
    std::vector<float> row(vocab);
    for (int v = 0; v < vocab; ++v)
      row[v] = static_cast<float>((mix(h ^ (static_cast<uint64_t>(v) << 32)) >> 40) / double(1 << 24) * 8.0 - 4.0);
    return row;
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
  bool token_masks_ = false;      // ... that applies grammar bitmasks
  int64_t masked_rows_ = 0;       // rows that came with a bitmask
  int64_t device_rows_ = 0;       // sequences that carried device_sampling
  int64_t device_steps_ = 0;      // steps answered with StepOutput::sampled
  int64_t device_verify_rows_ = 0;  // ... rows of them that verified drafts (greedy, per row)
  int64_t draft_calls_ = 0;       // draft() calls
  bool device_verification_ = false;  // verify random requests' drafts "on the device"
  int64_t device_verified_seqs_ = 0;  // ... sequences so verified
  size_t kept_q_size() const { return kept_q_.size(); }
  double noise_ = 0.0;            // the drafter's perturbation of the target's logits

 private:
  Cell* cell(size_t g, const std::vector<int32_t>& table, int64_t pos) {
    const int64_t page = groups_[g].page_tokens;
    const int64_t bi = pos / page;
    if (bi >= static_cast<int64_t>(table.size())) return nullptr;
    const int32_t b = table[bi];
    if (b < 0 || b >= groups_[g].num_blocks) return nullptr;
    return &pages_[g][static_cast<size_t>(b * page + pos % page)];
  }

  struct KeptQ {
    std::vector<int32_t> tokens;
    std::vector<float> probs;  // [k x vocab]
  };
  std::map<int64_t, KeptQ> kept_q_;
  ModelConfig config_;
  std::vector<CacheGroupInfo> groups_;
  std::vector<std::vector<Cell>> pages_;
};

}  // namespace ml4::testing
