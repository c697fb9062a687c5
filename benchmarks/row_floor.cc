// The rows' share of each option's step: the kernels' row loops alone, in C++.
//
// For the default step and one option, the row loop of the step kernel
// (`AdamRow` over mu and nu, with the parameter's rows read for weight decay,
// amsgrad's running max read and written, the rows' step counts written for
// per-row steps, the rows' last steps read and written and their catch-up
// factors looked up for catch-up, bf16 moments rounded stochastically;
// prefetched as the kernel prefetches) and then the scatter-add of
// `apply_updates` over the parameter, for B distinct random rows of V-row
// tables. Only these two's tables are held, each its own (as `bench_options`
// does: tables shared between options, or all held at once, change what the
// cache and the TLB keep of them). One thread, subnormals flushed as in XLA; no
// dispatch, sort, gradient sum or XLA ops; fresh rows in every round, the two
// interleaved round by round. Catch-up's rows were last updated 0 to 999 steps
// ago (a spread like uniform ids' over 1M rows at B = 4,096), so each round
// looks up many idle counts. Arguments: V D B rounds and the option's index
// (from 1; exit status 3 past the last). Printed: the option's and the default's
// median times and the median (and quartiles) of the per-round ratio. With V
// small enough for the tables to stay in cache, the ratios are the options'
// arithmetic alone. Built and run by benchmarks/row_floor.py.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "../optax_sparse_adam/_backends/cpu/kernels.cc"

namespace {

struct Option {
  const char* name;
  bool param;     // the parameter's rows read (weight decay)
  bool amsgrad;   // the running max read and written
  bool per_row;   // the rows' step counts written
  bool catch_up;  // the rows' last steps read and written, their idle steps caught up
  bool bf16;      // bf16 mu and nu, rounded stochastically
};

// Catch-up's constants for b1 = 0.9, b2 = 0.999, lr = 1e-3 and no weight decay,
// as kernels.py computes them (`_catch_up_coefficients`).
CatchUpBase BaseOf(float log_x) {
  const float small = -std::fabs(log_x);
  return CatchUpBase{log_x, log_x, small, std::expm1(small), -std::expm1(log_x)};
}

CatchUpConstants CatchUpAt(int32_t step) {
  const float log_b1 = std::log(0.9f), log_b2 = std::log(0.999f);
  return CatchUpConstants{step,  log_b1, log_b2, 0.0f,           1e-3f,
                          1e-3f, false,  false,  BaseOf(log_b1), BaseOf(log_b1 - 0.5f * log_b2)};
}

// One row of an option's step kernel: `AdamRow` with the option's flags (catch-up's terms where
// `idle`, as the kernel decides per row).
template <typename T>
void StepRow(const Option& opt, bool idle, float* d, T* m, T* v, T* vm, const RowExtras* x,
             int64_t D) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  const auto run = [&](auto decay, auto catch_up, auto amsgrad) {
    AdamRow<T, T, kBf16, decltype(decay)::value, decltype(catch_up)::value,
            decltype(amsgrad)::value>(d, m, v, D, false, .1f, .001f, 1e-8f, -1e-3f, 0x1234u, x,
                                      vm);
  };
  WithOptions(opt.param ? kDecoupled : kNoDecay, idle, opt.amsgrad, run);
}

}  // namespace

