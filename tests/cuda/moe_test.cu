// MoE on the GPU (ops/cuda/moe.h) and greedy sampling (ops/cuda/sampling.h) against the
// CPU: cpu::moe_route, and the MoE branch of CpuModel::ffn rebuilt from cpu ops on the
// activations the GPU's GEMMs see.
//
// Bounds: routing ids must match exactly (random logits: no ties at f32 precision);
// weights to 1e-6 relative (f32 softmax sum vs the CPU's f64). The MoE layer: BF16 path
// rounds x and the SwiGLU product to bf16 before each GEMM (2^-9 relative each, a few
// such roundings compound to ~3e-3 in norm), bound 1e-2 against an f32 reference. FP8:
// linear_f32 runs an expert with <= 8 rows through the exact-activation GEMV and one with
// more rows through act_quant + the FP8 GEMM (linear.h), so the reference quantizes an
// expert's activations (e4m3, 1x128 groups, bit-exact to act_quant) exactly when the GPU
// does -- per-row quantization does not depend on the batch. What is left: accumulation
// order (~1e-6), the FP8 GEMM's block accumulator (~2^-14, gemm_test.cu) and the rare e4m3
// rounding flip of a hidden activation whose f32 value differs in the last bits between GPU
// and CPU (one flip moves one element by 2^-4 relative): bound 1e-2, measured ~1e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <set>
#include <tuple>

#include "cuda_test_util.h"
#include "model/quant.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/quant.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/ffn_resident.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/sampling.h"

