// mla_attention and indexer_scores against naive f64 loops.
//
// Bound: logits are f32 dots of r + dr terms, error d <= gamma_{r+dr} * sum|q c| * scale
// (Higham 3.1). Softmax maps an absolute logit error d to a relative probability error
// of at most ~2d, so out (a convex combination of c rows, |c| <= 1) is off by <= ~3d and
// lse by <= ~2d; asserted with d computed per head from the actual magnitudes.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <cstdio>
#include <tuple>
#include <utility>

#include "core/dtype.h"
#include "model/quant.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/linear.h"
#include "ops_test_util.h"

namespace ml4::cpu {
namespace {

TEST(Attention, MlaMatchesNaive) {
  const int H = 5, r = 64, dr = 16;
  for (int64_t S : {1, 37, 300}) {
    auto ql = test::random_floats(H * r, 1);
    auto qr = test::random_floats(H * dr, 2);
    auto c = test::random_floats(S * r, 3 + S);
    auto kr = test::random_floats(S * dr, 4 + S);
    std::vector<float> scale = {0.1f, 0.3f, 0.5f, 4.0f, 1.0f};  // head 3 sharp: the running max moves
    std::vector<float> out(H * r, -9.0f), lse(H, -9.0f);
    mla_attention(ql.data(), qr.data(), H, r, dr, c.data(), kr.data(), S, scale.data(), out.data(), lse.data());
    for (int h = 0; h < H; ++h) {
      std::vector<double> logit(S);
      double mx = -INFINITY, mag = 0.0;
      for (int64_t s = 0; s < S; ++s) {
        double a = 0.0, m = 0.0;
        for (int i = 0; i < r; ++i) {
          a += double(ql[h * r + i]) * c[s * r + i];
          m += std::fabs(double(ql[h * r + i]) * c[s * r + i]);
        }
        for (int i = 0; i < dr; ++i) {
          a += double(qr[h * dr + i]) * kr[s * dr + i];
          m += std::fabs(double(qr[h * dr + i]) * kr[s * dr + i]);
        }
        logit[s] = a * scale[h];
        mag = std::max(mag, m * scale[h]);
        mx = std::max(mx, logit[s]);
      }
      double sum = 0.0;
      for (double l : logit) sum += std::exp(l - mx);
      const double ref_lse = mx + std::log(sum);
      // d: worst-case logit error (gamma_{r+dr} * sum|q c| * scale), plus exp/softmax ulps.
      const double d = (r + dr + 2) * test::kU * mag + 1e-6;
      EXPECT_NEAR(lse[h], ref_lse, 2 * d + 4 * test::kU * std::fabs(ref_lse)) << "S=" << S << " h=" << h;
      for (int i = 0; i < r; ++i) {
        double o = 0.0;
        for (int64_t s = 0; s < S; ++s) o += std::exp(logit[s] - ref_lse) * c[s * r + i];
        ASSERT_NEAR(out[h * r + i], o, 3 * d + 1e-6) << "S=" << S << " h=" << h << " i=" << i;
      }
    }
  }
}

// The AVX-512 score tiles (4 x 4, cross-register sums), P x C passes and the AVX2 ones give
// the same bits; shapes with 4-head tiles plus a remainder, key counts off the 4-key tiles and
// the 32-row blocks, and r / dr with an 8-step and a scalar tail.
TEST(Attention, MlaSameBitsWithAndWithoutAvx512) {
  for (auto [H, r, dr] : {std::tuple<int, int, int>{5, 64, 16}, {4, 128, 32}, {9, 72, 13}, {1, 24, 3}}) {
    for (int64_t S : {1, 3, 4, 33, 130}) {
      auto ql = test::random_floats(H * r, 11 + S);
      auto qr = test::random_floats(H * dr, 12 + S);
      auto c = test::random_floats(S * r, 13 + S);
      auto kr = test::random_floats(S * dr, 14 + S);
      std::vector<float> scale(H);
      for (int h = 0; h < H; ++h) scale[h] = 0.05f + 0.7f * h;
      std::vector<float> out[2], lse[2];
      for (int avx512 : {0, 1}) {
        linear_allow_avx512(avx512 != 0);
        out[avx512].assign(H * r, -9.0f);
        lse[avx512].assign(H, -9.0f);
        mla_attention(ql.data(), qr.data(), H, r, dr, c.data(), kr.data(), S, scale.data(), out[avx512].data(),
                      lse[avx512].data());
      }
      linear_allow_avx512(true);
      ASSERT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * 4)) << H << " " << r << " " << dr << " S=" << S;
      ASSERT_EQ(0, std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * 4)) << H << " " << r << " " << dr << " S=" << S;
    }
  }
}

