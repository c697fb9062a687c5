"""The row program: a rule's elementwise math compiled to an op list the generic kernel runs.

A rule without a fused kernel of its own (FTRL, a user's rule) runs on the CPU
as one generic FFI call (`row_program.cc`) when its `update` is elementwise:
the update is traced once (`jax.make_jaxpr`, on one row block's shapes, the
traced hyper-parameters as operands), and each equation is translated into an
op of a small static program (a tuple of ints, a hashable attribute of the
call) that the kernel interprets on each coalesced row, over row-wide
vectors, in the pass that coalesces the ids, sums duplicates, reads the slot
and parameter rows and stores the new ones in place. The kernel knows only
primitives (add, sub, mul, div, neg, sqrt, abs, sign, max, min, comparisons,
select, the bit XOR of `adam.rounded`, no-op conversions and broadcasts of
scalars), per-row values (one lane a row: a per-row slot's, broadcast over the
row by one op) and `osa.row_sum` (one op: the row's pairwise sum): no per-rule
C++.

Numerics: each op is one IEEE operation of float32, as XLA computes it (the
kernel is compiled without contraction), and the compiler does what XLA does
to the same math (`row_program_ops`: a division by a constant is a product by
its inverse; under jit such a product used by one sum is one FMA), so the
program's rows equal the XLA ops' bit for bit. Where XLA's result depends on
its fusions the program refuses the rule: a product of the rule's own summed
unrounded, or into `osa.row_sum` (`adam.rounded`, `row_sum`'s `opaque_zero`,
pins it), and any primitive it does not know (`pow`, `exp`, `jnp.sum`'s
`reduce_sum`, whose order XLA does not fix) on row values. An equation of
uniform values alone that the kernel does not know (the step count's
int->float conversion or comparison, `pow` of hyper-parameters) is hoisted:
computed by XLA before the kernel, by the same primitive, and read by the
kernel as one more scalar. A refused rule keeps the generic path (the rows
gathered, the math in XLA ops, the rows stored), and `refusal` says why
(`osa.row_program_report`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from optax_sparse_adam._backends import choice
from optax_sparse_adam._backends.cpu import moment_steps, row_program_format, row_program_ops
from optax_sparse_adam._backends.cpu.row_program_format import Program
from optax_sparse_adam._core import rounding
from optax_sparse_adam._core.rules import (
  RowBlock,
  RowsStep,
  StepInputs,
  StepPlan,
  Tables,
  reads_param,
  sets_rows,
)

ROW_PROGRAM = "optax_sparse_adam_row_program"
# The FFI target's name -> the library's symbol (registered by `kernels.available`).
TARGETS = {ROW_PROGRAM: "OsaRowProgram"}

_F32 = jnp.dtype(jnp.float32)


class _Traced(NamedTuple):
  program: Program | None
  refusal: str | None


@functools.lru_cache(maxsize=256)
def _program(
  rule: Any,
  maximize: bool,
  row_shape: tuple[int, ...],
  hyper_key: tuple,
  hyper_treedef: Any,
  step_aval: Any,
  jit: bool,
) -> _Traced:
  """The traced and compiled program of a rule's step (cached on everything it depends on)."""
  num_slots = len(rule.slots())
  scalar_positions = [i for i, (kind, _) in enumerate(hyper_key) if kind == "array"]
  num_scalars = len(scalar_positions) + 1 + (step_aval is not None)  # + the rounding zero

  def row_math(g, param, slots, arrays, opaque_zero, step):
    leaves = [value for _, value in hyper_key]
    for i, a in zip(scalar_positions, arrays, strict=True):
      leaves[i] = a
    hyper = jax.tree.unflatten(hyper_treedef, leaves)
    if maximize:
      g = -g
    slot_rows = {slot.name: s for slot, s in zip(rule.slots(), slots, strict=True)}
    store = rounding.nearest_store(slot_rows)
    block = RowBlock(
      g, slot_rows, step, jnp.float32, opaque_zero, store, param if reads_param(rule) else None
    )
    delta, new_rows = rule.update(block, hyper)
    from optax_sparse_adam._backends import xla  # the pipeline's own check

    xla.check_slot_rows(rule, new_rows)
    out = jnp.asarray(delta).astype(jnp.float32)
    return (out, *(jnp.asarray(new_rows[s.name]) for s in rule.slots()))

  block = jax.ShapeDtypeStruct(row_shape, jnp.float32)
  per_row = jax.ShapeDtypeStruct(row_shape[:1], jnp.float32)  # a per-row slot's values
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  slot_avals = [per_row if slot.per_row else block for slot in rule.slots()]
  args = (
    block,
    block,
    slot_avals,
    [scalar] * len(scalar_positions),
    jax.ShapeDtypeStruct((), jnp.int32),
    None if step_aval is None else jax.ShapeDtypeStruct((), step_aval),
  )
  jaxpr = jax.make_jaxpr(row_math)(*args)
  expected = [block, *slot_avals]
  for var, aval in zip(jaxpr.jaxpr.outvars, expected, strict=True):
    if not isinstance(var, jex_core.Literal) and tuple(var.aval.shape) not in (aval.shape, ()):
      return _Traced(None, f"the update returns a value of shape {var.aval.shape}")
    if jnp.dtype(var.aval.dtype) != _F32:
      return _Traced(None, f"the update returns {var.aval.dtype} rows")
  try:
    return _Traced(
      row_program_ops.compile_jaxpr(
        jaxpr,
        row_shape,
        num_slots,
        num_scalars,
        jit,
        zero_scalar=len(scalar_positions),
        per_row_slots=[slot.per_row for slot in rule.slots()],
      ),
      None,
    )
  except row_program_ops.Refused as refused:
    return _Traced(None, str(refused))


