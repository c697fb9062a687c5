"""The FFI call of the SGD, Adagrad and row-wise Adagrad kernel (`rule_kernels.cc`), and where
it applies.

One kernel runs the rules with one slot: SGD with the lazy `momentum_buffer`
(Nesterov or not), Adagrad (`sum`) and row-wise Adagrad (one `sum` per row),
with maximize, L2 or decoupled weight decay and `max_norm`. Plain SGD (no slot)
runs the generic kernels: its fused variant measured within 10% of them
(`benchmarks/bench_rules.py`), so it was deleted. The
step's scalars are computed here in XLA as `xla.masked_step` and the rule
compute them (so the two paths round alike); the slot is given in its own
shape and aliased to its output (in place when donated). `kernels.py` adds the
checks every kernel shares (`_moment_step_applies`: dtypes, one device, the
rounding zero for weight decay).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from optax_sparse_adam._backends.cpu import moment_steps
from optax_sparse_adam._core import rounding
from optax_sparse_adam._core.row_rules import adagrad, sgd
from optax_sparse_adam._core.row_rules.adagrad import AdagradRule
from optax_sparse_adam._core.row_rules.rowwise_adagrad import RowwiseAdagradRule
from optax_sparse_adam._core.row_rules.rowwise_adam import inverse_row_size
from optax_sparse_adam._core.row_rules.sgd import SGDRule
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan, Tables
from optax_sparse_adam._core.sharded import sharding

RULE_STEP = "optax_sparse_adam_rule_step_f32"
# The FFI target's name -> the library's symbol (registered by `kernels.available`).
TARGETS = {RULE_STEP: "OsaRuleStepF32"}
# The rules this kernel runs, by `RowRule.name`.
RULES = ("sgd", "adagrad", "rowwise_adagrad")
# `RuleKind` in rule_kernels.cc.
_SGD_MOMENTUM, _SGD_NESTEROV, _ADAGRAD, _ROWWISE_ADAGRAD = range(1, 5)
_DECAY_CODES = {"none": 0, "l2": 1, "decoupled": 2}


def _rule_code(rule: Any) -> int | None:
  if isinstance(rule, SGDRule):
    if not rule.momentum:
      return None  # plain SGD: the generic kernels
    return _SGD_NESTEROV if rule.nesterov else _SGD_MOMENTUM
  if isinstance(rule, AdagradRule):
    return _ADAGRAD
  if isinstance(rule, RowwiseAdagradRule):
    return _ROWWISE_ADAGRAD
  return None


def applies(inputs: StepInputs, plan: StepPlan) -> bool:
  """The rule's own conditions: a known rule, no per-row or last steps, a step count
  where Adagrad needs one, and a float32 parameter on one device for `max_norm` (with
  the rounding zero, which rounds the renormalisation's product in the XLA path)."""
  tables = inputs.tables
  if _rule_code(plan.rule) is None or tables.row_step is not None:
    return False
  if tables.last_step is not None:
    return False
  if isinstance(plan.rule, AdagradRule) and inputs.hyper.step_size is None:
    if inputs.step is None:
      return False
  if plan.config.max_norm is not None:
    param = tables.param
    return (
      param is not None
      and inputs.opaque_zero is not None
      and jnp.dtype(param.dtype) == jnp.dtype(jnp.float32)
      and sharding.on_one_cpu_device((param,))
    )
  return True


def _coefficients(inputs: StepInputs, plan: StepPlan) -> list[Any]:
  """`RuleCoeffs` of rule_kernels.cc, float32, as the rule and `xla.masked_step` compute them."""
  f32, hyper, rule = jnp.float32, inputs.hyper, plan.rule

  def c(x: Any) -> jax.Array:
    return jnp.asarray(x, f32)

  a: Any = 0.0
  b: Any = 0.0
  third: Any = 0.0
  if not isinstance(rule, AdagradRule):
    a = c(hyper.learning_rate)
  if isinstance(rule, SGDRule) and rule.momentum:
    b, third = c(hyper.momentum), sgd.gradient_weight(hyper, inputs.step, f32)
  elif isinstance(rule, AdagradRule):
    a, b = adagrad.step_size(hyper, inputs.step, f32), c(hyper.eps)
  elif isinstance(rule, RowwiseAdagradRule):
    b = c(hyper.eps)
    third = inverse_row_size(math.prod(plan.layout.dense_shape), f32)
  max_norm = plan.config.max_norm
  return [a, b, third, moment_steps._decay_coefficient(inputs, plan), max_norm or 0.0]


def rounds_in_pass(inputs: StepInputs, plan: StepPlan) -> bool:
  """Whether `rounded_step` computes this step: a bfloat16 or float16 table rounded
  stochastically, with a step count (its key), no weight decay and no `max_norm` (the
  kernel reads a float32 parameter only), where the kernel applies (`applies` and
  `kernels.step_applies`)."""
  param, config = inputs.tables.param, plan.config
  return (
    config.param_rounding == "stochastic"
    and config.weight_decay == "none"
    and config.max_norm is None
    and inputs.step is not None
    and param is not None
    and jnp.dtype(param.dtype) in moment_steps.SIXTEEN_BITS
  )


def masked_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """`xla.masked_step` of SGD with momentum, Adagrad or row-wise Adagrad: one FFI call."""
  return _step(inputs, plan, rounded=False)


def rounded_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """The step of a 16-bit table rounded stochastically, in the kernel's one pass.

  Where `rounds_in_pass`: `masked_step`, each distinct row's new value
  `round(table[row] + delta)` computed in the same pass (`RoundedRows` in row_round.h,
  the rule kernel's epilogue whatever the rule) with the parameter's bits
  (`rounding.kernel_keys` at `PARAM_SLOT`): those of `xla.rounded_param_rows` and of
  `row_round.add_rounded_rows`. Returns the new rows (the table's dtype, zeros at
  padding) in place of the delta, for the apply to store.
  """
  assert rounds_in_pass(inputs, plan)
  return _step(inputs, plan, rounded=True)


def _step(inputs: StepInputs, plan: StepPlan, *, rounded: bool) -> RowsStep:
  f32 = jnp.float32
  config, tables = plan.config, inputs.tables
  names = [slot.name for slot in plan.rule.slots()]
  slot = tables.slots[names[0]]
  reads_param = config.weight_decay != "none" or config.max_norm is not None
  param = tables.param if reads_param else None
  stochastic = config.moment_rounding == "stochastic"
  # A one-slot rule's slot is its pair's first: the hash's top half, as the kernel takes.
  pair = rounding.hash_half(names, names[0])[0]
  keys = rounding.kernel_keys(inputs.step, pair, inputs.row_offset)
  table = moment_steps.rounded_table(inputs, rounds=rounded)  # empty buffers if not
  call = jax.ffi.ffi_call(
    RULE_STEP,
    (
      jax.ShapeDtypeStruct(inputs.rows.shape, jnp.int32),
      jax.ShapeDtypeStruct(inputs.values.shape, f32),
      jax.ShapeDtypeStruct(slot.shape, slot.dtype),
      table.new_rows,
    ),
    input_output_aliases={2: 2},
    vmap_method=moment_steps.VMAP_METHOD,
  )
  rows, delta, new_slot, out = call(
    inputs.rows,
    inputs.values,
    slot,
    jnp.stack([jnp.asarray(x, f32) for x in _coefficients(inputs, plan)]),
    keys,
    jnp.zeros((0,), f32) if param is None else param,
    table.table,
    table.keys,
    num_rows=plan.layout.num_rows,
    rule=_rule_code(plan.rule),
    maximize=config.maximize,
    stochastic=stochastic,
    decay=_DECAY_CODES[config.weight_decay],
    max_norm=config.max_norm is not None,
  )
  return RowsStep(rows, out if rounded else delta, Tables({names[0]: new_slot}))
