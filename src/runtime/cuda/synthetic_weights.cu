// See synthetic_weights.h.
#include "runtime/cuda/synthetic_weights.h"

#include <cmath>
#include <random>
#include <string>

#include <cuda_bf16.h>

#include "core/dtype.h"
#include "ops/cuda/cuda_common.h"
#include "ops/cuda/gemv.h"

namespace ml4::cuda {
namespace {

__host__ __device__ __forceinline__ uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from element i's hash: the device fillers' values and the host table's.
__host__ __device__ __forceinline__ float uniform_pm1(uint64_t seed, int64_t i) {
  return 2.0f * (static_cast<float>(mix(seed ^ static_cast<uint64_t>(i)) >> 40) * (1.0f / 16777216.0f)) - 1.0f;
}

__device__ __forceinline__ uint8_t band_e4m3(uint64_t h) {
  const uint32_t sign = (h >> 8) & 1u, exp = 5u + static_cast<uint32_t>((h >> 16) % 5u), man = h & 7u;
  return static_cast<uint8_t>((sign << 7) | (exp << 3) | man);
}

__global__ void bytes_kernel(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    p[i] = band_e4m3(mix(seed ^ static_cast<uint64_t>(i)));
}

// e8m0 codes base + (0..3): MXFP4 block scales around 2^(base - 127).
__global__ void e8m0_kernel(uint8_t* p, int64_t n, int base, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    p[i] = static_cast<uint8_t>(base + static_cast<int>(mix(seed ^ static_cast<uint64_t>(i)) & 3u));
}

__global__ void bf16_kernel(__nv_bfloat16* p, int64_t n, float amp, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    p[i] = __float2bfloat16_rn(uniform_pm1(seed, i) * amp);
  }
}

__global__ void f32_kernel(float* p, int64_t n, float amp, float offset, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    p[i] = offset + uniform_pm1(seed, i) * amp;
  }
}

unsigned grid(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)); }

// Host values for the small vectors.
std::vector<float> host_values(std::mt19937_64& g, int64_t n, float offset, float amp) {
  std::uniform_real_distribution<float> u(-amp, amp);
  std::vector<float> v(n);
  for (auto& x : v) x = offset + u(g);
  return v;
}

LinearWeight shape_only(const std::string& name, LinearFormat f, int64_t N, int64_t K) {
  LinearWeight w;
  w.name = name;
  w.format = f;
  w.out_features = N;
  w.in_features = K;
  return w;
}

}  // namespace

Status fill_synthetic_bytes(void* p, int64_t n, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return ok_status();
  bytes_kernel<<<grid(n), 256, 0, stream>>>(static_cast<uint8_t*>(p), n, seed);
  return cuda_status(cudaGetLastError(), "synthetic bytes");
}

Status fill_synthetic_bf16(void* p, int64_t n, float amplitude, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return ok_status();
  bf16_kernel<<<grid(n), 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, amplitude, seed);
  return cuda_status(cudaGetLastError(), "synthetic bf16");
}

Result<DeviceLinear> synthetic_linear(const LinearWeight& w, uint64_t seed) {
  DeviceLinear d;
  d.name = w.name;
  d.format = w.format;
  d.N = w.out_features;
  d.K = w.in_features;
  const int64_t n = d.N * d.K;
  const float amp = 1.0f / std::sqrt(static_cast<float>(d.K));
  switch (w.format) {
    case LinearFormat::kBF16: {
      ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(n * 2));
      ML4_RETURN_IF_ERROR(fill_synthetic_bf16(d.weight.data(), n, amp, seed));
      break;
    }
    case LinearFormat::kF32: {
      ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(n * 4));
      f32_kernel<<<grid(n), 256>>>(d.weight.as<float>(), n, amp, 0.0f, seed);
      ML4_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      break;
    }
    case LinearFormat::kFP8Block: {
      if (d.K % 128 != 0 || d.N % 16 != 0)
        return unimplemented("{}: FP8 block linear needs K % 128 == 0 and N % 16 == 0 (N={}, K={})", d.name, d.N, d.K);
      ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(n));
      ML4_RETURN_IF_ERROR(fill_synthetic_bytes(d.weight.data(), n, seed));
      const int64_t kb = d.K / 128, nb = (d.N + 127) / 128, kb_lt = (kb + 3) / 4 * 4;
      const float s = 0.25f * amp;
      ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(nb * kb * 4));
      f32_kernel<<<grid(nb * kb), 256>>>(d.scale.as<float>(), nb * kb, 0.0f, s, seed);
      ML4_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      if (kb_lt != kb) {  // the padded copy cuBLASLt reads (linear.h)
        ML4_ASSIGN_OR_RETURN(d.scale_lt, DeviceBuffer::alloc(nb * kb_lt * 4));
        f32_kernel<<<grid(nb * kb_lt), 256>>>(d.scale_lt.as<float>(), nb * kb_lt, 0.0f, s, seed);
        ML4_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      }
      break;
    }
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4: {  // any byte is two e2m1 codes; finite scales (linear.h's layout)
      if (d.K % 32 != 0) return unimplemented("{}: {} needs K % 32 == 0 (K={})", d.name, linear_format_name(d.format), d.K);
      const bool nv = w.format == LinearFormat::kNVFP4;
      ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(n / 2));
      ML4_RETURN_IF_ERROR(fill_synthetic_bytes(d.weight.data(), n / 2, seed));
      const int64_t ng = d.N * (d.K / (nv ? 16 : 32));
      ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(nv ? static_cast<size_t>(fp4_global_offset(d.N, d.K)) + 16 : ng));
      if (nv) {  // e4m3 scales of 2^-2..2^2, the global scale brings e2m1 * scale to ~amp
        ML4_RETURN_IF_ERROR(fill_synthetic_bytes(d.scale.data(), ng, seed + 1));
        const float g = 0.25f * amp;
        ML4_RETURN_IF_ERROR(d.scale.upload(&g, 4, static_cast<size_t>(fp4_global_offset(d.N, d.K))));
      } else {
        e8m0_kernel<<<grid(ng), 256>>>(d.scale.as<uint8_t>(), ng, 127 + std::ilogb(0.25f * amp), seed + 1);
        ML4_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      }
      break;
    }
  }
  return Result<DeviceLinear>(std::move(d));
}

