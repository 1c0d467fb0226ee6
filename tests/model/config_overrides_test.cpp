// `--set` overrides and `--params` files (model/config_overrides.h), and the params.json
// writer's coverage of Mistral's native schema (what vLLM's and llama.cpp's readers need).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <set>

#include "model/config_loader.h"
#include "model/config_overrides.h"
#include "model/presets.h"
#include "model/weight_names.h"

namespace ml4 {
namespace {

using json = nlohmann::json;

ModelConfig resolve_ok(const std::string& preset, const std::string& text, const std::vector<std::string>& sets) {
  auto r = resolve_model_config(preset, text, sets);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? r.value() : ModelConfig{};
}

std::string resolve_error(const std::string& preset, const std::vector<std::string>& sets) {
  auto r = resolve_model_config(preset, "", sets);
  EXPECT_FALSE(r.ok());
  return r.ok() ? "" : r.status().message();
}

TEST(ConfigOverrides, SplitKeepsBracketsAndQuotes) {
  auto r = split_overrides(R"(dim=2048,nope_layers=[3,7],lerope={"window":8,"leak":2},name="a,b")");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r.value(), (std::vector<std::string>{"dim=2048", "nope_layers=[3,7]", R"(lerope={"window":8,"leak":2})",
                                                 R"(name="a,b")"}));
  EXPECT_FALSE(split_overrides("a=[1,2").ok());
  EXPECT_FALSE(split_overrides("a=1]").ok());
  EXPECT_FALSE(split_overrides(R"(a="x)").ok());
}

// The ~2B Mistral-4-shaped benchmark model (bench/models/): the features llama.cpp cannot
// convert removed from an ml4 slice, the width and MoE changed, all through --set.
TEST(ConfigOverrides, BuildsAMistral4ShapedModelFromAPreset) {
  const ModelConfig c = resolve_ok(
      "ml4-slice-8", "",
      {"dim=2048,n_heads=16,hidden_dim=8192,indexer=null,kv_sharing=null,nope_layer_interval=null,ssmax=null",
       "lerope=null,mtp=null,quantization=null,moe.num_experts=32,moe.expert_hidden_dim=896",
       "moe.first_k_dense_replace=0"});
  EXPECT_EQ(c.dim, 2048);
  EXPECT_EQ(c.n_layers, 8);
  EXPECT_EQ(c.n_heads, 16);
  EXPECT_EQ(c.moe.num_experts, 32);
  EXPECT_EQ(c.moe.num_experts_per_tok, 4);  // kept from the preset
  EXPECT_EQ(c.moe.expert_hidden_dim, 896);
  EXPECT_EQ(c.weight_format, WeightFormat::kBF16);
  EXPECT_FALSE(c.has_dsa());
  EXPECT_FALSE(c.drafter.enabled);
  EXPECT_FALSE(c.lerope.enabled);
  for (const auto& l : c.layers) {
    EXPECT_TRUE(l.rope) << l.index;
    EXPECT_TRUE(l.owns_kv()) << l.index;
    EXPECT_FALSE(l.ssmax) << l.index;
    EXPECT_EQ(l.ffn, FfnKind::kMoe) << l.index;
  }
  // 2 x 131072 x 2048 embeddings + 8 layers of MLA (no q LoRA) + 33 experts of 3 x 2048 x 896.
  const ParamCounts n = count_parameters(c);
  const int64_t attn = 2048LL * 16 * 192 + 2048LL * 576 + 512LL * 16 * 256 + 16LL * 128 * 2048 + 2 * 2048 + 512;
  const int64_t moe = 2048LL * 32 + 33LL * 3 * 2048 * 896;
  EXPECT_EQ(n.total, 2LL * 131072 * 2048 + 2048 + 8 * (attn + moe));
}

TEST(ConfigOverrides, ParamsFileAndTypesFromJson) {
  std::string text = preset_source_json("ml4-tiny").value();
  const ModelConfig c = resolve_ok("", text, {"norm_eps=1e-5,tied_embeddings=true,ssmax.layers=[1,2]"});
  EXPECT_EQ(c.name, "custom");
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_TRUE(c.tied_embeddings);
  for (const auto& l : c.layers) EXPECT_EQ(l.ssmax, l.index == 1 || l.index == 2) << l.index;
  // An HF config.json text is recognised and only its existing keys may be set.
  std::string hf = preset_source_json("mistral4-tiny").value();
  const ModelConfig h = resolve_ok("", hf, {"hidden_size=512,n_routed_experts=16"});
  EXPECT_EQ(h.dim, 512);
  EXPECT_EQ(h.moe.num_experts, 16);
  auto bad = resolve_model_config("", hf, {"dim=512"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("no key \"dim\""), std::string::npos) << bad.status().message();
}

TEST(ConfigOverrides, BadOverridesNameTheProblem) {
  EXPECT_NE(resolve_error("ml4-tiny", {"dimm=5"}).find("\"dimm\" is not a params.json key"), std::string::npos);
  EXPECT_NE(resolve_error("ml4-tiny", {"moe.num_expert=5"}).find("not a key of the moe block"), std::string::npos);
  EXPECT_NE(resolve_error("ml4-tiny", {"dim"}).find("expected KEY=VALUE"), std::string::npos);
  EXPECT_NE(resolve_error("ml4-tiny", {"moe..x=1"}).find("empty component"), std::string::npos);
  EXPECT_NE(resolve_error("ml4-tiny", {"dim=wide"}).find("\"dim\""), std::string::npos);  // the loader's type error
  EXPECT_NE(resolve_error("ml4-tiny", {"lerope.leek=2"}).find("leek"), std::string::npos);  // ML4 block: loader
  EXPECT_NE(resolve_error("ml4-tiny", {"dim.x=1"}).find("not an object"), std::string::npos);
  EXPECT_NE(resolve_error("no-such-preset", {}).find("unknown preset"), std::string::npos);
  EXPECT_FALSE(resolve_model_config("", "{not json", {}).ok());
}

// params.json carries every key of Mistral's native schema (Mistral's files; vLLM's
// adapt_config_dict and llama.cpp's MistralMoeModel read them), n_kv_heads included, and
// nothing inside `yarn` that vLLM's adapter would refuse.
TEST(ConfigOverrides, ParamsJsonHasMistralNativeKeys) {
  const std::set<std::string> top = {"dim", "n_layers", "head_dim", "hidden_dim", "n_heads", "n_kv_heads",
                                     "rope_theta", "norm_eps", "vocab_size", "tied_embeddings",
                                     "max_position_embeddings", "max_seq_len", "activation", "q_lora_rank",
                                     "qk_rope_head_dim", "qk_nope_head_dim", "kv_lora_rank", "v_head_dim"};
  const std::set<std::string> moe = {"route_every_n", "first_k_dense_replace", "num_experts",
                                     "num_experts_per_tok", "num_expert_groups", "num_expert_groups_per_tok",
                                     "routed_scale", "expert_hidden_dim", "num_shared_experts"};
  const std::set<std::string> yarn = {"factor", "original_max_position_embeddings", "beta", "alpha", "apply_scale"};
  for (const char* name : {"ml4", "ml4-tiny", "mistral4-tiny"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = preset_config(name).value();
    const json j = json::parse(params_json_from_config(c));
    for (const auto& k : top) EXPECT_TRUE(j.contains(k)) << k;
    EXPECT_EQ(j["n_kv_heads"], c.n_heads);
    EXPECT_EQ(j["max_seq_len"], c.max_position_embeddings);
    for (const auto& k : moe) EXPECT_TRUE(j["moe"].contains(k)) << "moe." << k;
    std::set<std::string> ykeys;
    for (auto it = j["yarn"].begin(); it != j["yarn"].end(); ++it) ykeys.insert(it.key());
    EXPECT_EQ(ykeys, yarn);
    if (c.q_lora_rank == 0) EXPECT_TRUE(j["q_lora_rank"].is_null());
    else EXPECT_EQ(j["q_lora_rank"], c.q_lora_rank);
    auto back = parse_params_json(j.dump());
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(params_json_from_config(back.value()), params_json_from_config(c));
  }
  // A yarn that the five native keys cannot express keeps the ML4 keys (and round-trips).
  ModelConfig c = preset_config("ml4-tiny").value();
  c.yarn.mscale = 0.707;
  const json j = json::parse(params_json_from_config(c));
  EXPECT_DOUBLE_EQ(j["yarn"]["mscale"].get<double>(), 0.707);
  EXPECT_DOUBLE_EQ(parse_params_json(j.dump()).value().yarn.mscale, 0.707);
  // Only SwiGLU runs here.
  auto gelu = resolve_model_config("ml4-tiny", "", {"activation=gelu"});
  ASSERT_FALSE(gelu.ok());
  EXPECT_NE(gelu.status().message().find("activation"), std::string::npos);
}

}  // namespace
}  // namespace ml4
