"""The fused CPU kernels (`kernels.cc`): each rule's kernel variant, and when to use it.

XLA:CPU runs gathers and scatters element by element; these XLA FFI kernels do
a step's coalescing, slot updates and parameter scatter-add in one pass per
table instead. A rule with a kernel variant is listed in `_VARIANTS` by its
name; the variant computes what `xla.masked_step` computes with that rule, bit
for bit (catch-up of idle rows to float32 rounding: its per-row powers use the
C library's exp). The Adam and row-wise Adam variants are used only where they
apply: on the CPU, float32 gradient and parameter, float32 or bfloat16 moments
(stored in place, rounded as the step asks), with no amsgrad, L2 weight decay
or per-row bias correction, and arrays known to be on one device (XLA cannot
partition a custom call: it would gather a sharded table onto every device, so
possibly sharded tables keep the XLA path). The Adam variant also runs the
catch-up of idle rows (`catch_up_idle_rows=True`), with decoupled weight decay
(`sparse_adamw`) too, in the kernel; the row-wise one does not. Everything
else runs XLA ops; `lax.platform_dependent` picks per backend when the step is
lowered (`_backends.dispatch`). Under `jax.vmap` the kernels run once per batch
element.

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
from optax_sparse_adam._core.bcoo import RowLayout
from optax_sparse_adam._core.errors import is_python_number
from optax_sparse_adam._core.row_rules.adam import AdamRule
from optax_sparse_adam._core.row_rules.rowwise_adam import (
  RowwiseAdamRule,
  bias_corrections,
  inverse_row_size,
)
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan, Tables

_FUSED_ADAM = "optax_sparse_adam_fused_adam_f32"
_FUSED_ADAM_CATCH_UP = "optax_sparse_adam_fused_adam_catch_up_f32"
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
      _FUSED_ADAM_CATCH_UP, jax.ffi.pycapsule(library.OsaFusedAdamCatchUpF32), platform="cpu"
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
  if not isinstance(rule, AdamRule) or rule.amsgrad:
    return False
  return _plain_step_applies(inputs, plan) or _adam_catch_up_applies(inputs, plan)


def _adam_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  assert isinstance(plan.rule, AdamRule)
  if not _plain_step_applies(inputs, plan):
    return _adam_catch_up_step(inputs, plan)
  step_size = plan.rule.step_size(inputs.hyper, inputs.step)
  return _moment_step(_FUSED_ADAM, inputs, plan, [step_size])


def _adam_catch_up_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  """Adam with catch-up of idle rows, with or without decoupled weight decay.

  Not lazy AdamW alone: XLA rounds its `delta - lr * wd * p` once (a fused
  multiply-add) under jit and twice op by op, so no kernel equals both; the
  catch-up step is equal to float32 rounding only anyway (jit's FMA, here).
  """
  tables, hyper, config = inputs.tables, inputs.hyper, plan.config
  decoupled = config.weight_decay == "decoupled"
  catch_up = tables.last_step is not None
  if not catch_up or config.weight_decay == "l2" or tables.row_step is not None:
    return False
  if decoupled and (tables.param is None or hyper.learning_rate is None):
    return False
  if catch_up and (inputs.step is None or hyper.log_b1 is None or hyper.log_b2 is None):
    return False
  if catch_up and hyper.step_size is None and hyper.learning_rate is None:
    return False
  if inputs.step is None and config.moment_rounding != "nearest":
    return False
  extra = (tables.param,) if decoupled else ()
  last_step = () if tables.last_step is None else (tables.last_step,)
  return (
    jnp.dtype(config.compute_dtype) == jnp.dtype(jnp.float32)
    and all(jnp.dtype(x.dtype) == jnp.dtype(jnp.int32) for x in last_step)
    and sharding.on_one_cpu_device(last_step)
    and _applies(
      (inputs.values, *extra),
      nse=inputs.values.shape[0],
      num_rows=plan.layout.num_rows,
      row_size=math.prod(plan.layout.dense_shape),
      moments=(tables.slots["mu"], tables.slots["nu"]),
    )
  )


def _catch_up_coefficients(inputs: StepInputs, plan: StepPlan) -> list[Any]:
  """`lr * wd`, then the constants of `catch_up.idle_rows` as XLA computes them (float32)."""
  f32 = jnp.float32
  hyper = inputs.hyper

  def c(x: Any) -> jax.Array:
    return jnp.asarray(0.0 if x is None else x, f32)

  decoupled = plan.config.weight_decay == "decoupled"
  lr_wd = c(hyper.learning_rate) * c(hyper.weight_decay) if decoupled else c(0.0)
  log_b1, log_b2 = c(hyper.log_b1), c(hyper.log_b2)
  # The idle steps take their own rate (a schedule's at count - 1), as catch_up.idle_rows.
  idle = hyper.for_idle_steps()
  log_d = jnp.log1p(-c(idle.learning_rate) * c(idle.weight_decay)) if decoupled else c(0.0)

  def base(log_x: jax.Array) -> list[jax.Array]:
    # As catch_up.decayed_sum, _geometric_sum and _centroid compute them.
    log_ratio = jnp.asarray(log_x - log_d, f32)
    small = -jnp.abs(jnp.where(jnp.isfinite(log_ratio), log_ratio, -jnp.inf))
    expm1_small = jnp.expm1(jnp.where(small == 0, -1.0, small))
    return [log_x, log_ratio, small, expm1_small, -jnp.expm1(log_x)]

  return [
    lr_wd,
    log_b1,
    log_b2,
    log_d,
    c(idle.learning_rate),
    c(hyper.step_size),
    *base(log_b1),
    *base(log_b1 - 0.5 * log_b2),
  ]


def _adam_catch_up_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """The Adam step with catch-up (and decoupled weight decay if asked): one FFI call.

  As `_moment_step`, with the parameter (read for weight decay) and the rows'
  last steps (updated in place when donated). Equal to `xla.masked_step` to
  float32 rounding: the per-row powers and sums of catch-up use the C
  library's exp and expm1, not XLA's (tests/backends/test_cpu_catch_up.py).
  """
  assert isinstance(plan.rule, AdamRule)
  f32, i32 = jnp.float32, jnp.int32
  hyper, tables, config = inputs.hyper, inputs.tables, plan.config
  decoupled = config.weight_decay == "decoupled"
  catch_up = tables.last_step is not None
  mu, nu = tables.slots["mu"], tables.slots["nu"]
  param = tables.param if decoupled else None
  last_step = tables.last_step if catch_up else None
  param = jnp.zeros((0,), f32) if param is None else param
  last_step = jnp.zeros((0,), i32) if last_step is None else last_step
  step = jnp.zeros((1,), i32) if inputs.step is None else jnp.reshape(inputs.step, (1,))
  coefficients = [
    hyper.one_minus_b1,
    hyper.one_minus_b2,
    hyper.eps,
    plan.rule.step_size(hyper, inputs.step),
    *_catch_up_coefficients(inputs, plan),
  ]
  nse = inputs.rows.shape[0]
  out_types = (
    jax.ShapeDtypeStruct((nse,), i32),
    jax.ShapeDtypeStruct(inputs.values.shape, f32),
    jax.ShapeDtypeStruct(mu.shape, mu.dtype),
    jax.ShapeDtypeStruct(nu.shape, nu.dtype),
    jax.ShapeDtypeStruct(last_step.shape, i32),
  )
  call = jax.ffi.ffi_call(
    _FUSED_ADAM_CATCH_UP,
    out_types,
    input_output_aliases={2: 2, 3: 3, 7: 4},
    vmap_method=_VMAP_METHOD,
  )
  distinct_rows, delta, mu, nu, last_step = call(
    inputs.rows,
    inputs.values,
    mu,
    nu,
    jnp.stack([jnp.asarray(x, f32) for x in coefficients]),
    _rounding_keys(inputs, plan),
    param,
    last_step,
    step.astype(i32),
    num_rows=plan.layout.num_rows,
    maximize=config.maximize,
    stochastic=config.moment_rounding == "stochastic",
    decoupled=decoupled,
    catch_up=catch_up,
    # catch_up.idle_rows divides by sqrt(v) + eps unguarded only for a Python eps > 0.
    guard_eps=not (is_python_number(hyper.eps) and hyper.eps > 0),
    given_step_size=hyper.step_size is not None,
  )
  new_tables = Tables({"mu": mu, "nu": nu}, last_step=last_step if catch_up else None)
  return RowsStep(distinct_rows, delta, new_tables)


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
