// Built-in presets, written as params.json / config.json text and parsed by the loaders.
//
// ml4 follows MODEL.md section 1 exactly; where it leaves a value open the choice is here
// and in docs/MODEL-FORMAT.md ("Presets"):
//   - indexer reuse: layer i reuses iff floor((i+1)*28/72) > floor(i*28/72): 28 reusers,
//     never two in a row, layer 0 owns, each reuses layer i-1 (the nearest owner);
//   - SSMax on the NoPE layers (3, 7, ..., 71): position-free layers get the length-aware
//     temperature; s_h is learned, so the choice only fixes which layers have `ssmax_s`;
//   - LeRoPE window 262144, leak 4: exact positions for the first 256k, 1M positions map
//     below 459k, well inside YaRN's 128 x 8192 range;
//   - weights FP8 block-scaled (the shipped format, MODEL.md section 4);
//   - mtp: 3 layers, block 16 (DFlash default), targets 1/18/36/54/71, window 2048, rank 512.
// ml4-slice-N keeps the first N layers and drops what refers to layers >= N.
#include "model/presets.h"

#include <nlohmann/json.hpp>

#include "model/config_loader.h"

namespace ml4 {
namespace {

using ojson = nlohmann::ordered_json;

constexpr int kMl4Layers = 72;

ojson ml4_params(int n) {
  auto below = [n](const std::vector<int>& v) {
    std::vector<int> out;
    for (int x : v) {
      if (x < n) out.push_back(x);
    }
    return out;
  };
  ojson j;
  j["dim"] = 6144;
  j["n_layers"] = n;
  j["n_heads"] = 64;
  j["head_dim"] = 192;
  j["hidden_dim"] = 16384;
  j["norm_eps"] = 1e-6;
  j["vocab_size"] = 131072;
  j["max_position_embeddings"] = 1048576;
  j["tied_embeddings"] = false;
  j["kv_lora_rank"] = 512;
  j["qk_nope_head_dim"] = 128;
  j["qk_rope_head_dim"] = 64;
  j["v_head_dim"] = 128;
  j["rope_theta"] = 10000.0;
  j["yarn"] = {{"factor", 128.0}, {"original_max_position_embeddings", 8192}, {"beta", 32.0}, {"alpha", 1.0}, {"apply_scale", true}};
  j["llama_4_scaling"] = {{"original_max_position_embeddings", 8192}, {"beta", 0.1}};
  j["moe"] = {{"num_experts", 128},        {"num_experts_per_tok", 4}, {"expert_hidden_dim", 5632},
              {"first_k_dense_replace", 1}, {"num_shared_experts", 1},  {"routed_scale", 1.0},
              {"num_expert_groups", 1},     {"num_expert_groups_per_tok", 1}};
  j["quantization"] = {{"qformat_weight", "fp8_e4m3"}, {"weight_block_size", {128, 128}}};
  ojson reuse = ojson::object();
  for (int i = 0; i < n; ++i) {
    if ((i + 1) * 28 / kMl4Layers > i * 28 / kMl4Layers) reuse[std::to_string(i)] = i - 1;
  }
  j["indexer"] = {{"n_heads", 32}, {"head_dim", 128}, {"rope_head_dim", 64}, {"topk", 2048}, {"reuse", reuse}};
  std::vector<int> consumers, nope;
  for (int l = 39; l < kMl4Layers; l += 4) consumers.push_back(l);
  for (int l = 3; l < kMl4Layers; l += 4) nope.push_back(l);
  if (n > 35 && !below(consumers).empty()) j["kv_sharing"] = {{"35", below(consumers)}};
  j["nope_layer_interval"] = 4;
  if (!below(nope).empty()) j["ssmax"] = {{"layers", below(nope)}};
  j["lerope"] = {{"window", 262144}, {"leak", 4.0}};
  std::vector<int> targets = below({1, 18, 36, 54, 71});
  if (!targets.empty()) {
    j["mtp"] = {{"n_layers", 3}, {"block_size", 16}, {"target_layers", targets}, {"window", 2048}, {"rnn_rank", 512}};
  }
  return j;
}

// Every ML4 feature at toy size (CPU tests): 12 layers, NoPE 3/7/11, layer 3's latent read
// by 7 and 11, indexer reused on 2, 6, 9, SSMax on a reuser, a consumer and a plain layer,
// LeRoPE window 24 and llama4 length 32 so both act inside short test prompts, top-k 16.
ojson ml4_tiny_params() {
  ojson j;
  j["dim"] = 256;
  j["n_layers"] = 12;
  j["n_heads"] = 4;
  j["head_dim"] = 64;
  j["hidden_dim"] = 512;
  j["norm_eps"] = 1e-6;
  j["vocab_size"] = 512;
  j["max_position_embeddings"] = 4096;
  j["tied_embeddings"] = false;
  j["kv_lora_rank"] = 128;  // fp8_ds_mla tiles are 128 wide
  j["qk_nope_head_dim"] = 32;
  j["qk_rope_head_dim"] = 32;
  j["v_head_dim"] = 32;
  j["rope_theta"] = 10000.0;
  j["yarn"] = {{"factor", 4.0}, {"original_max_position_embeddings", 1024}, {"beta", 32.0}, {"alpha", 1.0}, {"apply_scale", true}};
  j["llama_4_scaling"] = {{"original_max_position_embeddings", 32}, {"beta", 0.1}};
  j["moe"] = {{"num_experts", 8},           {"num_experts_per_tok", 2}, {"expert_hidden_dim", 128},
              {"first_k_dense_replace", 1}, {"num_shared_experts", 1},  {"routed_scale", 1.5},
              {"num_expert_groups", 2},     {"num_expert_groups_per_tok", 1}};
  j["indexer"] = {{"n_heads", 4}, {"head_dim", 128}, {"rope_head_dim", 32}, {"topk", 16},
                  {"reuse", {{"2", 1}, {"6", 5}, {"9", 8}}}};
  j["kv_sharing"] = {{"3", {7, 11}}};
  j["nope_layer_interval"] = 4;
  j["ssmax"] = {{"layers", {2, 7, 10}}};
  j["lerope"] = {{"window", 24}, {"leak", 4.0}};
  j["mtp"] = {{"n_layers", 1}, {"block_size", 4}, {"target_layers", {1, 5, 10}}, {"window", 64}, {"rnn_rank", 32}};
  return j;
}

// Shared toy MLA + MoE shape of the two HF oracle presets.
ojson hf_tiny_common() {
  ojson j;
  j["hidden_size"] = 256;
  j["num_hidden_layers"] = 4;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = 4;
  j["intermediate_size"] = 512;
  j["moe_intermediate_size"] = 128;
  j["n_routed_experts"] = 8;
  j["n_shared_experts"] = 1;
  j["num_experts_per_tok"] = 2;
  j["first_k_dense_replace"] = 1;
  j["n_group"] = 2;
  j["topk_group"] = 1;
  j["norm_topk_prob"] = true;
  j["q_lora_rank"] = 64;
  j["kv_lora_rank"] = 128;
  j["qk_nope_head_dim"] = 32;
  j["qk_rope_head_dim"] = 32;
  j["v_head_dim"] = 32;
  j["rms_norm_eps"] = 1e-6;
  j["vocab_size"] = 512;
  j["max_position_embeddings"] = 4096;
  j["tie_word_embeddings"] = false;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  return j;
}

// Mistral 4 (transformers Mistral4Config: query LoRA, softmax routing, llama4 scaling read
// from rope_parameters). YaRN factor 128 on an original length of 32 (Mistral 4's ratio)
// so the llama4 temperature steps at position 32.
ojson mistral4_tiny_config() {
  ojson j = {{"architectures", {"Mistral4ForCausalLM"}}, {"model_type", "mistral4"}};
  j.update(hf_tiny_common());
  j["routed_scaling_factor"] = 1.0;
  j["rope_interleave"] = true;
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 128.0},
                          {"original_max_position_embeddings", 32}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                          {"mscale", 1.0}, {"mscale_all_dim", 1.0}, {"llama_4_scaling_beta", 0.1},
                          {"partial_rotary_factor", 0.5}};
  j["dtype"] = "bfloat16";
  return j;
}

