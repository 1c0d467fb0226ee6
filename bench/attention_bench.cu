// Attention-side kernels on the card, each timed (CUDA events, median; gpu_bench_util.h) and
// set against the HBM copy ceiling measured in the same run:
//   1. sparse MLA decode (attention.h): H 16 (ML4 at TP 4) and 64 (TP 1), B = 1..128 tokens,
//      topk 2048, r 512, dr 64, fp8_ds_mla rows at random slots of a 172 MB cache (past the
//      50 MB L2; index sets rotate over >= 256 MB of rows), generic bf16 tensor-core kernel
//      against the dedicated decode kernel (attention_decode.cu).
//        bytes = B * 2048 * (656 + 4) (rows, indices) + B * H * (576 + 512 + 1) * 4 (q, out, lse)
//        flop  = 2 * B * H * 2048 * (576 + 512)
//      Prediction: H 16 is memory-bound (53 FLOP/B): B = 128 moves 174 MB, 41 us at 4.25 TB/s,
//      58 us at the 70% target (needs ~160 TFLOP/s of mma.sync); H 64 is compute-bound
//      (212 FLOP/B): 36.5 GFLOP at B = 128, ~90 us at ~400 TFLOP/s of mma.sync. B = 1 is latency
//      bound (one tile chain per split, launch + combine ~10 us).
//   2. dense MLA decode at 8k context, B = 1 and 32 (models without DSA).
//   3. indexer scores + top-k 2048 at 60k context, HI = 32 (ML4) and 64 (DeepSeek-V3.2):
//        bytes = B * 60k * 132 (keys) + 2 * B * 60k * 4 (scores written, read by top-k)
//        flop  = 2 * B * 60k * HI * 128
//   4. cache writes: 4096 latent rows (fp8_ds_mla) and 4096 indexer keys.
//   0. sparse MLA prefill (issue 18) at the ml4-slice-4 shapes, decode kernel against the wgmma
//      prefill kernel (see the section).
// ML4_ATTN_BENCH=prefill stops after section 0, ML4_ATTN_BENCH=sparse after section 1.
// Output lines start with "ATTN" (one per measurement).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <numeric>
#include <utility>
#include <random>
#include <vector>

#include "gpu_bench_util.h"
#include "kv/indexer_layout.h"
#include "kv/latent_layout.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/cache_write.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/indexer.h"
#include "ops/cuda/topk.h"

using namespace ml4;
using namespace ml4::cuda;

namespace {

DeviceBuffer must_alloc(size_t bytes) {
  auto b = DeviceBuffer::alloc(std::max<size_t>(bytes, 16));
  BENCH_CHECK(b.status());
  return std::move(b).value();
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer b = must_alloc(v.size() * sizeof(T));
  BENCH_CHECK(b.upload(v.data(), v.size() * sizeof(T)));
  return b;
}

}  // namespace

