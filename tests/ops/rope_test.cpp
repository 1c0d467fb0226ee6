// RoPE: inverse frequencies (plain and YaRN) against an independent f64 formula and
// against values computed with numpy (the transformers `_compute_yarn_parameters`
// algorithm, run here on 2026-12-02, f64 then rounded to f32; torch's f32 evaluation
// agrees to 1 ulp); rotations against a direct complex-multiply reference.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <numbers>

#include "ops/cpu/rope.h"
#include "ops_test_util.h"

namespace ml4::cpu {
namespace {

// DeepSeek-V3 precompute_freqs_cis, written the way model.py writes it (smooth factor).
std::vector<double> yarn_ref(double base, int dim, const YarnConfig& y) {
  auto corr = [&](double rot) {
    return dim * std::log(y.original_max_position_embeddings / (rot * 2 * std::numbers::pi)) /
           (2 * std::log(base));
  };
  double low = std::max(std::floor(corr(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(corr(y.beta_slow)), dim - 1.0);
  if (low == high) high += 0.001;
  std::vector<double> f(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    const double freq = 1.0 / std::pow(base, double(2 * i) / dim);
    const double smooth = 1.0 - std::clamp((i - low) / (high - low), 0.0, 1.0);
    f[i] = freq / y.factor * (1 - smooth) + freq * smooth;
  }
  return f;
}

YarnConfig deepseek_yarn() {
  YarnConfig y;
  y.enabled = true;
  y.factor = 40.0;
  y.original_max_position_embeddings = 4096;
  y.beta_fast = 32;
  y.beta_slow = 1;
  y.mscale = 1.0;
  y.mscale_all_dim = 1.0;
  return y;
}

TEST(Rope, InvFreqPlain) {
  auto f = rope_inv_freq(10000.0, 64, YarnConfig{});
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 32; ++i)
    EXPECT_FLOAT_EQ(f[i], static_cast<float>(std::pow(10000.0, -2.0 * i / 64)));
}

TEST(Rope, InvFreqYarnMatchesFormula) {
  for (double base : {10000.0, 1e6}) {
    YarnConfig y = deepseek_yarn();
    if (base == 1e6) {
      y.factor = 16;
      y.original_max_position_embeddings = 8192;
    }
    auto f = rope_inv_freq(base, 64, y);
    auto ref = yarn_ref(base, 64, y);
    for (int i = 0; i < 32; ++i) EXPECT_NEAR(f[i], ref[i], 1.2e-7 * ref[i]) << i;
  }
}

TEST(Rope, InvFreqYarnNumpyValues) {
  // numpy, theta 1e4, dim 64, factor 40, orig 4096, beta 32/1: ramp over dims [10, 23].
  const std::pair<int, double> a[] = {{0, 1.0},
                                      {5, 0.23713737726211548},
                                      {10, 0.05623413249850273},
                                      {11, 0.039006926119327545},
                                      {20, 0.0007905694073997438},
                                      {25, 1.8747356079984456e-05},
                                      {31, 3.3338035336782923e-06}};
  auto f = rope_inv_freq(10000.0, 64, deepseek_yarn());
  for (auto [i, v] : a) EXPECT_NEAR(f[i], v, 1.2e-7 * v) << i;  // 1 ulp of f32
  // theta 1e6, factor 16, orig 8192: ramp over dims [8, 17].
  YarnConfig y = deepseek_yarn();
  y.factor = 16;
  y.original_max_position_embeddings = 8192;
  const std::pair<int, double> b[] = {{5, 0.11547819525003433},
                                      {10, 0.010557044297456741},
                                      {11, 0.005953504703938961},
                                      {20, 1.1114246262877714e-05},
                                      {31, 9.624540808772508e-08}};
  auto g = rope_inv_freq(1e6, 64, y);
  for (auto [i, v] : b) EXPECT_NEAR(g[i], v, 1.2e-7 * v) << i;
}

TEST(Rope, AttentionFactor) {
  EXPECT_EQ(rope_attention_factor(YarnConfig{}), 1.0f);
  YarnConfig y = deepseek_yarn();
  EXPECT_FLOAT_EQ(rope_attention_factor(y), 1.0f);  // mscale == mscale_all_dim
  y.mscale = 0.707;
  EXPECT_NEAR(rope_attention_factor(y), 0.9210423553163399, 1e-7);  // numpy
  y.factor = 16;
  y.mscale = 1.0;
  y.mscale_all_dim = 0.5;
  EXPECT_NEAR(rope_attention_factor(y), 1.1217512, 1e-7);
  y.mscale_all_dim = 0.0;  // transformers: falls back to get_mscale(factor)
  EXPECT_NEAR(rope_attention_factor(y), 0.1 * std::log(16.0) + 1.0, 1e-7);
}

TEST(Rope, LeRopeAndLlama4) {
  LeRopeConfig le{true, 100, 4.0};
  EXPECT_EQ(lerope_position(0, le), 0.0);
  EXPECT_EQ(lerope_position(99, le), 99.0);
  EXPECT_EQ(lerope_position(100, le), 100.0);
  EXPECT_EQ(lerope_position(102, le), 100.5);
  EXPECT_EQ(lerope_position(1000, LeRopeConfig{}), 1000.0);
  Llama4Scaling l4{true, 8192, 0.1};
  EXPECT_EQ(llama4_q_scale(0, l4), 1.0f);
  EXPECT_EQ(llama4_q_scale(8191, l4), 1.0f);
  EXPECT_NEAR(llama4_q_scale(20000, l4), 1.109861228866811, 1e-7);  // numpy
  EXPECT_FLOAT_EQ(llama4_q_scale(8192, l4), static_cast<float>(1 + 0.1 * std::log(2.0)));
  EXPECT_EQ(llama4_q_scale(1 << 20, Llama4Scaling{}), 1.0f);
}

// Rotation: element pairs as complex numbers times attn * e^{i pos f}, in f64.
// f32 result: two products and a sum per output, plus cos/sin rounded: error <= ~4 ulp of
// the pair's magnitude.
void check_rotation(bool interleaved) {
  const int dim = 64, n_vec = 3;
  const int64_t stride = 80;  // vectors embedded in larger rows (q: [nope | rope] per head)
  auto inv = rope_inv_freq(10000.0, dim, deepseek_yarn());
  for (double pos : {0.0, 7.0, 100000.5, 1e7}) {
    auto x = test::random_floats(n_vec * stride, 9);
    auto y = x;
    const float attn = 1.25f;
    if (interleaved)
      rope_interleaved(y.data(), n_vec, dim, stride, pos, inv.data(), attn);
    else
      rope_neox(y.data(), n_vec, dim, stride, pos, inv.data(), attn);
    for (int v = 0; v < n_vec; ++v) {
      for (int i = 0; i < dim / 2; ++i) {
        const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + dim / 2;
        std::complex<double> z(x[v * stride + a], x[v * stride + b]);
        z *= std::polar(double(attn), pos * double(inv[i]));
        const double tol = 4 * test::kU * attn * std::abs(std::complex<double>(x[v * stride + a], x[v * stride + b])) + 1e-12;
        ASSERT_NEAR(y[v * stride + a], z.real(), tol) << pos << " " << i;
        ASSERT_NEAR(y[v * stride + b], z.imag(), tol) << pos << " " << i;
      }
      for (int j = dim; j < stride; ++j) ASSERT_EQ(y[v * stride + j], x[v * stride + j]);  // untouched
    }
  }
}

TEST(Rope, Interleaved) { check_rotation(true); }
TEST(Rope, Neox) { check_rotation(false); }

}  // namespace
}  // namespace ml4::cpu
