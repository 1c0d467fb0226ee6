// Our own small-M GEMM ("GEMV") for decode: y[M, N] f32 = x[M, K] f32 W[N, K]^T for
// M <= 8, W in bf16 or FP8 block format, read once at full width.
//
// A decode GEMM is a pure weight stream, so the kernel's job is keeping enough 16-byte
// loads in flight while the arithmetic stays off the critical path. Two kernels:
//   tensor-core path (default whenever a workspace is given, except at M <= 2): one warp owns a 16-row mma
//   tile, each lane's 16-byte weight load is used unchanged as its m16n8k16 A fragment
//   (bf16; e4m3 converted exactly to bf16), the k permutation this implies is applied to
//   x as well; x (f32, <= 8 tokens = the mma's n) is staged per 1024-k chunk in shared
//   memory split into three bf16 parts hi + mid + lo = x exactly (24 significand bits),
//   so every product is exact and the sums are f32 (the mma's f32 accumulator; FP8 adds
//   each 64-k partial times its block scale with an f32 FMA). The cost per weight byte no
//   longer grows with M. K is split into S slices (deterministic reduce) to fill the SMs;
//   (a variant streaming the weights through a per-warp cp.async shared-memory ring with an
//   integer e4m3 -> bf16 conversion was measured 0-20% slower on the H200 and removed;
//   docs/BENCHMARKS.md "GEMV ring kernel");
//   CUDA-core weight stream (kStream; kAuto's choice for FP8 and BF16 at M <= 2, gemv_stream.cuh):
//   R = 2-4 rows per block, K split over the block's threads, 4-byte coalesced loads and
//   exact e4m3 decoding (cvt.e4m3x2 -> f16 -> f32), f32 FMAs; no workspace (the H200
//   profile and figures: docs/BENCHMARKS.md "FP8 decode GEMV, profiled (engineer gemv3)");
//   f16 tensor-core stream for FP8 at M = 3..4 by default (GemvStreamConfig::mma / mma_min_m,
//   where the stream would run; gemv_mma.cuh; slower than the stream at M = 1 and, in the
//   step, at M = 2): blocks of 4-16 warps over 16 rows splitting K, each lane's 16-byte
//   load four m16n8k16 A fragments after cvt e4m3x2 -> f16x2, x as two f16 parts (hi + lo of
//   x times a power of two per 256 k: 22 bits) in B's columns, 2 per token; ~36 instructions
//   per KB of weights a warp where the CUDA-core stream's loop issues ~96;
//   CUDA-core path (null workspace, or GemvImpl::kCudaCore): the earlier kernel (one warp
//   per R rows, f32 FMAs), kept for callers without a workspace and as the bench baseline.
// All match cpu::linear to f32 rounding (x f32 times exactly decoded W, f32 sums: only
// the summation order differs; the f16 mma kernel also rounds x to 22 bits, ~1e-7).
// NVFP4 / MXFP4 weights (any M: passes of 8 tokens, also the prefill path of linear_f32 for
// now) take the tensor-core kernel (gemv_tc.cuh: e2m1 decoded to bf16 in registers through
// byte tables, times the group scale exactly; x in x_parts bf16 parts) unless impl is kStream
// or kCudaCore or x_parts is negative, which keep the exact CUDA-core stream (gemv_fp4.cuh: f32 FMAs, the CPU's
// weights bit for bit; ALU-bound: it reached 0.53 of the HBM rate at batch 1 on the H200).
// grouped_gemv's expert-grouped mode takes both. An NVFP4 weight's scale buffer carries its
// global scale after the e4m3 scales (fp4_global_offset).
//
// grouped_gemv runs MoE decode in one launch with no host synchronization (capturable):
// rows sorted by expert (moe_permute's offsets and active-expert list, read on the
// device), one block per (active expert, 128-row tile) looping over that expert's rows 8
// at a time, so each selected expert's weights are streamed once per 8 of its rows.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "model/linear_weight.h"

