// CudaRunner: the CUDA backend behind the ModelRunner interface (SYSTEM.md S4), the same
// forward as CpuModel (src/runtime/cpu_model.cpp, cpu_attention.cpp) with every step on
// the GPU: embedding, fused add+RMSNorm, query LoRA, q path (RoPE/YaRN/LeRoPE, llama_4
// temperature, SSMax), latent row -> paged fp8_ds_mla/fp8/bf16 cache, absorbed MLA over
// the pages (ops/cuda/attention.h), W_UV, wo, dense or MoE FFN (f32 router, grouped
// top-k, experts, shared expert), final norm and the logits rows.
//
// DSA (MODEL.md 3.5): indexer owners compute the indexer query/key/weights, write the key
// (Hadamard + FP8) into the indexer pages, score every visible key (indexer.h), pick the
// causal top-k by radix select (topk.h) straight into cache slots, and attention reads only
// those slots (sparse mla_attention); reusers attend to their source's slots. SSMax's n is
// then the number of selected keys, as on the CPU.
// Cache groups: latent, indexer, and the drafter group, whose pages are allocated and
// reported to the engine but not yet written (S7, block drafting, is not implemented on
// any backend).
// Scope (refused at load with kUnimplemented otherwise): weights bf16, fp8 block or f32
// (NVFP4/MXFP4 not yet).
// execute_traced records the indexer's top-k sets and the routed experts and obeys forced
// ones (forward_trace.h): the golden tests run the CUDA runner exactly as the CPU one.
// Linears: M <= 8 rows (decode) go through our GEMV (f32 activations, gemv.h); larger M
// through cuBLASLt (bf16 / e4m3 activations). exact_activations forces the GEMV path in
// 8-row chunks everywhere: every linear then matches cpu::linear to f32 rounding, which
// is what the whole-model test against CpuRunner uses.
// KV memory: RunnerOptions::kv_cache_bytes, or, when gpu_memory_utilization > 0, that
// fraction of the card's memory minus what is in use once the weights are resident
// (vLLM's --gpu-memory-utilization).
#pragma once

#include <map>
#include <memory>
#include <tuple>
#include <string>
#include <vector>

#include "kv/cache_spec.h"
#include "model/model_weights.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"
#include "runtime/model_runner.h"
#include "runtime/step_metadata.h"

namespace ml4::cuda {

struct CudaRunnerOptions {
  RunnerOptions base;
  double gpu_memory_utilization = 0.0;  // (0, 1]: size the KV pool from the card's memory
  bool exact_activations = false;
  // Steps replay CUDA graphs (one set per padded shape and context bucket): decode steps of
  // up to max_graph_batch sequences padded to a power of two, other steps of up to
  // max_graph_tokens tokens padded to a multiple of 64, each split around the work that reads
  // results back to the host (the MoE expert loop); larger and traced steps run eagerly.
  bool cuda_graphs = true;
  int max_graph_batch = 64;
  int64_t max_graph_tokens = 512;
  // An indexer owner's DSA chain (its projections, key cache write, scores, top-k) runs on a
  // second stream, overlapping the q / kv projections and the W_UK absorption, when every
  // linear of the layer takes the GEMV (decode-sized steps or exact numerics) and the step is
  // neither traced nor profiled. The result does not change: the two branches share no output.
  bool overlap_indexer = true;
};

class CudaRunner : public ModelRunner {
 public:
  static Result<std::unique_ptr<CudaRunner>> load(const std::string& model_dir, const CudaRunnerOptions& opts);
  // Speed measurements only: cfg's shapes with device-made values (synthetic_weights.h).
  static Result<std::unique_ptr<CudaRunner>> load_synthetic(const ModelConfig& cfg, const CudaRunnerOptions& opts,
                                                            uint64_t seed);
  ~CudaRunner() override;

  const ModelConfig& config() const override { return cfg_; }
  const std::vector<CacheGroupInfo>& cache_groups() const override { return groups_; }
  Result<StepOutput> execute(const StepInput& in) override { return execute_traced(in, nullptr); }
  Result<StepOutput> execute_traced(const StepInput& in, ForwardTrace* trace) override;
  // Draws on the GPU (sampling.h) when every sequence of a step asks for device sampling.
  bool samples_on_device() const override { return true; }
  std::vector<KvRegion> kv_regions() override;

  int64_t weight_bytes() const { return weight_bytes_; }
  // Bytes of all routed experts of all layers (the rest of weight_bytes is read every step).
  int64_t routed_expert_bytes() const { return routed_expert_bytes_; }
  // Benchmarks: finite random bytes in every latent and indexer page.
  Status fill_kv_synthetic(uint64_t seed);
  void set_cuda_graphs(bool on) { opts_.cuda_graphs = on; }
  // Benchmarks: turn the indexer overlap (CudaRunnerOptions::overlap_indexer) off or back on;
  // drops the captured graphs, which hold one schedule or the other.
  void set_overlap_indexer(bool on) {
    opts_.overlap_indexer = on;
    graphs_.clear();
  }
  // Benchmarks: when set, eager steps add the GPU milliseconds of each piece of the forward
  // (attention, MoE router, experts, dense FFN, lm_head, ...) into *p by label.
  void set_profile(std::map<std::string, double>* p) { profile_ = p; }
  // Tests: the bytes of one page (group index as in cache_groups(), layer slot, block).
  Status read_cache_page(int group, int layer_slot, int64_t block, std::vector<uint8_t>* out) const;
  // Decode steps served by replaying a captured graph, and graphs held.
  int64_t graph_replays() const { return graph_replays_; }
  // Layers whose indexer ran overlapped on the second stream (eager and captured steps).
  int64_t overlapped_layers() const { return overlapped_layers_; }
  size_t graphs_captured() const { return graphs_.size(); }
  int64_t kv_bytes() const { return kv_bytes_; }

