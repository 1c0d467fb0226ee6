// MoE layer at ML4's shape (presets.cpp "ml4": 128 experts, 4 per token, 1 shared,
// D 6144, I 5632, FP8 block weights) at decode batch sizes T = 1, 2, 4, 8, 32, 64: the
// expert-grouped decode path (moe_experts_forward_grouped: permute, 3 grouped GEMVs with
// the shared expert as an extra slot, silu, combine; no host sync, graph-capturable) with
// its default kernel (the CUDA-core weight stream at T = 1, tensor cores above), with the
// tensor-core grouped kernel throughout and with the CUDA-core stream throughout,
// the earlier row-wise path (moe_experts_forward_rowwise, T <= 8: one weight stream per
// (token, expert) row) and the loop over experts (moe_experts_forward: permutation, one
// host sync, 3 linear_f32 per active expert: GEMV for <= 8 rows, act_quant + FP8 GEMM
// above); T = 512 (prefill, ~16 rows per expert) through the loop only. Then prefill
// sizes through the loop and the grouped GEMMs (see prefill() below). Router included
// in none.
//
// Bytes counted: the weights of the distinct active experts + the shared expert (each
// 3 x 5632 x 6144 e4m3 + scales = 104 MB), activations negligible. The bound is that
// over the measured copy bandwidth (argv[1], GB/s). argv[2] = fp4: only fp4_prefill() below;
// argv[2] = prefill [T]: only prefill() (at one of its T), e.g. for a profiler.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu_bench_util.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_gemm.h"

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

// One MoE layer's inputs for T tokens: K distinct random experts per token (weights 0.25),
// uniform x, an output buffer and scratch for T * K rows; `distinct` gets the experts used.
struct MoeInputs {
  DeviceBuffer ids, w, x, out;
  MoeScratch sc;
};
MoeInputs moe_inputs(int64_t T, int E, int K, int64_t D, int64_t I, std::mt19937& g, std::set<int>* distinct,
                     cudaStream_t s) {
  std::vector<int32_t> ids(T * K);
  std::vector<float> w(T * K, 0.25f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), g);
    for (int k = 0; k < K; ++k) {
      ids[t * K + k] = perm[k];
      if (distinct) distinct->insert(perm[k]);
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
  MoeInputs in{std::move(dids).value(), std::move(dw).value(), std::move(x).value(), std::move(out).value(), {}};
  BENCH_CHECK(in.sc.reserve(T * K, D, I, E));
  return in;
}

// Prefill-shaped MoE layers (issue 18): the loop over experts against the grouped GEMMs
// (moe_experts_forward_gemm), whole layer with the shared expert; then at T = 4096 the two
// grouped launches alone against cuBLASLt's dense FP8 block GEMM of the same total size
// (M = every routed and shared row: gate and up as one N = 2I GEMM, down N = D). FLOPs =
// 2 x rows x 3 x D x I; the bound is the FP8 matrix rate (gpu_gemm_bench's cuBLASLt figure).
// The grouped GEMM launches of moe_experts_forward_gemm, alone: gate + up (x gathered by
// perm_token, silu into g), and down (the permuted hidden rows into y).
void gate_up_launch(MoeGroupedGemmParams& gp, const MoeExpertTables& tb, MoeScratch& sc) {
  gate_up_weights(gp, tb);
  gp.a_rows = sc.perm_token.as<int32_t>();
  gp.y = sc.g.as<float>();
}
void down_launch(MoeGroupedGemmParams& gp, const MoeExpertTables& tb, MoeScratch& sc) {
  down_weights(gp, tb);
  gp.a_rows = nullptr;
  gp.y = sc.y.as<float>();
}