namespace ml4::cuda {
namespace {

using namespace testing;

void sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

MoeConfig route_config(int E, int K, int G, int keep, RouterScoring sc) {
  MoeConfig cfg;
  cfg.num_experts = E;
  cfg.num_experts_per_tok = K;
  cfg.num_expert_groups = G;
  cfg.num_expert_groups_per_tok = keep;
  cfg.scoring = sc;
  return cfg;
}

TEST(CudaMoe, RouteMatchesCpu) {
  ML4_REQUIRE_GPU();
  struct Case {
    int E, K, G, keep;
    RouterScoring sc;
    bool bias, renorm;
    double scale;
  };
  const Case cases[] = {{64, 6, 8, 3, RouterScoring::kSoftmax, false, true, 1.0},
                        {256, 8, 8, 4, RouterScoring::kSigmoid, true, true, 2.5},
                        {128, 4, 1, 1, RouterScoring::kSoftmax, false, false, 1.0},
                        {16, 2, 16, 4, RouterScoring::kSoftmax, true, true, 1.0}};
  uint32_t seed = 1;
  for (const auto& c : cases) {
    MoeConfig cfg = route_config(c.E, c.K, c.G, c.keep, c.sc);
    cfg.renormalize = c.renorm;
    cfg.routed_scale = c.scale;
    const int64_t T = 77;
    auto logits = randn(T * c.E, seed++, 2.0f);
    auto bias = randn(c.E, seed++, 0.05f);
    std::vector<int32_t> rid(T * c.K);
    std::vector<float> rw(T * c.K);
    cpu::moe_route(logits.data(), T, cfg, c.bias ? bias.data() : nullptr, rid.data(), rw.data());
    auto dl = to_device(logits), db = to_device(bias);
    std::vector<std::vector<int32_t>> runs;
    for (int rep = 0; rep < 2; ++rep) {
      auto di = poisoned<int32_t>(T * c.K);
      auto dw = poisoned<float>(T * c.K);
      ML4_ASSERT_OK(moe_route({dl.as<float>(), T, cfg, c.bias ? db.as<float>() : nullptr, di.as<int32_t>(),
                               dw.as<float>(), nullptr}));
      sync();
      auto ids = to_host<int32_t>(di, T * c.K);
      auto w = to_host<float>(dw, T * c.K);
      EXPECT_EQ(ids, rid) << "E=" << c.E << " K=" << c.K;
      const double e = rel_err(w, rw);
      std::printf("moe_route E=%d K=%d G=%d keep=%d %s: ids %s, weights rel_err=%.3g (bound 1e-6)\n", c.E, c.K, c.G,
                  c.keep, c.sc == RouterScoring::kSoftmax ? "softmax" : "sigmoid+bias",
                  ids == rid ? "equal" : "DIFFER", e);
      EXPECT_LT(e, 1e-6);
      runs.push_back(ids);
    }
    EXPECT_EQ(runs[0], runs[1]);
  }
  MoeConfig bad;
  bad.num_experts = 10;
  bad.num_experts_per_tok = 11;
  EXPECT_EQ(moe_route({nullptr, 1, bad, nullptr, nullptr, nullptr, nullptr}).code(), StatusCode::kInvalidArgument);
}

// The fused decode router (router_route, issue 19): logits against an f64 reference of x G^T
// (f32 products and sums over D = 7168: relative error ~1e-6; bound 1e-5), and the routing of
// those logits equal to moe_route's (the same device code) and to cpu::moe_route's (weights
// within moe_route's 1e-6), for T = 1, 3 and 8 and the route configurations above; twice per
// case (the done-counter resets itself; the results are bit-identical); unsupported shapes
// are statuses.
// The router's logits in f64: x [T, D] against gate [E, D].
std::vector<double> router_logits_f64(const std::vector<float>& gate, const std::vector<float>& x, int64_t T, int E,
                                      int64_t D) {
  std::vector<double> ref(T * E);
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      double acc = 0.0;
      for (int64_t k = 0; k < D; ++k) acc += static_cast<double>(x[t * D + k]) * gate[e * D + k];
      ref[t * E + e] = acc;
    }
  return ref;
}

TEST(CudaMoe, FusedRouterMatchesCpu) {
  ML4_REQUIRE_GPU();
  struct Case {
    int E, K, G, keep;
    RouterScoring sc;
    bool bias;
  };
  const Case cases[] = {{128, 4, 1, 1, RouterScoring::kSoftmax, false},
                        {256, 8, 8, 4, RouterScoring::kSigmoid, true},
                        {16, 4, 1, 1, RouterScoring::kSoftmax, true}};
  uint32_t seed = 100;
  // 7168: the gate row by float4s in registers; 1030 (not a multiple of 4): the strided loop.
  for (const int64_t D : {int64_t{7168}, int64_t{1030}})
  for (const auto& c : cases) {
    const MoeConfig cfg = route_config(c.E, c.K, c.G, c.keep, c.sc);
    auto gate = randn(c.E * D, seed++, 0.02f);
    auto bias = randn(c.E, seed++, 0.05f);
    auto dg = to_device(gate), db = to_device(bias);
    auto counter = poisoned<uint8_t>(router_route_counter_bytes());
    ML4_ASSERT_OK(counter.fill_bytes(0));
    for (const int64_t T : {int64_t{1}, int64_t{3}, int64_t{8}}) {
      auto x = randn(T * D, seed++);
      const std::vector<double> ref = router_logits_f64(gate, x, T, c.E, D);
      auto dx = to_device(x);
      std::vector<std::vector<float>> logit_runs;
      for (int rep = 0; rep < 2; ++rep) {
        auto dl = poisoned<float>(T * c.E);
        auto di = poisoned<int32_t>(T * c.K), di2 = poisoned<int32_t>(T * c.K);
        auto dw = poisoned<float>(T * c.K), dw2 = poisoned<float>(T * c.K);
        RouterRouteParams p;
        p.x = dx.as<float>();
        p.D = D;
        p.gate = dg.as<float>();
        p.counter = counter.as<unsigned>();
        p.route = {dl.as<float>(), T, cfg, c.bias ? db.as<float>() : nullptr, di.as<int32_t>(), dw.as<float>(), nullptr};
        ML4_ASSERT_OK(router_route(p));
        // moe_route on the fused kernel's own logits: the same routing code.
        ML4_ASSERT_OK(moe_route({dl.as<float>(), T, cfg, c.bias ? db.as<float>() : nullptr, di2.as<int32_t>(),
                                 dw2.as<float>(), nullptr}));
        sync();
        auto l = to_host<float>(dl, T * c.E);
        double num = 0.0, den = 0.0;
        for (int64_t i = 0; i < T * c.E; ++i) {
          num += (l[i] - ref[i]) * (l[i] - ref[i]);
          den += ref[i] * ref[i];
        }
        const double err = std::sqrt(num / den);
        std::printf("router_route D=%lld E=%d K=%d T=%lld: logits rel_err=%.3g (bound 1e-5)\n",
                    static_cast<long long>(D), c.E, c.K, static_cast<long long>(T), err);
        EXPECT_LT(err, 1e-5);
        auto ids = to_host<int32_t>(di, T * c.K);
        auto w = to_host<float>(dw, T * c.K);
        EXPECT_EQ(ids, to_host<int32_t>(di2, T * c.K));
        EXPECT_EQ(w, to_host<float>(dw2, T * c.K));
        std::vector<int32_t> rid(T * c.K);
        std::vector<float> rw(T * c.K);
        cpu::moe_route(l.data(), T, cfg, c.bias ? bias.data() : nullptr, rid.data(), rw.data());
        EXPECT_EQ(ids, rid) << "E=" << c.E << " T=" << T;
        EXPECT_LT(rel_err(w, rw), 1e-6);
        logit_runs.push_back(l);
      }
      EXPECT_EQ(logit_runs[0], logit_runs[1]);
    }
  }
  MoeConfig big;
  big.num_experts = 512;
  big.num_experts_per_tok = 8;
  EXPECT_FALSE(router_route_supported(big, 1));
  MoeConfig ok;
  ok.num_experts = 128;
  ok.num_experts_per_tok = 8;
  EXPECT_FALSE(router_route_supported(ok, 9));
  RouterRouteParams bad;
  bad.route.cfg = big;
  bad.route.T = 1;
  EXPECT_EQ(router_route(bad).code(), StatusCode::kInvalidArgument);
}

// The FFN norm inside the router's launch (RouterRouteParams::norm_w, issue 19) against
// rms_norm with a residual and then router_route: the normalized rows, the updated residual,
// the logits and the routing are the same bits (the kernel repeats rms_norm_vec_kernel's
// per-thread arithmetic and block sum). Fresh random rows of ml4's width (6144) and of 7168,
// T = 1, 3, 8, each twice (the counter resets itself); a width the fused path does not take
// is refused as unimplemented, not computed.
TEST(CudaMoe, FusedRouterNormIsTheNormThenTheRouter) {
  ML4_REQUIRE_GPU();
  const MoeConfig cfg = route_config(128, 4, 1, 1, RouterScoring::kSoftmax);
  uint32_t seed = 900;
  auto counter = poisoned<uint8_t>(router_route_counter_bytes());
  ML4_ASSERT_OK(counter.fill_bytes(0));
  int checked = 0;
  for (const int64_t D : {int64_t{6144}, int64_t{7168}}) {
    auto gate = randn(128 * D, seed++, 0.02f);
    auto bias = randn(128, seed++, 0.05f);
    auto w = randn(D, seed++, 0.3f);
    for (auto& v : w) v += 1.0f;
    auto dg = to_device(gate), db = to_device(bias), dw = to_device(w);
    for (const int64_t T : {int64_t{1}, int64_t{3}, int64_t{8}}) {
      for (int rep = 0; rep < 2; ++rep) {
        auto attn = randn(T * D, seed++), res = randn(T * D, seed++, 4.0f);
        auto da = to_device(attn), dra = to_device(res), drb = to_device(res);
        auto ya = poisoned<float>(T * D), yb = poisoned<float>(T * D);
        auto la = poisoned<float>(T * 128), lb = poisoned<float>(T * 128);
        auto ia = poisoned<int32_t>(T * 4), ib = poisoned<int32_t>(T * 4);
        auto wa = poisoned<float>(T * 4), wb = poisoned<float>(T * 4);
        RmsNormParams np;
        np.x = da.as<float>();
        np.residual = dra.as<float>();
        np.w = dw.as<float>();
        np.rows = T;
        np.dim = D;
        np.eps = 1e-6f;
        np.y = ya.as<float>();
        ML4_ASSERT_OK(rms_norm(np));
        RouterRouteParams p;
        p.x = ya.as<float>();
        p.D = D;
        p.gate = dg.as<float>();
        p.counter = counter.as<unsigned>();
        p.route = {la.as<float>(), T, cfg, db.as<float>(), ia.as<int32_t>(), wa.as<float>(), nullptr};
        ML4_ASSERT_OK(router_route(p));
        RouterRouteParams f = p;
        f.x = yb.as<float>();
        f.route = {lb.as<float>(), T, cfg, db.as<float>(), ib.as<int32_t>(), wb.as<float>(), nullptr};
        f.attn = da.as<float>();
        f.residual = drb.as<float>();
        f.norm_w = dw.as<float>();
        f.eps = 1e-6f;
        ASSERT_TRUE(router_route_norm_supported(f));
        ML4_ASSERT_OK(router_route(f));
        sync();
        EXPECT_EQ(to_host<float>(ya, T * D), to_host<float>(yb, T * D)) << "D=" << D << " T=" << T << ": normalized rows";
        EXPECT_EQ(to_host<float>(dra, T * D), to_host<float>(drb, T * D)) << "D=" << D << " T=" << T << ": residual";
        EXPECT_EQ(to_host<float>(la, T * 128), to_host<float>(lb, T * 128)) << "D=" << D << " T=" << T << ": logits";
        EXPECT_EQ(to_host<int32_t>(ia, T * 4), to_host<int32_t>(ib, T * 4));
        EXPECT_EQ(to_host<float>(wa, T * 4), to_host<float>(wb, T * 4));
        // The residual really moved (the test would pass on two untouched buffers otherwise).
        auto r_after = to_host<float>(drb, T * D);
        EXPECT_EQ(r_after[0], attn[0] + res[0]);
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 12);
  std::printf("router_route with the FFN norm: %d cases bit-identical to rms_norm + router_route\n", checked);
  // A width the fused norm does not take: refused, not computed.
  const int64_t D = 1030;
  auto gate = to_device(randn(128 * D, seed++, 0.02f));
  auto x = to_device(randn(D, seed++)), r = to_device(randn(D, seed++)), w = to_device(randn(D, seed++));
  auto y = poisoned<float>(D), l = poisoned<float>(128);
  auto ids = poisoned<int32_t>(4);
  auto wts = poisoned<float>(4);
  RouterRouteParams f;
  f.x = y.as<float>();
  f.D = D;
  f.gate = gate.as<float>();
  f.counter = counter.as<unsigned>();
  f.route = {l.as<float>(), 1, cfg, nullptr, ids.as<int32_t>(), wts.as<float>(), nullptr};
  f.attn = x.as<float>();
  f.residual = r.as<float>();
  f.norm_w = w.as<float>();
  EXPECT_FALSE(router_route_norm_supported(f));
  EXPECT_EQ(router_route(f).code(), StatusCode::kUnimplemented);
}

// Host-side twin of the GPU MLP on the activations the GPU GEMMs see.
std::vector<float> quant_like_gpu(const std::vector<float>& x, int64_t K, LinearFormat f) {
  std::vector<float> o = x;
  if (f == LinearFormat::kBF16) {
    for (auto& v : o) v = round_bf16(v);
  } else if (f == LinearFormat::kFP8Block) {
    std::vector<uint8_t> q(K);
    std::vector<float> s(K / 128);
    for (size_t r = 0; r < x.size() / K; ++r) {
      cpu::quantize_fp8_groups(x.data() + r * K, K, 128, q.data(), s.data());
      cpu::dequantize_fp8_groups(q.data(), s.data(), K, 128, o.data() + r * K);
    }
  }
  return o;
}

struct HostMlp {
  LinearWeight w1, w2, w3;
};

std::vector<float> host_mlp(const HostMlp& m, const std::vector<float>& x, int64_t M, int64_t D, bool exact = false) {
  const int64_t I = m.w1.out_features;
  auto xq = exact ? x : quant_like_gpu(x, D, m.w1.format);
  std::vector<float> g(M * I), u(M * I), y(M * D);
  cpu::linear(xq.data(), M, m.w1, g.data());
  cpu::linear(xq.data(), M, m.w3, u.data());
  cpu::silu_mul(g.data(), u.data(), M * I, g.data());
  auto hq = exact ? g : quant_like_gpu(g, I, m.w2.format);
  cpu::linear(hq.data(), M, m.w2, y.data());
  return y;
}

// n random experts (w1, w2, w3) in format f, on the host and on the device. blocky: each
// 128 x 128 block of a weight scaled by its own power of two (2^-2..2^2), so that its FP8
// block scales differ by powers of two and a wrong scale index shows as a gross error.
std::pair<std::vector<HostMlp>, std::vector<DeviceMlp>> make_experts(LinearFormat f, int n, int64_t D, int64_t I,
                                                                     uint32_t& seed, bool blocky = false) {
  auto make = [&](int64_t N, int64_t Kd) {
    auto w = randn(N * Kd, seed++, 1.0f / std::sqrt(static_cast<float>(Kd)));
    if (blocky)
      for (int64_t r = 0; r < N; ++r)
        for (int64_t k = 0; k < Kd; ++k)
          w[r * Kd + k] = std::ldexp(w[r * Kd + k], static_cast<int>((r / 128 + 2 * (k / 128) + seed) % 5) - 2);
    auto r = quantize_linear(w.data(), N, Kd, f, "w");
    EXPECT_TRUE(r.ok());
    return std::move(r).value();
  };
  auto up = [](const LinearWeight& l) {
    auto r = upload_linear(l);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return std::move(r).value();
  };
  std::vector<HostMlp> hx;
  std::vector<DeviceMlp> dx;
  for (int e = 0; e < n; ++e) {
    HostMlp h{make(I, D), make(D, I), make(I, D)};
    dx.push_back(DeviceMlp{up(h.w1), up(h.w2), up(h.w3)});
    hx.push_back(std::move(h));
  }
  return {std::move(hx), std::move(dx)};
}

// Routing from random ids / weights (the router is tested above): K distinct experts per
// token, as top-k selects them.
void random_routing(int64_t T, int E, int K, uint32_t seed, std::vector<int32_t>& ids, std::vector<float>& w) {
  std::mt19937 g(seed);
  ids.assign(T * K, 0);
  w.assign(T * K, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g);
    for (int k = 0; k < K; ++k) {
      ids[t * K + k] = perm[k];
      w[t * K + k] = std::uniform_real_distribution<float>(0.1f, 1.0f)(g);
    }
  }
}

// A MoE layer to test: E routed experts and a shared one (hx[E] on the host, `shared` on the
// device), T tokens of x and their routing.
struct MoeCase {
  std::vector<HostMlp> hx;
  std::vector<DeviceMlp> dx;
  DeviceMlp shared;
  std::vector<float> x, w;
  std::vector<int32_t> ids;
};
MoeCase make_moe_case(LinearFormat f, int E, int K, int64_t D, int64_t I, int64_t T, uint32_t seed,
                      bool blocky = false) {
  MoeCase c;
  auto ex = make_experts(f, E + 1, D, I, seed, blocky);
  c.hx = std::move(ex.first);
  c.dx = std::move(ex.second);
  c.shared = std::move(c.dx.back());
  c.dx.pop_back();
  c.x = randn(T * D, seed++);
  random_routing(T, E, K, seed++, c.ids, c.w);
  return c;
}

TEST(CudaMoe, ExpertsAndSharedVsCpu) {
  ML4_REQUIRE_GPU();
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  const int E = 8, K = 2;
  // T * K / E ~ 15 rows per expert: most experts take the FP8 GEMM path, some the GEMV.
  const int64_t D = 256, I = 384, T = 61;
  const int64_t Tmax = 64;  // tokens drawn; the loop path takes the first T, the decode path up to Tmax
  for (LinearFormat f : {LinearFormat::kBF16, LinearFormat::kFP8Block, LinearFormat::kNVFP4, LinearFormat::kMXFP4}) {
    const bool fp4 = f == LinearFormat::kNVFP4 || f == LinearFormat::kMXFP4;  // f32 x at every M (gemv.h)
    MoeCase c = make_moe_case(f, E, K, D, I, Tmax, 500 + static_cast<uint32_t>(f));
    const std::vector<HostMlp>& hx = c.hx;
    const std::vector<DeviceMlp>& dx = c.dx;
    const DeviceMlp& dshared = c.shared;
    const std::vector<float>& x = c.x;
    const std::vector<int32_t>& ids = c.ids;
    const std::vector<float>& w = c.w;
    // Reference. FP8 activations are exact (GEMV) for an expert with <= kGemvMaxM rows.
    std::vector<int64_t> rows_of(E, 0);
    for (int64_t i = 0; i < T * K; ++i) ++rows_of[ids[i]];
    auto exact_for = [&](int64_t rows) { return fp4 || (f == LinearFormat::kFP8Block && rows <= kGemvMaxM); };
    int gemm_experts = 0;
    for (int e = 0; e < E; ++e) gemm_experts += rows_of[e] > kGemvMaxM;
    std::vector<double> ref(T * D, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> xt(x.begin() + t * D, x.begin() + (t + 1) * D);
      for (int k = 0; k < K; ++k) {
        const int e = ids[t * K + k];
        auto y = host_mlp(hx[e], xt, 1, D, exact_for(rows_of[e]));
        for (int64_t d = 0; d < D; ++d) ref[t * D + d] += static_cast<double>(w[t * K + k]) * y[d];
      }
    }
    auto ysh = host_mlp(hx[E], std::vector<float>(x.begin(), x.begin() + T * D), T, D, exact_for(T));
    for (int64_t i = 0; i < T * D; ++i) ref[i] += ysh[i];

    MoeScratch s;
    ML4_ASSERT_OK(s.reserve(Tmax * K, D, I, E));
    auto dxb = to_device(x);
    auto dids = to_device(ids);
    auto dw = to_device(w);
    std::vector<std::vector<float>> runs;
    for (int rep = 0; rep < 2; ++rep) {
      auto out = poisoned<float>(T * D);
      ML4_ASSERT_OK(moe_experts_forward(**lt, dx, &dshared, dxb.as<float>(), T, D, dids.as<int32_t>(), dw.as<float>(),
                                        K, out.as<float>(), s, nullptr));
      sync();
      runs.push_back(to_host<float>(out, T * D));
    }
    ASSERT_TRUE(all_finite(runs[0]));
    const double e = rel_err(runs[0], ref);
    std::printf("moe experts+shared %s E=%d K=%d D=%ld I=%ld T=%ld (%d of %d experts > %d rows) rel_err=%.3g "
                "(bound 1e-2)\n",
                linear_format_name(f), E, K, D, I, T, gemm_experts, E, kGemvMaxM, e);
    EXPECT_LT(e, 1e-2);
    EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4)) << "not deterministic";

    // Decode path: expert-grouped GEMV, f32 activations, against the exact-activation
    // reference. What differs is the f32 summation order only (per-mma f32 accumulation of
    // exact products, FP8 block-scale FMAs, silu in f32, the combine): ~1e-7 measured at
    // T <= 8 before; the bound stays 1e-5 at T = 32 and 64, where experts own up to ~25
    // rows (several 8-row passes over one expert's weights) and the shared expert rides
    // along with all T rows: the passes change which rows share an mma, not the arithmetic
    // of any one output. The earlier row-wise path (T <= 8) is checked the same way.
    auto tables = build_expert_tables(dx);
    ML4_ASSERT_OK(tables.status());
    for (int64_t Tb : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{8}, int64_t{32}, int64_t{64}}) {
      std::vector<double> ref2(Tb * D, 0.0);
      for (int64_t t = 0; t < Tb; ++t) {
        std::vector<float> xt(x.begin() + t * D, x.begin() + (t + 1) * D);
        for (int k = 0; k < K; ++k) {
          auto y = host_mlp(hx[ids[t * K + k]], xt, 1, D, true);
          for (int64_t d = 0; d < D; ++d) ref2[t * D + d] += static_cast<double>(w[t * K + k]) * y[d];
        }
        auto ys = host_mlp(hx[E], xt, 1, D, true);
        for (int64_t d = 0; d < D; ++d) ref2[t * D + d] += ys[d];
      }
      // path 0: grouped, default kernel choice (FP4: the tensor cores, x in 3 parts, exact);
      // 1: grouped with the other grouped kernel (the stream kernels turned off where they are
      // the default, T <= 4, and the CUDA-core stream on where it is not: T >= 8 then runs in
      // passes of 4 rows; FP4: the exact CUDA-core stream); 2: row-wise (T <= 8).
      // (BF16 experts: path 0 streams them at T <= 2, bf16_stream 2, path 1 then takes the tensor
      // cores; at T > 2 the other way round.)
      // 3 (FP8, T = 1, 2): path 0 with each warp streaming its own 4 rows at every N
      // (GemvStreamConfig::warp_rows 2; the default, 1, takes them only at N >= 16 blocks an SM,
      // wider than these experts, so path 0 is the four-warp kernel, at T = 2 its M = 2 kernel).
      // 4 (FP8, T = 1, 2): the f16 mma kernel at one and two rows (gemv_mma.cuh; by default it
      // takes grouped launches of 3-4 rows an expert, so path 0 runs it at T = 3, one pass of 4
      // with the shared expert's 3 rows; x kept to 22 bits, ~1e-7: the same bound).
      const GemvStreamConfig saved = gemv_stream_config();
      const bool fp8 = f == LinearFormat::kFP8Block;
      const bool bf16 = f == LinearFormat::kBF16;
      for (int path = 0; path < 5; ++path) {
        if ((path == 2 && (Tb > kGemvMaxM || fp4)) || (path == 3 && !(fp8 && Tb <= 2)) ||  // FP4: no row-wise
            (path == 4 && !(fp8 && Tb <= 2)))
          continue;
        GemvStreamConfig c = saved;
        if (path == 1) {  // whichever of the stream and the tensor cores path 0 did not take
          const bool streams = fp8 ? Tb <= std::max(saved.grouped_max_rows, saved.mma)
                                   : bf16 && saved.bf16_stream == 2 && Tb <= saved.grouped_max_rows;
          c.grouped_max_rows = streams ? 0 : 1 << 20;
          c.mma = 0;                         // the CUDA-core stream when on
          c.bf16_stream = streams ? 1 : 2;   // BF16 experts: the stream at every T (passes of 4 rows), or never
        }
        if (path == 3) {  // the stream with one-warp rows, also at two rows an expert
          c.warp_rows = 2;
          c.warp_rows_max_m = 2;
          c.grouped_max_rows = 2;
          c.mma = 0;
        }
        if (path == 4) {
          c.mma = 4;
          c.mma_min_m = 1;
        }
        gemv_set_stream_config(c);
        std::vector<std::vector<float>> gr;
        for (int rep = 0; rep < 2; ++rep) {
          auto out = poisoned<float>(Tb * D);
          if (path != 2)
            ML4_ASSERT_OK(moe_experts_forward_grouped(*tables, &dshared, dxb.as<float>(), Tb, dids.as<int32_t>(),
                                                      dw.as<float>(), K, out.as<float>(), s, nullptr,
                                                      fp4 && path == 1 ? -1 : 0));
          else
            ML4_ASSERT_OK(moe_experts_forward_rowwise(*tables, &dshared, dxb.as<float>(), Tb, dids.as<int32_t>(),
                                                      dw.as<float>(), K, out.as<float>(), s, nullptr));
          sync();
          gr.push_back(to_host<float>(out, Tb * D));
        }
        ASSERT_TRUE(all_finite(gr[0]));
        const double e2 = rel_err(gr[0], ref2);
        gemv_set_stream_config(saved);
        std::printf("moe %s decode %s T=%ld rel_err=%.3g (bound 1e-5)\n",
                    path == 0   ? "grouped"
                    : path == 1 ? "grouped-other"
                    : path == 2 ? "rowwise"
                    : path == 3 ? "grouped-warp-rows"
                                : "grouped-mma",
                    linear_format_name(f), Tb, e2);
        EXPECT_LT(e2, 1e-5) << "T=" << Tb << " path " << path;
        EXPECT_EQ(0, std::memcmp(gr[0].data(), gr[1].data(), gr[0].size() * 4)) << "not deterministic";
      }
    }
  }
}

