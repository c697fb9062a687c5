// Fused CPU kernels of the masked step, called from XLA through its FFI: one
// variant per row rule that has one (Adam, row-wise Adam), each also with the
// pipeline's options (weight decay, amsgrad, per-row steps; Adam: catch-up) as
// compile-time flags of one row loop, and the scatter-add.
//
// XLA:CPU emits gathers and scatters as element-by-element loops, and a masked
// step needs seven of them over the touched rows. These kernels do the same
// work in one pass per table: coalesce the gradient's row ids (a stable radix
// sort), then for each distinct row read its state once, update it in place and
// write the parameter delta. The arithmetic is the rule's `update` (`AdamRule`
// in _core/row_rules/adam.py, `RowwiseAdamRule` in _core/row_rules/rowwise_adam.py), operation for
// operation: every product and sum is rounded on its own (compiled with
// -ffp-contract=off, so no FMA), square root and division are IEEE, and
// duplicate entries are summed in input order starting from -0.0, as XLA's
// scatter-add does. The XLA ops round weight decay's products where they stand
// too (`adam.rounded`), so the two paths agree bit for bit with every option
// (docs/architecture.md, "One numerics contract"); tests check it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ffi_common.h"
#include "row_round.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// `x` rounded to nearest in the format of `T` (`astype`), as a float.
inline float RoundedAs(float x, const float*) { return x; }
inline float RoundedAs(float x, const uint16_t*) { return ToFloat(Bf16Bits<false>(x, 0u)); }

// What the pipeline does around the rule for one row (`xla.masked_step`): weight
// decay (`decay`: wd for L2, lr * wd decoupled; the row of the parameter `p`),
// the catch-up of its idle steps (`catch_up.idle_rows`: the moments' decay
// `pow_b1`, `pow_b2`, the discharge's `by_b1` and `by_r`, AdamW's
// `decay_minus_one` = d^k - 1).
struct RowExtras {
  const float* p = nullptr;
  float decay = 0.0f;
  bool guard_eps = false;  // 1 / (sqrt(v) + eps) is 0 where that sum is not > 0
  float pow_b1 = 1.0f;
  float pow_b2 = 1.0f;
  float by_b1 = 0.0f;
  float by_r = 0.0f;
  float decay_minus_one = 0.0f;
};

// `max(old, new)` as XLA:CPU's max computes it, NaNs included (the old value
// where it is NaN, the quiet NaN where only the new one is, else the larger,
// the old one if equal), stored in `*dst`'s format; returns the stored value.
// Bit masks, not branches, so that the row loops stay vectorized.
template <typename T>
inline float StoreMax(T* dst, float old_value, float new_value) {
  const uint32_t old_nan = 0u - static_cast<uint32_t>(old_value != old_value);
  const uint32_t new_nan = ~old_nan & (0u - static_cast<uint32_t>(new_value != new_value));
  const uint32_t keep_old = old_nan | (0u - static_cast<uint32_t>(old_value >= new_value));
  const uint32_t larger = (Bits(old_value) & keep_old) | (Bits(new_value) & ~keep_old);
  return StoreMoment<false>(dst, WithBits((larger & ~new_nan) | (0x7FC00000u & new_nan)), 0u, 0);
}

// The moment and parameter arithmetic of one row, in AdamRule.update's order;
// the delta is computed from the moments as stored. With `kCatchUp` the row's
// idle steps are caught up first, with `kDecay` its weight decay is applied
// and with `kAmsgrad` the running max `vmax` (stored like v) divides, all in
// `xla.masked_step`'s order (`x`). Every product is rounded before it is added,
// as the XLA path rounds the weight decay's products (`adam.rounded`).
template <typename MuT, typename NuT, bool kStochastic, int kDecay = kNoDecay,
          bool kCatchUp = false, bool kAmsgrad = false>
OSA_MULTIVERSIONED_TEMPLATE void AdamRow(
    float* __restrict__ g, MuT* __restrict__ m, NuT* __restrict__ v, int64_t row_size,
    bool maximize, float one_minus_b1, float one_minus_b2, float eps, float neg_step_size,
    uint32_t key, const RowExtras* extras = nullptr,
    NuT* __restrict__ vmax = nullptr) {
  // GCC unswitches the loop on `maximize`, and then gives up vectorizing the
  // larger bf16 and catch-up loops: there maximize flips a sign bit instead (a
  // negation, as in XLA: NaNs flip sign too), with no switch left in the loop.
  // The square is of the gradient as given (XLA folds (-g) * (-g) to g * g,
  // which differs for NaN; GCC folds the float32 loop's alike); with L2 it is
  // of the decayed gradient, which neither can fold.
  constexpr bool kBranchFree = kCatchUp || kDecay != kNoDecay || kAmsgrad ||
                               !std::is_same_v<MuT, float> || !std::is_same_v<NuT, float>;
  const uint32_t sign_flip = maximize ? 0x80000000u : 0u;
  RowExtras x;
  if constexpr (kDecay != kNoDecay || kCatchUp) x = *extras;
  const float* __restrict__ p = x.p;
  const uint32_t unguarded = x.guard_eps ? 0u : 0xFFFFFFFFu;
  uint32_t e = 0;  // j * kElementMultiplier, for stochastic rounding (`ElementHash`)
  for (int64_t j = 0; j < row_size; ++j, e += kElementMultiplier) {
    const float g_given = g[j];
    float gj;
    if constexpr (kBranchFree) {
      gj = WithBits(Bits(g_given) ^ sign_flip);
    } else {
      gj = maximize ? -g_given : g_given;
    }
    float mj = ToFloat(m[j]);
    float vj = ToFloat(v[j]);
    float pj = 0.0f;
    float shift = 0.0f;
    if constexpr (kDecay != kNoDecay) pj = p[j];
    if constexpr (kDecay == kL2) gj = gj + x.decay * pj;
    if constexpr (kCatchUp) {
      // With amsgrad the denominator over the window is the running max's (w = 0).
      const float root = std::sqrt(kAmsgrad ? ToFloat(vmax[j]) : vj);
      const float denom = root + eps;
      // 1 / denom, or 0 where denom is not > 0 if guarded.
      const uint32_t keep = denom > 0.0f ? 0xFFFFFFFFu : unguarded;
      const float inverse = WithBits(Bits(1.0f / denom) & keep);
      const float ratio = mj * inverse;
      if constexpr (kAmsgrad) {
        shift = -ratio * x.by_b1;
      } else {
        const float w = root * inverse;
        shift = -ratio * (x.by_b1 + w * (x.by_r - x.by_b1));
      }
      mj = RoundedAs(mj * x.pow_b1, m);
      vj = RoundedAs(vj * x.pow_b2, v);
      if constexpr (kDecay == kDecoupled) {
        shift = shift + x.decay_minus_one * pj;
        pj = pj + shift;
      }
    }
    // One hash for both moments: mu rounds with its top half, nu with its low half.
    const uint32_t h = kStochastic ? ElementHash(key, e) : 0u;
    const float m_new =
        StoreMomentBits<kStochastic>(&m[j], mj + (gj - mj) * one_minus_b1, FirstOfPairBits(h));
    const float g_squared = (kBranchFree && kDecay != kL2) ? g_given * g_given : gj * gj;
    const float v_new = StoreMomentBits<kStochastic>(
        &v[j], vj + (g_squared - vj) * one_minus_b2, SecondOfPairBits(h));
    float second = v_new;
    if constexpr (kAmsgrad) second = StoreMax(&vmax[j], ToFloat(vmax[j]), v_new);
    float delta = neg_step_size * (m_new / (std::sqrt(second) + eps));
    if constexpr (kDecay == kDecoupled) delta = delta - x.decay * pj;
    if constexpr (kCatchUp) delta = delta + shift;
    g[j] = delta;
  }
}

