// See moe.h. The router runs one warp per token with the token's scores in shared memory
// (moe_route.cuh: the routing rule, shared with the resident FFN kernel).
#include "ops/cuda/moe.h"
#include "ops/cuda/pdl.cuh"

#include <cmath>

#include "ops/cuda/act_quant.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe_gemm.h"
#include "ops/cuda/moe_route.cuh"
#include "ops/cuda/row_regs.cuh"

namespace ml4::cuda {
namespace {

// One warp per token; blockDim = 32 * warps, shared memory: warps * (2E + G) floats.
__global__ void route_kernel(RouteArgs a) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ float sm[];
  const int w = threadIdx.x >> 5;
  const int64_t t = blockIdx.x * int64_t{blockDim.x >> 5} + w;
  if (t >= a.T) return;
  route_row(a, t, a.logits + t * a.E, sm + w * (2 * a.E + a.G));
}

// The decode router fused (issue 19): block e computes expert e's logit for every token (T <=
// 8; f32 products summed per thread in k order, then across the warp and the 8 warps in a
// fixed order), writes it with a fence, and counts itself done; the last block to finish
// resets the counter (for the next launch or graph replay) and routes every token, warp t
// for token t, on the logits read back past L1 (__ldcg) into shared memory. Shared memory:
// 8 warps x (3E + G) floats.
constexpr int kRouterThreads = 256, kRouterMaxT = 8, kRouterVec = 8;  // float4s a thread: D <= 8192

// With norm.w (RouterRouteParams's norm): x is first made from the attention output and the
// residual, as rms_norm_vec_kernel does it with the same 256-thread partition and block sum (so
// the same bits): every block norms every token's row in its registers and writes 1/E of `a`;
// the last block adds the attention output into the residual after every block has read it.
struct RouterNorm {
  const float* attn = nullptr;
  float* residual = nullptr;
  const float* w = nullptr;
  float eps = 0.0f;
  float* a = nullptr;  // the normalized rows (RouterRouteParams::x; x itself is then not read)
};

__global__ void __launch_bounds__(kRouterThreads)
    router_route_kernel(const float* __restrict__ x, int64_t D, const float* __restrict__ gate, float* logits,
                        unsigned* counter, bool vec, RouteArgs a, RouterNorm norm) {
  pdl_wait();
  pdl_launch_dependents();
  extern __shared__ float sm[];
  __shared__ float part[kRouterThreads / 32][kRouterMaxT];
  __shared__ double red[32];
  __shared__ int last;
  const int e = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int T = static_cast<int>(a.T);
  const float* g = gate + static_cast<int64_t>(e) * D;
  float acc[kRouterMaxT];
#pragma unroll
  for (int t = 0; t < kRouterMaxT; ++t) acc[t] = 0.0f;
  if (vec) {  // D % 4 == 0, D <= 4 kRouterThreads kRouterVec, x and gate 16-byte aligned
    // By float4, the gate row in registers (all its loads issued at once), then each token's x
    // the same way: the strided loop below waits about one memory latency per 256 k (24 at
    // ml4's width), which made this kernel slower than cuBLAS's GEMV plus route_kernel.
    const int n4 = static_cast<int>(D / 4);
    const float4* g4 = reinterpret_cast<const float4*>(g);
    float4 gv[kRouterVec], wv[kRouterVec];
    load_row_regs<kRouterThreads>(gv, g4, n4);
    if (norm.w) load_row_regs<kRouterThreads>(wv, reinterpret_cast<const float4*>(norm.w), n4);
#pragma unroll
    for (int t = 0; t < kRouterMaxT; ++t) {
      if (t >= T) break;
      float4 xv[kRouterVec];
      if (norm.w) {  // rms_norm_vec_kernel's arithmetic, element for element
        float4 rv[kRouterVec];
        load_row_regs<kRouterThreads>(xv, reinterpret_cast<const float4*>(norm.attn + t * D), n4);
        load_row_regs<kRouterThreads>(rv, reinterpret_cast<const float4*>(norm.residual + t * D), n4);
        const double ss = block_sum_f64(add_sum_squares<kRouterThreads, true>(xv, rv, n4), red);
        const float inv = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(D) + static_cast<double>(norm.eps)));
        float4* a4 = reinterpret_cast<float4*>(norm.a + t * D);
#pragma unroll
        for (int j = 0; j < kRouterVec; ++j) {
          const int i = threadIdx.x + j * kRouterThreads;
          if (i >= n4) continue;
          xv[j] = rms_scale(xv[j], inv, wv[j]);
          if (i % gridDim.x == blockIdx.x) a4[i] = xv[j];
        }
      } else {
        load_row_regs<kRouterThreads>(xv, reinterpret_cast<const float4*>(x + t * D), n4);
      }
#pragma unroll
      for (int j = 0; j < kRouterVec; ++j) {
        const int i = threadIdx.x + j * kRouterThreads;
        if (i < n4) {
          acc[t] = fmaf(gv[j].x, xv[j].x, acc[t]);
          acc[t] = fmaf(gv[j].y, xv[j].y, acc[t]);
          acc[t] = fmaf(gv[j].z, xv[j].z, acc[t]);
          acc[t] = fmaf(gv[j].w, xv[j].w, acc[t]);
        }
      }
    }
  } else {
    for (int64_t k = threadIdx.x; k < D; k += kRouterThreads) {
      const float gk = g[k];
#pragma unroll
      for (int t = 0; t < kRouterMaxT; ++t)
        if (t < T) acc[t] = fmaf(gk, x[t * D + k], acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < kRouterMaxT; ++t) {
    float v = acc[t];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[w][t] = v;
  }
  __syncthreads();
  if (threadIdx.x < T) {
    float v = 0.0f;
    for (int i = 0; i < kRouterThreads / 32; ++i) v += part[i][threadIdx.x];
    logits[threadIdx.x * a.E + e] = v;
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // release by the signalling thread too (the writers fenced their own stores)
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) atomicExch(counter, 0u);
  if (norm.w) {  // every block has read the residual: residual += attention output, a row's
    // loads all issued before its stores (one memory latency a token, not one per 256 float4s)
    const int n4 = static_cast<int>(D / 4);
    const float4* __restrict__ at4 = reinterpret_cast<const float4*>(norm.attn);
    float4* __restrict__ r4 = reinterpret_cast<float4*>(norm.residual);
    for (int t = 0; t < T; ++t) {
      float4 av[kRouterVec], rv[kRouterVec];
      load_row_regs<kRouterThreads>(av, at4 + t * n4, n4);
      load_row_regs<kRouterThreads>(rv, r4 + t * n4, n4);
#pragma unroll
      for (int j = 0; j < kRouterVec; ++j) {
        const int i = threadIdx.x + j * kRouterThreads;
        if (i < n4) r4[t * n4 + i] = make_float4(av[j].x + rv[j].x, av[j].y + rv[j].y, av[j].z + rv[j].z,
                                                 av[j].w + rv[j].w);
      }
    }
  }
  if (w >= T) return;
  float* sl = sm + w * (3 * a.E + a.G);
  for (int i = lane; i < a.E; i += 32) sl[i] = __ldcg(logits + w * a.E + i);
  __syncwarp();
  route_row(a, w, sl, sl + a.E);
}

// One block: thread e counts expert e's rows, a serial scan gives offsets, then thread e
// lists its rows in (t, k) order. Deterministic; O(E * T*K / threads) for now.
__global__ void permute_kernel(const int32_t* __restrict__ ids, int64_t n, int E, int32_t* offsets,
                               int32_t* perm_token, int32_t* inv, int K, int32_t* active) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ int32_t cnt[];  // [E + 1]
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t c = 0;
    for (int64_t i = 0; i < n; ++i) c += ids[i] == e;
    cnt[e + 1] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    cnt[0] = 0;
    int32_t na = 0;
    for (int e = 0; e < E; ++e) {
      if (active && cnt[e + 1] > 0) active[1 + na++] = e;
      cnt[e + 1] += cnt[e];
    }
    if (active) active[0] = na;
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= E; e += blockDim.x) offsets[e] = cnt[e];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t o = cnt[e];
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] == e) {
        perm_token[o] = static_cast<int32_t>(i / K);
        inv[i] = o;
        ++o;
      }
    }
  }
}

