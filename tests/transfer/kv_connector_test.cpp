// KvConnector over UCX on loopback, with KV regions laid out as a runner's (two cache
// groups, several layer slots, random bytes): a load copies exactly the named blocks of
// every layer and nothing else, and releases the producer's hold; a hold past its timeout
// makes the load fail ("expired"), never succeed on freed blocks; an abort reaches the
// producer; a producer that is gone fails the load by the timeout; a foreign layout,
// corrupt metadata and block ids outside the producer's pool are refused with a message
// and change nothing.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "transfer/kv_connector.h"

namespace ml4::transfer {
namespace {

using namespace std::chrono_literals;

#if defined(ML4_WITH_UCX)

// A fake runner's KV memory: per (group, slot) num_blocks pages of block_bytes.
struct FakeKv {
  std::vector<CacheGroupInfo> groups;
  std::vector<std::vector<uint8_t>> mem;
  std::vector<KvRegion> regions;

  FakeKv(int64_t blocks, int64_t latent_bytes, int64_t indexer_bytes, std::mt19937_64* rng) {
    groups.push_back({"latent", 64, blocks, 0, latent_bytes * 2 / 64});
    groups.push_back({"indexer", 64, blocks, 0, indexer_bytes / 64});
    const int64_t per[3][2] = {{0, latent_bytes}, {0, latent_bytes}, {1, indexer_bytes}};
    int slot_of[2] = {0, 0};
    for (const auto& [g, bytes] : per) {
      mem.emplace_back(static_cast<size_t>(bytes * blocks));
      for (auto& b : mem.back()) b = rng ? static_cast<uint8_t>((*rng)()) : 0;
      regions.push_back(KvRegion{static_cast<int>(g), slot_of[g]++, mem.back().data(), bytes, blocks, false});
    }
  }
  const uint8_t* block(size_t region, int32_t b) const { return mem[region].data() + b * regions[region].block_bytes; }
};

KvTransferConfig config(const char* role, double timeout_s = 30.0, int delay_ms = 0) {
  KvTransferConfig c;
  c.kv_role = role;
  c.timeout_s = timeout_s;
  c.load_delay_ms = delay_ms;
  return c;
}

std::unique_ptr<KvConnector> make(const KvTransferConfig& c, const FakeKv& kv, const std::string& id) {
  KvTransferConfig cc = c;
  cc.engine_id = id;
  auto r = KvConnector::create(cc, kv.regions, kv.groups);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : nullptr;
}

std::string unique_id(const char* base, std::mt19937_64& rng) { return fmt::format("{}-{}", base, rng() % 1000000); }

KvLoadResult wait_load(KvConnector& c, int64_t key, std::chrono::milliseconds limit = 15s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    for (auto& r : c.poll_loads())
      if (r.key == key) return r;
    std::this_thread::sleep_for(1ms);
  }
  ADD_FAILURE() << "load " << key << " did not finish";
  return {};
}

std::vector<std::string> wait_released(KvConnector& c, size_t n, std::chrono::milliseconds limit = 5s) {
  std::vector<std::string> out;
  const auto end = std::chrono::steady_clock::now() + limit;
  while (out.size() < n && std::chrono::steady_clock::now() < end) {
    for (auto& s : c.take_released()) out.push_back(s);
    std::this_thread::sleep_for(1ms);
  }
  return out;
}

RemoteKvSource source(const KvConnector& p, const std::string& req, std::vector<std::vector<int32_t>> ids) {
  RemoteKvSource s;
  s.engine_id = p.engine_id();
  s.request_id = req;
  s.block_ids = std::move(ids);
  return s;
}

TEST(KvConnector, LoadCopiesExactlyTheNamedBlocksAndReleasesTheHold) {
  std::mt19937_64 rng(std::random_device{}());
  FakeKv pk(24, 64 * 656, 64 * 132, &rng), ck(20, 64 * 656, 64 * 132, nullptr);
  auto prod = make(config("kv_producer"), pk, unique_id("prefill", rng));
  auto cons = make(config("kv_consumer"), ck, unique_id("decode", rng));
  ASSERT_TRUE(prod && cons);
  auto peer = cons->load_peer(prod->metadata(), prod->engine_id());
  ASSERT_TRUE(peer.ok()) << peer.status().message();
  EXPECT_TRUE(cons->has_peer(prod->engine_id()));
  // Loading the same blob again is a no-op (concurrent requests for one producer).
  ASSERT_TRUE(cons->load_peer(prod->metadata()).ok());

  // Remote blocks in an arbitrary order (some consecutive, to exercise coalescing), into
  // arbitrary free local blocks; a different set per group.
  std::vector<int32_t> r0 = {5, 6, 7, 19, 2, 23}, l0 = {11, 12, 13, 0, 4, 19};
  std::vector<int32_t> r1 = {8, 9, 3, 4, 5, 1}, l1 = {1, 2, 3, 7, 8, 18};
  prod->hold("req-a", 12);
  EXPECT_EQ(prod->stats().blocks_held, 12);
  KvLoadBlocks blocks{{r0, r1}, {l0, l1}};
  ASSERT_TRUE(cons->start_load(7, source(*prod, "req-a", {{}, {}}), blocks).ok());
  KvLoadResult res = wait_load(*cons, 7);
  ASSERT_TRUE(res.ok) << res.error;
  for (size_t reg = 0; reg < 3; ++reg) {
    const auto& rr = reg < 2 ? r0 : r1;
    const auto& ll = reg < 2 ? l0 : l1;
    const int64_t bb = pk.regions[reg].block_bytes;
    for (int32_t b = 0; b < 20; ++b) {
      auto it = std::find(ll.begin(), ll.end(), b);
      if (it == ll.end()) {  // untouched: still zero
        const uint8_t* p = ck.block(reg, b);
        ASSERT_TRUE(std::all_of(p, p + bb, [](uint8_t v) { return v == 0; })) << "region " << reg << " block " << b;
      } else {
        ASSERT_EQ(std::memcmp(ck.block(reg, b), pk.block(reg, rr[it - ll.begin()]), bb), 0)
            << "region " << reg << " block " << b;
      }
    }
  }
  EXPECT_EQ(wait_released(*prod, 1), std::vector<std::string>{"req-a"});
  const KvTransferStats cs = cons->stats(), ps = prod->stats();
  EXPECT_EQ(cs.bytes, 6 * (2 * 64 * 656 + 64 * 132));
  EXPECT_EQ(cs.blocks, 12);
  EXPECT_EQ(cs.transfers_ok, 1);
  EXPECT_EQ(cs.failures, 0);
  EXPECT_EQ(cs.loads_in_flight, 0);
  EXPECT_EQ(ps.blocks_held, 0);
  EXPECT_EQ(ps.holds_released, 1);
  int64_t counted = 0;
  for (auto c : cs.time_counts) counted += c;
  EXPECT_EQ(counted, 1);

  // Nothing to read (the consumer's prefix cache had it all): still done, hold released.
  prod->hold("req-b", 3);
  ASSERT_TRUE(cons->start_load(8, source(*prod, "req-b", {{}, {}}), KvLoadBlocks{{{}, {}}, {{}, {}}}).ok());
  res = wait_load(*cons, 8);
  EXPECT_TRUE(res.ok) << res.error;
  EXPECT_EQ(wait_released(*prod, 1), std::vector<std::string>{"req-b"});
}

TEST(KvConnector, ExpiredHoldFailsTheLoad) {
  std::mt19937_64 rng(std::random_device{}());
  FakeKv pk(8, 1024, 256, &rng), ck(8, 1024, 256, nullptr);
  auto prod = make(config("kv_producer", 0.2), pk, unique_id("prefill", rng));
  auto cons = make(config("kv_consumer"), ck, unique_id("decode", rng));
  ASSERT_TRUE(prod && cons);
  ASSERT_TRUE(cons->load_peer(prod->metadata()).ok());
  prod->hold("req-slow", 2);
  std::this_thread::sleep_for(300ms);
  // The producer frees it on its own (engine poll) ...
  EXPECT_EQ(wait_released(*prod, 1), std::vector<std::string>{"req-slow"});
  EXPECT_EQ(prod->stats().expired, 1);
  EXPECT_EQ(prod->stats().blocks_held, 0);
  // ... and a late consumer is told, so it fails instead of decoding from freed blocks.
  ASSERT_TRUE(cons->start_load(1, source(*prod, "req-slow", {}), KvLoadBlocks{{{0}, {0}}, {{1}, {1}}}).ok());
  KvLoadResult res = wait_load(*cons, 1);
  EXPECT_FALSE(res.ok);
  EXPECT_NE(res.error.find("already freed"), std::string::npos) << res.error;
  EXPECT_EQ(cons->stats().failures, 1);
  EXPECT_EQ(cons->stats().expired, 1);
}

TEST(KvConnector, AbortReachesTheProducer) {
  std::mt19937_64 rng(std::random_device{}());
  FakeKv pk(8, 1024, 256, &rng), ck(8, 1024, 256, nullptr);
  auto prod = make(config("kv_producer"), pk, unique_id("prefill", rng));
  auto cons = make(config("kv_consumer", 30.0, 400), ck, unique_id("decode", rng));  // reads wait 400 ms
  ASSERT_TRUE(prod && cons);
  ASSERT_TRUE(cons->load_peer(prod->metadata()).ok());
  prod->hold("req-x", 2);
  ASSERT_TRUE(cons->start_load(3, source(*prod, "req-x", {}), KvLoadBlocks{{{0}, {0}}, {{1}, {1}}}).ok());
  cons->cancel_load(3);
  KvLoadResult res = wait_load(*cons, 3);
  EXPECT_FALSE(res.ok);
  EXPECT_TRUE(res.cancelled);
  EXPECT_EQ(wait_released(*prod, 1), std::vector<std::string>{"req-x"});  // long before any timeout
  EXPECT_EQ(prod->stats().holds_released, 1);
  EXPECT_EQ(prod->stats().expired, 0);
  EXPECT_EQ(cons->stats().failures, 0);  // a cancel is not a failure
  EXPECT_EQ(cons->loads_in_flight(), 0u);

  // A request aborted before its load started: release_remote tells the producer.
  prod->hold("req-y", 1);
  cons->release_remote(source(*prod, "req-y", {}));
  EXPECT_EQ(wait_released(*prod, 1), std::vector<std::string>{"req-y"});
}

TEST(KvConnector, ProducerGoneFailsTheLoad) {
  std::mt19937_64 rng(std::random_device{}());
  FakeKv pk(8, 4096, 256, &rng), ck(8, 4096, 256, nullptr);
  auto prod = make(config("kv_producer"), pk, unique_id("prefill", rng));
  auto cons = make(config("kv_consumer", 1.5), ck, unique_id("decode", rng));
  ASSERT_TRUE(prod && cons);
  ASSERT_TRUE(cons->load_peer(prod->metadata()).ok());
  const std::string id = prod->engine_id();
  prod.reset();
  RemoteKvSource src;
  src.engine_id = id;
  src.request_id = "req-dead";
  const auto t0 = std::chrono::steady_clock::now();
  Status st = cons->start_load(4, src, KvLoadBlocks{{{0, 1}, {0}}, {{2, 3}, {4}}});
  if (st.ok()) {
    KvLoadResult res = wait_load(*cons, 4);
    EXPECT_FALSE(res.ok);
    EXPECT_FALSE(res.cancelled);
    EXPECT_FALSE(res.error.empty());
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
    EXPECT_EQ(cons->stats().failures, 1);
  }
  EXPECT_EQ(cons->loads_in_flight(), 0u);
}

TEST(KvConnector, ForeignLayoutCorruptMetadataAndBadBlocksAreRefused) {
  std::mt19937_64 rng(std::random_device{}());
  FakeKv pk(8, 1024, 256, &rng), ck(8, 1024, 256, nullptr), other(8, 1152, 256, nullptr);
  auto prod = make(config("kv_producer"), pk, unique_id("prefill", rng));
  auto cons = make(config("kv_consumer"), ck, unique_id("decode", rng));
  auto bf16 = make(config("kv_consumer"), other, unique_id("decode-bf16", rng));
  ASSERT_TRUE(prod && cons && bf16);
  auto r = bf16->load_peer(prod->metadata());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("kv-cache-dtype"), std::string::npos) << r.status().message();