def _hyper_key(hyper: Any) -> tuple[tuple, Any] | str:
  """The hyper-parameters' leaves as a hashable key (floats kept, arrays as avals), or why not."""
  leaves, treedef = jax.tree.flatten(hyper)
  key: list[tuple[str, Any]] = []
  for leaf in leaves:
    if isinstance(leaf, jax.Array | np.ndarray | np.generic) and not isinstance(leaf, float):
      if np.shape(leaf) != () or jnp.dtype(leaf.dtype) != _F32:
        return f"a hyper-parameter of shape {np.shape(leaf)} and dtype {leaf.dtype}"
      if isinstance(leaf, jax.core.Tracer):
        key.append(("array", None))
      else:  # known now: XLA sees a constant (a division by it becomes a product)
        key.append(("value", np.float32(leaf)))
    elif isinstance(leaf, bool | int | float):
      key.append(("value", leaf))
    else:
      return f"a hyper-parameter {type(leaf).__name__}"
  return tuple(key), treedef


def traced_into_jit(x: Any) -> bool:
  """Whether `x` is traced into a jitted program, where XLA contracts the rule's products
  into sums: False for a concrete array and op by op under `vmap` or `grad`, whose
  tracers wrap a concrete value (`val`, `primal`) and run each primitive on its own."""
  while isinstance(x, jax.core.Tracer):
    if type(x).__name__ == "DynamicJaxprTracer":
      return True
    inner = next((a for a in ("val", "primal") if hasattr(x, a)), None)
    if inner is None:
      return True  # a tracer of another kind: assumed staged, as jit stages
    x = getattr(x, inner)
  return False


def refusal(inputs: StepInputs, plan: StepPlan, *, jit: bool = True) -> str | None:
  """Why the row program does not run this step (None: it does); `jit`: whether the
  step is traced, and XLA contracts its products into sums (`_Compiler`)."""
  layout, rule, config = plan
  tables = inputs.tables
  if not choice.current().row_program:
    return "switched off"
  if tables.row_step is not None or tables.last_step is not None:
    return "per-row steps or catch-up of idle rows"
  if config.weight_decay != "none" or config.max_norm is not None:
    return "the pipeline's weight decay or max_norm"
  if config.param_rounding != "nearest" or jnp.dtype(config.compute_dtype) != _F32:
    return "a step that is not float32 rounded to nearest"
  arrays = [*tables.slots.values()]
  if reads_param(rule) or sets_rows(rule):
    if tables.param is None:
      return "no parameter"
    arrays.append(tables.param)
  if any(jnp.dtype(a.dtype) != _F32 for a in arrays):
    return "a table that is not float32"
  traced = _traced(inputs, plan, jit)
  return traced if isinstance(traced, str) else traced.refusal


def _traced(inputs: StepInputs, plan: StepPlan, jit: bool) -> _Traced | str:
  key = _hyper_key(inputs.hyper)
  if isinstance(key, str):
    return key
  step = None if inputs.step is None else jnp.dtype(inputs.step.dtype)
  if inputs.step is not None and np.shape(inputs.step) != ():
    return "a step count per row"
  row_shape = (inputs.values.shape[0], *plan.layout.dense_shape)
  rule: Any = plan.rule  # a frozen dataclass: hashable
  return _program(rule, plan.config.maximize, row_shape, key[0], key[1], step, jit)


