// Config loaders and presets against MODEL.md's counts, a real DeepSeek-V3.2 config.json,
// round trips through both writers, and one rejected config per validation rule.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/config_loader.h"
#include "model/presets.h"
#include "model/weight_names.h"

namespace ml4 {
namespace {

using json = nlohmann::json;

ModelConfig preset(const std::string& name) {
  auto r = preset_config(name);
  EXPECT_TRUE(r.ok()) << name << ": " << r.status().message();
  return r.ok() ? r.value() : ModelConfig{};
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.tied_embeddings, b.tied_embeddings);
  EXPECT_EQ(a.q_lora_rank, b.q_lora_rank);
  EXPECT_EQ(a.kv_lora_rank, b.kv_lora_rank);
  EXPECT_EQ(a.qk_nope_head_dim, b.qk_nope_head_dim);
  EXPECT_EQ(a.qk_rope_head_dim, b.qk_rope_head_dim);
  EXPECT_EQ(a.v_head_dim, b.v_head_dim);
  EXPECT_EQ(a.hidden_dim, b.hidden_dim);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_interleave, b.rope_interleave);
  EXPECT_EQ(a.yarn.enabled, b.yarn.enabled);
  if (a.yarn.enabled) {
    EXPECT_EQ(a.yarn.factor, b.yarn.factor);
    EXPECT_EQ(a.yarn.original_max_position_embeddings, b.yarn.original_max_position_embeddings);
    EXPECT_EQ(a.yarn.beta_fast, b.yarn.beta_fast);
    EXPECT_EQ(a.yarn.beta_slow, b.yarn.beta_slow);
    EXPECT_DOUBLE_EQ(a.yarn.mscale, b.yarn.mscale);
    EXPECT_EQ(a.yarn.mscale_all_dim, b.yarn.mscale_all_dim);
    EXPECT_EQ(a.yarn.apply_scale, b.yarn.apply_scale);
  }
  EXPECT_EQ(a.llama4_scaling.enabled, b.llama4_scaling.enabled);
  if (a.llama4_scaling.enabled) {
    EXPECT_EQ(a.llama4_scaling.original_max_position_embeddings, b.llama4_scaling.original_max_position_embeddings);
    EXPECT_EQ(a.llama4_scaling.beta, b.llama4_scaling.beta);
  }
  EXPECT_EQ(a.lerope.enabled, b.lerope.enabled);
  EXPECT_EQ(a.lerope.window, b.lerope.window);
  EXPECT_EQ(a.lerope.leak, b.lerope.leak);
  const auto &m = a.moe, &n = b.moe;
  EXPECT_EQ(m.num_experts, n.num_experts);
  EXPECT_EQ(m.num_experts_per_tok, n.num_experts_per_tok);
  EXPECT_EQ(m.expert_hidden_dim, n.expert_hidden_dim);
  EXPECT_EQ(m.first_k_dense_replace, n.first_k_dense_replace);
  EXPECT_EQ(m.num_shared_experts, n.num_shared_experts);
  EXPECT_EQ(m.routed_scale, n.routed_scale);
  EXPECT_EQ(m.num_expert_groups, n.num_expert_groups);
  EXPECT_EQ(m.num_expert_groups_per_tok, n.num_expert_groups_per_tok);
  EXPECT_EQ(m.scoring, n.scoring);
  EXPECT_EQ(m.renormalize, n.renormalize);
  EXPECT_EQ(m.has_correction_bias, n.has_correction_bias);
  EXPECT_EQ(a.indexer.n_heads, b.indexer.n_heads);
  if (a.has_dsa()) {
    EXPECT_EQ(a.indexer.head_dim, b.indexer.head_dim);
    EXPECT_EQ(a.indexer.rope_head_dim, b.indexer.rope_head_dim);
    EXPECT_EQ(a.indexer.topk, b.indexer.topk);
  }
  EXPECT_EQ(a.drafter.enabled, b.drafter.enabled);
  EXPECT_EQ(a.drafter.n_layers, b.drafter.n_layers);
  EXPECT_EQ(a.drafter.block_size, b.drafter.block_size);
  EXPECT_EQ(a.drafter.target_layers, b.drafter.target_layers);
  EXPECT_EQ(a.drafter.window, b.drafter.window);
  EXPECT_EQ(a.drafter.rnn_rank, b.drafter.rnn_rank);
  EXPECT_EQ(a.weight_format, b.weight_format);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const auto &x = a.layers[i], &y = b.layers[i];
    EXPECT_EQ(x.index, y.index);
    EXPECT_EQ(x.rope, y.rope) << i;
    EXPECT_EQ(x.ssmax, y.ssmax) << i;
    EXPECT_EQ(x.kv_source, y.kv_source) << i;
    EXPECT_EQ(x.indexer, y.indexer) << i;
    EXPECT_EQ(x.indexer_source, y.indexer_source) << i;
    EXPECT_EQ(x.ffn, y.ffn) << i;
    EXPECT_EQ(x.latent_slot, y.latent_slot) << i;
    EXPECT_EQ(x.indexer_slot, y.indexer_slot) << i;
  }
}