int main(int argc, char** argv) {
#if defined(__x86_64__)
  // Subnormals flushed to zero, as XLA:CPU runs its ops and the kernels (long-idle
  // rows' b1^k is subnormal for k in about 830..980, which would take microcode assists).
  _mm_setcsr(_mm_getcsr() | 0x8040);
#endif
  const int64_t V = argc > 1 ? std::atoll(argv[1]) : 1000000;
  const int64_t D = argc > 2 ? std::atoll(argv[2]) : 64;
  const int64_t B = argc > 3 ? std::atoll(argv[3]) : 4096;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 200;
  const int which = argc > 5 ? std::atoi(argv[5]) : 1;
  const Option all[] = {
      {"default", false, false, false, false, false},
      {"weight decay (AdamW, L2)", true, false, false, false, false},
      {"amsgrad", false, true, false, false, false},
      {"per-row steps", false, false, true, false, false},
      {"AdamW + amsgrad + per-row", true, true, true, false, false},
      {"catch-up", false, false, false, true, false},
      {"AdamW + catch-up", true, false, false, true, false},
      {"bf16 moments, stochastic", false, false, false, false, true},
  };
  if (which < 1 || which >= static_cast<int>(sizeof(all) / sizeof(all[0]))) return 3;
  const Option options[] = {all[0], all[which]};  // only these two's tables held
  const int n = 2;
  struct Tables {
    std::vector<float> p, m, v, vmax;
    std::vector<uint16_t> mb, vb;
    std::vector<int32_t> steps, last;
  };
  std::vector<Tables> tables(n);
  std::mt19937 rng(0);
  int32_t step = 1000;
  for (int o = 0; o < n; ++o) {
    const Option& opt = options[o];
    Tables& t = tables[o];
    t.p.assign(V * D, 0.0f);
    if (opt.bf16) {
      t.mb.assign(V * D, 0);
      t.vb.assign(V * D, 0);
    } else {
      t.m.assign(V * D, 0.0f);
      t.v.assign(V * D, 0.0f);
    }
    if (opt.amsgrad) t.vmax.assign(V * D, 0.0f);
    if (opt.per_row) t.steps.assign(V, 0);
    if (opt.catch_up) {
      t.last.resize(V);
      for (auto& l : t.last) l = step - 1 - static_cast<int32_t>(rng() % 1000);
    }
  }
  std::vector<float> g(B * D, 0.1f), delta(B * D);
  std::vector<std::vector<double>> seconds(n);
  for (int k = 0; k < rounds; ++k) {
    for (int o = 0; o < n; ++o) {
      const Option& opt = options[o];
      auto& [p, m, v, vmax, mb, vb, steps, last] = tables[o];
      std::vector<int64_t> rows(B);
      for (auto& r : rows) r = rng() % V;
      std::sort(rows.begin(), rows.end());
      rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
      const int64_t nr = static_cast<int64_t>(rows.size());
      const CatchUpConstants constants = CatchUpAt(step + k + 1);
      const uint64_t call = catch_up_calls.fetch_add(1) + 1;
      const auto start = std::chrono::steady_clock::now();
      for (int64_t s = 0; s < nr; ++s) {
        if (s + kPrefetchRows < nr) {
          const int64_t a = rows[s + kPrefetchRows];
          if (opt.bf16) {
            PrefetchRow(&mb[a * D], D);
            PrefetchRow(&vb[a * D], D);
          } else {
            PrefetchRow(&m[a * D], D);
            PrefetchRow(&v[a * D], D);
          }
          if (opt.param) PrefetchRow(&p[a * D], D);
          if (opt.amsgrad) PrefetchRow(&vmax[a * D], D);
          if (opt.per_row) PrefetchLine(&steps[a]);
          if (opt.catch_up) PrefetchLine(&last[a]);
        }
        const int64_t row = rows[s];
        float* d = &delta[s * D];
        std::copy(&g[s * D], &g[s * D] + D, d);
        RowExtras x;
        x.p = &p[row * D];
        x.decay = 1e-5f;
        if (opt.per_row) steps[row] += 1;
        // As the kernel: a row updated at the previous step (no idle step) with
        // finite values skips catch-up's terms.
        const auto finite = [&] {
          return (opt.bf16 ? AllFinite(&mb[row * D], D) && AllFinite(&vb[row * D], D)
                           : AllFinite(&m[row * D], D) && AllFinite(&v[row * D], D)) &&
                 (!opt.param || AllFinite(&p[row * D], D)) &&
                 (!opt.amsgrad || AllFinite(&vmax[row * D], D));
        };
        const bool idle = opt.catch_up && (last[row] < constants.step - 1 || !finite());
        if (opt.catch_up) {
          const CatchUpRow& c = CachedCatchUpRow(constants, last[row], call);
          x.pow_b1 = c.pow_b1;
          x.pow_b2 = c.pow_b2;
          x.by_b1 = c.by_b1;
          x.by_r = c.by_r;
          x.decay_minus_one = c.decay_minus_one;
          last[row] = std::max(last[row], constants.step);
        }
        if (opt.bf16) {
          StepRow(opt, idle, d, &mb[row * D], &vb[row * D], static_cast<uint16_t*>(nullptr), &x, D);
        } else {
          StepRow(opt, idle, d, &m[row * D], &v[row * D], vmax.empty() ? nullptr : &vmax[row * D],
                  &x, D);
        }
      }
      for (int64_t s = 0; s < nr; ++s) {  // apply_updates' scatter-add
        if (s + kPrefetchRows < nr) PrefetchRow(&p[rows[s + kPrefetchRows] * D], D);
        AddRow(&p[rows[s] * D], &delta[s * D], D);
      }
      seconds[o].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  std::vector<double> ratio(rounds);
  for (int k = 0; k < rounds; ++k) ratio[k] = seconds[1][k] / seconds[0][k];
  std::sort(ratio.begin(), ratio.end());
  for (auto& t : seconds) std::sort(t.begin(), t.end());
  std::printf("%-26s %8.1f us (default %8.1f us)   / default: %.2f (quartiles %.2f-%.2f)\n",
              options[1].name, seconds[1][rounds / 2] * 1e6, seconds[0][rounds / 2] * 1e6,
              ratio[rounds / 2], ratio[rounds / 4], ratio[3 * rounds / 4]);
  return 0;
}
