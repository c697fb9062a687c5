"""SGD, Adagrad and row-wise Adagrad on the CPU kernels equal the XLA ops bit for bit.

The three rules run in one fused kernel (plain SGD, without momentum, on the generic
kernels) (`rule_kernels.cc`, called by
`_backends/cpu/rule_steps.py`), with every option their factories offer and the
pipeline's options around them (maximize, L2 and decoupled weight decay,
`max_norm`, bf16 slots rounded to nearest or stochastically). Each case trains
a few steps with the kernel and with the XLA ops every other backend runs, from
the same inputs, under `jit` with params and state donated (and op by op for
the cases that use the most options); parameters, every state array and the
update BCOO must agree in every bit, and the compiled program must call the
kernel. The XLA ops are checked against torch.optim.SGD / Adagrad
(tests/core/test_row_rules.py, tests/torch_compat) and FBGEMM's formula in
NumPy elsewhere; on the CPU those tests now run this kernel too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam._backends import xla
from optax_sparse_adam._backends.cpu import kernels, rule_steps
from optax_sparse_adam._core.bcoo import RowLayout
from optax_sparse_adam._core.row_rules.adagrad import AdagradHyperparams, AdagradRule
from optax_sparse_adam._core.row_rules.rowwise_adagrad import (
  RowwiseAdagradHyperparams,
  RowwiseAdagradRule,
)
from optax_sparse_adam._core.rules import StepConfig, StepInputs, StepPlan, Tables
from tests._helpers import cpu_only
from tests.backends import test_cpu_kernel_options as adam_options
from tests.backends.test_cpu_kernel_options import SHAPE, _assert_same_bits, _step

pytestmark = [
  cpu_only("the fused CPU kernels run, and equal the XLA ops bit for bit,"),
  pytest.mark.skipif(not kernels.available(), reason="the CPU kernels were not built"),
]


def _rule(rule, hyper, **kwargs):
  return lambda: osa.sparse_rule_transformation(rule, hyper, **kwargs)


# name: a function making the optimizer. The factories' options, and the pipeline's that
# `sparse_rule_transformation` adds (weight decay for SGD and Adagrad, bf16 slots).
OPTIONS = {
  "sgd_maximize": lambda: osa.sparse_sgd(2e-2, maximize=True),
  "sgd_lazy_momentum_dampening": lambda: osa.sparse_sgd(
    2e-2, momentum=0.9, dampening=0.3, lazy_momentum=True
  ),
  "sgd_l2_nesterov": _rule(
    osa.SGDRule(momentum=True, nesterov=True), osa.SGDHyperparams(2e-2, 0.9, 0.0, 0.3)
  ),
  "sgd_decoupled": _rule(
    osa.SGDRule(), osa.SGDHyperparams(2e-2, weight_decay=0.3), weight_decay_mode="decoupled"
  ),
  "adagrad_lr_decay_initial_eps_maximize": lambda: osa.sparse_adagrad(
    2e-2, lr_decay=0.05, initial_accumulator_value=0.5, eps=1e-3, maximize=True
  ),
  "adagrad_l2_bf16_stochastic": _rule(
    osa.AdagradRule(0.1),
    osa.AdagradHyperparams(2e-2, 0.01, weight_decay=0.2),
    slot_dtypes={"sum": jnp.bfloat16},
    moment_rounding="stochastic",
  ),
  "rowwise_adagrad_l2_max_norm": lambda: osa.sparse_rowwise_adagrad(
    0.5, weight_decay=0.1, weight_decay_mode="l2", max_norm=1.5
  ),
  "rowwise_adagrad_decoupled_max_norm_maximize": lambda: osa.sparse_rowwise_adagrad(
    0.5, eps=1e-4, weight_decay=0.1, weight_decay_mode="decoupled", max_norm=1.5, maximize=True
  ),
  "rowwise_adagrad_bf16_stochastic": _rule(
    osa.RowwiseAdagradRule(),
    osa.RowwiseAdagradHyperparams(2e-2),
    slot_dtypes={"sum": jnp.bfloat16},
    moment_rounding="stochastic",
  ),
  "rowwise_adagrad_bf16": _rule(
    osa.RowwiseAdagradRule(),
    osa.RowwiseAdagradHyperparams(2e-2),
    slot_dtypes={"sum": jnp.bfloat16},
  ),
  "sgd_nesterov_max_norm_bf16_stochastic_maximize": _rule(
    osa.SGDRule(momentum=True, nesterov=True),
    osa.SGDHyperparams(0.5, 0.9),
    max_norm=1.5,
    slot_dtypes={"momentum_buffer": jnp.bfloat16},
    moment_rounding="stochastic",
    maximize=True,
  ),
  # Op by op, without maximize: under jit XLA folds the negations of (-lr) * (-g) and
  # (-g) * (-g), op by op it cannot, so a NaN's sign differs between XLA's own two paths
  # (the kernel takes jit's).
  "sgd_momentum_decoupled_max_norm_bf16_stochastic": _rule(
    osa.SGDRule(momentum=True),
    osa.SGDHyperparams(0.5, 0.9, 0.2, 0.1),
    weight_decay_mode="decoupled",
    max_norm=1.5,
    slot_dtypes={"momentum_buffer": jnp.bfloat16},
    moment_rounding="stochastic",
  ),
  "adagrad_lr_decay_initial_eps": lambda: osa.sparse_adagrad(
    2e-2, lr_decay=0.05, initial_accumulator_value=0.5, eps=1e-3
  ),
  "rowwise_adagrad_decoupled_max_norm": lambda: osa.sparse_rowwise_adagrad(
    0.5, eps=1e-4, weight_decay=0.1, weight_decay_mode="decoupled", max_norm=1.5
  ),
}
EAGER = ["sgd_momentum_decoupled_max_norm_bf16_stochastic"]
# Plain SGD runs the generic kernels (checked here against the XLA ops all the same).
PLAIN_SGD = ("sgd_maximize", "sgd_decoupled")
EAGER_SLOW = ["adagrad_lr_decay_initial_eps", "rowwise_adagrad_decoupled_max_norm"]


def _train(name, *, use_jit, cpu_kernels, monkeypatch):
  """`test_cpu_kernel_options._train` (the steps' params, state, updates and the compiled
  text of the jitted step) of the optimizer named here."""
  monkeypatch.setattr(adam_options, "_opt", lambda name: OPTIONS[name]())
  return adam_options._train(name, use_jit=use_jit, cpu_kernels=cpu_kernels)


CASES = [
  *((name, True) for name in OPTIONS if name not in EAGER + EAGER_SLOW),
  *((name, False) for name in EAGER),
  *(pytest.param(name, False, marks=pytest.mark.slow) for name in EAGER_SLOW),
]


def _case_id(case):
  name, use_jit = case.values if hasattr(case, "values") else case
  return f"{name}-{'jit' if use_jit else 'eager'}"


@pytest.mark.parametrize("name,use_jit", CASES, ids=[_case_id(case) for case in CASES])
def test_rules_on_the_kernel_equal_the_xla_ops_bit_for_bit(name, use_jit, monkeypatch):
  with_kernel, text = _train(name, use_jit=use_jit, cpu_kernels=True, monkeypatch=monkeypatch)
  with_xla, xla_text = _train(name, use_jit=use_jit, cpu_kernels=False, monkeypatch=monkeypatch)
  _assert_same_bits(with_kernel, with_xla)
  if use_jit and name in PLAIN_SGD:
    # Plain SGD has no fused kernel (it measured within 10% of the generic kernels).
    assert rule_steps.RULE_STEP not in text and "optax_sparse_adam_coalesce_gather" in text
  elif use_jit:
    # The compiled step runs the kernel, with the options among its attributes.
    assert rule_steps.RULE_STEP in text and rule_steps.RULE_STEP not in xla_text
    assert ("max_norm = true" in text) == ("max_norm" in name)
    assert ("maximize = true" in text) == ("maximize" in name)
  # The data reach every option: the NaN and inf propagated, finite rows moved.
  params = with_kernel[-1][0]["w"]
  assert np.isnan(params).any() and np.isfinite(params).any()


def test_adagrad_without_a_step_count_or_step_size_keeps_the_xla_ops():
  """The kernel takes Adagrad's step size from the step count or the one given."""
  tables = Tables({"sum": jnp.zeros(SHAPE)})
  rows, values = jnp.array([1, 2], jnp.int32), jnp.ones((2, SHAPE[1]))
  plan = StepPlan(RowLayout(SHAPE[:1], SHAPE[1:]), AdagradRule(), StepConfig())
  given = StepInputs(rows, values, tables, None, AdagradHyperparams(0.1, step_size=0.05))
  assert kernels.step_applies(given, plan)
  assert kernels.step_applies(
    given._replace(step=jnp.array(1), hyper=AdagradHyperparams(0.1)), plan
  )
  assert not kernels.step_applies(given._replace(hyper=AdagradHyperparams(0.1)), plan)


