"""Plumbing for ops that XLA's partitioner lowers per shard, by the shardings it chose.

`jax.experimental.custom_partitioning` runs a Python `partition` callback after
sharding propagation, with the operands' shardings, and lowers the body it
returns on each device's shards (mesh axes bound for collectives). Under
Shardy, JAX's default partitioner, propagation through the op follows an
einsum-like sharding rule (`Rule`). `auto_partition` builds the sparse step,
apply and lookup on this.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import custom_partitioning as cp
from jax.sharding import NamedSharding, PartitionSpec

from optax_sparse_adam._core.sharded import routed, sharding

# How an operand's sharding reads: split by rows over the axis, whole, or other.
ROWS, WHOLE, OTHER = "rows", "whole", "other"


def mesh_axis(tables: Sequence[jax.Array], entries: Sequence[jax.Array]) -> tuple[str, Any] | None:
  """`(axis, mesh)` when the partitioner will choose the layout: `tables` typed on one mesh
  of `Auto` axes of which one, `axis`, has more than one device; `entries` on it or on none.

  None where routing is already chosen at trace time (`sharding.split_rows`: no
  tracer, `Explicit` axes), inside `shard_map` (manual axes), or on a mesh of
  several axes (the axis of the rows could be any of them).
  """
  meshes = set()
  for x in tables:
    if not isinstance(x, jax.core.Tracer):
      return None
    meshes.add(_mesh_of(x))
  for x in entries:
    mesh = _mesh_of(x) if isinstance(x, jax.core.Tracer) else None
    if mesh is not None and not mesh.empty:
      meshes.add(mesh)
  if len(meshes) != 1:
    return None
  (mesh,) = meshes
  if mesh is None or mesh.empty or tuple(getattr(mesh, "auto_axes", ())) != mesh.axis_names:
    return None
  split = [name for name in mesh.axis_names if mesh.shape[name] > 1]
  return (split[0], mesh) if len(split) == 1 else None


def call(
  whole: Callable[..., Any],
  operands: Sequence[jax.Array],
  partition: Callable[..., Any],
  rule: Rule,
) -> tuple[jax.Array, ...]:
  """`whole(*operands)` as a custom-partitioned op whose per-shard lowering `partition` picks.

  `custom_partitioning` traces a function that closes over no array: `whole`
  runs from its jaxpr, the arrays it closes over (constants) passed after
  `operands`, replicated. `partition`'s bodies take `operands` only.
  """
  closed = jax.make_jaxpr(whole)(*operands)
  consts = list(closed.consts)
  num_operands = len(operands)

  def from_jaxpr(*args: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jax.core.eval_jaxpr(closed.jaxpr, args[num_operands:], *args[:num_operands]))

  def partition_all(mesh, arg_shapes, result_shape):
    mesh, body, out_shardings, in_shardings = partition(
      mesh, arg_shapes[:num_operands], result_shape
    )
    replicated = NamedSharding(mesh, PartitionSpec())

    def lowered(*args: jax.Array) -> Any:
      with sharding.lowering_per_shard():  # the CPU kernels may run on a shard
        return body(*args[:num_operands])

    return mesh, lowered, out_shardings, (*in_shardings, *[replicated] * len(consts))

  op = cp.custom_partitioning(from_jaxpr)
  lhs, rhs = rule.text.split(" -> ")
  const_factors = [" ".join(f"c{i}_{d}" for d in range(jnp.ndim(c))) for i, c in enumerate(consts)]
  text = ", ".join([lhs, *const_factors]) + " -> " + rhs
  op.def_partition(partition=partition_all, sharding_rule=text, **rule.sizes)

  # `custom_partitioning` has no batching or differentiation rule: a step that
  # is itself vmapped or differentiated is the whole step, left to XLA.
  @jax.custom_batching.custom_vmap
  def partitioned(*args: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(op(*args))

  @partitioned.def_vmap
  def _batched(axis_size, in_batched, *args):
    del axis_size
    in_axes = [0 if batched else None for batched in in_batched]
    out = jax.vmap(from_jaxpr, in_axes=in_axes)(*args)
    return out, (True,) * len(out)

  @jax.custom_jvp
  def differentiable(*args: jax.Array) -> tuple[jax.Array, ...]:
    return partitioned(*args)

  @differentiable.defjvp
  def _jvp(primals, tangents):
    # The value partitioned as above; the tangents from the whole op (its
    # value there is not used, and XLA drops it).
    return partitioned(*primals), jax.jvp(from_jaxpr, primals, tangents)[1]

  return tuple(differentiable(*operands, *consts))


def warn_gathered(what: str, shardings: Sequence[Any], axis: str) -> None:
  """Warns, at compile time, that a table of this layout is gathered for the op."""
  specs = sorted({str(getattr(s, "spec", s)) for s in shardings})
  warnings.warn(
    f"optax_sparse_adam: the sparse {what} of a table sharded {', '.join(specs)} under Auto "
    f"mesh axes gathers the table on every device (tables split by rows, P({axis!r}, None), "
    "replicated, or, for rules of parameter-shaped slots only, split alike on the other "
    "dims are not gathered). Split the table by rows, or leave the step to XLA's "
    "partitioner with osa.sharded_routing(False).",
    stacklevel=2,
  )


def partitioner_decides() -> bool:
  """Whether the routing switches in force leave the choice to the partitioner.

  Routing on, no `auto_axis` (which routes at trace time instead), and Shardy
  (JAX's default partitioner), whose sharding rules the ops here give.
  """
  choice = routed.current()
  shardy = bool(getattr(jax.config, "jax_use_shardy_partitioner", False))
  return choice.enabled and choice.auto_axis is None and shardy


def layout(sharding: Any, axis: str) -> str:
  """`ROWS` for `P(axis, None, ...)`, `WHOLE` for a replicated sharding, else `OTHER`."""
  entries = _entries(sharding)
  if entries is None:
    return OTHER
  if all(e is None for e in entries):
    return WHOLE
  if entries and entries[0] == axis and all(e is None for e in entries[1:]):
    return ROWS
  return OTHER


def columns(tables: Sequence[jax.ShapeDtypeStruct]) -> PartitionSpec | None:
  """The spec of tables whose rows are whole and whose other dims are split alike, else None.

  Per-row (1-D) tables must be whole; at least one table must be split.
  """
  wide = {spec(t.sharding, t.ndim) for t in tables if t.ndim > 1}
  narrow = {layout(t.sharding, "") for t in tables if t.ndim <= 1}
  if len(wide) != 1 or narrow - {WHOLE}:
    return None
  (found,) = wide
  if found is None or found[0] is not None or all(e is None for e in found):
    return None
  return found


def spec(sharding: Any, ndim: int) -> PartitionSpec | None:
  """The `PartitionSpec` of a `NamedSharding`, one entry per dim (one-axis tuples unpacked)."""
  entries = _entries(sharding)
  if entries is None:
    return None
  return PartitionSpec(*entries, *([None] * (ndim - len(entries))))


def _entries(sharding: Any) -> list[Any] | None:
  if not isinstance(sharding, NamedSharding):
    return None
  entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in sharding.spec]
  return [None if e == () else e for e in entries]


def row_spec(axis: str, ndim: int) -> PartitionSpec:
  return PartitionSpec(axis, *([None] * (ndim - 1))) if ndim else PartitionSpec()


class Rule(NamedTuple):
  """A Shardy sharding rule in einsum-like notation, and the sizes of its compound factors."""

  text: str
  sizes: dict[str, int]


def _mesh_of(x: jax.Array) -> Any:
  sharding = getattr(jax.typeof(x), "sharding", None)
  return getattr(sharding, "mesh", None)
