// FP8 block -> MXFP4 on the GPU (ops/cuda/requant.h) against the CPU loader's
// requantize_fp8_to_mxfp4, byte for byte (both compute in f64 with the same thresholds): random
// FP8 weights from quantize_linear with rows and groups set to zero, to -0 codes (0x80: the
// sign survives as e2m1 -0), to the largest codes, and blocks whose scale pushes the MX
// exponent past +-127 (clamped); then a NaN code must be refused naming its element.
#include <gtest/gtest.h>

#include <cstring>
#include <utility>

#include "cuda_test_util.h"
#include "model/quant.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/requant.h"

namespace ml4::cuda {
namespace {

using namespace testing;

// The FP8 weight on the device as upload_linear lays it out, without upload_linear's N % 16
// check (the FP8 GEMMs' need, not the re-quantizer's): N = 300 and N = 1 keep a partial
// 128-row scale block.
Result<DeviceLinear> upload_fp8(const LinearWeight& w) {
  DeviceLinear d;
  d.name = w.name;
  d.format = w.format;
  d.N = w.out_features;
  d.K = w.in_features;
  ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(w.weight.nbytes()));
  ML4_RETURN_IF_ERROR(d.weight.upload(w.weight.data(), w.weight.nbytes()));
  ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(w.scale.nbytes()));
  ML4_RETURN_IF_ERROR(d.scale.upload(w.scale.data(), w.scale.nbytes()));
  return Result<DeviceLinear>(std::move(d));
}

TEST(CudaRequant, Fp8ToMxfp4MatchesCpuBytes) {
  ML4_REQUIRE_GPU();
  for (auto [N, K] : {std::pair<int64_t, int64_t>{300, 512}, {128, 128}, {1, 6144}}) {
    auto wf = randn(N * K, static_cast<uint32_t>(N + K), 0.02f);
    auto W = quantize_linear(wf.data(), N, K, LinearFormat::kFP8Block, "w");
    ML4_ASSERT_OK(W.status());
    uint8_t* q = W->weight.mutable_as<uint8_t>();
    float* sc = W->scale.mutable_as<float>();
    std::memset(q, 0, static_cast<size_t>(K));                        // row 0: all zero
    if (N > 2) std::memset(q + 2 * K + 32, 0x80, 32);                 // a -0 group
    if (N > 3) for (int64_t k = 64; k < 96; ++k) q[3 * K + k] = 0x7e;  // +448 codes
    if (K >= 256) {
      sc[0 * (K / 128) + 1] = 1.0e37f;  // block (0, 1): exponents above 127, clamped (values saturate)
      sc[0 * (K / 128) + 0] = 1.0e-36f;  // block (0, 0): exponents below -127, clamped
    }
    auto ref = requantize_fp8_to_mxfp4(*W);
    ML4_ASSERT_OK(ref.status());
    auto d = upload_fp8(*W);
    ML4_ASSERT_OK(d.status());
    auto got = requantize_fp8_to_mxfp4_device(*d, nullptr);
    ML4_ASSERT_OK(got.status());
    ASSERT_EQ(got->format, LinearFormat::kMXFP4);
    std::vector<uint8_t> gw(N * K / 2), gs(N * K / 32);
    ML4_ASSERT_OK(got->weight.download(gw.data(), gw.size()));
    ML4_ASSERT_OK(got->scale.download(gs.data(), gs.size()));
    int64_t wdiff = 0, sdiff = 0;
    for (size_t i = 0; i < gw.size(); ++i) wdiff += gw[i] != ref->weight.as<uint8_t>()[i];
    for (size_t i = 0; i < gs.size(); ++i) sdiff += gs[i] != ref->scale.as<uint8_t>()[i];
    std::printf("requant fp8 -> mxfp4 [%ld, %ld]: %ld of %zu weight bytes and %ld of %zu scales differ from the CPU\n",
                static_cast<long>(N), static_cast<long>(K), static_cast<long>(wdiff), gw.size(), static_cast<long>(sdiff),
                gs.size());
    EXPECT_EQ(wdiff, 0);
    EXPECT_EQ(sdiff, 0);
    // A NaN code is refused, naming the element.
    q[(N - 1) * K + 77] = 0x7f;
    auto bad = upload_fp8(*W);
    ML4_ASSERT_OK(bad.status());
    auto refused = requantize_fp8_to_mxfp4_device(*bad, nullptr);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("(" + std::to_string(N - 1) + ", 77)"), std::string::npos)
        << refused.status().message();
  }
}

}  // namespace
}  // namespace ml4::cuda