// DeepSeek-V3.2 (sigmoid routing with correction bias and groups, indexer on every layer
// from the query latent); index_head_dim 128 to match the 132 B indexer cache rows.
ojson dsv32_tiny_config() {
  ojson j = {{"architectures", {"DeepseekV32ForCausalLM"}}, {"model_type", "deepseek_v32"}};
  j.update(hf_tiny_common());
  j["routed_scaling_factor"] = 2.5;
  j["scoring_func"] = "sigmoid";
  j["topk_method"] = "noaux_tc";
  j["index_n_heads"] = 4;
  j["index_head_dim"] = 128;
  j["index_topk"] = 16;
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 4.0},
                          {"original_max_position_embeddings", 1024}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                          {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  j["dtype"] = "bfloat16";
  return j;
}

Result<int> slice_layers(const std::string& name) {
  const std::string prefix = "ml4-slice-";
  std::string digits = name.substr(prefix.size());
  if (digits.empty() || digits.size() > 3 || digits.find_first_not_of("0123456789") != std::string::npos) {
    return invalid_argument("preset \"{}\": expected ml4-slice-N with N a layer count in [1, {}]", name, kMl4Layers);
  }
  int n = std::stoi(digits);
  if (n < 1 || n > kMl4Layers) return out_of_range("preset \"{}\": N must be in [1, {}]", name, kMl4Layers);
  return n;
}

}  // namespace

std::vector<std::string> preset_names() { return {"ml4", "ml4-slice-N", "ml4-tiny", "mistral4-tiny", "dsv32-tiny"}; }

Result<std::string> preset_source_json(const std::string& name, bool* is_hf) {
  bool hf = false;
  ojson j;
  if (name == "ml4") {
    j = ml4_params(kMl4Layers);
  } else if (name.rfind("ml4-slice-", 0) == 0) {
    ML4_ASSIGN_OR_RETURN(int n, slice_layers(name));
    j = ml4_params(n);
  } else if (name == "ml4-tiny") {
    j = ml4_tiny_params();
  } else if (name == "mistral4-tiny") {
    j = mistral4_tiny_config();
    hf = true;
  } else if (name == "dsv32-tiny") {
    j = dsv32_tiny_config();
    hf = true;
  } else {
    return not_found("unknown preset \"{}\" (known: ml4, ml4-slice-N, ml4-tiny, mistral4-tiny, dsv32-tiny)", name);
  }
  if (is_hf) *is_hf = hf;
  return j.dump(2) + "\n";
}

Result<ModelConfig> preset_config(const std::string& name) {
  bool hf = false;
  ML4_ASSIGN_OR_RETURN(std::string text, preset_source_json(name, &hf));
  auto r = hf ? parse_hf_config_json(text) : parse_params_json(text);
  if (!r.ok()) return r.status().with_context(fmt::format("preset {}", name));
  ModelConfig cfg = std::move(r).value();
  cfg.name = name;
  return cfg;
}

}  // namespace ml4