// The shared expert split from the routed ones (moe.h MoeSharedPart, the shared expert's lane
// of CudaRunnerOptions::shared_expert_lane): kSharedOnly on a second stream, started before
// and running beside kRoutedOnly on the first, whose combine waits for it through an event,
// against the whole layer in one call. The same launches with the slots split between them,
// so the same bits (memcmp); both also within the decode path's 1e-5 of the exact-activation
// reference (ExpertsAndSharedVsCpu's bound and argument). The shared expert has the routed
// shape (the extra slot); without it the split is refused.
TEST(CudaMoe, SharedExpertSplitIsBitIdentical) {
  ML4_REQUIRE_GPU();
  const int E = 8, K = 2;
  const int64_t D = 256, I = 384, Tmax = 32;
  cudaStream_t main_s = nullptr, lane = nullptr;
  cudaEvent_t fork = nullptr, done = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&lane, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  for (LinearFormat f : {LinearFormat::kBF16, LinearFormat::kFP8Block, LinearFormat::kNVFP4}) {
    MoeCase c = make_moe_case(f, E, K, D, I, Tmax, 900 + static_cast<uint32_t>(f));
    auto tables = build_expert_tables(c.dx, &c.shared);
    ML4_ASSERT_OK(tables.status());
    ASSERT_TRUE(tables->shared_slot);
    MoeScratch s;
    ML4_ASSERT_OK(s.reserve(Tmax * K, D, I, E));
    auto dxb = to_device(c.x);
    auto dids = to_device(c.ids);
    auto dw = to_device(c.w);
    for (int64_t T : {int64_t{1}, int64_t{4}, int64_t{8}, int64_t{32}}) {
      std::vector<double> ref(T * D, 0.0);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> xt(c.x.begin() + t * D, c.x.begin() + (t + 1) * D);
        for (int k = 0; k < K; ++k) {
          auto y = host_mlp(c.hx[c.ids[t * K + k]], xt, 1, D, true);
          for (int64_t d = 0; d < D; ++d) ref[t * D + d] += static_cast<double>(c.w[t * K + k]) * y[d];
        }
        auto ys = host_mlp(c.hx[E], xt, 1, D, true);
        for (int64_t d = 0; d < D; ++d) ref[t * D + d] += ys[d];
      }
      auto whole = poisoned<float>(T * D);
      ML4_ASSERT_OK(moe_experts_forward_grouped(*tables, &c.shared, dxb.as<float>(), T, dids.as<int32_t>(),
                                                dw.as<float>(), K, whole.as<float>(), s, main_s));
      ASSERT_EQ(cudaStreamSynchronize(main_s), cudaSuccess);
      const std::vector<float> a = to_host<float>(whole, T * D);
      auto split = poisoned<float>(T * D);
      ASSERT_EQ(cudaEventRecord(fork, main_s), cudaSuccess);
      ASSERT_EQ(cudaStreamWaitEvent(lane, fork, 0), cudaSuccess);
      MoeSharedPart only;
      only.mode = MoeSharedPart::kSharedOnly;
      ML4_ASSERT_OK(moe_experts_forward_grouped(*tables, &c.shared, dxb.as<float>(), T, nullptr, nullptr, K, nullptr, s,
                                                lane, 0, only));
      ASSERT_EQ(cudaEventRecord(done, lane), cudaSuccess);
      MoeSharedPart rest;
      rest.mode = MoeSharedPart::kRoutedOnly;
      rest.shared_ready = done;
      ML4_ASSERT_OK(moe_experts_forward_grouped(*tables, &c.shared, dxb.as<float>(), T, dids.as<int32_t>(),
                                                dw.as<float>(), K, split.as<float>(), s, main_s, 0, rest));
      ASSERT_EQ(cudaStreamSynchronize(main_s), cudaSuccess);
      const std::vector<float> b = to_host<float>(split, T * D);
      ASSERT_TRUE(all_finite(a));
      const double e = rel_err(b, ref);
      std::printf("moe shared split %s T=%ld rel_err=%.3g (bound 1e-5), bit-identical to the whole: %s\n",
                  linear_format_name(f), T, e, std::memcmp(a.data(), b.data(), a.size() * 4) == 0 ? "yes" : "NO");
      EXPECT_LT(e, 1e-5) << linear_format_name(f) << " T=" << T;
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << linear_format_name(f) << " T=" << T;
    }
    // A shared expert of another width does not fit the extra slot: the split is refused.
    uint32_t narrow_seed = 77;
    auto narrow = make_experts(f, 1, D, I * 2, narrow_seed);
    MoeSharedPart only;
    only.mode = MoeSharedPart::kSharedOnly;
    EXPECT_FALSE(moe_experts_forward_grouped(*tables, &narrow.second[0], dxb.as<float>(), 1, nullptr, nullptr, K,
                                             nullptr, s, lane, 0, only)
                     .ok());
  }
  cudaEventDestroy(fork);
  cudaEventDestroy(done);
  cudaStreamDestroy(main_s);
  cudaStreamDestroy(lane);
}