namespace {

// An MLA block's linears (the query LoRA pair or wq; wkv_a when the layer owns its KV; wo) as
// shapes, its norms and wkv_b with values (the backend splits it into W_UK / W_UV on the host).
void mla_shapes(AttentionWeights& A, const ModelConfig& cfg, const std::string& pre, LinearFormat f, bool owns_kv,
                std::mt19937_64& g) {
  const int64_t D = cfg.dim, H = cfg.n_heads, dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim;
  const int64_t dv = cfg.v_head_dim, r = cfg.kv_lora_rank;
  if (cfg.q_lora_rank > 0) {
    A.wq_a = shape_only(pre + "attention.wq_a.weight", f, cfg.q_lora_rank, D);
    A.q_a_norm = host_values(g, cfg.q_lora_rank, 1.0f, 0.1f);
    A.wq_b = shape_only(pre + "attention.wq_b.weight", f, H * (dn + dr), cfg.q_lora_rank);
  } else {
    A.wq = shape_only(pre + "attention.wq.weight", f, H * (dn + dr), D);
  }
  if (owns_kv) {
    A.wkv_a = shape_only(pre + "attention.wkv_a_with_mqa.weight", f, r + dr, D);
    A.kv_a_norm = host_values(g, r, 1.0f, 0.1f);
  }
  A.wo = shape_only(pre + "attention.wo.weight", f, D, H * dv);
  const std::vector<float> v = host_values(g, H * (dn + dv) * r, 0.0f, 1.0f / std::sqrt(static_cast<float>(r)));
  A.wkv_b = shape_only(pre + "attention.wkv_b.weight", LinearFormat::kF32, H * (dn + dv), r);
  A.wkv_b.weight = Tensor(DType::kF32, {H * (dn + dv), r});
  std::copy(v.begin(), v.end(), A.wkv_b.weight.mutable_as<float>());
}

void mlp_shapes(MlpWeights& m, const std::string& pre, int64_t I, int64_t D, LinearFormat f) {
  m.w1 = shape_only(pre + "w1.weight", f, I, D);
  m.w2 = shape_only(pre + "w2.weight", f, D, I);
  m.w3 = shape_only(pre + "w3.weight", f, I, D);
}

// The DSpark drafter (MODEL.md section 5) in the layout the checkpoints ml4 writes give it
// (weight_names.cpp add_drafter: every linear bf16): its full-width cost for speed runs
// (issue 13). The Markov head's embedding table goes up from the host, as a loaded one does.
std::unique_ptr<DrafterWeights> synthetic_drafter(const ModelConfig& cfg, std::mt19937_64& g) {
  const auto& d = cfg.drafter;
  const int64_t D = cfg.dim, R = d.rnn_rank, V = cfg.vocab_size;
  const LinearFormat bf = LinearFormat::kBF16;
  const std::string p = "mtp_dspark.";
  auto W = std::make_unique<DrafterWeights>();
  W->fc = shape_only(p + "fc.weight", bf, D, D * static_cast<int64_t>(d.target_layers.size()));
  W->fc_norm = host_values(g, D, 1.0f, 0.1f);
  W->mask_embed = host_values(g, (d.block_size - 1) * D, 0.0f, 1.0f);
  W->layers.resize(d.n_layers);
  for (int i = 0; i < d.n_layers; ++i) {
    const std::string lp = p + "layers." + std::to_string(i) + ".";
    DrafterLayerWeights& L = W->layers[i];
    L.attention_norm = host_values(g, D, 1.0f, 0.1f);
    L.ffn_norm = host_values(g, D, 1.0f, 0.1f);
    mla_shapes(L.attn, cfg, lp, bf, /*owns_kv=*/true, g);
    mlp_shapes(L.ffn, lp + "feed_forward.", cfg.hidden_dim, D, bf);
  }
  W->norm = host_values(g, D, 1.0f, 0.1f);
  W->markov_embed = Tensor(DType::kBF16, {V, R});
  {  // the device bf16 filler's values, made here: the table goes up from the host as a loaded one does
    uint16_t* e = W->markov_embed.mutable_as<uint16_t>();
    const uint64_t seed = g();
    const float amp = 1.0f / std::sqrt(static_cast<float>(R));
    for (int64_t i = 0; i < V * R; ++i) e[i] = f32_to_bf16(uniform_pm1(seed, i) * amp);
  }
  W->markov_ih = shape_only(p + "markov.weight_ih", bf, 3 * R, D + R);
  W->markov_hh = shape_only(p + "markov.weight_hh", bf, 3 * R, R);
  W->markov_bias_ih = host_values(g, 3 * R, 0.0f, 0.1f);
  W->markov_bias_hh = host_values(g, 3 * R, 0.0f, 0.1f);
  W->markov_out = shape_only(p + "markov.out.weight", bf, V, R);
  return W;
}

}  // namespace

