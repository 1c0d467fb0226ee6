// `--decode-backend latency_specialized` (SYSTEM.md S17, issue 19): pure-decode steps of 1, 2
// or 4 requests as one resident kernel per layer, with bounded device-side waits and a sticky
// fault word. The path fails closed: a configuration it does not support is refused at
// start-up with every reason listed, never served by a silent fallback to the standard path.
//
// What is decided here is the start-up contract; the kernels come with the H200 work of issue
// 19. Until they exist, a build says so as one of the reasons, so the flag is always refused
// (with the configuration's other reasons listed too, so a user sees everything to change at
// once). `standard` (the default) is the path every other step runs on anyway.
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
  bool cuda_graphs = true;              // !--no-cuda-graphs
  bool batch_invariant = false;         // --batch-invariant (f32 activations)
  std::string kv_cache_dtype = "fp8_ds_mla";
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
