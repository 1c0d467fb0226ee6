// KvConnector (design in kv_connector.h).
#include "transfer/kv_connector.h"

#include <algorithm>
#include <random>

#include "core/log.h"
#include "transfer/wire.h"

namespace ml4::transfer {
namespace {

constexpr char kConnectorMagic[9] = "ML4KVCN1";
// Transfer time buckets (seconds): vLLM's nixl_xfer_time_seconds bounds.
const std::vector<double> kTimeBounds = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};

std::string random_engine_id() {
  std::random_device rd;
  std::mt19937_64 g((static_cast<uint64_t>(rd()) << 32) ^ rd());
  return fmt::format("ml4-{:016x}", g());
}

}  // namespace

uint64_t prompt_hash(const std::vector<int32_t>& tokens) {
  return fnv1a64(std::string_view(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(int32_t)));
}

KvConnector::KvConnector(KvTransferConfig config, std::unique_ptr<TransferAgent> agent)
    : config_(std::move(config)), agent_(std::move(agent)) {
  stats_.time_bounds = kTimeBounds;
  stats_.time_counts.assign(kTimeBounds.size() + 1, 0);
}

KvConnector::~KvConnector() {
  if (agent_) {
    agent_->set_notification_handler(nullptr);
    agent_->set_wakeup(nullptr);
  }
}

Result<std::unique_ptr<KvConnector>> KvConnector::create(const KvTransferConfig& config,
                                                         const std::vector<KvRegion>& regions,
                                                         const std::vector<CacheGroupInfo>& groups,
                                                         std::function<void()> thread_init) {
  if (config.kv_connector != "UcxConnector")
    return invalid_argument("kv_connector '{}' is unknown (ml4 has UcxConnector)", config.kv_connector);
  const std::string id = config.engine_id.empty() ? random_engine_id() : config.engine_id;
  ML4_ASSIGN_OR_RETURN(auto agent, make_ucx_agent(id, std::move(thread_init)));
  KvTransferConfig c = config;
  c.engine_id = id;
  return create_with_agent(c, std::move(agent), regions, groups);
}

Result<std::unique_ptr<KvConnector>> KvConnector::create_with_agent(const KvTransferConfig& config,
                                                                    std::unique_ptr<TransferAgent> agent,
                                                                    const std::vector<KvRegion>& regions,
                                                                    const std::vector<CacheGroupInfo>& groups) {
  std::unique_ptr<KvConnector> c(new KvConnector(config, std::move(agent)));
  ML4_RETURN_IF_ERROR(c->init(regions, groups));
  return c;
}

Status KvConnector::init(const std::vector<KvRegion>& regions, const std::vector<CacheGroupInfo>& groups) {
  engine_id_ = agent_->name();
  groups_ = groups;
  if (regions.empty()) return unimplemented("this model runner exposes no KV memory to transfer (kv_regions() is empty)");
  std::vector<MemoryRegion> mem;
  for (const KvRegion& r : regions) {
    if (r.group < 0 || r.group >= static_cast<int>(groups.size()) || r.block_bytes <= 0 || r.num_blocks <= 0)
      return internal_error("runner KV region (group {}, slot {}) is malformed", r.group, r.layer_slot);
    layout_.push_back({r.group, r.layer_slot, r.block_bytes, r.num_blocks, r.device});
    mem.push_back({r.base, static_cast<uint64_t>(r.block_bytes * r.num_blocks), r.device});
  }
  ML4_RETURN_IF_ERROR(agent_->register_memory(mem));
  ML4_ASSIGN_OR_RETURN(std::string agent_md, agent_->local_metadata());
  ByteWriter w;
  w.bytes(engine_id_);
  w.u32(static_cast<uint32_t>(groups.size()));
  for (const auto& g : groups) {
    w.bytes(g.name);
    w.i64(g.page_tokens);
    w.i64(g.num_blocks);
  }
  w.u32(static_cast<uint32_t>(layout_.size()));
  for (const auto& r : layout_) {
    w.i64(r.group);
    w.i64(r.slot);
    w.i64(r.block_bytes);
    w.i64(r.num_blocks);
    w.u8(r.device ? 1 : 0);
  }
  w.bytes(agent_md);
  metadata_ = seal_blob(kConnectorMagic, w.str());
  agent_->set_notification_handler([this](const std::string& msg) { return on_notification(msg); });
  ML4_LOG_INFO("kv transfer: {} as {} over {} ({} regions, {} bytes of KV registered)", config_.kv_role, engine_id_,
               agent_->describe(), layout_.size(), [&] {
                 int64_t s = 0;
                 for (const auto& r : layout_) s += r.block_bytes * r.num_blocks;
                 return s;
               }());
  return ok_status();
}

