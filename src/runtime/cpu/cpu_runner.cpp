#include "runtime/cpu/cpu_runner.h"

#include <algorithm>

#include "core/log.h"
#include "kv/kv_cache_dtype.h"
#include "model/config_loader.h"
#include "model/model_weights.h"
#include "model/weight_memory.h"
#include "runtime/pcp_split.h"

namespace ml4 {

Result<std::unique_ptr<CpuRunner>> CpuRunner::load(const std::string& model_dir, const RunnerOptions& opts,
                                                   bool duplicate_shared_kv) {
  ML4_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(model_dir));
  ML4_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::open(model_dir));
  auto ckpt = std::make_shared<Checkpoint>(std::move(ck));
  WeightLoadOptions wo;
  wo.experts_to_mxfp4 = opts.experts_to_mxfp4;
  wo.load_drafter = opts.drafter;
  if (opts.plan != nullptr) wo.shard = &opts.plan->shard();  // a parallel rank reads its shard only
  wo.copy_linears = opts.weight_memory == WeightMemory::kCopy ||
                    (opts.weight_memory == WeightMemory::kAuto && copy_pays_off(*ckpt));
  WeightCopyReport copied;
  wo.copy_report = &copied;
  ML4_ASSIGN_OR_RETURN(auto weights, load_model_weights(cfg, *ckpt, wo));
  if (wo.copy_linears) {
    for (const auto& f : ckpt->files()) f->drop_resident_pages();  // the copy is what runs
    ML4_LOG_INFO("cpu runner: {:.2f} GB of linear weights in memory ({} tensors, huge pages {}, {:.2f} s)",
                 copied.bytes / 1e9, copied.tensors, copied.huge_pages ? "advised" : "refused", copied.seconds);
  }
  ML4_ASSIGN_OR_RETURN(auto r, create(opts.plan != nullptr ? opts.plan->local_config() : cfg, weights, opts,
                                      duplicate_shared_kv));
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
  const int64_t windows = opts.drafter ? std::max<int64_t>(opts.max_num_seqs, 1) : 0;
  std::vector<int64_t> blocks = PagedKvCache::blocks_for_budget(spec, opts.kv_cache_bytes, windows);
  if (opts.hisparse.enabled) {
    ML4_ASSIGN_OR_RETURN(HiSparseSizing hs, hisparse_sizing(cfg, spec, opts.hisparse, opts.kv_cache_bytes, opts.max_num_seqs, opts.drafter));
    blocks = hs.blocks;
    r->hisparse_ = std::make_unique<HiSparseState>(hs.layers, hs.regions, hs.slots);
  }
  ML4_ASSIGN_OR_RETURN(PagedKvCache cache, PagedKvCache::create(spec, blocks));
  r->cache_ = std::make_unique<PagedKvCache>(std::move(cache));
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const auto& sg = spec.groups[g];
    r->groups_.push_back(CacheGroupInfo{sg.name, sg.page_tokens, blocks[g], sg.sliding_window, sg.bytes_per_token()});
  }
  if (opts.plan != nullptr) {
    r->shard_ = opts.plan->context_shard();
    r->pcp_size_ = opts.plan->layout().pcp_size;
    r->pcp_rank_ = opts.plan->layout().pcp_rank;
  }
  ML4_RETURN_IF_ERROR(shard_cache_groups(spec, r->shard_, &r->groups_));
  r->backend_ = std::make_unique<CpuBackend>(cfg, weights, r->cache_.get());
  ML4_ASSIGN_OR_RETURN(cpu::ActivationDtype act, cpu::parse_activation_dtype(opts.dtype));
  ML4_RETURN_IF_ERROR(r->backend_->set_activation_dtype(act));
  ModelForward::Options fo;
  fo.duplicate_shared_kv = duplicate_shared_kv;
  fo.drafter = opts.drafter;
  fo.plan = opts.plan;
  fo.comms = opts.comms;
  fo.hisparse = r->hisparse_.get();
  ML4_ASSIGN_OR_RETURN(r->program_, ModelForward::create(cfg, *weights, *r->backend_, fo));
  return r;
}

Result<StepOutput> CpuRunner::execute(const StepInput& in) { return execute_traced(in, nullptr); }