// The logit order (attention.cpp, DotSeg) in scalar code: two 8-lane accumulators over the
// 16-steps of segment 0, one 8-step more into the first, the same over segment 1, then
// hsum8(acc0 + acc1) (lanes l + l + 4, then (0 + 2) + (1 + 3)), then each segment's scalar tail.
float logit_order(const float* a0, const float* b0, int n0, const float* a1, const float* b1, int n1) {
  float acc0[8] = {}, acc1[8] = {};
  const float* A[2] = {a0, a1};
  const float* B[2] = {b0, b1};
  const int N[2] = {n0, n1};
  int tail[2];
  for (int g = 0; g < 2; ++g) {
    int i = 0;
    for (; i + 16 <= N[g]; i += 16)
      for (int l = 0; l < 8; ++l) {
        acc0[l] = std::fma(A[g][i + l], B[g][i + l], acc0[l]);
        acc1[l] = std::fma(A[g][i + 8 + l], B[g][i + 8 + l], acc1[l]);
      }
    for (; i + 8 <= N[g]; i += 8)
      for (int l = 0; l < 8; ++l) acc0[l] = std::fma(A[g][i + l], B[g][i + l], acc0[l]);
    tail[g] = i;
  }
  float v[8], h[4];
  for (int l = 0; l < 8; ++l) v[l] = acc0[l] + acc1[l];
  for (int l = 0; l < 4; ++l) h[l] = v[l] + v[l + 4];
  const float even = h[0] + h[2], odd = h[1] + h[3];
  float t = even + odd;
  for (int g = 0; g < 2; ++g)
    for (int k = tail[g]; k < N[g]; ++k) t = std::fma(A[g][k], B[g][k], t);
  return t;
}

// mla_attention's documented operation order for one head, one scalar operation at a time:
// per 32-key block the logits (logit order) times the head scale, the block max in key order
// (NaN skipped, the first of equal values kept), the running max, alpha = exp_softmax(m - m_new),
// p = exp_softmax(logit - m_new), the block sum in f64 in key order, l = l alpha + sum, each
// output element o alpha then an FMA chain over the block's keys; at the end o / l and m + log l.
void mla_head_reference(const float* ql, const float* qr, int r, int dr, const float* c, const float* kr, int64_t S,
                        float scale, float* o, float* lse) {
  const float kNegInf = -INFINITY;
  float m = kNegInf;
  double l = 0.0;
  std::fill(o, o + r, 0.0f);
  float p[32];
  for (int64_t s0 = 0; s0 < S; s0 += 32) {
    const int64_t rows = std::min<int64_t>(32, S - s0);
    float bmax = kNegInf;
    for (int64_t j = 0; j < rows; ++j) {
      p[j] = logit_order(ql, c + (s0 + j) * r, r, qr, kr + (s0 + j) * dr, dr);
      p[j] *= scale;
      bmax = std::max(bmax, p[j]);
    }
    const float m_new = std::max(m, bmax);
    if (m_new == kNegInf) continue;
    const float a = m == kNegInf ? 0.0f : exp_softmax(m - m_new);
    for (int64_t j = 0; j < rows; ++j) p[j] = exp_softmax(p[j] - m_new);
    double bsum = 0.0;
    for (int64_t j = 0; j < rows; ++j) bsum += p[j];
    l = l * a + bsum;
    m = m_new;
    for (int i = 0; i < r; ++i) {
      float acc = o[i] * a;
      for (int64_t j = 0; j < rows; ++j) acc = std::fma(p[j], c[(s0 + j) * r + i], acc);
      o[i] = acc;
    }
  }
  if (l <= 0.0) {
    std::fill(o, o + r, 0.0f);
    *lse = kNegInf;
    return;
  }
  const float inv = static_cast<float>(1.0 / l);
  for (int i = 0; i < r; ++i) o[i] *= inv;
  *lse = static_cast<float>(m + std::log(l));
}

// mla_attention gives mla_head_reference's bits for every head, AVX-512 or AVX2: head counts
// with 4-head tiles and remainders, key counts off the tiles and blocks, r / dr with 8-steps
// and tails; a zero head scale (every logit +-0: the block max is the first zero), a sharp one.
TEST(Attention, MlaSameBitsAsScalarReference) {
  for (auto [H, r, dr] : {std::tuple<int, int, int>{4, 128, 32}, {5, 64, 16}, {9, 72, 13}, {1, 24, 3}, {8, 512, 64}}) {
    for (int64_t S : {1, 7, 32, 33, 100, 256}) {
      auto ql = test::random_floats(H * r, 31 + S);
      auto qr = test::random_floats(H * dr, 32 + S);
      auto c = test::random_floats(S * r, 33 + S);
      auto kr = test::random_floats(S * dr, 34 + S);
      std::vector<float> scale(H);
      for (int h = 0; h < H; ++h) scale[h] = h == 1 ? 0.0f : h == 2 ? 9.0f : 0.05f + 0.3f * h;
      std::vector<float> ref(H * r), ref_lse(H);
      for (int h = 0; h < H; ++h)
        mla_head_reference(ql.data() + h * r, qr.data() + h * dr, r, dr, c.data(), kr.data(), S, scale[h],
                           ref.data() + h * r, ref_lse.data() + h);
      for (int avx512 : {0, 1}) {
        linear_allow_avx512(avx512 != 0);
        std::vector<float> out(H * r, -9.0f), lse(H, -9.0f);
        mla_attention(ql.data(), qr.data(), H, r, dr, c.data(), kr.data(), S, scale.data(), out.data(), lse.data());
        for (int h = 0; h < H; ++h) {
          ASSERT_EQ(std::bit_cast<uint32_t>(lse[h]), std::bit_cast<uint32_t>(ref_lse[h]))
              << H << " " << r << " S=" << S << " h=" << h << " avx512=" << avx512;
          for (int i = 0; i < r; ++i)
            ASSERT_EQ(std::bit_cast<uint32_t>(out[h * r + i]), std::bit_cast<uint32_t>(ref[h * r + i]))
                << H << " " << r << " S=" << S << " h=" << h << " i=" << i << " avx512=" << avx512;
        }
      }
      linear_allow_avx512(true);
    }
  }
}

