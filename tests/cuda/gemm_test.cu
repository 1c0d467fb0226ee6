// cuBLASLt GEMMs (ops/cuda/gemm.h), our FP8 block GEMM (ops/cuda/fp8_gemm.h) and FP8
// activation quantization (ops/cuda/act_quant.h) against ml4::cpu::linear on the same
// LinearWeight, decode-shaped (M = 1..64) and prefill-shaped (M = 300, 1024).
//
// Bounds, from the dtypes: the CPU reference accumulates in f32 over the same exactly
// representable operands (bf16 x, or x dequantized from the GPU's own e4m3 bytes), so
//  - f32 output of the BF16 GEMM differs only by summation order: ~sqrt(K) 2^-24 ~ 1e-6
//    relative; bound 1e-5;
//  - bf16 output adds one rounding of 2^-9 relative at most per element; bound 4e-3;
//  - FP8: the reference runs on x dequantized from the GPU's own e4m3 bytes and scales, so
//    the operands are the same; each e4m3 x e4m3 product is exact in f32 (4+4 significant
//    bits), and the only differences are the order of the sums and the Hopper tensor
//    cores' FP8 accumulator inside one 128-wide K block (about 14 mantissa bits, DeepSeek-V3
//    report 3.3.2) before promotion to f32: ~2^-14 relative per block, sum of K/128 blocks
//    adding ~sqrt(K/128) 2^-24 more. Bound 1e-3 (f32 out); bf16 output adds one rounding of
//    at most 2^-9 relative per element: 5e-3.
#include <gtest/gtest.h>

#include <random>

#include "cuda_test_util.h"
#include "model/quant.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/quant.h"
#include "ops/cuda/act_quant.h"
#include "ops/cuda/fp8_gemm.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/linear.h"

