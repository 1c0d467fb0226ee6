// Offline checkpoint quantization: see quantize_checkpoint.h.
#include "model/quantize_checkpoint.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "model/checkpoint.h"
#include "model/config_loader.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "model/weight_names.h"

namespace ml4 {
namespace {

namespace fs = std::filesystem;

// The stored weight's format and its LinearWeight, from the tensors next to it (the same
// rule as the weight loader: the dtype of `.weight` decides, scales by suffix).
Result<LinearWeight> read_linear(const Checkpoint& ck, const std::string& wname, int64_t N, int64_t K) {
  ML4_ASSIGN_OR_RETURN(Tensor w, ck.get(wname));
  const std::string base = wname.substr(0, wname.size() - std::string(".weight").size());
  switch (w.dtype()) {
    case DType::kF32:
      return make_linear_weight(wname, LinearFormat::kF32, N, K, w);
    case DType::kBF16:
      return make_linear_weight(wname, LinearFormat::kBF16, N, K, w);
    case DType::kF8E4M3: {
      ML4_ASSIGN_OR_RETURN(Tensor s, ck.get(base + "." + kFp8BlockScaleSuffix));
      return make_linear_weight(wname, LinearFormat::kFP8Block, N, K, w, s);
    }
    case DType::kU8:
    case DType::kF4E2M1x2: {
      ML4_ASSIGN_OR_RETURN(Tensor s, ck.get(base + "." + kFp4BlockScaleSuffix));
      if (s.dtype() == DType::kF8E4M3) {
        ML4_ASSIGN_OR_RETURN(Tensor g, ck.get(base + "." + kNvfp4GlobalScaleSuffix));
        if (g.numel() != 1 || g.dtype() != DType::kF32)
          return invalid_argument("tensor {}.{}: expected one f32, found {}", base, kNvfp4GlobalScaleSuffix,
                                  g.describe());
        return make_linear_weight(wname, LinearFormat::kNVFP4, N, K, w, s, g.as<float>()[0]);
      }
      return make_linear_weight(wname, LinearFormat::kMXFP4, N, K, w, s);
    }
    default:
      return invalid_argument("tensor {}: dtype {} is not a weight format", wname, dtype_name(w.dtype()));
  }
}

}  // namespace

Result<QuantizeReport> quantize_checkpoint(const QuantizeOptions& o) {
  WeightFormat target;
  if (o.to == "bf16") target = WeightFormat::kBF16;
  else if (o.to == "fp8") target = WeightFormat::kFP8Block;
  else if (o.to == "nvfp4") target = WeightFormat::kNVFP4Experts;
  else if (o.to == "mxfp4") target = WeightFormat::kMXFP4Experts;
  else return invalid_argument("--to must be bf16, fp8, mxfp4 or nvfp4, got '{}'", o.to);
  std::optional<LinearFormat> head_format;
  if (o.output_tensor_type == "bf16") head_format = LinearFormat::kBF16;
  else if (o.output_tensor_type == "fp8") head_format = LinearFormat::kFP8Block;
  else if (!o.output_tensor_type.empty())
    return invalid_argument("--output-tensor-type must be bf16 or fp8, got '{}'", o.output_tensor_type);
  std::error_code ec;
  if (fs::exists(o.out_dir, ec) && fs::equivalent(o.in_dir, o.out_dir, ec))
    return invalid_argument("OUT ({}) is the input directory; write the quantized model elsewhere", o.out_dir);
  for (const char* f : {"params.json", "config.json"})
    if (fs::exists(fs::path(o.out_dir) / f))
      return invalid_argument("{} already holds a model ({}); remove it or pick another OUT", o.out_dir, f);

  ML4_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(o.in_dir));
  ML4_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::open(o.in_dir));
  const CheckpointLayout layout = ck.layout();
  if (layout == CheckpointLayout::kHF && hf_fused_experts(cfg) && cfg.moe.num_experts > 0)
    return unimplemented("{}: quantized fused HF expert tensors (mistral4's gate_up_proj) are not written; quantize the "
                         "native layout (params.json) instead",
                         o.in_dir);
  ModelConfig out_cfg = cfg;
  out_cfg.weight_format = target;
  ML4_RETURN_IF_ERROR(validate_model_config(out_cfg).with_context("target format " + o.to));
  const std::string hf_type = out_cfg.hf_model_type.empty() ? "mistral4" : out_cfg.hf_model_type;
  if (layout == CheckpointLayout::kHF) ML4_RETURN_IF_ERROR(check_hf_representable(out_cfg, hf_type));

  if (head_format && cfg.tied_embeddings)
    return invalid_argument("--output-tensor-type: {} ties its output head to tok_embeddings (tied_embeddings), so "
                            "there is no output tensor to store",
                            o.in_dir);
  if (head_format == LinearFormat::kFP8Block && layout == CheckpointLayout::kHF)
    return unimplemented("--output-tensor-type fp8 writes the native layout only: transformers' FP8 loader keeps lm_head "
                         "in bf16, so {} would not load there; quantize a params.json directory",
                         o.in_dir);
  std::map<std::string, ExpectedTensor> source;
  for (auto& t : expected_tensors(cfg, layout)) source.emplace(t.name, t);
  QuantizeReport rep;
  for (const auto& f : ck.files()) rep.bytes_in += static_cast<int64_t>(f->data_bytes());
  SafetensorsWriter w;
  auto copy = [&](const std::string& name) -> Status {
    ML4_ASSIGN_OR_RETURN(Tensor t, ck.get(name));
    return w.add(name, t);
  };
  const std::string head_name = layout == CheckpointLayout::kHF ? "lm_head.weight" : "output.weight";
  for (ExpectedTensor t : expected_tensors(out_cfg, layout)) {
    if (head_format && t.name == head_name) t = stored_as(t, *head_format);
    if (!ck.contains(t.name)) {
      if (t.drafter) continue;  // a checkpoint without the drafter stays without it
      return not_found("{}: tensor {} is missing from the input", o.in_dir, t.name);
    }
    const bool linear = t.role == TensorRole::kLinear;
    auto src = source.find(t.name);
    // Copied as stored: not a linear, or a bf16 / f32 one the source keeps in that format too
    // (--to bf16 decodes the others through quantize_linear below).
    // (The stored dtype decides what the source holds: an FP8 `output` counts as FP8.)
    const bool plain = t.format == LinearFormat::kBF16 || t.format == LinearFormat::kF32;
    ML4_ASSIGN_OR_RETURN(Tensor stored, ck.get(t.name));
    if (!linear || src == source.end() || (plain && src->second.format == t.format && stored.dtype() == t.stored_dtype())) {
      ML4_RETURN_IF_ERROR(copy(t.name));
      if (src != source.end())
        for (const auto& s : src->second.scales)
          if (ck.contains(s.name)) ML4_RETURN_IF_ERROR(copy(s.name));
      continue;
    }
    const int64_t N = t.shape[0], K = t.shape[1];
    ML4_ASSIGN_OR_RETURN(LinearWeight in, read_linear(ck, t.name, N, K));
    LinearWeight q;
    if (in.format == t.format) {
      q = in;  // already in the target format: bytes as they are
    } else {
      const std::vector<float> f = dequantize_linear(in);
      if (f.empty()) return internal_error("tensor {}: could not decode", t.name);
      ML4_ASSIGN_OR_RETURN(q, quantize_linear(f.data(), N, K, t.format, t.name));
      ++rep.quantized_linears;
    }
    ML4_RETURN_IF_ERROR(w.add(t.name, q.weight));
    for (const auto& s : t.scales) {
      const std::string suffix = s.name.substr(s.name.rfind('.') + 1);
      if (suffix == kNvfp4GlobalScaleSuffix) {
        Tensor g(DType::kF32, s.shape);
        g.mutable_as<float>()[0] = q.global_scale;
        ML4_RETURN_IF_ERROR(w.add(s.name, g));
      } else {
        ML4_RETURN_IF_ERROR(w.add(s.name, q.scale));
      }
    }
  }
  rep.tensors = static_cast<int64_t>(w.size());
  rep.bytes_out = static_cast<int64_t>(w.total_bytes());

  fs::create_directories(o.out_dir, ec);
  if (ec) return io_error("cannot create {}: {}", o.out_dir, ec.message());
  for (const auto& [k, v] : ck.metadata()) w.set_metadata(k, v);
  w.set_metadata("ml4_quantized_to", o.to);
  const bool hf = layout == CheckpointLayout::kHF;
  ML4_RETURN_IF_ERROR(w.write_sharded(o.out_dir, hf ? "model" : "consolidated", static_cast<uint64_t>(o.max_shard_bytes)));
  {
    std::ofstream f(fs::path(o.out_dir) / (hf ? "config.json" : "params.json"));
    if (hf) {
      f << hf_config_json_from_config(out_cfg, hf_type);
    } else {
      f << params_json_from_config(out_cfg);
    }
    if (!f) return io_error("cannot write the config into {}", o.out_dir);
  }
  // Tokenizer and chat files travel unchanged.
  for (const char* name : {"tekken.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "generation_config.json", "chat_template.jinja"}) {
    const fs::path from = fs::path(o.in_dir) / name;
    if (fs::exists(from)) {
      fs::copy_file(from, fs::path(o.out_dir) / name, fs::copy_options::overwrite_existing, ec);
      if (ec) return io_error("cannot copy {}: {}", from.string(), ec.message());
    }
  }
  return rep;
}

}  // namespace ml4
