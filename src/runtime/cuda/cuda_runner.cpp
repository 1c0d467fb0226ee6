// See cuda_runner.h: loading, the KV pools, the step (metadata upload, graph buckets,
// sampling); the forward itself is the model program over CudaBackend.
#include "runtime/cuda/cuda_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/log.h"
#include "kv/paged_kv_cache.h"
#include "model/checkpoint.h"
#include "model/config_loader.h"
#include "ops/cuda/host_copy.h"
#include "ops/cuda/sampling.h"
#include "runtime/cuda/synthetic_weights.h"
#if defined(ML4_WITH_NCCL)
#include "parallel/cuda/nccl_communicator.h"
#endif

namespace ml4::cuda {

CudaRunner::~CudaRunner() = default;

Result<std::unique_ptr<CudaRunner>> CudaRunner::load(const std::string& model_dir, const CudaRunnerOptions& opts) {
  if (opts.base.dtype != "auto")
    return invalid_argument("dtype {} applies to the CPU runner; the CUDA runner's activations follow "
                            "exact_activations (--batch-invariant)", opts.base.dtype);
  if (!device_available()) return unimplemented("no CUDA device: the CUDA runner cannot start");
  ML4_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(model_dir));
  ML4_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::open(model_dir));
  WeightLoadOptions wo;
  // FP8 experts to MXFP4 on the device (CudaBackend::add_moe), not on the host.
  wo.experts_to_mxfp4 = false;
  wo.load_drafter = opts.base.drafter;
  if (opts.base.plan != nullptr) wo.shard = &opts.base.plan->shard();  // a parallel rank reads its shard only
  ML4_ASSIGN_OR_RETURN(auto weights, load_model_weights(cfg, ck, wo));
  return create(opts.base.plan != nullptr ? opts.base.plan->local_config() : cfg, *weights, opts, 0, model_dir);
}

Result<std::unique_ptr<CudaRunner>> CudaRunner::load_synthetic(const ModelConfig& cfg, const CudaRunnerOptions& opts,
                                                               uint64_t seed) {
  if (!device_available()) return unimplemented("no CUDA device: the CUDA runner cannot start");
  auto skeleton = synthetic_weight_skeleton(cfg, seed, opts.base.drafter);
  return create(cfg, *skeleton, opts, seed == 0 ? 1 : seed, "synthetic " + cfg.name);
}

