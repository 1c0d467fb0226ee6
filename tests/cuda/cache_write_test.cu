// GPU cache writes against the CPU encoders, byte for byte: latent rows (every KvCacheDtype,
// f32 and bf16 inputs, two model shapes) must equal ml4::encode_latent, indexer keys must
// equal ml4::encode_indexer_key after ml4::cpu::hadamard_transform. Caches start poisoned
// (0xFF) on both sides, so a stray write or a missed slot shows as a byte difference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cuda_test_util.h"
#include "kv/indexer_layout.h"
#include "kv/latent_layout.h"
#include "ops/cpu/quant.h"
#include "ops/cuda/cache_write.h"
#include "ops/cuda/elementwise.h"

namespace ml4::cuda {
namespace {

using testing::poisoned;
using testing::to_device;
using testing::to_host;

// Random slots: a permutation prefix of [0, num_slots), with slot -1 (padding) at `pad`.
std::vector<int64_t> random_slots(int64_t T, int64_t num_slots, int64_t pad, std::mt19937& rng) {
  std::vector<int64_t> all(num_slots);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<int64_t> s(all.begin(), all.begin() + T);
  if (pad >= 0 && pad < T) s[pad] = -1;
  return s;
}

struct LatentCase {
  KvCacheDtype dtype;
  int r, dr;
  bool bf16_in;
};

TEST(CudaCacheWrite, LatentRowsAreByteIdenticalToCpuEncoder) {
  ML4_REQUIRE_GPU();
  const LatentCase cases[] = {
      {KvCacheDtype::kFp8DsMla, 512, 64, false}, {KvCacheDtype::kFp8DsMla, 512, 64, true},
      {KvCacheDtype::kFp8DsMla, 128, 32, false}, {KvCacheDtype::kFp8, 512, 64, false},
      {KvCacheDtype::kBf16, 512, 64, false},     {KvCacheDtype::kBf16, 128, 32, true},
  };
  std::mt19937 rng(1234);
  for (const auto& cs : cases) {
    const int64_t T = 45, num_slots = 4 * kPageTokens;
    const float fp8_scale = cs.dtype == KvCacheDtype::kFp8 ? 0.05f : 1.0f;
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    std::vector<float> c(T * cs.r), kr(T * cs.dr);
    for (auto& v : c) v = u(rng);
    for (auto& v : kr) v = u(rng);
    // Tile edge cases: one tile of zeros (scale FLT_MIN) and one of tiny values.
    std::fill(c.begin() + 3 * cs.r, c.begin() + 3 * cs.r + 128, 0.0f);
    for (int i = 0; i < 128; ++i) c[5 * cs.r + i] *= 1e-30f;
    if (cs.bf16_in) {  // the kernel reads bf16; the reference encodes the same rounded values
      for (auto& v : c) v = round_bf16(v);
      for (auto& v : kr) v = round_bf16(v);
    }
    const auto slots = random_slots(T, num_slots, 7, rng);
    const size_t tb = latent_token_bytes(cs.dtype, cs.r, cs.dr);
    std::vector<uint8_t> ref(num_slots * tb, 0xFF);
    for (int64_t t = 0; t < T; ++t)
      if (slots[t] >= 0)
        encode_latent(cs.dtype, c.data() + t * cs.r, kr.data() + t * cs.dr, cs.r, cs.dr, fp8_scale,
                      ref.data() + slots[t] * tb);

    DeviceBuffer dc, dkr;
    if (cs.bf16_in) {
      std::vector<uint16_t> cb(c.size()), kb(kr.size());
      for (size_t i = 0; i < c.size(); ++i) cb[i] = f32_to_bf16(c[i]);
      for (size_t i = 0; i < kr.size(); ++i) kb[i] = f32_to_bf16(kr[i]);
      dc = to_device(cb);
      dkr = to_device(kb);
    } else {
      dc = to_device(c);
      dkr = to_device(kr);
    }
    auto dslots = to_device(slots);
    std::vector<std::vector<uint8_t>> outs;
    for (int rep = 0; rep < 2; ++rep) {
      auto cache = poisoned<uint8_t>(num_slots * tb);
      LatentCacheWriteParams p;
      p.c = dc.data();
      p.kr = dkr.data();
      p.c_dtype = p.kr_dtype = cs.bf16_in ? DType::kBF16 : DType::kF32;
      p.slots = dslots.as<int64_t>();
      p.T = T;
      p.r = cs.r;
      p.dr = cs.dr;
      p.dtype = cs.dtype;
      p.fp8_scale = fp8_scale;
      p.cache = cache.data();
      p.num_slots = num_slots;
      ML4_ASSERT_OK(latent_cache_write(p));
      ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
      outs.push_back(to_host<uint8_t>(cache, num_slots * tb));
    }
    size_t diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) diff += outs[0][i] != ref[i];
    std::printf("latent %s r=%d dr=%d %s: %zu of %zu bytes differ\n", kv_cache_dtype_name(cs.dtype), cs.r, cs.dr,
                cs.bf16_in ? "bf16 in" : "f32 in", diff, ref.size());
    EXPECT_EQ(diff, 0u);
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), ref.size())) << "repeat run differs";
  }
}

