// --dtype bfloat16 (RunnerOptions::dtype) on whole models, against the same model in float32.
//
// Both runners get the same prompt; the bf16 run is forced to the f32 run's decisions (its
// top-k sets and expert routing, ForwardTrace), so the two compute one function and differ by
// rounding only. Bound: each linear's input is rounded to bf16 (unit roundoff 2^-9), which
// moves its output by about 2^-9 / sqrt(3) ~ 1.1e-3 relative (random-sign rounding errors);
// ml4-tiny's residual stream passes some 5 such linears per layer (wq, wkv_a, wo, w1/w3, w2)
// x 12 layers + the head in series, so its logits move by about sqrt(61) x 1.1e-3 ~ 9e-3
// relative (measured 2026-12-05: 1.1e-2 bf16 and 1.0e-2 FP8 weights, mistral4-tiny 8.3e-3).
// The bound, 2e-2, is twice that (a random-rounding sum varies by that much between prompts);
// what one wrong formula costs is larger (golden_check.h: 7% for a missing q temperature).
// The difference must also not be zero: a mode that changed nothing would pass the bound.
#include <gtest/gtest.h>

#include <random>

#include "ops/cpu/linear.h"
#include "runtime/forward_trace.h"
#include "runtime/test_models.h"

namespace ml4 {
namespace {

using testing::rel_l2;
using testing::seq_step;
using testing::test_model;

std::unique_ptr<CpuRunner> runner(const std::string& dir, const std::string& dtype) {
  RunnerOptions ro;
  ro.kv_cache_dtype = "bf16";
  ro.kv_cache_bytes = 64ll << 20;
  ro.dtype = dtype;
  auto r = CpuRunner::load(dir, ro);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : nullptr;
}

void check_model(const std::string& preset, const std::string& weights) {
  SCOPED_TRACE(preset + " " + weights);
  const std::string dir = test_model(preset, 21, weights);
  auto a = runner(dir, "float32"), b = runner(dir, "bfloat16");
  ASSERT_TRUE(a && b);
  std::mt19937 rng(3);
  std::vector<int32_t> tokens(48);
  for (auto& t : tokens) t = 10 + static_cast<int32_t>(rng() % 500);
  const int n = static_cast<int>(tokens.size());
  ForwardTrace ta;
  auto ra = a->execute_traced(StepInput{{seq_step(*a, 1, tokens, 0, 0, 1, n)}}, &ta);
  ASSERT_TRUE(ra.ok()) << ra.status().message();
  ForwardTrace tb;
  tb.forced_topk = ta.topk;
  tb.forced_experts = ta.experts;
  auto rb = b->execute_traced(StepInput{{seq_step(*b, 1, tokens, 0, 0, 1, n)}}, &tb);
  ASSERT_TRUE(rb.ok()) << rb.status().message();
  const double e = rel_l2(rb.value().logits[0], ra.value().logits[0]);
  std::printf("%s %s: logits rel L2 bf16 vs f32 activations %.3g\n", preset.c_str(), weights.c_str(), e);
  EXPECT_LT(e, 2e-2);
  EXPECT_GT(e, 1e-6);
}

class ActivationDtype : public ::testing::Test {
 protected:
  void SetUp() override {
    Status s = cpu::activation_dtype_supported(cpu::ActivationDtype::kBF16);
    if (!s.ok()) GTEST_SKIP() << s.message();
  }
};

TEST_F(ActivationDtype, Ml4TinyBf16Weights) { check_model("ml4-tiny", "bf16"); }
TEST_F(ActivationDtype, Ml4TinyFp8Weights) { check_model("ml4-tiny", "fp8"); }
TEST_F(ActivationDtype, Mistral4TinyBf16Weights) { check_model("mistral4-tiny", "bf16"); }

// An unknown --dtype is refused at load with a message naming it.
TEST(ActivationDtypeOption, UnknownIsRefused) {
  RunnerOptions ro;
  ro.kv_cache_dtype = "bf16";
  ro.kv_cache_bytes = 16ll << 20;
  ro.dtype = "float16";
  auto r = CpuRunner::load(test_model("ml4-tiny", 21, "bf16"), ro);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("float16"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace ml4