// The grouped-GEMM prefill path (moe_gemm.h) against the same CPU reference as the loop:
// x quantized per token and 1x128 group exactly as act_quant does, the hidden activation
// likewise, so what differs is the accumulation order inside each 128-wide K block (the
// tensor cores' f32 sums) and the rare e4m3 flip of a hidden value that lands on a rounding
// boundary (one flip moves one element by 2^-4 relative): bound 1e-2 as for the loop, and
// the loop itself on the same inputs (both quantize alike where the loop's experts all have
// more than 8 rows) within 1e-2. Shapes: D = 640
// leaves the down projection's last 256-column tile partial; skewed routing gives one
// expert every token (several 64-row tiles) and one no row; T = 5 gives tiles of 1-2 rows;
// every 128 x 128 weight block scaled by its own power of two (a wrong scale index is gross).
// Expert 0 first for every token, expert E-1 never; the K ids of a token stay distinct.
void skew_routing(std::vector<int32_t>& ids, int64_t T, int E, int K) {
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k)
      if (ids[t * K + k] == 0 || ids[t * K + k] == E - 1) ids[t * K + k] = ids[t * K];
    ids[t * K] = 0;
    for (int k = 1; k < K; ++k) {  // refill duplicates from 1..E-2
      std::set<int32_t> used(ids.begin() + t * K, ids.begin() + t * K + k);
      int32_t e = ids[t * K + k];
      while (used.count(e) || e == 0 || e == E - 1) e = 1 + (e + 1) % (E - 2);
      ids[t * K + k] = e;
    }
  }
}

