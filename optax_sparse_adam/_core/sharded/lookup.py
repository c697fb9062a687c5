"""`table[ids]` for a row-sharded table: each id goes to its row's owner, each row comes back.

Left to XLA's partitioner, a lookup of ids split over a mesh axis in a table
split by rows over the same axis all-reduces a `[N * B, D]` array (every device
fills the rows it owns for every id of the global batch). `sharded_lookup`
routes instead, in two `all_to_all`s of O(local ids) per device:

  1. each device finds its distinct ids and buckets them by owner
     (`routing.bucket_by_owner`, `capacity` slots per owner);
  2. one all-to-all sends each bucket's ids to their owner, which gathers the
     rows from its shard; a second sends the rows back, in the same slots;
  3. each device reads its ids' rows from the slots of their distinct ids.

A lookup in which some device holds more distinct ids for one owner than the
capacity all-gathers the ids instead, and each owner fills the rows it owns
(a reduce-scatter of `[N * B, D]`): what the partitioned lookup costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from optax_sparse_adam._core import bcoo, coalesce
from optax_sparse_adam._core.sharded import (
  auto_partition,
  overflow,
  partitioned,
  placement,
  routed,
  routing,
  sharding,
)


def sharded_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """`table[ids]`, routed to the rows' owners when the table and the ids are split alike.

  When `table` is split by rows over a mesh axis, `P(axis, None)`, and `ids`
  (1-D) over the same axis, as a data-parallel batch, each device sends its
  distinct ids to the devices owning their rows and gets the rows back: two
  all-to-alls of a fixed number of slots per owner (the capacity of
  `sharded_routing`), whatever the number of devices. Elsewhere (one device, other layouts) this
  is `table[ids]`, under `Explicit` axes with the output split like the ids.
  Ids index as in `table[ids]`: negative ids count from the end, ids past
  either end are clamped.

  For training, differentiate the loss with respect to the rows this returns
  and give `sparse_adam` the BCOO `(row cotangents, ids)`: its routed step
  sends those to the owners in turn (docs/sharding.md).

  Args:
    table: `(num_rows, ...)` array.
    ids: integer `(batch,)` ids.

  Returns:
    `(batch, ...)` rows, split like `ids` on their first dim.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> osa.sharded_lookup(jnp.arange(6.0).reshape(3, 2), jnp.array([2, 0, -1]))
    Array([[4., 5.],
           [0., 1.],
           [4., 5.]], dtype=float32)
  """
  if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(
      f"sharded_lookup: ids of shape {ids.shape} and dtype {ids.dtype}; expected 1-D integer ids."
    )
  plan = _plan(table, ids)
  if plan is None and (auto := _auto_plan(table, ids)) is not None:
    return _auto_lookup(table, ids, auto, padding=False)
  if plan is None:
    routed.check_placement(None, [table], "lookup")
    out_spec = PartitionSpec(*sharding.spec_of(ids), *([None] * (table.ndim - 1)))
    return sharding.call_with_auto_axes(lambda t, i: t[i], (table, ids), out_spec)
  return _noted(*_routed_lookup(table, ids, plan, padding=False))


def _noted(rows: jax.Array, flag: jax.Array) -> jax.Array:
  overflow.note(overflow.LOOKUP, flag)
  return rows


def lookup_or_zeros(table: jax.Array, ids: jax.Array) -> jax.Array:
  """`table[ids]` for ids of any shape, ids outside `[0, num_rows)` reading zero rows.

  Routed as `sharded_lookup` is where the table and the flattened ids are split
  alike; elsewhere one gather. The Flax tables' lookup (padding ids, negative
  ones included, read zero rows there).
  """
  num_rows = table.shape[0]
  if ids.ndim == 1 or not sharding.explicit_axes():
    flat = ids.reshape(-1)
    plan = _plan(table, flat)
    if plan is not None:
      rows = _noted(*_routed_lookup(table, flat, plan, padding=True))
      return rows.reshape(ids.shape + table.shape[1:])
    auto = _auto_plan(table, flat)
    if auto is not None:
      rows = _auto_lookup(table, flat, auto, padding=True)
      return rows.reshape(ids.shape + table.shape[1:])
  routed.check_placement(None, [table], "lookup")
  return table.at[jnp.where(ids < 0, num_rows, ids)].get(mode="fill", fill_value=0)


def _plan(table: jax.Array, ids: jax.Array) -> routed.Plan | None:
  choice = routed.current()
  if not choice.enabled or table.ndim < 1 or ids.shape[0] == 0:
    return None
  found = {sharding.split_rows(x, choice.auto_axis) for x in (table, ids)}
  if len(found) != 1 or None in found:
    return None
  ((axis, mesh),) = found  # type: ignore[misc]  # None was ruled out above
  num_shards = mesh.shape[axis]
  if num_shards < 2 or table.shape[0] % num_shards or ids.shape[0] % num_shards:
    return None
  local = ids.shape[0] // num_shards
  capacity = routing.capacity(local, num_shards, choice.capacity_factor)
  return routed.Plan(axis, mesh, num_shards, capacity, routed.is_cyclic(num_shards, "lookup"))


def _auto_plan(table: jax.Array, ids: jax.Array) -> routed.Plan | None:
  """Under `Auto` axes: a plan without a mesh (`auto_partition` reads the layout), or None."""
  if table.ndim < 1 or ids.shape[0] == 0 or not partitioned.partitioner_decides():
    return None
  found = partitioned.mesh_axis([table], [ids])
  if found is None:
    return None
  axis, mesh = found
  num_shards = mesh.shape[axis]
  if table.shape[0] % num_shards or ids.shape[0] % num_shards:
    return None
  local = ids.shape[0] // num_shards
  capacity = routing.capacity(local, num_shards, routed.current().capacity_factor)
  return routed.Plan(axis, None, num_shards, capacity, routed.is_cyclic(num_shards, "lookup"))


def _auto_lookup(
  table: jax.Array, ids: jax.Array, plan: routed.Plan, *, padding: bool
) -> jax.Array:
  num_rows = table.shape[0]

  def whole(table: jax.Array, ids: jax.Array) -> jax.Array:
    if padding:
      return table.at[jnp.where(ids < 0, num_rows, ids)].get(mode="fill", fill_value=0)
    return table[ids]

  def routed_rows(table: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _routed_lookup(table, ids, plan, padding=padding)

  return auto_partition.lookup(table, ids, plan=plan, routed_lookup=routed_rows, whole_lookup=whole)


def _routed_lookup(
  table: jax.Array, ids: jax.Array, plan: routed.Plan, *, padding: bool
) -> tuple[jax.Array, jax.Array]:
  """The routed lookup, and its overflow flag (`overflow.flag_of`, alike on every device).

  `padding`: ids out of range read zero rows (else as `table[ids]`).
  """
  axis, num_shards, capacity = plan.axis, plan.num_shards, plan.capacity
  # A plan without a mesh: the caller runs per shard and `table` is a shard.
  num_rows = table.shape[0] * (num_shards if plan.mesh is None else 1)
  rows_per_shard = num_rows // num_shards
  row_shape = table.shape[1:]

  def body(table, ids):
    shard = lax.axis_index(axis)
    local_ids = ids.shape[0]
    if padding:  # out-of-range ids: padding row num_rows, which no owner holds
      valid = (ids >= 0) & (ids < num_rows)
      rows = jnp.where(valid, ids, num_rows).astype(jnp.int32)
    else:  # table[ids]'s indexing: negative ids from the end, then clamped into range
      rows = jnp.clip(jnp.where(ids < 0, ids + num_rows, ids), 0, num_rows - 1)
      rows = rows.astype(jnp.int32)
    if plan.cyclic:  # logical ids, the cyclic table's physical rows
      rows = placement.physical_rows(rows, num_rows, num_shards)
    numbered = coalesce.sort_rows(rows, num_rows)
    slot = coalesce.segments_by_search(rows, numbered, num_rows)
    # Only the ids travel: values of no columns.
    distinct = bcoo.CoalescedRows(numbered.unique_rows, jnp.zeros((local_ids, 0), table.dtype))
    buckets = routing.bucket_by_owner(
      distinct, num_rows=num_rows, num_shards=num_shards, capacity=capacity
    )

    def routed_rows(table):
      asked = lax.all_to_all(buckets.rows, axis, 0, 0, tiled=True)
      local = routing.to_local(asked, shard, rows_per_shard)
      found = table.at[local].get(mode="fill", fill_value=0)
      answered = lax.all_to_all(found, axis, 0, 0, tiled=True)
      # The slot of each distinct id in its owner's bucket.
      owner = numbered.unique_rows[slot] // rows_per_shard
      bounds = jnp.arange(num_shards, dtype=jnp.int32) * rows_per_shard
      starts = jnp.searchsorted(numbered.unique_rows, bounds, side="left", method="compare_all")
      found = answered[owner * capacity + slot - starts[owner]]
      if padding:
        found = jnp.where(routing.expand(valid, found.ndim), found, jnp.zeros((), found.dtype))
      return found

    @jax.named_scope(routed.OVERFLOW_SCOPE)
    def gathered_rows(table):
      all_rows = lax.all_gather(rows, axis, tiled=True)
      local = routing.to_local(all_rows, shard, rows_per_shard)
      filled = table.at[local].get(mode="fill", fill_value=0)
      # One owner per id, zeros elsewhere: the sums are exact.
      return lax.psum_scatter(filled, axis, scatter_dimension=0, tiled=True)

    if capacity >= local_ids:
      return routed_rows(table), overflow.flag_of(False)
    overflowed = lax.pmax(buckets.overflow.astype(jnp.int32), axis) > 0
    return lax.cond(overflowed, gathered_rows, routed_rows, table), overflow.flag_of(overflowed)

  row_spec = PartitionSpec(axis, *([None] * len(row_shape)))
  return routed.per_shard(
    body,
    plan.mesh,
    in_specs=(row_spec, PartitionSpec(axis)),
    out_specs=(row_spec, PartitionSpec()),
  )(table, ids)
