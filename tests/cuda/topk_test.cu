// GPU radix top-k against ml4::cpu::topk on the same rows: the selected positions must be
// exactly the CPU's set (same tie rule: lower position first; NaN as -inf; -0 == +0), written
// in ascending order, then -1 up to k. Rows have mixed lengths (shorter than k, one element,
// empty, 70k) and the score buffer past each row's length holds +inf: any read past the valid
// length would select it, so the scans provably stop at `lengths`. Both paths: one block per
// row, and the multi-block path (workspace given, splits forced: 7 and 64 blocks per row, so
// chunks end inside ties, short rows leave blocks empty, and row 0 spans many chunks).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "kv/kv_cache_dtype.h"
#include "ops/cpu/basic.h"
#include "ops/cuda/topk.h"

namespace ml4::cuda {
namespace {

using testing::poisoned;
using testing::to_device;
using testing::to_host;

// One topk call over every row with all three outputs (pos / slots [T, k], counts [T]), from
// poisoned buffers; `set` adds the path's own parameters (splits, workspace, max_length, ...).
struct TopkOut {
  std::vector<int32_t> pos, slots, counts;
};
template <typename Set>
TopkOut run_topk(const float* scores, int64_t stride, const int32_t* lengths, int64_t T, int k, const int32_t* bt,
                 int64_t pages, const int32_t* seq_of, Set set) {
  auto d_pos = poisoned<int32_t>(T * k), d_slots = poisoned<int32_t>(T * k), d_cnt = poisoned<int32_t>(T);
  TopkParams p;
  p.scores = scores;
  p.scores_stride = stride;
  p.lengths = lengths;
  p.T = T;
  p.k = k;
  p.positions = d_pos.as<int32_t>();
  p.slots = d_slots.as<int32_t>();
  p.counts = d_cnt.as<int32_t>();
  p.block_table = bt;
  p.block_table_stride = pages;
  p.seq_of_token = seq_of;
  set(p);
  TopkOut o;
  const Status st = topk(p);
  EXPECT_TRUE(st.ok()) << st.message();
  if (!st.ok()) return o;
  EXPECT_TRUE(cuda_status(cudaDeviceSynchronize(), "sync").ok());
  o.pos = to_host<int32_t>(d_pos, T * k);
  o.slots = to_host<int32_t>(d_slots, T * k);
  o.counts = to_host<int32_t>(d_cnt, T);
  return o;
}

// Checks o against cpu::topk row by row: the counts, the positions in ascending order then -1,
// and their slots (row t's pages: bt_of_row[t * pages + s / 64]). Returns the rows that differ.
int64_t rows_differing(const std::vector<float>& scores, int64_t stride, const std::vector<int32_t>& lengths, int k,
                       const TopkOut& o, const std::vector<int32_t>& bt_of_row, int64_t pages, const std::string& what) {
  const int64_t T = static_cast<int64_t>(lengths.size());
  if (o.pos.size() != static_cast<size_t>(T * k)) return T;
  int64_t bad_rows = 0;
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(o.counts[t], std::min(k, lengths[t])) << what << " row " << t;
    std::vector<int32_t> ref(k);
    cpu::topk(scores.data() + t * stride, lengths[t], k, ref.data());
    const int kk = std::min(k, lengths[t]);
    std::sort(ref.begin(), ref.begin() + kk);
    int bad = 0;
    for (int i = 0; i < k; ++i) {
      const int32_t want = i < kk ? ref[i] : -1;
      const int32_t want_slot =
          i < kk ? bt_of_row[t * pages + want / kPageTokens] * kPageTokens + want % kPageTokens : -1;
      bad += o.pos[t * k + i] != want || o.slots[t * k + i] != want_slot;
    }
    bad_rows += bad != 0;
    EXPECT_EQ(bad, 0) << what << " row " << t << " (length " << lengths[t] << ")";
  }
  return bad_rows;
}

TEST(CudaTopk, MatchesCpuTopkWithTiesNanAndPadding) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(2024);
  const std::vector<int32_t> lengths = {70000, 2048, 2049, 5000, 1, 0, 3000, 3000, 130, 65536};
  const int64_t T = static_cast<int64_t>(lengths.size());
  const int64_t stride = 70016;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> scores(T * stride, inf);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    float* row = scores.data() + t * stride;
    for (int i = 0; i < lengths[t]; ++i) row[i] = nd(rng);
  }
  // Row 6: heavy ties (8 distinct values) and signed zeros; row 7: NaNs and infinities;
  // row 3: all positive, close together (one exponent: the first radix digit is shared).
  for (int i = 0; i < 3000; ++i) scores[6 * stride + i] = static_cast<float>(static_cast<int>(rng() % 8) - 4) * 0.5f;
  for (int i = 0; i < 3000; i += 7) scores[6 * stride + i] = -0.0f;
  for (int i = 0; i < 3000; i += 13) scores[7 * stride + i] = std::numeric_limits<float>::quiet_NaN();
  for (int i = 5; i < 3000; i += 101) scores[7 * stride + i] = -inf;
  scores[7 * stride + 17] = inf;
  for (int i = 0; i < 5000; ++i) scores[3 * stride + i] = 1.0f + std::ldexp(static_cast<float>(rng() % 4096), -13);

  // One sequence per row, pages shuffled.
  const int64_t pages = stride / kPageTokens;
  std::vector<int32_t> bt(T * pages), seq_of(T);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(pages);
    std::iota(perm.begin(), perm.end(), static_cast<int32_t>(t * pages));
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy(perm.begin(), perm.end(), bt.begin() + t * pages);
    seq_of[t] = static_cast<int32_t>(T - 1 - t);  // rows map to a different table row
  }
  std::vector<int32_t> bt_rows(T * pages);
  for (int64_t t = 0; t < T; ++t) std::copy_n(bt.begin() + t * pages, pages, bt_rows.begin() + seq_of[t] * pages);

  auto d_scores = to_device(scores);
  auto d_len = to_device(lengths);
  auto d_bt = to_device(bt_rows);
  auto d_seq = to_device(seq_of);
  for (const auto& [k, splits] : std::vector<std::pair<int, int>>{{2048, 1}, {16, 1}, {2048, 7}, {16, 7}, {2048, 64}}) {
    std::vector<TopkOut> runs;
    auto d_ws = poisoned<uint8_t>(topk_workspace_bytes(T, splits));
    for (int rep = 0; rep < 2; ++rep)
      runs.push_back(run_topk(d_scores.as<float>(), stride, d_len.as<int32_t>(), T, k, d_bt.as<int32_t>(), pages,
                              d_seq.as<int32_t>(), [&](TopkParams& p) {
                                p.splits = splits;
                                p.workspace = d_ws.data();
                                p.workspace_bytes = topk_workspace_bytes(T, splits);
                              }));
    EXPECT_EQ(runs[0].pos, runs[1].pos) << "repeat run differs";
    EXPECT_EQ(runs[0].slots, runs[1].slots) << "repeat run differs";
    const int64_t mismatched_rows = rows_differing(scores, stride, lengths, k, runs[0], bt, pages,
                                                   "k=" + std::to_string(k) + " splits=" + std::to_string(splits));
    std::printf("topk k=%d splits=%d: %lld of %lld rows differ from cpu::topk\n", k, splits,
                static_cast<long long>(mismatched_rows), static_cast<long long>(T));
  }
}

