// Weight formats against their definitions: dequantize_linear equals an independent f64
// decode written here from the format text (linear_weight.h, OCP MX v1.0, OCP FP8), each
// quantizer stays within the error bound its format allows, scales follow the recipes,
// and make_linear_weight refuses wrong shapes and dtypes with a message naming the tensor.
#include "model/quant.h"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

namespace ml4 {
namespace {

// ---- Independent decoders, from the format definitions (not from core/dtype.cpp). ----

// OCP FP8 e4m3fn: bias 7; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN.
double ref_e4m3(uint8_t c) {
  int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return NAN;
  double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}
// OCP FP4 e2m1: bias 1; exponent 0 is subnormal (m/2).
double ref_e2m1(uint8_t c) {
  int s = (c >> 3) & 1, e = (c >> 1) & 3, m = c & 1;
  double v = e == 0 ? m * 0.5 : std::ldexp(1.0 + m / 2.0, e - 1);
  return s ? -v : v;
}
// OCP E8M0: 2^(c - 127), 0xFF is NaN.
double ref_e8m0(uint8_t c) { return c == 0xff ? NAN : std::ldexp(1.0, c - 127); }

double ref_fp4_at(const LinearWeight& w, int64_t n, int64_t k) {
  uint8_t b = w.weight.as<uint8_t>()[n * (w.in_features / 2) + k / 2];
  return ref_e2m1(k % 2 == 0 ? (b & 15) : (b >> 4));  // element 2j in the low nibble
}

// Value of element (n, k) per linear_weight.h, in f64.
double ref_value(const LinearWeight& w, int64_t n, int64_t k) {
  const int64_t K = w.in_features;
  switch (w.format) {
    case LinearFormat::kF32: return w.weight.as<float>()[n * K + k];
    case LinearFormat::kBF16: {
      uint32_t bits = static_cast<uint32_t>(w.weight.as<uint16_t>()[n * K + k]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case LinearFormat::kFP8Block:
      return ref_e4m3(w.weight.as<uint8_t>()[n * K + k]) *
             w.scale.as<float>()[(n / 128) * w.scale.dim(1) + k / 128];
    case LinearFormat::kNVFP4:
      return ref_fp4_at(w, n, k) * ref_e4m3(w.scale.as<uint8_t>()[n * (K / 16) + k / 16]) * w.global_scale;
    case LinearFormat::kMXFP4:
      return ref_fp4_at(w, n, k) * ref_e8m0(w.scale.as<uint8_t>()[n * (K / 32) + k / 32]);
  }
  return NAN;
}

// Fresh normal weights (std 0.02, a typical init) with a few outliers 30-60x larger, as
// real checkpoints have, so that some blocks are dominated by one value.
std::vector<float> make_weights(int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<float> w(static_cast<size_t>(N * K));
  for (auto& v : w) v = nd(rng);
  std::uniform_int_distribution<int64_t> pos(0, N * K - 1);
  for (int i = 0; i < 8; ++i) w[pos(rng)] = (i % 2 ? -1.0f : 1.0f) * (0.6f + 0.6f * (i / 8.0f));
  for (int64_t k = 0; k < 32 && k < K; ++k) w[k] = 0.0f;  // one all-zero group / partial block
  return w;
}

// Dequantization must equal the reference decode rounded once to f32: the products are exact
// in f64 (<= 2 + 4 + 24 significant bits), so no tolerance is needed.
void expect_dequant_exact(const LinearWeight& w) {
  std::vector<float> got = dequantize_linear(w);
  ASSERT_EQ(got.size(), static_cast<size_t>(w.out_features * w.in_features));
  int64_t bad = 0;
  for (int64_t n = 0; n < w.out_features; ++n) {
    for (int64_t k = 0; k < w.in_features; ++k) {
      float want = static_cast<float>(ref_value(w, n, k));
      float g = got[n * w.in_features + k];
      if (!(g == want) && bad++ < 5) ADD_FAILURE() << w.name << " (" << n << ", " << k << "): " << g << " vs " << want;
    }
  }
  EXPECT_EQ(bad, 0);
}

// Half the e2m1 grid spacing around |v| (in scaled units), or the saturation loss past 6:
// the grid is {0, .5, 1, 1.5, 2, 3, 4, 6}, so spacing 0.5 below 2, 1 in [2, 4), 2 in [4, 6].
double e2m1_max_error(double v) {
  double a = std::fabs(v);
  if (a > 6.0) return a - 6.0;
  return a < 2.0 ? 0.25 : a < 4.0 ? 0.5 : 1.0;
}

TEST(Quant, Bf16IsRoundToNearestEven) {
  const int64_t N = 37, K = 51;
  auto w = make_weights(N, K, 11);
  auto q = quantize_linear(w.data(), N, K, LinearFormat::kBF16, "bf16.weight");
  ASSERT_TRUE(q.ok()) << q.status().message();
  expect_dequant_exact(*q);
  auto d = dequantize_linear(*q);
  for (int64_t i = 0; i < N * K; ++i) {
    // 8 significant bits: RNE error <= half an ulp = 2^-8 of the leading power of two <= 2^-8 |x|.
    EXPECT_LE(std::fabs(static_cast<double>(d[i]) - w[i]), std::ldexp(std::fabs(w[i]), -8)) << i;
  }
}

TEST(Quant, Fp8BlockRaggedEdges) {
  const int64_t N = 200, K = 300;  // 2 x 3 blocks, the last row and column blocks partial
  auto w = make_weights(N, K, 12);
  auto q = quantize_linear(w.data(), N, K, LinearFormat::kFP8Block, "layers.0.attention.wo.weight");
  ASSERT_TRUE(q.ok()) << q.status().message();
  ASSERT_EQ(q->scale.shape(), (Shape{2, 3}));
  expect_dequant_exact(*q);
  auto d = dequantize_linear(*q);
  for (int64_t bn = 0; bn < 2; ++bn) {
    for (int64_t bk = 0; bk < 3; ++bk) {
      float amax = 0;
      for (int64_t n = bn * 128; n < std::min<int64_t>(N, bn * 128 + 128); ++n)
        for (int64_t k = bk * 128; k < std::min<int64_t>(K, bk * 128 + 128); ++k) amax = std::max(amax, std::fabs(w[n * K + k]));
      const float s = q->scale.as<float>()[bn * 3 + bk];
      EXPECT_EQ(s, amax / 448.0f) << "DeepSeek weight_quant: scale = amax / 448";
      for (int64_t n = bn * 128; n < std::min<int64_t>(N, bn * 128 + 128); ++n) {
        for (int64_t k = bk * 128; k < std::min<int64_t>(K, bk * 128 + 128); ++k) {
          // |x / s| <= 448. e4m3 has 4 significant bits: RNE error <= 2^-4 |v| for normal v,
          // <= 2^-10 (half the subnormal step 2^-9) below 2^-6. Times s, plus 2^-20 relative
          // slack for the f32 division and product.
          double x = w[n * K + k];
          double bound = std::max(std::ldexp(std::fabs(x), -4), std::ldexp(static_cast<double>(s), -10));
          EXPECT_LE(std::fabs(d[n * K + k] - x), bound * (1 + std::ldexp(1.0, -20))) << n << "," << k;
        }
      }
    }
  }
  // The block maximum itself is represented exactly (448 * s).
  EXPECT_EQ(std::fabs(d[0]), 0.0f);
}

TEST(Quant, Fp8AllZeroBlockGetsScaleOne) {
  std::vector<float> z(130 * 5, 0.0f);
  z[129 * 5] = 3.0f;  // second block row non-zero
  auto q = quantize_linear(z.data(), 130, 5, LinearFormat::kFP8Block, "z");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->scale.as<float>()[0], 1.0f);
  EXPECT_EQ(q->scale.as<float>()[1], 3.0f / 448.0f);
  auto d = dequantize_linear(*q);
  EXPECT_EQ(d[129 * 5], 3.0f);
}

TEST(Quant, Nvfp4WithinFormatBound) {
  const int64_t N = 64, K = 256;
  auto w = make_weights(N, K, 13);
  auto q = quantize_linear(w.data(), N, K, LinearFormat::kNVFP4, "layers.1.experts.3.w1.weight");
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ(q->weight.dtype(), DType::kF4E2M1x2);
  EXPECT_EQ(q->weight.shape(), (Shape{N, K / 2}));
  EXPECT_EQ(q->scale.shape(), (Shape{N, K / 16}));
  float amax = 0;
  for (float v : w) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(q->global_scale, amax / 2688.0f) << "ModelOpt weight_scale_2 = amax / (6 * 448)";
  expect_dequant_exact(*q);
  auto d = dequantize_linear(*q);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < K / 16; ++j) {
      const double S = ref_e4m3(q->scale.as<uint8_t>()[n * (K / 16) + j]);
      const double unit = S * q->global_scale;
      double bmax = 0;
      for (int i = 0; i < 16; ++i) bmax = std::max(bmax, std::fabs(static_cast<double>(w[n * K + j * 16 + i])));
      if (bmax == 0) {
        EXPECT_EQ(S, 1.0) << "an all-zero block gets scale 1 (ModelOpt)";
        continue;
      }
      // S = e4m3(bmax / 6 / g) is within 2^-4 relative of the ideal scale when that is in
      // e4m3's normal range (>= 2^-6, i.e. bmax / amax >= 2^-6 / 448: true for these
      // weights), so |x| / unit <= 6 / (1 - 2^-4).
      EXPECT_LE(bmax / unit, 6.0 / (1 - 1.0 / 16) * (1 + 1e-6)) << n << "," << j;
      for (int i = 0; i < 16; ++i) {
        const int64_t k = j * 16 + i;
        const double x = w[n * K + k];
        // Nearest e2m1 point: error <= half the local spacing (or the saturation loss), in
        // units of S * g, plus 2^-20 relative slack for the f32 division in the quantizer.
        const double bound = e2m1_max_error(x / unit) * unit + std::ldexp(std::fabs(x), -20);
        EXPECT_LE(std::fabs(d[n * K + k] - x), bound) << n << "," << k;
      }
    }
  }
}

TEST(Quant, Mxfp4ScaleRuleAndBound) {
  const int64_t N = 48, K = 256;
  auto w = make_weights(N, K, 14);
  auto q = quantize_linear(w.data(), N, K, LinearFormat::kMXFP4, "layers.2.experts.0.w2.weight");
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ(q->scale.dtype(), DType::kE8M0);
  EXPECT_EQ(q->scale.shape(), (Shape{N, K / 32}));
  expect_dequant_exact(*q);
  auto d = dequantize_linear(*q);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < K / 32; ++j) {
      double bmax = 0;
      for (int i = 0; i < 32; ++i) bmax = std::max(bmax, std::fabs(static_cast<double>(w[n * K + j * 32 + i])));
      const uint8_t code = q->scale.as<uint8_t>()[n * (K / 32) + j];
      // OCP MX v1.0 6.3: X = 2^(floor(log2(amax)) - emax_elem), emax_elem(e2m1) = 2.
      const int want_e = bmax == 0 ? 0 : static_cast<int>(std::floor(std::log2(bmax))) - 2;
      EXPECT_EQ(static_cast<int>(code) - 127, want_e) << n << "," << j;
      const double X = ref_e8m0(code);
      for (int i = 0; i < 32; ++i) {
        const int64_t k = j * 32 + i;
        const double x = w[n * K + k];
        // bmax / X lies in [4, 8): values past 6 X saturate (loss < 2 X); others round to
        // the nearest e2m1 point. Division by a power of two is exact, so no slack.
        EXPECT_LE(std::fabs(d[n * K + k] - x), e2m1_max_error(x / X) * X) << n << "," << k;
        EXPECT_LT(std::fabs(d[n * K + k] - x), 2 * X);
      }
    }
  }
}

