// TransferAgent: a one-sided memory transport shaped like NIXL's agent API
// (ai-dynamo/nixl: registerMem, getLocalMD / loadRemoteMD, createXferReq + postXferReq with a
// notification, getXferStatus, getNotifs / genNotif), small enough to implement on UCP.
//
// An agent registers memory regions (host or device), publishes an opaque metadata blob
// (its address, and per region the base, the length and a remote key), loads a peer's blob,
// and posts READs of lists of (remote region, offset) -> (local region, offset) ranges. A
// read may carry a notification: once every byte has landed locally the notification is
// delivered to the peer, and the read counts as done only when the peer has answered it.
// That answer is how a producer tells a consumer whether the blocks it read were still
// held for it the whole time (KvConnector: "ok" or "expired"); NIXL's notifications are
// one-way, ours are request/answer because a one-way notification cannot say that.
//
// Threading: every method may be called from any thread. Notification handlers run on the
// agent's own progress thread and must not block.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace ml4::transfer {

struct MemoryRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
  bool device = false;  // GPU memory (UCX moves it with cuda_ipc / cuda_copy)
};

// A peer's region as its metadata describes it (no pointer of ours).
struct RemoteRegion {
  uint64_t base = 0;
  uint64_t bytes = 0;
  bool device = false;
};

// One contiguous range to read: `bytes` from the peer's region at `remote_offset` into our
// region at `local_offset`. Both ranges must lie inside their registered regions.
struct ReadOp {
  int remote_region = 0;
  uint64_t remote_offset = 0;
  int local_region = 0;
  uint64_t local_offset = 0;
  uint64_t bytes = 0;
};

enum class XferState { kPending, kDone, kFailed };

struct XferStatus {
  XferState state = XferState::kPending;
  std::string answer;  // the peer's answer to the notification (kDone)
  std::string error;   // why it failed (kFailed)
};

// Called on the progress thread for each notification; returns the answer sent back
// (ignored for a notification posted with send_notification).
using NotificationHandler = std::function<std::string(const std::string& message)>;

class TransferAgent {
 public:
  virtual ~TransferAgent() = default;
  virtual const std::string& name() const = 0;
  // The backend's name and what it found ("ucx 1.22.0: cma, posix, cuda_ipc ..."), for logs.
  virtual std::string describe() const = 0;

  // Registers our regions; their indices are ReadOp::local_region. Call once, before
  // local_metadata().
  virtual Status register_memory(const std::vector<MemoryRegion>& regions) = 0;
  // The blob a peer passes to load_peer(): self-checking (a checksum over all of it).
  virtual Result<std::string> local_metadata() = 0;
  // Parses and checks a peer's blob, connects to it and unpacks its keys. Returns the peer's
  // agent name; a corrupt or truncated blob is an error that changes nothing. Loading a name
  // already loaded replaces it (a restarted peer).
  virtual Result<std::string> load_peer(const std::string& metadata) = 0;
  virtual Result<std::vector<RemoteRegion>> peer_regions(const std::string& peer) const = 0;
  virtual bool has_peer(const std::string& peer) const = 0;
  // Disconnects a peer by force: its pending reads complete at once as failed (a peer that
  // died or hangs). It must be loaded again before the next read.
  virtual void drop_peer(const std::string& peer) = 0;

  // Posts the reads (and, when `notification` is not empty, the notification after them).
  // Returns a handle for status() / release(). Bounds are checked here.
  virtual Result<uint64_t> post_read(const std::string& peer, const std::vector<ReadOp>& ops,
                                     const std::string& notification) = 0;
  virtual XferStatus status(uint64_t xfer) const = 0;
  // Stops a pending transfer: its notification is not sent, and it turns kFailed
  // ("cancelled") only once no read is outstanding, so local memory is never written after
  // status() says it is no longer pending. Other transfers to the peer go on.
  virtual void cancel(uint64_t xfer) = 0;
  // Forgets a transfer; a pending one is cancelled first and forgotten when it settles.
  virtual void release(uint64_t xfer) = 0;

  // A one-way notification (no answer expected).
  virtual Status send_notification(const std::string& peer, const std::string& message) = 0;
  virtual void set_notification_handler(NotificationHandler handler) = 0;
  // Called (from the progress thread) whenever a transfer changes state: a waiter's wake-up.
  virtual void set_wakeup(std::function<void()> wakeup) = 0;
};

// The UCX (UCP) agent. Fails with a clear message when ml4 was built without UCX.
// `thread_init` runs first on the agent's progress thread, where memory is registered and
// reads are driven: UCX's CUDA transports (cuda_ipc, cuda_copy) query device pointers with the
// driver API, which needs the device's context current on that thread (ModelRunner::
// bind_thread). On the H200 (2026-12-04) this alone did not make device regions register; the
// memory-type cache did (ucx_agent.cpp), and the runs since have both.
Result<std::unique_ptr<TransferAgent>> make_ucx_agent(const std::string& name, std::function<void()> thread_init = {});
// True when this build has UCX.
bool ucx_available();

}  // namespace ml4::transfer
