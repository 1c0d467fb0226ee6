// mla_attention and indexer_scores against naive f64 loops.
//
// Bound: logits are f32 dots of r + dr terms, error d <= gamma_{r+dr} * sum|q c| * scale
// (Higham 3.1). Softmax maps an absolute logit error d to a relative probability error
// of at most ~2d, so out (a convex combination of c rows, |c| <= 1) is off by <= ~3d and
// lse by <= ~2d; asserted with d computed per head from the actual magnitudes.
#include <gtest/gtest.h>

#include "ops/cpu/attention.h"
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

TEST(Attention, MlaEmpty) {
  const int H = 2, r = 8, dr = 4;
  auto q = test::random_floats(H * r, 1);
  std::vector<float> scale(H, 1.0f), out(H * r, 5.0f), lse(H, 5.0f);
  mla_attention(q.data(), q.data(), H, r, dr, nullptr, nullptr, 0, scale.data(), out.data(), lse.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
  for (float v : lse) EXPECT_EQ(v, -INFINITY);
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

}  // namespace
}  // namespace ml4::cpu