TEST(Quant, Fp8ToMxfp4Requantization) {
  const int64_t N = 160, K = 256;
  auto w = make_weights(N, K, 15);
  auto fp8 = quantize_linear(w.data(), N, K, LinearFormat::kFP8Block, "layers.5.experts.7.w3.weight");
  ASSERT_TRUE(fp8.ok());
  auto mx = requantize_fp8_to_mxfp4(*fp8);
  ASSERT_TRUE(mx.ok()) << mx.status().message();
  EXPECT_EQ(mx->format, LinearFormat::kMXFP4);
  EXPECT_EQ(mx->name, fp8->name);
  expect_dequant_exact(*mx);
  auto y = dequantize_linear(*fp8);
  auto d = dequantize_linear(*mx);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < K / 32; ++j) {
      // Independent MXFP4 of the exact FP8 values, in f64.
      double bmax = 0;
      for (int i = 0; i < 32; ++i) bmax = std::max(bmax, std::fabs(ref_value(*fp8, n, j * 32 + i)));
      const int e = bmax == 0 ? 0 : static_cast<int>(std::floor(std::log2(bmax))) - 2;
      EXPECT_EQ(mx->scale.as<uint8_t>()[n * (K / 32) + j], e + 127);
      const double X = std::ldexp(1.0, e);
      for (int i = 0; i < 32; ++i) {
        const int64_t k = j * 32 + i;
        const double yv = ref_value(*fp8, n, k);
        // Error against the FP8 weight: the MXFP4 bound; against the original f32 weight: the
        // sum of the FP8 block bound and the MXFP4 bound.
        const double mx_bound = e2m1_max_error(yv / X) * X;
        EXPECT_LE(std::fabs(d[n * K + k] - yv), mx_bound) << n << "," << k;
        const float s = fp8->scale.as<float>()[(n / 128) * fp8->scale.dim(1) + k / 128];
        const double fp8_bound = std::max(std::ldexp(std::fabs(static_cast<double>(w[n * K + k])), -4), std::ldexp(double{s}, -10)) * (1 + 1e-6);
        EXPECT_LE(std::fabs(d[n * K + k] - w[n * K + k]), fp8_bound + mx_bound) << n << "," << k;
      }
    }
  }
  // Same codes as quantizing the f32-rounded FP8 values directly: they could differ only
  // where rounding to f32 moves a value across an e2m1 midpoint (not for this seed).
  auto direct = quantize_linear(y.data(), N, K, LinearFormat::kMXFP4, "direct");
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(std::memcmp(direct->weight.data(), mx->weight.data(), mx->weight.nbytes()), 0);

  // A NaN e4m3 code (0x7f) is refused, not saturated to 6 X.
  LinearWeight corrupt = *fp8;
  corrupt.weight = Tensor(DType::kF8E4M3, {N, K});
  std::memcpy(corrupt.weight.mutable_data(), fp8->weight.data(), fp8->weight.nbytes());
  corrupt.weight.mutable_as<uint8_t>()[3 * K + 70] = 0x7f;
  auto bad = requantize_fp8_to_mxfp4(corrupt);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("element (3, 70) is not finite (e4m3 code 0x7f"), std::string::npos)
      << bad.status().message();

  auto not_fp8 = requantize_fp8_to_mxfp4(*mx);
  ASSERT_FALSE(not_fp8.ok());
  EXPECT_NE(not_fp8.status().message().find("needs an fp8 block weight"), std::string::npos);
  std::vector<float> odd(128 * 48, 0.5f);
  auto fp8_odd = quantize_linear(odd.data(), 128, 48, LinearFormat::kFP8Block, "odd");
  ASSERT_TRUE(fp8_odd.ok());
  auto r = requantize_fp8_to_mxfp4(*fp8_odd);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("in_features 48 is not a multiple of the mxfp4 group size 32"), std::string::npos);
}