Result<StepOutput> CpuRunner::execute_traced(const StepInput& in, ForwardTrace* trace) {
  const ModelConfig& cfg = config();
  ML4_ASSIGN_OR_RETURN(StepMetadata md, build_step_metadata(in, groups_, cfg.vocab_size, max_model_len_, -1, shard_));
  StepOutput out;
  if (pcp_size_ > 1) {
    // This rank's share of the tokens; every rank writes the whole step's K/V (pcp_split.h).
    const StepMetadata mine = pcp_step_metadata(md, pcp_size_, pcp_rank_);
    backend_->begin_step(mine, &md);
    ML4_RETURN_IF_ERROR(program_->forward(&mine, trace));
    if (mine.logits_rows.size() != md.logits_rows.size()) return out;  // rank 0 holds every logits row
  } else {
    backend_->begin_step(md);
    ML4_RETURN_IF_ERROR(program_->forward(&md, trace));
  }
  const int64_t V = cfg.vocab_size;
  const float* logits = backend_->acts().logits;
  size_t row = 0;
  for (const auto& s : in.seqs) {
    out.logits.emplace_back(logits + row * V, logits + (row + s.num_logits) * V);
    row += s.num_logits;
  }
  return out;
}

// One block of B tokens per sequence: the anchor, then placeholders (their rows are the mask
// embeddings) at the next positions; logits rows: slots 1..B-1 (ModelForward::draft).
Result<DraftOutput> CpuRunner::draft(const DraftInput& in) {
  if (!program_->has_drafter()) return unimplemented("this runner has no DSpark drafter (RunnerOptions::drafter)");
  const ModelConfig& cfg = config();
  const int B = cfg.drafter.block_size;
  const int64_t V = cfg.vocab_size;
  const int dg = spec_.group_index(CacheGroupSpec::kDrafter);
  StepInput step;
  for (const auto& d : in.seqs) {
    if (d.num_drafts < 1 || d.num_drafts > B - 1)
      return invalid_argument("draft seq {}: num_drafts {} outside [1, {}]", d.seq_id, d.num_drafts, B - 1);
    SeqStep s;
    s.seq_id = d.seq_id;
    s.tokens.assign(B, 0);
    s.tokens[0] = d.anchor_token;
    s.start_pos = d.anchor_pos;
    s.block_tables = d.block_tables;
    s.num_logits = B - 1;
    step.seqs.push_back(std::move(s));
  }
  ML4_ASSIGN_OR_RETURN(StepMetadata md, build_step_metadata(step, groups_, cfg.vocab_size, 0, dg, shard_));
  backend_->begin_step(md);
  const int64_t n = static_cast<int64_t>(in.seqs.size());
  const Activations& x = backend_->acts();
  for (int64_t i = 0; i < n; ++i) x.draft_ids[i] = in.seqs[i].anchor_token;
  std::vector<DeviceSamplingParams> params;
  bool any_sampled = false;
  for (const auto& d : in.seqs) any_sampled |= d.sampling.has_value();
  if (any_sampled) {
    params.resize((B - 1) * n);
    for (int j = 0; j < B - 1; ++j)
      for (int64_t i = 0; i < n; ++i) {
        DeviceSamplingParams p;
        p.temperature = 0.0f;
        if (in.seqs[i].sampling) {
          p = *in.seqs[i].sampling;
          p.counter += j;
        }
        params[j * n + i] = p;
      }
  }
  int slots = 1;
  for (const auto& d : in.seqs) slots = std::max(slots, d.num_drafts);
  ML4_RETURN_IF_ERROR(program_->draft(any_sampled ? params.data() : nullptr, in.want_probs, slots));
  DraftOutput out;
  for (int64_t i = 0; i < n; ++i) {
    const int k = in.seqs[i].num_drafts;
    std::vector<int32_t> toks(k);
    for (int j = 0; j < k; ++j) toks[j] = x.draft_ids[(j + 1) * n + i];
    out.tokens.push_back(std::move(toks));
    if (in.want_probs) {
      std::vector<float> q(k * V);
      for (int j = 0; j < k; ++j) std::copy_n(x.draft_probs + (j * n + i) * V, V, q.begin() + j * V);
      out.probs.push_back(std::move(q));
    }
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