void prefill(LtGemm& lt, const std::vector<DeviceMlp>& experts, const DeviceMlp& shared, const MoeExpertTables& tb,
             int E, int K, int64_t D, int64_t I, cudaStream_t s, int64_t only_T = 0) {
  std::mt19937 g(11);
  for (int64_t T : {512, 1024, 4096, 8192}) {
    if (only_T > 0 && T != only_T) continue;
    MoeInputs in = moe_inputs(T, E, K, D, I, g, nullptr, s);
    DeviceBuffer &dids = in.ids, &dw = in.w, &x = in.x, &out = in.out;
    MoeScratch& sc = in.sc;
    const double rows = static_cast<double>(T) * (K + 1), flop = 2.0 * rows * 3.0 * D * I;
    const double t_loop = bench::median_ms(s, 1, 5, [&](int) {
      BENCH_CHECK(moe_experts_forward(lt, experts, &shared, x.as<float>(), T, D, dids.as<int32_t>(),
                                      dw.as<float>(), K, out.as<float>(), sc, s));
    });
    const double t_gemm = bench::median_ms(s, 2, 10, [&](int) {
      BENCH_CHECK(moe_experts_forward_gemm(tb, &shared, x.as<float>(), T, dids.as<int32_t>(), dw.as<float>(), K,
                                           out.as<float>(), sc, s));
    });
    std::printf("moe prefill T=%ld (%.0f rows, %.2f TFLOP): expert loop %.3f ms (%.0f TFLOP/s), grouped GEMMs %.3f ms "
                "(%.0f TFLOP/s), %.2fx\n",
                T, rows, flop / 1e12, t_loop, flop / (t_loop * 1e9), t_gemm, flop / (t_gemm * 1e9), t_loop / t_gemm);
    // The grouped GEMMs' variants, whole MoE (moe.h MoeGemmOptions): 64-row tiles with the
    // overlapped promotion, 128-row tiles (tall), each also group-major. The 64-row one last:
    // the isolated launches below read its tile list.
    auto variant = [&](MoeGemmOptions o) {
      return bench::median_ms(s, 2, 10, [&](int) {
        BENCH_CHECK(moe_experts_forward_gemm(tb, &shared, x.as<float>(), T, dids.as<int32_t>(), dw.as<float>(), K,
                                             out.as<float>(), sc, s, nullptr, o));
      });
    };
    const double t_tall = variant({false, true, false}), t_tall_gm = variant({false, true, true});
    const double t_ws = variant({false, false, false, true});
    // The default (64-row overlap group-major) with and without its quantizing epilogue, and the
    // specialized kernel likewise: alternately three times, the best of each (the card's clock
    // drifts over a run; variants timed once apart differed by up to 14%).
    // The specialized kernel moves B by TMA (MoeGemmOptions::tma, on) or by cp.async.
    // The swapped kernel (MoeGemmOptions::swap: tokens as the MMA's N), group-major.
    // The specialized gate_up with the down projection on the swapped kernel (swap_down).
    double t_ov_gm = 1e30, t_ov_gm_nq = 1e30, t_ws_gm = 1e30, t_ws_gm_cp = 1e30, t_swap = 1e30, t_swap_down = 1e30;
    for (int round = 0; round < 3; ++round) {
      t_ov_gm_nq = std::min(t_ov_gm_nq, variant({true, false, true, false, false}));
      t_ov_gm = std::min(t_ov_gm, variant({true, false, true}));
      t_ws_gm_cp = std::min(t_ws_gm_cp, variant({false, false, true, true, true, false}));
      t_ws_gm = std::min(t_ws_gm, variant({false, false, true, true}));
      t_swap = std::min(t_swap, variant({false, false, true, false, true, true, true}));
      t_swap_down = std::min(t_swap_down, variant({false, false, true, true, true, true, false, true}));
    }
    const double t_ov = variant({true, false, false});
    auto tf = [&](double ms) { return flop / (ms * 1e9); };
    std::printf("moe prefill tiles T=%ld: 64-row %.3f ms (%.0f TFLOP/s), 64-row overlap %.3f ms (%.0f), + group-major "
                "%.3f ms (%.0f); 128-row %.3f ms (%.0f), + group-major %.3f ms (%.0f); best/overlap %.2fx\n",
                T, t_gemm, tf(t_gemm), t_ov, tf(t_ov), t_ov_gm, tf(t_ov_gm), t_tall, tf(t_tall), t_tall_gm, tf(t_tall_gm),
                t_ov / std::min({t_ov_gm, t_tall, t_tall_gm}));
    std::printf("moe prefill quant epilogue T=%ld: 64-row overlap group-major %.3f ms with, %.3f ms without\n", T,
                t_ov_gm, t_ov_gm_nq);
    std::printf("moe prefill specialized T=%ld: %.3f ms (%.0f TFLOP/s), + group-major %.3f ms (%.0f), B by cp.async "
                "instead of TMA %.3f ms (%.0f); vs 64-row overlap group-major %.2fx\n",
                T, t_ws, tf(t_ws), t_ws_gm, tf(t_ws_gm), t_ws_gm_cp, tf(t_ws_gm_cp), t_ov_gm / std::min(t_ws, t_ws_gm));
    std::printf("moe prefill swap T=%ld: %.3f ms (%.0f TFLOP/s), vs 64-row overlap group-major %.3f ms: %.2fx\n", T,
                t_swap, tf(t_swap), t_ov_gm, t_ov_gm / t_swap);
    std::printf("moe prefill swap_down T=%ld: %.3f ms (%.0f TFLOP/s), vs specialized group-major %.3f ms: %.2fx\n", T,
                t_swap_down, tf(t_swap_down), t_ws_gm, t_ws_gm / t_swap_down);
    if (T != 4096) continue;
    // The two grouped launches alone (the permutation and tile list of the last run stay).
    const int64_t nrows = T * (K + 1);
    MoeGroupedGemmParams gp;
    gp.a = sc.q.data();
    gp.a_scale = sc.q_scale.as<float>();
    gp.tiles = sc.tiles.as<MoeTile>();
    gp.num_tiles = sc.num_tiles.as<int32_t>();
    gp.work_counter = sc.num_tiles.as<int32_t>() + 1;  // the specialized launches' counter (MoeScratch)
    gp.max_tiles = moe_gemm_max_tiles(nrows, E + 1);
    gp.stream = s;
    gate_up_launch(gp, tb, sc);
    const double t_gu = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(gp)); });
    gp.overlap = true;  // MoeGroupedGemmParams::overlap: the next block's MMAs before this block's promotion
    const double t_gu_ov = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(gp)); });
    gp.overlap = false;
    down_launch(gp, tb, sc);
    const double t_dn = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(gp)); });
    gp.overlap = true;
    const double t_dn_ov = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(gp)); });
    gp.overlap = false;
    std::printf("moe grouped GEMM overlap T=%ld: gate+up %.3f -> %.3f ms, down %.3f -> %.3f ms (MMAs of block kb + 1 "
                "before the promotion of kb)\n",
                T, t_gu, t_gu_ov, t_dn, t_dn_ov);
    {  // The same two launches on 128-row tiles: one tall forward leaves its permutation and tiles.
      BENCH_CHECK(moe_experts_forward_gemm(tb, &shared, x.as<float>(), T, dids.as<int32_t>(), dw.as<float>(), K,
                                           out.as<float>(), sc, s, nullptr, MoeGemmOptions{false, true, false}));
      MoeGroupedGemmParams tp = gp;
      tp.tall = true;
      tp.max_tiles = moe_gemm_max_tiles(nrows, E + 1, kMoeGemmTallTileRows);
      gate_up_launch(tp, tb, sc);
      const double t_gu_tall = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(tp)); });
      down_launch(tp, tb, sc);
      const double t_dn_tall = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(tp)); });
      std::printf("moe grouped GEMM tall T=%ld: gate+up %.3f ms (%.0f TFLOP/s), down %.3f ms (%.0f TFLOP/s) on 128-row "
                  "tiles\n",
                  T, t_gu_tall, 2.0 * nrows * 2 * I * D / (t_gu_tall * 1e9), t_dn_tall,
                  2.0 * nrows * D * I / (t_dn_tall * 1e9));
      tp.tall = false;  // the same tiles, warp-specialized and persistent
      tp.specialized = true;
      gate_up_launch(tp, tb, sc);
      const double t_gu_ws = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(tp)); });
      down_launch(tp, tb, sc);
      const double t_dn_ws = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(tp)); });
      std::printf("moe grouped GEMM specialized T=%ld: gate+up %.3f ms (%.0f TFLOP/s), down %.3f ms (%.0f TFLOP/s) on "
                  "128-row tiles, B by cp.async\n",
                  T, t_gu_ws, 2.0 * nrows * 2 * I * D / (t_gu_ws * 1e9), t_dn_ws,
                  2.0 * nrows * D * I / (t_dn_ws * 1e9));
      tp.w_tmap = tb.t1.data();  // B by TMA
      tp.w_up_tmap = tb.t3.data();
      gate_up_launch(tp, tb, sc);
      const double t_gu_tma = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(tp)); });
      tp.w_tmap = tb.t2.data();
      tp.w_up_tmap = nullptr;
      down_launch(tp, tb, sc);
      const double t_dn_tma = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm(tp)); });
      std::printf("moe grouped GEMM specialized T=%ld: gate+up %.3f ms (%.0f TFLOP/s), down %.3f ms (%.0f TFLOP/s) on "
                  "128-row tiles, B by TMA\n",
                  T, t_gu_tma, 2.0 * nrows * 2 * I * D / (t_gu_tma * 1e9), t_dn_tma,
                  2.0 * nrows * D * I / (t_dn_tma * 1e9));
    }
    // cuBLASLt dense: x [nrows, D] and h [nrows, I] random e4m3 with group-major scales.
    auto xa = DeviceBuffer::alloc(nrows * std::max(D, I)), xs = DeviceBuffer::alloc(nrows * (std::max(D, I) / 128) * 4);
    auto wgu = random_linear(2 * I, D, 77, s), wdn = random_linear(D, I, 78, s);
    auto yd = DeviceBuffer::alloc(nrows * 2 * I * 4);
    BENCH_CHECK(xa.status());
    BENCH_CHECK(xs.status());
    BENCH_CHECK(wgu.status());
    BENCH_CHECK(wdn.status());
    BENCH_CHECK(yd.status());
    BENCH_CHECK(fill_uniform_e4m3(xa->data(), nrows * std::max(D, I), 5, -4, 4, s));
    BENCH_CHECK(fill_uniform_f32(xs->as<float>(), nrows * (std::max(D, I) / 128), 6, 0.01f, 0.02f, s));
    auto dense = [&](const DeviceLinear& wl, int64_t N, int64_t Kd) {
      GemmFp8BlockParams d{xa->data(), xs->as<float>(), wl.weight.data(), wl.gemm_scale(), yd->data(), DType::kF32,
                           nrows, N, Kd, s};
      d.w_scale_ld = wl.gemm_scale_ld();
      return bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(lt.fp8_block(d)); });
    };
    const double t_dgu = dense(*wgu, 2 * I, D), t_ddn = dense(*wdn, D, I);
    const double f_gu = 2.0 * nrows * 2 * I * D, f_dn = 2.0 * nrows * D * I;
    std::printf("moe grouped GEMM T=%ld rows=%ld: gate+up %.3f ms (%.0f TFLOP/s) vs cuBLASLt dense M=%ld N=%ld K=%ld "
                "%.3f ms (%.0f TFLOP/s); down %.3f ms (%.0f TFLOP/s) vs dense N=%ld K=%ld %.3f ms (%.0f TFLOP/s)\n",
                T, nrows, t_gu, f_gu / (t_gu * 1e9), nrows, 2 * I, D, t_dgu, f_gu / (t_dgu * 1e9), t_dn,
                f_dn / (t_dn * 1e9), D, I, t_ddn, f_dn / (t_ddn * 1e9));
  }
}

