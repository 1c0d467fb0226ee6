// UcxAgent: TransferAgent on UCP (design in transfer_agent.h).
//
// One UCP context (RMA + active messages + wake-up) and one worker, both owned by the
// agent's progress thread: every UCP call happens on that thread, so the worker runs in
// UCS_THREAD_MODE_SINGLE and no UCX lock is ever taken. Callers hand it commands through a
// queue (an eventfd wakes it) and read transfer states under a mutex. The thread always
// progresses, so a producer answers notifications and a consumer's reads complete whatever
// its engine loop is doing (Debian's UCX 1.13 hung in a 4-rank ring when a target stopped
// progressing; FIELD-NOTES.md).
//
// Reads: ucp_get_nbx per ReadOp into the registered local region (its memh passed, so
// device memory goes zero-copy through cuda_ipc / cuda_copy where UCX found them), with a
// completion callback. When a transfer's last read has completed and it carries a
// notification, the notification goes out as an active message (id kAmNotify, header =
// token + whether an answer is wanted, sent with the REPLY flag so the peer can answer
// without having loaded our metadata); the peer's handler returns the answer, which comes
// back as kAmAnswer with the token. Only then is the transfer kDone.
//
// Failures: a read that fails (cma from a process that is gone) fails its transfer; a peer
// error reported by UCX fails every transfer to that peer, and so does drop_peer() (a forced
// close, which completes outstanding reads with UCS_ERR_CANCELED before the local memory is
// handed back). Endpoints use error-handling mode none by default (see init()): the fast
// same-host transports do not support mode peer. Metadata is parsed with bounds checks and a checksum before any UCX
// call sees it.
#include "transfer/transfer_agent.h"

#if defined(ML4_WITH_UCX)

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/log.h"
#include "transfer/wire.h"

namespace ml4::transfer {
namespace {

constexpr char kAgentMagic[9] = "ML4UCXA1";
constexpr uint16_t kAmNotify = 17;
constexpr uint16_t kAmAnswer = 18;
constexpr uint32_t kMaxRegions = 1u << 16;
constexpr uint32_t kMaxKeyBytes = 1u << 16;
constexpr uint32_t kMaxAddressBytes = 1u << 20;
constexpr uint32_t kMaxMessageBytes = 1u << 16;

std::string ucs_error(ucs_status_t st) { return ucs_status_string(st); }

class UcxAgent;

struct GetCtx {
  UcxAgent* agent;
  uint64_t xfer;
};

struct SendCtx {
  UcxAgent* agent;
  uint64_t xfer;  // 0: a one-way notification or an answer
  std::string header, payload;
};

class UcxAgent final : public TransferAgent {
 public:
  UcxAgent(std::string name, std::function<void()> thread_init)
      : name_(std::move(name)), thread_init_(std::move(thread_init)) {}
  ~UcxAgent() override { shutdown(); }

