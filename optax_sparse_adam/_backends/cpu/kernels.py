"""The fused CPU kernels (`kernels.cc`): each rule's kernel variant, and when to use it.

XLA:CPU runs gathers and scatters element by element; these XLA FFI kernels do
a step's coalescing, slot updates and parameter scatter-add in one pass per
table instead. A rule with a kernel variant is listed in `_VARIANTS` by its
name; the variant computes what `xla.masked_step` computes with that rule, bit
for bit. The Adam and row-wise Adam variants are used only where they apply: on
the CPU, float32 gradient and parameter, float32 or bfloat16 moments (stored in
place, rounded as the step asks), with no amsgrad, weight decay, per-row bias
correction or catch-up of idle rows, and arrays
known to be on one device (XLA cannot partition a custom call: it would gather
a sharded table onto every device, so possibly sharded tables keep the XLA
path). Everything else runs XLA ops; `lax.platform_dependent` picks per backend
when the step is lowered (`_backends.dispatch`). Under `jax.vmap` the kernels
run once per batch element.

Set `OPTAX_SPARSE_ADAM_CPU_KERNELS=0` (before the first step is traced), or use
`use_cpu_kernels(False)`, to use the XLA path on the CPU too.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.machinery
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._backends import choice
from optax_sparse_adam._core import rounding, sharding
from optax_sparse_adam._core.adam import AdamRule
from optax_sparse_adam._core.bcoo import RowLayout
from optax_sparse_adam._core.rowwise_adam import (
  RowwiseAdamRule,
  bias_corrections,
  inverse_row_size,
)
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan, Tables

_FUSED_ADAM = "optax_sparse_adam_fused_adam_f32"
_FUSED_ROWWISE_ADAM = "optax_sparse_adam_fused_rowwise_adam_f32"
_SCATTER_ADD_ROWS = "optax_sparse_adam_scatter_add_rows_f32"
# Under jax.vmap a kernel runs once per batch element (a loop around the call).
_VMAP_METHOD = "sequential"


def _library_path() -> Path | None:
  here = Path(__file__).resolve().parent
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    candidate = here / f"_kernels{suffix}"
    if candidate.exists():
      return candidate
  return None


@functools.cache
def available() -> bool:
  """Whether the CPU kernels were built at install time and registered with XLA.

  Registration happens once, on the first call. False where no C++ compiler
  was found at install time: sparse_adam then runs XLA ops on the CPU too,
  with the same results, about 2x slower.

  Returns:
    True if the fused CPU kernels can be used.

  Example:
    >>> import optax_sparse_adam as osa
    >>> osa.cpu_kernels_available() in (True, False)
    True
  """
  path = _library_path()
  if path is None:
    return False
  try:
    library = ctypes.CDLL(str(path))
    jax.ffi.register_ffi_target(
      _FUSED_ADAM, jax.ffi.pycapsule(library.OsaFusedAdamF32), platform="cpu"
    )
    jax.ffi.register_ffi_target(
      _FUSED_ROWWISE_ADAM, jax.ffi.pycapsule(library.OsaFusedRowwiseAdamF32), platform="cpu"
    )
    jax.ffi.register_ffi_target(
      _SCATTER_ADD_ROWS, jax.ffi.pycapsule(library.OsaScatterAddRowsF32), platform="cpu"
    )
  except (OSError, AttributeError):  # A stale or foreign build: keep the XLA path.
    return False
  return True


def enabled() -> bool:
  """Whether steps traced now may use the kernels on the CPU (built, and switched on)."""
  return choice.cpu_kernels_wanted() and available()


def _applies(
  arrays: Sequence[Any], *, nse: int, num_rows: int, row_size: int, moments: Sequence[Any] = ()
) -> bool:
  """Whether a kernel may run a step on `arrays` (all float32) and `moments` at trace time.

  `moments` may be float32 or bfloat16 (the step kernels store either).

  Also needs at least one entry and one row of at least one value, no mesh with
  Explicit axes and arrays known to be on one device (a custom call cannot be
  partitioned: XLA would gather a sharded table onto every device), and
  `enabled()`.
  """
  float32 = jnp.dtype(jnp.float32)
  return (
    all(jnp.dtype(x.dtype) == float32 for x in arrays)
    and all(jnp.dtype(x.dtype) in (float32, jnp.dtype(jnp.bfloat16)) for x in moments)
    and nse > 0
    and num_rows > 0
    and row_size > 0
    and not sharding.explicit_axes()
    and enabled()
    and sharding.on_one_cpu_device((*arrays, *moments))
  )


class KernelVariant(NamedTuple):
  """A rule's fused CPU kernel: when it computes a step, and the step itself."""

  applies: Callable[[StepInputs, StepPlan], bool]
  masked_step: Callable[[StepInputs, StepPlan], RowsStep]


