// Sampling on the GPU: greedy argmax per row of logits, and the engine's whole device
// sampling contract (temperature, top-k, top-p, min-p, a seeded counter-based draw and the
// chosen token's logprob) for every row of a [B, V] f32 logits array in one launch.
//
// Semantics: engine/device_sampling.h (shared with the host reference the tests and the
// engine's fallback use). Ties go to the lower token id and NaN ranks below everything, as
// cpu::topk.
//
// Design (one 1024-thread block per row, no sort, no host synchronisation, capturable):
//   1. argmax pass (float4 loads): m and the greedy token;
//   2. sum pass: sum exp(l - m) in f64 for the logprob, and the integer weight total
//      (w = exp((l - m) / T) * 2^40) when top-p needs it without top-k;
//   3. top-k: radix select by count over order-preserving 32-bit keys, 11 + 11 + 10 bits, a
//      shared-memory histogram of counts and integer weights per digit (warp-aggregated with
//      __match_any_sync + __reduce_add_sync, so the sums are order-independent): gives the
//      k-th key, how many of its ties to keep, and the top-k weight;
//   4. top-p: the same radix select by weight, target top_p * (top-k weight);
//   5. when the shorter cut splits a run of equal logits, one pass finds the id of the last
//      tie kept (lowest ids first, as a stable sort);
//   6. final pass: Gumbel-max over the kept ids (min-p tested per id) with Philox noise keyed
//      by (seed, counter, id / 4): the token depends on nothing but the row and its params.
// Each pass re-reads the row (512 KB at V = 131072; from L2 after the first), at most 9.
//
// Runner integration (CudaRunner): keep a pinned host array and a device array of
// max_batch DeviceSamplingParams (32 B each) and device int32 tokens / f32 logprobs of
// max_batch. Per step: write the params of the rows whose logits were computed (in row
// order) into the pinned array, cudaMemcpyAsync them to the device array on the step's
// stream, call sample_rows(logits, B, V, params_dev, tokens_dev, logprobs_dev, stream), and
// copy tokens + logprobs back (8 B per row) instead of the B x V logits. All three are graph
// capturable (fixed pinned source and device addresses, no allocation, no sync inside).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "runtime/step.h"

namespace ml4::cuda {

// logits [B, V] f32 -> out [B] int32.
Status argmax_rows(const float* logits, int64_t B, int64_t V, int32_t* out, cudaStream_t stream);

// Samples one token per row. logits: device f32, row r at logits + r * row_stride
// (row_stride < 0: V; 0: every row reads the same logits, for tests and benchmarks).
// params: DEVICE array [B] of DeviceSamplingParams. tokens: device [B] int32. logprobs:
// device [B] f32 (log_softmax of the unmodified row at the token) or nullptr.
// Out-of-range fields act as "off" (top_k <= 0 or >= V, top_p >= 1 or NaN, min_p <= 0),
// temperature <= 0 or NaN is greedy; min_p above 1 acts as 1.
Status sample_rows(const float* logits, int64_t B, int64_t V, const DeviceSamplingParams* params, int32_t* tokens,
                   float* logprobs, cudaStream_t stream, int64_t row_stride = -1);

}  // namespace ml4::cuda
