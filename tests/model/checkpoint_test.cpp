// Checkpoint directories: layout discovery (Mistral native before HF, single or sharded) and
// a hostile index (missing shard, tensor missing from its shard, tensor in two shards, an
// unlisted tensor, path traversal, duplicate keys) each refused with its own message.
#include "model/checkpoint.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <gtest/gtest.h>

#include "model/temp_dir.h"

namespace ml4 {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

Tensor random_f32(Shape shape, std::mt19937& rng) {
  Tensor t(DType::kF32, std::move(shape));
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < t.numel(); ++i) t.mutable_as<float>()[i] = nd(rng);
  return t;
}

// Writes one shard file holding `names` (f32 [2, 3] each, random).
void write_shard(const TempDir& d, const std::string& file, const std::vector<std::string>& names, std::mt19937& rng) {
  SafetensorsWriter w;
  for (const auto& n : names) ASSERT_TRUE(w.add(n, random_f32({2, 3}, rng)).ok());
  ASSERT_TRUE(w.write(d.file(file)).ok());
}

std::string open_error(const TempDir& d) {
  auto c = Checkpoint::open(d.str());
  return c.ok() ? std::string() : c.status().message();
}

TEST(Checkpoint, MistralSingleFileAndViewsOutliveIt) {
  TempDir d;
  std::mt19937 rng(1);
  Tensor emb = random_f32({4, 8}, rng);
  SafetensorsWriter w;
  ASSERT_TRUE(w.add("tok_embeddings.weight", emb).ok());
  ASSERT_TRUE(w.add("norm.weight", random_f32({8}, rng)).ok());
  ASSERT_TRUE(w.write_sharded(d.str(), "consolidated", 1 << 20).ok());
  ASSERT_TRUE(fs::exists(d.file("consolidated.safetensors")));

  Tensor view;
  {
    auto c = Checkpoint::open(d.str());
    ASSERT_TRUE(c.ok()) << c.status().message();
    EXPECT_EQ(c->layout(), CheckpointLayout::kMistral);
    EXPECT_EQ(c->names(), (std::vector<std::string>{"norm.weight", "tok_embeddings.weight"}));
    EXPECT_TRUE(c->contains("norm.weight"));
    auto info = c->info("tok_embeddings.weight");
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->shape, (Shape{4, 8}));
    auto missing = c->get("output.weight");
    ASSERT_FALSE(missing.ok());
    EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
    EXPECT_NE(missing.status().message().find("no tensor \"output.weight\""), std::string::npos);
    auto t = c->get("tok_embeddings.weight");
    ASSERT_TRUE(t.ok());
    view = *t;
  }
  ASSERT_EQ(view.nbytes(), emb.nbytes());
  EXPECT_EQ(std::memcmp(view.data(), emb.data(), emb.nbytes()), 0);

  // A .safetensors path given directly also opens.
  auto direct = Checkpoint::open(d.file("consolidated.safetensors"));
  ASSERT_TRUE(direct.ok()) << direct.status().message();
  EXPECT_EQ(direct->size(), 2u);
}

TEST(Checkpoint, MistralNativeWinsOverHfInTheSameDirectory) {
  TempDir d;
  std::mt19937 rng(2);
  write_shard(d, "consolidated.safetensors", {"layers.0.attention.wq.weight"}, rng);
  SafetensorsWriter hf;
  ASSERT_TRUE(hf.add("model.layers.0.self_attn.q_proj.weight", random_f32({2, 3}, rng)).ok());
  ASSERT_TRUE(hf.add("model.norm.weight", random_f32({3}, rng)).ok());
  ASSERT_TRUE(hf.write_sharded(d.str(), "model", 24).ok());
  auto c = Checkpoint::open(d.str());
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->layout(), CheckpointLayout::kMistral);
  EXPECT_TRUE(c->contains("layers.0.attention.wq.weight"));

  fs::remove(d.file("consolidated.safetensors"));
  c = Checkpoint::open(d.str());
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->layout(), CheckpointLayout::kHF);
  EXPECT_EQ(c->files().size(), 2u);
  EXPECT_EQ(c->names(), (std::vector<std::string>{"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}));
}

TEST(Checkpoint, DirectoryProblems) {
  TempDir d;
  std::string msg = open_error(d);
  EXPECT_NE(msg.find("no weights found"), std::string::npos) << msg;

  auto absent = Checkpoint::open(d.file("nothing-here"));
  ASSERT_FALSE(absent.ok());
  EXPECT_EQ(absent.status().code(), StatusCode::kNotFound);

  std::mt19937 rng(3);
  write_shard(d, "consolidated-00001-of-00002.safetensors", {"a"}, rng);
  msg = open_error(d);
  EXPECT_NE(msg.find("consolidated-*.safetensors shards but no consolidated.safetensors.index.json"),
            std::string::npos)
      << msg;

  write_shard(d, "consolidated.safetensors", {"a"}, rng);
  write_text(d.file("consolidated.safetensors.index.json"),
             R"({"weight_map": {"a": "consolidated-00001-of-00002.safetensors"}})");
  msg = open_error(d);
  EXPECT_NE(msg.find("both consolidated.safetensors and consolidated.safetensors.index.json exist"),
            std::string::npos)
      << msg;
}

// Shards s1 = {a, b}, s2 = {c}; each case writes its own index.
class HostileIndex : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(4);
    write_shard(d_, "model-00001-of-00002.safetensors", {"a", "b"}, rng);
    write_shard(d_, "model-00002-of-00002.safetensors", {"c"}, rng);
  }
  std::string with_index(const std::string& json) {
    write_text(d_.file("model.safetensors.index.json"), json);
    return open_error(d_);
  }
  TempDir d_;
};

