// MoE layer at ML4's shape (presets.cpp "ml4": 128 experts, 4 per token, 1 shared,
// D 6144, I 5632, FP8 block weights) at decode batch sizes T = 1, 2, 4, 8, 32, 64: the
// expert-grouped decode path (moe_experts_forward_grouped: permute, 3 grouped GEMVs with
// the shared expert as an extra slot, silu, combine; no host sync, graph-capturable) with
// its default kernel (the CUDA-core weight stream at T = 1, tensor cores above), with the
// tensor-core grouped kernel throughout and with the CUDA-core stream throughout,
// the earlier row-wise path (moe_experts_forward_rowwise, T <= 8: one weight stream per
// (token, expert) row) and the loop over experts (moe_experts_forward: permutation, one
// host sync, 3 linear_f32 per active expert: GEMV for <= 8 rows, act_quant + FP8 GEMM
// above); T = 512 (prefill, ~16 rows per expert) through the loop only. Router included
// in none.
//
// Bytes counted: the weights of the distinct active experts + the shared expert (each
// 3 x 5632 x 6144 e4m3 + scales = 104 MB), activations negligible. The bound is that
// over the measured copy bandwidth (argv[1], GB/s).
#include <cstdio>
#include <random>
#include <set>
#include <vector>

#include "gpu_bench_util.h"
#include "ops/cuda/moe.h"

using namespace ml4;
using namespace ml4::cuda;

namespace {

Result<DeviceLinear> random_linear(int64_t N, int64_t K, uint64_t seed, cudaStream_t s) {
  DeviceLinear d;
  d.format = LinearFormat::kFP8Block;
  d.N = N;
  d.K = K;
  ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(N * K));
  ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc((N + 127) / 128 * (K / 128) * 4));
  ML4_RETURN_IF_ERROR(fill_uniform_e4m3(d.weight.data(), N * K, seed, -448, 448, s));
  ML4_RETURN_IF_ERROR(fill_uniform_f32(d.scale.as<float>(), (N + 127) / 128 * (K / 128), seed + 1, 1e-5f, 2e-5f, s));
  return std::move(d);
}

}  // namespace

