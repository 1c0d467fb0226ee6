// See cuda_runner.h. Loading, step buffers, the step (metadata, graphs, sampling) and the
// forward's layer loop; the per-layer pieces are in cuda_runner_layers.cpp.
#include "ops/cuda/cuda_runner.h"
#include "ops/cuda/cuda_runner_internal.h"

#include <algorithm>
#include <cmath>

#include "core/log.h"
#include "kv/paged_kv_cache.h"
#include "model/checkpoint.h"
#include "model/config_loader.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/sampling.h"
#include "ops/cuda/synthetic_weights.h"
#include "ops/cuda/topk.h"

namespace ml4::cuda {

namespace {

Result<DeviceBuffer> upload_floats(const std::vector<float>& v) {
  ML4_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::alloc(v.size() * 4));
  if (!v.empty()) ML4_RETURN_IF_ERROR(b.upload(v.data(), v.size() * 4));
  return std::move(b);
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

}  // namespace

CudaRunner::~CudaRunner() {
  buf_.reset();
  for (cudaEvent_t e : {ev_fork_, ev_qlat_, ev_join_})
    if (e) cudaEventDestroy(e);
  if (side_stream_) cudaStreamDestroy(side_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

Status CudaRunner::upload(const ModelWeights& w) {
  auto track = [&](const DeviceLinear& d) {
    weight_bytes_ += static_cast<int64_t>(d.bytes());
    max_in_ = std::max({max_in_, d.K, d.N});
  };
  uint64_t synth_counter = 0;
  auto up = [&](DeviceLinear& dst, const LinearWeight& src) -> Status {
    if (synthetic_seed_ != 0) {
      ML4_ASSIGN_OR_RETURN(dst, synthetic_linear(src, synthetic_seed_ * 1000003u + ++synth_counter));
    } else {
      ML4_ASSIGN_OR_RETURN(dst, upload_linear(src));
    }
    track(dst);
    return Status::ok();
  };
  auto up_mlp = [&](DeviceMlp& dst, const MlpWeights& src) -> Status {
    ML4_RETURN_IF_ERROR(up(dst.w1, src.w1));
    ML4_RETURN_IF_ERROR(up(dst.w2, src.w2));
    ML4_RETURN_IF_ERROR(up(dst.w3, src.w3));
    max_hidden_ = std::max(max_hidden_, dst.w1.N);
    return Status::ok();
  };
  if (synthetic_seed_ != 0) {
    const int64_t n = static_cast<int64_t>(cfg_.vocab_size) * cfg_.dim;
    ML4_ASSIGN_OR_RETURN(embed_, DeviceBuffer::alloc(n * 2));
    ML4_RETURN_IF_ERROR(fill_synthetic_bf16(embed_.data(), n, 1.0f, synthetic_seed_));
    embed_dtype_ = DType::kBF16;
  } else {
    ML4_ASSIGN_OR_RETURN(embed_, DeviceBuffer::alloc(w.tok_embeddings.nbytes()));
    ML4_RETURN_IF_ERROR(embed_.upload(w.tok_embeddings.data(), w.tok_embeddings.nbytes()));
    embed_dtype_ = w.tok_embeddings.dtype();
  }
  weight_bytes_ += static_cast<int64_t>(embed_.bytes());
  ML4_ASSIGN_OR_RETURN(norm_, upload_floats(w.norm));
  ML4_RETURN_IF_ERROR(up(output_, w.output));
  layers_.resize(cfg_.n_layers);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const LayerWeights& LW = w.layers[l];
    const LayerSpec& spec = cfg_.layers[l];
    Layer& L = layers_[l];
    ML4_ASSIGN_OR_RETURN(L.attn_norm, upload_floats(LW.attention_norm));
    ML4_ASSIGN_OR_RETURN(L.ffn_norm, upload_floats(LW.ffn_norm));
    const AttentionWeights& A = LW.attn;
    if (cfg_.q_lora_rank > 0) {
      ML4_RETURN_IF_ERROR(up(L.wq_a, A.wq_a));
      ML4_RETURN_IF_ERROR(up(L.wq_b, A.wq_b));
      ML4_ASSIGN_OR_RETURN(L.q_a_norm, upload_floats(A.q_a_norm));
    } else {
      ML4_RETURN_IF_ERROR(up(L.wq, A.wq));
    }
    if (spec.owns_kv()) {
      ML4_RETURN_IF_ERROR(up(L.wkv_a, A.wkv_a));
      ML4_ASSIGN_OR_RETURN(L.kv_a_norm, upload_floats(A.kv_a_norm));
    }
    ML4_RETURN_IF_ERROR(up(L.wo, A.wo));
    if (spec.indexer == IndexerRole::kOwner) {
      if (!A.indexer) return invalid_argument("layer {}: indexer owner without indexer weights", l);
      const IndexerWeights& I = *A.indexer;
      ML4_RETURN_IF_ERROR(up(L.idx_wq, I.wq));
      ML4_RETURN_IF_ERROR(up(L.idx_wk, I.wk));
      ML4_RETURN_IF_ERROR(up(L.idx_wproj, I.weights_proj));
      ML4_ASSIGN_OR_RETURN(L.idx_knorm_w, upload_floats(I.k_norm_weight));
      ML4_ASSIGN_OR_RETURN(L.idx_knorm_b, upload_floats(I.k_norm_bias));
    }
    ML4_ASSIGN_OR_RETURN(L.w_uk, upload_floats(A.w_uk));
    ML4_ASSIGN_OR_RETURN(L.w_uv, upload_floats(A.w_uv));
    weight_bytes_ += static_cast<int64_t>(L.w_uk.bytes() + L.w_uv.bytes());
    if (spec.ssmax) {
      ML4_ASSIGN_OR_RETURN(L.ssmax_s, upload_floats(A.ssmax_s));
    }
    const FfnWeights& F = LW.ffn;
    switch (spec.ffn) {
      case FfnKind::kDense:
        ML4_RETURN_IF_ERROR(up_mlp(L.dense, F.dense));
        break;
      case FfnKind::kMoe: {
        L.moe = true;
        if (synthetic_seed_ != 0) {
          LinearWeight g = F.gate;
          g.format = LinearFormat::kF32;
          ML4_ASSIGN_OR_RETURN(L.gate, synthetic_linear(g, synthetic_seed_ * 7919u + l));
        } else {
          ML4_ASSIGN_OR_RETURN(L.gate, upload_f32_linear(F.gate));
        }
        track(L.gate);
        if (!F.correction_bias.empty()) {
          ML4_ASSIGN_OR_RETURN(L.bias, upload_floats(F.correction_bias));
        }
        L.experts.resize(F.experts.size());
        for (size_t e = 0; e < F.experts.size(); ++e) ML4_RETURN_IF_ERROR(up_mlp(L.experts[e], F.experts[e]));
        for (const auto& e : L.experts) routed_expert_bytes_ += static_cast<int64_t>(e.w1.bytes() + e.w2.bytes() + e.w3.bytes());
        if (F.shared) {
          L.shared = std::make_unique<DeviceMlp>();
          ML4_RETURN_IF_ERROR(up_mlp(*L.shared, *F.shared));
        }
        auto t = build_expert_tables(L.experts);
        if (t.ok() && (t->format == LinearFormat::kBF16 || t->format == LinearFormat::kFP8Block))
          L.tables = std::make_unique<MoeExpertTables>(std::move(t).value());
        break;
      }
    }
  }
  return Status::ok();
}

Result<std::unique_ptr<CudaRunner>> CudaRunner::load(const std::string& model_dir, const CudaRunnerOptions& opts) {
  if (!device_available()) return unimplemented("no CUDA device: the CUDA runner cannot start");
  ML4_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(model_dir));
  ML4_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::open(model_dir));
  WeightLoadOptions wo;
  wo.experts_to_mxfp4 = opts.base.experts_to_mxfp4;
  ML4_ASSIGN_OR_RETURN(auto weights, load_model_weights(cfg, ck, wo));
  return create(cfg, *weights, opts, 0, model_dir);
}

