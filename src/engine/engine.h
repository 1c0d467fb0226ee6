// Engine: the synchronous core. add_request / abort / step, nothing else; one thread drives
// it (AsyncEngine in a server, a loop in tests and `ml4 generate`).
//
// A step: the scheduler picks (request, new tokens) pairs under the token budget; the engine
// turns them into one StepInput (tokens, start position, block tables per cache group,
// logits wanted only where a chunk reaches the end of the known tokens); the runner (CPU or
// CUDA, the engine cannot tell) executes; each row of logits is sampled; stop conditions are
// checked (stop ids, EOS, stop strings on the detokenized text, max_tokens, max_model_len);
// full blocks are registered for prefix caching; finished requests give their blocks back.
// Text is handed out incrementally: while a stop string could still be forming, the last
// (longest stop - 1) bytes are held back, as vLLM does, so a stream never shows a stop string.
//
// Device sampling: when the runner samples on its device (ModelRunner::samples_on_device()),
// each sequence whose next token needs nothing beyond temperature / top-k / top-p / min-p and
// the chosen token's logprob (no penalties, logprobs <= 0, min_tokens no longer masking, no
// drafts) carries SeqStep::device_sampling {its seed, counter = its output length}; the runner
// returns StepOutput::sampled when every sequence with logits carries it, and otherwise the
// engine draws those sequences on the host with the same counter-based generator
// (ops/cpu/sampling.h). So a seeded request's tokens do not depend on its batch. The
// draws differ from the host Sampler's (a different generator): seeds reproduce per backend.
//
// P/D (transfer/kv_connector.h), with a KvConnector set: a producer's finished request that
// asked for do_remote_decode keeps its blocks (held_, detached from the request) until the
// connector releases them; its last output carries the RemoteKvSource naming them. A
// consumer's request is admitted for loading (scheduler.h), the engine posts the load with
// the (remote, local) block pairs its prefix cache lacks, and polls the connector at the
// start of every step: a finished load resumes the request, a failed one fails it with the
// connector's error (never a local recompute of the prompt). An aborted load's blocks
// stay allocated (orphans_) until the connector says no read can touch them.
//
// DSpark speculative decoding (EngineConfig::speculative, engine/spec_decode.h): after each
// step one ModelRunner::draft() call proposes up to num_speculative_tokens drafts for every
// request that is decoding and may speculate (Request::spec_tokens; the drafter group's table
// is first extended over the draft block). The next step feeds the last token plus the drafts
// (num_logits = 1 + k; drafts the token budget cannot fit are dropped), the verifier emits
// the accepted drafts plus one token, each through the same stop checks as a sampled token
// (a stop inside the run truncates it), num_computed moves to the accepted tokens only and
// every block past them is given back (rejected positions hold stale KV that the next step
// overwrites: every cache is written and read by position). Preemption and abort drop the
// drafts with the blocks. Requests that cannot speculate, and engines without speculation,
// run the one-token path unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "engine/block_manager.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/spec_decode.h"
#include "engine/text_codec.h"
#include "runtime/model_runner.h"

namespace ml4 {

struct EngineConfig {
  SchedulerConfig scheduler;
  bool enable_prefix_caching = true;
  uint64_t seed = 0;  // seeds requests that bring no seed of their own
  // DSpark speculative decoding (off when num_speculative_tokens is 0); the runner must have
  // loaded its drafter (RunnerOptions::drafter): check_speculation() says so before start.
  SpeculativeConfig speculative;
};

// What a step produced for one request: the new part only.
struct RequestOutput {
  std::string request_id;
  std::vector<int32_t> new_tokens;
  std::string new_text;
  std::vector<TokenLogprob> new_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  std::string stop_reason;
  std::string error;  // set with FinishReason::kError
  int32_t stop_token = -1;  // the stop_token_ids entry that ended it (-1: none)
  // prompt_logprobs, with the first output: entry k is prompt position k + 1's.
  std::vector<TokenLogprob> prompt_logprobs;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
  std::optional<transfer::RemoteKvSource> kv_source;  // P/D producer: where the KV is held
};

// Timing hooks for metrics (server-side Prometheus histograms); called on the engine thread.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void on_first_token(double queue_time_s, double ttft_s) {}
  virtual void on_token(double inter_token_s) {}
  virtual void on_finished(double e2e_s, FinishReason reason, int64_t prompt_tokens, int64_t gen_tokens) {}
};

struct EngineCounters {
  int64_t prompt_tokens = 0;      // prompt tokens of finished requests
  int64_t generation_tokens = 0;  // sampled tokens
  int64_t preemptions = 0;
  int64_t prefix_queries = 0;
  int64_t prefix_hits = 0;
  int64_t steps = 0;
  int64_t max_batched_tokens_seen = 0;
  double step_seconds = 0.0;     // wall time inside step(), all of it
  double forward_seconds = 0.0;  // of which the runner's execute()
  int64_t batched_tokens = 0;    // tokens fed to the runner, summed over steps
  double draft_seconds = 0.0;    // of step_seconds: the runner's draft()
  int64_t spec_window_misses = 0;  // drafts skipped: no free drafter-window block
  SpecDecodeCounters spec;       // accepted_per_pos empty: speculation off
  // HiSparse (offload/hisparse.h; the runner's state, copied at the snapshot): rows found in
  // the hot buffers, rows loaded from the host pool, layer-steps served from the buffers and
  // read from the host pool directly, regions and rows held now.
  struct HiSparse {
    bool on = false;
    int64_t hits = 0, loads = 0, hot_layers = 0, direct_layers = 0, regions_in_use = 0, resident_rows = 0;
  } hisparse;
};

