// `ml4 capacity`: KV bytes per token per cache group and the token capacity of a memory
// budget, from a preset or a model directory (SYSTEM.md S6).
//
// The numbers come from make_kv_cache_spec and PagedKvCache::blocks_for_budget, the same
// code the engine sizes its cache with, so what this prints is what the engine admits
// against. For --preset ml4 the totals are MODEL.md section 1's: 47,136 B/token
// (fp8_ds_mla), 42,096 (fp8), 78,384 (bf16). The drafter group is a per-request sliding
// window, so it is listed apart and left out of the per-token total.
//
// With -tp / -dp / --enable-expert-parallel (SYSTEM.md S10) it also prints what each rank holds
// (parallel/parallel_plan.h: weight bytes by part, heads, vocabulary and experts) and the KV
// tokens per rank that --gpu-memory-gib x --gpu-memory-utilization leaves after the largest
// rank's weights. The MLA latent is replicated on every TP rank, so KV bytes per token do not
// shrink with TP (that is what decode context parallelism is for); DP replicas hold different
// sequences, so the deployment holds dp x the tokens of one rank.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "command.h"
#include "device_options.h"
#include "kv/cache_spec.h"
#include "kv/paged_kv_cache.h"
#include "model/config_loader.h"
#include "model/presets.h"
#include "offload/hisparse.h"
#include "parallel/parallel_plan.h"

