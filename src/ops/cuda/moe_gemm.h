// MoE prefill as grouped GEMMs (issue 18): every expert's FP8 block-scaled GEMM in one launch.
//
//   moe_permute_gemm: the rows of a step grouped by expert on the device (no host sync):
//     counts by atomics, offsets by one scan, rows scattered by per-expert cursors; with
//     `shared_slot` the shared expert is group E, owning rows [T*K, T*K + T) = every token in
//     order. Then the tile list: each group's rows cut into kMoeGemmTileRows-row tiles
//     (group, first row, end row), and their count.
//   moe_grouped_gemm: per tile, y[rows, N] = A[rows] . W_group^T on Hopper's wgmma
//     (m64n128k32, e4m3 x e4m3 -> f32), with the DeepSeek-V3 block scaling: per 128-wide K
//     block the tensor cores sum into a fresh accumulator that is then promoted,
//     acc += partial * a_scale[row, kb] * w_scale[n / 128, kb] (fp8_gemm.h's scheme).
//     gate_up: the B tile holds 64 rows of W1 and the same 64 rows of W3 per warpgroup, so
//     one thread holds gate and up of the same element, and the epilogue writes
//     silu(gate) * up (cpu::silu_mul's formula) -- the hidden activation, never g and u.
//
// Rows within an expert come out of the scatter in any order; no output depends on it: the
// tensor cores compute each output element from its own row and column alone, the
// activation quantization is per row, and the combine reads rows through `inv`. So results
// are bit-identical run to run (tested).
//
//   moe_grouped_gemm_fp4: the same tiles and gate_up epilogue for NVFP4 / MXFP4 expert weights
//     (moe_gemm_fp4.cu): A is bf16, each CTA expands its B tile to bf16 in shared memory
//     (e2m1 x its group scale is exact in bf16) and runs wgmma m64n128k16 bf16 -> f32; the
//     NVFP4 global scale multiplies the accumulators. gate_up writes the hidden activation
//     as bf16 (the down projection's A), the plain GEMM f32.
//
// Layout of the plain kernel: CTA = 2 warpgroups, tile 64 rows x 256 B rows (each warpgroup
// m64 x n128), K in 128-byte blocks through a 4-stage cp.async ring (A rows gathered through
// `a_rows`; TMA cannot gather on sm_90) stored in the 128-byte swizzle the wgmma descriptors
// name; bound by L2 at ml4's shapes (81-83% of its peak at T = 4096, ncu: 40 KB a K block for
// 4.2 MFLOP). The variants below trade that against other limits; the runner's default is
// `specialized` (128-row tiles, a producer warpgroup, B by TMA: the whole MoE at T = 4096
// 1.19x the 64-row kernel on an H100, docs/BENCHMARKS.md "Sixteenth session").
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"

