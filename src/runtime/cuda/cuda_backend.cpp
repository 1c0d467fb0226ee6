// See cuda_backend.h. Each op names the ops/cuda kernel(s) it launches; the numerics of
// each kernel against its CPU reference are in tests/cuda/.
#include "runtime/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>

#include "kv/paged_kv_cache.h"
#include "ops/cpu/linear.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/cache_write.h"
#include "ops/cuda/context_parallel.h"
#include "ops/cuda/hisparse.h"
#include "kv/latent_layout.h"
#include "ops/cuda/drafter.h"
#include "ops/cuda/sampling.h"
#include "ops/cpu/draft_tokens.h"
#include "ops/cpu/sampling.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/indexer.h"
#include "ops/cuda/requant.h"
#include "ops/cuda/topk.h"
#include "runtime/cuda/synthetic_weights.h"

namespace ml4::cuda {

namespace {

Result<DeviceBuffer> upload_floats(const std::vector<float>& v) {
  ML4_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::alloc(v.size() * 4));
  if (!v.empty()) ML4_RETURN_IF_ERROR(b.upload(v.data(), v.size() * 4));
  return b;
}

// The router runs in f32 (MODEL.md 3.7): a bf16-stored gate is widened once at load.
Result<DeviceLinear> upload_f32_linear(const LinearWeight& w) {
  if (w.format == LinearFormat::kF32) return upload_linear(w);
  LinearWeight f;
  f.name = w.name;
  f.format = LinearFormat::kF32;
  f.out_features = w.out_features;
  f.in_features = w.in_features;
  f.weight = Tensor(DType::kF32, {w.out_features, w.in_features});
  cpu::decode_weight_rows(w, 0, w.out_features, f.weight.mutable_as<float>());
  return upload_linear(f);
}

bool gemv_format(const DeviceLinear& w) {
  return w.format == LinearFormat::kBF16 || w.format == LinearFormat::kFP8Block;
}

}  // namespace

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(const ModelConfig& cfg, const CudaBackendOptions& opts,
                                                         uint64_t synthetic_seed, int64_t max_model_len) {
  if (cfg.has_dsa() && cfg.indexer.head_dim != 128)
    return unimplemented("the CUDA indexer kernels take head_dim 128 (model: {})", cfg.indexer.head_dim);
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->cfg_ = cfg;
  b->opts_ = opts;
  if (const char* v = std::getenv("ML4_MLA_PREFILL"); v && v[0] == '0') b->opts_.mla_prefill_kernel = false;
  if (const char* v = std::getenv("ML4_MLA_PREFILL_PAIRS"); v && v[0] == '0') b->opts_.mla_prefill_pairs = false;
  if (const char* v = std::getenv("ML4_MLA_LATENT_BF16"); v && v[0] == '0') b->opts_.mla_latent_bf16 = false;
  if (const char* v = std::getenv("ML4_INDEXER_WGMMA"); v && (v[0] == '0' || v[0] == '1')) b->opts_.indexer_wgmma = v[0] == '1';
  if (const char* v = std::getenv("ML4_RESIDENT_BLOCKS"); v && std::atoi(v) == 3) b->opts_.resident_blocks_per_sm = 3;
  {  // The GEMV's choices (gemv.h GemvStreamConfig, process-wide), for A/B runs of whole steps:
     // ML4_GEMV_MAX_M, ML4_GEMV_BF16_STREAM, ML4_GEMV_GROUPED_MAX_ROWS, ML4_GEMV_CONV,
     // ML4_GEMV_ROWS, ML4_GEMV_WARP_ROWS, ML4_GEMV_WARP_ROWS_MAX_M, ML4_GEMV_MMA,
     // ML4_GEMV_MMA_MIN_M, ML4_GEMV_MMA_WARPS, ML4_GEMV_PDL_PREFETCH (bytes a block; -1 all, 0 none).
    GemvStreamConfig c = gemv_stream_config();
    auto env_int = [](const char* name, int* v) {
      if (const char* s = std::getenv(name); s && *s) *v = std::atoi(s);
    };
    env_int("ML4_GEMV_MAX_M", &c.max_m);
    env_int("ML4_GEMV_BF16_STREAM", &c.bf16_stream);
    env_int("ML4_GEMV_GROUPED_MAX_ROWS", &c.grouped_max_rows);
    env_int("ML4_GEMV_CONV", &c.conv);
    env_int("ML4_GEMV_ROWS", &c.rows);
    env_int("ML4_GEMV_WARP_ROWS", &c.warp_rows);
    env_int("ML4_GEMV_WARP_ROWS_MAX_M", &c.warp_rows_max_m);
    env_int("ML4_GEMV_MMA", &c.mma);
    env_int("ML4_GEMV_MMA_MIN_M", &c.mma_min_m);
    env_int("ML4_GEMV_MMA_WARPS", &c.mma_warps);
    if (const char* v = std::getenv("ML4_GEMV_PDL_PREFETCH"); v && *v) c.pdl_prefetch_bytes = std::atoll(v);
    gemv_set_stream_config(c);
  }
  b->synthetic_seed_ = synthetic_seed;
  b->max_model_len_ = max_model_len;
  // Three priorities, so that the block dispatcher serves the latency-bound chains before bulk
  // weight streams that do not wait for them: the indexer's side lanes (its small projections,
  // key path, query quantization, scores and top-k) above the main stream (whose q projection,
  // thousands of blocks, otherwise queued ahead of them and held the chain ~25 us a layer), and
  // the main stream (the router's chain) above the low lane (the shared expert:
  // CudaBackendOptions::shared_expert_lane). Graphs keep them (end_segment).
  // ML4_STREAM_PRIORITY=0 leaves every stream at the default, =1 puts the side lanes level with
  // the main stream (the A/B of the priorities).
  int least = 0, greatest = 0;
  ML4_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  int side_priority = greatest, main_priority = std::min(greatest + 1, least);  // lower is served first
  if (const char* v = std::getenv("ML4_STREAM_PRIORITY"); v && v[0] == '0') least = side_priority = main_priority = 0;
  else if (v && v[0] == '1') main_priority = side_priority;
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&b->stream_, cudaStreamNonBlocking, main_priority));
  if (cfg.has_dsa() && opts.overlap_indexer) {
    for (cudaStream_t& st : b->side_streams_)
      ML4_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&st, cudaStreamNonBlocking, side_priority));
    for (cudaEvent_t* e : {&b->ev_side_[0], &b->ev_side_[1], &b->ev_lane_[0], &b->ev_lane_[1]})
      ML4_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&b->low_stream_, cudaStreamNonBlocking, least));
  for (cudaEvent_t* e : {&b->ev_low_[0], &b->ev_low_[1]})
    ML4_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  ML4_ASSIGN_OR_RETURN(b->lt_, LtGemm::create());
  b->buf_ = std::make_unique<Buffers>();
  return b;
}