  std::string md = prod->metadata();
  for (int i = 0; i < 20; ++i) {
    std::string bad = md;
    const size_t at = 24 + rng() % (md.size() - 24);
    bad[at] = static_cast<char>(bad[at] ^ 0x5a);
    auto rb = cons->load_peer(bad);
    ASSERT_FALSE(rb.ok());
    EXPECT_NE(rb.status().message().find("corrupt"), std::string::npos) << rb.status().message();
  }
  auto rt = cons->load_peer(md.substr(0, md.size() - 5));
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("truncated"), std::string::npos);
  auto rw = cons->load_peer(md, "some-other-engine");
  ASSERT_FALSE(rw.ok());
  EXPECT_NE(rw.status().message().find("restarted"), std::string::npos);
  EXPECT_FALSE(cons->has_peer(prod->engine_id()));

  ASSERT_TRUE(cons->load_peer(md).ok());
  prod->hold("req-z", 2);
  Status bad = cons->start_load(1, source(*prod, "req-z", {}), KvLoadBlocks{{{8}, {0}}, {{0}, {0}}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("outside the producer"), std::string::npos) << bad.message();
  EXPECT_EQ(cons->loads_in_flight(), 0u);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(prod->take_released().empty());  // nothing reached the producer
  EXPECT_EQ(prod->holds(), 1u);
}