Result<std::unique_ptr<CudaRunner>> CudaRunner::load_synthetic(const ModelConfig& cfg, const CudaRunnerOptions& opts,
                                                               uint64_t seed) {
  if (!device_available()) return unimplemented("no CUDA device: the CUDA runner cannot start");
  auto skeleton = synthetic_weight_skeleton(cfg, seed);
  return create(cfg, *skeleton, opts, seed == 0 ? 1 : seed, "synthetic " + cfg.name);
}

Result<std::unique_ptr<CudaRunner>> CudaRunner::create(const ModelConfig& cfg, const ModelWeights& weights,
                                                       const CudaRunnerOptions& opts, uint64_t synthetic_seed,
                                                       const std::string& model_dir) {
  ML4_ASSIGN_OR_RETURN(KvCacheDtype dtype, parse_kv_cache_dtype(opts.base.kv_cache_dtype));
  ML4_ASSIGN_OR_RETURN(KvCacheSpec spec, make_kv_cache_spec(cfg, dtype));
  if (cfg.has_dsa() && cfg.indexer.head_dim != 128)
    return unimplemented("{}: the CUDA indexer kernels take head_dim 128 (model: {})", model_dir, cfg.indexer.head_dim);
  std::unique_ptr<CudaRunner> r(new CudaRunner());
  r->cfg_ = cfg;
  r->opts_ = opts;
  r->synthetic_seed_ = synthetic_seed;
  r->spec_ = spec;
  r->max_model_len_ = opts.base.max_model_len > 0 ? opts.base.max_model_len : cfg.max_position_embeddings;
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&r->stream_, cudaStreamNonBlocking));
  if (cfg.has_dsa() && opts.overlap_indexer) {
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&r->side_stream_, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&r->ev_fork_, &r->ev_qlat_, &r->ev_join_})
      ML4_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  ML4_ASSIGN_OR_RETURN(r->lt_, LtGemm::create());
  ML4_RETURN_IF_ERROR(r->upload(weights).with_context(model_dir));
  ML4_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // synthetic fills ran on the default stream
  ML4_ASSIGN_OR_RETURN(r->inv_freq_, upload_floats(cpu::rope_inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim, cfg.yarn)));
  if (cfg.has_dsa()) {
    ML4_ASSIGN_OR_RETURN(r->idx_inv_freq_,
                         upload_floats(cpu::rope_inv_freq(cfg.rope_theta, cfg.indexer.rope_head_dim, cfg.yarn)));
  }
  // Top-k buffers: an owner whose sets a reuser reads keeps its own; the others share one.
  r->topk_buf_.assign(cfg.n_layers, -1);
  {
    std::vector<bool> has_reuser(cfg.n_layers, false);
    for (const auto& s : cfg.layers)
      if (s.indexer == IndexerRole::kReuser) has_reuser[s.indexer_source] = true;
    int next = 1;
    for (const auto& s : cfg.layers)
      if (s.indexer == IndexerRole::kOwner) r->topk_buf_[s.index] = has_reuser[s.index] ? next++ : 0;
    r->num_topk_bufs_ = cfg.has_dsa() ? next : 0;
  }
  r->rope_factor_ = cpu::rope_attention_factor(cfg.yarn);
  // KV sharing as CpuModel (without duplication): consumers read their source's slot.
  const int L = cfg.n_layers;
  r->latent_read_slot_.assign(L, -1);
  r->latent_write_slots_.assign(L, {});
  for (int l = 0; l < L; ++l) {
    const LayerSpec& s = cfg.layers[l];
    if (s.owns_kv()) {
      r->latent_read_slot_[l] = s.latent_slot;
      r->latent_write_slots_[l].push_back(s.latent_slot);
    } else {
      r->latent_read_slot_[l] = cfg.layers[s.kv_source].latent_slot;
    }
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
  const std::vector<int64_t> blocks = PagedKvCache::blocks_for_budget(spec, kv_budget);
  r->latent_group_ = spec.group_index(CacheGroupSpec::kLatent);
  r->indexer_group_ = spec.group_index(CacheGroupSpec::kIndexer);
  r->num_blocks_ = blocks[r->latent_group_];
  if (r->num_blocks_ <= 0) return resource_exhausted("KV budget of {} bytes holds no block", kv_budget);
  r->group_blocks_ = blocks;
  for (size_t gi = 0; gi < spec.groups.size(); ++gi) {
    const auto& g = spec.groups[gi];
    auto& dst = g.kind == CacheGroupSpec::kLatent ? r->kv_ : g.kind == CacheGroupSpec::kIndexer ? r->idx_kv_ : r->other_kv_;
    for (size_t slot = 0; slot < g.layers.size(); ++slot) {
      ML4_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::alloc(std::max<int64_t>(blocks[gi], 1) * g.page_bytes_per_layer()));
      ML4_RETURN_IF_ERROR(b.fill_bytes(0));
      r->kv_bytes_ += static_cast<int64_t>(b.bytes());
      dst.push_back(std::move(b));
    }
    r->groups_.push_back(CacheGroupInfo{g.name, g.page_tokens, blocks[gi], g.sliding_window, g.bytes_per_token()});
  }
  r->buf_ = std::make_unique<Buffers>();
  ML4_LOG_INFO("cuda runner: {} ({} layers), weights {:.1f} MiB, kv {} {:.1f} MiB ({} blocks)", model_dir, L,
               r->weight_bytes_ / 1048576.0, opts.base.kv_cache_dtype, r->kv_bytes_ / 1048576.0, r->num_blocks_);
  return r;
}