TEST(CudaCacheWrite, IndexerKeysAreByteIdenticalToCpuEncoder) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(99);
  for (bool hadamard : {true, false}) {
    const int dI = 128;
    const int64_t T = 70, num_blocks = 3;
    std::normal_distribution<float> nd(0.0f, 1.5f);
    std::vector<float> k(T * dI);
    for (auto& v : k) v = nd(rng);
    for (int i = 0; i < dI; ++i) k[4 * dI + i] = 0.0f;  // amax floor 1e-4
    const auto slots = random_slots(T, num_blocks * kPageTokens, 11, rng);
    std::vector<float> kt = k;
    if (hadamard) cpu::hadamard_transform(kt.data(), T, dI);
    const size_t pb = indexer_page_bytes(dI);
    std::vector<uint8_t> ref(num_blocks * pb, 0xFF);
    for (int64_t t = 0; t < T; ++t)
      if (slots[t] >= 0)
        encode_indexer_key(kt.data() + t * dI, dI, ref.data() + (slots[t] / kPageTokens) * pb, slots[t] % kPageTokens);
    auto dk = to_device(k);
    auto dslots = to_device(slots);
    std::vector<std::vector<uint8_t>> outs;
    for (int rep = 0; rep < 2; ++rep) {
      auto cache = poisoned<uint8_t>(num_blocks * pb);
      IndexerCacheWriteParams p;
      p.k = dk.data();
      p.slots = dslots.as<int64_t>();
      p.T = T;
      p.dI = dI;
      p.hadamard = hadamard;
      p.cache = cache.data();
      p.num_blocks = num_blocks;
      ML4_ASSERT_OK(indexer_cache_write(p));
      ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
      outs.push_back(to_host<uint8_t>(cache, num_blocks * pb));
    }
    size_t diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) diff += outs[0][i] != ref[i];
    std::printf("indexer keys hadamard=%d: %zu of %zu bytes differ\n", hadamard, diff, ref.size());
    EXPECT_EQ(diff, 0u);
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), ref.size())) << "repeat run differs";
  }
}

