// The control messages of a parallel run (runtime/parallel_runner.h): a step with forced
// decisions survives encoding exactly, every truncation of it is refused with an error (never
// read past its end), and a DP replica's slice holds its sequences with block ids made local
// (a sequence whose blocks span two replicas is refused).
#include "runtime/parallel_runner.h"

#include <random>

#include <gtest/gtest.h>

namespace ml4 {
namespace {

StepInput random_step(std::mt19937& g) {
  StepInput in;
  for (int i = 0; i < 3; ++i) {
    SeqStep s;
    s.seq_id = 10 + i;
    for (int k = 0; k < 1 + static_cast<int>(g() % 9); ++k) s.tokens.push_back(static_cast<int32_t>(g() % 500));
    s.start_pos = g() % 100;
    s.num_logits = 1;
    s.block_tables = {{static_cast<int32_t>(g() % 8), static_cast<int32_t>(g() % 8)}, {-1, static_cast<int32_t>(g() % 8)}};
    if (i == 1) {
      DeviceSamplingParams p;
      p.temperature = 0.7f;
      p.top_k = 5;
      p.seed = g();
      p.counter = 3;
      s.device_sampling = p;
    }
    in.seqs.push_back(s);
  }
  return in;
}

TEST(ParallelWire, StepRoundTripsAndTruncationsAreRefused) {
  std::mt19937 g(4);
  const StepInput in = random_step(g);
  ForwardTrace forced;
  forced.forced_topk = {{}, {{0, 1}, {2}}, {}};
  forced.forced_experts = {{}, {{3, 4}, {5, 6}}};
  const std::vector<uint8_t> bytes = encode_step(in, &forced);
  StepInput out;
  ForwardTrace f2;
  bool traced = false;
  ASSERT_TRUE(decode_step(bytes, &out, &f2, &traced).ok());
  ASSERT_TRUE(traced);
  ASSERT_EQ(out.seqs.size(), in.seqs.size());
  for (size_t i = 0; i < in.seqs.size(); ++i) {
    EXPECT_EQ(out.seqs[i].seq_id, in.seqs[i].seq_id);
    EXPECT_EQ(out.seqs[i].tokens, in.seqs[i].tokens);
    EXPECT_EQ(out.seqs[i].start_pos, in.seqs[i].start_pos);
    EXPECT_EQ(out.seqs[i].block_tables, in.seqs[i].block_tables);
    EXPECT_EQ(out.seqs[i].num_logits, in.seqs[i].num_logits);
    ASSERT_EQ(out.seqs[i].device_sampling.has_value(), in.seqs[i].device_sampling.has_value());
    if (in.seqs[i].device_sampling) {
      EXPECT_EQ(out.seqs[i].device_sampling->seed, in.seqs[i].device_sampling->seed);
      EXPECT_EQ(out.seqs[i].device_sampling->top_k, 5);
    }
  }
  EXPECT_EQ(f2.forced_topk, forced.forced_topk);
  EXPECT_EQ(f2.forced_experts, forced.forced_experts);
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    std::vector<uint8_t> part(bytes.begin(), bytes.begin() + cut);
    StepInput o;
    ForwardTrace t;
    bool tr = false;
    EXPECT_FALSE(decode_step(part, &o, &t, &tr).ok()) << "cut at " << cut;
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_FALSE(decode_step(longer, &out, &f2, &traced).ok());
}

// A DSpark draft step (ParallelRunner::draft broadcasts it): the same checks.
TEST(ParallelWire, DraftRoundTripsAndTruncationsAreRefused) {
  std::mt19937 g(9);
  DraftInput in;
  in.want_probs = true;
  for (int i = 0; i < 3; ++i) {
    DraftSeq d;
    d.seq_id = 40 + i;
    d.anchor_token = static_cast<int32_t>(g() % 500);
    d.anchor_pos = g() % 1000;
    d.block_tables = {{static_cast<int32_t>(g() % 8)}, {-1, static_cast<int32_t>(g() % 8), 3}};
    d.num_drafts = 1 + static_cast<int>(g() % 7);
    if (i != 1) {
      DeviceSamplingParams p;
      p.temperature = 0.9f;
      p.top_p = 0.8f;
      p.seed = g();
      p.counter = 11 + i;
      d.sampling = p;
    }
    in.seqs.push_back(d);
  }
  const std::vector<uint8_t> bytes = encode_draft(in);
  DraftInput out;
  ASSERT_TRUE(decode_draft(bytes, &out).ok());
  EXPECT_TRUE(out.want_probs);
  ASSERT_EQ(out.seqs.size(), in.seqs.size());
  for (size_t i = 0; i < in.seqs.size(); ++i) {
    EXPECT_EQ(out.seqs[i].seq_id, in.seqs[i].seq_id);
    EXPECT_EQ(out.seqs[i].anchor_token, in.seqs[i].anchor_token);
    EXPECT_EQ(out.seqs[i].anchor_pos, in.seqs[i].anchor_pos);
    EXPECT_EQ(out.seqs[i].block_tables, in.seqs[i].block_tables);
    EXPECT_EQ(out.seqs[i].num_drafts, in.seqs[i].num_drafts);
    ASSERT_EQ(out.seqs[i].sampling.has_value(), in.seqs[i].sampling.has_value());
    if (in.seqs[i].sampling) {
      EXPECT_EQ(out.seqs[i].sampling->seed, in.seqs[i].sampling->seed);
      EXPECT_EQ(out.seqs[i].sampling->counter, in.seqs[i].sampling->counter);
      EXPECT_EQ(out.seqs[i].sampling->top_p, 0.8f);
    }
  }
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    std::vector<uint8_t> part(bytes.begin(), bytes.begin() + cut);
    DraftInput o;
    EXPECT_FALSE(decode_draft(part, &o).ok()) << "cut at " << cut;
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_FALSE(decode_draft(longer, &out).ok());
}

TEST(ParallelWire, DpSliceMakesBlocksLocal) {
  // Two replicas of 8 blocks per group: seq 0 on replica 1, seq 1 on replica 0, seq 2 spans.
  StepInput in;
  auto seq = [](int64_t id, std::vector<int32_t> a, std::vector<int32_t> b) {
    SeqStep s;
    s.seq_id = id;
    s.tokens = {1};
    s.block_tables = {a, b};
    return s;
  };
  in.seqs = {seq(1, {9, 12}, {-1, 8}), seq(2, {0, 3}, {1, -1})};
  std::vector<int> idx;
  auto r1 = dp_slice(in, 1, 2, {8, 8}, &idx);
  ASSERT_TRUE(r1.ok()) << r1.status().message();
  ASSERT_EQ(r1->seqs.size(), 1u);
  EXPECT_EQ(idx, std::vector<int>{0});
  EXPECT_EQ(r1->seqs[0].block_tables, (std::vector<std::vector<int32_t>>{{1, 4}, {-1, 0}}));
  auto r0 = dp_slice(in, 0, 2, {8, 8}, &idx);
  ASSERT_TRUE(r0.ok());
  EXPECT_EQ(idx, std::vector<int>{1});
  EXPECT_EQ(r0->seqs[0].block_tables, (std::vector<std::vector<int32_t>>{{0, 3}, {1, -1}}));
  in.seqs.push_back(seq(3, {2, 10}, {2, 3}));
  auto bad = dp_slice(in, 0, 2, {8, 8});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("span DP ranks"), std::string::npos) << bad.status().message();
}

}  // namespace
}  // namespace ml4