TEST(Quant, MakeLinearWeightValidates) {
  // The message of STYLE.md rule 6, verbatim.
  auto r = make_linear_weight("layers.3.attention.wkv_b.weight", LinearFormat::kBF16, 16384, 512,
                              Tensor(DType::kBF16, {16384, 256}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "tensor layers.3.attention.wkv_b.weight: expected [16384, 512] bf16, found [16384, 256] bf16");

  // FP8: wrong scale shape, wrong scale dtype, non-finite scale, missing scale.
  r = make_linear_weight("a.weight", LinearFormat::kFP8Block, 300, 200, Tensor(DType::kF8E4M3, {300, 200}),
                         Tensor(DType::kF32, {2, 2}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "tensor a.weight scale: expected [3, 2] f32, found [2, 2] f32");
  r = make_linear_weight("a.weight", LinearFormat::kFP8Block, 300, 200, Tensor(DType::kF8E4M3, {300, 200}),
                         Tensor(DType::kBF16, {3, 2}));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("expected [3, 2] f32, found [3, 2] bf16"), std::string::npos);
  Tensor bad_scale(DType::kF32, {3, 2});
  bad_scale.mutable_as<float>()[4] = NAN;
  r = make_linear_weight("a.weight", LinearFormat::kFP8Block, 300, 200, Tensor(DType::kF8E4M3, {300, 200}), bad_scale);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor a.weight scale: block (2, 0) is nan"), std::string::npos)
      << r.status().message();
  r = make_linear_weight("a.weight", LinearFormat::kFP8Block, 300, 200, Tensor(DType::kF8E4M3, {300, 200}));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("found no tensor"), std::string::npos);

  // NVFP4: U8 weights accepted (safetensors stores packed FP4 as U8), K % 16, global scale.
  Tensor w8(DType::kU8, {4, 16});
  w8.mutable_as<uint8_t>()[0] = 0x21;
  r = make_linear_weight("e.w1.weight", LinearFormat::kNVFP4, 4, 32, w8, Tensor(DType::kF8E4M3, {4, 2}), 0.5f);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->weight.dtype(), DType::kF4E2M1x2);
  EXPECT_EQ(r->weight.data(), w8.data()) << "retagged, not copied";
  EXPECT_EQ(r->global_scale, 0.5f);
  r = make_linear_weight("e.w1.weight", LinearFormat::kNVFP4, 4, 24, Tensor(DType::kU8, {4, 12}),
                         Tensor(DType::kF8E4M3, {4, 1}), 0.5f);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("in_features 24 is not a multiple of the nvfp4 group size 16"), std::string::npos);
  r = make_linear_weight("e.w1.weight", LinearFormat::kNVFP4, 4, 32, w8, Tensor(DType::kF8E4M3, {4, 2}), 0.0f);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("global scale 0 is not a positive finite number"), std::string::npos);
  r = make_linear_weight("e.w1.weight", LinearFormat::kNVFP4, 4, 32, w8, Tensor(DType::kF32, {4, 2}), 1.0f);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "tensor e.w1.weight scale: expected [4, 2] f8_e4m3, found [4, 2] f32");

  // MXFP4: U8 or E8M0 scales; U8 retagged to E8M0.
  r = make_linear_weight("e.w2.weight", LinearFormat::kMXFP4, 4, 64, Tensor(DType::kU8, {4, 32}),
                         Tensor(DType::kU8, {4, 2}));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->scale.dtype(), DType::kE8M0);
  r = make_linear_weight("e.w2.weight", LinearFormat::kMXFP4, 4, 64, Tensor(DType::kU8, {4, 64}),
                         Tensor(DType::kE8M0, {4, 2}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "tensor e.w2.weight: expected [4, 32] e2m1x2 or u8, found [4, 64] u8");

  // BF16 with a stray scale; bad layer shape.
  r = make_linear_weight("b.weight", LinearFormat::kBF16, 2, 2, Tensor(DType::kBF16, {2, 2}), Tensor(DType::kF32, {1}));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("takes no scale"), std::string::npos);
  r = make_linear_weight("b.weight", LinearFormat::kF32, 0, 2, Tensor(DType::kF32, {0, 2}));
  ASSERT_FALSE(r.ok());

  // An invalid weight dequantizes to nothing instead of reading out of bounds.
  LinearWeight broken;
  broken.format = LinearFormat::kMXFP4;
  broken.out_features = 4;
  broken.in_features = 64;
  broken.weight = Tensor(DType::kU8, {4, 8});
  EXPECT_TRUE(dequantize_linear(broken).empty());
}

