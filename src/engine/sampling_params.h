// SamplingParams: what a request asks of the sampler and of the stop logic.
//
// Field names and defaults follow vLLM's SamplingParams (vllm/sampling_params.py) so the
// OpenAI server maps request fields one to one. validate() is the single place that rejects
// out-of-range values with a message naming the field; the engine assumes validated params.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ml4 {

class StructuredOutput;  // engine/structured_output.h

struct SamplingParams {
  int n = 1;                       // choices per request (the server fans out n requests)
  double temperature = 1.0;        // below kGreedyBelow: greedy (the engine stores 0)
  double top_p = 1.0;              // (0, 1]
  int top_k = 0;                   // 0 or -1: off
  double min_p = 0.0;              // [0, 1]
  double frequency_penalty = 0.0;  // [-2, 2], OpenAI semantics: logit -= f * count
  double presence_penalty = 0.0;   // [-2, 2]: logit -= p * (count > 0)
  // [1e-6, 2], CTRL (arXiv:1909.05858) as in vLLM / HF. vLLM takes any value > 0, but the
  // penalty divides and multiplies f32 logits: 5e-324 rounds to 0 in f32 (a masked -inf logit
  // times 0 is NaN), and below ~1e-30 a logit overflows to inf; 1e-6 already scales a logit a
  // million-fold.
  double repetition_penalty = 1.0;
  std::optional<uint64_t> seed;    // per-request generator; unset: drawn from the engine seed
  int max_tokens = 16;
  int min_tokens = 0;              // stop ids and EOS are masked until this many tokens
  std::vector<std::string> stop;   // stop strings, excluded from the output text
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int logprobs = -1;               // -1: none; 0: the sampled token's; N: also the top N
  bool skip_special_tokens = true;
  bool include_stop_str_in_output = false;
  // vLLM's prompt_logprobs: -1 none; N >= 0: each prompt token's logprob (from the second on)
  // with the N most likely ids at its position. Such a request skips the prefix cache.
  int prompt_logprobs = -1;
  // OpenAI logit_bias: added to the logit of each id after logprobs are taken, in [-100, 100].
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Grammar-constrained sampling (structured outputs, tool_choice); null: none.
  std::shared_ptr<const StructuredOutput> structured;

  static constexpr int kMaxLogprobs = 20;  // OpenAI's top_logprobs bound
  // vLLM's _SAMPLING_EPS: a temperature below it means greedy sampling. Dividing f32 logits by
  // a tiny temperature overflows them to inf (7e-233 did, found by tests/server/test_fuzz.py,
  // and the NaN step stopped the engine).
  static constexpr double kGreedyBelow = 1e-5;

  Status validate(int vocab_size) const {
    if (n < 1 || n > 128) return invalid_argument("n must be in [1, 128], got {}", n);
    if (!(temperature >= 0.0 && temperature <= 100.0))
      return invalid_argument("temperature must be in [0, 100], got {}", temperature);
    if (!(top_p > 0.0 && top_p <= 1.0)) return invalid_argument("top_p must be in (0, 1], got {}", top_p);
    if (top_k < -1) return invalid_argument("top_k must be -1 (off), 0 (off) or positive, got {}", top_k);
    if (!(min_p >= 0.0 && min_p <= 1.0)) return invalid_argument("min_p must be in [0, 1], got {}", min_p);
    if (!(frequency_penalty >= -2.0 && frequency_penalty <= 2.0))
      return invalid_argument("frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
    if (!(presence_penalty >= -2.0 && presence_penalty <= 2.0))
      return invalid_argument("presence_penalty must be in [-2, 2], got {}", presence_penalty);
    if (!(repetition_penalty >= 1e-6 && repetition_penalty <= 2.0))
      return invalid_argument("repetition_penalty must be in [1e-6, 2], got {}", repetition_penalty);
    if (max_tokens < 1) return invalid_argument("max_tokens must be at least 1, got {}", max_tokens);
    if (min_tokens < 0 || min_tokens > max_tokens)
      return invalid_argument("min_tokens must be in [0, max_tokens={}], got {}", max_tokens, min_tokens);
    if (logprobs < -1 || logprobs > kMaxLogprobs)
      return invalid_argument("logprobs must be in [0, {}], got {}", kMaxLogprobs, logprobs);
    if (stop.size() > 16) return invalid_argument("at most 16 stop strings, got {}", stop.size());
    for (const auto& s : stop)
      if (s.empty() || s.size() > 256) return invalid_argument("stop strings must be 1..256 bytes long");
    for (int32_t id : stop_token_ids)
      if (id < 0 || id >= vocab_size)
        return invalid_argument("stop_token_ids: {} is outside the vocabulary [0, {})", id, vocab_size);
    if (prompt_logprobs < -1 || prompt_logprobs > kMaxLogprobs)
      return invalid_argument("prompt_logprobs must be in [0, {}], got {}", kMaxLogprobs, prompt_logprobs);
    if (logit_bias.size() > static_cast<size_t>(vocab_size))
      return invalid_argument("logit_bias has more entries ({}) than the vocabulary", logit_bias.size());
    for (const auto& [id, bias] : logit_bias) {
      if (id < 0 || id >= vocab_size)
        return invalid_argument("logit_bias: token id {} is outside the vocabulary [0, {})", id, vocab_size);
      if (!(bias >= -100.0f && bias <= 100.0f))
        return invalid_argument("logit_bias: the bias of token {} must be in [-100, 100], got {}", id, bias);
    }
    return ok_status();
  }
};

}  // namespace ml4