// The register path (rows of at most 16,384 scores when the caller passes max_length): against
// cpu::topk and bit for bit against the looping one-block kernel (max_length 0), at every
// register width (4, 8, 12, 16 keys a thread), with aligned rows (float4 loads) and an odd
// stride (scalar loads), rows whose selection ends early (every score equal: the first digit
// bin holds exactly the keys wanted), and a max_length below a row's length (that row takes the
// looping code inside the kernel). Scores past each length are +inf: none may be selected.
TEST(CudaTopk, RegisterPathMatchesCpuAndTheLoopKernel) {
  ML4_REQUIRE_GPU();
  std::mt19937 rng(77);
  const float inf = std::numeric_limits<float>::infinity();
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int runs = 0;
  for (const auto& [max_length, stride] : std::vector<std::pair<int64_t, int64_t>>{
           {4096, 4100}, {8192, 8196}, {8448, 8449}, {12288, 12288}, {16384, 16384}, {3000, 5120}}) {
    std::vector<int32_t> lengths = {static_cast<int32_t>(std::min<int64_t>(max_length, stride)), 2049, 2048, 1, 0,
                                    3000, 3000, 2500, 130, static_cast<int32_t>(max_length) - 1};
    if (max_length == 3000) lengths[0] = 5000;  // longer than max_length says: the loop code
    const int64_t T = static_cast<int64_t>(lengths.size());
    std::vector<float> scores(T * stride, inf);
    for (int64_t t = 0; t < T; ++t)
      for (int i = 0; i < lengths[t]; ++i) scores[t * stride + i] = nd(rng);
    for (int i = 0; i < 3000; ++i) scores[5 * stride + i] = static_cast<float>(static_cast<int>(rng() % 8) - 4) * 0.5f;
    for (int i = 0; i < 3000; i += 7) scores[5 * stride + i] = -0.0f;
    for (int i = 0; i < 3000; i += 13) scores[6 * stride + i] = std::numeric_limits<float>::quiet_NaN();
    for (int i = 5; i < 3000; i += 101) scores[6 * stride + i] = -inf;
    scores[6 * stride + 17] = inf;
    for (int i = 0; i < 2500; ++i) scores[7 * stride + i] = 0.25f;  // one bin, ends after the first pass
    const int64_t pages = (stride + kPageTokens - 1) / kPageTokens;
    std::vector<int32_t> bt(T * pages);
    std::iota(bt.begin(), bt.end(), 0);
    std::shuffle(bt.begin(), bt.end(), rng);
    std::vector<int32_t> seq_of(T);
    std::iota(seq_of.begin(), seq_of.end(), 0);
    auto d_scores = to_device(scores);
    auto d_len = to_device(lengths);
    auto d_bt = to_device(bt);
    auto d_seq = to_device(seq_of);
    for (int k : {2048, 16}) {
      // The register kernel, then the loop kernel.
      std::vector<TopkOut> outs;
      for (const int64_t ml : {max_length, int64_t{0}})
        outs.push_back(run_topk(d_scores.as<float>(), stride, d_len.as<int32_t>(), T, k, d_bt.as<int32_t>(), pages,
                                d_seq.as<int32_t>(), [&](TopkParams& p) { p.max_length = ml; }));
      EXPECT_EQ(outs[0].pos, outs[1].pos) << "max_length " << max_length << " k " << k << ": register vs loop kernel";
      EXPECT_EQ(outs[0].slots, outs[1].slots) << "max_length " << max_length << " k " << k << ": register vs loop kernel";
      rows_differing(scores, stride, lengths, k, outs[0], bt, pages,
                     "max_length " + std::to_string(max_length) + " stride " + std::to_string(stride) + " k " +
                         std::to_string(k));
      ++runs;
    }
  }
  EXPECT_EQ(runs, 12);
}

