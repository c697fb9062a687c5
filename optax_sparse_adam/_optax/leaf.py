"""One parameter's step and one parameter's apply: the optax layer's two calls into the backends.

`masked_leaf_step` validates a BCOO gradient against a rule's tables, advances
the step counter, and hands the rows to `_backends.dispatch.masked_step`, which
picks how they run on the backend the step is lowered for; it builds the update
BCOO once. `sparse_adam_leaf_step` is its public Adam face. `scatter_add_bcoo`
does the same for `param + update`. Under a mesh with `Explicit` axes both run
in an auto-axes region (`_core.sharding`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse
from jax.sharding import PartitionSpec

from optax_sparse_adam._backends import dispatch
from optax_sparse_adam._core import bcoo, row_update
from optax_sparse_adam._core.errors import is_python_number, path_str
from optax_sparse_adam._core.row_rules import adam
from optax_sparse_adam._core.row_rules.adam import AdamCoefficients, AdamRule, LeafState
from optax_sparse_adam._core.rules import (
  RowRule,
  StepConfig,
  StepInputs,
  Tables,
  WeightDecay,
  sets_rows,
  stores_rows,
)
from optax_sparse_adam._core.set_rows import SetRowsUpdate, as_set_rows
from optax_sparse_adam._core.sharded import auto_partition, routed, sharding
from optax_sparse_adam._optax.leaf_plan import prepare_leaf_step


def weight_decay_mode(weight_decay: Any, *, decoupled: bool) -> WeightDecay:
  """The static weight-decay switch for a rate given when a transformation is made.

  A Python zero means none (SparseAdam's numerics, no parameter read); anything
  else, an array included, decays ("decoupled" AdamW-style, else "l2").
  """
  if weight_decay is None or (is_python_number(weight_decay) and weight_decay == 0):
    return "none"
  return "decoupled" if decoupled else "l2"


def sparse_adam_leaf_step(
  grad: sparse.BCOO,
  state: LeafState,
  param: jax.Array | None,
  coeffs: AdamCoefficients,
  *,
  maximize: bool = False,
  decoupled_weight_decay: bool = False,
  step_size: jax.Array | None = None,
  path: tuple = (),
  opaque_zero: jax.Array | None = None,
) -> tuple[sparse.BCOO, LeafState]:
  """One masked Adam step of one parameter from its BCOO gradient.

  Args:
    grad: BCOO gradient of the parameter's shape, `n_batch == 0`.
    state: the parameter's `LeafState`.
    param: the parameter, needed only with weight decay.
    coeffs: step constants (`adam_coefficients`).
    maximize: ascend instead of descend.
    decoupled_weight_decay: apply `coeffs.weight_decay` AdamW-style to the
      touched rows instead of adding it to the gradient (L2).
    step_size: an overriding bias-corrected step size for this step, e.g. one
      computed on the host in float64 as torch does. Ignored with per-row bias
      correction.
    path: the leaf's pytree path, for error messages.
    opaque_zero: an int32 zero passed into the compiled function at run time;
      when given, every product is rounded before it is added, as in torch,
      instead of being fused into an FMA by XLA (see `adam.rounded`).

  Returns:
    `(update, new_state)`: a BCOO update with sorted unique indices holding the
    signed deltas of the touched rows, and the new state. Only touched rows of
    the moments change; the step advances also when the gradient is empty. The
    new state has the sharding of `state`; under a mesh with `Explicit` axes the
    update is replicated (it holds the gradient's entries, not the table's).
  """
  slots = {"mu": state.mu, "nu": state.nu}
  if state.nu_max is not None:
    slots["nu_max"] = state.nu_max
  config = StepConfig(
    maximize=maximize,
    weight_decay=weight_decay_mode(coeffs.weight_decay, decoupled=decoupled_weight_decay),
  )
  # With per-row bias correction each row has its own step size.
  given = step_size if state.row_step is None else None
  step = masked_leaf_step(
    grad,
    Tables(slots, state.row_step, param),
    state.step,
    rule=AdamRule(amsgrad=state.nu_max is not None),
    config=config,
    hyper=adam.hyperparams_of(coeffs, given),
    path=path,
    opaque_zero=opaque_zero,
  )
  new_slots = step.tables.slots
  assert step.step is not None  # given a step, it returns one
  new_state = LeafState(
    step.step, new_slots["mu"], new_slots["nu"], new_slots.get("nu_max"), step.tables.row_step
  )
  return step.update, new_state


class LeafStep(NamedTuple):
  """What `masked_leaf_step` returns.

  Attributes:
    update: the BCOO update: sorted, unique indices holding the signed deltas
      of the touched rows (padding out of range).
    step: the parameter's new step count (None if not given one).
    tables: the rule's new tables (without `param`).
  """

  update: sparse.BCOO
  step: jax.Array | None
  tables: Tables


def masked_leaf_step(
  grad: sparse.BCOO,
  tables: Tables,
  step: jax.Array | None,
  *,
  rule: RowRule,
  config: StepConfig,
  hyper: Any,
  path: tuple = (),
  opaque_zero: jax.Array | None = None,
  update_flags: tuple[bool, bool] = (True, True),
) -> LeafStep:
  """One masked step of one parameter under `rule`, from its BCOO gradient.

  Args:
    grad: BCOO gradient of the parameter's shape, `n_batch == 0`.
    tables: the rule's slot tables, the row steps (or None) and the parameter
      (read with weight decay only).
    step: int32 scalar, the parameter's step count before this step; None
      where the caller counts steps itself and gives the rule what it needs
      (the torch adapter's host-computed step size).
    rule: the row rule.
    config: the static switches; its `compute_dtype` is set here from the
      gradient's and the slots' dtypes.
    hyper: the rule's hyper-parameters.
    path: the leaf's pytree path, for error messages.
    opaque_zero: an int32 zero given at run time, or None (`adam.rounded`).
    update_flags: the update BCOO's `(indices_sorted, unique_indices)`
      metadata (its indices are sorted and unique regardless).

  Returns:
    The `LeafStep`. Only touched rows of the tables change; the step advances
    also when the gradient is empty. The new tables have the sharding of
    `tables`; under a mesh with `Explicit` axes the update is replicated (it
    holds the gradient's entries, not the table's). A routed step (a
    row-sharded table, `sharded_routing`) returns the update split over the
    table's axis, each device's rows sorted, padding between.
  """
  grad, tables, plan, new_step = prepare_leaf_step(
    grad, tables, step, rule=rule, config=config, path=path
  )
  layout = plan.layout
  sets = stores_rows(rule, plan.config)
  indices_sorted, unique_indices = update_flags

  route = routed.plan_step(grad, tables, plan)
  # optax.apply_if_finite's rejecting branch is zeros like the gradient: the
  # update must have the gradient's entries, split as they are.
  update_specs = (PartitionSpec(), PartitionSpec())
  in_optax_apply_if_finite = _inside_optax_apply_if_finite()
  if in_optax_apply_if_finite and sets:
    who = f"the {rule.name!r} rule sets" if sets_rows(rule) else "param_rounding='stochastic' sets"
    raise ValueError(
      f"{who} the rows of the parameter at {path_str(path)}, and "
      "optax.apply_if_finite's rejecting branch is zeros like the gradient: stored as "
      "rows, they would zero the touched rows. Use osa.sparse_apply_if_finite, whose "
      "skipped step stores nothing."
    )
  if in_optax_apply_if_finite:
    update_specs = (sharding.spec_of(grad.data), sharding.spec_of(grad.indices))
  if route is not None and in_optax_apply_if_finite:
    # Its rejecting branch is zeros like the gradient, whose entries a routed
    # update cannot fit (an owner may receive more distinct rows than a device
    # sent): the step XLA partitions returns the gradient's shape.
    warnings.warn(
      f"the row-sharded parameter at {path_str(path)} is stepped inside "
      "optax.apply_if_finite, which needs the update to have the gradient's number of "
      "entries: the step is left to XLA's partitioner (one device's numbers, but traffic "
      "that grows with the devices). Use osa.sparse_apply_if_finite to route it.",
      stacklevel=2,
    )
    route = None
  # Under Auto axes the partitioner's shardings decide (routed where split by rows);
  # its update has the routed size too, which optax.apply_if_finite cannot take.
  auto = None
  if route is None and not in_optax_apply_if_finite:
    auto = auto_partition.plan_step(grad, tables, plan)
  if route is not None or auto is not None:  # each row's gradient goes to its owner
    inputs = StepInputs(
      bcoo.linear_rows(grad.indices, layout), grad.data, tables, new_step, hyper, opaque_zero
    )
    if route is not None:
      result = routed.masked_step(inputs, plan, route=route, local_step=dispatch.masked_step)
    elif auto is not None:
      result = auto_partition.masked_step(inputs, plan, route=auto, local_step=dispatch.masked_step)
    coalesced = bcoo.CoalescedRows(result.rows, result.delta)
    # Each device holds its own rows, sorted within its block only.
    update = bcoo.rows_to_bcoo(
      coalesced, layout, indices_sorted=False, unique_indices=unique_indices
    )
    update = as_set_rows(update) if sets else row_update.seal(update)
    return LeafStep(update, new_step, result.tables)
  routed.check_placement(None, list(tables.slots.values()), "step")

  def run(grad_data, grad_indices, tables, new_step, hyper, opaque_zero):
    inputs = StepInputs(
      bcoo.linear_rows(grad_indices, layout), grad_data, tables, new_step, hyper, opaque_zero
    )
    result = dispatch.masked_step(inputs, plan)
    update = bcoo.rows_to_bcoo(bcoo.CoalescedRows(result.rows, result.delta), layout)
    return (update.data, update.indices), result.tables

  if not sharding.explicit_axes():
    (data, indices), new_tables = run(grad.data, grad.indices, tables, new_step, hyper, opaque_zero)
  else:
    # Arrays reach the auto-axes region as arguments, not closures: a
    # closed-over value typed on the Explicit mesh would not match the region's
    # Auto mesh. Python floats stay closed over: constants, exact until used.
    leaves, treedef = jax.tree.flatten(hyper)
    traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def run_arrays(grad_data, grad_indices, tables, new_step, arrays, opaque_zero):
      full = list(leaves)
      for i, array in zip(traced, arrays, strict=True):
        full[i] = array
      hyper = jax.tree.unflatten(treedef, full)
      return run(grad_data, grad_indices, tables, new_step, hyper, opaque_zero)

    table_specs = jax.tree_util.tree_map(sharding.spec_of, tables._replace(param=None))
    (data, indices), new_tables = sharding.call_with_auto_axes(
      run_arrays,
      (grad.data, grad.indices, tables, new_step, [leaves[i] for i in traced], opaque_zero),
      (update_specs, table_specs),
    )
  # optax.apply_if_finite's rejecting branch is zeros like the gradient, a plain BCOO:
  # both branches must have one type. Elsewhere the update carries its ids' check.
  update_type = sparse.BCOO if in_optax_apply_if_finite else row_update.RowUpdate
  update = update_type(
    (data, indices),
    shape=grad.shape,
    indices_sorted=indices_sorted,
    unique_indices=unique_indices,
  )
  return LeafStep(as_set_rows(update) if sets else update, new_step, new_tables)


class DenseLeafStep(NamedTuple):
  """What `dense_leaf_step` returns: the dense update (a `SetRowsUpdate` of every row where
  the parameter's rows are rounded stochastically), the new step count and tables."""

  update: jax.Array | SetRowsUpdate
  step: jax.Array | None
  tables: Tables


def dense_leaf_step(
  grad: jax.Array,
  tables: Tables,
  step: jax.Array | None,
  *,
  rule: RowRule,
  config: StepConfig,
  hyper: Any,
  path: tuple = (),
  opaque_zero: jax.Array | None = None,
) -> DenseLeafStep:
  """One step of one parameter from its dense gradient: every element stepped.

  The dense optimizer's step is the rule's row step on every row at once: the
  gradient is read as a BCOO holding each row once, in order, and run through
  `masked_leaf_step` (the same pipeline, backends and rounding as a sparse
  step). For an elementwise rule (SGD, Adagrad) that is the dense optimizer's
  formula. A 0-d parameter is stepped as one row of one value.

  Args: as `masked_leaf_step`, with `grad` a dense array of the parameter's shape.

  Returns:
    The `DenseLeafStep`: the update a dense array of the parameter's shape.
  """
  grad = jnp.asarray(grad)
  shape = tuple(grad.shape)
  full_width = [tables.slots[slot.name] for slot in rule.slots() if not slot.per_row]
  known = full_width[0] if full_width else tables.param
  expected = shape if known is None else tuple(jnp.shape(known))
  if expected != shape:
    raise ValueError(
      f"Dense gradient at {path_str(path)} has shape {shape} but its parameter (or its "
      f"optimizer state) has shape {tuple(expected)}; they must be equal."
    )
  if not jnp.issubdtype(grad.dtype, jnp.floating):
    raise TypeError(
      f"Dense gradient at {path_str(path)} has dtype {grad.dtype}; expected a real floating dtype."
    )
  view = shape or (1,)

  def as_view(x: jax.Array) -> jax.Array:
    return x.reshape(view) if tuple(x.shape) == shape else x

  rows = jnp.arange(view[0], dtype=jnp.int32)
  every_row = sparse.BCOO(
    (grad.reshape(view), rows[:, None]), shape=view, indices_sorted=True, unique_indices=True
  )
  view_tables = tables._replace(
    slots={name: as_view(table) for name, table in tables.slots.items()},
    param=None if tables.param is None else as_view(tables.param),
  )
  result = masked_leaf_step(
    every_row,
    view_tables,
    step,
    rule=rule,
    config=config,
    hyper=hyper,
    path=path,
    opaque_zero=opaque_zero,
  )
  if isinstance(result.update, SetRowsUpdate):
    # Rows rounded stochastically (param_rounding): every row's new value, stored by
    # the apply; a dense delta would be rounded again when added.
    if shape != view:
      raise ValueError(
        f"param_rounding='stochastic' rounds rows, and the parameter at {path_str(path)} "
        f"is 0-d ({grad.dtype} gradient): keep it in float32, or use param_rounding='nearest'."
      )
    return DenseLeafStep(result.update, result.step, result.tables)
  # Each row once: set, not add, keeps the deltas' bits (a -0.0 included); padding dropped.
  update_rows = bcoo.linear_rows(result.update.indices, bcoo.row_layout(result.update, view))
  update = (
    jnp.zeros(view, result.update.dtype)
    .at[update_rows]
    .set(result.update.data, mode="drop", unique_indices=True)
    .reshape(shape)
  )
  new_slots = {
    name: table.reshape(tables.slots[name].shape) for name, table in result.tables.slots.items()
  }
  return DenseLeafStep(update, result.step, result.tables._replace(slots=new_slots))


def scatter_add_bcoo(param: jax.Array, update: sparse.BCOO, path: Sequence[Any] = ()) -> jax.Array:
  """`param + update` for a BCOO update, by scatter-add: never densifies the update.

  Repeated indices add up; out-of-range indices are dropped (BCOO padding).
  A `SetRowsUpdate` (a rule's new rows) is stored instead: `param[rows] = data`.
  The result has `param`'s sharding.
  """
  layout = bcoo.row_layout(update, param.shape, path, what="update")
  # A rule that sets rows gave their new values: they are stored, not added (chosen
  # before the ids are verified, which gives a plain BCOO).
  local = dispatch.store_rows if isinstance(update, SetRowsUpdate) else dispatch.scatter_add
  update = row_update.verified(update, path, what="update")
  route = routed.plan_apply(param, update)
  if route is not None:  # row-split: each device adds the rows it owns
    return routed.scatter_add(param, update, layout=layout, plan=route, local_scatter_add=local)
  auto = auto_partition.plan_apply(param, update)
  if auto is not None:  # Auto axes: routed where the partitioner splits param by rows
    return auto_partition.scatter_add(
      param, update, layout=layout, plan=auto, local_scatter_add=local
    )
  routed.check_placement(None, [param], "apply")

  def scatter_add(param, update):
    rows = bcoo.linear_rows(update.indices, layout)
    return local(
      param,
      rows,
      update.data,
      layout=layout,
      rows_unique=update.unique_indices,
      rows_sorted=update.indices_sorted,
    )

  return sharding.call_with_auto_axes(scatter_add, (param, update), sharding.spec_of(param))


@functools.cache
def _optax_apply_if_finite_branch() -> types.CodeType | None:
  """The code of `optax.apply_if_finite`'s accepting branch (`do_update`), or None."""
  pending = [inspect.unwrap(optax.apply_if_finite).__code__]
  while pending:
    code = pending.pop()
    if code.co_name == "do_update":
      return code
    pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
  return None


def _inside_optax_apply_if_finite() -> bool:
  """Whether this step is traced by `optax.apply_if_finite`'s `lax.cond` (a caller's frame)."""
  branch = _optax_apply_if_finite_branch()
  frame: types.FrameType | None = sys._getframe(1)
  while frame is not None and branch is not None:
    if frame.f_code is branch:
      return True
    frame = frame.f_back
  return False
