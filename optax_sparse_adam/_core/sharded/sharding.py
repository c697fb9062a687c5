"""Sharded parameters: the optimizer's arrays follow the parameters' sharding, under any mesh.

No communication is written here: XLA's SPMD partitioner does all of it. Under a
mesh whose axes are `Auto` it partitions a step's row gathers and scatters by
itself, so a row-sharded table and its moments are updated where they live and
only gradient-sized arrays cross devices.

Under `Explicit` axes (what `jax.make_mesh` gives by default in recent JAX),
JAX types each array's sharding and refuses a sort or a gather over a sharded
dimension, which coalescing a gradient needs. `call_with_auto_axes` runs such a
step with those axes switched to `Auto`, so the same partitioner does the same
work, and hands each output back with the sharding the caller names: the
moments keep their parameter's sharding from step to step.
"""

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from optax_sparse_adam._core.switches import Switch


class _Lowering(NamedTuple):
  per_shard: bool = False


# Set while a custom-partitioned op's per-shard body is traced (`partitioned`).
_LOWERING = Switch(_Lowering(), lambda _: None)


def lowering_per_shard() -> contextlib.AbstractContextManager[None]:
  """Within this block, every array traced is one device's shard.

  For the body that a custom partitioning lowers on each device, where the
  mesh's axes are bound but the values' types name no mesh.
  """
  return _LOWERING.choose(per_shard=True)


def _context_mesh() -> Any:
  get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  return None if get_abstract_mesh is None else get_abstract_mesh()


def explicit_axes() -> tuple[str, ...]:
  """The `Explicit` axes of the mesh set with `jax.set_mesh`; empty without one."""
  mesh = _context_mesh()
  if mesh is None or mesh.empty:
    return ()
  return tuple(getattr(mesh, "explicit_axes", ()))


def spec_of(x: Any) -> PartitionSpec:
  """The `PartitionSpec` in `x`'s type under an explicit mesh; `P()` otherwise."""
  typeof = getattr(jax, "typeof", None)  # JAX versions without it have no Explicit axes
  sharding = None if typeof is None else getattr(typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  return PartitionSpec() if spec is None else spec


def call_with_auto_axes(fn: Callable[..., Any], args: tuple, out_specs: Any) -> Any:
  """`fn(*args)`, partitioned by XLA even where the context mesh's axes are `Explicit`.

  Args:
    fn: a function of arrays.
    args: its positional arguments.
    out_specs: a tree of `PartitionSpec` with the structure of `fn`'s output
      (None leaves for None outputs): the sharding each output gets.

  Returns:
    `fn(*args)`; called as is when no mesh axis is `Explicit`.
  """
  axes = explicit_axes()
  if not axes:
    return fn(*args)
  return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_specs)(*args)


def on_one_cpu_device(arrays: Any) -> bool:
  """Whether every array in `arrays` is known to be on one device, when lowered for the CPU.

  True in a process with one CPU device. With several (e.g.
  `--xla_force_host_platform_device_count`), a concrete array says so by its
  sharding; a traced one only when its type names a mesh of one device, or a
  mesh whose axes are all `Manual` (inside `jax.shard_map`, where a value is
  one device's shard), and within `lowering_per_shard`: an argument passed
  sharded over several devices has its mesh in its type, but an empty mesh is
  not proof (`jax.jit(..., in_shardings=...)` leaves it out), so such a value
  counts as possibly sharded.
  """
  return _on_one_cpu_device(arrays, unknown=False)


def possibly_on_one_cpu_device(arrays: Any) -> bool:
  """`on_one_cpu_device`, but a traced array whose type names no mesh may be on one device.

  Such a value's placement is known only when the program is lowered
  (`_backends.one_device` decides there).
  """
  return _on_one_cpu_device(arrays, unknown=True)


def _on_one_cpu_device(arrays: Any, *, unknown: bool) -> bool:
  try:
    num_cpu_devices = len(jax.devices("cpu"))
  except RuntimeError:  # no CPU backend in this process: nothing is lowered for it
    return False
  if num_cpu_devices == 1 or _LOWERING.current().per_shard:
    return True
  for array in jax.tree_util.tree_leaves(arrays):
    if isinstance(array, jax.core.Tracer):
      typeof = getattr(jax, "typeof", None)
      mesh = getattr(getattr(typeof(array), "sharding", None), "mesh", None) if typeof else None
      if mesh is None or mesh.empty:
        if unknown:
          continue
        return False
      if mesh.size != 1 and not _all_manual(mesh):
        return False
    else:
      sharding = getattr(array, "sharding", None)
      if sharding is None or len(sharding.device_set) != 1:
        return False
  return True