CudaBackend::~CudaBackend() {
  buf_.reset();
  for (cudaEvent_t e : {ev_side_[0], ev_side_[1], ev_lane_[0], ev_lane_[1], ev_low_[0], ev_low_[1]})
    if (e) cudaEventDestroy(e);
  for (cudaStream_t st : side_streams_)
    if (st) cudaStreamDestroy(st);
  if (low_stream_) cudaStreamDestroy(low_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

// ---- weights ----

Status CudaBackend::set_embedding(const Tensor& table) {
  if (synthetic_seed_ != 0) {
    const int64_t n = static_cast<int64_t>(cfg_.vocab_size) * cfg_.dim;
    ML4_ASSIGN_OR_RETURN(embed_, DeviceBuffer::alloc(n * 2));
    ML4_RETURN_IF_ERROR(fill_synthetic_bf16(embed_.data(), n, 1.0f, synthetic_seed_));
    embed_dtype_ = DType::kBF16;
  } else {
    ML4_ASSIGN_OR_RETURN(embed_, DeviceBuffer::alloc(table.nbytes()));
    ML4_RETURN_IF_ERROR(embed_.upload(table.data(), table.nbytes()));
    embed_dtype_ = table.dtype();
  }
  weight_bytes_ += static_cast<int64_t>(embed_.bytes());
  return ok_status();
}

Result<DeviceLinear> CudaBackend::make_linear(const LinearWeight& w) {
  if ((w.format == LinearFormat::kNVFP4 || w.format == LinearFormat::kMXFP4) && !opts_.fp4_weights)
    return unimplemented("{}: {} weights with CudaRunnerOptions::fp4_weights off", w.name, linear_format_name(w.format));
  DeviceLinear d;
  if (synthetic_seed_ != 0) {
    ML4_ASSIGN_OR_RETURN(d, synthetic_linear(w, synthetic_seed_ * 1000003u + ++synthetic_counter_));
  } else {
    ML4_ASSIGN_OR_RETURN(d, upload_linear(w));
  }
  weight_bytes_ += static_cast<int64_t>(d.bytes());
  max_in_ = std::max({max_in_, d.K, d.N});
  return d;
}

Result<LinearRef> CudaBackend::add_linear(const LinearWeight& w, LinearUse use) {
  DeviceLinear d;
  switch (use) {
    case LinearUse::kDefault: {
      ML4_ASSIGN_OR_RETURN(d, make_linear(w));
      break;
    }
    case LinearUse::kRouter: {
      if (synthetic_seed_ != 0) {
        // Seeded by the MoE layer's index (the routers' synthetic values predate the program).
        int l = 0;
        for (int seen = -1; l < cfg_.n_layers; ++l)
          if (cfg_.layers[l].ffn == FfnKind::kMoe && ++seen == routers_) break;
        LinearWeight g = w;
        g.format = LinearFormat::kF32;
        ML4_ASSIGN_OR_RETURN(d, synthetic_linear(g, synthetic_seed_ * 7919u + l));
      } else {
        ML4_ASSIGN_OR_RETURN(d, upload_f32_linear(w));
      }
      ++routers_;
      weight_bytes_ += static_cast<int64_t>(d.bytes());
      max_in_ = std::max({max_in_, d.K, d.N});
      break;
    }
  }
  linears_.push_back(std::move(d));
  router_.push_back(use == LinearUse::kRouter);
  return LinearRef{static_cast<int>(linears_.size()) - 1};
}

Result<MlpRef> CudaBackend::add_mlp(const MlpWeights& m) {
  MlpRef r;
  ML4_ASSIGN_OR_RETURN(r.w1, add_linear(m.w1, LinearUse::kDefault));
  ML4_ASSIGN_OR_RETURN(r.w2, add_linear(m.w2, LinearUse::kDefault));
  ML4_ASSIGN_OR_RETURN(r.w3, add_linear(m.w3, LinearUse::kDefault));
  r.hidden = linears_[r.w1.id].N;
  max_hidden_ = std::max(max_hidden_, r.hidden);
  return r;
}

Result<const float*> CudaBackend::add_vector(const std::vector<float>& v) {
  if (v.empty()) return static_cast<const float*>(nullptr);
  ML4_ASSIGN_OR_RETURN(DeviceBuffer b, upload_floats(v));
  weight_bytes_ += static_cast<int64_t>(b.bytes());
  vectors_.push_back(std::move(b));
  return vectors_.back().as<float>();
}

Result<MoeRef> CudaBackend::add_moe(const std::vector<MlpWeights>& experts, const MlpWeights* shared) {
  Moe m;
  auto up_mlp = [&](DeviceMlp& dst, const MlpWeights& src) -> Status {
    ML4_ASSIGN_OR_RETURN(dst.w1, make_linear(src.w1));
    ML4_ASSIGN_OR_RETURN(dst.w2, make_linear(src.w2));
    ML4_ASSIGN_OR_RETURN(dst.w3, make_linear(src.w3));
    max_hidden_ = std::max(max_hidden_, dst.w1.N);
    return ok_status();
  };
  if (opts_.experts_to_mxfp4 && !opts_.fp4_weights)
    return unimplemented("experts re-quantized to MXFP4 need the GPU's FP4 path (CudaRunnerOptions::fp4_weights is off)");
  m.experts.resize(experts.size());
  for (size_t e = 0; e < experts.size(); ++e) {
    ML4_RETURN_IF_ERROR(up_mlp(m.experts[e], experts[e]));
    if (!opts_.experts_to_mxfp4) continue;
    // One FP8 matrix on the device at a time beside the MXFP4 results (requant.h).
    const auto t0 = std::chrono::steady_clock::now();
    for (DeviceLinear* l : {&m.experts[e].w1, &m.experts[e].w2, &m.experts[e].w3}) {
      if (l->format != LinearFormat::kFP8Block) continue;
      requant_transient_bytes_ = std::max(requant_transient_bytes_, static_cast<int64_t>(l->bytes()));
      ML4_ASSIGN_OR_RETURN(DeviceLinear q, requantize_fp8_to_mxfp4_device(*l, stream_));
      weight_bytes_ += static_cast<int64_t>(q.bytes()) - static_cast<int64_t>(l->bytes());
      *l = std::move(q);
    }
    requant_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  for (const auto& e : m.experts) routed_expert_bytes_ += static_cast<int64_t>(e.w1.bytes() + e.w2.bytes() + e.w3.bytes());
  if (shared != nullptr) {
    m.shared = std::make_unique<DeviceMlp>();
    ML4_RETURN_IF_ERROR(up_mlp(*m.shared, *shared));
  }
  auto t = build_expert_tables(m.experts, m.shared.get());
  if (t.ok() && t->format != LinearFormat::kF32)
    m.tables = std::make_unique<MoeExpertTables>(std::move(t).value());
  moes_.push_back(std::move(m));
  return MoeRef{static_cast<int>(moes_.size()) - 1};
}

Status CudaBackend::reserve_selections(int n) {
  num_selections_ = n;
  buf_->T = 0;  // the next ensure_buffers sizes the selection buffers
  return ok_status();
}

// ---- memory ----

Status CudaBackend::allocate_kv(const KvCacheSpec& spec, const std::vector<int64_t>& blocks, bool host_latent) {
  kv_dtype_ = spec.dtype;
  latent_group_ = spec.group_index(CacheGroupSpec::kLatent);
  indexer_group_ = spec.group_index(CacheGroupSpec::kIndexer);
  drafter_group_ = spec.group_index(CacheGroupSpec::kDrafter);
  num_blocks_ = blocks[latent_group_];
  group_blocks_ = blocks;
  ML4_RETURN_IF_ERROR(allocate_hot_pool());
  kv_.clear();
  kv_.resize(spec.groups.size());
  for (size_t gi = 0; gi < spec.groups.size(); ++gi) {
    const auto& g = spec.groups[gi];
    for (size_t slot = 0; slot < g.layers.size(); ++slot) {
      const size_t bytes = std::max<int64_t>(blocks[gi], 1) * g.page_bytes_per_layer();
      const bool host = host_latent && static_cast<int>(gi) == latent_group_;
      ML4_ASSIGN_OR_RETURN(DeviceBuffer b, host ? DeviceBuffer::alloc_host_mapped(bytes) : DeviceBuffer::alloc(bytes));
      ML4_RETURN_IF_ERROR(b.fill_bytes(0));
      (host ? host_kv_bytes_ : kv_bytes_) += static_cast<int64_t>(b.bytes());
      kv_[gi].push_back(std::move(b));
    }
  }
  return ok_status();
}

const DeviceBuffer* CudaBackend::kv_pool(int group, int layer_slot) const {
  if (group < 0 || group >= static_cast<int>(kv_.size())) return nullptr;
  if (layer_slot < 0 || layer_slot >= static_cast<int>(kv_[group].size())) return nullptr;
  return &kv_[group][layer_slot];
}

// The sparse MLA prefill kernel's workspace at most (its bf16 scratch is 73.7 KB per cache page:
// 256 MiB holds 3,640 pages, 233k distinct tokens; a 32k-token prefill touches at most 512).
constexpr size_t kMaxPrefillScratchBytes = size_t{256} << 20;

Status CudaBackend::ensure_buffers(int64_t T, int64_t R, int64_t S, int64_t maxb) {
  Buffers& b = *buf_;
  const ModelConfig& c = cfg_;
  const int64_t D = c.dim, H = c.n_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim, r = c.kv_lora_rank,
                dr = c.qk_rope_head_dim;
  const int64_t E = std::max(c.moe.num_experts, 1), K = std::max(c.moe.num_experts_per_tok, 1);
  if (T > b.T) {
    ++buffer_generation_;
    const int64_t n = std::max(T, 2 * b.T);
    auto f = [&](DeviceBuffer& d, int64_t count, size_t elem) -> Status {
      ML4_ASSIGN_OR_RETURN(d, DeviceBuffer::alloc(static_cast<size_t>(std::max<int64_t>(count, 1)) * elem));
      return ok_status();
    };
    ML4_RETURN_IF_ERROR(f(b.residual, n * D, 4));
    ML4_RETURN_IF_ERROR(f(b.a, n * D, 4));
    ML4_RETURN_IF_ERROR(f(b.tmp, n * D, 4));
    ML4_RETURN_IF_ERROR(f(b.q, n * H * qk, 4));
    ML4_RETURN_IF_ERROR(f(b.qlat_in, n * std::max(c.q_lora_rank, 1), 4));
    ML4_RETURN_IF_ERROR(f(b.ckv, n * (r + dr), 4));
    ML4_RETURN_IF_ERROR(f(b.c, n * r, 4));
    ML4_RETURN_IF_ERROR(f(b.q_lat, n * H * r, 4));
    ML4_RETURN_IF_ERROR(f(b.head_scale, n * H, 4));
    ML4_RETURN_IF_ERROR(f(b.out_lat, n * H * r, 4));
    ML4_RETURN_IF_ERROR(f(b.lse, n * H, 4));
    ML4_RETURN_IF_ERROR(f(b.o, n * H * c.v_head_dim, 4));
    ML4_RETURN_IF_ERROR(f(b.router, n * E, 4));
    ML4_RETURN_IF_ERROR(f(b.router_counter, 1, router_route_counter_bytes()));
    // On the step stream (non-blocking: a plain cudaMemset would not order before the kernel);
    // router_route leaves it at 0 after each launch.
    ML4_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.router_counter.data(), 0, b.router_counter.bytes(), stream_));
    ML4_RETURN_IF_ERROR(f(b.ids, n * K, 4));
    ML4_RETURN_IF_ERROR(f(b.wts, n * K, 4));
    ML4_RETURN_IF_ERROR(f(b.tok, n, 4));
    ML4_RETURN_IF_ERROR(f(b.pos, n, 8));
    ML4_RETURN_IF_ERROR(f(b.slots, n, 8));
    ML4_RETURN_IF_ERROR(f(b.seq_of, n, 4));
    ML4_RETURN_IF_ERROR(f(b.lengths, n, 4));
    ML4_RETURN_IF_ERROR(f(b.gemv_ws, gemv_workspace_floats(kGemvMaxM, 1, 1) * max_in_, 4));
    for (int lane = 0; lane < kSideLanes; ++lane)
      if (side_streams_[lane])
        ML4_RETURN_IF_ERROR(f(b.gemv_ws_side[lane], gemv_workspace_floats(kGemvMaxM, 1, 1) * max_in_, 4));
    ML4_RETURN_IF_ERROR(b.lin.reserve(n * max_in_, n * ((max_in_ + 127) / 128)));
    if (c.has_dsa()) {
      const int64_t HI = c.indexer.n_heads, dI = c.indexer.head_dim, k = c.indexer.topk;
      ML4_RETURN_IF_ERROR(f(b.iq, n * HI * dI, 4));
      ML4_RETURN_IF_ERROR(f(b.ik, n * dI, 4));
      ML4_RETURN_IF_ERROR(f(b.iw, n * HI, 4));
      ML4_RETURN_IF_ERROR(f(b.iq8, n * HI * dI, 1));
      ML4_RETURN_IF_ERROR(f(b.iqs, n * HI, 4));
      ML4_RETURN_IF_ERROR(f(b.idx_slots, n, 8));
      ML4_RETURN_IF_ERROR(f(b.topk_pos, n * k, 4));
      // topk's multi-block path (small steps over long contexts): the most splits it can pick.
      b.topk_ws_bytes = topk_max_workspace_bytes(n, max_model_len_);
      ML4_RETURN_IF_ERROR(f(b.topk_ws, static_cast<int64_t>(b.topk_ws_bytes), 1));
      b.topk_slots.resize(num_selections_);
      b.topk_counts.resize(num_selections_);
      for (int i = 0; i < num_selections_; ++i) {
        ML4_RETURN_IF_ERROR(f(b.topk_slots[i], n * k, 4));
        ML4_RETURN_IF_ERROR(f(b.topk_counts[i], n, 4));
      }
    }
    ML4_RETURN_IF_ERROR(f(b.forced_ids, n * K, 4));
    if (drafter_) {
      const int64_t nt = static_cast<int64_t>(c.drafter.target_layers.size()), rr = c.drafter.rnn_rank;
      const int64_t Bk = c.drafter.block_size, V = c.vocab_size;
      const int64_t ns = n / std::max<int64_t>(Bk, 1) + 1;  // sequences of a draft step of n tokens
      ML4_RETURN_IF_ERROR(f(b.drafter_slots, n, 8));
      ML4_RETURN_IF_ERROR(f(b.draft_anchor_pos, ns, 8));
      ML4_RETURN_IF_ERROR(f(b.draft_hidden, n * nt * D, 4));
      ML4_RETURN_IF_ERROR(f(b.draft_ctx, n * D, 4));
      ML4_RETURN_IF_ERROR(f(b.markov_x, ns * (D + rr), 4));
      ML4_RETURN_IF_ERROR(f(b.markov_e, ns * rr, 4));
      ML4_RETURN_IF_ERROR(f(b.markov_gi, ns * 3 * rr, 4));
      ML4_RETURN_IF_ERROR(f(b.markov_gh, ns * 3 * rr, 4));
      ML4_RETURN_IF_ERROR(f(b.markov_s, ns * rr, 4));
      ML4_RETURN_IF_ERROR(f(b.markov_logits, ns * V, 4));
      ML4_RETURN_IF_ERROR(f(b.draft_ids, Bk * ns, 4));
      ML4_RETURN_IF_ERROR(f(b.draft_probs, (Bk - 1) * ns * V, 4));
      ML4_RETURN_IF_ERROR(f(b.draft_samp_params, (Bk - 1) * ns * static_cast<int64_t>(sizeof(DeviceSamplingParams)), 1));
      ML4_RETURN_IF_ERROR(f(b.draft_samp_logprobs, ns, 4));
      ML4_RETURN_IF_ERROR(f(b.draft_samp_ws,
                            static_cast<int64_t>(std::max({sample_rows_workspace_bytes(ns, V),
                                                           argmax_rows_workspace_bytes(ns, V),
                                                           draft_rows_workspace_bytes(ns, V)})),
                            1));
    }
    b.moe = MoeScratch{};
    ML4_RETURN_IF_ERROR(
        b.moe.reserve(n * K, D, std::max<int64_t>(max_hidden_, 1), static_cast<int>(E), opts_.grouped_moe_gemm));
    b.T = n;
  }
  if (R > b.R) {
    ++buffer_generation_;
    const int64_t n = std::max(R, 2 * b.R);
    ML4_ASSIGN_OR_RETURN(b.rows, DeviceBuffer::alloc(n * D * 4));
    ML4_ASSIGN_OR_RETURN(b.normed, DeviceBuffer::alloc(n * D * 4));
    ML4_ASSIGN_OR_RETURN(b.logits, DeviceBuffer::alloc(n * c.vocab_size * 4));
    if (opts_.tensor_parallel) {
      ML4_ASSIGN_OR_RETURN(b.logits_parts, DeviceBuffer::alloc(n * c.vocab_size * 4));
    }
    ML4_ASSIGN_OR_RETURN(b.row_idx, DeviceBuffer::alloc(n * 4));
    b.R = n;
  }
  if (S * maxb > b.bt_cap) {
    ++buffer_generation_;
    ML4_ASSIGN_OR_RETURN(b.block_table, DeviceBuffer::alloc(std::max<int64_t>(S * maxb, 1) * 4));
    ML4_ASSIGN_OR_RETURN(b.idx_block_table, DeviceBuffer::alloc(std::max<int64_t>(S * maxb, 1) * 4));
    if (drafter_) {
      ML4_ASSIGN_OR_RETURN(b.drafter_block_table, DeviceBuffer::alloc(std::max<int64_t>(S * maxb, 1) * 4));
    }
    b.bt_cap = S * maxb;
  }
  b.maxb = maxb;  // this step's block-table row stride
  b.bt_rows = S;
  point_activations();
  return ok_status();
}

void CudaBackend::point_activations() {
  Buffers& b = *buf_;
  acts_.residual = b.residual.as<float>();
  acts_.a = b.a.as<float>();
  acts_.tmp = b.tmp.as<float>();
  acts_.q = b.q.as<float>();
  acts_.q_latent = b.qlat_in.as<float>();
  acts_.ckv = b.ckv.as<float>();
  acts_.c = b.c.as<float>();
  acts_.q_lat = b.q_lat.as<float>();
  acts_.head_scale = b.head_scale.as<float>();
  acts_.out_lat = b.out_lat.as<float>();
  acts_.lse = b.lse.as<float>();
  acts_.o = b.o.as<float>();
  acts_.router = b.router.as<float>();
  acts_.expert_ids = b.ids.as<int32_t>();
  acts_.expert_wts = b.wts.as<float>();
  acts_.ffn_g = b.moe.g.as<float>();
  acts_.ffn_u = b.moe.u.as<float>();
  acts_.iq = b.iq.as<float>();
  acts_.ik = b.ik.as<float>();
  acts_.iw = b.iw.as<float>();
  acts_.rows = b.rows.as<float>();
  acts_.normed = b.normed.as<float>();
  acts_.logits = b.logits.as<float>();
  acts_.logits_parts = opts_.tensor_parallel ? b.logits_parts.as<float>() : nullptr;
  acts_.draft_hidden = b.draft_hidden.as<float>();
  acts_.draft_ctx = b.draft_ctx.as<float>();
  acts_.markov_x = b.markov_x.as<float>();
  acts_.markov_e = b.markov_e.as<float>();
  acts_.markov_gi = b.markov_gi.as<float>();
  acts_.markov_gh = b.markov_gh.as<float>();
  acts_.markov_s = b.markov_s.as<float>();
  acts_.markov_logits = b.markov_logits.as<float>();
  acts_.draft_ids = b.draft_ids.as<int32_t>();
  acts_.draft_probs = b.draft_probs.as<float>();
}

void CudaBackend::begin_forward(int64_t T, int64_t R, int64_t maxlen, Mode mode, std::vector<GraphExec>* segments,
                                const StepMetadata* md, int64_t bucket_T, bool rows_are_tokens) {
  step_T_ = T;
  rows_are_tokens_ = rows_are_tokens;
  bucket_T_ = bucket_T > 0 ? bucket_T : T;
  step_R_ = R;
  step_maxlen_ = maxlen;
  mode_ = mode;
  segments_ = segments;
  md_ = md;
  resident_trace_layer_ = 0;
  in_segment_ = false;
  next_graph_ = 0;
  pending_absorb_ = {};  // an aborted forward's (mla_latent_bf16)
  lat_out_bf16_ = nullptr;
}

// ---- schedule ----

Status CudaBackend::end_segment() {
  if (!in_segment_) return ok_status();
  in_segment_ = false;
  ML4_RETURN_IF_ERROR(join_low());  // a capture ends with every stream it forked joined
  if (mode_ != Mode::kCapture) return ok_status();
  cudaGraph_t g = nullptr;
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream_, &g));
  cudaGraphExec_t exec = nullptr;
  // Each kernel node keeps the priority of the stream it was captured from.
  const cudaError_t inst = cudaGraphInstantiateWithFlags(&exec, g, cudaGraphInstantiateFlagUseNodePriority);
  cudaGraphDestroy(g);
  ML4_CUDA_RETURN_IF_ERROR(inst);
  segments_->emplace_back(exec);
  return ok_status();
}

