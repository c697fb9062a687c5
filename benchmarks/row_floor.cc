// The rows' share of each option's step: the kernels' row loops alone, in C++.
//
// For the default step and each option, the row loop of the step kernel
// (`AdamRow` over mu and nu, with the parameter's rows read for weight decay,
// amsgrad's running max read and written, the rows' step counts written for
// per-row steps; prefetched as the kernel prefetches) and then the scatter-add
// of `apply_updates` over the parameter, for B distinct random rows of V-row
// tables. One thread; no dispatch, sort, gradient sum or XLA ops; fresh rows in
// every round, options interleaved round by round. Printed: each one's median
// time and the median (and quartiles) of its per-round ratio to the default's.
// Built and run by benchmarks/row_floor.py.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../optax_sparse_adam/_backends/cpu/kernels.cc"

namespace {

struct Option {
  const char* name;
  bool param;    // the parameter's rows read (weight decay)
  bool amsgrad;  // the running max read and written
  bool per_row;  // the rows' step counts written
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t V = argc > 1 ? std::atoll(argv[1]) : 1000000;
  const int64_t D = argc > 2 ? std::atoll(argv[2]) : 64;
  const int64_t B = argc > 3 ? std::atoll(argv[3]) : 4096;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 200;
  const Option options[] = {{"default", false, false, false},
                            {"weight decay (AdamW, L2)", true, false, false},
                            {"amsgrad", false, true, false},
                            {"per-row steps", false, false, true},
                            {"AdamW + amsgrad + per-row", true, true, true}};
  const int n = sizeof(options) / sizeof(options[0]);
  std::vector<float> p(V * D), m(V * D), v(V * D), vmax(V * D), g(B * D, 0.1f), delta(B * D);
  std::vector<int32_t> steps(V);
  std::mt19937 rng(0);
  std::vector<std::vector<double>> seconds(n);
  for (int k = 0; k < rounds; ++k) {
    for (int o = 0; o < n; ++o) {
      const Option& opt = options[o];
      std::vector<int64_t> rows(B);
      for (auto& r : rows) r = rng() % V;
      std::sort(rows.begin(), rows.end());
      const auto start = std::chrono::steady_clock::now();
      for (int64_t s = 0; s < B; ++s) {
        if (s + kPrefetchRows < B) {
          const int64_t a = rows[s + kPrefetchRows];
          PrefetchRow(&m[a * D], D);
          PrefetchRow(&v[a * D], D);
          if (opt.param) PrefetchRow(&p[a * D], D);
          if (opt.amsgrad) PrefetchRow(&vmax[a * D], D);
          if (opt.per_row) PrefetchLine(&steps[a]);
        }
        const int64_t row = rows[s];
        float* d = &delta[s * D];
        std::copy(&g[s * D], &g[s * D] + D, d);
        RowExtras x;
        x.p = &p[row * D];
        x.decay = 1e-5f;
        if (opt.per_row) steps[row] += 1;
        float* mr = &m[row * D];
        float* vr = &v[row * D];
        float* vm = &vmax[row * D];
        if (opt.param && opt.amsgrad) {
          AdamRow<float, float, false, kDecoupled, false, true>(d, mr, vr, D, false, .1f, .001f,
                                                                1e-8f, -1e-3f, 0, 0, &x, vm);
        } else if (opt.param) {
          AdamRow<float, float, false, kDecoupled>(d, mr, vr, D, false, .1f, .001f, 1e-8f, -1e-3f,
                                                   0, 0, &x);
        } else if (opt.amsgrad) {
          AdamRow<float, float, false, kNoDecay, false, true>(d, mr, vr, D, false, .1f, .001f,
                                                              1e-8f, -1e-3f, 0, 0, &x, vm);
        } else {
          AdamRow<float, float, false>(d, mr, vr, D, false, .1f, .001f, 1e-8f, -1e-3f, 0, 0);
        }
      }
      for (int64_t s = 0; s < B; ++s) {  // apply_updates' scatter-add
        if (s + kPrefetchRows < B) PrefetchRow(&p[rows[s + kPrefetchRows] * D], D);
        AddRow(&p[rows[s] * D], &delta[s * D], D);
      }
      seconds[o].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  std::printf("V=%lld, D=%lld, B=%lld distinct random rows, %d interleaved rounds\n",
              static_cast<long long>(V), static_cast<long long>(D), static_cast<long long>(B),
              rounds);
  for (int o = 0; o < n; ++o) {
    std::vector<double> ratio(rounds);
    for (int k = 0; k < rounds; ++k) ratio[k] = seconds[o][k] / seconds[0][k];
    std::sort(ratio.begin(), ratio.end());
    std::vector<double> t = seconds[o];
    std::sort(t.begin(), t.end());
    std::printf("%-26s %8.1f us   / default: %.2f (quartiles %.2f-%.2f)\n", options[o].name,
                t[rounds / 2] * 1e6, ratio[rounds / 2], ratio[rounds / 4],
                ratio[3 * rounds / 4]);
  }
  return 0;
}
