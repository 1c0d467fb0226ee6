// CudaRunner: the CUDA backend behind the ModelRunner interface (SYSTEM.md S4, S5): the one
// model program (runtime/model_forward.h) over CudaBackend (cuda_backend.h), plus what a
// GPU runner adds around a step:
//   - loading (weights bf16, FP8 block or f32 as stored; NVFP4/MXFP4 refused with
//     kUnimplemented), or synthetic full-width weights made on the device (speed runs);
//   - the KV pools of every cache group (latent, indexer, drafter), from
//     RunnerOptions::kv_cache_bytes or, when gpu_memory_utilization > 0, that fraction of the
//     card's memory minus what is in use once the weights are resident (vLLM's
//     --gpu-memory-utilization);
//   - the step metadata upload (token ids, positions, slots, block tables, logits rows),
//     padded to a graph bucket, and the CUDA graphs of each bucket;
//   - sampling on the GPU when every sequence asks for it.
// execute_traced records the indexer's top-k sets and the routed experts and obeys forced
// ones (forward_trace.h): the golden tests run the CUDA runner exactly as the CPU one.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <string>
#include <vector>

#include "kv/cache_spec.h"
#include "model/model_weights.h"
#include "ops/cuda/fault.h"
#include "ops/cuda/sampling.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/model_forward.h"
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
  // MoE steps above kGroupedMoeMaxTokens run every expert's GEMMs in one grouped launch per
  // projection (moe_experts_forward_gemm: FP8 experts on e4m3 wgmma, NVFP4 / MXFP4 experts
  // expanded to bf16 (moe_gemm_fp4.cu); no host sync, capturable) instead of the loop over
  // experts. On by default since CudaMoe.GroupedGemmPrefillVsCpu
  // passed on a device (H100, 2026-12-05 sixth session); ml4-slice-4 prefill of 4096 tokens
  // 111.9 -> 89.4 ms on the H200 (docs/BENCHMARKS.md).
  bool grouped_moe_gemm = true;
  // The FP8 grouped GEMMs issue two K blocks' MMAs before the first one's promotion
  // (moe_gemm.h MoeGroupedGemmParams::overlap; the same bits). On since
  // CudaMoe.GroupedGemmOverlapIsBitIdentical (now GroupedGemmVariantsAreBitIdentical) passed on
  // an H100 (2026-12-05, ninth session):
  // gate+up at T = 4096 7.55 -> 6.60 ms, down unchanged, ml4-slice-4 prefill of 4096 tokens
  // 60.6 -> 59.9 ms.
  bool moe_gemm_overlap = true;
  // The FP8 grouped GEMMs on 128-row tiles (moe_gemm.h MoeGroupedGemmParams::tall; the same
  // bits; takes the place of moe_gemm_overlap): half the L2 bytes per FLOP, and each expert's
  // weights streamed from DRAM once per 128 rows instead of per 64 (ncu: the 64-row kernel is
  // DRAM-bound, reading the weights 2.2x at T = 4096). CudaMoe.GroupedGemmVariantsAreBitIdentical
  // passed on an H100 (tenth session): whole MoE at T = 4096 9.88 -> 8.58 ms there. Off since the
  // group-major order below reads the weights about once anyway, and the 64-row kernel beside it
  // wins on the H200 (eleventh session, gpu_moe_bench 4253 prefill 4096: 64-row overlap 8.88 ms,
  // + group-major 7.79; 128-row 8.52, + group-major 8.25).
  bool moe_gemm_tall = false;
  // The grouped GEMMs' CTAs group-major (MoeGroupedGemmParams::tile_first): an expert's tiles
  // of one weight slice run together and share it in L2. The same bits (the variants test
  // passed on the H200, 2026-12-06 eleventh session). On: whole MoE at T = 4096 8.88 -> 7.79 ms
  // with the 64-row overlapped kernel on the H200.
  bool moe_gemm_group_major = true;
  // The FP8 grouped GEMMs warp-specialized and persistent (moe_gemm.h
  // MoeGroupedGemmParams::specialized: the tall tiles and bits, a producer warpgroup staging the
  // operands (B by TMA), the scales and the item's rows, one CTA a multiprocessor; takes the
  // place of moe_gemm_tall and moe_gemm_overlap). On since the sixteenth session: the whole MoE
  // at T = 4096 with uniform routing 8.34 -> 6.99 ms (1.19x, H100, gpu_moe_bench), bit-identical;
  // ml4-slice-4 prefill of 4096 / 8192 tokens 3.6 / 8.2 ms faster than the 64-row kernel (H100,
  // seventeenth session; docs/BENCHMARKS.md "Seventeenth session").
  bool moe_gemm_specialized = true;
  // The FP8 grouped GEMMs with the tokens as the MMA's N (moe_gemm.h MoeGroupedGemmParams::swap:
  // tiles of up to 160 rows in steps of 16 instead of 64; takes the place of the other
  // variants; no quantizing epilogue). Sixteenth session: bit-identical, slower (whole MoE 8.27
  // ms against the specialized kernel's 6.99 at T = 4096, H100), off.
  bool moe_gemm_swap = false;
  // The down projection alone on the swapped kernel, gate_up on the specialized one (moe.h
  // MoeGemmOptions::swap_down; the same bits). Off: 1.05x the specialized kernel alone in the
  // MoE bench (uniform routing), 0.4-1.6 ms slower in the ml4-slice-4 prefill step (H100,
  // seventeenth session).
  bool moe_gemm_swap_down = false;
  // The FP8 grouped gate_up GEMM quantizes the hidden rows in its epilogue (moe.h
  // MoeGemmOptions::quant_epilogue; the same bytes as the separate quantization launch, so the
  // same bits, CudaMoe.GroupedGemmVariantsAreBitIdentical passed on an H100; not with
  // moe_gemm_tall). On: whole MoE at T = 4096 8.27 -> 8.12 ms, ml4-slice-4 prefill of 4096 /
  // 8192 tokens 53.2 -> 52.8 / 101.5 -> 100.4 ms (H100, fifteenth session, alternated runs).
  bool moe_quant_epilogue = true;
  // The MLA absorption (W_UK, W_UV) of steps of at least absorb_gemm_min_tokens tokens as
  // strided-batched TF32 GEMMs on the tensor cores (elementwise.h mla_absorb_q_gemm) instead
  // of the f32 CUDA-core kernels, outside exact mode (issue 18). Smaller steps keep the
  // weight-stationary kernels, which read the weights once for the whole step. On by default
  // since the H200 run of 2026-12-05 (fifth session): CudaElementwise.MlaAbsorptionGemmMatchesF64
  // at 2.9e-4 vs f64, CudaRunner.MatchesCpuRunnerProduction with it on every step within the
  // production bound; ml4-slice-4 prefill of 4096 tokens 89.4 -> 69.7 ms (absorption 21.7 ->
  // 1.9 ms).
  bool absorb_gemm = true;
  int64_t absorb_gemm_min_tokens = 64;
  // NVFP4 / MXFP4 linears (gemv.h: the tensor-core kernel, or the exact CUDA-core stream).
  // On by default since CudaGemv.Fp4MatchesCpuLinear, the FP4 cases of CudaMoe.* and the FP4
  // rows of CudaRunner.MatchesCpuRunnerExact passed on a device (H100, 2026-12-05); off refuses
  // FP4 weights at load.
  bool fp4_weights = true;
  // FP4 linears on the tensor cores (gemv.h GemvParams::x_parts): x as 1 bf16 part in
  // production (relative error <= 2^-9 per element, as vLLM's W4A16 kernels; 9% faster than 2
  // parts at batch 64), 2 or 3 (x exactly) on request; -1: the exact CUDA-core FP4 stream
  // (gemv_fp4.cuh), which exact_activations takes: both match cpu::linear to f32 rounding, but
  // the runner comparison of exact mode (ml4-tiny's random weights amplify any summation order
  // through near-tied routing) was calibrated on the stream (fp8-to-mxfp4 row: 5.1e-5 to 5.6e-3
  // with the stream across runs, 1.19e-2 once with 3 parts, bound 1e-2).
  int fp4_x_parts = 1;
  // Programmatic dependent launch (ops/cuda/pdl.cuh, issue 19): every kernel of ours starts
  // while the one before it drains and waits on the device for its results. The same kernels
  // on the same inputs, so the results are bit-identical either way
  // (CudaRunner.ProgrammaticLaunchIsBitIdentical passed on the H200, 2026-12-05). Off: the
  // ml4-slice-4 decode step gained 1% at batch 1 and 8 and lost 8% at batch 64 (step bench PDL
  // lines, docs/BENCHMARKS.md). programmatic_launch_tokens: decode steps of at most that many
  // tokens (their graph bucket) take it anyway: since the twenty-second session's stream
  // priorities and shared expert lane, batch 1 gains 1.2% with it (graph 1.736 -> 1.715 ms,
  // H100) while batch 2 is even and batch 4 loses 3.6% (ML4_PDL lines, docs/BENCHMARKS.md);
  // CudaRunner.ProgrammaticLaunchIsBitIdentical checks both. 0: never.
  bool programmatic_launch = false;
  int64_t programmatic_launch_tokens = 1;
  // The decode router fused (issue 19, ops/cuda/moe.h router_route): for steps of at most 8
  // tokens without forced experts, the router's f32 GEMV and the top-k routing in one launch
  // instead of cuBLAS's f32 GEMV (two kernels) and the route kernel. On since its GEMV loads
  // the gate row by float4s into registers (twelfth session): ml4-slice-4 decode on an H100
  // 1.003-1.007x at batch 1 and 4 (FUSEDROUTER lines; before, with a strided loop, 0.98x).
  bool fused_router = true;
  // The FFN norm of a MoE layer (residual += attention output, RMSNorm) inside the fused
  // router's launch (issue 19, moe.h RouterRouteParams::norm_w; Backend::norm_moe_router):
  // one launch and one serial row kernel fewer a MoE layer, the same bits
  // (CudaMoe.FusedRouterNormIsTheNormThenTheRouter, CudaRunner.FusedFfnNormIsBitIdentical passed
  // on an H100, twenty-first session). Only where fused_router applies, and not where
  // shared_expert_lane is taken (its lane forks between the norm and the router). Off: the
  // FUSEDFFNNORM lines measured 0.997-1.006 before the lane (twenty-first session); since the
  // lane is on they compare equal paths on ml4-slice-4.
  bool fused_ffn_norm = false;
  // The shared expert of a MoE layer on its own stream, started right after the FFN norm, so
  // that its weights stream while the router, its top-k and the permute run (issue 19; moe.h
  // MoeSharedPart; Backend::norm_moe_router): the decode steps' grouped path with the shared
  // expert in the extra slot, where its weights are at least shared_expert_lane_min_bytes (a
  // small one costs more in the fork and join than it hides: ml4-tiny 0.964x at batch 1). The
  // same launches split over two streams, so the same bits (CudaMoe.SharedExpertSplitIsBitIdentical,
  // CudaRunner.SharedExpertLaneIsBitIdentical passed on an H100, 2026-12-07 twenty-second
  // session). The lane's stream has the least priority and every other the greatest, so the
  // router's blocks go first (without the priorities batch 1 gained nothing). On: ml4-slice-4
  // decode at 8k, H100, graphs: batch 1 1.903 -> 1.861 ms (1.023x), 4 1.029x, 8 1.018x
  // (SHAREDLANE lines; docs/BENCHMARKS.md "Twenty-second session").
  bool shared_expert_lane = true;
  int64_t shared_expert_lane_min_bytes = int64_t{16} << 20;
  // A step's metadata (token ids, positions, slots, block tables, logits rows) written into
  // pinned, device-mapped host memory and moved into the device buffers by one kernel launch
  // (ops/cuda/host_copy.h) instead of ten-odd cudaMemcpyAsync calls from pageable vectors, each a
  // driver call on the host and a copy on the card in series before the forward (issue 19: the
  // step's time outside its graph); and the sampler writing its tokens and logprobs straight
  // into mapped host memory instead of two read-back copies after it. The same bytes arrive
  // (CudaRunner.MappedStepIoIsBitIdentical). MAPPEDIO lines: 1.013x at batch 1 on an H100
  // (twenty-third session).
  bool mapped_step_io = true;
  // Issue 19's indexer fusions: the key half (LayerNorm, RoPE, Hadamard + FP8 into its cache)
  // as one kernel instead of three (cache_write.h indexer_key_path), and the queries' RoPE
  // inside their Hadamard + FP8 (indexer.h IndexerQueryQuantParams::rope) instead of two. On
  // since CudaCacheWrite.IndexerKeyPathEqualsTheThreeLaunches, CudaIndexer.QueryQuantWithRope*
  // and CudaRunner.FusedIndexerIsBitIdentical passed on an H100 (2026-12-05, ninth session;
  // the same bytes and logits): ml4-slice-4 decode 1.001-1.005x (FUSEDINDEXER lines). Since the
  // fourteenth session it also gates the latent row's path (RMSNorm + RoPE + cache write as one
  // kernel, cache_write.h latent_key_path; CudaCacheWrite.LatentKeyPathEqualsTheThreeLaunches).
  bool fused_indexer = true;
  // The final residual + RMSNorm writes the logits rows itself when a step's rows are its
  // tokens in order (decoding, DSpark's verification; Backend::rows_are_tokens): no gather of
  // the rows and no second norm of the same values, two launches fewer a step. Both paths norm
  // the same stored f32 residual with the same kernel, so the logits are the same bits
  // (CudaRunner.FinalNormRowsAreBitIdentical); off only for that comparison.
  bool final_norm_rows = true;
  // DSpark's rejection sampler on the device (ops/cuda/sampling.h verify_rows) for random
  // requests (top-k / top-p too since the tenth session: CudaSampling.DraftRows* /
  // VerifyRows* with them passed on an H100): draft() keeps their q in a buffer reserved at load
  // (max_num_seqs x (block - 1) x vocab floats, before the KV pool is sized) and execute()
  // verifies there, so neither the 1 + k target rows nor q cross to the host. On since
  // CudaSampling.VerifyRowsMatchTheHostVerifier and CudaDrafter.DeviceRejectionSampling*
  // passed on an H100 (2026-12-05, ninth session; ml4-small T = 1 prob7 TPOT c1 / c8 / c32
  // 0.77 / 1.62 / 2.73 -> 0.61 / 1.12 / 1.56 ms); the environment's ML4_DEVICE_VERIFY=1 / 0
  // overrides it at load.
  bool device_verification = true;
  // `--decode-backend latency_specialized` (issue 19; runtime/latency_decode.h checks the
  // configuration at start-up): steps of 1..4 tokens run each layer's FFN half as one resident
  // kernel (ops/cuda/ffn_resident.h) whose device waits end after latency_wait_timeout_s with a
  // fault that fails the step and every later one. The attention half runs the standard kernels.
  bool latency_decode = false;
  double latency_wait_timeout_s = 10.0;
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
  bool applies_token_masks() const override { return true; }
  bool verifies_on_device(const DeviceSamplingParams& p) const override;
  std::vector<KvRegion> kv_regions() override;
  void bind_thread() const override;
  bool has_drafter() const override { return program_->has_drafter(); }
  Result<DraftOutput> draft(const DraftInput& in) override;
  void release(int64_t seq_id) override {
    if (hisparse_) hisparse_->release(seq_id);
    drop_kept_q(seq_id);
  }
  // Sequences whose drafts' q the runner holds for device verification (tests: leaks).
  size_t kept_q_count() const { return kept_q_.size(); }
  // Random requests' verifications done on the device.
  int64_t device_verifications() const { return device_verifications_; }
  const HiSparseState* hisparse() const override { return hisparse_.get(); }
  // HiSparse: bytes of the hot buffers (device) and of the host pool (pinned host memory).
  int64_t hot_bytes() const { return backend_->hot_bytes(); }
  int64_t host_kv_bytes() const { return backend_->host_kv_bytes(); }

  int64_t weight_bytes() const { return backend_->weight_bytes(); }
  // Bytes of all routed experts of all layers (the rest of weight_bytes is read every step).
  int64_t routed_expert_bytes() const { return backend_->routed_expert_bytes(); }
  int64_t embedding_bytes() const { return backend_->embedding_bytes(); }
  double requant_seconds() const { return backend_->requant_seconds(); }
  int64_t requant_transient_bytes() const { return backend_->requant_transient_bytes(); }
  // Benchmarks: finite random bytes in every latent and indexer page.
  Status fill_kv_synthetic(uint64_t seed) { return backend_->fill_kv_synthetic(seed); }
  void set_cuda_graphs(bool on) { opts_.cuda_graphs = on; }
  // Benchmarks: switch a path of CudaRunnerOptions (programmatic_launch, absorb_gemm,
  // grouped_moe_gemm, overlap_indexer, fp4_x_parts) on or off; each drops the captured graphs,
  // which hold one schedule or the other.
  void set_programmatic_launch(bool on) {
    opts_.programmatic_launch = on;
    graphs_.clear();
    draft_graphs_.clear();
  }
  void set_programmatic_launch_tokens(int64_t n) {
    opts_.programmatic_launch_tokens = n;
    graphs_.clear();
    draft_graphs_.clear();
  }
  void set_fused_indexer(bool on) {
    opts_.fused_indexer = on;
    backend_->set_fused_indexer(on);
    graphs_.clear();
    draft_graphs_.clear();
  }
  // `--decode-backend latency_specialized` on or off (the step bench's A/B).
  Status set_latency_decode(bool on) {
    ML4_RETURN_IF_ERROR(backend_->set_resident_ffn(on, fault_.device()));
    opts_.latency_decode = on;
    graphs_.clear();
    draft_graphs_.clear();
    return ok_status();
  }
  void set_fused_router(bool on) {
    opts_.fused_router = on;
    backend_->set_fused_router(on);
    graphs_.clear();
    draft_graphs_.clear();
  }
  void set_mapped_step_io(bool on) { opts_.mapped_step_io = on; }
  void set_shared_expert_lane(bool on) {
    opts_.shared_expert_lane = on;
    backend_->set_shared_expert_lane(on);
    graphs_.clear();
    draft_graphs_.clear();
  }
  void set_fused_ffn_norm(bool on) {
    opts_.fused_ffn_norm = on;
    backend_->set_fused_ffn_norm(on);
    graphs_.clear();
    draft_graphs_.clear();
  }
  void set_absorb_gemm(bool on) {
    opts_.absorb_gemm = on;
    backend_->set_absorb_gemm(on);
    graphs_.clear();
  }
  void set_moe_gemm_overlap(bool on) {
    opts_.moe_gemm_overlap = on;
    backend_->set_moe_gemm_overlap(on);
    graphs_.clear();
  }
  void set_moe_gemm_tall(bool on) {
    opts_.moe_gemm_tall = on;
    backend_->set_moe_gemm_tall(on);
    graphs_.clear();
  }
  void set_moe_gemm_group_major(bool on) {
    opts_.moe_gemm_group_major = on;
    backend_->set_moe_gemm_group_major(on);
    graphs_.clear();
  }
  void set_moe_gemm_specialized(bool on) {
    opts_.moe_gemm_specialized = on;
    backend_->set_moe_gemm_specialized(on);
    graphs_.clear();
  }
  void set_moe_gemm_swap(bool on) {
    opts_.moe_gemm_swap = on;
    backend_->set_moe_gemm_swap(on);
    graphs_.clear();
  }
  void set_moe_gemm_swap_down(bool on) {
    opts_.moe_gemm_swap_down = on;
    backend_->set_moe_gemm_swap_down(on);
    graphs_.clear();
  }
  void set_moe_quant_epilogue(bool on) {
    opts_.moe_quant_epilogue = on;
    backend_->set_moe_quant_epilogue(on);
    graphs_.clear();
  }
  // The MLA prefill kernel's schedule (CudaBackendOptions::mla_prefill_pairs), for the step bench.
  void set_mla_prefill_pairs(bool on) {
    backend_->set_mla_prefill_pairs(on);
    graphs_.clear();
  }
  // The MLA latents of prefill steps in bf16 (CudaBackendOptions::mla_latent_bf16), for the step
  // bench (on only where the backend made W_UK / W_UV's bf16 copies at load, i.e. it started on).
  void set_mla_latent_bf16(bool on) {
    backend_->set_mla_latent_bf16(on);
    graphs_.clear();
  }
  bool mla_latent_bf16() const { return backend_->mla_latent_bf16(); }
  int64_t latent_bf16_attentions() const { return backend_->latent_bf16_attentions(); }
  // cuBLASLt's FP8 GEMMs writing y row-major (LtGemm::set_fp8_row_out), for the step bench.
  void set_fp8_row_out(bool on) {
    backend_->set_fp8_row_out(on);
    graphs_.clear();
  }
  bool fp8_row_out() const { return backend_->fp8_row_out(); }
  // The indexer's wgmma scores kernel (CudaBackendOptions::indexer_wgmma), for the step bench.
  void set_indexer_wgmma(bool on) {
    backend_->set_indexer_wgmma(on);
    graphs_.clear();
  }
  void set_grouped_moe_gemm(bool on) {
    opts_.grouped_moe_gemm = on;
    backend_->set_grouped_moe_gemm(on);
    graphs_.clear();
  }
  void set_overlap_indexer(bool on) {
    opts_.overlap_indexer = on;
    backend_->set_overlap_indexer(on);
    graphs_.clear();
  }
  void set_fp4_x_parts(int parts) {
    opts_.fp4_x_parts = parts;
    backend_->set_fp4_x_parts(parts);
    graphs_.clear();
  }
  // Benchmarks: when set, eager steps add the GPU milliseconds of each piece of the forward
  // (attention, MoE router, experts, dense FFN, lm_head, ...) into *p by label.
  void set_profile(std::map<std::string, double>* p) { backend_->set_profile(p); }
  // Tests: the bytes of one page (group index as in cache_groups(), layer slot, block).
  Status read_cache_page(int group, int layer_slot, int64_t block, std::vector<uint8_t>* out) const;
  // Decode steps served by replaying a captured graph, and graphs held.
  int64_t graph_replays() const { return graph_replays_; }
  // Benchmarks (ml4 bench step's STEPSPLIT lines): the last graphed step's forward n more times,
  // back to back on the runner's stream, with no metadata upload, sampling or host
  // synchronisation between them (the same cache slots written again), and the device
  // milliseconds per forward by events: the device's part of a step, the rest of execute()'s
  // time being the host's and the sampling's.
  Result<double> replay_last_graph_ms(int n);
  // Draft steps served by replaying a captured graph.
  int64_t draft_replays() const { return draft_replays_; }
  // Layers whose indexer ran overlapped on the second stream (eager and captured steps).
  int64_t overlapped_layers() const { return backend_->overlapped_layers(); }
  int64_t fused_ffn_norms() const { return backend_->fused_ffn_norms(); }
  int64_t shared_lane_runs() const { return backend_->shared_lane_runs(); }
  // Steps run with programmatic dependent launch (programmatic_launch, programmatic_launch_tokens).
  int64_t programmatic_steps() const { return programmatic_steps_; }
  // The host's time in execute_step's parts, summed over the device-sampled steps since the
  // last reset (issue 19: where a step's time outside its graph goes; the step bench's HOSTSPLIT
  // lines): prep (metadata built and copied, until the forward is issued), launch (the forward
  // issued: the graph launch and the layer program's walk in replay), tail (the sampling issued,
  // and the read-back copies without mapped_step_io), wait (until the stream is done).
  struct HostSplit {
    double prep_us = 0, launch_us = 0, tail_us = 0, wait_us = 0;
    int64_t steps = 0;
  };
  const HostSplit& host_split() const { return host_split_; }
  void reset_host_split() { host_split_ = {}; }
  size_t graphs_captured() const { return graphs_.size(); }
  int64_t kv_bytes() const { return backend_->kv_bytes(); }
  // The sticky fault record the runner's kernels write and every step checks (tests inject a
  // fault through it: ops/cuda/fault.h run_barrier_probe).
  const FaultWord& fault_word() const { return fault_; }
  // Tests (latency_decode): the resident FFN kernel's block that never arrives at its first
  // barrier, and the bound of its waits (cuda_backend.h set_resident_fault_test).
  void set_resident_fault_test(int never_arrive_block, double timeout_s) {
    backend_->set_resident_fault_test(never_arrive_block, static_cast<uint64_t>(timeout_s * 1e9));
    graphs_.clear();  // captured launches hold the old values
    draft_graphs_.clear();
  }
  // Resident FFN launches issued (eager steps and graph captures; replays not counted).
  int64_t resident_ffn_launches() const { return backend_->resident_ffn_launches(); }
  Result<std::vector<uint64_t>> resident_trace() const { return backend_->resident_trace(); }

 private:
  CudaRunner() = default;
  Result<StepOutput> execute_step(const StepInput& in, ForwardTrace* trace);
  Result<DraftOutput> draft_step(const DraftInput& in);
  static Result<std::unique_ptr<CudaRunner>> create(const ModelConfig& cfg, const ModelWeights& weights,
                                                    const CudaRunnerOptions& opts, uint64_t synthetic_seed,
                                                    const std::string& model_dir);
  Status run_forward(CudaBackend::Mode mode, std::vector<GraphExec>* segments, const StepMetadata* md,
                     ForwardTrace* trace);
  // Copies `n` floats from the device to the pinned staging buffer (grown as needed) on the
  // stream, waits, and returns them: rows going to the host cross at the link's rate, without
  // a pageable bounce or a zero-filled vector.
  Result<const float*> download_floats(const void* device, size_t n, cudaStream_t stream);
  // Device verification (CudaRunnerOptions::device_verification): the kept q of `seq_id`
  // dropped, its slot freed; and the step's verifications checked and staged before the
  // forward runs (`vseqs` / `vdrafts`, the SeqStep index of each), then launched and read.
  void drop_kept_q(int64_t seq_id);
  Status stage_verification(const StepInput& in, std::vector<VerifySeq>* vseqs, std::vector<int32_t>* vdrafts,
                            std::vector<size_t>* vindex) const;
  Status run_verification(const StepInput& in, const std::vector<VerifySeq>& vseqs, const std::vector<int32_t>& vdrafts,
                          const std::vector<size_t>& vindex, StepOutput* out);

  ModelConfig cfg_;
  int device_ = 0;  // the CUDA device current when the runner was made
  CudaRunnerOptions opts_;
  KvCacheSpec spec_;
  std::vector<CacheGroupInfo> groups_;
  int64_t max_model_len_ = 0;
  std::unique_ptr<CudaBackend> backend_;
  std::unique_ptr<Communicator> tp_comm_, ep_comm_;  // NCCL, parallel ranks only (before program_)
  std::unique_ptr<HiSparseState> hisparse_;            // HiSparse only (before program_)
  std::unique_ptr<ModelForward> program_;
  // This step's launch shape (padded in graph mode).
  int64_t step_T_ = 0, step_R_ = 0, step_maxlen_ = 1;
  int64_t step_bucket_T_ = 0;  // the step's graph bucket (tokens), graphed or not
  bool step_rows_are_tokens_ = false;  // begin_forward's rows_are_tokens for this step's forward
  // (tokens, logits rows, max length, table stride, rows are the tokens) -> the step's graph
  // segments in order.
  using GraphKey = std::tuple<int64_t, int64_t, int64_t, int64_t, bool>;
  std::map<GraphKey, std::vector<GraphExec>> graphs_;
  std::optional<GraphKey> last_graph_;  // the last step's graph when it had one (replay_last_graph_ms)
  int64_t graph_replays_ = 0;
  int64_t programmatic_steps_ = 0;  // steps run with programmatic dependent launch
  HostSplit host_split_;
  // Greedy DSpark draft steps: (sequences, block-table stride) -> the draft's graph segments.
  std::map<std::pair<int64_t, int64_t>, std::vector<GraphExec>> draft_graphs_;
  int64_t draft_replays_ = 0;
  bool draft_graphs_ok_ = true;  // false after a failed capture: drafts run eagerly
  FaultWord fault_;              // kernels' sticky fault record (ops/cuda/fault.h), checked around each step
  DeviceBuffer host_stage_;      // pinned host memory: logits rows and draft distributions (download_floats)
  DeviceBuffer step_stage_;      // pinned, device-mapped: a step's metadata (mapped_step_io)
  DeviceBuffer sampled_out_;     // pinned, device-mapped: a step's sampled tokens, then logprobs (mapped_step_io)
  std::vector<float> large_download_;  // download_floats past the pinned size, until the next call
  // Device verification: per kept sequence its slot of (block - 1) q rows in verify_q_ and the
  // drafts they belong to; free slots; the verifier's inputs and outputs.
  struct KeptQ {
    int64_t slot = 0;
    std::vector<int32_t> tokens;
  };
  std::map<int64_t, KeptQ> kept_q_;
  std::vector<int64_t> free_q_slots_;
  DeviceBuffer verify_q_, verify_seqs_, verify_drafts_, verify_tokens_, verify_logprobs_, verify_accepted_, verify_ws_;
  int64_t device_verifications_ = 0;
};

// The engine-facing factory (the CPU one is load_cpu_runner).
Result<std::unique_ptr<ModelRunner>> load_cuda_runner(const std::string& model_dir, const RunnerOptions& opts,
                                                      double gpu_memory_utilization);

}  // namespace ml4::cuda
