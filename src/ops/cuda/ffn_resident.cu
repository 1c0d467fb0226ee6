// See ffn_resident.h.
#include "ops/cuda/ffn_resident.h"

#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "ops/cuda/cuda_common.h"
#include "ops/cuda/fault.cuh"
#include "ops/cuda/gemv_stream.cuh"
#include "ops/cuda/moe_route.cuh"
#include "ops/cuda/pdl.cuh"

namespace ml4::cuda {
namespace {

using gemv_stream::kStThreads;
using gemv_stream::kStWarps;

constexpr int kR = 4;  // weight rows per item
constexpr int kMaxT = kFfnResidentMaxTokens;
constexpr int kMaxK = kFfnResidentMaxTopK;
constexpr int kMaxRows = kMaxT * kMaxK + kMaxT;  // routed rows, then the always-run MLP's
constexpr int kNormVirtual = 256;                // rms_norm_vec_kernel's block: its f64 sum order
constexpr int kNormVec = 8;                      // float4s a virtual thread: D <= 8192
constexpr int kRouterVec = 16;                   // the router row's float4s a thread: D <= 8192
constexpr int kConv = gemv_stream::kConvF16Hw;   // the stream GEMV's default decoding (exact)
// Blocks a multiprocessor: three, the stream GEMV's count at M = 2 and 4 (170 registers a thread);
// at four (its M = 1 count, 128 registers) the item routines spilled in their loops.
constexpr int kBlocksPerSm = 3;
static_assert(kNormVirtual * kNormVec * 4 >= kFfnResidentMaxDim && kStThreads * kRouterVec * 4 >= kFfnResidentMaxDim);
static_assert(kNormVirtual == 2 * kStThreads);

using gemv_stream::BlockSync;

// The routing the blocks lay out in shared memory after the second barrier: as moe_permute
// (experts ascending, each expert's rows in (t, k) order).
struct Routing {
  int32_t ids[kMaxT * kMaxK];
  float wts[kMaxT * kMaxK];
  int32_t perm_token[kMaxT * kMaxK];  // token of permuted row i
  int32_t inv[kMaxT * kMaxK];         // permuted row of (t, k)
  int32_t expert[kMaxT * kMaxK];      // the active experts, ascending
  int32_t begin[kMaxT * kMaxK + 1];   // their rows [begin[j], begin[j + 1])
  int active;
};

// The rows [n0, n0 + kR) (clamped to N) of an FP8 matrix [N, K] into L2, by the block's
// threads: the block's next item, fetched while it finishes this one (or waits at a barrier).
__device__ __forceinline__ void prefetch_item(const void* w, int64_t N, int64_t K, int64_t n0) {
  if (w == nullptr || n0 >= N) return;
  const char* base = static_cast<const char*>(w) + n0 * K;
  const int64_t lines = (min(int64_t{kR}, N - n0) * K + 127) / 128;
  for (int64_t i = threadIdx.x; i < lines; i += blockDim.x) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + i * 128));
}

