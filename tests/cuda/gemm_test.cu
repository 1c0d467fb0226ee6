// cuBLASLt GEMMs (ops/cuda/gemm.h) and FP8 activation quantization (ops/cuda/act_quant.h)
// against ml4::cpu::linear on the same LinearWeight, decode-shaped (M = 1..64) and
// prefill-shaped (M = 300).
//
// Bounds, from the dtypes: the CPU reference accumulates in f32 over the same exactly
// representable operands (bf16 x, or x dequantized from the GPU's own e4m3 bytes), so
//  - f32 output of the BF16 GEMM differs only by summation order: ~sqrt(K) 2^-24 ~ 1e-6
//    relative; bound 1e-5;
//  - bf16 output adds one rounding of 2^-9 relative at most per element; bound 4e-3;
//  - the FP8 path accumulates each 128-wide K block in the Hopper tensor cores' reduced-
//    precision FP8 accumulator (about 14 mantissa bits, DeepSeek-V3 report section 3.3.2)
//    before promotion to f32: ~2^-14 per block, bound 1e-3 (f32 out) and 5e-3 (bf16 out).
#include <gtest/gtest.h>

#include <random>

#include "cuda_test_util.h"
#include "model/quant.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/quant.h"
#include "ops/cuda/act_quant.h"
#include "ops/cuda/gemm.h"

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

TEST(CudaGemm, Fp8BlockVsCpuLinear) {
  ML4_REQUIRE_GPU();
  auto lt = LtGemm::create();
  ML4_ASSERT_OK(lt.status());
  uint32_t seed = 200;
  for (const auto& s : kShapes) {
    SCOPED_TRACE(::testing::PrintToString(std::vector<int64_t>{s.M, s.N, s.K}));
    auto wf = randn(s.N * s.K, seed++, 0.05f);
    auto W = quantize_linear(wf.data(), s.N, s.K, LinearFormat::kFP8Block, "w");
    ML4_ASSERT_OK(W.status());
    auto x = randn(s.M * s.K, seed++);
    const int64_t G = s.K / 128;
    auto dx = to_device(x);
    auto dq = poisoned<uint8_t>(s.M * s.K);
    auto dxs = poisoned<float>(G * s.M);
    ML4_ASSERT_OK(fp8_act_quant({dx.data(), DType::kF32, 0, s.M, s.K, 128, dq.data(), dxs.as<float>(),
                                 ScaleLayout::kGroupMajor, nullptr}));
    // Reference input: the GPU's own e4m3 bytes and scales, dequantized exactly.
    auto q = to_host<uint8_t>(dq, s.M * s.K);
    auto xs = to_host<float>(dxs, G * s.M);
    std::vector<float> xdq(s.M * s.K);
    for (int64_t m = 0; m < s.M; ++m)
      for (int64_t k = 0; k < s.K; ++k) xdq[m * s.K + k] = e4m3_to_f32(q[m * s.K + k]) * xs[(k / 128) * s.M + m];
    std::vector<float> ref(s.M * s.N);
    cpu::linear(xdq.data(), s.M, *W, ref.data());
    auto dw = DeviceBuffer::alloc(W->weight.nbytes());
    auto dws = DeviceBuffer::alloc(W->scale.nbytes());
    ML4_ASSERT_OK(dw.status());
    ML4_ASSERT_OK(dws.status());
    ML4_ASSERT_OK(dw->upload(W->weight.data(), W->weight.nbytes()));
    ML4_ASSERT_OK(dws->upload(W->scale.data(), W->scale.nbytes()));
    for (DType yt : {DType::kF32, DType::kBF16}) {
      const size_t ysz = yt == DType::kF32 ? 4 : 2;
      std::vector<std::vector<uint8_t>> runs;
      for (int rep = 0; rep < 2; ++rep) {
        auto dy = poisoned<uint8_t>(s.M * s.N * ysz);
        GemmFp8BlockParams p{dq.data(), dxs.as<float>(), dw->data(), dws->as<float>(), dy.data(), yt, s.M, s.N, s.K,
                             nullptr};
        Status st = (*lt)->fp8_block(p);
        if (!st.is_ok()) {
          ADD_FAILURE() << st.message();
          break;
        }
        ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
        runs.push_back(to_host<uint8_t>(dy, s.M * s.N * ysz));
      }
      if (runs.size() < 2) continue;
      std::vector<float> y(s.M * s.N);
      if (yt == DType::kF32) {
        std::memcpy(y.data(), runs[0].data(), y.size() * 4);
      } else {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(runs[0].data());
        for (size_t i = 0; i < y.size(); ++i) y[i] = bf16_to_f32(h[i]);
      }
      ASSERT_TRUE(all_finite(y)) << "unwritten or non-finite output";
      const double err = rel_err(y, ref), bound = yt == DType::kF32 ? 1e-3 : 5e-3;
      std::printf("gemm fp8 block M=%ld N=%ld K=%ld out=%s rel_err=%.3g bound=%.0e%s\n", s.M, s.N, s.K,
                  dtype_name(yt), err, bound, (*lt)->last_fp8_swapped() ? " (swapped orientation)" : "");
      EXPECT_LT(err, bound);
      EXPECT_EQ(runs[0], runs[1]) << "repeat run not bit-identical";
    }
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
  EXPECT_EQ(fp8_act_quant({d, DType::kF32, 0, 4, 256, 100, d, buf->as<float>(), ScaleLayout::kRowMajor, nullptr})
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(fp8_act_quant({d, DType::kF16, 0, 4, 256, 128, d, buf->as<float>(), ScaleLayout::kRowMajor, nullptr})
                .code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ml4::cuda
