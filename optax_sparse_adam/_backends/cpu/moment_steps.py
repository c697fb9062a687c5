"""The FFI calls of the Adam and row-wise Adam kernel variants (`kernels.cc`), and their inputs.

`kernels.py` decides where a variant applies; these build its call: the
step's scalars computed in XLA as `xla.masked_step` computes them (so the two
paths round alike), the tables in their own shapes (a reshape would make XLA
copy an operand the kernel updates in place) and, for the pipeline's options,
the parameter (weight decay), the running max (amsgrad), each entry's step size
(per-row bias correction: the rows' step counts are counted by a small kernel
of their own first, `_entry_step_counts`) and the rows' last steps (catch-up).
Unused buffers are empty. Every table the kernel writes is aliased
to its operand, so it is updated in place when donated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._core import rounding
from optax_sparse_adam._core.errors import is_python_number
from optax_sparse_adam._core.row_rules.adam import AdamRule
from optax_sparse_adam._core.row_rules.rowwise_adam import (
  RowwiseAdamRule,
  bias_corrections,
  inverse_row_size,
)
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan, Tables

FUSED_ADAM = "optax_sparse_adam_fused_adam_f32"
FUSED_ADAM_OPTIONS = "optax_sparse_adam_fused_adam_options_f32"
FUSED_ROWWISE_ADAM = "optax_sparse_adam_fused_rowwise_adam_f32"
# The plain Adam step with 16-bit rows out: a 16-bit table's rows rounded stochastically in
# its pass, or a 16-bit gradient's delta converted to its dtype there.
FUSED_ADAM_ROUNDED = "optax_sparse_adam_fused_adam_rounded_f32"
ENTRY_STEPS = "optax_sparse_adam_entry_steps_s32"
# Under jax.vmap a kernel runs once per batch element (a loop around the call).
VMAP_METHOD = "sequential"


def plain(inputs: StepInputs, plan: StepPlan) -> bool:
  """No weight decay, amsgrad, per-row steps or catch-up: the rule's step alone."""
  tables = inputs.tables
  return (
    plan.config.weight_decay == "none"
    and "nu_max" not in tables.slots
    and tables.row_step is None
    and tables.last_step is None
  )


def adam_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """The Adam variant: the plain kernel, or the one with the pipeline's options."""
  assert isinstance(plan.rule, AdamRule)
  if not plain(inputs, plan):
    return _adam_options_step(inputs, plan, rounded_table(inputs, rounds=False))
  step_size = plan.rule.step_size(inputs.hyper, inputs.step)
  rows, delta, mu, nu = _fused_call(FUSED_ADAM, inputs, plan, [step_size], None)
  return RowsStep(rows, delta, Tables({"mu": mu, "nu": nu}))


SIXTEEN_BITS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def rounds_in_pass(inputs: StepInputs, plan: StepPlan) -> bool:
  """Whether `adam_rounded_step` computes this step: the Adam or row-wise Adam step of a
  bfloat16 or float16 table of the moments' rows, rounded stochastically, with a step
  count (its key), where the fused kernel applies (`kernels.step_applies`); any option
  but weight decay (the kernels read a float32 parameter only)."""
  param = inputs.tables.param
  return (
    isinstance(plan.rule, AdamRule | RowwiseAdamRule)
    and plan.config.weight_decay == "none"
    and plan.config.param_rounding == "stochastic"
    and inputs.step is not None
    and param is not None
    and jnp.dtype(param.dtype) in SIXTEEN_BITS
    and param.size == inputs.tables.slots["mu"].size
  )


def narrows_in_pass(inputs: StepInputs, plan: StepPlan) -> bool:
  """Whether `adam_narrow_step` computes this step: the plain Adam step of a bfloat16 or
  float16 gradient (its delta in the gradient's dtype), not rounded stochastically, where
  the fused kernel applies (`kernels.step_applies`)."""
  return (
    isinstance(plan.rule, AdamRule)
    and plain(inputs, plan)
    and plan.config.param_rounding != "stochastic"
    and jnp.dtype(inputs.values.dtype) in SIXTEEN_BITS
  )