  Status init() {
    // UCX 1.22's memory-type cache refused every cudaMalloc'ed KV region on the H200 ("failed to
    // insert region [0x0..0x0]", 2026-12-04, scripts/gpu_pd_check.sh); with it off they
    // register and go over cuda_ipc. Off unless the user set UCX_MEMTYPE_CACHE: the regions
    // say their memory type, so nothing needs the cache.
    if (std::getenv("UCX_MEMTYPE_CACHE") == nullptr) ucs_global_opts_set_value("MEMTYPE_CACHE", "n");
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return internal_error("UCX: cannot read its configuration: {}", ucs_error(st));
    // A ucp_get between device regions of two processes: UCX 1.22's protocol selection has no RMA
    // lane on cuda_ipc (it lacks bcopy) and emulates the get over shared-memory active messages,
    // 0.1 GB/s on the H200 (2026-12-04); the RMA pipeline protocol takes the cuda_ipc zero-copy
    // path: 54 GB/s for the same 23.6 MiB (best of 2). On unless the user set it.
    if (std::getenv("UCX_RMA_PPLN_ENABLE") == nullptr) ucp_config_modify(config, "RMA_PPLN_ENABLE", "y");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.name = name_.c_str();
    st = ucp_init(&params, config, &ctx_);
    ucp_config_release(config);
    if (st != UCS_OK) return internal_error("UCX: ucp_init failed: {}", ucs_error(st));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = ucp_worker_create(ctx_, &wp, &worker_);
    if (st != UCS_OK) return internal_error("UCX: ucp_worker_create failed: {}", ucs_error(st));
    if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;  // then timed polling
    // Error handling mode: UCX's shared-memory and cma transports (and cuda_ipc) do not
    // support peer-failure handling, so asking for it leaves only tcp on one host. The
    // default is speed (mode none: cma / shared memory / cuda_ipc); the connector's timeout
    // catches a dead or hung peer. ML4_UCX_PEER_ERRORS=1 asks for peer-failure handling.
    if (const char* e = std::getenv("ML4_UCX_PEER_ERRORS"); e && std::string(e) == "1")
      err_mode_ = UCP_ERR_HANDLING_MODE_PEER;
    for (uint16_t id : {kAmNotify, kAmAnswer}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                      UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      hp.id = id;
      hp.cb = id == kAmNotify ? &UcxAgent::on_notify_am : &UcxAgent::on_answer_am;
      hp.arg = this;
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;
      st = ucp_worker_set_am_recv_handler(worker_, &hp);
      if (st != UCS_OK) return internal_error("UCX: cannot set an active-message handler: {}", ucs_error(st));
    }
    ucp_worker_attr_t wa{};
    wa.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    st = ucp_worker_query(worker_, &wa);
    if (st != UCS_OK) return internal_error("UCX: ucp_worker_query failed: {}", ucs_error(st));
    address_.assign(static_cast<const char*>(static_cast<const void*>(wa.address)), wa.address_length);
    ucp_worker_release_address(worker_, wa.address);
    cmd_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (cmd_fd_ < 0) return io_error("eventfd failed");
    thread_ = std::thread([this] {
      if (thread_init_) thread_init_();
      loop();
    });
    return ok_status();
  }

  const std::string& name() const override { return name_; }

  std::string describe() const override {
    std::string s = fmt::format("ucx {} (agent {}, wake-up {})", ucp_get_version_string(), name_,
                                efd_ >= 0 ? "by event fd" : "by polling");
    std::lock_guard<std::mutex> lk(mu_);
    if (!transports_.empty()) s += "; transports: " + transports_;
    return s;
  }

  Status register_memory(const std::vector<MemoryRegion>& regions) override {
    return run_sync<Status>([&]() -> Status {
      if (!locals_.empty()) return internal_error("register_memory called twice");
      for (size_t i = 0; i < regions.size(); ++i) {
        const MemoryRegion& r = regions[i];
        if (r.base == nullptr || r.bytes == 0) return invalid_argument("region {} is empty", i);
        ucp_mem_map_params_t mp{};
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.address = r.base;
        mp.length = r.bytes;
        mp.memory_type = r.device ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
        Local l;
        l.region = r;
        ucs_status_t st = ucp_mem_map(ctx_, &mp, &l.memh);
        if (st != UCS_OK)
          return internal_error("UCX: cannot register region {} ({} bytes, {} memory): {}", i, r.bytes,
                                r.device ? "device" : "host", ucs_error(st));
        void* key = nullptr;
        size_t key_len = 0;
        st = ucp_rkey_pack(ctx_, l.memh, &key, &key_len);
        if (st != UCS_OK) {
          ucp_mem_unmap(ctx_, l.memh);
          return internal_error("UCX: cannot pack the key of region {}: {}", i, ucs_error(st));
        }
        l.rkey.assign(static_cast<const char*>(key), key_len);
        ucp_rkey_buffer_release(key);
        locals_.push_back(std::move(l));
      }
      std::lock_guard<std::mutex> lk(mu_);
      local_bounds_.clear();
      for (const auto& l : locals_) local_bounds_.push_back(l.region.bytes);
      return ok_status();
    });
  }