class Engine {
 public:
  Engine(ModelRunner* runner, const TextCodec* codec, const EngineConfig& config);

  // Whether `runner` can serve config.speculative (a drafter loaded, a config the model can
  // serve); the CLI calls it at start-up. An engine built with a config that fails it runs
  // without speculation (and logs why).
  static Status check_speculation(const ModelRunner& runner, const EngineConfig& config);
  bool speculative() const { return spec_on_; }

  // Validates and queues a request; errors name the bad field.
  Status add_request(const std::string& request_id, std::vector<int32_t> prompt, const SamplingParams& params,
                     int priority = 0, double now = 0.0, const transfer::KvTransferRequest& kv = {});
  // P/D: the checks add_request makes on a request's kv_transfer part (immutable state only).
  Status check_kv_transfer(const std::vector<int32_t>& prompt, const SamplingParams& params,
                           const transfer::KvTransferRequest& kv) const;
  // P/D: the connector (outlives the engine); null: no P/D.
  void set_kv_connector(transfer::KvConnector* c) { connector_ = c; }
  transfer::KvConnector* kv_connector() const { return connector_; }
  // True while KV is being loaded or held for a consumer: step() must still be called (it
  // polls the connector) even when has_work() is false.
  bool kv_active() const { return !loading_.empty() || !orphans_.empty() || !held_.empty(); }
  int64_t num_blocks_held_for_remote() const;
  size_t num_loading() const { return loading_.size(); }
  // The checks add_request makes, without queueing; reads only immutable state, so any
  // thread may call it while another drives the engine.
  Status check_request(const std::vector<int32_t>& prompt, const SamplingParams& params) const;
  // Finishes a live request (kAbort, or kError when the engine is failing); its blocks are
  // free on return. Returns false when no such request is live.
  bool abort(const std::string& request_id, FinishReason reason = FinishReason::kAbort);
  // One scheduling + forward + sampling round; outputs for requests that changed.
  Result<std::vector<RequestOutput>> step(double now = 0.0);

  bool has_work() const { return scheduler_.has_work(); }
  size_t num_running() const { return scheduler_.num_running(); }
  size_t num_waiting() const { return scheduler_.num_waiting(); }
  size_t num_live() const { return live_.size(); }
  const KvBlockManager& blocks() const { return blocks_; }
  KvBlockManager& blocks() { return blocks_; }
  EngineCounters counters() const;
  int64_t max_model_len() const { return config_.scheduler.max_model_len; }
  const EngineConfig& config() const { return config_; }
  const TextCodec& codec() const { return *codec_; }
  int vocab_size() const { return vocab_; }
  void set_observer(EngineObserver* o) { observer_ = o; }
  // Called after scheduling, before the forward (tests check the token budget here).
  void set_step_hook(std::function<void(const SchedulerOutput&, const StepInput&)> hook) {
    step_hook_ = std::move(hook);
  }

 private:
  // Appends `token`, updates text and stop state; returns true when the request finished.
  bool append_token(Request& r, int32_t token);
  RequestOutput take_output(Request& r);
  void finish(Request& r, FinishReason reason);
  // P/D (engine_kv.cpp).
  std::optional<transfer::RemoteKvSource> hold_for_remote(Request& r);
  void poll_remote_kv(double now, std::vector<RequestOutput>* outputs);
  void start_loads(const std::vector<Request*>& reqs, double now, std::vector<RequestOutput>* outputs);
  void fail_request(Request& r, const std::string& error, double now, std::vector<RequestOutput>* outputs);
  // DSpark: the drafts a decoding request may take next step (0: it does not speculate).
  int draft_count(const Request& r) const;
  // Emits r's verified drafts (`v`, from its 1 + k rows, row 0 at anchor_pos) and gives back the
  // blocks past them. Logprobs come from the rows' logits ([1 + k, vocab]) or, verified on the
  // device (greedy), from each row's raw logprob ([1 + k]).
  Status apply_verified(Request& r, const VerifyResult& v, const float* rows, const float* row_logprobs,
                        int64_t anchor_pos, double done);
  // One draft() call for the requests that decode next step.
  Status propose_drafts(const std::vector<Request*>& reqs);

  ModelRunner* runner_;
  const TextCodec* codec_;
  EngineConfig config_;
  int vocab_;
  KvBlockManager blocks_;
  Scheduler scheduler_;
  std::unordered_map<std::string, std::unique_ptr<Request>> live_;
  int64_t next_seq_id_ = 1;
  int64_t next_arrival_ = 0;
  uint64_t seed_state_;
  EngineCounters counters_;
  EngineObserver* observer_ = nullptr;
  std::function<void(const SchedulerOutput&, const StepInput&)> step_hook_;
  std::vector<uint32_t> mask_;  // a grammar's bitmask for the row being sampled
  bool spec_on_ = false;         // config_.speculative enabled and the runner has a drafter
  transfer::KvConnector* connector_ = nullptr;
  std::unordered_map<std::string, std::vector<std::vector<int32_t>>> held_;  // producer, by request id
  std::unordered_map<int64_t, Request*> loading_;                            // consumer, by seq id
  std::unordered_map<int64_t, std::vector<std::vector<int32_t>>> orphans_;  // aborted loads, by seq id
};

}  // namespace ml4