Status CudaBackend::segment(const Fn& fn) {
  if (!in_segment_) {
    in_segment_ = true;
    if (mode_ == Mode::kCapture) ML4_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    if (mode_ == Mode::kReplay) {
      if (next_graph_ >= segments_->size()) return internal_error("graph replay: segment {} missing", next_graph_);
      ML4_CUDA_RETURN_IF_ERROR(cudaGraphLaunch((*segments_)[next_graph_++], stream_));
    }
  }
  return mode_ == Mode::kReplay ? ok_status() : fn();
}

Status CudaBackend::host_sync(const Fn& fn) {
  ML4_RETURN_IF_ERROR(end_segment());
  return mode_ == Mode::kCapture ? ok_status() : fn();
}

Status CudaBackend::finish_forward() {
  ML4_RETURN_IF_ERROR(end_segment());
  if (mode_ == Mode::kReplay && next_graph_ != segments_->size())
    return internal_error("graph replay: {} of {} segments launched", next_graph_, segments_->size());
  return ok_status();
}

// Profiling (eager steps only): events around one piece of the forward, its GPU
// milliseconds added to (*profile_)[label].
Status CudaBackend::timed(const char* label, const Fn& fn) {
  if (profile_ == nullptr || mode_ != Mode::kEager) return fn();
  ML4_ASSIGN_OR_RETURN(const double ms, stream_ms(stream_, fn));
  (*profile_)[label] += ms;
  return ok_status();
}

bool CudaBackend::can_overlap(std::initializer_list<LinearRef> linears) const {
  if (side_streams_[0] == nullptr || !opts_.overlap_indexer || (profile_ != nullptr && mode_ == Mode::kEager))
    return false;
  // Only the GEMV may run on both streams at once (each has its own workspace); cuBLASLt
  // shares one workspace and scratch.
  for (LinearRef r : linears) {
    if (!r.valid()) continue;
    const DeviceLinear& w = linears_[r.id];
    if (router_[r.id] || !gemv_format(w) || !(opts_.exact_activations || step_T_ <= kGemvMaxM)) return false;
  }
  return true;
}

// fn runs with stream_ switched to the lane's stream (and lin() to its GEMV workspace), after
// everything issued so far on the main stream.
Status CudaBackend::side(const Fn& fn, int lane) {
  if (lane < 0 || lane >= kSideLanes || on_lane_ >= 0)
    return internal_error("side: lane {} (inside lane {})", lane, on_lane_);
  cudaEvent_t ev = ev_side_[side_calls_++ % 2];
  ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, stream_));
  std::swap(stream_, side_streams_[lane]);
  on_lane_ = lane;
  lane_used_[lane] = true;
  Status st = cuda_status(cudaStreamWaitEvent(stream_, ev, 0), "side stream wait");
  if (st.ok()) st = fn();
  std::swap(stream_, side_streams_[lane]);
  on_lane_ = -1;
  return st;
}

Status CudaBackend::wait_lane(int lane) {
  if (lane < 0 || lane >= kSideLanes || lane == on_lane_)
    return internal_error("wait_lane: lane {} from lane {}", lane, on_lane_);
  ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_lane_[lane], side_streams_[lane]));
  return cuda_status(cudaStreamWaitEvent(stream_, ev_lane_[lane], 0), "wait_lane");
}

Status CudaBackend::join_side() {
  for (int lane = 0; lane < kSideLanes; ++lane) {
    if (!lane_used_[lane]) continue;
    ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_lane_[lane], side_streams_[lane]));
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ev_lane_[lane], 0));
    lane_used_[lane] = false;
  }
  ++overlapped_layers_;
  return ok_status();
}

// ---- ops ----

Status CudaBackend::set_embedding_shard(const Tensor& table, int64_t first_id) {
  if (synthetic_seed_ != 0 && first_id != 0)
    return unimplemented("synthetic weights with a vocabulary-parallel embedding");
  ML4_RETURN_IF_ERROR(set_embedding(table));
  embed_first_ = first_id;
  embed_rows_ = table.dim(0);
  return ok_status();
}

Status CudaBackend::embedding(float* out) {
  if (embed_first_ >= 0) {
    EmbeddingParams p{embed_.data(), embed_dtype_, embed_rows_, cfg_.dim, buf_->tok.as<int32_t>(), step_T_, out, stream_};
    p.shard = true;
    p.first_id = embed_first_;
    return cuda::embedding(p);
  }
  return cuda::embedding({embed_.data(), embed_dtype_, cfg_.vocab_size, cfg_.dim, buf_->tok.as<int32_t>(), step_T_, out, stream_});
}

Status CudaBackend::rms_norm(const NormArgs& p) {
  RmsNormParams np{p.x, p.residual, p.w, p.rows, p.dim, p.eps, p.y, nullptr, stream_};
  np.x_stride = p.x_stride;
  return cuda::rms_norm(np);
}

Status CudaBackend::layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t dim, float eps,
                               float* y) {
  return cuda::layer_norm({x, w, b, rows, dim, eps, y, stream_});
}

