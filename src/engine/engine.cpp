// Engine (design in engine.h).
#include "engine/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include <fmt/ranges.h>

#include "core/log.h"
#include "core/threads.h"
#include "ops/cpu/sampling.h"
#include "engine/sampler.h"

namespace ml4 {
namespace {

double mono_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// True when the device's sampler (ops/cpu/sampling.h) does all `r` needs for its next
// token: no penalty (they need the token history), no top-N logprobs (only the chosen
// token's), and no min_tokens masking still active (EOS / stop ids would have to be masked).
// Stop ids and EOS are checked after sampling either way, so they do not matter otherwise.
// A grammar's mask goes with the row (SeqStep::allowed_tokens) when the runner applies masks
// (`masks`); otherwise such rows are drawn by the host Sampler.
bool device_samplable(const Request& r, bool masks) {
  const SamplingParams& p = r.params;
  return p.repetition_penalty == 1.0 && p.frequency_penalty == 0.0 && p.presence_penalty == 0.0 && p.logprobs <= 0 &&
         static_cast<int>(r.output.size()) >= p.min_tokens && r.spec_tokens.empty() && p.logit_bias.empty() &&
         (!r.grammar || masks);
}

// True when the runner's device can verify `r`'s drafts: greedy verification needs only each
// row's argmax (spec_decode.h verify_greedy), which device sampling of greedy rows returns, so
// the k + 1 rows of logits stay on the device. Random requests (the rejection sampler needs p and
// q) and top-N logprobs take the rows to the host.
bool device_verifiable(const Request& r, const DeviceSamplingParams& d) {
  return !r.spec_tokens.empty() && sampling::greedy(d) && r.params.logprobs <= 0 && !r.grammar;
}

// A random request whose drafts the runner can verify itself (SeqStep::device_verify): the
// rejection sampler's p from its rows, q kept on the device or one-hot, so neither crosses to
// the host. The same answer when its drafts are proposed (DraftSeq::keep_probs) and when they
// are verified: it depends on the request's fixed parameters only.
bool device_rejection_sampling(const ModelRunner& runner, const Request& r, const DeviceSamplingParams& d) {
  return !sampling::greedy(d) && r.params.logprobs <= 0 && !r.grammar && runner.samples_on_device() &&
         runner.verifies_on_device(d);
}

DeviceSamplingParams device_params(const Request& r) {
  DeviceSamplingParams d;
  d.temperature = static_cast<float>(r.params.temperature);
  d.top_k = r.params.top_k;
  d.top_p = static_cast<float>(r.params.top_p);
  d.min_p = static_cast<float>(r.params.min_p);
  d.seed = r.sample_seed;
  d.counter = static_cast<int64_t>(r.output.size());  // survives preemption (recompute)
  return d;
}

size_t max_stop_len(const SamplingParams& p) {
  size_t m = 0;
  for (const auto& s : p.stop) m = std::max(m, s.size());
  return m;
}

}  // namespace

Engine::Engine(ModelRunner* runner, const TextCodec* codec, const EngineConfig& config)
    : runner_(runner),
      codec_(codec),
      config_(config),
      vocab_(runner->config().vocab_size),
      blocks_(runner->cache_groups(), config.enable_prefix_caching),
      scheduler_(config.scheduler, &blocks_),
      seed_state_(config.seed) {
  blocks_.set_release_hook([runner](int64_t seq_id) { runner->release(seq_id); });
  // A sequence longer than the whole cache could never finish: bound max_model_len by it.
  int64_t cap = blocks_.capacity_tokens();
  if (config_.scheduler.max_model_len > cap) {
    ML4_LOG_WARN("max_model_len {} exceeds the KV cache capacity of {} tokens; using {}",
                 config_.scheduler.max_model_len, cap, cap);
    config_.scheduler.max_model_len = cap;
    scheduler_ = Scheduler(config_.scheduler, &blocks_);
  }
  if (config_.speculative.enabled()) {
    Status s = check_speculation(*runner_, config_);
    if (!s.ok()) {
      ML4_LOG_ERROR("speculative decoding off: {}", s.message());
    } else {
      spec_on_ = true;
      counters_.spec.accepted_per_pos.assign(static_cast<size_t>(config_.speculative.num_speculative_tokens), 0);
      // The drafter group must hold a window + draft block per running request, or the
      // scheduler preempts for drafter pages (correct, but slow).
      for (int g = 0; g < blocks_.num_groups(); ++g) {
        if (blocks_.group(g).sliding_window <= 0) continue;
        const int64_t want = config_.scheduler.max_num_seqs * drafter_blocks_per_seq(runner_->config(), blocks_.group(g).page_tokens);
        if (blocks_.num_total_blocks(g) < want)
          ML4_LOG_WARN("cache group {} has {} blocks, {} running requests may need {} (RunnerOptions::max_num_seqs = "
                       "drafter_runner_seqs())",
                       blocks_.group(g).name, blocks_.num_total_blocks(g), config_.scheduler.max_num_seqs, want);
      }
    }
  }
}

Status Engine::check_speculation(const ModelRunner& runner, const EngineConfig& config) {
  if (!config.speculative.enabled()) return ok_status();
  ML4_RETURN_IF_ERROR(check_speculative_config(config.speculative, runner.config()));
  if (!runner.has_drafter())
    return invalid_argument("--speculative-config: the model runner has not loaded the DSpark drafter "
                            "(RunnerOptions::drafter, or a backend without draft())");
  bool window = false;
  for (const auto& g : runner.cache_groups()) window |= g.sliding_window > 0 && g.num_blocks > 0;
  if (!window) return invalid_argument("--speculative-config: the runner gave the drafter's cache group no blocks");
  return ok_status();
}

Status Engine::add_request(const std::string& request_id, std::vector<int32_t> prompt,
                           const SamplingParams& params, int priority, double now,
                           const transfer::KvTransferRequest& kv) {
  if (live_.count(request_id)) return invalid_argument("request id '{}' is already in use", request_id);
  ML4_RETURN_IF_ERROR(check_request(prompt, params));
  ML4_RETURN_IF_ERROR(check_kv_transfer(prompt, params, kv));
  auto r = std::make_unique<Request>();
  r->seq_id = next_seq_id_++;
  r->request_id = request_id;
  r->priority = priority;
  r->arrival_order = next_arrival_++;
  r->arrival_time = now > 0 ? now : mono_now();
  r->prompt = std::move(prompt);
  r->params = params;
  if (r->params.temperature < SamplingParams::kGreedyBelow) r->params.temperature = 0.0;  // sampling_params.h
  r->sample_seed = params.seed ? *params.seed : splitmix(seed_state_);
  r->rng.seed(r->sample_seed);
  if (params.structured) r->grammar = params.structured->new_matcher();
  r->kv_transfer = kv;
  if (kv.remote_prefill) r->remote_kv = RemoteKv::kPending;
  scheduler_.add(r.get());
  live_.emplace(request_id, std::move(r));
  return ok_status();
}

Status Engine::check_request(const std::vector<int32_t>& prompt, const SamplingParams& params) const {
  if (prompt.empty()) return invalid_argument("the prompt is empty");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= vocab_)
      return invalid_argument("prompt token {} at position {} is outside the vocabulary [0, {})", prompt[i], i, vocab_);
  ML4_RETURN_IF_ERROR(params.validate(vocab_));
  if (params.structured && params.structured->vocab_size() != vocab_)
    return invalid_argument("structured output compiled for a vocabulary of {} ids, the model has {}",
                            params.structured->vocab_size(), vocab_);
  const int64_t max_len = config_.scheduler.max_model_len;
  const int64_t plen = static_cast<int64_t>(prompt.size());
  if (plen + params.max_tokens > max_len)
    return invalid_argument(
        "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the "
        "prompt, {} for the completion). Please reduce the length of the prompt or of max_tokens.",
        max_len, plen + params.max_tokens, plen, params.max_tokens);

