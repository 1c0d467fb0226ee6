// GPU sampling (ops/cuda/sampling.h) against host references:
//   - greedy: the token equals cpu::topk's first index (ties -> lower id, NaN below all) and,
//     on NaN-free rows, std::max_element (the host Sampler's greedy branch); argmax_rows too;
//   - logprob: against an f64 log-softmax of the unmodified row;
//   - temperature / top-k / top-p / min-p (and all together, and a tie-heavy row on the scalar
//     path): 20000 draws of one row with counters 0..N-1 land only on the tokens the exact
//     f64 distribution (the host Sampler's order: sort, top-k, top-p on the renormalised
//     top-k probabilities, min-p) keeps, and their total-variation distance to it is below
//     E[TV] + t, E[TV] <= 1/2 sum_b sqrt(p_b / N) over the buckets b, and t = sqrt(ln(1e6) /
//     (2N)) by McDiarmid (one draw moves TV by at most 1/N): a false failure has p < 1e-6;
//   - the host reference ops/cpu/sampling.h (the engine's fallback): the same token on
//     all but float-rounding flips (>= 97% of rows; a flip needs two Gumbel scores within a
//     few ulps);
//   - determinism: same (seed, counter) -> the same token and logprob bits, in any batch order;
//   - DSpark's rejection sampler (verify_rows) against the host verifier, decision for decision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "ops/cpu/sampling.h"
#include "engine/sampling_exact_dist.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/draft_tokens.h"
#include "ops/cuda/sampling.h"
#include "engine/spec_decode.h"

namespace ml4::cuda {
namespace {

using testing::poisoned;
using testing::to_device;
using testing::to_host;

constexpr int64_t kV = 131072;

struct Sampled {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};

enum class Path { kSplit, kRow };

// Runs sample_rows over B rows (row_stride 0: one row for all), outputs poisoned first; the
// split path's workspace is poisoned too (it needs no initialisation). plans: the split
// path's plan per row.
Sampled run(const std::vector<float>& logits, int64_t B, int64_t V, const std::vector<DeviceSamplingParams>& params,
            int64_t row_stride, Path path = Path::kSplit, std::vector<SplitPlan>* plans = nullptr) {
  DeviceBuffer dl = to_device(logits), dp = to_device(params);
  DeviceBuffer dt = poisoned<int32_t>(B), dlp = poisoned<float>(B);
  const size_t wb = path == Path::kSplit ? sample_rows_workspace_bytes(B, V) : 0;
  DeviceBuffer ws = path == Path::kSplit ? poisoned<uint8_t>(wb) : DeviceBuffer();
  const Status st = path == Path::kRow
                        ? sample_rows(dl.as<float>(), B, V, dp.as<DeviceSamplingParams>(), dt.as<int32_t>(),
                                      dlp.as<float>(), nullptr, row_stride)
                        : sample_rows(dl.as<float>(), B, V, dp.as<DeviceSamplingParams>(), dt.as<int32_t>(),
                                      dlp.as<float>(), ws.data(), wb, nullptr, row_stride);
  if (plans && path == Path::kSplit) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    plans->assign(B, SplitPlan::kAll);
    EXPECT_TRUE(sample_rows_split_plans(ws.data(), B, V, plans->data()).ok());
  }
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Sampled s{to_host<int32_t>(dt, B), to_host<float>(dlp, B)};
  for (int64_t b = 0; b < B; ++b) EXPECT_TRUE(s.tokens[b] >= 0 && s.tokens[b] < V) << "row " << b << " not written";
  return s;
}

double log_softmax_f64(const float* l, int64_t V, int64_t tok) {
  double m = -INFINITY;
  for (int64_t i = 0; i < V; ++i)
    if (l[i] == l[i]) m = std::max(m, static_cast<double>(l[i]));
  double s = 0;
  for (int64_t i = 0; i < V; ++i)
    if (l[i] == l[i]) s += std::exp(static_cast<double>(l[i]) - m);
  return static_cast<double>(l[tok]) - m - std::log(s);
}

TEST(CudaSampling, GreedyMatchesCpuTopkAndLogprobF64) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const int64_t B = 12;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> l(B * kV);
  for (auto& x : l) x = nd(rng);
  // Row 1: the max tied at 5 ids; row 2: quantised (huge tie runs); row 3: NaNs incl. id 0
  // and a NaN next to the max; row 4: all NaN; row 5: -inf everywhere but 3 ids; row 6:
  // the max at the last id; row 7: the max at id 0 tied with the last id.
  for (int64_t i : {77, 901, 4000, 65537, 131000}) l[1 * kV + i] = 20.0f;
  for (int64_t i = 0; i < kV; ++i) l[2 * kV + i] = std::round(l[2 * kV + i]);
  for (int64_t i = 0; i < kV; i += 17) l[3 * kV + i] = nan;
  l[3 * kV + 5000] = 30.0f;
  l[3 * kV + 5001] = nan;
  for (int64_t i = 0; i < kV; ++i) l[4 * kV + i] = nan;
  for (int64_t i = 0; i < kV; ++i) l[5 * kV + i] = -inf;
  l[5 * kV + 10] = -3.0f;
  l[5 * kV + 99999] = -2.0f;
  l[5 * kV + 12345] = -2.0f;
  l[6 * kV + kV - 1] = 40.0f;
  l[7 * kV + 0] = 40.0f;
  l[7 * kV + kV - 1] = 40.0f;
  std::vector<DeviceSamplingParams> params(B);
  for (auto& p : params) p.temperature = 0.0f;
  const Sampled s = run(l, B, kV, params, kV);
  const Sampled s_row = run(l, B, kV, params, kV, Path::kRow);

