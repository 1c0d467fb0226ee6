// MoE on the GPU (MODEL.md 3.7), the same function as CpuModel::ffn's MoE branch:
//   router logits (f32 GEMM, LtGemm::f32) -> moe_route (the exact semantics of
//   cpu::moe_route: softmax/sigmoid, correction bias for selection only, group-limited
//   top-k by top-2 group sums, ties to the lower id, renormalize, routed_scale)
//   -> moe_permute (rows grouped by expert, stable: by expert, then token, then k)
//   -> per expert: gather rows, SwiGLU MLP through DeviceLinear GEMMs (BF16 or FP8
//      block) -- a loop of cuBLASLt calls over experts (moe_experts_forward), or for FP8
//      and FP4 experts every expert in one grouped launch per projection (moe_experts_forward_gemm)
//   -> moe_combine: out[t] = sum_k w[t,k] y[perm(t,k)] (+ shared expert), in k order.
// moe_experts_forward reads the expert offsets back to the host (one small copy), so it
// is a graph break: a decode graph captures around it (SYSTEM.md S5).
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_config.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/linear.h"

namespace ml4::cuda {

struct MoeRouteParams {
  const float* logits = nullptr;  // [T, E]
  int64_t T = 0;
  MoeConfig cfg;                  // E = num_experts (<= 1024), K = num_experts_per_tok (<= 32)
  const float* bias = nullptr;    // [E] correction bias or null
  int32_t* ids = nullptr;         // [T, K] descending selection score
  float* weights = nullptr;       // [T, K]
  // Test input (ForwardTrace::forced_experts): select these ids [T, K] (each in [0, E))
  // instead, weighted as the router weighs its own choice (cpu_model.cpp's forced path).
  const int32_t* forced_ids = nullptr;
  cudaStream_t stream = nullptr;
};
Status moe_route(const MoeRouteParams& p);

// The router's f32 GEMV and moe_route in one launch for decode steps (issue 19's "router GEMM
// fused with top-k"): one block per expert computes that expert's logit for every token into
// route.logits, and the last block to finish routes every token as moe_route does (the same
// device code), so ids and weights are moe_route's of those logits. The logits' f32 sums run
// in another order than the cuBLASLt GEMM's (relative differences ~1e-7). x [T, D] f32,
// gate [E, D] f32 (the router's DeviceLinear), counter: router_route_counter_bytes() of
// device memory zeroed once (each launch leaves it at 0). route.forced_ids must be null.
struct RouterRouteParams {
  const float* x = nullptr;
  int64_t D = 0;
  const float* gate = nullptr;
  unsigned* counter = nullptr;
  MoeRouteParams route;  // logits (written), T, cfg, bias, ids, weights, stream
  // The FFN norm in the same launch (issue 19), when norm_w is set: x (written, [T, D]) =
  // rms(attn + residual) * norm_w, and residual += attn, with rms_norm's arithmetic (row_regs.cuh)
  // so meant to be the same bits (CudaMoe.FusedRouterNormIsTheNormThenTheRouter; not yet run on
  // a device); one launch and one serial row kernel fewer a MoE layer. Unimplemented where
  // router_route_norm_supported is false.
  const float* attn = nullptr;
  float* residual = nullptr;
  const float* norm_w = nullptr;
  float eps = 0.0f;
};
bool router_route_supported(const MoeConfig& cfg, int64_t T);  // T <= 8, E <= 256, K <= 32
bool router_route_norm_supported(const RouterRouteParams& p);  // D % 4 == 0, D <= 8192, aligned, distinct rows
size_t router_route_counter_bytes();
Status router_route(const RouterRouteParams& p);

struct MoePermuteParams {
  const int32_t* ids = nullptr;   // [T, K] expert ids
  int64_t T = 0;
  int K = 0, E = 0;
  int32_t* offsets = nullptr;     // [E + 1]: expert e owns permuted rows [offsets[e], offsets[e+1])
  int32_t* perm_token = nullptr;  // [T*K]: source token of permuted row i
  int32_t* inv = nullptr;         // [T*K]: permuted row of (t, k), at t*K + k
  cudaStream_t stream = nullptr;
  int32_t* active = nullptr;      // [1 + E] or null: count, then the experts with rows, ascending
};
Status moe_permute(const MoePermuteParams& p);

// out[i] = x[rows[i]] for i < n; rows of D f32.
Status gather_rows(const float* x, int64_t D, const int32_t* rows, int64_t n, float* out, cudaStream_t stream);

struct MoeCombineParams {
  const float* y_perm = nullptr;  // [T*K, D] expert outputs in permuted order
  const int32_t* inv = nullptr;   // [T*K]
  const float* weights = nullptr; // [T, K]
  int64_t T = 0;
  int K = 0;
  int64_t D = 0;
  const float* shared = nullptr;  // [T, D] shared-expert output or null
  float* out = nullptr;           // [T, D]
  cudaStream_t stream = nullptr;
};
Status moe_combine(const MoeCombineParams& p);

// One SwiGLU MLP on the GPU: w2(silu(w1 x) * w3 x).
struct DeviceMlp {
  DeviceLinear w1, w2, w3;  // gate [I, D], down [D, I], up [I, D]
};

// Scratch for mlp_forward / moe_experts_forward, sized once for max_rows rows.
struct MoeScratch {
  // grouped_gemm: also the grouped-GEMM path's buffers (cursor .. q_scale; 2 x rows x max(D, I)
  // bytes and more), which a backend with that path off does not pay for.
  Status reserve(int64_t max_rows, int64_t D, int64_t I, int E, bool grouped_gemm = true);
  DeviceBuffer xs, g, u, y;  // [rows, D], [rows, I], [rows, I], [rows, D] f32
  DeviceBuffer offsets, perm_token, inv, active;
  DeviceBuffer row_src, gemv_ws;  // decode path: token of each (t, k) row; GEMV split-K partials
  // Grouped-GEMM path (moe_gemm.h): per-expert cursors, tile list and count, e4m3 rows
  // (x, then the hidden activation) and their per-row scales [rows][cols / 128]. num_tiles holds
  // the count, the persistent kernels' work counter, and the second list's count; tiles2 /
  // tile_first2: the second tile list (MoeGemmOptions::swap_down), max_tiles entries too.
  DeviceBuffer cursor, tiles, num_tiles, tile_first, q, q_scale, tiles2, tile_first2;
  int64_t max_tiles = 0;  // 0: reserved without the grouped-GEMM buffers
  LinearScratch lin;
  std::vector<int32_t> host_offsets;
  int64_t max_rows = 0;
};

// out[M, D] = mlp(x[M, D]).
Status mlp_forward(LtGemm& lt, const DeviceMlp& m, const float* x, int64_t M, float* out, MoeScratch& s,
                   cudaStream_t stream);

// The routed experts and the shared one, given ids/weights from moe_route:
// out[T, D] = sum_k w[t,k] expert_{ids[t,k]}(x[t]) + shared(x[t]).
Status moe_experts_forward(LtGemm& lt, const std::vector<DeviceMlp>& experts, const DeviceMlp* shared,
                           const float* x, int64_t T, int64_t D, const int32_t* ids, const float* weights, int K,
                           float* out, MoeScratch& s, cudaStream_t stream);

// Per-expert device pointer tables for grouped_gemv (gemv.h) and the grouped GEMMs, built
// once at load. Every routed expert must share one format (bf16 or FP8 block) and shape. A
// shared expert of the same format and shape is entry E (shared_slot).
struct MoeExpertTables {
  LinearFormat format = LinearFormat::kBF16;
  int E = 0;
  bool shared_slot = false;
  int64_t D = 0, I = 0;
  DeviceBuffer w1, w3, w2;  // [E (+ 1)] const void*
  DeviceBuffer s1, s3, s2;  // [E (+ 1)] const float* (FP8 only)
  DeviceBuffer t1, t3, t2;  // [E (+ 1)] tensor maps of the FP8 weights (moe_weight_tensor_maps; empty where it failed)
  DeviceBuffer t1s, t3s;    // W1's and W3's with boxes of 8 rows (MoeGroupedGemmParams::swap)
};
Result<MoeExpertTables> build_expert_tables(const std::vector<DeviceMlp>& experts, const DeviceMlp* shared = nullptr);

// out[M, D] = mlp(x[M, D]) through our GEMV (M <= 8): f32 activations throughout.
Status mlp_forward_gemv(const DeviceMlp& m, const float* x, int64_t M, float* out, MoeScratch& s,
                        cudaStream_t stream, GemvImpl impl = GemvImpl::kAuto);

// Decode-shaped MoE (T*K <= the scratch's rows; meant for T up to ~128): the same
// function as moe_experts_forward with f32 activations (no bf16/e4m3 rounding of x), in a
// fixed number of launches with no host synchronization -- capturable. moe_permute sorts
// the rows by expert on the device; expert-grouped GEMVs (gemv.h; gate and up in one
// launch on the CUDA-core stream path, T <= 8) stream each selected expert's weights once
// per 8 of its rows, the shared expert riding along as one more slot of the same launches
// (its T rows 8 at a time) when it has the routed shape. x_parts goes to every grouped_gemv
// (gemv.h): FP4 experts take the tensor cores with x in x_parts bf16 parts (0: 3, exact), or
// the exact CUDA-core stream for x_parts < 0.
//
// part splits the work across two streams (CudaRunnerOptions::shared_expert_lane) when the
// shared expert rides in the extra slot (tb.shared_slot): kSharedOnly runs only the shared
// expert's slot (its rows after the T * K routed ones in s.g, s.u and s.y; ids, weights and out
// unused; no permute, so it may run beside the router), kRoutedOnly the rest, its combine
// waiting for `shared_ready` (an event recorded after the kSharedOnly call, or null when the
// same stream ran it). The same launches and per-slot arithmetic as kWhole, so the same bits.
struct MoeSharedPart {
  enum Mode { kWhole, kSharedOnly, kRoutedOnly } mode = kWhole;
  cudaEvent_t shared_ready = nullptr;
};
Status moe_experts_forward_grouped(const MoeExpertTables& tb, const DeviceMlp* shared, const float* x, int64_t T,
                                   const int32_t* ids, const float* weights, int K, float* out, MoeScratch& s,
                                   cudaStream_t stream, int x_parts = 0, MoeSharedPart part = {});

// Prefill-shaped MoE with FP8 block experts (issue 18): the same function as
// moe_experts_forward -- x quantized per 1x128 group (once per token, not per expert row),
// every expert's gate and up projections in one grouped launch whose epilogue writes
// silu(g) * u, that quantized per 1x128 group, every expert's down projection in a second
// launch, the combine -- with the shared expert as group E when tables.shared_slot. No host
// synchronization: capturable. Needs tables of FP8 block experts with D % 128 == 0 (the
// scratch reserved for T * K rows); a shared expert must be the tables' slot.
// NVFP4 / MXFP4 experts (issue 18) take moe_grouped_gemm_fp4 instead: x cast to bf16 once
// per token, gate and up with silu into bf16 hidden rows, the down projection -- weights
// exact, activations rounded to bf16 (relative 2^-9 per element). Their shared expert is the
// slot when it has the experts' format and shape, else (NVFP4 checkpoints keep it FP8) it
// runs first through mlp_forward on `lt` (lt_available in moe_gemm_supported).
bool moe_gemm_supported(const MoeExpertTables& tb, const DeviceMlp* shared, bool lt_available = false);
// The two grouped GEMMs' weights and shapes (gate + up with silu: [I, D]; down: [D, I]), for
// either kernel's parameters (MoeGroupedGemmParams, MoeGroupedGemmFp4Params).
template <typename P>
void gate_up_weights(P& g, const MoeExpertTables& tb) {
  g.gate_up = true;
  g.w = static_cast<const void* const*>(tb.w1.data());
  g.w_scale = static_cast<const float* const*>(tb.s1.data());
  g.w_up = static_cast<const void* const*>(tb.w3.data());
  g.w_up_scale = static_cast<const float* const*>(tb.s3.data());
  g.N = tb.I;
  g.K = tb.D;
}
template <typename P>
void down_weights(P& g, const MoeExpertTables& tb) {
  g.gate_up = false;
  g.w = static_cast<const void* const*>(tb.w2.data());
  g.w_scale = static_cast<const float* const*>(tb.s2.data());
  g.w_up = nullptr;
  g.w_up_scale = nullptr;
  g.N = tb.D;
  g.K = tb.I;
}

// The FP8 grouped GEMMs' variants (moe_gemm.h), all giving the same bits: overlap
// (MoeGroupedGemmParams::overlap), tall (128-row tiles; wins over overlap when both are
// asked for), specialized (the tall tiles, warp-specialized and persistent), group_major (the CTA order of MoeGroupedGemmParams::tile_first). FP4 experts
// take none of them.
struct MoeGemmOptions {
  bool overlap = false;
  bool tall = false;
  bool group_major = false;
  bool specialized = false;  // MoeGroupedGemmParams::specialized (128-row tiles; wins over tall and overlap)
  // The hidden rows quantized in the gate_up epilogue (MoeGroupedGemmParams::y_q; the same bytes
  // as the separate quantization, which it replaces); not with tall (without specialized).
  bool quant_epilogue = true;
  // New fields go last: callers initialize this struct by position.
  bool tma = true;    // specialized: B by TMA where the tables hold tensor maps (MoeGroupedGemmParams::w_tmap)
  bool swap = false;  // MoeGroupedGemmParams::swap (tokens as the MMA's N; wins over the others; no quant epilogue)
  // The down projection alone on the swapped kernel (its own tile list of kMoeGemmSwapTileRows
  // rows, MoePermuteGemmParams::tiles2), gate_up on the variant the fields above choose (and its
  // quant epilogue): the swapped kernel is the faster one for down, the slower for gate_up
  // (docs/BENCHMARKS.md "Sixteenth session"). The same bits (every variant's). FP8 experts with
  // the tables' tensor maps; ignored with swap.
  bool swap_down = false;
};
Status moe_experts_forward_gemm(const MoeExpertTables& tb, const DeviceMlp* shared, const float* x, int64_t T,
                                const int32_t* ids, const float* weights, int K, float* out, MoeScratch& s,
                                cudaStream_t stream, LtGemm* lt = nullptr, MoeGemmOptions gemm = {});

// The earlier decode path (T <= 8), kept as the benchmark's baseline: one weight stream per
// (token, expert) row (row-mode grouped_gemv), the shared expert through the GEMV.
Status moe_experts_forward_rowwise(const MoeExpertTables& tb, const DeviceMlp* shared, const float* x, int64_t T,
                                   const int32_t* ids, const float* weights, int K, float* out, MoeScratch& s,
                                   cudaStream_t stream);

}  // namespace ml4::cuda