  return ok_status();
}

bool Engine::abort(const std::string& request_id, FinishReason reason) {
  auto it = live_.find(request_id);
  if (it == live_.end()) return false;
  Request& r = *it->second;
  if (r.remote_kv == RemoteKv::kLoading) {
    // Reads may still land in its blocks: keep them until the connector says they settled.
    orphans_[r.seq_id] = std::move(r.block_tables);
    r.block_tables.clear();
    loading_.erase(r.seq_id);
    connector_->cancel_load(r.seq_id);
  } else if (r.remote_kv == RemoteKv::kPending && connector_ != nullptr) {
    connector_->release_remote(*r.kv_transfer.remote_prefill);  // the producer frees now
  }
  scheduler_.remove(&r);
  r.status = RequestStatus::kFinished;
  r.finish_reason = reason;
  if (observer_)
    observer_->on_finished(mono_now() - r.arrival_time, reason, static_cast<int64_t>(r.prompt.size()),
                           static_cast<int64_t>(r.output.size()));
  live_.erase(it);
  return true;
}

EngineCounters Engine::counters() const {
  EngineCounters c = counters_;
  c.preemptions = scheduler_.num_preemptions();
  c.prefix_queries = blocks_.prefix_queries();
  c.prefix_hits = blocks_.prefix_hits();
  if (const HiSparseState* h = runner_->hisparse()) {
    c.hisparse = {true, h->hits, h->loads, h->hot_layers, h->direct_layers, h->regions_in_use(), h->resident_rows()};
  }
  return c;
}