TEST(CudaTopk, BadArgumentsAreErrors) {
  TopkParams p;
  p.T = 1;
  p.k = 8;
  p.out_stride = 4;  // < k
  EXPECT_FALSE(topk(p).ok());
  p.out_stride = 0;
  int32_t dummy = 0;
  p.positions = &dummy;
  EXPECT_FALSE(topk(p).ok());  // null scores / lengths
  p.splits = -1;
  EXPECT_FALSE(topk(p).ok());
}

// The split choice (host only): several blocks per row only for small steps over rows longer
// than the register kernel's 16,384 scores,
// about 4096 positions per block, at most two waves of blocks.
TEST(CudaTopk, SplitChoice) {
  EXPECT_EQ(topk_choose_splits(1, 8192), 1);
  EXPECT_EQ(topk_choose_splits(1, 16384), 1);  // one block, the row in registers
  EXPECT_EQ(topk_choose_splits(1, 16385), 4);
  EXPECT_EQ(topk_choose_splits(1, 61440), 15);
  EXPECT_EQ(topk_choose_splits(8, 1 << 20), 33);
  EXPECT_EQ(topk_choose_splits(32, 61440), 8);
  EXPECT_EQ(topk_choose_splits(66, 1 << 20), 4);
  EXPECT_EQ(topk_choose_splits(67, 1 << 20), 1);
  EXPECT_EQ(topk_max_workspace_bytes(512, 8192), 0u);
  EXPECT_EQ(topk_max_workspace_bytes(512, 1 << 20), topk_workspace_bytes(66, 4));
}

}  // namespace
}  // namespace ml4::cuda
