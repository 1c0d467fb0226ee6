// --decode-backend (runtime/latency_decode.h): latency_specialized fails closed at start-up with
// every reason at once, each naming what to change; standard is never refused; an unknown
// backend is an error naming it.
#include "runtime/latency_decode.h"

#include <gtest/gtest.h>

namespace ml4 {
namespace {

bool has(const std::vector<std::string>& why, const std::string& needle) {
  for (const auto& w : why)
    if (w.find(needle) != std::string::npos) return true;
  return false;
}

ModelConfig fp8_model() {
  ModelConfig c;
  c.weight_format = WeightFormat::kFP8Block;
  return c;
}

TEST(LatencyDecode, SupportedSetupIsRefusedOnlyForTheMissingKernels) {
  const ModelConfig m = fp8_model();
  LatencyDecodeSetup s;
  s.device = "cuda";
  s.model = &m;
  const auto why = latency_decode_refusals(s);
  ASSERT_EQ(why.size(), 1u) << why.back();
  EXPECT_NE(why[0].find("no latency-specialised decode kernels"), std::string::npos) << why[0];
}

TEST(LatencyDecode, ListsEveryReasonAtOnce) {
  ModelConfig m;
  m.weight_format = WeightFormat::kBF16;
  LatencyDecodeSetup s;  // device cpu
  s.cuda_graphs = false;
  s.batch_invariant = true;
  s.kv_cache_dtype = "bf16";
  s.quantization = "mxfp4";
  s.parallel.tensor_parallel_size = 2;
  s.parallel.data_parallel_size = 2;
  s.parallel.enable_expert_parallel = true;
  s.parallel.decode_context_parallel_size = 2;
  s.parallel.prefill_context_parallel_size = 2;
  s.speculative = true;
  s.hisparse = true;
  s.model = &m;
  const auto why = latency_decode_refusals(s);
  const std::vector<std::string> expect = {"no latency-specialised decode kernels", "--device cpu",
                                           "--no-cuda-graphs", "--batch-invariant", "--kv-cache-dtype bf16",
                                           "--quantization mxfp4", "--tensor-parallel-size 2",
                                           "--data-parallel-size 2", "--enable-expert-parallel",
                                           "--decode-context-parallel-size 2", "--prefill-context-parallel-size 2",
                                           "--speculative-config", "HiSparse", "weights are bf16"};
  EXPECT_EQ(why.size(), expect.size());
  for (const auto& e : expect) EXPECT_TRUE(has(why, e)) << "missing reason: " << e;

  const Status st = check_decode_backend("latency_specialized", s);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("refused (14 reasons)"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("never falls back"), std::string::npos);
  for (const auto& w : why) EXPECT_NE(st.message().find("\n  - " + w), std::string::npos) << w;
}

TEST(LatencyDecode, FourBitExpertsAreNamed) {
  ModelConfig m;
  m.weight_format = WeightFormat::kNVFP4Experts;
  LatencyDecodeSetup s;
  s.device = "cuda";
  s.model = &m;
  EXPECT_TRUE(has(latency_decode_refusals(s), "NVFP4 experts"));
}

TEST(LatencyDecode, StandardIsNeverRefusedAndUnknownIsNamed) {
  LatencyDecodeSetup s;  // everything the latency path refuses
  s.cuda_graphs = false;
  s.parallel.tensor_parallel_size = 4;
  EXPECT_TRUE(check_decode_backend("standard", s).ok());
  const Status st = check_decode_backend("fast", s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("--decode-backend fast"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace ml4
