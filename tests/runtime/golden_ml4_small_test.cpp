// The trained default model (assets/ml4-small, issue 12) on the CPU runner against the
// float64 PyTorch reference (tools/reference/ml4_model.py), as golden_test.cpp checks the
// random tiny presets; see golden_check.h for what is compared and why the bounds hold.
//
// What this case adds to ml4-tiny's: trained weights (real attention patterns, routing that
// is not uniform), FP8 128x128 block weights decoded by the loader (the reference decodes
// the same e4m3 bytes and scales, so the comparison stays f32 vs f64), tied embeddings, text
// prompts, and a 300-token prompt + 32 greedy tokens, longer than the indexer top-k of 256,
// so every owner layer's selection bites on the late rows. The checkpoint is read from the
// repo (manifest "model_dir"), and its fingerprint must equal the manifest's: a retrained
// model needs new goldens (python3 tools/reference/make_goldens.py --models - --out
// tests/golden --cases ml4-small).
#include "runtime/golden_check.h"

namespace ml4 {
namespace {

std::unique_ptr<ModelRunner> cpu_runner(const std::string& dir, const std::string& kv) {
  return testing::load_runner(dir, kv);
}

TEST(GoldenMl4Small, TrainedModelAgainstPytorchReference) { golden::check_case("ml4-small", "native", "", cpu_runner); }

}  // namespace
}  // namespace ml4
