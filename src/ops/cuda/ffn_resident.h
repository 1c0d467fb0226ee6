// The FFN half of a decode layer as one resident kernel (SYSTEM.md S17, issue 19's
// `--decode-backend latency_specialized`): for a step of at most 4 tokens,
//
//   residual += attn_out;  a = rms(residual) * norm_w;  out = ffn(a)
//
// where ffn is the layer's MoE (router, top-k, routed experts, shared expert, weighted
// combine) or its dense MLP, all FP8 block-scaled. The standard path takes seven launches for
// this (RMSNorm, the fused router, permute, grouped gate/up, SiLU, grouped down, combine); here
// one cooperative launch does it in steps separated by bounded grid barriers (fault.cuh):
//   0. block t normalizes token t (and writes its residual row);
//   -- barrier 1 --
//   1. the router's logits (a block an expert) and the always-run MLP's (shared expert or
//      dense) gate/up rows, SiLU(g) * u in the item's epilogue. The block that finishes the
//      last router item routes every token (the standard path's warp routine, moe_route.cuh),
//      lays out the permutation and publishes it while the others go on;
//   -- barrier 2 -- every block copies the routing;
//   2. the routed experts' gate/up rows, SiLU in the epilogue;
//   -- barrier 3 --
//   3. the down projections, R output rows of one matrix an item, into y rows (a dense
//      layer's straight into out);
//   -- barrier 4 -- the weighted combine of the y rows into out, every thread a share.
// Blocks have the weight-stream GEMV's shape (128 threads, as many a multiprocessor as it runs)
// and take items of R = 4 weight rows from per-step counters; every item goes through one
// stream_rows call (gemv_stream.cuh), so every sum is the standard path's stream GEMV's; the
// router's logits are router_route's, the norm rms_norm's, the combine moe_combine's. At T = 1
// (where the standard path streams every linear) the result is bit-identical to it for matrices
// below 16 blocks an SM (wider ones the standard path streams a warp per 4 rows, gemv.cu
// warp_rows_at: another summation order, so it matches to f32 rounding there); at T = 2 the
// standard path streams its wide expert GEMVs a warp per 4 rows too, at T = 3..4 on the f16
// mma kernel (gemv_mma.cuh: x kept to 22 bits), so it matches to their rounding.
//
// A wait that runs past timeout_ns records a fault in the runner's fault word (fault.h) and
// ends the kernel; the host sees it after the step and stops. never_arrive_block is the test
// switch: that block leaves before the first barrier.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "ops/cuda/fault.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/moe.h"
#include "ops/ffn_resident_shape.h"

namespace ml4::cuda {

// An FP8 block-scaled MLP: gate w1 [I, D], up w3 [I, D], down w2 [D, I], scales [ceil(N/128)][K/128].
struct ResidentMlp {
  const void* w1 = nullptr;
  const void* w3 = nullptr;
  const void* w2 = nullptr;
  const float* s1 = nullptr;
  const float* s3 = nullptr;
  const float* s2 = nullptr;
  int64_t I = 0;
};

inline constexpr int kTracePoints = 10;
// Blocks of the widest launch (its blocks x kTracePoints words of FfnResidentParams::trace).
int ffn_resident_max_blocks();
size_t ffn_resident_routing_bytes();

struct FfnResidentParams {
  int T = 0;  // tokens, 1..kFfnResidentMaxTokens
  int64_t D = 0;
  const float* attn_out = nullptr;  // [T, D], added into residual (may be out)
  float* residual = nullptr;        // [T, D], updated
  const float* norm_w = nullptr;    // [D]
  float eps = 1e-6f;
  float* a = nullptr;               // [T, D]: the normalized rows (written)
  // MoE (gate != null): the f32 router [E, D], its bias [E] or null, the routing config, the
  // routed experts' tables [E] of FP8 pointers, and the standard path's outputs (written too).
  const float* gate = nullptr;
  const float* bias = nullptr;
  MoeConfig moe;
  const void* const* w1_table = nullptr;
  const void* const* w3_table = nullptr;
  const void* const* w2_table = nullptr;
  const float* const* s1_table = nullptr;
  const float* const* s3_table = nullptr;
  const float* const* s2_table = nullptr;
  int64_t I_routed = 0;
  float* logits = nullptr;   // [T, E]
  int32_t* ids = nullptr;    // [T, K]
  float* weights = nullptr;  // [T, K]
  // The MLP every token runs: the shared expert (MoE) or the dense FFN; w1 == null: none.
  ResidentMlp mlp;
  float* hidden = nullptr;  // ffn_resident_hidden_floats(...) floats of scratch (hidden and down rows)
  float* out = nullptr;     // [T, D]
  GridBarrierState* barrier = nullptr;  // zeroed once; a launch that passes leaves it zeroed
  unsigned* counters = nullptr;         // 4 words: the phases' item counters (the kernel zeroes them)
  void* routing = nullptr;              // MoE: ffn_resident_routing_bytes() (the routing, published)
  DeviceFault* fault = nullptr;
  uint64_t timeout_ns = kDefaultWaitTimeoutNs;
  int never_arrive_block = -1;  // test switch
  // Blocks a multiprocessor (0: the stream GEMV's count for the step's size; 3 at one token:
  // 170 registers a thread instead of 128). The same sums either way.
  int blocks_per_sm = 0;
  // Profiling: when set, thread 0 of block b writes %globaltimer at each of kTracePoints points
  // to trace[b * kTracePoints + k]: 0 start, 1 after the norm, 2 past barrier 1, 3 after the
  // router, 4 end of phase 1, 5 past barrier 2, 6 routed, 7 end of phase 2, 8 past barrier 3,
  // 9 end (a dense layer skips 6 to 8).
  uint64_t* trace = nullptr;
  cudaStream_t stream = nullptr;
};

int64_t ffn_resident_hidden_floats(int T, int K, int64_t I_routed, int64_t I_mlp, int64_t D);

// An FP8 MLP's matrices as the kernel takes them (shapes are the caller's to check).
ResidentMlp resident_mlp(const DeviceLinear& w1, const DeviceLinear& w2, const DeviceLinear& w3);
// The routed experts' tables (build_expert_tables) into p's w*_table / s*_table and I_routed.
void set_routed_experts(FfnResidentParams* p, const MoeExpertTables& tb);

Status ffn_resident(const FfnResidentParams& p);

}  // namespace ml4::cuda
