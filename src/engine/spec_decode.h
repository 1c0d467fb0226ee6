// DSpark speculative decoding, the engine's side (SYSTEM.md S7, MODEL.md section 5): the
// configuration as vLLM spells it, and the verifier.
//
// The loop, per engine step (engine.cpp): each running decode request that carries drafts
// (Request::spec_tokens, k of them) feeds its last accepted token plus the k drafts to the
// target in one forward and gets k + 1 rows of logits (SeqStep::num_logits = 1 + k); the
// verifier below turns those rows into the tokens it emits; after the step one
// ModelRunner::draft() call proposes the next block for every request still decoding.
//
// Verification is vLLM's rejection sampler (vllm/v1/sample/rejection_sampler.py):
//   - greedy requests (temperature 0): row j's argmax (ties -> lowest id, as the host Sampler)
//     is compared with draft j; the first mismatch emits the target's token and stops; when
//     all k drafts pass, row k's argmax is the bonus token. The emitted tokens are exactly
//     the ones decoding without drafts would give, token for token.
//   - random requests: p_j = the request's sampling distribution of row j
//     (sampling::row_distribution: temperature, top-k, top-p, min-p), q_j = the draft's
//     (the drafter's distribution for probabilistic drafts, DraftOutput::probs; one-hot at
//     the draft for greedy drafts, as vLLM treats draft_sample_method "greedy"). Draft j is
//     accepted when q_j(d) > 0 and p_j(d) / q_j(d) >= u (vLLM rejects when q = 0); the first
//     rejection emits a token drawn from normalize(max(p_j - q_j, 0)) and stops; when all
//     pass, the bonus is drawn from p_k. Leviathan et al. (arXiv:2211.17192, appendix A.1):
//     every emitted token is distributed as p given the tokens before it.
// The uniforms are counter-based (Philox4x32-10 of ops/cpu/sampling.h), keyed by the request's
// seed and the output index of the token being decided, under a tag of their own, so a seeded
// request reproduces whatever its batch, and draws never repeat those of the drafts or of the
// non-speculative sampler.
//
// Which requests speculate: requests whose next tokens need nothing beyond temperature /
// top-k / top-p / min-p (and logprobs, computed from the raw rows as the host Sampler does).
// Requests with repetition / frequency / presence penalties, logit_bias, a grammar
// (structured outputs), or min_tokens still masking EOS are decoded one token per step, as
// without speculation (the sampler would have to re-apply history-dependent edits per
// draft position; vLLM applies penalties per position, ml4 does not speculate them yet).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model_config.h"
#include "ops/cpu/sampling.h"

namespace ml4 {

// vLLM's --speculative-config, the fields ml4 reads.
struct SpeculativeConfig {
  std::string method;             // "dspark"
  int num_speculative_tokens = 0;  // drafts per step (0: speculation off)
  bool probabilistic_drafts = false;  // draft_sample_method "probabilistic" (else "greedy")
  bool enabled() const { return num_speculative_tokens > 0; }
};

// Parses --speculative-config '{"method":"dspark","num_speculative_tokens":N,
// "draft_sample_method":"greedy"|"probabilistic"}'. Unknown fields are refused (a misspelt one
// would otherwise change nothing); "model", when given, must be null (the DSpark drafter is
// read from the target checkpoint's `mtp` block and `mtp_dspark.*` tensors).
Result<SpeculativeConfig> parse_speculative_config(const std::string& json_text);

// Whether the model can serve the config: it has a drafter (an `mtp` block) and
// num_speculative_tokens <= block_size - 1 (slot 0 of a block is the accepted token).
Status check_speculative_config(const SpeculativeConfig& spec, const ModelConfig& model);

// Drafter-group blocks one speculating request can hold at once: its window of context before
// the anchor plus the draft block after it, [anchor - window, anchor + block_size), at the worst
// page alignment. PagedKvCache sizes the group as RunnerOptions::max_num_seqs windows of
// ceil(window / page) + 1 blocks, which misses the block; drafter_runner_seqs() is the
// max_num_seqs to pass so that `max_num_seqs` requests fit.
int64_t drafter_blocks_per_seq(const ModelConfig& model, int page_tokens = 64);
int64_t drafter_runner_seqs(int64_t max_num_seqs, const ModelConfig& model, int page_tokens = 64);

// The verifier's output for one request.
struct VerifyResult {
  int accepted = 0;             // drafts accepted (a prefix of them)
  std::vector<int32_t> tokens;  // accepted drafts, then the correction or bonus: accepted + 1
};

// Verifies k = drafts.size() drafts of one request against its k + 1 target rows
// (`rows`: [(k + 1) x vocab] f32 logits as the runner returned them).
//   params: the request's sampling (temperature <= 0: greedy verification);
//   draft_probs: [k x vocab] the drafts' distributions (probabilistic drafts), or null (greedy
//     drafts: q one-hot at the draft);
//   seed / first_index: the request's seed and the output index of the token row 0 decides.
VerifyResult verify_drafts(const float* rows, int64_t vocab, const std::vector<int32_t>& drafts,
                           const float* draft_probs, const DeviceSamplingParams& params, uint64_t seed,
                           int64_t first_index);

// verify_drafts for a greedy request from each row's argmax alone (`row_tokens`: [k + 1], ties
// to the lowest id), as a runner that samples greedy rows on its device returns them: the rows'
// logits never leave the device.
VerifyResult verify_greedy(const int32_t* row_tokens, const std::vector<int32_t>& drafts);

// The distribution a row is drawn from under `params`: sampling::row_distribution (O(V) when
// neither top-k nor top-p is on, the common case; with them it sorts the row).
void target_distribution(const float* logits, int64_t vocab, const DeviceSamplingParams& params,
                         std::vector<double>* out);

// The seed a request's probabilistic drafts are drawn with (ModelRunner::draft): its sampling
// seed mixed with a tag, so the drafts' draws are independent of the verifier's and of the
// target sampler's.
uint64_t draft_seed(uint64_t request_seed);

// Acceptance counters (vLLM's vllm:spec_decode_* metrics).
struct SpecDecodeCounters {
  int64_t num_drafts = 0;           // verified proposals (one per request and step)
  int64_t num_draft_tokens = 0;     // drafts verified
  int64_t num_accepted_tokens = 0;  // drafts accepted
  std::vector<int64_t> accepted_per_pos;  // [num_speculative_tokens]: accepted at draft position j
};

}  // namespace ml4
