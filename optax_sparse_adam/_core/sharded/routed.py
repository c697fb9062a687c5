"""The routed step and apply of a row-sharded table: each gradient row goes to its row's owner.

Under `jax.jit`, XLA's partitioner runs a row-sharded table's step by sending
every device every other device's gradient entries (all-reduces of `[N * B, D]`
arrays for `N` devices and a local batch of `B`), so a device's traffic grows
with `N`. When a table and its moments are split by rows over a mesh axis,
`P(axis, None)`, and the gradient's entries over the same axis, the step here
runs in `jax.shard_map` instead, in time and traffic of O(local entries):

  1. each device coalesces its own entries (sums a row's entries, input order);
  2. one `all_to_all` sends each distinct row's sum to the device owning the row,
     into a fixed `capacity` of slots per owner (`routing.capacity`);
  3. the owner runs the backend's rows step on its shard with what it received
     (the step coalesces again: the senders' sums of a row add in device order).

The update comes back split over the axis, each device holding its own rows,
so `apply_updates` adds it locally, with no collective but a flag.

A step where some device has more distinct rows for one owner than the
capacity (heavily skewed ids) takes the overflow path, decided on every device
alike: all devices' entries are all-gathered, each owner sums its rows' entries
in global input order (as one device does) and steps them in rounds of as many
distinct rows as the update has slots, and the owners' rows are spread over the
update's slots (`routing.spread_rows`); `apply_updates` then sees rows on
devices that do not own them and all-gathers the update. Nothing is dropped;
such a step costs what the partitioned step costs.

The tables ride a `while_loop` (one round unless the step overflows), and the
applied parameter two loops of one trip or none, not a `cond`: XLA updates a
loop's carry in place, but copies a table that a cond's branch both reads and
writes.

Routing is chosen at trace time where the arrays' shardings are known there:
concrete arrays, and arrays typed on a mesh with `Explicit` axes. Under `Auto`
axes a traced array's type does not say how XLA will split it: there
`auto_partition` runs this step per shard once the partitioner has chosen the
shardings; `sharded_routing(auto_axis=...)` declares the axis at trace time
instead, and `sharded_routing(False)` turns routing off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import sparse
from jax.sharding import PartitionSpec

from optax_sparse_adam._core import bcoo, coalesce
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan, Tables, stores_rows
from optax_sparse_adam._core.sharded import overflow, placement, routing, sharding
from optax_sparse_adam._core.switches import Switch

# Names the overflow path's ops in the compiled program (benchmarks and tests
# tell its collectives from those of the routed path by it).
OVERFLOW_SCOPE = "routed_overflow"


class Routing(NamedTuple):
  """The routing switches in force while a step is traced (part of JAX's cache keys).

  Attributes:
    enabled: route row-sharded tables' steps and applies where the layout allows.
    capacity_factor: slots per owner, as a multiple of the even share
      `local entries / devices` (`routing.capacity`); larger means fewer
      overflowing steps and more bytes per step. None: sized for uniform ids
      (six standard deviations over the share, at most twice it).
    auto_axis: under `Auto` mesh axes, the axis over which traced tables and
      gradient entries are taken to be split by rows; None leaves the choice to
      the shardings XLA's partitioner picks (`auto_partition`).
    row_placement: "block", "cyclic" (`placement`), or None: not said (blocks,
      refused once tables are cyclic: `placement.refuse_unsaid`).
    cyclic_seen: set once tables are cyclic: a new cache key, so steps traced
      before are traced (and checked) again.
  """

  enabled: bool = True
  capacity_factor: float | None = None
  auto_axis: str | None = None
  row_placement: str | None = None
  cyclic_seen: bool = False


def _check(choice: Routing) -> None:
  if choice.capacity_factor is not None and not choice.capacity_factor >= 1:
    raise ValueError(f"capacity_factor={choice.capacity_factor!r}; expected a number >= 1")
  if choice.row_placement is not None and choice.row_placement not in placement.PLACEMENTS:
    raise ValueError(
      f"row_placement={choice.row_placement!r}; expected one of {placement.PLACEMENTS}"
    )
  if choice.row_placement == placement.CYCLIC and not choice.enabled:
    raise ValueError("row_placement='cyclic' needs routing enabled: only routed steps map ids")
  if choice.row_placement == placement.CYCLIC:
    placement.note_cyclic_use()


_SWITCH = Switch(Routing(), _check)
placement.on_cyclic_use(lambda: _SWITCH.set_default(cyclic_seen=True))
# The routing switches in force now; within `choose(**changes)`, steps traced use them changed.
current = _SWITCH.current
choose = _SWITCH.choose


def sharded_routing(
  enabled: bool = True,
  *,
  capacity_factor: float | None = None,
  auto_axis: str | None = None,
  row_placement: str | None = None,
) -> contextlib.AbstractContextManager[None]:
  """Within this block, steps traced route (or not) the gradients of row-sharded tables.

  A table split by rows over a mesh axis, `P(axis, None)`, with its moments
  (as `init` makes them), and a BCOO gradient whose entries are split over the
  same axis (ids sharded `P(axis)`, as a data-parallel batch) are stepped
  *routed* by default: each device sums its own entries per row, one
  `all_to_all` sends each row's sum to the device that owns the row, and the
  owner steps its rows; `apply_updates` then adds each device's rows locally.
  A device sends and receives a fixed number of slots per owner, the
  capacity: by default the even share of its local entries plus six standard
  deviations of a uniform batch's count (docs/sharding.md).

  Routing is chosen from the sharding of concrete arrays, and from the types of
  values traced under a mesh with `Explicit` axes. Under `Auto` axes (a mesh of
  one axis of several devices) the step, `apply_updates` and `sharded_lookup`
  are lowered per device once XLA's partitioner has chosen their shardings:
  routed where the table is split by rows, kept as laid out where it is
  replicated or split on its columns (docs/sharding.md). With `auto_axis`,
  tables and entries on a mesh with that axis are instead taken at trace time
  to be split by rows over it (a table split otherwise is resharded, at the
  cost of moving it).

  A step in which some device holds more distinct rows for one owner than its
  capacity is not dropped: it all-gathers every device's entries and matches
  one device bit for bit, at the cost of the unrouted step. The setting is
  part of the key of JAX's trace and compilation caches.

  Args:
    enabled: route where the layout allows; False leaves every step to XLA's
      partitioner, as without this feature.
    capacity_factor: slots per owner as a multiple of the even share of a
      device's entries, at least 1. Larger: fewer overflowing steps, more bytes.
      None (the default): sized for uniform ids (`routing.capacity`); give a
      factor past the skew of ids whose hot rows share an owner.
    auto_axis: the mesh axis of row-split tables under `Auto` axes, or None
      (routed where the partitioner splits the table by rows).
    row_placement: "block" (the default): a row-split table holds its rows as
      `P(axis, None)` places them, device `k` the `k`-th block. "cyclic": every
      row-split table stepped, applied or looked up in the block holds logical
      row `r` on device `r % N` (`osa.to_cyclic_rows` makes one); ids,
      gradients and updates stay logical. A frequency-sorted vocabulary then
      spreads its hot rows over every device and skewed ids stay routed
      (docs/sharding.md). A row-split table that cannot be routed is refused.
      None (the default): the enclosing block's, else blocks; once tables are
      cyclic, a row-split table traced with none said is refused.

  Returns:
    A context manager.

  Example:
    >>> import optax_sparse_adam as osa
    >>> with osa.sharded_routing(capacity_factor=4.0):
    ...   pass  # steps traced here route with 4x the even share per owner
  """
  said = {} if row_placement is None else {"row_placement": row_placement}
  return choose(enabled=enabled, capacity_factor=capacity_factor, auto_axis=auto_axis, **said)


class Plan(NamedTuple):
  """How a leaf is routed: the mesh axis, its mesh and size, and the slots per owner.

  A None mesh: the step is already lowered per shard (`auto_partition`). `cyclic`:
  the tables hold their rows cyclically (`placement`), ids are mapped in and out.
  """

  axis: str
  mesh: Any
  num_shards: int
  capacity: int
  cyclic: bool = False


def is_cyclic(num_shards: int, what: str) -> bool:
  """Whether a routed `what`'s table holds its rows cyclically (`placement.refuse_unsaid`)."""
  row_placement = current().row_placement
  placement.refuse_unsaid(row_placement, num_shards, what)
  return row_placement == placement.CYCLIC


def check_placement(plan: StepPlan | None, arrays: list[Any], what: str) -> None:
  """Refuses cyclic tables where the step cannot honour them (`placement.check`)."""
  choice = current()
  placement.check(choice.row_placement, choice.auto_axis, plan, arrays, what)


def physical_ids(rows: jax.Array, table: jax.Array, what: str) -> jax.Array:
  """Logical ids as `table`'s rows for a direct gather (`placement.physical_ids`)."""
  choice = current()
  return placement.physical_ids(rows, table, choice.row_placement, choice.auto_axis, what)


def plan_step(grad: sparse.BCOO, tables: Tables, plan: StepPlan) -> Plan | None:
  """The `Plan` of a step, or None where the layout does not allow routing.

  Args:
    grad: the BCOO gradient (entries split over the axis, `n_sparse == 1`).
    tables: the rule's slots, the per-row arrays and the parameter (where weight
      decay reads it), all to be split by rows like the table.
    plan: the step's plan.
  """
  # Every rule and option routes (stochastic rounding: `StepInputs.row_offset`).
  arrays = [*tables.slots.values(), tables.row_step, tables.last_step, tables.param]
  found = _plan(grad, [a for a in arrays if a is not None])
  if found is None:
    return None
  axis, mesh, num_shards = found
  local = grad.nse // num_shards
  capacity = routing.capacity(local, num_shards, current().capacity_factor)
  if not routing.int32_fits(grad.shape[0], num_shards * num_shards * capacity):
    return None
  check_placement(plan, [], "step")
  return Plan(axis, mesh, num_shards, capacity, is_cyclic(num_shards, "step"))


def plan_apply(param: jax.Array, update: sparse.BCOO) -> Plan | None:
  """The `Plan` of `param + update`, or None where it is not routed."""
  found = _plan(update, [param])
  if found is None:
    return None
  return Plan(*found, capacity=0, cyclic=is_cyclic(found[2], "apply"))


def masked_step(
  inputs: StepInputs,
  plan: StepPlan,
  *,
  route: Plan,
  local_step: Callable[[StepInputs, StepPlan], RowsStep],
) -> RowsStep:
  """The routed masked step (`flagged_step`), counted in `overflow.routing_stats`."""
  result, flag = flagged_step(inputs, plan, route=route, local_step=local_step)
  overflow.note(overflow.STEP, flag)
  return result


def flagged_step(
  inputs: StepInputs,
  plan: StepPlan,
  *,
  route: Plan,
  local_step: Callable[[StepInputs, StepPlan], RowsStep],
) -> tuple[RowsStep, jax.Array]:
  """The routed masked step: `local_step` (the backend's) runs on each owner's shard.

  Args:
    inputs: as for `_backends.dispatch.masked_step`, global arrays split over
      `route.axis` (the step count, hyper-parameters and rounding zero
      replicated).
    plan: the step's plan, for the whole table.
    route: from `plan_step`.
    local_step: the backend's masked step, called on one shard.

  Returns:
    The `RowsStep`: `route.num_shards * route.capacity` slots per device, each
    device holding rows it owns (ascending) then padding, except after an
    overflowing step (see the module docstring); the new tables, split as given.
    And the step's `overflow` flag, an int32 scalar alike on every device.
  """
  axis, num_shards, capacity = route.axis, route.num_shards, route.capacity
  layout = plan.layout
  rows, values, tables = inputs.rows, inputs.values, inputs.tables
  num_rows = layout.num_rows
  rows_per_shard = num_rows // num_shards
  if route.cyclic:  # logical ids in, the cyclic tables' physical rows within
    rows = placement.physical_rows(rows, num_rows, num_shards)
  slots = num_shards * capacity  # the update's slots per device
  local_plan = plan._replace(layout=bcoo.RowLayout((rows_per_shard,), layout.dense_shape))
  # What a shard's step reads and writes, split by rows (the parameter is read only).
  carried_tables = tables._replace(param=None)
  # Hyper-parameters that are arrays cross into the shard_map as arguments;
  # Python floats stay closed over: constants, exact until used, as unrouted.
  leaves, treedef = jax.tree.flatten(inputs.hyper)
  traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
  replicated_inputs = (inputs.step, [leaves[i] for i in traced], inputs.opaque_zero)

  def owner_step(local_rows, local_values, carried, param, replicated):
    local_values = routing.from_bits(local_values, values.dtype)  # 16-bit: as bits (as_bits)
    step, arrays, opaque_zero = replicated
    full = list(leaves)
    for i, array in zip(traced, arrays, strict=True):
      full[i] = array
    hyper = jax.tree.unflatten(treedef, full)
    # Stochastic rounding keys on global rows: the shard's first row is added.
    row_offset = lax.axis_index(axis).astype(jnp.int32) * rows_per_shard
    carried = carried._replace(param=param)
    result = local_step(
      StepInputs(local_rows, local_values, carried, step, hyper, opaque_zero, row_offset),
      local_plan,
    )
    return result.rows, result.delta, result.tables

  def body(rows, values, carried, param, replicated):
    shard = lax.axis_index(axis)
    local_entries = rows.shape[0]
    coalesced = coalesce.coalesce_rows(rows, values, num_rows)
    buckets = routing.bucket_by_owner(
      coalesced, num_rows=num_rows, num_shards=num_shards, capacity=capacity
    )

    def routed_input(round_index):
      got_rows, got_values = routing.exchange(buckets.rows, buckets.values, axis, max_row=num_rows)
      return routing.to_local(got_rows, shard, rows_per_shard), got_values, jnp.int32(1), 0

    if capacity >= local_entries:  # no device can fill a bucket: no overflow path
      local, got_values, _, _ = routed_input(0)
      unique_rows, delta, carried = owner_step(local, got_values, carried, param, replicated)
      ids = routing.owned_ids(unique_rows, shard, rows_per_shard)
      return routing.decode_rows(ids, shard, num_rows), delta, carried, overflow.flag_of(False)

    @jax.named_scope(OVERFLOW_SCOPE)
    def gathered_input(round_index):
      # All entries of the owner's rows, summed in global input order (as one
      # device sums them), stepped `slots` distinct rows per round.
      all_rows, all_values = routing.gather_all(rows, values, axis, max_row=num_rows)
      local = routing.to_local(all_rows, shard, rows_per_shard)
      owned = coalesce.coalesce_rows(local, all_values, rows_per_shard)
      count = jnp.sum(owned.rows < rows_per_shard, dtype=jnp.int32)
      rounds = lax.pmax(-(-count // slots), axis)
      counts = lax.all_gather(count, axis)
      first_slot = jnp.sum(jnp.where(jnp.arange(num_shards) < shard, counts, 0))
      chunk_rows = routing.chunk(owned.rows, round_index, slots, rows_per_shard)
      chunk_values = routing.as_bits(routing.chunk(owned.values, round_index, slots, 0))
      return jnp.minimum(chunk_rows, rows_per_shard), chunk_values, rounds, first_slot

    # Every device takes the same branches: the collectives inside must match.
    overflowed = lax.pmax(buckets.overflow.astype(jnp.int32), axis) > 0

    def one_round(loop):
      round_index, _, carried, ids, delta = loop
      local, got_values, rounds, first_slot = lax.cond(
        overflowed, gathered_input, routed_input, round_index
      )
      unique_rows, round_delta, carried = owner_step(local, got_values, carried, param, replicated)

      @jax.named_scope(OVERFLOW_SCOPE)
      def spread(_):
        owned = unique_rows < rows_per_shard
        global_rows = jnp.where(owned, unique_rows + shard * rows_per_shard, num_rows)
        return routing.spread_rows(
          global_rows,
          round_delta,
          first_slot + round_index * slots,
          axis=axis,
          slots=slots,
          num_rows=num_rows,
        )

      def own(_):
        return routing.owned_ids(unique_rows, shard, rows_per_shard), routing.as_bits(round_delta)

      round_ids, round_delta = lax.cond(overflowed, spread, own, None)
      landed = round_ids > 0
      ids = jnp.where(landed, round_ids, ids)
      delta = jnp.where(routing.expand(landed, delta.ndim), round_delta, delta)
      return round_index + 1, rounds, carried, ids, delta

    # The tables travel in a loop, not a cond (module docstring); a 16-bit delta as its bits.
    dtype = param.dtype if stores_rows(plan.rule, plan.config) else values.dtype  # the delta's
    delta = routing.as_bits(jnp.zeros((slots,) + values.shape[1:], dtype))
    loop = (jnp.int32(0), jnp.int32(1), carried, jnp.zeros((slots,), jnp.int32), delta)
    _, _, carried, ids, delta = lax.while_loop(lambda loop: loop[0] < loop[1], one_round, loop)
    delta = routing.from_bits(delta, dtype)
    return routing.decode_rows(ids, shard, num_rows), delta, carried, overflow.flag_of(overflowed)

  def row_specs(tree: Any) -> Any:
    return jax.tree.map(lambda x: _row_spec(axis, x.ndim), tree)

  replicated_specs = jax.tree.map(lambda _: PartitionSpec(), replicated_inputs)
  new_rows, delta, new_tables, flag = per_shard(
    body,
    route.mesh,
    in_specs=(
      PartitionSpec(axis),
      _row_spec(axis, values.ndim),
      row_specs(carried_tables),
      None if tables.param is None else row_specs(tables.param),
      replicated_specs,
    ),
    out_specs=(
      PartitionSpec(axis),
      _row_spec(axis, values.ndim),
      row_specs(carried_tables),
      PartitionSpec(),  # the flag: alike on every device
    ),
  )(rows, values, carried_tables, tables.param, replicated_inputs)
  if route.cyclic:
    new_rows = placement.logical_rows(new_rows, num_rows, num_shards)
  return RowsStep(new_rows, delta, new_tables), flag


def scatter_add(
  param: jax.Array,
  update: sparse.BCOO,
  *,
  layout: bcoo.RowLayout,
  plan: Plan,
  local_scatter_add: Callable[..., jax.Array],
) -> jax.Array:
  """`param + update` on each owner's shard, for a row-split `param` and update.

  A device adds the entries it holds that it owns. Entries held by a device that
  does not own their row (any update but the routed step's, or one after an
  overflowing step) make every device all-gather the update first, so each
  entry is added once, by its owner.
  """
  axis, num_shards = plan.axis, plan.num_shards
  num_rows = layout.num_rows
  rows_per_shard = num_rows // num_shards
  local_layout = bcoo.RowLayout((rows_per_shard,), layout.dense_shape)
  unique = bool(update.unique_indices)

  def add(param, rows, values):
    # Distinct padding keeps the promise of unique rows.
    padded = jnp.where(
      rows < rows_per_shard, rows, rows_per_shard + jnp.arange(rows.shape[0], dtype=jnp.int32)
    )
    return local_scatter_add(
      param, padded, values, layout=local_layout, rows_unique=unique, rows_sorted=False
    )

  def body(param, rows, values):
    shard = lax.axis_index(axis)
    local = routing.to_local(rows, shard, rows_per_shard)
    foreign = jnp.any((rows < num_rows) & (local == rows_per_shard))
    foreign = lax.pmax(foreign.astype(jnp.int32), axis)  # 1 on every device, or 0

    @jax.named_scope(OVERFLOW_SCOPE)
    def gathered(param):
      all_rows, all_values = routing.gather_all(rows, values, axis, max_row=num_rows)
      return add(param, routing.to_local(all_rows, shard, rows_per_shard), all_values)

    # Two loops of one trip or none, not a cond: XLA updates a loop's carry in
    # place, but copies a table that a cond's branch both reads and writes.
    param = _repeat(gathered, foreign, param)
    return _repeat(lambda p: add(p, local, values), 1 - foreign, param)

  rows = bcoo.linear_rows(update.indices, layout)
  if plan.cyclic:
    rows = placement.physical_rows(rows, num_rows, num_shards)
  table_spec = _row_spec(axis, param.ndim)
  return per_shard(
    body,
    plan.mesh,
    in_specs=(table_spec, PartitionSpec(axis), _row_spec(axis, update.data.ndim)),
    out_specs=table_spec,
  )(param, rows, update.data)


def _repeat(fn: Callable[[jax.Array], jax.Array], trips: jax.Array, x: jax.Array) -> jax.Array:
  """`fn` applied `trips` times to `x`, which rides a `while_loop`'s carry (updated in place)."""
  _, x = lax.while_loop(
    lambda loop: loop[0] < trips, lambda loop: (loop[0] + 1, fn(loop[1])), (jnp.int32(0), x)
  )
  return x


def per_shard(body: Callable[..., Any], mesh: Any, *, in_specs: Any, out_specs: Any) -> Any:
  """`body` run on each shard of `mesh`; `body` itself where `mesh` is None.

  A None mesh means the caller already runs per shard, with the axis bound
  (`auto_partition` lowers a step for the shardings XLA's partitioner chose).
  """
  if mesh is None:
    return body
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _row_spec(axis: str, ndim: int) -> PartitionSpec:
  return PartitionSpec(axis, *([None] * (ndim - 1)))


def _plan(entries: sparse.BCOO, tables: list[jax.Array]) -> tuple[str, Any, int] | None:
  """`(axis, mesh, size)` when `entries` and every table are split by rows over one axis."""
  choice = current()
  if not choice.enabled or entries.n_sparse != 1 or entries.n_batch != 0 or entries.nse == 0:
    return None
  found = {
    sharding.split_rows(x, choice.auto_axis) for x in (entries.data, entries.indices, *tables)
  }
  if len(found) != 1 or None in found:
    return None
  ((axis, mesh),) = found  # type: ignore[misc]  # None was ruled out above
  num_shards = mesh.shape[axis]
  if num_shards < 2 or entries.shape[0] % num_shards or entries.nse % num_shards:
    return None
  return axis, mesh, num_shards