// Also: the permutation's invariants, bit-identical repeats, a CUDA graph replay equal to
// eager, and the path without a shared expert.
TEST(CudaMoe, GroupedGemmPrefillVsCpu) {
  ML4_REQUIRE_GPU();
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  const int E = 16, K = 4;
  for (auto [D, I, T] : {std::tuple<int64_t, int64_t, int64_t>{640, 384, 300}, {512, 256, 5}}) {
    MoeCase c = make_moe_case(LinearFormat::kFP8Block, E, K, D, I, T, 900 + static_cast<uint32_t>(T), /*blocky=*/true);
    const std::vector<HostMlp>& hx = c.hx;
    const std::vector<DeviceMlp>& dx = c.dx;
    const DeviceMlp& dshared = c.shared;
    const std::vector<float>& x = c.x;
    std::vector<int32_t>& ids = c.ids;
    const std::vector<float>& w = c.w;
    skew_routing(ids, T, E, K);
    for (bool with_shared : {true, false}) {
      std::vector<double> ref(T * D, 0.0);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> xt(x.begin() + t * D, x.begin() + (t + 1) * D);
        for (int k = 0; k < K; ++k) {
          auto y = host_mlp(hx[ids[t * K + k]], xt, 1, D);
          for (int64_t d = 0; d < D; ++d) ref[t * D + d] += static_cast<double>(w[t * K + k]) * y[d];
        }
      }
      if (with_shared) {
        auto ysh = host_mlp(hx[E], x, T, D);
        for (int64_t i = 0; i < T * D; ++i) ref[i] += ysh[i];
      }
      const DeviceMlp* sh = with_shared ? &dshared : nullptr;
      auto tables = build_expert_tables(dx, sh);
      ML4_ASSERT_OK(tables.status());
      ASSERT_EQ(tables->shared_slot, with_shared);
      ASSERT_TRUE(moe_gemm_supported(*tables, sh));
      MoeScratch s;
      ML4_ASSERT_OK(s.reserve(T * K, D, I, E));
      auto dxb = to_device(x);
      auto dids = to_device(ids);
      auto dw = to_device(w);
      std::vector<std::vector<float>> runs;
      for (int rep = 0; rep < 2; ++rep) {
        auto out = poisoned<float>(T * D);
        ML4_ASSERT_OK(moe_experts_forward_gemm(*tables, sh, dxb.as<float>(), T, dids.as<int32_t>(), dw.as<float>(), K,
                                               out.as<float>(), s, nullptr));
        sync();
        runs.push_back(to_host<float>(out, T * D));
      }
      ASSERT_TRUE(all_finite(runs[0]));
      const double e = rel_err(runs[0], ref);
      EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4)) << "not deterministic";
      // The permutation: every (t, k) row lies in its expert's range and points back to t.
      const auto offsets = to_host<int32_t>(s.offsets, E + 2);
      const auto perm = to_host<int32_t>(s.perm_token, T * K + T);
      const auto inv = to_host<int32_t>(s.inv, T * K);
      EXPECT_EQ(offsets[0], 0);
      EXPECT_EQ(offsets[1], T) << "expert 0 owns every token";
      EXPECT_EQ(offsets[E], offsets[E - 1]) << "expert E-1 owns no row";
      if (with_shared) EXPECT_EQ(offsets[E + 1], T * K + T);
      for (int64_t i = 0; i < T * K; ++i) {
        const int32_t r = inv[i], ex_id = ids[i];
        ASSERT_TRUE(r >= offsets[ex_id] && r < offsets[ex_id + 1]) << "row " << i;
        ASSERT_EQ(perm[r], i / K) << "row " << i;
      }
      // The loop over experts on the same inputs, where it quantizes the activations too: every
      // expert with rows has more than kGemvMaxM (fewer take the exact-activation GEMV).
      bool loop_quantizes = T > kGemvMaxM;
      for (int e = 0; e < E; ++e) {
        const int64_t n_e = offsets[e + 1] - offsets[e];
        loop_quantizes = loop_quantizes && (n_e == 0 || n_e > kGemvMaxM);
      }
      double el = 0.0;
      if (loop_quantizes) {
        auto loop_out = poisoned<float>(T * D);
        ML4_ASSERT_OK(moe_experts_forward(**lt, dx, sh, dxb.as<float>(), T, D, dids.as<int32_t>(), dw.as<float>(), K,
                                          loop_out.as<float>(), s, nullptr));
        sync();
        const auto loop = to_host<float>(loop_out, T * D);
        el = rel_err(runs[0], std::vector<double>(loop.begin(), loop.end()));
      }
      // Replayed from a CUDA graph: the same bits (no host synchronization inside).
      cudaStream_t st;
      ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
      auto gout = poisoned<float>(T * D);
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), cudaSuccess);
      const Status cs = moe_experts_forward_gemm(*tables, sh, dxb.as<float>(), T, dids.as<int32_t>(), dw.as<float>(),
                                                 K, gout.as<float>(), s, st);
      ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
      ML4_ASSERT_OK(cs);
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
      const auto graphed = to_host<float>(gout, T * D);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(st);
      EXPECT_EQ(0, std::memcmp(runs[0].data(), graphed.data(), graphed.size() * 4)) << "graph replay differs";
      std::printf("moe grouped GEMM fp8 E=%d K=%d D=%ld I=%ld T=%ld shared=%d rel_err=%.3g vs CPU, %.3g vs the "
                  "expert loop%s (bounds 1e-2)\n",
                  E, K, D, I, T, with_shared ? 1 : 0, e, el, loop_quantizes ? "" : " (not run: GEMV experts)");
      EXPECT_LT(e, 1e-2);
      EXPECT_LT(el, 1e-2);
    }
  }
}

// The variants below (and gpu_moe_bench) build MoeGemmOptions by position: each field keeps
// its place (a field once inserted ahead of quant_epilogue shifted every later one).
TEST(CudaMoe, GemmOptionsKeepTheirPositions) {
  const MoeGemmOptions a{true, false, false, false, false};
  EXPECT_TRUE(a.overlap);
  EXPECT_FALSE(a.quant_epilogue);
  EXPECT_TRUE(a.tma);
  EXPECT_FALSE(a.swap);
  const MoeGemmOptions b{false, false, true, true, true, false};
  EXPECT_TRUE(b.group_major && b.specialized && b.quant_epilogue);
  EXPECT_FALSE(b.tma);
  const MoeGemmOptions c{false, false, true, false, true, true, true};
  EXPECT_TRUE(c.swap);
  EXPECT_FALSE(c.swap_down);
  const MoeGemmOptions d{false, false, true, true, true, true, false, true};
  EXPECT_TRUE(d.swap_down && d.specialized && d.tma);
  EXPECT_FALSE(d.swap);
  EXPECT_FALSE(MoeGemmOptions{}.swap_down);
  EXPECT_FALSE(MoeGemmOptions{}.swap);
  EXPECT_FALSE(MoeGemmOptions{}.specialized);
}

