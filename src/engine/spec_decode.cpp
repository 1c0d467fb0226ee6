// DSpark speculative decoding: config and verifier (design in spec_decode.h).
#include "engine/spec_decode.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

namespace ml4 {
namespace {

constexpr uint64_t kDraftTag = 0x4d4c3444'52414654ull;  // "ML4DRAFT"

// Inverse CDF over unnormalised non-negative weights, in id order.
int32_t draw(const std::vector<double>& w, double u) {
  double total = 0.0;
  int64_t last = -1;
  for (size_t i = 0; i < w.size(); ++i)
    if (w[i] > 0.0) {
      total += w[i];
      last = static_cast<int64_t>(i);
    }
  if (last < 0) return 0;
  const double target = u * total;
  double acc = 0.0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i] <= 0.0) continue;
    acc += w[i];
    if (target < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);
}

int32_t argmax(const float* row, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i)
    if (sampling::ranks_above(row[i], i, row[best], best)) best = i;
  return static_cast<int32_t>(best);
}

// Greedy verification from each row's token (`row_token(j)`: row j's argmax): draft j passes
// while it equals row j's token; the first mismatch emits row j's token, all passing emit row
// k's as the bonus.
template <typename RowToken>
VerifyResult greedy_verify(const std::vector<int32_t>& drafts, RowToken row_token) {
  VerifyResult out;
  const int k = static_cast<int>(drafts.size());
  for (int j = 0; j <= k; ++j) {
    const int32_t t = row_token(j);
    out.tokens.push_back(t);
    if (j == k || t != drafts[j]) break;
    ++out.accepted;
  }
  return out;
}

}  // namespace

Result<SpeculativeConfig> parse_speculative_config(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return invalid_argument("--speculative-config is not valid JSON: {}", e.what());
  }
  if (!j.is_object()) return invalid_argument("--speculative-config must be a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    static const char* kKnown[] = {"method", "num_speculative_tokens", "draft_sample_method", "model"};
    bool known = false;
    for (const char* k : kKnown) known |= it.key() == k;
    if (!known)
      return invalid_argument(
          "--speculative-config: unknown field '{}' (ml4 reads method, num_speculative_tokens, draft_sample_method)",
          it.key());
  }
  SpeculativeConfig c;
  auto m = j.find("method");
  if (m == j.end() || !m->is_string())
    return invalid_argument("--speculative-config: 'method' is required and must be a string (\"dspark\")");
  c.method = m->get<std::string>();
  if (c.method != "dspark")
    return invalid_argument("--speculative-config: method '{}' is not supported (ml4 has \"dspark\", the checkpoint's "
                            "block drafter)",
                            c.method);
  if (auto it = j.find("model"); it != j.end() && !it->is_null())
    return invalid_argument(
        "--speculative-config: 'model' must be absent: the DSpark drafter is read from the target checkpoint "
        "(params.json `mtp`, tensors mtp_dspark.*)");
  auto n = j.find("num_speculative_tokens");
  if (n == j.end() || !n->is_number_integer())
    return invalid_argument("--speculative-config: 'num_speculative_tokens' is required and must be an integer");
  const int64_t k = n->get<int64_t>();
  if (k < 1 || k > 1024) return invalid_argument("--speculative-config: num_speculative_tokens must be >= 1, got {}", k);
  c.num_speculative_tokens = static_cast<int>(k);
  if (auto it = j.find("draft_sample_method"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return invalid_argument("--speculative-config: 'draft_sample_method' must be a string");
    const std::string s = it->get<std::string>();
    if (s == "probabilistic") {
      c.probabilistic_drafts = true;
    } else if (s != "greedy") {
      return invalid_argument("--speculative-config: draft_sample_method must be \"greedy\" or \"probabilistic\", got '{}'",
                              s);
    }
  }
  return c;
}

Status check_speculative_config(const SpeculativeConfig& spec, const ModelConfig& model) {
  if (!spec.enabled()) return ok_status();
  if (!model.drafter.enabled)
    return invalid_argument(
        "--speculative-config: model '{}' has no DSpark drafter (no `mtp` block in params.json, no mtp_dspark.* "
        "tensors)",
        model.name);
  const int most = model.drafter.block_size - 1;
  if (spec.num_speculative_tokens > most)
    return invalid_argument(
        "--speculative-config: num_speculative_tokens {} exceeds what the drafter proposes per step ({}: its block of "
        "{} holds the accepted token and {} drafts)",
        spec.num_speculative_tokens, most, model.drafter.block_size, most);
  return ok_status();
}

int64_t drafter_blocks_per_seq(const ModelConfig& model, int page) {
  // An interval of L positions touches at most 1 + ceil((L - 1) / page) pages.
  const int64_t L = static_cast<int64_t>(model.drafter.window) + model.drafter.block_size;
  return 1 + (L - 1 + page - 1) / page;
}

int64_t drafter_runner_seqs(int64_t max_num_seqs, const ModelConfig& model, int page) {
  const int64_t runner_window = (model.drafter.window + page - 1) / page + 1;  // PagedKvCache::window_blocks
  const int64_t need = max_num_seqs * drafter_blocks_per_seq(model, page);
  return (need + runner_window - 1) / runner_window;
}

uint64_t draft_seed(uint64_t request_seed) {
  uint64_t z = request_seed ^ kDraftTag;
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void target_distribution(const float* l, int64_t V, const DeviceSamplingParams& p, std::vector<double>* out) {
  out->resize(static_cast<size_t>(V));
  sampling::row_distribution(l, V, p, out->data());
}

VerifyResult verify_greedy(const int32_t* row_tokens, const std::vector<int32_t>& drafts) {
  return greedy_verify(drafts, [&](int j) { return row_tokens[j]; });
}

VerifyResult verify_drafts(const float* rows, int64_t V, const std::vector<int32_t>& drafts, const float* draft_probs,
                           const DeviceSamplingParams& params, uint64_t seed, int64_t first_index) {
  if (sampling::greedy(params))
    return greedy_verify(drafts, [&](int j) { return argmax(rows + static_cast<int64_t>(j) * V, V); });
  VerifyResult out;
  const int k = static_cast<int>(drafts.size());
  std::vector<double> p;
  for (int j = 0; j <= k; ++j) {
    target_distribution(rows + static_cast<int64_t>(j) * V, V, params, &p);
    const sampling::VerifyUniforms u = sampling::verify_uniforms(seed, first_index + j);
    if (j == k) {  // every draft passed: the bonus token, from p
      out.tokens.push_back(draw(p, u.draw));
      break;
    }
    const int32_t d = drafts[j];
    const float* q = draft_probs != nullptr ? draft_probs + static_cast<int64_t>(j) * V : nullptr;
    const double qd = q != nullptr ? q[d] : 1.0;
    if (qd > 0.0 && p[d] / qd >= u.accept) {
      out.tokens.push_back(d);
      ++out.accepted;
      continue;
    }
    // Rejected: the residual max(p - q, 0), renormalised by draw().
    if (q != nullptr) {
      for (int64_t i = 0; i < V; ++i) p[i] = std::max(0.0, p[i] - static_cast<double>(q[i]));
    } else {
      p[d] = 0.0;
    }
    double left = 0.0;
    for (double x : p) left += x;
    if (!(left > 0.0)) target_distribution(rows + static_cast<int64_t>(j) * V, V, params, &p);  // p == q: cannot happen
    out.tokens.push_back(draw(p, u.draw));
    break;
  }
  return out;
}

}  // namespace ml4