TEST(Presets, Ml4ResolvesToModelMdCounts) {
  ModelConfig c = preset("ml4");
  ASSERT_EQ(c.n_layers, 72);
  EXPECT_EQ(c.dim, 6144);
  EXPECT_EQ(c.n_heads, 64);
  EXPECT_EQ(c.vocab_size, 131072);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.indexer.n_heads, 32);
  EXPECT_EQ(c.indexer.head_dim, 128);
  EXPECT_EQ(c.indexer.topk, 2048);
  EXPECT_EQ(c.num_latent_layers(), 63);
  EXPECT_EQ(c.num_indexer_layers(), 44);

  std::vector<int> consumers, nope, reusers;
  int moe = 0;
  int latent_slot = 0, indexer_slot = 0;
  for (const auto& l : c.layers) {
    if (!l.owns_kv()) {
      consumers.push_back(l.index);
      EXPECT_EQ(l.kv_source, 35) << l.index;
      EXPECT_EQ(l.latent_slot, -1);
    } else {
      EXPECT_EQ(l.latent_slot, latent_slot++);
    }
    if (!l.rope) nope.push_back(l.index);
    EXPECT_EQ(l.ssmax, !l.rope) << l.index;  // preset choice: SSMax on NoPE layers
    if (l.indexer == IndexerRole::kReuser) {
      reusers.push_back(l.index);
      // Nearest preceding owner.
      int owner = l.index - 1;
      while (owner >= 0 && c.layers[owner].indexer != IndexerRole::kOwner) --owner;
      EXPECT_EQ(l.indexer_source, owner) << l.index;
      EXPECT_EQ(l.indexer_slot, -1);
    } else {
      ASSERT_EQ(l.indexer, IndexerRole::kOwner) << l.index;
      EXPECT_EQ(l.indexer_slot, indexer_slot++);
    }
    moe += l.ffn == FfnKind::kMoe;
  }
  std::vector<int> want_consumers, want_nope;
  for (int l = 39; l <= 71; l += 4) want_consumers.push_back(l);
  for (int l = 3; l <= 71; l += 4) want_nope.push_back(l);
  EXPECT_EQ(consumers, want_consumers);
  EXPECT_EQ(nope, want_nope);
  EXPECT_EQ(reusers.size(), 28u);
  EXPECT_EQ(c.layers[0].indexer, IndexerRole::kOwner);
  EXPECT_EQ(c.layers[0].ffn, FfnKind::kDense);
  EXPECT_EQ(moe, 71);
  EXPECT_EQ(c.moe.num_experts, 128);
  EXPECT_EQ(c.moe.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe.num_shared_experts, 1);
  EXPECT_EQ(c.moe.expert_hidden_dim, 5632);
  EXPECT_EQ(c.hidden_dim, 16384);
  // MODEL.md section 1: KV bytes per token with fp8_ds_mla = 63 x 656 + 44 x 132.
  EXPECT_EQ(c.num_latent_layers() * 656 + c.num_indexer_layers() * 132, 47136);
  EXPECT_TRUE(c.yarn.enabled);
  EXPECT_EQ(c.yarn.factor, 128.0);
  EXPECT_EQ(c.yarn.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c.llama4_scaling.enabled);
  EXPECT_EQ(c.llama4_scaling.beta, 0.1);
  EXPECT_TRUE(c.lerope.enabled);
  EXPECT_TRUE(c.drafter.enabled);
  EXPECT_EQ(c.drafter.n_layers, 3);
  EXPECT_EQ(c.drafter.target_layers, (std::vector<int>{1, 18, 36, 54, 71}));
  EXPECT_EQ(c.weight_format, WeightFormat::kFP8Block);
}