Status CudaRunner::ensure_buffers(int64_t T, int64_t R, int64_t S, int64_t maxb) {
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
      return Status::ok();
    };
    ML4_RETURN_IF_ERROR(f(b.residual, n * D, 4));
    ML4_RETURN_IF_ERROR(f(b.a, n * D, 4));
    ML4_RETURN_IF_ERROR(f(b.tmp, n * D, 4));
    ML4_RETURN_IF_ERROR(f(b.q, n * H * qk, 4));
    ML4_RETURN_IF_ERROR(f(b.qlat_in, n * std::max(c.q_lora_rank, 1), 4));
    ML4_RETURN_IF_ERROR(f(b.ckv, n * (r + dr), 4));
    ML4_RETURN_IF_ERROR(f(b.c, n * r, 4));
    ML4_RETURN_IF_ERROR(f(b.q_lat, n * H * r, 4));
    ML4_RETURN_IF_ERROR(f(b.q_rope, n * H * dr, 4));
    ML4_RETURN_IF_ERROR(f(b.head_scale, n * H, 4));
    ML4_RETURN_IF_ERROR(f(b.out_lat, n * H * r, 4));
    ML4_RETURN_IF_ERROR(f(b.lse, n * H, 4));
    ML4_RETURN_IF_ERROR(f(b.o, n * H * c.v_head_dim, 4));
    ML4_RETURN_IF_ERROR(f(b.router, n * E, 4));
    ML4_RETURN_IF_ERROR(f(b.ids, n * K, 4));
    ML4_RETURN_IF_ERROR(f(b.wts, n * K, 4));
    ML4_RETURN_IF_ERROR(f(b.tok, n, 4));
    ML4_RETURN_IF_ERROR(f(b.pos, n, 8));
    ML4_RETURN_IF_ERROR(f(b.slots, n, 8));
    ML4_RETURN_IF_ERROR(f(b.seq_of, n, 4));
    ML4_RETURN_IF_ERROR(f(b.lengths, n, 4));
    ML4_RETURN_IF_ERROR(f(b.gemv_ws, gemv_workspace_floats(kGemvMaxM, 1, 1) * max_in_, 4));
    if (side_stream_) ML4_RETURN_IF_ERROR(f(b.gemv_ws_side, gemv_workspace_floats(kGemvMaxM, 1, 1) * max_in_, 4));
    ML4_RETURN_IF_ERROR(b.lin.reserve(n * max_in_, n * ((max_in_ + 127) / 128)));
    if (c.has_dsa()) {
      const int64_t HI = c.indexer.n_heads, dI = c.indexer.head_dim, k = c.indexer.topk;
      ML4_RETURN_IF_ERROR(f(b.iq, n * HI * dI, 4));
      ML4_RETURN_IF_ERROR(f(b.ik, n * dI, 4));
      ML4_RETURN_IF_ERROR(f(b.iw, n * HI, 4));
      ML4_RETURN_IF_ERROR(f(b.iq8, n * HI * dI, 1));
      ML4_RETURN_IF_ERROR(f(b.iqs, n * HI, 4));
      ML4_RETURN_IF_ERROR(f(b.idx_slots, n, 8));
      ML4_RETURN_IF_ERROR(f(b.forced_slots, n * k, 4));
      ML4_RETURN_IF_ERROR(f(b.forced_counts, n, 4));
      ML4_RETURN_IF_ERROR(f(b.topk_pos, n * k, 4));
      // topk's multi-block path (small steps over long contexts): the most splits it can pick.
      b.topk_ws_bytes = topk_max_workspace_bytes(n, max_model_len_);
      ML4_RETURN_IF_ERROR(f(b.topk_ws, static_cast<int64_t>(b.topk_ws_bytes), 1));
      b.topk_slots.resize(num_topk_bufs_);
      b.topk_counts.resize(num_topk_bufs_);
      for (int i = 0; i < num_topk_bufs_; ++i) {
        ML4_RETURN_IF_ERROR(f(b.topk_slots[i], n * k, 4));
        ML4_RETURN_IF_ERROR(f(b.topk_counts[i], n, 4));
      }
    }
    ML4_RETURN_IF_ERROR(f(b.forced_ids, n * K, 4));
    b.moe = MoeScratch{};
    ML4_RETURN_IF_ERROR(b.moe.reserve(n * K, D, std::max<int64_t>(max_hidden_, 1), static_cast<int>(E)));
    b.T = n;
  }
  if (R > b.R) {
    ++buffer_generation_;
    const int64_t n = std::max(R, 2 * b.R);
    ML4_ASSIGN_OR_RETURN(b.rows, DeviceBuffer::alloc(n * D * 4));
    ML4_ASSIGN_OR_RETURN(b.normed, DeviceBuffer::alloc(n * D * 4));
    ML4_ASSIGN_OR_RETURN(b.logits, DeviceBuffer::alloc(n * c.vocab_size * 4));
    ML4_ASSIGN_OR_RETURN(b.row_idx, DeviceBuffer::alloc(n * 4));
    b.R = n;
  }
  if (S * maxb > b.bt_cap) {
    ++buffer_generation_;
    ML4_ASSIGN_OR_RETURN(b.block_table, DeviceBuffer::alloc(std::max<int64_t>(S * maxb, 1) * 4));
    ML4_ASSIGN_OR_RETURN(b.idx_block_table, DeviceBuffer::alloc(std::max<int64_t>(S * maxb, 1) * 4));
    b.bt_cap = S * maxb;
  }
  b.maxb = maxb;  // this step's block-table row stride
  return Status::ok();
}

