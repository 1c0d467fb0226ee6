// --kv-transfer-config parsing (design in kv_transfer_config.h).
#include "transfer/kv_transfer_config.h"

#include <nlohmann/json.hpp>

namespace ml4::transfer {

Result<KvTransferConfig> parse_kv_transfer_config(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return invalid_argument("--kv-transfer-config is not valid JSON: {}", e.what());
  }
  if (!j.is_object()) return invalid_argument("--kv-transfer-config must be a JSON object");
  KvTransferConfig c;
  auto str = [&](const char* key, std::string* out) -> Status {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return ok_status();
    if (!it->is_string()) return invalid_argument("--kv-transfer-config: '{}' must be a string", key);
    *out = it->get<std::string>();
    return ok_status();
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    static const char* kKnown[] = {"kv_connector", "kv_role", "engine_id", "kv_ip", "kv_connector_extra_config"};
    bool known = false;
    for (const char* k : kKnown) known |= it.key() == k;
    if (!known) return invalid_argument("--kv-transfer-config: unknown field '{}'", it.key());
  }
  ML4_RETURN_IF_ERROR(str("kv_connector", &c.kv_connector));
  ML4_RETURN_IF_ERROR(str("kv_role", &c.kv_role));
  ML4_RETURN_IF_ERROR(str("engine_id", &c.engine_id));
  ML4_RETURN_IF_ERROR(str("kv_ip", &c.kv_ip));
  if (c.kv_connector == "NixlConnector")
    return invalid_argument(
        "--kv-transfer-config: NixlConnector is not built into ml4 (NIXL ships no C++ headers); use "
        "\"kv_connector\":\"UcxConnector\", which moves KV over UCX, the layer NIXL builds on");
  if (c.kv_connector != "UcxConnector")
    return invalid_argument("--kv-transfer-config: kv_connector '{}' is unknown (ml4 has UcxConnector)", c.kv_connector);
  if (c.kv_role != "kv_producer" && c.kv_role != "kv_consumer" && c.kv_role != "kv_both")
    return invalid_argument("--kv-transfer-config: kv_role must be kv_producer, kv_consumer or kv_both, got '{}'",
                            c.kv_role);
  if (c.engine_id.size() > 128) return invalid_argument("--kv-transfer-config: engine_id is longer than 128 bytes");
  for (char ch : c.engine_id)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.'))
      return invalid_argument("--kv-transfer-config: engine_id may hold only letters, digits, '-', '_' and '.'");
  if (auto it = j.find("kv_connector_extra_config"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalid_argument("--kv-transfer-config: kv_connector_extra_config must be an object");
    for (auto e = it->begin(); e != it->end(); ++e) {
      if (e.key() != "load_delay_ms")
        return invalid_argument("--kv-transfer-config: unknown kv_connector_extra_config field '{}'", e.key());
      if (!e->is_number_integer() || e->get<int64_t>() < 0 || e->get<int64_t>() > 600000)
        return invalid_argument("--kv-transfer-config: load_delay_ms must be an integer in [0, 600000]");
      c.load_delay_ms = static_cast<int>(e->get<int64_t>());
    }
  }
  return c;
}

}  // namespace ml4::transfer