int main() {
  if (!device_available()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreate(&s));
  std::mt19937 rng(1);

  double hbm = 0;  // GB/s
  {
    const size_t bytes = size_t{1} << 30;
    DeviceBuffer a = must_alloc(bytes), b = must_alloc(bytes);
    BENCH_CHECK(fill_uniform_f32(a.as<float>(), bytes / 4, 1, -1, 1, s));
    const double ms = bench::median_ms(s, 3, 20, [&](int) {
      BENCH_CUDA(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s));
    });
    hbm = 2.0 * bytes / (ms * 1e6);
    std::printf("ATTN ceiling hbm_copy %.0f GB/s (1 GiB D2D, read + write)\n", hbm);
  }

  // A fp8_ds_mla cache of 262144 slots filled through the cache-write kernel.
  const int H = 64, r = 512, dr = 64, topk = 2048;  // H: the dense section
  const int64_t num_slots = 262144;
  const size_t tb = latent_token_bytes(KvCacheDtype::kFp8DsMla, r, dr);
  DeviceBuffer cache = must_alloc(num_slots * tb);
  {
    const int64_t chunk = 65536;
    DeviceBuffer c = must_alloc(chunk * r * 4), kr = must_alloc(chunk * dr * 4), sl = must_alloc(chunk * 8);
    std::vector<int64_t> slots(chunk);
    for (int64_t base = 0; base < num_slots; base += chunk) {
      BENCH_CHECK(fill_uniform_f32(c.as<float>(), chunk * r, 10 + base, -2, 2, s));
      BENCH_CHECK(fill_uniform_f32(kr.as<float>(), chunk * dr, 20 + base, -2, 2, s));
      std::iota(slots.begin(), slots.end(), base);
      BENCH_CHECK(sl.upload(slots.data(), chunk * 8));
      LatentCacheWriteParams w;
      w.c = c.data();
      w.kr = kr.data();
      w.slots = sl.as<int64_t>();
      w.T = chunk;
      w.cache = cache.data();
      w.num_slots = num_slots;
      w.stream = s;
      BENCH_CHECK(latent_cache_write(w));
      if (base == 0) {
        const double ms = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(latent_cache_write(w)); });
        const double bytes = chunk * (r + dr) * 4.0 + chunk * (8.0 + tb);
        std::printf("ATTN cache_write latent T=%lld: %.3f ms, %.0f GB/s (%.0f%% of copy)\n",
                    static_cast<long long>(chunk), ms, bytes / (ms * 1e6), 100 * bytes / (ms * 1e6) / hbm);
      }
    }
    BENCH_CUDA(cudaStreamSynchronize(s));
  }

  // ML4_ATTN_BENCH=splits jumps to section 1's split sweep (decode steps of ml4: H 64, B <= 4).
  const char* only_env = std::getenv("ML4_ATTN_BENCH");
  const bool splits_only = only_env && std::string(only_env) == "splits";
  if (splits_only) goto sparse_decode;
  // 0. Sparse MLA prefill (issue 18): one causal sequence of T = 4096 / 8192 tokens (ml4-slice-4:
  // H 64, topk 2048) on shuffled pages of the cache; token p sees min(p + 1, 2048) keys (a random
  // 2048-subset of [0, p] beyond). The decode kernel (prefill_kernel = false, today's prefill
  // path) against the wgmma prefill kernel (attention_prefill.cu, its pre-pass included) in its
  // tile and its pair schedule (MlaAttentionParams::prefill_pairs), same inputs, same run.
  //   flop = 2 * H * (576 + 512) * sum_t n_t   (0.876 TFLOP at 4096, 2.04 TFLOP at 8192)
  // ML4_MLA_PREFILL_SKIP=mask leaves pieces of the prefill kernel out (attention_prefill.cu; wrong
  // results, for the time breakdown in docs/BENCHMARKS.md); ML4_ATTN_PREFILL_SKIPS="0,64,48,..."
  // times the prefill kernel once per mask in the same process.
  {
    std::vector<std::string> variants;  // skip masks
    if (const char* v = std::getenv("ML4_ATTN_PREFILL_SKIPS")) {
      const std::string list = v;
      for (size_t b = 0; b < list.size();) {
        size_t e = list.find(',', b);
        if (e == std::string::npos) e = list.size();
        variants.push_back(list.substr(b, e - b));
        b = e + 1;
      }
    }
    std::vector<int32_t> page_perm(num_slots / kPageTokens);
    std::iota(page_perm.begin(), page_perm.end(), 0);
    std::shuffle(page_perm.begin(), page_perm.end(), rng);
    for (int64_t T : {4096, 8192}) {
      std::vector<int32_t> idx(T * topk, -1), idx_len(T);
      std::vector<int32_t> pos;
      double keys = 0;
      for (int64_t t = 0; t < T; ++t) {
        const int n = static_cast<int>(std::min<int64_t>(t + 1, topk));
        pos.resize(t + 1);
        std::iota(pos.begin(), pos.end(), 0);
        for (int j = 0; j < n && n < t + 1; ++j)  // partial Fisher-Yates: a random n-subset
          std::swap(pos[j], pos[std::uniform_int_distribution<int64_t>(j, t)(rng)]);
        for (int j = 0; j < n; ++j)
          idx[t * topk + j] = page_perm[pos[j] / kPageTokens] * kPageTokens + pos[j] % kPageTokens;
        idx_len[t] = n;
        keys += n;
      }
      DeviceBuffer d_idx = upload(idx), d_len = upload(idx_len);
      DeviceBuffer ql = must_alloc(size_t{4} * T * H * r), qr = must_alloc(size_t{4} * T * H * dr);
      DeviceBuffer hs = must_alloc(size_t{4} * T * H), out = must_alloc(size_t{4} * T * H * r),
                   lse = must_alloc(4 * T * H);
      BENCH_CHECK(fill_uniform_f32(ql.as<float>(), T * H * r, 3, -1, 1, s));
      BENCH_CHECK(fill_uniform_f32(qr.as<float>(), T * H * dr, 4, -1, 1, s));
      BENCH_CHECK(fill_uniform_f32(hs.as<float>(), T * H, 5, 0.03f, 0.05f, s));
      MlaAttentionParams p;
      p.q_lat = ql.as<float>();
      p.q_rope = qr.as<float>();
      p.head_scale = hs.as<float>();
      p.T = T;
      p.H = H;
      p.cache = cache.data();
      p.num_slots = num_slots;
      p.indices = d_idx.as<int32_t>();
      p.topk = topk;
      p.index_lengths = d_len.as<int32_t>();
      p.out_lat = out.as<float>();
      p.lse = lse.as<float>();
      p.stream = s;
      p.math = MlaMath::kBf16TensorCore;
      p.scratch_pages = (T + kPageTokens - 1) / kPageTokens;  // the sequence's pages
      const double flop = 2.0 * H * (576 + 512) * keys;
      for (int mode : {0, 1, 2}) {  // decode kernel, prefill kernel's tile schedule, its pair schedule
        const bool pre = mode > 0;
        p.prefill_kernel = pre;
        p.prefill_pairs = mode == 2;
        const size_t wsb = mla_attention_workspace_bytes(p);
        DeviceBuffer ws = must_alloc(wsb);
        p.workspace = ws.data();
        p.workspace_bytes = wsb;
        const size_t runs = mode == 1 ? std::max<size_t>(variants.size(), 1) : 1;  // skips: tile schedule
        for (size_t v = 0; v < runs; ++v) {
          std::string label;
          if (mode == 1 && !variants.empty()) {
            setenv("ML4_MLA_PREFILL_SKIP", variants[v].c_str(), 1);
            label = " skip=" + variants[v];
          }
          const double ms = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(mla_attention(p)); });
          std::printf("ATTN sparse_mla_prefill %s%s H=%d T=%lld topk=%d (mean %.0f keys): %.3f ms, %.1f TFLOP/s "
                      "(ws %.1f MB)\n",
                      mode == 2 ? "prefill-kernel-pairs" : pre ? "prefill-kernel-tiles" : "decode-kernel", label.c_str(), H, static_cast<long long>(T), topk,
                      keys / T, ms, flop / (ms * 1e9), wsb / 1e6);
        }
        if (mode == 1 && !variants.empty()) unsetenv("ML4_MLA_PREFILL_SKIP");
      }
    }
  }
  // 0b. The indexer's FP8 scores of a causal prefill (issue 18): one sequence of T = 4096 / 8192
  // tokens, token t scoring keys [0, t] (64 or 32 heads x 128), one token a block against four
  // tokens a block sharing their key pages (IndexerScoresParams::tokens_per_block) and the wgmma
  // kernel (IndexerMath::kFp8Wgmma), same inputs, same run.
  //   flop = 2 * HI * 128 * sum_t (t + 1)   (137 GFLOP at 4096 x 64 heads, 550 GFLOP at 8192)
  for (auto [T, HIx] : {std::pair<int64_t, int>{4096, 64}, {8192, 64}, {4096, 32}}) {  // ml4-slice-4: 32 heads
    const int dIx = 128;
    const int64_t npages = T / kPageTokens;
    DeviceBuffer ic = must_alloc(static_cast<size_t>(npages) * indexer_page_bytes(dIx));
    BENCH_CHECK(fill_uniform_e4m3(ic.data(), static_cast<int64_t>(npages * indexer_page_bytes(dIx)), 43, -100, 100, s));
    std::vector<int32_t> bt(npages), seq(T, 0), len(T);
    std::iota(bt.begin(), bt.end(), 0);
    std::shuffle(bt.begin(), bt.end(), rng);
    std::iota(len.begin(), len.end(), 1);
    DeviceBuffer d_bt = upload(bt), d_seq = upload(seq), d_len = upload(len);
    DeviceBuffer q = must_alloc(size_t{1} * T * HIx * dIx), qs = must_alloc(size_t{4} * T * HIx),
                 w = must_alloc(size_t{4} * T * HIx), sc = must_alloc(size_t{4} * T * T);
    BENCH_CHECK(fill_uniform_e4m3(q.data(), T * HIx * dIx, 44, -100, 100, s));
    BENCH_CHECK(fill_uniform_f32(qs.as<float>(), T * HIx, 45, 0.01f, 0.02f, s));
    BENCH_CHECK(fill_uniform_f32(w.as<float>(), T * HIx, 46, -0.1f, 0.1f, s));
    IndexerScoresParams ip;
    ip.q = q.data();
    ip.q_scale = qs.as<float>();
    ip.weights = w.as<float>();
    ip.cache = ic.data();
    ip.num_blocks = npages;
    ip.block_table = d_bt.as<int32_t>();
    ip.block_table_stride = npages;
    ip.seq_of_token = d_seq.as<int32_t>();
    ip.lengths = d_len.as<int32_t>();
    ip.T = T;
    ip.HI = HIx;
    ip.max_length = static_cast<int>(T);
    ip.scores = sc.as<float>();
    ip.scores_stride = T;
    ip.math = IndexerMath::kFp8TensorCore;
    ip.stream = s;
    const double flop = 2.0 * HIx * dIx * (double(T) * (T + 1) / 2);
    for (int tq : {1, 4, 0}) {  // 0: the wgmma kernel (IndexerMath::kFp8Wgmma)
      ip.tokens_per_block = tq;
      ip.math = tq == 0 ? IndexerMath::kFp8Wgmma : IndexerMath::kFp8TensorCore;
      const double ms = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(indexer_scores(ip)); });
      std::printf("ATTN indexer_prefill_scores T=%lld HI=%d %s: %.3f ms, %.1f TFLOP/s\n", static_cast<long long>(T), HIx,
                  tq == 0 ? "wgmma" : tq == 1 ? "tokens_per_block=1" : "tokens_per_block=4", ms, flop / (ms * 1e9));
    }
  }
  if (const char* only = std::getenv("ML4_ATTN_BENCH"); only && std::string(only) == "prefill") {
    BENCH_CUDA(cudaStreamDestroy(s));
    return 0;
  }