 private:
  struct Layer;
  struct Buffers;
  CudaRunner() = default;
  static Result<std::unique_ptr<CudaRunner>> create(const ModelConfig& cfg, const ModelWeights& weights,
                                                    const CudaRunnerOptions& opts, uint64_t synthetic_seed,
                                                    const std::string& model_dir);
  Status upload(const ModelWeights& w);
  Status ensure_buffers(int64_t T, int64_t R, int64_t S, int64_t max_blocks);
  Status lin(const DeviceLinear& w, const float* x, int64_t M, float* y);
  Status mlp(const DeviceMlp& m, const float* x, int64_t M, float* y);
  Status forward(const StepMetadata* md, ForwardTrace* trace);
  template <typename F>
  Status timed(const char* label, F&& fn);
  Status attention(int l, const StepMetadata* md, float* out, ForwardTrace* trace);
  Status indexer(int l, ForwardTrace* trace);
  Status indexer_keys(int l);
  Status indexer_select(int l, ForwardTrace* trace);
  bool overlap_indexer(int l, ForwardTrace* trace) const;
  template <typename F>
  Status on_side(F&& fn);
  QPathParams rope_params(float* x, int heads, int stride, int offset, int dim, const float* inv_freq) const;
  Status moe_route_step(int l, int64_t T);
  Status moe_trace(int l, int64_t T, ForwardTrace* trace);
  bool moe_grouped(const Layer& L, int64_t T) const;
  Status moe_experts(int l, int64_t T, float* out);

  ModelConfig cfg_;
  CudaRunnerOptions opts_;
  KvCacheSpec spec_;
  std::vector<CacheGroupInfo> groups_;
  int latent_group_ = 0, indexer_group_ = -1;
  int64_t max_model_len_ = 0;
  int64_t num_blocks_ = 0;
  std::vector<DeviceBuffer> kv_;                      // [latent slot] pages
  std::vector<DeviceBuffer> idx_kv_;                  // [indexer slot] pages
  std::vector<DeviceBuffer> other_kv_;                // drafter pages (allocated, unused)
  std::vector<int64_t> group_blocks_;
  std::vector<int> topk_buf_;                         // [layer] which top-k buffer an owner fills
  int num_topk_bufs_ = 0;
  std::vector<int> latent_read_slot_;
  std::vector<std::vector<int>> latent_write_slots_;
  std::vector<Layer> layers_;
  DeviceBuffer embed_, norm_, inv_freq_, idx_inv_freq_;
  DType embed_dtype_ = DType::kBF16;
  DeviceLinear output_;
  float rope_factor_ = 1.0f;
  int64_t max_in_ = 0, max_hidden_ = 0;
  std::unique_ptr<LtGemm> lt_;
  std::unique_ptr<Buffers> buf_;
  cudaStream_t stream_ = nullptr;
  // The indexer's branch (overlap_indexer): its stream, fork / q-latent-ready / join events, and
  // whether stream_ currently is the side stream (on_side swaps them; lin() then uses the side
  // GEMV workspace).
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t ev_fork_ = nullptr, ev_qlat_ = nullptr, ev_join_ = nullptr;
  bool on_side_ = false;
  int64_t overlapped_layers_ = 0;
  int64_t weight_bytes_ = 0, kv_bytes_ = 0, routed_expert_bytes_ = 0;
  uint64_t synthetic_seed_ = 0;  // non-zero: linears made on the device (load_synthetic)
  // This step's launch shape (padded in graph mode).
  int64_t step_T_ = 0, step_R_ = 0, step_maxlen_ = 1;
  // Bumped whenever a step buffer is reallocated: captured graphs hold old addresses.
  uint64_t buffer_generation_ = 0;
  struct GraphExec {
    explicit GraphExec(cudaGraphExec_t e) : exec(e) {}
    GraphExec(GraphExec&& o) noexcept : exec(o.exec) { o.exec = nullptr; }
    GraphExec(const GraphExec&) = delete;
    ~GraphExec() {
      if (exec) cudaGraphExecDestroy(exec);
    }
    operator cudaGraphExec_t() const { return exec; }
    cudaGraphExec_t exec = nullptr;
  };
  // (tokens, logits rows, max length, table stride) -> the step's graph segments in order.
  using GraphKey = std::tuple<int64_t, int64_t, int64_t, int64_t>;
  std::map<GraphKey, std::vector<GraphExec>> graphs_;
  enum class Mode { kEager, kCapture, kReplay };
  Mode mode_ = Mode::kEager;
  std::vector<GraphExec>* capture_ = nullptr;        // kCapture: segments recorded so far
  const std::vector<GraphExec>* replay_ = nullptr;   // kReplay: segments to launch
  int64_t graph_replays_ = 0;
  std::map<std::string, double>* profile_ = nullptr;
};

// The engine-facing factory (the CPU one is load_cpu_runner).
Result<std::unique_ptr<ModelRunner>> load_cuda_runner(const std::string& model_dir, const RunnerOptions& opts,
                                                      double gpu_memory_utilization);

}  // namespace ml4::cuda