int main(int argc, char** argv) {
  if (!device_available()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  const double copy_gbps = argc > 1 ? std::atof(argv[1]) : 4253.0;  // gpu_ceilings_bench; default: the H200 runs
  const int E = 128, K = 4;
  const int64_t D = 6144, I = 5632;
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto lt = LtGemm::create();
  BENCH_CHECK(lt.status());
  std::vector<DeviceMlp> experts(E);
  uint64_t seed = 1;
  for (int e = 0; e <= E; ++e) {
    DeviceMlp m;
    auto a = random_linear(I, D, seed++, s), b = random_linear(D, I, seed++, s), c = random_linear(I, D, seed++, s);
    BENCH_CHECK(a.status());
    BENCH_CHECK(b.status());
    BENCH_CHECK(c.status());
    m.w1 = std::move(a).value();
    m.w2 = std::move(b).value();
    m.w3 = std::move(c).value();
    if (e < E)
      experts[e] = std::move(m);
    else
      experts.push_back(std::move(m));
  }
  DeviceMlp shared = std::move(experts.back());
  experts.pop_back();
  auto tables = build_expert_tables(experts);
  BENCH_CHECK(tables.status());
  const double expert_bytes = 3.0 * (I * D + (I / 128 + 1) * (D / 128) * 4.0);
  std::printf("moe E=%d K=%d D=%ld I=%ld fp8 block; %.1f MB per expert\n", E, K, D, I, expert_bytes / 1e6);
  std::mt19937 g(7);
  for (int64_t T : {1, 2, 4, 8, 32, 64, 512}) {
    std::vector<int32_t> ids(T * K);
    std::vector<float> w(T * K, 0.25f);
    std::set<int> distinct;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int> perm(E);
      for (int e = 0; e < E; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), g);
      for (int k = 0; k < K; ++k) {
        ids[t * K + k] = perm[k];
        distinct.insert(perm[k]);
      }
    }
    auto dids = DeviceBuffer::alloc(ids.size() * 4), dw = DeviceBuffer::alloc(w.size() * 4),
         x = DeviceBuffer::alloc(T * D * 4), out = DeviceBuffer::alloc(T * D * 4);
    BENCH_CHECK(dids.status());
    BENCH_CHECK(dw.status());
    BENCH_CHECK(x.status());
    BENCH_CHECK(out.status());
    BENCH_CHECK(dids->upload(ids.data(), ids.size() * 4));
    BENCH_CHECK(dw->upload(w.data(), w.size() * 4));
    BENCH_CHECK(fill_uniform_f32(x->as<float>(), T * D, 3, -1, 1, s));
    MoeScratch sc;
    BENCH_CHECK(sc.reserve(T * K, D, I, E));
    const double bytes = (distinct.size() + 1) * expert_bytes;
    const double t_loop = bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward(**lt, experts, &shared, x->as<float>(), T, D, dids->as<int32_t>(),
                                      dw->as<float>(), K, out->as<float>(), sc, s));
    });
    const bool grouped = T <= 128, rowwise = T <= 8;
    const GemvStreamConfig saved = gemv_stream_config();
    GemvStreamConfig st_all = saved;
    st_all.grouped_max_rows = 1 << 20;  // the CUDA-core stream for every T (passes of 4 rows), for comparison
    gemv_set_stream_config(st_all);
    const double t_grp_st = !grouped ? 0.0 : bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward_grouped(*tables, &shared, x->as<float>(), T, dids->as<int32_t>(),
                                              dw->as<float>(), K, out->as<float>(), sc, s));
    });
    GemvStreamConfig tc_only = saved;
    tc_only.grouped_max_rows = 0;  // the tensor-core grouped kernel for every T, for comparison
    gemv_set_stream_config(tc_only);
    const double t_grp_tc = !grouped ? 0.0 : bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward_grouped(*tables, &shared, x->as<float>(), T, dids->as<int32_t>(),
                                              dw->as<float>(), K, out->as<float>(), sc, s));
    });
    gemv_set_stream_config(saved);  // the default: the CUDA-core stream for T <= grouped_max_rows (1)
    const double t_grp = !grouped ? 0.0 : bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward_grouped(*tables, &shared, x->as<float>(), T, dids->as<int32_t>(),
                                              dw->as<float>(), K, out->as<float>(), sc, s));
    });
    const double t_row = !rowwise ? 0.0 : bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward_rowwise(*tables, &shared, x->as<float>(), T, dids->as<int32_t>(),
                                              dw->as<float>(), K, out->as<float>(), sc, s));
    });
    const double floor_ms = copy_gbps > 0 ? bytes / (copy_gbps * 1e6) : 0.0;
    auto pct = [&](double ms) { return 100.0 * bytes / (ms * 1e6) / copy_gbps; };
    std::printf("moe T=%ld (%zu distinct experts + shared, %.0f MB): expert loop %.3f ms (%.0f GB/s, %.0f%%)", T,
                distinct.size(), bytes / 1e6, t_loop, bytes / (t_loop * 1e6), pct(t_loop));
    if (rowwise) std::printf(", rowwise %.3f ms (%.0f GB/s, %.0f%%)", t_row, bytes / (t_row * 1e6), pct(t_row));
    if (grouped)
      std::printf(", grouped %.3f ms (%.0f GB/s, %.0f%%; tensor-core grouped kernel %.3f ms, %.0f%%; CUDA-core stream "
                  "%.3f ms, %.0f%%)",
                  t_grp, bytes / (t_grp * 1e6), pct(t_grp), t_grp_tc, pct(t_grp_tc), t_grp_st, pct(t_grp_st));
    std::printf("; floor %.3f ms at copy bandwidth\n", floor_ms);
  }
  return 0;
}
