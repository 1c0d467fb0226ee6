// Chi-square goodness of fit for the sampling-losslessness tests (spec_decode_test.cpp on the
// fake runner, cpu_spec_decode_test.cpp on the CPU runner), and the sampling loop they share.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "engine/engine.h"

namespace ml4::testing {

// The regularized upper incomplete gamma Q(a, x) (Numerical Recipes' gammq: series for
// x < a + 1, Lentz's continued fraction otherwise); chi-square survival = Q(df / 2, x / 2).
inline double gamma_q(double a, double x) {
  if (x <= 0) return 1.0;
  const double gln = std::lgamma(a);
  if (x < a + 1) {
    double ap = a, sum = 1.0 / a, del = sum;
    for (int n = 0; n < 100000 && std::abs(del) > std::abs(sum) * 1e-15; ++n) sum += del *= x / ++ap;
    return 1.0 - sum * std::exp(-x + a * std::log(x) - gln);
  }
  double b = x + 1 - a, c = 1e300, d = 1 / b, h = d;
  for (int i = 1; i < 100000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::abs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::abs(c) < 1e-300) c = 1e-300;
    d = 1 / d;
    const double del = d * c;
    h *= del;
    if (std::abs(del - 1) < 1e-15) break;
  }
  return std::exp(-x + a * std::log(x) - gln) * h;
}

// Pearson's statistic over cells with expected count >= 5 (the rest merged into one cell).
struct ChiSquare {
  double stat = 0;
  int df = 0;
  double p_value = 1;
};
inline ChiSquare chi_square(const std::vector<double>& expected_p, const std::vector<int64_t>& counts, int64_t n) {
  ChiSquare r;
  double rest_e = 0, rest_o = 0;
  int cells = 0;
  for (size_t i = 0; i < expected_p.size(); ++i) {
    const double e = expected_p[i] * n;
    if (e >= 5) {
      r.stat += (counts[i] - e) * (counts[i] - e) / e;
      ++cells;
    } else {
      rest_e += e;
      rest_o += counts[i];
    }
  }
  if (rest_e > 0) {
    r.stat += (rest_o - rest_e) * (rest_o - rest_e) / rest_e;
    ++cells;
  }
  r.df = cells - 1;
  r.p_value = gamma_q(r.df / 2.0, r.stat / 2.0);
  return r;
}


// The statistic at which the survival function falls to `alpha` (bisection).
inline double chi_square_critical(int df, double alpha) {
  double lo = df, hi = 20.0 * df + 200;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (gamma_q(df / 2.0, mid / 2.0) > alpha ? lo : hi) = mid;
  }
  return lo;
}

// Runs n requests of `prompt` with `sp` through `e` (at most max_live at once) and counts
// their outputs, each exactly `len` tokens read as a base-`vocab` number, into counts.
inline Status count_outputs(Engine& e, const std::vector<int32_t>& prompt, const SamplingParams& sp, int64_t n,
                            int len, int vocab, int max_live, std::vector<int64_t>* counts) {
  std::map<std::string, std::vector<int32_t>> partial;
  int64_t done = 0, next = 0;
  while (done < n) {
    while (next < n && static_cast<int64_t>(e.num_live()) < max_live)
      ML4_RETURN_IF_ERROR(e.add_request(std::to_string(next++), prompt, sp));
    ML4_ASSIGN_OR_RETURN(std::vector<RequestOutput> outs, e.step());
    for (auto& o : outs) {
      auto& t = partial[o.request_id];
      t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (!o.finished) continue;
      if (static_cast<int>(t.size()) != len)
        return internal_error("request {} ended with {} tokens, not {}", o.request_id, t.size(), len);
      int64_t cell = 0;
      for (int32_t x : t) cell = cell * vocab + x;
      ++(*counts)[static_cast<size_t>(cell)];
      partial.erase(o.request_id);
      ++done;
    }
  }
  return ok_status();
}

}  // namespace ml4::testing