// Step 0, by block t for token t: residual[t] += attn_out[t], a[t] = rms(residual[t]) * w, with
// rms_norm_vec_kernel's arithmetic and f64 sum order: that kernel's thread th (256 a block)
// sums float4s th + 256 j over j; here thread tid plays th = tid (lo) and tid + 128 (hi), and
// the warp trees of lo's four warps and hi's four meet as that kernel's eight warps do. The
// summed row waits in shared memory (v) for the scaling.
__device__ __noinline__ void norm_row(const FfnResidentParams& p, int t, float* v, double* red8) {
  const int n4 = static_cast<int>(p.D / 4), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float4* x4 = reinterpret_cast<const float4*>(p.attn_out + t * p.D);
  float4* r4 = reinterpret_cast<float4*>(p.residual + t * p.D);
  float4* v4 = reinterpret_cast<float4*>(v);
  double ss[2] = {0.0, 0.0};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float4 xv[kNormVec], rv[kNormVec];
#pragma unroll
    for (int j = 0; j < kNormVec; ++j) {
      const int i = tid + h * kStThreads + j * kNormVirtual;
      if (i < n4) {
        xv[j] = x4[i];
        rv[j] = r4[i];
      }
    }
#pragma unroll
    for (int j = 0; j < kNormVec; ++j) {
      const int i = tid + h * kStThreads + j * kNormVirtual;
      if (i < n4) {
        float4 a = xv[j];
        a.x += rv[j].x;
        a.y += rv[j].y;
        a.z += rv[j].z;
        a.w += rv[j].w;
        ss[h] += static_cast<double>(a.x) * a.x;
        ss[h] += static_cast<double>(a.y) * a.y;
        ss[h] += static_cast<double>(a.z) * a.z;
        ss[h] += static_cast<double>(a.w) * a.w;
        v4[i] = a;
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss[h] += __shfl_xor_sync(0xffffffffu, ss[h], o);
    if (lane == 0) red8[h * kStWarps + warp] = ss[h];
  }
  __syncthreads();
  if (warp == 0) {
    double s = lane < kNormVirtual / 32 ? red8[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) red8[kNormVirtual / 32] = s;
  }
  __syncthreads();
  const double total = red8[kNormVirtual / 32];
  const float inv = static_cast<float>(1.0 / sqrt(total / static_cast<double>(p.D) + static_cast<double>(p.eps)));
  const float4* w4 = reinterpret_cast<const float4*>(p.norm_w);
  float4* a4 = reinterpret_cast<float4*>(p.a + t * p.D);
  for (int i = tid; i < n4; i += kStThreads) {
    const float4 a = v4[i], w = __ldg(w4 + i);
    r4[i] = a;
    a4[i] = make_float4(a.x * inv * w.x, a.y * inv * w.y, a.z * inv * w.z, a.w * inv * w.w);
  }
}

// Expert e's router logit for every token, with router_route_kernel's arithmetic and order:
// that kernel's thread i (256 a block) sums k = 4 (i + 256 j) .. +3 over j; here thread tid
// plays threads tid (lo) and tid + 128 (hi), and the warp sums of lo's four warps then hi's
// four meet in that kernel's warp order.
template <int M>
__device__ __noinline__ void router_item(const FfnResidentParams& p, int e, float (&red)[kStWarps][M * kR]) {
  const int n4 = static_cast<int>(p.D / 4), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float4* g4 = reinterpret_cast<const float4*>(p.gate + static_cast<int64_t>(e) * p.D);
  float acc[2][M];  // [lo, hi][token]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // h = 0: lo's float4s tid + 256 j, h = 1: hi's tid + 128 + 256 j (all of one half's gate
    // loads issued first).
    float4 gv[kRouterVec / 2];
#pragma unroll
    for (int j = 0; j < kRouterVec / 2; ++j) {
      const int i = tid + h * kStThreads + j * 2 * kStThreads;
      if (i < n4) gv[j] = __ldg(g4 + i);
    }
#pragma unroll
    for (int t = 0; t < M; ++t) {
      acc[h][t] = 0.0f;
      if (t >= p.T) continue;
      const float4* x4 = reinterpret_cast<const float4*>(p.a + t * p.D);
#pragma unroll
      for (int j = 0; j < kRouterVec / 2; ++j) {
        const int i = tid + h * kStThreads + j * 2 * kStThreads;
        if (i < n4) {
          const float4 xv = x4[i];
          acc[h][t] = fmaf(gv[j].x, xv.x, acc[h][t]);
          acc[h][t] = fmaf(gv[j].y, xv.y, acc[h][t]);
          acc[h][t] = fmaf(gv[j].z, xv.z, acc[h][t]);
          acc[h][t] = fmaf(gv[j].w, xv.w, acc[h][t]);
        }
      }
    }
  }
  // red[warp][t] holds lo's warp sums, red[warp][M + t] hi's (M * kR >= 2M).
#pragma unroll
  for (int t = 0; t < M; ++t) {
    const float a = gemv_stream::warp_sum(acc[0][t]), b = gemv_stream::warp_sum(acc[1][t]);
    if (lane == 0) {
      red[warp][t] = a;
      red[warp][M + t] = b;
    }
  }
  __syncthreads();
  if (tid < p.T) {
    float v = 0.0f;
    for (int w = 0; w < kStWarps; ++w) v += red[w][tid];
    for (int w = 0; w < kStWarps; ++w) v += red[w][M + tid];
    p.logits[tid * p.moe.num_experts + e] = v;
  }
  __syncthreads();
}