def _adagrad_step_text(**export):
  opt = osa.sparse_adagrad(0.1)
  params = {"w": jnp.zeros((50, 8), jnp.float32)}
  grads = {
    "w": jax.experimental.sparse.BCOO.fromdense(jnp.zeros((50, 8)).at[3].set(1.0), n_dense=1)
  }
  step = jax.jit(_step(opt))
  if not export:
    return step.lower(params, opt.init(params), grads).compile().as_text()
  # The kernels' targets promise no serialization compatibility: allowed here, to be seen.
  targets = (rule_steps.RULE_STEP, kernels._SCATTER_ADD_ROWS)
  allow = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
  exported = jax.export.export(step, disabled_checks=allow, **export)
  return exported(params, opt.init(params), grads).mlir_module()


def test_the_kernel_is_chosen_by_backend_and_left_where_the_library_is_missing(monkeypatch):
  """Lowered for the CPU the step calls the kernel; for a GPU or TPU, and on a CPU whose
  build lacks the library, it runs the XLA ops."""
  assert rule_steps.RULE_STEP in _adagrad_step_text(platforms=["cpu"])
  for platform in ("cuda", "tpu"):
    text = _adagrad_step_text(platforms=[platform])
    assert rule_steps.RULE_STEP not in text and "scatter" in text
  monkeypatch.setattr(kernels, "available", lambda: False)
  assert rule_steps.RULE_STEP not in _adagrad_step_text()


