// kv_transfer_params, the metadata side channel and the transfer metrics (design in
// kv_transfer_params.h).
#include "server/kv_transfer_params.h"

#include <httplib.h>

#include <fmt/format.h>

namespace ml4 {
namespace {

using ojson = nlohmann::ordered_json;

constexpr size_t kMaxBlockIds = 1u << 22;  // 4M blocks of 64 tokens: far past any context

Status field_error(const char* key, const char* want) {
  return invalid_argument("'kv_transfer_params.{}' must be {}", key, want);
}

}  // namespace

Result<transfer::KvTransferRequest> parse_kv_transfer_params(const ojson& body) {
  transfer::KvTransferRequest kv;
  auto it = body.find("kv_transfer_params");
  if (it == body.end() || it->is_null()) return kv;
  const ojson& p = *it;
  if (!p.is_object()) return invalid_argument("'kv_transfer_params' must be an object");
  auto flag = [&](const char* key, bool* out) -> Status {
    auto f = p.find(key);
    if (f == p.end() || f->is_null()) return ok_status();
    if (!f->is_boolean()) return field_error(key, "a boolean");
    *out = f->get<bool>();
    return ok_status();
  };
  bool remote_prefill = false;
  ML4_RETURN_IF_ERROR(flag("do_remote_decode", &kv.do_remote_decode));
  ML4_RETURN_IF_ERROR(flag("do_remote_prefill", &remote_prefill));
  if (!remote_prefill) return kv;
  transfer::RemoteKvSource src;
  auto str = [&](const char* key, std::string* out) -> Status {
    auto f = p.find(key);
    if (f == p.end() || !f->is_string() || f->get<std::string>().empty() || f->get<std::string>().size() > 256)
      return field_error(key, "a non-empty string (as the prefill server returned it)");
    *out = f->get<std::string>();
    return ok_status();
  };
  auto integer = [&](const char* key, int64_t lo, int64_t hi, int64_t* out) -> Status {
    auto f = p.find(key);
    if (f == p.end() || !f->is_number_integer()) return field_error(key, "an integer (as the prefill server returned it)");
    const int64_t v = f->is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(f->get<uint64_t>(), INT64_MAX))
                                              : f->get<int64_t>();
    if (v < lo || v > hi) return invalid_argument("'kv_transfer_params.{}' must be in [{}, {}], got {}", key, lo, hi, v);
    *out = v;
    return ok_status();
  };
  ML4_RETURN_IF_ERROR(str("remote_engine_id", &src.engine_id));
  ML4_RETURN_IF_ERROR(str("remote_request_id", &src.request_id));
  ML4_RETURN_IF_ERROR(str("remote_host", &src.host));
  int64_t port = 0;
  ML4_RETURN_IF_ERROR(integer("remote_port", 1, 65535, &port));
  src.port = static_cast<int>(port);
  ML4_RETURN_IF_ERROR(integer("remote_num_tokens", 1, INT64_MAX / 2, &src.num_tokens));
  std::string hash;
  ML4_RETURN_IF_ERROR(str("remote_prompt_hash", &hash));
  try {
    size_t used = 0;
    src.prompt_hash = std::stoull(hash, &used, 16);
    if (used != hash.size()) throw std::invalid_argument(hash);
  } catch (const std::exception&) {
    return field_error("remote_prompt_hash", "a hexadecimal string");
  }
  auto ids = p.find("remote_block_ids");
  if (ids == p.end() || !ids->is_array()) return field_error("remote_block_ids", "an array of block id arrays");
  size_t total = 0;
  for (const auto& g : *ids) {
    if (!g.is_array()) return field_error("remote_block_ids", "an array of block id arrays (one per cache group)");
    std::vector<int32_t> blocks;
    for (const auto& b : g) {
      // -1: a page of a sliding-window group (the DSpark drafter window) before its window,
      // which the producer no longer holds.
      if (!b.is_number_integer() || b.get<int64_t>() < -1 || b.get<int64_t>() > INT32_MAX)
        return field_error("remote_block_ids", "arrays of block ids (non-negative, or -1 for a page before a window)");
      blocks.push_back(static_cast<int32_t>(b.get<int64_t>()));
    }
    total += blocks.size();
    if (total > kMaxBlockIds) return invalid_argument("'kv_transfer_params.remote_block_ids' is too long");
    src.block_ids.push_back(std::move(blocks));
  }
  if (kv.do_remote_decode) return invalid_argument("'kv_transfer_params': do_remote_decode and do_remote_prefill exclude each other");
  kv.remote_prefill = std::move(src);
  return kv;
}

