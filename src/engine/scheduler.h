// Scheduler: continuous batching under one token budget per step.
//
// The policy of vLLM v1's unified scheduler (vllm/v1/core/sched/scheduler.py), in the
// small-class shape of TensorRT-LLM's capacity scheduler: there is no prefill or decode
// phase, only "tokens a request still has to compute" (num_tokens + drafts - num_computed).
// Each step:
//   1. running requests, in (priority, arrival) order, get min(that, budget) tokens; when a
//      group lacks blocks the lowest-ranked running request is preempted (recompute: its
//      blocks are freed, it goes back to the waiting queue) until the request fits or is
//      itself the victim;
//   2. if nothing was preempted, waiting requests in (priority, arrival) order are admitted
//      while the budget, max_num_seqs and the free blocks allow; a prefix-cache hit is
//      looked up first, and a prompt longer than the budget is chunked (chunked prefill), or
//      waits whole when chunking is off.
// The sum of scheduled tokens never exceeds max_num_batched_tokens, and nothing is
// admitted that the free blocks cannot hold (allocate() is all-or-nothing).
//
// P/D consumer (vLLM's WAITING_FOR_REMOTE_KVS): a waiting request whose KV comes from a
// producer (remote_kv kPending) is admitted like any other, but only to get blocks for its
// prompt but the last token (its own prefix-cache hit first); it then leaves the queues for
// `loading_` and is returned in to_load without using the token budget. finish_load() puts
// it back into the waiting queue with num_computed = prompt - 1, from where it is admitted
// normally (its blocks kept) to compute the last prompt token. A loading request counts
// toward max_num_seqs.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

#include "engine/block_manager.h"
#include "engine/request.h"

namespace ml4 {

struct SchedulerConfig {
  int max_num_seqs = 64;
  int64_t max_num_batched_tokens = 2048;
  int64_t max_model_len = 4096;
  bool enable_chunked_prefill = true;
};

struct ScheduledSeq {
  Request* req = nullptr;
  int64_t num_new_tokens = 0;
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> seqs;
  int64_t num_batched_tokens = 0;
  std::vector<Request*> preempted;
  std::vector<Request*> to_load;  // P/D: admitted to read their KV from a producer
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, KvBlockManager* blocks) : config_(config), blocks_(blocks) {}

  const SchedulerConfig& config() const { return config_; }
  void add(Request* r);
  SchedulerOutput schedule(double now);
  // Removes a request (finished or aborted) from whichever queue holds it and frees its blocks.
  void remove(Request* r);
  // P/D: a loading request's KV has arrived (its num_computed set by the caller).
  void finish_load(Request* r);
  size_t num_loading() const { return loading_.size(); }

  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  int64_t num_preemptions() const { return num_preemptions_; }

 private:
  struct Order {
    bool operator()(const Request* a, const Request* b) const {
      if (a->priority != b->priority) return a->priority < b->priority;
      return a->arrival_order < b->arrival_order;
    }
  };
  void preempt(Request* r);

  SchedulerConfig config_;
  KvBlockManager* blocks_;
  std::set<Request*, Order> waiting_;
  std::set<Request*, Order> running_;
  std::set<Request*, Order> loading_;
  int64_t num_preemptions_ = 0;
};

}  // namespace ml4
