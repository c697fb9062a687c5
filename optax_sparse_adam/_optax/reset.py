"""`reset_rows`: an optimizer's per-row state set back to `init`'s at given rows.

For evicted or reassigned ids (docs/online.md). A reset row's `row_last_step`
takes the next step (`online`): the next delta holds it, and catch-up counts no
idle steps before it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._core.errors import describe, path_str
from optax_sparse_adam._core.sharded import sharding
from optax_sparse_adam._optax import catch_up
from optax_sparse_adam._optax.online import any_treedef, flatten_like, refuse_cyclic


def _by_path(tree: Any, paths: list[Any], what: str, name: str) -> list[Any]:
  """One entry of `tree` per path in `paths` (None where absent); refuses unknown tables."""
  if tree is None:
    return [None] * len(paths)
  given = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
  known = {tuple(p): i for i, p in enumerate(paths)}
  out: list[Any] = [None] * len(paths)
  for path, value in given:
    key = tuple(path)
    if key not in known:
      raise ValueError(
        f"{what}: {name} names a table at {path_str(path)}, which the params do not have; "
        f"their tables are {', '.join(path_str(p) for p in paths)}."
      )
    out[known[key]] = value
  return out


def reset_rows(
  optimizer: optax.GradientTransformation,
  params: optax.Params,
  state: optax.OptState,
  ids: Any,
  *,
  values: Any = None,
) -> tuple[optax.Params, optax.OptState]:
  """Sets the rows `ids` of every per-row slot of the optimizer to what `init` gives.

  For a row evicted from a vocabulary, or handed to a new id: its moments,
  accumulators, momentum buffer, running max and per-row step count become
  `init`'s (Adagrad's initial accumulator value, zeros otherwise), and its
  parameter row becomes `values` where given. With `row_last_step` kept it is
  stamped with the next step, so the next delta holds the row and catch-up of
  idle rows counts no idle steps before it (a new row). O(rows), jit-able (with
  the state and params donated).

  Args:
    optimizer: the transformation of `sparse_adam`, `sparse_adamw`,
      `sparse_sgd`, `sparse_adagrad`, `sparse_rowwise_adagrad` or
      `sparse_rule_transformation` (inside `optax.chain`, that transformation
      and its own state).
    params: the parameters, the tree given to `init`.
    state: the optimizer's state.
    ids: per table, an int array of row ids, in a tree like `params` (a dict
      may leave tables out; None leaves a table): every id must be in range
      (checked outside `jit`; under `jit`, where they cannot be checked,
      out-of-range ids are dropped, as BCOO padding).
    values: per table (like `ids`), the new parameter rows `(len(ids),
      *row_shape)`, or None to leave the parameter's rows as they are.

  Returns:
    `(params, state)`; the step counts are unchanged.

  Raises:
    ValueError: `optimizer` is not this package's, `state` is not its state,
      `ids` or `values` name a table the params do not have, an id is out of
      range, or `values` have the wrong shape; nothing changes.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_adagrad(0.1, initial_accumulator_value=0.5)
    >>> params = {"table": jnp.zeros((3, 1))}
    >>> state = opt.init(params)
    >>> grad = {"table": sparse.BCOO((jnp.ones((2, 1)), jnp.array([[0], [2]])), shape=(3, 1))}
    >>> updates, state = opt.update(grad, state)
    >>> params = osa.apply_updates(params, updates)
    >>> params, state = osa.reset_rows(opt, params, state, {"table": jnp.array([2])},
    ...                                values={"table": jnp.array([[7.0]])})
    >>> state.slots["sum"]["table"][:, 0]  # row 0 keeps its sum; row 2 is init's again
    Array([1.5, 0.5, 0.5], dtype=float32)
    >>> params["table"][2]
    Array([7.], dtype=float32)
  """
  entry = catch_up.registered(optimizer)
  if entry is None:
    raise ValueError(
      "reset_rows needs the transformation returned by sparse_adam, sparse_adamw, sparse_sgd, "
      "sparse_adagrad, sparse_rowwise_adagrad or sparse_rule_transformation, got "
      f"{optimizer!r}. Inside optax.chain or optax.multi_transform, pass that "
      "transformation and its own state."
    )
  if not isinstance(state, entry.state_type):
    raise ValueError(
      f"reset_rows needs the {entry.state_type.__name__} that the optimizer's init made, got "
      f"{type(state).__name__}."
    )
  refuse_cyclic("reset_rows")
  leaves_with_path, params_treedef = jax.tree_util.tree_flatten_with_path(params)
  treedef = any_treedef(params_treedef)  # jaxlib ships no stub for PyTreeDef
  paths = [p for p, _ in leaves_with_path]
  param_leaves = [leaf for _, leaf in leaves_with_path]
  id_leaves = _by_path(ids, paths, "reset_rows", "ids")
  value_leaves = _by_path(values, paths, "reset_rows", "values")
  slot_trees = entry.slots(state)
  inits = {slot.name: slot.init for slot in entry.rule.slots()}
  slot_leaves = {
    key: flatten_like(treedef, tree, "reset_rows", f"the state's {key!r}")
    for key, tree in slot_trees.items()
  }
  row_steps = (
    None
    if state.row_step is None
    else flatten_like(treedef, state.row_step, "reset_rows", "row_step")
  )
  lasts = (
    None
    if state.row_last_step is None
    else flatten_like(treedef, state.row_last_step, "reset_rows", "row_last_step")
  )
  if state.param_steps.shape != (len(paths),):
    raise ValueError(
      f"reset_rows: the state's param_steps has shape {state.param_steps.shape} but params "
      f"hold {len(paths)} tables: pass the params given to init."
    )
  # Every check before any write.
  rows_per_leaf: list[jax.Array | None] = []
  for path, param, rows, value in zip(paths, param_leaves, id_leaves, value_leaves, strict=True):
    where = f"reset_rows: the table at {path_str(path)}"
    if rows is None:
      if value is not None:
        raise ValueError(f"{where} has values but no ids: pass the ids of the rows to set.")
      rows_per_leaf.append(None)
      continue
    num_rows = jnp.shape(param)[0] if jnp.ndim(param) else 0
    rows = jnp.asarray(rows)
    if rows.size == 0:
      rows = rows.astype(jnp.int32)  # [] is float to NumPy
    if not jnp.issubdtype(rows.dtype, jnp.integer):
      raise TypeError(f"{where}: ids must be integers, got {describe(rows)}.")
    rows = rows.reshape(-1)
    if not isinstance(rows, jax.core.Tracer) and rows.size:
      low, high = int(rows.min()), int(rows.max())
      if low < 0 or high >= num_rows:
        raise ValueError(
          f"{where} has {num_rows} rows, but ids holds {low if low < 0 else high}: ids "
          f"must be in [0, {num_rows})."
        )
    for key, leaves in slot_leaves.items():
      if leaves[len(rows_per_leaf)].shape[:1] != (num_rows,):
        raise ValueError(
          f"{where} has {num_rows} rows but the state's {key!r} has shape "
          f"{leaves[len(rows_per_leaf)].shape}: pass the params given to init."
        )
    if value is not None:
      want = (rows.shape[0], *jnp.shape(param)[1:])
      if tuple(jnp.shape(value)) != want:
        raise ValueError(
          f"{where}: values has shape {tuple(jnp.shape(value))}, but {rows.shape[0]} ids of "
          f"rows {tuple(jnp.shape(param)[1:])} need {want}."
        )
    rows_per_leaf.append(jnp.where(rows < 0, num_rows, rows).astype(jnp.int32))

  def set_rows(table: jax.Array, rows: jax.Array, value: Any) -> jax.Array:
    def fn(table: jax.Array, rows: jax.Array, value: jax.Array) -> jax.Array:
      return table.at[rows].set(value.astype(table.dtype), mode="drop")

    return sharding.call_with_auto_axes(
      fn, (table, rows, jnp.asarray(value)), sharding.spec_of(table)
    )

  new_params, new_slots = list(param_leaves), {key: list(v) for key, v in slot_leaves.items()}
  new_row_steps = None if row_steps is None else list(row_steps)
  new_lasts = None if lasts is None else list(lasts)
  for i, rows in enumerate(rows_per_leaf):
    if rows is None:
      continue
    if value_leaves[i] is not None:
      new_params[i] = set_rows(param_leaves[i], rows, value_leaves[i])
    for key in new_slots:
      new_slots[key][i] = set_rows(slot_leaves[key][i], rows, inits.get(key, 0.0))
    if new_row_steps is not None:
      new_row_steps[i] = set_rows(new_row_steps[i], rows, jnp.int32(0))
    if new_lasts is not None:
      next_step = optax.safe_increment(state.param_steps[i])
      new_lasts[i] = set_rows(new_lasts[i], rows, next_step)
  new_state = entry.replace(
    state,
    {key: treedef.unflatten(v) for key, v in new_slots.items()},
    None if new_lasts is None else treedef.unflatten(new_lasts),
  )
  new_state = new_state._replace(
    row_step=None if new_row_steps is None else treedef.unflatten(new_row_steps)
  )
  return treedef.unflatten(new_params), new_state
