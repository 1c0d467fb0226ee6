// Serving load generator (design in bench_client.h).
#include "server/bench_client.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

namespace ml4 {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

struct Prompt {
  std::vector<int32_t> ids;  // token ids (completions with random data)
  std::string text;          // text (datasets, chat, servers without /tokenize)
  int prompt_tokens = 0;
  int output_len = 0;
};

const char* kSample =
    "The history of computing is the story of people who wanted to calculate faster and more reliably than "
    "they could by hand. Early mechanical calculators gave way to electronic machines, and those in turn to "
    "integrated circuits holding billions of transistors. Each step made new applications possible: weather "
    "forecasts, banking, the web, and now language models that answer questions in many languages.";

httplib::Headers headers_for(const BenchOptions& o) {
  httplib::Headers h;
  if (!o.api_key.empty()) h.emplace("Authorization", "Bearer " + o.api_key);
  return h;
}

Result<nlohmann::json> get_json(httplib::Client& cli, const std::string& path, const BenchOptions& o) {
  auto res = cli.Get(path, headers_for(o));
  if (!res) return io_error("GET {}{}: {}", o.base_url, path, httplib::to_string(res.error()));
  if (res->status != 200) return io_error("GET {}{}: HTTP {}: {}", o.base_url, path, res->status, res->body);
  try {
    return nlohmann::json::parse(res->body);
  } catch (const std::exception& e) {
    return io_error("GET {}{}: bad JSON: {}", o.base_url, path, e.what());
  }
}

Result<nlohmann::json> post_json(httplib::Client& cli, const std::string& path, const nlohmann::json& body,
                                 const BenchOptions& o) {
  auto res = cli.Post(path, headers_for(o), body.dump(), "application/json");
  if (!res) return io_error("POST {}{}: {}", o.base_url, path, httplib::to_string(res.error()));
  if (res->status != 200) return io_error("POST {}{}: HTTP {}", o.base_url, path, res->status);
  try {
    return nlohmann::json::parse(res->body);
  } catch (const std::exception& e) {
    return io_error("POST {}{}: bad JSON: {}", o.base_url, path, e.what());
  }
}

int draw_len(std::mt19937_64& rng, int len, double ratio) {
  int lo = std::max(1, static_cast<int>(std::floor(len * (1.0 - ratio))));
  int hi = std::max(lo, static_cast<int>(std::ceil(len * (1.0 + ratio))));
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

Result<std::vector<Prompt>> make_prompts(httplib::Client& cli, const BenchOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<Prompt> prompts;
  const bool chat = o.endpoint.find("chat") != std::string::npos;
  if (o.dataset != "random") {
    std::ifstream in(o.dataset);
    if (!in) return io_error("cannot open dataset {}", o.dataset);
    std::vector<Prompt> all;
    std::string line;
    int lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        return invalid_argument("{}:{}: not JSON: {}", o.dataset, lineno, e.what());
      }
      if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string())
        return invalid_argument("{}:{}: needs a string \"prompt\"", o.dataset, lineno);
      Prompt p;
      p.text = j["prompt"].get<std::string>();
      p.output_len = j.contains("output_len") && j["output_len"].is_number_integer() ? j["output_len"].get<int>()
                                                                                      : draw_len(rng, o.output_len, o.range_ratio);
      all.push_back(std::move(p));
    }
    if (all.empty()) return invalid_argument("dataset {} has no prompts", o.dataset);
    for (int i = 0; i < o.num_prompts + o.num_warmups; ++i) prompts.push_back(all[i % all.size()]);
    return prompts;
  }
  // Random: token ids from the server's own tokenization of a sample text.
  std::vector<int32_t> alphabet;
  auto tok = post_json(cli, "/tokenize", {{"model", o.model}, {"prompt", kSample}, {"add_special_tokens", false}}, o);
  if (tok.ok() && tok->contains("tokens") && (*tok)["tokens"].is_array()) {
    for (const auto& t : (*tok)["tokens"]) alphabet.push_back(t.get<int32_t>());
    std::sort(alphabet.begin(), alphabet.end());
    alphabet.erase(std::unique(alphabet.begin(), alphabet.end()), alphabet.end());
  }
  std::vector<std::string> words;
  {
    std::string w;
    for (char c : std::string(kSample)) {
      if (c == ' ') {
        if (!w.empty()) words.push_back(w);
        w.clear();
      } else {
        w += c;
      }
    }
  }
  for (int i = 0; i < o.num_prompts + o.num_warmups; ++i) {
    Prompt p;
    const int n = draw_len(rng, o.input_len, o.range_ratio);
    p.output_len = draw_len(rng, o.output_len, o.range_ratio);
    if (!alphabet.empty()) {
      for (int k = 0; k < n; ++k) p.ids.push_back(alphabet[rng() % alphabet.size()]);
      p.prompt_tokens = n;
      if (chat) {
        auto d = post_json(cli, "/detokenize", {{"model", o.model}, {"tokens", p.ids}}, o);
        if (!d.ok()) return d.status();
        p.text = (*d)["prompt"].get<std::string>();
        p.ids.clear();
      }
    } else {
      for (int k = 0; k < n; ++k) p.text += (k ? " " : "") + words[rng() % words.size()];
    }
    prompts.push_back(std::move(p));
  }
  return prompts;
}

