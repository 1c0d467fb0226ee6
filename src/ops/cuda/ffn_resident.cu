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

constexpr int kMaxT = kFfnResidentMaxTokens;
constexpr int kMaxK = kFfnResidentMaxTopK;
constexpr int kMaxRows = kMaxT * kMaxK + kMaxT;  // routed rows, then the always-run MLP's
constexpr int kNormVirtual = 256;                // rms_norm_vec_kernel's block: its f64 sum order
constexpr int kNormVec = 8;                      // float4s a virtual thread: D <= 8192
constexpr int kRouterVec = 16;                   // the router row's float4s a thread: D <= 8192
constexpr int kConv = gemv_stream::kConvF16Hw;   // the stream GEMV's default decoding (exact)
// Weight rows an item (8 measured slower on the H100: 2.79 vs 2.21 ms for the ml4-slice-4 step).
constexpr int kRows = 4;
// Blocks a multiprocessor: the stream GEMV's own count (gemv_stream.cuh kStMinBlocks: four at
// M = 1, 128 registers a thread; three at M = 4, 170); the kernel's one stream_rows call site
// keeps its registers within them.
constexpr int blocks_per_sm(int m) { return gemv_stream::kStMinBlocks(m); }
static_assert(kNormVirtual * kNormVec * 4 >= kFfnResidentMaxDim && kStThreads * kRouterVec * 4 >= kFfnResidentMaxDim);
static_assert(kNormVirtual == 2 * kStThreads);

// The routing (route_tokens) in shared memory: as moe_permute lays it out (experts ascending,
// each expert's rows in (t, k) order).
struct Routing {
  int32_t ids[kMaxT * kMaxK];
  float wts[kMaxT * kMaxK];
  int32_t perm_token[kMaxT * kMaxK];  // token of permuted row i
  int32_t inv[kMaxT * kMaxK];         // permuted row of (t, k)
  int32_t expert[kMaxT * kMaxK];      // the active experts, ascending
  int32_t begin[kMaxT * kMaxK + 1];   // their rows [begin[j], begin[j + 1])
  int active;
};

// Step 0, by block t for token t: residual[t] += attn_out[t], a[t] = rms(residual[t]) * w, with
// rms_norm_vec_kernel's arithmetic and f64 sum order: that kernel's thread th (256 a block)
// sums float4s th + 256 j over j; here thread tid plays th = tid (lo) and tid + 128 (hi), and
// the warp trees of lo's four warps and hi's four meet as that kernel's eight warps do. The
// summed row waits in shared memory (v) for the scaling.
__device__ __forceinline__ void norm_row(const FfnResidentParams& p, int t, float* v, double* red8) {
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
  constexpr int kPass = 2 * kNormVec;  // float4s a thread (a strided loop waited a load latency a pass: 12 us)
  float4 wv[kPass];
#pragma unroll
  for (int j = 0; j < kPass; ++j) {
    const int i = tid + j * kStThreads;
    if (i < n4) wv[j] = __ldg(w4 + i);
  }
#pragma unroll
  for (int j = 0; j < kPass; ++j) {
    const int i = tid + j * kStThreads;
    if (i < n4) {
      const float4 a = v4[i], w = wv[j];
      r4[i] = a;
      a4[i] = make_float4(a.x * inv * w.x, a.y * inv * w.y, a.z * inv * w.z, a.w * inv * w.w);
    }
  }
}

