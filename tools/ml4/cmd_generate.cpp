// `ml4 generate`: one prompt through the CPU runner, token by token over the paged cache.
//
// The prompt is prefilled in one step, then each new token is one decode step reading
// the cache (no recomputation). Sampling is the engine's Sampler (greedy with
// --temperature 0, else temperature / top-p / top-k from a seeded generator).
// With --speculative-config (DSpark, engine/spec_decode.h) the prompt runs through the Engine
// instead, which verifies a block of drafts per step; greedy output is the same token for
// token, and the acceptance figures are printed after the timings.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "command.h"
#include "device_options.h"
#include "core/log.h"
#include "engine/engine.h"
#include "engine/request.h"
#include "engine/sampler.h"
#include "hisparse_options.h"
#include "spec_options.h"
#include "runtime/cpu/cpu_runner.h"
#include "tokenizer/tokenizer.h"

namespace ml4::cli {
namespace {

struct GenerateOptions {
  std::string model;
  std::string prompt;
  std::string prompt_ids;
  int max_tokens = 32;
  double temperature = 0.0;
  double top_p = 1.0;
  int top_k = 0;
  uint64_t seed = 0;
  std::string kv_cache_dtype = "fp8_ds_mla";
  bool ignore_eos = false;
  DeviceOptions dev;
  std::string speculative_config;
  std::string kv_transfer_config;  // HiSparse only (hisparse_options.h)
};

Result<std::vector<int32_t>> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      if (used != item.size() && item.find_first_not_of(' ', used) != std::string::npos) throw std::invalid_argument(item);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      return invalid_argument("--prompt-ids: '{}' is not an integer", item);
    }
  }
  if (ids.empty()) return invalid_argument("--prompt-ids is empty");
  return ids;
}

// The same generation through the Engine, with speculative decoding.
Status run_generate_engine(const GenerateOptions& o, ModelRunner* runner, const SpeculativeConfig& spec,
                           const std::vector<int32_t>& prompt) {
  const ModelConfig& cfg = runner->config();
  ML4_ASSIGN_OR_RETURN(std::unique_ptr<TextCodec> codec, make_text_codec(o.model, cfg.vocab_size));
  EngineConfig ec;
  ec.scheduler.max_num_seqs = 1;
  ec.scheduler.max_num_batched_tokens = std::max<int64_t>(2048, static_cast<int64_t>(prompt.size()));
  ec.scheduler.max_model_len = static_cast<int64_t>(prompt.size()) + o.max_tokens;
  ec.enable_prefix_caching = false;
  ec.speculative = spec;
  ML4_RETURN_IF_ERROR(Engine::check_speculation(*runner, ec));
  Engine engine(runner, codec.get(), ec);
  SamplingParams p;
  p.temperature = o.temperature;
  p.top_p = o.top_p;
  p.top_k = o.top_k;
  p.max_tokens = o.max_tokens;
  p.ignore_eos = o.ignore_eos;
  p.seed = o.seed;
  p.skip_special_tokens = true;
  ML4_RETURN_IF_ERROR(engine.add_request("generate", prompt, p));
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  double first = 0.0;
  std::vector<int32_t> generated;
  while (engine.has_work()) {
    ML4_ASSIGN_OR_RETURN(auto outs, engine.step());
    for (const auto& out : outs) {
      if (generated.empty() && !out.new_tokens.empty()) first = std::chrono::duration<double>(clock::now() - t0).count();
      generated.insert(generated.end(), out.new_tokens.begin(), out.new_tokens.end());
      std::fputs(out.new_text.c_str(), stdout);
      std::fflush(stdout);
    }
  }
  const double total = std::chrono::duration<double>(clock::now() - t0).count();
  std::printf("\n");
  std::string ids;
  for (auto id : generated) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  std::printf("ids: %s\n", ids.c_str());
  const size_t decoded = generated.size() > 0 ? generated.size() - 1 : 0;
  std::printf("prefill: %zu tokens in %.3f s (%.1f tok/s); decode: %zu tokens in %.3f s (%.2f tok/s)\n", prompt.size(),
              first, prompt.size() / first, decoded, total - first, decoded > 0 ? decoded / (total - first) : 0.0);
  const EngineCounters c = engine.counters();
  const SpecDecodeCounters& s = c.spec;
  std::printf("speculative: %ld drafts, %ld draft tokens, %ld accepted (acceptance rate %.3f, mean acceptance length "
              "%.2f); per position:",
              static_cast<long>(s.num_drafts), static_cast<long>(s.num_draft_tokens),
              static_cast<long>(s.num_accepted_tokens),
              s.num_draft_tokens > 0 ? static_cast<double>(s.num_accepted_tokens) / s.num_draft_tokens : 0.0,
              s.num_drafts > 0 ? 1.0 + static_cast<double>(s.num_accepted_tokens) / s.num_drafts : 1.0);
  for (int64_t a : s.accepted_per_pos) std::printf(" %.3f", s.num_drafts > 0 ? static_cast<double>(a) / s.num_drafts : 0.0);
  std::printf("\nengine: %ld steps, %ld tokens fed to the target in %.3f s, drafter %.3f s, rest %.3f s\n",
              static_cast<long>(c.steps), static_cast<long>(c.batched_tokens), c.forward_seconds, c.draft_seconds,
              c.step_seconds - c.forward_seconds - c.draft_seconds);
  return ok_status();
}

