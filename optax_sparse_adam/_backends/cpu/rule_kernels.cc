// Fused CPU kernels of the masked step for the rules with one slot: SGD with a
// lazy momentum buffer (Nesterov or not), Adagrad and row-wise Adagrad
// (`_core/row_rules/{sgd,adagrad,rowwise_adagrad}.py`; plain SGD runs the generic
// kernels: its fused kernel measured within 10% of them), with the
// pipeline's options around them (maximize, L2 or decoupled weight decay,
// renormalisation to `max_norm`), called from XLA through its FFI
// (`rule_steps.py` builds the call).
//
// One pass over the distinct rows, as the Adam kernels (`ffi_common.h`): the
// gradient's rows coalesced, each row's slot read once and updated in place,
// its delta written (and on a bfloat16 or float16 table rounded stochastically, the
// row's new value: `RoundedRows` in row_round.h, as the Adam kernels). The arithmetic
// is the rule's `update` and `xla.masked_step`'s around it, operation for operation:
// every product rounded on its own (compiled with -ffp-contract=off, so no FMA, as the
// XLA path rounds its products with `adam.rounded`), square root and division IEEE,
// row sums in `pairwise_row_sum`'s order, so the two paths agree bit for bit
// (tests/backends/test_cpu_rule_kernels.py).

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ffi_common.h"
#include "row_round.h"
#include "xla/ffi/api/ffi.h"

