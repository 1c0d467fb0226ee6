// Internals shared by the MLA attention kernels (attention.cu: f32 CUDA-core kernel and the
// split combine; attention_tc.cu: bf16 tensor-core kernel; attention_decode.cu: sparse
// fp8_ds_mla decode kernel). Not part of the API.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kv/kv_cache_dtype.h"

namespace ml4::cuda::detail {

// Kernel arguments, resolved from MlaAttentionParams by mla_attention().
struct Args {
  const float* q_lat;
  const float* q_rope;
  int64_t q_rope_stride;  // floats between (t, h) rows
  const float* head_scale;
  int T, H, r, dr;
  const uint8_t* cache;
  int64_t num_slots;
  int dtype;
  float fp8_scale;
  int row_bytes;
  const int32_t* indices;
  int64_t indices_stride;
  int topk;
  const int32_t* index_lengths;
  const int32_t* block_table;
  int64_t bt_stride;
  const int32_t* seq_of_token;
  const int32_t* lengths;
  int chunk;        // keys per split (multiple of 64: whole tiles of either kernel)
  int splits;
  float* out;       // final out (splits == 1) or partial [splits][T][H][r]
  float* lse;       // final lse or partial [splits][T][H]
  int lat_bf16;     // q_lat and out hold bf16 [T][H][r] (the prefill kernel only; splits == 1)
};

// Cache slot of key j of token t, or -1.
__device__ __forceinline__ int64_t key_slot(const Args& a, int64_t t, int j, int seq) {
  int64_t s;
  if (a.indices) {
    s = a.indices[t * a.indices_stride + j];
  } else {
    const int64_t b = a.block_table[seq * a.bt_stride + j / kPageTokens];
    s = b < 0 ? -1 : b * kPageTokens + j % kPageTokens;
  }
  return (s >= 0 && s < a.num_slots) ? s : -1;
}

// bf16 tensor-core kernel (attention_tc.cu): dynamic shared memory it needs, and its launch.
size_t mla_tc_smem_bytes(int r, int dr, int row_bytes);
cudaError_t launch_mla_tc(const Args& a, dim3 grid, size_t smem, cudaStream_t stream);

// Sparse fp8_ds_mla decode kernel (attention_decode.cu): whether it handles this shape, and its
// launch (grid.x = T, grid.y = splits; it picks the head blocks, ring depth and shared memory).
bool mla_decode_supported(int H, int r, int dr, int row_bytes);
cudaError_t launch_mla_decode(const Args& a, dim3 grid, cudaStream_t stream);

// Sparse fp8_ds_mla prefill kernel (attention_prefill.cu, wgmma): whether it handles the row
// format, its shared memory, the workspace for its bf16 row scratch (pages of the cache that the
// indices may touch, at most scratch_pages; 0 = every page), and its launch (one split; grid
// (T, 1, ceil(H / 64)) chosen inside).
bool mla_prefill_supported(int r, int dr, int row_bytes);
size_t mla_prefill_smem_bytes();
size_t mla_prefill_workspace_bytes(int64_t num_slots, int64_t T, int topk, int64_t scratch_pages);
cudaError_t launch_mla_prefill(const Args& a, void* workspace, int64_t scratch_pages, bool pairs, cudaStream_t stream);

}  // namespace ml4::cuda::detail