Result<std::unique_ptr<CudaRunner>> CudaRunner::create(const ModelConfig& cfg, const ModelWeights& weights,
                                                       const CudaRunnerOptions& opts, uint64_t synthetic_seed,
                                                       const std::string& model_dir) {
  ML4_ASSIGN_OR_RETURN(KvCacheDtype dtype, parse_kv_cache_dtype(opts.base.kv_cache_dtype));
  ML4_ASSIGN_OR_RETURN(KvCacheSpec spec, make_kv_cache_spec(cfg, dtype));
  std::unique_ptr<CudaRunner> r(new CudaRunner());
  ML4_CUDA_RETURN_IF_ERROR(cudaGetDevice(&r->device_));
  ML4_ASSIGN_OR_RETURN(r->fault_, FaultWord::create());
  r->cfg_ = cfg;
  r->opts_ = opts;
  r->spec_ = spec;
  r->max_model_len_ = opts.base.max_model_len > 0 ? opts.base.max_model_len : cfg.max_position_embeddings;
  CudaBackendOptions bo;
  bo.exact_activations = opts.exact_activations;
  bo.overlap_indexer = opts.overlap_indexer;
  bo.grouped_moe_gemm = opts.grouped_moe_gemm;
  bo.moe_gemm_overlap = opts.moe_gemm_overlap;
  bo.moe_gemm_tall = opts.moe_gemm_tall;
  bo.moe_gemm_group_major = opts.moe_gemm_group_major;
  bo.moe_gemm_specialized = opts.moe_gemm_specialized;
  bo.moe_gemm_swap = opts.moe_gemm_swap;
  bo.moe_gemm_swap_down = opts.moe_gemm_swap_down;
  bo.moe_quant_epilogue = opts.moe_quant_epilogue;
  bo.absorb_gemm = opts.absorb_gemm;
  bo.fused_router = opts.fused_router;
  bo.fused_ffn_norm = opts.fused_ffn_norm;
  bo.shared_expert_lane = opts.shared_expert_lane;
  bo.shared_expert_lane_min_bytes = opts.shared_expert_lane_min_bytes;
  bo.fused_indexer = opts.fused_indexer;
  bo.absorb_gemm_min_tokens = opts.absorb_gemm_min_tokens;
  bo.fp4_weights = opts.fp4_weights;
  bo.fp4_x_parts = opts.exact_activations ? -1 : opts.fp4_x_parts;
  bo.experts_to_mxfp4 = opts.base.experts_to_mxfp4;
  const ParallelPlan* plan = opts.base.plan;
  bo.tensor_parallel = plan != nullptr;
  bo.resident_wait_timeout_ns = static_cast<uint64_t>(std::max(opts.latency_wait_timeout_s, 1e-3) * 1e9);
  ML4_ASSIGN_OR_RETURN(r->backend_, CudaBackend::create(cfg, bo, synthetic_seed, r->max_model_len_));
  ModelForward::Options fo;
  fo.drafter = opts.base.drafter;
  if (plan != nullptr) {
    // A parallel rank: NCCL communicators over the plan's groups on the backend's stream,
    // bootstrapped through the MPI ones (parallel/cuda/nccl_communicator.h). A plan of one
    // rank gets a TP group of one: the single-GPU check of the NCCL path.
    if (plan->layout().pcp_size > 1)
      return unimplemented("--prefill-context-parallel-size {} on CUDA ranks is not supported yet (PCP runs on CPU ranks)",
                           plan->layout().pcp_size);
    if (plan->context_shard().sharded())
      return unimplemented(
          "--decode-context-parallel-size {} on CUDA ranks is not supported yet (DCP runs on CPU ranks; docs/PARALLEL.md)",
          plan->context_shard().size);
#if defined(ML4_WITH_NCCL)
    ML4_ASSIGN_OR_RETURN(r->tp_comm_, make_nccl_communicator(opts.base.comms.tp, r->backend_->stream()));
    if (plan->expert_parallel() && plan->ep_size() > 1) {
      ML4_ASSIGN_OR_RETURN(r->ep_comm_, make_nccl_communicator(opts.base.comms.ep, r->backend_->stream()));
    }
    fo.plan = plan;
    fo.comms = {r->tp_comm_.get(), r->ep_comm_.get()};
#else
    return unimplemented("parallel CUDA ranks need NCCL: this ml4 was built without it (nccl.h / libnccl not found)");
#endif
  }
  // HiSparse: the hot buffers' state (its regions and rows do not depend on the budget); the
  // program records the hot pool's shape; allocate_kv allocates it with the KV (its row format).
  const HiSparseConfig& hc = opts.base.hisparse;
  if (hc.enabled) {
    if (!cfg.has_dsa()) return invalid_argument("HiSparse needs a sparse-attention (DSA) model: this one attends every key");
    const int slots = hc.hot_slots_per_request > 0 ? hc.hot_slots_per_request : 2 * cfg.indexer.topk;
    r->hisparse_ = std::make_unique<HiSparseState>(hisparse_hot_layers(cfg), static_cast<int>(std::max<int64_t>(opts.base.max_num_seqs, 1)), slots);
    fo.hisparse = r->hisparse_.get();
  }
  auto prog = ModelForward::create(cfg, weights, *r->backend_, fo);
  if (!prog.ok()) return prog.status().with_context(model_dir);
  r->program_ = std::move(prog).value();
  if (opts.latency_decode) {
    ML4_RETURN_IF_ERROR(r->backend_->set_resident_ffn(true, r->fault_.device()));
    // The fault test's switch (issue 19), for a whole process: the resident kernel's block N
    // never arrives at its first barrier, so the first latency step faults.
    if (const char* v = std::getenv("ML4_TEST_RESIDENT_NEVER_ARRIVE"); v && *v)
      r->backend_->set_resident_fault_test(std::atoi(v), bo.resident_wait_timeout_ns);
  }
  ML4_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // synthetic fills ran on the default stream
  // Device verification's kept q (CudaRunnerOptions::device_verification), before the KV pool
  // takes what is left: a slot of (block - 1) rows per sequence the engine can run.
  if (const char* v = std::getenv("ML4_DEVICE_VERIFY"); v && (v[0] == '0' || v[0] == '1'))
    r->opts_.device_verification = v[0] == '1';
  if (!opts.base.drafter || plan != nullptr) r->opts_.device_verification = false;
  if (r->opts_.device_verification) {
    const int64_t slots = std::max<int64_t>(opts.base.max_num_seqs, 1);
    const int64_t rows = slots * std::max(cfg.drafter.block_size - 1, 1);
    ML4_ASSIGN_OR_RETURN(r->verify_q_, DeviceBuffer::alloc(static_cast<size_t>(rows * cfg.vocab_size) * 4));
    for (int64_t i = slots - 1; i >= 0; --i) r->free_q_slots_.push_back(i);
    ML4_LOG_INFO("cuda runner: device verification of random drafts, q for {} sequences ({:.1f} MiB)", slots,
                 r->verify_q_.bytes() / 1048576.0);
  }
  // KV pool.
  int64_t kv_budget = opts.base.kv_cache_bytes;
  if (opts.gpu_memory_utilization > 0) {
    if (opts.gpu_memory_utilization > 1.0)
      return invalid_argument("--gpu-memory-utilization {} must be in (0, 1]", opts.gpu_memory_utilization);
    size_t free_b = 0, total_b = 0;
    ML4_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
    const double used = static_cast<double>(total_b - free_b);
    // Leave room for step activations and cuBLASLt's workspace: 5% of the budget.
    kv_budget = static_cast<int64_t>((opts.gpu_memory_utilization * total_b - used) * 0.95);
    if (kv_budget <= 0)
      return resource_exhausted("--gpu-memory-utilization {}: weights and runtime already use {:.1f} of {:.1f} GiB",
                                opts.gpu_memory_utilization, used / 1073741824.0, total_b / 1073741824.0);
  }
  std::vector<int64_t> blocks = PagedKvCache::blocks_for_budget(
      spec, kv_budget, opts.base.drafter ? std::max<int64_t>(opts.base.max_num_seqs, 1) : 0);
  if (hc.enabled) {
    // hisparse_sizing takes the hot pool (allocated with the KV below) out of the budget.
    ML4_ASSIGN_OR_RETURN(HiSparseSizing z, hisparse_sizing(cfg, spec, hc, kv_budget, opts.base.max_num_seqs, opts.base.drafter));
    blocks = z.blocks;
  }
  if (blocks[spec.group_index(CacheGroupSpec::kLatent)] <= 0)
    return resource_exhausted("KV budget of {} bytes holds no block", kv_budget);
  ML4_RETURN_IF_ERROR(r->backend_->allocate_kv(spec, blocks, hc.enabled));
  for (size_t gi = 0; gi < spec.groups.size(); ++gi) {
    const auto& g = spec.groups[gi];
    r->groups_.push_back(CacheGroupInfo{g.name, g.page_tokens, blocks[gi], g.sliding_window, g.bytes_per_token()});
  }
  ML4_LOG_INFO("cuda runner: {} ({} layers), weights {:.1f} MiB, kv {} {:.1f} MiB ({} blocks)", model_dir, cfg.n_layers,
               r->backend_->weight_bytes() / 1048576.0, opts.base.kv_cache_dtype, r->backend_->kv_bytes() / 1048576.0,
               blocks[spec.group_index(CacheGroupSpec::kLatent)]);
  if (hc.enabled)
    ML4_LOG_INFO("cuda runner: HiSparse host pool {:.1f} MiB pinned, hot buffers {:.1f} MiB ({} layers x {} requests x {} rows)",
                 r->backend_->host_kv_bytes() / 1048576.0, r->backend_->hot_bytes() / 1048576.0, r->hisparse_->layers(),
                 r->hisparse_->regions(), r->hisparse_->slots());
  return r;
}

namespace {

int64_t round_up_pow2(int64_t v, int64_t lo) {
  int64_t b = lo;
  while (b < v) b *= 2;
  return b;
}

}  // namespace

Status CudaRunner::run_forward(CudaBackend::Mode mode, std::vector<GraphExec>* segments, const StepMetadata* md,
                               ForwardTrace* trace) {
  backend_->begin_forward(step_T_, step_R_, step_maxlen_, mode, segments, md, step_bucket_T_, step_rows_are_tokens_);
  return program_->forward(md, trace);
}

// Fail closed (issue 19): a fault a kernel recorded (ops/cuda/fault.h: a bounded device-side
// wait ran out) fails the step that saw it and every later one; the engine then stops with
// that error (every stream gets it, /health answers 503).
Result<StepOutput> CudaRunner::execute_traced(const StepInput& in, ForwardTrace* trace) {
  ML4_RETURN_IF_ERROR(fault_.status("cuda runner (an earlier step)"));
  auto out = execute_step(in, trace);
  ML4_RETURN_IF_ERROR(fault_.status("cuda runner"));  // the step has synchronised
  return out;
}