// MoeGroupedGemmParams::overlap (the next K block's MMAs issued before this block's
// promotion, two partial accumulators) computes the same sums in the same order: the whole
// grouped MoE (both launches, the shared slot) bit-identical to the serial kernel, for K
// blocks odd, even and one (D / I of 640 / 384, 512 / 256, 128 / 256), tiles full and partial.
// So does MoeGroupedGemmParams::tall (128-row tiles, each warpgroup 64 rows against both
// halves of the B tile): expert 0 takes every token (skew_routing), so T = 300 gives it three
// tall tiles, the last partial, and T = 5 tiles of one or two rows; D = 640 leaves the down
// projection's last CTA with an empty second half. And MoeGemmOptions::group_major (the CTAs
// in group-major order, MoeGroupedGemmParams::tile_first) with each: the same bits. So does
// MoeGemmOptions::specialized (the tall tiles warp-specialized and persistent: the T = 5 tiles
// leave consumer warpgroup 1 idle; T = 2000 gives ~95 tall tiles x 3 columns, more than a
// card's 132 multiprocessors, so its CTAs walk several tiles through the one ring), plain and
// group-major. And every one (but tall) with its gate_up epilogue quantizing the hidden rows
// (quant_epilogue, the default) against the first, which quantizes them in fp8_act_quant's own
// launch: the same e4m3 bytes and scales, so the same bits. And MoeGemmOptions::swap_down (the
// down projection on the swapped kernel over a second tile list of 160-row tiles).
TEST(CudaMoe, GroupedGemmVariantsAreBitIdentical) {
  ML4_REQUIRE_GPU();
  const int E = 16, K = 4;
  for (auto [D, I, T] :
       {std::tuple<int64_t, int64_t, int64_t>{640, 384, 300}, {512, 256, 5}, {128, 256, 70}, {640, 384, 2000}}) {
    MoeCase c = make_moe_case(LinearFormat::kFP8Block, E, K, D, I, T, 1700 + static_cast<uint32_t>(T), /*blocky=*/true);
    skew_routing(c.ids, T, E, K);
    auto tables = build_expert_tables(c.dx, &c.shared);
    ML4_ASSERT_OK(tables.status());
    // The specialized variants' B by TMA (tma, on by default) needs the tables' tensor maps;
    // without them they would quietly take cp.async.
    ASSERT_NE(tables->t1.data(), nullptr);
    ASSERT_NE(tables->t2.data(), nullptr);
    MoeScratch s;
    ML4_ASSERT_OK(s.reserve(T * K, D, I, E));
    auto dxb = to_device(c.x);
    auto dids = to_device(c.ids);
    auto dw = to_device(c.w);
    std::vector<std::vector<float>> runs;
    // The first quantizes the hidden rows in their own launch (fp8_act_quant), the reference of
    // every other's quantizing epilogue (quant_epilogue, on by default; the tall kernel has none).
    // The specialized ones with B by TMA (the default) and by cp.async; then the swapped kernel
    // (tokens as the MMA's N) group-major and not. All must give the first one's bits.
    const MoeGemmOptions variants[] = {
        {false, false, false, false, false}, {false, false, false}, {true, false, false},        {false, true, false},
        {false, false, true},                {true, false, true},   {false, true, true},         {false, false, false, true},
        {false, false, true, true},          {true, false, true, true, false}, {false, false, true, true, true, false},
        {false, false, false, true, false, false}, {false, false, true, false, true, true, true},
        {false, false, false, false, true, true, true},
        // The down projection alone on the swapped kernel over its own tiles (swap_down), gate_up
        // specialized (group-major and not) or on the 64-row kernel.
        {false, false, true, true, true, true, false, true}, {false, false, false, true, true, true, false, true},
        {true, false, true, false, true, true, false, true}};
    for (const MoeGemmOptions& o : variants) {
      auto out = poisoned<float>(T * D);
      ML4_ASSERT_OK(moe_experts_forward_gemm(*tables, &c.shared, dxb.as<float>(), T, dids.as<int32_t>(), dw.as<float>(),
                                             K, out.as<float>(), s, nullptr, nullptr, o));
      sync();
      runs.push_back(to_host<float>(out, T * D));
    }
    ASSERT_TRUE(all_finite(runs[0]));
    double norm = 0.0;
    for (float v : runs[0]) norm += static_cast<double>(v) * v;
    EXPECT_GT(norm, 0.0);
    for (size_t v = 1; v < runs.size(); ++v) {
      // The swapped operands too: each output is the same sum of the same products per K block,
      // and the tensor cores add a block's products alike for A.B^T and B.A^T (all eight cases
      // bit-identical on an H100, sixteenth session).
      const bool same = std::memcmp(runs[0].data(), runs[v].data(), runs[0].size() * 4) == 0;
      EXPECT_TRUE(same) << "variant " << v << " (overlap " << variants[v].overlap << ", tall " << variants[v].tall
                        << ", group-major " << variants[v].group_major << ", specialized " << variants[v].specialized
                        << ", quant epilogue " << variants[v].quant_epilogue << ", tma " << variants[v].tma
                        << ", swap " << variants[v].swap << ", swap_down " << variants[v].swap_down << "): D=" << D
                        << " I=" << I << " T=" << T;
    }
  }
}

// The grouped GEMMs with NVFP4 / MXFP4 experts (moe_grouped_gemm_fp4, issue 18) against the
// CPU's decode of the same weights (cpu::linear), fresh random inputs, routing skewed as above
// (expert 0 every token: several 64-row tiles; expert E-1 no row; T = 5: tiles of 1-2 rows),
// D = 640 leaving the down projection's last 256-column tile partial; the shared expert in the
// tables' slot (FP4, the routed shape), outside it (FP8 block, through mlp_forward on
// cuBLASLt, as NVFP4 checkpoints hold it) and absent. Two references:
//   mimic: the CPU's arithmetic on what the GPU rounds -- x and the hidden rows to bf16,
//          weights exact -- so only the f32 summation order and where the NVFP4 global scale
//          is applied differ (~1e-6 relative; a hidden value within that of a bf16 rounding
//          boundary lands one bf16 step apart, rare and 2^-8 of one element). Bound 1e-4.
//   exact: f32 activations (what the FP4 GEMV loop computes). Rounding x and h to bf16 gives
//          each element a relative error within +-2^-9 (RMS 2^-9 / sqrt(3) = 1.1e-3); x feeds
//          gate and up, h the down projection, so the output's relative error is about
//          sqrt(3) x 1.1e-3 ~ 2e-3. Bound 5e-3 (a wrong scale or a misplaced nibble is gross).
// The FP8 shared expert quantizes its activations per 1x128 group (its own error, ~1e-2 of
// its share): there both references take the CPU's FP8-activation MLP for it and the mimic
// bound is not asserted (an e4m3 step flip of one hidden value is 2^-3 of it).
// Also: bit-identical repeats, a CUDA graph replay equal to eager.
TEST(CudaMoe, GroupedGemmFp4PrefillVsCpu) {
  ML4_REQUIRE_GPU();
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  const int E = 16, K = 4;
  auto mimic_mlp = [](const HostMlp& m, std::vector<float> xq, int64_t M) {
    const int64_t I = m.w1.out_features, D = m.w2.out_features;
    for (auto& v : xq) v = round_bf16(v);
    std::vector<float> g(M * I), u(M * I), y(M * D);
    cpu::linear(xq.data(), M, m.w1, g.data());
    cpu::linear(xq.data(), M, m.w3, u.data());
    cpu::silu_mul(g.data(), u.data(), M * I, g.data());
    for (auto& v : g) v = round_bf16(v);
    cpu::linear(g.data(), M, m.w2, y.data());
    return y;
  };
  for (LinearFormat f : {LinearFormat::kNVFP4, LinearFormat::kMXFP4}) {
    for (auto [D, I, T] : {std::tuple<int64_t, int64_t, int64_t>{640, 384, 300}, {512, 256, 5}}) {
      const uint32_t base = 1300 + static_cast<uint32_t>(T) + 17 * static_cast<uint32_t>(f);
      MoeCase c = make_moe_case(f, E, K, D, I, T, base);
      skew_routing(c.ids, T, E, K);
      uint32_t seed = base + 5000;
      auto fp8_shared = make_experts(LinearFormat::kFP8Block, 1, D, I, seed);
      const std::vector<float>& x = c.x;
      std::vector<double> routed_exact(T * D, 0.0), routed_mimic(T * D, 0.0);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> xt(x.begin() + t * D, x.begin() + (t + 1) * D);
        for (int k = 0; k < K; ++k) {
          const HostMlp& m = c.hx[c.ids[t * K + k]];
          const auto ye = host_mlp(m, xt, 1, D, /*exact=*/true), ym = mimic_mlp(m, xt, 1);
          for (int64_t d = 0; d < D; ++d) {
            routed_exact[t * D + d] += static_cast<double>(c.w[t * K + k]) * ye[d];
            routed_mimic[t * D + d] += static_cast<double>(c.w[t * K + k]) * ym[d];
          }
        }
      }
      for (int mode = 0; mode < 3; ++mode) {  // shared expert: 0 the FP4 slot, 1 FP8 outside it, 2 none
        const char* mode_name = mode == 0 ? "fp4 slot" : mode == 1 ? "fp8 via cuBLASLt" : "none";
        const DeviceMlp* sh = mode == 0 ? &c.shared : mode == 1 ? &fp8_shared.second[0] : nullptr;
        std::vector<double> ref_exact = routed_exact, ref_mimic = routed_mimic;
        if (mode == 0) {
          const auto ye = host_mlp(c.hx[E], x, T, D, true), ym = mimic_mlp(c.hx[E], x, T);
          for (int64_t i = 0; i < T * D; ++i) {
            ref_exact[i] += ye[i];
            ref_mimic[i] += ym[i];
          }
        } else if (mode == 1) {
          const auto yq = host_mlp(fp8_shared.first[0], x, T, D, /*exact=*/T <= kGemvMaxM);  // linear.h: GEMV up to 8 rows
          for (int64_t i = 0; i < T * D; ++i) {
            ref_exact[i] += yq[i];
            ref_mimic[i] += yq[i];
          }
        }
        auto tables = build_expert_tables(c.dx, sh);
        ML4_ASSERT_OK(tables.status());
        ASSERT_EQ(tables->shared_slot, mode == 0);
        ASSERT_TRUE(moe_gemm_supported(*tables, sh, /*lt_available=*/true));
        EXPECT_EQ(moe_gemm_supported(*tables, sh, false), mode != 1) << "an FP8 shared expert needs the LtGemm";
        MoeScratch s;
        ML4_ASSERT_OK(s.reserve(T * K, D, I, E));
        auto dxb = to_device(x);
        auto dids = to_device(c.ids);
        auto dw = to_device(c.w);
        std::vector<std::vector<float>> runs;
        for (int rep = 0; rep < 2; ++rep) {
          auto out = poisoned<float>(T * D);
          ML4_ASSERT_OK(moe_experts_forward_gemm(*tables, sh, dxb.as<float>(), T, dids.as<int32_t>(), dw.as<float>(),
                                                 K, out.as<float>(), s, nullptr, lt->get()));
          sync();
          runs.push_back(to_host<float>(out, T * D));
        }
        ASSERT_TRUE(all_finite(runs[0]));
        EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4)) << "not deterministic";
        const double ee = rel_err(runs[0], ref_exact), em = rel_err(runs[0], ref_mimic);
        cudaStream_t st;
        ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
        auto gout = poisoned<float>(T * D);
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), cudaSuccess);
        const Status cs = moe_experts_forward_gemm(*tables, sh, dxb.as<float>(), T, dids.as<int32_t>(),
                                                   dw.as<float>(), K, gout.as<float>(), s, st, lt->get());
        ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
        ML4_ASSERT_OK(cs);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        const auto graphed = to_host<float>(gout, T * D);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(st);
        EXPECT_EQ(0, std::memcmp(runs[0].data(), graphed.data(), graphed.size() * 4)) << "graph replay differs";
        std::printf("moe grouped GEMM %s E=%d K=%d D=%ld I=%ld T=%ld shared=%s: rel_err %.3g vs the CPU on bf16 "
                    "activations (bound 1e-4%s), %.3g vs the exact CPU (bound 5e-3)\n",
                    linear_format_name(f), E, K, D, I, T, mode_name, em, mode == 1 ? ", not asserted" : "", ee);
        if (mode != 1) EXPECT_LT(em, 1e-4);
        EXPECT_LT(ee, 5e-3);
      }
    }
  }
}