void Engine::finish(Request& r, FinishReason reason) {
  r.status = RequestStatus::kFinished;
  r.finish_reason = reason;
}

bool Engine::append_token(Request& r, int32_t token) {
  const SamplingParams& p = r.params;
  r.output.push_back(token);
  ++r.output_counts[token];
  const bool past_min = static_cast<int>(r.output.size()) > p.min_tokens;
  if (past_min && !p.ignore_eos && token == codec_->eos_id()) {
    finish(r, FinishReason::kStop);
    return true;
  }
  if (past_min && std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end()) {
    r.stop_reason = std::to_string(token);
    r.stop_token = token;
    finish(r, FinishReason::kStop);
    return true;
  }
  const size_t old_size = r.text.size();
  r.text += r.detok.push(*codec_, token, p.skip_special_tokens);
  if (past_min && !p.stop.empty() && r.text.size() > old_size) {
    const size_t from = old_size >= max_stop_len(p) ? old_size - max_stop_len(p) + 1 : 0;
    size_t best = std::string::npos;
    const std::string* hit = nullptr;
    for (const auto& s : p.stop) {
      size_t pos = r.text.find(s, from);
      if (pos != std::string::npos && pos < best) {
        best = pos;
        hit = &s;
      }
    }
    if (hit) {
      r.text.resize(p.include_stop_str_in_output ? best + hit->size() : best);
      r.text_sent = std::min(r.text_sent, r.text.size());
      r.stop_reason = *hit;
      finish(r, FinishReason::kStop);
      return true;
    }
  }
  if (static_cast<int>(r.output.size()) >= p.max_tokens || r.num_tokens() >= config_.scheduler.max_model_len) {
    r.text += r.detok.flush();
    finish(r, FinishReason::kLength);
    return true;
  }
  return false;
}

RequestOutput Engine::take_output(Request& r) {
  RequestOutput o;
  o.request_id = r.request_id;
  o.new_tokens.assign(r.output.begin() + static_cast<int64_t>(r.tokens_sent), r.output.end());
  if (r.params.logprobs >= 0 && r.logprobs.size() >= r.tokens_sent)
    o.new_logprobs.assign(r.logprobs.begin() + static_cast<int64_t>(r.tokens_sent), r.logprobs.end());
  r.tokens_sent = r.output.size();
  size_t end = r.text.size();
  if (!r.finished()) {
    const size_t hold = max_stop_len(r.params);
    end = hold > 0 && end >= hold - 1 ? end - (hold - 1) : (hold > 0 ? 0 : end);
    while (end > r.text_sent && end < r.text.size() && (static_cast<unsigned char>(r.text[end]) & 0xC0) == 0x80) --end;
  }
  if (end > r.text_sent) {
    o.new_text = r.text.substr(r.text_sent, end - r.text_sent);
    r.text_sent = end;
  }
  o.finished = r.finished();
  o.finish_reason = r.finish_reason;
  o.stop_reason = r.stop_reason;
  o.stop_token = r.stop_token;
  if (r.params.prompt_logprobs >= 0 && !r.prompt_logprobs_sent) {
    o.prompt_logprobs = r.prompt_logprobs;
    r.prompt_logprobs_sent = true;
  }
  o.prompt_tokens = static_cast<int64_t>(r.prompt.size());
  o.completion_tokens = static_cast<int64_t>(r.output.size());
  o.cached_tokens = std::max<int64_t>(0, r.num_cached_tokens);
  return o;
}

