// The drafter's token choice on the host, shared by both backends' Backend::choose_tokens (the
// CUDA backend's sampled drafts come back to the host for it, so its drafts are the CPU
// backend's bit for bit).
#pragma once

#include <cstdint>

#include "ops/cpu/sampling.h"

namespace ml4::cpu {

// For each of `rows` rows of V logits: without params, the argmax and (when probs is given)
// the row's softmax; with params, the row's distribution q under them (row_distribution) into
// probs and a token drawn from that q (draw_from_weights; the argmax when greedy), or without
// probs the device contract's draw (sample_row_reference). ids [rows]; probs [rows, V] or null.
void choose_draft_tokens(const float* logits, int64_t rows, int64_t V, const DeviceSamplingParams* params,
                         int32_t* ids, float* probs);

}  // namespace ml4::cpu
