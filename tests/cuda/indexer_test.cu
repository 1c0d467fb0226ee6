// GPU indexer scores against an f64 reference built from the CPU codecs (dequantized q via
// ml4::cpu::dequantize_fp8_groups, keys via ml4::decode_indexer_key), for decode tokens and
// a prefill chunk over paged caches with shuffled block tables; then indexer + GPU top-k
// against ml4::cpu::indexer_scores + ml4::cpu::topk (sets equal apart from near-ties).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/dtype.h"
#include "cuda_test_util.h"
#include "kv/indexer_layout.h"
#include "kv/kv_cache_dtype.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/quant.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/indexer.h"
#include "ops/cuda/topk.h"

namespace ml4::cuda {
namespace {

using testing::poisoned;
using testing::to_device;
using testing::to_host;

void scores_and_topk(std::initializer_list<IndexerMath> maths) {
  std::mt19937 rng(77);
  const int dI = 128;
  // Bounds: kF32 sums exact e4m3 products in f32 (~sqrt(192) * 2^-24 ~ 1e-6 relative): 1e-5.
  // kFp8TensorCore: Hopper's FP8 mma accumulates with fewer mantissa bits than f32 (DeepSeek-V3
  // report 3.3.2 measured ~14 bits: 2^-14 ~ 6e-5 per add, averaging over 128-term dots): 1e-3.
  // kFp8Wgmma (the wgmma kernel at HI 64 and 32; HI 4 takes the mma.sync kernel): the same FP8
  // products and bound, summed in another order.
  // For the FP8 maths the error is taken against the magnitudes the accumulator adds, not the
  // result: row norm of mag[s] = sum_h |w_h| sum_i |q_hi k_si|. What the MMA drops scales with
  // those (bits cut below the largest partial sum), and a score that is a near-cancellation of
  // its heads' terms (rows of 1-2 keys at HI 32 on the first device run: 2e-3 and 7e-3 of
  // |score| with the wgmma kernel) is then not held to a tighter bound than its terms allow.
  // A missing or misplaced head, key or page is ~1/HI of mag or more: far past 1e-3.
  for (IndexerMath math : maths)
    for (int HI : {64, 32, 4}) {
      const double bound = math == IndexerMath::kF32 ? 1e-5 : 1e-3;
      const char* mname = math == IndexerMath::kF32 ? "f32" : math == IndexerMath::kFp8TensorCore ? "fp8-tc" : "fp8-wgmma";
      // Three sequences; tokens: a decode token of each, plus a prefill chunk of sequence 0.
      const std::vector<int32_t> ctx = {3000, 130, 64 * 5 + 3};
      const int64_t S = static_cast<int64_t>(ctx.size());
      const int64_t max_pages = 64;
      int64_t total_pages = 0;
      for (int32_t c : ctx) total_pages += (c + kPageTokens - 1) / kPageTokens;
      std::vector<int32_t> perm(total_pages);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<int32_t> bt(S * max_pages, -1);
      const size_t pb = indexer_page_bytes(dI);
      std::vector<uint8_t> cache(total_pages * pb, 0);
      std::vector<std::vector<float>> keys(S);  // dequantized, [ctx, dI]
      std::normal_distribution<float> nd(0.0f, 1.0f);
      int64_t next = 0;
      for (int64_t s = 0; s < S; ++s) {
        const int np = (ctx[s] + kPageTokens - 1) / kPageTokens;
        for (int i = 0; i < np; ++i) bt[s * max_pages + i] = perm[next++];
        keys[s].resize(static_cast<size_t>(ctx[s]) * dI);
        std::vector<float> k(dI);
        for (int j = 0; j < ctx[s]; ++j) {
          for (auto& v : k) v = nd(rng);
          uint8_t* page = cache.data() + bt[s * max_pages + j / kPageTokens] * pb;
          encode_indexer_key(k.data(), dI, page, j % kPageTokens);
          decode_indexer_key(page, j % kPageTokens, dI, keys[s].data() + static_cast<size_t>(j) * dI);
        }
      }
      std::vector<int32_t> seq_of, lengths;
      for (int64_t s = 0; s < S; ++s) {
        seq_of.push_back(static_cast<int32_t>(s));
        lengths.push_back(ctx[s]);
      }
      for (int32_t p : {0, 1, 63, 64, 1000, 2047, 2048, 2500, 2999}) {
        seq_of.push_back(0);
        lengths.push_back(p + 1);
      }
      const int64_t T = static_cast<int64_t>(seq_of.size());
      const int max_len = *std::max_element(lengths.begin(), lengths.end());
      const int64_t stride = max_len + 64;  // padding past max_len must stay untouched
      std::vector<float> qf(T * HI * dI), qdeq(T * HI * dI), qscale(T * HI), w(T * HI);
      std::vector<uint8_t> q8(T * HI * dI);
      std::uniform_real_distribution<float> uw(-1.0f, 1.0f);
      for (auto& v : qf) v = nd(rng);
      for (auto& v : w) v = uw(rng) / std::sqrt(static_cast<float>(HI * dI));
      for (int64_t row = 0; row < T * HI; ++row) {
        cpu::quantize_fp8_groups(qf.data() + row * dI, dI, 128, q8.data() + row * dI, qscale.data() + row);
        cpu::dequantize_fp8_groups(q8.data() + row * dI, qscale.data() + row, dI, 128, qdeq.data() + row * dI);
      }

      auto d_q = to_device(q8);
      auto d_qs = to_device(qscale);
      // The kernel gets 4 w and weight_scale 1/4 (the runner's 1/sqrt(HI dI) fold): exact in f32.
      std::vector<float> w4(w);
      for (auto& v : w4) v *= 4.0f;
      auto d_w = to_device(w4);
      auto d_cache = to_device(cache);
      auto d_bt = to_device(bt);
      auto d_seq = to_device(seq_of);
      auto d_len = to_device(lengths);
      std::vector<std::vector<float>> runs;
      // Runs 0 and 1 one token a block, run 2 (FP8 tensor cores) four tokens a block sharing
      // their keys (tokens_per_block; the groups here mix sequences 0-2 and 0, then hold only
      // sequence 0), runs 3 and 4 one and three key pages a block (pages_per_block; the
      // kernel's own choice elsewhere): the same bits as run 0.
      const int nruns = math == IndexerMath::kFp8TensorCore ? 5 : 2;
      for (int rep = 0; rep < nruns; ++rep) {
        auto d_scores = poisoned<float>(T * stride);
        IndexerScoresParams p;
        p.q = d_q.data();
        p.q_scale = d_qs.as<float>();
        p.weights = d_w.as<float>();
        p.weight_scale = 0.25f;
        p.cache = d_cache.data();
        p.num_blocks = total_pages;
        p.block_table = d_bt.as<int32_t>();
        p.block_table_stride = max_pages;
        p.seq_of_token = d_seq.as<int32_t>();
        p.lengths = d_len.as<int32_t>();
        p.T = T;
        p.HI = HI;
        p.max_length = max_len;
        p.scores = d_scores.as<float>();
        p.scores_stride = stride;
        p.math = math;
        p.tokens_per_block = rep == 2 ? 4 : 1;
        p.pages_per_block = rep == 3 ? 1 : rep == 4 ? 3 : 0;  // 0: the kernel's choice
        ML4_ASSERT_OK(indexer_scores(p));
        ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
        runs.push_back(to_host<float>(d_scores, T * stride));
      }
      EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4)) << "repeat run differs";
      for (int rep = 2; rep < nruns; ++rep)
        EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[rep].data(), runs[0].size() * 4))
            << (rep == 2 ? "4 tokens a block differ from 1" : rep == 3 ? "1 page a block differs" : "3 pages a block differ")
            << " (HI " << HI << ")";
      const auto& got = runs[0];

      // f64 reference; CPU f32 reference for the top-k comparison.
      double worst = 0, worst_mag = 0;
      for (int64_t t = 0; t < T; ++t) {
        const int n = lengths[t];
        const float* kk = keys[seq_of[t]].data();
        std::vector<double> ref(n), mag(n);
        std::vector<float> out(got.begin() + t * stride, got.begin() + t * stride + n);
        for (int s = 0; s < n; ++s) {
          double acc = 0, m = 0;
          for (int h = 0; h < HI; ++h) {
            double d = 0, a = 0;
            for (int i = 0; i < dI; ++i) {
              const double prod = static_cast<double>(qdeq[(t * HI + h) * dI + i]) * kk[s * dI + i];
              d += prod;
              a += std::fabs(prod);
            }
            acc += w[t * HI + h] * std::max(0.0, d);
            m += std::fabs(w[t * HI + h]) * a;
          }
          ref[s] = acc;
          mag[s] = m;
        }
        for (int64_t i = n; i < stride; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &got[t * stride + i], 4);
          ASSERT_EQ(bits, 0xFFFFFFFFu) << "written past the length: row " << t << " col " << i;
        }
        ASSERT_TRUE(testing::all_finite(out)) << "row " << t;
        const double e = testing::rel_err(out, ref);
        double num = 0, den = 0;
        for (int s = 0; s < n; ++s) {
          num += (out[s] - ref[s]) * (out[s] - ref[s]);
          den += mag[s] * mag[s];
        }
        const double em = std::sqrt(num / den);
        worst = std::max(worst, e);
        worst_mag = std::max(worst_mag, em);
        EXPECT_LT(math == IndexerMath::kF32 ? e : em, bound) << mname << " row " << t << " (of |score|: " << e << ")";
      }
      std::printf("indexer %s HI=%d: worst row ||gpu - f64|| / ||f64|| = %.3g, / ||mag|| = %.3g (bound %.0e on %s)\n",
                  mname, HI, worst, worst_mag, bound, math == IndexerMath::kF32 ? "the first" : "the second");

      // GPU top-k on the GPU scores.
      const int k = 256;
      auto d_scores = to_device(got);
      auto d_pos = poisoned<int32_t>(T * k);
      TopkParams tp;
      tp.scores = d_scores.as<float>();
      tp.scores_stride = stride;
      tp.lengths = d_len.as<int32_t>();
      tp.T = T;
      tp.k = k;
      tp.positions = d_pos.as<int32_t>();
      ML4_ASSERT_OK(topk(tp));
      ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
      const auto pos = to_host<int32_t>(d_pos, T * k);
      int64_t swapped = 0;
      for (int64_t t = 0; t < T; ++t) {
        const int n = lengths[t];
        const float* kk = keys[seq_of[t]].data();
        std::vector<float> cref(n);
        cpu::indexer_scores(qdeq.data() + t * HI * dI, w.data() + t * HI, HI, dI, kk, n, cref.data());
        std::vector<int32_t> want(k);
        cpu::topk(cref.data(), n, k, want.data());
        const int kk_n = std::min(k, n);
        std::set<int32_t> a(want.begin(), want.begin() + kk_n), b(pos.begin() + t * k, pos.begin() + t * k + kk_n);
        for (int i = kk_n; i < k; ++i) EXPECT_EQ(pos[t * k + i], -1);
        ASSERT_EQ(b.size(), static_cast<size_t>(kk_n)) << "duplicate or missing positions, row " << t;
        if (kk_n == 0) continue;
        // Sets may differ only by elements whose reference score ties the k-th score to within
        // the scores' rounding (`bound` of the row's largest magnitude).
        float amax = 0;
        for (float v : cref) amax = std::max(amax, std::fabs(v));
        const float kth = cref[want[kk_n - 1]];
        for (int32_t x : a)
          if (!b.count(x)) {
            ++swapped;
            EXPECT_NEAR(cref[x], kth, bound * amax) << mname << " row " << t << " lost position " << x;
          }
        for (int32_t x : b)
          if (!a.count(x)) EXPECT_NEAR(cref[x], kth, bound * amax) << mname << " row " << t << " gained position " << x;
      }
      std::printf("indexer+topk %s HI=%d: %lld near-tie swaps vs cpu::indexer_scores + cpu::topk\n", mname, HI,
                  static_cast<long long>(swapped));
    }
}

