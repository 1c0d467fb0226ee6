// Sampling on the GPU: greedy argmax per row of logits, and the engine's whole device
// sampling contract (temperature, top-k, top-p, min-p, a seeded counter-based draw and the
// chosen token's logprob) for every row of a [B, V] f32 logits array in one call.
//
// Semantics: ops/cpu/sampling.h (shared with the host reference the tests and the
// engine's fallback use). Ties go to the lower token id and NaN ranks below everything, as
// cpu::topk.
//
// Design, with a workspace (the split path, sampling.cu; sample_rows_workspace_bytes):
//   K1 one pass over the row by (row, 4 warp-tiles of 1024 logits) blocks: per-tile max /
//      argmax and f64 sum exp(l - m_tile) (the logprob; a fixed partition, whatever B is);
//   K2 (rows with top-k or top-p) a histogram of (m - l) in bins of 1/32 logit (2048 bins,
//      the last takes everything more than 64 below the max): count, and integer weight for top-p alone.
//      The row's last K2 block to finish scans the histogram to a plan: the bin holding the
//      top-k cut (count) or the top-p cut (weight, top-p alone); ids in bins before it are
//      surely kept, ids in the cut bin are candidates (top-k and top-p together: every id of
//      the bins up to the top-k cut bin, as the top-p target needs the top-k weight);
//   K3 a warp per 256 logits: the Gumbel score of the surely-kept ids (min-p per id), best
//      per warp, and the candidates appended to a list;
//   K4 one 1024-thread block per row: the logprob from the tile sums; the token as the best
//      of the tile scores and of the candidates, which are sorted by (key, id) (bitonic,
//      <= 2048, in registers) so the rank (top-k) and prefix-weight (top-p) rules, ties
//      included, apply exactly as in the host reference.
//   A row whose candidate set is larger than 2048 (a cut inside a bin of > 2048 ids: huge tie
//   runs, top-p 0.99 over very flat logits, top-k > ~2000 together with top-p) or whose max
//   is infinite falls back, inside K4, to the one-block sampler below: exact, slow.
//   Every reduction is in a fixed order or over integers, so a row's token and logprob are
//   bit-reproducible and independent of B and of the row's place in the batch.
// Without a workspace (the older overload): one 1024-thread block per row, no sort:
//   1. argmax pass (float4 loads): m and the greedy token;
//   2. sum pass: sum exp(l - m) in f64 for the logprob, and the integer weight total
//      (w = exp((l - m) / T) * 2^40) when top-p needs it without top-k;
//   3. top-k: radix select by count over order-preserving 32-bit keys, 11 + 11 + 10 bits, a
//      shared-memory histogram of counts and integer weights per digit: gives the k-th key,
//      how many of its ties to keep, and the top-k weight;
//   4. top-p: the same radix select by weight, target top_p * (top-k weight);
//   5. when the shorter cut splits a run of equal logits, one pass finds the id of the last
//      tie kept (lowest ids first, as a stable sort);
//   6. final pass: Gumbel-max over the kept ids (min-p tested per id); when no id is kept
//      (only with an infinite max: every weight NaN or 0), the argmax, as the host reference.
//   Each pass re-reads the row, at most 9: ~50 us (greedy) to ~1 ms (top-k + top-p) per launch
//   at any B on an H200 (docs/BENCHMARKS.md "Sampling on the GPU"); its logprob sums in
//   another order than the split path's (equal to ~1e-7, not bit-equal).
// The Gumbel noise is Philox keyed by (seed, counter, id / 4): the token depends on nothing
// but the row and its params, on either path.
//
// Structured outputs: rows with a grammar need apply_token_bitmask on their logits first
// (below); the runner uploads a [B, ceil(V / 32)] uint32 mask with the params.
//
// Runner integration (CudaRunner): keep a pinned host array and a device array of
// max_batch DeviceSamplingParams (32 B each), device int32 tokens / f32 logprobs of
// max_batch, and a device workspace of sample_rows_workspace_bytes(max_batch, V) (~46 KiB a
// row at V = 131072). Per step: write the params of the rows whose logits were computed (in
// row order) into the pinned array, cudaMemcpyAsync them to the device array on the step's
// stream, call sample_rows(logits, B, V, params_dev, tokens_dev, logprobs_dev, ws, ws_bytes,
// stream), and copy tokens + logprobs back (8 B per row) instead of the B x V logits. All of
// it is graph capturable (fixed addresses, no allocation, no host sync; the workspace needs
// no initialisation: K1 resets what K2 / K3 accumulate).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "ops/cpu/sampling.h"