  DeviceBuffer dl = to_device(l), da = poisoned<int32_t>(B);
  DeviceBuffer aws = poisoned<uint8_t>(argmax_rows_workspace_bytes(B, kV));
  ML4_ASSERT_OK(argmax_rows(dl.as<float>(), kV, nullptr, 0, B, kV, da.as<int32_t>(), aws.data(), aws.bytes(), nullptr));
  const std::vector<int32_t> am = to_host<int32_t>(da, B);
  double worst = 0;
  for (int64_t b = 0; b < B; ++b) {
    const float* row = l.data() + b * kV;
    int32_t ref = -1;
    cpu::topk(row, kV, 1, &ref);
    if (b == 4) ref = 0;  // all NaN: cpu::topk's order is by id among NaN too
    EXPECT_EQ(s.tokens[b], ref) << "row " << b;
    EXPECT_EQ(s_row.tokens[b], ref) << "one-block path, row " << b;
    EXPECT_EQ(am[b], ref) << "argmax_rows row " << b;
    EXPECT_EQ(s.tokens[b], sampling::sample_row_reference(row, kV, params[b])) << "row " << b;
    bool has_nan = false;
    for (int64_t i = 0; i < kV; ++i) has_nan |= row[i] != row[i];
    if (!has_nan) EXPECT_EQ(s.tokens[b], std::max_element(row, row + kV) - row) << "host Sampler greedy, row " << b;
    if (b != 4 && row[s.tokens[b]] == row[s.tokens[b]]) {
      const double ref_lp = log_softmax_f64(row, kV, s.tokens[b]);
      // l - m exact in f64; sum of f32 expf (<= 2 ulp each) in f64: ~3e-7 relative, so
      // log(sum) within ~3e-7; the f32 result rounds at 2^-24 |ref|.
      const double err = std::abs(s.logprobs[b] - ref_lp);
      worst = std::max(worst, err / (1.0 + std::abs(ref_lp)));
      EXPECT_LE(err, 1e-6 + 2e-7 * std::abs(ref_lp)) << "row " << b << " lp " << s.logprobs[b] << " ref " << ref_lp;
      EXPECT_LE(std::abs(s_row.logprobs[b] - ref_lp), 1e-6 + 2e-7 * std::abs(ref_lp)) << "one-block path, row " << b;
    }
  }
  std::printf("greedy: %lld rows match cpu::topk; logprob worst |err|/(1+|ref|) %.3g (bound 1e-6 + 2e-7|ref|)\n",
              static_cast<long long>(B), worst);
}

struct DistCase {
  const char* name;
  DeviceSamplingParams p;
};

void check_distribution(const std::vector<float>& row, const DistCase& c, int64_t N, double* worst_ratio) {
  const int64_t V = static_cast<int64_t>(row.size());
  std::vector<DeviceSamplingParams> params(N, c.p);
  for (int64_t r = 0; r < N; ++r) params[r].counter = 1000 + r;
  const Sampled s = run(row, N, V, params, 0);
  const std::vector<double> ex = ::ml4::testing::exact_dist(row, c.p);
  // Buckets: every id with p >= 1e-4 alone, the rest of the support merged, and "outside"
  // (must stay empty).
  std::vector<int64_t> bucket(V, -1);
  std::vector<double> pb;
  int64_t rest = -1;
  for (int64_t i = 0; i < V; ++i) {
    if (ex[i] >= 1e-4) {
      bucket[i] = static_cast<int64_t>(pb.size());
      pb.push_back(ex[i]);
    } else if (ex[i] > 0) {
      if (rest < 0) {
        rest = static_cast<int64_t>(pb.size());
        pb.push_back(0.0);
      }
      bucket[i] = rest;
      pb[rest] += ex[i];
    }
  }
  std::vector<int64_t> cnt(pb.size(), 0);
  int64_t outside = 0;
  for (int64_t r = 0; r < N; ++r) {
    const int64_t b = bucket[s.tokens[r]];
    if (b < 0) ++outside;
    else ++cnt[b];
  }
  EXPECT_EQ(outside, 0) << c.name << ": tokens outside the kept set";
  double tv = 0, e_tv = 0;
  for (size_t b = 0; b < pb.size(); ++b) {
    tv += std::abs(static_cast<double>(cnt[b]) / N - pb[b]);
    e_tv += std::sqrt(pb[b] / N);
  }
  tv *= 0.5;
  const double bound = 0.5 * e_tv + std::sqrt(std::log(1e6) / (2.0 * N));
  EXPECT_LT(tv, bound) << c.name;
  *worst_ratio = std::max(*worst_ratio, tv / bound);
  // The host reference agrees draw for draw (rare float-rounding flips aside) and on logprob.
  const int64_t M = V > 4096 ? 8 : 64;  // the reference sorts the row: O(V log V) each
  int agree = 0;
  for (int64_t r = 0; r < M; ++r) {
    agree += sampling::sample_row_reference(row.data(), V, params[r]) == s.tokens[r];
    const double lp = log_softmax_f64(row.data(), V, s.tokens[r]);
    EXPECT_NEAR(s.logprobs[r], lp, 1e-6 + 2e-7 * std::abs(lp)) << c.name << " row " << r;
  }
  EXPECT_GE(agree, M - 1) << c.name << ": host reference disagrees";
  std::printf("%-26s V=%-6lld N=%lld support=%zu buckets: TV %.4f bound %.4f; host reference agrees %d/%lld\n", c.name,
              static_cast<long long>(V), static_cast<long long>(N), pb.size(), tv, bound, agree,
              static_cast<long long>(M));
}

