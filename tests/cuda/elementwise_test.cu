// Fused elementwise kernels (ops/cuda/elementwise.h) against their CPU ops.
//
// Bounds: rms_norm sums squares in f32 (tree) where the CPU sums in f64 and rounds once:
// the inverse norm differs by ~dim^0.5 * 2^-24 relative, so outputs by ~1e-6; bound 1e-5.
// silu_mul: expf vs std::exp, a few ulp: bound 1e-6. RoPE: same f64 angles and cos/sin,
// then the same f32 products (FMA contraction may differ): bound 1e-6. Temperatures are
// computed in f64 on both sides and rounded once: bound 1e-6. Embedding and casts: exact.
// MLA absorption: f32 dot products of <= 512 terms (fma chains plus a fixed reduction tree)
// against f64: error ~ sqrt(n) * 2^-24 relative, ~1e-6; bound 1e-5.
#include <gtest/gtest.h>

#include <random>

#include "core/dtype.h"
#include "cuda_test_util.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"

namespace ml4::cuda {
namespace {

using namespace testing;

std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f, float mean = 0.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

void sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

TEST(CudaElementwise, RmsNormWithAndWithoutResidual) {
  ML4_REQUIRE_GPU();
  // 64 .. 7168: the register-resident kernel (1, 6 and 8 float4s a thread); 1002 and 9000 the
  // strided loop (dim % 4, wider than 8 float4s a thread).
  for (int64_t dim : {64, 1000, 1002, 6144, 7168, 9000}) {
    const int64_t rows = 13;
    auto x = randn(rows * dim, 1 + dim, 2.0f, 0.3f), res = randn(rows * dim, 2 + dim), w = randn(dim, 3 + dim, 0.2f, 1.0f);
    // CPU: both variants.
    std::vector<float> ref_plain(rows * dim), ref_res = res, ref_y(rows * dim);
    cpu::rms_norm(x.data(), w.data(), rows, dim, 1e-6f, ref_plain.data());
    cpu::add_rms_norm(ref_res.data(), x.data(), w.data(), rows, dim, 1e-6f, ref_y.data());
    auto dx = to_device(x), dw = to_device(w);
    std::vector<std::vector<float>> outs;
    for (int rep = 0; rep < 2; ++rep) {
      auto dy = poisoned<float>(rows * dim);
      auto dyb = poisoned<uint16_t>(rows * dim);
      ML4_ASSERT_OK(rms_norm({dx.as<float>(), nullptr, dw.as<float>(), rows, dim, 1e-6f, dy.as<float>(), dyb.data(), nullptr}));
      sync();
      auto y = to_host<float>(dy, rows * dim);
      auto yb = bf16_to_f32_vec(to_host<uint16_t>(dyb, rows * dim));
      ASSERT_TRUE(all_finite(y) && all_finite(yb));
      const double e = rel_err(y, ref_plain), eb = rel_err(yb, ref_plain);
      std::printf("rms_norm dim=%ld rel_err=%.3g (bound 1e-5) bf16 out rel_err=%.3g (bound 4e-3)\n", dim, e, eb);
      EXPECT_LT(e, 1e-5);
      EXPECT_LT(eb, 4e-3);
      outs.push_back(y);
    }
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4)) << "not deterministic";
    // With residual.
    auto dres = to_device(res);
    auto dy = poisoned<float>(rows * dim);
    ML4_ASSERT_OK(rms_norm({dx.as<float>(), dres.as<float>(), dw.as<float>(), rows, dim, 1e-6f, dy.as<float>(), nullptr, nullptr}));
    sync();
    auto y = to_host<float>(dy, rows * dim);
    auto r = to_host<float>(dres, rows * dim);
    EXPECT_EQ(0, std::memcmp(r.data(), ref_res.data(), r.size() * 4)) << "residual sum must be exact (one f32 add)";
    const double e = rel_err(y, ref_y);
    std::printf("add_rms_norm dim=%ld rel_err=%.3g (bound 1e-5)\n", dim, e);
    EXPECT_LT(e, 1e-5);
  }
  {  // In place over a strided row (the q / kv LoRA norms: x_stride > dim, y == x), both kernels.
    for (int64_t dim : {512, 510}) {
      const int64_t rows = 5, stride = dim + 64;
      auto x = randn(rows * stride, 40 + dim, 1.5f, 0.1f), w = randn(dim, 41 + dim, 0.2f, 1.0f);
      std::vector<float> ref = x;
      for (int64_t r = 0; r < rows; ++r) cpu::rms_norm(x.data() + r * stride, w.data(), 1, dim, 1e-6f, ref.data() + r * stride);
      auto dx = to_device(x), dw = to_device(w);
      RmsNormParams p{dx.as<float>(), nullptr, dw.as<float>(), rows, dim, 1e-6f, dx.as<float>(), nullptr, nullptr};
      p.x_stride = stride;
      // y rows are dim apart (rms_norm writes rows of dim): in place means row 0 only shares
      // its start with x, so check row by row with y == that row of x.
      for (int64_t r = 0; r < rows; ++r) {
        RmsNormParams q = p;
        q.x = dx.as<float>() + r * stride;
        q.y = dx.as<float>() + r * stride;
        q.rows = 1;
        ML4_ASSERT_OK(rms_norm(q));
      }
      sync();
      auto y = to_host<float>(dx, rows * stride);
      double num = 0, den = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < stride; ++i) {
          const double a = y[r * stride + i], b = ref[r * stride + i];
          if (i >= dim) {
            ASSERT_EQ(a, b) << "past the row's dim: row " << r << " col " << i;
            continue;
          }
          num += (a - b) * (a - b);
          den += b * b;
        }
      std::printf("rms_norm in place, dim=%ld stride=%ld rel_err=%.3g (bound 1e-5)\n", dim, stride, std::sqrt(num / den));
      EXPECT_LT(std::sqrt(num / den), 1e-5);
    }
  }
  auto b = DeviceBuffer::alloc(64);
  EXPECT_EQ(rms_norm({b->as<float>(), b->as<float>(), b->as<float>(), 1, 4, 1e-6f, b->as<float>(), nullptr, nullptr}).code(),
            StatusCode::kInvalidArgument);
}