// mla_attention_heads, as the CPU runner calls it: heads split into groups of every size (one
// call per group), the rope query read from rows of dn + dr floats, the keys a selection
// a selection given block by block as row pointers, some into the kernel's buffers, some into
// the array it picks from (rows()'s blocks are the 32-row softmax blocks) -- bit for bit
// mla_attention over the gathered rows, with AVX-512 or AVX2.
TEST(Attention, MlaHeadsSameBitsAsMlaAttention) {
  // Keys sel[s] of c_all / kr_all copied into the buffers, one block at a time.
  class Gather final : public MlaKeyBlocks {
   public:
    Gather(const std::vector<float>& c, const std::vector<float>& kr, const std::vector<int>& sel, int r, int dr)
        : c_(c), kr_(kr), sel_(sel), r_(r), dr_(dr) {}
    void rows(int64_t s0, int64_t n, float* cb, float* kb, const float** c, const float** kr) const override {
      EXPECT_EQ(s0 % kMlaBlock, 0);
      EXPECT_TRUE(n > 0 && n <= kMlaBlock && s0 + n <= static_cast<int64_t>(sel_.size()));
      for (int64_t j = 0; j < n; ++j) {
        if (j % 2 == 0) {  // even rows copied into the buffers, odd ones read where they are
          std::copy_n(c_.data() + sel_[s0 + j] * r_, r_, cb + j * r_);
          std::copy_n(kr_.data() + sel_[s0 + j] * dr_, dr_, kb + j * dr_);
          c[j] = cb + j * r_, kr[j] = kb + j * dr_;
        } else {
          c[j] = c_.data() + sel_[s0 + j] * r_, kr[j] = kr_.data() + sel_[s0 + j] * dr_;
        }
      }
    }

   private:
    const std::vector<float>&c_, &kr_;
    const std::vector<int>& sel_;
    int r_, dr_;
  };
  for (auto [H, r, dr, dn] : {std::tuple<int, int, int, int>{4, 128, 32, 32}, {5, 64, 16, 8}, {9, 72, 13, 5}, {1, 24, 3, 0}}) {
    for (int64_t S : {0, 1, 31, 32, 33, 130, 256}) {
      const int64_t n = 2 * S + 7;  // the cache the selection picks from
      auto ql = test::random_floats(H * r, 21 + S);
      auto q = test::random_floats(H * (dn + dr), 22 + S);  // [H, dn + dr], rope at dn
      auto c_all = test::random_floats(n * r, 23 + S);
      auto kr_all = test::random_floats(n * dr, 24 + S);
      std::vector<int> sel(S);
      std::mt19937 g(25 + S);
      for (auto& v : sel) v = static_cast<int>(g() % n);
      std::vector<float> c(S * r), kr(S * dr), qr(H * dr);
      for (int64_t s = 0; s < S; ++s) {
        std::copy_n(c_all.data() + sel[s] * r, r, c.data() + s * r);
        std::copy_n(kr_all.data() + sel[s] * dr, dr, kr.data() + s * dr);
      }
      for (int h = 0; h < H; ++h) std::copy_n(q.data() + h * (dn + dr) + dn, dr, qr.data() + h * dr);
      std::vector<float> scale(H);
      for (int h = 0; h < H; ++h) scale[h] = 0.05f + 0.7f * h;
      const Gather keys(c_all, kr_all, sel, r, dr);
      for (int avx512 : {0, 1}) {
        linear_allow_avx512(avx512 != 0);
        std::vector<float> ref(H * r, -9.0f), ref_lse(H, -9.0f);
        mla_attention(ql.data(), qr.data(), H, r, dr, c.data(), kr.data(), S, scale.data(), ref.data(), ref_lse.data());
        for (int hp = 1; hp <= H; ++hp) {
          std::vector<float> out(H * r, -7.0f), lse(H, -7.0f);
          for (int h0 = 0; h0 < H; h0 += hp) {
            const int nh = std::min(hp, H - h0);
            mla_attention_heads(ql.data() + h0 * r, q.data() + h0 * (dn + dr) + dn, dn + dr, nh, r, dr, S, keys,
                                scale.data() + h0, out.data() + h0 * r, lse.data() + h0);
          }
          ASSERT_EQ(0, std::memcmp(out.data(), ref.data(), out.size() * 4)) << H << " " << r << " S=" << S << " hp=" << hp;
          ASSERT_EQ(0, std::memcmp(lse.data(), ref_lse.data(), lse.size() * 4)) << H << " " << r << " S=" << S << " hp=" << hp;
        }
      }
      linear_allow_avx512(true);
    }
  }
}