// M <= 8 rows (decode) go through our GEMV (f32 activations, gemv.h); larger M through
// cuBLASLt (bf16 / e4m3 activations). exact_activations forces the GEMV path in 8-row chunks
// everywhere: every linear then matches cpu::linear to f32 rounding. Routers: f32 GEMM.
Status CudaBackend::lin(const DeviceLinear& w, const float* x, int64_t M, float* y) {
  if (gemv_format(w) && (opts_.exact_activations || M <= kGemvMaxM)) {
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxM) {
      const int64_t m = std::min<int64_t>(kGemvMaxM, M - m0);
      float* ws = (on_lane_ >= 0 ? buf_->gemv_ws_side[on_lane_] : buf_->gemv_ws).as<float>();
      GemvParams gp{x + m0 * w.K, m, w.N, w.K, w.format, w.weight.data(), w.scale.as<float>(), y + m0 * w.N, ws, stream_};
      gp.x_parts = opts_.fp4_x_parts;  // FP4 only
      ML4_RETURN_IF_ERROR(gemv(gp).with_context(w.name));
    }
    return ok_status();
  }
  return linear_f32(*lt_, w, x, M, y, buf_->lin, stream_).with_context(w.name);
}

Status CudaBackend::linear(LinearRef w, const float* x, int64_t M, float* y) {
  if (!w.valid() || w.id >= static_cast<int>(linears_.size())) return internal_error("linear: no weight {}", w.id);
  if (router_[w.id]) return linear_f32(*lt_, linears_[w.id], x, M, y, buf_->lin, stream_).with_context("router");
  return lin(linears_[w.id], x, M, y);
}

Status CudaBackend::silu_mul(const float* g, const float* u, int64_t rows, int64_t cols, float* out) {
  return cuda::silu_mul({g, u, rows, cols, 0, 0, out, nullptr, stream_});
}

// RoPE of this step's tokens (LeRoPE positions, YaRN factor): the q path's shared fields.
QPathParams CudaBackend::rope_params(const RopeArgs& r) const {
  QPathParams p;
  p.q = r.x;
  p.T = step_T_;
  p.H = r.heads;
  p.head_stride = r.stride;
  p.rope_offset = r.offset;
  p.rope_dim = r.dim;
  p.positions = buf_->pos.as<int64_t>();
  p.inv_freq = r.inv_freq;
  p.attn_factor = r.attn_factor;
  p.neox = r.neox;
  p.lerope = cfg_.lerope;
  p.stream = stream_;
  return p;
}

Status CudaBackend::rope(const RopeArgs& p) { return cuda::q_path(rope_params(p)); }

RopeRows CudaBackend::rope_rows(const RopeArgs& r) const {
  const QPathParams q = rope_params(r);
  RopeRows o;
  o.dim = q.rope_dim;
  o.positions = q.positions;
  o.inv_freq = q.inv_freq;
  o.attn_factor = q.attn_factor;
  o.lerope = q.lerope.enabled;
  o.lerope_window = q.lerope.window;
  o.lerope_leak = q.lerope.leak;
  return o;
}

const int32_t* CudaBackend::selection_counts(int selection) const {
  if (selection == kBlockWindow) return buf_->window_counts.as<int32_t>();
  return selection >= 0 ? buf_->topk_counts[selection].as<int32_t>() : nullptr;
}

Status CudaBackend::q_path(const QPathArgs& a) {
  QPathParams qp = rope_params(a.rope);
  qp.apply_rope = a.apply_rope;
  qp.base_scale = a.base_scale;
  qp.llama4 = a.llama4;
  qp.ssmax_s = a.ssmax_s;
  qp.n_keys = selection_counts(a.selection);
  qp.head_scale = a.head_scale;
  return cuda::q_path(qp);
}

Status CudaBackend::latent_cache_write(CacheGroup group, int cache_slot, const float* c, const float* kr,
                                       int kr_stride) {
  const bool draft = group == CacheGroup::kDrafter;
  LatentCacheWriteParams w;
  w.c = c;
  w.kr = kr;
  w.kr_stride = kr_stride;
  w.slots = (draft ? buf_->drafter_slots : buf_->slots).as<int64_t>();
  w.T = step_T_;
  w.r = cfg_.kv_lora_rank;
  w.dr = cfg_.qk_rope_head_dim;
  w.dtype = draft ? KvCacheDtype::kBf16 : kv_dtype_;  // MODEL.md 5: the drafter's window is bf16
  w.cache = kv_[draft ? drafter_group_ : latent_group_][cache_slot].data();
  w.num_slots = (draft ? group_blocks_[drafter_group_] : num_blocks_) * kPageTokens;
  w.stream = stream_;
  return cuda::latent_cache_write(w);
}

Status CudaBackend::indexer_key_write(int cache_slot, float* k) {
  IndexerCacheWriteParams wp;
  wp.k = k;
  wp.slots = buf_->idx_slots.as<int64_t>();
  wp.T = step_T_;
  wp.dI = cfg_.indexer.head_dim;
  wp.cache = kv_[indexer_group_][cache_slot].data();
  wp.num_blocks = group_blocks_[indexer_group_];
  wp.stream = stream_;
  return indexer_cache_write(wp);
}

// RMSNorm + RoPE + the latent write in one kernel (issue 19) when fused_indexer; the three
// launches otherwise (Backend's default).
Status CudaBackend::latent_key_path(float* ckv, int r, int dr, const float* w, float eps, const RopeArgs* rope,
                                    int cache_slot, float* c) {
  if (!opts_.fused_indexer || (rope != nullptr && (rope->x != ckv || rope->offset != r || rope->heads != 1 ||
                                                   rope->stride != r + dr || rope->dim != dr)))
    return Backend::latent_key_path(ckv, r, dr, w, eps, rope, cache_slot, c);
  LatentKeyPathParams p;
  p.ckv = ckv;
  p.ckv_stride = r + dr;
  p.c = c;
  p.norm_w = w;
  p.eps = eps;
  p.rope = rope != nullptr;
  if (rope != nullptr) {
    p.rope_rows = rope_rows(*rope);
    p.neox = rope->neox;
  }
  p.slots = buf_->slots.as<int64_t>();
  p.T = step_T_;
  p.r = r;
  p.dr = dr;
  p.dtype = kv_dtype_;
  p.cache = kv_[latent_group_][cache_slot].data();
  p.num_slots = num_blocks_ * kPageTokens;
  p.stream = stream_;
  return cuda::latent_key_path(p);
}

// LayerNorm + RoPE + the key write in one kernel (issue 19) when fused_indexer; the three
// launches otherwise (Backend's default).
Status CudaBackend::indexer_key_path(float* k, int64_t dim, const float* w, const float* b, float eps,
                                     const RopeArgs* rope, int cache_slot) {
  if (!opts_.fused_indexer || dim != 128 ||
      (rope != nullptr && (rope->offset != 0 || rope->heads != 1 || !rope->neox || rope->dim > dim)))
    return Backend::indexer_key_path(k, dim, w, b, eps, rope, cache_slot);
  IndexerKeyPathParams p;
  p.k = k;
  p.T = step_T_;
  p.dI = static_cast<int>(dim);
  p.ln_w = w;
  p.ln_b = b;
  p.eps = eps;
  p.rope = rope != nullptr;
  if (rope != nullptr) p.rope_rows = rope_rows(*rope);
  p.slots = buf_->idx_slots.as<int64_t>();
  p.cache = kv_[indexer_group_][cache_slot].data();
  p.num_blocks = group_blocks_[indexer_group_];
  p.stream = stream_;
  return cuda::indexer_key_path(p);
}

// Hadamard + FP8 of the queries, then for a chunk of tokens at a time the scores over the
// pages (f32 or FP8 tensor cores) and the radix top-k straight into latent cache slots.
Status CudaBackend::indexer_select(const IndexerSelectArgs& a) {
  Buffers& b = *buf_;
  const int HI = cfg_.indexer.n_heads, dI = cfg_.indexer.head_dim;
  const int k = cfg_.indexer.topk;
  const int64_t T = step_T_;
  IndexerQueryQuantParams qq{a.q, T * HI, dI, true, b.iq8.data(), b.iqs.as<float>(), stream_};
  const RopeArgs* r = a.q_rope;
  if (r != nullptr && opts_.fused_indexer && r->neox && r->offset == 0 && r->heads == HI && r->stride == dI) {
    qq.rope = true;  // rotated inside the quantization (issue 19)
    qq.heads = HI;
    qq.rope_rows = rope_rows(*r);
  } else if (r != nullptr) {
    ML4_RETURN_IF_ERROR(rope(*r));
  }
  ML4_RETURN_IF_ERROR(indexer_query_quant(qq));
  if (a.keys_lane >= 0) ML4_RETURN_IF_ERROR(wait_lane(a.keys_lane));  // this token's key, the head weights
  const int64_t maxlen = step_maxlen_;
  // Scores of a chunk of tokens at a time: at most 64 Mi floats (256 MiB) of scores.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(T, (int64_t{64} << 20) / maxlen));
  if (chunk * maxlen > b.scores_cap) {
    ++buffer_generation_;
    ML4_ASSIGN_OR_RETURN(b.scores, DeviceBuffer::alloc(chunk * maxlen * 4));
    b.scores_cap = chunk * maxlen;
  }
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    IndexerScoresParams sp;
    sp.q = static_cast<const uint8_t*>(b.iq8.data()) + t0 * HI * dI;
    sp.q_scale = b.iqs.as<float>() + t0 * HI;
    sp.weights = a.w + t0 * HI;
    sp.weight_scale = a.weight_scale;
    sp.cache = kv_[indexer_group_][a.cache_slot].data();
    sp.num_blocks = group_blocks_[indexer_group_];
    sp.block_table = b.idx_block_table.as<int32_t>();
    sp.block_table_stride = b.maxb;
    sp.seq_of_token = b.seq_of.as<int32_t>() + t0;
    sp.lengths = b.lengths.as<int32_t>() + t0;
    sp.T = n;
    sp.HI = HI;
    sp.dI = dI;
    sp.max_length = static_cast<int>(maxlen);
    sp.scores = b.scores.as<float>();
    sp.scores_stride = maxlen;
    sp.math = opts_.exact_activations ? IndexerMath::kF32
              : opts_.indexer_wgmma && T >= kIndexerWgmmaFromTokens ? IndexerMath::kFp8Wgmma
                                        : IndexerMath::kFp8TensorCore;
    sp.stream = stream_;
    ML4_RETURN_IF_ERROR(timed("attn: (indexer) of which scores", [&] { return indexer_scores(sp); }));
    TopkParams tp;
    tp.scores = b.scores.as<float>();
    tp.scores_stride = maxlen;
    tp.lengths = b.lengths.as<int32_t>() + t0;
    tp.T = n;
    tp.k = k;
    tp.positions = a.record_positions ? b.topk_pos.as<int32_t>() + t0 * k : nullptr;
    tp.slots = b.topk_slots[a.selection].as<int32_t>() + t0 * k;
    tp.counts = b.topk_counts[a.selection].as<int32_t>() + t0;
    tp.out_stride = k;
    tp.block_table = b.block_table.as<int32_t>();
    tp.block_table_stride = b.maxb;
    tp.seq_of_token = b.seq_of.as<int32_t>() + t0;
    tp.workspace = b.topk_ws.data();
    tp.workspace_bytes = b.topk_ws_bytes;
    tp.max_length = maxlen;
    tp.stream = stream_;
    ML4_RETURN_IF_ERROR(timed("attn: (indexer) of which top-k", [&] { return topk(tp); }));
  }
  return ok_status();
}

