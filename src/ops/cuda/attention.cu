// See attention.h. Design (FlashMLA's sparse decode, rebuilt in plain f32 for correctness):
//   grid (T, splits, ceil(H / 64)); a block of 512 threads holds one token's q for up to 64
//   heads in shared memory (f32, [576 + 4] padded rows) and walks its split's keys in tiles of
//   16. Per tile: raw cache rows (prefetched into registers during the previous tile) go to
//   shared memory, are dequantized to f32 rows next to q, the 64 x 16 logits are computed, an
//   online softmax (running max m and sum l per head, natural exp) rescales the accumulators,
//   and P . C is accumulated in registers: thread (column c, head group g) owns out[h][4c..4c+4)
//   for its group's heads (64 f32 accumulators for r = 512).
//   Each split writes (out / l, m + ln l); a combine kernel merges splits in order with
//   weights exp(lse_i - lse) (flash-decoding). With one split the block writes the result.
// Costs per token (H = 64, r = 512, dr = 64, topk 2048): 1.34 MB of fp8_ds_mla rows read and
// 2 * 64 * 2048 * (576 + 512) = 285 MFLOP. On f32 cores that is compute-bound (~4 us per
// token at the 67 TFLOP/s f32 peak vs 0.28 us of HBM time); reaching the memory bound needs
// tensor-core QK^T / PV (bf16 wgmma as FlashMLA does), which is the next step.
#include "ops/cuda/attention.h"
#include "ops/cuda/pdl.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kv/latent_layout.h"
#include "ops/cuda/attention_internal.h"
#include "ops/cuda/cuda_common.h"

namespace ml4::cuda {
namespace {

using detail::Args;
using detail::key_slot;

constexpr int kThreads = 512;
constexpr int kTile = 16;            // keys per tile
constexpr int kSplitQuantum = 64;    // split boundaries: whole tiles of both kernels
constexpr int kDecodeQuantum = 32;   // the decode kernel's tile (attention_decode.cu)
constexpr int kMaxRowWords = 288;    // bf16 rows: 1152 B
constexpr int kRawPerThread = (kTile * kMaxRowWords + kThreads - 1) / kThreads;  // 9
constexpr int kMaxHeadsPerGroup = 16;  // PV: at least 4 head groups of <= 16 heads (r <= 512)
static_assert(kThreads / (512 / 4) * kMaxHeadsPerGroup >= kMlaHeadsPerBlock, "PV mapping covers 64 heads");

__device__ __forceinline__ float e4m3_f32(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return static_cast<float>(v);
}
__device__ __forceinline__ float bf16_f32(const uint8_t* p) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
}

__global__ void __launch_bounds__(kThreads, 1) mla_kernel(const Args a) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  extern __shared__ float smem[];
  const int t = blockIdx.x, split = blockIdx.y;
  const int h0 = blockIdx.z * kMlaHeadsPerBlock;
  const int HB = min(kMlaHeadsPerBlock, a.H - h0);
  const int D = a.r + a.dr, DP = D + 4;
  const int row_words = a.row_bytes / 4;
  float* qs = smem;                          // [HB][DP]
  float* ks = qs + kMlaHeadsPerBlock * DP;   // [kTile][DP]
  float* sp = ks + kTile * DP;               // [kTile][HB] logits, then probabilities
  float* m_s = sp + kTile * kMlaHeadsPerBlock;
  float* l_s = m_s + kMlaHeadsPerBlock;
  float* corr = l_s + kMlaHeadsPerBlock;
  float* hs = corr + kMlaHeadsPerBlock;
  uint32_t* raw = reinterpret_cast<uint32_t*>(hs + kMlaHeadsPerBlock);  // [kTile][row_words]
  __shared__ bool valid[kTile];
  const int tid = threadIdx.x;

  int n;  // keys of token t
  int seq = 0;
  if (a.indices) {
    n = a.index_lengths ? min(max(a.index_lengths[t], 0), a.topk) : a.topk;
  } else {
    n = max(a.lengths[t], 0);
    seq = a.seq_of_token[t];
  }
  const int j0 = split * a.chunk;
  const int j1 = min(n, j0 + a.chunk);