namespace ml4::cuda {
namespace {

using namespace testing;

struct Shape3 {
  int64_t M, N, K;
};
const Shape3 kShapes[] = {{1, 384, 512}, {3, 384, 512}, {8, 256, 1024}, {16, 384, 512},
                          {33, 256, 512}, {64, 512, 256}, {300, 256, 1024}};

TEST(CudaGemm, Bf16VsCpuLinear) {
  ML4_REQUIRE_GPU();
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  uint32_t seed = 100;
  for (const auto& s : kShapes) {
    SCOPED_TRACE(::testing::PrintToString(std::vector<int64_t>{s.M, s.N, s.K}));
    auto wf = randn(s.N * s.K, seed++, 0.05f);
    auto W = quantize_linear(wf.data(), s.N, s.K, LinearFormat::kBF16, "w");
    ML4_ASSERT_OK(W.status());
    auto x = randn(s.M * s.K, seed++);
    std::vector<uint16_t> xb(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      xb[i] = f32_to_bf16(x[i]);
      x[i] = bf16_to_f32(xb[i]);
    }
    std::vector<float> ref(s.M * s.N);
    cpu::linear(x.data(), s.M, *W, ref.data());
    auto dx = to_device(xb);
    auto dw = DeviceBuffer::alloc(W->weight.nbytes());
    ML4_ASSERT_OK(dw.status());
    ML4_ASSERT_OK(dw->upload(W->weight.data(), W->weight.nbytes()));
    for (DType yt : {DType::kF32, DType::kBF16}) {
      const size_t ysz = yt == DType::kF32 ? 4 : 2;
      std::vector<std::vector<uint8_t>> runs;
      for (int rep = 0; rep < 2; ++rep) {
        auto dy = poisoned<uint8_t>(s.M * s.N * ysz);
        ML4_ASSERT_OK((*lt)->bf16({dx.data(), dw->data(), dy.data(), yt, s.M, s.N, s.K, nullptr}));
        ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
        runs.push_back(to_host<uint8_t>(dy, s.M * s.N * ysz));
      }
      std::vector<float> y(s.M * s.N);
      if (yt == DType::kF32) {
        std::memcpy(y.data(), runs[0].data(), y.size() * 4);
      } else {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(runs[0].data());
        for (size_t i = 0; i < y.size(); ++i) y[i] = bf16_to_f32(h[i]);
      }
      ASSERT_TRUE(all_finite(y)) << "unwritten or non-finite output";
      const double err = rel_err(y, ref), bound = yt == DType::kF32 ? 1e-5 : 4e-3;
      std::printf("gemm bf16 M=%ld N=%ld K=%ld out=%s rel_err=%.3g bound=%.0e\n", s.M, s.N, s.K, dtype_name(yt),
                  err, bound);
      EXPECT_LT(err, bound);
      EXPECT_EQ(runs[0], runs[1]) << "repeat run not bit-identical";
    }
  }
}

TEST(CudaGemm, ActQuantBitExactVsCpu) {
  ML4_REQUIRE_GPU();
  for (DType xt : {DType::kF32, DType::kBF16}) {
    for (ScaleLayout layout : {ScaleLayout::kGroupMajor, ScaleLayout::kRowMajor}) {
      const int64_t M = 37, K = 1024 + 64;  // a short last group
      const int group = 128, G = (K + group - 1) / group;
      auto x = randn(M * K, 7 + static_cast<int>(xt), 3.0f);
      x[5] = 0.0f;
      for (int64_t k = 0; k < 128; ++k) x[2 * K + k] = 1e-7f;  // amax below the 1e-4 floor
      std::vector<uint16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        xb[i] = f32_to_bf16(x[i]);
        if (xt == DType::kBF16) x[i] = bf16_to_f32(xb[i]);
      }
      DeviceBuffer dx = xt == DType::kF32 ? to_device(x) : to_device(xb);
      auto dq = poisoned<uint8_t>(M * K);
      auto ds = poisoned<float>(M * G);
      ML4_ASSERT_OK(fp8_act_quant({dx.data(), xt, 0, M, K, group, dq.data(), ds.as<float>(), layout, nullptr}));
      ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
      auto q = to_host<uint8_t>(dq, M * K);
      auto sc = to_host<float>(ds, M * G);
      std::vector<uint8_t> rq(K);
      std::vector<float> rs(G);
      int64_t bad = 0;
      for (int64_t m = 0; m < M; ++m) {
        cpu::quantize_fp8_groups(x.data() + m * K, K, group, rq.data(), rs.data());
        for (int64_t k = 0; k < K; ++k) bad += q[m * K + k] != rq[k];
        for (int g = 0; g < G; ++g) {
          const float got = layout == ScaleLayout::kGroupMajor ? sc[g * M + m] : sc[m * G + g];
          bad += std::memcmp(&got, &rs[g], 4) != 0;
        }
      }
      std::printf("act_quant x=%s layout=%d: %ld mismatching bytes/scales (bound 0)\n", dtype_name(xt),
                  static_cast<int>(layout), bad);
      EXPECT_EQ(bad, 0);
    }
  }
}

// FP8 shapes: every M class of our kernel (16 / 64 / 128-row tiles, split-K or not), M % 4
// != 0 (cuBLASLt through padded rows), N % 128 != 0 (576 = wkv_a), K/128 % 4 != 0 (256, 384:
// padded weight scales), and one ML4 K (6144).
struct Fp8Shape {
  int64_t M, N, K;
};
const Fp8Shape kFp8Shapes[] = {{1, 576, 512},   {3, 384, 256},   {8, 256, 1024},  {9, 576, 6144},
                               {16, 576, 384},  {33, 256, 512},  {64, 512, 256},  {300, 256, 1024},
                               {1024, 640, 512}};

// Each backend; cuBLASLt's twice: D row-major (LtGemm::set_fp8_row_out, the default, where
// cuBLASLt takes it) and D transposed.
std::vector<std::pair<Fp8Backend, bool>> expand_row_out(std::initializer_list<Fp8Backend> backends) {
  std::vector<std::pair<Fp8Backend, bool>> v;
  for (Fp8Backend be : backends) {
    v.emplace_back(be, true);
    if (be != Fp8Backend::kOwn) v.emplace_back(be, false);
  }
  return v;
}

// Runs every kFp8Shapes case through the given backends of LtGemm::fp8_block.
void fp8_vs_cpu(std::initializer_list<Fp8Backend> backends) {
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  uint32_t seed = 200;
  for (const auto& s : kFp8Shapes) {
    SCOPED_TRACE(::testing::PrintToString(std::vector<int64_t>{s.M, s.N, s.K}));
    auto wf = randn(s.N * s.K, seed++, 0.05f);
    auto W = quantize_linear(wf.data(), s.N, s.K, LinearFormat::kFP8Block, "w");
    ML4_ASSERT_OK(W.status());
    auto dl = upload_linear(*W);  // scale as stored, and scale_lt padded when K/128 % 4 != 0
    ML4_ASSERT_OK(dl.status());
    auto x = randn(s.M * s.K, seed++);
    const int64_t G = s.K / 128, m4 = (s.M + 3) / 4 * 4;
    auto dx = to_device(x);
    // Two quantized copies of x: unpadded ([M] rows, scales ld M) for our kernel, padded to
    // m4 rows (scales ld m4) for cuBLASLt.
    auto dq = poisoned<uint8_t>(s.M * s.K), dq4 = poisoned<uint8_t>(m4 * s.K);
    auto dxs = poisoned<float>(G * s.M), dxs4 = poisoned<float>(G * m4);
    ML4_ASSERT_OK(fp8_act_quant({dx.data(), DType::kF32, 0, s.M, s.K, 128, dq.data(), dxs.as<float>(),
                                 ScaleLayout::kGroupMajor, nullptr}));
    Fp8ActQuantParams qp{dx.data(), DType::kF32, 0, s.M, s.K, 128, dq4.data(), dxs4.as<float>(),
                         ScaleLayout::kGroupMajor, nullptr};
    qp.rows_out = m4;
    ML4_ASSERT_OK(fp8_act_quant(qp));
    // Reference input: the GPU's own e4m3 bytes and scales, dequantized exactly.
    auto q = to_host<uint8_t>(dq, s.M * s.K);
    auto xs = to_host<float>(dxs, G * s.M);
    {  // the padded copy: same bytes and scales for rows < M, zero rows after
      auto q4 = to_host<uint8_t>(dq4, m4 * s.K);
      auto xs4 = to_host<float>(dxs4, G * m4);
      int64_t bad = 0;
      for (int64_t m = 0; m < m4; ++m)
        for (int64_t k = 0; k < s.K; ++k) bad += q4[m * s.K + k] != (m < s.M ? q[m * s.K + k] : 0);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t m = 0; m < s.M; ++m) bad += std::memcmp(&xs4[g * m4 + m], &xs[g * s.M + m], 4) != 0;
      EXPECT_EQ(bad, 0) << "padded act_quant differs from the unpadded one";
    }
    std::vector<float> xdq(s.M * s.K);
    for (int64_t m = 0; m < s.M; ++m)
      for (int64_t k = 0; k < s.K; ++k) xdq[m * s.K + k] = e4m3_to_f32(q[m * s.K + k]) * xs[(k / 128) * s.M + m];
    std::vector<float> ref(s.M * s.N);
    cpu::linear(xdq.data(), s.M, *W, ref.data());
    for (const auto& [be, row_out] : expand_row_out(backends)) {
      (*lt)->set_fp8_backend(be);
      (*lt)->set_fp8_row_out(row_out);
      const bool padded = be != Fp8Backend::kOwn;
      GemmFp8BlockParams p{padded ? dq4.data() : dq.data(), padded ? dxs4.as<float>() : dxs.as<float>(),
                           dl->weight.data(), padded ? dl->gemm_scale() : dl->scale.as<float>(), nullptr,
                           DType::kF32, s.M, s.N, s.K, nullptr};
      p.m_pad = padded ? m4 : 0;
      p.w_scale_ld = padded ? dl->gemm_scale_ld() : 0;
      for (DType yt : {DType::kF32, DType::kBF16}) {
        const size_t ysz = yt == DType::kF32 ? 4 : 2;
        std::vector<std::vector<uint8_t>> runs;
        Status st = ok_status();
        for (int rep = 0; rep < 2 && st.ok(); ++rep) {
          auto dy = poisoned<uint8_t>(s.M * s.N * ysz);
          p.y = dy.data();
          p.y_dtype = yt;
          st = (*lt)->fp8_block(p);
          if (!st.ok()) break;
          ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
          runs.push_back(to_host<uint8_t>(dy, s.M * s.N * ysz));
        }
        const char* name = be == Fp8Backend::kOwn ? "own" : be == Fp8Backend::kCublasLt ? "cublaslt" : "auto";
        if (!st.ok()) {
          // cuBLASLt may have no kernel for a shape (kUnimplemented): that is what our kernel
          // is for. Any other error fails.
          std::printf("gemm fp8 block M=%ld N=%ld K=%ld backend=%s: %s\n", s.M, s.N, s.K, name, st.message().c_str());
          EXPECT_TRUE(be == Fp8Backend::kCublasLt && st.code() == StatusCode::kUnimplemented) << st.message();
          break;
        }
        std::vector<float> y(s.M * s.N);
        if (yt == DType::kF32) {
          std::memcpy(y.data(), runs[0].data(), y.size() * 4);
        } else {
          const uint16_t* h = reinterpret_cast<const uint16_t*>(runs[0].data());
          for (size_t i = 0; i < y.size(); ++i) y[i] = bf16_to_f32(h[i]);
        }
        ASSERT_TRUE(all_finite(y)) << "unwritten or non-finite output (" << name << ")";
        const double err = rel_err(y, ref), bound = yt == DType::kF32 ? 1e-3 : 5e-3;
        std::printf("gemm fp8 block M=%ld N=%ld K=%ld out=%s backend=%s (ran %s%s) rel_err=%.3g bound=%.0e\n", s.M,
                    s.N, s.K, dtype_name(yt), name, (*lt)->last_fp8_used_lt() ? "cublaslt" : "own",
                    !(*lt)->last_fp8_used_lt() ? "" : (*lt)->last_fp8_row_out() ? ", row-major D" : ", D transposed",
                    err, bound);
        EXPECT_LT(err, bound) << name;
        EXPECT_EQ(runs[0], runs[1]) << "repeat run not bit-identical (" << name << ")";
      }
    }
    (*lt)->set_fp8_backend(Fp8Backend::kAuto);
    (*lt)->set_fp8_row_out(true);
  }
}