// Expert e's router logit for every token, with router_route_kernel's arithmetic and order:
// that kernel's thread i (256 a block) sums k = 4 (i + 256 j) .. +3 over j; here thread tid
// plays threads tid (lo) and tid + 128 (hi), and the warp sums of lo's four warps then hi's
// four meet in that kernel's warp order.
template <int M, int R>
__device__ __forceinline__ void router_item(const FfnResidentParams& p, int e, float (&red)[kStWarps][M * R]) {
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
  // red[warp][t] holds lo's warp sums, red[warp][M + t] hi's (M * R >= 2M).
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

// By the block that finishes the last router item, while the others go on with phase 1: each
// token routed by a warp (warp t: token t) from the logits, and moe_permute's layout over the
// T K <= 32 picks in shared memory, published to p.routing (the others copy it after the next
// barrier) and written out as the standard path does.
struct RouteIo {  // what the routing reads and writes (by value: no parameter block on the stack)
  const float* logits;
  void* routing;
  int32_t* ids;
  float* weights;
  int T;
};
__device__ __noinline__ void route_tokens(const RouteIo p, const RouteArgs ra, float* route_sm, Routing& rt) {
  const int T = p.T, K = ra.K;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, E = ra.E;
  const int per = 3 * E + ra.G;
  if (warp < T) {
    float* sl = route_sm + warp * per;
    for (int e = lane; e < E; e += 32) sl[e] = __ldcg(p.logits + warp * E + e);
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
  // Published for the other blocks (read after the next barrier), and the routing's outputs.
  const int32_t* src = reinterpret_cast<const int32_t*>(&rt);
  int32_t* dst = static_cast<int32_t*>(p.routing);
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(Routing) / 4); i += blockDim.x) dst[i] = src[i];
  if (threadIdx.x < T * K) {
    p.ids[threadIdx.x] = rt.ids[threadIdx.x];
    p.weights[threadIdx.x] = rt.wts[threadIdx.x];
  }
}

// One stream_rows call: weight rows [n0, n0 + R) of w [N, K] against the x rows of tokens
// [r0, r1) (xmap: their rows of x), sums into destination rows dst_row0 + (row - r0) (of the
// stage, or of the y rows).
struct Work {
  const uint8_t* w = nullptr;
  const float* s = nullptr;
  int64_t N = 0, K = 0, n0 = 0;
  const float* x = nullptr;
  const int32_t* xmap = nullptr;
  int r0 = 0, r1 = 0;
  int dst = 0;       // gate/up: stage 0 (gate) or 1 (up)
  int dst_row0 = 0;  // its first row
};

// The items of the two gate/up phases and the down phase. A gate/up item (a matrix pair, R
// rows) is two Works the same block runs back to back through the kernel's one stream_rows call
// (one register allocation, the stream GEMV's own): the gate rows into stage 0, the up rows into
// stage 1, then SiLU(g) * u (silu_mul_kernel's expression) into the hidden rows. A down item is
// one Work: R output rows of one routed expert with rows (y rows 0 .. T K - 1, permuted order)
// or of the always-run MLP (y rows T K + t), into the y rows in global memory (whole row
// blocks as one item, five Works long, left a 26 us tail on the H100); after a fourth barrier
// every thread sums its share of out with moe_combine's arithmetic.

// Works a gate/up item, or down items an output row block.
__device__ __forceinline__ int works_of(const FfnResidentParams& p, const Routing& rt, int kind) {
  if (kind != 3) return 2;
  return (p.gate ? rt.active : 0) + (p.mlp.w1 ? 1 : 0);
}

