// Random checkpoints for presets (`ml4 make-model`): writes a complete model directory (config, weights, tokenizer) for a
// preset, with random weights from a seed, in the Mistral native layout, the HF layout,
// or both (MODEL.md section 6: the oracles read HF, ml4 reads both identically).
//
// Every tensor's values come from a generator seeded by (seed, Mistral-native name), so
// the two layouts hold the same numbers and a model is reproducible from its flags.
// Scales: linears N(0, 1/in) so activations stay O(1) through the layers; norms 1 + 0.1 N;
// the output head 2/sqrt(dim) so greedy choices are not near-ties.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "model/config_loader.h"
#include "model/config_overrides.h"
#include "model/hf_tokenizer.h"
#include "model/presets.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "model/weight_names.h"
#include "model/random_checkpoint.h"

namespace ml4 {
namespace {

uint64_t fnv1a(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ (seed * 0x9E3779B97F4A7C15ull);
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<float> random_values(const std::string& native_name, uint64_t seed, int64_t n, double mean, double stddev) {
  std::mt19937_64 rng(fnv1a(native_name, seed));
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(mean + stddev * nd(rng));
  return v;
}

// The f32 values of one native tensor.
std::vector<float> tensor_values(const ExpectedTensor& t, const ModelConfig& cfg, uint64_t seed) {
  const int64_t n = t.numel();
  switch (t.role) {
    case TensorRole::kLinear:
    case TensorRole::kExpertsLinear: {
      const int64_t in = t.shape.back();
      double sd = 1.0 / std::sqrt(static_cast<double>(in));
      if (t.name == "output.weight") sd = 2.0 / std::sqrt(static_cast<double>(in));
      return random_values(t.name, seed, n, 0.0, sd);
    }
    case TensorRole::kNorm:
      return random_values(t.name, seed, n, 1.0, 0.1);
    case TensorRole::kNormBias:
      return random_values(t.name, seed, n, 0.0, 0.1);
    case TensorRole::kEmbedding:
      return random_values(t.name, seed, n, 0.0, 1.0);
    case TensorRole::kRouterGate:
      return random_values(t.name, seed, n, 0.0, 1.0 / std::sqrt(static_cast<double>(cfg.dim)));
    case TensorRole::kCorrectionBias:
      return random_values(t.name, seed, n, 0.0, 0.05);
    case TensorRole::kSsmaxScale: {
      // s_h around 0.3: s*log(n) stays near 1 for the context lengths the tiny models see.
      auto v = random_values(t.name, seed, n, 0.3, 0.05);
      for (auto& x : v) x = std::fabs(x);
      return v;
    }
  }
  return {};
}

Tensor f32_tensor(const std::vector<float>& v, Shape shape, bool as_bf16) {
  if (!as_bf16) {
    Tensor t(DType::kF32, std::move(shape));
    std::copy(v.begin(), v.end(), t.mutable_as<float>());
    return t;
  }
  Tensor t(DType::kBF16, std::move(shape));
  auto* p = t.mutable_as<uint16_t>();
  for (size_t i = 0; i < v.size(); ++i) p[i] = f32_to_bf16(v[i]);
  return t;
}

// Adds one tensor (and its scales) under `name` / `scale names` to the writer.
Status add_tensor(SafetensorsWriter& w, const ExpectedTensor& t, const std::vector<float>& v) {
  const bool linear = t.role == TensorRole::kLinear || t.role == TensorRole::kExpertsLinear;
  if (!linear || t.format == LinearFormat::kF32 || t.format == LinearFormat::kBF16) {
    return w.add(t.name, f32_tensor(v, t.shape, t.format != LinearFormat::kF32));
  }
  if (t.role == TensorRole::kExpertsLinear)
    return unimplemented("tensor {}: quantized fused expert tensors are not written (use the native layout)", t.name);
  const int64_t N = t.shape[0], K = t.shape[1];
  ML4_ASSIGN_OR_RETURN(LinearWeight lw, quantize_linear(v.data(), N, K, t.format, t.name));
  ML4_RETURN_IF_ERROR(w.add(t.name, lw.weight));
  for (const auto& s : t.scales) {
    const std::string suffix = s.name.substr(s.name.rfind('.') + 1);
    if (suffix == kNvfp4GlobalScaleSuffix) {
      Tensor g(DType::kF32, s.shape);
      g.mutable_as<float>()[0] = lw.global_scale;
      ML4_RETURN_IF_ERROR(w.add(s.name, g));
    } else {
      ML4_RETURN_IF_ERROR(w.add(s.name, lw.scale));
    }
  }
  return ok_status();
}

}  // namespace

Status make_model(const MakeModelOptions& o) {
  ML4_ASSIGN_OR_RETURN(ModelConfig cfg, resolve_model_config(o.preset, o.params_text, o.overrides));
  if (o.weight_dtype == "bf16") cfg.weight_format = WeightFormat::kBF16;
  else if (o.weight_dtype == "fp8") cfg.weight_format = WeightFormat::kFP8Block;
  else if (o.weight_dtype == "nvfp4") cfg.weight_format = WeightFormat::kNVFP4Experts;
  else if (o.weight_dtype == "mxfp4") cfg.weight_format = WeightFormat::kMXFP4Experts;
  else return invalid_argument("--dtype must be bf16, fp8, nvfp4 or mxfp4, got '{}'", o.weight_dtype);
  if (o.layout != "native" && o.layout != "hf" && o.layout != "both" && o.layout != "merged" && o.layout != "default")
    return invalid_argument("--layout must be native, hf, both, merged or default, got '{}'", o.layout);
  const bool preset_hf = cfg.layout == CheckpointLayout::kHF;
  // merged: both layouts in one directory, as Mistral's Hub repos ship them (params.json +
  // consolidated*.safetensors + tekken.json beside config.json + model*.safetensors +
  // tokenizer.json): ml4 reads the native files, transformers the HF ones, and llama.cpp's
  // `convert_hf_to_gguf.py --mistral-format` finds the config.json it also opens.
  const bool merged = o.layout == "merged";
  const bool write_native = o.layout == "native" || o.layout == "both" || merged || (o.layout == "default" && !preset_hf);
  const bool write_hf = o.layout == "hf" || o.layout == "both" || merged || (o.layout == "default" && preset_hf);
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return io_error("cannot create {}: {}", o.out_dir, ec.message());

  // Values by native name: both layouts draw from the same numbers.
  ModelConfig native_cfg = cfg;
  native_cfg.layout = CheckpointLayout::kMistral;
  const auto native = expected_tensors(native_cfg, CheckpointLayout::kMistral);
  std::map<std::string, const ExpectedTensor*> by_name;
  for (const auto& t : native) by_name[t.name] = &t;

  auto write_dir = [&](const std::string& dir, CheckpointLayout layout) -> Status {
    fs::create_directories(dir, ec);
    ModelConfig c = cfg;
    c.layout = layout;
    SafetensorsWriter w;
    for (const auto& t : expected_tensors(c, layout)) {
      std::vector<float> v;
      if (layout == CheckpointLayout::kMistral) {
        v = tensor_values(t, cfg, o.seed);
      } else if (t.role == TensorRole::kExpertsLinear) {
        // HF fused experts: gate_up [E, 2I, H] = per expert [w1; w3]; down [E, H, I] = w2.
        const bool gate_up = t.name.find("gate_up_proj") != std::string::npos;
        const int64_t E = t.shape[0];
        for (int64_t e = 0; e < E; ++e) {
          const std::string pe = fmt::format("layers.{}.experts.{}.", t.layer, e);
          for (const char* part : gate_up ? std::vector<const char*>{"w1", "w3"} : std::vector<const char*>{"w2"}) {
            auto it = by_name.find(pe + part + ".weight");
            if (it == by_name.end()) return internal_error("no native tensor for {}{}", pe, part);
            auto pv = tensor_values(*it->second, cfg, o.seed);
            v.insert(v.end(), pv.begin(), pv.end());
          }
        }
      } else {
        ML4_ASSIGN_OR_RETURN(std::string nn, native_name_from_hf(t.name));
        auto it = by_name.find(nn);
        if (it == by_name.end()) return internal_error("HF tensor {} maps to {}, which the native layout lacks", t.name, nn);
        v = tensor_values(*it->second, cfg, o.seed);
      }
      ML4_RETURN_IF_ERROR(add_tensor(w, t, v));
    }
    const bool hf = layout == CheckpointLayout::kHF;
    if (hf) {
      std::ofstream(dir + "/config.json") << hf_config_json_from_config(
          c, !o.hf_model_type.empty() ? o.hf_model_type : (!cfg.hf_model_type.empty() ? cfg.hf_model_type : "mistral4"));
    } else {
      std::ofstream(dir + "/params.json") << params_json_from_config(c);
    }
    w.set_metadata("format", "pt");
    w.set_metadata("ml4_preset", cfg.name);
    w.set_metadata("ml4_seed", std::to_string(o.seed));
    ML4_RETURN_IF_ERROR(w.write_sharded(dir, hf ? "model" : "consolidated", o.max_shard_bytes));
    if (!o.tokenizer_json.empty()) {
      // tekken.json (ml4, mistral-common) plus the HF files (transformers, llama.cpp's HF
      // converter), side by side as in Mistral's own repos.
      std::ofstream(dir + "/tekken.json") << o.tokenizer_json;
      ML4_ASSIGN_OR_RETURN(HfTokenizerFiles hf_tok, hf_tokenizer_from_tekken(o.tokenizer_json, cfg.max_position_embeddings));
      std::ofstream(dir + "/tokenizer.json") << hf_tok.tokenizer_json;
      std::ofstream(dir + "/tokenizer_config.json") << hf_tok.tokenizer_config_json;
    }
    return ok_status();
  };
  if (write_native) ML4_RETURN_IF_ERROR(write_dir(o.out_dir, CheckpointLayout::kMistral));
  if (write_hf)
    ML4_RETURN_IF_ERROR(write_dir(write_native && !merged ? o.out_dir + "/hf" : o.out_dir, CheckpointLayout::kHF));
  return ok_status();
}
}  // namespace ml4