namespace {

int64_t round_up_pow2(int64_t v, int64_t lo) {
  int64_t b = lo;
  while (b < v) b *= 2;
  return b;
}

}  // namespace

// Embedding -> layers -> final norm -> logits rows into buf_->logits, for step_T_ tokens
// and step_R_ logits rows. Work is issued through seg() (kernels and device-to-device
// copies only: capturable) and brk() (work that reads device results back to the host:
// the MoE expert loop, traced decisions). mode_ says what those do:
//   kEager:   run everything;
//   kCapture: record each run of seg() work between breaks as one graph (segments_ of the
//             current bucket); breaks are cut points only (their work is not needed:
//             the eager run before has produced this step's results);
//   kReplay:  launch the recorded graphs in order and run the breaks eagerly between them
//             (they write into the same fixed buffers the next graph reads).
Status CudaRunner::forward(const StepMetadata* md, ForwardTrace* trace) {
  Buffers& b = *buf_;
  const int64_t T = step_T_, R = step_R_, D = cfg_.dim;
  const float eps = static_cast<float>(cfg_.norm_eps);
  float* residual = b.residual.as<float>();
  float* a = b.a.as<float>();
  float* tmp = b.tmp.as<float>();
  bool in_segment = false;
  size_t next_graph = 0;
  auto end_segment = [&]() -> Status {
    if (!in_segment) return Status::ok();
    in_segment = false;
    if (mode_ != Mode::kCapture) return Status::ok();
    cudaGraph_t g = nullptr;
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream_, &g));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    ML4_CUDA_RETURN_IF_ERROR(inst);
    capture_->emplace_back(exec);
    return Status::ok();
  };
  auto seg = [&](auto&& fn) -> Status {
    if (!in_segment) {
      in_segment = true;
      if (mode_ == Mode::kCapture)
        ML4_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      if (mode_ == Mode::kReplay) {
        if (next_graph >= replay_->size()) return internal_error("graph replay: segment {} missing", next_graph);
        ML4_CUDA_RETURN_IF_ERROR(cudaGraphLaunch((*replay_)[next_graph++], stream_));
      }
    }
    return mode_ == Mode::kReplay ? Status::ok() : fn();
  };
  auto brk = [&](auto&& fn) -> Status {
    ML4_RETURN_IF_ERROR(end_segment());
    return mode_ == Mode::kCapture ? Status::ok() : fn();
  };
  ML4_RETURN_IF_ERROR(seg([&] {
    return timed("embedding", [&] {
      return embedding({embed_.data(), embed_dtype_, cfg_.vocab_size, D, b.tok.as<int32_t>(), T, residual, stream_});
    });
  }));
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const Layer& L = layers_[l];
    ML4_RETURN_IF_ERROR(seg([&]() -> Status {
      if (l == 0) {
        ML4_RETURN_IF_ERROR(rms_norm({residual, nullptr, L.attn_norm.as<float>(), T, D, eps, a, nullptr, stream_}));
      } else {  // residual += previous FFN output; a = norm(residual)
        ML4_RETURN_IF_ERROR(rms_norm({tmp, residual, L.attn_norm.as<float>(), T, D, eps, a, nullptr, stream_}));
      }
      return Status::ok();
    }));
    // Traced steps read decisions back (and upload forced ones) inside the layer: always
    // eager (execute_traced never captures them).
    if (trace != nullptr) {
      ML4_RETURN_IF_ERROR(brk([&] { return attention(l, md, tmp, trace); }));
    } else {
      ML4_RETURN_IF_ERROR(seg([&] { return attention(l, md, tmp, nullptr); }));
    }
    ML4_RETURN_IF_ERROR(seg([&] {
      return rms_norm({tmp, residual, L.ffn_norm.as<float>(), T, D, eps, a, nullptr, stream_});
    }));
    if (!L.moe) {
      ML4_RETURN_IF_ERROR(seg([&] { return timed("dense ffn", [&] { return mlp(L.dense, a, T, tmp); }); }));
      continue;
    }
    ML4_RETURN_IF_ERROR(seg([&] { return timed("moe router", [&] { return moe_route_step(l, T); }); }));
    if (trace != nullptr) ML4_RETURN_IF_ERROR(brk([&] { return moe_trace(l, T, trace); }));
    if (moe_grouped(L, T)) {
      ML4_RETURN_IF_ERROR(seg([&] { return timed("moe experts", [&] { return moe_experts(l, T, tmp); }); }));
    } else {  // reads row counts back
      ML4_RETURN_IF_ERROR(brk([&] { return timed("moe experts", [&] { return moe_experts(l, T, tmp); }); }));
    }
  }
  if (R > 0) {
    ML4_RETURN_IF_ERROR(seg([&]() -> Status { return timed("final norm + lm_head", [&]() -> Status {
      // residual += last FFN output (into a: the residual is not needed afterwards).
      ML4_RETURN_IF_ERROR(rms_norm({tmp, residual, norm_.as<float>(), T, D, eps, a, nullptr, stream_}));
      ML4_RETURN_IF_ERROR(gather_rows(residual, D, b.row_idx.as<int32_t>(), R, b.rows.as<float>(), stream_));
      ML4_RETURN_IF_ERROR(rms_norm(
          {b.rows.as<float>(), nullptr, norm_.as<float>(), R, D, eps, b.normed.as<float>(), nullptr, stream_}));
      return lin(output_, b.normed.as<float>(), R, b.logits.as<float>());
    }); }));
  }
  ML4_RETURN_IF_ERROR(end_segment());
  if (mode_ == Mode::kReplay && next_graph != replay_->size())
    return internal_error("graph replay: {} of {} segments launched", next_graph, replay_->size());
  return Status::ok();
}

