// The Mistral-native and HF layouts of one checkpoint load to identical weights and give
// identical logits (MODEL.md section 6: the oracles read HF, ml4 reads both), and every
// weight format runs the whole model.
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include "model/config_loader.h"
#include "model/model_weights.h"
#include "kv/cache_spec.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "model/weight_names.h"
#include "runtime/test_models.h"

namespace ml4 {
namespace {

using testing::load_runner;
using testing::rel_l2;
using testing::seq_step;
using testing::test_model;

std::vector<int32_t> prompt(int n, int vocab) {
  std::mt19937 rng(99);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng() % vocab);
  return v;
}

void expect_same_linear(const LinearWeight& a, const LinearWeight& b) {
  ASSERT_EQ(a.out_features, b.out_features) << a.name;
  ASSERT_EQ(a.in_features, b.in_features) << a.name;
  EXPECT_EQ(dequantize_linear(a), dequantize_linear(b)) << a.name << " vs " << b.name;
}

class Layouts : public ::testing::TestWithParam<std::string> {};

TEST_P(Layouts, NativeAndHfLoadIdentically) {
  const std::string dir = test_model(GetParam(), 3, "bf16", "both");
  auto cn = load_model_config(dir);
  auto ch = load_model_config(dir + "/hf");
  ASSERT_TRUE(cn.ok()) << cn.status().message();
  ASSERT_TRUE(ch.ok()) << ch.status().message();
  auto kn = Checkpoint::open(dir);
  auto kh = Checkpoint::open(dir + "/hf");
  ASSERT_TRUE(kn.ok() && kh.ok());
  auto wn = load_model_weights(*cn, *kn);
  auto wh = load_model_weights(*ch, *kh);
  ASSERT_TRUE(wn.ok()) << wn.status().message();
  ASSERT_TRUE(wh.ok()) << wh.status().message();
  const ModelWeights& A = **wn;
  const ModelWeights& B = **wh;
  ASSERT_EQ(A.layers.size(), B.layers.size());
  expect_same_linear(A.output, B.output);
  EXPECT_EQ(A.norm, B.norm);
  for (size_t l = 0; l < A.layers.size(); ++l) {
    const auto& a = A.layers[l];
    const auto& b = B.layers[l];
    EXPECT_EQ(a.attention_norm, b.attention_norm);
    EXPECT_EQ(a.ffn_norm, b.ffn_norm);
    expect_same_linear(a.attn.wkv_b, b.attn.wkv_b);
    expect_same_linear(a.attn.wo, b.attn.wo);
    if (a.attn.wkv_a.out_features > 0) expect_same_linear(a.attn.wkv_a, b.attn.wkv_a);
    if (a.attn.wq.out_features > 0) expect_same_linear(a.attn.wq, b.attn.wq);
    if (a.attn.wq_b.out_features > 0) expect_same_linear(a.attn.wq_b, b.attn.wq_b);
    ASSERT_EQ(a.ffn.experts.size(), b.ffn.experts.size());
    for (size_t e = 0; e < a.ffn.experts.size(); ++e) {
      expect_same_linear(a.ffn.experts[e].w1, b.ffn.experts[e].w1);
      expect_same_linear(a.ffn.experts[e].w2, b.ffn.experts[e].w2);
      expect_same_linear(a.ffn.experts[e].w3, b.ffn.experts[e].w3);
    }
    EXPECT_EQ(a.ffn.correction_bias, b.ffn.correction_bias);
  }
  // And the whole forward agrees bit for bit.
  auto rn = load_runner(dir, "bf16");
  auto rh = load_runner(dir + "/hf", "bf16");
  ASSERT_TRUE(rn && rh);
  auto p = prompt(23, rn->config().vocab_size);
  auto on = rn->execute(StepInput{{seq_step(*rn, 1, p, 0, 0, 1, 23)}});
  auto oh = rh->execute(StepInput{{seq_step(*rh, 1, p, 0, 0, 1, 23)}});
  ASSERT_TRUE(on.ok() && oh.ok());
  EXPECT_EQ(on->logits[0], oh->logits[0]);
}

INSTANTIATE_TEST_SUITE_P(Presets, Layouts, ::testing::Values("mistral4-tiny", "dsv32-tiny"));

// Every weight format runs the whole model, and its decode inside the kernels is exact:
// the quantized model's logits equal those of the same model with every weight first
// dequantized to f32 (dequantize_linear, checked bit-exact against an f64 decode in
// tests/model/quant_test.cpp). Both runs read identical f32 weight values, so they differ
// only by the kernels' summation order and the single f32 rounding of each decoded
// product (NVFP4 forms scale*global first): 1e-5 relative covers that through 12 layers.
LinearWeight to_f32_linear(const LinearWeight& w) {
  if (w.out_features == 0) return w;
  std::vector<float> v = dequantize_linear(w);
  Tensor t(DType::kF32, {w.out_features, w.in_features});
  std::copy(v.begin(), v.end(), t.mutable_as<float>());
  LinearWeight o;
  o.name = w.name;
  o.format = LinearFormat::kF32;
  o.out_features = w.out_features;
  o.in_features = w.in_features;
  o.weight = t;
  return o;
}

MlpWeights to_f32_mlp(const MlpWeights& m) { return {to_f32_linear(m.w1), to_f32_linear(m.w2), to_f32_linear(m.w3)}; }

std::shared_ptr<const ModelWeights> dequantized_copy(const ModelWeights& W) {
  auto o = std::make_shared<ModelWeights>();
  o->tok_embeddings = W.tok_embeddings;
  o->norm = W.norm;
  o->output = to_f32_linear(W.output);
  o->layers.resize(W.layers.size());
  for (size_t l = 0; l < W.layers.size(); ++l) {
    const auto& a = W.layers[l];
    auto& b = o->layers[l];
    b.attention_norm = a.attention_norm;
    b.ffn_norm = a.ffn_norm;
    b.attn.wq = to_f32_linear(a.attn.wq);
    b.attn.wq_a = to_f32_linear(a.attn.wq_a);
    b.attn.wq_b = to_f32_linear(a.attn.wq_b);
    b.attn.q_a_norm = a.attn.q_a_norm;
    b.attn.wkv_a = to_f32_linear(a.attn.wkv_a);
    b.attn.kv_a_norm = a.attn.kv_a_norm;
    b.attn.wkv_b = to_f32_linear(a.attn.wkv_b);
    b.attn.wo = to_f32_linear(a.attn.wo);
    b.attn.ssmax_s = a.attn.ssmax_s;
    if (a.attn.indexer) {
      auto I = std::make_unique<IndexerWeights>();
      I->wq = to_f32_linear(a.attn.indexer->wq);
      I->wk = to_f32_linear(a.attn.indexer->wk);
      I->k_norm_weight = a.attn.indexer->k_norm_weight;
      I->k_norm_bias = a.attn.indexer->k_norm_bias;
      I->weights_proj = to_f32_linear(a.attn.indexer->weights_proj);
      b.attn.indexer = std::move(I);
    }
    b.ffn.dense = to_f32_mlp(a.ffn.dense);
    b.ffn.gate = to_f32_linear(a.ffn.gate);
    b.ffn.correction_bias = a.ffn.correction_bias;
    for (const auto& e : a.ffn.experts) b.ffn.experts.push_back(to_f32_mlp(e));
    if (a.ffn.shared) b.ffn.shared = std::make_unique<MlpWeights>(to_f32_mlp(*a.ffn.shared));
  }
  return o;
}

class Formats : public ::testing::TestWithParam<std::string> {};

TEST_P(Formats, KernelsDecodeExactly) {
  const std::string dir = test_model("ml4-tiny", 5, GetParam(), "native");
  auto cfg = load_model_config(dir);
  auto ck = Checkpoint::open(dir);
  ASSERT_TRUE(cfg.ok() && ck.ok());
  auto w = load_model_weights(*cfg, *ck);
  ASSERT_TRUE(w.ok()) << w.status().message();
  // The format really is quantized where the config says so.
  const auto& experts = (*w)->layers.back().ffn.experts;
  ASSERT_FALSE(experts.empty());
  const LinearFormat want = GetParam() == "fp8" ? LinearFormat::kFP8Block
                            : GetParam() == "nvfp4" ? LinearFormat::kNVFP4 : LinearFormat::kMXFP4;
  EXPECT_EQ(experts[0].w1.format, want);
  EXPECT_EQ((*w)->layers[0].attn.wo.format, LinearFormat::kFP8Block);
  RunnerOptions ro;
  ro.kv_cache_dtype = "bf16";
  ro.kv_cache_bytes = 16 << 20;
  auto quant = CpuRunner::create(*cfg, *w, ro);
  auto f32 = CpuRunner::create(*cfg, dequantized_copy(**w), ro);
  ASSERT_TRUE(quant.ok() && f32.ok());
  StepInput in;
  in.seqs.push_back(seq_step(**quant, 1, prompt(30, cfg->vocab_size), 0, 0, 1, 30));
  // The quantized kernels fold each 128-block's scale into the sum (linear_kernels.h) where
  // the f32 copy multiplies every weight first: the same products up to f32 rounding, in
  // another order. A near-tie in the router or the indexer may then pick differently, which
  // moves the logits by far more than the arithmetic does, so the f32 runner is given the
  // quantized runner's decisions (ForwardTrace). What remains is f32 rounding (~1e-7 per
  // product) and what it does to the bf16 KV cache: a latent that moves by 1e-7 crosses a
  // bf16 rounding boundary with probability ~1e-7 / 2^-8, i.e. a few of the ~10^5 cached
  // values here flip by one bf16 step (2^-8 relative), which moves the logits by ~1e-4
  // (measured 2e-4 to 3e-4). A wrongly decoded block moves them by 1e-2 or more: bound 2e-3.
  ForwardTrace ta;
  auto oa = (*quant)->execute_traced(in, &ta);
  ASSERT_TRUE(oa.ok());
  ForwardTrace tb;
  tb.forced_topk = ta.topk;
  tb.forced_experts = ta.experts;
  auto ob = (*f32)->execute_traced(in, &tb);
  ASSERT_TRUE(ob.ok()) << ob.status().message();
  const std::vector<float>& a = oa->logits[0];
  const std::vector<float>& b = ob->logits[0];
  EXPECT_LT(rel_l2(a, b), 2e-3) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(WeightFormats, Formats, ::testing::Values("fp8", "nvfp4", "mxfp4"));

// FP8 experts re-quantized to MXFP4 at load: every routed expert becomes MXFP4 with the
// bytes requantize_fp8_to_mxfp4 gives (its error bound is tested in quant_test.cpp), the
// rest stays FP8, and the model runs.
TEST(Formats, Fp8ExpertsRequantizedToMxfp4AtLoad) {
  const std::string dir = test_model("ml4-tiny", 5, "fp8", "native");
  auto cfg = load_model_config(dir);
  auto ck = Checkpoint::open(dir);
  ASSERT_TRUE(cfg.ok() && ck.ok());
  auto fp8 = load_model_weights(*cfg, *ck);
  WeightLoadOptions wo;
  wo.experts_to_mxfp4 = true;
  auto mx = load_model_weights(*cfg, *ck, wo);
  ASSERT_TRUE(fp8.ok() && mx.ok()) << mx.status().message();
  int experts = 0;
  for (size_t l = 0; l < (*mx)->layers.size(); ++l) {
    const auto& a = (*fp8)->layers[l].ffn;
    const auto& b = (*mx)->layers[l].ffn;
    for (size_t e = 0; e < b.experts.size(); ++e, ++experts) {
      ASSERT_EQ(b.experts[e].w1.format, LinearFormat::kMXFP4);
      auto want = requantize_fp8_to_mxfp4(a.experts[e].w2);
      ASSERT_TRUE(want.ok());
      EXPECT_EQ(dequantize_linear(b.experts[e].w2), dequantize_linear(*want));
    }
    if (b.shared) {
      EXPECT_EQ(b.shared->w1.format, LinearFormat::kFP8Block);
    }
  }
  EXPECT_GT(experts, 0);
  RunnerOptions ro;
  ro.kv_cache_dtype = "bf16";
  ro.kv_cache_bytes = 16 << 20;
  ro.experts_to_mxfp4 = true;
  auto r = CpuRunner::load(dir, ro);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto out = (*r)->execute(StepInput{{seq_step(**r, 1, prompt(20, cfg->vocab_size), 0, 0, 1, 1)}});
  ASSERT_TRUE(out.ok());
  for (float v : out->logits[0]) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace ml4

namespace ml4 {
namespace {

// An HF checkpoint stored with `rope_interleave: false` (rotate_half row order) loads to the
// same model: the test writes one from the native weights by permuting the rope rows of
// wq/wq_b and wkv_a_with_mqa, and the logits must equal the native model's bit for bit (the
// loader moves the bf16 rows back, so the same kernels run on the same bytes).
TEST(Layouts, HfRotateHalfRopeOrderLoadsIdentically) {
  const std::string dir = test_model("mistral4-tiny", 3, "bf16", "both");
  const std::string out = dir + "-rotate-half";
  std::filesystem::create_directories(out);
  auto cfg = load_model_config(dir + "/hf");
  ASSERT_TRUE(cfg.ok());
  const int dn = cfg->qk_nope_head_dim, dr = cfg->qk_rope_head_dim, r = cfg->kv_lora_rank;
  const std::vector<int> perm = hf_rope_row_permutation(dr, false);
  auto ck = Checkpoint::open(dir + "/hf");
  ASSERT_TRUE(ck.ok());
  SafetensorsWriter w;
  for (const auto& name : ck->names()) {
    Tensor t = ck->get(name).value();
    int64_t group = 0, offset = 0;
    if (name.find("q_b_proj.weight") != std::string::npos || name.find("q_proj.weight") != std::string::npos) {
      group = dn + dr;
      offset = dn;
    } else if (name.find("kv_a_proj_with_mqa.weight") != std::string::npos) {
      group = r + dr;
      offset = r;
    }
    if (group == 0) {
      ASSERT_TRUE(w.add(name, t).ok());
      continue;
    }
    ASSERT_EQ(t.dtype(), DType::kBF16) << name;
    Tensor c(DType::kBF16, t.shape());
    const int64_t K = t.dim(1);
    const uint16_t* src = t.as<uint16_t>();
    uint16_t* dst = c.mutable_as<uint16_t>();
    std::copy(src, src + t.numel(), dst);
    for (int64_t g = 0; g < t.dim(0) / group; ++g)
      for (int j = 0; j < dr; ++j)  // stored row j holds native row perm[j]
        std::copy_n(src + (g * group + offset + perm[j]) * K, K, dst + (g * group + offset + j) * K);
    ASSERT_TRUE(w.add(name, c).ok());
  }
  ASSERT_TRUE(w.write(out + "/model.safetensors").ok());
  {
    std::ifstream in(dir + "/hf/config.json");
    auto j = nlohmann::json::parse(in);
    j["rope_interleave"] = false;
    std::ofstream(out + "/config.json") << j.dump(2);
  }
  auto rn = load_runner(dir, "bf16");
  auto rh = load_runner(out, "bf16");
  ASSERT_TRUE(rn && rh);
  EXPECT_FALSE(rh->config().rope_interleave);
  auto p = prompt(29, rn->config().vocab_size);
  auto on = rn->execute(StepInput{{seq_step(*rn, 1, p, 0, 0, 1, 29)}});
  auto oh = rh->execute(StepInput{{seq_step(*rh, 1, p, 0, 0, 1, 29)}});
  ASSERT_TRUE(on.ok() && oh.ok());
  EXPECT_EQ(oh->logits[0], on->logits[0]);
  std::error_code ec;
  std::filesystem::remove_all(out, ec);
}

}  // namespace
}  // namespace ml4
