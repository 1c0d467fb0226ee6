// Small helpers the engine tests share.
#pragma once

#include "engine/sampling_params.h"

namespace ml4::testing {

// Greedy decoding of exactly `max_tokens` tokens (EOS ignored).
inline SamplingParams greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0.0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

}  // namespace ml4::testing
