// The backend choice shared by `serve`, `generate` and `bench step`: --device cpu|cuda and
// --gpu-memory-utilization (vLLM's flag: the fraction of the card the process may fill;
// the KV pool gets what the weights leave). An explicit --kv-cache-memory-bytes wins over
// the fraction, as in vLLM. The default device is the CPU, which every build has; a
// build without the CUDA backend refuses --device cuda with a clear error.
//
// Parallelism (SYSTEM.md S10, docs/PARALLEL.md), vLLM's flags: --tensor-parallel-size / -tp,
// --data-parallel-size / -dp, --enable-expert-parallel. Ranks are processes launched by
// mpirun (`mpirun -np 4 ml4 serve -tp 4 ...`, one node or a hostfile); without mpirun a
// command with more than one rank relaunches itself under `mpirun -np N` on this node. Rank 0
// continues as the command (server, engine, scheduler); the other ranks serve its steps and
// end with it. CUDA ranks take the GPU of their node-local rank (CUDA_VISIBLE_DEVICES, unless
// set).
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "core/log.h"
#include "core/status.h"
#include "model/config_loader.h"
#include "parallel/mpi_env.h"
#include "parallel/rank_layout.h"
#include "runtime/cpu/cpu_runner.h"
#include "runtime/latency_decode.h"
#include "runtime/model_runner.h"
#include "runtime/parallel_runner.h"
#if defined(ML4_WITH_CUDA)
#include "runtime/cuda/cuda_runner.h"
#endif

namespace ml4 {

struct DeviceOptions {
  std::string device = "cpu";
  double gpu_memory_utilization = 0.9;
  bool cuda_graphs = true;
  bool batch_invariant = false;
  std::string dtype = "auto";  // cpu: the linears' activations (RunnerOptions::dtype)
  std::string quantization = "auto";  // mxfp4: RunnerOptions::experts_to_mxfp4
  bool mmap = false, no_mmap = false;  // cpu: RunnerOptions::weight_memory (neither: auto)
  std::string decode_backend = "standard";  // runtime/latency_decode.h
  double latency_wait_timeout_s = 10.0;     // the resident kernel's device-side waits
  CLI::Option* kv_bytes_option = nullptr;  // set by add_device_options' caller
  ParallelConfig parallel;
};

// Decode and prefill context parallelism (SYSTEM.md S8, S9; vLLM's flags); also on `ml4 capacity`.
inline void add_dcp_options(CLI::App* cmd, ParallelConfig* p) {
  cmd->add_option("--decode-context-parallel-size", p->decode_context_parallel_size,
                  "-dcp: shard the KV cache by token over this many of the TP ranks (must divide -tp); KV capacity "
                  "grows by this factor")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--dcp-kv-cache-interleave-size", p->dcp_kv_cache_interleave_size,
                  "DCP: consecutive tokens kept on one rank before the next (must divide the 64-token page)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--dcp-comm-backend", p->dcp_comm_backend,
                  "DCP: combine the ranks' partial attention by one all-to-all (a2a) or an all-gather of lse and a "
                  "reduce-scatter (ag_rs)")
      ->check(CLI::IsMember({"a2a", "ag_rs"}))
      ->capture_default_str();
  cmd->add_option("--prefill-context-parallel-size", p->prefill_context_parallel_size,
                  "-pcp: split each prompt's tokens over this many rank groups (each with the -tp shard of the "
                  "weights; world = dp x pcp x tp); cuts prefill time")
      ->check(CLI::PositiveNumber);
}