TEST_F(HostileIndex, ValidIndexOpens) {
  std::string msg = with_index(R"({"metadata": {"total_size": 72}, "weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
      "c": "model-00002-of-00002.safetensors"}})");
  EXPECT_EQ(msg, "");
  auto c = Checkpoint::open(d_.str());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->file_of("c")->path(), d_.file("model-00002-of-00002.safetensors"));
}

TEST_F(HostileIndex, NamesAMissingFile) {
  std::string msg = with_index(R"({"weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
      "c": "model-00003-of-00003.safetensors"}})");
  EXPECT_NE(msg.find("names shard model-00003-of-00003.safetensors, which does not exist"), std::string::npos)
      << msg;
}

TEST_F(HostileIndex, TensorMissingFromItsShard) {
  std::string msg = with_index(R"({"weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
      "c": "model-00002-of-00002.safetensors", "d": "model-00002-of-00002.safetensors"}})");
  EXPECT_NE(msg.find("tensor \"d\" is mapped to model-00002-of-00002.safetensors, which does not hold it"),
            std::string::npos)
      << msg;
}

TEST_F(HostileIndex, TensorInTwoShards) {
  std::mt19937 rng(5);
  write_shard(d_, "model-00002-of-00002.safetensors", {"c", "a"}, rng);  // "a" also in shard 1
  std::string msg = with_index(R"({"weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
      "c": "model-00002-of-00002.safetensors"}})");
  EXPECT_NE(msg.find("tensor \"a\" is in two shards, model-00001-of-00002.safetensors and "
                     "model-00002-of-00002.safetensors"),
            std::string::npos)
      << msg;
}

TEST_F(HostileIndex, ShardHoldsAnUnlistedTensor) {
  std::string msg = with_index(R"({"weight_map": {
      "a": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})");
  EXPECT_NE(msg.find("shard model-00001-of-00002.safetensors holds tensor \"b\", which the index does not list"),
            std::string::npos)
      << msg;
}

TEST_F(HostileIndex, MalformedIndexes) {
  struct Case {
    std::string json, expect;
  };
  const std::vector<Case> cases = {
      {R"({"weight_map": {"a": "../model-00001-of-00002.safetensors"}})", "not a file name in the directory"},
      {R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "a": "model-00002-of-00002.safetensors"}})",
       "key \"a\" appears twice"},
      {R"({"weight_map": {"a": 3}})", "weight_map[\"a\"] is number, not a file name"},
      {R"({"metadata": {}})", "no \"weight_map\" object"},
      {R"([1])", "index is array, not an object"},
      {R"({"weight_map": )", "not valid JSON"},
  };
  for (const Case& c : cases) {
    std::string msg = with_index(c.json);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.json << " -> " << msg;
    EXPECT_NE(msg.find("model.safetensors.index.json"), std::string::npos) << msg;
  }
}

TEST_F(HostileIndex, CorruptShardIsReportedByName) {
  write_text(d_.file("model-00002-of-00002.safetensors"), std::string("\x10\0\0\0\0\0\0\0{\"c\": 1", 15));
  std::string msg = with_index(R"({"weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
      "c": "model-00002-of-00002.safetensors"}})");
  EXPECT_NE(msg.find("model-00002-of-00002.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("runs past the end of the file"), std::string::npos) << msg;
}

}  // namespace
}  // namespace ml4