// Random FP4 weights as DeviceLinear holds them (linear.h): any byte is two valid e2m1 codes;
// NVFP4 scales e4m3 in [0.5, 2] and a global scale of 1e-2, MXFP4 scales 2^-7.
Result<DeviceLinear> random_fp4(LinearFormat f, int64_t N, int64_t K, uint64_t seed, cudaStream_t s) {
  DeviceLinear d;
  d.format = f;
  d.N = N;
  d.K = K;
  const bool nv = f == LinearFormat::kNVFP4;
  ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(N * K / 2));
  ML4_RETURN_IF_ERROR(fill_uniform_e4m3(d.weight.data(), N * K / 2, seed, -448, 448, s));
  if (nv) {
    const int64_t off = fp4_global_offset(N, K);
    ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(off + 16));
    ML4_RETURN_IF_ERROR(fill_uniform_e4m3(d.scale.data(), N * K / 16, seed + 1, 0.5f, 2.0f, s));
    const float g = 1e-2f;
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    ML4_CUDA_RETURN_IF_ERROR(cudaMemcpy(static_cast<uint8_t*>(d.scale.data()) + off, &g, 4, cudaMemcpyHostToDevice));
  } else {
    ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(N * K / 32));
    ML4_RETURN_IF_ERROR(d.scale.fill_bytes(120));
  }
  return std::move(d);
}

