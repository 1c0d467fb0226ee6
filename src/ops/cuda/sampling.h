// Sampling on the GPU: greedy argmax per row of logits, the engine's temperature-0 path
// (engine/sampler.h does the rest on the host for now). Ties go to the lower token id
// and NaN ranks below everything, as cpu::topk.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"

namespace ml4::cuda {

// logits [B, V] f32 -> out [B] int32.
Status argmax_rows(const float* logits, int64_t B, int64_t V, int32_t* out, cudaStream_t stream);

}  // namespace ml4::cuda
