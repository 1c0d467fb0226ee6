// See gemm.h. Shapes cuBLASLt refuses (no heuristic result) come back as kUnimplemented
// naming the shape, never as a crash; fp8_block then runs our kernel instead (kAuto).
#include "ops/cuda/gemm.h"

#include <cstdlib>

#include "ops/cuda/cuda_common.h"
#include "ops/cuda/fp8_gemm.h"

namespace ml4::cuda {
namespace {

Status lt_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return ok_status();
  return internal_error("cuBLASLt error {} ({}) in {}", static_cast<int>(s), cublasGetStatusString(s), what);
}

#define ML4_LT_RETURN_IF_ERROR(expr) ML4_RETURN_IF_ERROR(lt_status((expr), #expr))

}  // namespace

Result<std::unique_ptr<LtGemm>> LtGemm::create(size_t workspace_bytes) {
  std::unique_ptr<LtGemm> g(new LtGemm());
  ML4_LT_RETURN_IF_ERROR(cublasLtCreate(&g->handle_));
  if (workspace_bytes > 0) {
    ML4_CUDA_RETURN_IF_ERROR(cudaMalloc(&g->workspace_, workspace_bytes));
    g->workspace_bytes_ = workspace_bytes;
  }
  // Our FP8 kernel splits K only for decode-sized M (<= 64 rows: at most ~5 MB for ML4's
  // shapes); a separate buffer so it never races cuBLASLt's workspace.
  g->own_ws_bytes_ = size_t{16} << 20;
  ML4_CUDA_RETURN_IF_ERROR(cudaMalloc(&g->own_ws_, g->own_ws_bytes_));
  if (const char* v = std::getenv("ML4_LT_ROW_OUT"); v && (v[0] == '0' || v[0] == '1')) g->fp8_row_out_ = v[0] == '1';
  return g;
}

LtGemm::~LtGemm() {
  for (auto& [k, p] : plans_) destroy(p);
  for (auto& [k, p] : batched_plans_) destroy(p);
  if (workspace_) cudaFree(workspace_);
  if (tbuf_) cudaFree(tbuf_);
  if (own_ws_) cudaFree(own_ws_);
  if (handle_) cublasLtDestroy(handle_);
}

void LtGemm::destroy(Plan& p) {
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.d) cublasLtMatrixLayoutDestroy(p.d);
  p = Plan{};
}

Status LtGemm::pick_algo(Plan& p, const std::string& what) {
  cublasLtMatmulPreference_t pref = nullptr;
  ML4_LT_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.d, p.d, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0)
    return unimplemented("cuBLASLt has no {} ({})", what, cublasGetStatusString(hs));
  p.algo = res.algo;
  return ok_status();
}

