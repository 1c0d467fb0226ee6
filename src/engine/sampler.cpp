// Sampler (design in sampler.h).
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace ml4 {

void Sampler::log_softmax(const float* logits, int vocab, std::vector<float>* out) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < vocab; ++i) mx = std::max(mx, logits[i]);
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  out->resize(vocab);
  for (int i = 0; i < vocab; ++i) (*out)[i] = static_cast<float>(logits[i] - lse);
}

namespace {

// The top n ids of a row by value, best first (ties -> lower id).
std::vector<std::pair<int32_t, float>> top_n(const std::vector<float>& logp, int n) {
  const int vocab = static_cast<int>(logp.size());
  n = std::min(n, vocab);
  std::vector<int32_t> idx(vocab);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
    return logp[a] > logp[b] || (logp[a] == logp[b] && a < b);
  });
  std::vector<std::pair<int32_t, float>> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) out.emplace_back(idx[i], logp[idx[i]]);
  return out;
}

}  // namespace

TokenLogprob Sampler::prompt_logprob(const float* logits, int vocab, int32_t token, int n) {
  std::vector<float> logp;
  log_softmax(logits, vocab, &logp);
  TokenLogprob lp;
  lp.token = token;
  lp.logprob = logp[token];
  lp.rank = 1;
  for (int i = 0; i < vocab; ++i) lp.rank += logp[i] > lp.logprob ? 1 : 0;
  if (n > 0) lp.top = top_n(logp, n);
  return lp;
}

int32_t Sampler::sample(Request& r, float* logits, int vocab, int32_t eos_id, const uint32_t* allowed) {
  const SamplingParams& sp = r.params;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // Whether the grammar allows anything but EOS and the stop ids (min_tokens yields if not).
  bool other_allowed = true;
  if (allowed) {
    other_allowed = false;
    for (int i = 0; i < vocab; ++i) {
      if (!bitmask_allows(allowed, i)) {
        logits[i] = kNegInf;
      } else if (!other_allowed && i != eos_id &&
                 std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), i) == sp.stop_token_ids.end()) {
        other_allowed = true;
      }
    }
  }

  std::vector<float> logp;
  if (sp.logprobs >= 0) log_softmax(logits, vocab, &logp);

  if (static_cast<int>(r.output.size()) < sp.min_tokens && other_allowed) {
    if (!sp.ignore_eos && eos_id >= 0 && eos_id < vocab) logits[eos_id] = kNegInf;
    for (int32_t id : sp.stop_token_ids) logits[id] = kNegInf;
  }
  for (const auto& [id, bias] : sp.logit_bias)
    if (id >= 0 && id < vocab && (!allowed || bitmask_allows(allowed, id))) logits[id] += bias;
  if (sp.repetition_penalty != 1.0) {
    const float rp = static_cast<float>(sp.repetition_penalty);
    auto apply = [&](int32_t t, std::vector<uint8_t>& seen) {
      if (t < 0 || t >= vocab || seen[t]) return;
      seen[t] = 1;
      logits[t] = logits[t] > 0 ? logits[t] / rp : logits[t] * rp;
    };
    std::vector<uint8_t> seen(vocab, 0);
    for (int32_t t : r.prompt) apply(t, seen);
    for (int32_t t : r.output) apply(t, seen);
  }
  if (sp.frequency_penalty != 0.0 || sp.presence_penalty != 0.0) {
    for (const auto& [t, c] : r.output_counts) {
      if (t < 0 || t >= vocab) continue;
      logits[t] -= static_cast<float>(sp.frequency_penalty * c + sp.presence_penalty);
    }
  }

  int32_t token = 0;
  if (sp.temperature == 0.0) {
    token = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  } else {
    const float inv_t = static_cast<float>(1.0 / sp.temperature);
    // Candidates sorted by logit, best first; top-k bounds the sort when it is set.
    std::vector<int32_t> idx(vocab);
    std::iota(idx.begin(), idx.end(), 0);
    auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    int keep = vocab;
    if (sp.top_k > 0 && sp.top_k < vocab) {
      keep = sp.top_k;
      std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), better);
    } else if (sp.top_p < 1.0 || sp.min_p > 0.0) {
      std::sort(idx.begin(), idx.end(), better);
    } else {
      // No filter: draw over the ids in vocabulary order, no sort needed.
      std::iter_swap(idx.begin(), std::max_element(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return better(b, a); }));
    }
    const bool sorted = sp.top_k > 0 || sp.top_p < 1.0 || sp.min_p > 0.0;
    if (sorted)
      while (keep > 1 && logits[idx[keep - 1]] == kNegInf) --keep;
    const double mx = static_cast<double>(logits[idx[0]]) * inv_t;
    std::vector<double> p(keep);
    double sum = 0.0;
    for (int i = 0; i < keep; ++i) {
      p[i] = std::exp(static_cast<double>(logits[idx[i]]) * inv_t - mx);
      sum += p[i];
    }
    for (auto& x : p) x /= sum;
    if (sp.top_p < 1.0) {
      double acc = 0.0;
      int cut = keep;
      for (int i = 0; i < keep; ++i) {
        acc += p[i];
        if (acc >= sp.top_p) { cut = i + 1; break; }
      }
      keep = cut;
    }
    if (sp.min_p > 0.0) {
      const double floor_p = sp.min_p * p[0];
      int cut = 1;
      while (cut < keep && p[cut] >= floor_p) ++cut;
      keep = cut;
    }
    double total = 0.0;
    for (int i = 0; i < keep; ++i) total += p[i];
    // 53 random bits -> u in [0, 1): identical across platforms for a given seed.
    const double u = static_cast<double>(r.rng() >> 11) * (1.0 / 9007199254740992.0) * total;
    double acc = 0.0;
    token = idx[keep - 1];
    for (int i = 0; i < keep; ++i) {
      acc += p[i];
      if (u < acc) { token = idx[i]; break; }
    }
  }

  if (sp.logprobs >= 0) {
    TokenLogprob lp;
    lp.token = token;
    lp.logprob = logp[token];
    if (sp.logprobs > 0) lp.top = top_n(logp, sp.logprobs);
    r.logprobs.push_back(std::move(lp));
  }
  return token;
}

}  // namespace ml4