def adam_rounded_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """The Adam or row-wise Adam step of a 16-bit table rounded stochastically, in one
  kernel pass.

  Where `rounds_in_pass`: the kernel's step, each distinct row's new value
  `round(table[row] + delta)` computed in the same pass (`RoundedRows` in row_round.h,
  one epilogue for the plain kernel, `FusedAdamRoundedImpl`, and the option kernels,
  whatever their options) with the parameter's bits (`rounding.kernel_keys` at
  `PARAM_SLOT`), which are those of `xla.rounded_param_rows` and of
  `row_round.add_rounded_rows` (one definition, `row_round.h`). Returns the new rows
  (the table's dtype, zeros at padding) in place of the delta, for the apply to store.
  """
  assert rounds_in_pass(inputs, plan)
  table = rounded_table(inputs, rounds=True)
  if isinstance(plan.rule, RowwiseAdamRule):
    return _rowwise_adam_step(inputs, plan, table)
  if not plain(inputs, plan):
    return _adam_options_step(inputs, plan, table)
  return _adam_16_bit_step(
    inputs, plan, table.table, table.keys, table.table.dtype, narrow_delta=False
  )


class RoundedTable(NamedTuple):
  """A 16-bit table whose rows a kernel rounds in its pass (`RoundedRows` in row_round.h):
  the table, its keys (uint32 `(2,)`) and its new rows' type; empty where none is."""

  table: jax.Array
  keys: jax.Array
  new_rows: jax.ShapeDtypeStruct

  @property
  def rounds(self) -> bool:
    return self.table.size > 0


def rounded_table(inputs: StepInputs, *, rounds: bool) -> RoundedTable:
  """The step's parameter as the table its kernel rounds (`rounds`: the parameter's keys
  of this step, `rounding.kernel_keys` at `PARAM_SLOT`), or the empty buffers of none."""
  param = inputs.tables.param
  if not rounds:
    empty = jax.ShapeDtypeStruct((0,), jnp.bfloat16)
    return RoundedTable(jnp.zeros((0,), jnp.bfloat16), jnp.zeros((2,), jnp.uint32), empty)
  assert param is not None
  keys = rounding.kernel_keys(inputs.step, rounding.PARAM_SLOT, inputs.row_offset)
  new_rows = jax.ShapeDtypeStruct(inputs.values.shape, param.dtype)
  return RoundedTable(param, keys.astype(jnp.uint32), new_rows)


def adam_narrow_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """The plain Adam step of a 16-bit gradient, its delta converted in the kernel's pass.

  Where `narrows_in_pass`: `kernels.in_values_dtype`'s result (the delta in the
  gradient's dtype, to nearest: the bits of XLA's convert) with no convert after the
  kernel (`FusedAdamRoundedImpl` with `narrow_delta`).
  """
  assert narrows_in_pass(inputs, plan)
  dtype = inputs.values.dtype
  keys = jnp.zeros((2,), jnp.uint32)  # unused: nothing rounds stochastically
  return _adam_16_bit_step(inputs, plan, jnp.zeros((0,), dtype), keys, dtype, narrow_delta=True)


def _adam_16_bit_step(
  inputs: StepInputs,
  plan: StepPlan,
  table: jax.Array,
  keys: jax.Array,
  dtype: Any,
  *,
  narrow_delta: bool,
) -> RowsStep:
  """The plain Adam kernel with 16-bit rows out (`FusedAdamRoundedImpl`) in place of the
  delta: the new rows of `table` rounded stochastically, or the delta to nearest."""
  assert isinstance(plan.rule, AdamRule)
  step_size = plan.rule.step_size(inputs.hyper, inputs.step)
  nse = inputs.rows.shape[0]
  rows, _, mu, nu, out = _fused_call(
    FUSED_ADAM_ROUNDED,
    inputs,
    plan,
    [step_size],
    None,
    read=(table, keys.astype(jnp.uint32)),
    more_outputs=(jax.ShapeDtypeStruct(inputs.values.shape, dtype),),
    narrow_delta=narrow_delta,
  )
  assert out.shape[0] == nse
  return RowsStep(rows, out, Tables({"mu": mu, "nu": nu}))