__global__ void gather_rows_kernel(const float* __restrict__ x, int64_t D, const int32_t* __restrict__ rows,
                                   float* __restrict__ out) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t i = blockIdx.x;
  const float* src = x + int64_t{rows[i]} * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) out[i * D + d] = src[d];
}

__global__ void combine_kernel(const float* __restrict__ y, const int32_t* __restrict__ inv,
                               const float* __restrict__ w, int K, int64_t D, const float* __restrict__ shared,
                               float* __restrict__ out) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += w[t * K + k] * y[int64_t{inv[t * K + k]} * D + d];
    if (shared) acc += shared[t * D + d];
    out[t * D + d] = acc;
  }
}

// gather_rows_kernel and combine_kernel by float4, one per thread, grid (D / 4 in blocks of
// 256, rows): a thread's loads (the K expert rows and the shared expert's) all issued before
// any is used. The one-block-a-row loops wait a memory latency per 256 elements: 12 and 34 us
// for a 6144-wide row on an H100 (ncu, batch-1 decode). The same operations per element (K
// fused multiply-adds in k order, then the shared row added).
__global__ void gather_rows_vec_kernel(const float4* __restrict__ x, int64_t D4, const int32_t* __restrict__ rows,
                                       int64_t n, float4* __restrict__ out) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D4) return;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) out[i * D4 + d] = x[int64_t{rows[i]} * D4 + d];
}

__global__ void combine_vec_kernel(const float4* __restrict__ y, const int32_t* __restrict__ inv,
                                   const float* __restrict__ w, int K, int64_t D4, int64_t T,
                                   const float4* __restrict__ shared, float4* __restrict__ out) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D4) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int k = 0; k < K; ++k) {
      const float wk = w[t * K + k];
      const float4 v = y[int64_t{inv[t * K + k]} * D4 + d];
      acc.x = fmaf(wk, v.x, acc.x);
      acc.y = fmaf(wk, v.y, acc.y);
      acc.z = fmaf(wk, v.z, acc.z);
      acc.w = fmaf(wk, v.w, acc.w);
    }
    if (shared) {
      const float4 v = shared[t * D4 + d];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    out[t * D4 + d] = acc;
  }
}

__global__ void decode_rows_kernel(int64_t n, int K, int32_t* __restrict__ row_src, int32_t* __restrict__ inv) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    row_src[i] = static_cast<int32_t>(i / K);
    inv[i] = static_cast<int32_t>(i);
  }
}

}  // namespace

Status moe_route(const MoeRouteParams& p) {
  const int E = p.cfg.num_experts, K = p.cfg.num_experts_per_tok, G = std::max(p.cfg.num_expert_groups, 1);
  if (E <= 0 || E > kMaxExperts || K <= 0 || K > E || K > kMaxTopK || E % G != 0 || G > E ||
      p.cfg.num_expert_groups_per_tok < 1)
    return invalid_argument("moe_route: unsupported config experts={} per_tok={} groups={} groups_per_tok={}", E, K,
                            p.cfg.num_expert_groups, p.cfg.num_expert_groups_per_tok);
  if (p.T < 0 || (p.T > 0 && (!p.logits || !p.ids || !p.weights))) return invalid_argument("moe_route: bad arguments");
  if (p.T == 0) return ok_status();
  RouteArgs a{p.logits, p.T, E, K, G, std::min(p.cfg.num_expert_groups_per_tok, G),
              p.cfg.scoring == RouterScoring::kSoftmax, p.cfg.renormalize, static_cast<float>(p.cfg.routed_scale),
              p.bias, p.ids, p.weights, p.forced_ids};
  const int warps = 4;
  const size_t smem = static_cast<size_t>(warps) * (2 * E + G) * sizeof(float);
  const int64_t blocks = (p.T + warps - 1) / warps;
  launch_kernel(route_kernel, static_cast<unsigned>(blocks), warps * 32, smem, p.stream, a);
  return cuda_status(cudaGetLastError(), "route_kernel");
}