namespace ml4::cli {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// 47136 -> "47,136".
std::string grouped(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

const char* kind_name(CacheGroupSpec::Kind k) {
  switch (k) {
    case CacheGroupSpec::kLatent: return "latent";
    case CacheGroupSpec::kIndexer: return "indexer";
    case CacheGroupSpec::kDrafter: return "drafter";
  }
  return "?";
}

struct CapacityOptions {
  std::string preset;
  std::string model_dir;
  std::string kv_cache_dtype = "auto";
  double gib = 0.0;
  int64_t max_requests = 0;
  ParallelConfig parallel;
  double gpu_memory_gib = 141.0;  // one H200
  double gpu_memory_utilization = 0.9;
  int64_t context = 65536;  // the request context of the DSpark x DCP line
  double host_pool_gib = 0.0;  // HiSparse (SYSTEM.md S12)
  int hot_slots = 0;
};

// HiSparse at the same device budget (--gib): the latent KV in a host pool of --host-pool-gib,
// the device holding the indexer cache and max_requests x the hot buffers (offload/hisparse.h,
// the sizing the runners use); against GPU-only, and against consumers materialised.
int print_hisparse(const CapacityOptions& o, const ModelConfig& cfg, const KvCacheSpec& spec) {
  HiSparseConfig hc;
  hc.enabled = true;
  hc.host_pool_bytes = static_cast<int64_t>(o.host_pool_gib * static_cast<double>(kGiB));
  hc.hot_slots_per_request = o.hot_slots;
  const auto device = static_cast<int64_t>(o.gib * static_cast<double>(kGiB));
  const int64_t requests = std::max<int64_t>(o.max_requests, 1);
  const bool windows = spec.group_index(CacheGroupSpec::kDrafter) >= 0 && o.max_requests > 0;
  auto z = hisparse_sizing(cfg, spec, hc, device, requests, windows);
  if (!z.ok()) {
    std::fprintf(stderr, "ml4 capacity: %s\n", z.status().message().c_str());
    return 1;
  }
  KvCacheSpec materialised = spec;
  const int g = spec.group_index(CacheGroupSpec::kLatent);
  for (const auto& l : cfg.layers)
    if (!l.owns_kv()) materialised.groups[g].layers.push_back(l.index);
  auto m = hisparse_sizing(cfg, materialised, hc, device, requests, windows);
  const int64_t tokens = z->blocks[g] * kPageTokens;
  const int64_t gpu_only = PagedKvCache::blocks_for_budget(spec, device, o.max_requests)[g] * kPageTokens;
  const int64_t host_bound = hc.host_pool_bytes / (spec.groups[g].page_bytes_per_layer() * static_cast<int64_t>(spec.groups[g].layers.size())) * kPageTokens;
  fmt::print("HiSparse: host pool {} GiB, device {} GiB = hot buffers {:.2f} GiB ({} sparse layers x {} requests x {} rows) "
             "+ indexer cache + drafter windows\n",
             o.host_pool_gib, o.gib, static_cast<double>(z->hot_bytes) / kGiB, z->layers, z->regions, z->slots);
  fmt::print("HiSparse tokens admitted: {} (the host pool holds {}, the device's indexer cache {}); GPU only at the "
             "same device budget: {}: {:.2f}x\n",
             grouped(tokens), grouped(host_bound), tokens < host_bound ? "less" : "at least as many", grouped(gpu_only),
             gpu_only > 0 ? static_cast<double>(tokens) / static_cast<double>(gpu_only) : 0.0);
  if (m.ok() && m->blocks[g] > 0)
    fmt::print("KV-sharing consumers bound to their source's host rows: {} tokens, materialised: {} ({:+.1f}%)\n",
               grouped(tokens), grouped(m->blocks[g] * kPageTokens),
               100.0 * (static_cast<double>(z->blocks[g]) / static_cast<double>(m->blocks[g]) - 1.0));
  return 0;
}

// Weights per rank and KV tokens per rank (see the file comment).
int print_parallel(const CapacityOptions& o, const ModelConfig& cfg, const KvCacheSpec& spec) {
  const ParallelConfig& pc = o.parallel;
  const int world = pc.world_size();
  int64_t most = 0;
  std::string lines;
  for (int r = 0; r < world; ++r) {
    auto layout = RankLayout::make(pc, world, r);
    if (!layout.ok()) {
      std::fprintf(stderr, "ml4 capacity: %s\n", layout.status().message().c_str());
      return 2;
    }
    auto plan = ParallelPlan::make(cfg, *layout);
    if (!plan.ok()) {
      std::fprintf(stderr, "ml4 capacity: %s\n", plan.status().message().c_str());
      return 1;
    }
    if (r == 0) fmt::print("{}", layout->describe());
    const RankWeightBytes b = plan->weight_bytes();
    most = std::max(most, b.total());
    lines += plan->describe();
  }
  fmt::print("{}", lines);
  const int64_t budget = static_cast<int64_t>(o.gpu_memory_gib * o.gpu_memory_utilization * static_cast<double>(kGiB));
  const int64_t kv = budget - most;
  fmt::print("per rank: {} GiB x {} = {:.2f} GiB, weights at most {:.2f} GiB, KV cache {:.2f} GiB\n", o.gpu_memory_gib,
             o.gpu_memory_utilization, static_cast<double>(budget) / kGiB, static_cast<double>(most) / kGiB,
             static_cast<double>(kv) / kGiB);
  if (kv <= 0) {
    fmt::print("KV tokens per rank: 0 (the weights do not fit)\n");
    return 0;
  }
  const auto blocks = PagedKvCache::blocks_for_budget(spec, kv, o.max_requests);
  const int latent = spec.group_index(CacheGroupSpec::kLatent);
  const int64_t tokens = blocks[latent] * kPageTokens;
  const int dcp = pc.decode_context_parallel_size;
  fmt::print("KV tokens per rank: {} ({} B/token)\n", grouped(tokens), grouped(spec.bytes_per_token()));
  if (dcp > 1) {
    fmt::print("KV tokens per DCP group: {} ({} ranks hold disjoint shares of each sequence; {} such group{} per "
               "DP replica hold{} copies)\n",
               grouped(tokens * dcp), dcp, pc.tensor_parallel_size / dcp, pc.tensor_parallel_size / dcp == 1 ? "" : "s",
               pc.tensor_parallel_size / dcp == 1 ? "s no" : "");
  } else {
    fmt::print("KV tokens per TP group: {} (the latent replicated on each of {} TP ranks)\n", grouped(tokens),
               pc.tensor_parallel_size);
  }
  fmt::print("KV tokens in all: {} ({} DP replica{})\n", grouped(tokens * dcp * pc.data_parallel_size),
             pc.data_parallel_size, pc.data_parallel_size == 1 ? "" : "s");
  // DSpark x DCP: the drafter's window is replicated on every DCP rank while the target's KV
  // is sharded, so a request costs (C / dcp) x B/token + the window per rank.
  const int dg = spec.group_index(CacheGroupSpec::kDrafter);
  if (dg >= 0 && dcp > 1 && o.context > 0) {
    const auto& g = spec.groups[dg];
    const int64_t window = PagedKvCache::window_blocks(g) * g.page_bytes_per_layer() * static_cast<int64_t>(g.layers.size());
    const double target = static_cast<double>(o.context) / dcp * static_cast<double>(spec.bytes_per_token());
    const double ratio = target / (target + static_cast<double>(window));
    fmt::print("DSpark x DCP {}: at a {} context a request holds {:.1f} MiB of target KV and the {:.1f} MiB drafter "
               "window on each rank: {:.0f} such requests per DCP group instead of {:.0f}, {:.2f}x of the drafter-free "
               "capacity\n",
               dcp, grouped(o.context), target / (1 << 20), static_cast<double>(window) / (1 << 20),
               std::floor(static_cast<double>(kv) / (target + static_cast<double>(window))),
               std::floor(static_cast<double>(kv) / target), ratio);
  }
  return 0;
}

int run_capacity(const CapacityOptions& o) {
  if (o.preset.empty() == o.model_dir.empty()) {
    std::fprintf(stderr, "ml4 capacity: give exactly one of --preset NAME or --model DIR\n");
    return 2;
  }
  if (o.gib < 0.0 || o.max_requests < 0) {
    std::fprintf(stderr, "ml4 capacity: --gib and --max-requests must be >= 0\n");
    return 2;
  }
  auto dtype = parse_kv_cache_dtype(o.kv_cache_dtype);
  if (!dtype.ok()) {
    std::fprintf(stderr, "ml4 capacity: %s\n", dtype.status().message().c_str());
    return 2;
  }
  auto cfg = o.preset.empty() ? load_model_config(o.model_dir) : preset_config(o.preset);
  if (!cfg.ok()) {
    std::fprintf(stderr, "ml4 capacity: %s\n", cfg.status().message().c_str());
    return 1;
  }
  auto spec = make_kv_cache_spec(*cfg, *dtype);
  if (!spec.ok()) {
    std::fprintf(stderr, "ml4 capacity: %s\n", spec.status().message().c_str());
    return 1;
  }

  fmt::print("model {} ({} layers), kv cache dtype {}, {} tokens per page\n",
             o.preset.empty() ? o.model_dir : o.preset, cfg->n_layers,
             kv_cache_dtype_name(*dtype), kPageTokens);
  fmt::print("{:<9} {:<8} {:>6} {:>14} {:>10} {:>13}\n", "group", "kind", "layers",
             "B/token/layer", "B/token", "page B/layer");
  for (const auto& g : spec->groups) {
    fmt::print("{:<9} {:<8} {:>6} {:>14} {:>10} {:>13}{}\n", g.name, kind_name(g.kind),
               g.layers.size(), grouped(g.token_bytes_per_layer), grouped(g.bytes_per_token()),
               grouped(g.page_bytes_per_layer()),
               g.full_attention() ? "" : fmt::format("  (sliding window {}, per request)", grouped(g.sliding_window)));
  }
  const int64_t per_token = spec->bytes_per_token();
  fmt::print("total: {} B/token (full-attention groups)\n", grouped(per_token));
  fmt::print("tokens per GiB: {}\n", grouped(kGiB / per_token));
  for (const auto& g : spec->groups) {
    if (g.full_attention()) continue;
    const int64_t blocks = PagedKvCache::window_blocks(g);
    fmt::print("{} per request: {} pages x {} B = {} B\n", g.name, blocks,
               grouped(g.page_bytes_per_layer() * static_cast<int64_t>(g.layers.size())),
               grouped(blocks * g.page_bytes_per_layer() * static_cast<int64_t>(g.layers.size())));
  }
  if (o.gib > 0.0) {
    const auto budget = static_cast<int64_t>(o.gib * static_cast<double>(kGiB));
    const auto blocks = PagedKvCache::blocks_for_budget(*spec, budget, o.max_requests);
    int64_t used = 0;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const auto& g = spec->groups[i];
      used += blocks[i] * g.page_bytes_per_layer() * static_cast<int64_t>(g.layers.size());
    }
    const int latent = spec->group_index(CacheGroupSpec::kLatent);
    fmt::print("budget {} GiB ({} B), {} drafter requests: {} tokens ({} pages of {}), {} B used\n",
               o.gib, grouped(budget), o.max_requests, grouped(blocks[latent] * kPageTokens),
               grouped(blocks[latent]), kPageTokens, grouped(used));
  }
  if (o.host_pool_gib > 0.0) {
    if (o.gib <= 0.0) {
      std::fprintf(stderr, "ml4 capacity: --host-pool-gib needs --gib (the device KV budget)\n");
      return 2;
    }
    if (const int rc = print_hisparse(o, *cfg, *spec); rc != 0) return rc;
  }
  if (o.parallel.parallel()) return print_parallel(o, *cfg, *spec);
  return 0;
}

CommandRegistrar reg("capacity", [](CLI::App& app, int* exit_code) {
  auto opts = std::make_shared<CapacityOptions>();
  auto* cmd = app.add_subcommand("capacity", "KV cache bytes per token and tokens per memory budget");
  cmd->add_option("--preset", opts->preset, "built-in model shape (ml4, ml4-slice-N, ml4-tiny, ...)");
  cmd->add_option("--model", opts->model_dir, "model directory (params.json or config.json)");
  cmd->add_option("--kv-cache-dtype", opts->kv_cache_dtype, "fp8_ds_mla | fp8 | bf16 | auto")
      ->capture_default_str();
  cmd->add_option("--gib", opts->gib, "memory budget for the KV cache, GiB");
  cmd->add_option("--max-requests", opts->max_requests,
                  "concurrent requests whose drafter windows the budget must also hold");
  cmd->add_option("--tensor-parallel-size", opts->parallel.tensor_parallel_size, "-tp: weights and KV per TP rank")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--data-parallel-size", opts->parallel.data_parallel_size, "-dp: DP replicas (with EP)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--enable-expert-parallel", opts->parallel.enable_expert_parallel, "routed experts over all ranks");
  add_dcp_options(cmd, &opts->parallel);
  cmd->add_option("--context", opts->context, "request context for the DSpark x DCP line of the parallel report")
      ->capture_default_str();
  cmd->add_option("--gpu-memory-gib", opts->gpu_memory_gib, "device memory per rank, GiB (parallel report)")
      ->capture_default_str();
  cmd->add_option("--gpu-memory-utilization", opts->gpu_memory_utilization, "fraction of it for weights + KV")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  cmd->add_option("--host-pool-gib", opts->host_pool_gib,
                  "HiSparse: host pool for the latent KV, GiB (with --gib as the device budget)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--hot-slots", opts->hot_slots, "HiSparse: hot rows per request and sparse layer (0: 2 x top-k)")
      ->check(CLI::NonNegativeNumber);
  cmd->callback([opts, exit_code] { *exit_code = run_capacity(*opts); });
});

}  // namespace
}  // namespace ml4::cli
