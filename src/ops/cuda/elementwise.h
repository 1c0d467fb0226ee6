// Fused elementwise kernels of the CUDA backend, each the GPU twin of a CPU op:
//   rms_norm     : [residual += x;] y = x / sqrt(mean(x^2) + eps) * w   (cpu::rms_norm,
//                  cpu::add_rms_norm; nano-vllm's fused (hidden, residual) pairs)
//   silu_mul     : out = silu(g) * u                                    (cpu::silu_mul)
//   embedding    : out[t] = table[ids[t]]                               (cpu::embedding_lookup)
//   q_path       : MLA query path: interleaved RoPE on the rope part of each head at the
//                  LeRoPE-mapped position (YaRN inv_freq and attention factor from the
//                  host, cpu::rope_inv_freq / rope_attention_factor), then the per-head
//                  softmax temperature: softmax_scale * llama_4_scaling(p) * (SSMax:
//                  s_h * ln(n_keys)), either returned per head or folded into q
//                  (cpu_attention.cpp steps 2 and 6; MODEL.md 3.2, 3.4)
//   cast_f32_bf16: GEMM inputs.
// Sums of squares are f64 tree reductions like the CPU's f64 sums: an f32 sum's ~1e-6 error
// in a row's scale moved many values of the bf16 / e4m3 latent cache across a rounding
// boundary (5x the CPU's error against the f64 goldens, measured 2026-12-02).
// Angles are formed and their cos/sin evaluated in f64 as on the CPU, so RoPE matches to
// f32 rounding. Shapes are in each params struct; everything is row-major.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/status.h"
#include "model/model_config.h"