Result<DraftOutput> CudaRunner::draft(const DraftInput& in) {
  ML4_RETURN_IF_ERROR(fault_.status("cuda runner (an earlier step)"));
  auto out = draft_step(in);
  ML4_RETURN_IF_ERROR(backend_->stage_draft_params(nullptr, 0));  // draft_step's parameters die with it
  ML4_RETURN_IF_ERROR(fault_.status("cuda runner draft"));
  return out;
}

Result<StepOutput> CudaRunner::execute_step(const StepInput& in, ForwardTrace* trace) {
  using Clock = std::chrono::steady_clock;
  const auto t_enter = Clock::now();
  auto us = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
  cuda::set_programmatic_launch(opts_.programmatic_launch);
  std::vector<VerifySeq> vseqs;
  std::vector<int32_t> vdrafts;
  std::vector<size_t> vindex;
  ML4_RETURN_IF_ERROR(stage_verification(in, &vseqs, &vdrafts, &vindex));  // process-wide: this runner's setting (pdl.cuh)
  ML4_ASSIGN_OR_RETURN(StepMetadata md, build_step_metadata(in, groups_, cfg_.vocab_size, max_model_len_));
  const int64_t T = md.num_tokens(), R = static_cast<int64_t>(md.logits_rows.size());
  const int64_t S = static_cast<int64_t>(md.seqs.size());
  const int latent_group = backend_->latent_group(), indexer_group = backend_->indexer_group();
  int64_t maxb = 1, maxlen = 1;
  for (const auto& s : in.seqs) {
    maxb = std::max<int64_t>(maxb, s.block_tables[latent_group].size());
    if (indexer_group >= 0) maxb = std::max<int64_t>(maxb, s.block_tables[indexer_group].size());
  }
  for (int64_t p : md.positions) maxlen = std::max(maxlen, p + 1);
  // Steps of up to graph_max_tokens() tokens run as CUDA graphs, padded to a bucket:
  // decode-like steps (every token a logits row: decoding, and DSpark's verification of the
  // last token plus its drafts) to a power-of-two token count, which keeps a c1 verification of
  // 8 tokens on the GEMV path instead of padding it to 64 tokens of GEMMs (2.3 -> see
  // docs/BENCHMARKS.md), mixed prefill/decode steps to a multiple of 64 tokens and a power-of-two number of
  // logits rows. Padding tokens write no cache slot (slot -1), attend to one key of an
  // all-zero block-table row, and their logits rows are dropped. Launch shapes that depend
  // on the context (key count, block-table stride) are rounded up to powers of two, so one
  // capture serves a range of lengths. Each (tokens, rows, length, stride) bucket is
  // captured once, after an eager run of the same padded step has sized every buffer and
  // made every GEMM plan; work that must read device results back (the MoE expert loop
  // of larger steps) splits the capture into segments and runs eagerly between them.
  const bool decode = R == T && T <= opts_.max_graph_batch;
  int64_t Tp = decode ? round_up_pow2(T, 1) : (T + 63) / 64 * 64;
  const int64_t bucket_T = Tp;
  // Programmatic dependent launch for every step, or for decode steps of a small bucket.
  const bool pdl = opts_.programmatic_launch || (decode && Tp <= opts_.programmatic_launch_tokens);
  cuda::set_programmatic_launch(pdl);
  programmatic_steps_ += pdl;
  // HiSparse steps run eagerly: each sparse layer diffs its selection on the host.
  const bool graph = opts_.cuda_graphs && trace == nullptr && hisparse_ == nullptr && T > 0 && Tp <= opts_.max_graph_tokens;
  int64_t Rp = R, Sp = S;
  if (!graph) Tp = T;
  if (graph) {
    Rp = decode ? Tp : (R > 0 ? round_up_pow2(R, 1) : 0);
    Sp = Tp + 1;  // row Tp..: the padding tokens' all-zero block table
    maxb = round_up_pow2(maxb, 4);
    maxlen = std::min<int64_t>(round_up_pow2(maxlen, 256), std::max<int64_t>(maxb * kPageTokens, 256));
  }
  const uint64_t gen = backend_->buffer_generation();
  ML4_RETURN_IF_ERROR(backend_->ensure_buffers(Tp, Rp, Sp, maxb));
  if (backend_->buffer_generation() != gen) graphs_.clear(), draft_graphs_.clear();  // captured addresses are stale
  CudaBackend::Buffers& b = backend_->buffers();
  cudaStream_t stream = backend_->stream();
  // Per-step metadata to the device (one plain copy per array), padded to Tp tokens.
  std::vector<int32_t> tok(Tp, 0), seq_of(Tp, static_cast<int32_t>(S)), lengths(Tp, 1), bt(Sp * maxb, 0),
      ibt(indexer_group >= 0 ? Sp * maxb : 0, 0), rows(Rp, 0);
  std::vector<int64_t> pos(Tp, 0), slots(Tp, -1), islots(Tp, -1), dslots(Tp, -1);
  const int drafter_group = backend_->drafter_enabled() ? backend_->drafter_group() : -1;
  for (int64_t t = 0; t < T; ++t) {
    if (drafter_group >= 0) dslots[t] = md.slots[drafter_group][t];
    tok[t] = md.token_ids[t];
    pos[t] = md.positions[t];
    lengths[t] = static_cast<int32_t>(md.positions[t] + 1);
    seq_of[t] = md.seq_of_token[t];
    slots[t] = md.slots[latent_group][t];
    if (indexer_group >= 0) islots[t] = md.slots[indexer_group][t];
  }
  for (int64_t s = 0; s < S; ++s) {
    const auto& tab = in.seqs[s].block_tables[latent_group];
    std::copy(tab.begin(), tab.end(), bt.begin() + s * maxb);
    if (indexer_group >= 0) {
      const auto& itab = in.seqs[s].block_tables[indexer_group];
      std::copy(itab.begin(), itab.end(), ibt.begin() + s * maxb);
    }
  }
  for (int64_t i = 0; i < R; ++i) rows[i] = static_cast<int32_t>(md.logits_rows[i]);
  // mapped_step_io: the arrays into pinned, device-mapped host memory and one launch moving
  // them all (host_copy.h); else a cudaMemcpyAsync each from the vectors.
  const bool mapped = opts_.mapped_step_io;
  CopySegments segs;
  size_t staged = 0;
  if (mapped) {
    const size_t need = Tp * (4 + 8 + 8 + 4 + 4 + 8 + 8) + (bt.size() + ibt.size() + Rp) * 4 + 16 * kMaxCopySegments;
    if (step_stage_.bytes() < need) {
      step_stage_ = {};
      ML4_ASSIGN_OR_RETURN(step_stage_, DeviceBuffer::alloc_host_mapped(std::max<size_t>(need, 64 << 10)));
    }
  }
  auto h2d = [&](DeviceBuffer& d, const void* src, size_t bytes) -> Status {
    if (!mapped) return cuda_status(cudaMemcpyAsync(d.data(), src, bytes, cudaMemcpyHostToDevice, stream), "step metadata");
    char* at = static_cast<char*>(step_stage_.data()) + staged;
    std::memcpy(at, src, bytes);
    staged += (bytes + 15) / 16 * 16;
    if (staged > step_stage_.bytes() || !segs.add(at, d.data(), static_cast<int64_t>(bytes)))
      return internal_error("step metadata: {} bytes in {} segments do not fit the stage", staged, segs.n);
    return ok_status();
  };
  ML4_RETURN_IF_ERROR(h2d(b.tok, tok.data(), Tp * 4));
  ML4_RETURN_IF_ERROR(h2d(b.pos, pos.data(), Tp * 8));
  ML4_RETURN_IF_ERROR(h2d(b.slots, slots.data(), Tp * 8));
  ML4_RETURN_IF_ERROR(h2d(b.seq_of, seq_of.data(), Tp * 4));
  ML4_RETURN_IF_ERROR(h2d(b.lengths, lengths.data(), Tp * 4));
  ML4_RETURN_IF_ERROR(h2d(b.block_table, bt.data(), bt.size() * 4));
  if (indexer_group >= 0) {
    ML4_RETURN_IF_ERROR(h2d(b.idx_block_table, ibt.data(), ibt.size() * 4));
    ML4_RETURN_IF_ERROR(h2d(b.idx_slots, islots.data(), Tp * 8));
  }
  if (Rp > 0) ML4_RETURN_IF_ERROR(h2d(b.row_idx, rows.data(), Rp * 4));
  if (drafter_group >= 0) ML4_RETURN_IF_ERROR(h2d(b.drafter_slots, dslots.data(), Tp * 8));
  if (mapped) ML4_RETURN_IF_ERROR(copy_segments(segs, stream));
  step_T_ = Tp;
  step_R_ = Rp;
  // Part of the graph's key: it changes the launch sequence (model_forward.cpp's final norm).
  step_rows_are_tokens_ = opts_.final_norm_rows && R == T && Rp == Tp;
  step_maxlen_ = maxlen;
  step_bucket_T_ = bucket_T;
  last_graph_.reset();  // this step's metadata now fills the buffers: only its own graph may replay it
  const auto t_issue = Clock::now();
  if (graph) {
    const GraphKey key{Tp, Rp, maxlen, maxb, step_rows_are_tokens_};
    auto it = graphs_.find(key);
    if (it != graphs_.end()) {
      ML4_RETURN_IF_ERROR(run_forward(CudaBackend::Mode::kReplay, &it->second, nullptr, nullptr));
      ++graph_replays_;
      last_graph_ = key;
    } else {
      // Eager first (sizes buffers, makes plans: nothing may allocate while capturing),
      // then capture the identical launch sequence for the next steps of this bucket.
      ML4_RETURN_IF_ERROR(run_forward(CudaBackend::Mode::kEager, nullptr, nullptr, nullptr));
      if (backend_->buffer_generation() != gen) graphs_.clear(), draft_graphs_.clear();
      std::vector<GraphExec> segments;
      const Status cap = run_forward(CudaBackend::Mode::kCapture, &segments, nullptr, nullptr);
      backend_->begin_forward(Tp, Rp, maxlen, CudaBackend::Mode::kEager, nullptr, nullptr, bucket_T);
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      cudaStreamIsCapturing(stream, &cs);
      if (cs != cudaStreamCaptureStatusNone) {  // a failed segment left the capture open
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(stream, &g);
        if (g) cudaGraphDestroy(g);
      }
      if (!cap.ok()) {
        (void)cudaGetLastError();
        ML4_LOG_WARN("cuda runner: graph capture failed for {} tokens ({}); running eagerly", Tp, cap.message());
        opts_.cuda_graphs = false;
      } else {
        graphs_.emplace(key, std::move(segments));
        last_graph_ = key;
      }
    }
  } else {
    ML4_RETURN_IF_ERROR(
        run_forward(CudaBackend::Mode::kEager, nullptr, trace != nullptr || hisparse_ != nullptr ? &md : nullptr, trace));
  }
  const auto t_issued = Clock::now();
  StepOutput out;
  // Device sampling (sampling.h): when every sequence asking for logits asked for it, draw
  // the R tokens on the GPU and copy back 8 bytes per row instead of R x V logits. A sequence
  // verifying drafts greedily (step.h) has 1 + k greedy rows: each row's argmax.
  // A sequence verifying on the device (SeqStep::device_verify) is drawn greedily here, unread.
  bool device_sample = R > 0 && trace == nullptr;
  for (const auto& s : in.seqs)
    if (s.num_logits > 0 && (!s.device_sampling || (s.num_logits > 1 && !sampling::greedy(*s.device_sampling) &&
                                                    s.device_verify == SeqStep::DeviceVerify::kNo)))
      device_sample = false;
  // DSpark verification on the device reads the rows before anything else touches them.
  if (!vseqs.empty()) ML4_RETURN_IF_ERROR(run_verification(in, vseqs, vdrafts, vindex, nullptr));
  if (device_sample) {
    if (b.samp_cap < R) {
      ML4_ASSIGN_OR_RETURN(b.samp_params, DeviceBuffer::alloc(R * sizeof(DeviceSamplingParams)));
      ML4_ASSIGN_OR_RETURN(b.samp_tokens, DeviceBuffer::alloc(R * 4));
      ML4_ASSIGN_OR_RETURN(b.samp_logprobs, DeviceBuffer::alloc(R * 4));
      ML4_ASSIGN_OR_RETURN(b.samp_ws, DeviceBuffer::alloc(sample_rows_workspace_bytes(R, cfg_.vocab_size)));
      b.samp_cap = R;
    }
    std::vector<DeviceSamplingParams> params;
    for (const auto& s : in.seqs) {
      if (s.num_logits == 0) continue;  // a chunk short of the prompt's end carries no parameters
      DeviceSamplingParams p = *s.device_sampling;
      if (s.device_verify != SeqStep::DeviceVerify::kNo) p.temperature = 0.0f;
      for (int j = 0; j < s.num_logits; ++j) params.push_back(p);
    }
    ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.samp_params.data(), params.data(), R * sizeof(DeviceSamplingParams),
                                             cudaMemcpyHostToDevice, stream));
    // Grammar masks (SeqStep::allowed_tokens), rows in logits order; rows without one allow all.
    std::vector<uint32_t> mask;
    const int64_t words = (cfg_.vocab_size + 31) / 32;
    for (const auto& sq : in.seqs)
      if (sq.num_logits == 1 && !sq.allowed_tokens.empty()) mask.resize(R * words, 0xffffffffu);
    if (!mask.empty()) {
      int64_t row = 0;
      for (const auto& sq : in.seqs) {
        if (sq.num_logits != 1) {  // verifying rows carry no mask (step.h)
          row += sq.num_logits;
          continue;
        }
        if (!sq.allowed_tokens.empty()) {
          if (static_cast<int64_t>(sq.allowed_tokens.size()) != words)
            return invalid_argument("seq {}: allowed_tokens has {} words, the vocabulary needs {}", sq.seq_id,
                                    sq.allowed_tokens.size(), words);
          std::copy(sq.allowed_tokens.begin(), sq.allowed_tokens.end(), mask.begin() + row * words);
        }
        ++row;
      }
      if (static_cast<int64_t>(b.samp_mask.bytes()) < R * words * 4) {
        ML4_ASSIGN_OR_RETURN(b.samp_mask, DeviceBuffer::alloc(R * words * 4));
      }
      ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.samp_mask.data(), mask.data(), R * words * 4, cudaMemcpyHostToDevice, stream));
      ML4_RETURN_IF_ERROR(apply_token_bitmask(b.logits.as<float>(), R, cfg_.vocab_size, b.samp_mask.as<uint32_t>(), stream));
    }
    // mapped_step_io: the sampler writes the tokens and logprobs straight into mapped host
    // memory (no read-back copies after it); else into device buffers, then two copies.
    if (mapped && sampled_out_.bytes() < static_cast<size_t>(R) * 8) {
      sampled_out_ = {};
      ML4_ASSIGN_OR_RETURN(sampled_out_, DeviceBuffer::alloc_host_mapped(std::max<int64_t>(R * 8, 4096)));
    }
    int32_t* tokens_at = mapped ? sampled_out_.as<int32_t>() : b.samp_tokens.as<int32_t>();
    float* logprobs_at = mapped ? reinterpret_cast<float*>(sampled_out_.as<int32_t>() + R) : b.samp_logprobs.as<float>();
    ML4_RETURN_IF_ERROR(sample_rows(b.logits.as<float>(), R, cfg_.vocab_size,
                                    static_cast<const DeviceSamplingParams*>(b.samp_params.data()), tokens_at,
                                    logprobs_at, b.samp_ws.data(), b.samp_ws.bytes(), stream));
    out.sampled.resize(R);
    out.sampled_logprob.resize(R);
    if (!mapped) {
      ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.sampled.data(), tokens_at, R * 4, cudaMemcpyDeviceToHost, stream));
      ML4_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(out.sampled_logprob.data(), logprobs_at, R * 4, cudaMemcpyDeviceToHost, stream));
    }
    const auto t_wait = Clock::now();
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));  // params (host vector) and outputs
    const auto t_done = Clock::now();
    if (mapped) {
      std::memcpy(out.sampled.data(), tokens_at, R * 4);
      std::memcpy(out.sampled_logprob.data(), logprobs_at, R * 4);
    }
    host_split_.prep_us += us(t_enter, t_issue);
    host_split_.launch_us += us(t_issue, t_issued);
    host_split_.tail_us += us(t_issued, t_wait);
    host_split_.wait_us += us(t_wait, t_done);
    ++host_split_.steps;
  } else if (R > 0) {
    const int64_t V = cfg_.vocab_size;
    ML4_ASSIGN_OR_RETURN(const float* logits, download_floats(b.logits.data(), static_cast<size_t>(R * V), stream));
    size_t row = 0;
    for (const auto& s : in.seqs) {
      out.logits.emplace_back(logits + row * V, logits + (row + s.num_logits) * V);
      row += s.num_logits;
    }
  } else {
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < in.seqs.size(); ++i) out.logits.emplace_back();
  }
  if (!vseqs.empty()) ML4_RETURN_IF_ERROR(run_verification(in, vseqs, vdrafts, vindex, &out));
  return out;
}