Result<StepOutput> CudaRunner::execute_traced(const StepInput& in, ForwardTrace* trace) {
  ML4_ASSIGN_OR_RETURN(StepMetadata md, build_step_metadata(in, groups_, cfg_.vocab_size, max_model_len_));
  const int64_t T = md.num_tokens(), R = static_cast<int64_t>(md.logits_rows.size());
  const int64_t S = static_cast<int64_t>(md.seqs.size());
  if (trace != nullptr) {
    trace->topk.assign(cfg_.n_layers, {});
    trace->experts.assign(cfg_.n_layers, {});
    ML4_RETURN_IF_ERROR(validate_forced_decisions(*trace, cfg_, md.positions));
  }
  int64_t maxb = 1, maxlen = 1;
  for (const auto& s : in.seqs) {
    maxb = std::max<int64_t>(maxb, s.block_tables[latent_group_].size());
    if (indexer_group_ >= 0) maxb = std::max<int64_t>(maxb, s.block_tables[indexer_group_].size());
  }
  for (int64_t p : md.positions) maxlen = std::max(maxlen, p + 1);
  // Steps of up to graph_max_tokens() tokens run as CUDA graphs, padded to a bucket:
  // decode steps (one token and one logits row per sequence) to a power-of-two batch,
  // mixed prefill/decode steps to a multiple of 64 tokens and a power-of-two number of
  // logits rows. Padding tokens write no cache slot (slot -1), attend to one key of an
  // all-zero block-table row, and their logits rows are dropped. Launch shapes that depend
  // on the context (key count, block-table stride) are rounded up to powers of two, so one
  // capture serves a range of lengths. Each (tokens, rows, length, stride) bucket is
  // captured once, after an eager run of the same padded step has sized every buffer and
  // made every GEMM plan; work that must read device results back (the MoE expert loop
  // of larger steps) splits the capture into segments and runs eagerly between them.
  const bool decode = T == S && R == T && T <= opts_.max_graph_batch;
  int64_t Tp = decode ? round_up_pow2(T, 1) : (T + 63) / 64 * 64;
  const bool graph = opts_.cuda_graphs && trace == nullptr && T > 0 && Tp <= opts_.max_graph_tokens;
  int64_t Rp = R, Sp = S;
  if (!graph) Tp = T;
  if (graph) {
    Rp = decode ? Tp : (R > 0 ? round_up_pow2(R, 1) : 0);
    Sp = Tp + 1;  // row Tp..: the padding tokens' all-zero block table
    maxb = round_up_pow2(maxb, 4);
    maxlen = std::min<int64_t>(round_up_pow2(maxlen, 256), std::max<int64_t>(maxb * kPageTokens, 256));
  }
  const uint64_t gen = buffer_generation_;
  ML4_RETURN_IF_ERROR(ensure_buffers(Tp, Rp, Sp, maxb));
  if (buffer_generation_ != gen) graphs_.clear();  // captured addresses are stale
  Buffers& b = *buf_;
  // Per-step metadata to the device (one plain copy per array), padded to Tp tokens.
  std::vector<int32_t> tok(Tp, 0), seq_of(Tp, static_cast<int32_t>(S)), lengths(Tp, 1), bt(Sp * maxb, 0),
      ibt(indexer_group_ >= 0 ? Sp * maxb : 0, 0), rows(Rp, 0);
  std::vector<int64_t> pos(Tp, 0), slots(Tp, -1), islots(Tp, -1);
  for (int64_t t = 0; t < T; ++t) {
    tok[t] = md.token_ids[t];
    pos[t] = md.positions[t];
    lengths[t] = static_cast<int32_t>(md.positions[t] + 1);
    seq_of[t] = md.seq_of_token[t];
    slots[t] = md.slots[latent_group_][t];
    if (indexer_group_ >= 0) islots[t] = md.slots[indexer_group_][t];
  }
  for (int64_t s = 0; s < S; ++s) {
    const auto& tab = in.seqs[s].block_tables[latent_group_];
    std::copy(tab.begin(), tab.end(), bt.begin() + s * maxb);
    if (indexer_group_ >= 0) {
      const auto& itab = in.seqs[s].block_tables[indexer_group_];
      std::copy(itab.begin(), itab.end(), ibt.begin() + s * maxb);
    }
  }
  for (int64_t i = 0; i < R; ++i) rows[i] = static_cast<int32_t>(md.logits_rows[i]);
  auto h2d = [&](DeviceBuffer& d, const void* src, size_t bytes) {
    return cuda_status(cudaMemcpyAsync(d.data(), src, bytes, cudaMemcpyHostToDevice, stream_), "step metadata");
  };
  ML4_RETURN_IF_ERROR(h2d(b.tok, tok.data(), Tp * 4));
  ML4_RETURN_IF_ERROR(h2d(b.pos, pos.data(), Tp * 8));
  ML4_RETURN_IF_ERROR(h2d(b.slots, slots.data(), Tp * 8));
  ML4_RETURN_IF_ERROR(h2d(b.seq_of, seq_of.data(), Tp * 4));
  ML4_RETURN_IF_ERROR(h2d(b.lengths, lengths.data(), Tp * 4));
  ML4_RETURN_IF_ERROR(h2d(b.block_table, bt.data(), bt.size() * 4));
  if (indexer_group_ >= 0) {
    ML4_RETURN_IF_ERROR(h2d(b.idx_block_table, ibt.data(), ibt.size() * 4));
    ML4_RETURN_IF_ERROR(h2d(b.idx_slots, islots.data(), Tp * 8));
  }
  if (Rp > 0) ML4_RETURN_IF_ERROR(h2d(b.row_idx, rows.data(), Rp * 4));
  step_T_ = Tp;
  step_R_ = Rp;
  step_maxlen_ = maxlen;
  mode_ = Mode::kEager;
  if (graph) {
    const GraphKey key{Tp, Rp, maxlen, maxb};
    auto it = graphs_.find(key);
    if (it != graphs_.end()) {
      mode_ = Mode::kReplay;
      replay_ = &it->second;
      const Status st = forward(nullptr, nullptr);
      mode_ = Mode::kEager;
      ML4_RETURN_IF_ERROR(st);
      ++graph_replays_;
    } else {
      // Eager first (sizes buffers, makes plans: nothing may allocate while capturing),
      // then capture the identical launch sequence for the next steps of this bucket.
      ML4_RETURN_IF_ERROR(forward(nullptr, nullptr));
      if (buffer_generation_ != gen) graphs_.clear();
      std::vector<GraphExec> segments;
      mode_ = Mode::kCapture;
      capture_ = &segments;
      const Status cap = forward(nullptr, nullptr);
      mode_ = Mode::kEager;
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      cudaStreamIsCapturing(stream_, &cs);
      if (cs != cudaStreamCaptureStatusNone) {  // a failed segment left the capture open
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(stream_, &g);
        if (g) cudaGraphDestroy(g);
      }
      if (!cap.is_ok()) {
        (void)cudaGetLastError();
        ML4_LOG_WARN("cuda runner: graph capture failed for {} tokens ({}); running eagerly", Tp, cap.message());
        opts_.cuda_graphs = false;
      } else {
        graphs_.emplace(key, std::move(segments));
      }
    }
  } else {
    ML4_RETURN_IF_ERROR(forward(trace != nullptr ? &md : nullptr, trace));
  }
  StepOutput out;
  // Device sampling (sampling.h): when every sequence asking for logits asked for it, draw
  // the R tokens on the GPU and copy back 8 bytes per row instead of R x V logits.
  bool device_sample = R > 0 && trace == nullptr;
  for (const auto& s : in.seqs)
    if (s.num_logits > 1 || (s.num_logits == 1 && !s.device_sampling)) device_sample = false;
  if (device_sample) {
    if (b.samp_cap < R) {
      ML4_ASSIGN_OR_RETURN(b.samp_params, DeviceBuffer::alloc(R * sizeof(DeviceSamplingParams)));
      ML4_ASSIGN_OR_RETURN(b.samp_tokens, DeviceBuffer::alloc(R * 4));
      ML4_ASSIGN_OR_RETURN(b.samp_logprobs, DeviceBuffer::alloc(R * 4));
      ML4_ASSIGN_OR_RETURN(b.samp_ws, DeviceBuffer::alloc(sample_rows_workspace_bytes(R, cfg_.vocab_size)));
      b.samp_cap = R;
    }
    std::vector<DeviceSamplingParams> params;
    for (const auto& s : in.seqs)
      if (s.num_logits == 1) params.push_back(*s.device_sampling);
    ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.samp_params.data(), params.data(), R * sizeof(DeviceSamplingParams),
                                             cudaMemcpyHostToDevice, stream_));
    ML4_RETURN_IF_ERROR(sample_rows(b.logits.as<float>(), R, cfg_.vocab_size,
                                    static_cast<const DeviceSamplingParams*>(b.samp_params.data()),
                                    b.samp_tokens.as<int32_t>(), b.samp_logprobs.as<float>(), b.samp_ws.data(),
                                    b.samp_ws.bytes(), stream_));
    out.sampled.resize(R);
    out.sampled_logprob.resize(R);
    ML4_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out.sampled.data(), b.samp_tokens.data(), R * 4, cudaMemcpyDeviceToHost, stream_));
    ML4_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out.sampled_logprob.data(), b.samp_logprobs.data(), R * 4, cudaMemcpyDeviceToHost, stream_));
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));  // params (host vector) and outputs
  } else if (R > 0) {
    std::vector<float> logits(R * cfg_.vocab_size);
    ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits.data(), b.logits.data(), logits.size() * 4,
                                             cudaMemcpyDeviceToHost, stream_));
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    const int64_t V = cfg_.vocab_size;
    size_t row = 0;
    for (const auto& s : in.seqs) {
      out.logits.emplace_back(logits.begin() + row * V, logits.begin() + (row + s.num_logits) * V);
      row += s.num_logits;
    }
  } else {
    ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    for (size_t i = 0; i < in.seqs.size(); ++i) out.logits.emplace_back();
  }
  return out;
}

