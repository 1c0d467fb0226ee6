// MoE router (MODEL.md 3.7): scores, optional group-limited selection and correction
// bias, top-k, and the weights handed to the experts. See moe.cpp for the sources.
#pragma once

#include <cstdint>

#include "model/model_config.h"

namespace ml4::cpu {

// logits: [T, num_experts] f32; correction_bias: [num_experts] or null; ids/weights:
// [T, num_experts_per_tok]. ids come out in descending selection score (ties: lower id).
// A config that cannot route (no experts, k > experts, experts not divisible by groups;
// the config loader rejects these) is logged and gives ids -1, weights 0.
void moe_route(const float* logits, int64_t T, const MoeConfig& cfg, const float* correction_bias,
               int32_t* ids, float* weights);

}  // namespace ml4::cpu