Result<LtGemm::Plan*> LtGemm::plan(int kind, DType y_dtype, int64_t M, int64_t N, int64_t K, const float* x_scale,
                                   const float* w_scale) {
  const Key key{kind, static_cast<int>(y_dtype), M, N, K};
  auto it = plans_.find(key);
  if (it != plans_.end()) return &it->second;
  auto bad = failed_.find(key);  // a refused shape is asked about once
  if (bad != failed_.end()) return bad->second;

  // kind 3: FP8 as kind 1, D asked for row-major (fp8_row_out): y itself, no transpose.
  const bool fp8 = kind == 1 || kind == 3;
  const cudaDataType_t in_t = kind == 0 ? CUDA_R_16BF : fp8 ? CUDA_R_8F_E4M3 : CUDA_R_32F;
  const cudaDataType_t out_t = y_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  // swapped (FP8): A = x with VEC128 scales, B = W with BLK128x128 (the orientation of
  // NVIDIA's CUDALibrarySamples LtBlk128x128Fp8Matmul), D = y^T [N][M] in tbuf_,
  // transposed into y after the GEMM. M here is the padded row count (gemm.h).
  auto attempt = [&](Plan& p, bool swapped, bool row_d) -> Status {
    p.swapped = swapped;
    p.row_d = row_d;
    ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)));
    ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
    if (fp8) {
      // DeepSeek-style block scaling (cuBLASLt 12.9+; sm_90 takes VEC128 x BLK128x128).
      const int32_t w_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const int32_t x_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      const int32_t a_mode = swapped ? x_mode : w_mode, b_mode = swapped ? w_mode : x_mode;
      ML4_LT_RETURN_IF_ERROR(
          cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
      ML4_LT_RETURN_IF_ERROR(
          cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
      // The heuristic may refuse block-scaled descriptors without scale pointers
      // (CUBLAS_STATUS_INVALID_VALUE was seen on the H200 with cuBLASLt 13.1), so the
      // first call's pointers go in before the query; each call sets its own afterwards.
      const float* pa = swapped ? x_scale : w_scale;
      const float* pb = swapped ? w_scale : x_scale;
      ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof(pa)));
      ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof(pb)));
    }
    if (!swapped) {
      ML4_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p.a, in_t, K, N, K));
      ML4_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p.b, in_t, K, M, K));
      ML4_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p.d, out_t, N, M, N));
    } else {
      ML4_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p.a, in_t, K, M, K));
      ML4_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p.b, in_t, K, N, K));
      ML4_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p.d, out_t, M, N, row_d ? N : M));
      if (row_d) {
        const int32_t order = CUBLASLT_ORDER_ROW;
        ML4_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(p.d, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order)));
      }
    }
    return pick_algo(p, fmt::format("{} GEMM for M={} N={} K={} -> {}{}", kind == 0 ? "bf16" : fp8 ? "fp8 block-scaled" : "f32",
                                    M, N, K, dtype_name(y_dtype), row_d ? " (row-major D)" : ""));
  };
  // FP8 runs swapped only: W-as-A was refused for every shape on the H200 (gemm.h); kind 3
  // first asks for a row-major D, then takes the transposed one.
  Plan p;
  Status st = attempt(p, fp8, kind == 3);
  if (!st.ok() && kind == 3) {
    destroy(p);
    p = Plan{};
    st = attempt(p, true, false);
  }
  if (!st.ok()) {
    destroy(p);
    failed_.emplace(key, st);
    return st;
  }
  if (p.swapped) {
    const size_t need = static_cast<size_t>(M) * N * (y_dtype == DType::kF32 ? 4 : 2);
    if (need > tbuf_bytes_) {
      // Plans are made on a shape's first call; earlier GEMMs may still read the old
      // buffer, so wait for them before freeing it.
      ML4_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      if (tbuf_) cudaFree(tbuf_);
      tbuf_ = nullptr;
      tbuf_bytes_ = 0;
      ML4_CUDA_RETURN_IF_ERROR(cudaMalloc(&tbuf_, need));
      tbuf_bytes_ = need;
    }
  }
  auto [ins, ok] = plans_.emplace(key, p);
  return &ins->second;
}

Status LtGemm::bf16(const GemmBf16Params& p) {
  if (p.M <= 0 || p.N <= 0 || p.K <= 0) return invalid_argument("gemm bf16: bad shape M={} N={} K={}", p.M, p.N, p.K);
  if (p.y_dtype != DType::kBF16 && p.y_dtype != DType::kF32)
    return invalid_argument("gemm bf16: output dtype {} (bf16 or f32)", dtype_name(p.y_dtype));
  if (!p.x || !p.w || !p.y) return invalid_argument("gemm bf16: null pointer");
  if (!aligned16(p.x) || !aligned16(p.w) || !aligned16(p.y) || p.K % 8 != 0)
    return invalid_argument("gemm bf16: operands must be 16-byte aligned and K % 8 == 0 (K={})", p.K);
  ML4_ASSIGN_OR_RETURN(Plan * pl, plan(0, p.y_dtype, p.M, p.N, p.K));
  const float alpha = 1.0f, beta = 0.0f;
  return lt_status(cublasLtMatmul(handle_, pl->op, &alpha, p.w, pl->a, p.x, pl->b, &beta, p.y, pl->d, p.y, pl->d,
                                  &pl->algo, workspace_, workspace_bytes_, p.stream),
                   "cublasLtMatmul(bf16)");
}

bool LtGemm::fp8_lt_eligible(const GemmFp8BlockParams& p) {
  const int64_t m4 = (p.M + 3) / 4 * 4, kb4 = (p.K / 128 + 3) / 4 * 4;
  const int64_t m_pad = p.m_pad ? p.m_pad : p.M;
  const int64_t w_ld = p.w_scale_ld ? p.w_scale_ld : p.K / 128;
  const int64_t d_align = p.y_dtype == DType::kF32 ? 4 : 8;  // D's ld: 16 bytes
  return m_pad == m4 && m_pad % d_align == 0 && w_ld == kb4;
}