ojson kv_transfer_params_json(const transfer::RemoteKvSource& src) {
  return ojson{{"do_remote_prefill", true},
               {"do_remote_decode", false},
               {"remote_engine_id", src.engine_id},
               {"remote_request_id", src.request_id},
               {"remote_host", src.host},
               {"remote_port", src.port},
               {"remote_block_ids", src.block_ids},
               {"remote_num_tokens", src.num_tokens},
               {"remote_prompt_hash", fmt::format("{:016x}", src.prompt_hash)},
               {"tp_size", 1}};
}

Status KvPeerLoader::ensure(const transfer::RemoteKvSource& src) {
  if (connector_->has_peer(src.engine_id)) return ok_status();
  std::lock_guard<std::mutex> lk(mu_);
  if (connector_->has_peer(src.engine_id)) return ok_status();  // another request loaded it
  httplib::Client cli(src.host, src.port);
  cli.set_connection_timeout(5, 0);
  cli.set_read_timeout(30, 0);
  httplib::Headers headers;
  if (!api_key_.empty()) headers.emplace("Authorization", "Bearer " + api_key_);
  auto res = cli.Get("/kv_transfer/metadata", headers);
  const std::string where = fmt::format("prefill engine {} at {}:{}", src.engine_id, src.host, src.port);
  if (!res) return internal_error("KV transfer: cannot fetch the metadata of {}: {}", where, httplib::to_string(res.error()));
  if (res->status != 200)
    return internal_error("KV transfer: {} answered {} to GET /kv_transfer/metadata: {}", where, res->status,
                          res->body.substr(0, 200));
  auto loaded = connector_->load_peer(res->body, src.engine_id);
  if (!loaded.ok()) return internal_error("KV transfer: the metadata of {} is unusable: {}", where, loaded.status().message());
  return ok_status();
}

std::string render_kv_transfer_metrics(const transfer::KvConnector& c, const std::string& model_name,
                                       int64_t engine_blocks_held) {
  const transfer::KvTransferStats s = c.stats();
  const std::string ml = fmt::format("model_name=\"{}\",kv_role=\"{}\"", model_name, c.config().kv_role);
  std::string o;
  auto line = [&](const char* name, const char* type, const char* help, auto value) {
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}{{{}}} {}\n", name, help, name, type, name, ml, value);
  };
  line("ml4:kv_transfer_bytes_total", "counter", "KV bytes this consumer read from producers.", s.bytes);
  line("ml4:kv_transfer_blocks_total", "counter", "KV blocks read (one per cache group and block, all layers).", s.blocks);
  line("ml4:kv_transfer_requests_total", "counter", "KV loads that completed.", s.transfers_ok);
  line("ml4:kv_transfer_failures_total", "counter", "KV loads that failed (their requests failed).", s.failures);
  line("ml4:kv_transfer_timeouts_total", "counter", "KV loads that passed --kv-transfer-timeout.", s.timeouts);
  line("ml4:kv_transfer_expired_total", "counter",
       "Producer: holds freed by the timeout; consumer: loads answered 'expired'.", s.expired);
  line("ml4:kv_transfer_holds_released_total", "counter", "Producer: holds freed on a consumer's done or abort.",
       s.holds_released);
  line("ml4:kv_blocks_held_for_remote", "gauge", "Producer: KV blocks the engine keeps for remote consumers.",
       engine_blocks_held);
  line("ml4:kv_requests_held_for_remote", "gauge", "Producer: requests whose blocks wait for a consumer.",
       s.requests_held);
  line("ml4:kv_transfer_loads_in_flight", "gauge", "Consumer: KV loads in flight.", s.loads_in_flight);
  const char* h = "ml4:kv_transfer_time_seconds";
  o += fmt::format("# HELP {} Time of one KV load, reads and the producer's answer.\n# TYPE {} histogram\n", h, h);
  int64_t cum = 0;
  for (size_t i = 0; i < s.time_bounds.size(); ++i) {
    cum += s.time_counts[i];
    o += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", h, ml, s.time_bounds[i], cum);
  }
  cum += s.time_counts.back();
  o += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n{}_sum{{{}}} {}\n{}_count{{{}}} {}\n", h, ml, cum, h, ml, s.time_sum,
                   h, ml, cum);
  return o;
}

}  // namespace ml4