  Result<std::string> local_metadata() override {
    return run_sync<Result<std::string>>([&]() -> Result<std::string> {
      ByteWriter w;
      w.bytes(name_);
      w.bytes(address_);
      w.u32(static_cast<uint32_t>(locals_.size()));
      for (const auto& l : locals_) {
        w.u64(reinterpret_cast<uint64_t>(l.region.base));
        w.u64(l.region.bytes);
        w.u8(l.region.device ? 1 : 0);
        w.bytes(l.rkey);
      }
      return seal_blob(kAgentMagic, w.str());
    });
  }

  Result<std::string> load_peer(const std::string& metadata) override {
    // Parse on the caller's thread: nothing of the blob reaches UCX unless all of it checks.
    auto peer = std::make_shared<Peer>();
    ML4_ASSIGN_OR_RETURN(std::string_view body, open_blob(metadata, kAgentMagic, "UCX agent metadata"));
    ByteReader r(body, "UCX agent metadata");
    ML4_RETURN_IF_ERROR(r.bytes(&peer->name, 4096));
    ML4_RETURN_IF_ERROR(r.bytes(&peer->address, kMaxAddressBytes));
    uint32_t n = 0;
    ML4_RETURN_IF_ERROR(r.u32(&n));
    if (n > kMaxRegions) return invalid_argument("UCX agent metadata: {} regions (at most {})", n, kMaxRegions);
    for (uint32_t i = 0; i < n; ++i) {
      RemoteRegion rr;
      uint8_t dev = 0;
      std::string key;
      ML4_RETURN_IF_ERROR(r.u64(&rr.base));
      ML4_RETURN_IF_ERROR(r.u64(&rr.bytes));
      ML4_RETURN_IF_ERROR(r.u8(&dev));
      ML4_RETURN_IF_ERROR(r.bytes(&key, kMaxKeyBytes));
      if (dev > 1 || key.empty()) return invalid_argument("UCX agent metadata: region {} is malformed", i);
      rr.device = dev != 0;
      peer->regions.push_back(rr);
      peer->keys.push_back(std::move(key));
    }
    if (r.remaining() != 0) return invalid_argument("UCX agent metadata: {} trailing bytes", r.remaining());
    if (peer->name.empty() || peer->address.empty()) return invalid_argument("UCX agent metadata: no name or address");
    if (peer->name == name_) return invalid_argument("UCX agent metadata: the peer has our own name '{}'", name_);
    return run_sync<Result<std::string>>([&]() -> Result<std::string> {
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(peer->address.data());
      ep.err_mode = err_mode_;
      ep.err_handler.cb = &UcxAgent::on_ep_error;
      ep.err_handler.arg = this;
      ucs_status_t st = ucp_ep_create(worker_, &ep, &peer->ep);
      if (st != UCS_OK) return internal_error("UCX: cannot connect to agent '{}': {}", peer->name, ucs_error(st));
      for (size_t i = 0; i < peer->keys.size(); ++i) {
        ucp_rkey_h k = nullptr;
        st = ucp_ep_rkey_unpack(peer->ep, peer->keys[i].data(), &k);
        if (st != UCS_OK) {
          close_peer_now(*peer);
          return invalid_argument("UCX agent metadata: the key of region {} does not unpack: {}", i, ucs_error(st));
        }
        peer->rkeys.push_back(k);
      }
      note_transports(*peer);
      auto old = peers_.find(peer->name);
      if (old != peers_.end()) fail_peer(old->second, "replaced by a newer metadata blob (restarted peer)", true);
      peers_[peer->name] = peer;
      std::lock_guard<std::mutex> lk(mu_);
      peer_regions_[peer->name] = peer->regions;
      return peer->name;
    });
  }