def _all_manual(mesh: Any) -> bool:
  manual = getattr(jax.sharding.AxisType, "Manual", None)
  axis_types = getattr(mesh, "axis_types", ())
  return manual is not None and bool(axis_types) and all(t == manual for t in axis_types)


def replicated_like(*arrays: Any) -> NamedSharding | None:
  """A replicated `NamedSharding` on the mesh of the first of `arrays` on a mesh, or None.

  For the state's scalars (step counts): a jitted step returns them replicated
  on the params' mesh, so they start there too, else the second step would
  see new input shardings and compile again.
  """
  for array in arrays:
    sharding = None if isinstance(array, jax.core.Tracer) else getattr(array, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return NamedSharding(sharding.mesh, PartitionSpec())
  return None


def leading_dims_sharding(param: Any, num_dims: int) -> NamedSharding | PartitionSpec | None:
  """The sharding of a `(prod(param.shape[:num_dims]),)` array split like `param`'s rows.

  For per-row state (one entry per row of a table): a table sharded on its
  rows (`P('x', None)`) gives `P('x')`, one sharded on its columns gives a
  replicated vector. Returns a `NamedSharding` for a concrete array, a
  `PartitionSpec` for a value traced under an explicit mesh, and None when
  nothing is known (a single device, or a value traced under `Auto` axes,
  whose sharding XLA chooses).
  """
  if isinstance(param, jax.core.Tracer):
    if not explicit_axes():
      return None
    spec = spec_of(param)
    if spec == PartitionSpec():
      return None
    return PartitionSpec(_flattened_axis(spec, num_dims))
  sharding = getattr(param, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  return NamedSharding(sharding.mesh, PartitionSpec(_flattened_axis(sharding.spec, num_dims)))


def _flattened_axis(spec: PartitionSpec, num_dims: int) -> Any:
  """The mesh axes of dims `[:num_dims]` flattened into one, when only the first is split.

  Splitting a later dim too would interleave shards in the flattened order, so
  such a vector is replicated instead (it is small: one entry per row).
  """
  entries = tuple(spec) + (None,) * max(0, num_dims - len(spec))
  if any(entry is not None for entry in entries[1:num_dims]):
    return None
  return entries[0]


def replicated_vector(replicated: NamedSharding | None) -> NamedSharding | None:
  """`replicated` (from `replicated_like`) in the form a jitted step returns for a vector.

  A step returns a replicated vector as `P(None,)` where the mesh has an `Explicit`
  axis (its type names every dim) and as `P()` under `Auto` axes; a vector that starts
  in the other form makes the second step compile again.
  """
  if replicated is None:
    return None
  explicit = any(t == AxisType.Explicit for t in getattr(replicated.mesh, "axis_types", ()))
  return NamedSharding(replicated.mesh, PartitionSpec(None) if explicit else PartitionSpec())


def split_rows(x: Any, auto_axis: str | None) -> tuple[str, Any] | None:
  """`(axis, mesh)` when `x` is known to be split on dim 0 over `axis` alone, else None.

  Known from a concrete array's `NamedSharding`, from the type of a value traced
  under `Explicit` axes, or, under `Auto` axes, from `auto_axis` (when `x`'s
  mesh has that axis).
  """
  if x.ndim == 0:
    return None
  if isinstance(x, jax.core.Tracer):
    typed = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(typed, "mesh", None)
    if mesh is None or mesh.empty:
      return None
    if not getattr(mesh, "explicit_axes", ()):
      if auto_axis is None or auto_axis not in getattr(mesh, "auto_axes", ()):
        return None  # no axis named, or inside a shard_map over it already
      return auto_axis, mesh
    spec = spec_of(x)
  else:
    named = getattr(x, "sharding", None)
    if not isinstance(named, NamedSharding):
      return None
    mesh, spec = named.mesh, named.spec
  entries = tuple(spec) + (None,) * (x.ndim - len(spec))
  first = entries[0]
  if isinstance(first, tuple):
    first = first[0] if len(first) == 1 else None
  if not isinstance(first, str) or any(e is not None for e in entries[1:]):
    return None
  return first, mesh
