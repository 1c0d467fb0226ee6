// Speed measurement of the CUDA runner's decode step (issue 6, "Decode step"): the body of
// bench/gpu_decode_step_bench.cpp and `ml4 bench step`. A full-width preset (e.g.
// ml4-slice-4, ~45 GB) runs on synthetic device-made weights (synthetic_weights.h) with KV
// pages of finite random bytes.
//
// Each STEP line is the wall time of CudaRunner::execute (host metadata upload, the graph
// or eager launches, sampling on the GPU (temperature 0.8, top-k 50, top-p 0.95) and the
// token copy to the host, the synchronization: what the engine waits for), median of 20
// after 3 warm-ups, against the roofline
//   bytes = weights read (everything but the routed experts and the token embedding table,
//           plus B rows of that table, plus the expected number of distinct routed experts
//           for B tokens: E (1 - (1 - k/E)^B) per MoE layer; the table was counted whole
//           before the twelfth session, 1.61 GB too many on ml4-slice-4)
//         + KV read (per layer min(ctx, top-k) latent rows; per indexer owner all ctx keys
//           and the f32 scores written and read back)
//   roofline = bytes / measured copy bandwidth (gpu_ceilings_bench).
// With `extras`: the same steps returning logits, graphs vs eager at batch 1 (also on
// ml4-tiny), the indexer overlapped vs serial at batch 1 / 8 / 64, a per-piece profile at
// batch 1 and 64, prefill tokens/s (MoE through the expert loop and through the grouped
// GEMMs) and a per-piece profile of each 4096-token prefill.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ml4::cuda {

struct StepBenchOptions {
  std::string preset = "ml4-slice-4";
  std::vector<int> batches{1, 8, 32, 64};
  std::vector<int64_t> contexts{8192, 61440};
  double copy_gbps = 4253.0;                 // the roofline's bandwidth
  int64_t kv_cache_bytes = int64_t{20} << 30;  // enough for max batch x max context of ml4-slice-4
  bool extras = true;
  // Routed experts' format: "fp8" (the preset's), "nvfp4" or "mxfp4" (issue 18's decode rows;
  // the rest of the model stays FP8), or "fp8-to-mxfp4" (made FP8, re-quantized on the device
  // at load: a REQUANT line with its time and transient memory).
  std::string experts = "fp8";
  // > 0: instead, HiSparse's decode-step overhead (offload/hisparse.h): the same steps on a
  // runner with the latent KV in pinned host memory and hot buffers of this many rows, against
  // the runner without offload (graphs on, and eager as HiSparse runs), HISPARSE lines.
  int hisparse_slots = 0;
};

// Prints STEP / STEP_LOGITS / GRAPHS / OVERLAP / PROFILE / PREFILL lines to stdout.
// Returns 0, or 1 when the model cannot be built (message on stderr).
int run_step_bench(const StepBenchOptions& opt);
int run_hisparse_step_bench(const StepBenchOptions& opt);

}  // namespace ml4::cuda