TEST(CudaElementwise, SiluMulStridedAndBf16) {
  ML4_REQUIRE_GPU();
  const int64_t rows = 9, cols = 1536;
  auto gu = randn(rows * 2 * cols, 11, 3.0f);  // [rows, 2*cols]: gate | up
  std::vector<float> ref(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    cpu::silu_mul(gu.data() + r * 2 * cols, gu.data() + r * 2 * cols + cols, cols, ref.data() + r * cols);
  auto d = to_device(gu);
  auto o = poisoned<float>(rows * cols);
  auto ob = poisoned<uint16_t>(rows * cols);
  ML4_ASSERT_OK(silu_mul({d.as<float>(), d.as<float>() + cols, rows, cols, 2 * cols, 2 * cols, o.as<float>(), ob.data(), nullptr}));
  sync();
  auto y = to_host<float>(o, rows * cols);
  auto yb = bf16_to_f32_vec(to_host<uint16_t>(ob, rows * cols));
  ASSERT_TRUE(all_finite(y) && all_finite(yb));
  const double e = rel_err(y, ref), eb = rel_err(yb, ref);
  std::printf("silu_mul rel_err=%.3g (bound 1e-6) bf16 rel_err=%.3g (bound 4e-3)\n", e, eb);
  EXPECT_LT(e, 1e-6);
  EXPECT_LT(eb, 4e-3);
}

TEST(CudaElementwise, EmbeddingExactAndBadIdIsNan) {
  ML4_REQUIRE_GPU();
  // D 384: the bf16 table by 16-byte loads; 390 (not a multiple of 8): the row loop.
  for (const int64_t D : {int64_t{384}, int64_t{390}}) {
  const int64_t V = 1000;
  auto tf = randn(V * D, 21);
  std::vector<uint16_t> tb(V * D);
  for (size_t i = 0; i < tf.size(); ++i) tb[i] = f32_to_bf16(tf[i]);
  std::vector<int32_t> ids = {0, 999, 17, 17, 500, 3};
  Tensor table(DType::kBF16, {V, D});
  std::memcpy(table.mutable_data(), tb.data(), tb.size() * 2);
  std::vector<float> ref(ids.size() * D);
  cpu::embedding_lookup(table, ids.data(), static_cast<int64_t>(ids.size()), ref.data());
  for (DType dt : {DType::kBF16, DType::kF32}) {
    std::vector<float> tf32(V * D);
    for (size_t i = 0; i < tb.size(); ++i) tf32[i] = bf16_to_f32(tb[i]);
    DeviceBuffer dt_buf = dt == DType::kBF16 ? to_device(tb) : to_device(tf32);
    auto di = to_device(ids);
    auto o = poisoned<float>(ids.size() * D);
    ML4_ASSERT_OK(embedding({dt_buf.data(), dt, V, D, di.as<int32_t>(), static_cast<int64_t>(ids.size()), o.as<float>(), nullptr}));
    sync();
    auto y = to_host<float>(o, ids.size() * D);
    EXPECT_EQ(0, std::memcmp(y.data(), ref.data(), y.size() * 4)) << dtype_name(dt);
  }
  std::vector<int32_t> bad = {5, -1, 1000};
  auto tbd = to_device(tb);
  auto di = to_device(bad);
  auto o = poisoned<float>(3 * D);
  ML4_ASSERT_OK(fill_uniform_f32(o.as<float>(), 3 * D, 1, 0, 1, nullptr));
  ML4_ASSERT_OK(embedding({tbd.data(), DType::kBF16, V, D, di.as<int32_t>(), 3, o.as<float>(), nullptr}));
  sync();
  auto y = to_host<float>(o, 3 * D);
  EXPECT_FALSE(std::isnan(y[0]));
  EXPECT_TRUE(std::isnan(y[D]) && std::isnan(y[2 * D + D - 1]));
  }
}

TEST(CudaElementwise, QPathRopeYarnLeropeLlama4Ssmax) {
  ML4_REQUIRE_GPU();
  // Heads in groups of 4 a block: 18 ends in a group of 2; dn 256 makes a group's fold (4 x 320
  // values) longer than the kernel's 8 registers a thread (the loop after them).
  for (const auto [H, dn] : {std::pair{18, 128}, std::pair{5, 256}}) {
  const int dr = 64, qk = dn + dr;
  const std::vector<int64_t> pos = {0, 1, 7, 4095, 8192, 40000, 131071, 65536 + 3};
  const int64_t T = static_cast<int64_t>(pos.size());
  YarnConfig yarn;
  yarn.enabled = true;
  yarn.factor = 40.0;
  yarn.original_max_position_embeddings = 4096;
  yarn.beta_fast = 32;
  yarn.beta_slow = 1;
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 0.707;
  LeRopeConfig lr{true, 8192, 4.0};
  Llama4Scaling l4{true, 8192, 0.1};
  const auto inv = cpu::rope_inv_freq(10000.0, dr, yarn);
  const float af = cpu::rope_attention_factor(yarn);
  auto ss = randn(H, 31, 0.1f, 0.5f);
  std::vector<int32_t> nk(T);
  for (int64_t t = 0; t < T; ++t) nk[t] = static_cast<int32_t>(std::min<int64_t>(pos[t] + 1, 2048));
  const double base = 1.0 / std::sqrt(192.0);
  auto q = randn(T * H * qk, 32);
  // CPU reference (cpu_attention.cpp steps 2 and 6).
  std::vector<float> ref = q, ref_scale(T * H);
  for (int64_t t = 0; t < T; ++t) {
    cpu::rope_interleaved(ref.data() + t * H * qk + dn, H, dr, qk, cpu::lerope_position(pos[t], lr), inv.data(), af);
    for (int h = 0; h < H; ++h)
      ref_scale[t * H + h] = static_cast<float>(base * cpu::llama4_q_scale(pos[t], l4) * ss[h] * std::log(static_cast<double>(nk[t])));
  }
  auto dq = to_device(q);
  auto dpos = to_device(pos);
  auto dinv = to_device(inv);
  auto dss = to_device(ss);
  auto dnk = to_device(nk);
  auto dsc = poisoned<float>(T * H);
  QPathParams p;
  p.q = dq.as<float>();
  p.T = T;
  p.H = H;
  p.head_stride = qk;
  p.rope_offset = dn;
  p.rope_dim = dr;
  p.positions = dpos.as<int64_t>();
  p.inv_freq = dinv.as<float>();
  p.attn_factor = af;
  p.lerope = lr;
  p.base_scale = base;
  p.llama4 = l4;
  p.ssmax_s = dss.as<float>();
  p.n_keys = dnk.as<int32_t>();
  p.head_scale = dsc.as<float>();
  ML4_ASSERT_OK(q_path(p));
  sync();
  auto got = to_host<float>(dq, T * H * qk);
  auto gs = to_host<float>(dsc, T * H);
  const double e = rel_err(got, ref), es = rel_err(gs, ref_scale);
  std::printf("q_path H=%d dn=%d rope rel_err=%.3g (bound 1e-6), head scale rel_err=%.3g (bound 1e-6)\n", H, dn, e, es);
  EXPECT_LT(e, 1e-6);
  EXPECT_LT(es, 1e-6);
  // Folded: q * scale per head.
  auto dq2 = to_device(q);
  p.q = dq2.as<float>();
  p.head_scale = nullptr;
  p.fold_scale = true;
  ML4_ASSERT_OK(q_path(p));
  sync();
  auto folded = to_host<float>(dq2, T * H * qk);
  std::vector<float> ref_f = ref;
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < qk; ++d) ref_f[(t * H + h) * qk + d] *= ref_scale[t * H + h];
  const double ef = rel_err(folded, ref_f);
  std::printf("q_path folded rel_err=%.3g (bound 2e-6)\n", ef);
  EXPECT_LT(ef, 2e-6);
  p.rope_dim = 63;
  EXPECT_EQ(q_path(p).code(), StatusCode::kInvalidArgument);
  }
}