TEST(CudaSampling, DistributionsMatchExact) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(2.0f, 6.0f);
  // 40 head ids at random places over a tail of 131032 ids ~3.5% of the mass at T = 1.
  std::vector<float> row(kV);
  for (auto& x : row) x = nd(rng) - 8.0f;
  for (int i = 0; i < 40; ++i) row[rng() % kV] = ud(rng);
  auto P = [](float t, int k, float tp, float mp) {
    DeviceSamplingParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = tp;
    p.min_p = mp;
    p.seed = 0x5eed1234abcdull;
    return p;
  };
  const int64_t N = 20000;
  double worst = 0;
  for (const DistCase& c : {DistCase{"temperature 1", P(1.0f, 0, 1.0f, 0.0f)},
                            DistCase{"temperature 0.7, top_k 20", P(0.7f, 20, 1.0f, 0.0f)},
                            DistCase{"temperature 1.3, top_p 0.8", P(1.3f, 0, 0.8f, 0.0f)},
                            DistCase{"min_p 0.1", P(1.0f, 0, 1.0f, 0.1f)},
                            DistCase{"k 30, p 0.9, min_p 0.05", P(0.9f, 30, 0.9f, 0.05f)},
                            DistCase{"top_k 5000 (cut bin)", P(1.0f, 5000, 1.0f, 0.0f)},
                            DistCase{"top_p 0.99 (cut bin)", P(1.0f, 0, 0.99f, 0.0f)},
                            DistCase{"k 3000, p 0.97 (fallback)", P(1.0f, 3000, 0.97f, 0.0f)}})
    check_distribution(row, c, N, &worst);
  // Ties at the cuts, V not a multiple of 4 (the scalar path): logits in steps of 0.5.
  std::vector<float> ties(1001);
  for (auto& x : ties) x = std::round(nd(rng) * 2.0f) * 0.5f;
  for (const DistCase& c : {DistCase{"ties: top_k 7", P(1.0f, 7, 1.0f, 0.0f)},
                            DistCase{"ties: top_p 0.3", P(1.0f, 0, 0.3f, 0.0f)},
                            DistCase{"ties: k 50, p 0.6", P(2.0f, 50, 0.6f, 0.0f)}})
    check_distribution(ties, c, N, &worst);
  std::printf("distributions: worst TV / bound %.3f\n", worst);
}

TEST(CudaSampling, DeterministicAndIndependentOfBatch) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(99);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const int64_t B = 8;
  std::vector<float> l(B * kV);
  for (auto& x : l) x = nd(rng);
  std::vector<DeviceSamplingParams> params(B);
  for (int64_t b = 0; b < B; ++b) {
    params[b].temperature = 0.5f + 0.1f * b;
    params[b].top_k = b % 2 ? 40 : 0;
    params[b].top_p = b % 3 ? 0.9f : 1.0f;
    params[b].min_p = b == 5 ? 0.02f : 0.0f;
    params[b].seed = 1234 + b;
    params[b].counter = 17 * b;
  }
  const Sampled a = run(l, B, kV, params, kV), a2 = run(l, B, kV, params, kV);
  // The same rows in reverse batch order.
  std::vector<float> lr(B * kV);
  std::vector<DeviceSamplingParams> pr(B);
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(l.begin() + b * kV, kV, lr.begin() + (B - 1 - b) * kV);
    pr[B - 1 - b] = params[b];
  }
  const Sampled r = run(lr, B, kV, pr, kV);
  for (int64_t b = 0; b < B; ++b) {
    EXPECT_EQ(a.tokens[b], a2.tokens[b]);
    EXPECT_EQ(std::memcmp(&a.logprobs[b], &a2.logprobs[b], 4), 0);
    EXPECT_EQ(a.tokens[b], r.tokens[B - 1 - b]);
    EXPECT_EQ(std::memcmp(&a.logprobs[b], &r.logprobs[B - 1 - b], 4), 0);
  }
  // A different counter changes the draw for a flat enough row (T = 1.4, no filter).
  std::vector<DeviceSamplingParams> pc(64, params[0]);
  for (int i = 0; i < 64; ++i) pc[i].counter = i;
  const Sampled c = run(l, 64, kV, pc, 0);
  std::vector<int32_t> distinct(c.tokens);
  std::sort(distinct.begin(), distinct.end());
  EXPECT_GT(std::unique(distinct.begin(), distinct.end()) - distinct.begin(), 8);
}

