// softmax, silu_mul, topk (ties, NaN, k > n) and embedding_lookup against direct references.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/dtype.h"
#include "ops/cpu/basic.h"
#include "ops_test_util.h"

namespace ml4::cpu {
namespace {

using test::kU;

TEST(Basic, Softmax) {
  auto x = test::random_floats(1000, 1, -20.0f, 20.0f);
  std::vector<double> ref(x.size());
  const double mx = *std::max_element(x.begin(), x.end());
  double sum = 0.0;
  for (size_t i = 0; i < x.size(); ++i) sum += ref[i] = std::exp(x[i] - mx);
  for (auto& r : ref) r /= sum;
  softmax_inplace(x.data(), static_cast<int64_t>(x.size()));
  // exp of an exact f32 difference (libm: <= 1 ulp), one multiply by 1/sum: ~4 ulp relative.
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(x[i], ref[i], 4 * kU * ref[i] + 1e-30) << i;

  std::vector<float> masked = {-INFINITY, 1.0f, -INFINITY};
  softmax_inplace(masked.data(), 3);
  EXPECT_EQ(masked, (std::vector<float>{0.0f, 1.0f, 0.0f}));
  std::vector<float> all_masked(3, -INFINITY);
  softmax_inplace(all_masked.data(), 3);
  EXPECT_EQ(all_masked, (std::vector<float>{0.0f, 0.0f, 0.0f}));
}

TEST(Basic, SiluMul) {
  auto g = test::random_floats(333, 2, -10.0f, 10.0f);
  auto u = test::random_floats(333, 3, -2.0f, 2.0f);
  std::vector<float> out(333);
  silu_mul(g.data(), u.data(), 333, out.data());
  for (int i = 0; i < 333; ++i) {
    const double ref = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    ASSERT_NEAR(out[i], ref, 8 * kU * std::fabs(ref) + 1e-30) << i;  // exp, add, div, mul
  }
}

std::vector<int32_t> topk_ref(const std::vector<float>& s, int k) {
  std::vector<int32_t> idx(s.size());
  std::iota(idx.begin(), idx.end(), 0);
  auto key = [&](int32_t i) { return std::isnan(s[i]) ? -INFINITY : s[i]; };
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return key(a) > key(b); });
  idx.resize(std::min<size_t>(k, s.size()));
  return idx;
}

TEST(Basic, TopkRandomSmallAndLarge) {
  for (int k : {1, 8, 64, 65, 300}) {
    auto s = test::random_floats(2000, 4 + k);
    std::vector<int32_t> idx(k);
    topk(s.data(), 2000, k, idx.data());
    EXPECT_EQ(idx, topk_ref(s, k)) << k;
  }
}

TEST(Basic, TopkTiesGoToLowerIndexAndNanIsLast) {
  // Quantized scores: many exact ties.
  auto s = test::random_floats(500, 5, 0.0f, 10.0f);
  for (auto& v : s) v = std::floor(v);
  s[3] = std::numeric_limits<float>::quiet_NaN();
  for (int k : {5, 40, 100, 499}) {
    std::vector<int32_t> idx(k);
    topk(s.data(), 500, k, idx.data());
    EXPECT_EQ(idx, topk_ref(s, k)) << k;
  }
  std::vector<float> t = {1.0f, 2.0f, 2.0f, 1.0f, 2.0f};
  std::vector<int32_t> idx(4);
  topk(t.data(), 5, 4, idx.data());
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 2, 4, 0}));
  std::vector<float> n = {NAN, -INFINITY, 3.0f};
  std::vector<int32_t> i3(5);
  topk(n.data(), 3, 5, i3.data());  // k > n: tail is -1
  EXPECT_EQ(i3, (std::vector<int32_t>{2, 0, 1, -1, -1}));
}

// topk_set: topk's indices sorted, with ties, NaN, -inf, -0 / +0 and k >= n.
TEST(Basic, TopkSetIsSortedTopk) {
  for (int n : {1, 7, 300, 520, 2000}) {
    for (int variant = 0; variant < 5; ++variant) {
      auto s = test::random_floats(n, 40 + n + variant, -5.0f, 5.0f);
      if (variant == 3) std::fill(s.begin(), s.end(), 0.0f);  // one value: all ties
      if (variant == 4)  // close values (one histogram bucket) and a few far ones
        for (int i = 0; i < n; ++i) s[i] = 1.0f + (i % 5 == 0 ? 0.0f : 1e-6f * static_cast<float>(i % 37)) + (i % 97 == 3 ? 100.0f : 0.0f);
      if (variant == 1 || variant == 2)
        for (auto& v : s) v = std::floor(v);  // many ties, zeros among them
      if (variant == 2)
        for (int i = 0; i < n; i += 7) s[i] = (i / 7) % 4 == 0 ? NAN : (i / 7) % 4 == 1 ? -INFINITY : (i / 7) % 4 == 2 ? -0.0f : 0.0f;
      for (int k : {0, 1, 5, 64, 65, 256, n - 1, n, n + 3}) {
        if (k < 0) continue;
        auto ref = topk_ref(s, k);
        std::sort(ref.begin(), ref.end());
        std::vector<int32_t> idx(std::min(k, n), -7);
        topk_set(s.data(), n, k, idx.data());
        EXPECT_EQ(idx, ref) << n << " " << variant << " " << k;
        std::vector<int32_t> full(std::max(k, 0));
        topk(s.data(), n, k, full.data());
        full.resize(std::min(k, n));
        EXPECT_EQ(full, topk_ref(s, k)) << n << " " << variant << " " << k;
      }
    }
  }
}

TEST(Basic, EmbeddingLookup) {
  const int64_t V = 50, D = 24;
  auto vals = test::random_floats(V * D, 6);
  Tensor f32(DType::kF32, {V, D}), b16(DType::kBF16, {V, D});
  for (int64_t i = 0; i < V * D; ++i) {
    f32.mutable_as<float>()[i] = vals[i];
    b16.mutable_as<uint16_t>()[i] = f32_to_bf16(vals[i]);
  }
  const std::vector<int32_t> ids = {3, 49, 0, 3};
  std::vector<float> out(ids.size() * D);
  embedding_lookup(f32, ids.data(), 4, out.data());
  for (size_t t = 0; t < ids.size(); ++t)
    for (int64_t d = 0; d < D; ++d) ASSERT_EQ(out[t * D + d], vals[ids[t] * D + d]);
  embedding_lookup(b16, ids.data(), 4, out.data());
  for (size_t t = 0; t < ids.size(); ++t)
    for (int64_t d = 0; d < D; ++d) ASSERT_EQ(out[t * D + d], round_bf16(vals[ids[t] * D + d]));
  // Out of range ids: NaN rows, others intact, no out-of-bounds read.
  const std::vector<int32_t> bad = {1, 50, -1};
  std::vector<float> o(3 * D, 0.0f);
  embedding_lookup(f32, bad.data(), 3, o.data());
  EXPECT_EQ(o[0], vals[D]);
  EXPECT_TRUE(std::isnan(o[D]));
  EXPECT_TRUE(std::isnan(o[2 * D]));
}

}  // namespace
}  // namespace ml4::cpu
