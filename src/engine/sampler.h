// Sampler: one row of logits -> the next token, with penalties, filters and logprobs.
//
// Order of operations follows vLLM v1 (vllm/v1/sample/sampler.py):
//   0. a structured-output grammar's bitmask (engine/structured_output.h) sets every id it
//      does not allow to -inf first, as vLLM applies the grammar bitmask to the logits before
//      its sampler (so logprobs are those of the masked distribution);
//   1. logprobs, when asked, come from the model logits (log_softmax before any penalty or
//      temperature; vLLM's default "raw_logprobs" mode);
//   2. min_tokens masks EOS and stop ids until enough tokens were generated (unless the
//      grammar allows nothing else: the grammar wins), and logit_bias adds to its ids;
//   3. repetition penalty over prompt + output (CTRL, arXiv:1909.05858: divide a positive
//      logit, multiply a negative one), then frequency and presence penalties over the
//      output (OpenAI's formula: logit -= f * count + p * (count > 0));
//   4. temperature == 0: argmax (ties -> lowest id), else logits / T, then top-k, top-p
//      (smallest set whose probability reaches p) and min-p (drop p < min_p * p_max), and
//      an inverse-CDF draw from the request's own generator, so a seeded request gives the
//      same tokens alone or in any batch.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/request.h"

namespace ml4 {

class Sampler {
 public:
  // Samples the next token for `r` from `logits` [vocab] (modified in place) and appends
  // the logprob entry to r.logprobs when the request asks for logprobs.
  // `allowed`: the grammar's bitmask (bitmask_words(vocab) words), or null.
  static int32_t sample(Request& r, float* logits, int vocab, int32_t eos_id, const uint32_t* allowed = nullptr);

  // One prompt position's logprob entry: `token`'s logprob and rank under `logits`, with the
  // top `n` ids (vLLM's prompt_logprobs).
  static TokenLogprob prompt_logprob(const float* logits, int vocab, int32_t token, int n);

  // log_softmax of a row, in f64 for the normaliser.
  static void log_softmax(const float* logits, int vocab, std::vector<float>* out);
};

}  // namespace ml4
