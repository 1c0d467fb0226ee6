// The DSpark drafter of the CPU runner against the float64 PyTorch drafter: see drafter_check.h.
#include "runtime/drafter_check.h"
#include "runtime/test_models.h"

namespace ml4 {
namespace {

TEST(DrafterGolden, Ml4SmallDraftBlockMatchesPytorch) {
  RunnerOptions ro;
  ro.kv_cache_dtype = "bf16";
  ro.kv_cache_bytes = 64ll << 20;
  ro.drafter = true;
  ro.max_num_seqs = 4;
  auto rr = CpuRunner::load(testing::drafter_golden_model_dir(), ro);
  ASSERT_TRUE(rr.ok()) << rr.status().message();
  testing::check_drafter_golden(**rr, "cpu");
}

}  // namespace
}  // namespace ml4