// The resident FFN kernel (ops/cuda/ffn_resident.h) against the CPU on random inputs: the
// residual add exact (one f32 add); the normalized row as the CPU computes it (f64 sum of
// squares, one f32 scale) within 1e-6 (the sum's order differs); the router's logits against
// f64 sums within 1e-5 (f32 sums of D products); the routing equal to cpu::moe_route on the
// kernel's own logits (the same rule, exact); out against f32 CPU linears on the kernel's x
// with the kernel's routing, f32 activations (no rounding of x or the hidden rows: the FP8
// weights are decoded exactly, so only the summation order and expf's last bits differ,
// ~1e-7): bound 1e-5 of the rows' norm. Shapes: ML4's routing (softmax, renormalized) with
// and without a shared expert, ml4-tiny's (two groups keeping one, routed_scale 1.5, a
// correction bias), a dense MLP; widths not multiples of 512 (the stream's partial batches);
// T = 1..4. A second run with 3 blocks a multiprocessor (T = 1: 4 by default) gives the same
// bits (items go to blocks by a counter, so each run's assignment differs too). The fault switch: a block that never arrives makes
// the others' first barrier time out (50 ms here), the kernel ends, the record names wait
// site 1 and a block other than the absent one, and the same stream then runs clean.
TEST(CudaMoe, ResidentFfnMatchesCpu) {
  ML4_REQUIRE_GPU();
  struct Case {
    int E, K, G, keep;
    double scale;
    bool bias, shared;
    int64_t D, I, I_mlp;  // E == 0: a dense layer of hidden I_mlp
  };
  const Case cases[] = {{16, 4, 1, 1, 1.0, false, true, 640, 384, 384},
                        {8, 2, 2, 1, 1.5, true, true, 256, 128, 128},
                        {16, 4, 1, 1, 1.0, false, false, 384, 256, 0},
                        {0, 0, 1, 1, 1.0, false, false, 512, 0, 1152}};
  auto fault = FaultWord::create();
  ML4_ASSERT_OK(fault.status());
  auto barrier = poisoned<uint8_t>(sizeof(GridBarrierState));
  auto counters = poisoned<unsigned>(4);  // the kernel zeroes them
  auto routing = poisoned<uint8_t>(ffn_resident_routing_bytes());
  auto scratch = [&](FfnResidentParams* p) {  // the kernel's own state
    p->barrier = barrier.as<GridBarrierState>();
    p->counters = counters.as<unsigned>();
    p->routing = routing.data();
    p->fault = fault->device();
  };
  uint32_t seed = 900;
  for (const Case& c : cases) {
    const int64_t D = c.D;
    MoeConfig cfg = route_config(c.E, c.K, c.G, c.keep, RouterScoring::kSoftmax);
    cfg.routed_scale = c.scale;
    cfg.num_shared_experts = c.shared ? 1 : 0;
    const bool moe = c.E > 0;
    auto ex = make_experts(LinearFormat::kFP8Block, c.E, D, c.I, seed, /*blocky=*/true);
    auto mlp = make_experts(LinearFormat::kFP8Block, c.I_mlp > 0 ? 1 : 0, D, c.I_mlp, seed, true);
    Result<MoeExpertTables> tables = moe ? build_expert_tables(ex.second) : Result<MoeExpertTables>(MoeExpertTables{});
    ML4_ASSERT_OK(tables.status());
    auto gate = randn(std::max(c.E, 1) * D, seed++, 1.0f / std::sqrt(static_cast<float>(D)));
    auto bias = randn(std::max(c.E, 1), seed++, 0.05f);
    auto norm_w = randn(D, seed++, 0.2f);
    for (auto& v : norm_w) v += 1.0f;
    auto dgate = to_device(gate), dbias = to_device(bias), dnorm = to_device(norm_w);
    for (int T = 1; T <= 4; ++T) {
      auto attn = randn(T * D, seed++), res = randn(T * D, seed++, 3.0f);
      const int K = moe ? c.K : 0;
      auto hidden = poisoned<float>(ffn_resident_hidden_floats(T, K, c.I, c.I_mlp, D));
      std::vector<std::vector<float>> outs;
      for (int rep = 0; rep < 2; ++rep) {
        auto dattn = to_device(attn), dres = to_device(res);
        auto da = poisoned<float>(T * D);
        auto dout = poisoned<float>(T * D);
        auto dlog = poisoned<float>(std::max(T * c.E, 1));
        auto dids = poisoned<int32_t>(std::max(T * K, 1));
        auto dw = poisoned<float>(std::max(T * K, 1));
        ML4_ASSERT_OK(barrier.fill_bytes(0));
        FfnResidentParams p;
        p.T = T;
        p.D = D;
        p.attn_out = dattn.as<float>();
        p.residual = dres.as<float>();
        p.norm_w = dnorm.as<float>();
        p.eps = 1e-6f;
        p.a = da.as<float>();
        if (moe) {
          p.gate = dgate.as<float>();
          p.bias = c.bias ? dbias.as<float>() : nullptr;
          p.moe = cfg;
          set_routed_experts(&p, *tables);
          p.logits = dlog.as<float>();
          p.ids = dids.as<int32_t>();
          p.weights = dw.as<float>();
        }
        if (c.I_mlp > 0) p.mlp = resident_mlp(mlp.second[0].w1, mlp.second[0].w2, mlp.second[0].w3);
        p.hidden = hidden.as<float>();
        p.out = dout.as<float>();
        scratch(&p);
        p.blocks_per_sm = rep == 0 ? 0 : 3;  // the second run with 3 blocks a multiprocessor
        ML4_ASSERT_OK(ffn_resident(p));
        sync();
        ML4_ASSERT_OK(fault->status("ffn_resident"));
        const auto out = to_host<float>(dout, T * D);
        ASSERT_TRUE(all_finite(out));
        outs.push_back(out);
        if (rep == 1) continue;
        // The residual and the normalized rows.
        const auto res2 = to_host<float>(dres, T * D);
        std::vector<float> xn(T * D);
        for (int64_t i = 0; i < T * D; ++i) ASSERT_EQ(res2[i], attn[i] + res[i]) << i;
        for (int t = 0; t < T; ++t) {
          double ss = 0.0;
          for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(res2[t * D + d]) * res2[t * D + d];
          const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(D) + 1e-6));
          for (int64_t d = 0; d < D; ++d) xn[t * D + d] = res2[t * D + d] * inv * norm_w[d];
        }
        // Routing and the reference output on the kernel's routing.
        std::vector<double> ref(T * D, 0.0);
        std::vector<int32_t> ids;
        std::vector<float> w;
        if (moe) {
          const auto lg = to_host<float>(dlog, T * c.E);
          EXPECT_LT(rel_err(lg, router_logits_f64(gate, xn, T, c.E, D)), 1e-5) << "logits, E=" << c.E << " T=" << T;
          ids = to_host<int32_t>(dids, T * K);
          w = to_host<float>(dw, T * K);
          std::vector<int32_t> rid(T * K);
          std::vector<float> rw(T * K);
          cpu::moe_route(lg.data(), T, cfg, c.bias ? bias.data() : nullptr, rid.data(), rw.data());
          EXPECT_EQ(ids, rid) << "E=" << c.E << " T=" << T;
          EXPECT_LT(rel_err(w, rw), 1e-6);
        }
        for (int t = 0; t < T; ++t) {
          std::vector<float> xt(xn.begin() + t * D, xn.begin() + (t + 1) * D);
          for (int k = 0; k < K; ++k) {
            auto y = host_mlp(ex.first[ids[t * K + k]], xt, 1, D, /*exact=*/true);
            for (int64_t d = 0; d < D; ++d) ref[t * D + d] += static_cast<double>(w[t * K + k]) * y[d];
          }
          if (c.I_mlp > 0) {
            auto y = host_mlp(mlp.first[0], xt, 1, D, true);
            for (int64_t d = 0; d < D; ++d) ref[t * D + d] += y[d];
          }
        }
        const double e = rel_err(out, ref);
        std::printf("resident ffn E=%d K=%d shared=%d D=%ld I=%ld mlp=%ld T=%d: out rel_err=%.3g (bound 1e-5)\n", c.E,
                    K, c.shared ? 1 : 0, static_cast<long>(D), static_cast<long>(c.I), static_cast<long>(c.I_mlp), T, e);
        EXPECT_LT(e, 1e-5);
      }
      EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4))
          << "the two launch shapes: not the same sums";
    }
  }

  // The fault switch, on the last case's shape (a dense layer).
  {
    const Case& c = cases[3];
    auto mlp = make_experts(LinearFormat::kFP8Block, 1, c.D, c.I_mlp, seed, false);
    auto dnorm = to_device(std::vector<float>(c.D, 1.0f));
    auto dattn = to_device(randn(c.D, seed++)), dres = to_device(randn(c.D, seed++));
    auto hidden = poisoned<float>(ffn_resident_hidden_floats(1, 0, 0, c.I_mlp, c.D));
    auto dout = poisoned<float>(c.D), da = poisoned<float>(c.D);
    FfnResidentParams p;
    p.T = 1;
    p.a = da.as<float>();
    p.D = c.D;
    p.attn_out = dattn.as<float>();
    p.residual = dres.as<float>();
    p.norm_w = dnorm.as<float>();
    p.mlp = resident_mlp(mlp.second[0].w1, mlp.second[0].w2, mlp.second[0].w3);
    p.hidden = hidden.as<float>();
    p.out = dout.as<float>();
    scratch(&p);
    p.timeout_ns = 50'000'000;
    p.never_arrive_block = 3;
    ML4_ASSERT_OK(barrier.fill_bytes(0));
    const auto t0 = std::chrono::steady_clock::now();
    ML4_ASSERT_OK(ffn_resident(p));
    sync();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const DeviceFault f = fault->read();
    EXPECT_EQ(f.code, kFaultWaitTimeout);
    EXPECT_EQ(f.site, 1u);
    EXPECT_NE(f.block, 3u);
    EXPECT_GE(f.waited_us, 50'000u);
    EXPECT_LT(secs, 5.0);
    const Status st = fault->status("ffn_resident");
    EXPECT_NE(st.message().find("wait site 1"), std::string::npos) << st.message();
    // The stream and the card go on: cleared, the same launch without the switch passes.
    fault->clear();
    ML4_ASSERT_OK(barrier.fill_bytes(0));
    p.never_arrive_block = -1;
    ML4_ASSERT_OK(ffn_resident(p));
    sync();
    ML4_ASSERT_OK(fault->status("ffn_resident"));
    EXPECT_TRUE(all_finite(to_host<float>(dout, c.D)));
  }
  // Shapes the kernel does not take are refused by name.
  FfnResidentParams bad;
  bad.T = 5;
  bad.D = 300;
  const Status st = ffn_resident(bad);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("5 tokens"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("width 300"), std::string::npos) << st.message();
}

