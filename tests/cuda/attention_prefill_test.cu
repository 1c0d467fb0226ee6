// The wgmma sparse MLA prefill kernel (attention_prefill.cu: MlaMath::kBf16TensorCore, sparse,
// fp8_ds_mla, r 512, dr 64) against ml4::cpu::mla_attention on the keys decoded with
// ml4::decode_latent from the same cache bytes, and against the decode kernel it replaces for
// prefill (attention_decode.cu, prefill_kernel = false) on every token.
//
// Steps are causal prefills of one sequence whose pages are shuffled over the cache: token at
// position p sees min(p + 1, topk) keys: all of [0, p] while p < topk, else a random topk-subset
// (the indexer's selection), listed in random order; some rows carry -1 holes and an out-of-range
// slot, one has index_length 0 (no key: out 0, lse -inf). head_scale (SSMax) varies per token and
// head, one token has 4x larger scales (sharper softmax).
// Bounds (the kBf16TensorCore ones of attention_test.cu): q, keys and P are rounded to bf16
// (relative 2^-9 per value); the dot products and the softmax average these to ~1e-3 relative on
// out_lat, bound 1e-2. lse: a logit hs * q.k over 576 terms moves by the bf16 rounding of q and k,
// standard deviation hs * sqrt(2 * 576 / 3) * 2^-9 ~ 0.038 hs; lse follows the largest logits,
// so the bound per (token, head) row is 6 sigma ~ 0.25 hs (2e-2 at hs = 0.08, attention_test's
// bound; the 4x-scaled token gets 4x) plus 4e-3 for the bf16 P in the row sum. The prefill and
// decode kernels differ in rounding order and in the key dequantization (this kernel:
// bf16(e4m3 x scale) in f32; the decode kernel: bf16(scale x 2^120) x bf16 bits, two roundings):
// each is within the bound of the reference, so they agree to twice it on lse and 1e-2 on out. The CPU reference covers a sample of tokens
// (its f64 sums cost ~0.3 GFLOP per token at topk 2048); the kernels are compared on all.
// Every output is poisoned with NaN bytes; a repeat run must be bit-identical. q_lat is drawn
// bf16-representable (the kernel rounds q to bf16 anyway), so the kernel's bf16 form
// (MlaAttentionParams::lat_bf16: q_lat read as bf16, out_lat written as bf16) must give out_lat's
// f32 values rounded to bf16 (RNE) bit for bit and the same lse bits. Both schedules of
// the kernel (tile, pair) meet the same bounds; the pair schedule rounds warpgroup 0's P0 to
// bf16 once before and once after its rescale (attention_prefill.cu), within the P bound above.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cuda_test_util.h"
#include "kv/latent_layout.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/attention.h"