def _rounding_keys(inputs: StepInputs, plan: StepPlan) -> jax.Array:
  """uint32 `(2,)`: mu's stochastic-rounding key of this step (nu, the second slot of
  the pair, rounds with the low half of mu's element hash: `rounding.slot_store`) and
  the tables' first global row (`StepInputs.row_offset`), read if stochastic."""
  names = [slot.name for slot in plan.rule.slots()]
  pair, mu_low = rounding.hash_half(names, "mu")
  if (pair, mu_low) != (rounding.hash_half(names, "nu")[0], False):
    # The kernel draws mu's bits from the top half of one hash and nu's from its low half.
    raise NotImplementedError(f"the Adam kernels need mu and nu to be one pair, not {names}")
  return rounding.kernel_keys(inputs.step, pair, inputs.row_offset)


def _entry_step_counts(inputs: StepInputs) -> tuple[jax.Array, jax.Array]:
  """Per-row steps' counts: each entry's row's count after this step as its bias correction
  counts it (at least 1; float32, what the step sizes convert it to; padding entries:
  unused), and the rows' counts with the touched rows' new ones (in place when donated),
  as `xla.masked_step` gathers, increments and stores them.

  One small kernel (`EntryStepsImpl`), not XLA ops: XLA:CPU splits the gather and
  the selects around it over two threads at a few thousand entries and waits for
  the second, which on a busy machine took longer than the step; and the step's
  kernel then leaves the counts alone (one pass over them, not two).
  """
  row_step = inputs.tables.row_step
  assert row_step is not None
  call = jax.ffi.ffi_call(
    ENTRY_STEPS,
    (
      jax.ShapeDtypeStruct(inputs.rows.shape, jnp.int32),
      jax.ShapeDtypeStruct(inputs.rows.shape, jnp.float32),
      jax.ShapeDtypeStruct(row_step.shape, row_step.dtype),
    ),
    input_output_aliases={1: 2},
    vmap_method=VMAP_METHOD,
  )
  _, counts, new_row_step = call(inputs.rows, row_step)
  return counts, new_row_step


def _decay_coefficient(inputs: StepInputs, plan: StepPlan) -> jax.Array:
  """`wd` (L2), `lr * wd` (decoupled) or 0, in float32 as `xla.masked_step` computes it."""
  f32, hyper = jnp.float32, inputs.hyper
  if plan.config.weight_decay == "l2":
    return jnp.asarray(hyper.weight_decay, f32)
  if plan.config.weight_decay == "decoupled":
    return jnp.asarray(hyper.learning_rate, f32) * jnp.asarray(hyper.weight_decay, f32)
  return jnp.zeros((), f32)


class _OptionArrays(NamedTuple):
  """The option buffers of a fused step (`OptionInputs` in kernels.cc): empty where unused."""

  param: jax.Array
  nu_max: jax.Array
  entry_scales: jax.Array


def _option_arrays(inputs: StepInputs, plan: StepPlan, entry_scales: Any = None) -> _OptionArrays:
  """The step's option buffers; with per-row steps, `entry_scales`: each entry's step-size
  factors, `(nse,)` or `(nse, k)` (the rows' counts are `_entry_step_counts`'s)."""
  tables = inputs.tables
  nu = tables.slots["nu"]
  param = tables.param if plan.config.weight_decay != "none" else None
  f32 = jnp.float32
  return _OptionArrays(
    jnp.zeros((0,), f32) if param is None else param,
    tables.slots.get("nu_max", jnp.zeros((0,), nu.dtype)),
    jnp.zeros((0,), f32) if entry_scales is None else jnp.asarray(entry_scales, f32),
  )


def _new_tables(inputs: StepInputs, mu, nu, nu_max, row_step, last_step=None) -> Tables:
  tables = inputs.tables
  slots = {"mu": mu, "nu": nu}
  if "nu_max" in tables.slots:
    slots["nu_max"] = nu_max
  return Tables(
    slots,
    row_step if tables.row_step is not None else None,
    last_step=last_step if tables.last_step is not None else None,
  )