// The split path against the one-block path (the same exact contract on the device: the same
// tokens, bit for bit, and logprobs to the f32 rounding of two summation orders) and against
// the host reference, over rows chosen to drive every plan: no cut, the top-k cut bin, the
// top-p cut bin, top-k + top-p candidates, and the fallback (huge tie runs, flat rows,
// an infinite max, top-k > the candidate capacity with top-p).
TEST(CudaSampling, SplitPathMatchesOneBlockPathAndHostReference) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(2024);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  const int64_t R = 12;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> l(R * kV);
  for (int64_t r = 0; r < R; ++r) {
    float* x = l.data() + r * kV;
    for (int64_t i = 0; i < kV; ++i) {
      const float g = nd(rng), u = ud(rng);
      switch (r) {
        case 0: x[i] = -12.0f + 16.0f * u; break;                     // the benchmark's logits
        case 1: x[i] = g; break;                                        // flat-ish
        case 2: x[i] = 3.0f * g; break;
        case 3: x[i] = std::round(2.0f * g) * 0.5f; break;             // runs of ~10^4 ties
        case 4: x[i] = std::round(32.0f * g) * 0.125f; break;          // short tie runs at the top
        case 5: x[i] = i % 13 == 0 ? nan : (i % 29 == 0 ? -inf : 2.0f * g); break;
        case 6: x[i] = g; break;                                        // +inf max (below)
        case 7: x[i] = 1.0f; break;                                     // all equal
        case 8: x[i] = 2.0f * g; break;                                 // a model's: a few strong ids
        case 9: x[i] = 40.0f * g; break;                                // wider than the bins
        case 10: x[i] = i % 2 ? 0.0f : -1.0f; break;                    // two values
        default: x[i] = 0.25f * g; break;                               // very flat
      }
    }
  }
  for (int i = 0; i < 30; ++i) l[8 * kV + rng() % kV] = 15.0f + 5.0f * ud(rng);
  l[6 * kV + 4321] = inf;
  auto P = [](float t, int k, float tp, float mp) {
    DeviceSamplingParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = tp;
    p.min_p = mp;
    return p;
  };
  const DeviceSamplingParams cfgs[] = {P(0.0f, 0, 1.0f, 0.0f),    P(1.0f, 0, 1.0f, 0.0f),    P(0.8f, 50, 1.0f, 0.0f),
                                       P(0.8f, 0, 0.9f, 0.0f),    P(0.8f, 50, 0.9f, 0.05f),  P(1.0f, 0, 0.99f, 0.0f),
                                       P(1.0f, 5000, 1.0f, 0.0f), P(1.0f, 7, 1.0f, 0.0f),    P(0.7f, 0, 1.0f, 0.1f),
                                       P(1.2f, 3000, 0.95f, 0.0f), P(1.0f, 1, 1.0f, 0.0f),   P(0.5f, 100, 0.5f, 0.0f),
                                       P(2.0f, 0, 0.3f, 0.2f)};
  int plan_count[5] = {0, 0, 0, 0, 0};
  int flips = 0, total = 0;
  double worst_lp = 0;
  for (size_t ci = 0; ci < std::size(cfgs); ++ci) {
    std::vector<DeviceSamplingParams> params(R, cfgs[ci]);
    for (int64_t r = 0; r < R; ++r) {
      params[r].seed = 77 + 1000 * ci + r;
      params[r].counter = 5 + r;
    }
    std::vector<SplitPlan> plans;
    const Sampled a = run(l, R, kV, params, kV, Path::kSplit, &plans);
    const Sampled b = run(l, R, kV, params, kV, Path::kRow);
    for (int64_t r = 0; r < R; ++r) {
      const float* row = l.data() + r * kV;
      EXPECT_EQ(a.tokens[r], b.tokens[r]) << "config " << ci << " row " << r << " plan " << static_cast<int>(plans[r]);
      if (cfgs[ci].temperature > 0.0f) ++plan_count[static_cast<int>(plans[r])];
      const double d = std::abs(static_cast<double>(a.logprobs[r]) - b.logprobs[r]);
      if (std::isfinite(a.logprobs[r]) || std::isfinite(b.logprobs[r])) {
        // Two f64 summation orders of f32 expf terms (<= 2 ulp each): ~3e-7 relative each.
        EXPECT_LE(d, 1e-6 + 4e-7 * std::abs(b.logprobs[r])) << "config " << ci << " row " << r;
        worst_lp = std::max(worst_lp, d / (1.0 + std::abs(b.logprobs[r])));
      }
      ++total;
      flips += sampling::sample_row_reference(row, kV, params[r]) != a.tokens[r];
    }
  }
  // A host/device flip needs two Gumbel scores within a few ulps (host vs device logf/expf).
  EXPECT_LE(flips, total / 30 + 1) << "host reference disagrees";
  std::printf("split vs one-block: %d rows x configs, tokens equal; logprob worst |d|/(1+|lp|) %.3g; host reference "
              "flips %d; plans: all %d, top-k bin %d, top-p bin %d, top-k+top-p %d, fallback %d\n",
              total, worst_lp, flips, plan_count[0], plan_count[1], plan_count[2], plan_count[3], plan_count[4]);
  for (int k = 0; k < 5; ++k) EXPECT_GT(plan_count[k], 0) << "plan " << k << " never exercised";

  // B = 1 (the most blocks per row) and B = 3 give the same bits as the batch of 12.
  std::vector<DeviceSamplingParams> params(R, cfgs[4]);
  for (int64_t r = 0; r < R; ++r) params[r].seed = 9 + r;
  const Sampled all = run(l, R, kV, params, kV);
  for (int64_t r : {0, 3, 6, 8}) {
    const std::vector<float> one(l.begin() + r * kV, l.begin() + (r + 1) * kV);
    const Sampled s1 = run(one, 1, kV, {params[r]}, kV);
    EXPECT_EQ(s1.tokens[0], all.tokens[r]) << "row " << r;
    EXPECT_EQ(std::memcmp(&s1.logprobs[0], &all.logprobs[r], 4), 0) << "row " << r;
  }
  const std::vector<float> three(l.begin() + 3 * kV, l.begin() + 6 * kV);
  const Sampled s3 = run(three, 3, kV, {params[3], params[4], params[5]}, kV);
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(s3.tokens[r], all.tokens[3 + r]);
    EXPECT_EQ(std::memcmp(&s3.logprobs[r], &all.logprobs[3 + r], 4), 0);
  }
}