Result<double> CudaRunner::replay_last_graph_ms(int n) {
  if (!last_graph_ || n <= 0) return invalid_argument("replay_last_graph_ms: the last step ran no graph");
  auto it = graphs_.find(*last_graph_);
  if (it == graphs_.end()) return invalid_argument("replay_last_graph_ms: the last step's graph was dropped");
  auto replays = [&]() -> Status {
    for (int i = 0; i < n; ++i)
      ML4_RETURN_IF_ERROR(run_forward(CudaBackend::Mode::kReplay, &it->second, nullptr, nullptr));
    return ok_status();
  };
  ML4_ASSIGN_OR_RETURN(const double ms, stream_ms(backend_->stream(), replays));
  ML4_RETURN_IF_ERROR(fault_.status("cuda runner (graph replays)"));
  return ms / n;
}

bool CudaRunner::verifies_on_device(const DeviceSamplingParams& p) const {
  return opts_.device_verification && program_->has_drafter() && verify_rows_supported(p, cfg_.vocab_size);
}

void CudaRunner::drop_kept_q(int64_t seq_id) {
  auto it = kept_q_.find(seq_id);
  if (it == kept_q_.end()) return;
  free_q_slots_.push_back(it->second.slot);
  kept_q_.erase(it);
}

Status CudaRunner::stage_verification(const StepInput& in, std::vector<VerifySeq>* vseqs, std::vector<int32_t>* vdrafts,
                                      std::vector<size_t>* vindex) const {
  const int qrows = std::max(cfg_.drafter.block_size - 1, 1);
  int64_t row = 0;
  for (size_t i = 0; i < in.seqs.size(); ++i) {
    const SeqStep& s = in.seqs[i];
    if (s.device_verify != SeqStep::DeviceVerify::kNo) {
      const int k = s.num_logits - 1;
      if (!s.device_sampling || !verifies_on_device(*s.device_sampling) || k < 1 ||
          static_cast<int>(s.tokens.size()) < s.num_logits)
        return invalid_argument("seq {}: device verification of {} rows with these parameters is not supported here",
                                s.seq_id, s.num_logits);
      VerifySeq v;
      v.row0 = row;
      v.k = k;
      v.draft0 = static_cast<int32_t>(vdrafts->size());
      v.out0 = static_cast<int32_t>(v.draft0 + vseqs->size());  // 1 + k outputs per sequence
      v.params = *s.device_sampling;
      vdrafts->insert(vdrafts->end(), s.tokens.end() - k, s.tokens.end());
      if (s.device_verify == SeqStep::DeviceVerify::kKeptQ) {
        auto it = kept_q_.find(s.seq_id);
        if (it == kept_q_.end() || static_cast<int>(it->second.tokens.size()) < k ||
            !std::equal(s.tokens.end() - k, s.tokens.end(), it->second.tokens.begin()))
          return internal_error("seq {}: no q kept on the device for these drafts", s.seq_id);
        v.q0 = it->second.slot * qrows;
      }
      vseqs->push_back(v);
      vindex->push_back(i);
    }
    row += s.num_logits;
  }
  return ok_status();
}

