// See elementwise.h. One block per row for the reductions (rows are at most ~16k wide);
// grid-stride loops elsewhere. Every kernel writes each output element exactly once, in
// a fixed order, so repeated runs are bit-identical.
#include "ops/cuda/elementwise.h"
#include "ops/cuda/pdl.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cuda/cuda_common.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/rope.cuh"
#include "ops/cuda/row_regs.cuh"

namespace ml4::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row; mean and variance in f64 like cpu::layer_norm (two passes), so the
// only difference is the order of the f64 sums.
__global__ void layer_norm_kernel(const float* x, const float* __restrict__ w, const float* __restrict__ b,
                                  int64_t dim, float eps, float* y) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ double smem[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
  const double mean = block_sum_f64(s, smem) / static_cast<double>(dim);
  double v = 0.0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
  const double var = block_sum_f64(v, smem) / static_cast<double>(dim);
  const double inv = 1.0 / sqrt(var + static_cast<double>(eps));
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float z = static_cast<float>((xr[i] - mean) * inv);
    // z * w + b with one rounding (what the compiler contracted it to; pinned, as the fused
    // indexer key path computes the same: cache_write.cu).
    y[row * dim + i] = b ? __fmaf_rn(z, w[i], b[i]) : __fmul_rn(z, w[i]);
  }
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    x[i] *= s;
}

__global__ void rms_norm_kernel(const float* __restrict__ x, float* __restrict__ residual, const float* __restrict__ w,
                                int64_t dim, float eps, float* y, __nv_bfloat16* __restrict__ yb, int64_t x_stride) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ double smem[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * x_stride;
  float* rr = residual ? residual + row * dim : nullptr;
  double ss = 0.0;  // f64 like cpu::rms_norm: the row's scale is then exact to f32 rounding
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = xr[i];
    if (rr) {
      v += rr[i];
      rr[i] = v;
    }
    ss += static_cast<double>(v) * v;
  }
  ss = block_sum_f64(ss, smem);
  const float inv = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(dim) + static_cast<double>(eps)));
  const float* src = rr ? rr : xr;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = src[i] * inv * w[i];
    if (y) y[row * dim + i] = v;
    if (yb) yb[row * dim + i] = __float2bfloat16_rn(v);
  }
}

// rms_norm_kernel with the row in registers, V float4 a thread (dim % 4 == 0, dim <= 1024 V,
// 16-byte aligned rows): every load of x, the residual and w is issued before any is used,
// then one f64 sum, then the stores. The loop above waits about one memory latency per 256
// elements: at ml4's width (6144) 13-22 us a row on an H100 (ncu, a batch-1 decode step: 14
// of them a step, 0.24 ms), where one latency is ~1-2 us. The same arithmetic per element (the
// f64 partial sums grouped differently: the f32 scale the same but in rare last-bit cases).
// No __restrict__ on x: y may be x (in place; every read is before the block barrier).
template <int V>
__global__ void __launch_bounds__(kThreads) rms_norm_vec_kernel(const float* x, float* __restrict__ residual,
                                                                const float* __restrict__ w, int dim, float eps,
                                                                float* y, __nv_bfloat16* __restrict__ yb,
                                                                int64_t x_stride) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ double smem[32];
  const int64_t row = blockIdx.x;
  const int n4 = dim >> 2;
  const float4* xr = reinterpret_cast<const float4*>(x + row * x_stride);
  float4* rr = residual ? reinterpret_cast<float4*>(residual + row * dim) : nullptr;
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float4 v[V], r[V], wv[V];
  load_row_regs<kThreads>(v, xr, n4);
  if (rr) load_row_regs<kThreads>(r, rr, n4);
  load_row_regs<kThreads>(wv, w4, n4);
  double ss = rr ? add_sum_squares<kThreads, true>(v, r, n4) : add_sum_squares<kThreads, false>(v, r, n4);
  ss = block_sum_f64(ss, smem);
  const float inv = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(dim) + static_cast<double>(eps)));
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i >= n4) continue;
    if (rr) rr[i] = v[j];
    const float4 o = rms_scale(v[j], inv, wv[j]);
    if (y) reinterpret_cast<float4*>(y + row * dim)[i] = o;
    if (yb) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x, o.y), hi = __floats2bfloat162_rn(o.z, o.w);
      uint2 u;
      u.x = *reinterpret_cast<const uint32_t*>(&lo);
      u.y = *reinterpret_cast<const uint32_t*>(&hi);
      reinterpret_cast<uint2*>(yb + row * dim)[i] = u;
    }
  }
}