// Structured outputs: apply_token_bitmask masks exactly the clear bits (bit for bit against
// the host), and sampling the masked rows on the device gives the host reference's token and
// logprob on the host-masked rows (the engine's CPU path masks the same way before its
// sampler). Fresh random logits, masks and params; V not a multiple of 32; a padded stride.
TEST(CudaSampling, TokenBitmaskMatchesHostMaskingAndSampling) {
  ML4_REQUIRE_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t B = 6, V = 50000 + 17, stride = V + 3, W = (V + 31) / 32;
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(B * stride), 7.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < V; ++i) logits[b * stride + i] = nd(rng);
  std::vector<uint32_t> mask(static_cast<size_t>(B * W));
  for (int64_t b = 0; b < B; ++b) {
    const double keep = b == 0 ? 1.0 : b == 1 ? 0.0005 : 0.3;  // row 0: no grammar (all ones)
    std::bernoulli_distribution bit(keep);
    for (int64_t w = 0; w < W; ++w) {
      uint32_t x = 0;
      for (int j = 0; j < 32; ++j) x |= (bit(rng) ? 1u : 0u) << j;
      mask[b * W + w] = b == 0 ? 0xffffffffu : x;
    }
    mask[b * W + (rng() % (V / 32))] |= 1u;  // at least one allowed id
  }
  std::vector<float> host = logits;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < V; ++i)
      if (!((mask[b * W + i / 32] >> (i % 32)) & 1u)) host[b * stride + i] = -INFINITY;

  DeviceBuffer dl = to_device(logits), dm = to_device(mask);
  ASSERT_TRUE(apply_token_bitmask(dl.as<float>(), B, V, dm.as<uint32_t>(), nullptr, stride).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> dev = to_host<float>(dl, logits.size());
  ASSERT_EQ(0, std::memcmp(dev.data(), host.data(), host.size() * sizeof(float)));  // padding untouched too

  std::vector<DeviceSamplingParams> params(B);
  for (int64_t b = 0; b < B; ++b) {
    params[b].temperature = b % 3 == 0 ? 0.0f : 0.9f;
    params[b].top_k = b == 4 ? 50 : 0;
    params[b].top_p = b == 5 ? 0.9f : 1.0f;
    params[b].seed = rng();
    params[b].counter = static_cast<int64_t>(rng() % 1000);
  }
  std::vector<float> packed(static_cast<size_t>(B * V));
  for (int64_t b = 0; b < B; ++b) std::copy_n(host.begin() + b * stride, V, packed.begin() + b * V);
  for (Path path : {Path::kSplit, Path::kRow}) {
    const Sampled s = run(packed, B, V, params, -1, path);
    for (int64_t b = 0; b < B; ++b) {
      float ref_lp = 0.0f;
      const int32_t ref = sampling::sample_row_reference(packed.data() + b * V, V, params[b], &ref_lp);
      EXPECT_EQ(s.tokens[b], ref) << "row " << b;
      EXPECT_TRUE((mask[b * W + s.tokens[b] / 32] >> (s.tokens[b] % 32)) & 1u) << "row " << b << " drew a masked id";
      // f32 logprob of an f64 log_softmax over the allowed ids: 1e-5 as the other tests.
      EXPECT_NEAR(s.logprobs[b], log_softmax_f64(packed.data() + b * V, V, s.tokens[b]), 1e-5) << "row " << b;
    }
  }
  EXPECT_FALSE(apply_token_bitmask(dl.as<float>(), B, V, nullptr, nullptr).ok());
  EXPECT_FALSE(apply_token_bitmask(dl.as<float>(), B, V, dm.as<uint32_t>(), nullptr, V - 1).ok());
}

// The drafter's sampled drafts on the device (draft_rows) against the host's
// cpu::choose_draft_tokens on the same logits: the same ids (a difference needs u * total within
// ~1e-16 of a cumulative boundary: the host sums sequentially, the device by tiles), q within
// 1e-6 relative per row (f64 exp and sums in another order, then the same f32 rounding: a few
// ulp at most), every row's q summing to 1; greedy rows one-hot at the argmax; both the float4
// and the scalar argmax path (V % 4 != 0); twice, bit-identical; rows with top-k, top-p and
// both (the kept prefix cut on the device first: the same ids as the host's sort, the top-p
// boundary from integer weights, 2^-40 per id, so a cut differs only where the cumulative
// weight falls that close to top_p: ~1e-9 per row here).