def step_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  """Whether the rule's kernel variant computes this step (see `masked_step`)."""
  variant = _VARIANTS.get(plan.rule.name)
  return variant is not None and variant.applies(inputs, plan)


def masked_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """`xla.masked_step` by the rule's fused kernel, for a step where `step_applies`."""
  return _VARIANTS[plan.rule.name].masked_step(inputs, plan)


def scatter_add_applies(param: jax.Array, values: jax.Array, *, layout: RowLayout) -> bool:
  """Whether `scatter_add_rows` can apply this update: float32 parameter and values."""
  return _applies(
    (param, values),
    nse=values.shape[0],
    num_rows=layout.num_rows,
    row_size=math.prod(layout.dense_shape),
  )


@contextlib.contextmanager
def use_cpu_kernels(enable: bool) -> Iterator[None]:
  """Within this block, steps *traced* use (or avoid) the fused CPU kernels.

  The kernels are on by default where they apply. Switch them off to run XLA
  ops on the CPU too, e.g. to `jax.export` a step (the kernels' custom calls
  carry no serialization guarantee) or to compare the two paths. The setting is
  part of the key of JAX's trace and compilation caches (a
  `jax.make_user_context`): a function called or exported inside the block is
  traced again with the setting, even one already traced outside it.
  `OPTAX_SPARSE_ADAM_CPU_KERNELS=0` in the environment switches them off
  everywhere.

  Args:
    enable: use the kernels (where they apply) or not.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_adam(0.1)
    >>> params = jnp.zeros((4, 2))
    >>> grad = sparse.BCOO((jnp.ones((1, 2)), jnp.array([[1]])), shape=(4, 2))
    >>> with osa.use_cpu_kernels(False):
    ...   updates, _ = jax.jit(opt.update)(grad, opt.init(params), params)
    >>> osa.apply_updates(params, updates)[1].round(3)
    Array([-0.1, -0.1], dtype=float32)
  """
  with choice.choose(cpu_kernels=bool(enable)):
    yield


def _plain_step_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  """Float32 gradient, float32 or bf16 `mu` and `nu`, no weight decay, per-row steps or catch-up."""
  tables = inputs.tables
  return (
    tables.row_step is None
    and tables.last_step is None
    and plan.config.weight_decay == "none"
    # Stochastic rounding keys on the step count (the XLA path refuses a step without one).
    and (inputs.step is not None or plan.config.moment_rounding == "nearest")
    and _applies(
      (inputs.values,),
      nse=inputs.values.shape[0],
      num_rows=plan.layout.num_rows,
      row_size=math.prod(plan.layout.dense_shape),
      moments=(tables.slots["mu"], tables.slots["nu"]),
    )
  )


def _rounding_keys(inputs: StepInputs, plan: StepPlan) -> jax.Array:
  """uint32 `(3,)`: mu's and nu's stochastic-rounding keys of this step and the tables'
  first global row (`StepInputs.row_offset`), read if stochastic."""
  step = inputs.step if inputs.step is not None else jnp.zeros((), jnp.int32)
  names = [slot.name for slot in plan.rule.slots()]
  keys = [rounding.step_key(step, names.index(name)) for name in ("mu", "nu")]
  offset = inputs.row_offset if inputs.row_offset is not None else 0
  return jnp.stack([*keys, jnp.asarray(offset).astype(jnp.uint32)])