TEST(CudaElementwise, CastsRoundTrip) {
  ML4_REQUIRE_GPU();
  const int64_t n = 100003;
  auto x = randn(n, 41, 100.0f);
  auto dx = to_device(x);
  auto db = poisoned<uint16_t>(n);
  auto dy = poisoned<float>(n);
  ML4_ASSERT_OK(cast_f32_bf16(dx.as<float>(), n, db.data(), nullptr));
  ML4_ASSERT_OK(cast_bf16_f32(db.data(), n, dy.as<float>(), nullptr));
  sync();
  auto b = to_host<uint16_t>(db, n);
  auto y = to_host<float>(dy, n);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += b[i] != f32_to_bf16(x[i]) || y[i] != bf16_to_f32(b[i]);
  EXPECT_EQ(bad, 0);
}

struct AbsorbShape { int H, dn, dv, r, q_stride, q_offset; int64_t T; };

// Both absorption products on random inputs against f64, run twice (bit-identical repeats);
// run(p) issues them; both first-run errors must stay under bound. bf16: the lat_bf16 form
// (bf16 weight copies, lat given as bf16, q_lat read back as bf16; the reference keeps the f32
// inputs).
template <typename Run>
void check_absorption(const AbsorbShape& sh, uint32_t seed, double bound, const char* what, Run run, bool bf16 = false) {
  auto q = randn(sh.T * sh.H * sh.q_stride, ++seed);
  auto wuk = randn(int64_t{sh.H} * sh.dn * sh.r, ++seed, 0.05f);
  auto lat = randn(sh.T * sh.H * sh.r, ++seed);
  auto wuv = randn(int64_t{sh.H} * sh.dv * sh.r, ++seed, 0.05f);
  std::vector<double> ref_q(sh.T * sh.H * sh.r, 0.0), ref_o(sh.T * sh.H * sh.dv, 0.0);
  for (int64_t t = 0; t < sh.T; ++t)
    for (int h = 0; h < sh.H; ++h) {
      double* rq = &ref_q[(t * sh.H + h) * sh.r];
      for (int d = 0; d < sh.dn; ++d) {
        const double qv = q[(t * sh.H + h) * sh.q_stride + sh.q_offset + d];
        const float* w = &wuk[(int64_t{h} * sh.dn + d) * sh.r];
        for (int j = 0; j < sh.r; ++j) rq[j] += qv * w[j];
      }
      for (int d = 0; d < sh.dv; ++d) {
        double a = 0;
        const float* w = &wuv[(int64_t{h} * sh.dv + d) * sh.r];
        const float* l = &lat[(t * sh.H + h) * sh.r];
        for (int j = 0; j < sh.r; ++j) a += double{w[j]} * l[j];
        ref_o[(t * sh.H + h) * sh.dv + d] = a;
      }
    }
  auto dq = to_device(q), dwuk = to_device(wuk), dlat = to_device(lat), dwuv = to_device(wuv);
  auto bits = [](const std::vector<float>& v) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
    return b;
  };
  auto dwuk16 = to_device(bits(wuk)), dlat16 = to_device(bits(lat)), dwuv16 = to_device(bits(wuv));
  auto dq16 = poisoned<uint16_t>(sh.T * sh.H * sh.dn);
  std::vector<float> first_q, first_o;
  for (int rep = 0; rep < 2; ++rep) {
    auto dql = poisoned<float>(ref_q.size());  // bf16: its first half
    auto dout = poisoned<float>(ref_o.size());
    MlaAbsorbParams p;
    p.T = sh.T;
    p.H = sh.H;
    p.dn = sh.dn;
    p.dv = sh.dv;
    p.r = sh.r;
    p.q = dq.as<float>();
    p.q_stride = sh.q_stride;
    p.q_offset = sh.q_offset;
    p.w_uk = dwuk.as<float>();
    p.q_lat = dql.as<float>();
    p.lat = dlat.as<float>();
    p.w_uv = dwuv.as<float>();
    p.o = dout.as<float>();
    if (bf16) {
      p.lat_bf16 = true;
      p.w_uk16 = dwuk16.data();
      p.w_uv16 = dwuv16.data();
      p.lat = reinterpret_cast<const float*>(dlat16.data());
      p.q16 = dq16.data();
    }
    run(p);
    sync();
    std::vector<float> gq(ref_q.size());
    if (bf16) {
      const auto g16 = to_host<uint16_t>(dql, ref_q.size());
      for (size_t i = 0; i < gq.size(); ++i) gq[i] = bf16_to_f32(g16[i]);
    } else {
      gq = to_host<float>(dql, ref_q.size());
    }
    auto go = to_host<float>(dout, ref_o.size());
    const double eq = rel_err(gq, ref_q), eo = rel_err(go, ref_o);
    if (rep == 0) {
      std::printf("%s H=%d dn=%d dv=%d r=%d T=%ld: W_UK rel_err=%.3g, W_UV rel_err=%.3g (bound %.0e)\n", what, sh.H, sh.dn,
                  sh.dv, sh.r, static_cast<long>(sh.T), eq, eo, bound);
      EXPECT_LT(eq, bound) << what;
      EXPECT_LT(eo, bound) << what;
      first_q = gq;
      first_o = go;
    } else {
      EXPECT_EQ(std::memcmp(gq.data(), first_q.data(), gq.size() * 4), 0) << what << ": W_UK not repeatable";
      EXPECT_EQ(std::memcmp(go.data(), first_o.data(), go.size() * 4), 0) << what << ": W_UV not repeatable";
    }
  }
}

