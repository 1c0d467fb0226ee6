// Where a DSpark step's time goes on the CUDA runner (issue 13): one sequence, a prompt
// prefilled, then (a) plain decode steps (1 token, device sampling: what `plain` serving runs),
// (b) verification steps (the last token + B - 1 drafts, B logits rows back to the host) and
// (c) draft steps (CudaRunner::draft, greedy, and probabilistic at T = 1 with q back to the
//     host), each timed alone: wall ms of the runner call,
// median of 30 after 5, and whether the step replayed a CUDA graph; and (d) a random request's
// whole cycle at T = 1, a probabilistic draft then the verification of its drafts, with q and
// the rows to the host and verify_drafts there (`random_cycle_host`), or q kept on the device
// and verify_rows there (`random_cycle_device`, CudaRunnerOptions::device_verification).
//
//   spec_step_bench --model assets/ml4-small [--prompt 128]
//   spec_step_bench --preset ml4-slice-4     (synthetic weights at full width, with a synthetic
//                                             drafter: the draft and verify cost of ML4's shapes)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#if defined(ML4_WITH_CUDA)
#include "engine/spec_decode.h"
#include "model/presets.h"
#include "runtime/cuda/cuda_runner.h"
#endif

int main(int argc, char** argv) {
  CLI::App app{"DSpark step pieces on the CUDA runner"};
  std::string model = "assets/ml4-small", preset;
  int prompt = 128;
  app.add_option("--model", model);
  app.add_option("--preset", preset, "synthetic weights of this preset instead of --model");
  app.add_option("--prompt", prompt);
  CLI11_PARSE(app, argc, argv);
#if defined(ML4_WITH_CUDA)
  using namespace ml4;
  using Clock = std::chrono::steady_clock;
  cuda::CudaRunnerOptions o;
  o.base.kv_cache_dtype = "bf16";
  o.base.kv_cache_bytes = 512ll << 20;
  o.base.drafter = true;
  o.base.max_num_seqs = 4;
  o.device_verification = true;
  auto load = [&]() -> Result<std::unique_ptr<cuda::CudaRunner>> {
    if (preset.empty()) return cuda::CudaRunner::load(model, o);
    ML4_ASSIGN_OR_RETURN(ModelConfig cfg, preset_config(preset));
    o.base.kv_cache_dtype = "fp8_ds_mla";
    o.base.kv_cache_bytes = 4ll << 30;
    ML4_ASSIGN_OR_RETURN(auto r, cuda::CudaRunner::load_synthetic(cfg, o, 7));
    ML4_RETURN_IF_ERROR(r->fill_kv_synthetic(11));
    return r;
  };
  auto rr = load();
  if (!rr.ok()) {
    std::fprintf(stderr, "%s\n", rr.status().message().c_str());
    return 1;
  }
  auto& r = **rr;
  std::printf("SPEC_MODEL %s block=%d drafter_layers=%d weights_gb=%.2f\n", preset.empty() ? model.c_str() : preset.c_str(),
              r.config().drafter.block_size, r.config().drafter.n_layers, r.weight_bytes() / 1e9);
  const int B = r.config().drafter.block_size;
  const auto& groups = r.cache_groups();
  auto tables = [&](int64_t upto) {
    std::vector<std::vector<int32_t>> t(groups.size());
    for (size_t g = 0; g < groups.size(); ++g)
      for (int64_t b = 0; b < (upto + 63) / 64; ++b)  // the window group: its blocks reused round robin
        t[g].push_back(static_cast<int32_t>(groups[g].sliding_window > 0 ? b % groups[g].num_blocks : b));
    return t;
  };
  SeqStep s;
  s.seq_id = 1;
  for (int i = 0; i < prompt; ++i) s.tokens.push_back(3 + (i * 37) % 5000);
  s.block_tables = tables(prompt + 4096);
  if (!r.execute(StepInput{{s}}).ok()) return 1;
  int64_t pos = prompt;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto measure = [&](const char* name, auto&& fn) {
    std::vector<double> ms;
    const int64_t g0 = r.graph_replays(), d0 = r.draft_replays();
    for (int i = 0; i < 35; ++i) {
      const auto t0 = Clock::now();
      if (!fn()) {
        std::fprintf(stderr, "%s failed\n", name);
        std::exit(1);
      }
      if (i >= 5) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    std::printf("SPEC_STEP %s ms=%.3f graph_replays=%lld draft_replays=%lld of 35 calls, graphs_held=%zu\n", name,
                median(ms), static_cast<long long>(r.graph_replays() - g0), static_cast<long long>(r.draft_replays() - d0),
                r.graphs_captured());
  };
  measure("plain_decode_device_sampling", [&] {
    SeqStep d;
    d.seq_id = 1;
    d.tokens = {17};
    d.start_pos = pos++;
    d.block_tables = s.block_tables;
    d.device_sampling = DeviceSamplingParams{};
    return r.execute(StepInput{{d}}).ok();
  });
  // B tokens: the last accepted one + B - 1 drafts; one accepted, so the next step rewrites the rest.
  // device_greedy: the rows verified on the device (greedy device sampling per row, step.h):
  // B tokens come back instead of B x vocab logits.
  auto verify_with = [&](bool device_greedy) {
    SeqStep d;
    d.seq_id = 1;
    d.tokens.assign(B, 17);
    d.start_pos = pos;
    d.num_logits = B;
    d.block_tables = s.block_tables;
    if (device_greedy) d.device_sampling = DeviceSamplingParams{};
    return r.execute(StepInput{{d}}).ok();
  };
  auto verify = [&] { return verify_with(false); };
  uint64_t draw = 0;
  auto draft_seq = [&](int drafts) {  // the block after the last accepted token (17 at pos)
    DraftSeq d;
    d.seq_id = 1;
    d.anchor_token = 17;
    d.anchor_pos = pos;
    d.block_tables = s.block_tables;
    d.num_drafts = drafts > 0 ? drafts : B - 1;
    return d;
  };
  auto draft_with = [&](bool sampled, int drafts = 0) {
    DraftInput in;
    DraftSeq d = draft_seq(drafts);
    if (sampled) {  // probabilistic drafts at T = 1 with their q (drawn on the device: sampling.h draft_rows)
      DeviceSamplingParams p;
      p.temperature = 1.0f;
      p.seed = 7;
      p.counter = static_cast<int64_t>(draw++) * B;
      d.sampling = p;
      in.want_probs = true;
    }
    in.seqs.push_back(d);
    return r.draft(in).ok();
  };
  auto draft = [&] { return draft_with(false); };
  measure("verify_block_tokens_logits", [&] {
    const bool ok = verify();
    pos += 1;
    return ok;
  });
  measure("verify_block_device_greedy", [&] {
    const bool ok = verify_with(true);
    pos += 1;
    return ok;
  });
  measure("draft_greedy", draft);
  measure("draft_greedy_3_drafts", [&] { return draft_with(false, 3); });  // 3 Markov slots of B - 1
  measure("draft_probabilistic_t1", [&] { return draft_with(true); });
  // (d) draft + verify of a random request (T = 1), q and rows to the host or kept on the device.
  auto random_cycle = [&](bool device) {
    DraftInput in;
    DraftSeq d = draft_seq(0);
    DeviceSamplingParams p;
    p.temperature = 1.0f;
    p.seed = 7;
    p.counter = static_cast<int64_t>(draw++) * B;
    d.sampling = p;
    d.keep_probs = device;
    in.want_probs = !device;
    in.seqs.push_back(d);
    auto dr = r.draft(in);
    if (!dr.ok()) return false;
    SeqStep v;
    v.seq_id = 1;
    v.tokens = {17};
    v.tokens.insert(v.tokens.end(), dr->tokens[0].begin(), dr->tokens[0].end());
    v.start_pos = pos;
    v.num_logits = B;
    v.block_tables = s.block_tables;
    DeviceSamplingParams tp = p;
    tp.seed = 8;
    if (device) {
      v.device_sampling = tp;
      v.device_verify = SeqStep::DeviceVerify::kKeptQ;
    }
    auto out = r.execute(StepInput{{v}});
    if (!out.ok()) return false;
    if (!device) {
      const std::vector<int32_t> drafts(v.tokens.begin() + 1, v.tokens.end());
      (void)verify_drafts(out->logits[0].data(), r.config().vocab_size, drafts, dr->probs[0].data(), tp, tp.seed, tp.counter);
    } else if (out->verified.size() != 1 || out->verified[0].tokens.empty()) {
      return false;
    }
    pos += 1;
    return true;
  };
  measure("random_cycle_host", [&] { return random_cycle(false); });
  measure("random_cycle_device", [&] { return random_cycle(true); });
  // Where a verification step and a draft spend their time: eager, events around each piece
  // (model_forward.cpp's timed() labels; adds a sync per piece), 5 calls each.
  std::map<std::string, double> prof;
  r.set_cuda_graphs(false);
  r.set_profile(&prof);
  for (const auto& [name, fn] : {std::pair<const char*, std::function<bool()>>{"verify", verify}, {"draft", draft}}) {
    prof.clear();
    for (int i = 0; i < 5; ++i)
      if (!fn()) return 1;
    for (const auto& [k, v] : prof) std::printf("SPEC_PROFILE %s %s ms=%.3f\n", name, k.c_str(), v / 5);
  }
  r.set_profile(nullptr);
  r.set_cuda_graphs(true);
  return 0;
#else
  std::fprintf(stderr, "built without the CUDA backend\n");
  return 1;
#endif
}