Status LtGemm::fp8_block(const GemmFp8BlockParams& p) {
  if (p.M <= 0 || p.N <= 0 || p.K <= 0) return invalid_argument("gemm fp8: bad shape M={} N={} K={}", p.M, p.N, p.K);
  if (p.K % 128 != 0 || p.N % 16 != 0)
    return invalid_argument("gemm fp8 block: K={} must be a multiple of 128 and N={} of 16", p.K, p.N);
  if (p.y_dtype != DType::kBF16 && p.y_dtype != DType::kF32)
    return invalid_argument("gemm fp8: output dtype {} (bf16 or f32)", dtype_name(p.y_dtype));
  if (!p.x || !p.w || !p.y || !p.x_scale || !p.w_scale) return invalid_argument("gemm fp8: null pointer");
  if (!aligned16(p.x) || !aligned16(p.w) || !aligned16(p.y) || !aligned16(p.x_scale) || !aligned16(p.w_scale))
    return invalid_argument("gemm fp8: operands and scales must be 16-byte aligned");
  const int64_t m_pad = p.m_pad ? p.m_pad : p.M;
  if (m_pad != p.M && m_pad != (p.M + 3) / 4 * 4)
    return invalid_argument("gemm fp8: m_pad {} is neither M {} nor roundup(M, 4)", m_pad, p.M);
  if (p.w_scale_ld != 0 && p.w_scale_ld < p.K / 128)
    return invalid_argument("gemm fp8: w_scale_ld {} < K/128 {}", p.w_scale_ld, p.K / 128);
  const bool eligible = fp8_lt_eligible(p);
  if (fp8_backend_ == Fp8Backend::kCublasLt && !eligible)
    return unimplemented("gemm fp8: cuBLASLt needs m_pad = roundup(M, 4) (a multiple of 8 for bf16 out) and "
                         "w_scale_ld = roundup(K/128, 4) (M={} m_pad={} K={} w_scale_ld={} out {})",
                         p.M, m_pad, p.K, p.w_scale_ld, dtype_name(p.y_dtype));
  bool use_lt = eligible && (fp8_backend_ == Fp8Backend::kCublasLt ||
                             (fp8_backend_ == Fp8Backend::kAuto && fp8_prefer_lt(p.M, p.N)));
  Plan* pl = nullptr;
  if (use_lt) {
    auto r = plan(fp8_row_out_ ? 3 : 1, p.y_dtype, m_pad, p.N, p.K, p.x_scale, p.w_scale);
    if (!r.ok()) {
      if (fp8_backend_ == Fp8Backend::kCublasLt) return r.status();
      use_lt = false;  // refused shape: our kernel takes it
    } else {
      pl = *r;
    }
  }
  last_used_lt_ = use_lt;
  last_row_out_ = false;
  if (!use_lt) {
    return fp8_block_gemm({p.x, p.x_scale, m_pad, p.w, p.w_scale, p.w_scale_ld, p.y, p.y_dtype, p.M, p.N, p.K, own_ws_,
                           own_ws_bytes_, p.stream});
  }
  const float* pa = p.x_scale;
  const float* pb = p.w_scale;
  ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof(pa)));
  ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof(pb)));
  const float alpha = 1.0f, beta = 0.0f;
  const size_t elem = p.y_dtype == DType::kF32 ? 4 : 2;
  // A row-major D is y (m_pad == M) or y with the pad rows after it (written to tbuf_, the first
  // M rows copied); else D is y^T, transposed into y.
  void* d = pl->row_d && m_pad == p.M ? p.y : tbuf_;
  ML4_LT_RETURN_IF_ERROR(cublasLtMatmul(handle_, pl->op, &alpha, p.x, pl->a, p.w, pl->b, &beta, d, pl->d, d, pl->d,
                                        &pl->algo, workspace_, workspace_bytes_, p.stream));
  last_row_out_ = pl->row_d;
  if (d == p.y) return ok_status();
  if (pl->row_d)
    return cuda_status(cudaMemcpyAsync(p.y, tbuf_, static_cast<size_t>(p.M) * p.N * elem, cudaMemcpyDeviceToDevice, p.stream),
                       "fp8 GEMM pad rows");
  return transpose_out(tbuf_, m_pad, static_cast<int>(elem), p.N, p.M, p.y, p.stream);
}