// The argmax of the drafter's Markov head and of greedy rows (argmax_rows): rows a + b (b at the
// slot-interleaved stride of the drafter's base logits) against the host's argmax of the same
// f32 sums, exact: ties across tiles (the lower id), NaN, -0 vs +0, an all-NaN row and a row
// of -inf, both load paths (V % 4 == 0: float4; V odd: scalar), without b, and twice (the
// workspace needs no initialisation).
TEST(CudaSampling, ArgmaxWithBaseMatchesHost) {
  ML4_REQUIRE_GPU();
  for (const int64_t V : {int64_t{131072}, int64_t{131072 + 7}, int64_t{4095}}) {
    const int64_t B = 6, bstride = 3 * V;  // base rows interleaved as x.logits + (j - 1) * V
    auto a = randn(B * V, 11);
    auto base = randn(B * bstride, 12, 4.0f);
    // Row 0: a tie of the sums in different tiles (when V has several): the lower id wins.
    const int64_t lo = V > 5000 ? 5000 : V / 3;
    a[0 * V + lo] = 100.0f;
    base[0 * bstride + lo] = 0.0f;
    a[0 * V + V - 2] = 50.0f;
    base[0 * bstride + V - 2] = 50.0f;
    // Row 1: NaN ranks last, the maximum in the last (partial) tile.
    a[1 * V + 7] = NAN;
    a[1 * V + V - 1] = 1e30f;
    // Row 2: -0 and +0 are equal (the lower id), everything else below.
    for (int64_t i = 0; i < V; ++i) {
      a[2 * V + i] = -1.0f - static_cast<float>(i % 97);
      base[2 * bstride + i] = 0.0f;
    }
    if (V > 4200) a[2 * V + 4200] = -0.0f;
    a[2 * V + 9] = 0.0f;
    if (V <= 4200) a[2 * V + 4000] = -0.0f;
    // Row 3: all NaN -> id 0; row 4: all -inf -> id 0; row 5: NaN at 0, -inf elsewhere -> id 1
    // (NaN below -inf, as sampling::ranks_above and the CPU backend's drafts rank it; cpu::topk,
    // the reference of the other rows, ties NaN with -inf, so row 5's is set by hand).
    for (int64_t i = 0; i < V; ++i) {
      a[3 * V + i] = NAN;
      a[4 * V + i] = a[5 * V + i] = -INFINITY;
      base[4 * bstride + i] = base[5 * bstride + i] = 0.0f;
    }
    a[5 * V] = NAN;
    std::vector<float> sum(B * V);
    for (int64_t r = 0; r < B; ++r)
      for (int64_t i = 0; i < V; ++i) sum[r * V + i] = a[r * V + i] + base[r * bstride + i];
    std::vector<int32_t> ref(B), ref_a(B);
    for (int64_t r = 0; r < B; ++r) {
      cpu::topk(sum.data() + r * V, V, 1, &ref[r]);
      cpu::topk(a.data() + r * V, V, 1, &ref_a[r]);
    }
    ref[5] = ref_a[5] = 1;
    ASSERT_EQ(ref[0], lo);
    ASSERT_EQ(ref[2], 9);
    auto da = to_device(a), db = to_device(base);
    const size_t wsb = argmax_rows_workspace_bytes(B, V);
    auto ws = poisoned<uint8_t>(wsb);
    for (int rep = 0; rep < 2; ++rep) {
      auto o = poisoned<int32_t>(B);
      ML4_ASSERT_OK(argmax_rows(da.as<float>(), V, db.as<float>(), bstride, B, V, o.as<int32_t>(), ws.data(), wsb,
                                nullptr));
      sync();
      auto got = to_host<int32_t>(o, B);
      EXPECT_EQ(got, ref) << "V=" << V << " rep " << rep;
      EXPECT_EQ(got[3], 0);
      EXPECT_EQ(got[4], 0);
      // Without b: the argmax of a alone.
      auto o2 = poisoned<int32_t>(B);
      ML4_ASSERT_OK(argmax_rows(da.as<float>(), V, nullptr, 0, B, V, o2.as<int32_t>(), ws.data(), wsb, nullptr));
      sync();
      EXPECT_EQ(to_host<int32_t>(o2, B), ref_a) << "V=" << V;
    }
  }
  // Bad arguments are statuses: a short workspace, a stride below V.
  auto d = poisoned<float>(64);
  auto o = poisoned<int32_t>(1);
  auto ws = poisoned<uint8_t>(8);
  EXPECT_FALSE(argmax_rows(d.as<float>(), 64, nullptr, 0, 2, 64, o.as<int32_t>(), ws.data(), 8, nullptr).ok());
  EXPECT_FALSE(argmax_rows(d.as<float>(), 32, nullptr, 0, 1, 64, o.as<int32_t>(), ws.data(), 8, nullptr).ok());
}

}  // namespace
}  // namespace ml4::cuda