TEST(Presets, SlicesKeepOnlyFeaturesInside) {
  ModelConfig s40 = preset("ml4-slice-40");
  ASSERT_EQ(s40.n_layers, 40);
  EXPECT_EQ(s40.dim, 6144);
  EXPECT_EQ(s40.moe.num_experts, 128);
  int consumers = 0;
  for (const auto& l : s40.layers) consumers += !l.owns_kv();
  EXPECT_EQ(consumers, 1);  // only 39 reads 35
  EXPECT_EQ(s40.layers[39].kv_source, 35);
  EXPECT_EQ(s40.drafter.target_layers, (std::vector<int>{1, 18, 36}));

  ModelConfig s1 = preset("ml4-slice-1");
  ASSERT_EQ(s1.n_layers, 1);
  EXPECT_EQ(s1.layers[0].ffn, FfnKind::kDense);
  EXPECT_TRUE(s1.layers[0].owns_kv());
  EXPECT_FALSE(s1.drafter.enabled);  // no target layer inside

  // The first layers of a slice are exactly the full model's.
  ModelConfig full = preset("ml4");
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(s40.layers[i].rope, full.layers[i].rope);
    EXPECT_EQ(s40.layers[i].indexer, full.layers[i].indexer);
    EXPECT_EQ(s40.layers[i].indexer_source, full.layers[i].indexer_source);
    EXPECT_EQ(s40.layers[i].kv_source, full.layers[i].kv_source);
  }
  expect_same(preset("ml4-slice-72"), full);

  for (const char* bad : {"ml4-slice-0", "ml4-slice-73", "ml4-slice-", "ml4-slice-x", "ml4-slice-4b", "nope"}) {
    auto r = preset_config(bad);
    EXPECT_FALSE(r.ok()) << bad;
  }
  EXPECT_NE(preset_config("ml4-slice-73").status().message().find("[1, 72]"), std::string::npos);
  EXPECT_NE(preset_config("gpt").status().message().find("unknown preset"), std::string::npos);
}