// exp_softmax against exp in f64 over the softmax's range (x <= 0): within 1.01 ulp (1.5
// asserted) down to -87.3, 0 below FLT_MIN's exponent, -inf -> 0, NaN -> NaN, exp(0) = 1;
// exp_shifted equal to the scalar function bit for bit at every array length and offset.
TEST(Attention, SoftmaxExp) {
  std::mt19937 g(5);
  std::uniform_real_distribution<float> u(-90.0f, 0.0f);
  double worst = 0.0;
  for (int i = 0; i < 200000; ++i) {
    const float x = i < 1000 ? -i * 1e-3f : u(g);
    const float e = exp_softmax(x);
    const double ref = std::exp(static_cast<double>(x));
    if (ref < 1.1754944e-38) {
      ASSERT_LE(e, 1.2e-38f) << x;
      continue;
    }
    const float rf = static_cast<float>(ref);
    worst = std::max(worst, std::fabs(e - ref) / (std::nextafter(rf, INFINITY) - rf));
  }
  EXPECT_LT(worst, 1.5);
  EXPECT_EQ(exp_softmax(0.0f), 1.0f);
  EXPECT_EQ(exp_softmax(-INFINITY), 0.0f);
  EXPECT_EQ(exp_softmax(-100.0f), 0.0f);
  EXPECT_TRUE(std::isnan(exp_softmax(NAN)));
  for (int n : {1, 7, 8, 9, 31, 32, 33}) {
    std::vector<float> p(n);
    for (auto& v : p) v = u(g) + 3.0f;
    p[n / 2] = NAN;
    std::vector<float> q = p;
    exp_shifted(q.data(), n, 3.0f);
    for (int j = 0; j < n; ++j) {
      const float want = exp_softmax(p[j] - 3.0f);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(q[j])) << n << " " << j;
      } else {
        EXPECT_EQ(std::bit_cast<uint32_t>(q[j]), std::bit_cast<uint32_t>(want)) << n << " " << j;
      }
    }
  }
  std::printf("exp_softmax: worst %.3f ulp over 200k points in [-87.3, 0]\n", worst);
}

