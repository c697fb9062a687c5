"""Rows changed since a step, and deltas for a serving copy (docs/online.md).

`changed_rows` and `rows_delta` run on the host: how many rows changed is known
only when the steps have run, and a delta leaves the device to be sent anyway,
so its size is read first and the ids are gathered at that size rounded up to a
power of two (a few compiled shapes, never a truncated delta). Only the changed
rows of a table are gathered, by XLA's partitioned gather on a row-sharded
table. `apply_rows_delta` writes a delta into a serving copy.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from optax_sparse_adam._core.errors import describe, path_str
from optax_sparse_adam._core.sharded import sharding
from optax_sparse_adam._optax.online import any_treedef, flatten_like, refuse_cyclic


class RowsDelta(NamedTuple):
  """The rows that changed since a step, with their values: what a serving copy needs.

  Attributes:
    steps: int32 NumPy `(num_params,)`, every parameter's step count when the delta was
      taken (`state.param_steps`): the `since` of the next delta.
    ids: per table, int32 `(n,)`, the changed rows' ids, ascending, then padding
      (the table's row count) up to `n`, a power of two.
    rows: per table, `(n, *row_shape)`, the changed rows' values (zero in padding).
    counts: per table, the number of changed rows (an int32 0-d array).
  """

  steps: Any
  ids: Any
  rows: Any
  counts: Any


def _tracked_last_steps(state: Any, what: str) -> Any:
  last = getattr(state, "row_last_step", None)
  if last is None or getattr(state, "param_steps", None) is None:
    raise ValueError(
      f"{what} needs the state of a transformation made with track_changed_rows=True "
      "(or with catch_up_idle_rows=True where the rule's idle rows move), which keeps "
      f"row_last_step; got {type(state).__name__} without it."
    )
  return last


def _since_per_param(since: Any, state: Any, what: str) -> np.ndarray:
  """`since` as one int64 per parameter, checked against the steps taken so far.

  An int is every table's, at most the update count (`state.count`); an array
  holds one step per parameter, each at most that parameter's step count.
  """
  steps = np.asarray(state.param_steps).astype(np.int64)
  given = np.asarray(since)
  if given.dtype.kind not in "iu" or given.ndim > 1:
    raise TypeError(
      f"{what}: since must be an int or int array of shape ({steps.size},) (a previous "
      f"delta's steps, or state.param_steps), got {describe(since)}."
    )
  if given.ndim == 0:
    count = int(np.asarray(getattr(state, "count", steps.max(initial=0))))
    if not 0 <= int(given) <= count:
      raise ValueError(
        f"{what}: since={int(given)} is "
        f"{'negative' if given < 0 else 'in the future'}: the optimizer has taken {count} "
        f"updates; since must be in [0, {count}] (0: every row written since init)."
      )
    return np.full(steps.shape, int(given), np.int64)
  if given.shape != steps.shape:
    raise ValueError(
      f"{what}: since has shape {given.shape} but the state holds {steps.size} parameters: "
      f"pass one int, or one per parameter ({steps.size},)."
    )
  given = given.astype(np.int64)
  bad = np.flatnonzero((given < 0) | (given > steps))
  if bad.size:
    i = int(bad[0])
    raise ValueError(
      f"{what}: since={int(given[i])} for parameter {i} is "
      f"{'negative' if given[i] < 0 else 'in the future'}: that parameter has taken "
      f"{int(steps[i])} steps; since must be in [0, {int(steps[i])}] (0: every row "
      "written since init)."
    )
  return given


@jax.jit
def _count_changed(last: jax.Array, since: jax.Array) -> jax.Array:
  return jnp.sum(last > since, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("size",))
def _changed_ids(last: jax.Array, since: jax.Array, size: int) -> jax.Array:
  (ids,) = jnp.nonzero(last > since, size=size, fill_value=last.shape[0])
  return ids.astype(jnp.int32)


def _padded_size(count: int) -> int:
  return 1 << max(count - 1, 0).bit_length()


def _changed(state: Any, since: Any, what: str) -> tuple[Any, list[Any], list[int], Any]:
  """`(treedef, ids per table (padded, on device), counts, param_steps)`."""
  refuse_cyclic(what)
  last_tree = _tracked_last_steps(state, what)
  leaves, treedef = jax.tree.flatten(last_tree)
  per_param = _since_per_param(since, state, what)
  if len(leaves) != per_param.size:
    raise ValueError(
      f"{what}: the state's row_last_step holds {len(leaves)} tables but param_steps "
      f"{per_param.size}: pass the state that the optimizer's init made."
    )
  replicated = PartitionSpec()

  def on_device(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return sharding.call_with_auto_axes(functools.partial(fn, **kwargs), args, replicated)

  all_ids, counts = [], []
  for last, s in zip(leaves, per_param, strict=True):
    s = jnp.int32(s)
    count = int(on_device(_count_changed, last, s))
    counts.append(count)
    all_ids.append(on_device(_changed_ids, last, s, size=_padded_size(count)))
  # A host copy: the state's own array is donated by the next jitted step.
  return treedef, all_ids, counts, np.array(state.param_steps, np.int32)


def changed_rows(state: optax.OptState, since: Any) -> Any:
  """The ids of the rows each table's optimizer wrote after step `since`, on the host.

  A row is written by a step that touches it (its gradient has the row), by the
  catch-up of idle rows, and by `reset_rows`. The count of rows is known only
  once the steps have run, so this runs on the host and returns arrays of that
  size; inside `jit` use the state's `row_last_step > since` mask.

  Args:
    state: the state of a transformation made with `track_changed_rows=True`
      (`SparseAdamState`, `SparseRuleState`), or with `catch_up_idle_rows=True`
      where its rule's idle rows move (both keep `row_last_step`).
    since: a step count: an int for every table, or one per parameter, e.g. the
      `steps` of the last `RowsDelta` or a saved `state.param_steps`; from 0 to
      the parameter's step count.

  Returns:
    A tree like the params of int32 NumPy arrays: each table's changed ids, ascending.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_sgd(0.1, track_changed_rows=True)
    >>> params = {"table": jnp.zeros((5, 2))}
    >>> state = opt.init(params)
    >>> for row in (3, 1):
    ...   grad = {"table": sparse.BCOO((jnp.ones((1, 2)), jnp.array([[row]])), shape=(5, 2))}
    ...   updates, state = opt.update(grad, state)
    >>> osa.changed_rows(state, since=1)["table"]
    array([1], dtype=int32)
  """
  treedef, ids, counts, _ = _changed(state, since, "changed_rows")
  return treedef.unflatten([np.asarray(i)[:c] for i, c in zip(ids, counts, strict=True)])


def rows_delta(params: optax.Params, state: optax.OptState, since: Any) -> RowsDelta:
  """The rows each table's optimizer wrote after step `since`, and their values: a delta.

  Applied to a serving copy that equals the trained tables at step `since`
  (`apply_rows_delta`), it makes the copy equal them now, bit for bit. A
  row-sharded table is never gathered: XLA's partitioned gather moves the
  changed rows only. Runs on the host (see `changed_rows`): the ids are padded
  to a power of two, so that a stream of deltas compiles a few shapes.

  Args:
    params: the trained parameters (after `apply_updates`).
    state: the optimizer's state (see `changed_rows`).
    since: the `steps` of the previous delta, or an int (0: every row written
      since init).

  Returns:
    A `RowsDelta`; its `steps` is the `since` of the next delta.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_adagrad(0.1, track_changed_rows=True)
    >>> params = {"table": jnp.ones((6, 2))}
    >>> state, serving = opt.init(params), params
    >>> grad = {"table": sparse.BCOO((jnp.ones((1, 2)), jnp.array([[4]])), shape=(6, 2))}
    >>> updates, state = opt.update(grad, state)
    >>> params = osa.apply_updates(params, updates)
    >>> delta = osa.rows_delta(params, state, since=0)
    >>> delta.ids["table"], int(delta.counts["table"])
    (Array([4], dtype=int32), 1)
    >>> serving = osa.apply_rows_delta(serving, delta)
    >>> bool((serving["table"] == params["table"]).all())
    True
  """
  treedef, ids, counts, steps = _changed(state, since, "rows_delta")
  tables = flatten_like(treedef, params, "rows_delta", "params")
  lasts = jax.tree.leaves(state.row_last_step)
  rows = []
  for table, table_ids, last in zip(tables, ids, lasts, strict=True):
    if jnp.shape(table)[:1] != last.shape:
      raise ValueError(
        f"rows_delta: a table has shape {jnp.shape(table)} but the state keeps "
        f"{last.shape[0]} row steps for it: pass the params given to init."
      )
    rows.append(sharding.call_with_auto_axes(_gather_rows, (table, table_ids), PartitionSpec()))
  return RowsDelta(
    steps=steps,
    ids=treedef.unflatten(ids),
    rows=treedef.unflatten(rows),
    counts=treedef.unflatten([jnp.int32(c) for c in counts]),
  )


@jax.jit
def _gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  return table.at[ids].get(mode="fill", fill_value=0)


@jax.jit
def _set_rows(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  return table.at[ids].set(rows, mode="drop")


def apply_rows_delta(serving: optax.Params, delta: RowsDelta) -> optax.Params:
  """A serving copy with a `RowsDelta`'s rows written in: the trained tables, bit for bit.

  Args:
    serving: the serving copy: a tree like the trained params (a table per leaf,
      of the trained table's shape and dtype), equal to them at the delta's
      `since`.
    delta: from `rows_delta`.

  Returns:
    `serving` with each table's changed rows set (padding ids dropped).

  Raises:
    ValueError: `serving` is not a tree of the delta's tables, a table's shape or
      dtype differs from the delta's rows, or an id is out of range; nothing is
      written.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> delta = osa.RowsDelta(steps=jnp.array([3]), ids={"t": jnp.array([2, 3])},
    ...                       rows={"t": jnp.array([[5.0], [0.0]])}, counts={"t": 1})
    >>> osa.apply_rows_delta({"t": jnp.zeros((3, 1))}, delta)["t"][:, 0]
    Array([0., 0., 5.], dtype=float32)
  """
  if not isinstance(delta, RowsDelta):
    raise TypeError(f"apply_rows_delta: delta must be a RowsDelta, got {type(delta).__name__}")
  id_leaves, treedef = jax.tree.flatten(delta.ids)
  treedef = any_treedef(treedef)  # jaxlib ships no stub for PyTreeDef
  row_leaves = flatten_like(treedef, delta.rows, "apply_rows_delta", "delta.rows")
  tables = flatten_like(treedef, serving, "apply_rows_delta", "serving")
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(delta.ids)[0]]
  for path, table, ids, rows in zip(paths, tables, id_leaves, row_leaves, strict=True):
    where = f"apply_rows_delta: the table at {path_str(path)}"
    shape, dtype = tuple(jnp.shape(table)), jnp.result_type(table)
    if tuple(rows.shape) != (ids.shape[0], *shape[1:]) or rows.dtype != dtype:
      raise ValueError(
        f"{where} is {describe(table)} but the delta holds rows {describe(rows)} for "
        f"{ids.shape[0]} ids: the serving copy must have the trained table's row shape "
        "and dtype (the copy is bit for bit, so no cast)."
      )
    host_ids = np.asarray(ids)
    if host_ids.size and (host_ids.min() < 0 or host_ids.max() > shape[0]):
      raise ValueError(
        f"{where} has {shape[0]} rows, but the delta's ids reach "
        f"{int(host_ids.min() if host_ids.min() < 0 else host_ids.max())}: a delta of "
        f"another table? Ids must be in [0, {shape[0]}) ({shape[0]}: padding)."
      )
  new = [_set_rows(t, i, r) for t, i, r in zip(tables, id_leaves, row_leaves, strict=True)]
  return treedef.unflatten(new)