TEST(Presets, TinyPresetsHaveTheirFeatures) {
  ModelConfig t = preset("ml4-tiny");
  EXPECT_EQ(t.vocab_size, 512);
  EXPECT_EQ(t.kv_lora_rank % 128, 0);
  EXPECT_EQ(t.indexer.topk, 16);
  int consumers = 0, reusers = 0, nope = 0, ssmax = 0, moe = 0;
  for (const auto& l : t.layers) {
    consumers += !l.owns_kv();
    reusers += l.indexer == IndexerRole::kReuser;
    nope += !l.rope;
    ssmax += l.ssmax;
    moe += l.ffn == FfnKind::kMoe;
  }
  EXPECT_GE(consumers, 2);
  EXPECT_GE(reusers, 1);
  EXPECT_GE(nope, 1);
  EXPECT_GE(ssmax, 1);
  EXPECT_EQ(t.layers[0].ffn, FfnKind::kDense);
  EXPECT_GE(moe, 1);
  EXPECT_GT(t.yarn.factor, 1.0);
  EXPECT_TRUE(t.lerope.enabled);
  EXPECT_EQ(t.lerope.window, 24);
  EXPECT_EQ(t.llama4_scaling.original_max_position_embeddings, 32);
  EXPECT_GT(t.moe.num_expert_groups, 1);
  EXPECT_TRUE(t.drafter.enabled);
  EXPECT_EQ(t.max_position_embeddings, 4096);

  ModelConfig m = preset("mistral4-tiny");
  EXPECT_EQ(m.hf_model_type, "mistral4");
  EXPECT_EQ(m.layout, CheckpointLayout::kHF);
  EXPECT_GT(m.q_lora_rank, 0);  // Mistral4Config has a query LoRA (q_lora_rank 1024 by default)
  EXPECT_FALSE(m.has_dsa());
  EXPECT_EQ(m.moe.scoring, RouterScoring::kSoftmax);
  EXPECT_FALSE(m.moe.has_correction_bias);
  EXPECT_TRUE(m.llama4_scaling.enabled);
  EXPECT_EQ(m.llama4_scaling.original_max_position_embeddings, m.yarn.original_max_position_embeddings);
  EXPECT_TRUE(check_hf_representable(m, "mistral4").ok()) << check_hf_representable(m, "mistral4").message();

  ModelConfig d = preset("dsv32-tiny");
  EXPECT_EQ(d.hf_model_type, "deepseek_v32");
  EXPECT_TRUE(d.has_dsa());
  EXPECT_EQ(d.num_indexer_layers(), d.n_layers);
  EXPECT_EQ(d.indexer.rope_head_dim, d.qk_rope_head_dim);
  EXPECT_EQ(d.moe.scoring, RouterScoring::kSigmoid);
  EXPECT_TRUE(d.moe.has_correction_bias);
  EXPECT_GT(d.moe.num_expert_groups, 1);
  EXPECT_TRUE(check_hf_representable(d, "deepseek_v32").ok()) << check_hf_representable(d, "deepseek_v32").message();

  EXPECT_EQ(preset_names().size(), 5u);
}

TEST(ConfigLoader, ParamsJsonRoundTrip) {
  for (const char* name : {"ml4", "ml4-tiny", "ml4-slice-40", "ml4-slice-3"}) {
    SCOPED_TRACE(name);
    ModelConfig a = preset(name);
    std::string text = params_json_from_config(a);
    auto b = parse_params_json(text);
    ASSERT_TRUE(b.ok()) << b.status().message();
    expect_same(a, b.value());
    EXPECT_EQ(params_json_from_config(b.value()), text);
  }
  // Lists that are not an interval pattern, a per-layer dense list, DeepSeek routing and
  // FP4 experts survive the native writer too.
  ModelConfig d = preset("dsv32-tiny");
  d.layers[2].ffn = FfnKind::kDense;
  d.weight_format = WeightFormat::kNVFP4Experts;
  ASSERT_TRUE(validate_model_config(d).ok());
  auto back = parse_params_json(params_json_from_config(d));
  ASSERT_TRUE(back.ok()) << back.status().message();
  expect_same(d, back.value());
}