  Result<std::vector<RemoteRegion>> peer_regions(const std::string& peer) const override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peer_regions_.find(peer);
    if (it == peer_regions_.end()) return not_found("no UCX peer '{}' loaded", peer);
    return it->second;
  }

  bool has_peer(const std::string& peer) const override {
    std::lock_guard<std::mutex> lk(mu_);
    return peer_regions_.count(peer) > 0;
  }

  void drop_peer(const std::string& peer) override {
    run_sync<int>([&] {
      auto it = peers_.find(peer);
      if (it != peers_.end()) fail_peer(it->second, "dropped (timed out or failed)", true);
      return 0;
    });
  }

  Result<uint64_t> post_read(const std::string& peer, const std::vector<ReadOp>& ops,
                             const std::string& notification) override {
    if (notification.size() > kMaxMessageBytes) return invalid_argument("notification too long");
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto pr = peer_regions_.find(peer);
      if (pr == peer_regions_.end()) return not_found("no UCX peer '{}' loaded", peer);
      for (size_t i = 0; i < ops.size(); ++i) {
        const ReadOp& op = ops[i];
        if (op.remote_region < 0 || op.remote_region >= static_cast<int>(pr->second.size()) || op.local_region < 0 ||
            op.local_region >= static_cast<int>(local_bounds_.size()))
          return out_of_range("read {}: region {} -> {} does not exist", i, op.remote_region, op.local_region);
        const uint64_t rb = pr->second[op.remote_region].bytes, lb = local_bounds_[op.local_region];
        if (op.bytes == 0 || op.remote_offset > rb || op.bytes > rb - op.remote_offset || op.local_offset > lb ||
            op.bytes > lb - op.local_offset)
          return out_of_range("read {}: {} bytes at remote {} / local {} leave the regions ({} / {} bytes)", i,
                              op.bytes, op.remote_offset, op.local_offset, rb, lb);
      }
      id = next_xfer_++;
      Xfer& x = xfers_[id];
      x.peer = peer;
      x.outstanding = static_cast<int>(ops.size());
      x.notification = notification;
    }
    post([this, id, peer, ops] { start_reads(id, peer, ops); });
    return id;
  }