size_t router_route_counter_bytes() { return sizeof(unsigned); }

Status router_route(const RouterRouteParams& p) {
  const MoeRouteParams& r = p.route;
  const int E = r.cfg.num_experts, K = r.cfg.num_experts_per_tok, G = std::max(r.cfg.num_expert_groups, 1);
  if (!router_route_supported(r.cfg, r.T) || r.cfg.num_expert_groups_per_tok < 1 || E % G != 0 || K > E)
    return invalid_argument("router_route: unsupported T={} experts={} per_tok={} groups={}", r.T, E, K,
                            r.cfg.num_expert_groups);
  if (p.D <= 0 || !p.x || !p.gate || !p.counter || !r.logits || !r.ids || !r.weights || r.forced_ids)
    return invalid_argument("router_route: bad arguments");
  if (r.T == 0) return ok_status();
  RouteArgs a{r.logits, r.T, E, K, G, std::min(r.cfg.num_expert_groups_per_tok, G),
              r.cfg.scoring == RouterScoring::kSoftmax, r.cfg.renormalize, static_cast<float>(r.cfg.routed_scale),
              r.bias, r.ids, r.weights, nullptr};
  const size_t smem = static_cast<size_t>(kRouterThreads / 32) * (3 * E + G) * sizeof(float);
  const bool vec = p.D % 4 == 0 && p.D <= 4 * kRouterThreads * kRouterVec && aligned16(p.x) && aligned16(p.gate);
  RouterNorm norm;
  if (p.norm_w != nullptr) {
    if (!router_route_norm_supported(p))
      return unimplemented("router_route: the fused norm needs D % 4 == 0, D <= 8192 and distinct 16-byte rows");
    norm = {p.attn, p.residual, p.norm_w, p.eps, const_cast<float*>(p.x)};
  }
  launch_kernel(router_route_kernel, static_cast<unsigned>(E), kRouterThreads, smem, r.stream, p.x, p.D, p.gate,
                const_cast<float*>(r.logits), p.counter, vec, a, norm);
  return cuda_status(cudaGetLastError(), "router_route_kernel");
}

bool router_route_norm_supported(const RouterRouteParams& p) {
  return p.attn && p.residual && p.norm_w && p.D % 4 == 0 && p.D <= 4 * kRouterThreads * kRouterVec &&
         aligned16(p.x) && aligned16(p.gate) && aligned16(p.attn) && aligned16(p.residual) && aligned16(p.norm_w) &&
         p.attn != p.x && p.residual != p.x && p.attn != p.residual;
}

bool router_route_supported(const MoeConfig& cfg, int64_t T) {
  const int E = cfg.num_experts, K = cfg.num_experts_per_tok;
  return T >= 0 && T <= kRouterMaxT && E > 0 && E <= 256 && K > 0 && K <= kMaxTopK;
}

Status moe_permute(const MoePermuteParams& p) {
  if (p.T < 0 || p.K <= 0 || p.E <= 0 || p.E > 8192) return invalid_argument("moe_permute: bad shape");
  if (!p.ids || !p.offsets || !p.perm_token || !p.inv) return invalid_argument("moe_permute: null pointer");
  launch_kernel(permute_kernel, 1, 256, (p.E + 1) * sizeof(int32_t), p.stream, p.ids, p.T * p.K, p.E, p.offsets,
                p.perm_token, p.inv, p.K, p.active);
  return cuda_status(cudaGetLastError(), "permute_kernel");
}

Status gather_rows(const float* x, int64_t D, const int32_t* rows, int64_t n, float* out, cudaStream_t stream) {
  if (n < 0 || D <= 0) return invalid_argument("gather_rows: bad shape");
  if (n == 0) return ok_status();
  if (D % 4 == 0 && aligned16(x) && aligned16(out)) {
    const int64_t D4 = D / 4;
    const dim3 grid(static_cast<unsigned>((D4 + 255) / 256), static_cast<unsigned>(std::min<int64_t>(n, 65535)));
    launch_kernel(gather_rows_vec_kernel, grid, 256, 0, stream, reinterpret_cast<const float4*>(x), D4, rows, n,
                  reinterpret_cast<float4*>(out));
    return cuda_status(cudaGetLastError(), "gather_rows_vec_kernel");
  }
  launch_kernel(gather_rows_kernel, static_cast<unsigned>(n), 256, 0, stream, x, D, rows, out);
  return cuda_status(cudaGetLastError(), "gather_rows_kernel");
}

Status moe_combine(const MoeCombineParams& p) {
  if (p.T < 0 || p.K <= 0 || p.D <= 0) return invalid_argument("moe_combine: bad shape");
  if (p.T == 0) return ok_status();
  if (!p.y_perm || !p.inv || !p.weights || !p.out) return invalid_argument("moe_combine: null pointer");
  if (p.D % 4 == 0 && aligned16(p.y_perm) && aligned16(p.out) && (!p.shared || aligned16(p.shared))) {
    const int64_t D4 = p.D / 4;
    const dim3 grid(static_cast<unsigned>((D4 + 255) / 256), static_cast<unsigned>(std::min<int64_t>(p.T, 65535)));
    launch_kernel(combine_vec_kernel, grid, 256, 0, p.stream, reinterpret_cast<const float4*>(p.y_perm), p.inv,
                  p.weights, p.K, D4, p.T, reinterpret_cast<const float4*>(p.shared), reinterpret_cast<float4*>(p.out));
    return cuda_status(cudaGetLastError(), "combine_vec_kernel");
  }
  launch_kernel(combine_kernel, static_cast<unsigned>(p.T), 256, 0, p.stream, p.y_perm, p.inv, p.weights, p.K, p.D,
                p.shared, p.out);
  return cuda_status(cudaGetLastError(), "combine_kernel");
}