// Launched (out == nullptr) right after the forward, on the step's stream; read (out set)
// once the step has synchronised.
Status CudaRunner::run_verification(const StepInput& in, const std::vector<VerifySeq>& vseqs,
                                    const std::vector<int32_t>& vdrafts, const std::vector<size_t>& vindex,
                                    StepOutput* out) {
  const int64_t n = static_cast<int64_t>(vseqs.size()), outs = static_cast<int64_t>(vdrafts.size()) + n;
  cudaStream_t stream = backend_->stream();
  if (out == nullptr) {
    auto fit = [](DeviceBuffer& d, size_t bytes) -> Status {
      if (d.bytes() >= bytes) return ok_status();
      ML4_ASSIGN_OR_RETURN(d, DeviceBuffer::alloc(std::max<size_t>(bytes, 4096)));
      return ok_status();
    };
    ML4_RETURN_IF_ERROR(fit(verify_seqs_, n * sizeof(VerifySeq)));
    ML4_RETURN_IF_ERROR(fit(verify_drafts_, vdrafts.size() * 4));
    ML4_RETURN_IF_ERROR(fit(verify_tokens_, outs * 4));
    ML4_RETURN_IF_ERROR(fit(verify_logprobs_, outs * 4));
    ML4_RETURN_IF_ERROR(fit(verify_accepted_, n * 4));
    int max_k = 0;
    int64_t rows = 0;
    for (const VerifySeq& v : vseqs) {
      max_k = std::max(max_k, static_cast<int>(v.k));
      rows = std::max(rows, v.row0 + v.k + 1);
    }
    ML4_RETURN_IF_ERROR(fit(verify_ws_, verify_rows_workspace_bytes(rows)));
    ML4_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(verify_seqs_.data(), vseqs.data(), n * sizeof(VerifySeq), cudaMemcpyHostToDevice, stream));
    ML4_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(verify_drafts_.data(), vdrafts.data(), vdrafts.size() * 4, cudaMemcpyHostToDevice, stream));
    return verify_rows(backend_->buffers().logits.as<float>(), cfg_.vocab_size, verify_q_.as<float>(),
                       verify_drafts_.as<int32_t>(), verify_seqs_.as<VerifySeq>(), n, max_k,
                       verify_tokens_.as<int32_t>(), verify_logprobs_.as<float>(), verify_accepted_.as<int32_t>(),
                       verify_ws_.data(), verify_ws_.bytes(), rows, stream);
  }
  std::vector<int32_t> tokens(outs), accepted(n);
  std::vector<float> logprobs(outs);
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens.data(), verify_tokens_.data(), outs * 4, cudaMemcpyDeviceToHost, stream));
  ML4_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(logprobs.data(), verify_logprobs_.data(), outs * 4, cudaMemcpyDeviceToHost, stream));
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(accepted.data(), verify_accepted_.data(), n * 4, cudaMemcpyDeviceToHost, stream));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  out->verified.assign(in.seqs.size(), StepOutput::Verified{});
  for (int64_t v = 0; v < n; ++v) {
    const VerifySeq& s = vseqs[v];
    const int a = accepted[v];
    if (a < 0 || a > s.k) return internal_error("verify_rows: {} drafts accepted of {}", a, s.k);
    StepOutput::Verified& o = out->verified[vindex[v]];
    o.accepted = a;
    o.tokens.assign(tokens.begin() + s.out0, tokens.begin() + s.out0 + a + 1);
    o.logprobs.assign(logprobs.begin() + s.out0, logprobs.begin() + s.out0 + a + 1);
    drop_kept_q(in.seqs[vindex[v]].seq_id);  // drafts are proposed again after the step
    ++device_verifications_;
  }
  return ok_status();
}