// Runs `body(MuT{}, NuT{}, Stochastic{})` with the storage types of mu and nu
// (float for F32, uint16_t for BF16) and `Stochastic::value == stochastic`.
template <typename Body>
ffi::Error WithMomentTypes(ffi::DataType mu, ffi::DataType nu, bool stochastic, Body body) {
  const auto storable = [](ffi::DataType t) {
    return t == ffi::DataType::F32 || t == ffi::DataType::BF16;
  };
  if (!storable(mu) || !storable(nu)) {
    return ffi::Error::InvalidArgument("mu and nu must be float32 or bfloat16");
  }
  const auto with_nu = [&](auto mu_t, auto rounding) {
    if (nu == ffi::DataType::F32) return body(mu_t, float{}, rounding);
    return body(mu_t, uint16_t{}, rounding);
  };
  const auto with_mu = [&](auto rounding) {
    if (mu == ffi::DataType::F32) return with_nu(float{}, rounding);
    return with_nu(uint16_t{}, rounding);
  };
  if (stochastic) return with_mu(std::true_type{});
  return with_mu(std::false_type{});
}

// The buffers of a fused moment step. Tables come in their own shapes (a
// reshape would make XLA copy an aliased operand) and are viewed as `num_rows`
// rows of `row_size` contiguous values. Inputs: rows int32 (nse,), values f32
// (nse, ...) of nse * row_size values, mu (a table) and nu (a table, or one
// value per row) in f32 or bf16, coeffs f32 = (1 - b1, 1 - b2, eps, then the
// rule's), keys u32 (2,): mu's key of this step for stochastic rounding
// (`rounding.step_key`; nu rounds with the low half of mu's element hash) and
// the tables' first global row (added to a row in its key: a shard hashes
// global rows), read when `stochastic` (bf16 tables only).
// Outputs: as `CoalescedRowsStep`; mu and nu, updated in the touched rows
// (aliased to the inputs, so in place when donated).
struct MomentStep {
  ffi::Buffer<ffi::S32> rows;
  ffi::AnyBuffer values;
  ffi::AnyBuffer mu;
  ffi::AnyBuffer nu;
  ffi::Buffer<ffi::F32> coeffs;
  ffi::Buffer<ffi::U32> keys;
  int64_t num_rows;
  bool stochastic;
  ffi::ThreadPool& pool;
  ffi::ResultBuffer<ffi::S32>& distinct_rows;
  ffi::ResultBuffer<ffi::F32>& delta;
  ffi::Result<ffi::AnyBuffer>& mu_out;
  ffi::Result<ffi::AnyBuffer>& nu_out;
};

struct NoPrefetch {
  void operator()(int64_t) const {}
};

// One distinct row of a step, as an update sees it: its index, the position of
// its first gradient entry, typed pointers to its moments (`Mu`, `Nu`: float or
// uint16_t for bfloat16), its summed gradient `g` (to be turned into its delta),
// the values in a row and the row's stochastic-rounding key (mu's; nu uses its hash too).
template <typename MuT, typename NuT, bool kStochasticRounding>
struct MomentRow {
  using Mu = MuT;
  using Nu = NuT;
  static constexpr bool kStochastic = kStochasticRounding;
  int64_t row;
  int64_t entry;
  MuT* m;
  NuT* v;
  float* g;
  int64_t size;
  uint32_t key;
};

// Checks a step's buffers, starts undonated outputs from the inputs, and runs
// `update(MomentRow)` on each distinct row. `kNuPerRow`: nu holds one value per
// row instead of a row. `prefetch(row)` prefetches the row in the rule's other
// tables, if any.
template <int kNumCoeffs, bool kNuPerRow, typename Update, typename Prefetch = NoPrefetch>
ffi::Error RunMomentStep(MomentStep& step, Update update, Prefetch prefetch = Prefetch{}) {
  const int64_t nse = static_cast<int64_t>(step.rows.element_count());
  const int64_t row_size = RowSize(step.mu.element_count(), step.num_rows);
  const int64_t nu_row_size = kNuPerRow ? 1 : row_size;
  if (row_size < 0 || RowSize(step.nu.element_count(), step.num_rows) != nu_row_size) {
    return ffi::Error::InvalidArgument("mu and nu must hold num_rows rows of the rule's sizes");
  }
  if (static_cast<int64_t>(step.values.element_count()) != nse * row_size) {
    return ffi::Error::InvalidArgument("values must hold nse rows of the tables' row size");
  }
  if (static_cast<int64_t>(step.coeffs.element_count()) != kNumCoeffs) {
    return ffi::Error::InvalidArgument("coeffs has the wrong size for this rule");
  }
  if (step.keys.element_count() != 2) return ffi::Error::InvalidArgument("keys must be (2,)");
  // Without donation XLA gives fresh output buffers: start from the inputs.
  CopyIfNotAliased(step.mu, step.mu_out);
  CopyIfNotAliased(step.nu, step.nu_out);
  const uint32_t mu_key = step.keys.typed_data()[0];
  const uint32_t row_offset = step.keys.typed_data()[1];
  const auto run = [&](auto mu_t, auto nu_t, auto rounding) {
    using MuT = decltype(mu_t);
    using NuT = decltype(nu_t);
    constexpr bool kStochastic = decltype(rounding)::value;
    MuT* m = static_cast<MuT*>(step.mu_out->untyped_data());
    NuT* v = static_cast<NuT*>(step.nu_out->untyped_data());
    return WithValues(step.values, [&](const auto* values) {
      CoalescedRowsStep(
          step.rows.typed_data(), nse, values, step.num_rows, row_size, step.pool,
          step.distinct_rows->typed_data(), step.delta->typed_data(),
          [&](int64_t row) {
            PrefetchRow(m + row * row_size, row_size);
            PrefetchRow(v + row * nu_row_size, nu_row_size);
            prefetch(row);
          },
          [&](int64_t row, int64_t entry, float* g) {
            update(MomentRow<MuT, NuT, kStochastic>{
                row, entry, m + row * row_size, v + row * nu_row_size, g, row_size,
                kStochastic ? RowKey(mu_key, row + row_offset) : 0u});
          });
      return ffi::Error::Success();
    });
  };
  return WithMomentTypes(step.mu.element_type(), step.nu.element_type(), step.stochastic, run);
}