Status MoeScratch::reserve(int64_t rows, int64_t D, int64_t I, int E, bool grouped_gemm) {
  if (rows <= max_rows && (!grouped_gemm || max_tiles > 0)) return ok_status();
  ML4_ASSIGN_OR_RETURN(xs, DeviceBuffer::alloc(rows * D * 4));
  // g, u, y: the routed rows, then (grouped decode path) the shared expert's T <= rows.
  ML4_ASSIGN_OR_RETURN(g, DeviceBuffer::alloc(2 * rows * I * 4));
  ML4_ASSIGN_OR_RETURN(u, DeviceBuffer::alloc(2 * rows * I * 4));
  ML4_ASSIGN_OR_RETURN(y, DeviceBuffer::alloc(2 * rows * D * 4));
  ML4_ASSIGN_OR_RETURN(offsets, DeviceBuffer::alloc((E + 2) * 4));
  ML4_ASSIGN_OR_RETURN(active, DeviceBuffer::alloc((E + 1) * 4));
  // The routed rows, then (grouped paths) the shared expert's T <= rows.
  ML4_ASSIGN_OR_RETURN(perm_token, DeviceBuffer::alloc(2 * rows * 4));
  ML4_ASSIGN_OR_RETURN(inv, DeviceBuffer::alloc(rows * 4));
  ML4_ASSIGN_OR_RETURN(row_src, DeviceBuffer::alloc(rows * 4));
  ML4_ASSIGN_OR_RETURN(gemv_ws, DeviceBuffer::alloc(gemv_workspace_floats(std::min<int64_t>(rows, kGemvMaxM), 1,
                                                                           1) * std::max(D, I) * 4));
  const int64_t wide = std::max(D, I);
  ML4_RETURN_IF_ERROR(lin.reserve(rows * wide, rows * ((wide + 127) / 128)));
  max_tiles = 0;
  for (DeviceBuffer* d : {&cursor, &tiles, &num_tiles, &tile_first, &q, &q_scale, &tiles2, &tile_first2}) *d = DeviceBuffer{};
  if (grouped_gemm) {
    const int64_t tiles_max = moe_gemm_max_tiles(2 * rows, E + 1);
    ML4_ASSIGN_OR_RETURN(cursor, DeviceBuffer::alloc((E + 1) * 4));
    ML4_ASSIGN_OR_RETURN(tiles, DeviceBuffer::alloc(tiles_max * sizeof(MoeTile)));
    ML4_ASSIGN_OR_RETURN(tiles2, DeviceBuffer::alloc(tiles_max * sizeof(MoeTile)));
    ML4_ASSIGN_OR_RETURN(num_tiles, DeviceBuffer::alloc(12));  // the tile count, a work counter, the second count
    ML4_ASSIGN_OR_RETURN(tile_first, DeviceBuffer::alloc((E + 2) * 4));
    ML4_ASSIGN_OR_RETURN(tile_first2, DeviceBuffer::alloc((E + 2) * 4));
    ML4_ASSIGN_OR_RETURN(q, DeviceBuffer::alloc(2 * rows * wide));
    ML4_ASSIGN_OR_RETURN(q_scale, DeviceBuffer::alloc(2 * rows * ((wide + 127) / 128) * 4));
    max_tiles = tiles_max;
  }
  host_offsets.resize(E + 1);
  max_rows = rows;
  return ok_status();
}

Status mlp_forward(LtGemm& lt, const DeviceMlp& m, const float* x, int64_t M, float* out, MoeScratch& s,
                   cudaStream_t stream) {
  if (M == 0) return ok_status();
  if (M > s.max_rows) return out_of_range("mlp_forward: {} rows, scratch holds {}", M, s.max_rows);
  const int64_t I = m.w1.N;
  ML4_RETURN_IF_ERROR(linear_f32(lt, m.w1, x, M, s.g.as<float>(), s.lin, stream));
  ML4_RETURN_IF_ERROR(linear_f32(lt, m.w3, x, M, s.u.as<float>(), s.lin, stream));
  ML4_RETURN_IF_ERROR(silu_mul({s.g.as<float>(), s.u.as<float>(), M, I, 0, 0, s.g.as<float>(), nullptr, stream}));
  return linear_f32(lt, m.w2, s.g.as<float>(), M, out, s.lin, stream);
}

Status moe_experts_forward(LtGemm& lt, const std::vector<DeviceMlp>& experts, const DeviceMlp* shared,
                           const float* x, int64_t T, int64_t D, const int32_t* ids, const float* weights, int K,
                           float* out, MoeScratch& s, cudaStream_t stream) {
  const int E = static_cast<int>(experts.size());
  if (T == 0) return ok_status();
  if (T * K > s.max_rows) return out_of_range("moe: {} expert rows, scratch holds {}", T * K, s.max_rows);
  ML4_RETURN_IF_ERROR(moe_permute({ids, T, K, E, s.offsets.as<int32_t>(), s.perm_token.as<int32_t>(),
                                   s.inv.as<int32_t>(), stream}));
  ML4_RETURN_IF_ERROR(gather_rows(x, D, s.perm_token.as<int32_t>(), T * K, s.xs.as<float>(), stream));
  // Graph break: the per-expert row counts decide the GEMM shapes.
  ML4_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.host_offsets.data(), s.offsets.data(), (E + 1) * 4,
                                           cudaMemcpyDeviceToHost, stream));
  ML4_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  // Experts write disjoint row ranges of y; the MLP's own scratch (g, u) is reused in
  // turn, so rows go through it at offset 0 and results land at the expert's offset.
  for (int e = 0; e < E; ++e) {
    const int64_t r0 = s.host_offsets[e], n = s.host_offsets[e + 1] - r0;
    if (n == 0) continue;
    ML4_RETURN_IF_ERROR(mlp_forward(lt, experts[e], s.xs.as<float>() + r0 * D, n, s.y.as<float>() + r0 * D, s, stream)
                            .with_context("expert " + std::to_string(e)));
  }
  const float* sh = nullptr;
  if (shared) {
    // The shared expert's output goes through xs (its gathered copy is no longer needed).
    ML4_RETURN_IF_ERROR(mlp_forward(lt, *shared, x, T, s.xs.as<float>(), s, stream).with_context("shared expert"));
    sh = s.xs.as<float>();
  }
  return moe_combine({s.y.as<float>(), s.inv.as<int32_t>(), weights, T, K, D, sh, out, stream});
}

