// Linear weights copied into huge-page memory (model/weight_memory.h, `--no-mmap`): every
// linear holds the bytes of its mapped twin, lives outside the checkpoint's files, 64-byte
// aligned; shared bytes (a tied head) are copied once; a rank's shard copies its slices only;
// and a runner over the copy gives the mapped runner's logits bit for bit, decode and prefill.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>

#include "model/checkpoint.h"
#include "model/config_loader.h"
#include "model/model_weights.h"
#include "model/random_checkpoint.h"
#include "model/temp_dir.h"
#include "model/tiny_rank_shard.h"
#include "model/weight_memory.h"
#include "runtime/cpu/cpu_runner.h"
#include "runtime/test_models.h"

namespace ml4 {
namespace {

using testing::seq_step;
using testing::test_model;

std::vector<const LinearWeight*> linears(const ModelWeights& w) {
  std::vector<const LinearWeight*> out;
  for_each_linear(w, [&](const LinearWeight& l) { out.push_back(&l); });
  return out;
}

bool inside_files(const Checkpoint& ck, const void* p) {
  for (const auto& f : ck.files()) {
    auto t = f->get(f->names().front());
    // The data region starts at or before the first tensor's bytes; any tensor of the file is
    // within [data, data + data_bytes) of its start.
    const auto* lo = static_cast<const uint8_t*>(t->data()) - f->info(f->names().front())->begin;
    if (p >= lo && p < lo + f->data_bytes()) return true;
  }
  return false;
}

// Checks `copy` against `mapped` linear by linear; returns the distinct copied bytes.
uint64_t expect_same_bytes(const Checkpoint& ck, const ModelWeights& mapped, const ModelWeights& copy) {
  const auto a = linears(mapped), b = linears(copy);
  EXPECT_EQ(a.size(), b.size());
  uint64_t bytes = 0;
  std::set<const void*> seen;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    SCOPED_TRACE(a[i]->name);
    EXPECT_EQ(a[i]->format, b[i]->format);
    EXPECT_EQ(a[i]->out_features, b[i]->out_features);
    EXPECT_EQ(a[i]->global_scale, b[i]->global_scale);
    for (auto [x, y] : {std::pair{&a[i]->weight, &b[i]->weight}, {&a[i]->scale, &b[i]->scale}}) {
      EXPECT_EQ(x->empty(), y->empty());
      if (x->empty() || y->empty()) continue;
      EXPECT_EQ(x->shape(), y->shape());
      EXPECT_EQ(x->dtype(), y->dtype());
      EXPECT_EQ(x->nbytes(), y->nbytes());
      if (x->nbytes() != y->nbytes()) continue;
      EXPECT_EQ(std::memcmp(x->data(), y->data(), x->nbytes()), 0);
      EXPECT_NE(x->data(), y->data());
      EXPECT_FALSE(inside_files(ck, y->data()));
      EXPECT_EQ(reinterpret_cast<uintptr_t>(y->data()) % 64, 0u);
      if (seen.insert(y->data()).second) bytes += y->nbytes();
    }
  }
  return bytes;
}

// ml4-tiny made with `mo`, its weights loaded twice with `wo`: mapped, then copied.
struct Loaded {
  testing::TempDir dir;
  Result<ModelConfig> cfg = internal_error("not loaded");
  Result<Checkpoint> ck = internal_error("not loaded");
  Result<std::shared_ptr<const ModelWeights>> mapped = internal_error("not loaded"), copy = internal_error("not loaded");
  WeightCopyReport rep;
  uint64_t bytes = 0;  // distinct bytes of the copy's linears, checked against the mapped twin

