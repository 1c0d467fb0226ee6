// `ml4 perplexity`: perplexity of a model over a text file, as llama.cpp's llama-perplexity
// reports it (tokens, mean NLL, perplexity with its standard error, and bits per byte), on
// the CPU or CUDA runner through the public ModelRunner interface.
//
// The file is tokenized once with the model's tekken.json (no BOS) and cut into chunks of
// --ctx tokens: <s> then ctx-1 text tokens, as tools/train/train.py's evaluation does, so
// PyTorch and ml4 score exactly the same tokens. Each chunk is one sequence prefilled in
// pieces of --batch tokens over the paged cache (chunked prefill, logits for every row); row i
// scores token i+1. Every text token of a chunk is scored, except its first --first ones
// (llama-perplexity scores only the second half, i.e. --first ctx/2; the default 0 scores all,
// which is what train.py and the model card report). NLL is accumulated in double from f32
// logits (log-sum-exp per row). Bits per byte = sum NLL / ln 2 / the UTF-8 bytes of the
// scored tokens (their token bytes, so a split character counts once).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "command.h"
#include "device_options.h"
#include "core/log.h"
#include "tokenizer/tokenizer.h"

namespace ml4::cli {
namespace {

struct PerplexityOptions {
  std::string model, file;
  int ctx = 512;
  int chunks = -1;
  int batch = 512;
  int first = 0;
  std::string kv_cache_dtype = "fp8_ds_mla";
  bool json = false;
  bool progress = true;
  DeviceOptions dev;
};

struct ChunkScore {
  double nll = 0.0;
  double nll2 = 0.0;  // sum of squared per-token NLL (standard error)
  int64_t tokens = 0;
  int64_t bytes = 0;
};

// log-sum-exp of one row of logits, in double.
double log_sum_exp(const float* row, int n) {
  float mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = std::max(mx, row[i]);
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(row[i]) - mx);
  return mx + std::log(s);
}

void draw_progress(int done, int total, double ppl, double secs) {
  const int width = 30;
  const int fill = total > 0 ? done * width / total : width;
  std::fprintf(stderr, "\r[%.*s%.*s] %d/%d chunks  ppl %.4f  %.1f s", fill, "==============================",
               width - fill, "                              ", done, total, ppl, secs);
  if (done == total) std::fputc('\n', stderr);
  std::fflush(stderr);
}

Status run_perplexity(const PerplexityOptions& o) {
  if (o.ctx < 2) return invalid_argument("--ctx {} must be at least 2", o.ctx);
  if (o.batch < 1) return invalid_argument("--batch {} must be positive", o.batch);
  if (o.first < 0 || o.first >= o.ctx - 1) return invalid_argument("--first {} must be in [0, ctx-1)", o.first);
  const std::string tok_path = o.model + "/tekken.json";
  if (!std::filesystem::exists(tok_path)) return invalid_argument("{} has no tekken.json", o.model);
  ML4_ASSIGN_OR_RETURN(auto tok, Tokenizer::load(tok_path));
  std::ifstream f(o.file, std::ios::binary);
  if (!f) return not_found("cannot open --file {}", o.file);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::vector<int32_t> ids = tok->encode(ss.str());
  const int64_t per_chunk = o.ctx - 1;
  int64_t n_chunks = static_cast<int64_t>(ids.size()) / per_chunk;
  if (o.chunks >= 0) n_chunks = std::min<int64_t>(n_chunks, o.chunks);
  if (n_chunks == 0)
    return invalid_argument("{}: {} tokens, fewer than one chunk of --ctx {} (<s> + {} tokens)", o.file, ids.size(),
                            o.ctx, per_chunk);

  RunnerOptions ro;
  ro.kv_cache_dtype = o.kv_cache_dtype;
  ro.max_model_len = o.ctx;
  ML4_ASSIGN_OR_RETURN(auto runner, load_runner_on(o.dev, o.model, ro));
  const ModelConfig& cfg = runner->config();
  if (o.ctx > cfg.max_position_embeddings)
    return invalid_argument("--ctx {} exceeds the model's max_position_embeddings {}", o.ctx,
                            cfg.max_position_embeddings);
  if (tok->vocab_size() != cfg.vocab_size)
    return invalid_argument("{}: tekken.json has {} ids, params.json vocab_size {}", o.model, tok->vocab_size(),
                            cfg.vocab_size);
  const int V = cfg.vocab_size;
  const auto& groups = runner->cache_groups();
  std::vector<std::vector<int32_t>> tables(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].sliding_window != 0) continue;  // the drafter's window group: no target layer reads it
    const int64_t need = (o.ctx + groups[g].page_tokens - 1) / groups[g].page_tokens;
    if (need > groups[g].num_blocks)
      return resource_exhausted("--ctx {} needs {} blocks of cache group {}, the cache has {}", o.ctx, need,
                                groups[g].name, groups[g].num_blocks);
    for (int64_t b = 0; b < need; ++b) tables[g].push_back(static_cast<int32_t>(b));
  }
  if (!o.json)
    std::fprintf(stderr, "perplexity: %s, %zu tokens in %s, %lld chunks of %d (<s> + %lld), device %s, kv %s\n",
                 o.model.c_str(), ids.size(), o.file.c_str(), static_cast<long long>(n_chunks), o.ctx,
                 static_cast<long long>(per_chunk), o.dev.device.c_str(), o.kv_cache_dtype.c_str());
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  ChunkScore total;
  std::string running;
  for (int64_t c = 0; c < n_chunks; ++c) {
    std::vector<int32_t> chunk;
    chunk.reserve(o.ctx);
    chunk.push_back(tok->bos_id());
    chunk.insert(chunk.end(), ids.begin() + c * per_chunk, ids.begin() + (c + 1) * per_chunk);
    SeqStep step;
    step.seq_id = c + 1;
    step.block_tables = tables;
    for (int64_t pos = 0; pos < o.ctx; pos += o.batch) {
      const int64_t n = std::min<int64_t>(o.batch, o.ctx - pos);
      step.tokens.assign(chunk.begin() + pos, chunk.begin() + pos + n);
      step.start_pos = pos;
      step.num_logits = static_cast<int>(n);
      ML4_ASSIGN_OR_RETURN(StepOutput out, runner->execute(StepInput{{step}}));
      if (out.logits.size() != 1 || out.logits[0].size() != static_cast<size_t>(n) * V)
        return internal_error("runner returned {} logit rows, expected {}", out.logits.empty() ? 0 : out.logits[0].size() / V,
                              n);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t target = pos + i + 1;  // the token row pos+i predicts
        if (target >= o.ctx || target <= o.first) continue;
        const float* row = out.logits[0].data() + i * V;
        const double nll = log_sum_exp(row, V) - row[chunk[target]];
        if (!std::isfinite(nll)) return internal_error("chunk {} token {}: non-finite NLL {}", c, target, nll);
        total.nll += nll;
        total.nll2 += nll * nll;
        total.tokens += 1;
        total.bytes += static_cast<int64_t>(tok->token_bytes(chunk[target]).size());
      }
    }
    const double ppl = std::exp(total.nll / total.tokens);
    running += fmt::format("[{}]{:.4f},", c + 1, ppl);
    if (o.progress && !o.json)
      draw_progress(static_cast<int>(c + 1), static_cast<int>(n_chunks), ppl,
                    std::chrono::duration<double>(clock::now() - t0).count());
  }
  const double secs = std::chrono::duration<double>(clock::now() - t0).count();
  const double mean = total.nll / total.tokens;
  const double var = std::max(0.0, total.nll2 / total.tokens - mean * mean);
  const double se = std::sqrt(var / std::max<int64_t>(1, total.tokens - 1));
  const double ppl = std::exp(mean);
  const double bpb = total.nll / std::log(2.0) / static_cast<double>(std::max<int64_t>(1, total.bytes));
  if (o.json) {
    std::printf("{\"file\": \"%s\", \"device\": \"%s\", \"kv_cache_dtype\": \"%s\", \"ctx\": %d, \"chunks\": %lld, "
                "\"tokens\": %lld, \"bytes\": %lld, \"mean_nll\": %.9f, \"nll_stderr\": %.9f, \"ppl\": %.6f, "
                "\"bits_per_byte\": %.6f, \"seconds\": %.3f}\n",
                o.file.c_str(), o.dev.device.c_str(), o.kv_cache_dtype.c_str(), o.ctx,
                static_cast<long long>(n_chunks), static_cast<long long>(total.tokens),
                static_cast<long long>(total.bytes), mean, se, ppl, bpb, secs);
  } else {
    if (!running.empty()) running.pop_back();
    std::printf("%s\n", running.c_str());
    std::printf("tokens %lld, mean NLL %.6f, perplexity %.4f +/- %.4f, bits per byte %.4f (%.1f s, %.0f tok/s)\n",
                static_cast<long long>(total.tokens), mean, ppl, ppl * se, bpb, secs, n_chunks * o.ctx / secs);
  }
  return ok_status();
}