Status LtGemm::f32(const GemmF32Params& p) {
  if (p.M <= 0 || p.N <= 0 || p.K <= 0) return invalid_argument("gemm f32: bad shape M={} N={} K={}", p.M, p.N, p.K);
  if (!p.x || !p.w || !p.y) return invalid_argument("gemm f32: null pointer");
  if (!aligned16(p.x) || !aligned16(p.w) || !aligned16(p.y) || p.K % 4 != 0)
    return invalid_argument("gemm f32: operands must be 16-byte aligned and K % 4 == 0 (K={})", p.K);
  ML4_ASSIGN_OR_RETURN(Plan * pl, plan(2, DType::kF32, p.M, p.N, p.K));
  const float alpha = 1.0f, beta = 0.0f;
  return lt_status(cublasLtMatmul(handle_, pl->op, &alpha, p.w, pl->a, p.x, pl->b, &beta, p.y, pl->d, p.y, pl->d,
                                  &pl->algo, workspace_, workspace_bytes_, p.stream),
                   "cublasLtMatmul(f32)");
}

Status LtGemm::batched(const GemmBatchedParams& p) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.batch <= 0)
    return invalid_argument("gemm batched: bad shape m={} n={} k={} batch={}", p.m, p.n, p.k, p.batch);
  if (!p.a || !p.b || !p.d) return invalid_argument("gemm batched: null pointer");
  auto lt_type = [](DType t) { return t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; };
  if ((p.ab_dtype != DType::kF32 && p.ab_dtype != DType::kBF16) || (p.d_dtype != DType::kF32 && p.d_dtype != DType::kBF16))
    return invalid_argument("gemm batched: operands {} / {} (f32 or bf16)", dtype_name(p.ab_dtype), dtype_name(p.d_dtype));
  if (p.lda < (p.trans_a ? p.k : p.m) || p.ldb < p.k || p.ldd < p.m || p.stride_a < 0 || p.stride_b < 0 ||
      p.stride_d < 0)
    return invalid_argument("gemm batched: leading dimensions lda={} ldb={} ldd={} below the shape m={} n={} k={}",
                            p.lda, p.ldb, p.ldd, p.m, p.n, p.k);
  const bool tf32 = p.tf32 && p.ab_dtype == DType::kF32;
  const BatchedKey key{p.m,        p.n,   p.k,        p.batch,    p.lda,
                       p.stride_a, p.trans_a, p.ldb,  p.stride_b, p.ldd,
                       p.stride_d, tf32,  static_cast<int64_t>(p.ab_dtype), static_cast<int64_t>(p.d_dtype)};
  Plan* pl = nullptr;
  if (auto it = batched_plans_.find(key); it != batched_plans_.end()) {
    pl = &it->second;
  } else {
    if (auto bad = batched_failed_.find(key); bad != batched_failed_.end()) return bad->second;
    Plan np;
    auto make = [&]() -> Status {
      const cublasComputeType_t ct = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
      ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&np.op, ct, CUDA_R_32F));
      const cublasOperation_t opA = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, opN = CUBLAS_OP_N;
      ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(np.op, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof(opA)));
      ML4_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(np.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
      auto layout = [&](cublasLtMatrixLayout_t* l, DType t, int64_t rows, int64_t cols, int64_t ld,
                        int64_t stride) -> Status {
        ML4_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(l, lt_type(t), rows, cols, ld));
        const int32_t count = p.batch;
        ML4_LT_RETURN_IF_ERROR(
            cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
        ML4_LT_RETURN_IF_ERROR(
            cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
        return ok_status();
      };
      ML4_RETURN_IF_ERROR(
          layout(&np.a, p.ab_dtype, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda, p.stride_a));
      ML4_RETURN_IF_ERROR(layout(&np.b, p.ab_dtype, p.k, p.n, p.ldb, p.stride_b));
      ML4_RETURN_IF_ERROR(layout(&np.d, p.d_dtype, p.m, p.n, p.ldd, p.stride_d));
      return pick_algo(np, fmt::format("{} batched GEMM ({} out) m={} n={} k={} batch={}",
                                       tf32 ? "tf32" : dtype_name(p.ab_dtype), dtype_name(p.d_dtype), p.m, p.n, p.k,
                                       p.batch));
    };
    Status st = make();
    if (!st.ok()) {
      destroy(np);
      batched_failed_.emplace(key, st);
      return st;
    }
    pl = &batched_plans_.emplace(key, np).first->second;
  }
  const float alpha = 1.0f, beta = 0.0f;
  return lt_status(cublasLtMatmul(handle_, pl->op, &alpha, p.a, pl->a, p.b, pl->b, &beta, p.d, pl->d, p.d, pl->d,
                                  &pl->algo, workspace_, workspace_bytes_, p.stream),
                   "cublasLtMatmul(batched)");
}

}  // namespace ml4::cuda
