// HiSparse (SYSTEM.md S12) on the H200: the UVA gather against a host copy (bytes equal), and
// the CUDA runner with its latent cache in pinned host memory and attention through hot
// buffers against the CUDA runner without offload: logits bit for bit equal over chunked
// prefill (host-pool reads), decode and verification-sized steps (hot buffers, rows evicted
// and reloaded) and a rollback, on ml4-tiny (KV-sharing consumers, indexer reusers) and on the
// trained ml4-small at a context of 12 x its hot buffer; then through the engine, with
// preemption and aborts, and no hot row or region left behind.
#if defined(ML4_WITH_CUDA)
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "cuda_test_util.h"
#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "ops/cuda/hisparse.h"
#include "runtime/cuda/cuda_runner.h"
#include "runtime/test_models.h"

namespace ml4::cuda {
namespace {

#define ML4_ASSERT_ASSIGN(lhs, rexpr)                          \
  auto lhs##_made = (rexpr);                                   \
  ASSERT_TRUE(lhs##_made.ok()) << lhs##_made.status().message(); \
  auto lhs = std::move(lhs##_made).value()

TEST(CudaHiSparse, GatherCopiesTheRowsItIsGiven) {
  ML4_REQUIRE_GPU();
  for (int64_t row_bytes : {656, 320, 100}) {  // fp8_ds_mla, ml4-small bf16, an unaligned size
    const int64_t pool_rows = 5000, hot_rows = 700, n = 600;
    ML4_ASSERT_ASSIGN(pool, DeviceBuffer::alloc_host_mapped(pool_rows * row_bytes));
    ASSERT_TRUE(pool.host());
    std::mt19937 rng(static_cast<uint32_t>(row_bytes));
    auto* p = pool.as<uint8_t>();
    for (int64_t i = 0; i < pool_rows * row_bytes; ++i) p[i] = static_cast<uint8_t>(rng());
    ML4_ASSERT_ASSIGN(hot, DeviceBuffer::alloc(hot_rows * row_bytes));
    ML4_ASSERT_OK(hot.fill_bytes(0xAB));
    std::vector<int64_t> src(n);
    std::vector<int32_t> dst(n);
    std::vector<int32_t> rows(hot_rows);
    for (int32_t i = 0; i < hot_rows; ++i) rows[i] = i;
    std::shuffle(rows.begin(), rows.end(), rng);
    for (int64_t i = 0; i < n; ++i) src[i] = static_cast<int64_t>(rng() % pool_rows), dst[i] = rows[i];
    src[7] = pool_rows;  // out of range: skipped
    ML4_ASSERT_ASSIGN(dsrc, DeviceBuffer::alloc(n * 8));
    ML4_ASSERT_ASSIGN(ddst, DeviceBuffer::alloc(n * 4));
    ML4_ASSERT_OK(dsrc.upload(src.data(), n * 8));
    ML4_ASSERT_OK(ddst.upload(dst.data(), n * 4));
    HotGatherParams g{pool.as<uint8_t>(), hot.as<uint8_t>(), dsrc.as<int64_t>(), ddst.as<int32_t>(), n, row_bytes,
                      pool_rows, hot_rows, nullptr};
    ML4_ASSERT_OK(hot_gather(g));
    ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
    std::vector<uint8_t> out(hot_rows * row_bytes);
    ML4_ASSERT_OK(hot.download(out.data(), out.size()));
    std::vector<uint8_t> want(hot_rows * row_bytes, 0xAB);
    for (int64_t i = 0; i < n; ++i)
      if (i != 7) std::memcpy(want.data() + dst[i] * row_bytes, p + src[i] * row_bytes, row_bytes);
    EXPECT_EQ(out, want) << row_bytes << "-byte rows";
  }
}

std::unique_ptr<CudaRunner> runner(const std::string& dir, const std::string& kv, bool hisparse, int slots,
                                   bool exact = false, bool overlap = true) {
  CudaRunnerOptions o;
  o.overlap_indexer = overlap;
  o.base.kv_cache_dtype = kv;
  o.base.kv_cache_bytes = 256ll << 20;
  o.base.max_num_seqs = 4;
  o.cuda_graphs = false;  // compare one launch sequence with the other
  o.exact_activations = exact;
  if (hisparse) {
    o.base.hisparse.enabled = true;
    o.base.hisparse.host_pool_bytes = 256ll << 20;
    o.base.hisparse.hot_slots_per_request = slots;
  }
  auto r = CudaRunner::load(dir, o);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : nullptr;
}

double max_abs_diff(const StepOutput& a, const StepOutput& b) {
  double m = 0;
  for (size_t i = 0; i < a.logits.size() && i < b.logits.size(); ++i)
    for (size_t j = 0; j < a.logits[i].size() && j < b.logits[i].size(); ++j)
      m = std::max(m, std::abs(static_cast<double>(a.logits[i][j]) - b.logits[i][j]));
  return m;
}

bool bit_equal(const StepOutput& a, const StepOutput& b) {
  if (a.logits.size() != b.logits.size()) return false;
  for (size_t i = 0; i < a.logits.size(); ++i)
    if (a.logits[i].size() != b.logits[i].size() ||
        std::memcmp(a.logits[i].data(), b.logits[i].data(), a.logits[i].size() * 4) != 0)
      return false;
  return true;
}

// Three sequences: chunked prefill, `decode` single-token steps, then 3-token steps of which
// sequence 0 keeps one (its other two rows are rewritten by the next step).
void compare(const std::string& dir, const std::string& kv, int slots, std::vector<int> prompt_len, int chunk,
             int decode) {
  // HiSparse steps run serially (the indexer is not overlapped on the side stream: the
  // selection is read back inside the layer), so the reference runs serially too; the
  // overlapped runner is compared as well, to show the overlap itself changes nothing.
  auto plain = runner(dir, kv, false, 0, false, false);
  auto overlapped = runner(dir, kv, false, 0, false, true);
  auto hs = runner(dir, kv, true, slots);
  ASSERT_TRUE(plain && hs && overlapped);
  const int V = plain->config().vocab_size;
  const int blocks = static_cast<int>((*std::max_element(prompt_len.begin(), prompt_len.end()) + decode + 64) / 64 + 1);
  std::mt19937 rng(17);
  auto tok = [&] { return static_cast<int32_t>(3 + rng() % (V - 3)); };
  std::vector<std::vector<int32_t>> prompts(3);
  for (int i = 0; i < 3; ++i)
    for (int p = 0; p < prompt_len[i]; ++p) prompts[i].push_back(tok());
  std::vector<int64_t> pos(3, 0);
  int steps = 0, differ = 0, differ_overlap = 0, first = -1;
  double worst = 0, worst_overlap = 0;
  auto run = [&](const StepInput& in) {
    auto a = plain->execute(in);
    auto b = hs->execute(in);
    auto c = overlapped->execute(in);
    ASSERT_TRUE(a.ok()) << a.status().message();
    ASSERT_TRUE(b.ok()) << b.status().message();
    ASSERT_TRUE(c.ok()) << c.status().message();
    if (!bit_equal(*a, *b)) {
      ++differ;
      if (first < 0) first = steps;
      worst = std::max(worst, max_abs_diff(*a, *b));
    }
    if (!bit_equal(*a, *c)) ++differ_overlap, worst_overlap = std::max(worst_overlap, max_abs_diff(*a, *c));
    ++steps;
  };
  while (pos[0] < prompt_len[0] || pos[1] < prompt_len[1] || pos[2] < prompt_len[2]) {
    StepInput in;
    for (int i = 0; i < 3; ++i) {
      if (pos[i] >= prompt_len[i]) continue;
      const int64_t n = std::min<int64_t>(chunk, prompt_len[i] - pos[i]);
      std::vector<int32_t> c(prompts[i].begin() + pos[i], prompts[i].begin() + pos[i] + n);
      in.seqs.push_back(::ml4::testing::seq_step(*plain, i, c, pos[i], i * blocks, blocks, pos[i] + n == prompt_len[i] ? 1 : 0));
      pos[i] += n;
    }
    run(in);
  }
  for (int s = 0; s < decode; ++s) {
    StepInput in;
    for (int i = 0; i < 3; ++i) in.seqs.push_back(::ml4::testing::seq_step(*plain, i, {tok()}, pos[i]++, i * blocks, blocks, 1));
    run(in);
  }
  for (int s = 0; s < 8; ++s) {
    StepInput in;
    for (int i = 0; i < 3; ++i) in.seqs.push_back(::ml4::testing::seq_step(*plain, i, {tok(), tok(), tok()}, pos[i], i * blocks, blocks, 3));
    run(in);
    for (int i = 0; i < 3; ++i) pos[i] += i == 0 ? 1 : 3;
  }
  const HiSparseState& st = *hs->hisparse();
  std::printf("%s kv %s, %d hot rows: %d steps, %d with different logits (first: step %d, max |diff| %.3g; the "
              "overlapped runner: %d, %.3g); hot layer-steps %lld, direct %lld, rows "
              "loaded %lld, hits %lld; host pool %.1f MiB, hot buffers %.1f MiB\n",
              dir.c_str(), kv.c_str(), slots, steps, differ, first, worst, differ_overlap, worst_overlap,
              static_cast<long long>(st.hot_layers),
              static_cast<long long>(st.direct_layers), static_cast<long long>(st.loads),
              static_cast<long long>(st.hits), hs->host_kv_bytes() / 1048576.0, hs->hot_bytes() / 1048576.0);
  EXPECT_EQ(differ, 0);
  EXPECT_GT(st.hot_layers, 0);
  EXPECT_GT(st.loads, 3 * st.layers() * st.slots());  // more rows moved than the buffers hold
  for (int i = 0; i < 3; ++i) hs->release(i);
  EXPECT_EQ(st.regions_in_use(), 0);
  EXPECT_EQ(st.resident_rows(), 0);
}

TEST(CudaHiSparse, Ml4TinyLogitsEqualWithoutOffload) {
  ML4_REQUIRE_GPU();
  const std::string dir = ::ml4::testing::test_model("ml4-tiny", 11, "bf16");
  for (const char* kv : {"fp8_ds_mla", "bf16"}) compare(dir, kv, 48, {300, 200, 257}, 100, 40);
}

TEST(CudaHiSparse, Ml4SmallLongContextLogitsEqualWithoutOffload) {
  ML4_REQUIRE_GPU();
  compare(std::string(ML4_SOURCE_DIR) + "/assets/ml4-small", "bf16", 512, {6144, 4000, 5000}, 1024, 48);
}

// Through the engine with batch-invariant numerics (greedy tokens then do not depend on the
// batch): a host pool of 14 blocks for 4 running requests forces preemption; a fifth of the
// requests of a second load are aborted; nothing stays behind.
TEST(CudaHiSparse, EngineGreedyEqualsWithoutOffloadUnderPreemptionAndAborts) {
  ML4_REQUIRE_GPU();
  const std::string dir = ::ml4::testing::test_model("ml4-tiny", 11, "bf16");
  auto plain = runner(dir, "fp8_ds_mla", false, 0, true, false);
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "fp8_ds_mla";
  o.base.kv_cache_bytes = 256ll << 20;
  o.base.max_num_seqs = 4;
  o.exact_activations = true;
  o.cuda_graphs = false;
  o.base.hisparse.enabled = true;
  int64_t latent_block = 0;
  for (const auto& g : plain->cache_groups())
    if (g.name == "latent") latent_block = g.bytes_per_token * g.page_tokens;
  o.base.hisparse.host_pool_bytes = latent_block * 14;
  o.base.hisparse.hot_slots_per_request = 32;
  auto made = CudaRunner::load(dir, o);
  ASSERT_TRUE(made.ok()) << made.status().message();
  auto hs = std::move(made).value();
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 10; ++i) {
    std::vector<int32_t> p;
    const int len = 150 + static_cast<int>(rng() % 250);
    for (int k = 0; k < len; ++k) p.push_back(3 + static_cast<int32_t>(rng() % 500));
    ps.push_back(p);
  }
  auto run = [&](ModelRunner* r, int64_t* preemptions) {
    EngineConfig c;
    c.scheduler.max_num_seqs = 4;
    c.scheduler.max_num_batched_tokens = 256;
    c.scheduler.max_model_len = 1024;
    ByteTextCodec codec(2000);
    Engine e(r, &codec, c);
    for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(e.add_request("r" + std::to_string(i), ps[i], ::ml4::testing::greedy(24)).ok());
    std::map<std::string, std::vector<int32_t>> out;
    for (int i = 0; i < 20000 && e.has_work(); ++i) {
      auto s = e.step();
      EXPECT_TRUE(s.ok()) << s.status().message();
      if (!s.ok()) break;
      for (auto& x : *s) out[x.request_id].insert(out[x.request_id].end(), x.new_tokens.begin(), x.new_tokens.end());
    }
    if (preemptions) *preemptions = e.counters().preemptions;
    return out;
  };
  int64_t preemptions = 0;
  const auto want = run(plain.get(), nullptr);
  const auto got = run(hs.get(), &preemptions);
  EXPECT_GT(preemptions, 0);
  for (const auto& [id, toks] : want) EXPECT_EQ(got.at(id), toks) << id;
  {
    EngineConfig c;
    c.scheduler.max_num_seqs = 4;
    c.scheduler.max_num_batched_tokens = 192;
    c.scheduler.max_model_len = 1024;
    ByteTextCodec codec(2000);
    Engine e(hs.get(), &codec, c);
    auto aborted = ::ml4::testing::run_with_aborts(e, 40, 8, 30, rng, [&] {
      std::vector<int32_t> p;
      const int len = 20 + static_cast<int>(rng() % 300);
      for (int k = 0; k < len; ++k) p.push_back(3 + static_cast<int32_t>(rng() % 500));
      return std::make_pair(p, ::ml4::testing::greedy(1 + static_cast<int>(rng() % 30)));
    });
    ASSERT_TRUE(aborted.ok()) << aborted.status().message();
    EXPECT_GT(*aborted, 0);
    for (int g = 0; g < e.blocks().num_groups(); ++g) EXPECT_EQ(e.blocks().num_free_blocks(g), e.blocks().num_total_blocks(g));
  }
  EXPECT_EQ(hs->hisparse()->regions_in_use(), 0);
  EXPECT_EQ(hs->hisparse()->resident_rows(), 0);
  std::printf("engine on the H200: %lld preemptions, hot layer-steps %lld, direct %lld, rows loaded %lld\n",
              static_cast<long long>(preemptions), static_cast<long long>(hs->hisparse()->hot_layers),
              static_cast<long long>(hs->hisparse()->direct_layers), static_cast<long long>(hs->hisparse()->loads));
}

}  // namespace
}  // namespace ml4::cuda
#endif