sparse_decode:
  // 1. Sparse decode: the generic bf16 tensor-core kernel (decode_kernel = false) against the
  // dedicated decode kernel (attention_decode.cu), same inputs, same run. Index sets rotate so
  // that the rows read by successive repetitions (>= 256 MB in all) do not sit in the 50 MB L2.
  for (int Hs : {16, 64}) {
    for (int B : splits_only ? std::vector<int>{1, 2, 4} : std::vector<int>{1, 8, 32, 64, 128}) {
      const size_t per_set = static_cast<size_t>(B) * topk;
      const int nsets = static_cast<int>(std::clamp<double>(256e6 / (per_set * tb), 1, 64));
      std::vector<int32_t> idx(per_set * nsets);
      std::uniform_int_distribution<int32_t> ud(0, static_cast<int32_t>(num_slots - 1));
      for (auto& v : idx) v = ud(rng);
      DeviceBuffer d_idx = upload(idx);
      DeviceBuffer ql = must_alloc(size_t{4} * B * Hs * r), qr = must_alloc(size_t{4} * B * Hs * dr);
      DeviceBuffer hs = must_alloc(size_t{4} * B * Hs), out = must_alloc(size_t{4} * B * Hs * r),
                   lse = must_alloc(4 * B * Hs);
      BENCH_CHECK(fill_uniform_f32(ql.as<float>(), int64_t{B} * Hs * r, 3, -1, 1, s));
      BENCH_CHECK(fill_uniform_f32(qr.as<float>(), int64_t{B} * Hs * dr, 4, -1, 1, s));
      BENCH_CHECK(fill_uniform_f32(hs.as<float>(), int64_t{B} * Hs, 5, 0.03f, 0.05f, s));
      MlaAttentionParams p;
      p.q_lat = ql.as<float>();
      p.q_rope = qr.as<float>();
      p.head_scale = hs.as<float>();
      p.T = B;
      p.H = Hs;
      p.cache = cache.data();
      p.num_slots = num_slots;
      p.indices = d_idx.as<int32_t>();
      p.topk = topk;
      p.out_lat = out.as<float>();
      p.lse = lse.as<float>();
      p.stream = s;
      p.math = MlaMath::kBf16TensorCore;
      const size_t wsb = mla_attention_workspace_bytes(p);
      const int splits = wsb ? static_cast<int>(wsb / (size_t{4} * B * Hs * (r + 1))) : 1;
      DeviceBuffer ws = must_alloc(wsb);
      p.workspace = ws.data();
      p.workspace_bytes = wsb;
      // Rows (+ their 4-byte indices), q in, out and lse out; split partials not counted.
      const double bytes = double(B) * topk * (tb + 4) + double(B) * Hs * ((r + dr) * 4 + r * 4 + 4);
      const double flop = 2.0 * B * Hs * topk * (576 + 512);
      if (splits_only) {  // the decode kernel at forced split counts (0: choose_splits')
        if (Hs != 64 || B > 4) continue;
        for (int ns : {0, 4, 8, 16, 32, 64}) {
          p.num_splits = ns;
          const double ms = bench::median_ms(s, 3, 50, [&](int i) {
            p.indices = d_idx.as<int32_t>() + static_cast<size_t>(i % nsets) * per_set;
            BENCH_CHECK(mla_attention(p));
          });
          std::printf("ATTN sparse_mla_decode splits H=%d B=%d topk=%d num_splits=%d: %.4f ms\n", Hs, B, topk, ns, ms);
        }
        p.num_splits = 0;
        continue;
      }
      for (bool dec : {false, true}) {
        p.decode_kernel = dec;
        const double ms = bench::median_ms(s, 3, 20, [&](int i) {
          p.indices = d_idx.as<int32_t>() + static_cast<size_t>(i % nsets) * per_set;
          BENCH_CHECK(mla_attention(p));
        });
        std::printf("ATTN sparse_mla_decode %s H=%d B=%d topk=%d splits=%d: %.4f ms, %.0f GB/s (%.1f%% of copy), "
                    "%.1f TFLOP/s, floor %.4f ms\n",
                    dec ? "decode-kernel" : "generic-tc", Hs, B, topk, splits, ms, bytes / (ms * 1e6),
                    100 * bytes / (ms * 1e6) / hbm, flop / (ms * 1e9), bytes / (hbm * 1e6));
      }
    }
  }
  if (splits_only || (only_env && std::string(only_env) == "sparse")) {
    BENCH_CUDA(cudaStreamDestroy(s));
    return 0;
  }

  // 2. Dense decode, 8k context.
  for (int B : {1, 32}) {
    const int ctx = 8192, pages = ctx / kPageTokens;
    std::vector<int32_t> bt(static_cast<size_t>(B) * pages), seq(B), len(B, ctx);
    std::uniform_int_distribution<int32_t> up(0, static_cast<int32_t>(num_slots / kPageTokens - 1));
    for (auto& v : bt) v = up(rng);
    std::iota(seq.begin(), seq.end(), 0);
    DeviceBuffer d_bt = upload(bt), d_seq = upload(seq), d_len = upload(len);
    DeviceBuffer ql = must_alloc(size_t{4} * B * H * r), qr = must_alloc(size_t{4} * B * H * dr);
    DeviceBuffer hs = must_alloc(size_t{4} * B * H), out = must_alloc(size_t{4} * B * H * r), lse = must_alloc(4 * B * H);
    BENCH_CHECK(fill_uniform_f32(ql.as<float>(), int64_t{B} * H * r, 3, -1, 1, s));
    BENCH_CHECK(fill_uniform_f32(qr.as<float>(), int64_t{B} * H * dr, 4, -1, 1, s));
    BENCH_CHECK(fill_uniform_f32(hs.as<float>(), int64_t{B} * H, 5, 0.03f, 0.05f, s));
    MlaAttentionParams p;
    p.q_lat = ql.as<float>();
    p.q_rope = qr.as<float>();
    p.head_scale = hs.as<float>();
    p.T = B;
    p.H = H;
    p.cache = cache.data();
    p.num_slots = num_slots;
    p.block_table = d_bt.as<int32_t>();
    p.block_table_stride = pages;
    p.seq_of_token = d_seq.as<int32_t>();
    p.lengths = d_len.as<int32_t>();
    p.max_length = ctx;
    p.out_lat = out.as<float>();
    p.lse = lse.as<float>();
    p.stream = s;
    const size_t wsb = mla_attention_workspace_bytes(p);
    DeviceBuffer ws = must_alloc(wsb);
    p.workspace = ws.data();
    p.workspace_bytes = wsb;
    for (MlaMath math : {MlaMath::kF32, MlaMath::kBf16TensorCore}) {
      p.math = math;
      const double ms = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(mla_attention(p)); });
      const double bytes = double(B) * ctx * tb;
      const double flop = 2.0 * B * H * ctx * (576 + 512);
      std::printf("ATTN dense_mla_decode %s B=%d ctx=%d H=%d: %.4f ms, %.0f GB/s (%.1f%% of copy), %.1f TFLOP/s\n",
                  math == MlaMath::kF32 ? "f32" : "bf16-tc", B, ctx, H, ms, bytes / (ms * 1e6),
                  100 * bytes / (ms * 1e6) / hbm, flop / (ms * 1e9));
    }
  }

  // 3. Indexer + top-k at 60k context.
  {
    const int ctx = 61440, pages = ctx / kPageTokens, dI = 128;
    const size_t pb = indexer_page_bytes(dI);
    const int64_t ipages = 4096;  // 35 MB of keys
    DeviceBuffer icache = must_alloc(ipages * pb);
    {
      const int64_t n = ipages * kPageTokens;
      DeviceBuffer k = must_alloc(n * dI * 4), sl = must_alloc(n * 8);
      BENCH_CHECK(fill_uniform_f32(k.as<float>(), n * dI, 30, -2, 2, s));
      std::vector<int64_t> slots(n);
      std::iota(slots.begin(), slots.end(), 0);
      BENCH_CHECK(sl.upload(slots.data(), n * 8));
      IndexerCacheWriteParams w;
      w.k = k.data();
      w.slots = sl.as<int64_t>();
      w.T = 4096;
      w.cache = icache.data();
      w.num_blocks = ipages;
      w.stream = s;
      const double ms = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(indexer_cache_write(w)); });
      std::printf("ATTN cache_write indexer T=4096 (Hadamard + FP8): %.4f ms\n", ms);
      w.T = n;
      BENCH_CHECK(indexer_cache_write(w));
      BENCH_CUDA(cudaStreamSynchronize(s));
    }
    for (int HI : {32, 64}) {
      for (int B : {1, 8, 32, 64}) {
        std::vector<int32_t> bt(static_cast<size_t>(B) * pages), seq(B), len(B, ctx);
        for (int b = 0; b < B; ++b)
          for (int i = 0; i < pages; ++i) bt[static_cast<size_t>(b) * pages + i] = static_cast<int32_t>((b * 977 + i * 7) % ipages);
        std::iota(seq.begin(), seq.end(), 0);
        DeviceBuffer d_bt = upload(bt), d_seq = upload(seq), d_len = upload(len);
        DeviceBuffer q = must_alloc(size_t{1} * B * HI * dI), qs = must_alloc(size_t{4} * B * HI), w = must_alloc(size_t{4} * B * HI);
        BENCH_CHECK(fill_uniform_e4m3(q.data(), int64_t{B} * HI * dI, 40, -100, 100, s));
        BENCH_CHECK(fill_uniform_f32(qs.as<float>(), int64_t{B} * HI, 41, 0.01f, 0.02f, s));
        BENCH_CHECK(fill_uniform_f32(w.as<float>(), int64_t{B} * HI, 42, -0.1f, 0.1f, s));
        DeviceBuffer scores = must_alloc(size_t{4} * B * ctx), sel = must_alloc(size_t{4} * B * topk);
        IndexerScoresParams ip;
        ip.q = q.data();
        ip.q_scale = qs.as<float>();
        ip.weights = w.as<float>();
        ip.cache = icache.data();
        ip.num_blocks = ipages;
        ip.block_table = d_bt.as<int32_t>();
        ip.block_table_stride = pages;
        ip.seq_of_token = d_seq.as<int32_t>();
        ip.lengths = d_len.as<int32_t>();
        ip.T = B;
        ip.HI = HI;
        ip.max_length = ctx;
        ip.scores = scores.as<float>();
        ip.scores_stride = ctx;
        ip.stream = s;
        TopkParams tp;
        tp.scores = scores.as<float>();
        tp.scores_stride = ctx;
        tp.lengths = d_len.as<int32_t>();
        tp.T = B;
        tp.k = topk;
        tp.slots = sel.as<int32_t>();
        tp.block_table = d_bt.as<int32_t>();
        tp.block_table_stride = pages;
        tp.seq_of_token = d_seq.as<int32_t>();
        tp.stream = s;
        ip.math = IndexerMath::kFp8TensorCore;
        const double ms_tc = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(indexer_scores(ip)); });
        ip.math = IndexerMath::kF32;
        const double ms_i = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(indexer_scores(ip)); });
        const double ms_k = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(ml4::cuda::topk(tp)); });
        const double bytes = double(B) * ctx * 132 + 2.0 * B * ctx * 4;
        const double flop = 2.0 * B * ctx * HI * dI;
        std::printf("ATTN indexer_topk ctx=%d HI=%d B=%d: indexer %.4f ms (%.1f TFLOP/s), topk %.4f ms, total %.4f ms, "
                    "%.0f GB/s (%.1f%% of copy), floor %.4f ms\n",
                    ctx, HI, B, ms_i, flop / (ms_i * 1e9), ms_k, ms_i + ms_k, bytes / ((ms_i + ms_k) * 1e6),
                    100 * bytes / ((ms_i + ms_k) * 1e6) / hbm, bytes / (hbm * 1e6));
        std::printf("ATTN indexer_fp8_tc ctx=%d HI=%d B=%d: indexer %.4f ms (%.1f TFLOP/s), + topk %.4f ms, %.0f GB/s "
                    "(%.1f%% of copy)\n",
                    ctx, HI, B, ms_tc, flop / (ms_tc * 1e9), ms_tc + ms_k, bytes / ((ms_tc + ms_k) * 1e6),
                    100 * bytes / ((ms_tc + ms_k) * 1e6) / hbm);
      }
    }
  }
  BENCH_CUDA(cudaStreamDestroy(s));
  return 0;
}