  for (int i = tid; i < HB * D; i += kThreads) {
    const int h = i / D, v = i % D;
    const int64_t th = static_cast<int64_t>(t) * a.H + h0 + h;
    qs[h * DP + v] = v < a.r ? a.q_lat[th * a.r + v] : a.q_rope[th * a.q_rope_stride + (v - a.r)];
  }
  if (tid < HB) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
    hs[tid] = a.head_scale[static_cast<int64_t>(t) * a.H + h0 + tid];
  }

  // PV mapping.
  const int NC = a.r / 4, NG = kThreads / NC;
  const int col = tid % NC, g = tid / NC;
  const int HPG = (HB + NG - 1) / NG;
  float4 acc[kMaxHeadsPerGroup];
#pragma unroll
  for (int i = 0; i < kMaxHeadsPerGroup; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);

  uint32_t regs[kRawPerThread];
  auto load_raw = [&](int jt) {
#pragma unroll
    for (int i = 0; i < kRawPerThread; ++i) {
      const int f = tid + i * kThreads;
      regs[i] = 0u;
      if (f < kTile * row_words) {
        const int jj = f / row_words, w = f % row_words;
        if (jt + jj < j1) {
          const int64_t s = key_slot(a, t, jt + jj, seq);
          if (s >= 0) regs[i] = __ldg(reinterpret_cast<const uint32_t*>(a.cache + s * a.row_bytes) + w);
        }
      }
    }
  };
  if (j0 < j1) load_raw(j0);

  for (int jt = j0; jt < j1; jt += kTile) {
#pragma unroll
    for (int i = 0; i < kRawPerThread; ++i) {
      const int f = tid + i * kThreads;
      if (f < kTile * row_words) raw[f] = regs[i];
    }
    if (tid < kTile) valid[tid] = jt + tid < j1 && key_slot(a, t, jt + tid, seq) >= 0;
    __syncthreads();
    if (jt + kTile < j1) load_raw(jt + kTile);  // in flight during this tile's math

    // Dequantize to f32 rows.
    const uint8_t* rb = reinterpret_cast<const uint8_t*>(raw);
    for (int f = tid; f < kTile * D; f += kThreads) {
      const int jj = f / D, v = f % D;
      const uint8_t* row = rb + jj * a.row_bytes;
      float x = 0.0f;
      if (valid[jj]) {
        if (a.dtype == static_cast<int>(KvCacheDtype::kFp8DsMla)) {
          if (v < a.r) {
            x = e4m3_f32(row[v]) * *reinterpret_cast<const float*>(row + a.r + 4 * (v / kDsMlaTile));
          } else {
            x = bf16_f32(row + a.r + 4 * (a.r / kDsMlaTile) + 2 * (v - a.r));
          }
        } else if (a.dtype == static_cast<int>(KvCacheDtype::kFp8)) {
          x = e4m3_f32(row[v]) * a.fp8_scale;
        } else {
          x = bf16_f32(row + 2 * v);
        }
      }
      ks[jj * DP + v] = x;
    }
    __syncthreads();

    // Logits.
    for (int pr = tid; pr < HB * kTile; pr += kThreads) {
      const int s = pr % kTile, h = pr / kTile;
      const float* qr = qs + h * DP;
      const float* kr = ks + s * DP;
      float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
      for (int v = 0; v < D; v += 4) {
        const float4 q4 = *reinterpret_cast<const float4*>(qr + v);
        const float4 k4 = *reinterpret_cast<const float4*>(kr + v);
        d0 = fmaf(q4.x, k4.x, d0);
        d1 = fmaf(q4.y, k4.y, d1);
        d2 = fmaf(q4.z, k4.z, d2);
        d3 = fmaf(q4.w, k4.w, d3);
      }
      sp[s * kMlaHeadsPerBlock + h] = valid[s] ? ((d0 + d1) + (d2 + d3)) * hs[h] : -INFINITY;
    }
    __syncthreads();

    // Online softmax, one thread per head.
    if (tid < HB) {
      const float mo = m_s[tid];
      float mx = mo;
      for (int s = 0; s < kTile; ++s) mx = fmaxf(mx, sp[s * kMlaHeadsPerBlock + tid]);
      float c = 1.0f, sum = 0.0f;
      if (mx == -INFINITY) {
        for (int s = 0; s < kTile; ++s) sp[s * kMlaHeadsPerBlock + tid] = 0.0f;
      } else {
        c = expf(mo - mx);  // mo = -inf -> 0
        for (int s = 0; s < kTile; ++s) {
          const float pv = expf(sp[s * kMlaHeadsPerBlock + tid] - mx);
          sp[s * kMlaHeadsPerBlock + tid] = pv;
          sum += pv;
        }
        m_s[tid] = mx;
      }
      l_s[tid] = l_s[tid] * c + sum;
      corr[tid] = c;
    }
    __syncthreads();

    // P . C (the latent part of each key row).
    if (g < NG) {
#pragma unroll
      for (int i = 0; i < kMaxHeadsPerGroup; ++i) {
        const int h = g * HPG + i;
        if (i < HPG && h < HB) {
          const float c = corr[h];
          acc[i].x *= c;
          acc[i].y *= c;
          acc[i].z *= c;
          acc[i].w *= c;
        }
      }
      for (int s = 0; s < kTile; ++s) {
        const float4 k4 = *reinterpret_cast<const float4*>(ks + s * DP + 4 * col);
#pragma unroll
        for (int i = 0; i < kMaxHeadsPerGroup; ++i) {
          const int h = g * HPG + i;
          if (i < HPG && h < HB) {
            const float pv = sp[s * kMlaHeadsPerBlock + h];
            acc[i].x = fmaf(pv, k4.x, acc[i].x);
            acc[i].y = fmaf(pv, k4.y, acc[i].y);
            acc[i].z = fmaf(pv, k4.z, acc[i].z);
            acc[i].w = fmaf(pv, k4.w, acc[i].w);
          }
        }
      }
    }
  }
  __syncthreads();

  // Normalised output of this split (or the final result with one split).
  const int64_t base = (static_cast<int64_t>(a.splits > 1 ? split : 0) * a.T + t) * a.H + h0;
  if (g < NG) {
#pragma unroll
    for (int i = 0; i < kMaxHeadsPerGroup; ++i) {
      const int h = g * HPG + i;
      if (i < HPG && h < HB) {
        const float l = l_s[h];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const float4 o = make_float4(acc[i].x * inv, acc[i].y * inv, acc[i].z * inv, acc[i].w * inv);
        *reinterpret_cast<float4*>(a.out + (base + h) * a.r + 4 * col) = o;
      }
    }
  }
  if (tid < HB) {
    const float l = l_s[tid];
    a.lse[base + tid] = l > 0.0f ? m_s[tid] + logf(l) : -INFINITY;
  }
}

