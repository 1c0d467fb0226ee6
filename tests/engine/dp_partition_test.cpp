// Data-parallel KV partitions in the block manager (engine/block_manager.h): with
// CacheGroupInfo::partitions = 2 (a DP 2 runner), every request's blocks in every group lie in
// one partition, new requests go where most blocks are free, prefix hits never cross
// partitions, one partition full refuses its requests while the other still admits, and the
// free counts per partition stay exact (check_invariants).
#include <gtest/gtest.h>

#include "engine/block_manager.h"

namespace ml4 {
namespace {

Request make_request(int n, int base) {
  Request r;
  for (int i = 0; i < n; ++i) r.prompt.push_back(base + (i * 37) % 101);
  return r;
}

int partition_of(const Request& r, int64_t part_size) {
  int p = -1;
  for (const auto& t : r.block_tables)
    for (int32_t b : t) {
      if (b < 0) continue;
      const int q = static_cast<int>(b / part_size);
      if (p >= 0 && q != p) return -2;  // spans partitions
      p = q;
    }
  return p;
}

std::vector<CacheGroupInfo> groups() {
  CacheGroupInfo latent{"latent", 4, 16, 0, 656};
  CacheGroupInfo indexer{"indexer", 4, 16, 0, 132};
  latent.partitions = indexer.partitions = 2;  // blocks 0-7 on DP rank 0, 8-15 on DP rank 1
  return {latent, indexer};
}

TEST(DpPartitions, RequestsStayInOnePartitionAndBalance) {
  KvBlockManager bm(groups(), true);
  EXPECT_EQ(bm.capacity_tokens(), 8 * 4);  // one partition's blocks
  std::vector<Request> rs;
  for (int i = 0; i < 4; ++i) rs.push_back(make_request(6, 10 * i));
  for (auto& r : rs) ASSERT_TRUE(bm.allocate(r, 6));  // 2 blocks each
  std::vector<int> where;
  for (auto& r : rs) {
    where.push_back(partition_of(r, 8));
    EXPECT_EQ(where.back(), r.kv_partition);
  }
  EXPECT_EQ(where, (std::vector<int>{0, 1, 0, 1}));  // the emptier partition each time
  // Growing keeps a request in its partition.
  ASSERT_TRUE(bm.allocate(rs[1], 14));
  EXPECT_EQ(partition_of(rs[1], 8), 1);
  EXPECT_TRUE(bm.check_invariants().ok()) << bm.check_invariants().message();
  // Partition 1 now holds 4 + 2 = 6 blocks of 8: a request needing 3 there is refused,
  // and nothing is taken.
  const int64_t free0 = bm.num_free_blocks(0);
  ASSERT_TRUE(bm.allocate(rs[3], 10));  // 2 -> 3 blocks in partition 1 (7 of 8 used)
  EXPECT_FALSE(bm.allocate(rs[3], 18));  // 5 blocks: 2 more than partition 1 has
  EXPECT_EQ(bm.num_free_blocks(0), free0 - 1);
  EXPECT_EQ(partition_of(rs[3], 8), 1);
  // A new request goes to partition 0, which has room.
  Request n = make_request(10, 500);
  ASSERT_TRUE(bm.allocate(n, 10));
  EXPECT_EQ(partition_of(n, 8), 0);
  for (auto& r : rs) bm.free(r);
  bm.free(n);
  for (auto& r : rs) EXPECT_EQ(r.kv_partition, -1);
  EXPECT_EQ(bm.num_free_blocks(0), 16);
  EXPECT_TRUE(bm.check_invariants().ok()) << bm.check_invariants().message();
}

TEST(DpPartitions, PrefixHitsFollowTheirPartition) {
  KvBlockManager bm(groups(), true);
  Request filler = make_request(4, 900);
  ASSERT_TRUE(bm.allocate(filler, 4));  // partition 0 gets one block
  Request a = make_request(13, 1);
  ASSERT_TRUE(bm.allocate(a, 13));  // partition 1 (emptier)
  ASSERT_EQ(a.kv_partition, 1);
  a.num_computed = 13;
  bm.cache_full_blocks(a);
  Request b = make_request(13, 1);
  b.prompt.back() = 777;
  PrefixHit hit = bm.find_cached_prefix(b);
  EXPECT_EQ(hit.num_tokens, 12);
  ASSERT_TRUE(bm.allocate(b, 13, &hit));
  // b joins a's partition (its hit) although partition 0 has more free blocks.
  EXPECT_EQ(b.kv_partition, 1);
  EXPECT_EQ(partition_of(b, 8), 1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a.block_tables[0][i], b.block_tables[0][i]);
  bm.free(a);
  bm.free(b);
  bm.free(filler);
  EXPECT_TRUE(bm.check_invariants().ok()) << bm.check_invariants().message();
}

}  // namespace
}  // namespace ml4