namespace {

// The rule of a step, `rule_steps.RULE_CODES`.
enum RuleKind : int {
  kSgdMomentum = 1,
  kSgdNesterov = 2,
  kAdagrad = 3,
  kRowwiseAdagrad = 4,
};

// The step's scalars, computed by XLA as `xla.masked_step` computes them.
//   SGD with momentum: a = lr, b = momentum, c = 1 - dampening.
//   Adagrad: a = the step size lr / (1 + (t - 1) * lr_decay), b = eps.
//   Row-wise Adagrad: a = lr, b = eps, c = 1 / row_size.
// decay: wd (L2) or lr * wd (decoupled); max_norm: the renormalisation's bound.
struct RuleCoeffs {
  float a, b, c, decay, max_norm;
};
constexpr int64_t kNumRuleCoeffs = 5;

// One row of a rule's step: `g` holds the row's summed gradient and receives
// its delta; `s` is the row's slot (a row of values, or the row's one value for
// row-wise Adagrad); `p` the parameter's row (read for
// weight decay and max_norm); `scratch` row_size floats.
template <int kRule, typename T, bool kStochastic, int kDecay, bool kMaxNorm>
OSA_MULTIVERSIONED_TEMPLATE void RuleRow(float* __restrict__ g, T* __restrict__ s,
                                         const float* __restrict__ p,
                                         float* __restrict__ scratch, int64_t row_size,
                                         bool maximize, RuleCoeffs c, uint32_t key) {
  // A negation, as in XLA (NaNs flip sign too), without a branch in the loop. Under jit
  // XLA folds the negations of (-g) * (-g) and of (-lr) * (-g): without L2 weight decay
  // those products are of the gradient as given (they differ only in a NaN's sign).
  const uint32_t sign_flip = maximize ? 0x80000000u : 0u;
  if constexpr (kRule == kRowwiseAdagrad) {
    for (int64_t j = 0; j < row_size; ++j) {
      const float g_given = g[j];
      float gj = WithBits(Bits(g_given) ^ sign_flip);
      if constexpr (kDecay == kL2) gj = gj + c.decay * p[j];
      g[j] = kDecay == kL2 ? gj : g_given;
      scratch[j] = kDecay == kL2 ? gj * gj : g_given * g_given;
    }
    float mean_square = PairwiseSum(scratch, row_size);
    if (row_size != 1) mean_square = mean_square * c.c;
    const float total = StoreMoment<kStochastic>(s, ToFloat(*s) + mean_square, key, 0);
    const float neg_rate = -(c.a / (std::sqrt(total) + c.b));
    // `g` holds the gradient as given without L2 (the folded (-rate) * (-g)).
    const float rate = kDecay == kL2 ? neg_rate : WithBits(Bits(neg_rate) ^ sign_flip);
    for (int64_t j = 0; j < row_size; ++j) {
      float delta = rate * g[j];
      if constexpr (kDecay == kDecoupled) delta = delta - c.decay * p[j];
      g[j] = delta;
    }
  } else {
    const float neg_lr = -c.a;
    uint32_t e = 0;  // j * kElementMultiplier, for stochastic rounding (`StochasticBits`)
    for (int64_t j = 0; j < row_size; ++j, e += kElementMultiplier) {
      const float g_given = g[j];
      float gj = WithBits(Bits(g_given) ^ sign_flip);
      if constexpr (kDecay == kL2) gj = gj + c.decay * p[j];
      const float g_squared = kDecay == kL2 ? gj * gj : g_given * g_given;
      float delta;
      if constexpr (kRule == kAdagrad) {
        const float total = StoreMoment<kStochastic>(&s[j], ToFloat(s[j]) + g_squared, key, e);
        delta = neg_lr * (gj / (std::sqrt(total) + c.b));
      } else {
        float direction =
            StoreMoment<kStochastic>(&s[j], ToFloat(s[j]) * c.b + gj * c.c, key, e);
        if constexpr (kRule == kSgdNesterov) direction = gj + direction * c.b;
        delta = neg_lr * direction;
      }
      if constexpr (kDecay == kDecoupled) delta = delta - c.decay * p[j];
      g[j] = delta;
    }
  }
  if constexpr (kMaxNorm) {
    // `xla._renormalised`: the row p + delta scaled back to max_norm where its norm is above.
    for (int64_t j = 0; j < row_size; ++j) {
      const float updated = p[j] + g[j];
      scratch[j] = updated * updated;
    }
    const float norm = std::sqrt(PairwiseSum(scratch, row_size));
    if (norm > c.max_norm) {
      const float scale = c.max_norm / norm;
      for (int64_t j = 0; j < row_size; ++j) g[j] = (p[j] + g[j]) * scale - p[j];
    }
  }
}

// Runs `body(rule, slot_type, stochastic, decay, max_norm)` with each as a
// compile-time value (`decltype(x)::value`, or the slot's storage type).
template <typename Body>
ffi::Error WithRuleTypes(int64_t rule, ffi::DataType slot_type, bool stochastic, int64_t decay,
                         bool max_norm, Body body) {
  const auto with_norm = [&](auto r, auto t, auto st, auto d) {
    if (max_norm) return body(r, t, st, d, std::true_type{});
    return body(r, t, st, d, std::false_type{});
  };
  const auto with_decay = [&](auto r, auto t, auto st) {
    if (decay == kL2) return with_norm(r, t, st, std::integral_constant<int, kL2>{});
    if (decay == kDecoupled) return with_norm(r, t, st, std::integral_constant<int, kDecoupled>{});
    return with_norm(r, t, st, std::integral_constant<int, kNoDecay>{});
  };
  // Stochastic rounding only stores bfloat16.
  const auto with_slot = [&](auto r) {
    if (slot_type == ffi::DataType::F32) {
      return with_decay(r, float{}, std::false_type{});
    }
    if (stochastic) return with_decay(r, uint16_t{}, std::true_type{});
    return with_decay(r, uint16_t{}, std::false_type{});
  };
  switch (rule) {
    case kSgdMomentum: return with_slot(std::integral_constant<int, kSgdMomentum>{});
    case kSgdNesterov: return with_slot(std::integral_constant<int, kSgdNesterov>{});
    case kAdagrad: return with_slot(std::integral_constant<int, kAdagrad>{});
    default: return with_slot(std::integral_constant<int, kRowwiseAdagrad>{});
  }
}

// The step of a rule with one slot. Inputs: rows s32 (nse,), values
// f32, bf16 or f16 (nse, ...), slot (f32 or bf16: the parameter's shape, (num_rows,) for
// row-wise Adagrad), coeffs f32 (5,) (`RuleCoeffs`), keys
// u32 (2,) (the slot's stochastic-rounding key of this step and the tables'
// first global row, read when `stochastic`), param f32 (its own shape; empty
// without weight decay and max_norm), then table and param_keys (`RoundedRows`: a
// bfloat16 or float16 table whose rows the step rounds stochastically in its pass; empty
// if none). Attributes: num_rows, maximize,
// stochastic, rule (`RuleKind`), decay (0 none, 1 L2, 2 decoupled),
// max_norm. Outputs: the distinct rows then padding, their deltas, the slot
// (aliased to its input, so updated in place when donated), the new rows of the table
// (`RoundedRows`; empty if none).
ffi::Error RuleStepImpl(ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values,
                        ffi::AnyBuffer slot, ffi::Buffer<ffi::F32> coeffs,
                        ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::F32> param,
                        ffi::AnyBuffer table, ffi::Buffer<ffi::U32> param_keys,
                        int64_t num_rows, bool maximize, bool stochastic, int64_t rule,
                        int64_t decay, bool max_norm, ffi::ThreadPool pool,
                        ffi::ResultBuffer<ffi::S32> distinct_rows,
                        ffi::ResultBuffer<ffi::F32> delta, ffi::Result<ffi::AnyBuffer> slot_out,
                        ffi::Result<ffi::AnyBuffer> new_rows) {
  if (rule < kSgdMomentum || rule > kRowwiseAdagrad) return ffi::Error::InvalidArgument("unknown rule");
  if (decay < kNoDecay || decay > kDecoupled) {
    return ffi::Error::InvalidArgument("decay must be 0 (none), 1 (L2) or 2 (decoupled)");
  }
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  if (nse == 0 || num_rows <= 0) return ffi::Error::InvalidArgument("no entries or no rows");
  const int64_t row_size = RowSize(values.element_count(), nse);
  const int64_t slot_row_size = rule == kRowwiseAdagrad ? 1 : row_size;
  if (row_size <= 0 ||
      static_cast<int64_t>(slot.element_count()) != num_rows * slot_row_size) {
    return ffi::Error::InvalidArgument("the slot must hold num_rows rows of the rule's size");
  }
  const bool reads_param = decay != kNoDecay || max_norm;
  if (reads_param && static_cast<int64_t>(param.element_count()) != num_rows * row_size) {
    return ffi::Error::InvalidArgument("param must hold num_rows rows of the values' size");
  }
  if (slot.element_type() != ffi::DataType::F32 &&
      slot.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("the slot must be float32 or bfloat16");
  }
  if (coeffs.element_count() != kNumRuleCoeffs || keys.element_count() != 2) {
    return ffi::Error::InvalidArgument("coeffs must be (5,) and keys (2,)");
  }
  RoundedRows rounded;
  if (auto error = rounded.Prepare(table, param_keys, new_rows, delta->typed_data(), nse,
                                   num_rows, row_size);
      error.failure()) {
    return error;
  }
  // Weight decay and max_norm read the float32 `param`; a 16-bit table is not read as
  // one (its rows would have to be widened first): on such a table they keep the generic
  // kernels (`kernels._moment_step_applies`, `rule_steps.rounds_in_pass`).
  if (rounded.active() && reads_param) {
    return ffi::Error::InvalidArgument(
        "a table rounded in the step's pass takes no weight decay or max_norm");
  }
  // Without donation XLA gives a fresh output buffer: start from the input.
  CopyIfNotAliased(slot, slot_out);
  const float* c = coeffs.typed_data();
  const RuleCoeffs scalars{c[0], c[1], c[2], c[3], c[4]};
  const uint32_t slot_key = keys.typed_data()[0];
  const uint32_t row_offset = keys.typed_data()[1];
  const float* p = reads_param ? param.typed_data() : nullptr;
  const ffi::Error error = WithRuleTypes(rule, slot.element_type(), stochastic, decay, max_norm,
                       [&](auto r, auto t, auto st, auto d, auto norm) {
    using T = decltype(t);
    constexpr int kRule = decltype(r)::value;
    constexpr bool kStochastic = decltype(st)::value;
    T* s = static_cast<T*>(slot_out->untyped_data());
    return WithValues(values, [&](const auto* vals) {
      CoalescedRowsStep(
          rows.typed_data(), nse, vals, num_rows, row_size, pool, distinct_rows->typed_data(),
          delta->typed_data(),
          [&](int64_t row) {
            PrefetchRow(s + row * slot_row_size, slot_row_size);
            if (p != nullptr) PrefetchRow(p + row * row_size, row_size);
            rounded.Prefetch(row);
          },
          [&](int64_t row, int64_t, float* g) {
            thread_local std::vector<float> scratch;
            if (static_cast<int64_t>(scratch.size()) < row_size) scratch.resize(row_size);
            RuleRow<kRule, T, kStochastic, decltype(d)::value, decltype(norm)::value>(
                g, s + row * slot_row_size, p == nullptr ? nullptr : p + row * row_size,
                scratch.data(), row_size, maximize, scalars,
                kStochastic ? RowKey(slot_key, row + row_offset) : 0u);
            rounded.Row(row, g);  // every rule's one epilogue
          });
      return ffi::Error::Success();
    });
  });
  if (error.failure()) return error;
  rounded.ZeroPadding(distinct_rows->typed_data(), nse, num_rows);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaRuleStepF32, RuleStepImpl,
                              RowStepOutputs(RowStepAttrs(RowStepBinding()
                                                              .Arg<ffi::AnyBuffer>()
                                                              .Arg<ffi::Buffer<ffi::F32>>()
                                                              .Arg<ffi::Buffer<ffi::U32>>()
                                                              .Arg<ffi::Buffer<ffi::F32>>()
                                                              .Arg<ffi::AnyBuffer>()
                                                              .Arg<ffi::Buffer<ffi::U32>>())
                                                 .Attr<int64_t>("rule")
                                                 .Attr<int64_t>("decay")
                                                 .Attr<bool>("max_norm"))
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