namespace ml4::cuda {

class LtGemm;

struct RmsNormParams {
  const float* x = nullptr;   // [rows, dim]
  float* residual = nullptr;  // [rows, dim] or null; when set: residual += x, normalize residual
  const float* w = nullptr;   // [dim]
  int64_t rows = 0, dim = 0;
  float eps = 1e-6f;
  float* y = nullptr;         // [rows, dim] f32 or null (may alias x, not residual)
  void* y_bf16 = nullptr;     // [rows, dim] bf16 or null (GEMM input)
  cudaStream_t stream = nullptr;
  int64_t x_stride = 0;       // elements between rows of x (0: dim); residual and y are dense
};
Status rms_norm(const RmsNormParams& p);

struct SiluMulParams {
  const float* g = nullptr;  // [rows] x cols, rows g_stride apart
  const float* u = nullptr;  // [rows] x cols, rows u_stride apart
  int64_t rows = 0, cols = 0, g_stride = 0, u_stride = 0;  // strides 0: cols
  float* out = nullptr;      // [rows, cols] f32 or null
  void* out_bf16 = nullptr;  // [rows, cols] bf16 or null
  cudaStream_t stream = nullptr;
};
Status silu_mul(const SiluMulParams& p);

struct EmbeddingParams {
  const void* table = nullptr;  // [V, D] table_dtype (kBF16 or kF32)
  DType table_dtype = DType::kBF16;
  int64_t V = 0, D = 0;
  const int32_t* ids = nullptr;  // [T]; an id outside [0, V) gives a NaN row (the engine
                                 // validates ids; never read out of bounds)
  int64_t T = 0;
  float* out = nullptr;          // [T, D]
  cudaStream_t stream = nullptr;
  // Vocabulary-parallel (tensor parallelism): the table holds ids [first_id, first_id + V) and
  // the other ids give zero rows (the ranks' rows are then summed).
  bool shard = false;
  int64_t first_id = 0;
};
Status embedding(const EmbeddingParams& p);

struct QPathParams {
  float* q = nullptr;               // [T, H, head_stride]; rope part at [rope_offset, rope_offset + rope_dim)
  int64_t T = 0;
  int H = 0, head_stride = 0, rope_offset = 0, rope_dim = 0;
  const int64_t* positions = nullptr;  // [T]
  const float* inv_freq = nullptr;     // [rope_dim / 2] (cpu::rope_inv_freq, YaRN-blended)
  float attn_factor = 1.0f;            // cpu::rope_attention_factor
  bool apply_rope = true;              // LayerSpec::rope (NoPE layers skip it)
  bool neox = false;                   // pairs (i, i + rope_dim/2) (cpu::rope_neox: the DSA
                                       // indexer) instead of (2i, 2i + 1) (cpu::rope_interleaved)
  LeRopeConfig lerope;
  // Temperature. base_scale 0 disables it (a key-side call: RoPE only).
  double base_scale = 0.0;             // ModelConfig::softmax_scale()
  Llama4Scaling llama4;
  const float* ssmax_s = nullptr;      // [H] or null (no SSMax)
  const int32_t* n_keys = nullptr;     // [T] keys each token attends (SSMax's n); null: p + 1
  float* head_scale = nullptr;         // [T, H] out, or null
  bool fold_scale = false;             // multiply the whole head row of q by its scale
  cudaStream_t stream = nullptr;
};
Status q_path(const QPathParams& p);

// y = (x - mean) / sqrt(var + eps) * w + b per row (cpu::layer_norm: two-pass mean and
// variance; the CPU sums in f64, here f32 tree sums: ~1e-7 relative). The DSA indexer's
// key norm.
struct LayerNormParams {
  const float* x = nullptr;  // [rows, dim]
  const float* w = nullptr;  // [dim]
  const float* b = nullptr;  // [dim] or null
  int64_t rows = 0, dim = 0;
  float eps = 1e-6f;
  float* y = nullptr;        // [rows, dim] (may alias x)
  cudaStream_t stream = nullptr;
};
Status layer_norm(const LayerNormParams& p);

// x[i] *= s, n values (f32 multiply, as the CPU's `v *= s`).
Status scale_inplace(float* x, int64_t n, float s, cudaStream_t stream);

// MLA weight absorption (MODEL.md 3.6), f32:
//   q_lat[t, h, j] = sum_d q[t, h, q_offset + d] * w_uk[h][d][j]   (d < dn, j < r)
//   o[t, h, d]     = sum_j w_uv[h][d][j] * lat[t, h, j]            (d < dv)
struct MlaAbsorbParams {
  int64_t T = 0;
  int H = 0, dn = 0, dv = 0, r = 0;
  const float* q = nullptr;      // [T, H, q_stride]
  int q_stride = 0, q_offset = 0;
  const float* w_uk = nullptr;   // [H, dn, r]
  float* q_lat = nullptr;        // [T, H, r]
  const float* lat = nullptr;    // [T, H, r]
  const float* w_uv = nullptr;   // [H, dv, r]
  float* o = nullptr;            // [T, H, dv]
  // The bf16 form of the GEMMs below (issue 18): q_lat and lat hold bf16 [T, H, r] at the same
  // addresses, the weights come as bf16 copies, and q's nope part is first cast to bf16
  // [T, H, dn] at q16 (scratch of T * H * dn * 2 bytes).
  bool lat_bf16 = false;
  const void* w_uk16 = nullptr;  // [H, dn, r] bf16
  const void* w_uv16 = nullptr;  // [H, dv, r] bf16
  void* q16 = nullptr;
  cudaStream_t stream = nullptr;
};
Status mla_absorb_q(const MlaAbsorbParams& p);
Status mla_apply_uv(const MlaAbsorbParams& p);
// The same two products as strided-batched GEMMs on the tensor cores, one batch entry per head
// (LtGemm::batched, TF32: inputs rounded to 10-bit mantissas, f32 sums; ~3e-4 relative
// against the kernels above), for prefill-sized steps outside exact mode (issue 18). With
// lat_bf16 the operands are bf16 (q's nope part and the weights rounded to bf16, f32 sums) and
// q_lat comes out bf16, lat goes in bf16, o stays f32: half the latent bytes through HBM, for
// the sparse MLA prefill kernel's bf16 q and out (MlaAttentionParams::lat_bf16). A shape
// cuBLASLt refuses comes back as kUnimplemented; the caller then runs the kernels above (f32
// form only: the kernels take no bf16).
Status mla_absorb_q_gemm(LtGemm& lt, const MlaAbsorbParams& p);
Status mla_apply_uv_gemm(LtGemm& lt, const MlaAbsorbParams& p);

// out[i] = bf16(x[i]) (RNE), n values.
Status cast_f32_bf16(const float* x, int64_t n, void* out, cudaStream_t stream);
// out[c][r] = in[r][c] for elements of elem_bytes (2 or 4): in [rows, cols] -> out [cols, rows].
Status transpose_2d(const void* in, int elem_bytes, int64_t rows, int64_t cols, void* out, cudaStream_t stream);
// out[i] = f32(x[i]), n values.
Status cast_bf16_f32(const void* x, int64_t n, float* out, cudaStream_t stream);

}  // namespace ml4::cuda