Result<std::string> KvConnector::load_peer(const std::string& blob, const std::string& expected_engine_id) {
  const char* what = "KV connector metadata";
  const uint64_t blob_hash = fnv1a64(blob);
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [id, p] : peers_)
      if (p.blob_hash == blob_hash && (expected_engine_id.empty() || id == expected_engine_id) && agent_->has_peer(id))
        return id;  // already connected to exactly this
  }
  ML4_ASSIGN_OR_RETURN(std::string_view body, open_blob(blob, kConnectorMagic, what));
  ByteReader r(body, what);
  Peer p;
  p.blob_hash = blob_hash;
  ML4_RETURN_IF_ERROR(r.bytes(&p.engine_id, 256));
  if (!expected_engine_id.empty() && p.engine_id != expected_engine_id)
    return invalid_argument("{}: served by engine '{}', the request names engine '{}' (restarted?)", what, p.engine_id,
                            expected_engine_id);
  uint32_t ng = 0;
  ML4_RETURN_IF_ERROR(r.u32(&ng));
  if (ng != groups_.size())
    return invalid_argument("{}: the producer has {} cache groups, this engine {}: not the same model", what, ng,
                            groups_.size());
  std::vector<int64_t> remote_group_blocks(ng);
  for (uint32_t g = 0; g < ng; ++g) {
    std::string name;
    int64_t page = 0;
    ML4_RETURN_IF_ERROR(r.bytes(&name, 64));
    ML4_RETURN_IF_ERROR(r.i64(&page));
    ML4_RETURN_IF_ERROR(r.i64(&remote_group_blocks[g]));
    if (name != groups_[g].name || page != groups_[g].page_tokens)
      return invalid_argument("{}: cache group {} is '{}' with {}-token pages there, '{}' with {} here", what, g, name,
                              page, groups_[g].name, groups_[g].page_tokens);
  }
  uint32_t nr = 0;
  ML4_RETURN_IF_ERROR(r.u32(&nr));
  if (nr != layout_.size()) {
    // A sliding-window group (DSpark's drafter window) has blocks only with speculation on.
    for (size_t g = 0; g < groups_.size(); ++g)
      if (groups_[g].sliding_window > 0 && (groups_[g].num_blocks > 0) != (remote_group_blocks[g] > 0))
        return invalid_argument("{}: speculative decoding is {} on the producer and {} here: start both with the same "
                                "--speculative-config (its drafter window cache group '{}' travels with the KV)",
                                what, remote_group_blocks[g] > 0 ? "on" : "off", groups_[g].num_blocks > 0 ? "on" : "off",
                                groups_[g].name);
    return invalid_argument("{}: the producer has {} KV regions, this engine {}: not the same model", what, nr,
                            layout_.size());
  }
  for (uint32_t i = 0; i < nr; ++i) {
    RegionLayout l;
    int64_t group = 0, slot = 0;
    uint8_t dev = 0;
    ML4_RETURN_IF_ERROR(r.i64(&group));
    ML4_RETURN_IF_ERROR(r.i64(&slot));
    ML4_RETURN_IF_ERROR(r.i64(&l.block_bytes));
    ML4_RETURN_IF_ERROR(r.i64(&l.num_blocks));
    ML4_RETURN_IF_ERROR(r.u8(&dev));
    l.group = static_cast<int>(group);
    l.slot = static_cast<int>(slot);
    l.device = dev != 0;
    const RegionLayout& mine = layout_[i];
    if (l.group != mine.group || l.slot != mine.slot || l.block_bytes != mine.block_bytes)
      return invalid_argument(
          "{}: KV region {} is (group {}, slot {}, {} bytes per block) there, (group {}, slot {}, {}) here: "
          "the model or --kv-cache-dtype differ",
          what, i, l.group, l.slot, l.block_bytes, mine.group, mine.slot, mine.block_bytes);
    if (l.num_blocks <= 0 || l.num_blocks != remote_group_blocks[l.group])
      return invalid_argument("{}: KV region {} has {} blocks, its group {}", what, i, l.num_blocks,
                              remote_group_blocks[l.group]);
    p.regions.push_back(l);
  }
  std::string agent_md;
  ML4_RETURN_IF_ERROR(r.bytes(&agent_md, 64u << 20));
  if (r.remaining() != 0) return invalid_argument("{}: {} trailing bytes", what, r.remaining());
  ML4_ASSIGN_OR_RETURN(std::string agent_name, agent_->load_peer(agent_md));
  if (agent_name != p.engine_id)
    return invalid_argument("{}: the agent is '{}', the engine '{}'", what, agent_name, p.engine_id);
  ML4_ASSIGN_OR_RETURN(auto remote, agent_->peer_regions(agent_name));
  if (remote.size() != p.regions.size())
    return invalid_argument("{}: {} agent regions for {} KV regions", what, remote.size(), p.regions.size());
  for (size_t i = 0; i < remote.size(); ++i)
    if (remote[i].bytes != static_cast<uint64_t>(p.regions[i].block_bytes * p.regions[i].num_blocks))
      return invalid_argument("{}: region {} is {} bytes, its layout says {}", what, i, remote[i].bytes,
                              p.regions[i].block_bytes * p.regions[i].num_blocks);
  std::lock_guard<std::mutex> lk(mu_);
  peers_[p.engine_id] = std::move(p);
  return agent_name;
}

