// Synthetic weights for speed measurements on the device (bench/decode_step_bench.cpp):
// a full-width model (ml4-slice-4 holds ~40 GB of FP8 experts) cannot be written and read
// back within a GPU session, so its linears are made directly in device memory.
//
// synthetic_weight_skeleton(cfg) builds the ModelWeights structure load_model_weights
// would (model_weights.cpp load_layer: same fields, names and shapes), where every linear
// carries its name, format and shape but no bytes; the small host vectors (norms, biases,
// W_UK / W_UV, SSMax scales) get seeded random values. synthetic_linear() then allocates a
// linear on the device and fills it from a counter-based hash:
//   e4m3 weights: sign random, exponent field 5..9, mantissa random (|w| in [1/4, 7.5]),
//                 block scales 1 / (4 sqrt(K)) -> |w * s| ~ 1/sqrt(K), activations stay O(1);
//   bf16 / f32 : uniform in +-1/sqrt(K).
// Every byte pattern the e4m3 filler writes is also a finite f32 / bf16 when read as one,
// so fill_synthetic_bytes also serves KV pages (finite latent rows, scales and rope parts).
// The values mean nothing; shapes, formats and routing spread (random router) are real.
#pragma once

#include <cstdint>
#include <memory>

#include <cuda_runtime.h>

#include "model/model_config.h"
#include "model/model_weights.h"
#include "ops/cuda/linear.h"

namespace ml4::cuda {

// Linears in the config's weight format (bf16, or FP8 block for every weight format other
// than bf16), the indexer's weights_proj, the router gate and the output head in bf16, as
// the checkpoints ml4 writes have them (weight_names.cpp). drafter: also the DSpark drafter of
// a config with `mtp` (all bf16, as ml4's checkpoints store it).
std::shared_ptr<ModelWeights> synthetic_weight_skeleton(const ModelConfig& cfg, uint64_t seed, bool drafter = false);

Result<DeviceLinear> synthetic_linear(const LinearWeight& shape_only, uint64_t seed);

// n bytes of the e4m3 filler (finite as e4m3, bf16 and f32).
Status fill_synthetic_bytes(void* p, int64_t n, uint64_t seed, cudaStream_t stream = nullptr);
// n bf16 values uniform in +-amplitude.
Status fill_synthetic_bf16(void* p, int64_t n, float amplitude, uint64_t seed, cudaStream_t stream = nullptr);

}  // namespace ml4::cuda