// The Adam step; coeffs f32 (4,) = (1 - b1, 1 - b2, eps, step_size).
ffi::Error FusedAdamImpl(ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values,
                        ffi::AnyBuffer mu, ffi::AnyBuffer nu, ffi::Buffer<ffi::F32> coeffs,
                        ffi::Buffer<ffi::U32> keys, int64_t num_rows, bool maximize,
                        bool stochastic, ffi::ThreadPool pool,
                        ffi::ResultBuffer<ffi::S32> distinct_rows, ffi::ResultBuffer<ffi::F32> delta,
                        ffi::Result<ffi::AnyBuffer> mu_out, ffi::Result<ffi::AnyBuffer> nu_out) {
  MomentStep step{rows,       values, mu,   nu,            coeffs, keys,   num_rows,
                  stochastic, pool,   distinct_rows, delta, mu_out, nu_out};
  const float* c = coeffs.typed_data();
  const float neg_step_size = -c[3];
  return RunMomentStep<4, false>(
      step, [&](auto r) {
        using R = decltype(r);
        AdamRow<typename R::Mu, typename R::Nu, R::kStochastic>(
            r.g, r.m, r.v, r.size, maximize, c[0], c[1], c[2], neg_step_size, r.key);
      });
}

// A row of float32 values to bfloat16 (their bits), to nearest as XLA converts.
OSA_MULTIVERSIONED inline void NarrowBf16Row(uint16_t* __restrict__ out,
                                             const float* __restrict__ in, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = Bf16Bits<false>(in[j], 0u);
}

// The plain Adam step with a 16-bit output of its rows, in one pass: each distinct
// row's delta as `FusedAdamImpl` computes it, then, while the row is at hand,
// - `narrow_delta` false: the row's new value on a bfloat16 or float16 table rounded
//   stochastically (`param_rounding`), `round(table[row] + delta)` (`RoundedRows`, the
//   bits of `row_round.add_rounded_rows` and `xla.rounded_param_rows`), the table's
//   row prefetched with the moments';
// - `narrow_delta` true: the delta in the 16-bit gradient's dtype, to nearest (the
//   bits of XLA's convert, which `xla.masked_step` applies to it); the table unused.
// Buffers as the Adam step's, then table (bf16 or f16, read; empty if narrow_delta)
// and param_keys u32 (2,) (the parameter's key of this step, `rounding.kernel_keys`
// at `PARAM_SLOT`, and the table's first global row); outputs as the Adam step's,
// then new_rows (nse, row_size) in bf16 or f16, zeros at padding.
ffi::Error FusedAdamRoundedImpl(ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values,
                                ffi::AnyBuffer mu, ffi::AnyBuffer nu, ffi::Buffer<ffi::F32> coeffs,
                                ffi::Buffer<ffi::U32> keys, ffi::AnyBuffer table,
                                ffi::Buffer<ffi::U32> param_keys, int64_t num_rows, bool maximize,
                                bool stochastic, bool narrow_delta, ffi::ThreadPool pool,
                                ffi::ResultBuffer<ffi::S32> distinct_rows,
                                ffi::ResultBuffer<ffi::F32> delta,
                                ffi::Result<ffi::AnyBuffer> mu_out,
                                ffi::Result<ffi::AnyBuffer> nu_out,
                                ffi::Result<ffi::AnyBuffer> new_rows) {
  const ffi::DataType type = new_rows->element_type();
  if (type != ffi::DataType::BF16 && type != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("new_rows must be bfloat16 or float16");
  }
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  const int64_t row_size = RowSize(mu.element_count(), num_rows);
  if (row_size <= 0 || static_cast<int64_t>(new_rows->element_count()) != nse * row_size) {
    return ffi::Error::InvalidArgument("new_rows must hold nse rows of mu's");
  }
  RoundedRows rounded;  // the table's rows (not narrow_delta)
  if (!narrow_delta) {
    if (table.element_count() == 0) return ffi::Error::InvalidArgument("no table to round");
    if (auto error = rounded.Prepare(table, param_keys, new_rows, delta->typed_data(), nse,
                                     num_rows, row_size);
        error.failure()) {
      return error;
    }
  }
  MomentStep step{rows,       values, mu,   nu,            coeffs, keys,   num_rows,
                  stochastic, pool,   distinct_rows, delta, mu_out, nu_out};
  const float* c = coeffs.typed_data();
  const float neg_step_size = -c[3];
  const float* delta_base = delta->typed_data();
  auto* out = static_cast<uint16_t*>(new_rows->untyped_data());
  const auto run = [&](auto f16_tag, auto narrow_tag) {
    constexpr bool kF16 = decltype(f16_tag)::value;
    constexpr bool kNarrow = decltype(narrow_tag)::value;
    return RunMomentStep<4, false>(
        step,
        [&](auto r) {
          using R = decltype(r);
          AdamRow<typename R::Mu, typename R::Nu, R::kStochastic>(
              r.g, r.m, r.v, r.size, maximize, c[0], c[1], c[2], neg_step_size, r.key);
          if constexpr (kNarrow && kF16) {
            NarrowF16Row(out + (r.g - delta_base), r.g, r.size);
          } else if constexpr (kNarrow) {
            NarrowBf16Row(out + (r.g - delta_base), r.g, r.size);
          } else {
            rounded.Row(r.row, r.g);
          }
        },
        [&](int64_t row) { rounded.Prefetch(row); });
  };
  using T = std::true_type;
  using F = std::false_type;
  const bool f16 = type == ffi::DataType::F16;
  const ffi::Error error = narrow_delta ? (f16 ? run(T{}, T{}) : run(F{}, T{})) : run(F{}, F{});
  if (error.failure()) return error;
  const int32_t* d = distinct_rows->typed_data();
  for (int64_t s = 0; s < nse; ++s) {  // padding (out of range): zeros
    if (d[s] < 0 || d[s] >= num_rows) std::memset(out + s * row_size, 0, 2 * row_size);
  }
  return ffi::Error::Success();
}

