// safetensors: hostile headers are each refused with their own message (naming the file and
// the tensor), random header mutations never crash, and writer -> reader round trips are
// byte-identical for every dtype, single-file and sharded.
#include "model/safetensors.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "model/temp_dir.h"

#include "model/checkpoint.h"

namespace ml4 {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// A file with `header` verbatim and `data_bytes` bytes of (non-zero) data.
std::string raw_file(const std::string& header, size_t data_bytes) {
  std::string data(data_bytes, '\0');
  for (size_t i = 0; i < data_bytes; ++i) data[i] = static_cast<char>(i * 37 + 11);
  return le64(header.size()) + header + data;
}

// Writes `header` + data and returns the open error message ("" if it opened).
std::string open_error(const TempDir& dir, const std::string& header, size_t data_bytes) {
  std::string p = dir.file("model.safetensors");
  write_bytes(p, raw_file(header, data_bytes));
  auto f = SafetensorsFile::open(p);
  return f.ok() ? std::string() : f.status().message();
}

Tensor random_tensor(DType dt, Shape shape, std::mt19937& rng) {
  Tensor t(dt, std::move(shape));
  auto* p = static_cast<uint8_t*>(t.mutable_data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
  return t;
}

TEST(Safetensors, ValidFileOpensAndViewsTheMapping) {
  TempDir dir;
  std::string p = dir.file("model.safetensors");
  // Two f32 [2, 2] tensors and metadata, laid out by hand as the spec describes.
  std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"BF16","shape":[4],"data_offsets":[16,24]}})";
  std::string data(24, '\0');
  const float av[4] = {1.5f, -2.0f, 3.25f, 1e-3f};
  std::memcpy(data.data(), av, 16);
  const uint16_t bv[4] = {f32_to_bf16(0.5f), f32_to_bf16(-7.0f), f32_to_bf16(1.0f), f32_to_bf16(2.0f)};
  std::memcpy(data.data() + 16, bv, 8);
  write_bytes(p, le64(header.size()) + header + data);

  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ((*f)->names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  EXPECT_TRUE((*f)->contains("a"));
  EXPECT_FALSE((*f)->contains("c"));
  auto info = (*f)->info("b");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->dtype, DType::kBF16);
  EXPECT_EQ(info->shape, (Shape{4}));
  EXPECT_EQ(info->nbytes(), 8u);

  Tensor a;
  {
    auto ta = (*f)->get("a");
    ASSERT_TRUE(ta.ok());
    a = *ta;
  }
  f = Status(StatusCode::kInternal, "drop the file");  // the view alone keeps the mapping alive
  EXPECT_EQ(a.shape(), (Shape{2, 2}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(a.as<float>()[i], av[i]);

  auto again = SafetensorsFile::open(p);
  ASSERT_TRUE(again.ok());
  auto missing = (*again)->get("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no tensor \"nope\""), std::string::npos);
}

// Each hostile header is refused with its own message.
TEST(Safetensors, HostileHeadersAreRefusedWithSpecificMessages) {
  TempDir dir;
  const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]})";
  struct Case {
    const char* what;
    std::string header;
    size_t data_bytes;
    std::string expect;  // substring of the message
  };
  const std::vector<Case> cases = {
      {"non-JSON", "{\"w\": nope", 32, "header is not valid JSON"},
      {"not an object", "[1, 2, 3]", 32, "header JSON is array, not an object"},
      {"unknown dtype", R"({"w":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", 8,
       "tensor \"w\": unknown dtype \"F7\""},
      {"negative shape", R"({"w":{"dtype":"F32","shape":[-2,4],"data_offsets":[0,32]}})", 32,
       "tensor \"w\": shape [-2,4] has a dimension -2 that is not a non-negative integer"},
      {"fractional shape", R"({"w":{"dtype":"F32","shape":[2.5,4],"data_offsets":[0,32]}})", 32,
       "not a non-negative integer"},
      {"offsets out of range", R"({"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]}})", 16,
       "tensor \"w\": data_offsets [0, 32] end past the data region (16 bytes): file truncated?"},
      {"begin > end", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 32,
       "tensor \"w\": data_offsets [8, 4] has begin > end"},
      {"size mismatch", R"({"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,24]}})", 32,
       "tensor \"w\": data_offsets [0, 24] hold 24 bytes but shape [2, 4] F32 needs 32"},
      {"overlap", "{" + ok_entry + R"(,"v":{"dtype":"F16","shape":[4],"data_offsets":[24,32]}})", 32,
       "overlap"},
      {"duplicate key", "{" + ok_entry + "," + ok_entry + "}", 32, "tensor \"w\" appears twice"},
      {"entry not an object", R"({"w":[1,2]})", 32, "tensor \"w\": entry is [1,2], not an object"},
      {"missing field", R"({"w":{"dtype":"F32","shape":[2,4]}})", 32, "tensor \"w\": entry has no \"data_offsets\""},
      {"extra field", R"({"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,32],"x":1}})", 32,
       "unexpected field \"x\""},
      {"offsets not a pair", R"({"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0]}})", 32,
       "is not [begin, end]"},
      {"metadata not strings", R"({"__metadata__":{"format":3}})", 0, "__metadata__ \"format\" is number"},
      {"shape overflows", R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,32]}})", 32,
       "too large"},
      {"deep nesting", std::string(40, '[') + std::string(40, ']'), 0, "nests deeper"},
  };
  for (const Case& c : cases) {
    std::string msg = open_error(dir, c.header, c.data_bytes);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": got \"" << msg << "\"";
    // Every message names the file.
    EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << c.what << ": " << msg;
  }
}

