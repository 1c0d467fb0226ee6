// KvConnector: prefill/decode disaggregation's KV side (SYSTEM.md S11), vLLM's
// NixlConnector flow (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py) on a
// TransferAgent (UCX).
//
// Roles (--kv-transfer-config kv_role): a producer (prefill) computes a prompt and, instead
// of freeing its KV blocks when the request finishes, holds them for a consumer; a consumer
// (decode) reads the blocks its prefix cache lacks from the producer, recomputes the last
// prompt token (as vLLM does: the first output token is sampled on the decode side) and
// decodes. kv_both is either, per request.
//
// The flow for one request (the proxy, src/server/proxy.h, drives it):
//   1. producer: the request comes with kv_transfer_params {do_remote_decode: true}; when it
//      finishes, the engine calls hold(): the blocks stay referenced, and the response's
//      kv_transfer_params (a RemoteKvSource) name them, this engine and where its metadata
//      is served (GET /kv_transfer/metadata on the producer's HTTP port, the side channel).
//   2. consumer: the request comes with those params {do_remote_prefill: true, ...}; the
//      server loads the producer's metadata once per engine id (load_peer); the scheduler
//      allocates blocks for the prompt but its last token, taking its own prefix-cache hit
//      first; the engine calls start_load() with (remote block, local block) pairs for the
//      blocks it lacks; one READ of those pages per region, then the notification
//      "done <request>" which the producer answers "ok" if the blocks were still held (it
//      frees them now) or "expired" if its timeout had freed them; the load is done only on
//      "ok", so a consumer never decodes from blocks that were freed under it.
//   3. release: the producer frees a hold on "done", on "abort <request>" (the consumer
//      aborted), or when it is older than kv-transfer-timeout (the consumer never came;
//      vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
// A load that fails (peer gone, timeout, expired, bad block ids) fails its request with an
// error naming the cause; nothing falls back to computing the prompt locally (vllm #42703).
//
// Threading: the engine thread calls hold / take_released / start_load / cancel_load /
// poll_loads; HTTP threads call load_peer / metadata / stats; notifications arrive on the
// agent's thread. One mutex guards the holds and loads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "runtime/model_runner.h"
#include "transfer/kv_transfer_config.h"
#include "transfer/transfer_agent.h"

namespace ml4::transfer {

// What a producer returns in kv_transfer_params and a consumer reads from.
struct RemoteKvSource {
  std::string engine_id;   // the producer engine (its agent name)
  std::string request_id;  // the producer's request id: the key of its hold
  std::string host;        // where GET /kv_transfer/metadata is served
  int port = 0;
  int64_t num_tokens = 0;     // prompt tokens whose KV the producer holds
  uint64_t prompt_hash = 0;   // of the prompt's token ids: a consumer checks it has the same prompt
  std::vector<std::vector<int32_t>> block_ids;  // per cache group, in position order
};

// A request's P/D part, as the API asked for it.
struct KvTransferRequest {
  bool do_remote_decode = false;               // producer: hold the blocks when done
  std::optional<RemoteKvSource> remote_prefill;  // consumer: read the prompt's KV from here
};

uint64_t prompt_hash(const std::vector<int32_t>& tokens);

// One consumer load as the engine asks for it: local and remote block ids of the same
// positions, per group.
struct KvLoadBlocks {
  std::vector<std::vector<int32_t>> remote, local;  // per group, same lengths
};

struct KvLoadResult {
  int64_t key = 0;  // the engine's key (its sequence id)
  bool ok = false;
  bool cancelled = false;
  std::string error;
};

struct KvTransferStats {
  int64_t bytes = 0;              // read by this consumer
  int64_t blocks = 0;             // per group and block (a block of every layer counts once)
  int64_t transfers_ok = 0;
  int64_t failures = 0;           // loads failed (timeouts and expiries included)
  int64_t timeouts = 0;           // consumer: loads past the timeout
  int64_t expired = 0;            // producer: holds freed by the timeout; consumer: "expired" answers
  int64_t holds_released = 0;     // producer: holds freed on "done" or "abort"
  int64_t blocks_held = 0;        // producer: blocks held for remote consumers now
  int64_t requests_held = 0;
  int64_t loads_in_flight = 0;
  std::vector<double> time_bounds;   // transfer time histogram (seconds), cumulative on render
  std::vector<int64_t> time_counts;  // one more than bounds (+Inf)
  double time_sum = 0.0;
};

class KvConnector {
 public:
  // Registers the runner's KV regions with a new agent. `groups` are the runner's cache groups;
  // `thread_init` runs on the agent's thread first (the runner's bind_thread: make_ucx_agent).
  static Result<std::unique_ptr<KvConnector>> create(const KvTransferConfig& config, const std::vector<KvRegion>& regions,
                                                     const std::vector<CacheGroupInfo>& groups,
                                                     std::function<void()> thread_init = {});
  // For tests: over a given agent (already constructed, not yet registered).
  static Result<std::unique_ptr<KvConnector>> create_with_agent(const KvTransferConfig& config,
                                                                std::unique_ptr<TransferAgent> agent,
                                                                const std::vector<KvRegion>& regions,
                                                                const std::vector<CacheGroupInfo>& groups);
  ~KvConnector();

