// Our own small-M GEMM ("GEMV") for decode: y[M, N] f32 = x[M, K] f32 W[N, K]^T for
// M <= 8, W in bf16 or FP8 block format, read once at full width.
//
// Why: cuBLASLt reaches 53-79% of the copy bandwidth on ML4's decode GEMMs and 9% on
// narrow ones (wkv_a, N=576: too few output tiles to fill 132 SMs) -- docs/BENCHMARKS.md.
// A decode GEMM is a pure weight stream (M=8 bf16: 8 flop per weight byte, far below the
// ridge), so the kernel's only job is keeping enough 16-byte loads in flight:
//   one warp owns R output rows (R = 4 when N is large, 1 otherwise) and walks K with
//   16-byte weight loads (8 bf16 or 16 e4m3 per lane), 4 loads in flight per row;
//   x stays f32 (read through L1; R rows reuse each x load);
//   when rows alone leave SMs idle, K is split into S slices whose partial sums go to a
//   workspace [S][M][N] and a second kernel adds them in slice order (deterministic).
// Activations are not quantized (x f32 times dequantized W, f32 accumulation): this is
// the CPU's cpu::linear arithmetic, so it matches it to f32 rounding.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "model/linear_weight.h"

namespace ml4::cuda {

struct GemvParams {
  const float* x = nullptr;        // [M, K] f32, M <= 8
  int64_t M = 0, N = 0, K = 0;
  LinearFormat format = LinearFormat::kBF16;  // kBF16 or kFP8Block
  const void* w = nullptr;         // [N, K]
  const float* w_scale = nullptr;  // kFP8Block: [ceil(N/128)][K/128]
  float* y = nullptr;              // [M, N] f32
  float* workspace = nullptr;      // gemv_workspace_floats(M, N, K) floats, or null (no split-K)
  cudaStream_t stream = nullptr;
};

constexpr int kGemvMaxM = 8;

// Floats of workspace the split-K path may use for this shape (0: never splits).
int64_t gemv_workspace_floats(int64_t M, int64_t N, int64_t K);

Status gemv(const GemvParams& p);

// Grouped GEMV for MoE decode, one launch for all (token, expert) rows and capturable in a
// CUDA graph (expert ids are read on the device): y[i] = x[row_src[i]] W_{row_expert[i]}^T.
// Every expert has the same format and shape; w_table / s_table are device arrays of
// per-expert device pointers.
struct GroupedGemvParams {
  const float* x = nullptr;           // [*, K] f32
  int64_t rows = 0, N = 0, K = 0;
  LinearFormat format = LinearFormat::kBF16;
  const int32_t* row_expert = nullptr;  // [rows]
  const int32_t* row_src = nullptr;     // [rows] row of x, or null (row i)
  const void* const* w_table = nullptr;   // [E] -> [N, K]
  const float* const* s_table = nullptr;  // [E] -> FP8 block scales
  float* y = nullptr;                 // [rows, N]
  cudaStream_t stream = nullptr;
};
Status grouped_gemv(const GroupedGemvParams& p);

}  // namespace ml4::cuda