namespace ml4::cuda {

constexpr int kMoeGemmTileRows = 64;
constexpr int kMoeGemmTallTileRows = 128;  // MoeGroupedGemmParams::tall
constexpr int kMoeGemmSwapTileRows = 160;  // MoeGroupedGemmParams::swap

struct MoeTile {
  int32_t group = 0, row0 = 0, row1 = 0, pad = 0;  // rows [row0, row1) of the permuted space
};

// Upper bound of the tile count for `rows` permuted rows over `groups` groups.
inline int64_t moe_gemm_max_tiles(int64_t rows, int64_t groups, int tile_rows = kMoeGemmTileRows) {
  return (rows + tile_rows - 1) / tile_rows + groups;
}

struct MoePermuteGemmParams {
  const int32_t* ids = nullptr;   // [T, K] expert ids in [0, E) (the router's; an id outside is
                                  // skipped, which would misplace the shared rows: callers check)
  int64_t T = 0;
  int K = 0, E = 0;
  bool shared_slot = false;       // group E = the shared expert over all T tokens
  int32_t* cursor = nullptr;      // [E + 1] scratch
  int32_t* offsets = nullptr;     // [E + 2]: group g owns rows [offsets[g], offsets[g + 1])
  int32_t* perm_token = nullptr;  // [T*K (+ T)]: source token of each permuted row
  int32_t* inv = nullptr;         // [T*K]: permuted row of (t, k), at t*K + k
  MoeTile* tiles = nullptr;       // [max_tiles]
  int32_t* num_tiles = nullptr;   // [1]
  int64_t max_tiles = 0;          // >= moe_gemm_max_tiles(T*K (+ T), E (+ 1), tile_rows)
  int tile_rows = kMoeGemmTileRows;  // or kMoeGemmTallTileRows (tall / specialized), kMoeGemmSwapTileRows (swap)
  int32_t* tile_first = nullptr;  // [E + 2] or null: the first tile of each group (and the count)
  cudaStream_t stream = nullptr;
  // Optionally a second tile list over the same permuted rows, of tile_rows2 rows (a GEMM of the
  // layer on another kernel: MoeGemmOptions::swap_down), with its own count and tile_first2.
  MoeTile* tiles2 = nullptr;
  int32_t* num_tiles2 = nullptr;
  int64_t max_tiles2 = 0;
  int tile_rows2 = 0;
  int32_t* tile_first2 = nullptr;
};
Status moe_permute_gemm(const MoePermuteGemmParams& p);

struct MoeGroupedGemmParams {
  bool gate_up = false;                  // y = silu(A W^T) * (A W_up^T), else y = A W^T
  const void* a = nullptr;               // e4m3 rows of K bytes
  const float* a_scale = nullptr;        // [rows of a][K / 128] f32, row-major
  const int32_t* a_rows = nullptr;       // permuted row i reads a[a_rows[i]]; null: a[i]
  const void* const* w = nullptr;        // [groups] e4m3 [N, K]
  const float* const* w_scale = nullptr; // [groups] [ceil(N / 128)][K / 128] f32
  const void* const* w_up = nullptr;     // gate_up: [groups] e4m3 [N, K]
  const float* const* w_up_scale = nullptr;
  const MoeTile* tiles = nullptr;        // from moe_permute_gemm
  const int32_t* num_tiles = nullptr;
  int64_t max_tiles = 0;                 // the grid's tile rows (CTAs past *num_tiles exit)
  // moe_permute_gemm's tile_first and its group count (E, + 1 with the shared slot): the CTAs
  // run group by group, a group's tiles of one column together (they share that slice of the
  // weights in L2); null: column-fastest over the tile list. The same bits either way.
  const int32_t* tile_first = nullptr;
  int groups = 0;
  int64_t N = 0, K = 0;                  // N % 16 == 0, K % 128 == 0
  float* y = nullptr;                    // [permuted rows, N] f32
  cudaStream_t stream = nullptr;
  // Block kb + 1's MMAs issued before block kb's partial sums are promoted (two partial
  // accumulators, the ring 2 blocks ahead instead of 3): the same sums in the same order, so
  // the same bits (CudaMoe.GroupedGemmVariantsAreBitIdentical); on by default in the runner
  // (CudaRunnerOptions::moe_gemm_overlap) since the ninth session.
  bool overlap = false;
  // Tiles of kMoeGemmTallTileRows rows (moe_permute_gemm with that tile_rows): a CTA of 128 A
  // rows, each warpgroup 64 of them against the whole B tile in two m64n128 halves, so each
  // 128-wide K block moves 48 KB for the MMAs the 64-row CTA does with 80 KB (twice 8 + 32):
  // half the L2 traffic per FLOP (the 64-row kernel's suspected bound), more rows wasted on
  // experts with few. The same sums in the same order: the same bits. No overlap variant
  // (its second partial accumulator would need 256 registers a thread). Tenth session, written
  // without a device.
  bool tall = false;
  // The tall tiles (moe_permute_gemm with kMoeGemmTallTileRows) and the tall kernel's sums in
  // its order (the same bits), warp-specialized and persistent: a producer warpgroup moves the
  // stages (mbarriers, no block-wide barrier) with each block's scales and each item's rows
  // beside them, so each consumer warpgroup's promotion runs under the other's MMAs and reads
  // nothing from global memory, and one CTA a multiprocessor takes work items from
  // work_counter, loading the next tile while the last one's outputs are stored. Takes the
  // place of tall and overlap when set; the runner's default (CudaRunnerOptions::
  // moe_gemm_specialized) since the sixteenth session.
  bool specialized = false;
  // gate_up, N % 128 == 0, not tall: the hidden rows quantized in the epilogue as
  // fp8_act_quant (group 128, row-major scales) quantizes y -- the same bytes and scales -- and
  // written here instead of y: e4m3 [rows, N] and f32 [rows][N / 128]. Saves y's f32 round trip
  // through memory and the quantization launch (fifteenth session).
  void* y_q = nullptr;
  float* y_q_scale = nullptr;
  // specialized: the weights' tensor maps, [groups] of kMoeTensorMapBytes each in device memory
  // (moe_weight_tensor_maps over w and w_up): the producer moves B in four 64-row boxes by TMA,
  // one thread issuing them, instead of 128 threads' cp.async (A stays cp.async: its rows are
  // gathered). Null: cp.async. The same bytes in shared memory, so the same bits.
  const void* w_tmap = nullptr;
  const void* w_up_tmap = nullptr;
  // Tokens as the MMA's N (moe_gemm.cu's grouped_gemm_swap_kernel): tiles of up to
  // kMoeGemmSwapTileRows rows (moe_permute_gemm with that tile_rows) computed in steps of 16
  // rows instead of wgmma's 64, each CTA 128 weight rows (gate_up: W1 and W3 interleaved by 8,
  // 64 output columns; else 128), warp-specialized and persistent as `specialized`. Needs
  // w_tmap (gate_up: boxes of 8 rows, and w_up_tmap; down: 64) and work_counter; no y_q. Takes
  // the place of every other variant when set. The same sums per K block, and the same bits
  // (CudaMoe.GroupedGemmVariantsAreBitIdentical).
  bool swap = false;
  // specialized: one int32 of device memory, the CTAs' shared work counter (zeroed by the call,
  // on the stream, before the kernel).
  int32_t* work_counter = nullptr;
};
Status moe_grouped_gemm(const MoeGroupedGemmParams& p);

// One CUtensorMap per matrix w[i] (e4m3 [N, K] row-major, 16-byte aligned, host array of device
// pointers) for MoeGroupedGemmParams::w_tmap: boxes of 128 bytes of K x box_rows rows in the
// 128-byte swizzle, rows past N read as zeros. Written to out (host memory, n x
// kMoeTensorMapBytes). Fails where the driver has no cuTensorMapEncodeTiled.
constexpr int kMoeTensorMapBytes = 128;
Status moe_weight_tensor_maps(const void* const* w, int n, int64_t N, int64_t K, void* out, int box_rows = 64);

// FP4 experts: weights as DeviceLinear holds them (linear.h): packed e2m1 [N, K/2] (element
// 2j in the low nibble of byte j) and the scale bytes -- NVFP4 e4m3 [N][K/16] then the f32
// global scale at gemv.h's fp4_global_offset(N, K); MXFP4 e8m0 [N][K/32].
struct MoeGroupedGemmFp4Params {
  bool gate_up = false;                  // y_bf16 = bf16(silu(A W^T) * (A W_up^T)), else y = A W^T
  bool nvfp4 = true;                     // else MXFP4
  const void* a = nullptr;               // bf16 rows of K, 16-byte aligned
  const int32_t* a_rows = nullptr;       // permuted row i reads a[a_rows[i]]; null: a[i]
  const void* const* w = nullptr;        // [groups] packed e2m1 [N, K/2]
  const float* const* w_scale = nullptr; // [groups] the scale bytes (MoeExpertTables' s1 / s2 / s3)
  const void* const* w_up = nullptr;     // gate_up
  const float* const* w_up_scale = nullptr;
  const MoeTile* tiles = nullptr;        // from moe_permute_gemm
  const int32_t* num_tiles = nullptr;
  int64_t max_tiles = 0;
  int64_t N = 0, K = 0;                  // N % 16 == 0, K % 64 == 0
  float* y = nullptr;                    // !gate_up: [permuted rows, N] f32
  void* y_bf16 = nullptr;                // gate_up: [permuted rows, N] bf16
  cudaStream_t stream = nullptr;
  int stages = 0;                        // cp.async ring depth: 0 = the default (3); 4 or 6 (bench)
};
Status moe_grouped_gemm_fp4(const MoeGroupedGemmFp4Params& p);
// CTAs of moe_grouped_gemm_fp4's kernel resident per SM at a ring depth (0: the default,
// designed for 2; the bench prints it).
int moe_grouped_gemm_fp4_ctas_per_sm(int stages = 0);

}  // namespace ml4::cuda