  Loaded(MakeModelOptions mo, WeightLoadOptions wo) {
    mo.preset = "ml4-tiny";
    mo.out_dir = dir.str();
    if (!make_model(mo).ok()) return;
    cfg = load_model_config(dir.str());
    ck = Checkpoint::open(dir.str());
    if (!cfg.ok() || !ck.ok()) return;
    mapped = load_model_weights(*cfg, *ck, wo);
    wo.copy_linears = true;
    wo.copy_report = &rep;
    copy = load_model_weights(*cfg, *ck, wo);
    if (mapped.ok() && copy.ok()) bytes = expect_same_bytes(*ck, **mapped, **copy);
  }
  bool ok() const { return cfg.ok() && ck.ok() && mapped.ok() && copy.ok(); }
};

TEST(WeightMemory, CopyHoldsTheMappedBytesOutsideTheFiles) {
  for (const char* dtype : {"fp8", "nvfp4", "bf16"}) {
    SCOPED_TRACE(dtype);
    MakeModelOptions mo;
    mo.seed = 9;
    mo.weight_dtype = dtype;
    WeightLoadOptions wo;
    wo.load_drafter = true;
    Loaded L(mo, wo);
    ASSERT_TRUE(L.ok());
    ASSERT_NE((*L.copy)->drafter, nullptr);
    EXPECT_GT(L.bytes, 0u);
    EXPECT_GE(L.rep.bytes, L.bytes);  // each tensor rounded up to 64 bytes
    EXPECT_LT(L.rep.bytes, L.bytes + 64u * L.rep.tensors);
    // The files may go: the copy keeps itself alive (its views own the region).
    for (const auto& f : L.ck->files()) f->drop_resident_pages();
    EXPECT_EQ(expect_same_bytes(*L.ck, **L.mapped, **L.copy), L.bytes);
  }
}

// A tied head on a rank's vocabulary rows: the head is a slice of the embedding (copied, the
// embedding table stays mapped), and the copy holds the slice's bytes only.
TEST(WeightMemory, ShardCopiesItsSlicesOnly) {
  MakeModelOptions mo;
  mo.seed = 4;
  mo.overrides = {"tied_embeddings=true"};
  const WeightShard s = testing::tiny_rank_shard();
  WeightLoadOptions wo;
  wo.shard = &s;
  Loaded L(mo, wo);
  ASSERT_TRUE(L.ok());
  ASSERT_TRUE(L.cfg->tied_embeddings);
  const ModelWeights& C = **L.copy;
  EXPECT_EQ(C.output.weight.dim(0), 256);
  EXPECT_TRUE(inside_files(*L.ck, C.tok_embeddings.data()));  // the table stays mapped
  EXPECT_FALSE(inside_files(*L.ck, C.output.weight.data()));
  // Slices only: the region holds the shard's distinct bytes (each rounded up to 64), not the
  // whole tensors they were cut from, and less than the whole model's linears.
  EXPECT_GE(L.rep.bytes, L.bytes);
  EXPECT_LT(L.rep.bytes, L.bytes + 64u * L.rep.tensors);
  auto whole = load_model_weights(*L.cfg, *L.ck);
  ASSERT_TRUE(whole.ok());
  uint64_t whole_bytes = 0;
  for (const LinearWeight* l : linears(**whole)) whole_bytes += l->weight.nbytes() + l->scale.nbytes();
  EXPECT_LT(L.rep.bytes, whole_bytes);
}

std::vector<float> logits_of(const std::string& dir, WeightMemory m, const std::vector<int32_t>& tokens) {
  RunnerOptions ro;
  ro.kv_cache_dtype = "bf16";
  ro.kv_cache_bytes = 32ll << 20;
  ro.weight_memory = m;
  auto r = CpuRunner::load(dir, ro);
  EXPECT_TRUE(r.ok()) << r.status().message();
  if (!r.ok()) return {};
  const int n = static_cast<int>(tokens.size());
  // The prompt but its last token as one prefill step, then the last token as a decode step.
  auto a = (*r)->execute(StepInput{{seq_step(**r, 1, std::vector<int32_t>(tokens.begin(), tokens.end() - 1), 0, 0, 1, 1)}});
  EXPECT_TRUE(a.ok()) << a.status().message();
  auto b = (*r)->execute(StepInput{{seq_step(**r, 1, {tokens[n - 1]}, n - 1, 0, 1, 1)}});
  EXPECT_TRUE(b.ok()) << b.status().message();
  if (!a.ok() || !b.ok()) return {};
  std::vector<float> out = a->logits[0];
  out.insert(out.end(), b->logits[0].begin(), b->logits[0].end());
  return out;
}

TEST(WeightMemory, RunnerOverTheCopyGivesTheSameLogits) {
  const std::string dir = test_model("ml4-tiny", 21, "fp8");
  std::mt19937 rng(7);
  std::vector<int32_t> tokens(40);
  for (auto& t : tokens) t = 10 + static_cast<int32_t>(rng() % 500);
  const auto mapped = logits_of(dir, WeightMemory::kMapped, tokens);
  const auto copy = logits_of(dir, WeightMemory::kCopy, tokens);
  ASSERT_FALSE(mapped.empty());
  ASSERT_EQ(mapped.size(), copy.size());
  EXPECT_EQ(std::memcmp(mapped.data(), copy.data(), mapped.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace ml4
