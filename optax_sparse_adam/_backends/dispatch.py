"""The one place that decides how a step runs: CPU kernels, the accelerator step, or XLA ops.

Both `masked_step` (the masked step of one parameter, under any rule) and
`scatter_add` (`apply_updates` of one parameter) come here. What can be decided
at trace time (dtypes, the rule, the plan's switches, `choice`) is decided here
in Python; what depends on the backend the step is lowered for is left to
`lax.platform_dependent`, so one traced step lowers to the CPU kernels (where
the rule has one that applies, else the generic XLA ops) on the CPU, to the
accelerator step (`accelerator`: one sort, no loop) on CUDA, ROCm and TPU, and
to the generic XLA ops (`xla`) on any other backend. Every path returns the
same results: on the CPU all three agree bit for bit (tests/backends), but for
the catch-up of idle rows, where the kernel agrees to float32 rounding.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_sparse_adam._backends import accelerator, choice, one_device, xla
from optax_sparse_adam._backends.cpu import kernels
from optax_sparse_adam._backends.protocol import StepBackend
from optax_sparse_adam._core import coalesce
from optax_sparse_adam._core.bcoo import RowLayout
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan
from optax_sparse_adam._core.sharded import sharding


def masked_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """One parameter's masked step on the backend it is lowered for (see `xla.masked_step`)."""
  # The hyper-parameters that are arrays (a traced learning rate, a step size)
  # travel as an argument: a backend must not close over them, or
  # differentiating through the step would leak them out of `_differentiated_as`'s
  # rule. Python floats stay closed over: constants, exact until used.
  leaves, treedef = jax.tree.flatten(inputs.hyper)
  traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

  def bound(backend: StepBackend) -> Callable[..., RowsStep]:
    def call(inputs: StepInputs, arrays: list[jax.Array]) -> RowsStep:
      full = list(leaves)
      for i, array in zip(traced, arrays, strict=True):
        full[i] = array
      return backend(inputs._replace(hyper=jax.tree.unflatten(treedef, full)), plan)

    return call

  generic = bound(xla.masked_step)

  def on_cpu() -> Callable[..., RowsStep] | None:
    if kernels.step_applies(inputs, plan):  # the rule's fused kernel
      return bound(kernels.masked_step)
    if kernels.generic_step_applies(inputs, plan):
      # Any rule: the rows coalesced and gathered by the generic kernel, the rule's math in
      # XLA ops, its tables' rows stored in place by the generic kernel.
      return bound(
        functools.partial(
          xla.masked_step,
          coalescer=kernels.coalesce_and_gather
          if kernels.gathers(inputs.values)
          else coalesce.coalesce_and_gather_rows_unmarked,
          store_rows=_kernel_store(plan.layout),
        )
      )
    return None

  return _by_backend(
    (inputs._replace(hyper=None), [leaves[i] for i in traced]),
    cpu=_on_cpu(on_cpu, (inputs.rows, inputs.values, inputs.tables), generic),
    accelerator=bound(accelerator.masked_step),
    generic=generic,
  )


