// The CPU backend against the goldens: see golden_check.h for what is compared and why
// the bounds are what they are.
#include "runtime/golden_check.h"

namespace ml4 {
namespace {

using golden::check_case;
using testing::load_runner;
using testing::seq_step;
using testing::test_model;

std::unique_ptr<ModelRunner> cpu_runner(const std::string& dir, const std::string& kv) { return load_runner(dir, kv); }

TEST(Golden, Mistral4TinyAgainstTransformersHfLayout) { check_case("mistral4-tiny", "both", "/hf", cpu_runner); }
TEST(Golden, Mistral4TinyAgainstTransformersNativeLayout) { check_case("mistral4-tiny", "both", "", cpu_runner); }
TEST(Golden, Dsv32TinyAgainstTransformersHfLayout) { check_case("dsv32-tiny", "both", "/hf", cpu_runner); }
TEST(Golden, Dsv32TinyAgainstTransformersNativeLayout) { check_case("dsv32-tiny", "both", "", cpu_runner); }
TEST(Golden, Ml4TinyAgainstPytorchReference) { check_case("ml4-tiny", "native", "", cpu_runner); }

// The forced decisions are test input to CpuModel: malformed ones are refused with a
// Status, never read out of bounds.
TEST(Golden, ForcedDecisionsAreValidated) {
  auto r = load_runner(test_model("ml4-tiny", 1234, "bf16", "native"));
  ASSERT_TRUE(r);
  const int L = r->config().n_layers;
  const std::vector<int32_t> tokens = {5, 6, 7, 8};
  auto run = [&](ForwardTrace& tr) {
    return r->execute_traced(StepInput{{seq_step(*r, 9, tokens, 0, 40, 1, 1)}}, &tr).status();
  };
  ForwardTrace future;  // a key after the token's own position
  future.forced_topk.assign(L, {});
  future.forced_topk[0] = {{0}, {0, 1}, {0, 3}, {0}};
  Status s = run(future);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("forced_topk[0][2]"), std::string::npos) << s.message();
  ForwardTrace short_rows;  // fewer rows than tokens
  short_rows.forced_topk.assign(L, {});
  short_rows.forced_topk[0] = {{0}};
  EXPECT_FALSE(run(short_rows).ok());
  ForwardTrace bad_expert;  // an expert id out of range, on an MoE layer
  bad_expert.forced_experts.assign(L, {});
  bad_expert.forced_experts[1].assign(tokens.size(), {0, r->config().moe.num_experts});
  s = run(bad_expert);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("forced_experts[1]"), std::string::npos) << s.message();
  ForwardTrace dense;  // forcing experts on the dense layer 0
  dense.forced_experts.assign(L, {});
  dense.forced_experts[0].assign(tokens.size(), {0, 1});
  EXPECT_FALSE(run(dense).ok());
}

}  // namespace
}  // namespace ml4