// FP4 routed experts in prefill (issue 18): the FP4 grouped GEMMs (moe_grouped_gemm_fp4, the
// FP8 shared expert through cuBLASLt as NVFP4 checkpoints hold it) against the loop over FP4
// experts (the FP4 weight stream per expert, f32 x) and the FP8 grouped GEMMs on FP8 experts
// of the same shape (shared expert in the slot), whole layers; then at each T the two FP4
// launches alone. FLOPs = 2 x rows x 3 x D x I over rows = T * (K + 1); the bound is the bf16
// matrix rate (the FP4 weights are expanded to bf16: H100 SXM 989 TFLOP/s dense, ~2/3 of it
// reached by cuBLASLt's bf16 GEMM, gpu_gemm_bench).
void fp4_prefill(LtGemm& lt, const std::vector<DeviceMlp>& fp8_experts, const DeviceMlp& fp8_shared,
                 const MoeExpertTables& fp8_tb, int E, int K, int64_t D, int64_t I, cudaStream_t s) {
  std::printf("moe fp4 grouped GEMM kernel: CTAs per SM resident: %d (3 stages, the default), %d (4), %d (6)\n",
              moe_grouped_gemm_fp4_ctas_per_sm(3), moe_grouped_gemm_fp4_ctas_per_sm(4),
              moe_grouped_gemm_fp4_ctas_per_sm(6));
  for (LinearFormat f : {LinearFormat::kNVFP4, LinearFormat::kMXFP4}) {
    std::vector<DeviceMlp> experts(E);
    uint64_t seed = 100;
    for (int e = 0; e < E; ++e) {
      auto a = random_fp4(f, I, D, seed++, s), b = random_fp4(f, D, I, seed++, s), c = random_fp4(f, I, D, seed++, s);
      BENCH_CHECK(a.status());
      BENCH_CHECK(b.status());
      BENCH_CHECK(c.status());
      experts[e] = DeviceMlp{std::move(a).value(), std::move(b).value(), std::move(c).value()};
    }
    auto tables = build_expert_tables(experts, &fp8_shared);
    BENCH_CHECK(tables.status());
    const MoeExpertTables& tb = *tables;
    std::mt19937 g(11);
    for (int64_t T : {512, 4096}) {
      MoeInputs in = moe_inputs(T, E, K, D, I, g, nullptr, s);
      const double rows = static_cast<double>(T) * (K + 1), flop = 2.0 * rows * 3.0 * D * I;
      const double t_loop = bench::median_ms(s, 1, 3, [&](int) {
        BENCH_CHECK(moe_experts_forward(lt, experts, &fp8_shared, in.x.as<float>(), T, D, in.ids.as<int32_t>(),
                                        in.w.as<float>(), K, in.out.as<float>(), in.sc, s));
      });
      const double t_fp8 = bench::median_ms(s, 2, 10, [&](int) {
        BENCH_CHECK(moe_experts_forward_gemm(fp8_tb, &fp8_shared, in.x.as<float>(), T, in.ids.as<int32_t>(),
                                             in.w.as<float>(), K, in.out.as<float>(), in.sc, s));
      });
      const double t_fp4 = bench::median_ms(s, 2, 10, [&](int) {
        BENCH_CHECK(moe_experts_forward_gemm(tb, &fp8_shared, in.x.as<float>(), T, in.ids.as<int32_t>(),
                                             in.w.as<float>(), K, in.out.as<float>(), in.sc, s, &lt));
      });
      std::printf("moe fp4 prefill %s T=%ld (%.0f rows, %.2f TFLOP): %s grouped GEMMs %.3f ms (%.0f TFLOP/s); %s expert "
                  "loop %.3f ms (%.0f TFLOP/s), %.2fx; fp8 grouped GEMMs %.3f ms (%.0f TFLOP/s)\n",
                  linear_format_name(f), T, rows, flop / 1e12, linear_format_name(f), t_fp4, flop / (t_fp4 * 1e9),
                  linear_format_name(f), t_loop, flop / (t_loop * 1e9), t_loop / t_fp4, t_fp8, flop / (t_fp8 * 1e9));
      // The two FP4 launches alone over the routed rows (the last run's tile list: no shared slot).
      MoeScratch& sc = in.sc;
      const int64_t nrows = T * K;
      MoeGroupedGemmFp4Params gp;
      gp.nvfp4 = f == LinearFormat::kNVFP4;
      gp.tiles = sc.tiles.as<MoeTile>();
      gp.num_tiles = sc.num_tiles.as<int32_t>();
      gp.max_tiles = moe_gemm_max_tiles(nrows, E);
      gp.stream = s;
      gp.gate_up = true;
      gp.a = sc.u.data();
      gp.a_rows = sc.perm_token.as<int32_t>();
      gp.w = static_cast<const void* const*>(tb.w1.data());
      gp.w_scale = static_cast<const float* const*>(tb.s1.data());
      gp.w_up = static_cast<const void* const*>(tb.w3.data());
      gp.w_up_scale = static_cast<const float* const*>(tb.s3.data());
      gp.N = I;
      gp.K = D;
      gp.y_bf16 = sc.q.data();
      MoeGroupedGemmFp4Params dn = gp;
      dn.gate_up = false;
      dn.a = sc.q.data();
      dn.a_rows = nullptr;
      dn.w = static_cast<const void* const*>(tb.w2.data());
      dn.w_scale = static_cast<const float* const*>(tb.s2.data());
      dn.w_up = nullptr;
      dn.w_up_scale = nullptr;
      dn.N = D;
      dn.K = I;
      dn.y_bf16 = nullptr;
      dn.y = sc.y.as<float>();
      const double f_gu = 2.0 * nrows * 2 * I * D, f_dn = 2.0 * nrows * D * I;
      for (int stages : {3, 4, 6}) {  // the ring depth (3, the default: two CTAs per SM; deeper: one)
        gp.stages = dn.stages = stages;
        const double t_gu = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm_fp4(gp)); });
        const double t_dn = bench::median_ms(s, 2, 10, [&](int) { BENCH_CHECK(moe_grouped_gemm_fp4(dn)); });
        std::printf("moe fp4 grouped GEMM %s T=%ld routed rows=%ld stages=%d: gate+up %.3f ms (%.0f TFLOP/s), down "
                    "%.3f ms (%.0f TFLOP/s)\n",
                    linear_format_name(f), T, nrows, stages, t_gu, f_gu / (t_gu * 1e9), t_dn, f_dn / (t_dn * 1e9));
      }
    }
  }
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
  auto tables = build_expert_tables(experts, &shared);
  BENCH_CHECK(tables.status());
  const double expert_bytes = 3.0 * (I * D + (I / 128 + 1) * (D / 128) * 4.0);
  std::printf("moe E=%d K=%d D=%ld I=%ld fp8 block; %.1f MB per expert\n", E, K, D, I, expert_bytes / 1e6);
  if (argc > 2 && std::string(argv[2]) == "fp4") {  // only the FP4 prefill comparison
    fp4_prefill(**lt, experts, shared, *tables, E, K, D, I, s);
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "prefill") {  // only the FP8 prefill (argv[3]: one T), e.g. under ncu
    prefill(**lt, experts, shared, *tables, E, K, D, I, s, argc > 3 ? std::atol(argv[3]) : 0);
    return 0;
  }
  std::mt19937 g(7);
  for (int64_t T : {1, 2, 4, 8, 32, 64, 512}) {
    std::set<int> distinct;
    MoeInputs in = moe_inputs(T, E, K, D, I, g, &distinct, s);
    DeviceBuffer &dids = in.ids, &dw = in.w, &x = in.x, &out = in.out;
    MoeScratch& sc = in.sc;
    const double bytes = (distinct.size() + 1) * expert_bytes;
    const double t_loop = bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward(**lt, experts, &shared, x.as<float>(), T, D, dids.as<int32_t>(),
                                      dw.as<float>(), K, out.as<float>(), sc, s));
    });
    const bool grouped = T <= 128, rowwise = T <= 8;
    const GemvStreamConfig saved = gemv_stream_config();
    GemvStreamConfig st_all = saved;
    st_all.grouped_max_rows = 1 << 20;  // the CUDA-core stream for every T (passes of 4 rows), for comparison
    st_all.mma = 0;
    gemv_set_stream_config(st_all);
    const double t_grp_st = !grouped ? 0.0 : bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward_grouped(*tables, &shared, x.as<float>(), T, dids.as<int32_t>(),
                                              dw.as<float>(), K, out.as<float>(), sc, s));
    });
    GemvStreamConfig tc_only = saved;
    tc_only.grouped_max_rows = 0;  // the tensor-core grouped kernel for every T, for comparison
    tc_only.mma = 0;
    gemv_set_stream_config(tc_only);
    const double t_grp_tc = !grouped ? 0.0 : bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward_grouped(*tables, &shared, x.as<float>(), T, dids.as<int32_t>(),
                                              dw.as<float>(), K, out.as<float>(), sc, s));
    });
    gemv_set_stream_config(saved);  // the default: the CUDA-core stream for T <= 2, the f16 mma kernel for 3-4
    const double t_grp = !grouped ? 0.0 : bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward_grouped(*tables, &shared, x.as<float>(), T, dids.as<int32_t>(),
                                              dw.as<float>(), K, out.as<float>(), sc, s));
    });
    const double t_row = !rowwise ? 0.0 : bench::median_ms(s, 2, 20, [&](int) {
      BENCH_CHECK(moe_experts_forward_rowwise(*tables, &shared, x.as<float>(), T, dids.as<int32_t>(),
                                              dw.as<float>(), K, out.as<float>(), sc, s));
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
  prefill(**lt, experts, shared, *tables, E, K, D, I, s);
  return 0;
}
