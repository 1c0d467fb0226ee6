// See cache_write.h. One thread block per token; every value is computed with the same f32
// operations, in the same order where order matters, as the CPU encoders, so the bytes match:
//   fp8_ds_mla tile: amax (order-free), scale = max(amax / 448, FLT_MIN), q = e4m3_satfinite(x / scale)
//     (IEEE division: this file is not built with fast-math);
//   indexer key: Hadamard butterflies h = 1, 2, 4, ... on pairs (j, j + h), then * n^-0.5 (the
//     host's f32 rounding of 1/sqrt(n), as ml4::cpu::hadamard_transform), then
//     scale = max(amax, 1e-4) / 448 (DeepSeek-V3.2 act_quant), q = e4m3_satfinite(x / scale).
#include "ops/cuda/cache_write.h"
#include "ops/cuda/pdl.cuh"

#include <cfloat>
#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kv/indexer_layout.h"
#include "kv/latent_layout.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/fp8_groups.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/cuda/row_regs.cuh"

namespace ml4::cuda {
namespace {

__device__ __forceinline__ float load_val(const void* base, bool bf16, int64_t i) {
  if (bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

__device__ __forceinline__ uint8_t to_e4m3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ void store_bf16(uint8_t* p, float v) {
  const __nv_bfloat16 h = __float2bfloat16_rn(v);
  *reinterpret_cast<__nv_bfloat16*>(p) = h;  // 2-byte aligned: offsets are even, rows even-sized
}

// Block-wide max of non-negative floats (their bit patterns order like unsigned ints).
__device__ __forceinline__ float block_amax(float v, unsigned* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x == 0) *red = 0u;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) atomicMax(red, __float_as_uint(v));
  __syncthreads();
  const float r = __uint_as_float(*red);
  __syncthreads();
  return r;
}

// One token's latent row into its cache slot dst: threads [0, 128) take value i of each
// 128-value tile (every thread of the block calls it: block_amax has barriers); c and kr may be
// global or shared memory.
__device__ __forceinline__ void write_latent_row(const void* c, bool c_bf16, int64_t c0, const void* kr,
                                                 bool kr_bf16, int64_t k0, int r, int dr, int dtype,
                                                 float fp8_scale, uint8_t* dst, unsigned* red) {
  const int tid = threadIdx.x;
  if (dtype == static_cast<int>(KvCacheDtype::kFp8DsMla)) {
    const int tiles = r / kDsMlaTile;
    for (int tile = 0; tile < tiles; ++tile) {
      const float x = tid < kDsMlaTile ? load_val(c, c_bf16, c0 + tile * kDsMlaTile + tid) : 0.0f;
      const float amax = block_amax(fabsf(x), red);
      const float scale = fmaxf(amax / 448.0f, FLT_MIN);
      if (tid < kDsMlaTile) dst[tile * kDsMlaTile + tid] = to_e4m3(x / scale);
      if (tid == 0) *reinterpret_cast<float*>(dst + r + 4 * tile) = scale;  // 4-aligned: r % 128 == 0
    }
    uint8_t* rope = dst + r + 4 * tiles;
    for (int i = tid; i < dr; i += blockDim.x) store_bf16(rope + 2 * i, load_val(kr, kr_bf16, k0 + i));
  } else if (dtype == static_cast<int>(KvCacheDtype::kFp8)) {
    for (int i = tid; i < r; i += blockDim.x) dst[i] = to_e4m3(load_val(c, c_bf16, c0 + i) / fp8_scale);
    for (int i = tid; i < dr; i += blockDim.x) dst[r + i] = to_e4m3(load_val(kr, kr_bf16, k0 + i) / fp8_scale);
  } else {
    for (int i = tid; i < r; i += blockDim.x) store_bf16(dst + 2 * i, load_val(c, c_bf16, c0 + i));
    for (int i = tid; i < dr; i += blockDim.x) store_bf16(dst + 2 * (r + i), load_val(kr, kr_bf16, k0 + i));
  }
}

// grid (T), block 128: thread i handles value i of each 128-value tile.
__global__ void latent_write_kernel(const void* __restrict__ c, bool c_bf16, int64_t c_stride,
                                    const void* __restrict__ kr, bool kr_bf16, int64_t kr_stride,
                                    const int64_t* __restrict__ slots, int r, int dr, int dtype,
                                    float fp8_scale, uint8_t* __restrict__ cache, int64_t num_slots,
                                    int64_t token_bytes) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ unsigned red;
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0 || slot >= num_slots) return;  // whole block leaves together
  write_latent_row(c, c_bf16, t * c_stride, kr, kr_bf16, t * kr_stride, r, dr, dtype, fp8_scale,
                   cache + slot * token_bytes, &red);
}

