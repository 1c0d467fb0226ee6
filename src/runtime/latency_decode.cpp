#include "runtime/latency_decode.h"

#include <fmt/format.h>

#include "ops/ffn_resident_shape.h"

namespace ml4 {

namespace {

const char* weight_format_label(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBF16: return "bf16";
    case WeightFormat::kFP8Block: return "fp8";
    case WeightFormat::kNVFP4Experts: return "FP8 with NVFP4 experts";
    case WeightFormat::kMXFP4Experts: return "FP8 with MXFP4 experts";
  }
  return "?";
}

}  // namespace

Status validate_decode_backend(const std::string& backend) {
  if (backend == "standard" || backend == "latency_specialized") return ok_status();
  return invalid_argument("--decode-backend {}: expected standard or latency_specialized", backend);
}

std::vector<std::string> latency_decode_refusals(const LatencyDecodeSetup& s) {
  std::vector<std::string> why;
  if (s.device != "cuda") why.push_back(fmt::format("--device {}: the path is a CUDA kernel (use --device cuda)", s.device));
  if (s.batch_invariant)
    why.push_back("--batch-invariant: the resident kernel uses the standard path's decode numerics, not f32 "
                  "activations whatever the step's size (drop the flag)");
  if (s.quantization != "auto")
    why.push_back(fmt::format("--quantization {}: the kernel streams FP8 block weights only", s.quantization));
  const ParallelConfig& p = s.parallel;
  if (p.tensor_parallel_size != 1)
    why.push_back(fmt::format("--tensor-parallel-size {}: one kernel holds a whole layer on one GPU (needs 1)",
                              p.tensor_parallel_size));
  if (p.data_parallel_size != 1)
    why.push_back(fmt::format("--data-parallel-size {}: needs 1", p.data_parallel_size));
  if (p.enable_expert_parallel) why.push_back("--enable-expert-parallel: the kernel holds every expert (drop it)");
  if (p.decode_context_parallel_size != 1)
    why.push_back(fmt::format("--decode-context-parallel-size {}: the kernel attends over the whole cache (needs 1)",
                              p.decode_context_parallel_size));
  if (p.prefill_context_parallel_size != 1)
    why.push_back(fmt::format("--prefill-context-parallel-size {}: needs 1", p.prefill_context_parallel_size));
  if (s.speculative)
    why.push_back("--speculative-config: every step then verifies several tokens per request, so no step is the "
                  "1-token decode the path runs (drop one of the two)");
  if (s.hisparse)
    why.push_back("HiSparse (--kv-transfer-config HiSparseConnector): the latent cache is in host memory, the "
                  "kernel reads it on the device");
  if (s.model != nullptr && s.model->weight_format != WeightFormat::kFP8Block)
    why.push_back(fmt::format("the checkpoint's weights are {}: the kernel streams FP8 block weights (ml4 quantize "
                              "--to fp8 IN OUT)",
                              weight_format_label(s.model->weight_format)));
  if (s.model != nullptr) {
    // Every FFN kind the model has, as the kernel would see it (its dense MLP, its MoE with the
    // shared experts as one MLP).
    const ModelConfig& m = *s.model;
    bool dense = false, moe = false;
    for (const auto& l : m.layers) (l.ffn == FfnKind::kMoe ? moe : dense) = true;
    std::string shape;
    if (dense) shape = ffn_resident_unsupported(m.dim, nullptr, 0, m.hidden_dim, 1);
    if (moe) {
      const std::string w = ffn_resident_unsupported(
          m.dim, &m.moe, m.moe.expert_hidden_dim,
          static_cast<int64_t>(m.moe.num_shared_experts) * m.moe.expert_hidden_dim, 1);
      shape += (shape.empty() || w.empty() ? "" : "; ") + w;
    }
    if (!shape.empty()) why.push_back("the model's FFN shapes: " + shape);
  }
  return why;
}

Status check_decode_backend(const std::string& backend, const LatencyDecodeSetup& setup) {
  ML4_RETURN_IF_ERROR(validate_decode_backend(backend));
  if (backend == "standard") return ok_status();
  const std::vector<std::string> why = latency_decode_refusals(setup);
  if (why.empty()) return ok_status();
  std::string msg = fmt::format("--decode-backend latency_specialized refused ({} reason{}); it never falls back to "
                                "the standard path:",
                                why.size(), why.size() == 1 ? "" : "s");
  for (const auto& w : why) msg += "\n  - " + w;
  return invalid_argument("{}", msg);
}

}  // namespace ml4