Result<MoeExpertTables> build_expert_tables(const std::vector<DeviceMlp>& experts, const DeviceMlp* shared) {
  MoeExpertTables t;
  if (experts.empty()) return invalid_argument("build_expert_tables: no experts");
  const DeviceMlp& e0 = experts[0];
  t.format = e0.w1.format;
  t.E = static_cast<int>(experts.size());
  t.D = e0.w1.K;
  t.I = e0.w1.N;
  std::vector<const void*> w1, w2, w3;
  std::vector<const float*> s1, s2, s3;
  for (size_t e = 0; e < experts.size(); ++e) {
    const DeviceMlp& m = experts[e];
    for (const DeviceLinear* l : {&m.w1, &m.w2, &m.w3})
      if (l->format != t.format)
        return invalid_argument("expert {}: {} is {}, expert 0 is {}", e, l->name, linear_format_name(l->format),
                                linear_format_name(t.format));
    if (m.w1.N != t.I || m.w3.N != t.I || m.w1.K != t.D || m.w3.K != t.D || m.w2.N != t.D || m.w2.K != t.I)
      return invalid_argument("expert {}: shapes differ from expert 0", e);
    w1.push_back(m.w1.weight.data());
    w2.push_back(m.w2.weight.data());
    w3.push_back(m.w3.weight.data());
    s1.push_back(m.w1.scale.as<float>());
    s2.push_back(m.w2.scale.as<float>());
    s3.push_back(m.w3.scale.as<float>());
  }
  if (shared && shared->w1.format == t.format && shared->w2.format == t.format && shared->w3.format == t.format &&
      shared->w1.N == t.I && shared->w3.N == t.I && shared->w1.K == t.D && shared->w3.K == t.D &&
      shared->w2.N == t.D && shared->w2.K == t.I) {
    t.shared_slot = true;
    w1.push_back(shared->w1.weight.data());
    w2.push_back(shared->w2.weight.data());
    w3.push_back(shared->w3.weight.data());
    s1.push_back(shared->w1.scale.as<float>());
    s2.push_back(shared->w2.scale.as<float>());
    s3.push_back(shared->w3.scale.as<float>());
  }
  const size_t b = w1.size() * sizeof(void*);
  for (auto [buf, src] : {std::pair<DeviceBuffer*, const void*>{&t.w1, w1.data()}, {&t.w2, w2.data()},
                          {&t.w3, w3.data()}, {&t.s1, s1.data()}, {&t.s2, s2.data()}, {&t.s3, s3.data()}}) {
    ML4_ASSIGN_OR_RETURN(*buf, DeviceBuffer::alloc(b));
    ML4_RETURN_IF_ERROR(buf->upload(src, b));
  }
  if (t.format == LinearFormat::kFP8Block) {  // the grouped GEMM's TMA boxes (none: it uses cp.async)
    const int n = static_cast<int>(w1.size());
    std::vector<uint8_t> maps(5 * n * static_cast<size_t>(kMoeTensorMapBytes));
    uint8_t* const m1 = maps.data();
    uint8_t* const m3 = m1 + n * kMoeTensorMapBytes;
    uint8_t* const m2 = m3 + n * kMoeTensorMapBytes;
    uint8_t* const m1s = m2 + n * kMoeTensorMapBytes;
    uint8_t* const m3s = m1s + n * kMoeTensorMapBytes;
    if (moe_weight_tensor_maps(w1.data(), n, t.I, t.D, m1).ok() &&
        moe_weight_tensor_maps(w3.data(), n, t.I, t.D, m3).ok() &&
        moe_weight_tensor_maps(w2.data(), n, t.D, t.I, m2).ok() &&
        moe_weight_tensor_maps(w1.data(), n, t.I, t.D, m1s, 8).ok() &&
        moe_weight_tensor_maps(w3.data(), n, t.I, t.D, m3s, 8).ok()) {
      for (auto [buf, src] : {std::pair<DeviceBuffer*, const uint8_t*>{&t.t1, m1}, {&t.t3, m3}, {&t.t2, m2},
                              {&t.t1s, m1s}, {&t.t3s, m3s}}) {
        ML4_ASSIGN_OR_RETURN(*buf, DeviceBuffer::alloc(n * kMoeTensorMapBytes));
        ML4_RETURN_IF_ERROR(buf->upload(src, n * kMoeTensorMapBytes));
      }
    }
  }
  return std::move(t);
}

Status mlp_forward_gemv(const DeviceMlp& m, const float* x, int64_t M, float* out, MoeScratch& s,
                        cudaStream_t stream, GemvImpl impl) {
  if (M == 0) return ok_status();
  if (M > s.max_rows || M > kGemvMaxM) return out_of_range("mlp_forward_gemv: {} rows", M);
  const int64_t I = m.w1.N;
  auto run = [&](const DeviceLinear& l, const float* in, float* o) {
    return gemv({in, M, l.N, l.K, l.format, l.weight.data(), l.scale.as<float>(), o, s.gemv_ws.as<float>(), stream,
                 impl});
  };
  ML4_RETURN_IF_ERROR(run(m.w1, x, s.g.as<float>()));
  ML4_RETURN_IF_ERROR(run(m.w3, x, s.u.as<float>()));
  ML4_RETURN_IF_ERROR(silu_mul({s.g.as<float>(), s.u.as<float>(), M, I, 0, 0, s.g.as<float>(), nullptr, stream}));
  return run(m.w2, s.g.as<float>(), out);
}

