// The bf16 tensor-core MLA kernel (MlaMath::kBf16TensorCore in attention.h), after FlashMLA's
// sparse decode: q and the dequantized keys are bf16 in shared memory, QK^T and PV run on
// mma.sync m16n8k16 (bf16 in, f32 accumulate), the online softmax stays in f32. Numerics: q,
// keys and P are rounded to bf16 (8-bit mantissa), so the output is ~1e-3 relative off the f32
// reference (FlashMLA rounds the same way).
//
// Block: 512 threads = 16 warps, up to 64 heads, tiles of 64 keys. Warp w: head tile m = w % 4
// (16 heads), quarter qtr = w / 4. QK^T: the warp computes S for its 16 heads x keys
// [16 qtr, 16 qtr + 16) over K = r + dr; the row max and row sum of the 64-key tile are
// combined across the 4 quarters through shared memory (fixed order: deterministic), P goes to
// shared memory as bf16. PV: the warp accumulates O for its 16 heads x columns
// [qtr r/4, (qtr+1) r/4) over the 64 keys (V = the first r columns of the key rows, read with
// ldmatrix.trans), r/32 n-tiles of 8: 64 f32 registers for r = 512.
// Pipeline: raw cache rows of the next tile are fetched with cp.async into a staging buffer
// while the current tile's math runs; dequantization (e4m3 x tile scale -> bf16, bf16 rope
// copied) goes staging -> key buffer. Cache dtypes: fp8_ds_mla and fp8 (bf16 caches use the
// f32 kernel: their rows would need a second 74 KB staging buffer).
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (A row-major, B column-major,
// row = lane / 4 (+8), column pair = 2 (lane % 4) (+8)).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kv/latent_layout.h"
#include "ops/cuda/attention_internal.h"
#include "ops/cuda/pdl.cuh"

namespace ml4::cuda::detail {
namespace {

constexpr int kThreads = 512;
constexpr int kKeys = 64;     // keys per tile
constexpr int kHeads = 64;    // heads per block
constexpr int kPad = 8;       // bf16 padding per row: row strides = 4 words mod 32 banks
constexpr int kMaxNt = 16;    // n-tiles of 8 output columns per warp (r / 32, r <= 512)

__device__ __forceinline__ float e4m3_f32(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return static_cast<float>(v);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits)
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

__global__ void __launch_bounds__(kThreads, 1) mla_tc_kernel(const Args a) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ __align__(16) uint8_t smem[];
  const int t = blockIdx.x, split = blockIdx.y;
  const int h0 = blockIdx.z * kHeads;
  const int HB = min(kHeads, a.H - h0);
  const int D = a.r + a.dr, DP = D + kPad;  // bf16 elements per smem row
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);           // [64][DP]
  __nv_bfloat16* ks = qs + kHeads * DP;                                  // [64][DP]
  __nv_bfloat16* ps = ks + kKeys * DP;                                   // [64][kKeys + kPad]
  float* redmax = reinterpret_cast<float*>(ps + kHeads * (kKeys + kPad));  // [4][64]
  float* redsum = redmax + 4 * kHeads;                                     // [4][64]
  float* hs = redsum + 4 * kHeads;                                         // [64]
  uint8_t* raw = reinterpret_cast<uint8_t*>(hs + kHeads);                  // [64][row_bytes], 16-aligned
  __shared__ bool valid[2][kKeys];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int mt = warp & 3, qtr = warp >> 2;

  int n, seq = 0;
  if (a.indices) {
    n = a.index_lengths ? min(max(a.index_lengths[t], 0), a.topk) : a.topk;
  } else {
    n = max(a.lengths[t], 0);
    seq = a.seq_of_token[t];
  }
  const int j0 = split * a.chunk;
  const int j1 = min(n, j0 + a.chunk);

  // q -> bf16 (rows >= HB are zero), head scales.
  for (int i = tid; i < kHeads * (D / 2); i += kThreads) {
    const int h = i / (D / 2), v = 2 * (i % (D / 2));
    float x0 = 0.f, x1 = 0.f;
    if (h < HB) {
      const int64_t th = static_cast<int64_t>(t) * a.H + h0 + h;
      const float* src = v < a.r ? a.q_lat + th * a.r + v : a.q_rope + th * a.q_rope_stride + (v - a.r);
      x0 = src[0];
      x1 = src[1];
    }
    *reinterpret_cast<uint32_t*>(qs + h * DP + v) = pack_bf16(x0, x1);
  }
  if (tid < kHeads) hs[tid] = tid < HB ? a.head_scale[static_cast<int64_t>(t) * a.H + h0 + tid] : 0.0f;

  const bool v16 = a.row_bytes % 16 == 0;
  const int chunks = v16 ? a.row_bytes / 16 : a.row_bytes / 4;
  auto issue = [&](int jt, int buf) {
    for (int i = tid; i < kKeys * chunks; i += kThreads) {
      const int key = i / chunks, c = i % chunks;
      if (jt + key >= j1) continue;
      const int64_t s = key_slot(a, t, jt + key, seq);
      if (s < 0) continue;
      const uint8_t* src = a.cache + s * a.row_bytes;
      if (v16) cp_async16(raw + key * a.row_bytes + 16 * c, src + 16 * c);
      else cp_async4(raw + key * a.row_bytes + 4 * c, src + 4 * c);
    }
    if (tid < kKeys) valid[buf][tid] = jt + tid < j1 && key_slot(a, t, jt + tid, seq) >= 0;
    cp_async_commit();
  };

  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};  // rows g, g + 8 of the warp's head tile
  const int NT = a.r / 32;
  const int col0 = qtr * (a.r / 4);
  float acc[kMaxNt][4];
#pragma unroll
  for (int i = 0; i < kMaxNt; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  if (j0 < j1) issue(j0, 0);
  int buf = 0;
  for (int jt = j0; jt < j1; jt += kKeys, buf ^= 1) {
    cp_async_wait_all();
    __syncthreads();  // raw of this tile visible; previous tile's PV done with ks / ps
    // Dequantize: pairs of values -> one bf16x2 word.
    const bool dsmla = a.dtype == static_cast<int>(KvCacheDtype::kFp8DsMla);
    for (int i = tid; i < kKeys * (D / 2); i += kThreads) {
      const int key = i / (D / 2), v = 2 * (i % (D / 2));
      uint32_t w = 0;
      if (valid[buf][key]) {
        const uint8_t* row = raw + key * a.row_bytes;
        if (v < a.r) {
          const float sc = dsmla ? *reinterpret_cast<const float*>(row + a.r + 4 * (v / kDsMlaTile)) : a.fp8_scale;
          w = pack_bf16(e4m3_f32(row[v]) * sc, e4m3_f32(row[v + 1]) * sc);
        } else if (dsmla) {
          w = *reinterpret_cast<const uint32_t*>(row + a.r + 4 * (a.r / kDsMlaTile) + 2 * (v - a.r));
        } else {
          w = pack_bf16(e4m3_f32(row[v]) * a.fp8_scale, e4m3_f32(row[v + 1]) * a.fp8_scale);
        }
      }
      *reinterpret_cast<uint32_t*>(ks + key * DP + v) = w;
    }
    __syncthreads();  // ks ready; raw free
    if (jt + kKeys < j1) issue(jt + kKeys, buf ^ 1);

    // S = Q K^T for heads [16 mt, +16) x keys [16 qtr, +16): two n-tiles of 8 keys.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const __nv_bfloat16* qa = qs + (16 * mt + g) * DP + 2 * tq;
    const __nv_bfloat16* kb0 = ks + (16 * qtr + g) * DP + 2 * tq;
    const __nv_bfloat16* kb1 = kb0 + 8 * DP;
    for (int k0 = 0; k0 < D; k0 += 16) {
      const uint32_t a0 = *reinterpret_cast<const uint32_t*>(qa + k0);
      const uint32_t a1 = *reinterpret_cast<const uint32_t*>(qa + 8 * DP + k0);
      const uint32_t a2 = *reinterpret_cast<const uint32_t*>(qa + k0 + 8);
      const uint32_t a3 = *reinterpret_cast<const uint32_t*>(qa + 8 * DP + k0 + 8);
      mma_bf16(s[0], a0, a1, a2, a3, *reinterpret_cast<const uint32_t*>(kb0 + k0),
               *reinterpret_cast<const uint32_t*>(kb0 + k0 + 8));
      mma_bf16(s[1], a0, a1, a2, a3, *reinterpret_cast<const uint32_t*>(kb1 + k0),
               *reinterpret_cast<const uint32_t*>(kb1 + k0 + 8));
    }
    // Scale, mask, row max over this warp's 16 keys.
    const int row0 = 16 * mt + g, row1 = row0 + 8;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int key = 16 * qtr + 8 * j + 2 * tq;
      const bool v0 = valid[buf][key], v1 = valid[buf][key + 1];
      s[j][0] = v0 ? s[j][0] * hs[row0] : -INFINITY;
      s[j][1] = v1 ? s[j][1] * hs[row0] : -INFINITY;
      s[j][2] = v0 ? s[j][2] * hs[row1] : -INFINITY;
      s[j][3] = v1 ? s[j][3] * hs[row1] : -INFINITY;
      mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
      mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    if (tq == 0) {
      redmax[qtr * kHeads + row0] = mx0;
      redmax[qtr * kHeads + row1] = mx1;
    }
    __syncthreads();
    float mn[2], corr[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = rr ? row1 : row0;
      float tm = redmax[row];
      for (int q = 1; q < 4; ++q) tm = fmaxf(tm, redmax[q * kHeads + row]);
      mn[rr] = fmaxf(m_r[rr], tm);
      corr[rr] = mn[rr] == -INFINITY ? 1.0f : expf(m_r[rr] - mn[rr]);  // m_r = -inf -> 0
    }
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float p0 = mn[0] == -INFINITY ? 0.f : expf(s[j][0] - mn[0]);
      const float p1 = mn[0] == -INFINITY ? 0.f : expf(s[j][1] - mn[0]);
      const float p2 = mn[1] == -INFINITY ? 0.f : expf(s[j][2] - mn[1]);
      const float p3 = mn[1] == -INFINITY ? 0.f : expf(s[j][3] - mn[1]);
      sum0 += p0 + p1;
      sum1 += p2 + p3;
      const int key = 16 * qtr + 8 * j + 2 * tq;
      *reinterpret_cast<uint32_t*>(ps + row0 * (kKeys + kPad) + key) = pack_bf16(p0, p1);
      *reinterpret_cast<uint32_t*>(ps + row1 * (kKeys + kPad) + key) = pack_bf16(p2, p3);
    }
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
    if (tq == 0) {
      redsum[qtr * kHeads + row0] = sum0;
      redsum[qtr * kHeads + row1] = sum1;
    }
    __syncthreads();  // ps and redsum complete
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = rr ? row1 : row0;
      const float ts = ((redsum[row] + redsum[kHeads + row]) + redsum[2 * kHeads + row]) + redsum[3 * kHeads + row];
      l_r[rr] = l_r[rr] * corr[rr] + ts;
      m_r[rr] = mn[rr];
    }
#pragma unroll
    for (int i = 0; i < kMaxNt; ++i) {
      acc[i][0] *= corr[0];
      acc[i][1] *= corr[0];
      acc[i][2] *= corr[1];
      acc[i][3] *= corr[1];
    }
    // O += P V over the 64 keys: 4 k-steps of 16.
    const __nv_bfloat16* pa = ps + (16 * mt + g) * (kKeys + kPad) + 2 * tq;
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t a0 = *reinterpret_cast<const uint32_t*>(pa + 16 * kk);
      const uint32_t a1 = *reinterpret_cast<const uint32_t*>(pa + 8 * (kKeys + kPad) + 16 * kk);
      const uint32_t a2 = *reinterpret_cast<const uint32_t*>(pa + 16 * kk + 8);
      const uint32_t a3 = *reinterpret_cast<const uint32_t*>(pa + 8 * (kKeys + kPad) + 16 * kk + 8);
      const __nv_bfloat16* vrow = ks + (16 * kk + (lane & 15)) * DP + col0 + 8 * (lane >> 4);
#pragma unroll
      for (int nt = 0; nt < kMaxNt; nt += 2) {
        if (nt < NT) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vrow + 8 * nt);
          mma_bf16(acc[nt], a0, a1, a2, a3, b[0], b[1]);
          mma_bf16(acc[nt + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    }
  }

  // Output of this split (normalised) and its lse (natural log).
  const int64_t base = (static_cast<int64_t>(a.splits > 1 ? split : 0) * a.T + t) * a.H + h0;
  const int row0 = 16 * mt + g, row1 = row0 + 8;
  const float inv0 = l_r[0] > 0.f ? 1.0f / l_r[0] : 0.f, inv1 = l_r[1] > 0.f ? 1.0f / l_r[1] : 0.f;
#pragma unroll
  for (int nt = 0; nt < kMaxNt; ++nt) {
    if (nt < NT) {
      const int c = col0 + 8 * nt + 2 * tq;
      if (row0 < HB) *reinterpret_cast<float2*>(a.out + (base + row0) * a.r + c) = make_float2(acc[nt][0] * inv0, acc[nt][1] * inv0);
      if (row1 < HB) *reinterpret_cast<float2*>(a.out + (base + row1) * a.r + c) = make_float2(acc[nt][2] * inv1, acc[nt][3] * inv1);
    }
  }
  if (qtr == 0 && tq == 0) {
    if (row0 < HB) a.lse[base + row0] = l_r[0] > 0.f ? m_r[0] + logf(l_r[0]) : -INFINITY;
    if (row1 < HB) a.lse[base + row1] = l_r[1] > 0.f ? m_r[1] + logf(l_r[1]) : -INFINITY;
  }
}

}  // namespace

size_t mla_tc_smem_bytes(int r, int dr, int row_bytes) {
  const size_t DP = static_cast<size_t>(r + dr + kPad);
  const size_t bf = 2 * (kHeads * DP + kKeys * DP + kHeads * (kKeys + kPad));
  const size_t f = 4 * (4 * kHeads + 4 * kHeads + kHeads);
  return bf + f + static_cast<size_t>(kKeys) * row_bytes;
}

cudaError_t launch_mla_tc(const Args& a, dim3 grid, size_t smem, cudaStream_t stream) {
  cudaError_t e = cudaFuncSetAttribute(mla_tc_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  launch_kernel(mla_tc_kernel, grid, kThreads, smem, stream, a);
  return cudaGetLastError();
}

}  // namespace ml4::cuda::detail
