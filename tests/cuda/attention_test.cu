// GPU MLA attention (absorbed; sparse through top-k slots, dense causal through block tables)
// against ml4::cpu::mla_attention on the keys decoded with ml4::decode_latent from the same
// cache bytes. The kernel computes in f32 (keys dequantized exactly to f32, f32 dots and
// softmax), the reference in f32 with f64 sums: both sides round ~2^-24 per operation over
// 576-term dots, so ||out - ref|| / ||ref|| stays near 1e-6; the bound is 2e-5, and lse (natural
// log) is compared to 2e-5 absolute (lse ~ 1..10). The bf16 tensor-core kernel runs the same
// cases with bounds from bf16 rounding (bounds_for); with fp8_ds_mla rows that is the dedicated
// decode kernel (attention_decode.cu), tested again at decode shapes (H 16/64/128, topk 2048).
// Every output is poisoned with NaN bytes before the run; a repeat run must be bit-identical.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "kv/latent_layout.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/attention.h"

namespace ml4::cuda {
namespace {

using testing::poisoned;
using testing::to_device;
using testing::to_host;

struct Shape {
  int H, r, dr;
  KvCacheDtype dtype;
};

// A paged latent cache of num_slots random rows, with host copies of the decoded keys.
struct Cache {
  int r, dr;
  KvCacheDtype dtype;
  int64_t num_slots;
  std::vector<uint8_t> bytes;
  std::vector<float> c, kr;  // decoded [num_slots, r], [num_slots, dr]
};

Cache make_cache(const Shape& sh, int64_t num_slots, std::mt19937& rng) {
  Cache k{sh.r, sh.dr, sh.dtype, num_slots, {}, {}, {}};
  const size_t tb = latent_token_bytes(sh.dtype, sh.r, sh.dr);
  k.bytes.resize(num_slots * tb);
  k.c.resize(num_slots * sh.r);
  k.kr.resize(num_slots * sh.dr);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> c(sh.r), kr(sh.dr);
  for (int64_t s = 0; s < num_slots; ++s) {
    for (auto& v : c) v = nd(rng);
    for (auto& v : kr) v = nd(rng);
    encode_latent(sh.dtype, c.data(), kr.data(), sh.r, sh.dr, 1.0f, k.bytes.data() + s * tb);
    decode_latent(sh.dtype, k.bytes.data() + s * tb, sh.r, sh.dr, 1.0f, k.c.data() + s * sh.r, k.kr.data() + s * sh.dr);
  }
  return k;
}

struct Outputs {
  std::vector<float> out, lse;
};

// Reference for one token over the listed slots.
void reference(const Cache& k, int H, const float* q_lat, const float* q_rope, const float* hs,
               const std::vector<int64_t>& slots, float* out, float* lse) {
  const int64_t S = static_cast<int64_t>(slots.size());
  std::vector<float> c(S * k.r), kr(S * k.dr);
  for (int64_t j = 0; j < S; ++j) {
    std::copy_n(k.c.data() + slots[j] * k.r, k.r, c.data() + j * k.r);
    std::copy_n(k.kr.data() + slots[j] * k.dr, k.dr, kr.data() + j * k.dr);
  }
  cpu::mla_attention(q_lat, q_rope, H, k.r, k.dr, c.data(), kr.data(), S, hs, out, lse);
}

// Bounds per kernel arithmetic. kF32: see the file comment. kBf16TensorCore: q, keys and P are
// rounded to bf16 (relative step 2^-8, error 2^-9 ~ 2e-3 per value); over the dot products and the
// softmax average these give ~1e-3 relative on out_lat, bound 1e-2; logits of magnitude ~1-5
// move by ~5e-3, so lse (a smooth max of them) gets 2e-2 absolute.
struct Bounds {
  double out, lse;
};
Bounds bounds_for(MlaMath m) { return m == MlaMath::kF32 ? Bounds{2e-5, 2e-5} : Bounds{1e-2, 2e-2}; }

void check(const Outputs& got, const std::vector<float>& ref_out, const std::vector<float>& ref_lse, const char* what,
           Bounds b = {2e-5, 2e-5}) {
  ASSERT_EQ(got.out.size(), ref_out.size());
  size_t empty_rows = 0;
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      ++empty_rows;
      EXPECT_TRUE(std::isinf(got.lse[i]) && got.lse[i] < 0) << what << " row " << i << " lse " << got.lse[i];
    } else {
      EXPECT_NEAR(got.lse[i], ref_lse[i], b.lse) << what << " row " << i;
    }
  }
  ASSERT_TRUE(testing::all_finite(got.out)) << what << ": unwritten or NaN outputs";
  const double e = testing::rel_err(got.out, ref_out);
  double lse_err = 0;
  for (size_t i = 0; i < ref_lse.size(); ++i)
    if (!std::isinf(ref_lse[i])) lse_err = std::max(lse_err, std::fabs(double(got.lse[i]) - ref_lse[i]));
  std::printf("%s: ||out - ref|| / ||ref|| = %.3g (bound %.0e), max |lse - ref| = %.3g (bound %.0e), %zu empty rows\n",
              what, e, b.out, lse_err, b.lse, empty_rows);
  EXPECT_LT(e, b.out) << what;
}

