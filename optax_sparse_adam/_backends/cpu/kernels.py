"""The CPU kernels: the generic kernels every rule runs, the fused variants, and when to use them.

XLA:CPU runs gathers and scatters element by element. Every rule's step runs on
the generic kernels: `coalesce_and_gather` (`row_gather.cc`: the gradient's rows
coalesced, every table's rows gathered at them) before the rule's math, traced
by XLA, and `store_rows` (`row_store.cc`: rows stored in place into a donated
table of any dtype) after it: the XLA ops' bits, by construction. A rule with a
hand-fused variant, listed in `_VARIANTS` by its name, runs it where it applies
(kept only where it measured faster than the generic kernels:
`benchmarks/bench_rules.py`): the variant computes what `xla.masked_step`
computes with that rule, bit for bit (catch-up of idle rows to float32 rounding:
its per-row powers use the C library's exp). The Adam and row-wise Adam variants
(their calls: `moment_steps`) take a float32, bfloat16 or float16 gradient (its
duplicates summed in its dtype, as XLA sums them), a float32 parameter (read for
weight decay), float32 or bfloat16 moments (stored in place, rounded as the step
asks), with any of the pipeline's options (L2 or decoupled weight decay,
amsgrad, per-row bias correction; for Adam, catch-up of idle rows). Every kernel
runs only on arrays on one device (XLA cannot partition a custom call: it would
gather a sharded table onto every device); where the arrays' types do not say,
the choice is made when the step is lowered (`_backends.one_device`). Weight
decay in a fused variant needs the step's rounding zero
(`StepInputs.opaque_zero`, which `sparse_adam` always gives): with it the XLA
path rounds the decay's terms as the kernels do. `lax.platform_dependent` picks
per backend when the step is lowered (`_backends.dispatch`). Under `jax.vmap`
the kernels run once per batch element.

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
from optax_sparse_adam._backends.cpu import moment_steps, row_program, rule_steps
from optax_sparse_adam._core import rules
from optax_sparse_adam._core.bcoo import CoalescedRows, RowLayout
from optax_sparse_adam._core.coalesce import Coalesced
from optax_sparse_adam._core.row_rules.adam import AdamRule
from optax_sparse_adam._core.row_rules.rowwise_adam import (
  RowwiseAdamRule,
)
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan
from optax_sparse_adam._core.sharded import sharding

_SCATTER_ADD_ROWS = "optax_sparse_adam_scatter_add_rows_f32"
_STORE_ROWS = "optax_sparse_adam_store_rows"  # row_store.cc: any dtype, any rule
_COALESCE_GATHER = "optax_sparse_adam_coalesce_gather"  # row_gather.cc: any tables
ADD_ROUNDED_ROWS = "optax_sparse_adam_add_rounded_rows"  # row_round.cc: 16-bit tables
ADD_ROWS_IN_PLACE = "optax_sparse_adam_add_rows_in_place"  # row_round.cc: 16-bit tables
# The tables `store_rows` writes: the rows' bytes are copied, whatever they hold.
_STORED_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
# The gradients the kernels sum (`SumEntries`: each add rounded to the dtype, as XLA's).
_SUMMED_DTYPES = _STORED_DTYPES


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
      moment_steps.FUSED_ADAM, jax.ffi.pycapsule(library.OsaFusedAdamF32), platform="cpu"
    )
    jax.ffi.register_ffi_target(
      moment_steps.FUSED_ADAM_OPTIONS,
      jax.ffi.pycapsule(library.OsaFusedAdamOptionsF32),
      platform="cpu",
    )
    jax.ffi.register_ffi_target(
      moment_steps.FUSED_ADAM_ROUNDED,
      jax.ffi.pycapsule(library.OsaFusedAdamRoundedF32),
      platform="cpu",
    )
    jax.ffi.register_ffi_target(
      moment_steps.FUSED_ROWWISE_ADAM,
      jax.ffi.pycapsule(library.OsaFusedRowwiseAdamF32),
      platform="cpu",
    )
    jax.ffi.register_ffi_target(
      _SCATTER_ADD_ROWS, jax.ffi.pycapsule(library.OsaScatterAddRowsF32), platform="cpu"
    )
    jax.ffi.register_ffi_target(
      _STORE_ROWS, jax.ffi.pycapsule(library.OsaStoreRows), platform="cpu"
    )
    jax.ffi.register_ffi_target(
      _COALESCE_GATHER, jax.ffi.pycapsule(library.OsaCoalesceGather), platform="cpu"
    )
    for target, symbol in (
      (ADD_ROUNDED_ROWS, "OsaAddRoundedRows"),
      (ADD_ROWS_IN_PLACE, "OsaAddRowsInPlace"),
    ):
      jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
      )
    jax.ffi.register_ffi_target(
      moment_steps.ENTRY_STEPS, jax.ffi.pycapsule(library.OsaEntryStepsS32), platform="cpu"
    )
    for target, symbol in (*rule_steps.TARGETS.items(), *row_program.TARGETS.items()):
      jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
      )
  except (OSError, AttributeError):  # A stale or foreign build: keep the XLA path.
    return False
  return True


def enabled() -> bool:
  """Whether steps traced now may use the kernels on the CPU (built, and switched on)."""
  return choice.cpu_kernels_wanted() and available()


def _applies(
  arrays: Sequence[Any],
  *,
  nse: int,
  num_rows: int,
  row_size: int,
  moments: Sequence[Any] = (),
  values: Sequence[Any] = (),
) -> bool:
  """Whether a kernel may run a step on `arrays` (all float32) and `moments` at trace time.

  `moments` may be float32 or bfloat16 (the step kernels store either); `values`
  (a gradient's) float32, bfloat16 or float16 (the kernels sum each, every add
  rounded to its dtype as XLA adds them).

  Also needs at least one entry and one row of at least one value, no mesh with
  Explicit axes and arrays known to be on one device (a custom call cannot be
  partitioned: XLA would gather a sharded table onto every device), and
  `enabled()`.
  """
  float32 = jnp.dtype(jnp.float32)
  return (
    all(jnp.dtype(x.dtype) == float32 for x in arrays)
    and all(jnp.dtype(x.dtype) in (float32, jnp.dtype(jnp.bfloat16)) for x in moments)
    and all(jnp.dtype(x.dtype) in _SUMMED_DTYPES for x in values)
    and nse > 0
    and num_rows > 0
    and row_size > 0
    and not sharding.explicit_axes()
    and enabled()
    and sharding.on_one_cpu_device((*arrays, *moments, *values))
  )


class KernelVariant(NamedTuple):
  """A rule's fused CPU kernel: when it computes a step, and the step itself."""

  applies: Callable[[StepInputs, StepPlan], bool]
  masked_step: Callable[[StepInputs, StepPlan], RowsStep]
  # Renormalises to `max_norm` after the step (else the XLA ops do, where it is set).
  max_norm: bool = False
  # Where it applies (with `applies`), the step of a bfloat16 or float16 table rounded
  # stochastically in the kernel's own pass: its new rows in place of the delta.
  rounds_in_pass: Callable[[StepInputs, StepPlan], bool] | None = None
  rounded_step: Callable[[StepInputs, StepPlan], RowsStep] | None = None