__global__ void silu_mul_kernel(const float* __restrict__ g, const float* __restrict__ u, int64_t rows, int64_t cols,
                                int64_t gs, int64_t us, float* out, __nv_bfloat16* outb) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float gv = g[r * gs + c];
    // cpu::silu_mul: v / (1 + exp(-v)) in f32; expf to ~2 ulp.
    const float v = gv / (1.0f + expf(-gv)) * u[r * us + c];
    if (out) out[i] = v;
    if (outb) outb[i] = __float2bfloat16_rn(v);
  }
}

template <typename T>
__global__ void embedding_kernel(const T* __restrict__ table, int64_t V, int64_t D, const int32_t* __restrict__ ids,
                                 float* __restrict__ out, bool shard, int64_t first_id) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t] - first_id;
  const bool ok = id >= 0 && id < V;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float v;
    if (!ok) {
      v = shard ? 0.0f : __int_as_float(0x7fc00000);
    } else if constexpr (std::is_same_v<T, float>) {
      v = table[id * D + d];
    } else {
      v = __bfloat162float(table[id * D + d]);
    }
    out[t * D + d] = v;
  }
}

// embedding_kernel for a bf16 table by 8 values a thread (one 16-byte load), grid (D / 8 in
// blocks of 256, tokens): the row loop above waits a memory latency per 256 values (13 us for
// a 6144-wide row on an H100, ncu). The same values.
__global__ void embedding_bf16_vec_kernel(const uint4* __restrict__ table, int64_t V, int64_t D8,
                                          const int32_t* __restrict__ ids, int64_t T, float4* __restrict__ out,
                                          bool shard, int64_t first_id) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D8) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const int64_t id = ids[t] - first_id;
    float4 lo, hi;
    if (id >= 0 && id < V) {
      const uint4 u = table[id * D8 + d];
      auto f = [](uint32_t b) { return __uint_as_float(b << 16); };  // bf16 -> f32 exactly
      lo = make_float4(f(u.x & 0xffffu), f(u.x >> 16), f(u.y & 0xffffu), f(u.y >> 16));
      hi = make_float4(f(u.z & 0xffffu), f(u.z >> 16), f(u.w & 0xffffu), f(u.w >> 16));
    } else {
      const float v = shard ? 0.0f : __int_as_float(0x7fc00000);
      lo = hi = make_float4(v, v, v, v);
    }
    out[(t * D8 + d) * 2] = lo;
    out[(t * D8 + d) * 2 + 1] = hi;
  }
}

struct QPathArgs {
  float* q;
  int H, head_stride, rope_offset, rope_dim;
  const int64_t* positions;
  const float* inv_freq;
  float attn_factor;
  bool apply_rope;
  bool neox;
  bool lerope;
  int64_t lerope_window;
  double lerope_leak;
  double base_scale;
  bool llama4;
  int64_t llama4_orig;
  double llama4_beta;
  const float* ssmax_s;
  const int32_t* n_keys;
  float* head_scale;
  bool fold;
};

// Grid (tokens, groups of kQpHeads heads), 128 threads: cos/sin of the token's angles in
// shared memory, then the group's pairs (one a thread for 4 heads of 32 pairs); then the head
// temperatures, and the fold with every load of the group's heads issued before any store.
// One block a token (every head) walked its 64 heads' pairs 16 to a thread, each load after the
// previous store: 10 us on an H100 for ml4's q (ncu, batch-1 decode), about one memory latency
// per step. The same operations per element.
constexpr int kQpHeads = 4, kQpThreads = 128, kQpFoldRegs = 8;