TEST(ConfigLoader, HfConfigRoundTrip) {
  for (const auto& [name, type] : std::vector<std::pair<std::string, std::string>>{
           {"mistral4-tiny", "mistral4"}, {"dsv32-tiny", "deepseek_v32"}}) {
    SCOPED_TRACE(name);
    ModelConfig a = preset(name);
    auto b = parse_hf_config_json(hf_config_json_from_config(a, type));
    ASSERT_TRUE(b.ok()) << b.status().message();
    expect_same(a, b.value());
    EXPECT_EQ(b->hf_model_type, type);
  }
  // A config.json from the native mistral4-shaped params is the same model.
  ModelConfig m = preset("mistral4-tiny");
  auto native = parse_params_json(params_json_from_config(m));
  ASSERT_TRUE(native.ok()) << native.status().message();
  expect_same(m, native.value());

  // A dense-only model survives the HF writer's "n_routed_experts 1, all layers dense".
  ModelConfig dense = preset("mistral4-tiny");
  dense.moe = MoeConfig{};
  for (auto& l : dense.layers) l.ffn = FfnKind::kDense;
  ASSERT_TRUE(validate_model_config(dense).ok());
  auto dense_back = parse_hf_config_json(hf_config_json_from_config(dense, "mistral4"));
  ASSERT_TRUE(dense_back.ok()) << dense_back.status().message();
  expect_same(dense, dense_back.value());

  // deepseek_v3 (no indexer): drop the indexer from dsv32-tiny.
  ModelConfig v3 = preset("dsv32-tiny");
  v3.indexer.n_heads = 0;
  for (auto& l : v3.layers) {
    l.indexer = IndexerRole::kNone;
    l.indexer_source = -1;
    l.indexer_slot = -1;
  }
  ASSERT_TRUE(validate_model_config(v3).ok());
  ASSERT_TRUE(check_hf_representable(v3, "deepseek_v3").ok()) << check_hf_representable(v3, "deepseek_v3").message();
  auto v3b = parse_hf_config_json(hf_config_json_from_config(v3, "deepseek_v3"));
  ASSERT_TRUE(v3b.ok()) << v3b.status().message();
  expect_same(v3, v3b.value());
}

TEST(ConfigLoader, Ml4IsNotRepresentableAsHf) {
  Status s = check_hf_representable(preset("ml4-tiny"), "mistral4");
  ASSERT_FALSE(s.ok());
  for (const char* why : {"KV-sharing consumer", "NoPE", "SSMax", "indexer-reusing", "LeRoPE", "drafter", "indexer (DSA)"}) {
    EXPECT_NE(s.message().find(why), std::string::npos) << why << " in: " << s.message();
  }
  Status d = check_hf_representable(preset("mistral4-tiny"), "deepseek_v3");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.message().find("softmax routing"), std::string::npos) << d.message();
  EXPECT_NE(d.message().find("llama_4_scaling"), std::string::npos) << d.message();
}

// deepseek-ai/DeepSeek-V3.2-Exp config.json as published on its model card.
const char* kDeepseekV32Config = R"({
  "architectures": ["DeepseekV32ForCausalLM"],
  "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
  "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
  "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "initializer_range": 0.02,
  "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
  "model_type": "deepseek_v32", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
  "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
  "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
  "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
  "transformers_version": "4.44.2", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
})";

TEST(ConfigLoader, RealDeepseekV32Config) {
  auto r = parse_hf_config_json(kDeepseekV32Config);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ModelConfig& c = r.value();
  EXPECT_EQ(c.hf_model_type, "deepseek_v32");
  EXPECT_EQ(c.n_layers, 61);
  EXPECT_EQ(c.dim, 7168);
  EXPECT_EQ(c.n_heads, 128);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.hidden_dim, 18432);
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_EQ(c.moe.num_experts, 256);
  EXPECT_EQ(c.moe.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe.expert_hidden_dim, 2048);
  EXPECT_EQ(c.moe.num_expert_groups, 8);
  EXPECT_EQ(c.moe.num_expert_groups_per_tok, 4);
  EXPECT_EQ(c.moe.first_k_dense_replace, 3);
  EXPECT_EQ(c.moe.routed_scale, 2.5);
  EXPECT_EQ(c.moe.scoring, RouterScoring::kSigmoid);
  EXPECT_TRUE(c.moe.has_correction_bias);
  EXPECT_EQ(c.indexer.n_heads, 64);
  EXPECT_EQ(c.indexer.head_dim, 128);
  EXPECT_EQ(c.indexer.rope_head_dim, 64);
  EXPECT_EQ(c.indexer.topk, 2048);
  EXPECT_EQ(c.num_indexer_layers(), 61);
  EXPECT_EQ(c.num_latent_layers(), 61);
  EXPECT_EQ(c.weight_format, WeightFormat::kFP8Block);
  EXPECT_TRUE(c.yarn.enabled);
  EXPECT_EQ(c.yarn.factor, 40.0);
  EXPECT_EQ(c.yarn.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.yarn.mscale, 1.0);
  EXPECT_EQ(c.yarn.mscale_all_dim, 1.0);
  for (int i = 0; i < 61; ++i) EXPECT_EQ(c.layers[i].ffn, i < 3 ? FfnKind::kDense : FfnKind::kMoe);
  // DeepSeek-V3 inference/model.py: softmax_scale = 192^-0.5 * (0.1 ln 40 + 1)^2.
  double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), m * m / std::sqrt(192.0), 1e-12);
  // DeepSeek-V3's model card: 671B total, 37B activated (the 14B MTP module aside); V3.2
  // adds ~0.85B of indexer weights. Counted from expected_tensors: 671.9B and 36.6B.
  ParamCounts pc = count_parameters(c);
  EXPECT_NEAR(static_cast<double>(pc.total) / 671e9, 1.0, 0.01) << pc.total;
  EXPECT_NEAR(static_cast<double>(pc.active) / 37e9, 1.0, 0.02) << pc.active;
}