// Exact midpoints between e2m1 values go to the even code (OCP: RNE), and values past 6 X
// saturate. amax 7 gives X = 2^(2 - 2) = 1, so the inputs are the scaled values themselves.
TEST(Quant, Mxfp4TiesGoToEvenAndSaturate) {
  const float in[32] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 7.0f, -0.25f, -0.75f, -5.0f, 6.5f,
                        0.26f, 0.74f, 2.49f, 3.51f};
  const float want[32] = {0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f, 6.0f, -0.0f, -1.0f, -4.0f, 6.0f,
                          0.5f, 0.5f, 2.0f, 4.0f};
  auto q = quantize_linear(in, 1, 32, LinearFormat::kMXFP4, "ties");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->scale.as<uint8_t>()[0], 127);
  auto d = dequantize_linear(*q);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(d[i], want[i]) << in[i];
    EXPECT_EQ(d[i], e2m1_to_f32(f32_to_e2m1(in[i]))) << in[i];  // agrees with core's RNE encoder
  }
}

TEST(Quant, QuantizeRefusesBadInput) {
  std::vector<float> w(4 * 48, 0.25f);
  auto r = quantize_linear(w.data(), 4, 48, LinearFormat::kMXFP4, "x.weight");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("in_features 48 is not a multiple of the mxfp4 group size 32"), std::string::npos);
  r = quantize_linear(w.data(), 4, 40, LinearFormat::kNVFP4, "x.weight");
  ASSERT_FALSE(r.ok());
  w[5] = INFINITY;
  r = quantize_linear(w.data(), 4, 48, LinearFormat::kFP8Block, "x.weight");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor x.weight: element (0, 5) is inf"), std::string::npos)
      << r.status().message();
  r = quantize_linear(nullptr, 4, 48, LinearFormat::kBF16, "x.weight");
  ASSERT_FALSE(r.ok());
}