// The positions the last indexer_select with record_positions wrote (traced steps read them
// right after it).
Result<std::vector<std::vector<int32_t>>> CudaBackend::read_selection(int selection) {
  Buffers& b = *buf_;
  const int k = cfg_.indexer.topk;
  const int64_t T = step_T_;
  std::vector<int32_t> pos(T * k), cnt(T);
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pos.data(), b.topk_pos.data(), pos.size() * 4, cudaMemcpyDeviceToHost, stream_));
  ML4_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(cnt.data(), b.topk_counts[selection].data(), cnt.size() * 4, cudaMemcpyDeviceToHost, stream_));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  std::vector<std::vector<int32_t>> rows(T);
  for (int64_t t = 0; t < T; ++t) rows[t].assign(pos.begin() + t * k, pos.begin() + t * k + cnt[t]);
  return rows;
}

// Forced positions -> latent slots of the token's sequence, -1 padded (traced steps: md_).
Status CudaBackend::set_selection(int selection, const std::vector<std::vector<int32_t>>& positions) {
  if (md_ == nullptr) return internal_error("set_selection needs the step's host metadata");
  Buffers& b = *buf_;
  const int k = cfg_.indexer.topk;
  const int64_t T = step_T_;
  std::vector<int32_t> sl(T * k, -1), cnt(T, 0);
  for (int64_t t = 0; t < T && t < static_cast<int64_t>(positions.size()); ++t) {
    const auto& row = positions[t];
    const int si = md_->seq_of_token[t];
    for (size_t j = 0; j < row.size(); ++j) sl[t * k + j] = static_cast<int32_t>(md_->slot_of(si, latent_group_, row[j]));
    cnt[t] = static_cast<int32_t>(row.size());
  }
  ML4_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(b.topk_slots[selection].data(), sl.data(), sl.size() * 4, cudaMemcpyHostToDevice, stream_));
  ML4_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(b.topk_counts[selection].data(), cnt.data(), cnt.size() * 4, cudaMemcpyHostToDevice, stream_));
  return cuda_status(cudaStreamSynchronize(stream_), "set_selection");  // the host vectors die here
}

namespace {

MlaAbsorbParams absorb_params(const ModelConfig& c, int64_t T, cudaStream_t stream) {
  MlaAbsorbParams ab;
  ab.T = T;
  ab.H = c.n_heads;
  ab.dn = c.qk_nope_head_dim;
  ab.dv = c.v_head_dim;
  ab.r = c.kv_lora_rank;
  ab.q_stride = c.qk_nope_head_dim + c.qk_rope_head_dim;
  ab.q_offset = 0;
  ab.stream = stream;
  return ab;
}

}  // namespace

Result<AbsorbRef> CudaBackend::add_absorb(const LinearWeight& wkv_b) {
  ML4_RETURN_IF_ERROR(check_wkv_b_shape(cfg_, wkv_b));
  WkvbSplit s = split_wkv_b(wkv_b, cfg_.qk_nope_head_dim, cfg_.v_head_dim);
  if (s.w_uk.empty()) return invalid_argument("{}: wkv_b's tensors do not match its format", wkv_b.name);
  ML4_ASSIGN_OR_RETURN(const float* uk, add_vector(s.w_uk));
  ML4_ASSIGN_OR_RETURN(const float* uv, add_vector(s.w_uv));
  absorbs_.push_back({uk, uv});
  std::pair<DeviceBuffer, DeviceBuffer> w16;
  if (opts_.mla_latent_bf16 && opts_.absorb_gemm && !opts_.exact_activations) {
    auto up16 = [&](const std::vector<float>& v) -> Result<DeviceBuffer> {
      std::vector<uint16_t> h(v.size());
      for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
      ML4_ASSIGN_OR_RETURN(DeviceBuffer d, DeviceBuffer::alloc(h.size() * 2));
      ML4_RETURN_IF_ERROR(d.upload(h.data(), h.size() * 2));
      weight_bytes_ += static_cast<int64_t>(d.bytes());
      return d;
    };
    ML4_ASSIGN_OR_RETURN(w16.first, up16(s.w_uk));
    ML4_ASSIGN_OR_RETURN(w16.second, up16(s.w_uv));
  }
  absorbs16_.push_back(std::move(w16));
  return AbsorbRef{static_cast<int>(absorbs_.size()) - 1};
}

// By the step's graph bucket, not its launch count: a prefill of 30 tokens is padded to 64 in a
// graph and must not switch to TF32 there but stay f32 when run eagerly (the H100 run of
// 2026-12-05 caught CudaRunner.VerificationStepsRunAsDecodeGraphs apart by 0.4-0.6: the small
// difference, through ml4-tiny's near-tied top-k, moved whole selections).
bool CudaBackend::absorb_as_gemm() const {
  return opts_.absorb_gemm && !opts_.exact_activations && bucket_T_ >= opts_.absorb_gemm_min_tokens;
}

Status CudaBackend::mla_absorb_q(AbsorbRef a, const float* q, float* q_lat) {
  if (!a.valid() || a.id >= static_cast<int>(absorbs_.size())) return internal_error("mla_absorb_q: no wkv_b {}", a.id);
  ML4_RETURN_IF_ERROR(flush_absorb());
  if (opts_.mla_latent_bf16 && opts_.mla_prefill_kernel && absorb_as_gemm() && absorbs16_[a.id].first.data()) {
    pending_absorb_ = {a, q, q_lat};  // mla_attention decides its form (cuda_backend.h, mla_latent_bf16)
    return ok_status();
  }
  return absorb_q_now(a, q, q_lat, false);
}

Status CudaBackend::absorb_q_now(AbsorbRef a, const float* q, float* q_lat, bool bf16) {
  MlaAbsorbParams ab = absorb_params(cfg_, step_T_, stream_);
  ab.q = q;
  ab.w_uk = absorbs_[a.id].first;
  ab.q_lat = q_lat;
  if (bf16) {  // q's nope part cast to bf16 into q_lat's upper half, the bf16 q_lat into its lower half
    ab.lat_bf16 = true;
    ab.w_uk16 = absorbs16_[a.id].first.data();
    ab.q16 = reinterpret_cast<uint16_t*>(q_lat) + step_T_ * ab.H * ab.r;
    return cuda::mla_absorb_q_gemm(*lt_, ab);
  }
  if (absorb_as_gemm()) {
    Status st = cuda::mla_absorb_q_gemm(*lt_, ab);
    if (st.code() != StatusCode::kUnimplemented) return st;  // a refused shape runs the kernel
  }
  return cuda::mla_absorb_q(ab);
}

Status CudaBackend::flush_absorb() {
  if (pending_absorb_.q_lat == nullptr) return ok_status();
  const PendingAbsorb p = pending_absorb_;
  pending_absorb_ = {};
  return absorb_q_now(p.a, p.q, p.q_lat, false);
}

Status CudaBackend::mla_apply_uv(AbsorbRef a, const float* out_lat, float* o) {
  if (!a.valid() || a.id >= static_cast<int>(absorbs_.size())) return internal_error("mla_apply_uv: no wkv_b {}", a.id);
  const bool bf16 = lat_out_bf16_ != nullptr;
  if (bf16 && lat_out_bf16_ != out_lat)
    return internal_error("mla_apply_uv: the bf16 out_lat of the last attention is not the one given");
  lat_out_bf16_ = nullptr;
  MlaAbsorbParams ab = absorb_params(cfg_, step_T_, stream_);
  ab.lat = out_lat;
  ab.w_uv = absorbs_[a.id].second;
  ab.o = o;
  if (bf16) {  // no kernel fallback: the kernels take f32 only
    ab.lat_bf16 = true;
    ab.w_uv16 = absorbs16_[a.id].second.data();
    if (ab.w_uv16 == nullptr) return internal_error("mla_apply_uv: bf16 out_lat without bf16 W_UV {}", a.id);
    return cuda::mla_apply_uv_gemm(*lt_, ab);
  }
  if (absorb_as_gemm()) {
    Status st = cuda::mla_apply_uv_gemm(*lt_, ab);
    if (st.code() != StatusCode::kUnimplemented) return st;
  }
  return cuda::mla_apply_uv(ab);
}