template <int R>
__device__ __forceinline__ Work work_of(const FfnResidentParams& p, const Routing& rt, const float* hidden_mlp, int kind,
                                        int item, int sub) {
  Work w;
  const int T = p.T;
  if (kind == 1) {  // the always-run MLP's gate (sub 0) / up (sub 1) rows for every token
    w.w = static_cast<const uint8_t*>(sub == 0 ? p.mlp.w1 : p.mlp.w3);
    w.s = sub == 0 ? p.mlp.s1 : p.mlp.s3;
    w.N = p.mlp.I;
    w.K = p.D;
    w.n0 = int64_t{item} * R;
    w.x = p.a;
    w.r1 = T;
    w.dst = sub;
  } else if (kind == 2) {  // expert j's rows of its tokens
    const int per_e = static_cast<int>((p.I_routed + R - 1) / R), j = item / per_e, e = rt.expert[j];
    w.w = static_cast<const uint8_t*>(sub == 0 ? p.w1_table[e] : p.w3_table[e]);
    w.s = sub == 0 ? p.s1_table[e] : p.s3_table[e];
    w.N = p.I_routed;
    w.K = p.D;
    w.n0 = int64_t{item % per_e} * R;
    w.x = p.a;
    w.xmap = rt.perm_token;
    w.r0 = rt.begin[j];
    w.r1 = rt.begin[j + 1];
    w.dst = sub;
  } else {  // down: sub < active: routed expert sub's rows; else the always-run MLP's
    const int routed = p.gate ? rt.active : 0;
    w.N = p.D;
    w.n0 = int64_t{item} * R;
    if (sub < routed) {
      const int e = rt.expert[sub];
      w.w = static_cast<const uint8_t*>(p.w2_table[e]);
      w.s = p.s2_table[e];
      w.K = p.I_routed;
      w.x = p.hidden;
      w.r0 = rt.begin[sub];
      w.r1 = rt.begin[sub + 1];
      w.dst_row0 = w.r0;
    } else {
      w.w = static_cast<const uint8_t*>(p.mlp.w2);
      w.s = p.mlp.s2;
      w.K = p.mlp.I;
      w.x = hidden_mlp;
      w.r1 = T;
      w.dst_row0 = T * (p.gate ? p.moe.num_experts_per_tok : 0);
    }
  }
  return w;
}

// A gate/up item's epilogue, once its two Works are in the stage: SiLU into the hidden rows.
template <int R>
__device__ __forceinline__ void finish_gate_up(const FfnResidentParams& p, const Routing& rt, float* hidden_mlp,
                                               int kind, int item, const float* g_st, const float* u_st) {
  const int tid = threadIdx.x;
  const Work w = work_of<R>(p, rt, hidden_mlp, kind, item, 0);
  float* hidden = kind == 1 ? hidden_mlp : p.hidden;
  if (tid < (w.r1 - w.r0) * R) {
    const int i = tid / R, r = tid % R;
    if (w.n0 + r < w.N) {
      const float gv = g_st[i * R + r];
      hidden[(w.r0 + i) * w.N + w.n0 + r] = gv / (1.0f + expf(-gv)) * u_st[i * R + r];
    }
  }
  __syncthreads();
}

// Output element (t, n) once every down row is in y: moe_combine's sum (the K routed rows in k
// order, then the always-run MLP's row) into out.
__device__ __forceinline__ void combine_one(const FfnResidentParams& p, const Routing& rt, const float* y, int t,
                                            int64_t n) {
  const int T = p.T, K = p.moe.num_experts_per_tok;
  const float* yc = y + n;
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) acc = fmaf(rt.wts[t * K + k], __ldcg(yc + int64_t{rt.inv[t * K + k]} * p.D), acc);
  if (p.mlp.w1) acc += __ldcg(yc + int64_t{T * K + t} * p.D);
  p.out[t * p.D + n] = acc;
}

