// `ml4 quantize` (model/quantize_checkpoint.h): a bf16 model re-stored as fp8 / nvfp4 /
// mxfp4 loads through the real loader with the target format on exactly the linears
// MODEL-FORMAT.md section 3 names, every quantized weight's bytes equal quantize_linear()
// of the exactly decoded source, everything else is copied byte for byte; bad requests fail
// with a message and write nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>
#include <string>

#include "model/checkpoint.h"
#include "model/config_loader.h"
#include "model/model_weights.h"
#include "model/quant.h"
#include "model/quantize_checkpoint.h"
#include "model/random_checkpoint.h"
#include "model/weight_names.h"
#include "temp_dir.h"

namespace ml4 {
namespace {

// Equal bytes and shape; packed FP4 and e8m0 scales are stored as safetensors U8, so a u8
// tensor read back equals an e2m1x2 / e8m0 one with the same bytes.
bool same_bytes(const Tensor& a, const Tensor& b) {
  auto storage = [](DType d) { return d == DType::kF4E2M1x2 || d == DType::kE8M0 ? DType::kU8 : d; };
  return storage(a.dtype()) == storage(b.dtype()) && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

// The 512-token tekken.json the repo ships for the tiny presets.
std::string tiny_tekken() { return read_text(std::string(ML4_SOURCE_DIR) + "/tests/golden/tokenizer/tekken_trained_v15_512.json"); }

void make_tiny(const std::string& dir, const std::string& preset, const std::string& layout,
               std::vector<std::string> overrides = {}) {
  MakeModelOptions m;
  m.preset = preset;
  m.out_dir = dir;
  m.seed = 5;
  m.layout = layout;
  m.overrides = std::move(overrides);
  m.tokenizer_json = tiny_tekken();
  ASSERT_FALSE(m.tokenizer_json.empty());
  Status s = make_model(m);
  ASSERT_TRUE(s.ok()) << s.message();
}

// quantize_checkpoint(o) is refused with a message containing `needle`, writing nothing.
void expect_refused(const QuantizeOptions& o, const std::string& needle) {
  auto r = quantize_checkpoint(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  EXPECT_FALSE(std::filesystem::exists(o.out_dir));
}

void check_quantized(const std::string& in, const std::string& out, WeightFormat want) {
  auto cfg = load_model_config(out);
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  EXPECT_EQ(cfg->weight_format, want);
  auto ck_in = Checkpoint::open(in).value();
  auto ck_out = Checkpoint::open(out).value();
  // The real loader accepts the result (names, shapes, dtypes, scales).
  auto weights = load_model_weights(cfg.value(), ck_out);
  ASSERT_TRUE(weights.ok()) << weights.status().message();
  int quantized = 0;
  for (const ExpectedTensor& t : expected_tensors(cfg.value(), ck_out.layout())) {
    SCOPED_TRACE(t.name);
    Tensor o = ck_out.get(t.name).value();
    Tensor i = ck_in.get(t.name).value();
    if (t.role != TensorRole::kLinear || t.format == LinearFormat::kBF16) {
      EXPECT_TRUE(same_bytes(o, i));
      continue;
    }
    // Source bf16 decoded exactly, quantized by the public recipe: the same bytes.
    const int64_t N = t.shape[0], K = t.shape[1];
    auto src = make_linear_weight(t.name, LinearFormat::kBF16, N, K, i).value();
    const std::vector<float> f = dequantize_linear(src);
    auto q = quantize_linear(f.data(), N, K, t.format, t.name).value();
    EXPECT_TRUE(same_bytes(o, q.weight)) << o.describe() << " vs " << q.weight.describe();
    ASSERT_FALSE(t.scales.empty());
    Tensor s = ck_out.get(t.scales[0].name).value();
    EXPECT_TRUE(same_bytes(s, q.scale));
    if (t.format == LinearFormat::kNVFP4) {
      EXPECT_EQ(ck_out.get(t.scales[1].name).value().as<float>()[0], q.global_scale);
    }
    ++quantized;
  }
  EXPECT_GT(quantized, 10);
  for (const char* f : {"tekken.json", "tokenizer.json", "tokenizer_config.json"})
    EXPECT_EQ(read_text((std::filesystem::path(out) / f).string()), read_text((std::filesystem::path(in) / f).string())) << f;
  EXPECT_EQ(read_text((std::filesystem::path(out) / "tekken.json").string()), tiny_tekken());
}

TEST(Quantize, Ml4TinyToEachFormat) {
  testing::TempDir tmp;
  const std::string in = tmp.file("bf16");
  make_tiny(in, "ml4-tiny", "native");
  const std::pair<const char*, WeightFormat> cases[] = {
      {"fp8", WeightFormat::kFP8Block}, {"nvfp4", WeightFormat::kNVFP4Experts}, {"mxfp4", WeightFormat::kMXFP4Experts}};
  for (const auto& [to, fmt] : cases) {
    SCOPED_TRACE(to);
    QuantizeOptions o{in, tmp.file(to), to};
    auto r = quantize_checkpoint(o);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_GT(r->quantized_linears, 10);
    EXPECT_LT(r->bytes_out, r->bytes_in);
    check_quantized(in, o.out_dir, fmt);
  }
}

// --to bf16 decodes an FP8 checkpoint back (the MPI tests split ml4-small's FP8 linears over TP
// this way): every FP8 linear becomes the bf16 rounding of its decode, scales are dropped, the
// bf16 / f32 tensors and the rest keep their bytes, and the result loads as a bf16 model.
TEST(Quantize, Fp8BackToBf16) {
  testing::TempDir tmp;
  make_tiny(tmp.file("bf16"), "ml4-tiny", "native");
  ASSERT_TRUE(quantize_checkpoint({tmp.file("bf16"), tmp.file("fp8"), "fp8"}).ok());
  auto r = quantize_checkpoint({tmp.file("fp8"), tmp.file("back"), "bf16"});
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_GT(r->quantized_linears, 10);
  auto fp8_cfg = load_model_config(tmp.file("fp8"));
  auto cfg = load_model_config(tmp.file("back"));
  ASSERT_TRUE(cfg.ok() && fp8_cfg.ok());
  EXPECT_EQ(cfg->weight_format, WeightFormat::kBF16);
  Checkpoint fp8 = Checkpoint::open(tmp.file("fp8")).value();
  Checkpoint back = Checkpoint::open(tmp.file("back")).value();
  std::map<std::string, ExpectedTensor> src;
  for (auto& t : expected_tensors(*fp8_cfg, fp8.layout())) src.emplace(t.name, t);
  int decoded = 0;
  for (const ExpectedTensor& t : expected_tensors(*cfg, back.layout())) {
    SCOPED_TRACE(t.name);
    Tensor o = back.get(t.name).value();
    Tensor i = fp8.get(t.name).value();
    const ExpectedTensor& s = src.at(t.name);
    if (t.role != TensorRole::kLinear || s.format == t.format) {
      EXPECT_TRUE(same_bytes(o, i));
      continue;
    }
    ASSERT_EQ(s.format, LinearFormat::kFP8Block);
    const int64_t N = t.shape[0], K = t.shape[1];
    Tensor sc = fp8.get(s.scales[0].name).value();
    const std::vector<float> f = dequantize_linear(make_linear_weight(t.name, LinearFormat::kFP8Block, N, K, i, sc).value());
    auto want = quantize_linear(f.data(), N, K, LinearFormat::kBF16, t.name).value();
    EXPECT_TRUE(same_bytes(o, want.weight));
    EXPECT_FALSE(back.contains(s.scales[0].name));
    ++decoded;
  }
  EXPECT_GT(decoded, 10);
  EXPECT_TRUE(load_model_weights(*cfg, back).ok());
}

// --output-tensor-type fp8 (llama-quantize's flag): `output` is stored FP8 128x128 with its
// scale, bytes equal to quantize_linear() of the bf16 head, the loader takes it as an FP8
// linear; quantizing that model back to bf16 decodes the head too (its stored dtype, not the
// recipe, says what it is); the HF layout is refused (transformers keeps lm_head bf16).
TEST(Quantize, Fp8OutputHead) {
  testing::TempDir tmp;
  const std::string in = tmp.file("bf16");
  make_tiny(in, "ml4-tiny", "native");
  QuantizeOptions o{in, tmp.file("fp8"), "fp8"};
  o.output_tensor_type = "fp8";
  auto r = quantize_checkpoint(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto cfg = load_model_config(o.out_dir).value();
  Checkpoint ck_in = Checkpoint::open(in).value(), ck = Checkpoint::open(o.out_dir).value();
  Tensor head = ck.get("output.weight").value();
  ASSERT_EQ(head.dtype(), DType::kF8E4M3);
  const int64_t V = cfg.vocab_size, D = cfg.dim;
  const std::vector<float> f =
      dequantize_linear(make_linear_weight("output.weight", LinearFormat::kBF16, V, D, ck_in.get("output.weight").value()).value());
  auto want = quantize_linear(f.data(), V, D, LinearFormat::kFP8Block, "output.weight").value();
  EXPECT_TRUE(same_bytes(head, want.weight));
  EXPECT_TRUE(same_bytes(ck.get("output.weight_scale_inv").value(), want.scale));
  auto weights = load_model_weights(cfg, ck);
  ASSERT_TRUE(weights.ok()) << weights.status().message();
  EXPECT_EQ((*weights)->output.format, LinearFormat::kFP8Block);

  auto back = quantize_checkpoint({o.out_dir, tmp.file("back"), "bf16"});
  ASSERT_TRUE(back.ok()) << back.status().message();
  Checkpoint ckb = Checkpoint::open(tmp.file("back")).value();
  auto want_bf16 = quantize_linear(dequantize_linear(want).data(), V, D, LinearFormat::kBF16, "output.weight").value();
  EXPECT_TRUE(same_bytes(ckb.get("output.weight").value(), want_bf16.weight));
  EXPECT_FALSE(ckb.contains("output.weight_scale_inv"));
  EXPECT_TRUE(load_model_weights(load_model_config(tmp.file("back")).value(), ckb).ok());

  make_tiny(tmp.file("hf"), "dsv32-tiny", "hf");
  QuantizeOptions h{tmp.file("hf"), tmp.file("hf-fp8"), "fp8"};
  h.output_tensor_type = "fp8";
  expect_refused(h, "lm_head");
  h.output_tensor_type = "int8";
  EXPECT_FALSE(quantize_checkpoint(h).ok());
}

// A model whose head is tok_embeddings (tied_embeddings) has no output to store: refused.
TEST(Quantize, OutputTensorTypeNeedsAnOutputTensor) {
  testing::TempDir tmp;
  make_tiny(tmp.file("tied"), "ml4-tiny", "native", {"tied_embeddings=true"});
  QuantizeOptions o{tmp.file("tied"), tmp.file("out"), "fp8"};
  o.output_tensor_type = "fp8";
  expect_refused(o, "tied_embeddings");
}

// The HF layout of a per-expert model type (deepseek_v32) quantizes too; fused mistral4
// experts are refused with a message that says what to do.
TEST(Quantize, HfLayouts) {
  testing::TempDir tmp;
  make_tiny(tmp.file("dsv32"), "dsv32-tiny", "hf");
  QuantizeOptions o{tmp.file("dsv32"), tmp.file("dsv32-fp8"), "fp8"};
  auto r = quantize_checkpoint(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  check_quantized(o.in_dir, o.out_dir, WeightFormat::kFP8Block);

  make_tiny(tmp.file("m4"), "mistral4-tiny", "hf");
  expect_refused({tmp.file("m4"), tmp.file("m4-fp8"), "fp8"}, "native layout");
}

TEST(Quantize, BadRequestsWriteNothing) {
  testing::TempDir tmp;
  const std::string in = tmp.file("bf16");
  make_tiny(in, "ml4-tiny", "native");
  auto msg = [](const Result<QuantizeReport>& r) { return r.ok() ? std::string("ok") : r.status().message(); };
  EXPECT_NE(msg(quantize_checkpoint({in, tmp.file("x"), "int4"})).find("--to must be"), std::string::npos);
  EXPECT_NE(msg(quantize_checkpoint({in, in, "fp8"})).find("input directory"), std::string::npos);
  EXPECT_NE(msg(quantize_checkpoint({tmp.file("nope"), tmp.file("y"), "fp8"})).find("nope"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(tmp.file("x")));
  EXPECT_FALSE(std::filesystem::exists(tmp.file("y")));
  ASSERT_TRUE(quantize_checkpoint({in, tmp.file("fp8"), "fp8"}).ok());
  EXPECT_NE(msg(quantize_checkpoint({in, tmp.file("fp8"), "fp8"})).find("already holds a model"), std::string::npos);
}

}  // namespace
}  // namespace ml4