Status moe_experts_forward_grouped(const MoeExpertTables& tb, const DeviceMlp* shared, const float* x, int64_t T,
                                   const int32_t* ids, const float* weights, int K, float* out, MoeScratch& s,
                                   cudaStream_t stream, int x_parts, MoeSharedPart part) {
  if (T == 0) return ok_status();
  const int64_t n = T * K, D = tb.D, I = tb.I;
  if (n > s.max_rows) return out_of_range("moe grouped: {} expert rows, scratch holds {}", n, s.max_rows);
  if (K <= 0 || K > tb.E) return invalid_argument("moe grouped: {} experts per token of {}", K, tb.E);
  // The shared expert joins the routed launches as their extra slot when it has the routed
  // experts' format and shape; otherwise it runs first through the GEMV, 8 rows at a time
  // (into xs, using g/u as its scratch before the routed experts need them).
  const bool fused = shared && shared->w1.format == tb.format && shared->w2.format == tb.format &&
                     shared->w3.format == tb.format && shared->w1.N == I && shared->w3.N == I &&
                     shared->w1.K == D && shared->w3.K == D && shared->w2.N == D && shared->w2.K == I;
  const bool shared_only = part.mode == MoeSharedPart::kSharedOnly;
  const bool routed_only = part.mode == MoeSharedPart::kRoutedOnly;
  if (part.mode != MoeSharedPart::kWhole && !fused)
    return invalid_argument("moe grouped: the shared expert split from the routed ones needs it in the extra slot");
  if (shared && !fused) {
    for (int64_t t0 = 0; t0 < T; t0 += kGemvMaxM) {
      const int64_t m = std::min<int64_t>(kGemvMaxM, T - t0);
      ML4_RETURN_IF_ERROR(mlp_forward_gemv(*shared, x + t0 * D, m, s.xs.as<float>() + t0 * D, s, stream)
                              .with_context("shared expert"));
    }
  }
  if (!shared_only)
    ML4_RETURN_IF_ERROR(moe_permute({ids, T, K, tb.E, s.offsets.as<int32_t>(), s.perm_token.as<int32_t>(),
                                     s.inv.as<int32_t>(), stream, s.active.as<int32_t>()}));
  // The slots each launch serves: the routed experts (max_active, read from s.active on the
  // device) unless shared_only, the extra (shared) one unless routed_only.
  const bool with_extra = fused && !routed_only;
  auto params = [&](const DeviceBuffer& table, const DeviceBuffer& stable, const DeviceLinear* extra, const float* in,
                    const int32_t* row_src, int64_t N, int64_t Kd, int64_t extra_x_row0, float* y) {
    GroupedGemvParams p;
    p.x = in;
    p.rows = n;
    p.N = N;
    p.K = Kd;
    p.format = tb.format;
    p.row_src = row_src;
    p.w_table = static_cast<const void* const*>(table.data());
    p.s_table = static_cast<const float* const*>(stable.data());
    p.y = y;
    p.stream = stream;
    p.offsets = s.offsets.as<int32_t>();
    p.active = s.active.as<int32_t>();
    p.max_active = shared_only ? 0 : static_cast<int>(std::min<int64_t>(tb.E, n));
    p.max_expert_rows = T;  // routed: <= T rows unless forced ids repeat (only picks the kernel); shared: T
    p.x_parts = x_parts;
    if (extra) {
      p.extra_w = extra->weight.data();
      p.extra_s = extra->scale.as<float>();
      p.extra_rows = T;
      p.extra_x_row0 = extra_x_row0;
      p.extra_y_row0 = n;
    }
    return p;
  };
  auto run = [&](const DeviceBuffer& table, const DeviceBuffer& stable, const DeviceLinear* extra, const float* in,
                 const int32_t* row_src, int64_t N, int64_t Kd, int64_t extra_x_row0, float* y) {
    return grouped_gemv(params(table, stable, extra, in, row_src, N, Kd, extra_x_row0, y));
  };
  float* g = s.g.as<float>();
  float* u = s.u.as<float>();
  float* y = s.y.as<float>();
  const int32_t* tok = s.perm_token.as<int32_t>();
  {  // gate and up projections in one launch (two on the tensor-core path): same rows, same x
    GroupedGemvParams p = params(tb.w1, tb.s1, with_extra ? &shared->w1 : nullptr, x, tok, I, D, 0, g);
    p.w_table2 = static_cast<const void* const*>(tb.w3.data());
    p.s_table2 = static_cast<const float* const*>(tb.s3.data());
    if (with_extra) {
      p.extra_w2 = shared->w3.weight.data();
      p.extra_s2 = shared->w3.scale.as<float>();
    }
    p.y2 = u;
    ML4_RETURN_IF_ERROR(grouped_gemv(p));
  }
  // SiLU is elementwise: the rows in one launch or split between the two parts, the same bits.
  const int64_t row0 = shared_only ? n : 0, rows = (shared_only ? 0 : n) + (with_extra ? T : 0);
  ML4_RETURN_IF_ERROR(silu_mul({g + row0 * I, u + row0 * I, rows, I, 0, 0, g + row0 * I, nullptr, stream}));
  ML4_RETURN_IF_ERROR(run(tb.w2, tb.s2, with_extra ? &shared->w2 : nullptr, g, nullptr, D, I, n, y));
  if (shared_only) return ok_status();
  if (part.shared_ready)
    ML4_RETURN_IF_ERROR(cuda_status(cudaStreamWaitEvent(stream, part.shared_ready, 0), "moe grouped: shared expert"));
  const float* sh = fused ? y + n * D : shared ? s.xs.as<float>() : nullptr;
  return moe_combine({y, s.inv.as<int32_t>(), weights, T, K, D, sh, out, stream});
}

bool moe_gemm_supported(const MoeExpertTables& tb, const DeviceMlp* shared, bool lt_available) {
  if (tb.D % 128 != 0 || tb.I % 128 != 0) return false;
  if (tb.format == LinearFormat::kFP8Block) return !shared || tb.shared_slot;
  const bool fp4 = tb.format == LinearFormat::kNVFP4 || tb.format == LinearFormat::kMXFP4;
  return fp4 && (!shared || tb.shared_slot || lt_available);
}