TEST(CudaMlaAttention, SparseMatchesCpuReference) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(5);
  const Shape shapes[] = {{64, 512, 64, KvCacheDtype::kFp8DsMla},
                          {4, 128, 32, KvCacheDtype::kFp8DsMla},
                          {80, 512, 64, KvCacheDtype::kBf16},
                          {16, 512, 64, KvCacheDtype::kFp8}};
  for (const auto& sh : shapes) {
    const int64_t num_slots = 40 * 64;
    const Cache cache = make_cache(sh, num_slots, rng);
    const int64_t T = 6;
    const int topk = 300;
    // Rows: full list; with -1 holes; a short index_length; empty; one key; all distinct slots.
    std::vector<int32_t> idx(T * topk, -1), idx_len(T, topk);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> perm(num_slots);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::copy_n(perm.begin(), topk, idx.begin() + t * topk);
    }
    for (int i = 0; i < topk; i += 5) idx[1 * topk + i] = -1;
    idx[1 * topk + 7] = static_cast<int32_t>(num_slots + 3);  // out of range: skipped
    idx_len[2] = 77;
    idx_len[3] = 0;
    idx_len[4] = 1;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> us(0.02f, 0.08f);
    std::vector<float> q_lat(T * sh.H * sh.r), q_rope(T * sh.H * sh.dr), hs(T * sh.H);
    for (auto& v : q_lat) v = nd(rng);
    for (auto& v : q_rope) v = nd(rng);
    for (auto& v : hs) v = us(rng);

    std::vector<float> ref_out(T * sh.H * sh.r), ref_lse(T * sh.H);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int64_t> sl;
      for (int j = 0; j < idx_len[t]; ++j) {
        const int32_t s = idx[t * topk + j];
        if (s >= 0 && s < num_slots) sl.push_back(s);
      }
      reference(cache, sh.H, q_lat.data() + t * sh.H * sh.r, q_rope.data() + t * sh.H * sh.dr, hs.data() + t * sh.H, sl,
                ref_out.data() + t * sh.H * sh.r, ref_lse.data() + t * sh.H);
    }

    auto d_cache = to_device(cache.bytes);
    auto d_ql = to_device(q_lat);
    auto d_qr = to_device(q_rope);
    auto d_hs = to_device(hs);
    auto d_idx = to_device(idx);
    auto d_len = to_device(idx_len);
    const int64_t qs = sh.dr + 12;  // q_rope rows of a wider buffer: a multiple of 4 (16-byte rows), past dr
    std::vector<float> wide(T * sh.H * qs, std::nanf(""));
    for (int64_t th = 0; th < T * sh.H; ++th) std::copy_n(q_rope.data() + th * sh.dr, sh.dr, wide.data() + th * qs + 8);
    auto d_wide = to_device(wide);
    for (MlaMath math : {MlaMath::kF32, MlaMath::kBf16TensorCore}) {
      std::vector<Outputs> runs;
      constexpr int kSplits[] = {1, 0, 7, 0, 0};  // run 4: q_rope strided
      for (int run = 0; run < 5; ++run) {
        const int splits = kSplits[run];
        MlaAttentionParams p;
        p.math = math;
        p.q_lat = d_ql.as<float>();
        p.q_rope = run == 4 ? d_wide.as<float>() + 8 : d_qr.as<float>();
        p.q_rope_stride = run == 4 ? qs : 0;
        p.head_scale = d_hs.as<float>();
        p.T = T;
        p.H = sh.H;
        p.r = sh.r;
        p.dr = sh.dr;
        p.cache = d_cache.data();
        p.num_slots = num_slots;
        p.dtype = sh.dtype;
        p.indices = d_idx.as<int32_t>();
        p.topk = topk;
        p.index_lengths = d_len.as<int32_t>();
        p.num_splits = splits;
        auto out = poisoned<float>(T * sh.H * sh.r), lse = poisoned<float>(T * sh.H);
        p.out_lat = out.as<float>();
        p.lse = lse.as<float>();
        const size_t ws_bytes = mla_attention_workspace_bytes(p);
        DeviceBuffer ws;
        if (ws_bytes > 0) {
          auto b = DeviceBuffer::alloc(ws_bytes);
          ASSERT_TRUE(b.ok());
          ws = std::move(b).value();
          ASSERT_TRUE(ws.fill_bytes(0xFF).ok());
        }
        p.workspace = ws.data();
        p.workspace_bytes = ws_bytes;
        ML4_ASSERT_OK(mla_attention(p));
        ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
        runs.push_back({to_host<float>(out, T * sh.H * sh.r), to_host<float>(lse, T * sh.H)});
        char what[128];
        std::snprintf(what, sizeof what, "sparse %s H=%d r=%d %s splits=%d (ws %zu B)",
                      math == MlaMath::kF32 ? "f32" : "bf16-tc", sh.H, sh.r, kv_cache_dtype_name(sh.dtype), splits,
                      ws_bytes);
        check(runs.back(), ref_out, ref_lse, what, bounds_for(math));
      }
      // Runs 1 and 3 use the same (automatic) split count: bit-identical.
      EXPECT_EQ(0, std::memcmp(runs[1].out.data(), runs[3].out.data(), runs[1].out.size() * 4)) << "repeat run differs";
      EXPECT_EQ(0, std::memcmp(runs[1].lse.data(), runs[3].lse.data(), runs[1].lse.size() * 4)) << "repeat run differs";
      // Run 4 reads q_rope in place from rows of a wider buffer (MlaAttentionParams::
      // q_rope_stride: the runner passes the q projection's [T, H, dn + dr] rows): run 1's bits.
      EXPECT_EQ(0, std::memcmp(runs[1].out.data(), runs[4].out.data(), runs[1].out.size() * 4)) << "strided q_rope differs";
      EXPECT_EQ(0, std::memcmp(runs[1].lse.data(), runs[4].lse.data(), runs[1].lse.size() * 4)) << "strided q_rope differs";
    }
  }
}