// Gate and up rows [n0, n0 + kR) of one FP8 MLP for the rows [r0, r1) of a (xmap: their token
// rows; a is read with plain loads: written in this kernel before a barrier), then SiLU(g) * u
// (silu_mul_kernel's expression) into hidden rows [r0, r1) of width I.
template <int M, int U>
__device__ __noinline__ void gate_up_item(const FfnResidentParams& p, const void* w1, const float* s1, const void* w3,
                             const float* s3, int64_t I, int64_t n0, const int32_t* xmap, int r0, int r1,
                             float* hidden, float (&red)[kStWarps][M * kR], float* g_st, float* u_st) {
  const int tid = threadIdx.x;
  auto st = [&](float* dst) { return [=](int64_t row, int r, float v) { dst[(row - r0) * kR + r] = v; }; };
  gemv_stream::stream_rows<M, kR, true, kConv, gemv_stream::kXPlain, U>(static_cast<const uint8_t*>(w1), s1, I, p.D, n0,
                                                                     p.a, xmap, 0, r0, r1, tid, red, BlockSync{},
                                                                     st(g_st));
  gemv_stream::stream_rows<M, kR, true, kConv, gemv_stream::kXPlain, U>(static_cast<const uint8_t*>(w3), s3, I, p.D, n0,
                                                                     p.a, xmap, 0, r0, r1, tid, red, BlockSync{},
                                                                     st(u_st));
  if (tid < (r1 - r0) * kR) {
    const int i = tid / kR, r = tid % kR;
    if (n0 + r < I) {
      const float gv = g_st[i * kR + r];
      hidden[(r0 + i) * I + n0 + r] = gv / (1.0f + expf(-gv)) * u_st[i * kR + r];
    }
  }
  __syncthreads();
}

// After the second barrier, in every block: each token routed by a warp (warp t: token t) from
// the logits (plain loads: written before the barrier), and moe_permute's layout over the T K <=
// 32 picks in shared memory; block 0 writes the routing out as the standard path does.
__device__ __noinline__ void route_tokens(const FfnResidentParams& p, const RouteArgs& ra, float* route_sm,
                                          Routing& rt) {
  const int T = p.T, K = p.moe.num_experts_per_tok;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, E = p.moe.num_experts;
  const int per = 3 * E + ra.G;
  if (warp < T) {
    float* sl = route_sm + warp * per;
    for (int e = lane; e < E; e += 32) sl[e] = p.logits[warp * E + e];
    __syncwarp();
    RouteArgs a = ra;
    a.ids = rt.ids;
    a.weights = rt.wts;
    route_row(a, warp, sl, sl + E);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // moe_permute's layout, over T * K <= 32 entries
    const int n = T * K;
    int na = 0;
    rt.begin[0] = 0;
    for (int last = -1;;) {  // the next larger expert id among the picks
      int e = 0x7fffffff;
      for (int i = 0; i < n; ++i)
        if (rt.ids[i] > last && rt.ids[i] < e) e = rt.ids[i];
      if (e == 0x7fffffff) break;
      int o = rt.begin[na];
      for (int i = 0; i < n; ++i)
        if (rt.ids[i] == e) {
          rt.perm_token[o] = i / K;
          rt.inv[i] = o;
          ++o;
        }
      rt.expert[na] = e;
      rt.begin[++na] = o;
      last = e;
    }
    rt.active = na;
  }
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x < T * K) {
    p.ids[threadIdx.x] = rt.ids[threadIdx.x];
    p.weights[threadIdx.x] = rt.wts[threadIdx.x];
  }
}