TEST(Quant, MxScaleExponentEdges) {
  EXPECT_EQ(mxfp4_scale_exponent(0.0), 0);
  EXPECT_EQ(mxfp4_scale_exponent(1.0), -2);    // 1 = 4 * 2^-2: max code 6 covers it
  EXPECT_EQ(mxfp4_scale_exponent(7.99), 0);    // floor(log2 7.99) = 2
  EXPECT_EQ(mxfp4_scale_exponent(8.0), 1);
  EXPECT_EQ(mxfp4_scale_exponent(1e-45), -127);  // clamped to the e8m0 range
  EXPECT_EQ(mxfp4_scale_exponent(3e38), 125);
}

TEST(Quant, ToF32EveryDtype) {
  Tensor b(DType::kBF16, {3});
  const float bv[3] = {1.5f, -0.007812f, 3e20f};
  for (int i = 0; i < 3; ++i) b.mutable_as<uint16_t>()[i] = f32_to_bf16(bv[i]);
  Tensor f = to_f32(b);
  ASSERT_EQ(f.dtype(), DType::kF32);
  ASSERT_EQ(f.shape(), (Shape{3}));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(f.as<float>()[i], round_bf16(bv[i]));

  Tensor h(DType::kF16, {2});
  h.mutable_as<uint16_t>()[0] = 0x3c00;  // 1.0
  h.mutable_as<uint16_t>()[1] = 0xc500;  // -5.0
  f = to_f32(h);
  EXPECT_EQ(f.as<float>()[0], 1.0f);
  EXPECT_EQ(f.as<float>()[1], -5.0f);

  Tensor e(DType::kF8E4M3, {256});
  for (int c = 0; c < 256; ++c) e.mutable_as<uint8_t>()[c] = static_cast<uint8_t>(c);
  f = to_f32(e);
  for (int c = 0; c < 256; ++c) {
    double want = ref_e4m3(static_cast<uint8_t>(c));
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(f.as<float>()[c]));
    else EXPECT_EQ(f.as<float>()[c], static_cast<float>(want)) << c;
  }

  Tensor p(DType::kF4E2M1x2, {2, 1});
  p.mutable_as<uint8_t>()[0] = 0x9f;  // low 0xf = -6, high 0x9 = -0.5
  p.mutable_as<uint8_t>()[1] = 0x72;  // low 1.0, high 6
  f = to_f32(p);
  ASSERT_EQ(f.shape(), (Shape{2, 2}));
  EXPECT_EQ(f.as<float>()[0], -6.0f);
  EXPECT_EQ(f.as<float>()[1], -0.5f);
  EXPECT_EQ(f.as<float>()[2], 1.0f);
  EXPECT_EQ(f.as<float>()[3], 6.0f);

  Tensor i64(DType::kI64, {1});
  i64.mutable_as<int64_t>()[0] = -42;
  EXPECT_EQ(to_f32(i64).as<float>()[0], -42.0f);
  EXPECT_TRUE(to_f32(Tensor()).empty());
}

}  // namespace
}  // namespace ml4