// grid (T), block kLkThreads (rms_norm_vec_kernel's 256, so that its f64 sum has the same
// partition): the row ckv = [c | kr] of token t. c: RMSNorm as rms_norm_vec_kernel<1> computes
// it (thread i: values 4i..4i+3, block_sum_f64, (v * inv) * w), to p.c and shared memory; kr:
// rotated as q_path_kernel rotates one head's rope part (interleaved or NeoX pairs, rope.cuh),
// back into ckv and shared memory; then the slot's bytes as latent_write_kernel writes them.
constexpr int kLkThreads = 256, kLkMaxR = 4 * kLkThreads, kLkMaxDr = 256;

__global__ void __launch_bounds__(kLkThreads) latent_key_path_kernel(LatentKeyPathParams p, int64_t token_bytes) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ double sum_smem[32];
  __shared__ unsigned red;
  __shared__ __align__(16) float cv[kLkMaxR];
  __shared__ float kv[kLkMaxDr];
  __shared__ float cs[kLkMaxDr];
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x, r4 = p.r / 4;
  float* row = p.ckv + t * p.ckv_stride;
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f), w = v;
  if (tid < r4) {
    v = reinterpret_cast<const float4*>(row)[tid];
    w = reinterpret_cast<const float4*>(p.norm_w)[tid];
  }
  for (int i = tid; i < p.dr; i += kLkThreads) kv[i] = row[p.r + i];
  double ss = 0.0;
  if (tid < r4) {
    ss += static_cast<double>(v.x) * v.x;
    ss += static_cast<double>(v.y) * v.y;
    ss += static_cast<double>(v.z) * v.z;
    ss += static_cast<double>(v.w) * v.w;
  }
  ss = block_sum_f64(ss, sum_smem);  // its barriers also publish kv
  const float inv = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(p.r) + static_cast<double>(p.eps)));
  if (tid < r4) {
    const float4 o = make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w);
    reinterpret_cast<float4*>(cv)[tid] = o;
    if (p.c) reinterpret_cast<float4*>(p.c + t * p.r)[tid] = o;
  }
  if (p.rope) {
    const RopeRows& rr = p.rope_rows;
    const int half = rr.dim / 2;
    const double pos = rope_position(rr.positions[t], rr.lerope, rr.lerope_window, rr.lerope_leak);
    for (int i = tid; i < half; i += kLkThreads)
      rope_cos_sin(pos, rr.inv_freq[i], rr.attn_factor, &cs[2 * i], &cs[2 * i + 1]);
    __syncthreads();
    for (int i = tid; i < half; i += kLkThreads)
      rope_rotate(p.neox ? &kv[i] : &kv[2 * i], p.neox ? &kv[i + half] : &kv[2 * i + 1], cs[2 * i], cs[2 * i + 1]);
  }
  __syncthreads();
  for (int i = tid; i < p.dr; i += kLkThreads) row[p.r + i] = kv[i];
  const int64_t slot = p.slots[t];
  if (slot < 0 || slot >= p.num_slots) return;  // whole block leaves together
  write_latent_row(cv, false, 0, kv, false, 0, p.r, p.dr, static_cast<int>(p.dtype), p.fp8_scale,
                   static_cast<uint8_t*>(p.cache) + slot * token_bytes, &red);
}