// Step 3's item: output rows [n0, n0 + kR): the down projection of every routed row (y rows
// 0 .. T K - 1, permuted order) and of the always-run MLP's (y rows T K + t), then moe_combine's
// sum into out.
template <int M, int U>
__device__ __noinline__ void down_item(const FfnResidentParams& p, const Routing& rt, int64_t n0, const float* hidden_mlp,
                          float (&red)[kStWarps][M * kR], float* y) {
  const bool moe = p.gate != nullptr;
  const int T = p.T, K = moe ? p.moe.num_experts_per_tok : 0, tid = threadIdx.x;
  const int64_t D = p.D, Ir = p.I_routed, Im = p.mlp.I;
  auto st = [&](int64_t row0) { return [=](int64_t row, int r, float v) { y[(row0 + row) * kR + r] = v; }; };
  if (moe) {
    for (int j = 0; j < rt.active; ++j) {
      const int e = rt.expert[j];
      gemv_stream::stream_rows<M, kR, true, kConv, gemv_stream::kXPlain, U>(
          static_cast<const uint8_t*>(p.w2_table[e]), p.s2_table[e], D, Ir, n0, p.hidden, nullptr, 0, rt.begin[j],
          rt.begin[j + 1], tid, red, BlockSync{}, st(0));
    }
  }
  if (p.mlp.w1) {
    gemv_stream::stream_rows<M, kR, true, kConv, gemv_stream::kXPlain, U>(
        static_cast<const uint8_t*>(p.mlp.w2), p.mlp.s2, D, Im, n0, hidden_mlp, nullptr, 0, 0, T, tid, red,
        BlockSync{}, st(T * K));
  }
  if (tid < T * kR) {
    const int t = tid / kR, r = tid % kR;
    if (n0 + r < D) {
      float acc = 0.0f;
      if (moe) {
        for (int k = 0; k < K; ++k) acc = fmaf(rt.wts[t * K + k], y[rt.inv[t * K + k] * kR + r], acc);
        if (p.mlp.w1) acc += y[(T * K + t) * kR + r];
      } else {
        acc = y[t * kR + r];
      }
      p.out[t * D + n0 + r] = acc;
    }
  }
  __syncthreads();
}