namespace {


// moe_experts_forward_gemm for NVFP4 / MXFP4 experts (moe_grouped_gemm_fp4): x cast to bf16
// once per token (into u, unused on this path), gate and up with silu into bf16 hidden rows
// (q), the down projection into y. A shared expert outside the tables' slot (NVFP4
// checkpoints keep it FP8) runs first through mlp_forward into xs.
Status moe_gemm_fp4_layers(const MoeExpertTables& tb, const DeviceMlp* shared, const float* x, int64_t T,
                           const float* weights, int K, float* out, MoeScratch& s, cudaStream_t stream, int64_t tiles,
                           bool slot) {
  const int64_t n = T * K, D = tb.D, I = tb.I;
  if (static_cast<int64_t>(s.u.bytes()) < T * D * 2 || static_cast<int64_t>(s.q.bytes()) < (n + (slot ? T : 0)) * I * 2)
    return internal_error("moe grouped GEMM fp4: scratch too small for T={} D={} I={}", T, D, I);
  MoeGroupedGemmFp4Params g;
  g.nvfp4 = tb.format == LinearFormat::kNVFP4;
  g.tiles = s.tiles.as<MoeTile>();
  g.num_tiles = s.num_tiles.as<int32_t>();
  g.max_tiles = tiles;
  g.stream = stream;
  ML4_RETURN_IF_ERROR(cast_f32_bf16(x, T * D, s.u.data(), stream));
  gate_up_weights(g, tb);
  g.a = s.u.data();
  g.a_rows = s.perm_token.as<int32_t>();
  g.y_bf16 = s.q.data();
  ML4_RETURN_IF_ERROR(moe_grouped_gemm_fp4(g));
  down_weights(g, tb);
  g.a = s.q.data();
  g.a_rows = nullptr;
  g.y_bf16 = nullptr;
  g.y = s.y.as<float>();
  ML4_RETURN_IF_ERROR(moe_grouped_gemm_fp4(g));
  const float* y = s.y.as<float>();
  const float* sh = slot ? y + n * D : shared ? s.xs.as<float>() : nullptr;
  return moe_combine({y, s.inv.as<int32_t>(), weights, T, K, D, sh, out, stream});
}

}  // namespace

Status moe_experts_forward_gemm(const MoeExpertTables& tb, const DeviceMlp* shared, const float* x, int64_t T,
                                const int32_t* ids, const float* weights, int K, float* out, MoeScratch& s,
                                cudaStream_t stream, LtGemm* lt, MoeGemmOptions gemm) {
  if (T == 0) return ok_status();
  if (!moe_gemm_supported(tb, shared, lt != nullptr))
    return invalid_argument("moe grouped GEMM: needs FP8 block or FP4 experts with D, I % 128 == 0 and a shared "
                            "expert of their shape (FP4: or an LtGemm for it) (format {}, D {}, I {})",
                            linear_format_name(tb.format), tb.D, tb.I);
  const int64_t n = T * K, D = tb.D, I = tb.I;
  if (n > s.max_rows) return out_of_range("moe grouped GEMM: {} expert rows, scratch holds {}", n, s.max_rows);
  if (K <= 0 || K > tb.E) return invalid_argument("moe grouped GEMM: {} experts per token of {}", K, tb.E);
  const bool fp4 = tb.format != LinearFormat::kFP8Block;
  const bool slot = shared != nullptr && tb.shared_slot;
  if (fp4 && shared && !slot)  // before the scratch below is reused: mlp_forward writes g, u and xs
    ML4_RETURN_IF_ERROR(mlp_forward(*lt, *shared, x, T, s.xs.as<float>(), s, stream).with_context("shared expert"));
  const int64_t rows = n + (slot ? T : 0);
  const bool swap = gemm.swap && !fp4;  // moe_grouped_gemm refuses it without the tables' tensor maps
  const bool specialized = gemm.specialized && !fp4 && !swap;
  const bool tall = ((gemm.tall && !fp4) || specialized) && !swap;
  const int tile_rows = swap ? kMoeGemmSwapTileRows : tall ? kMoeGemmTallTileRows : kMoeGemmTileRows;
  const int64_t tiles = moe_gemm_max_tiles(rows, tb.E + (slot ? 1 : 0), tile_rows);
  if (tiles > s.max_tiles)
    return internal_error("moe grouped GEMM: {} tiles, the scratch holds {} (reserved without grouped_gemm?)", tiles,
                          s.max_tiles);
  MoePermuteGemmParams pp;
  pp.ids = ids;
  pp.T = T;
  pp.K = K;
  pp.E = tb.E;
  pp.shared_slot = slot;
  pp.cursor = s.cursor.as<int32_t>();
  pp.offsets = s.offsets.as<int32_t>();
  pp.perm_token = s.perm_token.as<int32_t>();
  pp.inv = s.inv.as<int32_t>();
  pp.tiles = s.tiles.as<MoeTile>();
  pp.num_tiles = s.num_tiles.as<int32_t>();
  pp.max_tiles = s.max_tiles;
  pp.tile_rows = tile_rows;
  // The group-major order's table, only when an FP8 launch below reads it.
  const bool group_major = gemm.group_major && !fp4;
  pp.tile_first = group_major ? s.tile_first.as<int32_t>() : nullptr;
  pp.stream = stream;
  // swap_down: the down projection's own list of swap tiles.
  const bool swap_down = gemm.swap_down && !fp4 && !swap && tb.t2.data() != nullptr;
  const int64_t tiles2 = swap_down ? moe_gemm_max_tiles(rows, tb.E + (slot ? 1 : 0), kMoeGemmSwapTileRows) : 0;
  if (swap_down) {
    pp.tiles2 = s.tiles2.as<MoeTile>();
    pp.num_tiles2 = s.num_tiles.as<int32_t>() + 2;
    pp.max_tiles2 = s.max_tiles;
    pp.tile_rows2 = kMoeGemmSwapTileRows;
    pp.tile_first2 = group_major ? s.tile_first2.as<int32_t>() : nullptr;
  }
  ML4_RETURN_IF_ERROR(moe_permute_gemm(pp));
  if (fp4) return moe_gemm_fp4_layers(tb, shared, x, T, weights, K, out, s, stream, tiles, slot);
  auto quant = [&](const float* in, int64_t M, int64_t cols) {
    Fp8ActQuantParams q;
    q.x = in;
    q.x_dtype = DType::kF32;
    q.M = M;
    q.K = cols;
    q.group = 128;
    q.q = s.q.data();
    q.scale = s.q_scale.as<float>();
    q.scale_layout = ScaleLayout::kRowMajor;
    q.stream = stream;
    return fp8_act_quant(q);
  };
  MoeGroupedGemmParams g;
  g.a = s.q.data();
  g.a_scale = s.q_scale.as<float>();
  g.tiles = s.tiles.as<MoeTile>();
  g.num_tiles = s.num_tiles.as<int32_t>();
  g.max_tiles = tiles;
  g.stream = stream;
  g.work_counter = s.num_tiles.as<int32_t>() + 1;
  g.overlap = gemm.overlap && !tall;
  g.tall = tall && !specialized;
  g.specialized = specialized;
  g.swap = swap;
  const bool tma = (specialized && gemm.tma) || swap;
  if (group_major) {
    g.tile_first = s.tile_first.as<int32_t>();
    g.groups = tb.E + (slot ? 1 : 0);
  }
  // Gate and up with silu: x's rows (quantized once per token) gathered through perm_token.
  ML4_RETURN_IF_ERROR(quant(x, T, D));
  gate_up_weights(g, tb);
  g.w_tmap = !tma ? nullptr : swap ? tb.t1s.data() : tb.t1.data();  // swap: boxes of 8 rows
  g.w_up_tmap = !tma ? nullptr : swap ? tb.t3s.data() : tb.t3.data();
  g.a_rows = s.perm_token.as<int32_t>();
  g.y = s.g.as<float>();
  // The gate_up kernel quantizes the hidden rows itself, into s.g's memory (e4m3 rows, then the
  // scales 256-aligned: rows x I x (1 + 4 / 128) bytes of the 2 x max_rows x I x 4 held).
  const bool quant_epilogue = gemm.quant_epilogue && I % 128 == 0 && (specialized || !tall) && !swap;
  uint8_t* const hq = s.g.as<uint8_t>();
  float* const hq_scale = reinterpret_cast<float*>(hq + (rows * I + 255) / 256 * 256);
  if (quant_epilogue) {
    g.y_q = hq;
    g.y_q_scale = hq_scale;
  }
  ML4_RETURN_IF_ERROR(moe_grouped_gemm(g));
  g.y_q = nullptr;
  g.y_q_scale = nullptr;
  // Down: the hidden rows quantized in permuted order.
  if (quant_epilogue) {
    g.a = hq;
    g.a_scale = hq_scale;
  } else {
    ML4_RETURN_IF_ERROR(quant(s.g.as<float>(), rows, I));
  }
  down_weights(g, tb);
  g.w_tmap = tma || swap_down ? tb.t2.data() : nullptr;
  g.w_up_tmap = nullptr;
  g.a_rows = nullptr;
  g.y = s.y.as<float>();
  if (swap_down) {  // the swapped kernel over its own tiles (its 64-row boxes of W2: tb.t2)
    g.swap = true;
    g.tiles = s.tiles2.as<MoeTile>();
    g.num_tiles = s.num_tiles.as<int32_t>() + 2;
    g.max_tiles = tiles2;
    if (group_major) g.tile_first = s.tile_first2.as<int32_t>();
  }
  ML4_RETURN_IF_ERROR(moe_grouped_gemm(g));
  const float* y = s.y.as<float>();
  return moe_combine({y, s.inv.as<int32_t>(), weights, T, K, D, slot ? y + n * D : nullptr, out, stream});
}