TEST(Attention, MlaEmpty) {
  const int H = 2, r = 8, dr = 4;
  auto q = test::random_floats(H * r, 1);
  std::vector<float> scale(H, 1.0f), out(H * r, 5.0f), lse(H, 5.0f);
  mla_attention(q.data(), q.data(), H, r, dr, nullptr, nullptr, 0, scale.data(), out.data(), lse.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
  for (float v : lse) EXPECT_EQ(v, -INFINITY);
}

// mla_absorb_q / mla_apply_uv against f64 loops, T = 1 (decode: heads spread over
// threads) and T = 3, r with and without a vector tail, wkv_b in f32. Each output is a sum of
// dn (or r) f32 products: |error| <= (n + 1) u sum |terms| (Higham 3.1, any order).
// T >= 4 runs the token-tiled paths (r, dv multiples of 16): against f64, and bit for bit
// against the same tokens one at a time (the decode path). Then wkv_b stored as bf16 and FP8
// (decoded per job) gives the bits of its f32 decoding stored as f32 (read in place).
LinearWeight f32_weight(const std::vector<float>& v, int64_t N, int64_t K) {
  LinearWeight w;
  w.name = "wkv_b";
  w.format = LinearFormat::kF32;
  w.out_features = N;
  w.in_features = K;
  w.weight = Tensor(DType::kF32, {N, K});
  std::copy(v.begin(), v.end(), w.weight.mutable_as<float>());
  return w;
}

TEST(Attention, MlaAbsorbAndApplyUv) {
  for (int r : {64, 37, 200, 256})
    for (int dv : {20, 32})
    for (int64_t T : {1, 3, 9, 70}) {
      if (T == 70 && r < 200) continue;
      SCOPED_TRACE(testing::Message() << "r=" << r << " dv=" << dv << " T=" << T);
      const int H = 6, dn = 24, dr = 8, qk = dn + dr;
      const auto wv = test::random_floats(H * (dn + dv) * r, 11 + r + dv);
      const LinearWeight wkv_b = f32_weight(wv, H * (dn + dv), r);
      auto wuk = [&](int h, int d, int j) { return wv[(h * (dn + dv) + d) * r + j]; };
      auto wuv = [&](int h, int d, int j) { return wv[(h * (dn + dv) + dn + d) * r + j]; };
      auto q = test::random_floats(T * H * qk, 13 + T);
      auto ol = test::random_floats(T * H * r, 14 + T);
      std::vector<float> ql(T * H * r, -9.0f), o(T * H * dv, -9.0f);
      mla_absorb_q(wkv_b, q.data(), T, H, dn, dv, qk, r, ql.data());
      mla_apply_uv(wkv_b, ol.data(), T, H, dn, dv, r, o.data());
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
          for (int j = 0; j < r; ++j) {
            double ref = 0.0, mag = 0.0;
            for (int d = 0; d < dn; ++d) {
              const double term = double(q[(t * H + h) * qk + d]) * wuk(h, d, j);
              ref += term;
              mag += std::fabs(term);
            }
            ASSERT_LE(std::fabs(ql[(t * H + h) * r + j] - ref), (dn + 1) * test::kU * mag + 1e-30)
                << "absorb t=" << t << " h=" << h << " j=" << j;
          }
          for (int d = 0; d < dv; ++d) {
            double ref = 0.0, mag = 0.0;
            for (int j = 0; j < r; ++j) {
              const double term = double(wuv(h, d, j)) * ol[(t * H + h) * r + j];
              ref += term;
              mag += std::fabs(term);
            }
            ASSERT_LE(std::fabs(o[(t * H + h) * dv + d] - ref), (r + 1) * test::kU * mag + 1e-30)
                << "apply t=" << t << " h=" << h << " d=" << d;
          }
        }
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> ql1(H * r), o1(H * dv);
        mla_absorb_q(wkv_b, q.data() + t * H * qk, 1, H, dn, dv, qk, r, ql1.data());
        mla_apply_uv(wkv_b, ol.data() + t * H * r, 1, H, dn, dv, r, o1.data());
        for (int i = 0; i < H * r; ++i) ASSERT_EQ(f32_to_bits(ql1[i]), f32_to_bits(ql[t * H * r + i])) << "t=" << t;
        for (int i = 0; i < H * dv; ++i) ASSERT_EQ(f32_to_bits(o1[i]), f32_to_bits(o[t * H * dv + i])) << "t=" << t;
      }
      for (LinearFormat f : {LinearFormat::kBF16, LinearFormat::kFP8Block}) {
        SCOPED_TRACE(linear_format_name(f));
        auto stored = quantize_linear(wv.data(), H * (dn + dv), r, f, "wkv_b");
        ASSERT_TRUE(stored.ok()) << stored.status().message();
        const LinearWeight as_f32 = f32_weight(dequantize_linear(*stored), H * (dn + dv), r);
        std::vector<float> a(T * H * r), b(T * H * r), c(T * H * dv), d(T * H * dv);
        mla_absorb_q(*stored, q.data(), T, H, dn, dv, qk, r, a.data());
        mla_absorb_q(as_f32, q.data(), T, H, dn, dv, qk, r, b.data());
        mla_apply_uv(*stored, ol.data(), T, H, dn, dv, r, c.data());
        mla_apply_uv(as_f32, ol.data(), T, H, dn, dv, r, d.data());
        for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(f32_to_bits(a[i]), f32_to_bits(b[i])) << i;
        for (size_t i = 0; i < c.size(); ++i) ASSERT_EQ(f32_to_bits(c[i]), f32_to_bits(d[i])) << i;
        // The decode kernels (AVX-512, on the kernel-ordered copy: W_UK chunked, W_UV
        // transposed) and, with AVX-512 off, the decoding paths: the same bits again.
        const AbsorbLayout lay = layout_absorb(*stored, H, dn, dv);
        if (linear_uses_avx512()) {
          EXPECT_EQ(lay.empty(), dv % 16 != 0 || r % 128 != 0);
        }
        for (bool avx512 : {true, false}) {
          linear_allow_avx512(avx512);
          std::vector<float> c2(T * H * dv, -9.0f);
          std::fill(a.begin(), a.end(), -9.0f);  // a path that wrote nothing must fail
          mla_absorb_q(*stored, q.data(), T, H, dn, dv, qk, r, a.data(), &lay);
          mla_apply_uv(*stored, ol.data(), T, H, dn, dv, r, c2.data(), &lay);
          for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(f32_to_bits(a[i]), f32_to_bits(b[i])) << i;
          for (size_t i = 0; i < c2.size(); ++i) ASSERT_EQ(f32_to_bits(c2[i]), f32_to_bits(d[i])) << i;
        }
        linear_allow_avx512(true);
      }
    }
}