// grid (T * H), block r / 4: merges the splits of one (token, head) in split order.
__global__ void mla_combine_kernel(const float* __restrict__ part_out, const float* __restrict__ part_lse, int splits,
                                   int64_t TH, int r, float* __restrict__ out, float* __restrict__ lse) {
  pdl_wait();  // pdl.cuh: nothing before this touches the step's activations
  pdl_launch_dependents();
  const int64_t th = blockIdx.x;
  float mx = -INFINITY;
  for (int i = 0; i < splits; ++i) mx = fmaxf(mx, part_lse[i * TH + th]);
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.0f;
  if (mx != -INFINITY) {
    for (int i = 0; i < splits; ++i) {
      const float w = expf(part_lse[i * TH + th] - mx);
      sum += w;
      const float4 p = *reinterpret_cast<const float4*>(part_out + (i * TH + th) * r + 4 * threadIdx.x);
      o.x = fmaf(w, p.x, o.x);
      o.y = fmaf(w, p.y, o.y);
      o.z = fmaf(w, p.z, o.z);
      o.w = fmaf(w, p.w, o.w);
    }
    const float inv = 1.0f / sum;
    o = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
  }
  *reinterpret_cast<float4*>(out + th * r + 4 * threadIdx.x) = o;
  if (threadIdx.x == 0) lse[th] = mx == -INFINITY ? -INFINITY : mx + logf(sum);
}

