#include "runtime/cpu/cpu_runner.h"

#include "core/log.h"
#include "kv/kv_cache_dtype.h"
#include "model/config_loader.h"
#include "model/model_weights.h"

namespace ml4 {

Result<std::unique_ptr<CpuRunner>> CpuRunner::load(const std::string& model_dir, const RunnerOptions& opts,
                                                   bool duplicate_shared_kv) {
  ML4_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(model_dir));
  ML4_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::open(model_dir));
  auto ckpt = std::make_shared<Checkpoint>(std::move(ck));
  WeightLoadOptions wo;
  wo.experts_to_mxfp4 = opts.experts_to_mxfp4;
  ML4_ASSIGN_OR_RETURN(auto weights, load_model_weights(cfg, *ckpt, wo));
  ML4_ASSIGN_OR_RETURN(auto r, create(cfg, weights, opts, duplicate_shared_kv));
  r->ckpt_ = ckpt;
  ML4_LOG_DEBUG("cpu runner: {} ({} layers), kv {} : {} B/token, {} blocks of {} tokens", model_dir, cfg.n_layers,
                opts.kv_cache_dtype, r->spec_.bytes_per_token(), r->groups_.empty() ? 0 : r->groups_[0].num_blocks,
                kPageTokens);
  return r;
}

Result<std::unique_ptr<CpuRunner>> CpuRunner::create(const ModelConfig& cfg, std::shared_ptr<const ModelWeights> weights,
                                                     const RunnerOptions& opts, bool duplicate_shared_kv) {
  ML4_ASSIGN_OR_RETURN(KvCacheDtype dtype, parse_kv_cache_dtype(opts.kv_cache_dtype));
  ML4_ASSIGN_OR_RETURN(KvCacheSpec spec, make_kv_cache_spec(cfg, dtype));
  if (duplicate_shared_kv) {
    const int g = spec.group_index(CacheGroupSpec::kLatent);
    for (const auto& l : cfg.layers)
      if (!l.owns_kv()) spec.groups[g].layers.push_back(l.index);  // slots num_latent_layers + k
  }
  auto r = std::unique_ptr<CpuRunner>(new CpuRunner());
  r->spec_ = spec;
  r->max_model_len_ = opts.max_model_len > 0 ? opts.max_model_len : cfg.max_position_embeddings;
  std::vector<int64_t> blocks = PagedKvCache::blocks_for_budget(spec, opts.kv_cache_bytes);
  ML4_ASSIGN_OR_RETURN(PagedKvCache cache, PagedKvCache::create(spec, blocks));
  r->cache_ = std::make_unique<PagedKvCache>(std::move(cache));
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const auto& sg = spec.groups[g];
    r->groups_.push_back(CacheGroupInfo{sg.name, sg.page_tokens, blocks[g], sg.sliding_window, sg.bytes_per_token()});
  }
  r->backend_ = std::make_unique<CpuBackend>(cfg, weights, r->cache_.get());
  ModelForward::Options fo;
  fo.duplicate_shared_kv = duplicate_shared_kv;
  ML4_ASSIGN_OR_RETURN(r->program_, ModelForward::create(cfg, *weights, *r->backend_, fo));
  return r;
}

Result<StepOutput> CpuRunner::execute(const StepInput& in) { return execute_traced(in, nullptr); }

Result<StepOutput> CpuRunner::execute_traced(const StepInput& in, ForwardTrace* trace) {
  const ModelConfig& cfg = config();
  ML4_ASSIGN_OR_RETURN(StepMetadata md, build_step_metadata(in, groups_, cfg.vocab_size, max_model_len_));
  backend_->begin_step(md);
  ML4_RETURN_IF_ERROR(program_->forward(&md, trace));
  StepOutput out;
  const int64_t V = cfg.vocab_size;
  const float* logits = backend_->acts().logits;
  size_t row = 0;
  for (const auto& s : in.seqs) {
    out.logits.emplace_back(logits + row * V, logits + (row + s.num_logits) * V);
    row += s.num_logits;
  }
  return out;
}

std::vector<KvRegion> CpuRunner::kv_regions() {
  std::vector<KvRegion> out;
  for (int g = 0; g < cache_->num_groups(); ++g) {
    const auto& sg = spec_.groups[g];
    if (cache_->num_blocks(g) <= 0) continue;
    for (int slot = 0; slot < static_cast<int>(sg.layers.size()); ++slot)
      out.push_back(KvRegion{g, slot, cache_->page(g, slot, 0), sg.page_bytes_per_layer(), cache_->num_blocks(g), false});
  }
  return out;
}

Result<std::unique_ptr<ModelRunner>> load_cpu_runner(const std::string& model_dir, const RunnerOptions& opts) {
  ML4_ASSIGN_OR_RETURN(auto r, CpuRunner::load(model_dir, opts));
  return std::unique_ptr<ModelRunner>(std::move(r));
}

}  // namespace ml4