__global__ void __launch_bounds__(kQpThreads) q_path_kernel(QPathArgs a) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ float cs[];  // [rope_dim/2][2]
  __shared__ float sfs[kQpHeads];
  const int64_t t = blockIdx.x;
  const int h0 = static_cast<int>(blockIdx.y) * kQpHeads, nh = min(kQpHeads, a.H - h0);
  const int64_t p = a.positions[t];
  const int half = a.rope_dim / 2;
  float* qt = a.q + (t * a.H + h0) * a.head_stride;  // the group's first head
  if (a.apply_rope) {
    const double pos = rope_position(p, a.lerope, a.lerope_window, a.lerope_leak);
    for (int i = threadIdx.x; i < half; i += blockDim.x)
      rope_cos_sin(pos, a.inv_freq[i], a.attn_factor, &cs[2 * i], &cs[2 * i + 1]);
    __syncthreads();
    for (int j = threadIdx.x; j < nh * half; j += blockDim.x) {
      const int h = j / half, i = j % half;
      float* base = qt + h * a.head_stride + a.rope_offset;
      rope_rotate(a.neox ? base + i : base + 2 * i, a.neox ? base + i + half : base + 2 * i + 1, cs[2 * i], cs[2 * i + 1]);
    }
  }
  if (a.base_scale == 0.0) return;
  // Temperature (cpu_attention.cpp step 6): f64 as on the CPU, rounded to f32 once.
  if (threadIdx.x < nh) {
    const int h = h0 + threadIdx.x;
    double sc = a.base_scale;
    if (a.llama4 && a.llama4_orig > 0) {
      const double n = floor(static_cast<double>(p) / static_cast<double>(a.llama4_orig));
      sc *= static_cast<double>(static_cast<float>(1.0 + a.llama4_beta * log(1.0 + n)));
    }
    const double nk = a.n_keys ? static_cast<double>(a.n_keys[t]) : static_cast<double>(p + 1);
    double s = sc;
    if (a.ssmax_s) s *= static_cast<double>(a.ssmax_s[h]) * log(nk);
    const float sf = static_cast<float>(s);
    sfs[threadIdx.x] = sf;
    if (a.head_scale) a.head_scale[t * a.H + h] = sf;
  }
  __syncthreads();  // rope writes before the fold reads; sfs written
  if (!a.fold) return;
  const int n = nh * a.head_stride;
  float v[kQpFoldRegs];
  load_row_regs<kQpThreads>(v, qt, n);
#pragma unroll
  for (int k = 0; k < kQpFoldRegs; ++k) {
    const int d = threadIdx.x + k * kQpThreads;
    if (d < n) qt[d] = v[k] * sfs[d / a.head_stride];
  }
  for (int d = threadIdx.x + kQpFoldRegs * kQpThreads; d < n; d += kQpThreads) qt[d] *= sfs[d / a.head_stride];
}

__global__ void cast_f32_bf16_kernel(const float* __restrict__ x, int64_t n, __nv_bfloat16* __restrict__ o) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    o[i] = __float2bfloat16_rn(x[i]);
}
// o[i][0, cols) = bf16(x[i * x_stride + (0, cols)]) (RNE), cols % 4 == 0, x 16-byte aligned rows.
__global__ void cast_rows_f32_bf16_kernel(const float* __restrict__ x, int64_t x_stride, int64_t rows, int cols,
                                          __nv_bfloat16* __restrict__ o) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int q4 = cols / 4;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * q4; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / q4, c = 4 * (i % q4);
    const float4 v = __ldcs(reinterpret_cast<const float4*>(x + row * x_stride + c));
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo);
    packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(o + row * cols + c) = packed;
  }
}
__global__ void cast_bf16_f32_kernel(const __nv_bfloat16* __restrict__ x, int64_t n, float* __restrict__ o) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    o[i] = __bfloat162float(x[i]);
}

template <typename T>
__global__ void transpose_kernel(const T* __restrict__ in, int64_t rows, int64_t cols, T* __restrict__ out) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = i / rows, r = i % rows;  // write-coalesced
    out[i] = in[r * cols + c];
  }
}

// grid (T, H): q_lat[t,h,:] = W_UK[h]^T q_nope[t,h] (the CPU's loop order: d outer). The
// general fallback (dn > 128 or r % 4 != 0); it re-reads W_UK[h] once per token.
__global__ void absorb_q_kernel(MlaAbsorbParams p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const float* qn = p.q + (t * p.H + h) * p.q_stride + p.q_offset;
  const float* w = p.w_uk + static_cast<int64_t>(h) * p.dn * p.r;
  float* out = p.q_lat + (t * p.H + h) * p.r;
  for (int j = threadIdx.x; j < p.r; j += blockDim.x) {
    float acc = 0.0f;
    for (int d = 0; d < p.dn; ++d) acc += qn[d] * w[static_cast<int64_t>(d) * p.r + j];
    out[j] = acc;
  }
}

// grid (T, H), one warp per output d: o[t,h,d] = W_UV[h][d] . lat[t,h]. The general fallback
// (r > 512 or r % 4 != 0).
__global__ void apply_uv_kernel(MlaAbsorbParams p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const float* lat = p.lat + (t * p.H + h) * p.r;
  for (int d = threadIdx.x >> 5; d < p.dv; d += blockDim.x >> 5) {
    const float* w = p.w_uv + (static_cast<int64_t>(h) * p.dv + d) * p.r;
    float acc = 0.0f;
    for (int j = lane; j < p.r; j += 32) acc += w[j] * lat[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) p.o[(t * p.H + h) * p.dv + d] = acc;
  }
}