#endif  // ML4_WITH_UCX

TEST(KvTransferConfig, ParsesVllmShapeAndRefusesMistakes) {
  auto c = parse_kv_transfer_config(
      R"({"kv_connector":"UcxConnector","kv_role":"kv_both","engine_id":"p-1","kv_connector_extra_config":{"load_delay_ms":5}})");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(c->producer());
  EXPECT_TRUE(c->consumer());
  EXPECT_EQ(c->engine_id, "p-1");
  EXPECT_EQ(c->load_delay_ms, 5);
  auto p = parse_kv_transfer_config(R"({"kv_connector":"UcxConnector","kv_role":"kv_producer"})");
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->producer());
  EXPECT_FALSE(p->consumer());
  const std::pair<const char*, const char*> bad[] = {
      {"not json", "not valid JSON"},
      {"[]", "JSON object"},
      {R"({"kv_connector":"UcxConnector","kv_role":"kv_decoder"})", "kv_role must be"},
      {R"({"kv_connector":"NixlConnector","kv_role":"kv_producer"})", "NIXL"},
      {R"({"kv_connector":"Foo","kv_role":"kv_producer"})", "unknown"},
      {R"({"kv_role":"kv_producer","kv_rank":0})", "unknown field 'kv_rank'"},
      {R"({"kv_role":"kv_producer","engine_id":"a b"})", "engine_id"},
      {R"({"kv_role":"kv_producer","kv_connector_extra_config":{"load_delay_ms":-1}})", "load_delay_ms"},
  };
  for (const auto& [text, want] : bad) {
    auto r = parse_kv_transfer_config(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace ml4::transfer