// One kStThreads-thread block per item at a time, blocks_per_sm(M) a multiprocessor, every
// block resident (a cooperative launch). Values another block wrote before a barrier (a, the
// logits, the hidden rows) are read with plain loads: the barrier's fences order them
// (fault.cuh), and no block reads those addresses before the barrier.
template <int M, int R, int BPS>
__global__ void __launch_bounds__(kStThreads, BPS)
    ffn_resident_kernel(const FfnResidentParams p, const RouteArgs ra) {
  pdl_wait();
  extern __shared__ float4 dyn4[];
  float* v = reinterpret_cast<float*>(dyn4);  // [D]: step 0's summed row
  float* route_sm = v + p.D;                  // [T][3E + groups]
  __shared__ float red[kStWarps][M * R];
  __shared__ float stage[2][kMaxRows * R];
  __shared__ double red8[kNormVirtual / 32 + 1];
  __shared__ Routing rt;
  const int NB = gridDim.x, b = blockIdx.x, tid = threadIdx.x;
  const bool moe = p.gate != nullptr;
  const int T = p.T, K = moe ? p.moe.num_experts_per_tok : 0;
  float* hidden_mlp = p.hidden + static_cast<int64_t>(T) * K * p.I_routed;  // the always-run MLP's rows [T][Im]
  float* y = hidden_mlp + static_cast<int64_t>(T) * p.mlp.I;                 // the down rows [T K + T][D]
  if (!moe) rt.active = 0;
  auto mark = [&](int k) {  // FfnResidentParams::trace
    if (p.trace != nullptr && tid == 0) p.trace[b * kTracePoints + k] = global_ns();
  };
  mark(0);
  // The phases' item counters and the router's done count, zeroed before the first barrier
  // (used only after it).
  if (b == 0 && tid < 4) p.counters[tid] = 0u;

  // 0. Token t's residual and normalized rows by block t (no other block reads either row).
  if (b < T) norm_row(p, b, v, red8);
  mark(1);
  if (b == p.never_arrive_block) return;  // the test switch
  if (!bounded_grid_sync(p.barrier, NB, p.fault, p.timeout_ns, 1)) return;
  mark(2);

  // 1. Router logits (E items, a block each), then the phases.
  const int n_router = moe ? p.moe.num_experts : 0;
  __shared__ int s_last;
  for (int i = b; i < n_router; i += NB) {
    router_item<M, R>(p, i, red);
    __threadfence();  // the logits stored (release), then counted
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(p.counters + 3, 1u) == static_cast<unsigned>(n_router - 1);
    __syncthreads();
    if (s_last) {
      __threadfence();  // every router item's logits (acquire)
      route_tokens(RouteIo{p.logits, p.routing, p.ids, p.weights, p.T}, ra, route_sm, rt);
    }
  }
  mark(3);
  const int n_mlp = p.mlp.w1 ? static_cast<int>((p.mlp.I + R - 1) / R) : 0;
  const int n_down = static_cast<int>((p.D + R - 1) / R);
  __shared__ int s_next;
  for (int kind = 1; kind <= 3; ++kind) {
    if (kind == 2) {
      mark(4);
      if (!bounded_grid_sync(p.barrier, NB, p.fault, p.timeout_ns, 2)) return;
      mark(5);
      if (!moe) continue;  // a dense layer's hidden rows are complete
      {  // the published routing into this block's shared memory
        const int32_t* src = static_cast<const int32_t*>(p.routing);
        int32_t* dst = reinterpret_cast<int32_t*>(&rt);
        for (int j = tid; j < static_cast<int>(sizeof(Routing) / 4); j += kStThreads) dst[j] = src[j];
        __syncthreads();
      }
      mark(6);
    }
    if (kind == 3 && moe) {
      mark(7);
      if (!bounded_grid_sync(p.barrier, NB, p.fault, p.timeout_ns, 3)) return;
      mark(8);
    }
    const int per_e = static_cast<int>((p.I_routed + R - 1) / R);
    const int works = works_of(p, rt, kind);  // down: items an output row block
    const int items = kind == 1 ? n_mlp : kind == 2 ? rt.active * per_e : n_down * works;
    // Items from a shared counter, the next one fetched while this one runs: a block that
    // streams faster takes more (blocks striding statically ended a phase 20-100 us apart).
    unsigned* counter = p.counters + (kind - 1);
    if (tid == 0) s_next = static_cast<int>(atomicAdd(counter, 1u));
    __syncthreads();
    int i = s_next;
    while (i < items) {
      unsigned ahead = 0;
      if (tid == 0) ahead = atomicAdd(counter, 1u);
      const int item = kind == 3 ? i / works : i;
      for (int sub = kind == 3 ? i % works : 0, n = kind == 3 ? 1 : works; n > 0; ++sub, --n) {
        const Work w = work_of<R>(p, rt, hidden_mlp, kind, item, sub);
        // Sums into the stage (gate/up) or the y rows (down), rows `stride` apart.
        const int64_t stride = kind == 3 ? p.D : R;
        float* dst = (kind == 3 ? (moe ? y : p.out) + w.n0 : stage[w.dst]) + (w.dst_row0 - w.r0) * stride;
        gemv_stream::stream_rows<M, R, true, kConv, gemv_stream::kXPlain>(
            w.w, w.s, w.N, w.K, w.n0, w.x, w.xmap, 0, w.r0, w.r1, red,
            [=](int64_t row, int r, float val) { dst[row * stride + r] = val; });
      }
      if (kind != 3) finish_gate_up<R>(p, rt, hidden_mlp, kind, item, stage[0], stage[1]);  // ends with __syncthreads
      if (tid == 0) s_next = static_cast<int>(ahead);
      __syncthreads();
      i = s_next;
    }
  }
  // 4. The combine, once every down row is in y (a dense layer's MLP wrote out directly).
  if (moe) {
    if (!bounded_grid_sync(p.barrier, NB, p.fault, p.timeout_ns, 4)) return;
    for (int64_t j = int64_t{b} * kStThreads + tid; j < int64_t{T} * p.D; j += int64_t{NB} * kStThreads)
      combine_one(p, rt, y, static_cast<int>(j / p.D), j % p.D);
  }
  mark(9);
}

