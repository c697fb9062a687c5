"""The masked step and the apply in plain XLA ops: every backend, rule, dtype and option.

The rows are coalesced (`_core.coalesce`; by default the generic way, which may
use a donated slot table as scratch to number the distinct rows), the rule's
slots gathered, the rule applied (`rules.RowRule.update`), and the new rows
scattered back in place.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._core import bcoo, coalesce, rounding
from optax_sparse_adam._core.row_rules.adam import pinned, rounded, rounded_if_narrow
from optax_sparse_adam._core.row_sum import pairwise_row_sum
from optax_sparse_adam._core.rules import (
  IdleBlock,
  RowBlock,
  RowsStep,
  StepInputs,
  StepPlan,
  Tables,
  catch_up_of,
  reads_param,
  sets_rows,
)

# Stores rows into a table in its own shape: `(table, rows, values) -> table`.
RowStore = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def masked_step(
  inputs: StepInputs,
  plan: StepPlan,
  *,
  coalescer: coalesce.Coalescer | None = None,
  through_bits: bool = True,
  store_rows: RowStore | None = None,
) -> RowsStep:
  """One parameter's masked step in XLA ops (a `protocol.StepBackend`).

  Args:
    inputs: the step's arrays and hyper-parameters.
    plan: the row layout, the rule and the static switches.
    coalescer: how the rows are coalesced; None is
      `coalesce.coalesce_and_gather_rows`, looked up when the step is traced.
    through_bits: whether bfloat16 (and 8-bit float) tables are stored through
      their bits (`bcoo.set_rows`): XLA:CPU converts the whole table to float32
      and back around a bfloat16 scatter.
    store_rows: how the slots' new rows are stored, `store_rows(table, rows,
      values) -> table` (the table in its own shape; a set of the same bits as
      `bcoo.scatter_rows`, e.g. the CPU's in-place kernel), or None: XLA's scatter.

  Returns:
    The `RowsStep`: distinct rows, their deltas, the new tables.
  """
  layout, rule, config = plan
  coalescer = coalescer or coalesce.coalesce_and_gather_rows
  compute_dtype = config.compute_dtype
  tables = inputs.tables
  slots = rule.slots()

  def as_rows(table: jax.Array, per_row: bool) -> jax.Array:
    return table if per_row else bcoo.as_rows(table, layout)

  # The slots' old rows are gathered while the gradient is coalesced; one slot
  # table may come back holding scratch values in the touched rows, which the
  # scatters below overwrite.
  reads, sets = reads_param(rule), sets_rows(rule)
  rounds = config.param_rounding == "stochastic"
  needs_param = (
    config.weight_decay != "none" or config.max_norm is not None or reads or sets or rounds
  )
  if needs_param:
    assert tables.param is not None  # the optax layer checks it
  # The parameter's and the step tables' rows are gathered with the slots' (never scratch).
  coalesced, gathered, scattered_into = coalescer(
    inputs.rows,
    inputs.values,
    layout.num_rows,
    [as_rows(tables.slots[slot.name], slot.per_row) for slot in slots],
    (
      bcoo.as_rows(_present(tables.param), layout) if needs_param else None,
      tables.row_step,
      tables.last_step,
    ),
  )
  gathered_param, gathered_row_step, gathered_last_step = gathered[len(slots) :]
  # Every slot table given is an array, so every gathered row block and table is one.
  old_rows = [_present(rows) for rows in gathered[: len(slots)]]
  slot_tables = [_present(table) for table in scattered_into]
  rows = coalesced.rows
  g = coalesced.values.astype(compute_dtype)
  if config.maximize:
    g = -g
  param_rows = None
  if needs_param:
    param_rows = _present(gathered_param).astype(compute_dtype)
    if config.weight_decay == "l2":
      # Both terms are rounded where they stand (`rounded`), as the CPU kernels (built
      # without contraction) and op-by-op steps compute them: under jit XLA would
      # otherwise fuse the product and the sum into one FMA, and start the sum of
      # the gradient's entries from the decay instead of adding it last.
      wd = jnp.asarray(inputs.hyper.weight_decay, compute_dtype)
      g = rounded(g, inputs.opaque_zero) + rounded(wd * param_rows, inputs.opaque_zero)

  old_param_rows = param_rows  # as gathered (catch-up may shift param_rows)
  step = inputs.step
  row_step = tables.row_step

  def put(table_rows: jax.Array, values: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`table[rows] = values`, the table given as rows, returned in `shape`."""
    if store_rows is not None:
      return store_rows(table_rows.reshape(shape), rows, values)
    return bcoo.scatter_rows(table_rows, rows, values, through_bits=through_bits).reshape(shape)

  if row_step is not None:
    new_row_steps = optax.safe_increment(_present(gathered_row_step))
    step = jnp.maximum(new_row_steps, 1)
    step = step.reshape(step.shape + (1,) * len(layout.dense_shape))
    row_step = put(row_step, new_row_steps, row_step.shape)

  slot_rows = {slot.name: old for slot, old in zip(slots, old_rows, strict=True)}
  last_step = tables.last_step
  shift = None
  shifted_param = False  # whether param_rows holds the idle steps' shift
  if last_step is not None:
    # Catch-up: the rows' idle steps first, as the rule's dense form would have taken them.
    assert inputs.step is not None  # the optax layer gives a step with catch-up
    closed_form = catch_up_of(rule, config).rows
    assert closed_form is not None  # the optax layer keeps no last steps otherwise
    last_rows = _present(gathered_last_step)
    last = last_rows.reshape(last_rows.shape + (1,) * len(layout.dense_shape))
    idle = jnp.maximum(inputs.step - 1 - last, 0)
    caught = closed_form(IdleBlock(slot_rows, idle, last, compute_dtype), inputs.hyper)
    slot_rows, shift = caught.slot_rows, caught.shift
    # The caught-up slots are read back by the rule below.
    slot_rows = {name: rounded_if_narrow(x, inputs.opaque_zero) for name, x in slot_rows.items()}
    if caught.decay_minus_one is not None:
      assert param_rows is not None
      shift = shift + caught.decay_minus_one * param_rows
      param_rows = param_rows + shift
      shifted_param = True
    # The step, as a function of the gathered rows (each row's last step is below
    # it): the scatter then follows the gather, and XLA updates the table in place
    # instead of copying it.
    last_step = put(last_step, jnp.maximum(last_rows, inputs.step), last_step.shape)

  store = rounding.slot_store(
    config.moment_rounding,
    slot_names=tuple(slot.name for slot in slots),
    dtypes={slot.name: tables.slots[slot.name].dtype for slot in slots},
    step=inputs.step,
    rows=rows,
    row_offset=inputs.row_offset,
  )

  # A rule that reads the parameter sees its rows as the idle steps left them.
  read_rows = None
  if reads:
    assert param_rows is not None
    read_rows = param_rows if shift is None or shifted_param else param_rows + shift
  delta, new_rows = rule.update(
    RowBlock(g, slot_rows, step, compute_dtype, inputs.opaque_zero, store, read_rows),
    inputs.hyper,
  )
  check_slot_rows(rule, new_rows)
  decoupled = None
  if config.weight_decay == "decoupled":
    assert param_rows is not None
    lr_wd = jnp.asarray(inputs.hyper.learning_rate, compute_dtype) * jnp.asarray(
      inputs.hyper.weight_decay, compute_dtype
    )
    decoupled = rounded(lr_wd * param_rows, inputs.opaque_zero)
  valid = rows < layout.num_rows
  valid = valid.reshape(valid.shape + (1,) * len(layout.dense_shape))
  if sets:
    # The rule gave the rows' new values (which the idle steps' shift is in): the
    # options act on them, and they are rounded once, to the parameter's dtype.
    assert tables.param is not None
    new = delta.astype(compute_dtype)
    if decoupled is not None:
      new = new - decoupled
    if config.max_norm is not None:
      new = _renormalised_rows(new, config.max_norm, inputs.opaque_zero)
    store_param = rounding.param_store(
      config.param_rounding,
      dtype=tables.param.dtype,
      step=inputs.step,
      rows=rows,
      row_offset=inputs.row_offset,
    )
    delta = jnp.where(valid, store_param(new), jnp.zeros((), tables.param.dtype))
  else:
    if decoupled is not None:
      delta = delta - decoupled
    if shift is not None:
      delta = delta + shift
    if config.max_norm is not None:
      assert param_rows is not None
      delta = _renormalised(param_rows, delta, config.max_norm, inputs.opaque_zero)
    if rounds:
      assert old_param_rows is not None
      delta = rounded_param_rows(inputs, plan, rows, old_param_rows, delta)
    else:
      delta = jnp.where(valid, delta, jnp.zeros((), delta.dtype)).astype(inputs.values.dtype)

  new_slots = {
    slot.name: put(table, new_rows[slot.name], tables.slots[slot.name].shape)
    for slot, table in zip(slots, slot_tables, strict=True)
  }
  return RowsStep(rows, delta, Tables(new_slots, row_step, last_step=last_step))


def rounded_param_rows(
  inputs: StepInputs, plan: StepPlan, rows: jax.Array, param_rows: jax.Array, delta: jax.Array
) -> jax.Array:
  """The new rows `param_rows + delta` of a step that rounds them stochastically, in the
  parameter's dtype (`rounding.param_store`); padding rows zero.

  `param_rows` are the rows as gathered and `delta` the step's update of them, both
  in the compute dtype. The delta is rounded where it stands (`pinned`), so that
  XLA fuses no product of it into the sum: a fused kernel's delta (an output,
  rounded) then gives the same rows (`dispatch`).
  """
  param = inputs.tables.param
  assert param is not None
  store = rounding.param_store(
    plan.config.param_rounding,
    dtype=param.dtype,
    step=inputs.step,
    rows=rows,
    row_offset=inputs.row_offset,
  )
  new = param_rows + pinned(delta.astype(param_rows.dtype), inputs.opaque_zero)
  valid = rows < plan.layout.num_rows
  valid = valid.reshape(valid.shape + (1,) * len(plan.layout.dense_shape))
  return jnp.where(valid, store(new), jnp.zeros((), param.dtype))


def check_slot_rows(rule: Any, new_rows: Any) -> None:
  """Refuses, when the step is traced, a rule's update that does not return its slots' rows."""
  declared = [slot.name for slot in rule.slots()]
  given = list(new_rows) if isinstance(new_rows, dict) else None
  if given is None or set(given) != set(declared):
    extra = sorted(set(given or ()) - set(declared))
    missing = sorted(set(declared) - set(given or ()))
    raise ValueError(
      f"the {rule.name!r} rule's update returned new rows for slots {given}, but the rule "
      f"declares {declared} (slots()): "
      + (f"{extra} not declared; " if extra else "")
      + (f"{missing} missing; " if missing else "")
      + "return a dict with exactly one entry per declared slot."
    )


def _renormalised_rows(new: jax.Array, max_norm: float, opaque_zero: jax.Array | None) -> jax.Array:
  """`new` with each row whose L2 norm exceeds `max_norm` scaled to it (`_renormalised`'s order)."""
  n = new.shape[0]
  squares = rounded(new * new, opaque_zero).reshape(n, math.prod(new.shape[1:]))  # n may be 0
  norm = jnp.sqrt(pairwise_row_sum(squares)).reshape((n,) + (1,) * (new.ndim - 1))
  scale = jnp.where(norm > max_norm, jnp.asarray(max_norm, new.dtype) / norm, 1)
  return jnp.where(norm > max_norm, rounded(new * scale, opaque_zero), new)


def _renormalised(
  param_rows: jax.Array, delta: jax.Array, max_norm: float, opaque_zero: jax.Array | None
) -> jax.Array:
  """The delta that leaves each row at `p + delta` scaled to norm `max_norm` where it is above.

  FBGEMM's `max_norm`: after the step, a row whose L2 norm exceeds it is
  multiplied by `max_norm / norm` (to an ulp of FBGEMM's, which stores the
  scaled row, where the apply adds the difference). The squares are summed in
  `pairwise_row_sum`'s fixed order and the products rounded where they stand
  (`rounded`), as the CPU kernel (rule_kernels.cc) computes them.
  """
  new = param_rows + delta
  n = new.shape[0]
  squares = rounded(new * new, opaque_zero).reshape(n, math.prod(new.shape[1:]))  # n may be 0
  norm = jnp.sqrt(pairwise_row_sum(squares)).reshape((n,) + (1,) * (new.ndim - 1))
  scale = jnp.where(norm > max_norm, jnp.asarray(max_norm, new.dtype) / norm, 1)
  return jnp.where(norm > max_norm, rounded(new * scale, opaque_zero) - param_rows, delta)


def _present(x: jax.Array | None) -> jax.Array:
  assert x is not None
  return x


def scatter_add(
  param: jax.Array,
  rows: jax.Array,
  values: jax.Array,
  *,
  layout: bcoo.RowLayout,
  rows_unique: bool,
  rows_sorted: bool,
  through_bits: bool = True,
) -> jax.Array:
  """`param[rows] += values` in XLA ops; out-of-range (padding) rows are dropped.

  `values` are cast to `param`'s dtype first. With `through_bits`, a bfloat16
  parameter is not scatter-added (XLA:CPU converts the whole table to float32
  and back around that): its touched rows are gathered, each row's values
  added to it in float32 in input order, rounded once to bfloat16 and stored
  through `bcoo.set_rows`. That is XLA:CPU's arithmetic bit for bit; it is
  also the correctly rounded sum `param + value` of a row with one entry
  (float32 has more than twice bfloat16's significand bits plus two, so
  rounding twice is rounding once).
  """
  param_rows = bcoo.as_rows(param, layout)
  values = values.astype(param_rows.dtype)
  if rows.shape[0] == 0:  # an update with no entries (shapes are static)
    return param
  if not through_bits or param_rows.dtype != jnp.bfloat16:
    added = param_rows.at[rows].add(
      values, mode="drop", unique_indices=rows_unique, indices_are_sorted=rows_sorted
    )
    return added.reshape(param.shape)
  wide = jnp.float32
  if rows_unique:
    distinct = rows
    old = param_rows.at[rows].get(
      mode="fill", fill_value=0, unique_indices=True, indices_are_sorted=rows_sorted
    )
    sums = old.astype(wide) + values.astype(wide)
  else:
    # Repeated rows are added one after the other into one float32 row each.
    sorted_rows = coalesce.sort_rows(rows, layout.num_rows)
    slot = coalesce.segments_by_search(rows, sorted_rows, layout.num_rows)
    distinct, rows_sorted = sorted_rows.unique_rows, True
    sums = (
      bcoo.gather_rows(param_rows, distinct)
      .astype(wide)
      .at[slot]
      .add(values.astype(wide), mode="drop")
    )
  stored = bcoo.set_rows(
    param_rows, distinct, sums, mode="drop", unique_indices=True, indices_are_sorted=rows_sorted
  )
  return stored.reshape(param.shape)


def store_rows(
  param: jax.Array,
  rows: jax.Array,
  values: jax.Array,
  *,
  layout: bcoo.RowLayout,
  rows_unique: bool,
  rows_sorted: bool,
  through_bits: bool = True,
) -> jax.Array:
  """`param[rows] = values` in XLA ops (a rule's set rows); out-of-range (padding) rows dropped.

  `values` are cast to `param`'s dtype (a set rows update holds them in it: the
  cast is exact). With `through_bits`, a bfloat16 or 8-bit float table is
  written through its bits (`bcoo.set_rows`), a set of the same bits.
  """
  if rows.shape[0] == 0:  # an update with no entries (shapes are static)
    return param
  param_rows = bcoo.as_rows(param, layout)
  flags: dict[str, Any] = {
    "mode": "drop",
    "unique_indices": rows_unique,
    "indices_are_sorted": rows_sorted,
  }
  if through_bits:
    stored = bcoo.set_rows(param_rows, rows, values, **flags)
  else:
    stored = param_rows.at[rows].set(values.astype(param_rows.dtype), **flags)
  return stored.reshape(param.shape)
