// GEMMs of the CUDA backend through cuBLASLt: y[M, N] = x[M, K] W[N, K]^T.
//
// Row-major operands map onto cuBLASLt's column-major ones without copies (FIELD-NOTES.md
// "The GPU machine, as probed"): W row-major [N, K] is cuBLASLt's A, column-major [K, N]
// with op T; x row-major [M, K] is B, column-major [K, M] with op N; y row-major [M, N]
// is D, column-major [N, M]. This "TN" form is also the only one Hopper's FP8 path takes.
//
// FP8 (DeepSeek-V3 block format, MODEL.md 4), fp8_block(): W e4m3 with one f32 scale per
// 128x128 block, x e4m3 with one f32 scale per 1x128 group of a row. Two backends:
//  - cuBLASLt 13 (A_SCALE_MODE VEC128_32F / B_SCALE_MODE BLK128x128_32F). On the H200 the
//    heuristic refuses W-as-A for every shape (2026-12-02 runs), so x is A and W is B --
//    the orientation of NVIDIA's CUDALibrarySamples LtBlk128x128Fp8Matmul -- and D is asked
//    for row-major (CUBLASLT_ORDER_ROW), i.e. y itself (the H200 took it for every shape of
//    the tests and of ml4-slice-4, 2026-12-06); a shape refused that way gets D = y^T, which
//    transpose_out (fp8_gemm.h) turns into y (set_fp8_row_out below). cuBLASLt reads the scales in
//    TransformerEngine's "GEMM-ready" layout (TE docs, FP8 blockwise scaling, "swizzle";
//    TE tests' get_scales): VEC128 [ceil(K/128)][roundup(M, 4)] and BLK128x128
//    [ceil(N/128)][roundup(ceil(K/128), 4)], and takes M % 4 == 0 only. So the path runs
//    when w_scale_ld == roundup(ceil(K/128), 4) and x holds m_pad = roundup(M, 4) rows
//    (rows >= M zero, act_quant's rows_out), m_pad also being x_scale's leading dimension.
//    A bf16 D also needs m_pad % 8 == 0 (its leading dimension in bytes a multiple of 16:
//    the heuristic refused bf16 out for m_pad = 4, 12, 36, 300 and took 8, 16, 64, 1024).
//  - our mma.sync kernel (fp8_gemm.h) for every other shape and where it is faster. The
//    H200 run of 2026-12-02 (docs/BENCHMARKS.md, ML4 shapes, f32 out): ours is faster or
//    within ~10% at M = 1..8 on every shape (wq_a 15.8 vs 28.1 us at M=1; M = 16 runs the
//    same 16-row tile) and at M <= 64 on the narrow ones (N 1536, 576); cuBLASLt is 2x
//    faster at M = 32-64 for N >= 5632 and 3.4-4.2x at M = 4096 (785-1003 vs 229-238
//    TFLOP/s). kAuto follows that: cuBLASLt when M > 16 and (N >= 4096 or M >= 128).
//
// Plans (descriptors, layouts and the heuristic's algorithm) are cached per shape, so a
// call after the first costs a few attribute sets and one cublasLtMatmul, and can be
// captured into a CUDA graph.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
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
  const void* x = nullptr;         // [m_pad, K] e4m3 row-major
  const float* x_scale = nullptr;  // [K/128][m_pad] f32 (M fastest)
  const void* w = nullptr;         // [N, K] e4m3 row-major
  const float* w_scale = nullptr;  // [ceil(N/128)][w_scale_ld] f32
  void* y = nullptr;               // [M, N] y_dtype (kBF16 or kF32) row-major
  DType y_dtype = DType::kBF16;
  int64_t M = 0, N = 0, K = 0;
  cudaStream_t stream = nullptr;
  // Rows x holds (rows >= M zero) and x_scale's leading dimension: 0 = M, or roundup(M, 4)
  // (what cuBLASLt needs when M % 4 != 0).
  int64_t m_pad = 0;
  int64_t w_scale_ld = 0;  // 0 = K/128; cuBLASLt needs roundup(K/128, 4)
};