// The dedicated sparse decode kernel (attention_decode.cu) applies: bf16 tensor cores, sparse,
// fp8_ds_mla rows of r = 512, dr = 64, H a multiple of 16 up to 128, 16-byte aligned cache (its
// bulk copies need it) and q (its float4 loads). Its split rule is choose_splits' (>= 64 keys per split).
bool use_decode_kernel(const MlaAttentionParams& p, int row_bytes) {
  return p.decode_kernel && p.math == MlaMath::kBf16TensorCore && p.indices && p.dtype == KvCacheDtype::kFp8DsMla &&
         aligned16(p.cache) && aligned16(p.q_lat) && aligned16(p.q_rope) && p.q_rope_stride % 4 == 0 &&
         detail::mla_decode_supported(p.H, p.r, p.dr, row_bytes);
}

// The wgmma prefill kernel (attention_prefill.cu) applies: bf16 tensor cores, sparse, fp8_ds_mla
// rows of r = 512, dr = 64, 16-byte aligned cache and q (its 16-byte copies and loads), and at
// least a wave of (token, head block) CTAs (below that the split decode kernel fills the SMs).
bool use_prefill_kernel(const MlaAttentionParams& p, int row_bytes) {
  if (!(p.prefill_kernel && p.math == MlaMath::kBf16TensorCore && p.indices && p.dtype == KvCacheDtype::kFp8DsMla &&
        detail::mla_prefill_supported(p.r, p.dr, row_bytes)))
    return false;
  if (reinterpret_cast<uintptr_t>(p.cache) % 16 != 0 || reinterpret_cast<uintptr_t>(p.q_lat) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.q_rope) % 16 != 0 || p.q_rope_stride % 4 != 0)
    return false;
  const int64_t blocks = p.T * ((p.H + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock);
  const int64_t need = p.prefill_min_blocks > 0 ? p.prefill_min_blocks : std::max(1, sm_count());
  if (blocks < need) return false;
  int dev = 0, limit = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return false;
  return static_cast<size_t>(limit) >= detail::mla_prefill_smem_bytes();
}

size_t prefill_workspace_bytes(const MlaAttentionParams& p) {
  return detail::mla_prefill_workspace_bytes(p.num_slots, p.T, p.topk, p.scratch_pages);
}

int max_keys(const MlaAttentionParams& p) { return p.indices ? p.topk : p.max_length; }

