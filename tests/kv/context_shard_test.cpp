// ContextShard (kv/context_shard.h, SYSTEM.md S8): the token -> (rank, local index) map of
// decode context parallelism against a brute-force walk over the tokens, for several group
// sizes and interleaves: every token has exactly one owner, local indices on a rank are
// 0, 1, 2, ... in token order (so "visible to position p" is a prefix), global_index inverts
// local_index, and local_count(n) counts the tokens of [0, n) a rank holds. The block view:
// with I dividing a 64-token page, block b of the engine (64 N tokens) puts each rank's tokens
// exactly into its page b.
#include "kv/context_shard.h"

#include <gtest/gtest.h>

namespace ml4 {
namespace {

TEST(ContextShard, MatchesABruteForceWalk) {
  for (int N : {1, 2, 3, 4, 8}) {
    for (int I : {1, 2, 4, 8, 64}) {
      std::vector<int64_t> next(N, 0);  // the next local index of each rank
      std::vector<ContextShard> s(N);
      for (int r = 0; r < N; ++r) s[r] = {N, r, I};
      for (int64_t i = 0; i < 5000; ++i) {
        int owners = 0;
        for (int r = 0; r < N; ++r) {
          if (!s[r].holds(i)) continue;
          ++owners;
          EXPECT_EQ(s[r].owner(i), r);
          ASSERT_EQ(s[r].local_index(i), next[r]) << "N " << N << " I " << I << " token " << i;
          EXPECT_EQ(s[r].global_index(next[r]), i);
          ++next[r];
        }
        ASSERT_EQ(owners, 1) << "N " << N << " I " << I << " token " << i;
        for (int r = 0; r < N; ++r) ASSERT_EQ(s[r].local_count(i + 1), next[r]) << "N " << N << " I " << I << " n " << i + 1;
      }
    }
  }
}

TEST(ContextShard, EngineBlocksHoldOnePageOnEveryRank) {
  constexpr int64_t kPage = 64;
  for (int N : {2, 4, 8})
    for (int I : {1, 4, 16, 64}) {
      for (int r = 0; r < N; ++r) {
        const ContextShard s{N, r, I};
        for (int64_t i = 0; i < 4 * kPage * N; ++i) {
          if (!s.holds(i)) continue;
          EXPECT_EQ(s.local_index(i) / kPage, i / (kPage * N)) << "N " << N << " I " << I << " token " << i;
        }
        EXPECT_EQ(s.local_count(3 * kPage * N), 3 * kPage);
      }
    }
}

}  // namespace
}  // namespace ml4