def _kernel_store(layout: RowLayout) -> xla.RowStore:
  """The CPU's in-place row store (`kernels.store_rows`) for tables of `layout`'s rows."""

  def store(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    # The rows are distinct but for padding, which is out of range and dropped.
    return kernels.store_rows(table, rows, values, num_rows=layout.num_rows, rows_unique=True)

  return store


def scatter_add(
  param: jax.Array,
  rows: jax.Array,
  values: jax.Array,
  *,
  layout: RowLayout,
  rows_unique: bool,
  rows_sorted: bool,
) -> jax.Array:
  """`param[rows] += values` on the backend it is lowered for; padding rows dropped."""
  # The XLA scatter-add every path but the kernel's runs, with the path's own flags.
  xla_add = functools.partial(
    xla.scatter_add, layout=layout, rows_unique=rows_unique, rows_sorted=rows_sorted
  )
  generic = xla_add

  def on_cpu() -> Callable[..., jax.Array] | None:
    if param.dtype == jnp.bfloat16 and kernels.store_applies(
      param, nse=rows.shape[0], num_rows=layout.num_rows
    ):
      # XLA's sums, rounded once, stored in place: no bfloat16 table copy.
      return functools.partial(xla_add, store_rows=_kernel_store(layout))
    if kernels.scatter_add_applies(param, values, layout=layout):

      def add(param, rows, values):
        # The kernel takes the parameter in its own shape: a reshaped operand that
        # it updates in place would be copied by XLA.
        return kernels.scatter_add_rows(
          param, rows, values, num_rows=layout.num_rows, rows_unique=rows_unique
        )

      return add
    return None

  # One scatter-add of the parameter's own dtype, no sort, on GPUs and TPUs.
  # An update from sparse_adam repeats no row (its padding rows are dropped),
  # but its flags mirror the gradient's, so they cannot promise that to XLA.
  on_accelerator = functools.partial(xla_add, through_bits=False)

  return _by_backend(
    (param, rows, values),
    cpu=_on_cpu(on_cpu, (param, rows, values), generic),
    accelerator=on_accelerator,
    generic=generic,
  )


def store_rows(
  param: jax.Array,
  rows: jax.Array,
  values: jax.Array,
  *,
  layout: RowLayout,
  rows_unique: bool,
  rows_sorted: bool,
) -> jax.Array:
  """`param[rows] = values` (a rule's set rows) on the backend it is lowered for; no padding."""

  def through(bits: bool) -> Callable[..., jax.Array]:
    def store(param, rows, values):
      return xla.store_rows(
        param,
        rows,
        values,
        layout=layout,
        rows_unique=rows_unique,
        rows_sorted=rows_sorted,
        through_bits=bits,
      )

    return store

  # XLA:CPU has no 16-bit float scatter: the bits are stored there and elsewhere.
  generic = through(True)

  def on_cpu() -> Callable[..., jax.Array] | None:
    if not kernels.store_applies(param, nse=rows.shape[0], num_rows=layout.num_rows):
      return None

    def store(param, rows, values):
      # The same bits, stored in place by the generic kernel (no 16-bit table copy).
      return kernels.store_rows(
        param, rows, values, num_rows=layout.num_rows, rows_unique=rows_unique
      )

    return store

  return _by_backend(
    (param, rows, values),
    cpu=_on_cpu(on_cpu, (param, rows, values), generic),
    accelerator=through(False),
    generic=generic,
  )


def _on_cpu(
  kernel: Callable[[], Callable[..., Any] | None], arrays: Any, generic: Callable[..., Any]
) -> Callable[..., Any]:
  """The CPU's path: `kernel()` (the kernels' path, or None where none applies), else `generic`.

  The kernels run only on arrays on one device. Where that is known now, they are
  chosen now; where the arrays' types do not say (jit in a process with several
  CPU devices), the kernels are traced as for one device and chosen when the
  program is lowered, if it is lowered for one device (`one_device`).
  """
  now = kernel()
  if now is not None:
    return now
  if not sharding.possibly_on_one_cpu_device(arrays):
    return generic
  with sharding.lowering_per_shard():
    later = kernel()
  if later is None:
    return generic

  def per_device(*args: Any) -> Any:
    with sharding.lowering_per_shard():
      return later(*args)

  return one_device.on_one_device(per_device, generic)


_ACCELERATOR_PLATFORMS = ("cuda", "rocm", "tpu")


def _by_backend(
  args: tuple,
  *,
  cpu: Callable[..., Any],
  accelerator: Callable[..., Any],
  generic: Callable[..., Any],
) -> Any:
  """`cpu(*args)` on the CPU, `accelerator(*args)` on CUDA/ROCm/TPU, `generic(*args)` elsewhere.

  Chosen when the step is lowered (one branch per backend it is lowered for);
  a forced path (`choice.PathChoice.forced`) runs on every backend instead.
  """
  forced = choice.forced()
  if forced == choice.ACCELERATOR:
    return accelerator(*args)
  if forced == choice.GENERIC_XLA:
    return generic(*args)
  branches = dict.fromkeys(_ACCELERATOR_PLATFORMS, accelerator)

  def by_platform(*args):
    return lax.platform_dependent(*args, cpu=cpu, default=generic, **branches)

  if cpu is generic:
    return by_platform(*args)
  return _differentiated_as(by_platform, generic)(*args)


def _differentiated_as(run: Callable[..., Any], generic: Callable[..., Any]) -> Callable[..., Any]:
  """`run`, whose derivatives are those of `generic` (XLA ops), for `jax.jvp`, `grad`, `vmap`.

  The CPU kernels are FFI calls, which JAX cannot differentiate; they compute
  what `generic` computes bit for bit (catch-up: to float32 rounding), so a step
  that is differentiated (through the optimizer, e.g. to tune a learning rate)
  runs `generic` and its JVP.
  """
  wrapped = jax.custom_jvp(run)

  @wrapped.defjvp
  def jvp(primals, tangents):
    return jax.jvp(generic, primals, tangents)

  return wrapped
