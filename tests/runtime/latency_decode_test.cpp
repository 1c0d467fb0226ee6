// --decode-backend (runtime/latency_decode.h): latency_specialized is accepted for a supported
// configuration and fails closed at start-up otherwise, with every reason at once, each naming
// what to change; standard is never refused; an unknown backend is an error naming it.
#include "runtime/latency_decode.h"

#include <gtest/gtest.h>

namespace ml4 {
namespace {

bool has(const std::vector<std::string>& why, const std::string& needle) {
  for (const auto& w : why)
    if (w.find(needle) != std::string::npos) return true;
  return false;
}

// ML4's FFN shapes (a dense layer, then MoE layers), FP8.
ModelConfig fp8_model() {
  ModelConfig c;
  c.weight_format = WeightFormat::kFP8Block;
  c.dim = 6144;
  c.hidden_dim = 16384;
  c.moe.num_experts = 128;
  c.moe.num_experts_per_tok = 4;
  c.moe.expert_hidden_dim = 5632;
  c.moe.num_shared_experts = 1;
  c.layers.resize(4);
  for (size_t l = 1; l < c.layers.size(); ++l) c.layers[l].ffn = FfnKind::kMoe;
  return c;
}

TEST(LatencyDecode, SupportedSetupIsAccepted) {
  const ModelConfig m = fp8_model();
  LatencyDecodeSetup s;
  s.device = "cuda";
  s.model = &m;
  const auto why = latency_decode_refusals(s);
  EXPECT_TRUE(why.empty()) << why.front();
  EXPECT_TRUE(check_decode_backend("latency_specialized", s).ok());
}

TEST(LatencyDecode, ListsEveryReasonAtOnce) {
  ModelConfig m = fp8_model();
  m.weight_format = WeightFormat::kBF16;
  m.dim = 6000;                     // not a multiple of 128
  m.moe.num_experts_per_tok = 16;  // more than the kernel's 8
  LatencyDecodeSetup s;  // device cpu
  s.batch_invariant = true;
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
  const std::vector<std::string> expect = {"--device cpu", "--batch-invariant", "--quantization mxfp4",
                                           "--tensor-parallel-size 2", "--data-parallel-size 2",
                                           "--enable-expert-parallel", "--decode-context-parallel-size 2",
                                           "--prefill-context-parallel-size 2", "--speculative-config", "HiSparse",
                                           "weights are bf16", "FFN shapes"};
  EXPECT_EQ(why.size(), expect.size());
  for (const auto& e : expect) EXPECT_TRUE(has(why, e)) << "missing reason: " << e;
  // The shape reason names both problems.
  EXPECT_TRUE(has(why, "width 6000")) << why.back();
  EXPECT_TRUE(has(why, "16 experts per token")) << why.back();

  const Status st = check_decode_backend("latency_specialized", s);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("refused (12 reasons)"), std::string::npos) << st.message();
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
  s.batch_invariant = true;
  s.parallel.tensor_parallel_size = 4;
  EXPECT_TRUE(check_decode_backend("standard", s).ok());
  const Status st = check_decode_backend("fast", s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("--decode-backend fast"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace ml4