CommandRegistrar reg("perplexity", [](CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("perplexity", "perplexity of a model over a text file (as llama-perplexity)");
  auto o = std::make_shared<PerplexityOptions>();
  cmd->add_option("--model,-m", o->model, "model directory (with tekken.json)")->required();
  cmd->add_option("--file,-f", o->file, "UTF-8 text file")->required();
  cmd->add_option("--ctx,-c", o->ctx, "tokens per chunk, <s> included (llama-perplexity -c)")->capture_default_str();
  cmd->add_option("--chunks", o->chunks, "score at most this many chunks (-1: all)")->capture_default_str();
  cmd->add_option("--batch,-b", o->batch, "prefill step size in tokens")->capture_default_str();
  cmd->add_option("--first", o->first, "leading text tokens of each chunk not scored (llama.cpp: ctx/2)")
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "fp8_ds_mla, fp8 or bf16")->capture_default_str();
  cmd->add_flag("--json", o->json, "print one JSON object instead of the text report");
  cmd->add_flag("!--no-progress", o->progress, "no progress bar on stderr");
  add_device_options(cmd, &o->dev);
  cmd->callback([o, exit_code] {
    Status s = run_perplexity(*o);
    if (!s.ok()) {
      ML4_LOG_ERROR("perplexity: {}", s.message());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace ml4::cli
