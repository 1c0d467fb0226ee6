// The backend choice shared by `serve`, `generate` and `bench step`: --device cpu|cuda and
// --gpu-memory-utilization (vLLM's flag: the fraction of the card the process may fill;
// the KV pool gets what the weights leave). An explicit --kv-cache-memory-bytes wins over
// the fraction, as in vLLM. The default device is the CPU, which every build has; a
// build without the CUDA backend refuses --device cuda with a clear error.
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "core/status.h"
#include "runtime/cpu/cpu_runner.h"
#include "runtime/model_runner.h"
#if defined(ML4_WITH_CUDA)
#include "runtime/cuda/cuda_runner.h"
#endif

namespace ml4 {

struct DeviceOptions {
  std::string device = "cpu";
  double gpu_memory_utilization = 0.9;
  bool cuda_graphs = true;
  CLI::Option* kv_bytes_option = nullptr;  // set by add_device_options' caller
};

inline void add_device_options(CLI::App* cmd, DeviceOptions* d) {
  cmd->add_option("--device", d->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--gpu-memory-utilization", d->gpu_memory_utilization,
                  "cuda: fraction of GPU memory for weights + KV cache")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_flag("!--no-cuda-graphs", d->cuda_graphs, "cuda: run decode steps eagerly");
}

inline Result<std::unique_ptr<ModelRunner>> load_runner_on(const DeviceOptions& d, const std::string& model,
                                                           const RunnerOptions& ro) {
  if (d.device == "cpu") return load_cpu_runner(model, ro);
#if defined(ML4_WITH_CUDA)
  cuda::CudaRunnerOptions co;
  co.base = ro;
  const bool explicit_bytes = d.kv_bytes_option != nullptr && d.kv_bytes_option->count() > 0;
  co.gpu_memory_utilization = explicit_bytes ? 0.0 : d.gpu_memory_utilization;
  co.cuda_graphs = d.cuda_graphs;
  ML4_ASSIGN_OR_RETURN(auto r, cuda::CudaRunner::load(model, co));
  return std::unique_ptr<ModelRunner>(std::move(r));
#else
  return unimplemented("--device {}: this ml4 was built without the CUDA backend (cmake -DML4_CUDA=ON)", d.device);
#endif
}

}  // namespace ml4
