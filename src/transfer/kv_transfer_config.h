// --kv-transfer-config: vLLM's KVTransferConfig JSON (vllm/config/kv_transfer.py), the
// fields ml4 reads:
//   kv_connector   "UcxConnector" (the only one; "NixlConnector" is refused with a message)
//   kv_role        "kv_producer" (prefill), "kv_consumer" (decode) or "kv_both"
//   engine_id      optional; default: random per process start, so a restarted peer is
//                  recognised as new and its metadata loaded again
//   kv_ip          the host consumers reach this server's side channel at (default: the
//                  server's --host, or 127.0.0.1 when that is 0.0.0.0 / ::)
//   kv_connector_extra_config: {"load_delay_ms": N} delays each consumer load by N ms
//                  before its reads are posted (fault-injection tests only).
// Unknown fields are refused (a misspelt role must not start a server that silently never
// transfers).
#pragma once

#include <string>

#include "core/status.h"

namespace ml4::transfer {

struct KvTransferConfig {
  std::string kv_connector = "UcxConnector";
  std::string kv_role;
  std::string engine_id;
  std::string kv_ip;
  double timeout_s = 480.0;  // --kv-transfer-timeout: holds (producer) and loads (consumer)
  int load_delay_ms = 0;

  bool producer() const { return kv_role == "kv_producer" || kv_role == "kv_both"; }
  bool consumer() const { return kv_role == "kv_consumer" || kv_role == "kv_both"; }
};

Result<KvTransferConfig> parse_kv_transfer_config(const std::string& json);

}  // namespace ml4::transfer