// Strided-batched GEMMs in cuBLASLt's own column-major terms (the MLA absorption of
// prefill-sized steps, MODEL.md 3.6: one batch entry per head). For b < batch, with
// X_b = X + b * stride_x (strides in elements):
//   D_b[i, j] = sum_l op(A_b)[i, l] B_b[l, j]        (i < m, j < n, l < k)
// A is m x k column-major (lda >= m), or with trans_a stored k x m (lda >= k) and read
// transposed; B is k x n (ldb >= k), D m x n (ldd >= m). Batches may interleave (a stride
// below ld * cols): the heads of one token's row. A and B are ab_dtype (kF32 or kBF16), D
// d_dtype (kF32 or kBF16); sums in f32. f32 operands with tf32: CUBLAS_COMPUTE_32F_FAST_TF32
// (inputs rounded to 10-bit mantissas on the tensor cores), else full f32; bf16 operands run
// on the bf16 tensor cores, a bf16 D rounded from the f32 sums (RNE).
struct GemmBatchedParams {
  const void* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  void* d = nullptr;
  int64_t ldd = 0, stride_d = 0;
  int64_t m = 0, n = 0, k = 0;
  int batch = 1;
  DType ab_dtype = DType::kF32;
  DType d_dtype = DType::kF32;
  bool tf32 = false;
  cudaStream_t stream = nullptr;
};

enum class Fp8Backend { kAuto, kCublasLt, kOwn };

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
  Status batched(const GemmBatchedParams& p);
  // kAuto (default): cuBLASLt where it applies and is the faster one (top of this file),
  // else our kernel. Tests and benchmarks force one (a forced cuBLASLt call that cannot
  // run is kUnimplemented).
  void set_fp8_backend(Fp8Backend b) { fp8_backend_ = b; }
  // cuBLASLt's FP8 GEMMs asked for a row-major D (CUBLASLT_ORDER_ROW: y written directly) before
  // the column-major y^T that transpose_out turns into y (top of this file); a refused shape
  // takes the transpose. On by default since the H200 run of the seventeenth session (every GPU
  // test passed with it; ml4-slice-4 prefill of 4096 / 8192 tokens 2.1 / 4.8 ms faster);
  // ML4_LT_ROW_OUT=0 at create turns it off (the step bench's "lt_row_out=off" line).
  void set_fp8_row_out(bool on) { fp8_row_out_ = on; }
  bool fp8_row_out() const { return fp8_row_out_; }
  // Whether the last fp8_block call on cuBLASLt wrote y row-major (no transpose).
  bool last_fp8_row_out() const { return last_row_out_; }
  // kAuto's choice for a shape cuBLASLt can take.
  static bool fp8_prefer_lt(int64_t M, int64_t N) { return M > 16 && (N >= 4096 || M >= 128); }
  // Whether the last fp8_block call ran cuBLASLt (tests and benchmarks report it).
  bool last_fp8_used_lt() const { return last_used_lt_; }
  // Whether cuBLASLt can take this call's shape and layouts (without asking its heuristic).
  static bool fp8_lt_eligible(const GemmFp8BlockParams& p);

 private:
  LtGemm() = default;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool swapped = false;  // FP8: x as A, W as B, D = y^T in tbuf_ (see the top of this file)
    bool row_d = false;    // FP8 kind 3: D row-major, i.e. y (LtGemm::set_fp8_row_out)
  };
  // (kind 0 = bf16 / 1 = fp8 block / 2 = f32 / 3 = fp8 block, row-major D first, out dtype, M, N, K)
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t>;
  Result<Plan*> plan(int kind, DType y_dtype, int64_t M, int64_t N, int64_t K, const float* x_scale = nullptr,
                     const float* w_scale = nullptr);

  // The heuristic's first algorithm for p's descriptors, or kUnimplemented naming `what`.
  Status pick_algo(Plan& p, const std::string& what);
  static void destroy(Plan& p);
  using BatchedKey = std::array<int64_t, 14>;

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan> plans_;
  std::map<Key, Status> failed_;
  std::map<BatchedKey, Plan> batched_plans_;
  std::map<BatchedKey, Status> batched_failed_;
  void* tbuf_ = nullptr;  // y^T of swapped FP8 plans, sized at plan time
  size_t tbuf_bytes_ = 0;
  void* own_ws_ = nullptr;  // split-K partials of our FP8 kernel
  size_t own_ws_bytes_ = 0;
  Fp8Backend fp8_backend_ = Fp8Backend::kAuto;
  bool fp8_row_out_ = true;
  bool last_used_lt_ = false;
  bool last_row_out_ = false;
};

}  // namespace ml4::cuda