template <int M, int R, int BPS = blocks_per_sm(M)>
Status launch(const FfnResidentParams& p, const RouteArgs& ra, size_t smem) {
  auto kernel = ffn_resident_kernel<M, R, BPS>;
  ML4_RETURN_IF_ERROR(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(smem)),
                                  "ffn_resident smem"));
  int per_sm = 0;
  ML4_RETURN_IF_ERROR(cuda_status(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStThreads, smem), "ffn_resident occupancy"));
  const int want = BPS;
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

size_t ffn_resident_routing_bytes() { return sizeof(Routing); }

ResidentMlp resident_mlp(const DeviceLinear& w1, const DeviceLinear& w2, const DeviceLinear& w3) {
  return ResidentMlp{w1.weight.data(), w3.weight.data(), w2.weight.data(), w1.scale.as<float>(),
                     w3.scale.as<float>(), w2.scale.as<float>(), w1.N};
}

void set_routed_experts(FfnResidentParams* p, const MoeExpertTables& tb) {
  p->w1_table = static_cast<const void* const*>(tb.w1.data());
  p->w3_table = static_cast<const void* const*>(tb.w3.data());
  p->w2_table = static_cast<const void* const*>(tb.w2.data());
  p->s1_table = static_cast<const float* const*>(tb.s1.data());
  p->s3_table = static_cast<const float* const*>(tb.s3.data());
  p->s2_table = static_cast<const float* const*>(tb.s2.data());
  p->I_routed = tb.I;
}

int ffn_resident_max_blocks() { return gemv_stream::kStMinBlocks(1) * sm_count(); }

int64_t ffn_resident_hidden_floats(int T, int K, int64_t I_routed, int64_t I_mlp, int64_t D) {
  return static_cast<int64_t>(T) * K * I_routed + static_cast<int64_t>(T) * I_mlp +
         (static_cast<int64_t>(T) * K + T) * D;
}

Status ffn_resident(const FfnResidentParams& p) {
  const MoeConfig* moe = p.gate ? &p.moe : nullptr;
  const std::string why = ffn_resident_unsupported(p.D, moe, p.I_routed, p.mlp.w1 ? p.mlp.I : 0, p.T);
  if (!why.empty()) return invalid_argument("ffn_resident: unsupported shape: {}", why);
  if (!p.attn_out || !p.residual || !p.norm_w || !p.a || !p.hidden || !p.out || !p.barrier || !p.counters ||
      !p.fault || (p.gate && !p.routing))
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
  if (p.T == 1 && p.blocks_per_sm == 3) return launch<1, kRows, 3>(p, ra, smem);
  return p.T == 1 ? launch<1, kRows>(p, ra, smem) : launch<4, kRows>(p, ra, smem);
}

}  // namespace ml4::cuda