RequestResult send_one(httplib::Client& cli, const BenchOptions& o, const std::string& model, const Prompt& p) {
  RequestResult r;
  r.prompt_tokens = p.prompt_tokens;
  const bool chat = o.endpoint.find("chat") != std::string::npos;
  nlohmann::json body = {{"model", model},
                         {"max_tokens", p.output_len},
                         {"temperature", o.temperature},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
  if (o.ignore_eos) body["ignore_eos"] = true;
  if (o.top_p < 1.0) body["top_p"] = o.top_p;
  if (o.top_k > 0) body["top_k"] = o.top_k;
  if (chat) {
    body["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", p.text}}});
  } else if (!p.ids.empty()) {
    body["prompt"] = p.ids;
  } else {
    body["prompt"] = p.text;
  }
  httplib::Request req;
  req.method = "POST";
  req.path = o.endpoint;
  req.headers = headers_for(o);
  req.set_header("Content-Type", "application/json");
  req.set_header("Accept", "text/event-stream");
  req.body = body.dump();

  std::string buf, raw;
  int chunks = 0;
  bool done = false;
  double last = 0.0;
  const auto t0 = clock_type::now();
  auto handle_event = [&](const std::string& ev) {
    size_t pos = 0;
    while (pos < ev.size()) {
      size_t nl = ev.find('\n', pos);
      std::string line = ev.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      pos = nl == std::string::npos ? ev.size() : nl + 1;
      if (line.rfind("data:", 0) != 0) continue;
      std::string data = line.substr(5);
      if (!data.empty() && data[0] == ' ') data.erase(0, 1);
      if (data == "[DONE]") {
        done = true;
        continue;
      }
      nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        r.error = j["error"].dump();
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object() && j["usage"].contains("completion_tokens")) {
        r.output_tokens = j["usage"]["completion_tokens"].get<int>();
        if (j["usage"].contains("prompt_tokens")) r.prompt_tokens = j["usage"]["prompt_tokens"].get<int>();
      }
      if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) continue;
      const auto& c = j["choices"][0];
      std::string text;
      if (c.contains("text") && c["text"].is_string()) text = c["text"].get<std::string>();
      if (c.contains("delta") && c["delta"].contains("content") && c["delta"]["content"].is_string())
        text = c["delta"]["content"].get<std::string>();
      if (text.empty()) continue;
      const double t = seconds_since(t0);
      if (chunks == 0) r.ttft = t;
      else r.itl.push_back(t - last);
      last = t;
      ++chunks;
    }
  };
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    buf.append(data, len);
    if (raw.size() < 2048) raw.append(data, std::min(len, size_t(2048)));
    size_t sep;
    while ((sep = buf.find("\n\n")) != std::string::npos) {
      handle_event(buf.substr(0, sep));
      buf.erase(0, sep + 2);
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = cli.send(req, res, err);
  r.latency = seconds_since(t0);
  if (!sent) {
    r.error = "transport: " + httplib::to_string(err);
    return r;
  }
  if (res.status != 200) {
    r.error = fmt::format("HTTP {}: {}", res.status, raw.substr(0, 300));
    return r;
  }
  if (!buf.empty()) handle_event(buf);
  if (r.output_tokens == 0) r.output_tokens = chunks;
  if (r.error.empty() && !done) r.error = "stream ended without [DONE]";
  if (r.error.empty() && chunks == 0) r.error = "no content";
  r.ok = r.error.empty();
  return r;
}

double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0.0;
  const double pos = q / 100.0 * (sorted.size() - 1);  // numpy's default "linear"
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

}  // namespace

