// Rotary position embedding (MODEL.md 3.2): inverse frequencies with YaRN, the
// attention factor, LeRoPE position mapping, Mistral 4's llama-4 query temperature,
// and the two pair layouts (MLA interleaved, DSA indexer NeoX-style).
//
// Sources: DeepSeek-V3 inference/model.py `precompute_freqs_cis`; transformers
// modeling_rope_utils.py `_compute_yarn_parameters` (same formulas; transformers adds
// the `truncate` flag, default true = DeepSeek's floor/ceil). Frequencies are computed
// in f64 and rounded to f32 once (torch computes them in f32, so values may differ
// from torch's by an ulp). Angles pos * inv_freq are formed in f64 and cos/sin
// evaluated in f64, then cast to f32, so long positions lose nothing to f32 angles.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_config.h"

namespace ml4::cpu {

// rope_dim/2 inverse frequencies theta^(-2i/rope_dim), YaRN-blended when yarn.enabled.
std::vector<float> rope_inv_freq(double theta, int rope_dim, const YarnConfig& yarn);

// The cos/sin multiplier: yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor,
// mscale_all_dim) (transformers `attention_factor`); 1 when yarn is off.
float rope_attention_factor(const YarnConfig& yarn);

// LeRoPE: p for p < window, window + (p - window) / leak beyond; p when disabled (or
// leak <= 0, which the config loader rejects).
double lerope_position(int64_t p, const LeRopeConfig& cfg);

// Mistral 4: 1 + beta * log(1 + floor(p / original_max_position_embeddings)); 1 when off.
float llama4_q_scale(int64_t p, const Llama4Scaling& cfg);

// Rotates n_vec vectors (vector j starts at x + j*stride) in place: pair
// (x[2i], x[2i+1]) by angle pos*inv_freq[i], i < rope_dim/2, then scales by attn_factor.
void rope_interleaved(float* x, int64_t n_vec, int rope_dim, int64_t stride, double pos,
                      const float* inv_freq, float attn_factor);

// As rope_interleaved with pairs (x[i], x[i + rope_dim/2]) (NeoX / DSA indexer style).
void rope_neox(float* x, int64_t n_vec, int rope_dim, int64_t stride, double pos,
               const float* inv_freq, float attn_factor);

}  // namespace ml4::cpu