Status run_generate(const GenerateOptions& o) {
  RunnerOptions ro;
  ro.kv_cache_dtype = o.kv_cache_dtype;
  ML4_ASSIGN_OR_RETURN(SpeculativeConfig spec, speculative_runner_options(o.speculative_config, o.model, 1, &ro));
  ML4_ASSIGN_OR_RETURN(const bool hisparse, hisparse_runner_options(o.kv_transfer_config, 1, &ro));
  if (!o.kv_transfer_config.empty() && !hisparse)
    return invalid_argument("--kv-transfer-config: generate takes only the HiSparseConnector (P/D is for serve)");
  ML4_ASSIGN_OR_RETURN(auto runner, load_runner_on(o.dev, o.model, ro));
  const ModelConfig& cfg = runner->config();
  std::shared_ptr<const Tokenizer> tok;
  const std::string tok_path = o.model + "/tekken.json";
  if (std::filesystem::exists(tok_path)) {
    ML4_ASSIGN_OR_RETURN(tok, Tokenizer::load(tok_path));
  }
  std::vector<int32_t> prompt;
  if (!o.prompt_ids.empty()) {
    ML4_ASSIGN_OR_RETURN(prompt, parse_ids(o.prompt_ids));
  } else {
    if (!tok) return invalid_argument("{} has no tekken.json: pass --prompt-ids", o.model);
    prompt.push_back(tok->bos_id());
    auto body = tok->encode(o.prompt);
    prompt.insert(prompt.end(), body.begin(), body.end());
  }
  if (spec.enabled()) return run_generate_engine(o, runner.get(), spec, prompt);
  const int64_t total = static_cast<int64_t>(prompt.size()) + o.max_tokens;
  const auto& groups = runner->cache_groups();
  SeqStep step;
  step.seq_id = 1;
  step.block_tables.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].sliding_window != 0) continue;
    const int64_t need = (total + groups[g].page_tokens - 1) / groups[g].page_tokens;
    if (need > groups[g].num_blocks)
      return resource_exhausted("{} tokens need {} blocks of group {}, the cache has {}", total, need, groups[g].name,
                                groups[g].num_blocks);
    for (int64_t b = 0; b < need; ++b) step.block_tables[g].push_back(static_cast<int32_t>(b));
  }
  Request req;
  req.prompt = prompt;
  req.params.temperature = o.temperature;
  req.params.top_p = o.top_p;
  req.params.top_k = o.top_k;
  req.params.max_tokens = o.max_tokens;
  req.params.ignore_eos = o.ignore_eos;
  ML4_RETURN_IF_ERROR(req.params.validate(cfg.vocab_size));
  req.rng.seed(o.seed);
  const int32_t eos = tok ? tok->eos_id() : -1;

  using clock = std::chrono::steady_clock;
  step.tokens = prompt;
  step.start_pos = 0;
  auto t0 = clock::now();
  ML4_ASSIGN_OR_RETURN(StepOutput out, runner->execute(StepInput{{step}}));
  auto t1 = clock::now();
  std::unique_ptr<StreamDecoder> dec;
  if (tok) dec = std::make_unique<StreamDecoder>(tok);
  std::vector<int32_t> generated;
  double decode_s = 0.0;
  for (int i = 0; i < o.max_tokens; ++i) {
    int32_t next = Sampler::sample(req, out.logits[0].data(), cfg.vocab_size, eos);
    req.output.push_back(next);
    req.output_counts[next]++;
    generated.push_back(next);
    if (dec) {
      std::fputs(dec->push(next).c_str(), stdout);
      std::fflush(stdout);
    }
    if (next == eos && !o.ignore_eos) break;
    if (i + 1 == o.max_tokens) break;
    step.start_pos += static_cast<int64_t>(step.tokens.size());
    step.tokens = {next};
    auto d0 = clock::now();
    ML4_ASSIGN_OR_RETURN(out, runner->execute(StepInput{{step}}));
    decode_s += std::chrono::duration<double>(clock::now() - d0).count();
  }
  if (dec) std::fputs(dec->flush().c_str(), stdout);
  std::printf("\n");
  std::string ids;
  for (auto id : generated) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  std::printf("ids: %s\n", ids.c_str());
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const size_t decoded = generated.size() > 0 ? generated.size() - 1 : 0;
  std::printf("prefill: %zu tokens in %.3f s (%.1f tok/s); decode: %zu tokens in %.3f s (%.2f tok/s)\n", prompt.size(),
              prefill_s, prompt.size() / prefill_s, decoded, decode_s, decoded > 0 ? decoded / decode_s : 0.0);
  return ok_status();
}

