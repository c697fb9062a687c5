"""Routing under `Auto` mesh axes, chosen from the shardings XLA's partitioner settled on.

Under `jax.jit` with `Auto` axes (arrays placed with
`jax.device_put(x, NamedSharding(mesh, P('x', None)))`), a traced array's type
names its mesh but not how it is split: that is decided later, by sharding
propagation. The step, the apply and the lookup of such a table are therefore
custom-partitioned ops (`partitioned.call`): the partitioner calls `partition`
with the shardings it chose for the operands, and the op is lowered per shard:

- the table and its state split by rows over the mesh's one axis: the routed
  step (`routed.masked_step`), apply (`routed.scatter_add`) and lookup, per
  shard; the gradient's entries are taken split over that axis (entries held
  whole are sliced; entries split otherwise are moved, O(entries) bytes);
- every table replicated: the step of one device, on every device, with the
  entries gathered (as XLA's partitioning of the step gathers them);
- the rows whole and the other dims split alike (columns), for a rule whose
  slots are all parameter-shaped: each device steps its block of columns;
- any other layout (a per-row slot on split columns, tables split unlike each
  other): the tables are gathered for the op, with a warning, and the results
  split back as the partitioner asks; `sharded_routing(False)` leaves the step
  to XLA instead.

Outside the partitioner (one device) the op is the unrouted step; a step that
is itself vmapped or differentiated is too. Its update has the routed step's
number of slots in every case (the unrouted step's padded): its shape is fixed
before the partitioner chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import sparse
from jax.sharding import NamedSharding, PartitionSpec

from optax_sparse_adam._core import bcoo
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan, Tables
from optax_sparse_adam._core.sharded import overflow, partitioned, routed, routing


def plan_step(grad: sparse.BCOO, tables: Tables, plan: StepPlan) -> routed.Plan | None:
  """A `routed.Plan` whose `mesh` is None (the layout is the partitioner's), or None.

  The conditions of `routed.plan_step`, with the axis read from the mesh the
  tables are typed on; the routing switches apply (`sharded_routing(False)`
  turns this off; an `auto_axis` routes at trace time instead).
  """
  arrays = [*tables.slots.values(), tables.row_step, tables.last_step, tables.param]
  found = _split_axis([a for a in arrays if a is not None], grad)
  if found is None:
    return None
  axis, num_shards = found
  capacity = routing.capacity(grad.nse // num_shards, num_shards, routed.current().capacity_factor)
  if not routing.int32_fits(grad.shape[0], num_shards * num_shards * capacity):
    return None
  routed.check_placement(plan, [], "step")
  return routed.Plan(axis, None, num_shards, capacity, routed.is_cyclic(num_shards, "step"))


def plan_apply(param: jax.Array, update: sparse.BCOO) -> routed.Plan | None:
  """A `routed.Plan` (mesh None) for `param + update` under `Auto` axes, or None."""
  found = _split_axis([param], update)
  if found is None:
    return None
  axis, num_shards = found
  return routed.Plan(axis, None, num_shards, 0, routed.is_cyclic(num_shards, "apply"))


def _split_axis(tables: list[jax.Array], entries: sparse.BCOO) -> tuple[str, int] | None:
  """`(axis, devices on it)` when the partitioner will lay out `tables` and `entries`
  (rows of one sparse dim) on a one-axis `Auto` mesh whose size divides both, else None."""
  if not partitioned.partitioner_decides():
    return None
  if entries.n_sparse != 1 or entries.n_batch != 0 or entries.nse == 0:
    return None
  found = partitioned.mesh_axis(tables, [entries.data, entries.indices])
  if found is None:
    return None
  axis, mesh = found
  num_shards = mesh.shape[axis]
  if entries.shape[0] % num_shards or entries.nse % num_shards:
    return None
  return axis, num_shards


def masked_step(
  inputs: StepInputs,
  plan: StepPlan,
  *,
  route: routed.Plan,
  local_step: Callable[[StepInputs, StepPlan], RowsStep],
) -> RowsStep:
  """The step, routed where the partitioner splits the tables by rows over `route.axis`.

  Args:
    inputs: as for `routed.masked_step`, global arrays.
    plan: the step's plan, for the whole table.
    route: from `plan_step` (mesh None).
    local_step: the backend's masked step.

  Returns:
    The `RowsStep` of `routed.masked_step`'s shapes: `num_shards**2 * capacity`
    slots, split over the axis when routed.
  """
  axis, num_shards, capacity = route.axis, route.num_shards, route.capacity
  num_rows = plan.layout.num_rows
  slots = num_shards * num_shards * capacity
  leaves, treedef = jax.tree.flatten(inputs)
  # Arrays are the op's operands; Python numbers stay closed over (constants).
  arrays_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
  operands = [leaves[i] for i in arrays_at]

  def rebuild(arrays: Sequence[Any]) -> StepInputs:
    full = list(leaves)
    for i, array in zip(arrays_at, arrays, strict=True):
      full[i] = array
    return jax.tree.unflatten(treedef, full)

  def flat(result: RowsStep, flag: jax.Array) -> tuple[jax.Array, ...]:
    return (result.rows, result.delta, *jax.tree.leaves(result.tables), flag)

  def whole_step(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    # The whole rows; the whole columns too, or a block of them (`partitioned.columns`).
    inputs = rebuild(arrays)
    layout = bcoo.RowLayout(plan.layout.sparse_shape, inputs.values.shape[1:])
    result = local_step(inputs, plan._replace(layout=layout))
    pad = slots - result.rows.shape[0]
    rows = jnp.concatenate([result.rows, jnp.full((pad,), num_rows, result.rows.dtype)])
    delta = jnp.concatenate(
      [result.delta, jnp.zeros((pad,) + result.delta.shape[1:], result.delta.dtype)]
    )
    return flat(result._replace(rows=rows, delta=delta), jnp.int32(overflow.NOT_ROUTED))

  def routed_step(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    return flat(*routed.flagged_step(rebuild(arrays), plan, route=route, local_step=local_step))

  probe = rebuild(list(range(len(operands))))  # which operand is what
  entry_ids: set[int] = {probe.rows, probe.values}  # type: ignore[arg-type]  # ints in the probe
  table_ids: set[int] = set(jax.tree.leaves(probe.tables))
  # The new tables, in order: the tables but the parameter (read, not written).
  carried_ids = jax.tree.leaves(probe.tables._replace(param=None))

  # A rule whose slots are all parameter-shaped steps each column on its own.
  by_columns = not any(slot.per_row for slot in plan.rule.slots())

  def partition(mesh, arg_shapes, result_shape):
    kinds = {partitioned.layout(arg_shapes[i].sharding, axis) for i in table_ids}
    columns = partitioned.columns([arg_shapes[i] for i in table_ids]) if by_columns else None
    if route.cyclic and not (kinds == {partitioned.ROWS} and mesh.shape[axis] == num_shards):
      _refuse_cyclic("step", axis)
    if kinds == {partitioned.ROWS} and mesh.shape[axis] == num_shards:
      in_specs = [
        partitioned.row_spec(axis, s.ndim) if i in entry_ids | table_ids else PartitionSpec()
        for i, s in enumerate(arg_shapes)
      ]
      out_specs = [partitioned.row_spec(axis, s.ndim) for s in result_shape[:-1]]
      out_specs.append(PartitionSpec())  # the overflow flag
      body = routed_step
    elif columns is not None:  # the rows whole, the columns split: each device its columns
      in_specs = [
        columns if i in table_ids | {probe.values} and s.ndim > 1 else PartitionSpec()
        for i, s in enumerate(arg_shapes)
      ]
      out_specs = (
        [PartitionSpec(), columns] + [in_specs[i] for i in carried_ids] + [PartitionSpec()]
      )
      body = whole_step
    else:
      if kinds != {partitioned.WHOLE}:
        partitioned.warn_gathered("step", [arg_shapes[i].sharding for i in sorted(table_ids)], axis)
      in_specs = [PartitionSpec()] * len(arg_shapes)
      out_specs = [PartitionSpec()] * len(result_shape)
      body = whole_step
    return (
      mesh,
      body,
      tuple(NamedSharding(mesh, s) for s in out_specs),
      tuple(NamedSharding(mesh, s) for s in in_specs),
    )

  rule = _rule(
    operands,
    jax.eval_shape(whole_step, *operands),
    num_shards=num_shards,
    table_ids=table_ids,
    carried_ids=carried_ids,
    entry_ids=entry_ids,
    entries_split=False,
    flags=1,
  )
  out = partitioned.call(whole_step, operands, partition, rule)
  new_tables = jax.tree.unflatten(
    jax.tree.structure(inputs.tables._replace(param=None)), list(out[2:-1])
  )
  overflow.note(overflow.STEP, out[-1])
  return RowsStep(out[0], out[1], new_tables)


def scatter_add(
  param: jax.Array,
  update: sparse.BCOO,
  *,
  layout: bcoo.RowLayout,
  plan: routed.Plan,
  local_scatter_add: Callable[..., jax.Array],
) -> jax.Array:
  """`param + update`, routed (`routed.scatter_add`) where the partitioner splits `param`'s rows."""
  axis = plan.axis
  unique, is_sorted = bool(update.unique_indices), bool(update.indices_sorted)

  def as_bcoo(data: jax.Array, indices: jax.Array) -> sparse.BCOO:
    return sparse.BCOO(
      (data, indices), shape=update.shape, unique_indices=unique, indices_sorted=is_sorted
    )

  def whole_add(param: jax.Array, data: jax.Array, indices: jax.Array) -> tuple[jax.Array]:
    rows = bcoo.linear_rows(indices, layout)
    # The whole columns, or a block of them (`partitioned.columns`).
    local = bcoo.RowLayout(layout.sparse_shape, data.shape[1:])
    added = local_scatter_add(
      param, rows, data, layout=local, rows_unique=unique, rows_sorted=is_sorted
    )
    return (added,)

  def routed_add(param: jax.Array, data: jax.Array, indices: jax.Array) -> tuple[jax.Array]:
    added = routed.scatter_add(
      param,
      as_bcoo(data, indices),
      layout=layout,
      plan=plan,
      local_scatter_add=local_scatter_add,
    )
    return (added,)

  def partition(mesh, arg_shapes, result_shape):
    param_shape = arg_shapes[0]
    rows_split = (
      partitioned.layout(param_shape.sharding, axis) == partitioned.ROWS
      and mesh.shape[axis] == plan.num_shards
    )
    if plan.cyclic and not rows_split:
      _refuse_cyclic("apply", axis)
    if rows_split:
      specs = [partitioned.row_spec(axis, s.ndim) for s in arg_shapes]
      body, out_spec = routed_add, partitioned.row_spec(axis, param_shape.ndim)
    elif (columns := partitioned.columns([param_shape])) is not None:
      specs = [columns, columns, PartitionSpec()]
      body, out_spec = whole_add, columns
    else:
      if partitioned.layout(param_shape.sharding, axis) != partitioned.WHOLE:
        partitioned.warn_gathered("apply", [param_shape.sharding], axis)
      specs = [PartitionSpec()] * 3
      body, out_spec = whole_add, PartitionSpec()
    return (
      mesh,
      body,
      (NamedSharding(mesh, out_spec),),
      tuple(NamedSharding(mesh, s) for s in specs),
    )

  operands = [param, update.data, update.indices]
  rule = _rule(
    operands,
    jax.eval_shape(whole_add, *operands),
    num_shards=plan.num_shards,
    table_ids={0},
    carried_ids=[0],
    entry_ids={1, 2},
    entries_split=True,
  )
  (out,) = partitioned.call(whole_add, operands, partition, rule)
  return out


def lookup(
  table: jax.Array,
  ids: jax.Array,
  *,
  plan: routed.Plan,
  routed_lookup: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
  whole_lookup: Callable[[jax.Array, jax.Array], jax.Array],
) -> jax.Array:
  """`table[ids]`: `routed_lookup` per shard where the partitioner splits `table` by rows.

  Args:
    table: `(num_rows, ...)`.
    ids: `(batch,)` integer ids.
    plan: a `routed.Plan` without a mesh.
    routed_lookup: the routed lookup of a shard's table and ids (axis bound), and its
      overflow flag (counted in `overflow.routing_stats`).
    whole_lookup: the lookup of the whole table, or of a block of its columns.

  Returns:
    `(batch, ...)` rows.
  """
  axis = plan.axis

  def routed_rows(table: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    return routed_lookup(table, ids)

  def whole_rows(table: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    return whole_lookup(table, ids), jnp.int32(overflow.NOT_ROUTED)

  def partition(mesh, arg_shapes, result_shape):
    table_shape, ids_shape = arg_shapes
    kind = partitioned.layout(table_shape.sharding, axis)
    ids_spec = partitioned.spec(ids_shape.sharding, 1) or PartitionSpec(None)
    if plan.cyclic and not (kind == partitioned.ROWS and mesh.shape[axis] == plan.num_shards):
      _refuse_cyclic("lookup", axis)
    if kind == partitioned.ROWS and mesh.shape[axis] == plan.num_shards:
      specs = [partitioned.row_spec(axis, table_shape.ndim), PartitionSpec(axis)]
      body, out_spec = routed_rows, partitioned.row_spec(axis, table_shape.ndim)
    elif kind == partitioned.WHOLE:  # each device its ids' rows
      specs = [PartitionSpec(), ids_spec]
      body, out_spec = whole_rows, PartitionSpec(*ids_spec, *[None] * (table_shape.ndim - 1))
    elif (columns := partitioned.columns([table_shape])) is not None:  # all ids, a block of columns
      specs = [columns, PartitionSpec()]
      body, out_spec = whole_rows, columns
    else:
      partitioned.warn_gathered("lookup", [table_shape.sharding], axis)
      specs = [PartitionSpec(), PartitionSpec()]
      body, out_spec = whole_rows, PartitionSpec()
    return (
      mesh,
      body,
      (NamedSharding(mesh, out_spec), NamedSharding(mesh, PartitionSpec())),
      tuple(NamedSharding(mesh, s) for s in specs),
    )

  columns = " ".join(f"d{i}" for i in range(table.ndim - 1))
  rule = partitioned.Rule(
    f"(p t) {columns}, e -> e {columns}, ",  # the rows, the overflow flag
    {"p": plan.num_shards, "t": table.shape[0] // plan.num_shards},
  )
  rows, flag = partitioned.call(whole_rows, [table, ids], partition, rule)
  overflow.note(overflow.LOOKUP, flag)
  return rows


def _refuse_cyclic(what: str, axis: str) -> None:
  raise ValueError(
    f"row_placement='cyclic': XLA's partitioner did not split the {what}'s table by rows "
    f"over {axis!r}, and unrouted the {what} would read logical ids as cyclic rows; "
    f"declare the axis (sharded_routing(auto_axis={axis!r}, row_placement='cyclic'))"
  )


def _rule(
  operands: Sequence[jax.Array],
  outputs: Sequence[jax.ShapeDtypeStruct],
  *,
  num_shards: int,
  table_ids: set[int],
  carried_ids: Sequence[int],
  entry_ids: set[int],
  entries_split: bool,
  flags: int = 0,
) -> partitioned.Rule:
  """The op's Shardy rule.

  The first dim of every table, and of the update's rows and values, is the
  compound `(p t)` / `(p s)` with `p` of the axis's size: a table split by rows
  over the axis makes Shardy split the update by the same blocks (as the
  routed step returns it), a replicated table leaves it whole. A new table has
  its table's factors. The gradient's entries (`entries_split` False) and every
  other dim have factors of their own. The last `flags` outputs are scalars.
  """
  names = iter(f"f{i}" for i in range(10_000))
  sizes = {"p": num_shards}
  wide = max((x.ndim for x in operands if x.ndim > 1), default=1)
  columns = [f"d{i}" for i in range(wide - 1)]  # the trailing dims of tables and entries
  factors: dict[int, list[str]] = {}
  lhs = []
  for i, x in enumerate(operands):
    if x.ndim and i in table_ids:
      sizes["t"] = x.shape[0] // num_shards
      factors[i] = ["(p t)"] + columns[: x.ndim - 1]
      dims = factors[i]
    elif x.ndim and i in entry_ids:
      if entries_split:
        sizes["s"] = x.shape[0] // num_shards
      dims = ["(p s)" if entries_split else "e"] + (columns if x.ndim == wide else [])
      dims += [next(names) for _ in range(x.ndim - len(dims))]
    else:
      dims = [next(names) for _ in range(x.ndim)]
    lhs.append(" ".join(dims))
  rhs = []
  outputs = outputs[: len(outputs) - flags]
  for out in outputs[: len(outputs) - len(carried_ids)]:  # the update's rows and values
    sizes["s"] = out.shape[0] // num_shards
    rhs.append(" ".join(["(p s)"] + columns[: out.ndim - 1]))
  rhs += [" ".join(factors[i]) for i in carried_ids] + [""] * flags
  return partitioned.Rule(", ".join(lhs) + " -> " + ", ".join(rhs), sizes)
