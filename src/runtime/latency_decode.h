// `--decode-backend latency_specialized` (SYSTEM.md S17, issue 19): steps of 1..4 tokens run
// each layer's FFN half (residual add, RMSNorm, router, experts or dense MLP, combine) as one
// resident kernel (ops/cuda/ffn_resident.h) with bounded device-side waits and a sticky fault
// word; the attention half runs the standard kernels. The path fails closed: a configuration
// it does not support is refused at start-up with every reason listed, never served by a silent
// fallback. Steps of more tokens (prefill) run the standard path in the same engine.
// `standard` (the default) is the path every other step runs on anyway.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "model/model_config.h"
#include "parallel/rank_layout.h"

namespace ml4 {

// What the start-up check looks at (the command's flags and the checkpoint's config).
struct LatencyDecodeSetup {
  std::string device = "cpu";           // --device
  bool batch_invariant = false;         // --batch-invariant (f32 activations)
  std::string quantization = "auto";    // --quantization (mxfp4: FP4 experts)
  ParallelConfig parallel;
  bool speculative = false;             // --speculative-config
  bool hisparse = false;                // HiSparse host KV offload
  const ModelConfig* model = nullptr;   // the checkpoint's config; null: not checked
};

// "standard" | "latency_specialized"; anything else is invalid_argument naming the value.
Status validate_decode_backend(const std::string& backend);

// Every reason `setup` cannot run the latency-specialised path, in a fixed order; empty when it
// can. Each reason names the flag or checkpoint property to change.
std::vector<std::string> latency_decode_refusals(const LatencyDecodeSetup& setup);

// OK for "standard"; for "latency_specialized" OK only when latency_decode_refusals is empty,
// else invalid_argument listing every reason, one per line.
Status check_decode_backend(const std::string& backend, const LatencyDecodeSetup& setup);

}  // namespace ml4
