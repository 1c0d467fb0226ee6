// The P/D part of the OpenAI server: `kv_transfer_params` in requests and responses (vLLM's
// names, NixlConnector's fields), the side channel a consumer loads a producer's metadata
// through, and the transfer metrics.
//
// Request (either role):
//   {"kv_transfer_params": {"do_remote_decode": true}}               -> producer leg
//   {"kv_transfer_params": {"do_remote_prefill": true,                -> consumer leg
//       "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
//       "remote_block_ids": [[...] per cache group], "remote_num_tokens", "remote_prompt_hash"}}
// A producer's non-streaming response carries the second form at the top level (the proxy
// copies it into the decode leg, as vLLM's toy proxy does).
//
// Side channel: GET /kv_transfer/metadata on the producer's HTTP port answers the
// connector's metadata blob (vLLM uses a ZMQ socket for the same handshake). A consumer
// fetches it once per producer engine id, under one lock so concurrent requests do not
// connect twice; a restarted producer has a new engine id and is fetched anew. When the
// server has an API key the endpoint needs it, and a consumer sends its own.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "transfer/kv_connector.h"

namespace ml4 {

// Parses body["kv_transfer_params"] (absent or null: no P/D). kInvalidArgument names the field.
Result<transfer::KvTransferRequest> parse_kv_transfer_params(const nlohmann::ordered_json& body);

// The response's kv_transfer_params for a held request.
nlohmann::ordered_json kv_transfer_params_json(const transfer::RemoteKvSource& src);

// Loads (once) the metadata of the producer a consumer request names.
class KvPeerLoader {
 public:
  KvPeerLoader(transfer::KvConnector* connector, std::string api_key)
      : connector_(connector), api_key_(std::move(api_key)) {}
  // An error names the producer and the cause (unreachable, refused, corrupt or
  // incompatible metadata); the server answers 502 with it.
  Status ensure(const transfer::RemoteKvSource& src);

 private:
  transfer::KvConnector* connector_;
  std::string api_key_;
  std::mutex mu_;
};

// Prometheus lines for the connector's statistics (ml4:kv_transfer_*; vLLM's nixl_* names in
// docs/ARCHITECTURE.md).
// `engine_blocks_held`: the engine's own count of blocks it keeps for consumers (snapshot).
std::string render_kv_transfer_metrics(const transfer::KvConnector& connector, const std::string& model_name,
                                       int64_t engine_blocks_held);

}  // namespace ml4