// Both absorption products at ml4 width (the weight-stationary kernels, token tiles of 8 with
// tails), at toy width, and on shapes that take the per-token fallback (r % 4 != 0, dn > 128).
TEST(CudaElementwise, MlaAbsorptionMatchesF64) {
  ML4_REQUIRE_GPU();
  const AbsorbShape shapes[] = {{64, 128, 128, 512, 192, 0, 1},  {64, 128, 128, 512, 192, 0, 8},
                                {64, 128, 128, 512, 192, 0, 19}, {4, 32, 32, 128, 48, 0, 3},
                                {3, 20, 12, 130, 30, 4, 2},      {2, 136, 40, 64, 200, 8, 9}};
  uint32_t seed = 300;
  for (const AbsorbShape& sh : shapes) {
    check_absorption(sh, seed += 4, 1e-5, "mla absorption", [](const MlaAbsorbParams& p) {
      ML4_ASSERT_OK(mla_absorb_q(p));
      ML4_ASSERT_OK(mla_apply_uv(p));
    });
  }
}

// Both absorption GEMMs (mla_absorb_q_gemm, mla_apply_uv_gemm), f32 / TF32 or bf16 form, on ml4's
// width and two toy shapes (the last with r = 132, or 136 in bf16: its operands' rows in 16 bytes).
void check_absorption_gemms(bool bf16, double bound, uint32_t seed) {
  ML4_REQUIRE_GPU();
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  const AbsorbShape shapes[] = {
      {64, 128, 128, 512, 192, 0, 200}, {4, 32, 32, 128, 48, 0, 70}, {3, 24, 12, bf16 ? 136 : 132, 40, 8, 65}};
  for (const AbsorbShape& sh : shapes) {
    check_absorption(
        sh, seed += 4, bound, bf16 ? "mla absorption GEMM (bf16)" : "mla absorption GEMM (tf32)",
        [&](const MlaAbsorbParams& p) {
          ML4_ASSERT_OK(mla_absorb_q_gemm(**lt, p));
          ML4_ASSERT_OK(mla_apply_uv_gemm(**lt, p));
        },
        bf16);
  }
}