  XferStatus status(uint64_t xfer) const override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return {XferState::kFailed, "", "unknown transfer"};
    return {it->second.state, it->second.answer, it->second.error};
  }

  void cancel(uint64_t xfer) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end() || it->second.state != XferState::kPending) return;
    it->second.cancelled = true;
    settle_locked(it->second);
  }

  void release(uint64_t xfer) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return;
    if (it->second.state == XferState::kPending) {
      it->second.cancelled = true;
      it->second.released = true;
      settle_locked(it->second);
      if (it->second.state == XferState::kPending) return;  // forgotten once it settles
    }
    xfers_.erase(it);
  }

  Status send_notification(const std::string& peer, const std::string& message) override {
    if (message.size() > kMaxMessageBytes) return invalid_argument("notification too long");
    return run_sync<Status>([&]() -> Status {
      auto it = peers_.find(peer);
      if (it == peers_.end() || it->second->failed) return not_found("no UCX peer '{}' connected", peer);
      return send_am(it->second->ep, kAmNotify, 0, false, message);
    });
  }

  void set_notification_handler(NotificationHandler handler) override {
    run_sync<int>([&] {
      handler_ = std::move(handler);
      return 0;
    });
  }

  void set_wakeup(std::function<void()> wakeup) override {
    std::lock_guard<std::mutex> lk(mu_);
    wakeup_ = std::move(wakeup);
  }

 private:
  struct Local {
    MemoryRegion region;
    ucp_mem_h memh = nullptr;
    std::string rkey;
  };
  struct Peer {
    std::string name, address;
    std::vector<RemoteRegion> regions;
    std::vector<std::string> keys;
    ucp_ep_h ep = nullptr;
    std::vector<ucp_rkey_h> rkeys;
    bool failed = false;
  };
  struct Xfer {
    std::string peer;
    int outstanding = 0;  // reads posted or about to be, not yet completed
    bool cancelled = false, released = false, notified = false;
    std::string notification;
    XferState state = XferState::kPending;
    std::string answer, error;
  };

  // --- command queue -------------------------------------------------------------------
  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lk(cmd_mu_);
      cmds_.push_back(std::move(fn));
    }
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(cmd_fd_, &one, 8);
  }

  template <typename R, typename F>
  R run_sync(F&& fn) {
    if (std::this_thread::get_id() == thread_.get_id()) return fn();
    std::promise<R> p;
    auto fut = p.get_future();
    post([&] { p.set_value(fn()); });
    return fut.get();
  }

  void loop() {
    for (;;) {
      std::deque<std::function<void()>> cmds;
      {
        std::lock_guard<std::mutex> lk(cmd_mu_);
        cmds.swap(cmds_);
      }
      for (auto& c : cmds) c();
      while (ucp_worker_progress(worker_) != 0) {
      }
      run_deferred();
      bool wake = false, pending = false;
      std::function<void()> wakeup;
      {
        std::lock_guard<std::mutex> lk(mu_);
        wake = changed_;
        changed_ = false;
        for (auto it = xfers_.begin(); it != xfers_.end();) {
          pending |= it->second.state == XferState::kPending;
          if (it->second.released && it->second.state != XferState::kPending) it = xfers_.erase(it);
          else ++it;
        }
        if (wake) wakeup = wakeup_;
      }
      if (wakeup) wakeup();
      if (stop_) return;
      {
        std::lock_guard<std::mutex> lk(cmd_mu_);
        if (!cmds_.empty()) continue;
      }
      // Sleep until the worker has an event or a command arrives. With transfers in flight
      // the wait is short whatever the event fd says (some transports complete reads only
      // when progressed).
      pollfd fds[2] = {{cmd_fd_, POLLIN, 0}, {efd_, POLLIN, 0}};
      int nfds = 1;
      if (efd_ >= 0) {
        ucs_status_t st = ucp_worker_arm(worker_);
        if (st == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
        nfds = st == UCS_OK ? 2 : 1;
      }
      ::poll(fds, nfds, pending || nfds == 1 ? 1 : 100);
      uint64_t drain = 0;
      [[maybe_unused]] ssize_t n = ::read(cmd_fd_, &drain, 8);
    }
  }

  void run_deferred() {
    while (!deferred_.empty()) {
      auto d = std::move(deferred_);
      deferred_.clear();
      for (auto& fn : d) fn();
      while (ucp_worker_progress(worker_) != 0) {
      }
    }
  }

  void shutdown() {
    if (thread_.joinable()) {
      post([this] {
        for (auto& [name, p] : peers_) fail_peer(p, "the agent is shutting down", false);
        peers_.clear();
        for (auto& l : locals_) ucp_mem_unmap(ctx_, l.memh);
        locals_.clear();
        stop_ = true;
      });
      thread_.join();
    }
    if (worker_) ucp_worker_destroy(worker_);
    if (ctx_) ucp_cleanup(ctx_);
    if (cmd_fd_ >= 0) ::close(cmd_fd_);
  }

  // --- transfers (progress thread) -------------------------------------------------------
  void start_reads(uint64_t id, const std::string& peer_name, const std::vector<ReadOp>& ops) {
    auto pit = peers_.find(peer_name);
    std::shared_ptr<Peer> peer = pit == peers_.end() ? nullptr : pit->second;
    if (ops.empty()) {  // nothing to read (a full local prefix hit): only the notification
      std::lock_guard<std::mutex> lk(mu_);
      auto it = xfers_.find(id);
      if (it == xfers_.end()) return;
      if (!peer || peer->failed) it->second.error = "UCX peer '" + peer_name + "' is gone";
      settle_locked(it->second);
      maybe_notify_locked(id, it->second);
      return;
    }
    size_t posted = 0;
    for (; posted < ops.size(); ++posted) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = xfers_.find(id);
        if (it == xfers_.end()) return;
        Xfer& x = it->second;
        if (x.cancelled || x.state != XferState::kPending || !peer || peer->failed) {
          if (x.error.empty()) x.error = !peer || peer->failed ? "UCX peer '" + peer_name + "' is gone" : "cancelled";
          x.outstanding -= static_cast<int>(ops.size() - posted);
          settle_locked(x);
          return;
        }
      }
      const ReadOp& op = ops[posted];
      const Local& l = locals_[op.local_region];
      auto* ctx = new GetCtx{this, id};
      ucp_request_param_t prm{};
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
      prm.cb.send = &UcxAgent::on_get_done;
      prm.user_data = ctx;
      prm.memh = l.memh;
      ucs_status_ptr_t req =
          ucp_get_nbx(peer->ep, static_cast<char*>(l.region.base) + op.local_offset, op.bytes,
                      peer->regions[op.remote_region].base + op.remote_offset, peer->rkeys[op.remote_region], &prm);
      if (req == nullptr) {
        get_done(ctx, UCS_OK);
      } else if (UCS_PTR_IS_ERR(req)) {
        get_done(ctx, UCS_PTR_STATUS(req));
      }  // else pending: the callback completes and frees it
    }
  }

  static void on_get_done(void* request, ucs_status_t st, void* user) {
    auto* ctx = static_cast<GetCtx*>(user);
    ctx->agent->get_done(ctx, st);
    ucp_request_free(request);
  }

  void get_done(GetCtx* ctx, ucs_status_t st) {
    const uint64_t id = ctx->xfer;
    delete ctx;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return;
    Xfer& x = it->second;
    --x.outstanding;
    if (st != UCS_OK && x.error.empty()) x.error = "UCX read from '" + x.peer + "' failed: " + ucs_error(st);
    settle_locked(x);
    maybe_notify_locked(id, x);
  }

  // Once the last read of a healthy transfer has landed: done, or send its notification and
  // wait for the answer. Caller holds mu_.
  void maybe_notify_locked(uint64_t id, Xfer& x) {
    if (x.state != XferState::kPending || x.outstanding != 0 || x.notified || !x.error.empty() || x.cancelled) return;
    x.notified = true;
    if (x.notification.empty()) {
      x.state = XferState::kDone;
      changed_ = true;
      return;
    }
    std::string peer = x.peer, msg = x.notification;
    deferred_.push_back([this, id, peer, msg] {
      auto pit = peers_.find(peer);
      Status s = pit == peers_.end() || pit->second->failed ? not_found("UCX peer '{}' is gone", peer)
                                                             : send_am(pit->second->ep, kAmNotify, id, true, msg);
      if (!s.ok()) fail_xfer(id, "cannot notify '" + peer + "': " + s.message());
    });
  }

  // Decides a pending transfer's fate once nothing is outstanding. Caller holds mu_.
  void settle_locked(Xfer& x) {
    if (x.state != XferState::kPending || x.outstanding > 0) return;
    if (!x.error.empty() || x.cancelled) {
      x.state = XferState::kFailed;
      if (x.error.empty()) x.error = "cancelled";
      changed_ = true;
    }
  }

  void fail_xfer(uint64_t id, const std::string& why) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end() || it->second.state != XferState::kPending) return;
    if (it->second.error.empty()) it->second.error = why;
    settle_locked(it->second);
  }

  // --- active messages -----------------------------------------------------------------
  Status send_am(ucp_ep_h ep, uint16_t id, uint64_t token, bool want_answer, const std::string& payload) {
    auto* ctx = new SendCtx{this, want_answer ? token : 0, std::string(9, '\0'), payload};
    std::memcpy(ctx->header.data(), &token, 8);
    ctx->header[8] = want_answer ? 1 : 0;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    prm.cb.send = &UcxAgent::on_send_done;
    prm.user_data = ctx;
    prm.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t req = ucp_am_send_nbx(ep, id, ctx->header.data(), ctx->header.size(), ctx->payload.data(),
                                           ctx->payload.size(), &prm);
    if (req == nullptr) {
      delete ctx;
      return ok_status();
    }
    if (UCS_PTR_IS_ERR(req)) {
      delete ctx;
      return internal_error("UCX active message failed: {}", ucs_error(UCS_PTR_STATUS(req)));
    }
    return ok_status();  // pending: on_send_done frees it
  }

  static void on_send_done(void* request, ucs_status_t st, void* user) {
    auto* ctx = static_cast<SendCtx*>(user);
    if (st != UCS_OK && ctx->xfer != 0) ctx->agent->fail_xfer(ctx->xfer, "notification failed: " + ucs_error(st));
    delete ctx;
    ucp_request_free(request);
  }

  static ucs_status_t on_notify_am(void* arg, const void* header, size_t header_len, void* data, size_t len,
                                   const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxAgent*>(arg);
    if (header_len != 9 || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      ML4_LOG_WARN("UCX agent {}: dropped a malformed notification", self->name_);
      return UCS_OK;
    }
    uint64_t token = 0;
    std::memcpy(&token, header, 8);
    const bool want_answer = static_cast<const char*>(header)[8] != 0;
    std::string msg(static_cast<const char*>(data), len);
    std::string answer = self->handler_ ? self->handler_(msg) : std::string();
    if (want_answer && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
      ucp_ep_h reply = param->reply_ep;
      // Sending from inside a UCX callback is not allowed: answer after progress returns.
      self->deferred_.push_back([self, reply, token, answer] {
        Status s = self->send_am(reply, kAmAnswer, token, false, answer);
        if (!s.ok()) ML4_LOG_WARN("UCX agent {}: cannot answer a notification: {}", self->name_, s.message());
      });
    }
    std::lock_guard<std::mutex> lk(self->mu_);
    self->changed_ = true;
    return UCS_OK;
  }

  static ucs_status_t on_answer_am(void* arg, const void* header, size_t header_len, void* data, size_t len,
                                   const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxAgent*>(arg);
    if (header_len != 9 || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) return UCS_OK;
    uint64_t token = 0;
    std::memcpy(&token, header, 8);
    std::lock_guard<std::mutex> lk(self->mu_);
    auto it = self->xfers_.find(token);
    if (it == self->xfers_.end() || it->second.state != XferState::kPending) return UCS_OK;
    it->second.answer.assign(static_cast<const char*>(data), len);
    it->second.state = XferState::kDone;
    self->changed_ = true;
    return UCS_OK;
  }

  // --- peers (progress thread) ------------------------------------------------------------
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st) {
    auto* self = static_cast<UcxAgent*>(arg);
    for (auto& [name, p] : self->peers_)
      if (p->ep == ep) {
        ML4_LOG_WARN("UCX agent {}: peer '{}' failed: {}", self->name_, name, ucs_error(st));
        auto keep = p;
        self->deferred_.push_back([self, keep, st] { self->fail_peer(keep, "peer failed: " + ucs_error(st), true); });
        return;
      }
  }

  // Marks a peer failed, fails what waits on it and closes its endpoint by force (which
  // completes its outstanding reads). Optionally forgets it.
  void fail_peer(std::shared_ptr<Peer> p, const std::string& why, bool erase) {
    if (!p->failed) {
      p->failed = true;
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& [id, x] : xfers_)
        if (x.peer == p->name && x.state == XferState::kPending && x.error.empty())
          x.error = "UCX peer '" + p->name + "' " + why;
      // Transfers whose reads are done and which only wait for an answer fail now.
      std::vector<uint64_t> ids;
      for (auto& [id, x] : xfers_) if (x.peer == p->name) ids.push_back(id);
      for (uint64_t id : ids) {
        auto it = xfers_.find(id);
        if (it != xfers_.end() && it->second.outstanding == 0) settle_locked(it->second);
      }
      changed_ = true;
    }
    close_peer_now(*p);
    if (erase) {
      auto it = peers_.find(p->name);
      if (it != peers_.end() && it->second == p) peers_.erase(it);
      std::lock_guard<std::mutex> lk(mu_);
      auto rit = peer_regions_.find(p->name);
      if (rit != peer_regions_.end() && peers_.count(p->name) == 0) peer_regions_.erase(rit);
    }
  }

  void close_peer_now(Peer& p) {
    for (ucp_rkey_h k : p.rkeys) ucp_rkey_destroy(k);
    p.rkeys.clear();
    if (p.ep == nullptr) return;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t req = ucp_ep_close_nbx(p.ep, &prm);
    p.ep = nullptr;
    if (req != nullptr && UCS_PTR_IS_PTR(req)) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(worker_);
      ucp_request_free(req);
    }
  }

  void note_transports(Peer& p) {
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    if (f == nullptr) return;
    ucp_ep_print_info(p.ep, f);
    fclose(f);
    std::string info(buf, len);
    free(buf);
    // Keep the lane lines ("lane[0]: ... cma/memory ..."), joined.
    std::string lanes;
    size_t pos = 0;
    while (pos < info.size()) {
      size_t e = info.find('\n', pos);
      if (e == std::string::npos) e = info.size();
      std::string line = info.substr(pos, e - pos);
      if (line.find("lane[") != std::string::npos) {
        while (!line.empty() && (line[0] == '#' || line[0] == ' ')) line.erase(0, 1);
        lanes += (lanes.empty() ? "" : " | ") + line;
      }
      pos = e + 1;
    }
    ML4_LOG_INFO("UCX agent {}: connected to '{}': {}", name_, p.name, lanes);
    std::lock_guard<std::mutex> lk(mu_);
    transports_ = lanes;
  }

  std::string name_;
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1, cmd_fd_ = -1;
  ucp_err_handling_mode_t err_mode_ = UCP_ERR_HANDLING_MODE_NONE;
  std::string address_;
  std::function<void()> thread_init_;  // first thing on thread_ (a device context)
  std::thread thread_;
  std::atomic<bool> stop_{false};

  std::mutex cmd_mu_;
  std::deque<std::function<void()>> cmds_;
  std::vector<std::function<void()>> deferred_;  // progress thread only

  // Progress thread only.
  std::vector<Local> locals_;
  std::unordered_map<std::string, std::shared_ptr<Peer>> peers_;
  NotificationHandler handler_;

  mutable std::mutex mu_;  // everything below
  std::vector<uint64_t> local_bounds_;
  std::unordered_map<std::string, std::vector<RemoteRegion>> peer_regions_;
  std::unordered_map<uint64_t, Xfer> xfers_;
  uint64_t next_xfer_ = 1;
  bool changed_ = false;
  std::function<void()> wakeup_;
  std::string transports_;
};

}  // namespace

bool ucx_available() { return true; }

Result<std::unique_ptr<TransferAgent>> make_ucx_agent(const std::string& name, std::function<void()> thread_init) {
  auto a = std::make_unique<UcxAgent>(name, std::move(thread_init));
  ML4_RETURN_IF_ERROR(a->init());
  return std::unique_ptr<TransferAgent>(std::move(a));
}

}  // namespace ml4::transfer

#else  // !ML4_WITH_UCX

namespace ml4::transfer {

bool ucx_available() { return false; }

Result<std::unique_ptr<TransferAgent>> make_ucx_agent(const std::string&, std::function<void()>) {
  return unimplemented(
      "the UcxConnector needs UCX, and this ml4 was built without it: run scripts/setup.sh (it installs "
      "libucx-cu13 into .venv/ucx) and configure the build again");
}

}  // namespace ml4::transfer

#endif
