// Request: one sequence's state as the engine tracks it, from arrival to finish.
//
// Lifecycle (vLLM v1 RequestStatus): kWaiting -> kRunning -> kFinished, with kRunning ->
// kPreempted -> kRunning when the scheduler takes its KV blocks back (preemption by
// recompute: the blocks are freed, num_computed drops to 0 and prompt + output so far are
// prefilled again, mostly as prefix-cache hits). Token ids are prompt then output; the KV
// of tokens [0, num_computed) is in the cache, so a decode step feeds the single token at
// num_computed. spec_tokens: DSpark drafts proposed after the last step, verified in the
// next one (it feeds 1 + k tokens); num_external_tokens (P/D: KV transferred before
// scheduling).
//
// P/D (transfer/kv_connector.h): a consumer's request with remote-prefill params is kWaiting
// with remote_kv kPending until the scheduler gives it blocks for its prompt but the last
// token; it then waits in kWaitingForRemoteKv (remote_kv kLoading) while the KV it lacks is
// read, and goes back to kWaiting (kLoaded, num_computed = prompt - 1) to compute the last
// prompt token and decode. A producer's request with do_remote_decode keeps its blocks past
// kFinished until the consumer has read them (Engine: held for remote).
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/sampling_params.h"
#include "engine/structured_output.h"
#include "engine/text_codec.h"
#include "transfer/kv_connector.h"

namespace ml4 {

enum class RequestStatus { kWaiting, kRunning, kPreempted, kWaitingForRemoteKv, kFinished };
enum class RemoteKv { kNone, kPending, kLoading, kLoaded };
enum class FinishReason { kNone, kStop, kLength, kAbort, kError };

inline const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
  }
  return "";
}

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // the N most likely, best first
  int64_t rank = 0;  // prompt logprobs: 1 + the number of ids more likely than `token`
};

struct Request {
  int64_t seq_id = 0;        // engine-internal id, also the runner's seq_id
  std::string request_id;    // caller's id (unique among live requests)
  int priority = 0;          // lower runs first (vLLM convention)
  int64_t arrival_order = 0; // FCFS tie-break
  double arrival_time = 0.0; // seconds, monotonic clock

  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  SamplingParams params;

  // Scheduling state.
  RequestStatus status = RequestStatus::kWaiting;
  int64_t num_computed = 0;          // tokens whose KV is in the cache
  int64_t num_cached_tokens = -1;    // prefix-cache hit at first scheduling (-1: not yet)
  std::vector<int32_t> spec_tokens;  // DSpark drafts to verify next step (engine/spec_decode.h)
  std::vector<float> spec_probs;     // their distributions q, [k x vocab] (probabilistic drafts only)
  bool spec_q_on_device = false;     // ... kept by the runner instead (DraftSeq::keep_probs)
  int64_t num_external_tokens = 0;   // P/D: tokens whose KV arrived from elsewhere
  transfer::KvTransferRequest kv_transfer;  // P/D: what the API asked for
  RemoteKv remote_kv = RemoteKv::kNone;
  int num_preemptions = 0;

  // Block manager state, per cache group: block ids in position order, and the block-hash
  // chain of the full blocks registered so far.
  std::vector<std::vector<int32_t>> block_tables;
  std::vector<std::vector<uint64_t>> block_hashes;
  int kv_partition = -1;  // data parallelism: the DP rank holding its blocks (-1: none yet)

  // Sampling and output state.
  std::mt19937_64 rng;
  uint64_t sample_seed = 0;  // the seed of rng, also the key of device sampling's draws
  std::unordered_map<int32_t, int> output_counts;
  IncrementalDetokenizer detok;
  std::string text;        // detokenized output (stop strings cut off)
  size_t text_sent = 0;    // bytes of `text` already handed out
  size_t tokens_sent = 0;  // output tokens already handed out
  std::vector<TokenLogprob> logprobs;
  FinishReason finish_reason = FinishReason::kNone;
  std::string stop_reason;  // the stop string or id that ended it
  int32_t stop_token = -1;  // the stop_token_ids entry that ended it (-1: none)

  // Structured outputs: the request's place in its grammar (engine/structured_output.h).
  std::shared_ptr<GrammarMatcher> grammar;
  // prompt_logprobs: entry k is prompt position k + 1's (position 0 has none); filled as
  // prefill chunks return their logits, handed out once with the first output.
  std::vector<TokenLogprob> prompt_logprobs;
  bool prompt_logprobs_sent = false;

  // Timing (monotonic seconds) for metrics.
  double first_scheduled_time = 0.0;
  double first_token_time = 0.0;
  double last_token_time = 0.0;

  int64_t num_tokens() const { return static_cast<int64_t>(prompt.size() + output.size()); }
  int32_t token_at(int64_t i) const {
    int64_t p = static_cast<int64_t>(prompt.size());
    return i < p ? prompt[i] : output[i - p];
  }
  bool finished() const { return status == RequestStatus::kFinished; }
};

}  // namespace ml4
