// Engine: the P/D hooks (design in engine.h and transfer/kv_connector.h). With speculative
// decoding the drafter's sliding-window group travels too: its tables carry kNoBlock before
// the window, and only pages both sides hold are read.
#include <algorithm>
#include <chrono>

#include "core/log.h"
#include "engine/engine.h"

namespace ml4 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks a table holds: a sliding-window group's entries before its window are kNoBlock.
int64_t held_blocks(const std::vector<int32_t>& t) {
  return static_cast<int64_t>(std::count_if(t.begin(), t.end(), [](int32_t b) { return b != kNoBlock; }));
}

}  // namespace

Status Engine::check_kv_transfer(const std::vector<int32_t>& prompt, const SamplingParams& params,
                                 const transfer::KvTransferRequest& kv) const {
  if (!kv.do_remote_decode && !kv.remote_prefill) return ok_status();
  if (kv.do_remote_decode && kv.remote_prefill)
    return invalid_argument("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other");
  if (kv.do_remote_decode && (connector_ == nullptr || !connector_->producer()))
    return invalid_argument(
        "kv_transfer_params: do_remote_decode needs a server started with --kv-transfer-config kv_role kv_producer "
        "or kv_both");
  if (!kv.remote_prefill) return ok_status();
  if (connector_ == nullptr || !connector_->consumer())
    return invalid_argument(
        "kv_transfer_params: do_remote_prefill needs a server started with --kv-transfer-config kv_role kv_consumer "
        "or kv_both");
  const transfer::RemoteKvSource& src = *kv.remote_prefill;
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (src.num_tokens != n)
    return invalid_argument("kv_transfer_params: the producer holds KV for {} prompt tokens, this prompt has {}",
                            src.num_tokens, n);
  if (src.prompt_hash != transfer::prompt_hash(prompt))
    return invalid_argument(
        "kv_transfer_params: the producer computed a different prompt (token ids differ: another chat template "
        "or tokenizer?)");
  if (src.block_ids.size() != static_cast<size_t>(blocks_.num_groups()))
    return invalid_argument("kv_transfer_params: remote_block_ids has {} cache groups, the model {}", src.block_ids.size(),
                            blocks_.num_groups());
  for (int g = 0; g < blocks_.num_groups(); ++g) {
    const int64_t want = blocks_.active(g) ? ceil_div(n, blocks_.group(g).page_tokens) : 0;
    if (static_cast<int64_t>(src.block_ids[g].size()) != want)
      return invalid_argument("kv_transfer_params: remote_block_ids[{}] names {} blocks, a {}-token prompt needs {}", g,
                              src.block_ids[g].size(), n, want);
  }
  return ok_status();
}

int64_t Engine::num_blocks_held_for_remote() const {
  int64_t s = 0;
  for (const auto& [id, tables] : held_)
    for (const auto& t : tables) s += held_blocks(t);
  return s;
}

std::optional<transfer::RemoteKvSource> Engine::hold_for_remote(Request& r) {
  if (connector_ == nullptr || !r.kv_transfer.do_remote_decode) return std::nullopt;
  if (r.finish_reason != FinishReason::kStop && r.finish_reason != FinishReason::kLength) return std::nullopt;
  transfer::RemoteKvSource src;
  src.engine_id = connector_->engine_id();
  src.request_id = r.request_id;
  src.num_tokens = static_cast<int64_t>(r.prompt.size());
  src.prompt_hash = transfer::prompt_hash(r.prompt);
  int64_t count = 0;
  for (size_t g = 0; g < r.block_tables.size(); ++g) {
    auto& t = r.block_tables[g];
    const size_t keep = blocks_.active(static_cast<int>(g))
                            ? static_cast<size_t>(ceil_div(src.num_tokens, blocks_.group(static_cast<int>(g)).page_tokens))
                            : 0;
    if (t.size() > keep) {  // blocks past the prompt (none with max_tokens = 1) are not held
      std::vector<std::vector<int32_t>> extra(r.block_tables.size());
      extra[g].assign(t.begin() + static_cast<int64_t>(keep), t.end());
      blocks_.free_tables(extra);
      t.resize(keep);
    }
    count += held_blocks(t);
  }
  src.block_ids = r.block_tables;
  held_[r.request_id] = std::move(r.block_tables);
  r.block_tables.clear();
  for (auto& h : r.block_hashes) h.clear();
  connector_->hold(r.request_id, count);
  return src;
}