// The dedicated sparse decode kernel (attention_decode.cu: MlaMath::kBf16TensorCore, sparse,
// fp8_ds_mla, r 512, dr 64, H % 16 == 0) at the decode shapes: H 16 / 64 / 128 (one head block
// of 16, one full block of 64, two full blocks) at T 1 / 5 / 64, and H 48 / 96 (a 48-head block;
// a full block and a 32-head one) at T 5, topk 2048 over a 6144-row cache. Token rows
// (by (t + H / 16) % 6): the full list; -1 holes and an out-of-range slot; index_length 1000;
// length 1; length 63 (a partial tile); -1 padding from entry 1500 on. Bounds are the
// kBf16TensorCore ones (bounds_for: q, keys and P rounded to bf16). Automatic splits run twice
// (bit-identical) and a forced 3-way split once, each on poisoned outputs and workspace.
TEST(CudaMlaAttention, SparseDecodeKernelMatchesCpuReference) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(11);
  const int64_t num_slots = 96 * kPageTokens;
  const Cache cache = make_cache({16, 512, 64, KvCacheDtype::kFp8DsMla}, num_slots, rng);
  auto d_cache = to_device(cache.bytes);
  const int topk = 2048, r = 512, dr = 64;
  const int64_t stride = topk + 8;
  for (int H : {16, 48, 64, 96, 128}) {
    for (int64_t T : {1, 5, 64}) {
      if (H % 64 != 0 && H != 16 && T != 5) continue;  // the MT = 2, 3 head blocks: one shape each
      std::vector<int32_t> idx(T * stride, -1), idx_len(T, topk);
      std::vector<int32_t> perm(num_slots);
      std::iota(perm.begin(), perm.end(), 0);
      for (int64_t t = 0; t < T; ++t) {
        std::shuffle(perm.begin(), perm.end(), rng);
        int32_t* row = idx.data() + t * stride;
        std::copy_n(perm.begin(), topk, row);
        switch ((t + H / 16) % 6) {
          case 1:
            for (int i = 3; i < topk; i += 9) row[i] = -1;
            row[100] = static_cast<int32_t>(num_slots + 5);
            break;
          case 2: idx_len[t] = 1000; break;
          case 3: idx_len[t] = 1; break;
          case 4: idx_len[t] = 63; break;
          case 5: std::fill(row + 1500, row + topk, -1); break;
          default: break;
        }
      }
      std::normal_distribution<float> nd(0.0f, 1.0f);
      std::uniform_real_distribution<float> us(0.02f, 0.08f);
      std::vector<float> q_lat(T * H * r), q_rope(T * H * dr), hs(T * H);
      for (auto& v : q_lat) v = nd(rng);
      for (auto& v : q_rope) v = nd(rng);
      for (auto& v : hs) v = us(rng);
      std::vector<float> ref_out(T * H * r), ref_lse(T * H);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int64_t> sl;
        for (int j = 0; j < idx_len[t]; ++j) {
          const int32_t s = idx[t * stride + j];
          if (s >= 0 && s < num_slots) sl.push_back(s);
        }
        reference(cache, H, q_lat.data() + t * H * r, q_rope.data() + t * H * dr, hs.data() + t * H, sl,
                  ref_out.data() + t * H * r, ref_lse.data() + t * H);
      }
      auto d_ql = to_device(q_lat);
      auto d_qr = to_device(q_rope);
      auto d_hs = to_device(hs);
      auto d_idx = to_device(idx);
      auto d_len = to_device(idx_len);
      std::vector<Outputs> runs;
      for (int splits : {0, 0, 3}) {
        MlaAttentionParams p;
        p.math = MlaMath::kBf16TensorCore;
        p.q_lat = d_ql.as<float>();
        p.q_rope = d_qr.as<float>();
        p.head_scale = d_hs.as<float>();
        p.T = T;
        p.H = H;
        p.r = r;
        p.dr = dr;
        p.cache = d_cache.data();
        p.num_slots = num_slots;
        p.dtype = KvCacheDtype::kFp8DsMla;
        p.indices = d_idx.as<int32_t>();
        p.indices_stride = stride;
        p.topk = topk;
        p.index_lengths = d_len.as<int32_t>();
        p.num_splits = splits;
        auto out = poisoned<float>(T * H * r), lse = poisoned<float>(T * H);
        p.out_lat = out.as<float>();
        p.lse = lse.as<float>();
        const size_t ws_bytes = mla_attention_workspace_bytes(p);
        auto ws = poisoned<uint8_t>(std::max<size_t>(ws_bytes, 16));
        p.workspace = ws.data();
        p.workspace_bytes = ws_bytes;
        ML4_ASSERT_OK(mla_attention(p));
        ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
        runs.push_back({to_host<float>(out, T * H * r), to_host<float>(lse, T * H)});
        char what[128];
        std::snprintf(what, sizeof what, "decode kernel H=%d T=%lld splits=%d (ws %zu B)", H,
                      static_cast<long long>(T), splits, ws_bytes);
        check(runs.back(), ref_out, ref_lse, what, bounds_for(MlaMath::kBf16TensorCore));
      }
      EXPECT_EQ(0, std::memcmp(runs[0].out.data(), runs[1].out.data(), runs[0].out.size() * 4)) << "repeat run differs";
      EXPECT_EQ(0, std::memcmp(runs[0].lse.data(), runs[1].lse.data(), runs[0].lse.size() * 4)) << "repeat run differs";
    }
  }
}

