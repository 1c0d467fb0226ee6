// See parallel_runner.h.
#include "runtime/parallel_runner.h"

#include <optional>

#include "core/log.h"
#include "model/config_loader.h"
#include "parallel/wire.h"
#include "runtime/step_metadata.h"

namespace ml4 {
namespace {

enum class Command : uint64_t { kStop = 1, kExecute = 2, kExecuteTraced = 3, kDraft = 4, kRelease = 5 };

struct Header {
  uint64_t command = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(Header) == 16);

using Nested = std::vector<std::vector<std::vector<int32_t>>>;

void put_nested(WireWriter& w, const Nested& v) {
  w.put<uint64_t>(v.size());
  for (const auto& a : v) {
    w.put<uint64_t>(a.size());
    for (const auto& b : a) w.put_vec(b);
  }
}

Status get_nested(WireReader& r, Nested* v) {
  uint64_t n = 0;
  ML4_RETURN_IF_ERROR(r.get(&n));
  if (n > r.left()) return internal_error("control message: {} layers overrun it", n);
  v->assign(n, {});
  for (auto& a : *v) {
    uint64_t m = 0;
    ML4_RETURN_IF_ERROR(r.get(&m));
    if (m > r.left()) return internal_error("control message: {} rows overrun it", m);
    a.assign(m, {});
    for (auto& b : a) ML4_RETURN_IF_ERROR(r.get_vec(&b));
  }
  return ok_status();
}

// Per-cache-group block tables and an optional sampling row, as steps and draft steps carry them.
void put_tables(WireWriter& w, const std::vector<std::vector<int32_t>>& tables) {
  w.put<uint64_t>(tables.size());
  for (const auto& bt : tables) w.put_vec(bt);
}
Status get_tables(WireReader& r, std::vector<std::vector<int32_t>>* tables) {
  uint64_t g = 0;
  ML4_RETURN_IF_ERROR(r.get(&g));
  if (g > r.left()) return internal_error("control message: {} block tables overrun it", g);
  tables->assign(g, {});
  for (auto& bt : *tables) ML4_RETURN_IF_ERROR(r.get_vec(&bt));
  return ok_status();
}
void put_sampling(WireWriter& w, const std::optional<DeviceSamplingParams>& p) {
  w.put<uint8_t>(p.has_value() ? 1 : 0);
  if (p) w.put(*p);
}
Status get_sampling(WireReader& r, std::optional<DeviceSamplingParams>* p) {
  uint8_t has = 0;
  ML4_RETURN_IF_ERROR(r.get(&has));
  if (!has) return ok_status();
  DeviceSamplingParams v;
  ML4_RETURN_IF_ERROR(r.get(&v));
  *p = v;
  return ok_status();
}

// The DP rank whose blocks a sequence uses (every block of every group on one rank).
Result<int> dp_of(const SeqStep& s, int dp_size, const std::vector<int64_t>& per_rank) {
  int d = -1;
  for (size_t g = 0; g < s.block_tables.size() && g < per_rank.size(); ++g) {
    for (int32_t b : s.block_tables[g]) {
      if (b < 0) continue;
      const int db = static_cast<int>(b / per_rank[g]);
      if (db >= dp_size) return out_of_range("seq {}: block {} beyond {} DP ranks", s.seq_id, b, dp_size);
      if (d >= 0 && db != d)
        return internal_error("seq {}: its blocks span DP ranks {} and {} (the scheduler keeps a sequence on one)",
                              s.seq_id, d, db);
      d = db;
    }
  }
  if (d < 0) return invalid_argument("seq {}: no KV blocks", s.seq_id);
  return d;
}

// The forced decisions of the tokens of in.seqs[index[...]] (a DP replica's share).
ForwardTrace slice_forced(const ForwardTrace& t, const StepInput& in, const std::vector<int>& index) {
  std::vector<int64_t> first(in.seqs.size() + 1, 0);
  for (size_t i = 0; i < in.seqs.size(); ++i) first[i + 1] = first[i] + static_cast<int64_t>(in.seqs[i].tokens.size());
  auto cut = [&](const Nested& all) {
    Nested out(all.size());
    for (size_t l = 0; l < all.size(); ++l) {
      if (all[l].empty()) continue;
      for (int i : index)
        for (int64_t k = first[i]; k < first[i + 1] && k < static_cast<int64_t>(all[l].size()); ++k)
          out[l].push_back(all[l][k]);
    }
    return out;
  };
  ForwardTrace s;
  s.forced_topk = cut(t.forced_topk);
  s.forced_experts = cut(t.forced_experts);
  return s;
}

}  // namespace

std::vector<uint8_t> encode_draft(const DraftInput& in) {
  WireWriter w;
  w.put<uint64_t>(in.seqs.size());
  for (const auto& d : in.seqs) {
    w.put<int64_t>(d.seq_id);
    w.put<int32_t>(d.anchor_token);
    w.put<int64_t>(d.anchor_pos);
    put_tables(w, d.block_tables);
    w.put<int32_t>(d.num_drafts);
    put_sampling(w, d.sampling);
  }
  w.put<uint8_t>(in.want_probs ? 1 : 0);
  return std::move(w.bytes());
}

Status decode_draft(const std::vector<uint8_t>& bytes, DraftInput* in) {
  WireReader r(bytes.data(), bytes.size());
  uint64_t n = 0;
  ML4_RETURN_IF_ERROR(r.get(&n));
  if (n > r.left()) return internal_error("control message: {} draft sequences overrun it", n);
  in->seqs.assign(n, {});
  for (auto& d : in->seqs) {
    ML4_RETURN_IF_ERROR(r.get(&d.seq_id));
    ML4_RETURN_IF_ERROR(r.get(&d.anchor_token));
    ML4_RETURN_IF_ERROR(r.get(&d.anchor_pos));
    ML4_RETURN_IF_ERROR(get_tables(r, &d.block_tables));
    ML4_RETURN_IF_ERROR(r.get(&d.num_drafts));
    ML4_RETURN_IF_ERROR(get_sampling(r, &d.sampling));
  }
  uint8_t wp = 0;
  ML4_RETURN_IF_ERROR(r.get(&wp));
  in->want_probs = wp != 0;
  if (r.left() != 0) return internal_error("control message: {} bytes after the draft", r.left());
  return ok_status();
}

std::vector<uint8_t> encode_step(const StepInput& in, const ForwardTrace* forced) {
  WireWriter w;
  w.put<uint64_t>(in.seqs.size());
  for (const auto& s : in.seqs) {
    w.put<int64_t>(s.seq_id);
    w.put_vec(s.tokens);
    w.put<int64_t>(s.start_pos);
    put_tables(w, s.block_tables);
    w.put<int32_t>(s.num_logits);
    put_sampling(w, s.device_sampling);
  }
  w.put<uint8_t>(forced != nullptr ? 1 : 0);
  if (forced != nullptr) {
    put_nested(w, forced->forced_topk);
    put_nested(w, forced->forced_experts);
  }
  return std::move(w.bytes());
}

Status decode_step(const std::vector<uint8_t>& bytes, StepInput* in, ForwardTrace* forced, bool* traced) {
  WireReader r(bytes.data(), bytes.size());
  uint64_t n = 0;
  ML4_RETURN_IF_ERROR(r.get(&n));
  if (n > r.left()) return internal_error("control message: {} sequences overrun it", n);
  in->seqs.assign(n, {});
  for (auto& s : in->seqs) {
    ML4_RETURN_IF_ERROR(r.get(&s.seq_id));
    ML4_RETURN_IF_ERROR(r.get_vec(&s.tokens));
    ML4_RETURN_IF_ERROR(r.get(&s.start_pos));
    ML4_RETURN_IF_ERROR(get_tables(r, &s.block_tables));
    ML4_RETURN_IF_ERROR(r.get(&s.num_logits));
    ML4_RETURN_IF_ERROR(get_sampling(r, &s.device_sampling));
  }
  uint8_t tr = 0;
  ML4_RETURN_IF_ERROR(r.get(&tr));
  *traced = tr != 0;
  if (*traced) {
    ML4_RETURN_IF_ERROR(get_nested(r, &forced->forced_topk));
    ML4_RETURN_IF_ERROR(get_nested(r, &forced->forced_experts));
  }
  if (r.left() != 0) return internal_error("control message: {} bytes left over", r.left());
  return ok_status();
}

Result<StepInput> dp_slice(const StepInput& in, int dp, int dp_size, const std::vector<int64_t>& per_rank,
                           std::vector<int>* seq_index) {
  StepInput out;
  if (seq_index != nullptr) seq_index->clear();
  for (size_t i = 0; i < in.seqs.size(); ++i) {
    const SeqStep& s = in.seqs[i];
    int d = 0;
    if (dp_size > 1) {
      ML4_ASSIGN_OR_RETURN(d, dp_of(s, dp_size, per_rank));
    }
    if (d != dp) continue;
    SeqStep c = s;
    for (size_t g = 0; g < c.block_tables.size() && g < per_rank.size(); ++g)
      for (int32_t& b : c.block_tables[g])
        if (b >= 0) b -= static_cast<int32_t>(d * per_rank[g]);
    out.seqs.push_back(std::move(c));
    if (seq_index != nullptr) seq_index->push_back(static_cast<int>(i));
  }
  return out;
}

ParallelRunner::ParallelRunner(std::shared_ptr<ParallelGroup> group, std::unique_ptr<ModelRunner> local)
    : group_(std::move(group)), local_(std::move(local)) {
  groups_ = local_->cache_groups();
  for (auto& g : groups_) {
    g.num_blocks *= group_->layout.dp_size;
    g.partitions = group_->layout.dp_size;  // the engine keeps a sequence on one DP rank
  }
}

ParallelRunner::~ParallelRunner() {
  Status s = stop();
  if (!s.ok()) ML4_LOG_WARN("parallel runner: {}", s.message());
}

Status ParallelRunner::stop() {
  if (stopped_) return ok_status();
  stopped_ = true;
  if (group_->env->failed()) return group_->env->failure();
  Header h{static_cast<uint64_t>(Command::kStop), 0};
  ML4_RETURN_IF_ERROR(group_->world->broadcast(&h, sizeof(h), 0));
  // Every worker has the stop before rank 0 may exit (so none mistakes the exit for a death).
  float done = 0.0f;
  return group_->world->all_reduce_sum(&done, 1);
}

Result<StepOutput> ParallelRunner::execute_traced(const StepInput& in, ForwardTrace* trace) {
  if (stopped_) return internal_error("the parallel group was stopped");
  if (group_->env->failed()) return group_->env->failure();
  const int dp = group_->layout.dp_size;
  const ModelConfig& cfg = config();
  // Every rank must see a valid step: validate here, before anything is sent.
  ML4_RETURN_IF_ERROR(build_step_metadata(in, groups_, cfg.vocab_size, 0, -1, group_->plan->context_shard()).status());
  std::vector<int64_t> per_rank;
  for (const auto& g : local_->cache_groups()) per_rank.push_back(g.num_blocks);
  std::vector<StepInput> slices(dp);
  std::vector<std::vector<int>> index(dp);
  for (int d = 0; d < dp; ++d) {
    ML4_ASSIGN_OR_RETURN(slices[d], dp_slice(in, d, dp, per_rank, &index[d]));
  }
  if (trace != nullptr && group_->layout.pcp_size > 1)
    return unimplemented("traced steps under prefill context parallelism (each rank runs part of the tokens)");
  if (trace != nullptr) {
    // Forced decisions are checked on the whole step (positions in step order).
    std::vector<int64_t> positions;
    for (const auto& s : in.seqs)
      for (size_t i = 0; i < s.tokens.size(); ++i) positions.push_back(s.start_pos + static_cast<int64_t>(i));
    ML4_RETURN_IF_ERROR(validate_forced_decisions(*trace, cfg, positions));
  }
  std::vector<uint8_t> payload = encode_step(in, trace);
  Header h{static_cast<uint64_t>(trace != nullptr ? Command::kExecuteTraced : Command::kExecute), payload.size()};
  ML4_RETURN_IF_ERROR(group_->world->broadcast(&h, sizeof(h), 0));
  ML4_RETURN_IF_ERROR(group_->world->broadcast(payload.data(), static_cast<int64_t>(payload.size()), 0));
  // Rank 0 runs DP replica 0's sequences (all of them without DP). Under DP a traced step
  // records replica 0's tokens only.
  ForwardTrace mine_trace;
  if (trace != nullptr && dp > 1) mine_trace = slice_forced(*trace, in, index[0]);
  ForwardTrace* local_trace = trace == nullptr ? nullptr : dp > 1 ? &mine_trace : trace;
  ML4_ASSIGN_OR_RETURN(StepOutput mine, local_trace != nullptr ? local_->execute_traced(slices[0], local_trace)
                                                               : local_->execute(slices[0]));
  if (dp == 1) return mine;
  if (trace != nullptr) {
    trace->topk = std::move(mine_trace.topk);
    trace->experts = std::move(mine_trace.experts);
  }
  // The other replicas' leaders send their logits rows, [rows of its sequences in order, V].
  StepOutput out;
  out.logits.assign(in.seqs.size(), {});
  for (size_t i = 0; i < index[0].size(); ++i) out.logits[index[0][i]] = std::move(mine.logits[i]);
  const int64_t V = cfg.vocab_size;
  for (int d = 1; d < dp; ++d) {
    int64_t rows = 0;
    for (const auto& s : slices[d].seqs) rows += s.num_logits;
    if (rows == 0) continue;
    std::vector<float> buf(rows * V);
    ML4_RETURN_IF_ERROR(group_->world->recv(buf.data(), rows * V * static_cast<int64_t>(sizeof(float)),
                                            group_->layout.replica_leader(d)));
    int64_t row = 0;
    for (size_t i = 0; i < index[d].size(); ++i) {
      const int nl = slices[d].seqs[i].num_logits;
      out.logits[index[d][i]].assign(buf.begin() + row * V, buf.begin() + (row + nl) * V);
      row += nl;
    }
  }
  return out;
}

// The engine gave a sequence up: every rank frees its per-sequence state (HiSparse's hot
// buffers; a DP rank that never ran the sequence has none to free).
void ParallelRunner::release(int64_t seq_id) {
  local_->release(seq_id);
  // Only HiSparse keeps per-sequence state on the ranks (every rank has it or none does):
  // without it a finished request costs no collective.
  if (local_->hisparse() == nullptr || stopped_ || group_->env->failed()) return;
  Header h{static_cast<uint64_t>(Command::kRelease), sizeof(seq_id)};
  Status s = group_->world->broadcast(&h, sizeof(h), 0);
  if (s.ok()) s = group_->world->broadcast(&seq_id, sizeof(seq_id), 0);
  if (!s.ok()) ML4_LOG_WARN("parallel runner: release of seq {}: {}", seq_id, s.message());
}

// DSpark under TP / DCP (dp 1): every rank runs the draft step (its drafter heads and FFN
// slice, the TP all-reduces and the logits' all-gather); rank 0's drafts are returned.
Result<DraftOutput> ParallelRunner::draft(const DraftInput& in) {
  if (stopped_) return internal_error("the parallel group was stopped");
  if (group_->env->failed()) return group_->env->failure();
  if (!local_->has_drafter()) return unimplemented("this runner has no DSpark drafter (RunnerOptions::drafter)");
  std::vector<uint8_t> payload = encode_draft(in);
  Header h{static_cast<uint64_t>(Command::kDraft), payload.size()};
  ML4_RETURN_IF_ERROR(group_->world->broadcast(&h, sizeof(h), 0));
  ML4_RETURN_IF_ERROR(group_->world->broadcast(payload.data(), static_cast<int64_t>(payload.size()), 0));
  return local_->draft(in);
}

Result<std::unique_ptr<ModelRunner>> load_parallel_runner(const ParallelConfig& config, const std::string& model_dir,
                                                          const RunnerOptions& opts, const LocalRunnerLoader& load_local,
                                                          Status* worker_status) {
  ML4_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(model_dir));
  ML4_ASSIGN_OR_RETURN(std::unique_ptr<ParallelGroup> made, ParallelGroup::create(config, cfg));
  std::shared_ptr<ParallelGroup> group = std::move(made);
  if (opts.drafter && config.data_parallel_size > 1)
    return unimplemented("speculative decoding with data parallelism is not supported yet (TP, EP and DCP are)");
  RunnerOptions ro = opts;
  ro.plan = group->plan.get();
  ro.comms = group->comms();
  auto local = load_local(ro);
  if (!local.ok()) {
    // A rank that cannot load stops the group: the others would wait for it forever.
    group->env->fail(fmt::format("rank {} could not load its shard: {}", group->layout.world_rank,
                                 local.status().message()));
    return local.status();
  }
  if (group->is_driver()) {
    ML4_LOG_INFO("rank 0: {}", group->plan->describe());
    return std::unique_ptr<ModelRunner>(new ParallelRunner(group, std::move(local).value()));
  }
  group->env->install_worker_signal_handlers();
  *worker_status = run_parallel_worker(*group, *local.value());
  return std::unique_ptr<ModelRunner>();
}