@pytest.mark.parametrize("per_row", [False, True], ids=["adagrad", "rowwise_adagrad"])
def test_a_shards_rows_draw_their_global_rows_bits(per_row):
  """Stochastic rounding with `row_offset` (a routed shard's first global row): the
  kernel's bits equal the XLA ops', and differ from the same rows at offset 0."""
  rule, hyper = (
    (RowwiseAdagradRule(), RowwiseAdagradHyperparams(0.1))
    if per_row
    else (AdagradRule(), AdagradHyperparams(0.1))
  )
  shape = SHAPE[:1] if per_row else SHAPE
  tables = Tables({"sum": jnp.full(shape, 0.3, jnp.bfloat16)})
  rng = np.random.default_rng(0)
  rows = jnp.array([1, 4, 4, 7], jnp.int32)
  values = jnp.asarray(rng.normal(size=(4, SHAPE[1])), jnp.float32)
  plan = StepPlan(RowLayout(SHAPE[:1], SHAPE[1:]), rule, StepConfig(moment_rounding="stochastic"))

  def run(backend, offset):
    inputs = StepInputs(rows, values, tables, jnp.int32(3), hyper, row_offset=jnp.int32(offset))
    assert backend is xla.masked_step or kernels.step_applies(inputs, plan)
    return jax.jit(lambda i: backend(i, plan))(inputs)

  with_kernel, with_xla = run(rule_steps.masked_step, 37), run(xla.masked_step, 37)
  _assert_same_bits(with_kernel, with_xla)
  at_zero = run(rule_steps.masked_step, 0).tables.slots["sum"]
  assert np.any(np.asarray(at_zero) != np.asarray(with_kernel.tables.slots["sum"]))