// The decode kernels (AVX-512, T < 4) at every register count: dv of 1, 8 and 9 registers (two
// parts), dn up to a head's 128, r = 512 (4 chunks), bf16 and FP8: the bits of the f32 path.
TEST(Attention, MlaAbsorbDecodeKernelsEveryWidth) {
  if (!linear_uses_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU: the decode kernels do not run";
  const int H = 3, r = 512;
  for (LinearFormat f : {LinearFormat::kBF16, LinearFormat::kFP8Block})
    for (int dn : {24, 128})
      for (int dv : {16, 128, 144})
        for (int64_t T : {1, 3}) {
          SCOPED_TRACE(testing::Message() << linear_format_name(f) << " dn=" << dn << " dv=" << dv << " T=" << T);
          const int qk = dn + 8;
          const auto wv = test::random_floats(H * (dn + dv) * r, 31 + dn + dv);
          auto stored = quantize_linear(wv.data(), H * (dn + dv), r, f, "wkv_b");
          ASSERT_TRUE(stored.ok());
          const LinearWeight as_f32 = f32_weight(dequantize_linear(*stored), H * (dn + dv), r);
          const AbsorbLayout lay = layout_absorb(*stored, H, dn, dv);
          ASSERT_FALSE(lay.empty());
          auto q = test::random_floats(T * H * qk, 32), ol = test::random_floats(T * H * r, 33);
          std::vector<float> a(T * H * r, -9.0f), b(T * H * r), c(T * H * dv, -9.0f), d(T * H * dv);
          mla_absorb_q(*stored, q.data(), T, H, dn, dv, qk, r, a.data(), &lay);
          mla_absorb_q(as_f32, q.data(), T, H, dn, dv, qk, r, b.data());
          mla_apply_uv(*stored, ol.data(), T, H, dn, dv, r, c.data(), &lay);
          mla_apply_uv(as_f32, ol.data(), T, H, dn, dv, r, d.data());
          for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(f32_to_bits(a[i]), f32_to_bits(b[i])) << i;
          for (size_t i = 0; i < c.size(); ++i) ASSERT_EQ(f32_to_bits(c[i]), f32_to_bits(d[i])) << i;
        }
}

// An FP8 scale so large that s * 256 overflows (finite s): every path still gives v * s rounded
// once, as dequantize_linear does (the 2^8 trick is skipped there).
TEST(Attention, MlaAbsorbHugeFp8Scale) {
  const int H = 1, dn = 16, dv = 16, r = 128, qk = dn;
  LinearWeight w;
  w.name = "wkv_b";
  w.format = LinearFormat::kFP8Block;
  w.out_features = H * (dn + dv);
  w.in_features = r;
  w.weight = Tensor(DType::kF8E4M3, {w.out_features, r});
  w.scale = Tensor(DType::kF32, {1, 1});
  w.scale.mutable_as<float>()[0] = 2e36f;
  uint8_t* q8 = w.weight.mutable_as<uint8_t>();
  for (int64_t i = 0; i < w.out_features * r; ++i) q8[i] = (i % 3 == 0) ? 0x00 : (i % 3 == 1 ? 0x38 : 0xb0);
  const LinearWeight as_f32 = f32_weight(dequantize_linear(w), w.out_features, r);
  const AbsorbLayout lay = layout_absorb(w, H, dn, dv);
  EXPECT_TRUE(lay.empty());  // the decode kernels refuse it
  auto q = test::random_floats(H * qk, 41, -1e-3f, 1e-3f), ol = test::random_floats(H * r, 42, -1e-3f, 1e-3f);
  std::vector<float> a(H * r), b(H * r), c(H * dv), d(H * dv);
  for (int64_t T : {1, 5}) {
    std::vector<float> qT, olT;
    for (int64_t t = 0; t < T; ++t) {
      qT.insert(qT.end(), q.begin(), q.end());
      olT.insert(olT.end(), ol.begin(), ol.end());
    }
    a.assign(T * H * r, -9.0f), b.assign(T * H * r, 0.0f), c.assign(T * H * dv, -9.0f), d.assign(T * H * dv, 0.0f);
    mla_absorb_q(w, qT.data(), T, H, dn, dv, qk, r, a.data(), &lay);
    mla_absorb_q(as_f32, qT.data(), T, H, dn, dv, qk, r, b.data());
    mla_apply_uv(w, olT.data(), T, H, dn, dv, r, c.data(), &lay);
    mla_apply_uv(as_f32, olT.data(), T, H, dn, dv, r, d.data());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(std::isfinite(a[i])) << i;
      ASSERT_EQ(f32_to_bits(a[i]), f32_to_bits(b[i])) << i;
    }
    for (size_t i = 0; i < c.size(); ++i) ASSERT_EQ(f32_to_bits(c[i]), f32_to_bits(d[i])) << i;
  }
}