// The weight-stationary absorption kernels (decode: the weights are read once per step, not
// once per token; at ml4 width W_UK and W_UV are 16.8 MB of f32 each per layer). Each block
// loads its weight tile into registers with 16-byte loads all in flight at once (64 KB per
// block, two blocks per SM), then loops over the step's tokens kTok at a time.
constexpr int kAbsTok = 8;

// absorb: grid (H, ceil(r / 128)), block (32, 8). Lane x owns columns c0 + 4x .. +3, row y
// the d-group [y * dpg, (y + 1) * dpg) (dpg = ceil(dn / 8) <= 16). Each d-group's partial
// (a sequential f32 fma chain over its d's) goes to shared memory; the 8 partials are then
// added in group order, so the result is deterministic.
constexpr int kAbsGroups = 8, kAbsMaxDpg = 16, kAbsCols = 128;
__global__ void __launch_bounds__(256) absorb_q_ws_kernel(MlaAbsorbParams p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ float qs[kAbsTok][kAbsGroups * kAbsMaxDpg];
  __shared__ float4 part[kAbsGroups][kAbsTok][32];
  const int h = blockIdx.x, lane = threadIdx.x, g = threadIdx.y, tid = g * 32 + lane;
  const int dpg = (p.dn + kAbsGroups - 1) / kAbsGroups, d0 = g * dpg;
  const int c = blockIdx.y * kAbsCols + 4 * lane;
  const float* wb = p.w_uk + static_cast<int64_t>(h) * p.dn * p.r;
  float4 w[kAbsMaxDpg];
#pragma unroll
  for (int i = 0; i < kAbsMaxDpg; ++i) {
    const int d = d0 + i;
    w[i] = (i < dpg && d < p.dn && c < p.r) ? __ldg(reinterpret_cast<const float4*>(wb + static_cast<int64_t>(d) * p.r + c))
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int64_t t0 = 0; t0 < p.T; t0 += kAbsTok) {
    const int nt = static_cast<int>(p.T - t0 < kAbsTok ? p.T - t0 : kAbsTok);
    __syncthreads();  // the previous tile's readers of qs and part are done
    for (int i = tid; i < nt * p.dn; i += 256) {
      const int tt = i / p.dn, d = i - tt * p.dn;
      qs[tt][d] = p.q[((t0 + tt) * p.H + h) * p.q_stride + p.q_offset + d];
    }
    __syncthreads();
#pragma unroll
    for (int tt = 0; tt < kAbsTok; ++tt) {
      if (tt < nt) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < kAbsMaxDpg; ++i) {
          if (i < dpg && d0 + i < p.dn) {
            const float qv = qs[tt][d0 + i];
            a.x = fmaf(qv, w[i].x, a.x);
            a.y = fmaf(qv, w[i].y, a.y);
            a.z = fmaf(qv, w[i].z, a.z);
            a.w = fmaf(qv, w[i].w, a.w);
          }
        }
        part[g][tt][lane] = a;
      }
    }
    __syncthreads();
    const int tt = tid >> 5, quad = tid & 31, cc = blockIdx.y * kAbsCols + 4 * quad;
    if (tt < nt && cc < p.r) {
      float4 s = part[0][tt][quad];
#pragma unroll
      for (int gg = 1; gg < kAbsGroups; ++gg) {
        const float4 v = part[gg][tt][quad];
        s.x += v.x;
        s.y += v.y;
        s.z += v.z;
        s.w += v.w;
      }
      *reinterpret_cast<float4*>(p.q_lat + ((t0 + tt) * p.H + h) * p.r + cc) = s;
    }
  }
}

// apply_uv: grid (H, ceil(dv / 32)), 256 threads. Warp w owns rows d0 + 4w .. +3; lane x holds
// float4 columns x, x + 32, x + 64, x + 96 of each (r <= 512). lat rows of kTok tokens are staged
// in shared memory; each row's dot is the lane's f32 fma chain, then a butterfly over the warp.
constexpr int kUvRows = 4, kUvWarps = 8, kUvMaxR4 = 128;
__global__ void __launch_bounds__(256) apply_uv_ws_kernel(MlaAbsorbParams p) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  __shared__ float4 ls[kAbsTok][kUvMaxR4];
  const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = blockIdx.y * (kUvWarps * kUvRows) + warp * kUvRows;
  const int r4 = p.r / 4;
  const float* wb = p.w_uv + static_cast<int64_t>(h) * p.dv * p.r;
  float4 w[kUvRows][kUvMaxR4 / 32];