TEST(CudaIndexer, ScoresAndTopkMatchCpu) {
  ML4_REQUIRE_GPU();
  scores_and_topk({IndexerMath::kF32, IndexerMath::kFp8TensorCore});
}

// The wgmma scores kernel (the runner's for steps of 256 tokens or more): its own test, so a
// fault in it can be left out of a whole-suite run (ML4_GTEST_EXCLUDE=CudaIndexer.Wgmma*).
TEST(CudaIndexer, WgmmaScoresAndTopkMatchCpu) {
  ML4_REQUIRE_GPU();
  scores_and_topk({IndexerMath::kFp8Wgmma});
}

TEST(CudaIndexer, QueryQuantIsByteIdenticalToCpu) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int dI : {128, 256}) {
    for (bool hadamard : {true, false}) {
      const int64_t rows = 3 * 64 + 5;
      std::vector<float> q(rows * dI);
      for (auto& v : q) v = nd(rng);
      for (int i = 0; i < dI; ++i) q[7 * dI + i] = 0.0f;  // amax floor 1e-4
      std::vector<float> qt = q;
      if (hadamard) cpu::hadamard_transform(qt.data(), rows, dI);
      const int G = dI / 128;
      std::vector<uint8_t> ref8(rows * dI);
      std::vector<float> refs(rows * G);
      for (int64_t r = 0; r < rows; ++r)
        cpu::quantize_fp8_groups(qt.data() + r * dI, dI, 128, ref8.data() + r * dI, refs.data() + r * G);
      auto d_q = to_device(q);
      auto d_q8 = poisoned<uint8_t>(rows * dI);
      auto d_s = poisoned<float>(rows * G);
      IndexerQueryQuantParams p;
      p.q = d_q.as<float>();
      p.rows = rows;
      p.dI = dI;
      p.hadamard = hadamard;
      p.q8 = d_q8.data();
      p.scales = d_s.as<float>();
      ML4_ASSERT_OK(indexer_query_quant(p));
      ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
      const auto got8 = to_host<uint8_t>(d_q8, rows * dI);
      const auto gots = to_host<float>(d_s, rows * G);
      size_t diff = 0;
      for (size_t i = 0; i < ref8.size(); ++i) diff += got8[i] != ref8[i];
      std::printf("indexer query quant dI=%d hadamard=%d: %zu of %zu bytes differ\n", dI, hadamard, diff, ref8.size());
      EXPECT_EQ(diff, 0u);
      EXPECT_EQ(0, std::memcmp(gots.data(), refs.data(), refs.size() * 4)) << "scales differ";
    }
  }
}