inline void add_device_options(CLI::App* cmd, DeviceOptions* d) {
  cmd->add_option("--device", d->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--gpu-memory-utilization", d->gpu_memory_utilization,
                  "cuda: fraction of GPU memory for weights + KV cache")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_flag("!--no-cuda-graphs", d->cuda_graphs, "cuda: run decode steps eagerly");
  cmd->add_flag("--batch-invariant", d->batch_invariant,
                "cuda: exact numerics (f32 activations through the GEMV, f32 attention and indexer), so a token's "
                "result does not depend on the batch or on how its prompt was split (prefix-cache hits, P/D); "
                "slower. The CPU backend always is");
  cmd->add_option("--dtype", d->dtype,
                  "cpu: the linear layers' activations: auto / float32 (exact, the default) or bfloat16 (rounded to "
                  "bf16 and summed in f32 by AVX512_BF16 dot products, as vLLM and transformers run a bf16 model; "
                  "about 2x the prefill matrix rate; needs a CPU with AVX512_BF16). On cuda, --batch-invariant "
                  "chooses f32 activations")
      ->check(CLI::IsMember({"auto", "float32", "float", "f32", "bfloat16", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--quantization,-q", d->quantization,
                  "weights as the checkpoint stores them (auto), or mxfp4: an FP8 checkpoint's routed experts "
                  "re-quantized to MXFP4 at load (half their bytes; the rest stays FP8). vLLM's flag; other "
                  "checkpoints are refused with it")
      ->check(CLI::IsMember({"auto", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--decode-backend", d->decode_backend,
                  "standard, or latency_specialized: steps of 1 to 4 tokens run each layer's FFN half (norm, "
                  "router, experts, combine) as one resident kernel that fails closed (bounded waits, a sticky "
                  "fault word that stops the engine). A configuration it does not support is refused at start-up "
                  "with every reason listed; it never falls back")
      ->check(CLI::IsMember({"standard", "latency_specialized"}))
      ->capture_default_str();
  cmd->add_option("--latency-wait-timeout", d->latency_wait_timeout_s,
                  "latency_specialized: seconds a resident kernel's block waits at a grid barrier before it "
                  "records a device fault (the step fails, /health turns unhealthy, the engine stops)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  auto* no_mmap = cmd->add_flag("--no-mmap", d->no_mmap,
                                "cpu: copy the linear weights into memory advised for huge pages (faster decode: "
                                "decode streams every weight per token); the default for checkpoints of 256 MiB "
                                "and more that fit in half of the available memory. llama.cpp's flag");
  cmd->add_flag("--mmap", d->mmap,
                "cpu: run the linear weights from the checkpoint's file mapping (page cache, shared between "
                "processes; the default for checkpoints under 256 MiB or over half of the available memory)")
      ->excludes(no_mmap);
  cmd->add_option("--tensor-parallel-size", d->parallel.tensor_parallel_size,
                  "-tp: ranks the attention heads, FFN and vocabulary are split over (one process per rank)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--data-parallel-size", d->parallel.data_parallel_size,
                  "-dp: replicas of attention, each with its own sequences and KV cache (needs "
                  "--enable-expert-parallel)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--enable-expert-parallel", d->parallel.enable_expert_parallel,
                "split the routed experts over all dp x tp ranks (tokens dispatched by all-to-all)");
  add_dcp_options(cmd, &d->parallel);
}

// One rank's runner on its device (no parallelism).
inline Result<std::unique_ptr<ModelRunner>> load_local_runner_on(const DeviceOptions& d, const std::string& model,
                                                                 const RunnerOptions& ro_in) {
  RunnerOptions ro = ro_in;
  if (d.quantization == "mxfp4") {  // re-quantizes FP8 experts: any other checkpoint is refused, not ignored
    ML4_ASSIGN_OR_RETURN(const ModelConfig cfg, load_model_config(model));
    if (cfg.weight_format != WeightFormat::kFP8Block)
      return invalid_argument("--quantization mxfp4 re-quantizes the routed experts of an FP8 checkpoint; {} is not "
                              "one (to convert a bf16 model: ml4 quantize --to mxfp4 IN OUT)", model);
    ro.experts_to_mxfp4 = true;
  }
  if (d.device == "cpu") {
    RunnerOptions o = ro;
    o.dtype = d.dtype;
    o.weight_memory = d.no_mmap ? WeightMemory::kCopy : d.mmap ? WeightMemory::kMapped : WeightMemory::kAuto;
    return load_cpu_runner(model, o);
  }
  if (d.dtype != "auto")
    return invalid_argument("--dtype {} applies to --device cpu; on cuda, --batch-invariant chooses f32 activations",
                            d.dtype);
#if defined(ML4_WITH_CUDA)
  cuda::CudaRunnerOptions co;
  co.base = ro;
  const bool explicit_bytes = d.kv_bytes_option != nullptr && d.kv_bytes_option->count() > 0;
  co.gpu_memory_utilization = explicit_bytes ? 0.0 : d.gpu_memory_utilization;
  co.cuda_graphs = d.cuda_graphs;
  co.exact_activations = d.batch_invariant;
  co.latency_decode = d.decode_backend == "latency_specialized";
  co.latency_wait_timeout_s = d.latency_wait_timeout_s;
  ML4_ASSIGN_OR_RETURN(auto r, cuda::CudaRunner::load(model, co));
  return std::unique_ptr<ModelRunner>(std::move(r));
#else
  return unimplemented("--device {}: this ml4 was built without the CUDA backend (cmake -DML4_CUDA=ON)", d.device);
#endif
}

// The start-up check of --decode-backend (runtime/latency_decode.h): every reason at once.
inline Status check_decode_backend_on(const DeviceOptions& d, const std::string& model, const RunnerOptions& ro) {
  if (d.decode_backend == "standard") return ok_status();
  LatencyDecodeSetup s;
  s.device = d.device;
  s.batch_invariant = d.batch_invariant;
  s.quantization = d.quantization;
  s.parallel = d.parallel;
  s.speculative = ro.drafter;
  s.hisparse = ro.hisparse.enabled;
  auto cfg = load_model_config(model);  // a bad model directory is reported by the load itself
  if (cfg.ok()) s.model = &cfg.value();
  return check_decode_backend(d.decode_backend, s);
}

// The runner a command drives. Under parallelism a worker rank never returns: it serves rank
// 0's steps and then ends the process (0 when rank 0 stopped the group, 1 on a failure).
inline Result<std::unique_ptr<ModelRunner>> load_runner_on(const DeviceOptions& d, const std::string& model,
                                                           const RunnerOptions& ro) {
  ML4_RETURN_IF_ERROR(check_decode_backend_on(d, model, ro));
  const int launched = MpiEnv::launched_world_size();
  if (!d.parallel.parallel() && launched == 1) return load_local_runner_on(d, model, ro);
  ML4_RETURN_IF_ERROR(d.parallel.validate());
  if (!MpiEnv::launched_by_mpi()) {
    ML4_RETURN_IF_ERROR(MpiEnv::relaunch_under_mpirun(d.parallel.world_size()));
  }
  if (d.device == "cuda" && std::getenv("CUDA_VISIBLE_DEVICES") == nullptr)
    if (const char* lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) setenv("CUDA_VISIBLE_DEVICES", lr, 1);
  Status worker_status;
  auto local = [&](const RunnerOptions& o) { return load_local_runner_on(d, model, o); };
  ML4_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> r,
                       load_parallel_runner(d.parallel, model, ro, local, &worker_status));
  if (r == nullptr) {  // a worker whose group has finished
    if (!worker_status.ok()) ML4_LOG_ERROR("{}", worker_status.message());
    std::exit(worker_status.ok() ? 0 : 1);
  }
  return r;
}

}  // namespace ml4