#pragma unroll
  for (int rr = 0; rr < kUvRows; ++rr) {
#pragma unroll
    for (int i = 0; i < kUvMaxR4 / 32; ++i) {
      const int d = row0 + rr, j4 = lane + 32 * i;
      w[rr][i] = (d < p.dv && j4 < r4) ? __ldg(reinterpret_cast<const float4*>(wb + static_cast<int64_t>(d) * p.r) + j4)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  for (int64_t t0 = 0; t0 < p.T; t0 += kAbsTok) {
    const int nt = static_cast<int>(p.T - t0 < kAbsTok ? p.T - t0 : kAbsTok);
    __syncthreads();
    for (int i = threadIdx.x; i < nt * r4; i += 256) {
      const int tt = i / r4, j4 = i - tt * r4;
      ls[tt][j4] = reinterpret_cast<const float4*>(p.lat + ((t0 + tt) * p.H + h) * p.r)[j4];
    }
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
#pragma unroll
      for (int rr = 0; rr < kUvRows; ++rr) {
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < kUvMaxR4 / 32; ++i) {
          if (lane + 32 * i < r4) {
            const float4 l = ls[tt][lane + 32 * i];
            a = fmaf(w[rr][i].x, l.x, a);
            a = fmaf(w[rr][i].y, l.y, a);
            a = fmaf(w[rr][i].z, l.z, a);
            a = fmaf(w[rr][i].w, l.w, a);
          }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        const int d = row0 + rr;
        if (lane == rr && d < p.dv) p.o[((t0 + tt) * p.H + h) * p.dv + d] = a;
      }
    }
  }
}

// The weight-stationary kernels need float4 rows (r % 4 == 0, 16-byte aligned bases), dn <= 128
// (absorb) or r <= 512 (apply_uv). They also serve prefill: there they run at the f32 FMA rate
// (T x H x dn x r x 2 flops, e.g. 34 GFLOP ~ 0.5 ms per layer at 4096 tokens), where the
// per-token fallback re-reads W_UK[h] from L2 for every (token, head): 68 GB per layer.
bool absorb_weight_stationary(const MlaAbsorbParams& p, bool uv) {
  if (p.r % 4 != 0) return false;
  const void* w = uv ? static_cast<const void*>(p.w_uv) : static_cast<const void*>(p.w_uk);
  const void* io = uv ? static_cast<const void*>(p.lat) : static_cast<const void*>(p.q_lat);
  if (reinterpret_cast<uintptr_t>(w) % 16 != 0 || reinterpret_cast<uintptr_t>(io) % 16 != 0) return false;
  return uv ? p.r <= 4 * kUvMaxR4 : p.dn <= kAbsGroups * kAbsMaxDpg;
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536)); }

}  // namespace

Status rms_norm(const RmsNormParams& p) {
  if (p.rows < 0 || p.dim <= 0) return invalid_argument("rms_norm: bad shape rows={} dim={}", p.rows, p.dim);
  if (!p.x || !p.w || (!p.y && !p.y_bf16)) return invalid_argument("rms_norm: null input or no output");
  if (p.residual && static_cast<const void*>(p.y) == p.residual)
    return invalid_argument("rms_norm: y must not alias residual");
  if (p.x_stride != 0 && p.x_stride < p.dim) return invalid_argument("rms_norm: x_stride {} < dim {}", p.x_stride, p.dim);
  if (p.rows == 0) return ok_status();
  if (p.rows > INT32_MAX) return invalid_argument("rms_norm: {} rows", p.rows);
  const int64_t xs = p.x_stride ? p.x_stride : p.dim;
  const int v = static_cast<int>((p.dim / 4 + kThreads - 1) / kThreads);  // float4s a thread
  if (p.dim % 4 == 0 && xs % 4 == 0 && v <= 8 && aligned16(p.x) && aligned16(p.w) &&
      (!p.residual || aligned16(p.residual)) && (!p.y || aligned16(p.y)) &&
      reinterpret_cast<uintptr_t>(p.y_bf16) % 8 == 0) {
    auto launch = [&](auto kernel) {
      launch_kernel(kernel, static_cast<int>(p.rows), kThreads, 0, p.stream, p.x, p.residual, p.w,
                    static_cast<int>(p.dim), p.eps, p.y, static_cast<__nv_bfloat16*>(p.y_bf16), xs);
    };
    if (v <= 1) launch(rms_norm_vec_kernel<1>);
    else if (v <= 2) launch(rms_norm_vec_kernel<2>);
    else if (v <= 4) launch(rms_norm_vec_kernel<4>);
    else if (v <= 6) launch(rms_norm_vec_kernel<6>);
    else launch(rms_norm_vec_kernel<8>);
    return cuda_status(cudaGetLastError(), "rms_norm_vec_kernel");
  }
  launch_kernel(rms_norm_kernel, static_cast<int>(p.rows), kThreads, 0, p.stream, p.x, p.residual, p.w, p.dim, p.eps,
                p.y, static_cast<__nv_bfloat16*>(p.y_bf16), xs);
  return cuda_status(cudaGetLastError(), "rms_norm_kernel");
}