// Absorbed MLA over the pages (the selection's slots, or every key of the token's sequence),
// reading the rope part of q where the q projection left it (rows of qk floats; until the
// twenty-third session a 16 KB copy made it contiguous first, one launch and ~2 us a layer).
Status CudaBackend::mla_attention(const MlaArgs& a) {
  if (a.heads != 0 && a.heads != cfg_.n_heads)
    return unimplemented("mla_attention over {} heads (decode context parallelism) on CUDA", a.heads);
  Buffers& b = *buf_;
  const bool draft = a.group == CacheGroup::kDrafter;
  const int H = cfg_.n_heads, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim;
  const int qk = dn + dr;
  const int64_t T = step_T_;
  MlaAttentionParams ap;
  ap.q_lat = a.q_lat;
  ap.q_rope = a.q + dn;
  ap.q_rope_stride = qk;
  ap.head_scale = a.head_scale;
  ap.T = T;
  ap.H = H;
  ap.r = cfg_.kv_lora_rank;
  ap.dr = dr;
  if (a.group == CacheGroup::kHot) {  // HiSparse: the hot pool, through the remapped rows
    if (a.selection != kHotSelection || a.cache_slot < 0 || a.cache_slot >= static_cast<int>(hot_.size()))
      return internal_error("mla_attention: the hot pool is read through set_hot_selection's rows only");
    ap.cache = hot_[a.cache_slot].data();
    ap.num_slots = hot_rows_;
  } else {
    ap.cache = kv_[draft ? drafter_group_ : latent_group_][a.cache_slot].data();
    ap.num_slots = (draft ? group_blocks_[drafter_group_] : num_blocks_) * kPageTokens;
  }
  ap.dtype = draft ? KvCacheDtype::kBf16 : kv_dtype_;
  if (a.selection == kHotSelection) {
    const int k = cfg_.indexer.topk;
    ap.indices = hot_sel_rows_.as<int32_t>();
    ap.indices_stride = k;
    ap.topk = k;
    ap.index_lengths = hot_sel_counts_.as<int32_t>();
  } else if (a.selection == kBlockWindow) {
    ap.indices = b.window_slots.as<int32_t>();
    ap.indices_stride = b.window_stride;
    ap.topk = static_cast<int>(b.window_stride);
    ap.index_lengths = b.window_counts.as<int32_t>();
  } else if (a.selection >= 0) {
    const int k = cfg_.indexer.topk;
    ap.indices = b.topk_slots[a.selection].as<int32_t>();
    ap.indices_stride = k;
    ap.topk = k;
    ap.index_lengths = b.topk_counts[a.selection].as<int32_t>();
    // The prefill kernel's scratch: the selected slots lie on this step's block-table pages (a
    // true bound; pages past it would be read as empty). This step's, not the buffers' high-water
    // mark, which a large decode batch leaves behind.
    ap.scratch_pages = b.bt_rows * b.maxb;
  } else {
    ap.block_table = b.block_table.as<int32_t>();
    ap.block_table_stride = b.maxb;
    ap.seq_of_token = b.seq_of.as<int32_t>();
    ap.lengths = b.lengths.as<int32_t>();
    ap.max_length = static_cast<int>(step_maxlen_);
  }
  ap.out_lat = a.out_lat;
  ap.lse = a.lse;
  ap.math = opts_.exact_activations ? MlaMath::kF32 : MlaMath::kBf16TensorCore;
  ap.prefill_kernel = opts_.mla_prefill_kernel && a.selection >= 0;
  ap.prefill_pairs = opts_.mla_prefill_pairs;
  ap.stream = stream_;
  size_t need = mla_attention_workspace_bytes(ap);
  // A step whose block tables span more pages than kMaxPrefillScratchBytes of bf16 scratch holds
  // (many sequences of long context, e.g. a graphed verification batch: it is not a prefill) takes
  // the decode kernel instead of allocating that scratch beside the KV pool.
  if (ap.prefill_kernel && need > kMaxPrefillScratchBytes) {
    ap.prefill_kernel = false;
    need = mla_attention_workspace_bytes(ap);
  }
  if (need > b.attn_ws_bytes) {
    ++buffer_generation_;
    ML4_ASSIGN_OR_RETURN(b.attn_ws, DeviceBuffer::alloc(need));
    b.attn_ws_bytes = need;
  }
  ap.workspace = b.attn_ws.data();
  ap.workspace_bytes = b.attn_ws_bytes;
  // mla_latent_bf16: the deferred W_UK absorption, bf16 where the prefill kernel takes the step.
  if (pending_absorb_.q_lat != nullptr && pending_absorb_.q_lat != a.q_lat) ML4_RETURN_IF_ERROR(flush_absorb());
  if (pending_absorb_.q_lat != nullptr) {
    const PendingAbsorb p = pending_absorb_;
    pending_absorb_ = {};
    ap.lat_bf16 = cuda::mla_attention_runs_prefill(ap);
    if (ap.lat_bf16) {
      Status st = absorb_q_now(p.a, p.q, p.q_lat, true);
      if (st.code() == StatusCode::kUnimplemented) ap.lat_bf16 = false;  // cuBLASLt refused: f32 below
      else ML4_RETURN_IF_ERROR(st);
    }
    if (!ap.lat_bf16) ML4_RETURN_IF_ERROR(absorb_q_now(p.a, p.q, p.q_lat, false));
  }
  ML4_RETURN_IF_ERROR(cuda::mla_attention(ap));
  if (ap.lat_bf16) {
    lat_out_bf16_ = a.out_lat;
    ++latent_bf16_attentions_;
  }
  return ok_status();
}

// ---- HiSparse (offload/hisparse.h) ----

// The hot pool's row format is the latent cache's, known once allocate_kv has the KV dtype:
// reserve records the shape, allocate_kv allocates it.
Status CudaBackend::hisparse_reserve(int layers, int64_t rows) {
  hot_layers_ = layers;
  hot_rows_ = rows;
  return ok_status();
}

Status CudaBackend::allocate_hot_pool() {
  const size_t row_bytes = latent_token_bytes(kv_dtype_, cfg_.kv_lora_rank, cfg_.qk_rope_head_dim);
  hot_.clear();
  hot_bytes_ = 0;
  for (int l = 0; l < hot_layers_; ++l) {
    ML4_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::alloc(std::max<int64_t>(hot_rows_, 1) * row_bytes));
    ML4_RETURN_IF_ERROR(b.fill_bytes(0));
    hot_bytes_ += static_cast<int64_t>(b.bytes());
    hot_.push_back(std::move(b));
  }
  return ok_status();
}

namespace {

// Grows a device buffer to `bytes` (HiSparse steps run eagerly: no graph holds its address).
Status grow(DeviceBuffer& b, size_t bytes) {
  if (b.bytes() >= bytes) return ok_status();
  ML4_ASSIGN_OR_RETURN(b, DeviceBuffer::alloc(std::max<size_t>(bytes, 2 * b.bytes())));
  return ok_status();
}

}  // namespace

// The misses' pool rows from the step's block tables, then one gather kernel reading the host
// pool through unified addressing, in stream order after this step's cache writes.
Status CudaBackend::hisparse_load_rows(int latent_slot, int hot_layer, const std::vector<HotLoad>& loads) {
  if (loads.empty()) return ok_status();
  if (md_ == nullptr) return internal_error("hisparse_load_rows needs the step's host metadata");
  if (hot_layer < 0 || hot_layer >= static_cast<int>(hot_.size()))
    return internal_error("hisparse_load_rows: hot layer {} of {}", hot_layer, hot_.size());
  const int64_t n = static_cast<int64_t>(loads.size());
  std::vector<int64_t> src(n);
  std::vector<int32_t> dst(n);
  const int64_t pool_rows = num_blocks_ * kPageTokens;
  for (int64_t i = 0; i < n; ++i) {
    src[i] = md_->slot_of(loads[i].seq, latent_group_, loads[i].position);
    dst[i] = loads[i].row;
    if (src[i] < 0 || src[i] >= pool_rows || dst[i] < 0 || dst[i] >= hot_rows_)
      return internal_error("HiSparse load {} -> {} outside the pool ({}) or the hot layer ({})", src[i], dst[i],
                            pool_rows, hot_rows_);
  }
  ML4_RETURN_IF_ERROR(grow(hot_src_, n * 8));
  ML4_RETURN_IF_ERROR(grow(hot_dst_, n * 4));
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(hot_src_.data(), src.data(), n * 8, cudaMemcpyHostToDevice, stream_));
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(hot_dst_.data(), dst.data(), n * 4, cudaMemcpyHostToDevice, stream_));
  HotGatherParams g;
  g.pool = static_cast<const uint8_t*>(kv_[latent_group_][latent_slot].data());
  g.hot = static_cast<uint8_t*>(hot_[hot_layer].data());
  g.src = hot_src_.as<int64_t>();
  g.dst = hot_dst_.as<int32_t>();
  g.n = n;
  g.row_bytes = static_cast<int64_t>(latent_token_bytes(kv_dtype_, cfg_.kv_lora_rank, cfg_.qk_rope_head_dim));
  g.pool_rows = pool_rows;
  g.hot_rows = hot_rows_;
  g.stream = stream_;
  ML4_RETURN_IF_ERROR(hot_gather(g));
  // The host vectors die here; the copies above read them (pageable: staged before return,
  // but the kernel must not outlive this frame's view of them either).
  return cuda_status(cudaStreamSynchronize(stream_), "hisparse_load_rows");
}

Status CudaBackend::set_hot_selection(const int32_t* rows, const int32_t* counts) {
  const int64_t T = step_T_;
  const int k = cfg_.indexer.topk;
  ML4_RETURN_IF_ERROR(grow(hot_sel_rows_, std::max<int64_t>(T * k, 1) * 4));
  ML4_RETURN_IF_ERROR(grow(hot_sel_counts_, std::max<int64_t>(T, 1) * 4));
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(hot_sel_rows_.data(), rows, T * k * 4, cudaMemcpyHostToDevice, stream_));
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(hot_sel_counts_.data(), counts, T * 4, cudaMemcpyHostToDevice, stream_));
  return cuda_status(cudaStreamSynchronize(stream_), "set_hot_selection");  // the host arrays die after the call
}

// Not under exact activations, whose moe_router runs the same kernel in chunks of <= 8 tokens
// at every step size (its per-token sums are the same for any T <= 8).
bool CudaBackend::router_fused(LinearRef gate) const {
  return opts_.fused_router && !opts_.exact_activations && router_kernel_takes(gate, step_T_);
}

bool CudaBackend::router_kernel_takes(LinearRef gate, int64_t T) const {
  return gate.valid() && gate.id < static_cast<int>(linears_.size()) && router_[gate.id] &&
         linears_[gate.id].format == LinearFormat::kF32 && linears_[gate.id].N == cfg_.moe.num_experts &&
         router_route_supported(cfg_.moe, T);
}

RouterRouteParams CudaBackend::router_params(LinearRef gate, const float* x, const float* bias, float* logits,
                                             int32_t* ids, float* weights) const {
  const DeviceLinear& w = linears_[gate.id];
  RouterRouteParams p;
  p.x = x;
  p.D = w.K;
  p.gate = w.weight.as<float>();
  p.counter = buf_->router_counter.as<unsigned>();
  p.route = MoeRouteParams{logits, step_T_, cfg_.moe, bias, ids, weights, nullptr, stream_};
  return p;
}

Status CudaBackend::moe_router(LinearRef gate, const float* x, const float* bias, float* logits, int32_t* ids,
                               float* weights) {
  constexpr int64_t kChunk = 8;  // router_route's most tokens a launch
  if (opts_.exact_activations && router_kernel_takes(gate, std::min(step_T_, kChunk))) {
    // The exact mode: the fused kernel in chunks of <= 8 tokens, each token's logits its own
    // f32 sums in one order whatever the step (cuBLASLt's f32 GEMM picks its algorithm, and so
    // its summation order, by M: a token's experts could depend on its batch). Gates it does not
    // take (> 256 experts, top-k > 32) keep cuBLASLt, and with it that dependence.
    const int64_t D = linears_[gate.id].K, E = cfg_.moe.num_experts, K = cfg_.moe.num_experts_per_tok;
    for (int64_t t0 = 0; t0 < step_T_; t0 += kChunk) {
      RouterRouteParams p = router_params(gate, x + t0 * D, bias, logits + t0 * E, ids + t0 * K, weights + t0 * K);
      p.route.T = std::min(kChunk, step_T_ - t0);
      ML4_RETURN_IF_ERROR(router_route(p).with_context("router (exact mode)"));
    }
    return ok_status();
  }
  if (!router_fused(gate)) return Backend::moe_router(gate, x, bias, logits, ids, weights);
  return router_route(router_params(gate, x, bias, logits, ids, weights)).with_context("router");
}

// The shared expert on the low lane (CudaBackendOptions::shared_expert_lane): the grouped
// decode path with the shared expert in the extra slot, one chunk, a shared expert of at least
// shared_expert_lane_min_bytes, and no profile (whose times assume one stream).
bool CudaBackend::shared_lane(MoeRef moe) const {
  if (!opts_.shared_expert_lane || moe.id < 0 || moe.id >= static_cast<int>(moes_.size()) ||
      (profile_ != nullptr && mode_ == Mode::kEager))
    return false;
  const Moe& M = moes_[moe.id];
  if (!M.shared || !M.tables || !M.tables->shared_slot || !moe_grouped(M) || step_T_ > kGroupedMoeMaxTokens)
    return false;
  const DeviceMlp& sh = *M.shared;
  return static_cast<int64_t>(sh.w1.bytes() + sh.w2.bytes() + sh.w3.bytes()) >= opts_.shared_expert_lane_min_bytes;
}

