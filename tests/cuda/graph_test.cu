// CUDA graphs over a decode-shaped chain of this backend's kernels (the runner's decode
// step is not wired yet): L dense layers of [add+RMSNorm -> gate/up GEMM (cuBLASLt) ->
// SwiGLU -> down GEMM], then a final norm and greedy argmax, at batch 1 and 8.
// Checks: graph replay is bit-identical to eager execution (same kernels, same order,
// fixed addresses), and prints the speedup of replay over eager launches -- at batch 1
// the step is launch-bound, which is what graphs remove.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "cuda_test_util.h"
#include "model/quant.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/sampling.h"

namespace ml4::cuda {
namespace {

using namespace testing;

TEST(CudaGraph, DecodeChainReplayEqualsEagerAndSpeedup) {
  ML4_REQUIRE_GPU();
  const int L = 16;
  const int64_t D = 512, I = 1024, V = 4096;
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  std::vector<DeviceMlp> mlps;
  std::vector<DeviceBuffer> norms;
  uint32_t seed = 1;
  for (int l = 0; l < L; ++l) {
    auto mk = [&](int64_t N, int64_t K) {
      auto w = randn(N * K, seed++, 1.0f / std::sqrt(static_cast<float>(K)));
      auto lw = quantize_linear(w.data(), N, K, l % 2 ? LinearFormat::kFP8Block : LinearFormat::kBF16, "w");
      EXPECT_TRUE(lw.ok());
      auto d = upload_linear(*lw);
      EXPECT_TRUE(d.ok()) << d.status().message();
      return std::move(d).value();
    };
    DeviceMlp m;
    m.w1 = mk(I, D);
    m.w2 = mk(D, I);
    m.w3 = mk(I, D);
    mlps.push_back(std::move(m));
    norms.push_back(to_device(randn(D, seed++, 0.1f)));
  }
  auto head = quantize_linear(randn(V * D, seed++, 0.05f).data(), V, D, LinearFormat::kBF16, "head");
  ML4_ASSERT_OK(head.status());
  auto dhead = upload_linear(*head);
  ML4_ASSERT_OK(dhead.status());
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);

  for (int64_t B : {1, 8}) {
    MoeScratch scratch;
    ML4_ASSERT_OK(scratch.reserve(B, D, std::max(I, V), 1));
    auto x0 = to_device(randn(B * D, 99));
    auto residual = DeviceBuffer::alloc(B * D * 4), a = DeviceBuffer::alloc(B * D * 4), f = DeviceBuffer::alloc(B * D * 4),
         logits = DeviceBuffer::alloc(B * V * 4), tok = DeviceBuffer::alloc(B * 4),
         aws = DeviceBuffer::alloc(argmax_rows_workspace_bytes(B, V));
    ML4_ASSERT_OK(residual.status());
    ML4_ASSERT_OK(a.status());
    ML4_ASSERT_OK(f.status());
    ML4_ASSERT_OK(logits.status());
    ML4_ASSERT_OK(tok.status());
    ML4_ASSERT_OK(aws.status());
    auto step = [&]() -> Status {
      ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(residual->data(), x0.data(), B * D * 4, cudaMemcpyDeviceToDevice, s));
      ML4_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(f->data(), 0, B * D * 4, s));
      for (int l = 0; l < L; ++l) {
        ML4_RETURN_IF_ERROR(rms_norm({f->as<float>(), residual->as<float>(), norms[l].as<float>(), B, D, 1e-6f,
                                      a->as<float>(), nullptr, s}));
        ML4_RETURN_IF_ERROR(mlp_forward(**lt, mlps[l], a->as<float>(), B, f->as<float>(), scratch, s));
      }
      ML4_RETURN_IF_ERROR(rms_norm({f->as<float>(), residual->as<float>(), norms[0].as<float>(), B, D, 1e-6f,
                                    a->as<float>(), nullptr, s}));
      ML4_RETURN_IF_ERROR(linear_f32(**lt, *dhead, a->as<float>(), B, logits->as<float>(), scratch.lin, s));
      return argmax_rows(logits->as<float>(), V, nullptr, 0, B, V, tok->as<int32_t>(), aws->data(), aws->bytes(), s);
    };
    // Eager (twice: determinism), then capture and replay.
    ML4_ASSERT_OK(step());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    auto eager = to_host<float>(*logits, B * V);
    auto eager_tok = to_host<int32_t>(*tok, B);
    ASSERT_TRUE(all_finite(eager));
    ML4_ASSERT_OK(logits->fill_bytes(0xFF));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    Status cap = step();
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    ML4_ASSERT_OK(cap);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    auto replay = to_host<float>(*logits, B * V);
    auto replay_tok = to_host<int32_t>(*tok, B);
    EXPECT_EQ(0, std::memcmp(eager.data(), replay.data(), eager.size() * 4)) << "graph replay != eager";
    EXPECT_EQ(eager_tok, replay_tok);
    // Timing: median of 50 of each, wall clock around a synchronized step.
    auto time_it = [&](auto&& fn) {
      std::vector<double> t;
      for (int i = 0; i < 60; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        cudaStreamSynchronize(s);
        if (i >= 10) t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(t.begin(), t.end());
      return t[t.size() / 2];
    };
    const double te = time_it([&] { (void)step(); });
    const double tg = time_it([&] { cudaGraphLaunch(exec, s); });
    std::printf("graph: %d layers D=%ld I=%ld batch %ld: eager %.1f us, graph %.1f us, speedup %.2fx (bit-identical: %s)\n",
                L, D, I, B, te, tg, te / tg, std::memcmp(eager.data(), replay.data(), eager.size() * 4) == 0 ? "yes" : "NO");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace ml4::cuda
