"""Where a row-sharded table's rows live: in blocks (`P(axis, None)` as is) or cyclically.

A table split by rows over `N` devices, `P(axis, None)`, holds rows in blocks:
device `k` the rows `[k * V / N, (k + 1) * V / N)`. A vocabulary sorted by
frequency then puts every hot row on device 0, which must receive about `N`
times its share of a step's rows: its bytes grow with `N` whatever the capacity.
Cyclic placement stores logical row `r` on device `r % N`, at local row `r // N`
(as jax-tpu-embedding does), so consecutive hot rows land on different devices.

A `(V, D)` array's `NamedSharding` can only express blocks, so a cyclic table is
the same `(V, D)` array, split `P(axis, None)`, holding its rows permuted:
physical row `p = (r % N) * (V / N) + r // N` holds logical row `r`.
`to_cyclic_rows` and `from_cyclic_rows` convert a table (or any array with a
row per table row: m, v, per-row steps) between the two orders, e.g. before
saving a checkpoint; the routed step, apply and lookup under
`sharded_routing(row_placement="cyclic")` take logical ids and map them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from optax_sparse_adam._core.sharded import sharding

BLOCK, CYCLIC = "block", "cyclic"
PLACEMENTS = (BLOCK, CYCLIC)
# Whether this process has placed rows cyclically (a cyclic block entered, or
# `to_cyclic_rows` over several shards). A cyclic table is a plain (V, D) array,
# so nothing on it says its order: once cyclic tables may exist, a row-split
# table stepped, applied or looked up where no placement was said is refused
# instead of being read in blocks (`refuse_unsaid`).
_cyclic_used = False
_on_cyclic_use: list[Callable[[], None]] = []


def on_cyclic_use(hook: Callable[[], None]) -> None:
  """Calls `hook` when this process first places tables cyclically."""
  _on_cyclic_use.append(hook)


def note_cyclic_use() -> None:
  """Records that this process holds (or is about to hold) cyclic tables.

  Only where it has several devices: on one, no table is split by rows, so none
  can be read in the wrong order.
  """
  global _cyclic_used
  if _cyclic_used or jax.device_count() < 2:
    return
  _cyclic_used = True
  for hook in _on_cyclic_use:
    hook()


def refuse_unsaid(row_placement: str | None, split_over: int, what: str) -> None:
  """Refuses a row-split table traced where no placement was said, once cyclic tables exist.

  Args:
    row_placement: the placement in force: "block", "cyclic", or None (not said).
    split_over: the devices the table's rows are split over (1: not split).
    what: the operation, for the message.
  """
  if row_placement is None and _cyclic_used and split_over > 1:
    raise ValueError(
      f"A {what} of a table split by rows over {split_over} devices is traced outside "
      "sharded_routing(row_placement=...), but this process has placed tables cyclically "
      "(row_placement='cyclic' or to_cyclic_rows), and a cyclic table read in blocks would "
      "step or read the wrong rows. Trace it inside sharded_routing(row_placement='cyclic') "
      "for a cyclic table, or sharded_routing(row_placement='block') for a table in logical "
      "order."
    )


def physical_rows(rows: jax.Array, num_rows: int, num_shards: int) -> jax.Array:
  """Logical row ids as the physical rows of a cyclic table; ids outside `[0, num_rows)` kept."""
  per_shard = num_rows // num_shards
  valid = (rows >= 0) & (rows < num_rows)
  mapped = (rows % num_shards) * per_shard + rows // num_shards
  return jnp.where(valid, mapped, rows).astype(rows.dtype)


def logical_rows(rows: jax.Array, num_rows: int, num_shards: int) -> jax.Array:
  """The inverse of `physical_rows`: physical rows of a cyclic table as logical ids."""
  per_shard = num_rows // num_shards
  valid = (rows >= 0) & (rows < num_rows)
  mapped = (rows % per_shard) * num_shards + rows // per_shard
  return jnp.where(valid, mapped, rows).astype(rows.dtype)


def _check(x: jax.Array, num_shards: int, name: str) -> None:
  if not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"{name}: num_shards={num_shards!r}; expected a positive int")
  if jnp.ndim(x) < 1 or x.shape[0] % num_shards:
    raise ValueError(
      f"{name}: an array of shape {jnp.shape(x)}, whose rows do not divide into "
      f"num_shards={num_shards} shards; expected a leading dim that is a multiple of it "
      "(pad the table with rows no id reads)"
    )


def to_cyclic_rows(x: jax.Array, num_shards: int) -> jax.Array:
  """`x`'s rows in cyclic order for `num_shards` devices: row `r` at `(r % N) * (V / N) + r // N`.

  Split `P(axis, None)` over `num_shards` devices, the result holds logical row
  `r` on device `r % num_shards`. Use it on a table and every state array with a
  row per table row (`init`'s m and v, per-row steps), or make the state with
  `init` from the converted table. Under `jax.jit` with a sharded `x` this moves
  the whole array once (an all-to-all), so convert at the boundaries: after
  building or restoring a table, before saving it (`from_cyclic_rows`).

  Args:
    x: `(V, ...)` array in logical row order, `V` a multiple of `num_shards`.
    num_shards: the devices the rows are split over.

  Returns:
    The array in cyclic order (same shape and dtype).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> osa.to_cyclic_rows(jnp.arange(6), 2)
    Array([0, 2, 4, 1, 3, 5], dtype=int32)
  """
  _check(x, num_shards, "to_cyclic_rows")
  if num_shards > 1:
    note_cyclic_use()

  def convert(x: jax.Array) -> jax.Array:
    folded = x.reshape((x.shape[0] // num_shards, num_shards) + x.shape[1:])
    return jnp.swapaxes(folded, 0, 1).reshape(x.shape)

  return _keeping_sharding(convert, x)


def from_cyclic_rows(x: jax.Array, num_shards: int) -> jax.Array:
  """The inverse of `to_cyclic_rows`: a cyclic table's rows back in logical order.

  Args:
    x: `(V, ...)` array in cyclic order for `num_shards` devices.
    num_shards: the devices the rows were split over.

  Returns:
    The array in logical row order (`result[i]` is row `i`).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> osa.from_cyclic_rows(jnp.array([0, 2, 4, 1, 3, 5]), 2)
    Array([0, 1, 2, 3, 4, 5], dtype=int32)
  """
  _check(x, num_shards, "from_cyclic_rows")

  def convert(x: jax.Array) -> jax.Array:
    folded = x.reshape((num_shards, x.shape[0] // num_shards) + x.shape[1:])
    return jnp.swapaxes(folded, 0, 1).reshape(x.shape)

  return _keeping_sharding(convert, x)


def _keeping_sharding(convert: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """`convert(x)` with `x`'s sharding, under `Auto` or `Explicit` axes, traced or not."""
  named = getattr(x, "sharding", None)
  if (
    isinstance(x, jax.core.Tracer)
    or not isinstance(named, NamedSharding)
    or not isinstance(named.mesh, jax.sharding.Mesh)
  ):
    return sharding.call_with_auto_axes(convert, (x,), sharding.spec_of(x))
  explicit = bool(getattr(named.mesh, "explicit_axes", ()))
  with jax.set_mesh(named.mesh) if explicit else contextlib.nullcontext():
    in_context = jax.jit(lambda x: sharding.call_with_auto_axes(convert, (x,), named.spec))
    return jax.jit(in_context, out_shardings=named)(x)


def check(
  row_placement: str | None, auto_axis: str | None, plan: Any, arrays: list[Any], what: str
) -> None:
  """Refuses cyclic tables where the step cannot honour them (before any state changes).

  `plan` (a `StepPlan`) given: a routed step of stochastically rounded moments
  (its bits key on block rows). `plan` None: an unrouted step, apply or lookup
  of `arrays` split by rows, which would read logical ids as physical rows.
  No placement said while cyclic tables exist: refused (`refuse_unsaid`).
  """
  if row_placement is None:
    for x in arrays:
      found = x is not None and sharding.split_rows(x, auto_axis)
      if found:
        refuse_unsaid(row_placement, found[1].shape[found[0]], what)
    return
  if row_placement != CYCLIC:
    return
  if plan is not None:
    for option in ("moment_rounding", "param_rounding"):
      if getattr(plan.config, option) == "stochastic":
        raise ValueError(
          f"row_placement='cyclic' with {option}='stochastic': not supported (the "
          "rounding's bits key on block rows); use row_placement='block' or nearest rounding"
        )
    return
  for x in arrays:
    found = x is not None and sharding.split_rows(x, auto_axis)
    if found and found[1].shape[found[0]] > 1:
      raise ValueError(
        f"row_placement='cyclic': the {what} of a table of shape {x.shape} split by rows "
        f"over {found[0]!r} cannot be routed (gradient entries split otherwise, a batch "
        "not a multiple of the axis size, or optax.apply_if_finite), and unrouted it "
        "would read logical ids as cyclic rows; route it or use row_placement='block'"
      )


def physical_ids(
  rows: jax.Array, table: jax.Array, row_placement: str | None, auto_axis: str | None, what: str
) -> jax.Array:
  """Logical ids as the rows of `table` to index directly (an unrouted gather or scatter).

  Blocks, one device, or a table not split by rows: `rows`. A cyclic table split by rows
  over `N > 1` devices: `physical_rows(rows, V, N)`. A traced table on a mesh of several
  devices whose split is not known at trace time (`Auto` axes without `auto_axis`):
  refused, as the order of its rows cannot be told.
  """
  if row_placement != CYCLIC:
    check(row_placement, auto_axis, None, [table], what)
    return rows
  found = sharding.split_rows(table, auto_axis)
  if found:
    num_shards = found[1].shape[found[0]]
    return physical_rows(rows, table.shape[0], num_shards) if num_shards > 1 else rows
  mesh = getattr(getattr(jax.typeof(table), "sharding", None), "mesh", None)
  if isinstance(table, jax.core.Tracer) and mesh is not None and not mesh.empty and mesh.size > 1:
    raise ValueError(
      f"row_placement='cyclic': {what} of a table of shape {table.shape} on a mesh of "
      f"{mesh.size} devices whose split is not known when traced; declare the axis "
      "(sharded_routing(auto_axis=..., row_placement='cyclic'))"
    )
  return rows