TEST(Safetensors, BadLengthFieldsAndTruncation) {
  TempDir dir;
  std::string p = dir.file("m.safetensors");
  // Shorter than the length field itself.
  write_bytes(p, "abc");
  auto r = SafetensorsFile::open(p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("too short for the 8-byte header length"), std::string::npos);
  // Header length past the end of the file.
  write_bytes(p, le64(1000) + "{}");
  r = SafetensorsFile::open(p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("header length 1000 runs past the end of the file (10 bytes)"),
            std::string::npos)
      << r.status().message();
  // Absurd length (a text file, say).
  write_bytes(p, le64(1ull << 40) + "{}");
  r = SafetensorsFile::open(p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is absurd"), std::string::npos) << r.status().message();
  // A real file cut short: the last tensor's end falls past the data region.
  SafetensorsWriter w;
  std::mt19937 rng(7);
  ASSERT_TRUE(w.add("layers.0.attention.wq.weight", random_tensor(DType::kBF16, {32, 64}, rng)).ok());
  ASSERT_TRUE(w.write(p).ok());
  std::string full = read_bytes(p);
  write_bytes(p, full.substr(0, full.size() - 2048));
  r = SafetensorsFile::open(p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(
                "tensor \"layers.0.attention.wq.weight\": data_offsets [0, 4096] end past the data region (2048 "
                "bytes): file truncated?"),
            std::string::npos)
      << r.status().message();
  // Missing file and directory.
  r = SafetensorsFile::open(dir.file("absent.safetensors"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  r = SafetensorsFile::open(dir.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not a regular file"), std::string::npos);
}

// Random byte mutations of a valid file's length field and header: each file opens or is
// refused; when it opens, every tensor it lists is readable in full (the validation held).
TEST(Safetensors, FuzzedHeadersNeverCrash) {
  TempDir dir;
  std::mt19937 rng(2024);
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  ASSERT_TRUE(w.add("a", random_tensor(DType::kF32, {3, 5}, rng)).ok());
  ASSERT_TRUE(w.add("b.weight", random_tensor(DType::kBF16, {7}, rng)).ok());
  ASSERT_TRUE(w.add("c", random_tensor(DType::kF8E4M3, {2, 2, 3}, rng)).ok());
  ASSERT_TRUE(w.add("s", random_tensor(DType::kI64, {}, rng)).ok());
  std::string p = dir.file("fuzz.safetensors");
  ASSERT_TRUE(w.write(p).ok());
  const std::string orig = read_bytes(p);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<uint8_t>(orig[i]);
  const size_t span = 8 + hlen;
  const char kInteresting[] = "{}[],:\"0123456789-.eE \x00\xff";
  int opened = 0, refused = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::string m = orig;
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      size_t pos = rng() % span;
      m[pos] = (rng() % 2) ? static_cast<char>(rng()) : kInteresting[rng() % (sizeof(kInteresting) - 1)];
    }
    if (rng() % 10 == 0) m.resize(rng() % m.size());  // sometimes also truncate
    write_bytes(p, m);
    auto f = SafetensorsFile::open(p);
    if (!f.ok()) {
      EXPECT_FALSE(f.status().message().empty());
      ++refused;
      continue;
    }
    ++opened;
    for (const std::string& n : (*f)->names()) {
      auto t = (*f)->get(n);
      ASSERT_TRUE(t.ok()) << n;
      uint64_t sum = 0;
      const auto* b = static_cast<const uint8_t*>(t->data());
      for (size_t i = 0; i < t->nbytes(); ++i) sum += b[i];
      (void)sum;
    }
  }
  // Both outcomes occur: mutations inside string values leave valid files.
  EXPECT_GT(opened, 0);
  EXPECT_GT(refused, 0);
}

// Every dtype with random bytes; scalars and empty tensors included.
std::vector<std::pair<std::string, Tensor>> all_dtype_tensors(std::mt19937& rng) {
  const std::vector<std::pair<DType, Shape>> specs = {
      {DType::kF64, {3, 5}},     {DType::kF32, {17, 9}},     {DType::kF16, {4, 4, 3}}, {DType::kBF16, {33}},
      {DType::kF8E4M3, {8, 16}}, {DType::kF4E2M1x2, {6, 8}}, {DType::kE8M0, {6, 1}},  {DType::kU8, {11}},
      {DType::kI8, {2, 3}},      {DType::kI32, {5}},         {DType::kI64, {}},       {DType::kBool, {0, 4}},
  };
  std::vector<std::pair<std::string, Tensor>> out;
  int i = 0;
  for (const auto& [dt, shape] : specs) {
    out.emplace_back(fmt::format("layers.{}.{}.weight", i++, dtype_name(dt)), random_tensor(dt, shape, rng));
  }
  return out;
}

void expect_same(const Tensor& got, const Tensor& want, const std::string& name) {
  // Packed FP4 is stored as safetensors "U8" and reads back as u8 with the same bytes.
  DType want_dt = want.dtype() == DType::kF4E2M1x2 ? DType::kU8 : want.dtype();
  EXPECT_EQ(got.dtype(), want_dt) << name;
  EXPECT_EQ(got.shape(), want.shape()) << name;
  ASSERT_EQ(got.nbytes(), want.nbytes()) << name;
  if (want.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0) << name;
  }
}

TEST(Safetensors, RoundTripEveryDtypeSingleFile) {
  TempDir dir;
  std::mt19937 rng(99);
  auto tensors = all_dtype_tensors(rng);
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.set_metadata("ml4", "test");
  for (auto& [n, t] : tensors) ASSERT_TRUE(w.add(n, t).ok());
  EXPECT_FALSE(w.add(tensors[0].first, tensors[0].second).ok());  // duplicate name
  EXPECT_FALSE(w.add("__metadata__", tensors[0].second).ok());
  std::string p = dir.file("consolidated.safetensors");
  ASSERT_TRUE(w.write(p).ok());
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  // File layout: header length a multiple of 8 (space padded); the data region holds the
  // tensors back to back, each aligned to its element size (this mix cannot keep the added
  // order aligned, so the writer orders by element size).
  std::string bytes = read_bytes(p);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ(hlen % 8, 0u);
  EXPECT_EQ(bytes[8], '{');
  uint64_t total = 0;
  {
    auto f = SafetensorsFile::open(p);
    ASSERT_TRUE(f.ok()) << f.status().message();
    for (auto& [n, t] : tensors) {
      auto info = (*f)->info(n);
      ASSERT_TRUE(info.ok());
      EXPECT_EQ(info->begin % dtype_size(t.dtype()), 0u) << n;
      if (t.nbytes() > 0) {
        EXPECT_EQ(std::memcmp(bytes.data() + 8 + hlen + info->begin, t.data(), t.nbytes()), 0) << n;
      }
      total += t.nbytes();
    }
  }
  EXPECT_EQ(8 + hlen + total, bytes.size());

  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ((*f)->size(), tensors.size());
  EXPECT_EQ((*f)->metadata().at("ml4"), "test");
  for (auto& [n, t] : tensors) {
    auto g = (*f)->get(n);
    ASSERT_TRUE(g.ok()) << n;
    expect_same(*g, t, n);
  }
}

// Known answer: these bytes are what the reference writer (Python safetensors 0.8.0,
// `safetensors.numpy.save_file({"a": f32 [1, -2], "b.weight": i8 [[1, 2, 3]]},
// metadata={"format": "pt"})`) produces; ours must be identical.
TEST(Safetensors, WriterMatchesReferenceBytes) {
  TempDir dir;
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b.weight":{"dtype":"I8","shape":[1,3],"data_offsets":[8,11]}}     )";
  ASSERT_EQ(header.size(), 0x98u);
  const std::string want = le64(0x98) + header + std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0\x01\x02\x03", 11);
  Tensor a(DType::kF32, {2});
  a.mutable_as<float>()[0] = 1.0f;
  a.mutable_as<float>()[1] = -2.0f;
  Tensor b(DType::kI8, {1, 3});
  for (int i = 0; i < 3; ++i) b.mutable_as<int8_t>()[i] = static_cast<int8_t>(i + 1);
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  ASSERT_TRUE(w.add("a", a).ok());
  ASSERT_TRUE(w.add("b.weight", b).ok());
  std::string p = dir.file("ref.safetensors");
  ASSERT_TRUE(w.write(p).ok());
  EXPECT_EQ(read_bytes(p), want);
}

TEST(Safetensors, WriterKeepsTheAddedOrderWhenAligned) {
  TempDir dir;
  std::mt19937 rng(3);
  SafetensorsWriter w;
  ASSERT_TRUE(w.add("z", random_tensor(DType::kF32, {4}, rng)).ok());
  ASSERT_TRUE(w.add("a", random_tensor(DType::kBF16, {4}, rng)).ok());
  ASSERT_TRUE(w.add("m", random_tensor(DType::kU8, {3}, rng)).ok());
  ASSERT_TRUE(w.add("b", random_tensor(DType::kU8, {5}, rng)).ok());
  std::string p = dir.file("o.safetensors");
  ASSERT_TRUE(w.write(p).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->info("z")->begin, 0u);
  EXPECT_EQ((*f)->info("a")->begin, 16u);
  EXPECT_EQ((*f)->info("m")->begin, 24u);
  EXPECT_EQ((*f)->info("b")->begin, 27u);
  // A u8 [3] first would misalign what follows: larger elements move ahead, in added order.
  SafetensorsWriter w2;
  ASSERT_TRUE(w2.add("m", random_tensor(DType::kU8, {3}, rng)).ok());
  ASSERT_TRUE(w2.add("h", random_tensor(DType::kF16, {1}, rng)).ok());
  ASSERT_TRUE(w2.add("z", random_tensor(DType::kF32, {1}, rng)).ok());
  ASSERT_TRUE(w2.add("y", random_tensor(DType::kF32, {1}, rng)).ok());
  ASSERT_TRUE(w2.write(p).ok());
  f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->info("z")->begin, 0u);
  EXPECT_EQ((*f)->info("y")->begin, 4u);
  EXPECT_EQ((*f)->info("h")->begin, 8u);
  EXPECT_EQ((*f)->info("m")->begin, 10u);
}

