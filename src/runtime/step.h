// The contract between the engine (scheduler) and a model runner (CPU or CUDA).
//
// The engine decides, per step, which sequences advance by which tokens and which KV
// blocks each sequence owns in each cache group; the runner turns that into per-token
// metadata (positions, slot mapping, top-k buffers), runs the forward, writes the new
// tokens' KV into the cache pages and returns logits where asked.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "ops/cpu/sampling.h"  // DeviceSamplingParams

namespace ml4 {

// One sequence's share of a step.
struct SeqStep {
  int64_t seq_id = 0;
  std::vector<int32_t> tokens;   // the new tokens: a prefill chunk, or 1 (decode), or 1+drafts
  int64_t start_pos = 0;         // position of tokens[0] == tokens already in the cache
  // Per cache group (index = group id from KvCacheSpec): block ids in position order;
  // block b covers positions [b*page, (b+1)*page). Must cover start_pos + tokens.size().
  std::vector<std::vector<int32_t>> block_tables;
  // Logits are returned for the last `num_logits` tokens of this chunk (0: none, as for
  // a prefill chunk that does not end the prompt; 1: normal decode; 1+k: verification).
  int num_logits = 1;
  // Set by the engine only when the runner samples on its device, with num_logits == 1, or
  // with 1 + k rows of greedy params (a request verifying its drafts greedily: each row's
  // argmax decides, engine/spec_decode.h verify_greedy): the runner may then return one token
  // per row in StepOutput::sampled instead of the logits.
  std::optional<DeviceSamplingParams> device_sampling;
  // Structured outputs, with device_sampling on a runner that applies_token_masks(): the
  // allowed tokens of this row as a bitmask ((vocab + 31) / 32 words, bit i % 32 of word i / 32;
  // xgrammar's layout), applied to the logits before the draw. Empty: no mask.
  std::vector<uint32_t> allowed_tokens;
  // DSpark verification on the runner's device (ModelRunner::verifies_on_device): set by the
  // engine only with num_logits == 1 + k and device_sampling holding a random request's params
  // (seed, and the output index of the token row 0 decides as `counter`). The runner verifies
  // the drafts, the chunk's last k tokens, as engine/spec_decode.h verify_drafts does (p from
  // these rows under device_sampling, the same uniforms) and returns what it emits in
  // StepOutput::verified; q is
  //   kOneHotQ: one-hot at each draft (greedy drafts),
  //   kKeptQ:   the distributions it kept on its device from this sequence's last draft()
  //             (DraftSeq::keep_probs); a runner without them for these drafts fails the step.
  enum class DeviceVerify : uint8_t { kNo, kOneHotQ, kKeptQ };
  DeviceVerify device_verify = DeviceVerify::kNo;
};

struct StepInput {
  std::vector<SeqStep> seqs;
};

struct StepOutput {
  // For each seq in order, num_logits rows of [vocab] logits (f32), concatenated.
  std::vector<std::vector<float>> logits;
  // Device sampling: when every sequence with num_logits > 0 carries device_sampling, a
  // runner may leave `logits` empty and fill these instead: the sampled token and its logprob
  // (log_softmax of the unmodified logits) for each row asked for, sequences in order, rows in
  // order (one entry per row: 1 + k for a verifying sequence). Where no sequence has more than
  // one row, one entry per sequence in order is also accepted (-1 and 0 for a sequence with
  // num_logits == 0). A runner may always return logits instead; the engine then draws on the
  // host with the same counter-based generator.
  std::vector<int32_t> sampled;
  std::vector<float> sampled_logprob;
  // When any sequence has SeqStep::device_verify: one entry per sequence in order (empty for
  // the others). `tokens` are the accepted drafts, then the correction or bonus token
  // (accepted + 1 of them); `logprobs` each one's log_softmax under its raw row. The
  // logits / sampled entries of these sequences are present as usual and not read.
  struct Verified {
    int accepted = 0;
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
  };
  std::vector<Verified> verified;
};

// DSpark (MODEL.md section 5, SYSTEM.md S7): one block of drafts per sequence, proposed after
// a target step. The target forward of a runner with a drafter writes the drafter's context
// K/V for every token it processes (into the drafter group's blocks of SeqStep::block_tables,
// where they exist); a draft step reads the window of it before the anchor.
struct DraftSeq {
  int64_t seq_id = 0;
  int32_t anchor_token = 0;  // the last accepted token (not yet processed by the target)
  int64_t anchor_pos = 0;    // its position == tokens in the target's cache
  // As SeqStep: per cache group; only the drafter group's is read, and it must cover
  // [anchor_pos - window, anchor_pos + block_size) (the block's own rows are written at its
  // positions, where the next target step overwrites them).
  std::vector<std::vector<int32_t>> block_tables;
  int num_drafts = 0;  // 1 .. block_size - 1
  // Probabilistic drafts: slot j (1-based) is drawn with these parameters and counter
  // sampling->counter + j - 1; none: greedy (argmax).
  std::optional<DeviceSamplingParams> sampling;
  // With `sampling`, on a runner that verifies_on_device(): keep these drafts' distributions
  // on the device for the next execute() of this sequence (SeqStep::DeviceVerify::kKeptQ)
  // instead of returning them (DraftOutput::probs[i] stays empty). Kept until the sequence is
  // drafted again or released (ModelRunner::release).
  bool keep_probs = false;
};

struct DraftInput {
  std::vector<DraftSeq> seqs;
  bool want_probs = false;  // return each draft's distribution q (probabilistic verification), but for keep_probs sequences
};

struct DraftOutput {
  std::vector<std::vector<int32_t>> tokens;  // [seq][num_drafts]
  std::vector<std::vector<float>> probs;     // [seq][num_drafts * vocab] when want_probs
};

}  // namespace ml4