void Engine::fail_request(Request& r, const std::string& error, double now, std::vector<RequestOutput>* outputs) {
  finish(r, FinishReason::kError);
  RequestOutput o = take_output(r);
  o.error = error;
  outputs->push_back(std::move(o));
  if (observer_)
    observer_->on_finished(now - r.arrival_time, FinishReason::kError, static_cast<int64_t>(r.prompt.size()),
                           static_cast<int64_t>(r.output.size()));
  scheduler_.remove(&r);
  const std::string id = r.request_id;
  live_.erase(id);
}

void Engine::poll_remote_kv(double now, std::vector<RequestOutput>* outputs) {
  for (const std::string& id : connector_->take_released()) {
    auto it = held_.find(id);
    if (it == held_.end()) continue;
    blocks_.free_tables(it->second);
    held_.erase(it);
  }
  for (const transfer::KvLoadResult& res : connector_->poll_loads()) {
    if (auto o = orphans_.find(res.key); o != orphans_.end()) {
      blocks_.free_tables(o->second);
      orphans_.erase(o);
      continue;
    }
    auto it = loading_.find(res.key);
    if (it == loading_.end()) continue;
    Request& r = *it->second;
    loading_.erase(it);
    if (!res.ok) {
      if (!res.cancelled) connector_->release_remote(*r.kv_transfer.remote_prefill);  // best effort
      fail_request(r, res.cancelled ? "KV transfer cancelled" : res.error, now, outputs);
      continue;
    }
    const int64_t target = r.num_tokens() - 1;
    r.num_external_tokens = target - r.num_computed;
    r.num_computed = target;
    scheduler_.finish_load(&r);
  }
}

void Engine::start_loads(const std::vector<Request*>& reqs, double now, std::vector<RequestOutput>* outputs) {
  for (Request* rp : reqs) {
    Request& r = *rp;
    const transfer::RemoteKvSource& src = *r.kv_transfer.remote_prefill;
    const int64_t target = r.num_tokens() - 1;  // the last prompt token is computed here (vLLM)
    transfer::KvLoadBlocks b;
    b.remote.resize(blocks_.num_groups());
    b.local.resize(blocks_.num_groups());
    Status st;
    for (int g = 0; g < blocks_.num_groups() && st.ok(); ++g) {
      if (!blocks_.active(g)) continue;
      const int64_t page = blocks_.group(g).page_tokens;
      const int64_t first = r.num_computed / page, last = ceil_div(target, page);
      if (static_cast<int64_t>(r.block_tables[g].size()) < last || static_cast<int64_t>(src.block_ids[g].size()) < last) {
        st = internal_error("kv transfer: group {} has {} local / {} remote blocks, {} needed", g,
                            r.block_tables[g].size(), src.block_ids[g].size(), last);
        break;
      }
      for (int64_t i = first; i < last; ++i) {
        // The drafter window: pages before it are kNoBlock on both sides (the same window rule
        // on the same tokens); a page one side still holds and the other gave back is not read.
        if (src.block_ids[g][i] == kNoBlock || r.block_tables[g][i] == kNoBlock) continue;
        b.remote[g].push_back(src.block_ids[g][i]);
        b.local[g].push_back(r.block_tables[g][i]);
      }
    }
    if (st.ok()) st = connector_->start_load(r.seq_id, src, b);
    if (!st.ok()) {
      // Nothing was posted: the blocks are free to go. The producer's hold is released too.
      connector_->release_remote(src);
      fail_request(r, st.message(), now, outputs);
      continue;
    }
    loading_[r.seq_id] = &r;
  }
}

}  // namespace ml4