Status moe_experts_forward_rowwise(const MoeExpertTables& tb, const DeviceMlp* shared, const float* x, int64_t T,
                                   const int32_t* ids, const float* weights, int K, float* out, MoeScratch& s,
                                   cudaStream_t stream) {
  if (T == 0) return ok_status();
  if (T > kGemvMaxM) return out_of_range("moe rowwise: {} tokens (at most {})", T, kGemvMaxM);
  const int64_t n = T * K;
  if (n > s.max_rows) return out_of_range("moe grouped: {} expert rows, scratch holds {}", n, s.max_rows);
  launch_kernel(decode_rows_kernel, static_cast<unsigned>((n + 255) / 256), 256, 0, stream, n, K,
                s.row_src.as<int32_t>(), s.inv.as<int32_t>());
  ML4_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const auto w1 = static_cast<const void* const*>(tb.w1.data()), w2 = static_cast<const void* const*>(tb.w2.data()),
             w3 = static_cast<const void* const*>(tb.w3.data());
  const auto s1 = static_cast<const float* const*>(tb.s1.data()), s2 = static_cast<const float* const*>(tb.s2.data()),
             s3 = static_cast<const float* const*>(tb.s3.data());
  ML4_RETURN_IF_ERROR(grouped_gemv({x, n, tb.I, tb.D, tb.format, ids, s.row_src.as<int32_t>(), w1, s1, s.g.as<float>(), stream}));
  ML4_RETURN_IF_ERROR(grouped_gemv({x, n, tb.I, tb.D, tb.format, ids, s.row_src.as<int32_t>(), w3, s3, s.u.as<float>(), stream}));
  ML4_RETURN_IF_ERROR(silu_mul({s.g.as<float>(), s.u.as<float>(), n, tb.I, 0, 0, s.g.as<float>(), nullptr, stream}));
  ML4_RETURN_IF_ERROR(grouped_gemv({s.g.as<float>(), n, tb.D, tb.I, tb.format, ids, nullptr, w2, s2, s.y.as<float>(), stream}));
  const float* sh = nullptr;
  if (shared) {
    ML4_RETURN_IF_ERROR(mlp_forward_gemv(*shared, x, T, s.xs.as<float>(), s, stream, GemvImpl::kCudaCore).with_context("shared expert"));
    sh = s.xs.as<float>();
  }
  return moe_combine({s.y.as<float>(), s.inv.as<int32_t>(), weights, T, K, tb.D, sh, out, stream});
}

}  // namespace ml4::cuda