LatencyStats latency_stats(std::vector<double> v) {
  LatencyStats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / v.size();
  s.median = percentile(v, 50);
  s.p90 = percentile(v, 90);
  s.p99 = percentile(v, 99);
  s.min = v.front();
  s.max = v.back();
  return s;
}

std::optional<SpecDecodeStats> parse_spec_decode_metrics(const std::string& text) {
  SpecDecodeStats s;
  bool any = false;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.rfind("vllm:spec_decode_", 0) != 0) continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    double v = 0;
    try {
      v = std::stod(line.substr(sp + 1));
    } catch (const std::exception&) {
      continue;
    }
    const std::string name = line.substr(0, line.find_first_of("{ "));
    if (name == "vllm:spec_decode_num_drafts_total") {
      s.num_drafts += v;
    } else if (name == "vllm:spec_decode_num_draft_tokens_total") {
      s.draft_tokens += v;
    } else if (name == "vllm:spec_decode_num_accepted_tokens_total") {
      s.accepted_tokens += v;
    } else if (name == "vllm:spec_decode_num_accepted_tokens_per_pos_total") {
      const size_t at = line.find("position=\"");
      if (at == std::string::npos) continue;
      const size_t j = static_cast<size_t>(std::strtoul(line.c_str() + at + 10, nullptr, 10));
      if (j >= 4096) continue;
      if (s.accepted_per_pos.size() <= j) s.accepted_per_pos.resize(j + 1, 0.0);
      s.accepted_per_pos[j] += v;
    } else {
      continue;
    }
    any = true;
  }
  if (!any) return std::nullopt;
  return s;
}

namespace {

// The server's counters now; nullopt when /metrics is missing or has none.
std::optional<SpecDecodeStats> scrape_spec(httplib::Client& cli, const BenchOptions& o) {
  auto res = cli.Get("/metrics", headers_for(o));
  if (!res || res->status != 200) return std::nullopt;
  return parse_spec_decode_metrics(res->body);
}

}  // namespace