// Catch-up of idle rows (`_core/catch_up.py`) in float32, operation for
// operation as `catch_up.idle_rows` computes it in XLA; the step's constants
// come computed by XLA (kernels.py), the per-row values (powers, decayed sums,
// step sizes at the windows' centroids) are computed here with the C library's
// exp and expm1, which may differ from XLA's in the last bit.
//
// The constants of one base x of a geometric sum (b1, or r = b1 / sqrt(b2)).
struct CatchUpBase {
  float log_x;
  float log_ratio;    // log x - log d
  float small;        // -|log_ratio|, -inf where it is not finite
  float expm1_small;  // expm1(small) (expm1(-1) where small is 0: unused)
  float one_minus_x;  // -expm1(log x)
};

struct CatchUpConstants {
  int32_t step;
  float log_b1, log_b2, log_d, lr, step_size;
  bool given_step_size, decoupled;
  CatchUpBase b1, r;
};

// `base^k` as `exp(k log base)`, 1 at k = 0 (`catch_up._pow`).
inline float PowOf(float log_base, float k) { return k == 0.0f ? 1.0f : std::exp(k * log_base); }

// `sum_{j=1..k} d^(k-j) x^j` (`catch_up.decayed_sum`).
inline float DecayedSum(const CatchUpBase& x, float log_d, float k) {
  if (k == 0.0f) return 0.0f;
  const float geometric = x.small == 0.0f ? k : std::expm1(k * x.small) / x.expm1_small;
  const float lead = x.log_ratio <= 0.0f ? (k - 1.0f) * log_d + x.log_x : k * x.log_x;
  return std::exp(lead) * geometric;
}

// The window's centroid step `t` (`catch_up._centroid`) for a base whose k-th
// power is `x_k`.
inline float CentroidStep(const CatchUpBase& x, int32_t last, float k, float x_k) {
  const float safe = x_k == 1.0f ? 1.0f : 1.0f - x_k;
  float centroid = 1.0f / x.one_minus_x - k * x_k / safe;
  centroid = std::nearbyint(std::isfinite(centroid) ? centroid : 1.0f);  // ties to even
  centroid = std::min(std::max(centroid, 1.0f), std::max(k, 1.0f));
  return static_cast<float>(last) + centroid;
}

// The step size at step `t` (`adam.bias_corrected_step_size`).
inline float StepSizeAt(const CatchUpConstants& c, float t) {
  const float bias_correction1 = -std::expm1(t * c.log_b1);
  const float bias_correction2 = -std::expm1(t * c.log_b2);
  return c.lr * std::sqrt(bias_correction2) / bias_correction1;
}

// The per-row values of a row last updated at step `last`.
struct CatchUpRow {
  int32_t last;
  float pow_b1, pow_b2, by_b1, by_r, decay_minus_one;
};

// The same values as computing each factor on its own (`catch_up.idle_rows`),
// with each exp or expm1 of the same argument taken once: b1^k is both the
// moment's decay and b1's power in its centroid, and the two bases' centroids
// often fall on the same step, which then shares its bias corrections.
CatchUpRow CatchUpRowOf(const CatchUpConstants& c, int32_t last) {
  const int32_t idle = std::max(c.step - 1 - last, 0);
  const float k = static_cast<float>(idle);
  const float pow_b1 = PowOf(c.log_b1, k);
  CatchUpRow row{last, pow_b1, PowOf(c.log_b2, k), 0.0f, 0.0f, 0.0f};
  float size_b1 = c.step_size, size_r = c.step_size;
  if (!c.given_step_size) {
    const float b1_k = c.b1.log_x == c.log_b1 ? pow_b1 : PowOf(c.b1.log_x, k);
    const float t_b1 = CentroidStep(c.b1, last, k, b1_k);
    const float t_r = CentroidStep(c.r, last, k, PowOf(c.r.log_x, k));
    size_b1 = StepSizeAt(c, t_b1);
    size_r = t_r == t_b1 ? size_b1 : StepSizeAt(c, t_r);
  }
  row.by_b1 = size_b1 * DecayedSum(c.b1, c.log_d, k);
  row.by_r = size_r * DecayedSum(c.r, c.log_d, k);
  if (c.decoupled) row.decay_minus_one = k == 0.0f ? 0.0f : std::expm1(k * c.log_d);
  return row;
}

// Whether all `n` values at `x` (float32 or bf16 bits) are finite: one pass of
// bit tests, vectorized, no branch per value.
inline bool AllFinite(const float* x, int64_t n) {
  uint32_t any = 0;
  for (int64_t j = 0; j < n; ++j) {
    any |= static_cast<uint32_t>((Bits(x[j]) & 0x7F800000u) == 0x7F800000u);
  }
  return any == 0;
}
inline bool AllFinite(const uint16_t* x, int64_t n) {
  uint32_t any = 0;
  for (int64_t j = 0; j < n; ++j) any |= static_cast<uint32_t>((x[j] & 0x7F80u) == 0x7F80u);
  return any == 0;
}