// One kStThreads-thread block per item at a time, kStMinBlocks(M) blocks a multiprocessor (the
// stream GEMV's own shape and register budget), every block resident (a cooperative launch).
// Values another block wrote before a barrier (a, the logits, the hidden rows) are read with
// plain loads: the barrier's fences order them (fault.cuh), and no block reads those addresses
// before the barrier.
template <int M, int U>
__global__ void __launch_bounds__(kStThreads, kBlocksPerSm)
    ffn_resident_kernel(const FfnResidentParams p, const RouteArgs ra) {
  pdl_wait();
  extern __shared__ float4 dyn4[];
  float* v = reinterpret_cast<float*>(dyn4);  // [D]: step 0's summed row
  float* route_sm = v + p.D;                  // [T][3E + groups]
  __shared__ float red[kStWarps][M * kR];
  __shared__ float stage[2][kMaxRows * kR];
  __shared__ double red8[kNormVirtual / 32 + 1];
  __shared__ Routing rt;
  const int NB = gridDim.x, b = blockIdx.x;
  const bool moe = p.gate != nullptr;
  const int T = p.T, K = moe ? p.moe.num_experts_per_tok : 0;
  const int64_t Ir = p.I_routed, Im = p.mlp.I;
  float* hidden_mlp = p.hidden + static_cast<int64_t>(T) * K * Ir;  // the always-run MLP's rows [T][Im]

  // Items' weights go to L2 one item ahead (prefetch_item): phase 1's and phase 3's are known
  // from the start, phase 2's once the block has routed.
  const int n_router = moe ? p.moe.num_experts : 0;
  const int n_mlp = p.mlp.w1 ? static_cast<int>((Im + kR - 1) / kR) : 0;
  const int n_down = static_cast<int>((p.D + kR - 1) / kR);
  auto prefetch1 = [&](int i) {
    if (!p.prefetch) return;
    if (i < n_router) {
      prefetch_item(p.gate + static_cast<int64_t>(i) * p.D, 1, p.D * 4, 0);
    } else if (i < n_router + n_mlp) {
      prefetch_item(p.mlp.w1, Im, p.D, int64_t{i - n_router} * kR);
      prefetch_item(p.mlp.w3, Im, p.D, int64_t{i - n_router} * kR);
    }
  };
  auto prefetch3 = [&](int i, bool routed) {
    if (!p.prefetch || i >= n_down) return;
    if (routed)
      for (int j = 0; j < rt.active; ++j) prefetch_item(p.w2_table[rt.expert[j]], p.D, Ir, int64_t{i} * kR);
    if (p.mlp.w1) prefetch_item(p.mlp.w2, p.D, Im, int64_t{i} * kR);
  };

  // 0. Token t's residual and normalized rows by block t (no other block reads either row);
  // meanwhile the others fetch their first item.
  if (b < T) norm_row(p, b, v, red8);
  prefetch1(b);
  if (b == p.never_arrive_block) return;  // the test switch
  if (!bounded_grid_sync(p.barrier, NB, p.fault, p.timeout_ns, 1)) return;

  // 1. Router logits (E items), then the always-run MLP's gate/up (Im / kR items).
  for (int i = b; i < n_router + n_mlp; i += NB) {
    prefetch1(i + NB);
    if (i < n_router)
      router_item<M>(p, i, red);
    else
      gate_up_item<M, U>(p, p.mlp.w1, p.mlp.s1, p.mlp.w3, p.mlp.s3, Im, int64_t{i - n_router} * kR, nullptr, 0, T,
                      hidden_mlp, red, stage[0], stage[1]);
  }
  if (!moe) prefetch3(b, false);
  if (!bounded_grid_sync(p.barrier, NB, p.fault, p.timeout_ns, 2)) return;

  if (moe) {
    route_tokens(p, ra, route_sm, rt);
    // 2. The routed experts' gate/up: (active expert, kR rows) items.
    const int per_e = static_cast<int>((Ir + kR - 1) / kR);
    auto prefetch2 = [&](int i) {
      if (!p.prefetch || i >= rt.active * per_e) return;
      const int e = rt.expert[i / per_e];
      prefetch_item(p.w1_table[e], Ir, p.D, int64_t{i % per_e} * kR);
      prefetch_item(p.w3_table[e], Ir, p.D, int64_t{i % per_e} * kR);
    };
    for (int i = b; i < rt.active * per_e; i += NB) {
      prefetch2(i + NB);
      const int j = i / per_e, e = rt.expert[j];
      gate_up_item<M, U>(p, p.w1_table[e], p.s1_table[e], p.w3_table[e], p.s3_table[e], Ir, int64_t{i % per_e} * kR,
                      rt.perm_token, rt.begin[j], rt.begin[j + 1], p.hidden, red, stage[0], stage[1]);
    }
    prefetch3(b, true);
    if (!bounded_grid_sync(p.barrier, NB, p.fault, p.timeout_ns, 3)) return;
  }  // a dense layer's hidden rows were complete at the second barrier

  // 3. The down projections and the combine, kR output rows an item.
  for (int i = b; i < n_down; i += NB) {
    prefetch3(i + NB, moe);
    down_item<M, U>(p, rt, int64_t{i} * kR, hidden_mlp, red, stage[0]);
  }
}