namespace ml4::cuda {

// kAuto: FP8 with M <= gemv_stream_config().max_m (or .mma): kStream (which hands
// mma_min_m..mma tokens to the f16 mma kernel); BF16 with M <= max_m likewise (bf16_stream;
// always at N <= 64); otherwise kTensorCore with a workspace, the CUDA-core kernel without one.
// With x_parts < 0 (the exact mode) FP8 and BF16 always kTensorCore (x_parts above). kStream: the CUDA-core weight stream
// (gemv_stream.cuh: R rows per block, K split over the block, integer e4m3 decoding; no
// workspace).
enum class GemvImpl { kAuto, kCudaCore, kTensorCore, kStream };

struct GemvParams {
  const float* x = nullptr;        // [M, K] f32, M <= 8
  int64_t M = 0, N = 0, K = 0;
  LinearFormat format = LinearFormat::kBF16;  // kBF16, kFP8Block, kNVFP4 or kMXFP4 (FP4: any M)
  const void* w = nullptr;         // [N, K] (FP4: [N, K/2] bytes)
  const float* w_scale = nullptr;  // kFP8Block: [ceil(N/128)][K/128]; FP4: the scale bytes (linear.h)
  float* y = nullptr;              // [M, N] f32
  float* workspace = nullptr;      // gemv_workspace_floats(M, N, K) floats, or null (no split-K)
  cudaStream_t stream = nullptr;
  GemvImpl impl = GemvImpl::kAuto;  // kAuto: above (the stream at M <= 2, tensor cores with a workspace)
  // FP4 on the tensor cores: x as 1, 2 or 3 bf16 parts (0: 3). 3 is x exactly (every product
  // exact, the sums f32: cpu::linear to f32 rounding); 2 keeps 16 bits (relative error per
  // element <= 2^-17); 1 rounds x to bf16 (<= 2^-9). Fewer parts, fewer mmas per weight byte.
  // Negative (the exact mode's choice, with impl kAuto): FP4 takes the exact CUDA-core stream, as
  // impl kStream does; FP8 and BF16 the tensor cores (x in three exact parts) at every M and N,
  // with the split-K count of 8 rows (grouped_gemv: never the stream), so a token's sums do not
  // depend on the rows that share its launch (CudaGemv.ExactModeIsBatchInvariant).
  int x_parts = 0;
};

constexpr int kGemvMaxM = 8;

// Byte offset of an NVFP4 weight's f32 global scale in its device scale buffer, after the
// [N, K/16] e4m3 scales (rounded up to 16 bytes).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t fp4_global_offset(int64_t N, int64_t K) { return (N * (K / 16) + 15) / 16 * 16; }

// Floats of workspace the split-K path may use for this shape (0: never splits).
int64_t gemv_workspace_floats(int64_t M, int64_t N, int64_t K);

Status gemv(const GemvParams& p);

// Benchmark knob: the tensor-core path's L2 prefetch distance in warp steps (default 0: off, measured faster).
void gemv_set_l2_prefetch(int steps);

// Where the CUDA-core weight stream (kStream) runs and how (benchmark/test knobs; the
// defaults are the measured choice, docs/BENCHMARKS.md "FP8 decode GEMV, profiled").
struct GemvStreamConfig {
  int max_m = 2;             // kAuto: FP8 gemv with M <= max_m streams (BF16 too: bf16_stream)
  int bf16_stream = 2;       // kAuto: BF16 with M <= max_m streams too, at any N (1; not with x_parts < 0),
                             // or only at N <= 64 (0); 2 (the default): grouped_gemv's BF16 experts
                             // too, with max_expert_rows <= grouped_max_rows (ml4-tiny's batch-1
                             // step 0.68 -> 0.60 ms on the H100; docs/BENCHMARKS.md "Twenty-eighth session")
  int grouped_max_rows = 2;  // grouped_gemv: FP8 with max_expert_rows <= this streams (MoE T <= 2)
  int conv = 1;              // e4m3 decoding: 0 integer -> f16, 1 cvt.e4m3x2 -> f16, 2 integer -> f32
  int rows = 0;              // rows per block: 2, 4, or 0 (by N)
  int warp_rows = 1;         // FP8 with cvt decoding at M = 1: blocks of one warp, each streaming its
                             // own 4 rows (gemv_stream.cuh stream_rows kT = 32), where N >= 16
                             // blocks an SM (1), at every N (2), or never (0: four warps share 4 rows)
  int warp_rows_max_m = 2;   // ... at M up to this (1 or 2; at 2: 168 registers, no spill)
  int mma = 4;               // FP8 with mma_min_m <= M <= mma (1, 2 or 4; 0 off) on the tensor cores in
  int mma_min_m = 3;         // f16, x as two f16 parts scaled by a power of two per 256 k (gemv_mma.cuh),
                             // where the stream would run (so with kAuto, M <= mma streams; grouped:
                             // max_expert_rows <= mma). M is the launch's pass: 3 and 4 tokens run M = 4
  int mma_warps = 0;         // its warps a block, splitting K: 4, 8, 16 (M <= 2), or 0: by N (gemv.cu mma_warps)
  // Under programmatic launch a plain stream GEMV's blocks prefetch their rows into L2 before they
  // wait on their predecessor: all of them (-1), at most this many bytes a block, or none (0, the
  // default: the one-warp rows keep ~16 blocks an SM resident, whose prefetch of the next launch's
  // first wave, ~50 MB, cost the H100's batch-1 step ~30 us; docs/BENCHMARKS.md "Twenty-eighth session").
  int64_t pdl_prefetch_bytes = 0;
};
void gemv_set_stream_config(const GemvStreamConfig& c);
GemvStreamConfig gemv_stream_config();

// Grouped GEMV for MoE decode, one launch, capturable in a CUDA graph (expert ids are read
// on the device): y[i] = x[row_src[i]] W_{expert of row i}^T. Every expert has the same
// format and shape; w_table / s_table are device arrays of per-expert device pointers.
//   Expert-grouped mode (offsets != null; the decode path): rows i are sorted by expert,
//   expert e owning [offsets[e], offsets[e+1]); active = [count, ids...] lists the experts
//   with rows (moe_permute). Grid slots: max_active (>= count; min(E, rows) is safe) plus
//   one for an optional extra expert (the shared one) whose rows t < extra_rows read x row
//   extra_x_row0 + t and write y row extra_y_row0 + t. Each expert's weights are streamed
//   once per 8 of its rows.
//   Row mode (offsets == null; the earlier kernel, kept as the bench baseline): row i uses
//   expert row_expert[i], one weight stream per row.
struct GroupedGemvParams {
  const float* x = nullptr;           // [*, K] f32
  int64_t rows = 0, N = 0, K = 0;
  LinearFormat format = LinearFormat::kBF16;
  const int32_t* row_expert = nullptr;  // row mode: [rows]
  const int32_t* row_src = nullptr;     // [rows] row of x, or null (row i)
  const void* const* w_table = nullptr;   // [E] -> [N, K]
  const float* const* s_table = nullptr;  // [E] -> FP8 block scales
  float* y = nullptr;                 // [rows, N]
  cudaStream_t stream = nullptr;
  // Expert-grouped mode:
  const int32_t* offsets = nullptr;   // [E + 1]
  const int32_t* active = nullptr;    // [1 + E]
  int max_active = 0;
  const void* extra_w = nullptr;      // [N, K] or null
  const float* extra_s = nullptr;
  int64_t extra_rows = 0, extra_x_row0 = 0, extra_y_row0 = 0;
  // Most rows any slot has (routed experts: <= T; the extra: extra_rows), or 0 (unknown).
  // Known and small (gemv_stream_config().grouped_max_rows): the CUDA-core weight stream
  // (FP8; bf16 only with impl = kStream), one block per (slot, 2-4 rows), a slot's rows 1, 2
  // or 4 per pass; otherwise the tensor-core kernel, one block per (slot, 128 rows).
  int64_t max_expert_rows = 0;
  GemvImpl impl = GemvImpl::kAuto;    // kTensorCore: never stream
  // Optional second weight set over the same rows and x (MoE: w3 beside w1), y2 = x W2^T:
  // one launch on the stream path (twice the slots), two launches on the tensor-core path.
  const void* const* w_table2 = nullptr;
  const float* const* s_table2 = nullptr;
  const void* extra_w2 = nullptr;
  const float* extra_s2 = nullptr;
  float* y2 = nullptr;
  int x_parts = 0;                    // GemvParams::x_parts (FP4 parts; negative: the exact mode, FP8 / bf16 never stream)
};
Status grouped_gemv(const GroupedGemvParams& p);

}  // namespace ml4::cuda