def step_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  """Whether the rule's kernel variant computes this step (see `masked_step`)."""
  variant = _VARIANTS.get(plan.rule.name)
  if (
    variant is None
    or not choice.fused_kernels_wanted()
    or (plan.config.max_norm is not None and not variant.max_norm)
  ):
    return False
  if rules.reads_param(plan.rule) or rules.sets_rows(plan.rule):  # a rule by another name
    return False
  return variant.applies(inputs, plan)


def masked_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """`xla.masked_step` by the rule's fused kernel, for a step where `step_applies`.

  The delta is float32 (the compute dtype); `xla.masked_step` gives it in the
  gradient's dtype where the rows are not rounded (`in_values_dtype`).
  """
  return _VARIANTS[plan.rule.name].masked_step(inputs, plan)


def rounds_in_pass(inputs: StepInputs, plan: StepPlan) -> bool:
  """Whether `rounded_step` computes this step (where `step_applies`): the rule's kernel
  rounds a 16-bit table's rows stochastically in its own pass."""
  variant = _VARIANTS[plan.rule.name]
  return variant.rounds_in_pass is not None and variant.rounds_in_pass(inputs, plan)


def rounded_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """The rule's kernel step with the table's new rows `round(table[row] + delta)`, rounded
  stochastically in the kernel's pass, in place of the delta (where `rounds_in_pass`)."""
  variant = _VARIANTS[plan.rule.name]
  assert variant.rounded_step is not None
  return variant.rounded_step(inputs, plan)