// A NaN code in an FP8 wkv_b: NaN in exactly the outputs that read it, on the decode kernels
// (which fall back) as on the decoding path.
TEST(Attention, MlaAbsorbFp8NanCode) {
  const int H = 3, dn = 16, dv = 32, r = 256, qk = dn;
  const auto wv = test::random_floats(H * (dn + dv) * r, 21);
  auto stored = quantize_linear(wv.data(), H * (dn + dv), r, LinearFormat::kFP8Block, "wkv_b");
  ASSERT_TRUE(stored.ok());
  uint8_t* q8 = stored->weight.mutable_as<uint8_t>();
  q8[(1 * (dn + dv) + 3) * r + 130] = 0x7f;       // head 1's W_UK row 3, column 130
  q8[(2 * (dn + dv) + dn + 5) * r + 7] = 0xff;    // head 2's W_UV row 5, column 7
  const AbsorbLayout fp8 = layout_absorb(*stored, H, dn, dv);
  if (linear_uses_avx512()) {
    EXPECT_FALSE(fp8.empty());
  }
  auto q = test::random_floats(H * qk, 22), ol = test::random_floats(H * r, 23);
  for (bool avx512 : {true, false}) {
    linear_allow_avx512(avx512);
    std::vector<float> ql(H * r), o(H * dv);
    mla_absorb_q(*stored, q.data(), 1, H, dn, dv, qk, r, ql.data(), &fp8);
    mla_apply_uv(*stored, ol.data(), 1, H, dn, dv, r, o.data(), &fp8);
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < r; ++j) EXPECT_EQ(std::isnan(ql[h * r + j]), h == 1 && j == 130) << h << " " << j;
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < dv; ++d) EXPECT_EQ(std::isnan(o[h * dv + d]), h == 2 && d == 5) << h << " " << d;
  }
  linear_allow_avx512(true);
}

// A wkv_b that is not H heads of (dn + dv) rows x r gives NaN, not a read out of bounds.
TEST(Attention, MlaAbsorbWrongShapeIsNan) {
  const int H = 2, dn = 8, dv = 8, r = 16;
  const LinearWeight w = f32_weight(test::random_floats((H * (dn + dv) - 1) * r, 3), H * (dn + dv) - 1, r);
  auto q = test::random_floats(H * dn, 4), ol = test::random_floats(H * r, 5);
  std::vector<float> ql(H * r, 0.0f), o(H * dv, 0.0f);
  mla_absorb_q(w, q.data(), 1, H, dn, dv, dn, r, ql.data());
  mla_apply_uv(w, ol.data(), 1, H, dn, dv, r, o.data());
  for (float v : ql) EXPECT_TRUE(std::isnan(v));
  for (float v : o) EXPECT_TRUE(std::isnan(v));
}

TEST(Attention, IndexerScores) {
  const int HI = 8, dI = 128;
  const int64_t S = 200;
  auto q = test::random_floats(HI * dI, 5);
  auto w = test::random_floats(HI, 6);
  auto k = test::random_floats(S * dI, 7);
  std::vector<float> scores(S);
  indexer_scores(q.data(), w.data(), HI, dI, k.data(), S, scores.data());
  for (int64_t s = 0; s < S; ++s) {
    double ref = 0.0, mag = 0.0;
    for (int h = 0; h < HI; ++h) {
      double d = 0.0, m = 0.0;
      for (int i = 0; i < dI; ++i) {
        d += double(q[h * dI + i]) * k[s * dI + i];
        m += std::fabs(double(q[h * dI + i]) * k[s * dI + i]);
      }
      ref += w[h] * std::max(0.0, d);
      mag += std::fabs(w[h]) * m;
    }
    // gamma_{dI + HI} * sum |w q k|: relu is 1-Lipschitz.
    ASSERT_NEAR(scores[s], ref, (dI + HI + 2) * test::kU * mag) << s;
  }
}


// indexer_scores_rows: T tokens over a key range, each score bit for bit indexer_scores' for the
// token (AVX-512 tiles or AVX2), only [s0, min(s1, visible[t])) written; head counts with and without a remainder of
// 4, dI with and without the 8-step and the scalar tail; zero rows (dots of exactly +-0) and a NaN.
TEST(Attention, IndexerScoresRowsSameBitsAsIndexerScores) {
  for (int HI : {4, 8, 5, 3, 1}) {
    for (int dI : {128, 64, 136, 100}) {
      const int64_t T = 9, S = 77;
      auto q = test::random_floats(T * HI * dI, 11 + HI + dI);
      auto w = test::random_floats(T * HI, 12 + HI);
      auto k = test::random_floats(S * dI, 13 + dI);
      for (int i = 0; i < dI; ++i) k[5 * dI + i] = 0.0f, k[6 * dI + i] = -0.0f;
      for (int i = 0; i < dI; ++i) q[(2 * HI) * dI + i] = 0.0f;  // token 2, head 0
      k[9 * dI + 3] = NAN;
      w[HI + 1 < T * HI ? HI + 1 : 0] = -0.0f;
      const int64_t visible[T] = {1, 77, 76, 8, 9, 16, 17, 70, 0};
      for (auto [s0, s1, avx512] : {std::tuple<int64_t, int64_t, bool>{0, S, true}, {0, S, false}, {3, 40, true},
                                    {8, 24, false}, {70, 77, true}, {17, 61, false}}) {
        std::vector<float> got(T * S, 1234.5f);
        linear_allow_avx512(avx512);
        indexer_scores_rows(q.data(), w.data(), T, HI, dI, k.data(), s0, s1, visible, got.data(), S);
        linear_allow_avx512(true);
        for (int64_t t = 0; t < T; ++t) {
          std::vector<float> ref(S);
          indexer_scores(q.data() + t * HI * dI, w.data() + t * HI, HI, dI, k.data(), S, ref.data());
          for (int64_t s = 0; s < S; ++s) {
            const bool in = s >= s0 && s < std::min(s1, visible[t]);
            if (in) {
              ASSERT_EQ(std::bit_cast<uint32_t>(got[t * S + s]), std::bit_cast<uint32_t>(ref[s]))
                  << HI << " " << dI << " " << t << " " << s;
            } else {
              ASSERT_EQ(got[t * S + s], 1234.5f) << HI << " " << dI << " " << t << " " << s;
            }
          }
        }
      }
    }
  }
}