Result<BenchSummary> run_bench(const BenchOptions& o) {
  if (o.num_prompts < 1) return invalid_argument("--num-prompts must be at least 1");
  if (o.request_rate < 0) return invalid_argument("--request-rate must be >= 0");
  if (o.range_ratio < 0 || o.range_ratio >= 1) return invalid_argument("--random-range-ratio must be in [0, 1)");
  httplib::Client probe(o.base_url);
  if (!probe.is_valid()) return invalid_argument("bad --base-url {}", o.base_url);
  probe.set_read_timeout(static_cast<time_t>(o.timeout_s), 0);
  BenchSummary s;
  s.options = o;
  s.model = o.model;
  if (s.model.empty()) {
    ML4_ASSIGN_OR_RETURN(auto models, get_json(probe, "/v1/models", o));
    if (!models.contains("data") || !models["data"].is_array() || models["data"].empty())
      return io_error("{}/v1/models lists no model", o.base_url);
    s.model = models["data"][0].value("id", "");
  }
  BenchOptions oo = o;
  oo.model = s.model;
  ML4_ASSIGN_OR_RETURN(std::vector<Prompt> prompts, make_prompts(probe, oo));

  auto make_client = [&] {
    auto c = std::make_unique<httplib::Client>(o.base_url);
    c->set_tcp_nodelay(true);
    c->set_read_timeout(static_cast<time_t>(o.timeout_s), 0);
    c->set_write_timeout(30, 0);
    c->set_keep_alive(true);
    return c;
  };
  for (int i = 0; i < o.num_warmups; ++i) {
    auto c = make_client();
    RequestResult w = send_one(*c, o, s.model, prompts[i]);
    if (!w.ok) return io_error("warm-up request failed: {}", w.error);
  }

  const std::optional<SpecDecodeStats> spec_before = scrape_spec(probe, o);
  const int n = o.num_prompts;
  std::vector<double> arrivals(n, 0.0);
  if (o.request_rate > 0) {
    std::mt19937_64 rng(o.seed ^ 0xA5A5A5A5ull);
    std::exponential_distribution<double> gap(o.request_rate);
    double t = 0;
    for (int i = 0; i < n; ++i) {
      arrivals[i] = t;
      t += gap(rng);
    }
  }
  const int workers = std::min(o.max_concurrency > 0 ? o.max_concurrency : n, 1024);
  std::vector<RequestResult> results(n);
  std::atomic<int> next{0}, finished{0}, in_flight{0}, peak{0};
  std::mutex done_mu;
  double last_done = 0.0;  // when the last request ended: the duration (the wait below polls)
  const auto t0 = clock_type::now();
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&] {
      auto cli = make_client();
      for (;;) {
        const int i = next.fetch_add(1);
        if (i >= n) return;
        const double wait = arrivals[i] - seconds_since(t0);
        if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
        int now_in = ++in_flight;
        int p = peak.load();
        while (now_in > p && !peak.compare_exchange_weak(p, now_in)) {
        }
        results[i] = send_one(*cli, o, s.model, prompts[o.num_warmups + i]);
        {
          std::lock_guard<std::mutex> lk(done_mu);
          last_done = std::max(last_done, seconds_since(t0));
        }
        --in_flight;
        ++finished;
      }
    });
  }
  while (finished.load() < n) {
    if (o.progress) {
      const int d = finished.load();
      const int width = 40, fill = d * width / n;
      std::fprintf(stderr, "\r[%s%s] %d/%d requests, %.1f s", std::string(fill, '#').c_str(),
                   std::string(width - fill, '.').c_str(), d, n, seconds_since(t0));
      std::fflush(stderr);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  for (auto& t : pool) t.join();
  s.duration_s = last_done;
  if (o.progress) std::fprintf(stderr, "\r[%s] %d/%d requests, %.1f s\n", std::string(40, '#').c_str(), n, n, s.duration_s);

  std::vector<double> ttft, tpot, itl, e2el;
  for (const auto& r : results) {
    if (!r.ok) {
      ++s.failed;
      if (s.errors.size() < 5) s.errors.push_back(r.error);
      continue;
    }
    ++s.completed;
    s.total_input += r.prompt_tokens;
    s.total_output += r.output_tokens;
    s.input_lens.push_back(r.prompt_tokens);
    s.output_lens.push_back(r.output_tokens);
    ttft.push_back(r.ttft * 1e3);
    e2el.push_back(r.latency * 1e3);
    if (r.output_tokens > 1) tpot.push_back((r.latency - r.ttft) / (r.output_tokens - 1) * 1e3);
    for (double x : r.itl) itl.push_back(x * 1e3);
  }
  if (spec_before) {
    if (const std::optional<SpecDecodeStats> after = scrape_spec(probe, o)) {
      SpecDecodeStats d;
      d.num_drafts = after->num_drafts - spec_before->num_drafts;
      d.draft_tokens = after->draft_tokens - spec_before->draft_tokens;
      d.accepted_tokens = after->accepted_tokens - spec_before->accepted_tokens;
      d.accepted_per_pos = after->accepted_per_pos;
      for (size_t j = 0; j < d.accepted_per_pos.size() && j < spec_before->accepted_per_pos.size(); ++j)
        d.accepted_per_pos[j] -= spec_before->accepted_per_pos[j];
      s.spec = d;
    }
  }
  s.max_concurrency_seen = peak.load();
  s.request_throughput = s.completed / s.duration_s;
  s.output_throughput = s.total_output / s.duration_s;
  s.total_throughput = (s.total_input + s.total_output) / s.duration_s;
  s.ttft_ms = latency_stats(ttft);
  s.tpot_ms = latency_stats(tpot);
  s.itl_ms = latency_stats(itl);
  s.e2el_ms = latency_stats(e2el);
  return s;
}

std::string format_bench_table(const BenchSummary& s) {
  std::string o;
  auto row = [&](const std::string& k, const std::string& v) { o += fmt::format("{:<40}{:>12}\n", k, v); };
  auto head = [&](const std::string& t) { o += fmt::format("{:-^52}\n", t); };
  o += fmt::format("{:=^52}\n", " Serving Benchmark Result ");
  row("Successful requests:", std::to_string(s.completed));
  row("Failed requests:", std::to_string(s.failed));
  row("Maximum request concurrency:", s.options.max_concurrency > 0 ? std::to_string(s.options.max_concurrency) : "inf");
  row("Request rate (req/s):", s.options.request_rate > 0 ? fmt::format("{:.2f}", s.options.request_rate) : "inf");
  row("Benchmark duration (s):", fmt::format("{:.2f}", s.duration_s));
  row("Total input tokens:", std::to_string(s.total_input));
  row("Total generated tokens:", std::to_string(s.total_output));
  row("Request throughput (req/s):", fmt::format("{:.2f}", s.request_throughput));
  row("Output token throughput (tok/s):", fmt::format("{:.2f}", s.output_throughput));
  row("Total token throughput (tok/s):", fmt::format("{:.2f}", s.total_throughput));
  auto block = [&](const char* title, const char* abbr, const LatencyStats& l) {
    head(title);
    row(fmt::format("Mean {} (ms):", abbr), fmt::format("{:.2f}", l.mean));
    row(fmt::format("Median {} (ms):", abbr), fmt::format("{:.2f}", l.median));
    row(fmt::format("P90 {} (ms):", abbr), fmt::format("{:.2f}", l.p90));
    row(fmt::format("P99 {} (ms):", abbr), fmt::format("{:.2f}", l.p99));
  };
  block("Time to First Token", "TTFT", s.ttft_ms);
  block("Time per Output Token (excl. 1st token)", "TPOT", s.tpot_ms);
  block("Inter-token Latency", "ITL", s.itl_ms);
  block("End-to-end Latency", "E2EL", s.e2el_ms);
  if (s.spec) {  // vllm bench serve's block
    const SpecDecodeStats& d = *s.spec;
    head("Speculative Decoding");
    row("Acceptance rate (%):", fmt::format("{:.2f}", 100.0 * d.acceptance_rate()));
    row("Acceptance length:", fmt::format("{:.2f}", d.acceptance_length()));
    row("Drafts:", fmt::format("{:.0f}", d.num_drafts));
    row("Draft tokens:", fmt::format("{:.0f}", d.draft_tokens));
    row("Accepted tokens:", fmt::format("{:.0f}", d.accepted_tokens));
    o += "Per-position acceptance (%):\n";
    for (size_t j = 0; j < d.accepted_per_pos.size(); ++j)
      row(fmt::format("  Position {}:", j),
          fmt::format("{:.2f}", d.num_drafts > 0 ? 100.0 * d.accepted_per_pos[j] / d.num_drafts : 0.0));
  }
  o += std::string(52, '=') + "\n";
  for (const auto& e : s.errors) o += "error: " + e + "\n";
  return o;
}

nlohmann::json bench_json(const BenchSummary& s) {
  auto lat = [](const LatencyStats& l) {
    return nlohmann::json{{"mean", l.mean}, {"median", l.median}, {"p90", l.p90}, {"p99", l.p99}, {"min", l.min}, {"max", l.max}};
  };
  const auto& o = s.options;
  return {{"base_url", o.base_url},
          {"endpoint", o.endpoint},
          {"model", s.model},
          {"dataset", o.dataset},
          // The options' lengths mean something only for random prompts; the lengths each
          // completed request really had (the server's usage) are input_lens / output_lens.
          {"input_len", o.dataset == "random" ? nlohmann::json(o.input_len) : nlohmann::json(nullptr)},
          {"output_len", o.dataset == "random" ? nlohmann::json(o.output_len) : nlohmann::json(nullptr)},
          {"range_ratio", o.range_ratio},
          {"input_lens", s.input_lens},
          {"output_lens", s.output_lens},
          {"num_prompts", o.num_prompts},
          {"max_concurrency", o.max_concurrency},
          {"request_rate", o.request_rate},
          {"completed", s.completed},
          {"failed", s.failed},
          {"duration_s", s.duration_s},
          {"total_input_tokens", s.total_input},
          {"total_output_tokens", s.total_output},
          {"request_throughput", s.request_throughput},
          {"output_throughput", s.output_throughput},
          {"total_token_throughput", s.total_throughput},
          {"max_concurrency_seen", s.max_concurrency_seen},
          {"ttft_ms", lat(s.ttft_ms)},
          {"tpot_ms", lat(s.tpot_ms)},
          {"itl_ms", lat(s.itl_ms)},
          {"e2el_ms", lat(s.e2el_ms)},
          {"errors", s.errors},
          {"temperature", o.temperature},
          {"spec_decode", s.spec ? nlohmann::json{{"num_drafts", s.spec->num_drafts},
                                                 {"draft_tokens", s.spec->draft_tokens},
                                                 {"accepted_tokens", s.spec->accepted_tokens},
                                                 {"acceptance_rate", s.spec->acceptance_rate()},
                                                 {"acceptance_length", s.spec->acceptance_length()},
                                                 {"accepted_per_pos", s.spec->accepted_per_pos}}
                                : nlohmann::json(nullptr)}};
}

}  // namespace ml4
