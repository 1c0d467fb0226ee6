// CudaRunner's private state shared by cuda_runner.cpp (loading, steps, graphs) and
// cuda_runner_layers.cpp (the per-layer pieces of the forward).
#pragma once

#include <cuda_runtime.h>

#include "ops/cuda/cuda_runner.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/moe.h"

namespace ml4::cuda {

// Tokens up to which MoE layers take the grouped decode path (moe_experts_forward_grouped:
// each selected expert's weights read once per 8 of its rows, no host synchronization,
// capturable); larger steps loop over experts (cuBLASLt / FP8 GEMMs per expert).
constexpr int64_t kGroupedMoeMaxTokens = 128;

struct CudaRunner::Layer {
  DeviceBuffer attn_norm, ffn_norm;
  DeviceLinear wq, wq_a, wq_b, wkv_a, wo;
  DeviceBuffer q_a_norm, kv_a_norm, w_uk, w_uv, ssmax_s;
  DeviceLinear idx_wq, idx_wk, idx_wproj;  // DSA indexer owners
  DeviceBuffer idx_knorm_w, idx_knorm_b;
  bool moe = false;
  DeviceMlp dense;
  DeviceLinear gate;  // f32
  DeviceBuffer bias;
  std::vector<DeviceMlp> experts;
  std::unique_ptr<DeviceMlp> shared;
  std::unique_ptr<MoeExpertTables> tables;
};

// Step buffers, grown to the largest step seen (fixed addresses between steps of a size).
struct CudaRunner::Buffers {
  int64_t T = 0, R = 0, bt_cap = 0, maxb = 0;
  DeviceBuffer residual, a, tmp, q, qlat_in, ckv, c, q_lat, q_rope, head_scale, out_lat, lse, o;
  DeviceBuffer router, ids, wts, rows, normed, logits;
  DeviceBuffer tok, pos, slots, seq_of, lengths, block_table, row_idx, attn_ws, gemv_ws, gemv_ws_side;
  size_t attn_ws_bytes = 0;
  // DSA: indexer q/k/weights, q in e4m3 + scales, key slots, scores for a chunk of tokens,
  // per-buffer top-k slots and counts, forced selections, traced positions.
  DeviceBuffer iq, ik, iw, iq8, iqs, idx_slots, idx_block_table, scores, forced_slots, forced_counts, topk_pos, topk_ws;
  std::vector<DeviceBuffer> topk_slots, topk_counts;
  DeviceBuffer forced_ids;
  DeviceBuffer samp_params, samp_tokens, samp_logprobs, samp_ws;  // device sampling, samp_cap rows
  int64_t samp_cap = 0;
  int64_t scores_cap = 0;
  size_t topk_ws_bytes = 0;
  LinearScratch lin;
  MoeScratch moe;
};

// Profiling (eager steps only, CudaRunner::set_profile): events around one piece of the
// forward, its GPU milliseconds added to (*profile_)[label].
template <typename F>
Status CudaRunner::timed(const char* label, F&& fn) {
  if (profile_ == nullptr || mode_ != Mode::kEager) return fn();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0, stream_);
  Status st = fn();
  cudaEventRecord(e1, stream_);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  (*profile_)[label] += ms;
  return st;
}

// Runs fn with stream_ switched to the indexer's side stream (and lin() to its GEMV workspace).
template <typename F>
Status CudaRunner::on_side(F&& fn) {
  std::swap(stream_, side_stream_);
  on_side_ = !on_side_;
  Status st = fn();
  std::swap(stream_, side_stream_);
  on_side_ = !on_side_;
  return st;
}

}  // namespace ml4::cuda
