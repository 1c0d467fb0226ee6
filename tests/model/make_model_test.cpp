// make_model (model/random_checkpoint.h) layouts: `merged` puts the native and HF files in
// one directory (as Mistral's repos do) holding the same numbers, and ml4 reads the native
// ones; the HF tokenizer files ride along with tekken.json in every layout.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/checkpoint.h"
#include "model/config_loader.h"
#include "model/random_checkpoint.h"
#include "model/weight_names.h"
#include "temp_dir.h"

namespace ml4 {
namespace {

namespace fs = std::filesystem;

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

TEST(MakeModel, MergedLayoutHoldsBothWithTheSameWeights) {
  testing::TempDir tmp;
  MakeModelOptions o;
  o.preset = "mistral4-tiny";
  o.out_dir = tmp.file("m");
  o.layout = "merged";
  o.tokenizer_json = read_text(std::string(ML4_SOURCE_DIR) + "/tests/golden/tokenizer/tekken_trained_v15_512.json");
  ASSERT_TRUE(make_model(o).ok());
  for (const char* f : {"params.json", "config.json", "consolidated.safetensors", "model.safetensors", "tekken.json",
                        "tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(fs::path(o.out_dir) / f)) << f;
  EXPECT_FALSE(fs::exists(fs::path(o.out_dir) / "hf"));
  auto cfg = load_model_config(o.out_dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  EXPECT_EQ(cfg->layout, CheckpointLayout::kMistral);
  auto ck = Checkpoint::open(o.out_dir);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->layout(), CheckpointLayout::kMistral);
  // The HF file holds the same bytes under HF names (mistral4 fuses experts: skip those).
  auto hf = SafetensorsFile::open(o.out_dir + "/model.safetensors").value();
  int same = 0;
  for (const auto& name : ck->names()) {
    auto hname = hf_name_from_native(name);
    if (!hname.ok() || !hf->contains(hname.value())) continue;
    Tensor a = ck->get(name).value(), b = hf->get(hname.value()).value();
    ASSERT_EQ(a.nbytes(), b.nbytes()) << name;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << name;
    ++same;
  }
  EXPECT_GT(same, 20);
  // An unknown layout is refused.
  o.layout = "mixed";
  o.out_dir = tmp.file("x");
  EXPECT_FALSE(make_model(o).ok());
}

}  // namespace
}  // namespace ml4