// Sampling parameters with top-k / top-p on every few rows (r % 4 == 2: top-k, 3: top-p, and
// r % 8 == 7: both), temperatures 0.7-1.5, min-p on even rows.
void with_top_k_top_p(DeviceSamplingParams& p, int64_t r) {
  if (r % 4 == 2) p.top_k = static_cast<int32_t>(5 + 37 * (r / 4));
  if (r % 4 == 3) p.top_p = r % 8 == 7 ? 0.8f : 0.9f;
  if (r % 8 == 7) p.top_k = 300;
}

TEST(CudaSampling, DraftRowsMatchHostDrafts) {
  ML4_REQUIRE_GPU();
  for (const int64_t V : {int64_t{8192}, int64_t{131072 + 3}}) {
    const int64_t B = 12;
    auto l = testing::randn(B * V, 31, 2.5f);
    std::vector<DeviceSamplingParams> ps(B);
    for (int64_t r = 0; r < B; ++r) {
      DeviceSamplingParams& p = ps[r];
      p.temperature = r == 0 ? 0.0f : (r % 3 == 0 ? 0.7f : r % 3 == 1 ? 1.0f : 1.5f);
      p.min_p = r % 2 == 0 ? 0.05f : 0.0f;
      p.seed = 1000 + static_cast<uint64_t>(r);
      p.counter = 17 * r;
      with_top_k_top_p(p, r);
    }
    std::vector<int32_t> hid(B);
    std::vector<float> hq(B * V);
    cpu::choose_draft_tokens(l.data(), B, V, ps.data(), hid.data(), hq.data());
    auto dl = to_device(l), dp = to_device(ps);
    const size_t wb = draft_rows_workspace_bytes(B, V);
    auto ws = poisoned<uint8_t>(wb);
    std::vector<std::vector<float>> runs;
    for (int rep = 0; rep < 2; ++rep) {
      auto di = poisoned<int32_t>(B);
      auto dq = poisoned<float>(B * V);
      ML4_ASSERT_OK(draft_rows(dl.as<float>(), B, V, dp.as<DeviceSamplingParams>(), di.as<int32_t>(), dq.as<float>(),
                               ws.data(), wb, nullptr, /*cuts=*/true));
      ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "draft_rows"));
      auto ids = to_host<int32_t>(di, B);
      auto q = to_host<float>(dq, B * V);
      EXPECT_EQ(ids, hid) << "V=" << V;
      for (int64_t r = 0; r < B; ++r) {
        double num = 0.0, den = 0.0, sum = 0.0;
        int64_t kept = 0, host_kept = 0;
        for (int64_t i = 0; i < V; ++i) {
          const double d = static_cast<double>(q[r * V + i]) - hq[r * V + i];
          num += d * d;
          den += static_cast<double>(hq[r * V + i]) * hq[r * V + i];
          sum += q[r * V + i];
          kept += q[r * V + i] > 0.0f;
          host_kept += hq[r * V + i] > 0.0f;
        }
        EXPECT_LT(std::sqrt(num / den), 1e-6) << "row " << r << " V=" << V;
        EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << r;
        EXPECT_EQ(kept, host_kept) << "row " << r << " V=" << V;  // the same kept set, not only its mass
        if (needs_kept_cut(ps[r], V)) EXPECT_LT(host_kept, V / 2) << "row " << r;  // the cut cut
      }
      EXPECT_EQ(q[ids[0]], 1.0f);  // greedy row: one-hot
      runs.push_back(std::move(q));
    }
    EXPECT_EQ(runs[0], runs[1]);
    std::printf("draft_rows V=%lld: %lld rows, ids equal to the host's: %s\n", static_cast<long long>(V),
                static_cast<long long>(B), "checked above");
  }
  DeviceSamplingParams tk;
  tk.top_k = 50;
  EXPECT_TRUE(needs_kept_cut(tk, 8192));
  tk.temperature = 0.0f;
  EXPECT_FALSE(needs_kept_cut(tk, 8192));  // greedy: no cut
  DeviceBuffer d = poisoned<float>(64);
  const auto* p = reinterpret_cast<const DeviceSamplingParams*>(d.as<float>());
  DeviceBuffer ws = poisoned<uint8_t>(8);
  EXPECT_FALSE(draft_rows(d.as<float>(), 2, 8, p, d.as<int32_t>(), d.as<float>(), ws.data(), 8, nullptr, false).ok());
}