Status silu_mul(const SiluMulParams& p) {
  if (p.rows < 0 || p.cols <= 0) return invalid_argument("silu_mul: bad shape rows={} cols={}", p.rows, p.cols);
  const int64_t gs = p.g_stride ? p.g_stride : p.cols, us = p.u_stride ? p.u_stride : p.cols;
  if (gs < p.cols || us < p.cols) return invalid_argument("silu_mul: stride below cols");
  if (!p.g || !p.u || (!p.out && !p.out_bf16)) return invalid_argument("silu_mul: null input or no output");
  if (p.rows == 0) return ok_status();
  launch_kernel(silu_mul_kernel, grid_for(p.rows * p.cols), kThreads, 0, p.stream, p.g, p.u, p.rows, p.cols, gs, us,
                p.out, static_cast<__nv_bfloat16*>(p.out_bf16));
  return cuda_status(cudaGetLastError(), "silu_mul_kernel");
}

Status embedding(const EmbeddingParams& p) {
  if (p.V <= 0 || p.D <= 0 || p.T < 0) return invalid_argument("embedding: bad shape V={} D={} T={}", p.V, p.D, p.T);
  if (!p.table || !p.ids || !p.out) return invalid_argument("embedding: null pointer");
  if (p.T == 0) return ok_status();
  switch (p.table_dtype) {
    case DType::kF32:
      launch_kernel(embedding_kernel<float>, static_cast<int>(p.T), kThreads, 0, p.stream,
                    static_cast<const float*>(p.table), p.V, p.D, p.ids, p.out, p.shard, p.first_id);
      break;
    case DType::kBF16:
      if (p.D % 8 == 0 && aligned16(p.table) && aligned16(p.out)) {
        const int64_t D8 = p.D / 8;
        const dim3 grid(static_cast<unsigned>((D8 + kThreads - 1) / kThreads),
                        static_cast<unsigned>(std::min<int64_t>(p.T, 65535)));
        launch_kernel(embedding_bf16_vec_kernel, grid, kThreads, 0, p.stream, static_cast<const uint4*>(p.table), p.V, D8,
                      p.ids, p.T, reinterpret_cast<float4*>(p.out), p.shard, p.first_id);
        break;
      }
      launch_kernel(embedding_kernel<__nv_bfloat16>, static_cast<int>(p.T), kThreads, 0, p.stream,
                    static_cast<const __nv_bfloat16*>(p.table), p.V, p.D, p.ids, p.out, p.shard, p.first_id);
      break;
    default:
      return invalid_argument("embedding: table dtype {} (bf16 or f32)", dtype_name(p.table_dtype));
  }
  return cuda_status(cudaGetLastError(), "embedding_kernel");
}

Status q_path(const QPathParams& p) {
  if (p.T < 0 || p.H <= 0 || p.head_stride <= 0) return invalid_argument("q_path: bad shape T={} H={}", p.T, p.H);
  if (p.apply_rope && (p.rope_dim <= 0 || p.rope_dim % 2 != 0 || p.rope_offset < 0 ||
                       p.rope_offset + p.rope_dim > p.head_stride || !p.inv_freq))
    return invalid_argument("q_path: rope part [{}, {}) of a {}-wide head (even rope_dim, inv_freq set)",
                            p.rope_offset, p.rope_offset + p.rope_dim, p.head_stride);
  if (!p.q || !p.positions) return invalid_argument("q_path: null q or positions");
  if (p.T == 0) return ok_status();
  QPathArgs a{p.q, p.H, p.head_stride, p.rope_offset, p.rope_dim, p.positions, p.inv_freq, p.attn_factor,
              p.apply_rope, p.neox, p.lerope.enabled, p.lerope.window, p.lerope.leak, p.base_scale, p.llama4.enabled,
              p.llama4.original_max_position_embeddings, p.llama4.beta, p.ssmax_s, p.n_keys, p.head_scale,
              p.fold_scale};
  const size_t smem = static_cast<size_t>(std::max(p.rope_dim, 2)) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(p.T), static_cast<unsigned>((p.H + kQpHeads - 1) / kQpHeads));
  launch_kernel(q_path_kernel, grid, kQpThreads, smem, p.stream, a);
  return cuda_status(cudaGetLastError(), "q_path_kernel");
}