// Rows idle since the same step share their values (all rows never touched, all
// rows touched at the last step, rows touched in the same earlier step): a cache
// per thread, keyed by the last step, its entries tagged with the call that
// computed them. Large enough for the idle counts of one step's rows (uniform ids
// over 1M rows at B = 4,096 spread over about a thousand), so each is computed
// about once per thread and call.
constexpr int kCatchUpCacheSize = 4096;
std::atomic<uint64_t> catch_up_calls{0};

struct CatchUpCacheEntry {
  uint64_t call = 0;  // calls count from 1
  CatchUpRow row;
};

const CatchUpRow& CachedCatchUpRow(const CatchUpConstants& c, int32_t last, uint64_t call) {
  thread_local std::unique_ptr<CatchUpCacheEntry[]> cache;
  if (!cache) cache.reset(new CatchUpCacheEntry[kCatchUpCacheSize]);
  CatchUpCacheEntry& entry = cache[static_cast<uint32_t>(last) % kCatchUpCacheSize];
  if (entry.call != call || entry.row.last != last) {
    entry.call = call;
    entry.row = CatchUpRowOf(c, last);
  }
  return entry.row;
}

// The buffers of the pipeline's options around a rule (`xla.masked_step`), read
// or updated in place by a fused step with options: param f32 (the parameter in
// its own shape, read; empty without weight decay), nu_max (amsgrad's running
// max, stored and shaped like nu, updated in place; empty without amsgrad),
// entry_scales f32 (nse, width) (each gradient entry's row's step-size factors
// for its row's new step count, computed by XLA, whose exp is not the C
// library's, from `EntryStepsImpl`'s counts, which it also stores; empty
// without per-row steps); then which of them the step reads (its options) and
// `scales_width`, entry_scales' values per entry.
struct OptionInputs {
  ffi::Buffer<ffi::F32> param;
  ffi::AnyBuffer nu_max;
  ffi::Buffer<ffi::F32> entry_scales;
  ffi::Result<ffi::AnyBuffer>& nu_max_out;
  bool decay;
  bool amsgrad;
  bool per_row;
  int64_t scales_width;
  // A 16-bit table whose rows the step rounds stochastically in its pass (`RoundedRows`;
  // empty if none): its buffers, and the output of its new rows.
  ffi::AnyBuffer table;
  ffi::Buffer<ffi::U32> param_keys;
  ffi::Result<ffi::AnyBuffer>& new_rows;
};

// The option buffers as a step's rows use them: null where unused.
struct OptionBuffers {
  const float* p = nullptr;
  void* nu_max = nullptr;
  const float* entry_scales = nullptr;
  int64_t row_size = 0;      // values in a row of param
  int64_t nu_row_bytes = 0;  // bytes in a row of nu_max

  // Prefetches `row` in the tables the options read or write.
  void Prefetch(int64_t row) const {
    if (p != nullptr) PrefetchRow(p + row * row_size, row_size);
    if (nu_max != nullptr) {
      const char* base = static_cast<const char*>(nu_max) + row * nu_row_bytes;
      for (int64_t j = 0; j < nu_row_bytes; j += kBytesPerLine) PrefetchLine(base + j);
    }
  }
};

// Checks the option buffers of `step`, starts undonated outputs from the inputs,
// and points `out` at them.
ffi::Error PrepareOptions(const MomentStep& step, const OptionInputs& in, int64_t nu_row_size,
                          OptionBuffers& out) {
  const int64_t nse = static_cast<int64_t>(step.rows.element_count());
  const int64_t num_rows = step.num_rows;
  if (in.decay && in.param.element_count() != step.mu.element_count()) {
    return ffi::Error::InvalidArgument("param must have mu's size with weight decay");
  }
  if (in.amsgrad && (in.nu_max.element_type() != step.nu.element_type() ||
                     in.nu_max.element_count() != step.nu.element_count())) {
    return ffi::Error::InvalidArgument("nu_max must have nu's dtype and size with amsgrad");
  }
  if (in.per_row &&
      static_cast<int64_t>(in.entry_scales.element_count()) != nse * in.scales_width) {
    return ffi::Error::InvalidArgument("entry_scales must hold the step sizes of every entry");
  }
  if (in.amsgrad) CopyIfNotAliased(in.nu_max, in.nu_max_out);
  out.p = in.decay ? in.param.typed_data() : nullptr;
  out.nu_max = in.amsgrad ? in.nu_max_out->untyped_data() : nullptr;
  out.entry_scales = in.per_row ? in.entry_scales.typed_data() : nullptr;
  out.row_size = num_rows > 0 ? static_cast<int64_t>(step.mu.element_count()) / num_rows : 0;
  out.nu_row_bytes = nu_row_size * (step.nu.element_type() == ffi::DataType::F32 ? 4 : 2);
  return ffi::Error::Success();
}

// One row of the option buffers, as an update sees it: the row of the parameter
// (weight decay) and of nu_max (amsgrad), the step-size factors of the row's
// first entry (per-row steps); null where unused.
template <typename NuT>
struct OptionRow {
  const float* p;
  NuT* vmax;
  const float* scales;
};

// `RunMomentStep` with the options' buffers: checks and prepares them, stores
// each row's new step count (per-row steps), prefetches the rows they touch
// (and `prefetch(row)`'s), and runs `update(MomentRow, OptionRow)` on each
// distinct row, then, on a 16-bit table rounded in the pass, the row's new value
// (`RoundedRows`: one epilogue whatever the options).
template <int kNumCoeffs, bool kNuPerRow, typename Update, typename Prefetch = NoPrefetch>
ffi::Error RunOptionStep(MomentStep& step, const OptionInputs& in, Update update,
                         Prefetch prefetch = Prefetch{}) {
  OptionBuffers o;
  const int64_t nse = static_cast<int64_t>(step.rows.element_count());
  const int64_t row_size = RowSize(step.mu.element_count(), step.num_rows);
  const int64_t nu_row_size = kNuPerRow ? 1 : row_size;
  if (auto error = PrepareOptions(step, in, nu_row_size, o); error.failure()) return error;
  RoundedRows rounded;
  if (auto error = rounded.Prepare(in.table, in.param_keys, in.new_rows,
                                   step.delta->typed_data(), nse, step.num_rows, row_size);
      error.failure()) {
    return error;
  }
  // Weight decay reads a float32 parameter: a 16-bit table is not read as one.
  if (rounded.active() && in.decay) {
    return ffi::Error::InvalidArgument(
        "a table rounded in the step's pass takes no weight decay");
  }
  const ffi::Error error = RunMomentStep<kNumCoeffs, kNuPerRow>(
      step,
      [&](auto r) {
        using NuT = typename decltype(r)::Nu;
        const OptionRow<NuT> options{
            o.p == nullptr ? nullptr : o.p + r.row * r.size,
            o.nu_max == nullptr ? nullptr : static_cast<NuT*>(o.nu_max) + r.row * nu_row_size,
            o.entry_scales == nullptr ? nullptr : o.entry_scales + r.entry * in.scales_width};
        update(r, options);
        rounded.Row(r.row, r.g);
      },
      [&](int64_t row) {
        o.Prefetch(row);
        prefetch(row);
        rounded.Prefetch(row);
      });
  if (error.failure()) return error;
  rounded.ZeroPadding(step.distinct_rows->typed_data(), nse, step.num_rows);
  return ffi::Error::Success();
}