def in_values_dtype(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """`masked_step`, its delta cast to the gradient's dtype as `xla.masked_step` casts it
  (by the plain Adam kernel in its pass, for a 16-bit gradient: `adam_narrow_step`)."""
  if moment_steps.narrows_in_pass(inputs, plan):
    return moment_steps.adam_narrow_step(inputs, plan)
  result = masked_step(inputs, plan)
  return result._replace(delta=result.delta.astype(inputs.values.dtype))


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


def _moment_step_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  """Float32, bfloat16 or float16 gradient, float32 parameter (read for weight decay), float32 or
  bf16 slots, int32 step tables, float32 arithmetic: any weight decay, amsgrad, per-row
  steps or catch-up."""
  tables, hyper, config = inputs.tables, inputs.hyper, plan.config
  weight_decay = config.weight_decay != "none"
  # Weight decay's terms are rounded as the kernels round them only with the rounding zero.
  if weight_decay and (
    tables.param is None or hyper.weight_decay is None or inputs.opaque_zero is None
  ):
    return False
  if config.weight_decay == "decoupled" and hyper.learning_rate is None:
    return False
  # Stochastic rounding keys on the step count (the XLA path refuses a step without one).
  if inputs.step is None and config.moment_rounding != "nearest":
    return False
  slots = tables.slots
  if "nu_max" in slots and jnp.dtype(slots["nu_max"].dtype) != jnp.dtype(slots["nu"].dtype):
    return False
  steps = tuple(x for x in (tables.row_step, tables.last_step) if x is not None)
  param = (tables.param,) if weight_decay else ()
  # A 16-bit gradient's rows are summed in it, each add rounded, as XLA sums them.
  return (
    jnp.dtype(config.compute_dtype) == jnp.dtype(jnp.float32)
    and all(jnp.dtype(x.dtype) == jnp.dtype(jnp.int32) for x in steps)
    and sharding.on_one_cpu_device(steps)
    and _applies(
      param,
      nse=inputs.values.shape[0],
      num_rows=plan.layout.num_rows,
      row_size=math.prod(plan.layout.dense_shape),
      moments=tuple(slots.values()),
      values=(inputs.values,),
    )
  )


def _adam_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  if not isinstance(plan.rule, AdamRule) or not _moment_step_applies(inputs, plan):
    return False
  return inputs.tables.last_step is None or _adam_catch_up_applies(inputs, plan)


def _adam_catch_up_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  """Catch-up of idle rows, with or without decoupled weight decay and amsgrad (the optax
  layer refuses it with L2 weight decay and per-row steps)."""
  tables, hyper, config = inputs.tables, inputs.hyper, plan.config
  if config.weight_decay == "l2" or tables.row_step is not None:
    return False
  if inputs.step is None or hyper.log_b1 is None or hyper.log_b2 is None:
    return False
  return hyper.step_size is not None or hyper.learning_rate is not None


def _rowwise_adam_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  return (
    isinstance(plan.rule, RowwiseAdamRule)
    and inputs.tables.last_step is None
    and _moment_step_applies(inputs, plan)
  )


def _rule_step_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  return rule_steps.applies(inputs, plan) and _moment_step_applies(inputs, plan)


# The rules with a fused kernel, by `RowRule.name`.
_VARIANTS: dict[str, KernelVariant] = {
  "adam": KernelVariant(
    _adam_applies,
    moment_steps.adam_step,
    rounds_in_pass=moment_steps.rounds_in_pass,
    rounded_step=moment_steps.adam_rounded_step,
  ),
  "rowwise_adam": KernelVariant(
    _rowwise_adam_applies,
    moment_steps.rowwise_adam_step,
    rounds_in_pass=moment_steps.rounds_in_pass,
    rounded_step=moment_steps.adam_rounded_step,
  ),
  # SGD with momentum, Adagrad, row-wise Adagrad: one kernel (rule_steps; plain SGD: none).
  **{
    name: KernelVariant(
      _rule_step_applies,
      rule_steps.masked_step,
      max_norm=True,
      rounds_in_pass=rule_steps.rounds_in_pass,
      rounded_step=rule_steps.rounded_step,
    )
    for name in rule_steps.RULES
  },
}


def store_applies(table: jax.Array, *, nse: int, num_rows: int) -> bool:
  """Whether `store_rows` can store rows into `table` (float32, bfloat16 or float16).

  As `_applies`: entries and rows, no Explicit axes, the table on one CPU device.
  """
  row_size = math.prod(table.shape) // num_rows if num_rows > 0 else 0
  return (
    jnp.dtype(table.dtype) in _STORED_DTYPES
    and nse > 0
    and num_rows > 0
    and row_size > 0
    and not sharding.explicit_axes()
    and enabled()
    and sharding.on_one_cpu_device((table,))
  )


def store_rows(
  table: jax.Array, rows: jax.Array, values: jax.Array, *, num_rows: int, rows_unique: bool
) -> jax.Array:
  """`table[rows] = values` (cast to the table's dtype), out-of-range rows dropped; in place.

  `table` keeps its shape and is viewed as `num_rows` rows; `values` holds one
  row per entry of `rows`. A repeated row keeps its last entry. The generic
  kernel every rule's step and apply share on the CPU (`row_store.cc`): a set of
  the same bits as XLA's scatter, with no table-sized copy for 16-bit tables.
  """
  call = jax.ffi.ffi_call(
    _STORE_ROWS,
    jax.ShapeDtypeStruct(table.shape, table.dtype),
    input_output_aliases={2: 0},
    vmap_method=moment_steps.VMAP_METHOD,
  )
  values = values.astype(table.dtype).reshape(rows.shape[0], -1)
  return call(rows.astype(jnp.int32), values, table, num_rows=num_rows, rows_unique=rows_unique)


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
    input_output_aliases={2: 0},
    vmap_method=moment_steps.VMAP_METHOD,
  )
  return call(rows, values, table, num_rows=num_rows, rows_unique=rows_unique)