template <int M, int U>
Status launch(const FfnResidentParams& p, const RouteArgs& ra, size_t smem) {
  auto kernel = ffn_resident_kernel<M, U>;
  ML4_RETURN_IF_ERROR(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(smem)),
                                  "ffn_resident smem"));
  int per_sm = 0;
  ML4_RETURN_IF_ERROR(cuda_status(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStThreads, smem), "ffn_resident occupancy"));
  const int want = kBlocksPerSm;
  if (per_sm < want)
    return internal_error("ffn_resident: {} blocks a multiprocessor fit ({} bytes of shared memory), {} wanted", per_sm,
                          smem, want);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(want * sm_count()));
  cfg.blockDim = dim3(kStThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = p.stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cuda_status(cudaLaunchKernelEx(&cfg, kernel, p, ra), "ffn_resident_kernel");
}

}  // namespace

int64_t ffn_resident_hidden_floats(int T, int K, int64_t I_routed, int64_t I_mlp) {
  return static_cast<int64_t>(T) * K * I_routed + static_cast<int64_t>(T) * I_mlp;
}

Status ffn_resident(const FfnResidentParams& p) {
  const MoeConfig* moe = p.gate ? &p.moe : nullptr;
  const std::string why = ffn_resident_unsupported(p.D, moe, p.I_routed, p.mlp.w1 ? p.mlp.I : 0, p.T);
  if (!why.empty()) return invalid_argument("ffn_resident: unsupported shape: {}", why);
  if (!p.attn_out || !p.residual || !p.norm_w || !p.a || !p.hidden || !p.out || !p.barrier || !p.fault)
    return invalid_argument("ffn_resident: null pointer");
  if (p.mlp.w1 && (!p.mlp.w2 || !p.mlp.w3 || !p.mlp.s1 || !p.mlp.s2 || !p.mlp.s3))
    return invalid_argument("ffn_resident: incomplete MLP");
  if (moe && (!p.w1_table || !p.w2_table || !p.w3_table || !p.s1_table || !p.s2_table || !p.s3_table || !p.logits ||
              !p.ids || !p.weights))
    return invalid_argument("ffn_resident: incomplete MoE");
  if (!aligned16(p.attn_out) || !aligned16(p.residual) || !aligned16(p.norm_w) || !aligned16(p.a) || !aligned16(p.hidden) ||
      (p.gate && !aligned16(p.gate)))
    return invalid_argument("ffn_resident: rows must be 16-byte aligned");
  RouteArgs ra{};
  int groups = 1;
  if (moe) {
    groups = std::max(p.moe.num_expert_groups, 1);
    ra = RouteArgs{p.logits, p.T, p.moe.num_experts, p.moe.num_experts_per_tok, groups,
                   std::min(p.moe.num_expert_groups_per_tok, groups), p.moe.scoring == RouterScoring::kSoftmax,
                   p.moe.renormalize, static_cast<float>(p.moe.routed_scale), p.bias, nullptr, nullptr, nullptr};
  }
  const int E = moe ? p.moe.num_experts : 0;
  const size_t smem = (static_cast<size_t>(p.D) + static_cast<size_t>(p.T) * (moe ? 3 * E + groups : 0)) * sizeof(float);
  // M = 1, or 4 for 2..4 tokens (the M = 2 instance spilled in its loops at 170 registers).
  if (p.quads != 8 && p.quads != 12) return invalid_argument("ffn_resident: {} quads a batch (8 or 12)", p.quads);
  if (p.quads == 8) return p.T == 1 ? launch<1, 8>(p, ra, smem) : launch<4, 8>(p, ra, smem);
  return p.T == 1 ? launch<1, 12>(p, ra, smem) : launch<4, 12>(p, ra, smem);
}

}  // namespace ml4::cuda