// Our kernel (fp8_gemm.h) on every shape, unpadded layouts.
TEST(CudaGemm, Fp8BlockVsCpuLinear) {
  ML4_REQUIRE_GPU();
  fp8_vs_cpu({Fp8Backend::kOwn});
}

// cuBLASLt on padded layouts where it has a kernel, and the kAuto dispatch (a test of its
// own: a fault inside cuBLASLt would poison the CUDA context for the tests after it).
TEST(CudaGemm, Fp8BlockCublasLtVsCpuLinear) {
  ML4_REQUIRE_GPU();
  fp8_vs_cpu({Fp8Backend::kCublasLt, Fp8Backend::kAuto});
}

// linear_f32 on FP8 weights: M <= 8 is the exact-activation GEMV, M > 8 quantizes x and runs
// the FP8 GEMM; each against cpu::linear on the activations that path sees (bounds above;
// the GEMV's f32 sums: 1e-5).
TEST(CudaGemm, LinearF32Fp8VsCpu) {
  ML4_REQUIRE_GPU();
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  const int64_t N = 576, K = 384;
  auto wf = randn(N * K, 300, 0.05f);
  auto W = quantize_linear(wf.data(), N, K, LinearFormat::kFP8Block, "w");
  ML4_ASSERT_OK(W.status());
  auto dl = upload_linear(*W);
  ML4_ASSERT_OK(dl.status());
  for (int64_t M : {int64_t{5}, int64_t{8}, int64_t{13}, int64_t{200}}) {
    auto x = randn(M * K, 301 + static_cast<uint32_t>(M));
    std::vector<float> xin = x;
    if (M > kGemvMaxM) {  // the GEMM path sees x through act_quant (bit-exact to the CPU's)
      std::vector<uint8_t> qb(K);
      std::vector<float> sc(K / 128);
      for (int64_t m = 0; m < M; ++m) {
        cpu::quantize_fp8_groups(x.data() + m * K, K, 128, qb.data(), sc.data());
        cpu::dequantize_fp8_groups(qb.data(), sc.data(), K, 128, xin.data() + m * K);
      }
    }
    std::vector<float> ref(M * N);
    cpu::linear(xin.data(), M, *W, ref.data());
    LinearScratch scratch;
    ML4_ASSERT_OK(scratch.reserve(M * std::max(N, K), M * ((K + 127) / 128)));
    auto dx = to_device(x);
    auto dy = poisoned<float>(M * N);
    ML4_ASSERT_OK(linear_f32(**lt, *dl, dx.as<float>(), M, dy.as<float>(), scratch, nullptr));
    ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
    auto y = to_host<float>(dy, M * N);
    ASSERT_TRUE(all_finite(y));
    const double err = rel_err(y, ref), bound = M <= kGemvMaxM ? 1e-5 : 1e-3;
    std::printf("linear_f32 fp8 M=%ld N=%ld K=%ld (%s) rel_err=%.3g bound=%.0e\n", M, N, K,
                M <= kGemvMaxM ? "gemv" : "act_quant + fp8 gemm", err, bound);
    EXPECT_LT(err, bound);
  }
}