# The tables `coalesce_and_gather` gathers and `store_rows` stores: bytes copied.
_ROW_TABLE_DTYPES = (*_STORED_DTYPES, jnp.dtype(jnp.int32))


def generic_step_applies(inputs: StepInputs, plan: StepPlan) -> bool:
  """Whether any rule's step may store its tables' rows with the generic kernels.

  A gradient with entries, rows of at least one value, every table (slots,
  parameter, per-row steps) float32, bfloat16, float16 or int32 and on one CPU
  device, no Explicit mesh axes, and `enabled()`. The rows are then also
  coalesced and gathered by the generic kernel where the gradient is float32,
  bfloat16 or float16 (`gathers`).
  """
  tables = inputs.tables
  given = [*tables.slots.values(), tables.param, tables.row_step, tables.last_step]
  arrays = [x for x in given if x is not None]
  return (
    all(jnp.dtype(x.dtype) in _ROW_TABLE_DTYPES for x in arrays)
    and inputs.values.shape[0] > 0
    and plan.layout.num_rows > 0
    and math.prod(plan.layout.dense_shape) > 0
    and not sharding.explicit_axes()
    and enabled()
    and sharding.on_one_cpu_device(arrays)
  )


def gathers(values: jax.Array) -> bool:
  """Whether `coalesce_and_gather` sums these gradient values (float32, bfloat16, float16)."""
  return jnp.dtype(values.dtype) in _SUMMED_DTYPES


def coalesce_and_gather(
  rows: jax.Array,
  values: jax.Array,
  num_rows: int,
  tables: Sequence[jax.Array | None],
  read_only: Sequence[jax.Array | None] = (),
) -> Coalesced:
  """`coalesce.coalesce_and_gather_rows` (a `Coalescer`) by one call of the generic kernel.

  `row_gather.cc`: the gradient's rows coalesced (each row's entries summed in
  input order from -0.0, each add rounded to the values' dtype) and every
  table's rows gathered at them (zeros at padding), the same bits as the XLA
  ops. The tables are left untouched.
  """
  given = [t for t in (*tables, *read_only) if t is not None]
  call = jax.ffi.ffi_call(
    _COALESCE_GATHER,
    (
      jax.ShapeDtypeStruct(rows.shape, jnp.int32),
      jax.ShapeDtypeStruct(values.shape, values.dtype),
      *(jax.ShapeDtypeStruct((rows.shape[0], *t.shape[1:]), t.dtype) for t in given),
    ),
    vmap_method=moment_steps.VMAP_METHOD,
  )
  unique_rows, sums, *rows_of = call(rows.astype(jnp.int32), values, *given, num_rows=num_rows)
  it = iter(rows_of)
  gathered = [None if t is None else next(it) for t in (*tables, *read_only)]
  return CoalescedRows(unique_rows, sums), gathered, list(tables)