// Runs `body(decay, catch_up, amsgrad)` with the three as compile-time values
// (`decltype(x)::value`); `catch_up` with L2 weight decay is not offered.
template <typename Body>
void WithOptions(int decay, bool catch_up, bool amsgrad, Body body) {
  using kNo = std::integral_constant<int, kNoDecay>;
  using kL2c = std::integral_constant<int, kL2>;
  using kDec = std::integral_constant<int, kDecoupled>;
  const auto with_amsgrad = [&](auto d, auto c) {
    if (amsgrad) return body(d, c, std::true_type{});
    return body(d, c, std::false_type{});
  };
  if (catch_up) {
    if (decay == kDecoupled) return with_amsgrad(kDec{}, std::true_type{});
    return with_amsgrad(kNo{}, std::true_type{});
  }
  if (decay == kL2) return with_amsgrad(kL2c{}, std::false_type{});
  if (decay == kDecoupled) return with_amsgrad(kDec{}, std::false_type{});
  return with_amsgrad(kNo{}, std::false_type{});
}

// The Adam step with what the pipeline adds around the rule, in the kernel:
// weight decay (L2 or decoupled), amsgrad, per-row step counts, catch-up of
// idle rows. Buffers as the Adam step's, then the option buffers
// (`OptionInputs`; entry_scales (nse,): each entry's row's step size),
// last_step s32 (num_rows,) (each row's last step, updated in place; empty
// without catch-up) and step s32 (1,) (this step's count), then a 16-bit table rounded
// in the pass and its keys (`RoundedRows`; empty if none); coeffs f32 (20,) = (1 - b1,
// 1 - b2, eps, step_size, wd (L2) or lr * wd (decoupled), log b1, log b2,
// log d, lr, the given step size, then `CatchUpBase` of b1 and of r). Outputs: the
// option step's, last_step, then the table's new rows (`RoundedRows`).
ffi::Error FusedAdamOptionsImpl(
    ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values, ffi::AnyBuffer mu,
    ffi::AnyBuffer nu, ffi::Buffer<ffi::F32> coeffs, ffi::Buffer<ffi::U32> keys,
    ffi::Buffer<ffi::F32> param, ffi::AnyBuffer nu_max, ffi::Buffer<ffi::F32> entry_scales,
    ffi::Buffer<ffi::S32> last_step,
    ffi::Buffer<ffi::S32> step_count, ffi::AnyBuffer table, ffi::Buffer<ffi::U32> param_keys,
    int64_t num_rows, bool maximize, bool stochastic,
    bool decoupled, bool catch_up, bool guard_eps, bool given_step_size, bool l2, bool amsgrad,
    bool per_row, ffi::ThreadPool pool, ffi::ResultBuffer<ffi::S32> distinct_rows,
    ffi::ResultBuffer<ffi::F32> delta, ffi::Result<ffi::AnyBuffer> mu_out,
    ffi::Result<ffi::AnyBuffer> nu_out, ffi::Result<ffi::AnyBuffer> nu_max_out,
    ffi::ResultBuffer<ffi::S32> last_step_out, ffi::Result<ffi::AnyBuffer> new_rows) {
  const int decay = decoupled ? kDecoupled : (l2 ? kL2 : kNoDecay);
  if (catch_up && (l2 || per_row)) {
    return ffi::Error::InvalidArgument("catch-up takes no L2 weight decay or per-row steps");
  }
  if (catch_up && static_cast<int64_t>(last_step.element_count()) != num_rows) {
    return ffi::Error::InvalidArgument("last_step must hold one step per row with catch-up");
  }
  if (step_count.element_count() != 1) return ffi::Error::InvalidArgument("step must be (1,)");
  int32_t* last = last_step_out->typed_data();
  if (last != last_step.typed_data() && last_step.element_count() > 0) {
    std::memcpy(last, last_step.typed_data(), last_step.size_bytes());
  }
  MomentStep step{rows,       values, mu,   nu,            coeffs, keys,   num_rows,
                  stochastic, pool,   distinct_rows, delta, mu_out, nu_out};
  const float* c = coeffs.typed_data();
  const float neg_step_size = -c[3];
  const auto base = [&](int i) { return CatchUpBase{c[i], c[i + 1], c[i + 2], c[i + 3], c[i + 4]}; };
  const CatchUpConstants constants{step_count.typed_data()[0], c[5], c[6], c[7], c[8], c[9],
                                   given_step_size, decoupled, base(10), base(15)};
  const uint64_t call = catch_up_calls.fetch_add(1) + 1;
  return RunOptionStep<20, false>(
      step,
      {param, nu_max, entry_scales, nu_max_out, decay != kNoDecay, amsgrad, per_row, 1, table,
       param_keys, new_rows},
      [&](auto r, auto options) {
        using R = decltype(r);
        RowExtras x;
        x.decay = c[4];
        x.guard_eps = guard_eps;
        x.p = options.p;
        const float row_neg_step_size =
            options.scales == nullptr ? neg_step_size : -*options.scales;
        // A row updated at the previous step has no idle step (k = 0): its
        // catch-up multiplies the moments by 1 and adds a zero shift, so, with
        // finite moments (and parameter, with AdamW), the row runs the loop
        // without it: the same values, but for the sign of a zero delta.
        // Catch-up's per-value square root and division are most of its cost,
        // and a quarter of Zipf ids' rows are touched at consecutive steps.
        const bool catch_row =
            catch_up &&
            (last[r.row] < constants.step - 1 || !AllFinite(r.m, r.size) ||
             !AllFinite(r.v, r.size) || (decay != kNoDecay && !AllFinite(x.p, r.size)) ||
             (options.vmax != nullptr && !AllFinite(options.vmax, r.size)));
        if (catch_row) {
          const CatchUpRow& scalars = CachedCatchUpRow(constants, last[r.row], call);
          x.pow_b1 = scalars.pow_b1;
          x.pow_b2 = scalars.pow_b2;
          x.by_b1 = scalars.by_b1;
          x.by_r = scalars.by_r;
          x.decay_minus_one = scalars.decay_minus_one;
        }
        if (catch_up) last[r.row] = std::max(last[r.row], constants.step);
        WithOptions(decay, catch_row, options.vmax != nullptr, [&](auto d, auto caught, auto ams) {
          AdamRow<typename R::Mu, typename R::Nu, R::kStochastic, decltype(d)::value,
                  decltype(caught)::value, decltype(ams)::value>(
              r.g, r.m, r.v, r.size, maximize, c[0], c[1], c[2], row_neg_step_size, r.key, &x,
              options.vmax);
        });
      },
      [&](int64_t row) {
        if (catch_up) PrefetchLine(last + row);
      });
}