bool KvConnector::has_peer(const std::string& engine_id) const {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (peers_.count(engine_id) == 0) return false;
  }
  return agent_->has_peer(engine_id);
}

// --- producer ------------------------------------------------------------------------------

void KvConnector::hold(const std::string& request_id, int64_t num_blocks) {
  std::lock_guard<std::mutex> lk(mu_);
  Hold h;
  h.num_blocks = num_blocks;
  h.deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(config_.timeout_s));
  holds_[request_id] = h;
  stats_.blocks_held += num_blocks;
  stats_.requests_held = static_cast<int64_t>(holds_.size());
}

void KvConnector::expire_holds_locked(std::chrono::steady_clock::time_point now) {
  for (auto it = holds_.begin(); it != holds_.end();) {
    if (now >= it->second.deadline) {
      ML4_LOG_WARN("kv transfer: request {} held {} blocks for {} s and no consumer read them; freed", it->first,
                   it->second.num_blocks, config_.timeout_s);
      ++stats_.expired;
      stats_.blocks_held -= it->second.num_blocks;
      released_.push_back(it->first);
      it = holds_.erase(it);
    } else {
      ++it;
    }
  }
  stats_.requests_held = static_cast<int64_t>(holds_.size());
}

std::vector<std::string> KvConnector::take_released() {
  std::lock_guard<std::mutex> lk(mu_);
  expire_holds_locked(std::chrono::steady_clock::now());
  std::vector<std::string> out;
  out.swap(released_);
  return out;
}

std::string KvConnector::on_notification(const std::string& msg) {
  const size_t sp = msg.find(' ');
  const std::string verb = msg.substr(0, sp), id = sp == std::string::npos ? "" : msg.substr(sp + 1);
  std::function<void()> wake;
  std::string answer;
  {
    std::lock_guard<std::mutex> lk(mu_);
    expire_holds_locked(std::chrono::steady_clock::now());
    auto it = holds_.find(id);
    if (verb != "done" && verb != "abort") {
      ML4_LOG_WARN("kv transfer: unknown notification '{}'", msg.substr(0, 64));
      return "unknown";
    }
    if (it == holds_.end()) {
      answer = "expired";
    } else {
      stats_.blocks_held -= it->second.num_blocks;
      ++stats_.holds_released;
      released_.push_back(id);
      holds_.erase(it);
      stats_.requests_held = static_cast<int64_t>(holds_.size());
      answer = "ok";
    }
    wake = wakeup_;
  }
  if (wake) wake();
  return answer;
}

size_t KvConnector::holds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return holds_.size();
}

// --- consumer ------------------------------------------------------------------------------