// A key row in shared memory v [dI] (all dI / 2 threads): Hadamard + e4m3 per 128 values into
// its slot of the indexer pages (values, then the page's scales).
__device__ __forceinline__ void quantize_key_to_page(float* v, unsigned* gmax, int dI, bool hadamard, float hscale,
                                                     int64_t slot, uint8_t* cache, int64_t page_bytes) {
  const int tid = threadIdx.x, half = dI / 2, G = dI / kIndexerQuantBlock;
  const Fp8GroupPair f = hadamard_fp8_groups(v, gmax, dI, hadamard, hscale);
  const int64_t block = slot / kPageTokens, off = slot % kPageTokens;
  uint8_t* page = cache + block * page_bytes;
  uint8_t* values = page + off * dI;
  float* scales = reinterpret_cast<float*>(page + int64_t{kPageTokens} * dI + off * 4 * G);
  values[tid] = to_e4m3(f.x0 / f.s0);
  values[tid + half] = to_e4m3(f.x1 / f.s1);
  if (tid < G) scales[tid] = fp8_group_scale(gmax, tid);
}

// grid (T), block dI / 2: thread i owns values i and i + dI/2 between butterfly stages.
__global__ void indexer_write_kernel(const void* __restrict__ k, bool k_bf16, int64_t k_stride,
                                     const int64_t* __restrict__ slots, int dI, bool hadamard,
                                     float hscale, uint8_t* __restrict__ cache, int64_t num_blocks,
                                     int64_t page_bytes) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ float v[];  // [dI]
  __shared__ unsigned gmax[8];  // one per 128-value group (dI <= 1024)
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0 || slot >= num_blocks * kPageTokens) return;
  const int tid = threadIdx.x, half = dI / 2;
  v[tid] = load_val(k, k_bf16, t * k_stride + tid);
  v[tid + half] = load_val(k, k_bf16, t * k_stride + tid + half);
  quantize_key_to_page(v, gmax, dI, hadamard, hscale, slot, cache, page_bytes);
}

// Block sum of one double per thread (dI / 2 = 64 threads: two warps), to every thread.
__device__ __forceinline__ double key_block_sum(double v, double* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += red[w];
  __syncthreads();
  return s;
}

// grid (T), block dI / 2: thread i owns values i and i + dI/2 (as indexer_write_kernel).
__global__ void indexer_key_path_kernel(IndexerKeyPathParams p, float hscale, int64_t page_bytes) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ float v[128];
  __shared__ unsigned gmax[1];
  __shared__ double red[2];
  __shared__ float cs[128];  // [rope_dim / 2][cos, sin], rope_dim <= dI = 128
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slots[t];
  if (slot < 0 || slot >= p.num_blocks * kPageTokens) return;
  const int tid = threadIdx.x, half = p.dI / 2;
  const float* kr = p.k + t * p.dI;
  const float x0 = kr[tid], x1 = kr[tid + half];
  // LayerNorm: f64 two-pass mean and variance (layer_norm_kernel's formula).
  const double mean = key_block_sum(static_cast<double>(x0) + static_cast<double>(x1), red) / p.dI;
  const double d0 = x0 - mean, d1 = x1 - mean;
  const double var = key_block_sum(d0 * d0 + d1 * d1, red) / p.dI;
  const double inv = 1.0 / sqrt(var + static_cast<double>(p.eps));
  const float z0 = static_cast<float>((x0 - mean) * inv), z1 = static_cast<float>((x1 - mean) * inv);
  // layer_norm_kernel's z * w + b, one rounding (both pinned with the same intrinsics).
  v[tid] = p.ln_b ? __fmaf_rn(z0, p.ln_w[tid], p.ln_b[tid]) : __fmul_rn(z0, p.ln_w[tid]);
  v[tid + half] = p.ln_b ? __fmaf_rn(z1, p.ln_w[tid + half], p.ln_b[tid + half]) : __fmul_rn(z1, p.ln_w[tid + half]);
  if (p.rope) rope_row(v, cs, p.rope_rows, t);  // q_path_kernel's NeoX rotation
  __syncthreads();
  quantize_key_to_page(v, gmax, p.dI, true, hscale, slot, static_cast<uint8_t*>(p.cache), page_bytes);
}