// `v` is the row's one second-moment value (and `vmax`, if given, its running
// max); the delta is computed from the moments as stored. `kDecay` and `p`,
// `decay` as in `AdamRow`.
template <typename MuT, typename NuT, bool kStochastic, int kDecay = kNoDecay>
OSA_MULTIVERSIONED_TEMPLATE void RowwiseAdamRow(
    float* __restrict__ g, MuT* __restrict__ m, NuT* __restrict__ v,
    float* __restrict__ scratch, int64_t row_size, bool maximize, float one_minus_b1,
    float one_minus_b2, float eps, float lr_over_bc1, float inv_bc2, float inv_row_size,
    uint32_t key, const float* __restrict__ p = nullptr, float decay = 0.0f,
    NuT* __restrict__ vmax = nullptr) {
  for (int64_t j = 0; j < row_size; ++j) {
    float gj = maximize ? -g[j] : g[j];  // a negation, as in XLA: NaNs flip sign too
    if constexpr (kDecay == kL2) gj = gj + decay * p[j];
    g[j] = gj;
    scratch[j] = gj * gj;
  }
  const float mean_square = PairwiseSum(scratch, row_size) * inv_row_size;
  const float v_old = ToFloat(*v);
  const float v_new =
      StoreMomentBits<kStochastic>(v, v_old + (mean_square - v_old) * one_minus_b2,
                                   SecondOfPairBits(kStochastic ? ElementHash(key, 0u) : 0u));
  const float second = vmax == nullptr ? v_new : StoreMax(vmax, ToFloat(*vmax), v_new);
  const float neg_rate = (-lr_over_bc1) / (std::sqrt(second * inv_bc2) + eps);
  uint32_t e = 0;  // j * kElementMultiplier, for stochastic rounding (`StochasticBits`)
  for (int64_t j = 0; j < row_size; ++j, e += kElementMultiplier) {
    const float mj = ToFloat(m[j]);
    const float m_new = StoreMoment<kStochastic>(&m[j], mj + (g[j] - mj) * one_minus_b1, key, e);
    // Where both are NaN, XLA's product keeps the moment's (GCC would pick either);
    // chosen by a bit mask, so that the loop stays vectorized.
    const uint32_t m_nan = 0u - static_cast<uint32_t>(m_new != m_new);
    float delta = WithBits((Bits(m_new) & m_nan) | (Bits(neg_rate * m_new) & ~m_nan));
    if constexpr (kDecay == kDecoupled) delta = delta - decay * p[j];
    g[j] = delta;
  }
}

// The row-wise Adam step: nu holds one value per row ((num_rows,)), coeffs f32
// (7,) = (1 - b1, 1 - b2, eps, lr / (1 - b1^t), 1 / (1 - b2^t), 1 / row_size,
// wd (L2) or lr * wd (decoupled)), then the option buffers (`OptionInputs`;
// entry_scales (nse, 2): each entry's row's lr / (1 - b1^t), 1 / (1 - b2^t)), then a
// 16-bit table rounded in the pass and its keys; outputs the option step's, then the
// table's new rows (`RoundedRows`; both empty if none).
ffi::Error FusedRowwiseAdamImpl(
    ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values, ffi::AnyBuffer mu,
    ffi::AnyBuffer nu, ffi::Buffer<ffi::F32> coeffs, ffi::Buffer<ffi::U32> keys,
    ffi::Buffer<ffi::F32> param, ffi::AnyBuffer nu_max, ffi::Buffer<ffi::F32> entry_scales,
    ffi::AnyBuffer table, ffi::Buffer<ffi::U32> param_keys, int64_t num_rows,
    bool maximize, bool stochastic,
    int64_t decay, bool amsgrad, bool per_row, ffi::ThreadPool pool,
    ffi::ResultBuffer<ffi::S32> distinct_rows, ffi::ResultBuffer<ffi::F32> delta,
    ffi::Result<ffi::AnyBuffer> mu_out, ffi::Result<ffi::AnyBuffer> nu_out,
    ffi::Result<ffi::AnyBuffer> nu_max_out, ffi::Result<ffi::AnyBuffer> new_rows) {
  if (decay < kNoDecay || decay > kDecoupled) {
    return ffi::Error::InvalidArgument("decay must be 0 (none), 1 (L2) or 2 (decoupled)");
  }
  MomentStep step{rows,       values, mu,   nu,            coeffs, keys,   num_rows,
                  stochastic, pool,   distinct_rows, delta, mu_out, nu_out};
  const float* c = coeffs.typed_data();
  return RunOptionStep<7, true>(
      step,
      {param, nu_max, entry_scales, nu_max_out, decay != kNoDecay, amsgrad, per_row, 2, table,
       param_keys, new_rows},
      [&](auto r, auto options) {
        using R = decltype(r);
        thread_local std::vector<float> scratch;
        if (static_cast<int64_t>(scratch.size()) < r.size) scratch.resize(r.size);
        const float* scales = options.scales == nullptr ? c + 3 : options.scales;
        const auto run = [&](auto d) {
          RowwiseAdamRow<typename R::Mu, typename R::Nu, R::kStochastic, decltype(d)::value>(
              r.g, r.m, r.v, scratch.data(), r.size, maximize, c[0], c[1], c[2], scales[0],
              scales[1], c[5], r.key, options.p, c[6], options.vmax);
        };
        if (decay == kL2) return run(std::integral_constant<int, kL2>{});
        if (decay == kDecoupled) return run(std::integral_constant<int, kDecoupled>{});
        return run(std::integral_constant<int, kNoDecay>{});
      });
}