  const KvTransferConfig& config() const { return config_; }
  const std::string& engine_id() const { return engine_id_; }
  bool producer() const { return config_.producer(); }
  bool consumer() const { return config_.consumer(); }
  std::string describe() const { return agent_->describe(); }

  // The side-channel blob: layout (groups, regions) + the agent's metadata.
  const std::string& metadata() const { return metadata_; }
  // Consumer: checks a producer's blob (checksum, KV layout equal to ours) and connects.
  // Returns its engine id; `expected_engine_id` (if not empty) must match.
  Result<std::string> load_peer(const std::string& blob, const std::string& expected_engine_id = "");
  bool has_peer(const std::string& engine_id) const;

  // Producer: hold `num_blocks` blocks for request_id until released; the engine frees them
  // when take_released() names the request.
  void hold(const std::string& request_id, int64_t num_blocks);
  std::vector<std::string> take_released();

  // Consumer: reads `blocks` from `src`; the result comes from poll_loads() under `key`.
  // Block ids are checked against the producer's layout; an error here changes nothing.
  Status start_load(int64_t key, const RemoteKvSource& src, const KvLoadBlocks& blocks);
  // The request went away: the producer is told to free (if the load had not reported yet);
  // the load still reports, as cancelled, once no read can touch its blocks.
  void cancel_load(int64_t key);
  // The request went away before its load started: tells the producer to free.
  void release_remote(const RemoteKvSource& src);
  std::vector<KvLoadResult> poll_loads();
  size_t loads_in_flight() const;
  size_t holds() const;

  // Woken (from the agent's thread) when a load finished or a hold was released.
  void set_wakeup(std::function<void()> wakeup);
  KvTransferStats stats() const;

 private:
  KvConnector(KvTransferConfig config, std::unique_ptr<TransferAgent> agent);
  Status init(const std::vector<KvRegion>& regions, const std::vector<CacheGroupInfo>& groups);
  std::string on_notification(const std::string& msg);
  void expire_holds_locked(std::chrono::steady_clock::time_point now);
  void record_time_locked(double seconds);

  struct RegionLayout {
    int group = 0, slot = 0;
    int64_t block_bytes = 0, num_blocks = 0;
    bool device = false;
  };
  struct Peer {
    std::string engine_id;
    uint64_t blob_hash = 0;
    std::vector<RegionLayout> regions;
  };
  struct Hold {
    int64_t num_blocks = 0;
    std::chrono::steady_clock::time_point deadline;
  };
  struct Load {
    uint64_t xfer = 0;
    std::string engine_id, remote_request;
    int64_t bytes = 0, blocks = 0;
    std::chrono::steady_clock::time_point start, deadline;
    bool cancelled = false;
    std::string timeout_error;  // set when it timed out; reported once its reads settle
  };

  KvTransferConfig config_;
  std::unique_ptr<TransferAgent> agent_;
  std::string engine_id_;
  std::vector<RegionLayout> layout_;
  std::vector<CacheGroupInfo> groups_;
  std::string metadata_;

  mutable std::mutex mu_;
  std::unordered_map<std::string, Peer> peers_;
  std::unordered_map<std::string, Hold> holds_;
  std::vector<std::string> released_;
  std::map<int64_t, Load> loads_;
  std::map<int64_t, std::vector<ReadOp>> pending_ops_;  // loads delayed by load_delay_ms
  std::function<void()> wakeup_;
  KvTransferStats stats_;
};

}  // namespace ml4::transfer