// The fused indexer key path (indexer_key_path, issue 19) against the three launches it
// replaces (layer_norm, q_path's NeoX rope on one head, indexer_cache_write) on the same keys:
// the same page bytes. Only LayerNorm's f64 sums run in another order (two values per thread,
// 64 threads, against one value each over 128), ~1e-16 relative: an output byte can differ only
// where that moves an f32 rounding, far below one in these 77 x 128 values. With rope and
// without (NoPE), LeRoPE past its window, a bias, a padded slot; repeat runs identical.
TEST(CudaCacheWrite, IndexerKeyPathEqualsTheThreeLaunches) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(123);
  const int dI = 128, dr = 64;
  const int64_t T = 77, num_blocks = 3;
  std::normal_distribution<float> nd(0.3f, 2.0f);
  std::vector<float> k(T * dI), w(dI), b(dI), inv(dr / 2);
  for (auto& v : k) v = nd(rng);
  for (auto& v : w) v = 0.5f + std::abs(nd(rng)) * 0.3f;
  for (auto& v : b) v = nd(rng) * 0.1f;
  for (int i = 0; i < dr / 2; ++i) inv[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / dr));
  std::vector<int64_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = 3000 + 61 * t;  // past the LeRoPE window below
  const auto slots = random_slots(T, num_blocks * kPageTokens, 7, rng);
  auto dk = to_device(k), dw = to_device(w), db = to_device(b), dinv = to_device(inv), dpos = to_device(pos),
       dslots = to_device(slots);
  const size_t pb = indexer_page_bytes(dI);
  for (bool rope : {true, false}) {
    // The three launches, on a copy of the keys.
    auto kc = to_device(k);
    auto ref = poisoned<uint8_t>(num_blocks * pb);
    ML4_ASSERT_OK(layer_norm({kc.as<float>(), dw.as<float>(), db.as<float>(), T, dI, 1e-6f, kc.as<float>(), nullptr}));
    if (rope) {
      QPathParams q;
      q.q = kc.as<float>();
      q.T = T;
      q.H = 1;
      q.head_stride = dI;
      q.rope_offset = 0;
      q.rope_dim = dr;
      q.positions = dpos.as<int64_t>();
      q.inv_freq = dinv.as<float>();
      q.attn_factor = 1.0625f;
      q.neox = true;
      q.lerope = LeRopeConfig{true, 2048, 4.0};
      ML4_ASSERT_OK(q_path(q));
    }
    IndexerCacheWriteParams wp;
    wp.k = kc.data();
    wp.slots = dslots.as<int64_t>();
    wp.T = T;
    wp.dI = dI;
    wp.cache = ref.data();
    wp.num_blocks = num_blocks;
    ML4_ASSERT_OK(indexer_cache_write(wp));
    ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
    const auto want = to_host<uint8_t>(ref, num_blocks * pb);
    std::vector<std::vector<uint8_t>> outs;
    for (int rep = 0; rep < 2; ++rep) {
      auto cache = poisoned<uint8_t>(num_blocks * pb);
      IndexerKeyPathParams p;
      p.k = dk.as<float>();
      p.T = T;
      p.dI = dI;
      p.ln_w = dw.as<float>();
      p.ln_b = db.as<float>();
      p.eps = 1e-6f;
      p.rope = rope;
      p.rope_rows = {dr, dpos.as<int64_t>(), dinv.as<float>(), 1.0625f, true, 2048, 4.0};
      p.slots = dslots.as<int64_t>();
      p.cache = cache.data();
      p.num_blocks = num_blocks;
      ML4_ASSERT_OK(indexer_key_path(p));
      ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
      outs.push_back(to_host<uint8_t>(cache, num_blocks * pb));
    }
    size_t diff = 0;
    for (size_t i = 0; i < want.size(); ++i) diff += outs[0][i] != want[i];
    std::printf("fused indexer key path rope=%d: %zu of %zu bytes differ from the three launches\n", rope, diff,
                want.size());
    EXPECT_EQ(diff, 0u);
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), want.size())) << "repeat run differs";
  }
  IndexerKeyPathParams bad;
  bad.T = 4;
  bad.dI = 256;
  EXPECT_FALSE(indexer_key_path(bad).ok());  // dI 128 only
}