Status KvConnector::start_load(int64_t key, const RemoteKvSource& src, const KvLoadBlocks& blocks) {
  std::vector<ReadOp> ops;
  int64_t bytes = 0, nblocks = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (loads_.count(key)) return internal_error("kv transfer: load {} is already running", key);
    auto pit = peers_.find(src.engine_id);
    if (pit == peers_.end()) return not_found("kv transfer: the metadata of engine '{}' is not loaded", src.engine_id);
    const Peer& peer = pit->second;
    if (blocks.remote.size() != groups_.size() || blocks.local.size() != groups_.size())
      return invalid_argument("kv transfer: block lists for {} groups, the model has {}", blocks.remote.size(),
                              groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (blocks.remote[g].size() != blocks.local[g].size())
        return internal_error("kv transfer: group {}: {} remote blocks for {} local ones", g, blocks.remote[g].size(),
                              blocks.local[g].size());
      nblocks += static_cast<int64_t>(blocks.remote[g].size());
    }
    for (size_t i = 0; i < layout_.size(); ++i) {
      const RegionLayout& mine = layout_[i];
      const RegionLayout& theirs = peer.regions[i];
      const auto& rb = blocks.remote[mine.group];
      const auto& lb = blocks.local[mine.group];
      for (size_t k = 0; k < rb.size();) {
        if (rb[k] < 0 || rb[k] >= theirs.num_blocks)
          return invalid_argument("kv transfer: remote block {} of group {} is outside the producer's {} blocks", rb[k],
                                  mine.group, theirs.num_blocks);
        if (lb[k] < 0 || lb[k] >= mine.num_blocks)
          return internal_error("kv transfer: local block {} of group {} is outside [0, {})", lb[k], mine.group,
                                mine.num_blocks);
        // Runs of consecutive ids on both sides become one read.
        size_t e = k + 1;
        while (e < rb.size() && rb[e] == rb[e - 1] + 1 && lb[e] == lb[e - 1] + 1 && rb[e] < theirs.num_blocks &&
               lb[e] < mine.num_blocks)
          ++e;
        ReadOp op;
        op.remote_region = op.local_region = static_cast<int>(i);
        op.remote_offset = static_cast<uint64_t>(rb[k]) * theirs.block_bytes;
        op.local_offset = static_cast<uint64_t>(lb[k]) * mine.block_bytes;
        op.bytes = static_cast<uint64_t>(e - k) * mine.block_bytes;
        bytes += static_cast<int64_t>(op.bytes);
        ops.push_back(op);
        k = e;
      }
    }
  }
  const auto now = std::chrono::steady_clock::now();
  Load l;
  l.engine_id = src.engine_id;
  l.remote_request = src.request_id;
  l.bytes = bytes;
  l.blocks = nblocks;
  l.start = now + std::chrono::milliseconds(config_.load_delay_ms);
  l.deadline = l.start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(config_.timeout_s));
  if (config_.load_delay_ms > 0) {
    // Fault-injection delay: the reads are posted by poll_loads() once it has passed.
    std::lock_guard<std::mutex> lk(mu_);
    l.xfer = 0;
    pending_ops_[key] = std::move(ops);
    loads_[key] = std::move(l);
    stats_.loads_in_flight = static_cast<int64_t>(loads_.size());
    return ok_status();
  }
  ML4_ASSIGN_OR_RETURN(uint64_t xfer, agent_->post_read(src.engine_id, ops, "done " + src.request_id));
  l.xfer = xfer;
  std::lock_guard<std::mutex> lk(mu_);
  loads_[key] = std::move(l);
  stats_.loads_in_flight = static_cast<int64_t>(loads_.size());
  return ok_status();
}

void KvConnector::cancel_load(int64_t key) {
  std::string engine, remote;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = loads_.find(key);
    if (it == loads_.end() || it->second.cancelled) return;
    it->second.cancelled = true;
    engine = it->second.engine_id;
    remote = it->second.remote_request;
    if (it->second.xfer != 0) agent_->cancel(it->second.xfer);
  }
  // The producer frees its hold now rather than at its timeout (an abort reaches the other side).
  Status s = agent_->send_notification(engine, "abort " + remote);
  if (!s.ok()) ML4_LOG_WARN("kv transfer: cannot tell engine {} to free request {}: {}", engine, remote, s.message());
}

void KvConnector::release_remote(const RemoteKvSource& src) {
  if (!agent_->has_peer(src.engine_id)) return;  // never connected: the producer's timeout frees it
  Status s = agent_->send_notification(src.engine_id, "abort " + src.request_id);
  if (!s.ok())
    ML4_LOG_WARN("kv transfer: cannot tell engine {} to free request {}: {}", src.engine_id, src.request_id, s.message());
}

