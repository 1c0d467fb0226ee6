// Decode context parallelism's combine kernels (ops/cuda/context_parallel.h) against the CPU
// ops (ops/cpu/attention.h): N = 2, 4, 8 parts of [rows, cols] partial outputs with random
// lse, some parts empty (lse -inf) and one row empty in every part. Same formulas in the same
// order; the only differences are expf / logf against std::exp / std::log (a few ulps) and FMA
// contraction: bound rel L2 1e-6 over the output, max-abs relative 1e-5; empty rows exactly 0.
// A second run must give the same bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "cuda_test_util.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/context_parallel.h"

namespace ml4::cuda {
namespace {

using namespace testing;

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

TEST(CudaContextParallel, MergeAndRescaleMatchTheCpu) {
  ML4_REQUIRE_GPU();
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int N : {2, 4, 8}) {
    const int64_t rows = 37 * 4, cols = 512;  // T 37 x 4 heads, kv_lora_rank 512
    const int64_t stride = rows * (cols + 1);
    std::mt19937 g(7 + N);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::uniform_real_distribution<float> l(-20.0f, 20.0f);
    std::vector<float> parts(N * stride);
    for (int p = 0; p < N; ++p) {
      for (int64_t i = 0; i < rows * cols; ++i) parts[p * stride + i] = d(g);
      for (int64_t r = 0; r < rows; ++r) {
        float v = l(g);
        if (r == 5 || (r + p) % 7 == 0) v = ninf;  // row 5 empty everywhere; scattered empty parts
        parts[p * stride + rows * cols + r] = v;
        if (v == ninf)
          for (int64_t c = 0; c < cols; ++c) parts[p * stride + r * cols + c] = 0.0f;  // as attention leaves it
      }
    }
    // a2a merge.
    std::vector<float> want(rows * cols);
    cpu::merge_attention_parts(parts.data(), N, stride, rows, cols, want.data());
    auto dp = to_device(parts);
    auto dout = poisoned<float>(rows * cols);
    ASSERT_TRUE(merge_attention_parts(dptr<float>(dp), N, stride, rows, cols, dptr<float>(dout), nullptr).ok());
    const auto got = to_host<float>(dout, rows * cols);
    auto dout2 = poisoned<float>(rows * cols);
    ASSERT_TRUE(merge_attention_parts(dptr<float>(dp), N, stride, rows, cols, dptr<float>(dout2), nullptr).ok());
    EXPECT_EQ(to_host<float>(dout2, rows * cols), got) << "a second run differs";
    double mx = 0.0, big = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      mx = std::max(mx, std::abs(double(got[i]) - want[i]));
      big = std::max(big, std::abs(double(want[i])));
    }
    EXPECT_LT(rel_l2(got, want), 1e-6) << "N " << N;
    EXPECT_LT(mx, 1e-5 * big) << "N " << N;
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(got[5 * cols + c], 0.0f);
    // ag_rs rescale of every part, summed.
    std::vector<float> lse_all(N * rows);
    for (int p = 0; p < N; ++p) std::copy_n(parts.data() + p * stride + rows * cols, rows, lse_all.data() + p * rows);
    auto dall = to_device(lse_all);
    std::vector<float> sum_cpu(rows * cols, 0.0f), sum_gpu(rows * cols, 0.0f);
    for (int p = 0; p < N; ++p) {
      std::vector<float> mine(parts.begin() + p * stride, parts.begin() + p * stride + rows * cols);
      std::vector<float> lse(parts.begin() + p * stride + rows * cols, parts.begin() + (p + 1) * stride);
      auto dm = to_device(mine);
      auto dl = to_device(lse);
      cpu::rescale_attention_part(mine.data(), lse.data(), lse_all.data(), N, rows, cols);
      ASSERT_TRUE(rescale_attention_part(dptr<float>(dm), dptr<float>(dl), dptr<float>(dall), N, rows, cols, nullptr).ok());
      const auto gm = to_host<float>(dm, rows * cols);
      EXPECT_LT(rel_l2(gm, mine), 1e-6) << "N " << N << " part " << p;
      for (int64_t i = 0; i < rows * cols; ++i) sum_cpu[i] += mine[i], sum_gpu[i] += gm[i];
    }
    EXPECT_LT(rel_l2(sum_gpu, want), 1e-6) << "N " << N << ": the rescaled sum is the merge";
  }
}

}  // namespace
}  // namespace ml4::cuda