// The fused latent path (RMSNorm of c, RoPE of kr in place, the slot's bytes: one kernel)
// against the three launches it replaces (rms_norm, q_path's rotation, latent_cache_write), bit
// for bit: the cache bytes, the normalized c and the rotated kr left in ckv. It runs the same
// f32 operations with the same f64 sum partition (256 threads, 4 values a thread) as
// rms_norm_vec_kernel, and the same rotation helpers as q_path_kernel, so no byte may differ.
// Every cache dtype, ML4's shape (r 512, dr 64) and a small one (256, 32), interleaved and
// NeoX pairs, NoPE, LeRoPE past its window, a padded slot; repeat runs identical.
TEST(CudaCacheWrite, LatentKeyPathEqualsTheThreeLaunches) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(321);
  const int64_t T = 37;
  std::normal_distribution<float> nd(0.1f, 1.5f);
  int cases = 0;
  for (const auto& [r, dr] : std::vector<std::pair<int, int>>{{512, 64}, {256, 32}}) {
    const int W = r + dr;
    std::vector<float> ckv(T * W), w(r), inv(dr / 2);
    for (auto& v : ckv) v = nd(rng);
    for (auto& v : w) v = 0.5f + std::abs(nd(rng)) * 0.3f;
    for (int i = 0; i < dr / 2; ++i) inv[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / dr));
    std::vector<int64_t> pos(T);
    for (int64_t t = 0; t < T; ++t) pos[t] = 1500 + 37 * t;  // crosses the LeRoPE window below
    const int64_t num_slots = 2 * kPageTokens;
    const auto slots = random_slots(T, num_slots, 5, rng);
    auto dw = to_device(w), dinv = to_device(inv), dpos = to_device(pos), dslots = to_device(slots);
    for (KvCacheDtype dtype : {KvCacheDtype::kFp8DsMla, KvCacheDtype::kFp8, KvCacheDtype::kBf16}) {
      const size_t tb = latent_token_bytes(dtype, r, dr);
      for (int rope = 0; rope < 3; ++rope) {  // NoPE, interleaved, NeoX
        const float fp8_scale = 0.03125f;
        // The three launches.
        auto ref_ckv = to_device(ckv);
        auto ref_c = poisoned<float>(T * r);
        auto ref_cache = poisoned<uint8_t>(num_slots * tb);
        RmsNormParams np;
        np.x = ref_ckv.as<float>();
        np.w = dw.as<float>();
        np.rows = T;
        np.dim = r;
        np.eps = 1e-6f;
        np.y = ref_c.as<float>();
        np.x_stride = W;
        ML4_ASSERT_OK(rms_norm(np));
        if (rope > 0) {
          QPathParams q;
          q.q = ref_ckv.as<float>();
          q.T = T;
          q.H = 1;
          q.head_stride = W;
          q.rope_offset = r;
          q.rope_dim = dr;
          q.positions = dpos.as<int64_t>();
          q.inv_freq = dinv.as<float>();
          q.attn_factor = 1.0625f;
          q.neox = rope == 2;
          q.lerope = LeRopeConfig{true, 2048, 4.0};
          ML4_ASSERT_OK(q_path(q));
        }
        LatentCacheWriteParams wp;
        wp.c = ref_c.data();
        wp.kr = ref_ckv.as<float>() + r;
        wp.kr_stride = W;
        wp.slots = dslots.as<int64_t>();
        wp.T = T;
        wp.r = r;
        wp.dr = dr;
        wp.dtype = dtype;
        wp.fp8_scale = fp8_scale;
        wp.cache = ref_cache.data();
        wp.num_slots = num_slots;
        ML4_ASSERT_OK(latent_cache_write(wp));
        ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
        const auto want_cache = to_host<uint8_t>(ref_cache, num_slots * tb);
        const auto want_c = to_host<float>(ref_c, T * r);
        const auto want_ckv = to_host<float>(ref_ckv, T * W);
        std::vector<std::vector<uint8_t>> caches;
        for (int rep = 0; rep < 2; ++rep) {
          auto d_ckv = to_device(ckv);
          auto d_c = poisoned<float>(T * r);
          auto cache = poisoned<uint8_t>(num_slots * tb);
          LatentKeyPathParams p;
          p.ckv = d_ckv.as<float>();
          p.ckv_stride = W;
          p.c = d_c.as<float>();
          p.norm_w = dw.as<float>();
          p.eps = 1e-6f;
          p.rope = rope > 0;
          p.neox = rope == 2;
          p.rope_rows = {dr, dpos.as<int64_t>(), dinv.as<float>(), 1.0625f, true, 2048, 4.0};
          p.slots = dslots.as<int64_t>();
          p.T = T;
          p.r = r;
          p.dr = dr;
          p.dtype = dtype;
          p.fp8_scale = fp8_scale;
          p.cache = cache.data();
          p.num_slots = num_slots;
          ML4_ASSERT_OK(latent_key_path(p));
          ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
          caches.push_back(to_host<uint8_t>(cache, num_slots * tb));
          const auto got_c = to_host<float>(d_c, T * r);
          const auto got_ckv = to_host<float>(d_ckv, T * W);
          EXPECT_EQ(0, std::memcmp(got_c.data(), want_c.data(), want_c.size() * 4))
              << "c differs: r " << r << " dtype " << static_cast<int>(dtype) << " rope " << rope;
          EXPECT_EQ(0, std::memcmp(got_ckv.data(), want_ckv.data(), want_ckv.size() * 4))
              << "ckv (rotated kr) differs: r " << r << " rope " << rope;
        }
        size_t diff = 0;
        for (size_t i = 0; i < want_cache.size(); ++i) diff += caches[0][i] != want_cache[i];
        EXPECT_EQ(diff, 0u) << "r " << r << " dtype " << static_cast<int>(dtype) << " rope " << rope;
        EXPECT_EQ(caches[0], caches[1]) << "repeat run differs";
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 18);
  std::printf("fused latent key path: 18 cases (2 shapes x 3 cache dtypes x NoPE / interleaved / NeoX) compared\n");
  LatentKeyPathParams bad;
  bad.T = 4;
  bad.r = 2048;  // more than one value a thread
  EXPECT_FALSE(latent_key_path(bad).ok());
}

TEST(CudaCacheWrite, BadShapesAreErrors) {
  // Argument checks run before any CUDA call, so these hold without a GPU too.
  LatentCacheWriteParams p;
  p.T = 1;
  p.r = 100;  // not a multiple of 128 for fp8_ds_mla
  EXPECT_FALSE(latent_cache_write(p).ok());
  p.r = 512;
  p.c_dtype = DType::kI32;
  EXPECT_FALSE(latent_cache_write(p).ok());
  p.c_dtype = DType::kF32;
  EXPECT_FALSE(latent_cache_write(p).ok());  // null pointers
  IndexerCacheWriteParams q;
  q.T = 1;
  q.dI = 96;
  EXPECT_FALSE(indexer_cache_write(q).ok());
}

}  // namespace
}  // namespace ml4::cuda