bool float_dtype(DType d) { return d == DType::kF32 || d == DType::kBF16; }

// The Hadamard scale as the CPU reference rounds it (ops/cpu/quant.cpp).
float hadamard_scale(int dI) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(dI))); }

}  // namespace

Status latent_cache_write(const LatentCacheWriteParams& p) {
  if (p.T < 0) return invalid_argument("latent_cache_write: T = {}", p.T);
  if (p.r <= 0 || p.dr < 0 || p.r % 2 || p.dr % 2)
    return invalid_argument("latent_cache_write: r = {}, dr = {} (positive, even)", p.r, p.dr);
  if (p.dtype == KvCacheDtype::kFp8DsMla && p.r % kDsMlaTile != 0)
    return invalid_argument("latent_cache_write: fp8_ds_mla needs r % 128 == 0, got r = {}", p.r);
  if (!float_dtype(p.c_dtype) || !float_dtype(p.kr_dtype))
    return invalid_argument("latent_cache_write: c/kr dtype must be f32 or bf16");
  if ((p.c_stride != 0 && p.c_stride < p.r) || (p.kr_stride != 0 && p.kr_stride < p.dr))
    return invalid_argument("latent_cache_write: row stride smaller than the row");
  if (p.T == 0) return ok_status();
  if (!p.c || (p.dr > 0 && !p.kr) || !p.slots || !p.cache || p.num_slots <= 0)
    return invalid_argument("latent_cache_write: null pointer or empty cache");
  if (p.dtype == KvCacheDtype::kFp8 && !(p.fp8_scale > 0.0f))
    return invalid_argument("latent_cache_write: fp8_scale must be > 0, got {}", p.fp8_scale);
  if (p.T > 0x7fffffff) return invalid_argument("latent_cache_write: T = {} too large", p.T);
  const int64_t token_bytes = static_cast<int64_t>(latent_token_bytes(p.dtype, p.r, p.dr));
  launch_kernel(latent_write_kernel, static_cast<unsigned>(p.T), kDsMlaTile, 0, p.stream, p.c,
                p.c_dtype == DType::kBF16, p.c_stride ? p.c_stride : p.r, p.kr, p.kr_dtype == DType::kBF16,
                p.kr_stride ? p.kr_stride : p.dr, p.slots, p.r, p.dr, static_cast<int>(p.dtype), p.fp8_scale,
                static_cast<uint8_t*>(p.cache), p.num_slots, token_bytes);
  return cuda_status(cudaGetLastError(), "latent_write_kernel");
}