CommandRegistrar reg("generate", [](CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("generate", "generate from a prompt on the CPU backend");
  auto o = std::make_shared<GenerateOptions>();
  cmd->add_option("--model", o->model, "model directory")->required();
  cmd->add_option("--prompt", o->prompt, "prompt text (tokenized with the model's tekken.json, BOS prepended)");
  cmd->add_option("--prompt-ids", o->prompt_ids, "prompt token ids, comma separated");
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to generate");
  cmd->add_option("--temperature", o->temperature, "0: greedy");
  cmd->add_option("--top-p", o->top_p, "nucleus sampling");
  cmd->add_option("--top-k", o->top_k, "top-k sampling (0: off)");
  cmd->add_option("--seed", o->seed, "sampling seed");
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "fp8_ds_mla, fp8 or bf16");
  add_device_options(cmd, &o->dev);
  cmd->add_flag("--ignore-eos", o->ignore_eos, "keep generating after EOS");
  cmd->add_option("--speculative-config", o->speculative_config,
                  "DSpark speculative decoding: JSON, e.g. '{\"method\":\"dspark\",\"num_speculative_tokens\":7}'");
  cmd->add_option("--kv-transfer-config", o->kv_transfer_config,
                  "HiSparse host KV offload: '{\"kv_connector\":\"HiSparseConnector\",\"kv_connector_extra_config\":"
                  "{\"host_pool_gb\":G,\"hot_slots_per_request\":S}}'");
  cmd->callback([o, exit_code] {
    if (o->prompt.empty() == o->prompt_ids.empty()) {
      ML4_LOG_ERROR("generate: give exactly one of --prompt and --prompt-ids");
      *exit_code = 2;
      return;
    }
    Status s = run_generate(*o);
    if (!s.ok()) {
      ML4_LOG_ERROR("generate: {}", s.message());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace ml4::cli