def _adam_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  rule = plan.rule
  return isinstance(rule, AdamRule) and not rule.amsgrad and _plain_step_applies(inputs, plan)


def _adam_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  assert isinstance(plan.rule, AdamRule)
  step_size = plan.rule.step_size(inputs.hyper, inputs.step)
  return _moment_step(_FUSED_ADAM, inputs, plan, [step_size])


def _rowwise_adam_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  rule = plan.rule
  return (
    isinstance(rule, RowwiseAdamRule) and not rule.amsgrad and _plain_step_applies(inputs, plan)
  )


def _rowwise_adam_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  assert inputs.step is not None  # the optax layer counts the steps of this rule
  # The same function, so the same bits, as the rule's own bias corrections.
  lr_over_bc1, inv_bc2 = bias_corrections(inputs.hyper, inputs.step, jnp.float32)
  inv_row_size = inverse_row_size(math.prod(plan.layout.dense_shape), jnp.float32)
  return _moment_step(_FUSED_ROWWISE_ADAM, inputs, plan, [lr_over_bc1, inv_bc2, inv_row_size])


def _moment_step(
  target: str, inputs: StepInputs, plan: StepPlan, coefficients: list[Any]
) -> RowsStep:
  """The fused step of a rule whose state is `mu` and `nu`: one FFI call.

  The kernel is given float32 `(1 - b1, 1 - b2, eps, *coefficients)`, the
  rounding keys of this step and the tables in their own shapes (a reshape would
  make XLA copy an operand the kernel updates in place); it views them as
  `num_rows` rows, updates `mu` and `nu` (float32 or bfloat16) in place when
  donated, and returns the distinct rows then padding and their deltas, as
  `xla.masked_step` with the same rule.
  """
  f32 = jnp.float32
  hyper = inputs.hyper
  mu, nu = inputs.tables.slots["mu"], inputs.tables.slots["nu"]
  coefficients = [hyper.one_minus_b1, hyper.one_minus_b2, hyper.eps, *coefficients]
  nse = inputs.rows.shape[0]
  out_types = (
    jax.ShapeDtypeStruct((nse,), jnp.int32),
    jax.ShapeDtypeStruct(inputs.values.shape, f32),
    jax.ShapeDtypeStruct(mu.shape, mu.dtype),
    jax.ShapeDtypeStruct(nu.shape, nu.dtype),
  )
  call = jax.ffi.ffi_call(
    target, out_types, input_output_aliases={2: 2, 3: 3}, vmap_method=_VMAP_METHOD
  )
  distinct_rows, delta, mu, nu = call(
    inputs.rows,
    inputs.values,
    mu,
    nu,
    jnp.stack([jnp.asarray(x, f32) for x in coefficients]),
    _rounding_keys(inputs, plan),
    num_rows=plan.layout.num_rows,
    maximize=plan.config.maximize,
    stochastic=plan.config.moment_rounding == "stochastic",
  )
  return RowsStep(distinct_rows, delta, Tables({"mu": mu, "nu": nu}))


# The rules with a fused kernel, by `RowRule.name`.
_VARIANTS: dict[str, KernelVariant] = {
  "adam": KernelVariant(_adam_applies, _adam_step),
  "rowwise_adam": KernelVariant(_rowwise_adam_applies, _rowwise_adam_step),
}


def scatter_add_rows(
  table: jax.Array, rows: jax.Array, values: jax.Array, *, num_rows: int, rows_unique: bool
) -> jax.Array:
  """`table[rows] += values` in input order, out-of-range rows dropped; in place when donated.

  `table` keeps its shape and is viewed as `num_rows` rows; `values` holds one
  row per entry of `rows`. `rows_unique` promises that no in-range row repeats.
  """
  call = jax.ffi.ffi_call(
    _SCATTER_ADD_ROWS,
    jax.ShapeDtypeStruct(table.shape, jnp.float32),
    input_output_aliases={0: 0},
    vmap_method=_VMAP_METHOD,
  )
  return call(table, rows, values, num_rows=num_rows, rows_unique=rows_unique)