// Our cos/sin factor: mscale(f, mscale) / mscale(f, mscale_all_dim), mscale(f, 0) = 1.
double cos_sin_factor(const YarnConfig& y) {
  auto ms = [&](double m) { return y.factor <= 1 ? 1.0 : 0.1 * m * std::log(y.factor) + 1.0; };
  return ms(y.mscale) / ms(y.mscale_all_dim);
}

TEST(ConfigLoader, YarnAttentionFactorFollowsTransformers) {
  json base = json::parse(kDeepseekV32Config);
  const double f = 40.0, get_mscale = 0.1 * std::log(f) + 1.0;
  // transformers _compute_yarn_parameters: without both mscale and mscale_all_dim the
  // cos/sin factor is get_mscale(factor).
  for (const char* drop : {"mscale", "mscale_all_dim"}) {
    json j = base;
    j["rope_scaling"].erase(drop);
    auto r = parse_hf_config_json(j.dump());
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_NEAR(cos_sin_factor(r->yarn), get_mscale, 1e-12) << drop;
  }
  // An explicit attention_factor wins.
  json j = base;
  j["rope_scaling"]["attention_factor"] = 1.25;
  auto r = parse_hf_config_json(j.dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_NEAR(cos_sin_factor(r->yarn), 1.25, 1e-12);
  // And the writer makes transformers see the same factor: round trip keeps it.
  auto back = parse_hf_config_json(hf_config_json_from_config(r.value(), "deepseek_v32"));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_NEAR(cos_sin_factor(back->yarn), 1.25, 1e-12);
  // params.json apply_scale false: no cos/sin magnitude correction (vLLM: attention_factor 1).
  json p = json::parse(preset_source_json("ml4-tiny").value());
  p["yarn"]["apply_scale"] = false;
  p["yarn"]["mscale"] = 2.0;
  auto pr = parse_params_json(p.dump());
  ASSERT_TRUE(pr.ok()) << pr.status().message();
  EXPECT_NEAR(cos_sin_factor(pr->yarn), 1.0, 1e-12);
}

struct BadCase {
  const char* patch;  // JSON merge patch applied to ml4-tiny's params.json
  const char* expect;
};

TEST(ConfigLoader, InvalidParamsRejectedWithMessage) {
  const json base = json::parse(preset_source_json("ml4-tiny").value());
  const std::vector<BadCase> cases = {
      {R"({"kv_sharing": {"3": [2]}})", "layer 2 reads layer 3, which is not an earlier layer"},
      {R"({"kv_sharing": {"3": [7], "7": [11]}})", "owns no latent cache"},
      {R"({"kv_sharing": {"3": null, "2": [7]}})", "rope keys would not match"},
      {R"({"kv_sharing": {"3": [12]}})", "layer 12 out of range [0, 12)"},
      {R"({"kv_sharing": {"3": [7, 7]}})", "more than once"},
      {R"({"kv_sharing": {"x": [7]}})", "not a layer index"},
      {R"({"kv_sharing": {"3": []}})", "empty consumer list"},
      {R"({"indexer": {"reuse": {"2": 3}}})", "not an earlier layer"},
      {R"({"indexer": {"reuse": {"2": 1, "3": 2}}})", "does not own an indexer"},
      {R"({"indexer": {"reuse": {"20": 1}}})", "out of range"},
      {R"({"indexer": {"topk": 0}})", "topk must be > 0"},
      {R"({"indexer": {"rope_head_dim": 256}})", "rope_head_dim"},
      {R"({"indexer": {"n_heads": null}})", "missing required key \"n_heads\""},
      {R"({"indexer": {"bogus": 1}})", "unknown key \"bogus\""},
      {R"({"head_dim": 65})", "head dims do not add up"},
      {R"({"qk_rope_head_dim": 31, "head_dim": 63})", "must be even"},
      {R"({"quantization": {"qformat_weight": "int4"}})", "unknown quantization"},
      {R"({"quantization": {"qformat_weight": "fp8_e4m3"}})", "weight_block_size"},
      {R"({"quantization": {"qformat_weight": "fp8_e4m3", "weight_block_size": [128, 128], "qformat_experts": "int2"}})", "unknown quantization"},
      {R"({"quantization": "fp8"})", "unknown quantization"},
      {R"({"nope_layer_interval": 0})", "nope_layer_interval must be >= 1"},
      {R"({"nope_layers": [3]})", "not both"},
      {R"({"ssmax": {"layers": [12]}})", "ssmax.layers: layer 12 out of range"},
      {R"({"lerope": {"leak": 0.5}})", "leak must be >= 1"},
      {R"({"lerope": {"window": null}})", "missing required key \"window\""},
      {R"({"moe": {"num_experts_per_tok": 9}})", "num_experts_per_tok"},
      {R"({"moe": {"num_expert_groups": 3}})", "must divide"},
      {R"({"moe": {"route_every_n": 2}})", "route_every_n"},
      {R"({"moe": {"scoring_func": "relu"}})", "scoring_func"},
      {R"({"moe": {"first_k_dense_replace": 13}})", "first_k_dense_replace"},
      {R"({"dim": null})", "missing required key \"dim\""},
      {R"({"dim": "256"})", "\"dim\" must be an integer"},
      {R"({"dim": 0})", "dim must be > 0"},
      {R"({"kv_lora_rank": null})", "MLA models only"},
      {R"({"norm_eps": -1})", "norm_eps"},
      {R"({"tied_embeddings": 1})", "true or false"},
      {R"({"yarn": {"factor": null}})", "missing required key \"factor\""},
      {R"({"yarn": {"beta": 0.5}})", "must exceed alpha"},
      {R"({"llama_4_scaling": {"beta": null}})", "missing required key \"beta\""},
      {R"({"mtp": {"target_layers": [12]}})", "mtp.target_layers: layer 12 out of range"},
      {R"({"mtp": {"block_size": 1}})", "block_size"},
      {R"({"hidden_dim": null})", "dense FFN but hidden_dim"},
      {R"({"max_position_embeddings": null})", "max_position_embeddings"},
  };
  for (const auto& c : cases) {
    json j = base;
    j.merge_patch(json::parse(c.patch));
    auto r = parse_params_json(j.dump());
    ASSERT_FALSE(r.ok()) << c.patch;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos)
        << c.patch << " -> " << r.status().message() << " (wanted \"" << c.expect << "\")";
    EXPECT_EQ(r.status().message().rfind("params.json: ", 0), 0u) << r.status().message();
  }
  for (const char* text : {"", "{", "[1, 2]", "null", "{\"dim\": }"}) {
    auto r = parse_params_json(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  // Unknown top-level keys are ignored.
  json j = base;
  j["some_future_key"] = {{"x", 1}};
  EXPECT_TRUE(parse_params_json(j.dump()).ok());
}

TEST(ConfigLoader, InvalidHfRejectedWithMessage) {
  const json base = json::parse(kDeepseekV32Config);
  const std::vector<BadCase> cases = {
      {R"({"model_type": "llama"})", "model_type \"llama\" is not supported"},
      {R"({"model_type": null})", "missing required key \"model_type\""},
      {R"({"rope_scaling": {"type": "linear"}})", "rope type \"linear\""},
      {R"({"num_key_value_heads": 8})", "num_key_value_heads"},
      {R"({"q_lora_rank": null})", "needs q_lora_rank"},
      {R"({"quantization_config": {"quant_method": "gptq"}})", "unknown quantization_config"},
      {R"({"quantization_config": {"weight_block_size": [64, 64]}})", "weight_block_size [128, 128]"},
      {R"({"scoring_func": "softmax"})", "scoring_func"},
      {R"({"head_dim": 100})", "head dims do not add up"},
      {R"({"index_topk": -1})", "topk must be > 0"},
      {R"({"n_group": 7})", "must divide"},
      {R"({"hidden_act": "gelu"})", "hidden_act"},
      {R"({"mlp_layer_types": ["dense"]})", "1 entries for 61 layers"},
      {R"({"rope_scaling": {"llama_4_scaling_beta": 0.1}})", "mistral4 field"},
  };
  for (const auto& c : cases) {
    json j = base;
    j.merge_patch(json::parse(c.patch));
    auto r = parse_hf_config_json(j.dump());
    ASSERT_FALSE(r.ok()) << c.patch;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos)
        << c.patch << " -> " << r.status().message() << " (wanted \"" << c.expect << "\")";
  }
}

class TempDir {
 public:
  TempDir() {
    std::mt19937_64 rng(std::random_device{}());
    path_ = std::filesystem::temp_directory_path() / fmt::format("ml4_cfg_test_{:x}", rng());
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path_ / name) << text; }

 private:
  std::filesystem::path path_;
};