TEST(CudaMlaAttention, DenseCausalPrefillAndDecodeMatchCpuReference) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(6);
  const Shape sh{64, 512, 64, KvCacheDtype::kFp8DsMla};
  const int64_t num_blocks = 48, num_slots = num_blocks * kPageTokens;
  const Cache cache = make_cache(sh, num_slots, rng);
  // Two sequences with shuffled pages: seq 0 has 1000 tokens (a prefill chunk of 5 tokens at
  // its end plus early positions), seq 1 has 70 (one decode token).
  const int64_t max_pages = 20;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> bt(2 * max_pages, -1);
  for (int i = 0; i < 16; ++i) bt[i] = perm[i];
  for (int i = 0; i < 2; ++i) bt[max_pages + i] = perm[16 + i];
  const std::vector<int32_t> seq_of = {0, 0, 0, 0, 0, 0, 0, 1};
  const std::vector<int32_t> lengths = {1, 2, 64, 65, 996, 999, 1000, 70};
  const int64_t T = static_cast<int64_t>(seq_of.size());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q_lat(T * sh.H * sh.r), q_rope(T * sh.H * sh.dr), hs(T * sh.H);
  for (auto& v : q_lat) v = nd(rng);
  for (auto& v : q_rope) v = nd(rng);
  for (auto& v : hs) v = 0.0417f;  // 1/sqrt(576)
  std::vector<float> ref_out(T * sh.H * sh.r), ref_lse(T * sh.H);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> sl;
    for (int j = 0; j < lengths[t]; ++j) sl.push_back(int64_t{bt[seq_of[t] * max_pages + j / 64]} * 64 + j % 64);
    reference(cache, sh.H, q_lat.data() + t * sh.H * sh.r, q_rope.data() + t * sh.H * sh.dr, hs.data() + t * sh.H, sl,
              ref_out.data() + t * sh.H * sh.r, ref_lse.data() + t * sh.H);
  }
  auto d_cache = to_device(cache.bytes);
  auto d_ql = to_device(q_lat);
  auto d_qr = to_device(q_rope);
  auto d_hs = to_device(hs);
  auto d_bt = to_device(bt);
  auto d_seq = to_device(seq_of);
  auto d_len = to_device(lengths);
  for (MlaMath math : {MlaMath::kF32, MlaMath::kBf16TensorCore})
    for (int splits : {1, 0}) {
      MlaAttentionParams p;
      p.math = math;
      p.q_lat = d_ql.as<float>();
      p.q_rope = d_qr.as<float>();
      p.head_scale = d_hs.as<float>();
      p.T = T;
      p.H = sh.H;
      p.r = sh.r;
      p.dr = sh.dr;
      p.cache = d_cache.data();
      p.num_slots = num_slots;
      p.dtype = sh.dtype;
      p.block_table = d_bt.as<int32_t>();
      p.block_table_stride = max_pages;
      p.seq_of_token = d_seq.as<int32_t>();
      p.lengths = d_len.as<int32_t>();
      p.max_length = 1000;
      p.num_splits = splits;
      auto out = poisoned<float>(T * sh.H * sh.r), lse = poisoned<float>(T * sh.H);
      p.out_lat = out.as<float>();
      p.lse = lse.as<float>();
      const size_t ws_bytes = mla_attention_workspace_bytes(p);
      auto ws = poisoned<uint8_t>(std::max<size_t>(ws_bytes, 16));
      p.workspace = ws.data();
      p.workspace_bytes = ws_bytes;
      ML4_ASSERT_OK(mla_attention(p));
      ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
      char what[96];
      std::snprintf(what, sizeof what, "dense causal %s splits=%d (ws %zu B)",
                    math == MlaMath::kF32 ? "f32" : "bf16-tc", splits, ws_bytes);
      check({to_host<float>(out, T * sh.H * sh.r), to_host<float>(lse, T * sh.H)}, ref_out, ref_lse, what,
            bounds_for(math));
    }
}

TEST(CudaMlaAttention, BadArgumentsAreErrors) {
  MlaAttentionParams p;
  p.T = 1;
  p.r = 100;
  EXPECT_FALSE(mla_attention(p).ok());
  p.r = 512;
  p.dr = 65;
  EXPECT_FALSE(mla_attention(p).ok());
  p.dr = 64;
  EXPECT_FALSE(mla_attention(p).ok());  // null pointers
}

}  // namespace
}  // namespace ml4::cuda