// DSpark's rejection sampler on the device (verify_rows) against the host verifier
// (engine/spec_decode.h verify_drafts) on the same rows, q, parameters and uniforms: every
// sequence's accepted count and tokens equal (the sums differ in order only, ~1e-16 relative:
// a decision can flip only when u falls that close to its threshold, ~1e-13 per decision
// here), logprobs within f32 rounding of the f64 log-softmax, unused outputs -1, repeat
// launches bit-identical. Kept q (a noisy drafter's distribution, drafts drawn from it) and
// one-hot q (greedy drafts: a draw from p, so they pass at the rate p(d) gives), temperatures
// 0.7-1.3, min-p on and off, top-k, top-p and both on half the sequences (with_top_k_top_p:
// their cuts made on the device first, integer top-p weights against the host's f64 sort, see
// DraftRowsMatchHostDrafts), 1-7 drafts, a vocabulary that is not a multiple of the block.
TEST(CudaSampling, VerifyRowsMatchTheHostVerifier) {
  ML4_REQUIRE_GPU();
  for (const int64_t V : {int64_t{8192 + 5}, int64_t{131072}}) {
    constexpr int kSeqs = 8, kTrials = 24;
    std::vector<VerifySeq> seqs(kSeqs);
    int64_t rows = 0, qrows = 0, ndrafts = 0;
    for (int s = 0; s < kSeqs; ++s) {
      VerifySeq& v = seqs[s];
      v.k = 1 + s % 7;
      v.row0 = rows;
      v.q0 = s % 2 == 0 ? qrows : -1;
      v.draft0 = static_cast<int32_t>(ndrafts);
      v.out0 = static_cast<int32_t>(rows);
      v.params.temperature = s % 3 == 0 ? 0.7f : s % 3 == 1 ? 1.0f : 1.3f;
      v.params.min_p = s % 4 == 1 ? 0.05f : 0.0f;
      v.params.seed = 9000 + static_cast<uint64_t>(s);
      with_top_k_top_p(v.params, s);
      ASSERT_TRUE(verify_rows_supported(v.params, V));
      rows += 1 + v.k;
      if (v.q0 >= 0) qrows += v.k;
      ndrafts += v.k;
    }
    const auto l = testing::randn(rows * V, 77, 2.5f);
    const auto noise = testing::randn(rows * V, 78, 0.7f);
    std::vector<float> q(std::max<int64_t>(qrows, 1) * V, 0.0f);
    std::vector<int32_t> drafts(ndrafts);
    std::vector<double> dist(V);
    std::vector<float> row(V), w(V);
    for (int s = 0; s < kSeqs; ++s) {
      const VerifySeq& v = seqs[s];
      for (int j = 0; j < v.k; ++j) {
        const float* lj = l.data() + (v.row0 + j) * V;
        if (v.q0 >= 0) {  // a drafter near the target: q from perturbed logits, the draft drawn from q
          for (int64_t i = 0; i < V; ++i) row[i] = lj[i] + noise[(v.row0 + j) * V + i];
          sampling::row_distribution(row.data(), V, v.params, dist.data());
          float* qj = q.data() + (v.q0 + j) * V;
          for (int64_t i = 0; i < V; ++i) qj[i] = static_cast<float>(dist[i]);
          drafts[v.draft0 + j] = sampling::draw_from_weights(qj, V, 55 + s, j);
        } else {  // greedy drafts of another model: here a draw from p itself
          sampling::row_distribution(lj, V, v.params, dist.data());
          for (int64_t i = 0; i < V; ++i) w[i] = static_cast<float>(dist[i]);
          drafts[v.draft0 + j] = sampling::draw_from_weights(w.data(), V, 66 + s, j);
        }
      }
    }
    auto dl = to_device(l), dq = to_device(q), dd = to_device(drafts);
    const size_t wb = verify_rows_workspace_bytes(rows);
    auto ws = poisoned<uint8_t>(wb);
    int64_t decided = 0, accepted_total = 0, rejected = 0, bonus = 0;
    std::vector<int32_t> first_tokens;
    std::vector<float> first_logprobs;
    for (int trial = 0; trial < kTrials; ++trial) {
      for (int s = 0; s < kSeqs; ++s) seqs[s].params.counter = 1000 * trial + 3 * s;
      auto ds = to_device(seqs);
      for (int rep = 0; rep < (trial == 0 ? 2 : 1); ++rep) {
        auto dt = poisoned<int32_t>(rows), dlp = poisoned<float>(rows), da = poisoned<int32_t>(kSeqs);
        ML4_ASSERT_OK(verify_rows(dl.as<float>(), V, dq.as<float>(), dd.as<int32_t>(), ds.as<VerifySeq>(), kSeqs, 7,
                                  dt.as<int32_t>(), dlp.as<float>(), da.as<int32_t>(), ws.data(), wb, rows, nullptr));
        ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "verify_rows"));
        const auto tokens = to_host<int32_t>(dt, rows);
        const auto logprobs = to_host<float>(dlp, rows);
        const auto acc = to_host<int32_t>(da, kSeqs);
        if (rep == 1) {  // a repeat launch: the same bits
          EXPECT_EQ(tokens, first_tokens);
          EXPECT_EQ(0, std::memcmp(logprobs.data(), first_logprobs.data(), logprobs.size() * 4));
          continue;
        }
        if (trial == 0) first_tokens = tokens, first_logprobs = logprobs;
        for (int s = 0; s < kSeqs; ++s) {
          const VerifySeq& v = seqs[s];
          const std::vector<int32_t> dj(drafts.begin() + v.draft0, drafts.begin() + v.draft0 + v.k);
          const VerifyResult h = verify_drafts(l.data() + v.row0 * V, V, dj, v.q0 >= 0 ? q.data() + v.q0 * V : nullptr,
                                               v.params, v.params.seed, v.params.counter);
          ASSERT_EQ(acc[s], h.accepted) << "V=" << V << " trial " << trial << " seq " << s;
          for (int j = 0; j <= v.k; ++j) {
            const int32_t t = tokens[v.out0 + j];
            if (j > h.accepted) {
              EXPECT_EQ(t, -1) << "seq " << s << " slot " << j;
              EXPECT_EQ(logprobs[v.out0 + j], 0.0f);
              continue;
            }
            ASSERT_EQ(t, h.tokens[j]) << "V=" << V << " trial " << trial << " seq " << s << " slot " << j;
            const float* lj = l.data() + (v.row0 + j) * V;
            const double m = *std::max_element(lj, lj + V);
            double z = 0.0;
            for (int64_t i = 0; i < V; ++i) z += std::exp(static_cast<double>(lj[i]) - m);
            const double want = static_cast<double>(lj[t]) - m - std::log(z);
            // f32 rounding of a value of magnitude < 32 (2^-19 ~ 1.9e-6) plus f64 sum-order noise.
            EXPECT_NEAR(logprobs[v.out0 + j], want, 4e-6) << "seq " << s << " slot " << j;
          }
          ++decided;
          accepted_total += h.accepted;
          if (h.accepted < v.k) ++rejected; else ++bonus;
        }
      }
    }
    std::printf("verify_rows V=%lld: %lld verifications, %lld drafts accepted, %lld rejections, %lld bonus tokens\n",
                static_cast<long long>(V), static_cast<long long>(decided), static_cast<long long>(accepted_total),
                static_cast<long long>(rejected), static_cast<long long>(bonus));
    EXPECT_GT(accepted_total, decided / 4);  // both branches ran, many times
    EXPECT_GT(rejected, decided / 4);
    EXPECT_GT(bonus, 0);
  }
  DeviceSamplingParams p;
  p.temperature = 0.0f;
  EXPECT_FALSE(verify_rows_supported(p, 8192));  // greedy rows verify by argmax
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  EXPECT_TRUE(verify_rows_supported(p, 8192));
  DeviceBuffer d = poisoned<float>(64);
  DeviceBuffer ws = poisoned<uint8_t>(64);
  const auto* vs = reinterpret_cast<const VerifySeq*>(d.as<float>());
  auto call = [&](const float* logits, int64_t n, int max_k, size_t wbytes, int64_t rows) {
    return verify_rows(logits, 8, nullptr, d.as<int32_t>(), vs, n, max_k, d.as<int32_t>(), d.as<float>(),
                       d.as<int32_t>(), ws.data(), wbytes, rows, nullptr);
  };
  EXPECT_FALSE(call(d.as<float>(), -1, 1, 64, 2).ok());
  EXPECT_FALSE(call(nullptr, 1, 1, 64, 2).ok());
  EXPECT_FALSE(call(d.as<float>(), 1, -1, 64, 2).ok());
  EXPECT_FALSE(call(d.as<float>(), 1, 1, 16, 2).ok());  // workspace too small for 2 rows
  EXPECT_TRUE(call(d.as<float>(), 0, 1, 0, 0).ok());
}

