// The NCCL path on one GPU (issue 14): the NCCL communicator (parallel/cuda/
// nccl_communicator.h) as a group of one, every collective on device buffers on a stream,
// checked against what a group of one must give (the input, in place or copied, and a send
// to itself); then the model program with a TP group of one through NCCL (the vocabulary-
// parallel embedding, an all-reduce after every wo / FFN / MoE, the logits all-gathered into
// logits_parts and laid out) against the same runner without a group, on ml4-tiny with the
// indexer and mistral4-tiny: with one rank every collective is an identity, so the logits
// must be bit-identical, eager and replayed from CUDA graphs (NCCL calls captured).
// Multi-GPU runs (TP 2..8 over NCCL) need a machine with several GPUs (their own issue).
#if defined(ML4_WITH_CUDA) && defined(ML4_WITH_NCCL)
#include <gtest/gtest.h>

#include <random>

#include "cuda_test_util.h"
#include "parallel/cuda/nccl_communicator.h"
#include "parallel/parallel_plan.h"
#include "runtime/cuda/cuda_runner.h"
#include "runtime/test_models.h"

namespace ml4::cuda {
namespace {

std::vector<float> download(const float* d, int64_t n) {
  std::vector<float> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

TEST(NcclTp1, CollectivesOfAGroupOfOne) {
  ML4_REQUIRE_GPU();
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  {
    auto c = make_nccl_communicator(nullptr, s);
    ASSERT_TRUE(c.ok()) << c.status().message();
    Communicator& comm = **c;
    EXPECT_EQ(comm.size(), 1);
    EXPECT_STREQ(comm.backend_name(), "nccl");
    const int64_t n = 4099;
    const std::vector<float> x = testing::randn(n, 3);
    float *a = nullptr, *b = nullptr;
    ASSERT_EQ(cudaMalloc(&a, n * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&b, n * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(a, x.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(comm.all_reduce_sum(a, n).ok());
    ASSERT_TRUE(comm.synchronize().ok());
    EXPECT_EQ(download(a, n), x);
    ASSERT_EQ(cudaMemset(b, 0, n * 4), cudaSuccess);
    ASSERT_TRUE(comm.all_gather(a, b, n * 4).ok());  // out of place
    ASSERT_TRUE(comm.all_gather(a, a, n * 4).ok());  // in place (send == recv + rank * bytes)
    ASSERT_TRUE(comm.synchronize().ok());
    EXPECT_EQ(download(b, n), x);
    ASSERT_EQ(cudaMemset(b, 0, n * 4), cudaSuccess);
    ASSERT_TRUE(comm.reduce_scatter_sum(a, b, n).ok());
    ASSERT_TRUE(comm.synchronize().ok());
    EXPECT_EQ(download(b, n), x);
    ASSERT_EQ(cudaMemset(b, 0, n * 4), cudaSuccess);
    ASSERT_TRUE(comm.all_to_all_v(a, {n * 4}, b, {n * 4}).ok());
    ASSERT_TRUE(comm.synchronize().ok());
    EXPECT_EQ(download(b, n), x);
    ASSERT_TRUE(comm.broadcast(a, n * 4, 0).ok());
    ASSERT_TRUE(comm.synchronize().ok());
    EXPECT_EQ(download(a, n), x);
    std::vector<int64_t> counts;
    ASSERT_TRUE(comm.exchange_counts({17}, &counts).ok());
    EXPECT_EQ(counts, std::vector<int64_t>{17});
    EXPECT_EQ(comm.stats().calls, 6);
    cudaFree(a);
    cudaFree(b);
  }
  cudaStreamDestroy(s);
}

// The same steps through a runner with a TP group of one (NCCL) and one without.
void check_model(const std::string& preset, bool graphs) {
  const std::string dir = ::ml4::testing::test_model(preset, 21, "bf16");
  auto cfg_dir = ::ml4::testing::load_runner(dir, "bf16");
  ASSERT_NE(cfg_dir, nullptr);
  ParallelConfig pc;
  auto layout = RankLayout::make(pc, 1, 0);
  ASSERT_TRUE(layout.ok());
  auto plan = ParallelPlan::make(cfg_dir->config(), *layout);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "bf16";
  o.base.kv_cache_bytes = 64ll << 20;
  o.cuda_graphs = graphs;
  auto plain = CudaRunner::load(dir, o);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  o.base.plan = &*plan;  // comms left null: a group of one needs no MPI
  auto nccl = CudaRunner::load(dir, o);
  ASSERT_TRUE(nccl.ok()) << nccl.status().message();
  std::mt19937 g(9);
  std::uniform_int_distribution<int> tok(1, cfg_dir->config().vocab_size - 1);
  std::vector<int32_t> pa(29), pb(7);
  for (auto& t : pa) t = tok(g);
  for (auto& t : pb) t = tok(g);
  StepInput in;
  in.seqs.push_back(::ml4::testing::seq_step(*cfg_dir, 1, pa, 0, 0, 1, 1));
  in.seqs.push_back(::ml4::testing::seq_step(*cfg_dir, 2, pb, 0, 2, 1, 1));
  for (int step = 0; step < 6; ++step) {
    auto a = (*plain)->execute(in);
    auto b = (*nccl)->execute(in);
    ASSERT_TRUE(a.ok()) << a.status().message();
    ASSERT_TRUE(b.ok()) << b.status().message();
    ASSERT_EQ(a->logits.size(), 2u);
    for (int s = 0; s < 2; ++s) {
      ASSERT_TRUE(testing::all_finite(b->logits[s]));
      EXPECT_EQ(a->logits[s], b->logits[s]) << preset << " step " << step << " seq " << s;
    }
    StepInput next;
    for (int s = 0; s < 2; ++s) {
      const auto& l = a->logits[s];
      const int32_t t = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
      const auto& q = in.seqs[s];
      next.seqs.push_back(::ml4::testing::seq_step(*cfg_dir, q.seq_id, {t}, q.start_pos + static_cast<int64_t>(q.tokens.size()),
                                                   s == 0 ? 0 : 2, 1, 1));
    }
    in = next;
  }
  if (graphs) {
    EXPECT_GT((*nccl)->graph_replays(), 0) << "decode steps should replay graphs holding NCCL calls";
  }
}

TEST(NcclTp1, Ml4TinyEagerIsBitIdentical) { ML4_REQUIRE_GPU(); check_model("ml4-tiny", false); }
TEST(NcclTp1, Ml4TinyGraphsAreBitIdentical) { ML4_REQUIRE_GPU(); check_model("ml4-tiny", true); }
TEST(NcclTp1, Mistral4TinyGraphsAreBitIdentical) { ML4_REQUIRE_GPU(); check_model("mistral4-tiny", true); }

}  // namespace
}  // namespace ml4::cuda
#endif