Status CudaBackend::fork_low() {
  ML4_RETURN_IF_ERROR(join_low());
  ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_low_[0], stream_));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(low_stream_, ev_low_[0], 0));
  low_open_ = true;
  return ok_status();
}

Status CudaBackend::join_low() {
  if (!low_open_) return ok_status();
  low_open_ = false;
  shared_pending_ = -1;
  ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_low_[1], low_stream_));
  return cuda_status(cudaStreamWaitEvent(stream_, ev_low_[1], 0), "low lane join");
}

Status CudaBackend::norm_moe_router(const NormArgs& n, MoeRef moe, LinearRef gate, const float* bias, float* logits,
                                    int32_t* ids, float* weights) {
  if (shared_lane(moe)) {  // the norm, then the shared expert beside the router and the permute
    ML4_RETURN_IF_ERROR(rms_norm(n));
    ML4_RETURN_IF_ERROR(fork_low());
    const Moe& M = moes_[moe.id];
    MoeSharedPart part;
    part.mode = MoeSharedPart::kSharedOnly;
    ML4_RETURN_IF_ERROR(moe_experts_forward_grouped(*M.tables, M.shared.get(), n.y, step_T_, nullptr, nullptr,
                                                    cfg_.moe.num_experts_per_tok, nullptr, buf_->moe, low_stream_,
                                                    opts_.fp4_x_parts, part)
                            .with_context("shared expert lane"));
    ML4_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_low_[1], low_stream_));
    shared_pending_ = moe.id;
    ++shared_lane_runs_;
    return moe_router(gate, n.y, bias, logits, ids, weights);
  }
  if (opts_.fused_ffn_norm && router_fused(gate) && n.residual != nullptr && n.x_stride == 0 && n.rows == step_T_ &&
      n.dim == linears_[gate.id].K) {
    RouterRouteParams p = router_params(gate, n.y, bias, logits, ids, weights);
    p.attn = n.x;
    p.residual = n.residual;
    p.norm_w = n.w;
    p.eps = n.eps;
    Status st = router_route(p);  // refuses, before any launch, a shape it does not take
    if (st.code() != StatusCode::kUnimplemented) {
      fused_ffn_norms_ += st.ok();
      return st.with_context("router + ffn norm");
    }
  }
  return Backend::norm_moe_router(n, moe, gate, bias, logits, ids, weights);
}

Status CudaBackend::moe_route(const MoeRouteArgs& a) {
  MoeRouteParams rp{a.logits, step_T_, cfg_.moe, a.bias, a.ids, a.weights, nullptr, stream_};
  if (a.forced_host == nullptr) return cuda::moe_route(rp);
  const int64_t n = step_T_ * cfg_.moe.num_experts_per_tok;
  ML4_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(buf_->forced_ids.data(), a.forced_host, n * 4, cudaMemcpyHostToDevice, stream_));
  rp.forced_ids = buf_->forced_ids.as<int32_t>();
  ML4_RETURN_IF_ERROR(cuda::moe_route(rp));
  return cuda_status(cudaStreamSynchronize(stream_), "forced experts");  // the host ids die after this call
}

bool CudaBackend::moe_grouped(const Moe& m) const {
  return m.tables != nullptr && (opts_.exact_activations || step_T_ <= kGroupedMoeMaxTokens);
}

bool CudaBackend::moe_gemm(const Moe& m) const {
  return opts_.grouped_moe_gemm && !moe_grouped(m) && m.tables != nullptr &&
         moe_gemm_supported(*m.tables, m.shared.get(), /*lt_available=*/true);
}

bool CudaBackend::moe_experts_capturable(MoeRef moe) const {
  return moe_grouped(moes_[moe.id]) || moe_gemm(moes_[moe.id]);
}

// The grouped decode path (capturable; exact mode runs larger steps through it in chunks),
// the grouped GEMMs (capturable), or the expert loop, which reads the per-expert row counts
// back.
Status CudaBackend::moe_experts(MoeRef moe, const float* x, const int32_t* ids, const float* weights, float* out) {
  const Moe& M = moes_[moe.id];
  Buffers& b = *buf_;
  const int K = cfg_.moe.num_experts_per_tok;
  const int64_t D = cfg_.dim, T = step_T_;
  if (shared_pending_ >= 0) {  // norm_moe_router started this layer's shared expert on its lane
    if (shared_pending_ != moe.id || !moe_grouped(M) || T > kGroupedMoeMaxTokens)
      return internal_error("moe experts {}: the shared expert lane ran for MoE {}", moe.id, shared_pending_);
    shared_pending_ = -1;
    low_open_ = false;  // the combine joins it
    MoeSharedPart part;
    part.mode = MoeSharedPart::kRoutedOnly;
    part.shared_ready = ev_low_[1];
    return moe_experts_forward_grouped(*M.tables, M.shared.get(), x, T, ids, weights, K, out, b.moe, stream_,
                                       opts_.fp4_x_parts, part);
  }
  if (moe_gemm(M)) {
    MoeGemmOptions g;  // by name: a positional list once put one switch into another's field
    g.overlap = opts_.moe_gemm_overlap;
    g.tall = opts_.moe_gemm_tall;
    g.group_major = opts_.moe_gemm_group_major;
    g.specialized = opts_.moe_gemm_specialized;
    g.quant_epilogue = opts_.moe_quant_epilogue;
    g.swap = opts_.moe_gemm_swap;
    g.swap_down = opts_.moe_gemm_swap_down;
    return moe_experts_forward_gemm(*M.tables, M.shared.get(), x, T, ids, weights, K, out, b.moe, stream_,
                                    lt_.get(), g);
  }
  if (moe_grouped(M)) {
    for (int64_t t0 = 0; t0 < T; t0 += kGroupedMoeMaxTokens) {
      const int64_t n = std::min<int64_t>(kGroupedMoeMaxTokens, T - t0);
      ML4_RETURN_IF_ERROR(moe_experts_forward_grouped(*M.tables, M.shared.get(), x + t0 * D, n, ids + t0 * K,
                                                      weights + t0 * K, K, out + t0 * D, b.moe, stream_,
                                                      opts_.fp4_x_parts));
    }
    return ok_status();
  }
  return moe_experts_forward(*lt_, M.experts, M.shared.get(), x, T, D, ids, weights, K, out, b.moe, stream_);
}

// The resident FFN kernel (issue 19): FP8 block weights throughout, an f32 router of E rows,
// shapes ffn_resident_unsupported accepts, steps of 1..4 tokens, outside exact activations.
bool CudaBackend::resident_ffn_params(const FfnBlockArgs& a, FfnResidentParams* p) const {
  if (!resident_on_ || resident_fault_ == nullptr || opts_.exact_activations || step_T_ < 1 ||
      step_T_ > kFfnResidentMaxTokens)
    return false;
  auto fp8 = [&](const DeviceLinear& l) { return l.format == LinearFormat::kFP8Block; };
  auto mlp_of = [&](const DeviceLinear& w1, const DeviceLinear& w2, const DeviceLinear& w3, ResidentMlp* m) {
    if (!fp8(w1) || !fp8(w2) || !fp8(w3) || w1.K != cfg_.dim || w3.K != cfg_.dim || w3.N != w1.N ||
        w2.N != cfg_.dim || w2.K != w1.N)
      return false;
    *m = resident_mlp(w1, w2, w3);
    return true;
  };
  FfnResidentParams q;
  q.T = static_cast<int>(step_T_);
  q.D = cfg_.dim;
  if (a.gate.valid()) {
    if (a.moe.id < 0 || a.moe.id >= static_cast<int>(moes_.size()) || a.gate.id >= static_cast<int>(linears_.size()))
      return false;
    const Moe& M = moes_[a.moe.id];
    const DeviceLinear& g = linears_[a.gate.id];
    if (!M.tables || M.tables->format != LinearFormat::kFP8Block || M.tables->D != cfg_.dim ||
        g.format != LinearFormat::kF32 || g.N != cfg_.moe.num_experts || g.K != cfg_.dim)
      return false;
    if (M.shared && !mlp_of(M.shared->w1, M.shared->w2, M.shared->w3, &q.mlp)) return false;
    q.gate = g.weight.as<float>();
    q.bias = a.router_bias;
    q.moe = cfg_.moe;
    set_routed_experts(&q, *M.tables);
  } else {
    const MlpRef& d = a.dense;
    if (!d.w1.valid() || !mlp_of(linears_[d.w1.id], linears_[d.w2.id], linears_[d.w3.id], &q.mlp)) return false;
  }
  if (!ffn_resident_unsupported(q.D, q.gate ? &q.moe : nullptr, q.I_routed, q.mlp.w1 ? q.mlp.I : 0, q.T).empty())
    return false;
  if (ffn_resident_hidden_floats(q.T, q.gate ? q.moe.num_experts_per_tok : 0, q.I_routed, q.mlp.I, q.D) >
      resident_hidden_floats_)
    return false;
  if (p == nullptr) return true;
  q.attn_out = a.attn_out;
  q.residual = a.residual;
  q.norm_w = a.norm_w;
  q.eps = a.eps;
  q.a = a.a;
  q.logits = a.logits;
  q.ids = a.ids;
  q.weights = a.weights;
  q.hidden = resident_hidden_.as<float>();
  q.out = a.out;
  q.barrier = resident_barrier_.as<GridBarrierState>();
  q.counters = resident_counters_.as<unsigned>();
  q.routing = resident_routing_.data();
  q.fault = resident_fault_;
  q.timeout_ns = opts_.resident_wait_timeout_ns;
  q.never_arrive_block = resident_never_arrive_;
  q.blocks_per_sm = opts_.resident_blocks_per_sm;
  q.stream = stream_;
  *p = q;
  return true;
}

bool CudaBackend::ffn_block_fused(const FfnBlockArgs& a) const { return resident_ffn_params(a, nullptr); }

Status CudaBackend::ffn_block(const FfnBlockArgs& a) {
  FfnResidentParams p;
  if (!resident_ffn_params(a, &p)) return internal_error("ffn_block: this step's FFN block is not fused");
  ++resident_launches_;
  if (!resident_trace_.empty() && mode_ == Mode::kEager) {  // ML4_RESIDENT_TRACE: eager steps, layer by layer
    const int64_t per = int64_t{ffn_resident_max_blocks()} * kTracePoints;
    if ((resident_trace_layer_ + 1) * per * 8 <= static_cast<int64_t>(resident_trace_.bytes()))
      p.trace = resident_trace_.as<uint64_t>() + resident_trace_layer_++ * per;
  }
  return ffn_resident(p);
}