Result<const float*> CudaRunner::download_floats(const void* device, size_t n, cudaStream_t stream) {
  // Past 256 MiB (prompt logprobs over a long chunk) a pageable vector for this call only:
  // pinned memory that size would stay locked for the runner's life. 256 MiB holds the rows of
  // 64 sequences verifying 7 drafts at a 131,072-id vocabulary (the c32 / c64 steps).
  constexpr size_t kPinnedMax = size_t{256} << 20;
  std::vector<float>().swap(large_download_);
  if (n * 4 > kPinnedMax) {
    large_download_.resize(n);
    ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(large_download_.data(), device, n * 4, cudaMemcpyDeviceToHost, stream));
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return static_cast<const float*>(large_download_.data());
  }
  if (host_stage_.bytes() < n * 4) {
    const size_t grown = std::min(kPinnedMax, std::max<size_t>(n * 4, 2 * host_stage_.bytes()));
    host_stage_ = DeviceBuffer();
    ML4_ASSIGN_OR_RETURN(host_stage_, DeviceBuffer::alloc_host_mapped(std::max<size_t>(grown, size_t{1} << 20)));
  }
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_stage_.data(), device, n * 4, cudaMemcpyDeviceToHost, stream));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return static_cast<const float*>(host_stage_.as<float>());
}

