// Sampler: one row of logits -> the next token, with penalties, filters and logprobs.
//
// Order of operations follows vLLM v1 (vllm/v1/sample/sampler.py):
//   1. logprobs, when asked, come from the raw model logits (log_softmax before any
//      penalty or temperature; vLLM's default "raw_logprobs" mode);
//   2. min_tokens masks EOS and stop ids until enough tokens were generated;
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
  static int32_t sample(Request& r, float* logits, int vocab, int32_t eos_id);

  // log_softmax of a row, in f64 for the normaliser.
  static void log_softmax(const float* logits, int vocab, std::vector<float>* out);
};

}  // namespace ml4