Result<std::vector<RequestOutput>> Engine::step(double now) {
  const double t_enter = mono_now();
  if (now <= 0) now = t_enter;
  std::vector<RequestOutput> outputs;
  if (connector_ != nullptr) poll_remote_kv(now, &outputs);
  SchedulerOutput so = scheduler_.schedule(now);
  if (!so.to_load.empty()) start_loads(so.to_load, now, &outputs);
  if (so.empty()) return outputs;
  // Drafts the token budget could not fit are dropped (vLLM trims scheduled drafts alike).
  for (const auto& s : so.seqs) {
    Request& r = *s.req;
    if (r.spec_tokens.empty()) continue;
    const int64_t fit = std::max<int64_t>(0, r.num_computed + s.num_new_tokens - r.num_tokens());
    if (fit < static_cast<int64_t>(r.spec_tokens.size())) {
      r.spec_tokens.resize(static_cast<size_t>(fit));
      if (!r.spec_probs.empty()) r.spec_probs.resize(static_cast<size_t>(fit) * vocab_);
      if (fit == 0) r.spec_q_on_device = false;  // kept q of a prefix of the drafts still serves
    }
  }

  StepInput in;
  in.seqs.reserve(so.seqs.size());
  const bool device = runner_->samples_on_device();
  const bool masks = device && runner_->applies_token_masks();
  for (const auto& s : so.seqs) {
    Request& r = *s.req;
    SeqStep ss;
    ss.seq_id = r.seq_id;
    ss.start_pos = r.num_computed;
    ss.tokens.reserve(s.num_new_tokens);
    const int64_t known = r.num_tokens();
    for (int64_t i = r.num_computed; i < r.num_computed + s.num_new_tokens; ++i)
      ss.tokens.push_back(i < known ? r.token_at(i) : r.spec_tokens[i - known]);
    ss.block_tables = r.block_tables;
    const bool reaches_end = r.num_computed + s.num_new_tokens >= known;
    ss.num_logits = reaches_end ? 1 + static_cast<int>(r.spec_tokens.size()) : 0;
    // prompt_logprobs: prompt position q needs the logits of position q - 1; the runner
    // returns the chunk's last num_logits rows, so ask from the first position still missing.
    const int64_t plen = static_cast<int64_t>(r.prompt.size());
    const int64_t next_q = 1 + static_cast<int64_t>(r.prompt_logprobs.size());
    if (r.params.prompt_logprobs >= 0 && next_q < plen && next_q - 1 < r.num_computed + s.num_new_tokens) {
      const int64_t from = std::max(r.num_computed, next_q - 1);
      ss.num_logits = std::max<int>(ss.num_logits, static_cast<int>(r.num_computed + s.num_new_tokens - from));
    }
    if (device && ss.num_logits == 1 && device_samplable(r, masks)) {
      ss.device_sampling = device_params(r);
      if (r.grammar) {
        ss.allowed_tokens.assign(static_cast<size_t>(bitmask_words(vocab_)), 0u);
        r.grammar->fill_bitmask(ss.allowed_tokens.data());
      }
    } else if (device && reaches_end && ss.num_logits == 1 + static_cast<int>(r.spec_tokens.size())) {
      const DeviceSamplingParams d = device_params(r);
      if (device_verifiable(r, d)) {
        ss.device_sampling = d;  // one greedy token per row: the rows' argmax
      } else if (!r.spec_tokens.empty() && device_rejection_sampling(*runner_, r, d) &&
                 (r.spec_q_on_device || r.spec_probs.empty())) {  // (no drafts: penalties, min_tokens, ...)
        ss.device_sampling = d;
        ss.device_verify = r.spec_q_on_device ? SeqStep::DeviceVerify::kKeptQ : SeqStep::DeviceVerify::kOneHotQ;
      }
    }
    if (r.spec_q_on_device && !r.spec_tokens.empty() && ss.device_verify != SeqStep::DeviceVerify::kKeptQ)
      return internal_error("seq {}: its drafts' q is on the device but the step does not verify there", r.seq_id);
    in.seqs.push_back(std::move(ss));
  }
  counters_.max_batched_tokens_seen = std::max(counters_.max_batched_tokens_seen, so.num_batched_tokens);
  ++counters_.steps;
  if (step_hook_) step_hook_(so, in);

  counters_.batched_tokens += so.num_batched_tokens;
  const double t_fwd = mono_now();
  ML4_ASSIGN_OR_RETURN(StepOutput out, runner_->execute(in));
  // Tokens exist once the forward is done: timestamps for TTFT / ITL are taken here.
  const double done = mono_now();
  counters_.forward_seconds += done - t_fwd;

  // The runner returns logits, one entry per sequence or one per sequence that asked for them,
  // or, only when every such sequence carries device_sampling, sampled tokens: one per row
  // (step.h).
  size_t wanted = 0, wanted_rows = 0;
  int most_rows = 0;
  bool all_device = true;
  for (const auto& ss : in.seqs) {
    wanted += ss.num_logits > 0 ? 1 : 0;
    wanted_rows += static_cast<size_t>(std::max(0, ss.num_logits));
    most_rows = std::max(most_rows, ss.num_logits);
    if (ss.num_logits > 0 && !ss.device_sampling) all_device = false;
  }
  const bool sampled = !out.sampled.empty();
  const size_t entries = sampled ? out.sampled.size() : out.logits.size();
  // Sampled tokens come one per row (a verifying sequence has 1 + k); the per-sequence form
  // only where no sequence has more than one row.
  const bool per_seq = entries == in.seqs.size() && (!sampled || most_rows <= 1);
  if (!per_seq && entries != (sampled ? wanted_rows : wanted))
    return internal_error("runner returned {} {} entries for {} sequences ({} asking for logits, {} rows)", entries,
                          sampled ? "sampled" : "logits", in.seqs.size(), wanted, wanted_rows);
  if (sampled && (!all_device || out.sampled_logprob.size() != out.sampled.size()))
    return internal_error("runner sampled on the device for a step that did not ask for it, or without logprobs");

  // Each sequence's entry: logits are one per sequence, sampled tokens one per row.
  std::vector<size_t> entry(so.seqs.size());
  for (size_t i = 0, li = 0; i < so.seqs.size(); ++i) {
    entry[i] = per_seq ? i : li;
    if (!per_seq && in.seqs[i].num_logits > 0) li += sampled ? static_cast<size_t>(in.seqs[i].num_logits) : 1;
  }
  // Drafts verified from host rows (the rejection sampler: O(vocab) per row, f64) for every
  // such sequence at once on the thread pool, before the loop below applies them in order:
  // each result depends on its own request alone.
  std::vector<VerifyResult> host_verified(so.seqs.size());
  if (!sampled) {
    std::vector<size_t> jobs;
    for (size_t i = 0; i < so.seqs.size(); ++i) {
      const Request& r = *so.seqs[i].req;
      const int num_logits = in.seqs[i].num_logits;
      if (num_logits > 0 && !r.spec_tokens.empty() && r.num_computed + so.seqs[i].num_new_tokens >= r.num_tokens() &&
          in.seqs[i].device_verify == SeqStep::DeviceVerify::kNo &&
          out.logits[entry[i]].size() == static_cast<size_t>(num_logits) * vocab_)
        jobs.push_back(i);
    }
    // On the pool's threads an exception (bad_alloc: a vocab of doubles per row) would end the
    // process: it is caught there and the step fails as a step does.
    std::atomic<bool> failed{false};
    parallel_for(static_cast<int64_t>(jobs.size()), 1, [&](int64_t b, int64_t e) {
      try {
        for (int64_t j = b; j < e; ++j) {
          const size_t i = jobs[j];
          const Request& r = *so.seqs[i].req;
          host_verified[i] = verify_drafts(out.logits[entry[i]].data(), vocab_, r.spec_tokens,
                                           r.spec_probs.empty() ? nullptr : r.spec_probs.data(), device_params(r),
                                           r.sample_seed, static_cast<int64_t>(r.output.size()));
        }
      } catch (const std::exception&) {
        failed = true;
      }
    });
    if (failed) return resource_exhausted("verifying drafts: out of host memory");
  }

  bool any_device_verify = false;
  for (const auto& ss : in.seqs) any_device_verify |= ss.device_verify != SeqStep::DeviceVerify::kNo;
  if (any_device_verify && out.verified.size() != in.seqs.size())
    return internal_error("runner returned {} verification results for {} sequences", out.verified.size(), in.seqs.size());

  std::vector<Request*> drafting;  // DSpark: requests that propose drafts after this step
  for (size_t i = 0; i < so.seqs.size(); ++i) {
    Request& r = *so.seqs[i].req;
    const int num_logits = in.seqs[i].num_logits;
    const int64_t chunk_end = r.num_computed + so.seqs[i].num_new_tokens;
    const bool samples = chunk_end >= r.num_tokens();  // the chunk reaches the end: a token is due
    r.num_computed = chunk_end;
    const size_t e = entry[i];
    const bool device_verified = in.seqs[i].device_verify != SeqStep::DeviceVerify::kNo;
    if (num_logits > 0 && !sampled && !device_verified && r.params.prompt_logprobs >= 0) {
      if (out.logits[e].size() != static_cast<size_t>(num_logits) * vocab_)
        return internal_error("runner returned {} logits for seq {}, expected {}", out.logits[e].size(), r.seq_id,
                              static_cast<size_t>(num_logits) * vocab_);
      const int64_t plen = static_cast<int64_t>(r.prompt.size());
      for (int j = 0; j < num_logits; ++j) {
        const int64_t q = chunk_end - num_logits + j + 1;  // the prompt position row j predicts
        if (q != 1 + static_cast<int64_t>(r.prompt_logprobs.size()) || q >= plen) continue;
        r.prompt_logprobs.push_back(Sampler::prompt_logprob(out.logits[e].data() + static_cast<size_t>(j) * vocab_,
                                                            vocab_, r.prompt[q], r.params.prompt_logprobs));
      }
    }
    if (num_logits > 0 && !samples) {
      // prompt-logprob rows of a chunk that does not end the prompt
    } else if (num_logits > 0 && !r.spec_tokens.empty()) {
      if (device_verified) {
        const StepOutput::Verified& v = out.verified[i];
        const int k = static_cast<int>(r.spec_tokens.size());
        bool ok = v.accepted >= 0 && v.accepted <= k && v.tokens.size() == static_cast<size_t>(v.accepted) + 1 &&
                  v.logprobs.size() == v.tokens.size() && num_logits == 1 + k;
        for (size_t j = 0; ok && j < v.tokens.size(); ++j)
          ok = v.tokens[j] >= 0 && v.tokens[j] < vocab_ && (j >= static_cast<size_t>(v.accepted) || v.tokens[j] == r.spec_tokens[j]);
        if (!ok)
          return internal_error("runner's verification of seq {} ({} accepted, {} tokens) does not fit its {} drafts",
                                r.seq_id, v.accepted, v.tokens.size(), k);
        VerifyResult vr;
        vr.accepted = v.accepted;
        vr.tokens = v.tokens;
        ML4_RETURN_IF_ERROR(apply_verified(r, vr, nullptr, v.logprobs.data(), chunk_end - num_logits, done));
      } else if (sampled) {
        if (per_seq || e + static_cast<size_t>(num_logits) > out.sampled.size() ||
            num_logits != 1 + static_cast<int>(r.spec_tokens.size()))
          return internal_error("runner sampled {} tokens for seq {}, which verifies {} drafts", out.sampled.size(),
                                r.seq_id, r.spec_tokens.size());
        for (int j = 0; j < num_logits; ++j)
          if (out.sampled[e + j] < 0 || out.sampled[e + j] >= vocab_)
            return internal_error("runner chose token {} for seq {}, outside [0, {})", out.sampled[e + j], r.seq_id, vocab_);
        ML4_RETURN_IF_ERROR(apply_verified(r, verify_greedy(out.sampled.data() + e, r.spec_tokens), nullptr,
                                           out.sampled_logprob.data() + e, chunk_end - num_logits, done));
      } else {
        const size_t need = static_cast<size_t>(num_logits) * vocab_;
        if (out.logits[e].size() != need)
          return internal_error("runner returned {} logits for seq {}, expected {}", out.logits[e].size(), r.seq_id, need);
        ML4_RETURN_IF_ERROR(apply_verified(r, host_verified[i], out.logits[e].data(), nullptr, chunk_end - num_logits, done));
      }
    } else if (num_logits > 0) {
      const std::optional<DeviceSamplingParams>& ds = in.seqs[i].device_sampling;
      int32_t token = 0;
      float logprob = 0.0f;
      if (sampled) {
        token = out.sampled[e];
        logprob = out.sampled_logprob[e];
        if (token < 0 || token >= vocab_)
          return internal_error("runner sampled token {} for seq {}, outside [0, {})", token, r.seq_id, vocab_);
      } else {
        std::vector<float>& row = out.logits[e];
        const size_t need = static_cast<size_t>(num_logits) * vocab_;
        if (row.size() != need)
          return internal_error("runner returned {} logits for seq {}, expected {}", row.size(), r.seq_id, need);
        // Without drafts the last row is the only one; verification lands with DSpark.
        float* last = row.data() + static_cast<size_t>(num_logits - 1) * vocab_;
        // A sequence that asked for device sampling draws the same way on the host, so its
        // tokens do not depend on whether the rest of the batch let the runner sample.
        if (ds) {
          const std::vector<uint32_t>& allowed = in.seqs[i].allowed_tokens;
          if (!allowed.empty()) mask_disallowed(last, vocab_, allowed.data());  // as the device does
          token = sampling::sample_row_reference(last, vocab_, *ds, &logprob);
        } else {
          const uint32_t* allowed = nullptr;
          if (r.grammar) {
            mask_.assign(static_cast<size_t>(bitmask_words(vocab_)), 0u);
            r.grammar->fill_bitmask(mask_.data());
            allowed = mask_.data();
          }
          token = Sampler::sample(r, last, vocab_, r.params.ignore_eos ? -1 : codec_->eos_id(), allowed);
        }
      }
      if (ds && r.params.logprobs >= 0) {
        TokenLogprob lp;
        lp.token = token;
        lp.logprob = logprob;
        r.logprobs.push_back(std::move(lp));
      }
      r.spec_tokens.clear();
      ++counters_.generation_tokens;
      if (r.output.empty()) {
        r.first_token_time = done;
        if (observer_) observer_->on_first_token(r.first_scheduled_time - r.arrival_time, done - r.arrival_time);
      } else if (observer_) {
        observer_->on_token(done - r.last_token_time);
      }
      r.last_token_time = done;
      const bool grammar_ok = !r.grammar || r.grammar->accept(token);
      append_token(r, token);
      if (!grammar_ok && !r.finished()) {
        // The mask allows only what the grammar accepts; this is a fault, not user input.
        ML4_LOG_ERROR("request {}: the grammar rejected sampled token {}", r.request_id, token);
        finish(r, FinishReason::kError);
      } else if (r.grammar && r.grammar->terminated() && !r.finished()) {
        r.text += r.detok.flush();
        finish(r, FinishReason::kStop);  // the grammar ended (its EOS was taken, even with ignore_eos)
      }
    }
    blocks_.cache_full_blocks(r);
    blocks_.release_outside_window(r);
    std::optional<transfer::RemoteKvSource> held;
    if (r.finished()) held = hold_for_remote(r);
    if (r.finished() || (num_logits > 0 && r.tokens_sent < r.output.size())) {
      outputs.push_back(take_output(r));
      outputs.back().kv_source = std::move(held);
    }
    if (r.finished()) {
      counters_.prompt_tokens += static_cast<int64_t>(r.prompt.size());
      if (observer_)
        observer_->on_finished(done - r.arrival_time, r.finish_reason, static_cast<int64_t>(r.prompt.size()),
                               static_cast<int64_t>(r.output.size()));
      scheduler_.remove(&r);
      const std::string id = r.request_id;  // r dies with the erase
      live_.erase(id);
    } else if (spec_on_ && draft_count(r) > 0) {
      drafting.push_back(&r);
    }
  }
  if (!drafting.empty()) ML4_RETURN_IF_ERROR(propose_drafts(drafting));
  counters_.step_seconds += mono_now() - t_enter;
  return outputs;
}