std::shared_ptr<ModelWeights> synthetic_weight_skeleton(const ModelConfig& cfg, uint64_t seed, bool drafter) {
  std::mt19937_64 g(seed);
  auto W = std::make_shared<ModelWeights>();
  const int64_t D = cfg.dim, V = cfg.vocab_size, H = cfg.n_heads;
  const LinearFormat big = cfg.weight_format == WeightFormat::kBF16 ? LinearFormat::kBF16 : LinearFormat::kFP8Block;
  W->tok_embeddings = Tensor();  // made on the device (CudaRunner)
  W->norm = host_values(g, D, 1.0f, 0.1f);
  W->output = shape_only("output.weight", LinearFormat::kBF16, V, D);
  W->layers.resize(cfg.n_layers);
  for (int l = 0; l < cfg.n_layers; ++l) {
    const LayerSpec& spec = cfg.layers[l];
    LayerWeights& LW = W->layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    LW.attention_norm = host_values(g, D, 1.0f, 0.1f);
    LW.ffn_norm = host_values(g, D, 1.0f, 0.1f);
    AttentionWeights& A = LW.attn;
    mla_shapes(A, cfg, p, big, spec.owns_kv(), g);
    if (spec.ssmax) A.ssmax_s = host_values(g, H, 0.3f, 0.05f);
    if (spec.indexer == IndexerRole::kOwner) {
      auto I = std::make_unique<IndexerWeights>();
      const int64_t HI = cfg.indexer.n_heads, dI = cfg.indexer.head_dim;
      I->wq = shape_only(p + "attention.indexer.wq.weight", big, HI * dI, cfg.q_lora_rank > 0 ? cfg.q_lora_rank : D);
      I->wk = shape_only(p + "attention.indexer.wk.weight", big, dI, D);
      I->k_norm_weight = host_values(g, dI, 1.0f, 0.1f);
      I->k_norm_bias = host_values(g, dI, 0.0f, 0.1f);
      I->weights_proj = shape_only(p + "attention.indexer.weights_proj.weight", LinearFormat::kBF16, HI, D);
      A.indexer = std::move(I);
    }
    FfnWeights& F = LW.ffn;
    // Routed experts in the checkpoint's expert format (NVFP4 / MXFP4 checkpoints keep the rest FP8).
    const LinearFormat routed = cfg.weight_format == WeightFormat::kNVFP4Experts   ? LinearFormat::kNVFP4
                                : cfg.weight_format == WeightFormat::kMXFP4Experts ? LinearFormat::kMXFP4
                                                                                   : big;
    if (spec.ffn == FfnKind::kDense) {
      mlp_shapes(F.dense, p + "feed_forward.", cfg.hidden_dim, D, big);
    } else {
      const int64_t E = cfg.moe.num_experts, I = cfg.moe.expert_hidden_dim;
      F.gate = shape_only(p + "gate.weight", LinearFormat::kBF16, E, D);
      if (cfg.moe.has_correction_bias) F.correction_bias = host_values(g, E, 0.0f, 0.01f);
      F.experts.resize(E);
      for (int64_t e = 0; e < E; ++e) mlp_shapes(F.experts[e], p + "experts." + std::to_string(e) + ".", I, D, routed);
      if (cfg.moe.num_shared_experts > 0) {
        F.shared = std::make_unique<MlpWeights>();
        mlp_shapes(*F.shared, p + "shared_experts.", I * cfg.moe.num_shared_experts, D, big);
      }
    }
  }
  if (drafter && cfg.drafter.enabled) W->drafter = synthetic_drafter(cfg, g);
  return W;
}

}  // namespace ml4::cuda