Status latent_key_path(const LatentKeyPathParams& p) {
  if (p.T < 0) return invalid_argument("latent_key_path: T = {}", p.T);
  if (p.r <= 0 || p.r % 4 || p.r > kLkMaxR || p.dr < 0 || p.dr % 2 || p.dr > kLkMaxDr)
    return invalid_argument("latent_key_path: r = {} (a multiple of 4, at most {}), dr = {} (even, at most {})", p.r,
                            kLkMaxR, p.dr, kLkMaxDr);
  if (p.dtype == KvCacheDtype::kFp8DsMla && p.r % kDsMlaTile != 0)
    return invalid_argument("latent_key_path: fp8_ds_mla needs r % 128 == 0, got r = {}", p.r);
  if (p.ckv_stride < p.r + p.dr) return invalid_argument("latent_key_path: row stride smaller than the row");
  if (p.rope && (p.rope_rows.dim != p.dr || !p.rope_rows.positions || !p.rope_rows.inv_freq))
    return invalid_argument("latent_key_path: RoPE over {} of the {} rope values", p.rope_rows.dim, p.dr);
  if (p.dtype == KvCacheDtype::kFp8 && !(p.fp8_scale > 0.0f))
    return invalid_argument("latent_key_path: fp8_scale must be > 0, got {}", p.fp8_scale);
  if (p.T == 0) return ok_status();
  if (!p.ckv || !p.norm_w || !p.slots || !p.cache || p.num_slots <= 0)
    return invalid_argument("latent_key_path: null pointer or empty cache");
  if ((reinterpret_cast<uintptr_t>(p.ckv) | reinterpret_cast<uintptr_t>(p.norm_w) |
       reinterpret_cast<uintptr_t>(p.c) | static_cast<uintptr_t>(p.ckv_stride * 4)) & 15u)
    return invalid_argument("latent_key_path: ckv, its rows, norm_w and c must be 16-byte aligned");
  if (p.T > 0x7fffffff) return invalid_argument("latent_key_path: T = {} too large", p.T);
  const int64_t token_bytes = static_cast<int64_t>(latent_token_bytes(p.dtype, p.r, p.dr));
  launch_kernel(latent_key_path_kernel, static_cast<unsigned>(p.T), kLkThreads, 0, p.stream, p, token_bytes);
  return cuda_status(cudaGetLastError(), "latent_key_path_kernel");
}

Status indexer_cache_write(const IndexerCacheWriteParams& p) {
  if (p.T < 0) return invalid_argument("indexer_cache_write: T = {}", p.T);
  if (p.dI < kIndexerQuantBlock || p.dI > 1024 || (p.dI & (p.dI - 1)) != 0)
    return invalid_argument("indexer_cache_write: dI = {} (a power of two in [128, 1024])", p.dI);
  if (!float_dtype(p.k_dtype)) return invalid_argument("indexer_cache_write: k dtype must be f32 or bf16");
  if (p.k_stride != 0 && p.k_stride < p.dI) return invalid_argument("indexer_cache_write: k_stride < dI");
  if (p.T == 0) return ok_status();
  if (!p.k || !p.slots || !p.cache || p.num_blocks <= 0)
    return invalid_argument("indexer_cache_write: null pointer or empty cache");
  if (p.T > 0x7fffffff) return invalid_argument("indexer_cache_write: T = {} too large", p.T);
  const float hscale = hadamard_scale(p.dI);
  launch_kernel(indexer_write_kernel, static_cast<unsigned>(p.T), p.dI / 2, p.dI * sizeof(float), p.stream, p.k,
                p.k_dtype == DType::kBF16, p.k_stride ? p.k_stride : p.dI, p.slots, p.dI, p.hadamard, hscale,
                static_cast<uint8_t*>(p.cache), p.num_blocks, static_cast<int64_t>(indexer_page_bytes(p.dI)));
  return cuda_status(cudaGetLastError(), "indexer_write_kernel");
}

Status indexer_key_path(const IndexerKeyPathParams& p) {
  if (p.T < 0 || p.dI != 128) return invalid_argument("indexer_key_path: T = {}, dI = {} (128 only)", p.T, p.dI);
  const RopeRows& r = p.rope_rows;
  if (p.rope && (r.dim <= 0 || r.dim > p.dI || r.dim % 2 != 0 || !r.inv_freq || !r.positions))
    return invalid_argument("indexer_key_path: rope dim {} of {} (even), inv_freq and positions", r.dim, p.dI);
  if (p.T == 0) return ok_status();
  if (!p.k || !p.ln_w || !p.slots || !p.cache || p.num_blocks <= 0)
    return invalid_argument("indexer_key_path: null pointer or empty cache");
  if (p.T > 0x7fffffff) return invalid_argument("indexer_key_path: T = {} too large", p.T);
  launch_kernel(indexer_key_path_kernel, static_cast<unsigned>(p.T), p.dI / 2, 0, p.stream, p, hadamard_scale(p.dI),
                static_cast<int64_t>(indexer_page_bytes(p.dI)));
  return cuda_status(cudaGetLastError(), "indexer_key_path_kernel");
}

}  // namespace ml4::cuda