Status CudaBackend::set_resident_ffn(bool on, DeviceFault* fault) {
  resident_on_ = on;
  if (!on || resident_fault_ != nullptr) return ok_status();
  if (fault == nullptr) return invalid_argument("set_resident_ffn: no fault word");
  const int K = std::max(cfg_.moe.num_experts_per_tok, 0);
  resident_hidden_floats_ = ffn_resident_hidden_floats(kFfnResidentMaxTokens, K, max_hidden_, max_hidden_, cfg_.dim);
  ML4_ASSIGN_OR_RETURN(resident_hidden_, DeviceBuffer::alloc(static_cast<size_t>(resident_hidden_floats_) * 4));
  ML4_ASSIGN_OR_RETURN(resident_barrier_, DeviceBuffer::alloc(sizeof(GridBarrierState)));
  ML4_CUDA_RETURN_IF_ERROR(cudaMemset(resident_barrier_.data(), 0, sizeof(GridBarrierState)));
  ML4_ASSIGN_OR_RETURN(resident_counters_, DeviceBuffer::alloc(4 * sizeof(unsigned)));
  ML4_ASSIGN_OR_RETURN(resident_routing_, DeviceBuffer::alloc(ffn_resident_routing_bytes()));
  resident_fault_ = fault;
  if (const char* v = std::getenv("ML4_RESIDENT_TRACE"); v && v[0] == '1') {
    const size_t bytes = static_cast<size_t>(cfg_.n_layers) * ffn_resident_max_blocks() * kTracePoints * 8;
    ML4_ASSIGN_OR_RETURN(resident_trace_, DeviceBuffer::alloc(bytes));
    ML4_CUDA_RETURN_IF_ERROR(cudaMemset(resident_trace_.data(), 0, bytes));
  }
  return ok_status();
}

Result<std::vector<uint64_t>> CudaBackend::resident_trace() const {
  std::vector<uint64_t> t(resident_trace_.bytes() / 8);
  if (!t.empty()) ML4_RETURN_IF_ERROR(resident_trace_.download(t.data(), t.size() * 8));
  return t;
}

Result<std::vector<int32_t>> CudaBackend::read_ints(const int32_t* p, int64_t n) {
  std::vector<int32_t> v(n);
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(v.data(), p, n * 4, cudaMemcpyDeviceToHost, stream_));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return v;
}

Status CudaBackend::gather_logits_rows(const float* x, float* out) {
  return gather_rows(x, cfg_.dim, buf_->row_idx.as<int32_t>(), step_R_, out, stream_);
}

Status CudaBackend::fill_kv_synthetic(uint64_t seed) {
  uint64_t i = 0;
  for (int g : {latent_group_, indexer_group_}) {
    if (g < 0) continue;
    for (auto& b : kv_[g]) ML4_RETURN_IF_ERROR(fill_synthetic_bytes(b.data(), static_cast<int64_t>(b.bytes()), seed + ++i, stream_));
  }
  return cuda_status(cudaStreamSynchronize(stream_), "fill_kv_synthetic");
}

// ---- the DSpark drafter's ops (ops/cuda/drafter.h; the CPU twins in cpu_backend.cpp) ----

Status CudaBackend::enable_drafter() {
  if (drafter_group_ < 0 && !kv_.empty()) return invalid_argument("the KV cache has no drafter group");
  drafter_ = true;
  buf_->T = 0;  // the next ensure_buffers sizes the drafter's buffers
  return ok_status();
}

Result<TableRef> CudaBackend::add_table(const Tensor& t) {
  if (t.rank() != 2 || (t.dtype() != DType::kBF16 && t.dtype() != DType::kF32))
    return invalid_argument("table: expected a [rows, cols] bf16/f32 tensor, found {}", t.describe());
  ML4_ASSIGN_OR_RETURN(DeviceBuffer d, DeviceBuffer::alloc(t.nbytes()));
  ML4_RETURN_IF_ERROR(d.upload(t.data(), t.nbytes()));
  weight_bytes_ += static_cast<int64_t>(d.bytes());
  tables_.emplace_back(std::move(d), t.dtype());
  table_rows_.push_back(t.dim(0));
  table_cols_v_.push_back(t.dim(1));
  return TableRef{static_cast<int>(tables_.size()) - 1};
}

Status CudaBackend::gather_table_rows(TableRef t, const int32_t* ids, int64_t n, float* out) {
  const auto& tb = tables_[t.id];
  return cuda::embedding({tb.first.data(), tb.second, table_rows_[t.id], table_cols_v_[t.id], ids, n, out, stream_});
}

Status CudaBackend::copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                              int64_t cols) {
  if (rows <= 0 || cols <= 0) return ok_status();
  ML4_RETURN_IF_ERROR(flush_absorb());  // a reader of q_lat (context parallelism)
  if (lat_out_bf16_ != nullptr && src == lat_out_bf16_)
    return internal_error("copy_rows: out_lat holds bf16 (mla_latent_bf16) and is read only by mla_apply_uv");
  return cuda_status(cudaMemcpy2DAsync(dst, dst_stride * 4, src, src_stride * 4, cols * 4, rows, cudaMemcpyDeviceToDevice,
                                       stream_),
                     "copy_rows");
}

Status CudaBackend::add_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t rows, int64_t cols) {
  return cuda::add_rows(y, y_stride, x, x_stride, rows, cols, stream_);
}

Status CudaBackend::fill(float* x, int64_t n, float value) { return fill_f32(x, n, value, stream_); }

Status CudaBackend::merge_attention_parts(const float* parts, int n, int64_t part_stride, int64_t rows, int64_t cols,
                                          float* out) {
  return cuda::merge_attention_parts(parts, n, part_stride, rows, cols, out, stream_);
}

Status CudaBackend::rescale_attention_part(float* out, const float* lse, const float* lse_all, int n, int64_t rows,
                                           int64_t cols) {
  return cuda::rescale_attention_part(out, lse, lse_all, n, rows, cols, stream_);
}

Status CudaBackend::block_embed(const float* mask, float* out) {
  BlockEmbedParams p;
  p.table = embed_.data();
  p.table_dtype = embed_dtype_;
  p.V = cfg_.vocab_size;
  p.D = cfg_.dim;
  p.tokens = buf_->tok.as<int32_t>();
  p.mask = mask;
  p.T = step_T_;
  p.B = cfg_.drafter.block_size;
  p.out = out;
  p.stream = stream_;
  return cuda::block_embed(p);
}

// The runner lays a draft step out as blocks of B tokens (sequence t / B) and uploads the
// drafter block table and each block's anchor position.
Status CudaBackend::select_block_window(CacheGroup group, int64_t window) {
  if (group != CacheGroup::kDrafter) return invalid_argument("block windows read the drafter group");
  Buffers& b = *buf_;
  const int64_t stride = window + cfg_.drafter.block_size;
  if (step_T_ * stride > b.window_cap) {
    ++buffer_generation_;
    ML4_ASSIGN_OR_RETURN(b.window_slots, DeviceBuffer::alloc(step_T_ * stride * 4));
    ML4_ASSIGN_OR_RETURN(b.window_counts, DeviceBuffer::alloc(step_T_ * 4));
    b.window_cap = step_T_ * stride;
  }
  b.window_stride = stride;
  BlockWindowParams p;
  p.block_table = b.drafter_block_table.as<int32_t>();
  p.bt_stride = b.maxb;
  p.anchor_pos = b.draft_anchor_pos.as<int64_t>();
  p.T = step_T_;
  p.B = cfg_.drafter.block_size;
  p.window = window;
  p.slots = b.window_slots.as<int32_t>();
  p.stride = stride;
  p.counts = b.window_counts.as<int32_t>();
  p.stream = stream_;
  return block_window_slots(p);
}

Status CudaBackend::gru_update(const float* gi, const float* gh, const float* b_ih, const float* b_hh, int64_t rows,
                               int64_t r, float* s) {
  return cuda::gru_update(gi, gh, b_ih, b_hh, rows, r, s, stream_);
}

Status CudaBackend::stage_draft_params(const DeviceSamplingParams* params, int64_t count) {
  staged_params_ = nullptr;
  staged_count_ = 0;
  if (params == nullptr || count <= 0) return ok_status();
  Buffers& b = buffers();
  const size_t bytes = static_cast<size_t>(count) * sizeof(DeviceSamplingParams);
  if (bytes > b.draft_samp_params.bytes())
    return internal_error("stage_draft_params: {} rows, room for {}", count,
                          b.draft_samp_params.bytes() / sizeof(DeviceSamplingParams));
  // From pageable memory: the call returns once the source has been staged, so the host
  // array may change at once (no stream sync on the draft path).
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.draft_samp_params.data(), params, bytes, cudaMemcpyHostToDevice, stream_));
  staged_params_ = params;
  staged_count_ = count;
  return ok_status();
}

// Greedy rows without distributions: the device argmax (argmax_rows, the base added
// inside). Sampled rows with their distributions and staged parameters: the device draw
// (draft_rows). Otherwise (top-k / top-p rows, or greedy rows whose softmax is wanted) the host
// reference: the logits come back, the token and its distribution are made exactly as the CPU
// backend makes them, and go up.
Status CudaBackend::choose_tokens(float* logits, int64_t rows, const DeviceSamplingParams* params, int32_t* ids,
                                  float* probs, const float* base, int64_t base_stride) {
  const int64_t V = cfg_.vocab_size;
  if (params == nullptr && probs == nullptr) {
    // Device work only (no upload, no sync), so a greedy draft can be captured in a graph;
    // ties to the lower id, as sample_rows at temperature 0 and the host. The base logits
    // are added inside the split argmax (the sum is not stored): one pass over the rows by
    // 32 blocks per row of 131,072 instead of an add and a one-block-per-row argmax.
    Buffers& b = buffers();
    return argmax_rows(logits, V, base, base_stride, rows, V, ids, b.draft_samp_ws.data(),
                             b.draft_samp_ws.bytes(), stream_);
  }
  if (base != nullptr) ML4_RETURN_IF_ERROR(add_rows(logits, V, base, base_stride, rows, V));
  // Sampled drafts with their q on the device (no host round trip, so the draft can be a
  // graph) when the runner staged these rows' parameters.
  if (params != nullptr && probs != nullptr && staged_params_ != nullptr && params >= staged_params_ &&
      params + rows <= staged_params_ + staged_count_) {
    bool cuts = false;  // some row has top-k or top-p: its kept prefix first
    for (int64_t i = 0; i < rows; ++i) cuts = cuts || needs_kept_cut(params[i], V);
    Buffers& b = buffers();
    const auto* dp = static_cast<const DeviceSamplingParams*>(b.draft_samp_params.data()) + (params - staged_params_);
    return draft_rows(logits, rows, V, dp, ids, probs, b.draft_samp_ws.data(), b.draft_samp_ws.bytes(), stream_, cuts);
  }
  std::vector<float> l(rows * V), q(probs != nullptr ? rows * V : 0);
  std::vector<int32_t> tok(rows);
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(l.data(), logits, l.size() * 4, cudaMemcpyDeviceToHost, stream_));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  cpu::choose_draft_tokens(l.data(), rows, V, params, tok.data(), probs != nullptr ? q.data() : nullptr);
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids, tok.data(), rows * 4, cudaMemcpyHostToDevice, stream_));
  if (probs != nullptr)
    ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(probs, q.data(), q.size() * 4, cudaMemcpyHostToDevice, stream_));
  return cuda_status(cudaStreamSynchronize(stream_), "choose_tokens");
}

}  // namespace ml4::cuda