Status CudaRunner::read_cache_page(int group, int layer_slot, int64_t block, std::vector<uint8_t>* out) const {
  if (group < 0 || group >= static_cast<int>(spec_.groups.size())) return out_of_range("cache group {}", group);
  const auto& g = spec_.groups[group];
  const auto& pool = g.kind == CacheGroupSpec::kLatent ? kv_ : g.kind == CacheGroupSpec::kIndexer ? idx_kv_ : other_kv_;
  if (layer_slot < 0 || layer_slot >= static_cast<int>(pool.size()) || block < 0 || block >= group_blocks_[group])
    return out_of_range("cache group {} slot {} block {}", group, layer_slot, block);
  const int64_t bytes = g.page_bytes_per_layer();
  out->resize(bytes);
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return cuda_status(cudaMemcpy(out->data(), static_cast<const uint8_t*>(pool[layer_slot].data()) + block * bytes, bytes,
                                cudaMemcpyDeviceToHost),
                     "read_cache_page");
}

std::vector<KvRegion> CudaRunner::kv_regions() {
  std::vector<KvRegion> out;
  for (size_t g = 0; g < spec_.groups.size(); ++g) {
    const auto& sg = spec_.groups[g];
    auto& pool = sg.kind == CacheGroupSpec::kLatent ? kv_ : sg.kind == CacheGroupSpec::kIndexer ? idx_kv_ : other_kv_;
    if (group_blocks_[g] <= 0) continue;
    for (size_t slot = 0; slot < pool.size() && slot < sg.layers.size(); ++slot)
      out.push_back(KvRegion{static_cast<int>(g), static_cast<int>(slot), pool[slot].data(), sg.page_bytes_per_layer(),
                             group_blocks_[g], true});
  }
  return out;
}

Status CudaRunner::fill_kv_synthetic(uint64_t seed) {
  uint64_t i = 0;
  for (auto* pool : {&kv_, &idx_kv_})
    for (auto& b : *pool) ML4_RETURN_IF_ERROR(fill_synthetic_bytes(b.data(), static_cast<int64_t>(b.bytes()), seed + ++i, stream_));
  return cuda_status(cudaStreamSynchronize(stream_), "fill_kv_synthetic");
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
