// KvBlockManager: exact accounting per group, all-or-nothing allocation, ref-counted
// sharing, prefix hits that must exist in every group (and respect every page size), LRU
// eviction of cached blocks, and the detokenizer's UTF-8 hold-back.
#include <gtest/gtest.h>

#include "engine/block_manager.h"
#include "engine/text_codec.h"

namespace ml4 {
namespace {

Request make_request(std::vector<int32_t> prompt) {
  Request r;
  r.prompt = std::move(prompt);
  return r;
}

std::vector<int32_t> seq(int n, int base) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = base + (i * 37) % 101;
  return v;
}

TEST(BlockManager, AccountingIsExactAndAllOrNothing) {
  // Two groups with different sizes: the smaller one limits admission.
  KvBlockManager bm({{"latent", 4, 10, 0, 656}, {"indexer", 4, 6, 0, 132}}, false);
  Request a = make_request(seq(20, 1));
  ASSERT_TRUE(bm.allocate(a, 17));  // 5 blocks each
  EXPECT_EQ(bm.num_free_blocks(0), 5);
  EXPECT_EQ(bm.num_free_blocks(1), 1);
  Request b = make_request(seq(8, 2));
  EXPECT_FALSE(bm.allocate(b, 8));  // needs 2 in each; indexer has 1
  EXPECT_EQ(bm.num_free_blocks(0), 5);  // nothing taken
  EXPECT_TRUE(b.block_tables.empty() || b.block_tables[0].empty());
  ASSERT_TRUE(bm.allocate(b, 4));
  EXPECT_EQ(bm.num_free_blocks(1), 0);
  EXPECT_DOUBLE_EQ(bm.usage(1), 1.0);
  bm.free(a);
  bm.free(b);
  EXPECT_EQ(bm.num_free_blocks(0), 10);
  EXPECT_EQ(bm.num_free_blocks(1), 6);
  EXPECT_TRUE(bm.check_invariants().ok());
  EXPECT_EQ(bm.capacity_tokens(), 24);
}

TEST(BlockManager, PrefixHitSharesBlocksAcrossGroups) {
  KvBlockManager bm({{"latent", 4, 16, 0, 656}, {"indexer", 4, 16, 0, 132}}, true);
  Request a = make_request(seq(14, 1));
  ASSERT_TRUE(bm.allocate(a, 14));
  a.num_computed = 14;
  bm.cache_full_blocks(a);  // 3 full blocks registered per group
  Request b = make_request(seq(14, 1));
  b.prompt.back() = 999;  // same first 13 tokens
  PrefixHit hit = bm.find_cached_prefix(b);
  EXPECT_EQ(hit.num_tokens, 12);
  const int64_t free_before = bm.num_free_blocks(0);
  ASSERT_TRUE(bm.allocate(b, 14, &hit));
  EXPECT_EQ(bm.num_free_blocks(0), free_before - 1);  // only the 4th block is new
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a.block_tables[0][i], b.block_tables[0][i]);
  bm.free(a);
  EXPECT_EQ(bm.num_free_blocks(0), free_before);  // a's 4th block back; shared ones held by b
  bm.free(b);
  EXPECT_EQ(bm.num_free_blocks(0), 16);

  // Cached blocks survive with ref 0; a hit takes them back out of the free list, and the
  // accounting counts them as taken.
  Request c = make_request(seq(13, 1));
  hit = bm.find_cached_prefix(c);
  EXPECT_EQ(hit.num_tokens, 12);
  ASSERT_TRUE(bm.allocate(c, 13, &hit));
  EXPECT_EQ(bm.num_free_blocks(0), 12);
  EXPECT_TRUE(bm.check_invariants().ok());
  bm.free(c);

  // A whole-prompt hit still leaves one token to compute.
  Request d = make_request(seq(12, 1));
  EXPECT_EQ(bm.find_cached_prefix(d).num_tokens, 8);
  EXPECT_EQ(bm.prefix_hits(), 12 + 12 + 8);
}

TEST(BlockManager, HitMustExistInEveryGroupAndPageSize) {
  // Group pages 4 and 8: a hit is a multiple of 8.
  KvBlockManager bm({{"latent", 4, 32, 0, 656}, {"drafter", 8, 16, 2048, 100}}, true);
  Request a = make_request(seq(30, 3));
  ASSERT_TRUE(bm.allocate(a, 30));
  a.num_computed = 30;
  bm.cache_full_blocks(a);  // latent: 7 full blocks (28 tokens); drafter: 3 (24 tokens)
  bm.free(a);
  Request b = make_request(seq(30, 3));
  PrefixHit hit = bm.find_cached_prefix(b);
  EXPECT_EQ(hit.num_tokens, 24);
  EXPECT_EQ(hit.blocks[0].size(), 6u);
  EXPECT_EQ(hit.blocks[1].size(), 3u);
  // Evict the drafter group's cached blocks: with no hit there, nothing is reused.
  Request filler = make_request(seq(128, 50));
  ASSERT_TRUE(bm.allocate(filler, 128));  // takes all 16 drafter blocks
  bm.free(filler);
  EXPECT_EQ(bm.find_cached_prefix(b).num_tokens, 0);
  EXPECT_TRUE(bm.check_invariants().ok());
}

TEST(BlockManager, LruEvictsUnhashedFirst) {
  KvBlockManager bm({{"latent", 4, 4, 0, 656}}, true);
  Request a = make_request(seq(9, 1));
  ASSERT_TRUE(bm.allocate(a, 9));  // 3 blocks, 2 full
  a.num_computed = 9;
  bm.cache_full_blocks(a);
  bm.free(a);
  // One new block: must come from the never-used or unhashed blocks, keeping the cache.
  Request b = make_request(seq(4, 77));
  ASSERT_TRUE(bm.allocate(b, 4));
  Request c = make_request(seq(9, 1));
  EXPECT_EQ(bm.find_cached_prefix(c).num_tokens, 8);
  bm.free(b);
}

TEST(Detokenizer, HoldsBackPartialUtf8) {
  ByteTextCodec codec(1300);
  const std::string s = "a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80z";  // a é € 😀 z
  auto ids = codec.encode(s, false).value();
  IncrementalDetokenizer d;
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::string piece = d.push(codec, ids[i], true);
    EXPECT_EQ(sanitize_utf8(piece), piece);  // every piece is valid UTF-8 on its own
    out += piece;
  }
  out += d.flush();
  EXPECT_EQ(out, s);
  IncrementalDetokenizer bad;
  std::string t = bad.push(codec, 1000 + 0xFF, true) + bad.push(codec, 1000 + 'x', true) + bad.flush();
  EXPECT_EQ(t, "\xEF\xBF\xBDx");
  EXPECT_EQ(codec.decode({1, 1000 + 'h', 2}, true), "h");
}

}  // namespace
}  // namespace ml4