Status layer_norm(const LayerNormParams& p) {
  if (p.rows < 0 || p.dim <= 0) return invalid_argument("layer_norm: bad shape rows={} dim={}", p.rows, p.dim);
  if (p.rows == 0) return ok_status();
  if (!p.x || !p.w || !p.y) return invalid_argument("layer_norm: null pointer");
  launch_kernel(layer_norm_kernel, static_cast<unsigned>(p.rows), 128, 0, p.stream, p.x, p.w, p.b, p.dim, p.eps, p.y);
  return cuda_status(cudaGetLastError(), "layer_norm_kernel");
}

Status scale_inplace(float* x, int64_t n, float s, cudaStream_t stream) {
  if (n < 0 || (n > 0 && !x)) return invalid_argument("scale_inplace: bad arguments");
  if (n == 0) return ok_status();
  launch_kernel(scale_kernel, grid_for(n), kThreads, 0, stream, x, n, s);
  return cuda_status(cudaGetLastError(), "scale_kernel");
}

Status mla_absorb_q(const MlaAbsorbParams& p) {
  if (p.T < 0 || p.H <= 0 || p.dn <= 0 || p.r <= 0 || p.q_offset + p.dn > p.q_stride)
    return invalid_argument("mla_absorb_q: bad shape");
  if (p.T == 0) return ok_status();
  if (!p.q || !p.w_uk || !p.q_lat) return invalid_argument("mla_absorb_q: null pointer");
  if (absorb_weight_stationary(p, false)) {
    launch_kernel(absorb_q_ws_kernel, dim3(p.H, (p.r + kAbsCols - 1) / kAbsCols), dim3(32, kAbsGroups), 0, p.stream, p);
    return cuda_status(cudaGetLastError(), "absorb_q_ws_kernel");
  }
  launch_kernel(absorb_q_kernel, dim3(static_cast<unsigned>(p.T), p.H), 128, 0, p.stream, p);
  return cuda_status(cudaGetLastError(), "absorb_q_kernel");
}

Status mla_apply_uv(const MlaAbsorbParams& p) {
  if (p.T < 0 || p.H <= 0 || p.dv <= 0 || p.r <= 0) return invalid_argument("mla_apply_uv: bad shape");
  if (p.T == 0) return ok_status();
  if (!p.lat || !p.w_uv || !p.o) return invalid_argument("mla_apply_uv: null pointer");
  if (absorb_weight_stationary(p, true)) {
    const int rows = kUvWarps * kUvRows;
    launch_kernel(apply_uv_ws_kernel, dim3(p.H, (p.dv + rows - 1) / rows), 256, 0, p.stream, p);
    return cuda_status(cudaGetLastError(), "apply_uv_ws_kernel");
  }
  launch_kernel(apply_uv_kernel, dim3(static_cast<unsigned>(p.T), p.H), 256, 0, p.stream, p);
  return cuda_status(cudaGetLastError(), "apply_uv_kernel");
}