// The fused query path (IndexerQueryQuantParams::rope, issue 19): RoPE inside the quantization
// kernel gives the bytes and scales of q_path's NeoX rotation followed by the quantization: the
// same f32 operations on each value (rope.cuh), no reduction between them. 29 tokens x 8 heads,
// LeRoPE past its window; repeat runs identical.
TEST(CudaIndexer, QueryQuantWithRopeEqualsRopeThenQuant) {
  ML4_REQUIRE_GPU();
  const int HI = 8, dI = 128, dr = 64;
  const int64_t T = 29, rows = T * HI;
  auto q = testing::randn(rows * dI, 31, 1.7f);
  std::vector<float> inv(dr / 2);
  for (int i = 0; i < dr / 2; ++i) inv[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / dr));
  std::vector<int64_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = 17 + 211 * t;
  auto dq = to_device(q), dinv = to_device(inv), dpos = to_device(pos);
  // Rotate a copy, then quantize it.
  auto rotated = to_device(q);
  QPathParams r;
  r.q = rotated.as<float>();
  r.T = T;
  r.H = HI;
  r.head_stride = dI;
  r.rope_dim = dr;
  r.positions = dpos.as<int64_t>();
  r.inv_freq = dinv.as<float>();
  r.attn_factor = 0.875f;
  r.neox = true;
  r.lerope = LeRopeConfig{true, 1024, 3.0};
  ML4_ASSERT_OK(q_path(r));
  auto want8 = poisoned<uint8_t>(rows * dI);
  auto want_s = poisoned<float>(rows);
  ML4_ASSERT_OK(indexer_query_quant({rotated.as<float>(), rows, dI, true, want8.data(), want_s.as<float>(), nullptr}));
  ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
  const auto w8 = to_host<uint8_t>(want8, rows * dI);
  const auto ws = to_host<float>(want_s, rows);
  for (int rep = 0; rep < 2; ++rep) {
    auto got8 = poisoned<uint8_t>(rows * dI);
    auto got_s = poisoned<float>(rows);
    IndexerQueryQuantParams p{dq.as<float>(), rows, dI, true, got8.data(), got_s.as<float>(), nullptr};
    p.rope = true;
    p.heads = HI;
    p.rope_rows = {dr, dpos.as<int64_t>(), dinv.as<float>(), 0.875f, true, 1024, 3.0};
    ML4_ASSERT_OK(indexer_query_quant(p));
    ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
    const auto g8 = to_host<uint8_t>(got8, rows * dI);
    const auto gs = to_host<float>(got_s, rows);
    size_t diff = 0;
    for (size_t i = 0; i < g8.size(); ++i) diff += g8[i] != w8[i];
    EXPECT_EQ(diff, 0u) << "rep " << rep;
    EXPECT_EQ(0, std::memcmp(gs.data(), ws.data(), ws.size() * 4)) << "rep " << rep;
    if (rep == 0) std::printf("fused indexer query path: %zu of %zu bytes differ from rope then quant\n", diff, g8.size());
  }
  IndexerQueryQuantParams bad{dq.as<float>(), rows, dI, true, dq.data(), dq.as<float>(), nullptr};
  bad.rope = true;
  bad.heads = 7;  // rows not a multiple of it
  EXPECT_FALSE(indexer_query_quant(bad).ok());
}

TEST(CudaIndexer, BadArgumentsAreErrors) {
  IndexerScoresParams p;
  p.T = 1;
  p.max_length = 10;
  p.scores_stride = 10;
  p.dI = 64;
  EXPECT_FALSE(indexer_scores(p).ok());
  p.dI = 128;
  p.HI = 65;
  EXPECT_FALSE(indexer_scores(p).ok());
  p.HI = 64;
  p.scores_stride = 5;
  EXPECT_FALSE(indexer_scores(p).ok());
  p.scores_stride = 10;
  EXPECT_FALSE(indexer_scores(p).ok());  // null pointers
  IndexerQueryQuantParams qq;
  qq.rows = 1;
  qq.dI = 96;
  EXPECT_FALSE(indexer_query_quant(qq).ok());
  qq.dI = 128;
  EXPECT_FALSE(indexer_query_quant(qq).ok());  // null pointers
}

}  // namespace
}  // namespace ml4::cuda
