// See step_bench.h.
#include "runtime/cuda/step_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "kv/indexer_layout.h"
#include "kv/latent_layout.h"
#include "model/presets.h"
#include "runtime/cuda/cuda_runner.h"

namespace ml4::cuda {
namespace {


using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

StepInput decode_step(const CudaRunner& r, int batch, int64_t ctx, int64_t blocks_per_seq) {
  StepInput in;
  for (int i = 0; i < batch; ++i) {
    SeqStep s;
    s.seq_id = i;
    s.tokens = {1 + i};
    s.start_pos = ctx - 1;
    s.num_logits = 1;
    s.device_sampling = DeviceSamplingParams{0.8f, 50, 0.95f, 0.0f, 1234u, ctx};  // drawn on the GPU
    for (const auto& g : r.cache_groups()) {
      std::vector<int32_t> bt;
      if (g.sliding_window == 0)
        for (int64_t b = 0; b < (ctx + 63) / 64; ++b) bt.push_back(static_cast<int32_t>(i * blocks_per_seq + b));
      s.block_tables.push_back(std::move(bt));
    }
    in.seqs.push_back(std::move(s));
  }
  return in;
}

// The median step time; a failed step aborts the bench (nothing sensible to measure after it)
// unless `failed` is given: then it gets the error and the result is -1.
double time_step(CudaRunner& r, const StepInput& in, int warm, int reps, std::string* failed = nullptr) {
  std::vector<double> ms;
  for (int i = 0; i < warm + reps; ++i) {
    const auto t0 = Clock::now();
    auto o = r.execute(in);
    if (i >= warm) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    if (o.ok()) continue;
    std::fprintf(stderr, "step failed: %s\n", o.status().message().c_str());
    if (failed == nullptr) std::abort();
    *failed = o.status().message();
    return -1.0;
  }
  return median(ms);
}

// This card's copy bandwidth: a 1 GiB device-to-device copy, bytes read + written, median of 10
// (the convention of gpu_ceilings_bench's "HBM copy" ceiling). 0 when it cannot be measured.
double measure_copy_gbps() {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess) return 0.0;
  if (cudaMalloc(&b, bytes) != cudaSuccess) {
    cudaFree(a);
    return 0.0;
  }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> ms;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(e0);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0.0f;
    cudaEventElapsedTime(&t, e0, e1);
    if (i >= 2) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  const bool ok = cudaGetLastError() == cudaSuccess;
  const double m = median(ms);
  return ok && m > 0.0 ? 2.0 * bytes / (m * 1e6) : 0.0;
}

// ML4_RESIDENT_TRACE=1: each resident FFN launch of the last eager step, its phases in us from
// the earliest block's start (min / max over blocks of each point; ffn_resident.h).
void print_resident_trace(const CudaRunner& r, int layers) {
  auto t = r.resident_trace();
  if (!t.ok() || t->empty()) return;
  const int64_t per = int64_t{ffn_resident_max_blocks()} * kTracePoints;
  static const char* names[kTracePoints] = {"start", "norm", "bar1", "router", "phase1", "bar2", "routed",
                                            "phase2", "bar3", "end"};
  for (int l = 0; l < layers && (l + 1) * per <= static_cast<int64_t>(t->size()); ++l) {
    const uint64_t* L = t->data() + l * per;
    uint64_t t0 = UINT64_MAX;
    for (int64_t b = 0; b < ffn_resident_max_blocks(); ++b)
      if (L[b * kTracePoints] != 0) t0 = std::min(t0, L[b * kTracePoints]);
    if (t0 == UINT64_MAX) continue;
    std::printf("RESIDENT_TRACE layer=%d", l);
    for (int k = 0; k < kTracePoints; ++k) {
      uint64_t lo = UINT64_MAX, hi = 0;
      for (int64_t b = 0; b < ffn_resident_max_blocks(); ++b) {
        const uint64_t v = L[b * kTracePoints + k];
        if (v == 0) continue;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      if (hi == 0) continue;
      std::printf(" %s=%.1f..%.1f", names[k], (lo - t0) / 1e3, (hi - t0) / 1e3);
    }
    std::printf(" us\n");
  }
}

}  // namespace

int run_step_bench(const StepBenchOptions& opt) {
  const double hbm_gbps = opt.copy_gbps > 0 ? opt.copy_gbps : 4253.0;
  // The roofline keeps the H200's figure (comparable across sessions); the ratio against this
  // card's own copy bandwidth is printed beside it (an H100's is ~3.0 TB/s, not 4.25).
  const double card_gbps = measure_copy_gbps();
  std::printf("COPY card_gbps=%.0f roofline_gbps=%.0f (1 GiB device-to-device, read + written)\n", card_gbps, hbm_gbps);
  const std::string& preset = opt.preset;
  auto cfg_r = preset_config(preset);
  if (!cfg_r.ok()) {
    std::fprintf(stderr, "%s\n", cfg_r.status().message().c_str());
    return 1;
  }
  ModelConfig cfg = *cfg_r;
  if (opt.experts == "nvfp4") {
    cfg.weight_format = WeightFormat::kNVFP4Experts;
  } else if (opt.experts == "mxfp4") {
    cfg.weight_format = WeightFormat::kMXFP4Experts;
  } else if (opt.experts != "fp8" && opt.experts != "fp8-to-mxfp4") {
    std::fprintf(stderr, "bench step: experts %s (fp8, nvfp4, mxfp4 or fp8-to-mxfp4)\n", opt.experts.c_str());
    return 1;
  }
  const int64_t kMaxCtx = *std::max_element(opt.contexts.begin(), opt.contexts.end());
  const int64_t kMaxBatch = *std::max_element(opt.batches.begin(), opt.batches.end());
  const int64_t blocks_per_seq = (kMaxCtx + 63) / 64;
  // The lines after the STEP table decode at 8192 tokens of context, or the largest --ctx when
  // smaller (a small model's max_model_len, e.g. ml4-tiny's 4096).
  const int64_t fixed_ctx = std::min<int64_t>(8192, kMaxCtx);
  CudaRunnerOptions o;
  o.base.kv_cache_dtype = "fp8_ds_mla";
  // Latent + indexer pages for 64 x 60k tokens, and the drafter's share of the split.
  o.base.kv_cache_bytes = opt.kv_cache_bytes;
  o.max_graph_batch = kMaxBatch;
  o.fp4_weights = opt.experts != "fp8";
  o.base.experts_to_mxfp4 = opt.experts == "fp8-to-mxfp4";  // made FP8, re-quantized on the device at load
  // ML4_LATENCY_DECODE=1: every line (the ncu step too) on `--decode-backend latency_specialized`.
  if (const char* v = std::getenv("ML4_LATENCY_DECODE"); v && v[0] == '1') o.latency_decode = true;
  // ML4_SHARED_EXPERT_LANE=1 / 0: the lines (the traced and ncu steps too) with the shared expert
  // on its lane or not (CudaRunnerOptions::shared_expert_lane; the A/B lines set their own).
  if (const char* v = std::getenv("ML4_SHARED_EXPERT_LANE"); v && (v[0] == '0' || v[0] == '1'))
    o.shared_expert_lane = v[0] == '1';
  // ML4_BATCH_INVARIANT=1: every line in the exact mode (`--batch-invariant`: f32 activations, the
  // GEMVs on gemv_tc at every M, the router in chunks of 8 tokens), for its cost.
  if (const char* v = std::getenv("ML4_BATCH_INVARIANT"); v && v[0] == '1') o.exact_activations = true;
  // ML4_PDL=1 / 0: every line with programmatic dependent launch, or none (CudaRunnerOptions::
  // programmatic_launch, programmatic_launch_tokens).
  if (const char* v = std::getenv("ML4_PDL"); v && v[0] == '1') o.programmatic_launch = true;
  else if (v && v[0] == '0') o.programmatic_launch_tokens = 0;
  const auto t0 = Clock::now();
  auto rr = CudaRunner::load_synthetic(cfg, o, 1234);
  if (!rr.ok()) {
    std::fprintf(stderr, "%s\n", rr.status().message().c_str());
    return 1;
  }
  auto& r = **rr;
  if (!r.fill_kv_synthetic(99).ok()) return 1;
  const double setup_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (r.cache_groups()[0].num_blocks < kMaxBatch * blocks_per_seq) {
    std::fprintf(stderr, "KV pool too small: %ld blocks\n", static_cast<long>(r.cache_groups()[0].num_blocks));
    return 1;
  }
  // ML4_BENCH_NCU_STEP=B (issue 19's per-kernel profile): one eager decode step of batch B at the
  // largest context between cudaProfilerStart / Stop, for `ncu --profile-from-start off`, after
  // the same step timed with graphs and eager; then nothing else.
  if (const char* v = std::getenv("ML4_BENCH_NCU_STEP"); v && std::atoi(v) > 0) {
    const int batch = std::atoi(v);
    const StepInput in = decode_step(r, batch, kMaxCtx, blocks_per_seq);
    const double g = time_step(r, in, 3, 20);
    r.set_cuda_graphs(false);
    const double e = time_step(r, in, 3, 20);
    cudaDeviceSynchronize();
    cudaProfilerStart();
    const bool ok = r.execute(in).ok();
    cudaDeviceSynchronize();
    cudaProfilerStop();
    r.set_cuda_graphs(true);
    std::printf("NCUSTEP model=%s batch=%d ctx=%ld latency_decode=%d graph_ms=%.3f eager_ms=%.3f profiled_step_ok=%d\n",
                preset.c_str(), batch, static_cast<long>(kMaxCtx), o.latency_decode ? 1 : 0, g, e, ok ? 1 : 0);
    print_resident_trace(r, cfg.n_layers);
    return ok ? 0 : 1;
  }
  // ML4_BENCH_TRACE_STEP=B: ten graphed decode steps of batch B at the largest context between
  // cudaProfilerStart / Stop, for the CUPTI tracer (bench/cupti_trace.cpp) and
  // bench/step_timeline.py (the time between kernels, per boundary, and the host's share of a
  // step); then nothing else.
  if (const char* v = std::getenv("ML4_BENCH_TRACE_STEP"); v && std::atoi(v) > 0) {
    const int batch = std::atoi(v);
    const StepInput in = decode_step(r, batch, kMaxCtx, blocks_per_seq);
    const double g = time_step(r, in, 3, 20);
    cudaDeviceSynchronize();
    cudaProfilerStart();
    const double p = time_step(r, in, 0, 10);
    cudaDeviceSynchronize();
    cudaProfilerStop();
    std::printf("TRACESTEP model=%s batch=%d ctx=%ld latency_decode=%d graph_ms=%.3f profiled_ms=%.3f\n",
                preset.c_str(), batch, static_cast<long>(kMaxCtx), o.latency_decode ? 1 : 0, g, p);
    return 0;
  }
  const int E = cfg.moe.num_experts, K = cfg.moe.num_experts_per_tok;
  int moe_layers = 0, owners = 0;
  for (const auto& l : cfg.layers) {
    moe_layers += l.ffn == FfnKind::kMoe;
    owners += l.indexer == IndexerRole::kOwner;
  }
  // Read by every step: the weights but the routed experts and the token embedding table (of
  // which a step reads one row a token, counted below). Until the twelfth session the table
  // (1.61 GB of bf16 on ml4-slice-4) was counted whole: every roofline before was 1.6 GB high.
  const double always = static_cast<double>(r.weight_bytes() - r.routed_expert_bytes() - r.embedding_bytes());
  const double embed_row = static_cast<double>(r.embedding_bytes()) / cfg.vocab_size;
  const double per_expert = moe_layers > 0 ? static_cast<double>(r.routed_expert_bytes()) / (E * moe_layers) : 0.0;
  const double row = static_cast<double>(latent_token_bytes(KvCacheDtype::kFp8DsMla, cfg.kv_lora_rank, cfg.qk_rope_head_dim));
  const double ikey = static_cast<double>(indexer_token_bytes(cfg.indexer.head_dim));
  std::printf("MODEL %s (%s experts): %d layers, weights %.2f GB (routed experts %.2f GB), kv pool %.2f GB, setup %.1f s\n",
              preset.c_str(), opt.experts.c_str(), cfg.n_layers, r.weight_bytes() / 1e9, r.routed_expert_bytes() / 1e9, r.kv_bytes() / 1e9,
              setup_s);
  if (o.base.experts_to_mxfp4)
    std::printf("REQUANT fp8->mxfp4 on the device: %.2f s for %.2f GB of MXFP4 experts; beyond the result at most %.1f "
                "MB (one FP8 matrix) while it ran\n",
                r.requant_seconds(), r.routed_expert_bytes() / 1e9, r.requant_transient_bytes() / 1e6);
  // The bytes a decode step of `batch` sequences at `ctx` must read: the weights (each routed
  // expert once if any token picks it, the expected distinct count under uniform routing), one
  // embedding row a token, the attended latent rows and the indexer's keys. Its KV part out.
  auto step_bytes = [&](int batch, int64_t ctx, double* kv_out) {
    const double experts = moe_layers > 0 ? E * (1.0 - std::pow(1.0 - static_cast<double>(K) / E, batch)) : 0.0;
    double kv = 0.0;
    for (const auto& l : cfg.layers) {
      kv += batch * row * (l.sparse() ? std::min<double>(ctx, cfg.indexer.topk) : static_cast<double>(ctx));
      if (l.indexer == IndexerRole::kOwner) kv += batch * ctx * (ikey + 8.0);
    }
    if (kv_out) *kv_out = kv;
    return always + batch * embed_row + experts * per_expert * moe_layers + kv;
  };
  // ML4_BENCH_PREFILL_ONLY=1: no decode lines, and of the prefill lines the defaults and their
  // variants only (a short device call).
  const char* prefill_only_env = std::getenv("ML4_BENCH_PREFILL_ONLY");
  const bool prefill_only = prefill_only_env != nullptr && prefill_only_env[0] == '1';
  if (!prefill_only) {
    for (int64_t ctx : opt.contexts) {
      for (int batch : opt.batches) {
        const StepInput in = decode_step(r, batch, ctx, blocks_per_seq);
        const int64_t replays = r.graph_replays();
        const double ms = time_step(r, in, 3, 20);
        const bool graphed = r.graph_replays() > replays;
        double kv = 0.0;
        const double bytes = step_bytes(batch, ctx, &kv);
        const double roof = bytes / (hbm_gbps * 1e6);
        std::printf("STEP batch=%d ctx=%ld ms=%.3f graphs=%d roofline_ms=%.3f ratio=%.2f bytes_gb=%.2f (weights %.2f, "
                    "kv %.3f) tok_s=%.0f card_ratio=%.2f\n",
                    batch, static_cast<long>(ctx), ms, graphed ? 1 : 0, roof, ms / roof, bytes / 1e9,
                    (bytes - kv) / 1e9, kv / 1e9, batch / ms * 1e3,
                    card_gbps > 0 ? ms / (bytes / (card_gbps * 1e6)) : 0.0);
      }
    }
    // Where a step's time goes beside its graph (issue 19, the host's part): the step as
    // execute() runs it (top-k / top-p sampling on the device, as in the STEP lines), the same
    // with greedy sampling (one argmax), and the graph's forward alone, replayed back to back
    // without the host between (CudaRunner::replay_last_graph_ms): the device's part. outside_ms
    // = step - graph: the metadata upload, the graph launch's latency, the sampling kernels, the
    // read-back and the host's turn-around, during which the card is idle.
    for (int batch : opt.batches) {
      StepInput in = decode_step(r, batch, fixed_ctx, blocks_per_seq);
      for (int i = 0; i < 3; ++i) (void)time_step(r, in, 0, 1);  // warm-up (a capture's host time is not a step's)
      r.reset_host_split();
      const double step = time_step(r, in, 0, 20);
      const CudaRunner::HostSplit hs = r.host_split();
      auto graph = r.replay_last_graph_ms(20);
      if (!graph.ok()) {
        std::fprintf(stderr, "STEPSPLIT: %s\n", graph.status().message().c_str());
        break;
      }
      for (auto& s : in.seqs) s.device_sampling->temperature = 0.0f;
      const double greedy = time_step(r, in, 3, 20);
      const double roof = step_bytes(batch, fixed_ctx, nullptr) / (hbm_gbps * 1e6);
      std::printf("STEPSPLIT model=%s batch=%d ctx=%ld step_ms=%.3f greedy_step_ms=%.3f graph_ms=%.3f outside_ms=%.3f "
                  "roofline_ms=%.3f graph_ratio=%.2f\n",
                  preset.c_str(), batch, static_cast<long>(fixed_ctx), step, greedy, *graph, step - *graph, roof,
                  *graph / roof);
      // The host's side of the same 20 steps (means, us; CudaRunner::HostSplit).
      if (hs.steps > 0) {
        const double n = static_cast<double>(hs.steps);
        std::printf("HOSTSPLIT model=%s batch=%d prep_us=%.1f launch_us=%.1f tail_us=%.1f wait_us=%.1f sum_us=%.1f "
                    "step_us=%.1f\n",
                    preset.c_str(), batch, hs.prep_us / n, hs.launch_us / n, hs.tail_us / n, hs.wait_us / n,
                    (hs.prep_us + hs.launch_us + hs.tail_us + hs.wait_us) / n, step * 1e3);
      }
    }
    if (o.fp4_weights) {  // FP4 experts on the tensor cores: x in 1, 2 or 3 bf16 parts (gemv.h)
      for (int batch : {1, 8, 64}) {
        const StepInput fin = decode_step(r, batch, fixed_ctx, blocks_per_seq);
        double ms[4] = {0, 0, 0, 0};  // [0]: the CUDA-core stream (fp4_x_parts -1)
        for (int parts = 0; parts <= 3; ++parts) {
          r.set_fp4_x_parts(parts == 0 ? -1 : parts);
          ms[parts] = time_step(r, fin, 3, 20);
        }
        r.set_fp4_x_parts(o.fp4_x_parts);
        std::printf("FP4PARTS experts=%s batch=%d ctx=%ld stream_ms=%.3f parts1_ms=%.3f parts2_ms=%.3f "
                    "parts3_ms=%.3f\n",
                    opt.experts.c_str(), batch, static_cast<long>(fixed_ctx), ms[0], ms[1], ms[2], ms[3]);
      }
    }
    for (int batch : {1, 64}) {  // the same step returning logits (host sampling) instead
      StepInput in = decode_step(r, batch, fixed_ctx, blocks_per_seq);
      for (auto& s : in.seqs) s.device_sampling.reset();
      std::printf("STEP_LOGITS batch=%d ctx=%ld ms=%.3f (logits to the host, no device sampling)\n",
                  batch, static_cast<long>(fixed_ctx),
                  time_step(r, in, 3, 20));
    }
    // A fusion on vs off at batch 1 / 4 / 8, each set explicitly and the default restored after
    // (the lines once took the runner's current setting as "off", so a fusion that is on by
    // default measured itself twice and stayed off for every line after).
    auto fusion_ab = [&](const char* label, const std::function<void(bool)>& set, bool dflt) {
      for (int batch : {1, 4, 8}) {
        // A batch above --batch's largest runs as a padded 64-token graph (the twenty-first and
        // twenty-second sessions' batch-8 lines, 11.5-12.5 ms, were such steps).
        if (batch > kMaxBatch) continue;
        const StepInput fin = decode_step(r, batch, fixed_ctx, blocks_per_seq);
        set(false);
        const int64_t replays = r.graph_replays();
        const double off = time_step(r, fin, 3, 20);
        set(true);
        const double on = time_step(r, fin, 3, 20);
        set(dflt);
        // graphs=0: an eager step (the step did not replay a graph).
        std::printf("%s model=%s batch=%d ctx=%ld fused_ms=%.3f plain_ms=%.3f gain=%.3f graphs=%d\n", label,
                    preset.c_str(), batch, static_cast<long>(fixed_ctx), on, off, off / on,
                    r.graph_replays() > replays ? 1 : 0);
      }
    };
    // `--decode-backend latency_specialized` (issue 19: each layer's FFN half as one resident
    // kernel) vs the standard path, batch 1 / 2 / 4 at both the fixed and the largest context,
    // graphs on, against the roofline (H200 rate) and this card's copy rate.
    if (!o.fp4_weights) {
      for (int64_t ctx : {fixed_ctx, kMaxCtx}) {
        for (int batch : {1, 2, 4}) {
          const StepInput lin = decode_step(r, batch, ctx, blocks_per_seq);
          (void)r.set_latency_decode(false);
          const double standard = time_step(r, lin, 3, 20);
          if (Status st = r.set_latency_decode(true); !st.ok()) {
            std::fprintf(stderr, "latency path: %s\n", st.message().c_str());
            return 1;
          }
          const double latency = time_step(r, lin, 3, 20);
          (void)r.set_latency_decode(o.latency_decode);
          const double bytes = step_bytes(batch, ctx, nullptr);
          std::printf("LATENCY model=%s batch=%d ctx=%ld latency_ms=%.3f standard_ms=%.3f gain=%.3f ratio=%.2f "
                      "card_ratio=%.2f (roofline %.3f ms at %.0f GB/s)\n",
                      preset.c_str(), batch, static_cast<long>(ctx), latency, standard, standard / latency,
                      latency / (bytes / (hbm_gbps * 1e6)), card_gbps > 0 ? latency / (bytes / (card_gbps * 1e6)) : 0.0,
                      bytes / (hbm_gbps * 1e6), hbm_gbps);
        }
        if (kMaxCtx == fixed_ctx) break;
      }
    }
    // The decode router fused with its top-k (moe.h router_route) vs cuBLAS's GEMV + route_kernel.
    fusion_ab("FUSEDROUTER", [&](bool on) { r.set_fused_router(on); }, CudaRunnerOptions{}.fused_router);
    // The FFN norm inside the fused router's launch (CudaRunnerOptions::fused_ffn_norm).
    fusion_ab("FUSEDFFNNORM", [&](bool on) { r.set_fused_ffn_norm(on); }, CudaRunnerOptions{}.fused_ffn_norm);
    // Programmatic dependent launch on single-token decode steps (CudaRunnerOptions::
    // programmatic_launch_tokens 1 against 0; the batch 4 and 8 lines compare equal paths).
    fusion_ab("PDL1", [&](bool on) { r.set_programmatic_launch_tokens(on ? 1 : 0); },
              CudaRunnerOptions{}.programmatic_launch_tokens > 0);
    // The shared expert on its own lane beside the router (CudaRunnerOptions::shared_expert_lane).
    fusion_ab("SHAREDLANE", [&](bool on) { r.set_shared_expert_lane(on); }, CudaRunnerOptions{}.shared_expert_lane);
    // The step's metadata through mapped host memory in one launch (CudaRunnerOptions::mapped_step_io).
    fusion_ab("MAPPEDIO", [&](bool on) { r.set_mapped_step_io(on); }, CudaRunnerOptions{}.mapped_step_io);
    // The indexer fusions (CudaRunnerOptions::fused_indexer) vs the separate launches.
    fusion_ab("FUSEDINDEXER", [&](bool on) { r.set_fused_indexer(on); }, CudaRunnerOptions{}.fused_indexer);
    if (!opt.extras) return 0;
    {  // Graphs vs eager, batch 1, 8k.
      const StepInput in = decode_step(r, 1, fixed_ctx, blocks_per_seq);
      const double g = time_step(r, in, 3, 20);
      r.set_cuda_graphs(false);
      const double e = time_step(r, in, 3, 20);
      r.set_cuda_graphs(true);
      std::printf("GRAPHS model=%s batch=1 ctx=%ld graph_ms=%.3f eager_ms=%.3f speedup=%.2f\n",
                  preset.c_str(), static_cast<long>(fixed_ctx), g, e,
                  e / g);
      for (int batch : {1, 8, 64}) {  // programmatic dependent launch (pdl.cuh) on vs off, graphs on
        const StepInput pin = decode_step(r, batch, fixed_ctx, blocks_per_seq);
        r.set_programmatic_launch_tokens(0);
        const double off = time_step(r, pin, 3, 20);
        r.set_programmatic_launch(true);
        const double on = time_step(r, pin, 3, 20);
        r.set_programmatic_launch(o.programmatic_launch);
        r.set_programmatic_launch_tokens(o.programmatic_launch_tokens);
        std::printf("PDL model=%s batch=%d ctx=%ld pdl_ms=%.3f plain_ms=%.3f gain=%.2f\n",
                    preset.c_str(), batch, static_cast<long>(fixed_ctx), on,
                    off, off / on);
      }
      for (int batch : {1, 8, 64}) {  // the indexer on the main stream vs overlapped (graphs on)
        const StepInput oin = decode_step(r, batch, fixed_ctx, blocks_per_seq);
        const double with = time_step(r, oin, 3, 20);
        r.set_overlap_indexer(false);
        const double without = time_step(r, oin, 3, 20);
        r.set_overlap_indexer(true);
        std::printf("OVERLAP batch=%d ctx=%ld indexer_overlapped_ms=%.3f serial_ms=%.3f gain=%.2f\n",
                    batch, static_cast<long>(fixed_ctx), with,
                    without, without / with);
      }
      // Where the time goes (eager, events around each piece; adds a sync per piece).
      for (int batch : {1, 64}) {
        const StepInput pin = decode_step(r, batch, fixed_ctx, blocks_per_seq);
        std::map<std::string, double> prof;
        r.set_cuda_graphs(false);
        r.set_profile(&prof);
        const int reps = 5;
        for (int i = 0; i < reps; ++i)
          if (!r.execute(pin).ok()) return 1;
        r.set_profile(nullptr);
        r.set_cuda_graphs(true);
        for (const auto& [k, v] : prof) std::printf("PROFILE batch=%d ctx=%ld %s ms=%.3f\n",
                                                    batch, static_cast<long>(fixed_ctx), k.c_str(), v / reps);
      }
    }
    {  // Graphs where launches dominate: ml4-tiny (12 small layers), batch 1.
      auto tiny_cfg = preset_config("ml4-tiny");
      CudaRunnerOptions to;
      to.base.kv_cache_dtype = "fp8_ds_mla";
      to.base.kv_cache_bytes = int64_t{256} << 20;
      auto tr = CudaRunner::load_synthetic(*tiny_cfg, to, 7);
      if (tr.ok()) {
        const StepInput in = decode_step(**tr, 1, 1024, 16);
        const double g = time_step(**tr, in, 3, 50);
        (*tr)->set_cuda_graphs(false);
        const double e = time_step(**tr, in, 3, 50);
        std::printf("GRAPHS model=ml4-tiny batch=1 ctx=1024 graph_ms=%.3f eager_ms=%.3f speedup=%.2f\n", g, e, e / g);
      }
    }
  }  // !prefill_only
  // ML4_BENCH_PREFILL_MAX=N: only the prefills of at most N tokens (a short device call).
  const char* prefill_max = std::getenv("ML4_BENCH_PREFILL_MAX");
  for (int64_t n : {int64_t{4096}, int64_t{8192}, int64_t{32768}}) {  // prefill: one sequence, last-token logits
    if (prefill_max != nullptr && n > std::atol(prefill_max)) continue;
    StepInput in;
    SeqStep s;
    s.seq_id = 1000;
    for (int64_t i = 0; i < n; ++i) s.tokens.push_back(static_cast<int32_t>(1 + i % 1000));
    s.num_logits = 1;
    for (const auto& g : r.cache_groups()) {
      std::vector<int32_t> bt;
      if (g.sliding_window == 0)
        for (int64_t b = 0; b < (n + 63) / 64; ++b) bt.push_back(static_cast<int32_t>(b));
      s.block_tables.push_back(std::move(bt));
    }
    in.seqs.push_back(std::move(s));
    // ML4_BENCH_PREFILL_NCU=1: one default prefill of this size between cudaProfilerStart / Stop
    // (after one untimed), for `ncu --profile-from-start off`; then nothing else.
    if (const char* v = std::getenv("ML4_BENCH_PREFILL_NCU"); v && v[0] == '1') {
      r.set_grouped_moe_gemm(true);
      const bool warm = r.execute(in).ok();
      cudaDeviceSynchronize();
      cudaProfilerStart();
      const bool ok = warm && r.execute(in).ok();
      cudaDeviceSynchronize();
      cudaProfilerStop();
      std::printf("NCUPREFILL tokens=%ld ok=%d\n", static_cast<long>(n), ok ? 1 : 0);
      return ok ? 0 : 1;
    }
    // The MoE as a loop over experts, then as grouped GEMMs; then also the MLA absorption as
    // batched TF32 GEMMs (issue 18); then the grouped GEMMs with their MMAs overlapping the
    // promotion (CudaRunnerOptions::moe_gemm_overlap); then on 128-row tiles (moe_gemm_tall);
    // then those CTAs group-major (moe_gemm_group_major); then the 64-row overlapped ones
    // group-major (the default).
    struct Config {
      bool grouped, absorb, overlap, tall, group_major;
    };
    std::vector<Config> configs = {Config{false, false, false, false, false}, Config{true, false, false, false, false},
                                   Config{true, true, false, false, false},  Config{true, true, true, false, false},
                                   Config{true, true, false, true, false},   Config{true, true, false, true, true},
                                   Config{true, true, true, false, true}};
    if (prefill_only) configs.erase(configs.begin(), configs.end() - 1);  // the defaults' line
    // The last line is the defaults': with the warp-specialized kernel where it is on by
    // default (moe_gemm_specialized takes the place of overlap and tall), the others without.
    const bool ws_default = CudaRunnerOptions{}.moe_gemm_specialized;
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const auto [grouped, absorb, overlap, tall, gm] = configs[ci];
      const bool ws = ws_default && ci + 1 == configs.size();
      r.set_grouped_moe_gemm(grouped);
      r.set_absorb_gemm(absorb);
      r.set_moe_gemm_overlap(overlap);
      r.set_moe_gemm_tall(tall);
      r.set_moe_gemm_group_major(gm);
      r.set_moe_gemm_specialized(ws);
      std::string failed;
      const double ms = time_step(r, in, 1, 3, &failed);
      const char* moe = !grouped ? "loop"
                        : ws     ? "grouped_gemm_specialized_group_major"
                        : tall   ? (gm ? "grouped_gemm_tall_group_major" : "grouped_gemm_tall")
                        : overlap ? (gm ? "grouped_gemm_overlap_group_major" : "grouped_gemm_overlap")
                                  : "grouped_gemm";
      // gemm: the batched GEMMs (TF32, or bf16 where the latents are: mla_latent_bf16).
      const char* abs = absorb ? "gemm" : "kernel_f32";
      if (ms < 0) {  // e.g. out of memory beside the KV pool on an 80 GB card: say so, go on
        std::printf("PREFILL tokens=%ld moe=%s absorb=%s failed: %s\n", static_cast<long>(n), moe, abs, failed.c_str());
        continue;
      }
      std::printf("PREFILL tokens=%ld moe=%s absorb=%s ms=%.1f tok_s=%.0f\n", static_cast<long>(n), moe, abs, ms,
                  n / ms * 1e3);
      if (n != 4096) continue;
      std::map<std::string, double> prof;  // where the time goes (events around each piece, one sync each)
      r.set_profile(&prof);
      const bool ok = r.execute(in).ok();
      r.set_profile(nullptr);
      if (!ok) return 1;
      for (const auto& [k, v] : prof)
        std::printf("PREFILL_PROFILE tokens=%ld moe=%s absorb=%s %s ms=%.3f\n", static_cast<long>(n), moe, abs,
                    k.c_str(), v);
    }
    // The defaults with one switch set to `value`, against the defaults, alternately three times
    // each (a card's clock drifts over a run of lines: a variant timed once after the others
    // read up to 5% slow), the best of each; `base` (ms) is the defaults' best.
    auto variant = [&](const char* label, const std::function<void(bool)>& set, bool value, bool dflt) {
      std::string failed;
      double best = -1.0, base = -1.0;
      for (int round = 0; round < 3 && failed.empty(); ++round) {
        set(value);
        const double ms = time_step(r, in, 1, 3, &failed);
        set(dflt);
        const double b = failed.empty() ? time_step(r, in, 1, 3, &failed) : -1.0;
        if (ms >= 0 && (best < 0 || ms < best)) best = ms;
        if (b >= 0 && (base < 0 || b < base)) base = b;
      }
      if (failed.empty())
        std::printf("PREFILL tokens=%ld moe=defaults absorb=gemm %s ms=%.1f tok_s=%.0f "
                    "base_ms=%.1f\n",
                    static_cast<long>(n), label, best, n / best * 1e3, base);
      else
        std::printf("PREFILL tokens=%ld %s failed: %s\n", static_cast<long>(n), label, failed.c_str());
    };
    // The MLA prefill kernel's tile schedule (ML4_MLA_PREFILL_PAIRS=0).
    variant("mla=tiles", [&](bool on) { r.set_mla_prefill_pairs(on); }, false, CudaBackendOptions{}.mla_prefill_pairs);
    // The MLA latents of the prefill kernel's steps in f32 (ML4_MLA_LATENT_BF16=0), and cuBLASLt's
    // FP8 GEMMs writing y^T and transposing it instead of y row-major (ML4_LT_ROW_OUT=0); each
    // restored to the state the process started in (its environment may have set it).
    const bool latent0 = r.mla_latent_bf16(), row0 = r.fp8_row_out();
    variant("mla_latent=f32", [&](bool on) { r.set_mla_latent_bf16(on); }, false, latent0);
    variant("lt_row_out=off", [&](bool on) { r.set_fp8_row_out(on); }, false, row0);
    // The grouped MoE GEMMs warp-specialized and persistent (moe_gemm_specialized), flipped.
    variant(CudaRunnerOptions{}.moe_gemm_specialized ? "moe_specialized=off" : "moe_specialized=on",
            [&](bool on) { r.set_moe_gemm_specialized(on); }, !CudaRunnerOptions{}.moe_gemm_specialized,
            CudaRunnerOptions{}.moe_gemm_specialized);
    // The grouped MoE GEMMs with the tokens as the MMA's N (moe_gemm_swap), flipped.
    variant(CudaRunnerOptions{}.moe_gemm_swap ? "moe_swap=off" : "moe_swap=on",
            [&](bool on) { r.set_moe_gemm_swap(on); }, !CudaRunnerOptions{}.moe_gemm_swap,
            CudaRunnerOptions{}.moe_gemm_swap);
    // The down projection alone on the swapped kernel (moe_gemm_swap_down), flipped.
    variant(CudaRunnerOptions{}.moe_gemm_swap_down ? "moe_swap_down=off" : "moe_swap_down=on",
            [&](bool on) { r.set_moe_gemm_swap_down(on); }, !CudaRunnerOptions{}.moe_gemm_swap_down,
            CudaRunnerOptions{}.moe_gemm_swap_down);
    // The hidden rows quantized in their own launch instead of the gate_up epilogue.
    variant("quant_epilogue=off", [&](bool on) { r.set_moe_quant_epilogue(on); }, false,
            CudaRunnerOptions{}.moe_quant_epilogue);
    // The indexer's prefill scores on the mma.sync kernel instead of wgmma (ML4_INDEXER_WGMMA=0).
    variant("indexer=mma_sync", [&](bool on) { r.set_indexer_wgmma(on); }, false, CudaBackendOptions{}.indexer_wgmma);
    r.set_absorb_gemm(true);  // the defaults
    r.set_moe_gemm_overlap(true);
    r.set_moe_gemm_tall(CudaRunnerOptions{}.moe_gemm_tall);
    r.set_moe_gemm_group_major(CudaRunnerOptions{}.moe_gemm_group_major);
    r.set_moe_gemm_specialized(CudaRunnerOptions{}.moe_gemm_specialized);
    r.set_grouped_moe_gemm(false);
    if (n <= 8192) continue;
    // As a server prefills a long prompt (vLLM's chunked prefill, --max-num-batched-tokens):
    // chunks of 8,192 tokens, each attending to the chunks before it; the default paths. Its
    // activations are an 8k step's, so an 80 GB card measures it where one 32k step does not fit.
    r.set_grouped_moe_gemm(true);
    const int64_t chunk = 8192;
    std::vector<StepInput> chunks;
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
      SeqStep c = in.seqs[0];
      c.start_pos = c0;
      c.tokens.assign(in.seqs[0].tokens.begin() + c0, in.seqs[0].tokens.begin() + std::min(n, c0 + chunk));
      c.num_logits = c0 + chunk >= n ? 1 : 0;
      chunks.push_back(StepInput{{c}});
    }
    std::vector<double> total;
    std::string failed;
    for (int rep = 0; rep < 3 && failed.empty(); ++rep) {
      double ms = 0.0;
      for (const auto& c : chunks) {
        const double t = time_step(r, c, 0, 1, &failed);
        if (t < 0) break;
        ms += t;
      }
      if (failed.empty() && rep > 0) total.push_back(ms);  // the first pass warms up
    }
    if (!failed.empty()) {
      std::printf("PREFILL_CHUNKED tokens=%ld chunk=%ld failed: %s\n", static_cast<long>(n), static_cast<long>(chunk),
                  failed.c_str());
    } else {
      const double ms = std::min(total[0], total[1]);
      std::printf("PREFILL_CHUNKED tokens=%ld chunk=%ld ms=%.1f tok_s=%.0f\n", static_cast<long>(n),
                  static_cast<long>(chunk), ms, n / ms * 1e3);
    }
    r.set_grouped_moe_gemm(false);
  }
  return 0;
}


