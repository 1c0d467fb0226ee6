// GEMMs of the CUDA backend through cuBLASLt: y[M, N] = x[M, K] W[N, K]^T.
//
// Row-major operands map onto cuBLASLt's column-major ones without copies (FIELD-NOTES.md
// "The GPU machine, as probed"): W row-major [N, K] is cuBLASLt's A, column-major [K, N]
// with op T; x row-major [M, K] is B, column-major [K, M] with op N; y row-major [M, N]
// is D, column-major [N, M]. This "TN" form is also the only one Hopper's FP8 path takes.
//
// FP8 (DeepSeek-V3 block format, MODEL.md 4): W e4m3 with one f32 scale per 128x128 block,
// [ceil(N/128)][ceil(K/128)] row-major (`weight_scale_inv` as stored) -> A_SCALE_MODE
// BLK128x128_32F; x e4m3 with one f32 scale per 128 values of a row, laid out
// [ceil(K/128)][M] (M fastest) -> B_SCALE_MODE VEC128_32F. act_quant.h writes that layout.
//
// Plans (descriptors, layouts and the heuristic's algorithm) are cached per shape, so a
// call after the first costs a few attribute sets and one cublasLtMatmul, and can be
// captured into a CUDA graph.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/status.h"

namespace ml4::cuda {

struct GemmBf16Params {
  const void* x = nullptr;  // [M, K] bf16 row-major
  const void* w = nullptr;  // [N, K] bf16 row-major
  void* y = nullptr;        // [M, N] y_dtype (kBF16 or kF32) row-major
  DType y_dtype = DType::kBF16;
  int64_t M = 0, N = 0, K = 0;
  cudaStream_t stream = nullptr;
};

struct GemmFp8BlockParams {
  const void* x = nullptr;         // [M, K] e4m3 row-major
  const float* x_scale = nullptr;  // [ceil(K/128)][M] f32 (VEC128, M fastest)
  const void* w = nullptr;         // [N, K] e4m3 row-major
  const float* w_scale = nullptr;  // [ceil(N/128)][ceil(K/128)] f32 (BLK128x128)
  void* y = nullptr;               // [M, N] y_dtype (kBF16 or kF32) row-major
  DType y_dtype = DType::kBF16;
  int64_t M = 0, N = 0, K = 0;
  cudaStream_t stream = nullptr;
};

struct GemmF32Params {
  const float* x = nullptr;  // [M, K] f32 row-major
  const float* w = nullptr;  // [N, K] f32 row-major
  float* y = nullptr;        // [M, N] f32 row-major
  int64_t M = 0, N = 0, K = 0;
  cudaStream_t stream = nullptr;
};

class LtGemm {
 public:
  // One cuBLASLt handle and a device workspace (cuBLASLt's recommendation for Hopper is
  // 32 MiB).
  static Result<std::unique_ptr<LtGemm>> create(size_t workspace_bytes = size_t{32} << 20);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  Status bf16(const GemmBf16Params& p);
  Status fp8_block(const GemmFp8BlockParams& p);
  // Full f32 (CUBLAS_COMPUTE_32F, no TF32): the MoE router (MODEL.md 3.7).
  Status f32(const GemmF32Params& p);
  // Whether the last fp8_block call ran the swapped orientation (tests report it).
  bool last_fp8_swapped() const { return last_swapped_; }

 private:
  LtGemm() = default;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool swapped = false;  // FP8: x as A, W as B, D = y^T in tbuf_ (see gemm.cpp)
  };
  // (kind 0 = bf16 / 1 = fp8 block / 2 = f32, out dtype, M, N, K)
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t>;
  Result<Plan*> plan(int kind, DType y_dtype, int64_t M, int64_t N, int64_t K, const float* a_scale = nullptr,
                     const float* b_scale = nullptr);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan> plans_;
  std::map<Key, Status> failed_;
  void* tbuf_ = nullptr;  // y^T of swapped FP8 plans, sized at plan time
  size_t tbuf_bytes_ = 0;
  bool last_swapped_ = false;
};

}  // namespace ml4::cuda