namespace ml4::cuda {

// The argmax of each row a[r, :V] + b[r, :V] (b null: a alone; the f32 sum add_rows forms,
// not stored) -> out [B] int32: ties to the lower id, NaN ranks last, -0 equals +0
// (sampling::ranks_above). Tiles of 4096 logits per block (a grid of (tiles, B)), then one warp
// per row over the tiles' results: a row of 131,072 logits is read by 32 blocks. Each logit
// becomes a 64-bit key (order-preserving value bits above, ~id below, NaN lowest, -0 as +0), so
// the maximum key is the argmax whatever the tiling.
// Rows a_stride / b_stride floats apart. workspace: device memory of at least
// argmax_rows_workspace_bytes(B, V) bytes, 8-byte aligned, no initialisation, one per stream.
size_t argmax_rows_workspace_bytes(int64_t B, int64_t V);
Status argmax_rows(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t B, int64_t V,
                         int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The drafter's sampled drafts on the device (DSpark, "draft_sample_method": "probabilistic"):
// for each row r of logits [B, V], q = sampling::row_distribution(row, params[r]) into probs
// [B, V] (f32) and ids[r] = sampling::draw_from_weights(q, seed, counter) -- an inverse-CDF
// draw with the host's uniform -- or, for a greedy row, q one-hot at the argmax and that id:
// cpu::choose_draft_tokens with probs, on the device, so a sampled draft runs inside a CUDA
// graph. Sums run in double in a fixed tiled order instead of the host's sequential one: q
// agrees to ~1e-16 relative before its f32 rounding, and a token differs from the host's only
// where u * total falls that close to a boundary of the cumulative sum.
// Rows with top-k or top-p (needs_kept_cut) first get their kept prefix, one 1024-thread block
// a row: the sampler's radix select (the split path's fallback, sampling_row.cuh) over the
// order (logit descending, id ascending), top-p on its integer weights (2^-40 per id from the
// host's f64 sums: a cut differs from row_distribution's only where the cumulative weight
// falls that close to top_p); `cuts` must be true when any row needs it (the caller knows the
// parameters), false skips that launch.
// params: DEVICE [B]. workspace: draft_rows_workspace_bytes(B, V), 8-byte aligned, no
// initialisation, one per stream.
bool needs_kept_cut(const DeviceSamplingParams& p, int64_t V);
size_t draft_rows_workspace_bytes(int64_t B, int64_t V);
Status draft_rows(const float* logits, int64_t B, int64_t V, const DeviceSamplingParams* params, int32_t* ids,
                  float* probs, void* workspace, size_t workspace_bytes, cudaStream_t stream, bool cuts);

// DSpark verification of random requests on the device: engine/spec_decode.h verify_drafts
// (vLLM's rejection sampler) for n sequences at once, so neither the target's rows nor the
// drafts' q leave the device. Sequence s (VerifySeq, a DEVICE array) has k drafts at
// drafts[draft0 ..], its 1 + k logits rows from logits row row0 (V floats apart), q's k rows
// from q row q0 (q0 < 0: q one-hot at each draft, greedy drafts), and its parameters (seed;
// counter = the output index of the token row 0 decides: the verifier's uniforms,
// sampling::verify_uniforms). p = sampling::row_distribution of each row (temperature, top-k,
// top-p, min-p; the top-k / top-p cut as draft_rows makes it, every row of every sequence at
// once before the verification); draft j is accepted when q(d) > 0 and p(d) / q(d)
// >= u; the first rejection emits a draw from max(p - q, 0), all passing a bonus from p_k.
// Out: tokens / logprobs [out0 .. out0 + k]: the accepted drafts, then the emitted token, then
// -1 (logprob 0); the logprob of each is its row's log_softmax; accepted [n]. Sums are f64
// in a fixed order other than the host's sequential one: a decision differs from
// verify_drafts only where u falls within rounding (~1e-15 relative) of its threshold.
struct VerifySeq {
  int64_t row0 = 0;
  int64_t q0 = -1;
  int32_t k = 0;
  int32_t draft0 = 0;
  int32_t out0 = 0;
  int32_t pad = 0;
  DeviceSamplingParams params;
};
// max_k: the largest k of the n sequences; rows: the logits rows they reach (every row0 + k <
// rows); workspace: verify_rows_workspace_bytes(rows), 8-byte aligned, no initialisation.
// verify_rows_supported: random rows (a greedy request verifies by each row's argmax instead).
bool verify_rows_supported(const DeviceSamplingParams& p, int64_t V);
size_t verify_rows_workspace_bytes(int64_t rows);
Status verify_rows(const float* logits, int64_t V, const float* q, const int32_t* drafts, const VerifySeq* seqs,
                   int64_t n, int max_k, int32_t* tokens, float* logprobs, int32_t* accepted, void* workspace,
                   size_t workspace_bytes, int64_t rows, cudaStream_t stream);

// Samples one token per row. logits: device f32, row r at logits + r * row_stride
// (row_stride < 0: V; 0: every row reads the same logits, for tests and benchmarks).
// params: DEVICE array [B] of DeviceSamplingParams. tokens: device [B] int32. logprobs:
// device [B] f32 (log_softmax of the unmodified row at the token) or nullptr.
// Out-of-range fields act as "off" (top_k <= 0 or >= V, top_p >= 1 or NaN, min_p <= 0),
// temperature <= 0 or NaN is greedy; min_p above 1 acts as 1.
// This overload runs the one-block-per-row kernel (no workspace): slow at small B.
Status sample_rows(const float* logits, int64_t B, int64_t V, const DeviceSamplingParams* params, int32_t* tokens,
                   float* logprobs, cudaStream_t stream, int64_t row_stride = -1);

// Device bytes of the workspace the split path needs for B rows of V logits:
// B * (~40 KiB + 48 B per 1024 logits). 0 when B or V <= 0.
size_t sample_rows_workspace_bytes(int64_t B, int64_t V);

// The same contract through the split path (several blocks per row; see "Design"): the same
// tokens as the overload above and as the host reference. workspace: device memory of at
// least sample_rows_workspace_bytes(B, V) bytes, 256-byte aligned, no initialisation, not
// shared with a launch running at the same time (one per stream).
Status sample_rows(const float* logits, int64_t B, int64_t V, const DeviceSamplingParams* params, int32_t* tokens,
                   float* logprobs, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   int64_t row_stride = -1);

// Structured outputs (engine/structured_output.h): sets logits[r, i] = -inf wherever bit
// i % 32 of word i / 32 of row r's mask is clear, in place, before sample_rows / argmax_rows
// (as vLLM applies xgrammar's bitmask to the logits before its sampler). allowed: device
// [B, (V + 31) / 32] uint32, row r at allowed + r * words; a row without a grammar is all
// ones. Masked ids then weigh 0 in every path above and the logprob is that of the masked
// distribution, as on the host (engine/sampler.h). Graph capturable; one read of the mask,
// writes only where a bit is clear. row_stride as for sample_rows.
Status apply_token_bitmask(float* logits, int64_t B, int64_t V, const uint32_t* allowed, cudaStream_t stream,
                           int64_t row_stride = -1);

// For tests: how the split path's last call on `workspace` resolved rows [0, B) (stale for
// greedy rows). Synchronous (cudaMemcpy).
enum class SplitPlan : int32_t { kAll = 0, kTopK = 1, kTopP = 2, kTopKTopP = 3, kFallback = 4 };
Status sample_rows_split_plans(const void* workspace, int64_t B, int64_t V, SplitPlan* plans);

}  // namespace ml4::cuda