// Per head h (batch entry), cuBLASLt's column-major view of the row-major tensors:
//   q_lat_h^T [r, T]  = W_UK[h]^T [r, dn] (W_UK[h] row-major [dn, r] read as is) q_h^T [dn, T]
//   o_h^T     [dv, T] = W_UV[h] [dv, r] (row-major [dv, r]: col-major [r, dv], transposed) lat_h^T [r, T]
// with the token rows H * (row width) apart and the heads (row width) apart.
Status mla_absorb_q_gemm(LtGemm& lt, const MlaAbsorbParams& p) {
  if (p.T <= 0 || p.H <= 0 || p.dn <= 0 || p.r <= 0 || p.q_offset + p.dn > p.q_stride)
    return invalid_argument("mla_absorb_q_gemm: bad shape");
  if (!p.q || !(p.lat_bf16 ? p.w_uk16 : p.w_uk) || !p.q_lat || (p.lat_bf16 && !p.q16))
    return invalid_argument("mla_absorb_q_gemm: null pointer");
  GemmBatchedParams g;  // (nvcc compiles C++17 here: no designated initializers)
  g.lda = p.r;
  g.stride_a = int64_t{p.dn} * p.r;
  g.d = p.q_lat;
  g.ldd = int64_t{p.H} * p.r;
  g.stride_d = p.r;
  g.m = p.r;
  g.n = p.T;
  g.k = p.dn;
  g.batch = p.H;
  g.stream = p.stream;
  if (p.lat_bf16) {  // q's nope part to bf16 [T, H, dn], then bf16 x bf16 -> bf16 q_lat
    if (p.dn % 4 != 0 || p.q_stride % 4 != 0 || p.q_offset % 4 != 0)
      return invalid_argument("mla_absorb_q_gemm: bf16 form needs dn, q_stride, q_offset multiples of 4");
    const int64_t rows = p.T * p.H;
    launch_kernel(cast_rows_f32_bf16_kernel, grid_for(rows * (p.dn / 4)), kThreads, 0, p.stream, p.q + p.q_offset,
                  int64_t{p.q_stride}, rows, p.dn, static_cast<__nv_bfloat16*>(p.q16));
    ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "cast_rows_f32_bf16_kernel"));
    g.a = p.w_uk16;
    g.b = p.q16;
    g.ldb = int64_t{p.H} * p.dn;
    g.stride_b = p.dn;
    g.ab_dtype = g.d_dtype = DType::kBF16;
  } else {
    g.a = p.w_uk;
    g.b = p.q + p.q_offset;
    g.ldb = int64_t{p.H} * p.q_stride;
    g.stride_b = p.q_stride;
    g.tf32 = true;
  }
  return lt.batched(g);
}

Status mla_apply_uv_gemm(LtGemm& lt, const MlaAbsorbParams& p) {
  if (p.T <= 0 || p.H <= 0 || p.dv <= 0 || p.r <= 0) return invalid_argument("mla_apply_uv_gemm: bad shape");
  if (!p.lat || !(p.lat_bf16 ? p.w_uv16 : p.w_uv) || !p.o) return invalid_argument("mla_apply_uv_gemm: null pointer");
  GemmBatchedParams g;
  g.a = p.lat_bf16 ? p.w_uv16 : static_cast<const void*>(p.w_uv);
  g.lda = p.r;
  g.stride_a = int64_t{p.dv} * p.r;
  g.trans_a = true;
  g.b = p.lat;
  g.ldb = int64_t{p.H} * p.r;
  g.stride_b = p.r;
  g.d = p.o;
  g.ldd = int64_t{p.H} * p.dv;
  g.stride_d = p.dv;
  g.m = p.dv;
  g.n = p.T;
  g.k = p.r;
  g.batch = p.H;
  g.ab_dtype = p.lat_bf16 ? DType::kBF16 : DType::kF32;  // o stays f32 (the o projection quantizes it)
  g.tf32 = true;
  g.stream = p.stream;
  return lt.batched(g);
}

Status cast_f32_bf16(const float* x, int64_t n, void* out, cudaStream_t stream) {
  if (n < 0 || (n > 0 && (!x || !out))) return invalid_argument("cast_f32_bf16: bad arguments");
  if (n == 0) return ok_status();
  launch_kernel(cast_f32_bf16_kernel, grid_for(n), kThreads, 0, stream, x, n, static_cast<__nv_bfloat16*>(out));
  return cuda_status(cudaGetLastError(), "cast_f32_bf16_kernel");
}

Status transpose_2d(const void* in, int elem_bytes, int64_t rows, int64_t cols, void* out, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || (elem_bytes != 2 && elem_bytes != 4)) return invalid_argument("transpose_2d: bad arguments");
  if (rows * cols == 0) return ok_status();
  if (elem_bytes == 4)
    launch_kernel(transpose_kernel<uint32_t>, grid_for(rows * cols), kThreads, 0, stream,
                  static_cast<const uint32_t*>(in), rows, cols, static_cast<uint32_t*>(out));
  else
    launch_kernel(transpose_kernel<uint16_t>, grid_for(rows * cols), kThreads, 0, stream,
                  static_cast<const uint16_t*>(in), rows, cols, static_cast<uint16_t*>(out));
  return cuda_status(cudaGetLastError(), "transpose_kernel");
}

Status cast_bf16_f32(const void* x, int64_t n, float* out, cudaStream_t stream) {
  if (n < 0 || (n > 0 && (!x || !out))) return invalid_argument("cast_bf16_f32: bad arguments");
  if (n == 0) return ok_status();
  launch_kernel(cast_bf16_f32_kernel, grid_for(n), kThreads, 0, stream, static_cast<const __nv_bfloat16*>(x), n, out);
  return cuda_status(cudaGetLastError(), "cast_bf16_f32_kernel");
}

}  // namespace ml4::cuda