def _catch_up_coefficients(inputs: StepInputs, plan: StepPlan) -> list[Any]:
  """`lr * wd`, then the constants of `row_rules.adam.idle_rows` as XLA computes them (float32)."""
  f32 = jnp.float32
  hyper = inputs.hyper

  def c(x: Any) -> jax.Array:
    return jnp.asarray(0.0 if x is None else x, f32)

  decoupled = plan.config.weight_decay == "decoupled"
  lr_wd = c(hyper.learning_rate) * c(hyper.weight_decay) if decoupled else c(0.0)
  log_b1, log_b2 = c(hyper.log_b1), c(hyper.log_b2)
  # The idle steps take their own rate (a schedule's at count - 1), as row_rules.adam.idle_rows.
  idle = hyper.for_idle_steps()
  log_d = jnp.log1p(-c(idle.learning_rate) * c(idle.weight_decay)) if decoupled else c(0.0)

  def base(log_x: jax.Array) -> list[jax.Array]:
    # As catch_up.decayed_sum, _geometric_sum and _centroid compute them.
    log_ratio = jnp.asarray(log_x - log_d, f32)
    small = -jnp.abs(jnp.where(jnp.isfinite(log_ratio), log_ratio, -jnp.inf))
    expm1_small = jnp.expm1(jnp.where(small == 0, -1.0, small))
    return [log_x, log_ratio, small, expm1_small, -jnp.expm1(log_x)]

  return [
    lr_wd,
    log_b1,
    log_b2,
    log_d,
    c(idle.learning_rate),
    c(hyper.step_size),
    *base(log_b1),
    *base(log_b1 - 0.5 * log_b2),
  ]


# The catch-up constants after the decay coefficient (`_catch_up_coefficients`).
_NUM_CATCH_UP_CONSTANTS = 15


def _adam_options_step(inputs: StepInputs, plan: StepPlan, rounded: RoundedTable) -> RowsStep:
  """The Adam step with weight decay, amsgrad, per-row steps or catch-up: one FFI call
  (with per-row steps, after `_entry_step_counts`'s).

  The plain step's call with the option buffers (`_OptionArrays`), then the rows'
  last steps (catch-up, updated in place) and this step's count. Equal to
  `xla.masked_step` bit for bit, but with catch-up: there to float32 rounding,
  as the per-row powers and sums of catch-up use the C library's exp and expm1,
  not XLA's (tests/backends/test_cpu_catch_up.py). With a `rounded` table, its new
  rows in place of the delta.
  """
  assert isinstance(plan.rule, AdamRule)
  f32, i32 = jnp.float32, jnp.int32
  hyper, tables, config = inputs.hyper, inputs.tables, plan.config
  catch_up = tables.last_step is not None
  per_row = tables.row_step is not None
  last_step = jnp.zeros((0,), i32) if tables.last_step is None else tables.last_step
  step = jnp.zeros((1,), i32) if inputs.step is None else jnp.reshape(inputs.step, (1,))
  entry_scales = new_row_step = None
  step_size: Any = 0.0
  if per_row:
    counts, new_row_step = _entry_step_counts(inputs)
    sizes = plan.rule.step_size(hyper, counts)
    entry_scales = jnp.broadcast_to(jnp.asarray(sizes, f32), inputs.rows.shape)
  else:
    step_size = plan.rule.step_size(hyper, inputs.step)
  if catch_up:
    extra = _catch_up_coefficients(inputs, plan)[1:]
  else:
    extra = [0.0] * _NUM_CATCH_UP_CONSTANTS
  coefficients = [step_size, _decay_coefficient(inputs, plan), *extra]
  rows, delta, mu, nu, nu_max, last_step, new_rows = _fused_call(
    FUSED_ADAM_OPTIONS,
    inputs,
    plan,
    coefficients,
    _option_arrays(inputs, plan, entry_scales),
    updated=(last_step,),
    read=(step.astype(i32), rounded.table, rounded.keys),
    more_outputs=(rounded.new_rows,),
    decoupled=config.weight_decay == "decoupled",
    catch_up=catch_up,
    # row_rules.adam.idle_rows divides by sqrt(v) + eps unguarded only for a Python eps > 0.
    guard_eps=not (is_python_number(hyper.eps) and hyper.eps > 0),
    given_step_size=hyper.step_size is not None,
    l2=config.weight_decay == "l2",
    amsgrad=plan.rule.amsgrad,
    per_row=per_row,
  )
  delta = new_rows if rounded.rounds else delta
  return RowsStep(rows, delta, _new_tables(inputs, mu, nu, nu_max, new_row_step, last_step))


_DECAY_CODES = {"none": 0, "l2": 1, "decoupled": 2}


def rowwise_adam_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """The row-wise Adam step, with weight decay, amsgrad and per-row steps: one FFI call
  (with per-row steps, after `_entry_step_counts`'s)."""
  return _rowwise_adam_step(inputs, plan, rounded_table(inputs, rounds=False))