void KvConnector::record_time_locked(double seconds) {
  size_t i = std::lower_bound(stats_.time_bounds.begin(), stats_.time_bounds.end(), seconds) - stats_.time_bounds.begin();
  ++stats_.time_counts[i];
  stats_.time_sum += seconds;
}

std::vector<KvLoadResult> KvConnector::poll_loads() {
  std::vector<KvLoadResult> out;
  std::vector<std::string> drop;
  const auto now = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lk(mu_);
  for (auto it = loads_.begin(); it != loads_.end();) {
    const int64_t key = it->first;
    Load& l = it->second;
    KvLoadResult res;
    res.key = key;
    bool finished = false;
    if (l.xfer == 0) {  // delayed (fault injection)
      if (l.cancelled) {
        res.cancelled = true;
        res.error = "cancelled";
        finished = true;
      } else if (now >= l.start) {
        auto ops = std::move(pending_ops_[key]);
        pending_ops_.erase(key);
        auto x = agent_->post_read(l.engine_id, ops, "done " + l.remote_request);
        if (!x.ok()) {
          res.error = fmt::format("KV transfer from engine {} failed: {}", l.engine_id, x.status().message());
          ++stats_.failures;
          finished = true;
        } else {
          l.xfer = x.value();
          l.start = now;
        }
      }
    } else {
      XferStatus st = agent_->status(l.xfer);
      if (st.state == XferState::kPending && now >= l.deadline && !l.cancelled) {
        // The producer died or hangs: drop it, which completes the outstanding reads as failed.
        ++stats_.timeouts;
        drop.push_back(l.engine_id);
        l.cancelled = false;
        l.timeout_error = fmt::format("KV transfer from engine {} timed out after {} s (--kv-transfer-timeout)",
                                      l.engine_id, config_.timeout_s);
        agent_->cancel(l.xfer);
        l.deadline = std::chrono::steady_clock::time_point::max();
      } else if (st.state == XferState::kDone) {
        finished = true;
        if (l.cancelled) {
          res.cancelled = true;
          res.error = "cancelled";
        } else if (st.answer == "ok") {
          res.ok = true;
          stats_.bytes += l.bytes;
          stats_.blocks += l.blocks;
          ++stats_.transfers_ok;
          record_time_locked(std::chrono::duration<double>(now - l.start).count());
        } else if (st.answer == "expired") {
          ++stats_.expired;
          ++stats_.failures;
          res.error = fmt::format(
              "KV transfer from engine {} failed: it had already freed the blocks of request {} (its "
              "--kv-transfer-timeout passed, or the request was aborted there)",
              l.engine_id, l.remote_request);
        } else {
          ++stats_.failures;
          res.error = fmt::format("KV transfer from engine {} failed: unexpected answer '{}'", l.engine_id,
                                  st.answer.substr(0, 64));
        }
      } else if (st.state == XferState::kFailed) {
        finished = true;
        if (!l.timeout_error.empty()) {
          res.error = l.timeout_error;
          ++stats_.failures;
        } else if (l.cancelled) {
          res.cancelled = true;
          res.error = "cancelled";
        } else {
          ++stats_.failures;
          res.error = fmt::format("KV transfer from engine {} failed: {}", l.engine_id, st.error);
        }
      }
      if (finished) agent_->release(l.xfer);
    }
    if (finished) {
      if (!res.ok && !res.cancelled) ML4_LOG_WARN("kv transfer: load {}: {}", key, res.error);
      out.push_back(std::move(res));
      it = loads_.erase(it);
    } else {
      ++it;
    }
  }
  stats_.loads_in_flight = static_cast<int64_t>(loads_.size());
  for (const auto& e : drop) peers_.erase(e);
  lk.unlock();
  // drop_peer waits for the agent's thread, which may be waiting for mu_ in a notification
  // handler: never under the lock. Dropping completes the reads; the next poll reports them.
  for (const auto& e : drop) agent_->drop_peer(e);
  return out;
}

size_t KvConnector::loads_in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  return loads_.size();
}

void KvConnector::set_wakeup(std::function<void()> wakeup) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    wakeup_ = wakeup;
  }
  agent_->set_wakeup(std::move(wakeup));
}

KvTransferStats KvConnector::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

}  // namespace ml4::transfer
