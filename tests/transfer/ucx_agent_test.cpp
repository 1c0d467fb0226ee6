// The UCX agent on loopback: two agents in one process (UCX connects them as it would two
// processes: the same worker addresses, keys and transports). Reads copy exactly the named
// byte ranges; the notification reaches the peer after the reads and its answer comes
// back; bad metadata (corrupt, truncated, foreign) and out-of-bounds reads are refused
// with a message and change nothing; a dropped peer fails its transfers, and the agent
// goes on. Fresh random bytes each run.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "transfer/transfer_agent.h"

namespace ml4::transfer {
namespace {

using namespace std::chrono_literals;

#if defined(ML4_WITH_UCX)

std::vector<uint8_t> random_bytes(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

XferStatus wait(TransferAgent& a, uint64_t x, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  XferStatus st;
  while ((st = a.status(x)).state == XferState::kPending && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(1ms);
  return st;
}

struct Pair {
  std::unique_ptr<TransferAgent> producer, consumer;
  std::vector<uint8_t> src0, src1, dst0, dst1;
  std::vector<std::string> notes;  // what the producer's handler saw
  std::mutex mu;
  size_t num_notes() {
    std::lock_guard<std::mutex> lk(mu);
    return notes.size();
  }
};

std::unique_ptr<Pair> make_pair(std::mt19937_64& rng) {
  auto p = std::make_unique<Pair>();
  auto a = make_ucx_agent("producer-" + std::to_string(rng() % 100000));
  auto b = make_ucx_agent("consumer-" + std::to_string(rng() % 100000));
  EXPECT_TRUE(a.ok()) << a.status().message();
  EXPECT_TRUE(b.ok()) << b.status().message();
  if (!a.ok() || !b.ok()) return nullptr;
  p->producer = std::move(a).value();
  p->consumer = std::move(b).value();
  p->src0 = random_bytes(1 << 20, rng);
  p->src1 = random_bytes(300000, rng);
  p->dst0.assign(1 << 20, 0);
  p->dst1.assign(300000, 0);
  EXPECT_TRUE(p->producer->register_memory({{p->src0.data(), p->src0.size()}, {p->src1.data(), p->src1.size()}}).ok());
  EXPECT_TRUE(p->consumer->register_memory({{p->dst0.data(), p->dst0.size()}, {p->dst1.data(), p->dst1.size()}}).ok());
  Pair* raw = p.get();
  p->producer->set_notification_handler([raw](const std::string& m) {
    std::lock_guard<std::mutex> lk(raw->mu);
    raw->notes.push_back(m);
    return "seen " + m;
  });
  return p;
}

TEST(UcxAgent, ReadsExactRangesThenNotifies) {
  std::mt19937_64 rng(std::random_device{}());
  auto p = make_pair(rng);
  ASSERT_TRUE(p);
  auto md = p->producer->local_metadata();
  ASSERT_TRUE(md.ok()) << md.status().message();
  auto name = p->consumer->load_peer(*md);
  ASSERT_TRUE(name.ok()) << name.status().message();
  EXPECT_EQ(*name, p->producer->name());
  auto regions = p->consumer->peer_regions(*name);
  ASSERT_TRUE(regions.ok());
  ASSERT_EQ(regions->size(), 2u);
  EXPECT_EQ((*regions)[1].bytes, p->src1.size());

  // Random ranges of both regions, into other offsets.
  std::vector<ReadOp> ops;
  for (int i = 0; i < 40; ++i) {
    ReadOp op;
    op.remote_region = op.local_region = static_cast<int>(rng() % 2);
    const uint64_t size = op.remote_region == 0 ? p->src0.size() : p->src1.size();
    op.bytes = 1 + rng() % 4096;
    op.remote_offset = rng() % (size - op.bytes);
    op.local_offset = rng() % (size - op.bytes);
    ops.push_back(op);
  }
  // Non-overlapping destinations so every range can be checked afterwards.
  std::vector<ReadOp> kept;
  std::vector<std::pair<uint64_t, uint64_t>> used[2];
  for (const auto& op : ops) {
    bool overlap = false;
    for (auto [s, e] : used[op.local_region]) overlap |= op.local_offset < e && s < op.local_offset + op.bytes;
    if (overlap) continue;
    used[op.local_region].push_back({op.local_offset, op.local_offset + op.bytes});
    kept.push_back(op);
  }
  auto x = p->consumer->post_read(*name, kept, "done req-1");
  ASSERT_TRUE(x.ok()) << x.status().message();
  XferStatus st = wait(*p->consumer, *x);
  ASSERT_EQ(st.state, XferState::kDone) << st.error;
  EXPECT_EQ(st.answer, "seen done req-1");
  for (const auto& op : kept) {
    const auto& src = op.remote_region == 0 ? p->src0 : p->src1;
    const auto& dst = op.local_region == 0 ? p->dst0 : p->dst1;
    ASSERT_EQ(std::memcmp(src.data() + op.remote_offset, dst.data() + op.local_offset, op.bytes), 0);
  }
  {
    std::lock_guard<std::mutex> lk(p->mu);
    ASSERT_EQ(p->notes.size(), 1u);
    EXPECT_EQ(p->notes[0], "done req-1");
  }
  p->consumer->release(*x);
  EXPECT_EQ(p->consumer->status(*x).state, XferState::kFailed);  // forgotten

  // A whole region at once (1 MiB), and a transfer with no reads: only the notification.
  std::fill(p->dst0.begin(), p->dst0.end(), 0);
  auto big = p->consumer->post_read(*name, {{0, 0, 0, 0, p->src0.size()}}, "");
  ASSERT_TRUE(big.ok());
  ASSERT_EQ(wait(*p->consumer, *big).state, XferState::kDone);
  EXPECT_EQ(p->dst0, p->src0);
  auto empty = p->consumer->post_read(*name, {}, "done req-2");
  ASSERT_TRUE(empty.ok());
  st = wait(*p->consumer, *empty);
  ASSERT_EQ(st.state, XferState::kDone) << st.error;
  EXPECT_EQ(st.answer, "seen done req-2");

  // One-way notification.
  ASSERT_TRUE(p->consumer->send_notification(*name, "abort req-3").ok());
  for (int i = 0; i < 5000 && p->num_notes() < 3; ++i) std::this_thread::sleep_for(1ms);
  std::lock_guard<std::mutex> lk(p->mu);
  ASSERT_EQ(p->notes.size(), 3u);
  EXPECT_EQ(p->notes[2], "abort req-3");
}

TEST(UcxAgent, BadMetadataIsRefusedAndChangesNothing) {
  std::mt19937_64 rng(std::random_device{}());
  auto p = make_pair(rng);
  ASSERT_TRUE(p);
  const std::string md = p->producer->local_metadata().value();
  // Every truncation, a flipped byte anywhere, garbage of the same length, and another kind.
  for (size_t len : {size_t{0}, size_t{7}, size_t{23}, size_t{24}, md.size() / 2, md.size() - 1}) {
    auto r = p->consumer->load_peer(md.substr(0, len));
    ASSERT_FALSE(r.ok()) << len;
    EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status().message();
  }
  for (int i = 0; i < 50; ++i) {
    std::string bad = md;
    const size_t at = 24 + rng() % (md.size() - 24);
    bad[at] = static_cast<char>(bad[at] ^ (1 + rng() % 255));
    auto r = p->consumer->load_peer(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("corrupt"), std::string::npos) << r.status().message();
  }
  std::string garbage(md.size(), '\0');
  for (auto& c : garbage) c = static_cast<char>(rng());
  EXPECT_FALSE(p->consumer->load_peer(garbage).ok());
  EXPECT_FALSE(p->consumer->has_peer(p->producer->name()));
  // The agent still works with the good blob.
  auto name = p->consumer->load_peer(md);
  ASSERT_TRUE(name.ok()) << name.status().message();
  auto x = p->consumer->post_read(*name, {{1, 100, 1, 200, 1000}}, "");
  ASSERT_TRUE(x.ok());
  ASSERT_EQ(wait(*p->consumer, *x).state, XferState::kDone);
  EXPECT_EQ(std::memcmp(p->src1.data() + 100, p->dst1.data() + 200, 1000), 0);
}

TEST(UcxAgent, OutOfBoundsReadsAreRefused) {
  std::mt19937_64 rng(std::random_device{}());
  auto p = make_pair(rng);
  ASSERT_TRUE(p);
  auto name = p->consumer->load_peer(p->producer->local_metadata().value());
  ASSERT_TRUE(name.ok());
  const uint64_t n1 = p->src1.size();
  const std::vector<ReadOp> bad = {
      {2, 0, 0, 0, 8},            // no such remote region
      {0, 0, -1, 0, 8},           // no such local region
      {1, n1 - 4, 1, 0, 8},       // past the remote end
      {1, 0, 1, n1 - 4, 8},       // past the local end
      {1, ~0ull - 2, 1, 0, 8},    // offset overflow
      {1, 0, 1, 0, 0},            // empty
  };
  for (const auto& op : bad) {
    auto x = p->consumer->post_read(*name, {{1, 0, 1, 0, 16}, op}, "done");
    ASSERT_FALSE(x.ok());
    EXPECT_EQ(x.status().code(), StatusCode::kOutOfRange);
    EXPECT_NE(x.status().message().find("read 1"), std::string::npos) << x.status().message();
  }
  EXPECT_FALSE(p->consumer->post_read("nobody", {{1, 0, 1, 0, 16}}, "").ok());
  std::lock_guard<std::mutex> lk(p->mu);
  EXPECT_TRUE(p->notes.empty());  // nothing was sent for a refused transfer
}

TEST(UcxAgent, DroppedPeerFailsItsTransfersAndCanBeLoadedAgain) {
  std::mt19937_64 rng(std::random_device{}());
  auto p = make_pair(rng);
  ASSERT_TRUE(p);
  const std::string md = p->producer->local_metadata().value();
  auto name = p->consumer->load_peer(md);
  ASSERT_TRUE(name.ok());
  // The producer goes away (its agent is destroyed: endpoint, memory and worker).
  p->producer.reset();
  // Either UCX already reported the peer gone (the read is refused), or the transfer fails
  // (its notification gets no answer until the peer is dropped, as the connector's timeout
  // does): never kDone.
  auto x = p->consumer->post_read(*name, {{0, 0, 0, 0, 4096}}, "done gone");
  if (x.ok()) {
    XferStatus st = wait(*p->consumer, *x, 2s);
    if (st.state == XferState::kPending) {
      p->consumer->drop_peer(*name);
      st = wait(*p->consumer, *x, 10s);
    }
    ASSERT_EQ(st.state, XferState::kFailed);
    EXPECT_FALSE(st.error.empty());
    p->consumer->release(*x);
  } else {
    EXPECT_NE(x.status().message().find("no UCX peer"), std::string::npos) << x.status().message();
  }
  // A new producer, a new blob: reads work again.
  auto np = make_ucx_agent("producer-new");
  ASSERT_TRUE(np.ok());
  std::vector<uint8_t> src = random_bytes(8192, rng);
  ASSERT_TRUE((*np)->register_memory({{src.data(), src.size()}}).ok());
  auto n2 = p->consumer->load_peer((*np)->local_metadata().value());
  ASSERT_TRUE(n2.ok()) << n2.status().message();
  auto y = p->consumer->post_read(*n2, {{0, 0, 0, 0, src.size()}}, "");
  ASSERT_TRUE(y.ok());
  ASSERT_EQ(wait(*p->consumer, *y).state, XferState::kDone);
  EXPECT_EQ(std::memcmp(src.data(), p->dst0.data(), src.size()), 0);
}

TEST(UcxAgent, CancelledTransferSettlesAndSendsNoNotification) {
  std::mt19937_64 rng(std::random_device{}());
  auto p = make_pair(rng);
  ASSERT_TRUE(p);
  auto name = p->consumer->load_peer(p->producer->local_metadata().value());
  ASSERT_TRUE(name.ok());
  std::vector<ReadOp> ops;
  for (uint64_t off = 0; off < p->src0.size(); off += 4096) ops.push_back({0, off, 0, off, 4096});
  auto x = p->consumer->post_read(*name, ops, "done cancelled");
  ASSERT_TRUE(x.ok());
  p->consumer->cancel(*x);
  XferStatus st = wait(*p->consumer, *x);
  // The cancel lands before the reads end (kFailed, no notification), after them while the
  // answer is awaited (kFailed, the peer saw one notification), or after the answer (kDone):
  // never pending, never a second notification.
  ASSERT_NE(st.state, XferState::kPending);
  std::this_thread::sleep_for(50ms);
  std::lock_guard<std::mutex> lk(p->mu);
  EXPECT_LE(p->notes.size(), 1u);
  if (st.state == XferState::kFailed) EXPECT_EQ(st.error, "cancelled");
  else EXPECT_EQ(p->notes.size(), 1u);
}

#else  // !ML4_WITH_UCX

TEST(UcxAgent, RefusedWithAClearMessageWithoutUcx) {
  EXPECT_FALSE(ucx_available());
  auto a = make_ucx_agent("x");
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("built without"), std::string::npos) << a.status().message();
  EXPECT_NE(a.status().message().find("scripts/setup.sh"), std::string::npos);
}

#endif

}  // namespace
}  // namespace ml4::transfer