def _rowwise_adam_step(inputs: StepInputs, plan: StepPlan, rounded: RoundedTable) -> RowsStep:
  """`rowwise_adam_step`; with a `rounded` table, its new rows in place of the delta."""
  assert isinstance(plan.rule, RowwiseAdamRule)
  f32 = jnp.float32
  config, hyper = plan.config, inputs.hyper
  assert inputs.step is not None  # the optax layer counts the steps of this rule
  per_row = inputs.tables.row_step is not None
  # The same function, so the same bits, as the rule's own bias corrections.
  lr_over_bc1, inv_bc2 = bias_corrections(hyper, inputs.step, f32)
  entry_scales = new_row_step = None
  if per_row:
    counts, new_row_step = _entry_step_counts(inputs)
    entry_scales = jnp.stack(bias_corrections(hyper, counts, f32), 1)
  inv_row_size = inverse_row_size(math.prod(plan.layout.dense_shape), f32)
  coefficients = [lr_over_bc1, inv_bc2, inv_row_size, _decay_coefficient(inputs, plan)]
  rows, delta, mu, nu, nu_max, new_rows = _fused_call(
    FUSED_ROWWISE_ADAM,
    inputs,
    plan,
    coefficients,
    _option_arrays(inputs, plan, entry_scales),
    read=(rounded.table, rounded.keys),
    more_outputs=(rounded.new_rows,),
    decay=_DECAY_CODES[config.weight_decay],
    amsgrad=plan.rule.amsgrad,
    per_row=per_row,
  )
  delta = new_rows if rounded.rounds else delta
  return RowsStep(rows, delta, _new_tables(inputs, mu, nu, nu_max, new_row_step))


def _fused_call(
  target: str,
  inputs: StepInputs,
  plan: StepPlan,
  coefficients: list[Any],
  options: _OptionArrays | None,
  *,
  updated: Sequence[jax.Array] = (),
  read: Sequence[jax.Array] = (),
  more_outputs: Sequence[jax.ShapeDtypeStruct] = (),
  **attributes: Any,
) -> tuple[jax.Array, ...]:
  """One fused step of a rule whose state is `mu` and `nu`: one FFI call.

  The kernel is given the rows, the values, `mu` and `nu`, float32
  `(1 - b1, 1 - b2, eps, *coefficients)`, the rounding keys of this step, then
  (if given) the option buffers and the `updated` and `read` arrays, with the
  attributes `num_rows`, `maximize`, `stochastic` and `attributes`. Tables come
  in their own shapes (a reshape would make XLA copy an operand the kernel
  updates in place). Returns the distinct rows then padding, their deltas, the
  new `mu` and `nu` (float32 or bfloat16), then the new `nu_max`
  (with options) and the new `updated` arrays, each aliased to its operand (in
  place when donated), then the kernel's `more_outputs`.
  """
  f32, hyper = jnp.float32, inputs.hyper
  mu, nu = inputs.tables.slots["mu"], inputs.tables.slots["nu"]
  coefficients = [hyper.one_minus_b1, hyper.one_minus_b2, hyper.eps, *coefficients]
  args = [
    inputs.rows,
    inputs.values,
    mu,
    nu,
    jnp.stack([jnp.asarray(x, f32) for x in coefficients]),
    _rounding_keys(inputs, plan),
  ]
  written = [(2, mu), (3, nu)]
  if options is not None:
    written += [(len(args) + 1, options.nu_max)]
    args += list(options)
  written += [(len(args) + i, x) for i, x in enumerate(updated)]
  args += [*updated, *read]
  out_types = (
    jax.ShapeDtypeStruct(inputs.rows.shape, jnp.int32),
    jax.ShapeDtypeStruct(inputs.values.shape, f32),
    *(jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in written),
    *more_outputs,
  )
  call = jax.ffi.ffi_call(
    target,
    out_types,
    input_output_aliases={arg: out for out, (arg, _) in enumerate(written, start=2)},
    vmap_method=VMAP_METHOD,
  )
  return tuple(
    call(
      *args,
      num_rows=plan.layout.num_rows,
      maximize=plan.config.maximize,
      stochastic=plan.config.moment_rounding == "stochastic",
      **attributes,
    )
  )