int Engine::draft_count(const Request& r) const {
  const SamplingParams& p = r.params;
  if (r.status != RequestStatus::kRunning || r.num_computed != r.num_tokens() - 1 || r.output.empty()) return 0;
  // What the verifier cannot apply per draft position (spec_decode.h): these decode one by one.
  if (p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 ||
      !p.logit_bias.empty() || r.grammar || static_cast<int>(r.output.size()) < p.min_tokens)
    return 0;
  int64_t k = config_.speculative.num_speculative_tokens;
  k = std::min<int64_t>(k, p.max_tokens - static_cast<int64_t>(r.output.size()) - 1);  // the bonus is a token too
  k = std::min<int64_t>(k, config_.scheduler.max_model_len - r.num_tokens());  // verified positions fit
  return static_cast<int>(std::max<int64_t>(0, k));
}

Status Engine::apply_verified(Request& r, const VerifyResult& v, const float* rows, const float* row_logprobs,
                              int64_t anchor_pos, double done) {
  const int k = static_cast<int>(r.spec_tokens.size());
  SpecDecodeCounters& c = counters_.spec;
  ++c.num_drafts;
  c.num_draft_tokens += k;
  c.num_accepted_tokens += v.accepted;
  for (int j = 0; j < v.accepted && j < static_cast<int>(c.accepted_per_pos.size()); ++j) ++c.accepted_per_pos[j];
  r.spec_tokens.clear();
  r.spec_probs.clear();
  r.spec_q_on_device = false;
  if (r.output.empty()) {
    r.first_token_time = done;
    if (observer_) observer_->on_first_token(r.first_scheduled_time - r.arrival_time, done - r.arrival_time);
  } else if (observer_) {
    observer_->on_token(done - r.last_token_time);  // one gap per step, as vLLM's ITL with drafts
  }
  r.last_token_time = done;
  for (size_t j = 0; j < v.tokens.size(); ++j) {
    const int32_t t = v.tokens[j];
    if (r.params.logprobs >= 0 && rows != nullptr) {  // raw logprobs of the row that decided the token
      r.logprobs.push_back(Sampler::prompt_logprob(rows + j * vocab_, vocab_, t, r.params.logprobs));
    } else if (r.params.logprobs >= 0) {  // the device's: the chosen token's, as device sampling gives
      TokenLogprob lp;
      lp.token = t;
      lp.logprob = row_logprobs[j];
      r.logprobs.push_back(std::move(lp));
    }
    ++counters_.generation_tokens;
    if (append_token(r, t)) break;  // a stop inside the accepted run ends it there
  }
  // Only the accepted tokens' KV counts; blocks past them are given back (their rows are
  // overwritten by position when the request gets there).
  r.num_computed = std::min<int64_t>(anchor_pos + 1 + v.accepted, r.num_tokens());
  blocks_.trim(r, r.num_computed);
  return ok_status();
}