// Decode context parallelism's combine (SYSTEM.md S8): the keys split over N ranks (token i on
// rank (i / I) % N), each rank's partial (out, lse) from mla_attention over its share, merged
// by merge_attention_parts (the all-to-all combine) and by rescale_attention_part + a sum (the
// all-gather + reduce-scatter combine), against mla_attention over all keys. Shares with no key
// (more ranks than keys) give out 0, lse -inf, and weigh 0. Bound: both sides are f32
// mla_attention over the same keys in another grouping, each within this file's bound of the
// exact value (logit error d <= gamma_{r+dr} sum|q c| scale, ~2.4e-6 x the logits' magnitude
// here; out off by <= 3d); the merge adds one exp and an N-term weighted sum per element, a few
// ulps. 1e-5 relative sits under that worst case and 15x over the measured 6.6e-7; a wrong
// weight (a missing renormalisation, a swapped part) costs 1e-1.
TEST(Attention, ContextParallelMergesEqualOneRank) {
  const int H = 3, r = 32, dr = 8;
  double worst = 0.0;
  for (int N : {2, 4, 8})
    for (int I : {1, 4})
      for (int64_t S : {3, 40, 333}) {
        auto ql = test::random_floats(H * r, 10 + N);
        auto qr = test::random_floats(H * dr, 20 + N);
        auto c = test::random_floats(S * r, 30 + S);
        auto kr = test::random_floats(S * dr, 40 + S);
        std::vector<float> scale = {0.2f, 1.0f, 3.0f};
        std::vector<float> ref(H * r), ref_lse(H);
        mla_attention(ql.data(), qr.data(), H, r, dr, c.data(), kr.data(), S, scale.data(), ref.data(), ref_lse.data());
        // parts [N][out H r | lse H], one per rank.
        const int64_t stride = H * (r + 1);
        std::vector<float> parts(N * stride);
        for (int p = 0; p < N; ++p) {
          std::vector<float> cs, ks;
          for (int64_t i = 0; i < S; ++i) {
            if ((i / I) % N != p) continue;
            cs.insert(cs.end(), c.begin() + i * r, c.begin() + (i + 1) * r);
            ks.insert(ks.end(), kr.begin() + i * dr, kr.begin() + (i + 1) * dr);
          }
          mla_attention(ql.data(), qr.data(), H, r, dr, cs.data(), ks.data(), static_cast<int64_t>(cs.size() / r),
                        scale.data(), parts.data() + p * stride, parts.data() + p * stride + H * r);
        }
        std::vector<float> a2a(H * r);
        merge_attention_parts(parts.data(), N, stride, H, r, a2a.data());
        // ag_rs: every part rescaled against all lse, then summed.
        std::vector<float> lse_all(N * H), ag(H * r, 0.0f);
        for (int p = 0; p < N; ++p) std::copy_n(parts.data() + p * stride + H * r, H, lse_all.data() + p * H);
        for (int p = 0; p < N; ++p) {
          std::vector<float> mine(parts.begin() + p * stride, parts.begin() + p * stride + H * r);
          rescale_attention_part(mine.data(), parts.data() + p * stride + H * r, lse_all.data(), N, H, r);
          for (int64_t k = 0; k < H * r; ++k) ag[k] += mine[k];
        }
        const std::vector<double> refd(ref.begin(), ref.end());
        const double ea = test::rel_l2(a2a.data(), refd.data(), refd.size());
        const double eg = test::rel_l2(ag.data(), refd.data(), refd.size());
        worst = std::max({worst, ea, eg});
        EXPECT_LT(ea, 1e-5) << "a2a N " << N << " I " << I << " S " << S;
        EXPECT_LT(eg, 1e-5) << "ag_rs N " << N << " I " << I << " S " << S;
      }
  std::printf("DCP combines against one rank: worst rel L2 %.2e (bound 1e-5)\n", worst);
}

}  // namespace
}  // namespace ml4::cpu