TEST(Safetensors, RoundTripSharded) {
  TempDir dir;
  std::mt19937 rng(5);
  auto tensors = all_dtype_tensors(rng);
  SafetensorsWriter w;
  uint64_t total = 0;
  for (auto& [n, t] : tensors) {
    ASSERT_TRUE(w.add(n, t).ok());
    total += t.nbytes();
  }
  ASSERT_TRUE(w.write_sharded(dir.path().string(), "model", 200).ok());
  // 200-byte shards: the 612-byte f32 tensor gets one of its own.
  std::string idx_text = read_bytes(dir.file("model.safetensors.index.json"));
  ASSERT_FALSE(idx_text.empty());
  EXPECT_NE(idx_text.find(fmt::format("\"total_size\": {}", total)), std::string::npos) << idx_text;
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors")));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    std::string fn = e.path().filename().string();
    if (fn.rfind("model-", 0) == 0) {
      ++shards;
      EXPECT_NE(fn.find("-of-"), std::string::npos);
      auto f = SafetensorsFile::open(e.path().string());
      ASSERT_TRUE(f.ok()) << f.status().message();
      if ((*f)->size() > 1) {
        EXPECT_LE((*f)->data_bytes(), 200u) << fn;
      }
    }
  }
  EXPECT_GE(shards, 3);
  EXPECT_TRUE(fs::exists(dir.file(safetensors_shard_name("model", 0, shards))));

  auto ck = Checkpoint::open(dir.path().string());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->layout(), CheckpointLayout::kHF);
  EXPECT_EQ(ck->size(), tensors.size());
  for (auto& [n, t] : tensors) {
    auto g = ck->get(n);
    ASSERT_TRUE(g.ok()) << n;
    expect_same(*g, t, n);
  }

  // Rewriting as one shard replaces the index by a single file.
  ASSERT_TRUE(w.write_sharded(dir.path().string(), "model", 1ull << 30).ok());
  EXPECT_TRUE(fs::exists(dir.file("model.safetensors")));
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors.index.json")));
  EXPECT_FALSE(w.write_sharded(dir.path().string(), "model", 0).ok());
}

TEST(Safetensors, MisalignedTensorIsCopiedNotMisread) {
  TempDir dir;
  // A header of odd length (not what our writer makes) leaves the f32 data misaligned.
  std::string header = R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  ASSERT_NE((8 + header.size()) % 4, 0u);
  const float v[3] = {1.0f, -0.5f, 3.0f};
  std::string data(12, '\0');
  std::memcpy(data.data(), v, 12);
  std::string p = dir.file("odd.safetensors");
  write_bytes(p, le64(header.size()) + header + data);
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().message();
  auto t = (*f)->get("x");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data()) % alignof(float), 0u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(t->as<float>()[i], v[i]);
}

}  // namespace
}  // namespace ml4