Status Engine::propose_drafts(const std::vector<Request*>& reqs) {
  const int B = runner_->config().drafter.block_size;
  DraftInput din;
  std::vector<Request*> who;
  for (Request* r : reqs) {
    const int k = draft_count(*r);
    if (k <= 0) continue;
    // The draft block's own rows are written at [anchor, anchor + B) of the drafter window.
    if (!blocks_.extend_windows(*r, r->num_computed + B)) {
      ++counters_.spec_window_misses;
      continue;
    }
    DraftSeq d;
    d.seq_id = r->seq_id;
    d.anchor_token = r->token_at(r->num_tokens() - 1);
    d.anchor_pos = r->num_computed;
    d.block_tables = r->block_tables;
    d.num_drafts = k;
    if (config_.speculative.probabilistic_drafts && r->params.temperature > 0.0) {
      const DeviceSamplingParams target = device_params(*r);
      d.sampling = target;
      d.sampling->seed = draft_seed(r->sample_seed);  // counter: the output index slot 1 proposes
      d.keep_probs = device_rejection_sampling(*runner_, *r, target);
      din.want_probs = din.want_probs || !d.keep_probs;
    }
    din.seqs.push_back(std::move(d));
    who.push_back(r);
  }
  if (who.empty()) return ok_status();
  const double t0 = mono_now();
  ML4_ASSIGN_OR_RETURN(DraftOutput out, runner_->draft(din));
  counters_.draft_seconds += mono_now() - t0;
  if (out.tokens.size() != who.size() || (din.want_probs && out.probs.size() != who.size()))
    return internal_error("runner drafted for {} sequences, asked for {}", out.tokens.size(), who.size());
  for (size_t i = 0; i < who.size(); ++i) {
    Request& r = *who[i];
    const DraftSeq& d = din.seqs[i];
    if (static_cast<int>(out.tokens[i].size()) != d.num_drafts)
      return internal_error("runner returned {} drafts for seq {}, asked for {}", out.tokens[i].size(), r.seq_id,
                            d.num_drafts);
    for (int32_t t : out.tokens[i])
      if (t < 0 || t >= vocab_) return internal_error("runner drafted token {} for seq {}, outside [0, {})", t, r.seq_id, vocab_);
    if (spdlog::should_log(spdlog::level::debug))
      ML4_LOG_DEBUG("seq {}: anchor {} at {}, drafts {}", r.seq_id, d.anchor_token, d.anchor_pos,
                    fmt::join(out.tokens[i], ","));
    r.spec_tokens = std::move(out.tokens[i]);
    r.spec_q_on_device = d.keep_probs;
    if (d.sampling && !d.keep_probs) {  // q of probabilistic drafts; greedy drafts verify against one-hot q
      if (out.probs[i].size() != static_cast<size_t>(d.num_drafts) * vocab_)
        return internal_error("runner returned {} draft probabilities for seq {}, expected {}", out.probs[i].size(),
                              r.seq_id, static_cast<size_t>(d.num_drafts) * vocab_);
      r.spec_probs = std::move(out.probs[i]);
    }
  }
  return ok_status();
}

}  // namespace ml4