// param[rows[i]] += values[i] for in-range rows, in input order (XLA's
// scatter-add order); out-of-range rows (BCOO padding) are dropped. The update's
// rows and values come first, as a step's gradient does (`RowStepBinding`).
// `rows_unique` promises no in-range row repeats (sparse_adam's updates).
ffi::Error ScatterAddRowsImpl(ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values,
                              ffi::Buffer<ffi::F32> param, int64_t num_rows, bool rows_unique,
                              ffi::ThreadPool pool, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  const int64_t row_size = RowSize(param.element_count(), num_rows);
  if (row_size < 0) return ffi::Error::InvalidArgument("param must hold num_rows rows");
  if (static_cast<int64_t>(values.element_count()) != nse * row_size) {
    return ffi::Error::InvalidArgument("values must hold nse rows of the param's row size");
  }
  float* p = out->typed_data();
  if (p != param.typed_data()) std::memcpy(p, param.typed_data(), param.size_bytes());
  if (values.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("values must be float32");
  }
  const float* val = static_cast<const float*>(values.untyped_data());
  ForEachEntryRow(
      pool, rows.typed_data(), nse, num_rows, row_size, rows_unique,
      [&](int64_t row) { PrefetchRow(p + row * row_size, row_size); },
      [&](int64_t i, int64_t row) { AddRow(p + row * row_size, val + i * row_size, row_size); });
  return ffi::Error::Success();
}

// Per-row step counts (`xla.masked_step`'s): each gradient entry's row's count
// after this step, `row_step[rows[i]]` (0 for a row out of range; a negative row
// counts from the end, as in a jnp gather) plus one unless it is INT32_MAX
// (`optax.safe_increment`); that count, at least 1, as a float32 (for the step
// sizes XLA computes from it); and row_step with the touched rows' new counts
// (aliased: in place when donated). One thread, one pass over the counts: XLA
// would split the gather and the ops around it over its threads and wait.
ffi::Error EntryStepsImpl(ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> row_step,
                          ffi::ResultBuffer<ffi::S32> entry_steps,
                          ffi::ResultBuffer<ffi::F32> counts,
                          ffi::ResultBuffer<ffi::S32> row_step_out) {
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  const int64_t num_rows = static_cast<int64_t>(row_step.element_count());
  const int32_t* r = rows.typed_data();
  int32_t* steps = row_step_out->typed_data();
  if (steps != row_step.typed_data()) {
    std::memcpy(steps, row_step.typed_data(), row_step.size_bytes());
  }
  int32_t* out = entry_steps->typed_data();
  float* t = counts->typed_data();
  const auto in_range = [&](int64_t i) {
    const int64_t row = r[i] < 0 ? r[i] + num_rows : r[i];
    return row >= 0 && row < num_rows ? row : int64_t{-1};
  };
  for (int64_t i = 0; i < nse; ++i) {
    if (i + kPrefetchRows < nse) {
      const int64_t ahead = in_range(i + kPrefetchRows);
      if (ahead >= 0) PrefetchLine(steps + ahead);
    }
    const int64_t row = in_range(i);
    const int32_t old = row >= 0 ? steps[row] : 0;
    const int32_t count = old < INT32_MAX ? old + 1 : INT32_MAX;
    out[i] = count;
    t[i] = static_cast<float>(std::max(count, 1));
  }
  // Stored once every entry has read its row's old count (a row may repeat).
  for (int64_t i = 0; i < nse; ++i) {
    const int64_t row = in_range(i);
    if (row >= 0) steps[row] = out[i];
  }
  return ffi::Error::Success();
}

// The inputs every fused moment step starts with (rows, values, m, v, coefficients,
// rounding keys).
auto MomentStepInputs() {
  return RowStepBinding()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::U32>>();
}

// A step's inputs with the option buffers (`OptionInputs`) after them.
auto OptionStepInputs() {
  return MomentStepInputs()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

// A step's inputs, then a 16-bit table rounded in its pass and its keys (`RoundedRows`).
template <typename Binding>
auto RoundedInputs(Binding&& binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>().template Arg<ffi::Buffer<ffi::U32>>();
}

// The outputs of a fused moment step (`MomentStep`'s): the row step's, then m and v.
template <typename Binding>
auto MomentStepOutputs(Binding&& binding) {
  return RowStepOutputs(std::move(binding))
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

// A step's outputs, then the option buffer it updates (nu_max).
template <typename Binding>
auto OptionStepOutputs(Binding&& binding) {
  return MomentStepOutputs(std::move(binding)).template Ret<ffi::AnyBuffer>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaFusedAdamF32, FusedAdamImpl,
                              MomentStepOutputs(RowStepAttrs(MomentStepInputs())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    OsaFusedAdamRoundedF32, FusedAdamRoundedImpl,
    MomentStepOutputs(
        RowStepAttrs(MomentStepInputs().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::U32>>())
            .Attr<bool>("narrow_delta"))
        .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    OsaFusedRowwiseAdamF32, FusedRowwiseAdamImpl,
    OptionStepOutputs(
        Attrs<bool>(RowStepAttrs(RoundedInputs(OptionStepInputs())).Attr<int64_t>("decay"),
                    "amsgrad", "per_row"))
        .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    OsaFusedAdamOptionsF32, FusedAdamOptionsImpl,
    OptionStepOutputs(Attrs<bool>(RowStepAttrs(RoundedInputs(OptionStepInputs()
                                                                 .Arg<ffi::Buffer<ffi::S32>>()
                                                                 .Arg<ffi::Buffer<ffi::S32>>())),
                                  "decoupled", "catch_up", "guard_eps", "given_step_size", "l2",
                                  "amsgrad", "per_row"))
        .Ret<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaEntryStepsS32, EntryStepsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaScatterAddRowsF32, ScatterAddRowsImpl,
                              RowStepBinding()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_rows")
                                  .Attr<bool>("rows_unique")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