TEST(ConfigLoader, LoadModelConfigFromDirectory) {
  TempDir dir;
  auto missing = load_model_config(dir.path().string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("neither params.json nor config.json"), std::string::npos);
  EXPECT_FALSE(load_model_config((dir.path() / "absent").string()).ok());

  // config.json only -> HF.
  dir.write("config.json", kDeepseekV32Config);
  auto hf = load_model_config(dir.path().string());
  ASSERT_TRUE(hf.ok()) << hf.status().message();
  EXPECT_EQ(hf->hf_model_type, "deepseek_v32");

  // params.json wins when both exist.
  dir.write("params.json", preset_source_json("ml4-tiny").value());
  auto native = load_model_config(dir.path().string());
  ASSERT_TRUE(native.ok()) << native.status().message();
  expect_same(native.value(), preset("ml4-tiny"));
  EXPECT_EQ(native->layout, CheckpointLayout::kMistral);

  // Errors name the file.
  dir.write("params.json", R"({"dim": 1})");
  auto bad = load_model_config(dir.path().string());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find((dir.path() / "params.json").string()), std::string::npos) << bad.status().message();
}

// docs/MODEL-FORMAT.md's params.json example is the ml4-tiny preset.
TEST(ConfigLoader, DocumentedExampleIsMl4Tiny) {
  std::ifstream f(std::string(ML4_SOURCE_DIR) + "/docs/MODEL-FORMAT.md");
  ASSERT_TRUE(f) << "docs/MODEL-FORMAT.md not found";
  std::stringstream ss;
  ss << f.rdbuf();
  std::string doc = ss.str();
  size_t begin = doc.find("```json\n");
  ASSERT_NE(begin, std::string::npos);
  begin += 8;
  size_t end = doc.find("```", begin);
  ASSERT_NE(end, std::string::npos);
  auto r = parse_params_json(doc.substr(begin, end - begin));
  ASSERT_TRUE(r.ok()) << r.status().message();
  expect_same(r.value(), preset("ml4-tiny"));
  EXPECT_EQ(json::parse(doc.substr(begin, end - begin)), json::parse(preset_source_json("ml4-tiny").value()));
}

}  // namespace
}  // namespace ml4