int choose_splits(const MlaAttentionParams& p) {
  const int64_t keys = max_keys(p);
  if (keys <= 0 || p.T <= 0) return 1;
  if (use_decode_kernel(p, static_cast<int>(latent_token_bytes(p.dtype, p.r, p.dr)))) {
    // Decode kernel: one block per SM (its shared memory), so as many splits as keep all blocks
    // in ONE wave (a second, partial wave costs a whole block time), >= 32 keys (a tile) each.
    const int64_t max_splits = std::max<int64_t>(1, (keys + kDecodeQuantum - 1) / kDecodeQuantum);
    if (p.num_splits > 0) return static_cast<int>(std::min<int64_t>(p.num_splits, max_splits));
    const int64_t blocks = p.T * ((p.H + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock);
    const int64_t sms = std::max(1, sm_count());
    return static_cast<int>(std::clamp<int64_t>(sms / blocks, 1, max_splits));
  }
  const int64_t tiles = (keys + kTile - 1) / kTile;
  const int64_t max_splits = std::max<int64_t>(1, tiles / 4);  // >= 64 keys per split
  if (p.num_splits > 0) return static_cast<int>(std::min<int64_t>(p.num_splits, tiles));
  const int64_t blocks = p.T * ((p.H + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock);
  const int64_t sms = std::max(1, sm_count());
  if (blocks >= sms) return 1;
  return static_cast<int>(std::min<int64_t>(max_splits, (sms + blocks - 1) / blocks));
}

size_t split_bytes(const MlaAttentionParams& p) {
  return static_cast<size_t>(p.T) * p.H * (p.r + 1) * sizeof(float);
}

size_t smem_bytes(const MlaAttentionParams& p, int row_bytes) {
  const int DP = p.r + p.dr + 4;
  return sizeof(float) * (static_cast<size_t>(kMlaHeadsPerBlock) * DP + kTile * DP + kTile * kMlaHeadsPerBlock +
                          4 * kMlaHeadsPerBlock) +
         static_cast<size_t>(kTile) * row_bytes;
}

}  // namespace

size_t mla_attention_workspace_bytes(const MlaAttentionParams& p) {
  if (p.T > 0 && use_prefill_kernel(p, static_cast<int>(latent_token_bytes(p.dtype, p.r, p.dr))))
    return prefill_workspace_bytes(p);
  const int s = choose_splits(p);
  return s > 1 ? s * split_bytes(p) : 0;
}

bool mla_attention_runs_prefill(const MlaAttentionParams& p) {
  if (p.T <= 0) return false;
  return use_prefill_kernel(p, static_cast<int>(latent_token_bytes(p.dtype, p.r, p.dr))) && p.workspace &&
         p.workspace_bytes >= prefill_workspace_bytes(p);
}

Status mla_attention(const MlaAttentionParams& p) {
  if (p.T < 0 || p.H <= 0) return invalid_argument("mla_attention: T = {}, H = {}", p.T, p.H);
  if (p.r <= 0 || p.r % kDsMlaTile != 0 || p.r > 512)
    return invalid_argument("mla_attention: r = {} (a multiple of 128, at most 512)", p.r);
  if (p.dr < 0 || p.dr > 64 || p.dr % 2 != 0 || (p.r + p.dr) % 4 != 0)
    return invalid_argument("mla_attention: dr = {} (even, <= 64, r + dr a multiple of 4)", p.dr);
  if (p.T == 0) return ok_status();
  if (p.T > 0x7fffffff || p.H > 65535 * kMlaHeadsPerBlock) return invalid_argument("mla_attention: T or H too large");
  if (p.q_rope_stride < 0 || (p.q_rope_stride > 0 && p.q_rope_stride < p.dr))
    return invalid_argument("mla_attention: q_rope_stride {} below dr {}", p.q_rope_stride, p.dr);
  if (!p.q_lat || (p.dr > 0 && !p.q_rope) || !p.head_scale || !p.cache || !p.out_lat || !p.lse)
    return invalid_argument("mla_attention: null pointer");
  if (p.num_slots <= 0) return invalid_argument("mla_attention: empty cache");
  if (p.dtype == KvCacheDtype::kFp8 && !(p.fp8_scale > 0.0f))
    return invalid_argument("mla_attention: fp8_scale must be > 0");
  int64_t istride = 0;
  if (p.indices) {
    istride = p.indices_stride ? p.indices_stride : p.topk;
    if (p.topk < 0 || istride < p.topk)
      return invalid_argument("mla_attention: topk = {}, indices_stride = {}", p.topk, istride);
  } else {
    if (!p.block_table || !p.seq_of_token || !p.lengths || p.block_table_stride <= 0 || p.max_length < 0)
      return invalid_argument("mla_attention: dense attention needs block_table, seq_of_token, lengths, max_length");
    if ((p.max_length + kPageTokens - 1) / kPageTokens > p.block_table_stride)
      return invalid_argument("mla_attention: max_length {} exceeds the block table ({} pages)", p.max_length,
                              p.block_table_stride);
  }
  const int row_bytes = static_cast<int>(latent_token_bytes(p.dtype, p.r, p.dr));
  if (row_bytes % 4 != 0 || row_bytes / 4 > kMaxRowWords)
    return invalid_argument("mla_attention: row of {} bytes unsupported", row_bytes);

  const bool prefill = mla_attention_runs_prefill(p);
  if (p.lat_bf16 && !prefill) return invalid_argument("mla_attention: bf16 q_lat / out_lat need the prefill kernel");
  int splits = prefill ? 1 : choose_splits(p);
  if (splits > 1) {
    const size_t fit = p.workspace ? p.workspace_bytes / split_bytes(p) : 0;
    splits = static_cast<int>(std::min<size_t>(splits, fit));
    if (splits < 2) splits = 1;
  }
  if (splits > 65535) splits = 65535;
  const int64_t keys = std::max(max_keys(p), 1);
  int chunk = static_cast<int>((keys + splits - 1) / splits);
  const int quantum = use_decode_kernel(p, row_bytes) ? kDecodeQuantum : kSplitQuantum;
  chunk = (chunk + quantum - 1) / quantum * quantum;

  Args a{};
  a.q_lat = p.q_lat;
  a.q_rope = p.q_rope;
  a.q_rope_stride = p.q_rope_stride > 0 ? p.q_rope_stride : p.dr;
  a.head_scale = p.head_scale;
  a.T = static_cast<int>(p.T);
  a.H = p.H;
  a.r = p.r;
  a.dr = p.dr;
  a.cache = static_cast<const uint8_t*>(p.cache);
  a.num_slots = p.num_slots;
  a.dtype = static_cast<int>(p.dtype);
  a.fp8_scale = p.fp8_scale;
  a.row_bytes = row_bytes;
  a.indices = p.indices;
  a.indices_stride = istride;
  a.topk = p.topk;
  a.index_lengths = p.index_lengths;
  a.block_table = p.block_table;
  a.bt_stride = p.block_table_stride;
  a.seq_of_token = p.seq_of_token;
  a.lengths = p.lengths;
  a.chunk = chunk;
  a.splits = splits;
  float* part_out = static_cast<float*>(p.workspace);
  float* part_lse = splits > 1 ? part_out + static_cast<size_t>(splits) * p.T * p.H * p.r : nullptr;
  a.out = splits > 1 ? part_out : p.out_lat;
  a.lse = splits > 1 ? part_lse : p.lse;
  a.lat_bf16 = p.lat_bf16 ? 1 : 0;

  const dim3 grid(static_cast<unsigned>(p.T), static_cast<unsigned>(splits),
                  static_cast<unsigned>((p.H + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock));
  const bool tc = p.math == MlaMath::kBf16TensorCore && p.dtype != KvCacheDtype::kBf16 && (p.r + p.dr) % 16 == 0;
  if (prefill) {
    ML4_RETURN_IF_ERROR(
        cuda_status(detail::launch_mla_prefill(a, p.workspace, p.scratch_pages, p.prefill_pairs, p.stream), "mla_prefill_kernel"));
  } else if (use_decode_kernel(p, row_bytes)) {
    ML4_RETURN_IF_ERROR(cuda_status(detail::launch_mla_decode(a, grid, p.stream), "mla_decode_kernel"));
  } else if (tc) {
    ML4_RETURN_IF_ERROR(
        cuda_status(detail::launch_mla_tc(a, grid, detail::mla_tc_smem_bytes(p.r, p.dr, row_bytes), p.stream),
                    "mla_tc_kernel"));
  } else {
    const size_t smem = smem_bytes(p, row_bytes);
    ML4_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(mla_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(smem)));
    launch_kernel(mla_kernel, grid, kThreads, smem, p.stream, a);
    ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "mla_kernel"));
  }
  if (splits > 1) {
    const int64_t TH = p.T * p.H;
    if (TH > 0x7fffffff) return invalid_argument("mla_attention: T * H too large");
    launch_kernel(mla_combine_kernel, static_cast<unsigned>(TH), p.r / 4, 0, p.stream, part_out, part_lse, splits, TH,
                  p.r, p.out_lat, p.lse);
    ML4_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "mla_combine_kernel"));
  }
  return ok_status();
}

}  // namespace ml4::cuda