// HiSparse: per (context, batch), the decode step of the runner without offload (graphs, then
// eager) and of the HiSparse runner (eager: each sparse layer diffs its selection on the host)
// with (a) the same token each step at the next position (the selection barely moves: the
// steady state of a buffer that holds the working set) and (b) a new token each step (the
// query moves; rows loaded per step printed). Synthetic weights and KV: random selections,
// so (b) is a worst case for locality.
int run_hisparse_step_bench(const StepBenchOptions& opt) {
  auto cfg_r = preset_config(opt.preset);
  if (!cfg_r.ok()) {
    std::fprintf(stderr, "%s\n", cfg_r.status().message().c_str());
    return 1;
  }
  const ModelConfig cfg = *cfg_r;
  const int64_t kMaxCtx = *std::max_element(opt.contexts.begin(), opt.contexts.end());
  const int64_t kMaxBatch = *std::max_element(opt.batches.begin(), opt.batches.end());
  const int reps = 20;
  const int64_t blocks_per_seq = (kMaxCtx + reps + 8 + 63) / 64;
  auto steps = [&](const CudaRunner& r, int batch, int64_t ctx, int rep, bool new_token) {
    StepInput in = decode_step(r, batch, ctx + rep, blocks_per_seq);
    for (int i = 0; i < batch; ++i) {
      in.seqs[i].tokens = {new_token ? static_cast<int32_t>(1 + (rep * 131 + i * 17) % 1000) : 1 + i};
      for (auto& bt : in.seqs[i].block_tables)
        if (!bt.empty()) {
          bt.clear();
          for (int64_t b = 0; b < (ctx + rep + 63) / 64; ++b) bt.push_back(static_cast<int32_t>(i * blocks_per_seq + b));
        }
    }
    return in;
  };
  auto timed = [&](CudaRunner& r, int batch, int64_t ctx, bool new_token) {
    std::vector<double> ms;
    for (int rep = -3; rep < reps; ++rep) {
      const StepInput in = steps(r, batch, ctx, rep + 3, new_token);
      const auto t0 = Clock::now();
      if (!r.execute(in).ok()) std::abort();  // a bench step failed: nothing sensible to measure after it
      if (rep >= 0) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    return median(ms);
  };
  std::map<std::pair<int64_t, int>, std::pair<double, double>> plain_ms;
  const int64_t latent_row = static_cast<int64_t>(latent_token_bytes(KvCacheDtype::kFp8DsMla, cfg.kv_lora_rank, cfg.qk_rope_head_dim));
  const int64_t tokens = kMaxBatch * blocks_per_seq * 64;
  for (int pass = 0; pass < 2; ++pass) {
    CudaRunnerOptions o;
    o.base.kv_cache_dtype = "fp8_ds_mla";
    o.base.kv_cache_bytes = opt.kv_cache_bytes;
    o.base.max_num_seqs = kMaxBatch;
    o.max_graph_batch = static_cast<int>(kMaxBatch);
    if (pass == 1) {
      o.base.hisparse.enabled = true;
      o.base.hisparse.host_pool_bytes = tokens * latent_row * cfg.num_latent_layers() + (int64_t{64} << 20);
      o.base.hisparse.hot_slots_per_request = opt.hisparse_slots;
    }
    const auto t0 = Clock::now();
    auto rr = CudaRunner::load_synthetic(cfg, o, 1234);
    if (!rr.ok()) {
      std::fprintf(stderr, "%s\n", rr.status().message().c_str());
      return 1;
    }
    auto& r = **rr;
    if (!r.fill_kv_synthetic(99).ok()) return 1;
    if (r.cache_groups()[0].num_blocks < kMaxBatch * blocks_per_seq) {
      std::fprintf(stderr, "KV pool too small: %ld blocks\n", static_cast<long>(r.cache_groups()[0].num_blocks));
      return 1;
    }
    std::printf("HISPARSE_MODEL %s pass=%s device_kv_gb=%.2f host_pool_gb=%.2f hot_gb=%.3f setup_s=%.1f\n",
                opt.preset.c_str(), pass ? "hisparse" : "gpu-only", r.kv_bytes() / 1e9, r.host_kv_bytes() / 1e9,
                r.hot_bytes() / 1e9, std::chrono::duration<double>(Clock::now() - t0).count());
    for (int64_t ctx : opt.contexts) {
      for (int batch : opt.batches) {
        if (pass == 0) {
          const double g = timed(r, batch, ctx, true);
          r.set_cuda_graphs(false);
          const double e = timed(r, batch, ctx, true);
          r.set_cuda_graphs(true);
          plain_ms[{ctx, batch}] = {g, e};
          continue;
        }
        const HiSparseState& st = *r.hisparse();
        const double same = timed(r, batch, ctx, false);
        const int64_t loads0 = st.loads, hits0 = st.hits;
        const double moving = timed(r, batch, ctx, true);
        const double per_step = static_cast<double>(st.loads - loads0) / (reps + 3);
        const double hit_rate = static_cast<double>(st.hits - hits0) / std::max<double>(1.0, static_cast<double>(st.hits - hits0 + st.loads - loads0));
        for (int i = 0; i < batch; ++i) r.release(i);
        const auto [g, e] = plain_ms[{ctx, batch}];
        std::printf("HISPARSE batch=%d ctx=%ld gpu_graphs_ms=%.3f gpu_eager_ms=%.3f hisparse_same_token_ms=%.3f "
                    "hisparse_new_token_ms=%.3f rows_loaded_per_step=%.0f (%.1f MB) hit_rate=%.3f overhead_vs_graphs=%.2fx\n",
                    batch, static_cast<long>(ctx), g, e, same, moving, per_step, per_step * latent_row / 1e6, hit_rate,
                    moving / g);
      }
    }
  }
  return 0;
}

}  // namespace ml4::cuda