// The absorption as strided-batched TF32 GEMMs (prefill-sized steps outside exact mode):
// against f64 on ml4's width and on toy shapes, with heads' rows interleaved as the runner
// lays them out. Bound: TF32 keeps 10 mantissa bits, so each rounded input is off by up to
// 2^-11 relative (RMS ~2.8e-4 if rounded, ~5.6e-4 if truncated); a product carries two such
// errors, and over sums of independent random terms the relative L2 error of the result is
// that of one term: ~4e-4 with round-to-nearest, <= ~8e-4 with truncation. Bound 1.5e-3, about
// twice the truncating case (the H200 gave 2.9e-4 on ML4's shape); the f32 kernels sit at 1e-7.
TEST(CudaElementwise, MlaAbsorptionGemmMatchesF64) { check_absorption_gemms(false, 1.5e-3, 900); }

// Their bf16 form (MlaAbsorbParams::lat_bf16: q's nope part, the weights and lat rounded to bf16,
// f32 sums, q_lat rounded to bf16) against f64 of the unrounded f32 inputs. Bound: each bf16
// input is off by up to 2^-9 relative (RMS ~1.1e-3 with round-to-nearest); a product carries
// two (~1.6e-3), which sums of independent terms keep as the relative L2 error; q_lat's own
// rounding adds ~1.1e-3 in quadrature: ~2e-3 for W_UK, ~1.6e-3 for W_UV. Bound 6e-3, three
// times that.
TEST(CudaElementwise, MlaAbsorptionGemmBf16MatchesF64) { check_absorption_gemms(true, 6e-3, 1900); }

}  // namespace
}  // namespace ml4::cuda
