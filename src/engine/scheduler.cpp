// Scheduler (design in scheduler.h).
#include "engine/scheduler.h"

#include <algorithm>

namespace ml4 {

void Scheduler::add(Request* r) {
  r->status = RequestStatus::kWaiting;
  waiting_.insert(r);
}

void Scheduler::remove(Request* r) {
  waiting_.erase(r);
  running_.erase(r);
  loading_.erase(r);
  blocks_->free(*r);
}

void Scheduler::finish_load(Request* r) {
  loading_.erase(r);
  r->remote_kv = RemoteKv::kLoaded;
  r->status = RequestStatus::kWaiting;
  waiting_.insert(r);
}

void Scheduler::preempt(Request* r) {
  running_.erase(r);
  blocks_->free(*r);
  r->num_computed = 0;
  r->spec_tokens.clear();  // drafts are proposed again once it decodes
  r->spec_probs.clear();
  r->spec_q_on_device = false;
  r->status = RequestStatus::kPreempted;
  ++r->num_preemptions;
  ++num_preemptions_;
  waiting_.insert(r);
}

SchedulerOutput Scheduler::schedule(double now) {
  SchedulerOutput out;
  int64_t budget = config_.max_num_batched_tokens;

  // 1. Running requests, best first; victims come from the back.
  std::vector<Request*> order(running_.begin(), running_.end());
  for (size_t i = 0; i < order.size() && budget > 0; ++i) {
    Request* r = order[i];
    if (r->status != RequestStatus::kRunning) continue;  // preempted earlier in this loop
    int64_t todo = r->num_tokens() + static_cast<int64_t>(r->spec_tokens.size()) - r->num_computed;
    int64_t n = std::min(todo, budget);
    if (n <= 0) continue;
    bool fits = false;
    while (!(fits = blocks_->allocate(*r, r->num_computed + n))) {
      Request* victim = *running_.rbegin();
      preempt(victim);
      out.preempted.push_back(victim);
      if (victim == r) break;
    }
    if (!fits) break;
    out.seqs.push_back({r, n});
    budget -= n;
  }

  // 2. Waiting requests, only when nothing had to be preempted this step.
  while (out.preempted.empty() && budget > 0 && !waiting_.empty() &&
         running_.size() + loading_.size() < static_cast<size_t>(config_.max_num_seqs)) {
    Request* r = *waiting_.begin();
    // A request that holds blocks (P/D, KV loaded) resumes at num_computed; others look up
    // the prefix cache.
    const bool fresh = r->block_tables.empty() || r->block_tables[0].empty();
    PrefixHit hit;
    if (fresh) hit = blocks_->find_cached_prefix(*r);
    const int64_t base = fresh ? hit.num_tokens : r->num_computed;
    if (r->remote_kv == RemoteKv::kPending) {
      if (!blocks_->allocate(*r, r->num_tokens() - 1, &hit)) break;
      waiting_.erase(waiting_.begin());
      r->num_computed = hit.num_tokens;
      if (r->num_cached_tokens < 0) r->num_cached_tokens = hit.num_tokens;
      if (r->first_scheduled_time == 0.0) r->first_scheduled_time = now;
      r->status = RequestStatus::kWaitingForRemoteKv;
      r->remote_kv = RemoteKv::kLoading;
      loading_.insert(r);
      out.to_load.push_back(r);
      continue;
    }
    int64_t todo = r->num_tokens() - base;
    if (!config_.enable_chunked_prefill && todo > budget) break;
    int64_t n = std::min(todo, budget);
    if (!blocks_->allocate(*r, base + n, fresh ? &hit : nullptr)) break;
    waiting_.erase(waiting_.begin());
    r->num_computed = base;
    if (r->num_cached_tokens < 0) r->num_cached_tokens = hit.num_tokens;
    if (r->first_scheduled_time == 0.0) r->first_scheduled_time = now;
    r->status = RequestStatus::kRunning;
    running_.insert(r);
    out.seqs.push_back({r, n});
    budget -= n;
  }
  out.num_batched_tokens = config_.max_num_batched_tokens - budget;
  return out;
}

}  // namespace ml4
