"""A choice made when a step is lowered: the CPU kernels where the program runs on one device.

XLA cannot partition a custom call: in a program partitioned over several devices
it would gather a sharded table onto each. Where the arrays' types do not say
where they live (under `jax.jit` in a process with several CPU devices, a table
committed to one device looks like a sharded one), the choice is left to the
lowering, which knows the program's devices: `on_one_device(kernel, generic)`
runs `kernel` in a program lowered for one device (or per shard, every mesh axis
manual, as inside `jax.shard_map`), and `generic` otherwise. It is a `lax.switch`
on an index that lowers to a constant, so XLA keeps only the chosen branch.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core
from jax.interpreters import mlir

_index_p = core.Primitive("optax_sparse_adam_one_device_index")
_index_p.def_abstract_eval(lambda: jax.core.ShapedArray((), np.int32))


def _runs_on_one_device(axis_context: Any) -> bool:
  """Whether a program lowered in `axis_context` runs each of its arrays on one device."""
  num_devices = getattr(axis_context, "num_devices", None)
  if num_devices is not None:  # jit: the program's devices
    return num_devices == 1
  mesh = getattr(axis_context, "mesh", None)
  manual = getattr(axis_context, "manual_axes", None)
  if mesh is not None and manual is not None:  # shard_map: each device's shard
    return set(manual) == set(mesh.axis_names)
  return False


def _index_lowering(ctx: Any) -> Any:
  one = _runs_on_one_device(ctx.module_context.axis_context)
  return [mlir.ir_constant(np.int32(1 if one else 0))]


mlir.register_lowering(_index_p, _index_lowering)


def on_one_device(kernel: Callable[..., Any], generic: Callable[..., Any]) -> Callable[..., Any]:
  """`kernel(*args)` where the program is lowered for one device, else `generic(*args)`."""

  def run(*args: Any) -> Any:
    return lax.switch(_index_p.bind(), [generic, kernel], *args)

  return run