namespace ml4::cuda {
namespace {

using testing::poisoned;
using testing::to_device;
using testing::to_host;

constexpr int kR = 512, kDr = 64;

struct Outputs {
  std::vector<float> out, lse;
};

struct Case {
  int H;
  int topk;
  int64_t start;  // positions [start, start + T) of the sequence are the step's tokens
  int64_t T;
  int64_t scratch_pages;  // MlaAttentionParams::scratch_pages (0: every page)
};

void run_case(const Case& cs, uint32_t seed, bool pairs) {
  std::mt19937 rng(seed);
  const int H = cs.H, topk = cs.topk;
  const int64_t T = cs.T, len = cs.start + T;
  const int64_t seq_pages = (len + kPageTokens - 1) / kPageTokens;
  const int64_t num_pages = seq_pages + 9;  // pages the sequence does not own stay unread
  const int64_t num_slots = num_pages * kPageTokens;
  const size_t tb = latent_token_bytes(KvCacheDtype::kFp8DsMla, kR, kDr);

  // Cache rows (random, encoded) and their decoded values.
  std::vector<uint8_t> bytes(num_slots * tb);
  std::vector<float> dc(num_slots * kR), dk(num_slots * kDr);
  {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> c(kR), kr(kDr);
    for (int64_t s = 0; s < num_slots; ++s) {
      for (auto& v : c) v = nd(rng);
      for (auto& v : kr) v = nd(rng);
      encode_latent(KvCacheDtype::kFp8DsMla, c.data(), kr.data(), kR, kDr, 1.0f, bytes.data() + s * tb);
      decode_latent(KvCacheDtype::kFp8DsMla, bytes.data() + s * tb, kR, kDr, 1.0f, dc.data() + s * kR,
                    dk.data() + s * kDr);
    }
  }
  std::vector<int32_t> pages(num_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  auto slot_of = [&](int64_t pos) { return int64_t{pages[pos / kPageTokens]} * kPageTokens + pos % kPageTokens; };

  // Indices: causal top-k lists in random order.
  const int64_t stride = topk + 8;
  std::vector<int32_t> idx(T * stride, -1), idx_len(T);
  std::vector<int32_t> pos(len);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = cs.start + t;
    const int n = static_cast<int>(std::min<int64_t>(p + 1, topk));
    pos.resize(p + 1);
    std::iota(pos.begin(), pos.end(), 0);
    std::shuffle(pos.begin(), pos.end(), rng);
    for (int j = 0; j < n; ++j) idx[t * stride + j] = static_cast<int32_t>(slot_of(pos[j]));
    idx_len[t] = n;
    if (t % 7 == 3)
      for (int j = 1; j < n; j += 11) idx[t * stride + j] = -1;
    if (t % 13 == 5 && n > 2) idx[t * stride + 1] = static_cast<int32_t>(num_slots + 17);  // out of range: skipped
  }
  idx_len[T / 3] = 0;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> us(0.02f, 0.08f);
  std::vector<float> q_lat(T * H * kR), q_rope(T * H * kDr), hs(T * H);
  for (auto& v : q_lat) v = round_bf16(nd(rng));
  for (auto& v : q_rope) v = nd(rng);
  for (auto& v : hs) v = us(rng);
  for (int h = 0; h < H; ++h) hs[(T / 2) * H + h] *= 4.0f;

  auto d_cache = to_device(bytes);
  auto d_ql = to_device(q_lat);
  std::vector<uint16_t> q_lat16(q_lat.size());
  for (size_t i = 0; i < q_lat.size(); ++i) q_lat16[i] = f32_to_bf16(q_lat[i]);
  auto d_ql16 = to_device(q_lat16);
  auto d_qr = to_device(q_rope);
  auto d_hs = to_device(hs);
  auto d_idx = to_device(idx);
  auto d_len = to_device(idx_len);
  std::vector<uint16_t> out16;  // the bf16 form's out_lat (lat16 runs)
  auto run = [&](bool prefill, size_t* ws_used, bool lat16 = false) {
    MlaAttentionParams p;
    p.math = MlaMath::kBf16TensorCore;
    p.q_lat = lat16 ? reinterpret_cast<const float*>(d_ql16.data()) : d_ql.as<float>();
    p.lat_bf16 = lat16;
    p.q_rope = d_qr.as<float>();
    p.head_scale = d_hs.as<float>();
    p.T = T;
    p.H = H;
    p.r = kR;
    p.dr = kDr;
    p.cache = d_cache.data();
    p.num_slots = num_slots;
    p.dtype = KvCacheDtype::kFp8DsMla;
    p.indices = d_idx.as<int32_t>();
    p.indices_stride = stride;
    p.topk = topk;
    p.index_lengths = d_len.as<int32_t>();
    p.prefill_kernel = prefill;
    p.prefill_pairs = pairs;
    p.prefill_min_blocks = 1;  // the prefill kernel at any T
    p.scratch_pages = cs.scratch_pages;
    auto out = poisoned<float>(T * H * kR), lse = poisoned<float>(T * H);
    p.out_lat = out.as<float>();
    p.lse = lse.as<float>();
    const size_t ws_bytes = mla_attention_workspace_bytes(p);
    auto ws = poisoned<uint8_t>(std::max<size_t>(ws_bytes, 16));
    p.workspace = ws.data();
    p.workspace_bytes = ws_bytes;
    EXPECT_TRUE(mla_attention(p).ok());
    EXPECT_TRUE(cuda_status(cudaDeviceSynchronize(), "sync").ok());
    *ws_used = ws_bytes;
    if (lat16) {
      std::vector<uint16_t> o16(T * H * kR);
      EXPECT_TRUE(cuda_status(cudaMemcpy(o16.data(), out.data(), o16.size() * 2, cudaMemcpyDeviceToHost), "d2h").ok());
      out16 = std::move(o16);
      return Outputs{{}, to_host<float>(lse, T * H)};
    }
    return Outputs{to_host<float>(out, T * H * kR), to_host<float>(lse, T * H)};
  };
  size_t ws_new = 0, ws_old = 0, ws16 = 0;
  const Outputs a = run(true, &ws_new), b = run(true, &ws_new), old = run(false, &ws_old);
  const Outputs a16 = run(true, &ws16, true);
  {
    size_t out_diff = 0;
    for (size_t i = 0; i < a.out.size(); ++i) out_diff += out16[i] != f32_to_bf16(a.out[i]);
    EXPECT_EQ(out_diff, 0u) << "bf16 out_lat is not the f32 out_lat rounded";
    EXPECT_EQ(0, std::memcmp(a.lse.data(), a16.lse.data(), a.lse.size() * 4)) << "bf16 form's lse differs";
  }
  // The prefill path sizes a scratch of >= the sequence's pages (the decode path needs none at
  // one split): a zero here would mean the prefill kernel did not run.
  ASSERT_GE(ws_new, static_cast<size_t>(std::min<int64_t>(seq_pages, cs.scratch_pages ? cs.scratch_pages : seq_pages)) *
                        kPageTokens * 1152)
      << "prefill kernel not selected";
  EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), a.out.size() * 4)) << "repeat run differs";
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4)) << "repeat run differs";
  ASSERT_TRUE(testing::all_finite(a.out)) << "unwritten or NaN outputs";

  // CPU reference on a sample of tokens: the first ones, around p = topk, the scaled and the
  // empty token, the last.
  std::vector<int64_t> sample = {0, 1, 2, 63, 64, T / 3, T / 2, T - 2, T - 1};
  for (int64_t d : {-2, -1, 0, 1, 2}) sample.push_back(topk - 1 - cs.start + d);
  for (int i = 0; i < 6; ++i) sample.push_back(std::uniform_int_distribution<int64_t>(0, T - 1)(rng));
  std::sort(sample.begin(), sample.end());
  sample.erase(std::unique(sample.begin(), sample.end()), sample.end());
  sample.erase(std::remove_if(sample.begin(), sample.end(), [&](int64_t t) { return t < 0 || t >= T; }), sample.end());
  std::vector<float> ref_out, ref_lse, got_out, got_lse;
  for (int64_t t : sample) {
    std::vector<int64_t> sl;
    for (int j = 0; j < idx_len[t]; ++j) {
      const int32_t s = idx[t * stride + j];
      if (s >= 0 && s < num_slots) sl.push_back(s);
    }
    const int64_t S = static_cast<int64_t>(sl.size());
    std::vector<float> c(S * kR), kr(S * kDr), o(H * kR), l(H);
    for (int64_t j = 0; j < S; ++j) {
      std::copy_n(dc.data() + sl[j] * kR, kR, c.data() + j * kR);
      std::copy_n(dk.data() + sl[j] * kDr, kDr, kr.data() + j * kDr);
    }
    cpu::mla_attention(q_lat.data() + t * H * kR, q_rope.data() + t * H * kDr, H, kR, kDr, c.data(), kr.data(), S,
                       hs.data() + t * H, o.data(), l.data());
    ref_out.insert(ref_out.end(), o.begin(), o.end());
    ref_lse.insert(ref_lse.end(), l.begin(), l.end());
    got_out.insert(got_out.end(), a.out.begin() + t * H * kR, a.out.begin() + (t + 1) * H * kR);
    got_lse.insert(got_lse.end(), a.lse.begin() + t * H, a.lse.begin() + (t + 1) * H);
  }
  std::vector<float> got_hs;
  for (int64_t t : sample) got_hs.insert(got_hs.end(), hs.begin() + t * H, hs.begin() + (t + 1) * H);
  auto lse_bound = [](float h) { return 0.25 * h + 4e-3; };
  double lse_err = 0, lse_ratio = 0;  // max |lse - ref|, and max of |lse - ref| / bound
  size_t empty_rows = 0;
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      ++empty_rows;
      EXPECT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << "row " << i << " lse " << got_lse[i];
    } else {
      const double d = std::fabs(double(got_lse[i]) - ref_lse[i]);
      lse_err = std::max(lse_err, d);
      lse_ratio = std::max(lse_ratio, d / lse_bound(got_hs[i]));
    }
  }
  const double e = testing::rel_err(got_out, ref_out);
  // Against the decode kernel, all tokens.
  double lse_diff = 0, diff_ratio = 0;
  for (size_t i = 0; i < a.lse.size(); ++i) {
    if (std::isinf(old.lse[i]) || std::isinf(a.lse[i])) {
      EXPECT_EQ(a.lse[i], old.lse[i]) << "row " << i;
    } else {
      const double d = std::fabs(double(a.lse[i]) - old.lse[i]);
      lse_diff = std::max(lse_diff, d);
      diff_ratio = std::max(diff_ratio, d / (2 * lse_bound(hs[i])));
    }
  }
  const double e_old = testing::rel_err(a.out, old.out);
  std::printf(
      "prefill kernel (%s schedule) H=%d topk=%d positions [%lld, %lld) scratch_pages=%lld (ws %zu B): vs CPU on %zu tokens: "
      "||out - ref|| / ||ref|| = %.3g (bound 1e-2), max |lse - ref| = %.3g (%.2f of its row's bound), %zu empty "
      "rows; vs decode kernel on all: ||out - old|| / ||old|| = %.3g (bound 1e-2), max |lse - old| = %.3g (%.2f of "
      "its bound)\n",
      pairs ? "pair" : "tile", H, topk, static_cast<long long>(cs.start), static_cast<long long>(len), static_cast<long long>(cs.scratch_pages),
      ws_new, sample.size(), e, lse_err, lse_ratio, empty_rows, e_old, lse_diff, diff_ratio);
  EXPECT_LT(e, 1e-2);
  EXPECT_LT(lse_ratio, 1.0);
  EXPECT_LT(e_old, 1e-2);
  EXPECT_LT(diff_ratio, 1.0);
}

TEST(CudaMlaAttention, PrefillKernelMatchesCpuReference) {
  ML4_REQUIRE_GPU();
  // H 64 at the model's topk 2048 (p < topk and p > topk in one step, scratch bounded by the
  // sequence's pages); a chunk that starts mid-sequence at topk 256; H 16 (a padded head block)
  // and H 128 (two head blocks); 80 heads (a full block and a padded one).
  // Both schedules (MlaAttentionParams::prefill_pairs), each against the same references.
  for (bool pairs : {true, false}) {
    run_case({64, 2048, 0, 2300, 37}, 1, pairs);
    run_case({64, 256, 500, 300, 0}, 2, pairs);
    run_case({16, 512, 0, 700, 0}, 3, pairs);
    run_case({128, 256, 100, 200, 0}, 4, pairs);
    run_case({80, 128, 0, 150, 0}, 5, pairs);
  }
}

}  // namespace
}  // namespace ml4::cuda
