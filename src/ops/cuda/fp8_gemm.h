// Our own FP8 block-scaled GEMM (DeepSeek-V3 format, MODEL.md 4):
//   y[M, N] = sum_kb x_scale[m, kb] * w_scale[n / 128, kb] * (x_q[m, kb*128 : +128] . w_q[n, kb*128 : +128])
// x e4m3 [M, K] with one f32 scale per 1x128 group, W e4m3 [N, K] with one f32 scale per
// 128x128 block, f32 accumulation, bf16 or f32 output.
//
// Why it exists: cuBLASLt 13's block-scaled FP8 GEMM (gemm.h) only runs on the H200 with
// x as the A operand and M % 4 == 0, writes y^T, and has no kernel for some shapes; this
// kernel takes every shape the engine uses (M >= 1, K % 128 == 0, N % 16 == 0) and is the
// faster one at decode-sized M (see docs/BENCHMARKS.md).
//
// How (DeepSeek-V3 report 3.3.2 "increasing accumulation precision", DeepGEMM's scheme):
// each CTA owns a BM x BN output tile (BN <= 128 divides 128, so the tile sees one weight
// scale per K block); per 128-wide K block it stages x and W tiles in shared memory with
// cp.async (3-4 stage ring, rows padded to 144 bytes so ldmatrix is bank-conflict free),
// runs 4 x mma.sync m16n8k32 e4m3 x e4m3 -> f32 into a fresh partial accumulator, then
// promotes: acc += partial * x_scale[m, kb] * w_scale[n/128, kb]. When the output tiles
// alone cannot fill the SMs (decode), K blocks are split over S CTAs whose f32 partial
// tiles go to a workspace [S][M][N]; a second kernel adds them in slice order, so results
// are bit-identical run to run (no atomics).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/status.h"

namespace ml4::cuda {

struct Fp8GemmParams {
  const void* x = nullptr;         // [M, K] e4m3 row-major (rows >= M are never read)
  const float* x_scale = nullptr;  // [K/128][x_scale_ld] f32 (group-major, M fastest)
  int64_t x_scale_ld = 0;          // 0: M
  const void* w = nullptr;         // [N, K] e4m3 row-major
  const float* w_scale = nullptr;  // [ceil(N/128)][w_scale_ld] f32
  int64_t w_scale_ld = 0;          // 0: K/128
  void* y = nullptr;               // [M, N] y_dtype (kBF16 or kF32) row-major
  DType y_dtype = DType::kBF16;
  int64_t M = 0, N = 0, K = 0;
  void* workspace = nullptr;       // split-K partials, or null (never splits)
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

// Bytes of workspace that let the kernel split K as it wants for this shape.
size_t fp8_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K);

Status fp8_block_gemm(const Fp8GemmParams& p);

// y[m, n] = t[n * ld_t + m] for m < M, n < N (elem_bytes 2 or 4): the transpose after
// cuBLASLt's swapped FP8 GEMM, whose D is y^T with M padded to ld_t.
Status transpose_out(const void* t, int64_t ld_t, int elem_bytes, int64_t N, int64_t M, void* y,
                     cudaStream_t stream);

}  // namespace ml4::cuda
