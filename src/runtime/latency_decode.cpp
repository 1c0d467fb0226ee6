#include "runtime/latency_decode.h"

#include <fmt/format.h>

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
  // The build first: what no flag can change.
  why.push_back(
      "this build has no latency-specialised decode kernels (issue 19: they are written and tested on the H200)");
  if (s.device != "cuda") why.push_back(fmt::format("--device {}: the path is a CUDA kernel (use --device cuda)", s.device));
  if (!s.cuda_graphs)
    why.push_back("--no-cuda-graphs: the latency path replays one CUDA graph per batch size (drop the flag)");
  if (s.batch_invariant)
    why.push_back("--batch-invariant: the latency kernels use the standard path's bf16/FP8 numerics, not f32 "
                  "activations (drop the flag)");
  if (s.kv_cache_dtype != "fp8_ds_mla")
    why.push_back(fmt::format("--kv-cache-dtype {}: the kernels read the fp8_ds_mla cache only", s.kv_cache_dtype));
  if (s.quantization != "auto")
    why.push_back(fmt::format("--quantization {}: the kernels stream FP8 block weights only", s.quantization));
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
    why.push_back(fmt::format("the checkpoint's weights are {}: the kernels stream FP8 block weights (ml4 quantize "
                              "--to fp8 IN OUT)",
                              weight_format_label(s.model->weight_format)));
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