// As CpuRunner::draft: one block of B tokens per sequence (the anchor, then placeholders whose
// rows are the mask embeddings); the Markov head's tokens come back from draft_ids. Drafts run
// as CUDA graphs, one per (sequences, block-table stride rounded up to a power of two, greedy
// or sampled): every input is device data uploaded before the launch (tokens, positions,
// slots, the drafter block table, anchors, the staged draw parameters); the greedy choice is a
// device argmax, a sampled draft with its q a device draw (draft_rows, top-k / top-p too).
// Sampled drafts whose q nobody keeps (the host draws them) and greedy drafts returning their
// softmax run eagerly.
Result<DraftOutput> CudaRunner::draft_step(const DraftInput& in) {
  if (!program_->has_drafter()) return unimplemented("this runner has no DSpark drafter (RunnerOptions::drafter)");
  cuda::set_programmatic_launch(opts_.programmatic_launch);
  const int B = cfg_.drafter.block_size;
  const int64_t V = cfg_.vocab_size;
  const int dg = backend_->drafter_group();
  StepInput step;
  int64_t maxb = 1;
  for (const auto& d : in.seqs) {
    if (d.num_drafts < 1 || d.num_drafts > B - 1)
      return invalid_argument("draft seq {}: num_drafts {} outside [1, {}]", d.seq_id, d.num_drafts, B - 1);
    SeqStep s;
    s.seq_id = d.seq_id;
    s.tokens.assign(B, 0);
    s.tokens[0] = d.anchor_token;
    s.start_pos = d.anchor_pos;
    s.block_tables = d.block_tables;
    s.num_logits = B - 1;
    if (static_cast<int>(s.block_tables.size()) > dg) maxb = std::max<int64_t>(maxb, s.block_tables[dg].size());
    step.seqs.push_back(std::move(s));
  }
  bool any_sampled = false, any_keep = false;
  for (const auto& d : in.seqs) {
    any_sampled |= d.sampling.has_value();
    any_keep |= d.keep_probs;
    if (d.keep_probs && (!d.sampling || !verifies_on_device(*d.sampling)))
      return invalid_argument("draft seq {}: keep_probs for drafts this runner cannot verify on the device", d.seq_id);
  }
  const bool want_q = in.want_probs || any_keep;  // q made on the device, for the host or kept
  // Each slot's draw parameters (greedy for the sequences without sampling), slot-major.
  std::vector<DeviceSamplingParams> params;
  if (any_sampled) {
    params.resize(static_cast<size_t>(B - 1) * in.seqs.size());
    for (int j = 0; j < B - 1; ++j)
      for (size_t i = 0; i < in.seqs.size(); ++i) {
        DeviceSamplingParams p;
        p.temperature = 0.0f;
        if (in.seqs[i].sampling) {
          p = *in.seqs[i].sampling;
          p.counter += j;
        }
        params[j * in.seqs.size() + i] = p;
      }
  }
  // Sampled drafts with their q are drawn on the device (sampling.h draft_rows; rows with
  // top-k or top-p get their kept prefix first: `cuts`); greedy drafts are argmaxes on the
  // device. Either can be a graph; the host draws sampled drafts without q (and the drafter's
  // softmax of greedy drafts, asked for diagnostics).
  const bool device_draws = any_sampled && want_q;
  bool cuts = false;
  for (const auto& p : params) cuts = cuts || needs_kept_cut(p, V);
  const bool host_choice = any_sampled ? !device_draws : in.want_probs;
  const bool graph = opts_.cuda_graphs && draft_graphs_ok_ && !host_choice;
  int kmax = 1;  // the Markov head's slots: the most drafts any sequence asked for
  for (const auto& s : in.seqs) kmax = std::max(kmax, s.num_drafts);
  if (graph) maxb = round_up_pow2(maxb, 4);
  ML4_ASSIGN_OR_RETURN(StepMetadata md, build_step_metadata(step, groups_, cfg_.vocab_size, 0, dg));
  const int64_t n = static_cast<int64_t>(in.seqs.size()), T = md.num_tokens(), R = static_cast<int64_t>(md.logits_rows.size());
  for (size_t i = 0; i < in.seqs.size(); ++i) {  // the window must be there (the block's rows are written)
    const auto& bt = step.seqs[i].block_tables[dg];
    const int64_t lo = std::max<int64_t>(0, in.seqs[i].anchor_pos - cfg_.drafter.window);
    for (int64_t p = lo; p < in.seqs[i].anchor_pos + B; ++p)
      if (p / kPageTokens >= static_cast<int64_t>(bt.size()) || bt[p / kPageTokens] < 0)
        return invalid_argument("draft seq {}: drafter block table does not cover position {}", in.seqs[i].seq_id, p);
  }
  const uint64_t gen0 = backend_->buffer_generation();
  ML4_RETURN_IF_ERROR(backend_->ensure_buffers(T, R, n, maxb));
  if (backend_->buffer_generation() != gen0) {  // every captured graph holds old addresses
    draft_graphs_.clear();
    graphs_.clear();
  }
  CudaBackend::Buffers& b = backend_->buffers();
  cudaStream_t stream = backend_->stream();
  std::vector<int32_t> tok(T), seq_of(T), lengths(T), bt(n * maxb, -1), rows(R), ids(n);
  std::vector<int64_t> pos(T), dslots(T), anchors(n);
  for (int64_t t = 0; t < T; ++t) {
    tok[t] = md.token_ids[t];
    pos[t] = md.positions[t];
    seq_of[t] = md.seq_of_token[t];
    lengths[t] = static_cast<int32_t>(md.positions[t] + 1);
    dslots[t] = md.slots[dg][t];
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto& tab = step.seqs[i].block_tables[dg];
    std::copy(tab.begin(), tab.end(), bt.begin() + i * maxb);
    anchors[i] = in.seqs[i].anchor_pos;
    ids[i] = in.seqs[i].anchor_token;
  }
  for (int64_t i = 0; i < R; ++i) rows[i] = static_cast<int32_t>(md.logits_rows[i]);
  auto h2d = [&](DeviceBuffer& d, const void* src, size_t bytes) {
    return cuda_status(cudaMemcpyAsync(d.data(), src, bytes, cudaMemcpyHostToDevice, stream), "draft metadata");
  };
  ML4_RETURN_IF_ERROR(h2d(b.tok, tok.data(), T * 4));
  ML4_RETURN_IF_ERROR(h2d(b.pos, pos.data(), T * 8));
  ML4_RETURN_IF_ERROR(h2d(b.seq_of, seq_of.data(), T * 4));
  ML4_RETURN_IF_ERROR(h2d(b.lengths, lengths.data(), T * 4));
  ML4_RETURN_IF_ERROR(h2d(b.drafter_slots, dslots.data(), T * 8));
  ML4_RETURN_IF_ERROR(h2d(b.drafter_block_table, bt.data(), bt.size() * 4));
  ML4_RETURN_IF_ERROR(h2d(b.draft_anchor_pos, anchors.data(), n * 8));
  ML4_RETURN_IF_ERROR(h2d(b.draft_ids, ids.data(), n * 4));
  ML4_RETURN_IF_ERROR(h2d(b.row_idx, rows.data(), R * 4));
  // The device draws read the parameters from a fixed device buffer (graph replays too).
  ML4_RETURN_IF_ERROR(backend_->stage_draft_params(device_draws ? params.data() : nullptr,
                                                   device_draws ? static_cast<int64_t>(params.size()) : 0));
  const int64_t maxlen = std::max<int64_t>(1, md.positions.empty() ? 1 : md.positions.back() + 1);
  auto run = [&](CudaBackend::Mode mode, std::vector<GraphExec>* segments) -> Status {
    backend_->begin_forward(T, R, maxlen, mode, segments, mode == CudaBackend::Mode::kEager ? &md : nullptr);
    ML4_RETURN_IF_ERROR(program_->draft(any_sampled ? params.data() : nullptr, want_q, kmax));
    return backend_->finish_forward();
  };
  // Sampled drafts run other kernels (top-k / top-p rows one more), and the Markov head runs
  // kmax slots: all in the key.
  const auto key = std::make_pair(
      n + (any_sampled ? int64_t{1} << 32 : 0) + (cuts ? int64_t{1} << 33 : 0) + (int64_t{kmax} << 40), maxb);
  if (auto it = graph ? draft_graphs_.find(key) : draft_graphs_.end(); it != draft_graphs_.end()) {
    ML4_RETURN_IF_ERROR(run(CudaBackend::Mode::kReplay, &it->second));
    ++draft_replays_;
  } else {
    const uint64_t gen = backend_->buffer_generation();
    ML4_RETURN_IF_ERROR(run(CudaBackend::Mode::kEager, nullptr));
    if (backend_->buffer_generation() != gen) {  // captured addresses are stale
      draft_graphs_.clear();
      graphs_.clear();
    }
    if (graph) {  // capture the same launches for the next drafts of this shape
      std::vector<GraphExec> segments;
      const Status cap = run(CudaBackend::Mode::kCapture, &segments);
      backend_->begin_forward(T, R, maxlen, CudaBackend::Mode::kEager, nullptr, nullptr);
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      cudaStreamIsCapturing(stream, &cs);
      if (cs != cudaStreamCaptureStatusNone) {
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(stream, &g);
        if (g) cudaGraphDestroy(g);
      }
      if (!cap.ok()) {
        (void)cudaGetLastError();
        ML4_LOG_WARN("cuda runner: draft graph capture failed ({}); drafting eagerly", cap.message());
        draft_graphs_ok_ = false;
      } else {
        draft_graphs_.emplace(key, std::move(segments));
      }
    }
  }
  // Kept q (DraftSeq::keep_probs): each such sequence's rows, slot-major in draft_probs, into
  // its slot of verify_q_, where the next step's verification reads them.
  for (int64_t i = 0; i < n; ++i) {
    const DraftSeq& d = in.seqs[i];
    if (!d.keep_probs) {
      drop_kept_q(d.seq_id);  // drafted again without: what was kept is stale
      continue;
    }
    auto it = kept_q_.find(d.seq_id);
    if (it == kept_q_.end()) {
      if (free_q_slots_.empty())
        return resource_exhausted("draft seq {}: device verification holds q for {} sequences already", d.seq_id,
                                  kept_q_.size());
      it = kept_q_.emplace(d.seq_id, KeptQ{free_q_slots_.back(), {}}).first;
      free_q_slots_.pop_back();
    }
    const size_t row = static_cast<size_t>(V) * 4;
    float* dst = verify_q_.as<float>() + it->second.slot * (B - 1) * V;
    const float* src = b.draft_probs.as<float>() + i * V;
    if (n * row <= static_cast<size_t>(INT32_MAX)) {  // one strided copy (its pitch is below 2^31)
      ML4_CUDA_RETURN_IF_ERROR(
          cudaMemcpy2DAsync(dst, row, src, n * row, row, d.num_drafts, cudaMemcpyDeviceToDevice, stream));
    } else {
      for (int j = 0; j < d.num_drafts; ++j)
        ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + j * V, src + j * n * V, row, cudaMemcpyDeviceToDevice, stream));
    }
  }
  std::vector<int32_t> drafted(B * n);
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(drafted.data(), b.draft_ids.data(), drafted.size() * 4, cudaMemcpyDeviceToHost, stream));
  // q is slot-major ([B - 1][n][V]): the slots up to the most drafts any sequence asked for.
  const float* q = nullptr;
  if (in.want_probs) {
    ML4_ASSIGN_OR_RETURN(q, download_floats(b.draft_probs.data(), static_cast<size_t>(kmax * n * V), stream));
  } else {
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  DraftOutput out;
  for (int64_t i = 0; i < n; ++i) {
    const int k = in.seqs[i].num_drafts;
    std::vector<int32_t> t(k);
    for (int j = 0; j < k; ++j) t[j] = drafted[(j + 1) * n + i];
    if (in.seqs[i].keep_probs) kept_q_[in.seqs[i].seq_id].tokens = t;
    out.tokens.push_back(std::move(t));
    if (in.want_probs && in.seqs[i].keep_probs) {
      out.probs.emplace_back();  // kept on the device
    } else if (in.want_probs) {
      std::vector<float> qi;
      qi.reserve(static_cast<size_t>(k) * V);
      for (int j = 0; j < k; ++j) qi.insert(qi.end(), q + (j * n + i) * V, q + (j * n + i + 1) * V);
      out.probs.push_back(std::move(qi));
    }
  }
  return out;
}