Status run_parallel_worker(ParallelGroup& group, ModelRunner& local) {
  const RankLayout& L = group.layout;
  std::vector<int64_t> per_rank;
  for (const auto& g : local.cache_groups()) per_rank.push_back(g.num_blocks);
  const int64_t V = local.config().vocab_size;
  for (;;) {
    Header h;
    ML4_RETURN_IF_ERROR(group.world->broadcast_unbounded(&h, sizeof(h), 0));
    if (h.command == static_cast<uint64_t>(Command::kStop)) {
      float done = 0.0f;
      return group.world->all_reduce_sum(&done, 1);
    }
    if (h.command != static_cast<uint64_t>(Command::kExecute) && h.command != static_cast<uint64_t>(Command::kExecuteTraced) &&
        h.command != static_cast<uint64_t>(Command::kDraft) && h.command != static_cast<uint64_t>(Command::kRelease))
      return internal_error("rank {}: unknown command {} from rank 0", L.world_rank, h.command);
    if (h.command == static_cast<uint64_t>(Command::kRelease)) {
      if (h.bytes != sizeof(int64_t)) return internal_error("rank {}: release of {} bytes", L.world_rank, h.bytes);
      int64_t seq_id = 0;
      ML4_RETURN_IF_ERROR(group.world->broadcast(&seq_id, sizeof(seq_id), 0));
      local.release(seq_id);
      continue;
    }
    std::vector<uint8_t> payload(h.bytes);
    ML4_RETURN_IF_ERROR(group.world->broadcast(payload.data(), static_cast<int64_t>(h.bytes), 0));
    if (h.command == static_cast<uint64_t>(Command::kDraft)) {
      DraftInput din;
      ML4_RETURN_IF_ERROR(decode_draft(payload, &din));
      auto d = local.draft(din);
      if (!d.ok()) return d.status().with_context(fmt::format("rank {}: draft", L.world_rank));
      continue;
    }
    StepInput in;
    ForwardTrace trace;
    bool traced = false;
    ML4_RETURN_IF_ERROR(decode_step(payload, &in, &trace, &traced));
    std::vector<int> index;
    ML4_ASSIGN_OR_RETURN(StepInput mine, dp_slice(in, L.dp_rank, L.dp_size, per_rank, &index));
    if (traced && L.dp_size > 1) trace = slice_forced(trace, in, index);
    auto out = traced ? local.execute_traced(mine, &trace) : local.execute(mine);
    if (!out.ok()) return out.status().with_context(fmt::format("rank {}: step", L.world_rank));
    // A DP replica's leader answers for it (rank 0 is replica 0's).
    if (L.dp_rank > 0 && L.tp_rank == 0 && L.pcp_rank == 0) {
      std::vector<float> rows;
      for (const auto& l : out->logits) rows.insert(rows.end(), l.begin(), l.end());
      if (!rows.empty()) {
        if (static_cast<int64_t>(rows.size()) % V != 0) return internal_error("rank {}: ragged logits", L.world_rank);
        ML4_RETURN_IF_ERROR(group.world->send(rows.data(), static_cast<int64_t>(rows.size() * sizeof(float)), 0));
      }
    }
  }
}

}  // namespace ml4