TEST(CudaGemm, BadInputsAreStatuses) {
  ML4_REQUIRE_GPU();
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  auto buf = DeviceBuffer::alloc(1 << 20);
  ML4_ASSERT_OK(buf.status());
  void* d = buf->data();
  EXPECT_EQ((*lt)->bf16({d, d, d, DType::kBF16, 0, 16, 16, nullptr}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*lt)->bf16({d, d, d, DType::kF16, 4, 16, 16, nullptr}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*lt)->fp8_block({d, buf->as<float>(), d, buf->as<float>(), d, DType::kBF16, 4, 128, 100, nullptr}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*lt)->fp8_block({d, buf->as<float>(), d, buf->as<float>(), d, DType::kBF16, 4, 40, 128, nullptr}).code(),
            StatusCode::kInvalidArgument);  // N % 16
  GemmFp8BlockParams bad{d, buf->as<float>(), d, buf->as<float>(), d, DType::kF32, 5, 128, 256, nullptr};
  bad.m_pad = 7;  // neither M nor roundup(M, 4)
  EXPECT_EQ((*lt)->fp8_block(bad).code(), StatusCode::kInvalidArgument);
  bad.m_pad = 0;
  (*lt)->set_fp8_backend(Fp8Backend::kCublasLt);  // M % 4 != 0 unpadded: cuBLASLt cannot
  EXPECT_EQ((*lt)->fp8_block(bad).code(), StatusCode::kUnimplemented);
  (*lt)->set_fp8_backend(Fp8Backend::kAuto);
  EXPECT_EQ(fp8_block_gemm({d, buf->as<float>(), 0, d, buf->as<float>(), 0, d, DType::kF32, 4, 128, 200, nullptr, 0,
                            nullptr})
                .code(),
            StatusCode::kInvalidArgument);  // K % 128
  EXPECT_EQ(fp8_block_gemm({d, nullptr, 0, d, buf->as<float>(), 0, d, DType::kF32, 4, 128, 256, nullptr, 0, nullptr})
                .code(),
            StatusCode::kInvalidArgument);  // null scale
  EXPECT_EQ(fp8_block_gemm({d, buf->as<float>(), 2, d, buf->as<float>(), 0, d, DType::kF32, 4, 128, 256, nullptr, 0,
                            nullptr})
                .code(),
            StatusCode::kInvalidArgument);  // x_scale_ld < M
  Fp8ActQuantParams aq{d, DType::kF32, 0, 4, 256, 128, d, buf->as<float>(), ScaleLayout::kGroupMajor, nullptr};
  aq.rows_out = 3;
  EXPECT_EQ(fp8_act_quant(aq).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fp8_act_quant({d, DType::kF32, 0, 4, 256, 100, d, buf->as<float>(), ScaleLayout::kRowMajor, nullptr})
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(fp8_act_quant({d, DType::kF16, 0, 4, 256, 128, d, buf->as<float>(), ScaleLayout::kRowMajor, nullptr})
                .code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ml4::cuda