Status CudaRunner::read_cache_page(int group, int layer_slot, int64_t block, std::vector<uint8_t>* out) const {
  if (group < 0 || group >= static_cast<int>(spec_.groups.size())) return out_of_range("cache group {}", group);
  const DeviceBuffer* pool = backend_->kv_pool(group, layer_slot);
  if (pool == nullptr || block < 0 || block >= backend_->group_blocks()[group])
    return out_of_range("cache group {} slot {} block {}", group, layer_slot, block);
  const int64_t bytes = spec_.groups[group].page_bytes_per_layer();
  out->resize(bytes);
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(backend_->stream()));
  return cuda_status(
      cudaMemcpy(out->data(), static_cast<const uint8_t*>(pool->data()) + block * bytes, bytes, cudaMemcpyDeviceToHost),
      "read_cache_page");
}

void CudaRunner::bind_thread() const { cudaSetDevice(device_); }

std::vector<KvRegion> CudaRunner::kv_regions() {
  std::vector<KvRegion> out;
  for (size_t g = 0; g < spec_.groups.size(); ++g) {
    const auto& sg = spec_.groups[g];
    if (backend_->group_blocks()[g] <= 0) continue;
    for (size_t slot = 0; slot < sg.layers.size(); ++slot) {
      const DeviceBuffer* pool = backend_->kv_pool(static_cast<int>(g), static_cast<int>(slot));
      if (pool == nullptr) continue;
      out.push_back(KvRegion{static_cast<int>(g), static_cast<int>(slot), const_cast<void*>(pool->data()),
                             sg.page_bytes_per_layer(), backend_->group_blocks()[g], !pool->host()});
    }
  }
  return out;
}

Result<std::unique_ptr<ModelRunner>> load_cuda_runner(const std::string& model_dir, const RunnerOptions& opts,
                                                      double gpu_memory_utilization) {
  CudaRunnerOptions o;
  o.base = opts;
  o.gpu_memory_utilization = gpu_memory_utilization;
  ML4_ASSIGN_OR_RETURN(auto r, CudaRunner::load(model_dir, o));
  return std::unique_ptr<ModelRunner>(std::move(r));
}

}  // namespace ml4::cuda