def masked_step(inputs: StepInputs, plan: StepPlan, *, jit: bool = True) -> RowsStep:
  """`xla.masked_step` of a rule the row program runs (`refusal` is None): one FFI call."""
  traced = _traced(inputs, plan, jit)
  assert not isinstance(traced, str) and traced.program is not None
  layout, rule, _ = plan
  tables = inputs.tables
  slots = [tables.slots[slot.name] for slot in rule.slots()]
  leaves = jax.tree.leaves(inputs.hyper)
  arrays = [leaf for leaf in leaves if isinstance(leaf, jax.core.Tracer)]
  zero = jnp.zeros((), jnp.int32) if inputs.opaque_zero is None else inputs.opaque_zero
  given = [jnp.asarray(a, jnp.float32) for a in arrays]
  given.append(jnp.asarray(zero, jnp.int32))
  if inputs.step is not None:
    given.append(jnp.asarray(inputs.step))
  # The uniform values the kernel does not compute, computed here by XLA (`row_program_ops`).
  given += row_program_format.hoisted_scalars(traced.program, given)
  scalars = [_lane_bits(x) for x in given]
  param = tables.param if tables.param is not None else jnp.zeros((0,), jnp.float32)
  n = len(slots)
  call = jax.ffi.ffi_call(
    ROW_PROGRAM,
    (
      jax.ShapeDtypeStruct(inputs.rows.shape, jnp.int32),
      jax.ShapeDtypeStruct(inputs.values.shape, jnp.float32),
      *(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in slots),
    ),
    input_output_aliases={4 + k: 2 + k for k in range(n)},
    vmap_method=moment_steps.VMAP_METHOD,
  )
  rows, out, *new_slots = call(
    inputs.rows.astype(jnp.int32),
    inputs.values,
    param,
    jnp.stack(scalars),
    *slots,
    num_rows=layout.num_rows,
    program=np.asarray(traced.program.code, np.int32),
  )
  if not sets_rows(rule):
    out = out.astype(inputs.values.dtype)
  new = {slot.name: s for slot, s in zip(rule.slots(), new_slots, strict=True)}
  return RowsStep(rows, out, Tables(new))


def _lane_bits(x: Any) -> jax.Array:
  """A 0-d value's 32 bits as the kernel's lanes hold them (a bool as 0 or 1)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  return lax.bitcast_convert_type(x, jnp.uint32)


def report(rule: Any, hyper: Any, *, dense_shape: Sequence[int], maximize: bool = False) -> str:
  """Says whether `rule`'s CPU step runs on the row program, or why it runs the generic path.

  A rule without a fused kernel of its own runs its CPU step on the row program
  (one generic kernel that runs the rule's traced math on each coalesced row,
  reading and storing its rows in place) where its `update` is elementwise over
  float32 rows, per-row values (per-row slots) and row sums by `osa.row_sum`;
  otherwise on the generic kernels around its math in XLA ops (the rows are
  gathered into blocks and stored back). A sum by `jnp.sum` or `jnp.mean` keeps
  a rule there: the report says to use `osa.row_sum`. This traces the
  rule's update as a jitted step traces it, for float32 tables with rows of
  `dense_shape` and no weight decay or `max_norm`.

  Args:
    rule: a row rule (`osa.Slot`s and an `update`; docs/architecture.md).
    hyper: its hyper-parameters (floats, or 0-d float32 arrays).
    dense_shape: the shape of one row of the table.
    maximize: whether the step maximizes.

  Returns:
    A sentence: the row program and its number of ops, or the generic path and
    the equation that kept the rule off the row program.

  Example:
    >>> import optax_sparse_adam as osa
    >>> from optax_sparse_adam._core.row_rules import ftrl
    >>> osa.row_program_report(ftrl.FtrlRule(), ftrl.FtrlHyperparams(0.1), dense_shape=(8,))
    "the 'ftrl' rule runs the row program (17 ops)"
  """
  row_shape = (1, *dense_shape)
  key = _hyper_key(hyper)
  if isinstance(key, str):
    return f"the {rule.name!r} rule runs the generic path: {key}"
  traced = _program(rule, maximize, row_shape, key[0], key[1], jnp.dtype(jnp.int32), True)
  if traced.program is not None:
    code = traced.program.code
    ops = (len(code) - 5 - len(rule.slots())) // row_program_format.OP_WIDTH - code[
      1
    ]  # the ops of each row
    return f"the {rule.name!r} rule runs the row program ({ops} ops)"
  return f"the {rule.name!r} rule runs the generic path: {traced.refusal}"
