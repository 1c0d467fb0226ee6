// Small helpers the engine tests share.
#pragma once

#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "engine/engine.h"
#include "engine/sampling_params.h"

namespace ml4::testing {

// Greedy decoding of exactly `max_tokens` tokens (EOS ignored).
inline SamplingParams greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0.0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

// A mixed load with aborts: `n` requests from make() (prompt, params), at most max_live at once;
// about a fifth are aborted within abort_window steps of their arrival (waiting, prefilling or
// decoding). The block manager's invariants are checked every 50 steps. Returns how many of the
// aborts found their request still live.
inline Result<int> run_with_aborts(Engine& e, int n, int max_live, int abort_window, std::mt19937& rng,
                                   const std::function<std::pair<std::vector<int32_t>, SamplingParams>()>& make) {
  std::multimap<int, std::string> to_abort;  // step -> request
  int added = 0, aborted = 0, steps = 0;
  while (added < n || e.has_work()) {
    while (added < n && static_cast<int>(e.num_live()) < max_live) {
      auto [prompt, sp] = make();
      const std::string id = "m" + std::to_string(added++);
      ML4_RETURN_IF_ERROR(e.add_request(id, prompt, sp));
      if (rng() % 5 == 0) to_abort.emplace(steps + static_cast<int>(rng() % abort_window), id);
    }
    for (auto it = to_abort.begin(); it != to_abort.end() && it->first <= steps;) {
      aborted += e.abort(it->second) ? 1 : 0;
      it = to_abort.erase(it);
    }
    ML4_RETURN_IF_ERROR(e.step().status());
    if (++steps >= 100000) return internal_error("the load did not drain in 100000 steps");
    if (steps % 50 == 0) ML4_RETURN_IF_ERROR(e.blocks().check_invariants());
  }
  return aborted;
}

}  // namespace ml4::testing