TEST(CudaSampling, BadArgumentsAreErrors) {
  ML4_REQUIRE_GPU();
  DeviceBuffer d = poisoned<float>(64);
  const DeviceSamplingParams* p = reinterpret_cast<const DeviceSamplingParams*>(d.as<float>());
  EXPECT_FALSE(sample_rows(d.as<float>(), -1, 4, p, d.as<int32_t>(), nullptr, nullptr).ok());
  EXPECT_FALSE(sample_rows(d.as<float>(), 1, 0, p, d.as<int32_t>(), nullptr, nullptr).ok());
  EXPECT_FALSE(sample_rows(d.as<float>(), 1, 4, nullptr, d.as<int32_t>(), nullptr, nullptr).ok());
  EXPECT_FALSE(sample_rows(nullptr, 1, 4, p, d.as<int32_t>(), nullptr, nullptr).ok());
  EXPECT_TRUE(sample_rows(d.as<float>(), 0, 4, p, d.as<int32_t>(), nullptr, nullptr).ok());
  // The split path: a missing, short or misaligned workspace.
  const size_t wb = sample_rows_workspace_bytes(2, 4);
  EXPECT_GT(wb, 0u);
  DeviceBuffer ws = poisoned<uint8_t>(wb + 256);
  EXPECT_FALSE(sample_rows(d.as<float>(), 2, 4, p, d.as<int32_t>(), nullptr, nullptr, wb, nullptr).ok());
  EXPECT_FALSE(sample_rows(d.as<float>(), 2, 4, p, d.as<int32_t>(), nullptr, ws.data(), wb - 1, nullptr).ok());
  EXPECT_FALSE(
      sample_rows(d.as<float>(), 2, 4, p, d.as<int32_t>(), nullptr, ws.as<uint8_t>() + 16, wb, nullptr).ok());
  EXPECT_FALSE(sample_rows(d.as<float>(), -1, 4, p, d.as<int32_t>(), nullptr, ws.data(), wb, nullptr).ok());
  EXPECT_TRUE(sample_rows(d.as<float>(), 0, 4, p, d.as<int32_t>(), nullptr, nullptr, 0, nullptr).ok());
}

}  // namespace
}  // namespace ml4::cuda
