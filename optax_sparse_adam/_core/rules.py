"""Row rules, and the values that carry one parameter's step from the optax layer to a backend.

A row rule is an optimizer reduced to what differs between optimizers, in the
shape of FBGEMM's optimizer codegen: it declares its state per row (`slots`:
full-width tables like Adam's m and v, or one scalar per row like a row-wise
second moment) and its update of a block of coalesced rows (`update`). One
pipeline runs every rule (`_backends.xla.masked_step`, which every backend
shares or matches bit for bit):

  rows, g   = coalesce(gradient)                 (duplicates summed, `_core.coalesce`)
  s[name]   = slot tables gathered at the rows   (for each of `rule.slots()`)
  g         = -g if maximize;  g += wd * p[rows] if L2 weight decay
  t         = the parameter's step, or each row's own (per-row step counts)
  delta, s' = rule.update(RowBlock(g, s, t, ...), hyper)  (s' rounded to each
                                                  slot's dtype by `store`)
  delta    -= lr * wd * p[rows] if decoupled weight decay
  delta     = max_norm * (p + delta) / |p + delta| - p  where |p + delta| > max_norm (if set)
  slot tables[rows] = s'                         (touched rows only)

What is fixed when a step is traced travels apart from what is traced: a
`StepPlan` (the row layout, the rule, a `StepConfig`; hashable) against
`StepInputs` (arrays, and the rule's hyper-parameters as floats or arrays).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from optax_sparse_adam._core.bcoo import RowLayout
from optax_sparse_adam._core.rounding import MomentRounding, ParamRounding, SlotStore
from optax_sparse_adam._core.sharded import sharding

WeightDecay = Literal["none", "l2", "decoupled"]


class Slot(NamedTuple):
  """One table of a rule's state.

  Attributes:
    name: the slot's key in the rule's tables (and its field in the optax state).
    per_row: one value per row, shape `(num_rows,)`, instead of the parameter's
      shape.
    dtype_of: the slot whose dtype setting this one follows (e.g. a running max
      of `nu` is stored like `nu`); None: its own.
    init: the value every entry starts at (Adagrad's `initial_accumulator_value`).
  """

  name: str
  per_row: bool = False
  dtype_of: str | None = None
  init: float = 0.0


class RowRule(Protocol):
  """An optimizer's per-row state and its update of a block of rows: hashable, static.

  A rule's hyper-parameters are a NamedTuple of floats or 0-d arrays with at
  least the fields `learning_rate` and `weight_decay` (None where unused): the
  pipeline reads those two for weight decay and hands the whole to `update`.

  A rule may also declare how its dense form moves the rows a step does not
  touch: `catch_up(config: StepConfig) -> CatchUp` (`STILL`, a closed form of
  the idle steps, or why there is none). Without it, catch-up is refused.

  Two optional class attributes (read by `reads_param` and `sets_rows`; False
  where absent) let a rule see and replace the parameter's rows:

  - `reads_param = True`: `RowBlock.param` holds the parameter's old rows (the
    step then needs `params` in `update`, as for weight decay);
  - `sets_rows = True`: `update` returns the rows' new values instead of their
    deltas, and `apply_updates` stores them as they are (`SetRowsUpdate`):
    `w_new`, not `w + (w_new - w)`, so an exact zero stays zero (FTRL's L1).
  """

  @property
  def name(self) -> str:
    """Names the rule (and its fused CPU kernel, where one is registered)."""
    ...

  def slots(self) -> tuple[Slot, ...]:
    """The rule's tables, in the order the pipeline gathers them."""
    ...

  def update(self, block: RowBlock, hyper: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The update of a block of `n` coalesced rows (`RowBlock`), under `hyper`.

    Returns:
      `(delta, new_slot_rows)`: the signed parameter update of each row (before
      decoupled weight decay; with `sets_rows`, the rows' new values instead)
      and every slot's new rows, in the slot's dtype.
      Every slot must be returned: the pipeline may have used a slot table as
      scratch in the touched rows (`coalesce.segments_by_marking`).
    """
    ...


class IdleBlock(NamedTuple):
  """A block of `n` rows to catch up over their idle steps, as a rule's closed form sees it.

  Attributes:
    slots: each slot's rows, in its storage dtype (as `RowBlock.slots`).
    idle: int32 `(n, 1, ...)`: the number of idle (zero-gradient) steps `k` of each row.
    last_step: int32 `(n, 1, ...)`: the step `t0` of each row's last update.
    compute_dtype: the dtype of the arithmetic.
  """

  slots: Mapping[str, jax.Array]
  idle: jax.Array
  last_step: jax.Array
  compute_dtype: Any


class CaughtUp(NamedTuple):
  """What catching a block of rows up over their idle steps gives the pipeline.

  Attributes:
    slot_rows: the rule's slots at the rows, after the idle steps (every slot).
    shift: the parameter's move over the idle steps, besides decoupled weight
      decay (`(n, *dense_shape)`, or a scalar 0).
    decay_minus_one: `d^k - 1` per row (decoupled weight decay over the idle
      steps, applied to the parameter by the pipeline), or None without it.
  """

  slot_rows: dict[str, jax.Array]
  shift: jax.Array
  decay_minus_one: jax.Array | None


class CatchUp(NamedTuple):
  """How a rule's dense form moves a row it does not touch (a rule's `catch_up` hook).

  One of three, for a `StepConfig`:

  - `STILL` (both None): under the dense optimizer an idle row's gradient is
    zero and nothing moves (SGD, Adagrad): lazy is dense, catching up is the identity;
  - `rows` given: the closed form of `k` idle steps of a block of rows,
    `rows(IdleBlock, hyper) -> CaughtUp`;
  - `refused` given: why the idle steps have no closed form (in a sentence that
    follows "because").

  Attributes:
    rows: the closed form, or None.
    refused: the reason there is none, or None.
  """

  rows: Callable[[IdleBlock, Any], CaughtUp] | None = None
  refused: str | None = None


STILL = CatchUp()


def still_without_weight_decay(config: StepConfig) -> CatchUp:
  """`STILL` for an accumulating rule (Adagrad's): a zero gradient adds nothing, so an
  idle row does not move under the dense optimizer, unless weight decay moves it."""
  if config.weight_decay == "none":
    return STILL
  return CatchUp(
    refused="under weight decay the dense optimizer moves idle rows, and with L2 decay "
    "their gradient weight_decay * p enters the accumulator: no closed form"
  )


def reads_param(rule: Any) -> bool:
  """Whether the rule reads the parameter's old rows (`RowBlock.param`; `RowRule`)."""
  return bool(getattr(rule, "reads_param", False))


def sets_rows(rule: Any) -> bool:
  """Whether the rule's `update` returns the rows' new values instead of deltas (`RowRule`)."""
  return bool(getattr(rule, "sets_rows", False))


def stores_rows(rule: Any, config: StepConfig) -> bool:
  """Whether a step returns the parameter's new rows, to be stored (`SetRowsUpdate`): the
  rule sets rows, or the step rounds them stochastically (`StepConfig.param_rounding`)."""
  return sets_rows(rule) or config.param_rounding == "stochastic"


def catch_up_of(rule: Any, config: StepConfig) -> CatchUp:
  """The rule's `catch_up(config)` hook; refused for a rule that declares none."""
  hook = getattr(rule, "catch_up", None)
  if hook is None:
    return CatchUp(
      refused=f"the {rule.name!r} rule declares no closed form of its idle steps (no "
      "catch_up method: see docs/architecture.md, Adding a rule)"
    )
  return hook(config)


class RowBlock(NamedTuple):
  """A block of `n` coalesced rows, as a rule's `update` sees it.

  Attributes:
    grad: `(n, *dense_shape)` summed gradient rows in `compute_dtype`, with
      maximize and L2 weight decay applied.
    slots: each slot's old rows, in its storage dtype: `(n, *dense_shape)` for
      a full-width slot, `(n,)` for a per-row one.
    step: int32, the step count this update makes: a scalar (the parameter's),
      or `(n, 1, ...)` (each row's, broadcastable to `grad`); None where the
      caller gave none (`StepInputs.step`).
    compute_dtype: the dtype of the arithmetic.
    opaque_zero: an int32 zero known only at run time, or None; when given,
      products are rounded before they are added (`adam.rounded`).
    store: `store(name, rows)` rounds a slot's new rows (in `compute_dtype`) to
      the slot's dtype, as the step's `StepConfig.moment_rounding` asks; a rule
      computes with the stored values, as they will be read back. None:
      `astype` (round to nearest).
    param: the parameter's old rows `(n, *dense_shape)` in `compute_dtype`
      (after the idle steps' shift, with catch-up), for a rule that declares
      `reads_param`; else None.
  """

  grad: jax.Array
  slots: Mapping[str, jax.Array]
  step: jax.Array | None
  compute_dtype: Any
  opaque_zero: jax.Array | None = None
  store: SlotStore | None = None
  param: jax.Array | None = None


class StepConfig(NamedTuple):
  """The static switches of a step, fixed at trace time (hashable).

  Attributes:
    maximize: ascend instead of descend (the summed gradient is negated).
    weight_decay: "none"; "l2" (`g += wd * p`, before the rule); or
      "decoupled" (`delta -= lr * wd * p`, after it), on the touched rows.
    compute_dtype: the dtype of the arithmetic (float32 or wider).
    moment_rounding: how new slot rows are rounded to a narrower storage
      dtype: "nearest", or "stochastic" (`_core.rounding`; bf16 slots).
    max_norm: after the step, each touched row whose L2 norm exceeds it is
      scaled back to it (FBGEMM's `max_norm`); None: no renormalisation.
    param_rounding: how the parameter's new rows `w + delta` are rounded to
      its dtype: "nearest" (the apply adds the delta), or "stochastic" (a
      bfloat16 or float16 table only, `_core.rounding`: the step reads the
      rows, rounds `w + delta` and returns the rounded rows, which the apply
      stores; `stores_rows`).
  """

  maximize: bool = False
  weight_decay: WeightDecay = "none"
  compute_dtype: Any = jnp.dtype(jnp.float32)
  moment_rounding: MomentRounding = "nearest"
  max_norm: float | None = None
  param_rounding: ParamRounding = "nearest"


class StepPlan(NamedTuple):
  """What a backend needs to know when it traces a step: all static."""

  layout: RowLayout
  rule: RowRule
  config: StepConfig


class Tables(NamedTuple):
  """The arrays of one parameter's step that are indexed by its rows.

  Attributes:
    slots: the rule's tables by slot name: parameter-shaped (a backend views
      them as rows as it needs: an in-place kernel must not see a reshaped
      copy), or `(num_rows,)` for a per-row slot.
    row_step: int32 `(num_rows,)` steps of each row, or None (one step for all).
    param: the parameter, read for weight decay (never written), or None.
    last_step: int32 `(num_rows,)`, the step up to which each row is caught up
      (catch-up of idle rows, `_core.catch_up`), or None (lazy: idle rows wait).
  """

  slots: dict[str, jax.Array]
  row_step: jax.Array | None = None
  param: jax.Array | None = None
  last_step: jax.Array | None = None


class StepInputs(NamedTuple):
  """The traced inputs of one parameter's step.

  Attributes:
    rows: int32 `(nse,)` row ids (`bcoo.linear_rows`; padding is `num_rows`).
    values: `(nse, *dense_shape)` gradient entries.
    tables: the rule's tables and the optional arrays.
    step: int32 scalar, the parameter's step count after this step, or None
      where the rule needs none (a step size given in `hyper`).
    hyper: the rule's hyper-parameters (floats or arrays).
    opaque_zero: an int32 zero known only at run time, or None.
    row_offset: int32 scalar, the global row of the tables' first row, or None
      (0): a shard of a row-split table (the routed step) gives its first row,
      so that stochastic rounding keys on global rows, as one device does.
  """

  rows: jax.Array
  values: jax.Array
  tables: Tables
  step: jax.Array | None
  hyper: Any
  opaque_zero: jax.Array | None = None
  row_offset: jax.Array | None = None


class RowsStep(NamedTuple):
  """What a backend returns for one parameter's step.

  Attributes:
    rows: int32 `(nse,)` distinct rows, ascending, then padding slots
      (`bcoo.CoalescedRows`).
    delta: the signed parameter update of each slot, in the gradient's dtype;
      zero in padding slots. For a rule that `sets_rows`: the rows' new values,
      in the parameter's dtype (stored as they are by the apply).
    tables: the new `Tables` (without `param`).
  """

  rows: jax.Array
  delta: jax.Array
  tables: Tables


def init_tables(
  rule: RowRule,
  param: jax.Array,
  *,
  dtypes: Mapping[str, Any] | None = None,
  per_row_steps: bool = False,
  sparse_dims: int = 1,
  last_steps: bool = False,
) -> Tables:
  """Zero slot tables for `param` (with its sharding), and zero row steps if asked.

  Args:
    rule: the rule whose slots to make.
    param: the parameter.
    dtypes: a storage dtype by slot name (None or missing: the parameter's).
    per_row_steps: also keep an int32 step count per row.
    last_steps: also keep the int32 step up to which each row is caught up.
    sparse_dims: the number of leading dims that index rows (1 for an
      embedding table), for per-row slots and row steps.

  Returns:
    `Tables` with no `param`.
  """
  dtypes = dtypes or {}
  num_rows = math.prod(param.shape[:sparse_dims])
  slots: dict[str, jax.Array] = {}
  for slot in rule.slots():
    dtype = dtypes.get(slot.dtype_of or slot.name) or param.dtype
    if slot.per_row:
      table = _zeros_by_row(param, num_rows, sparse_dims, dtype)
    else:
      table = jnp.zeros_like(param, dtype=dtype)
    # An add keeps the table's sharding.
    slots[slot.name] = table if slot.init == 0 else table + jnp.asarray(slot.init, dtype)
  row_step = _zeros_by_row(param, num_rows, sparse_dims, jnp.int32) if per_row_steps else None
  last_step = _zeros_by_row(param, num_rows, sparse_dims, jnp.int32) if last_steps else None
  return Tables(slots, row_step, last_step=last_step)


def _zeros_by_row(param: jax.Array, num_rows: int, sparse_dims: int, dtype: Any) -> jax.Array:
  # Split like the table's rows, so that a row-sharded table's per-row arrays are too.
  rows_sharding = sharding.leading_dims_sharding(param, sparse_dims)
  if isinstance(rows_sharding, PartitionSpec):
    return jnp.zeros((num_rows,), dtype, out_sharding=rows_sharding)
  return jnp.zeros((num_rows,), dtype, device=rows_sharding)
