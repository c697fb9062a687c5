"""Every option of the pipeline on the fused CPU kernels equals the XLA ops bit for bit.

Weight decay (L2 and decoupled), amsgrad and per-row bias correction, alone and
combined with maximize, the row-wise second moment, bf16 moments and stochastic
rounding, run in the kernels (`kernels.cc`: `AdamRow`, `RowwiseAdamRow` with
their option flags). Each step here runs with the kernels and with the XLA ops
every other backend runs, from the same inputs, under `jit` with the params and
state donated and op by op; parameters, every state array and the update BCOO
must agree in every bit. The XLA ops themselves are checked against
independent references elsewhere, which now run the kernels on the CPU too:
torch.optim.Adam/AdamW in float64 (tests/core/test_adam_options.py), FBGEMM's
row-wise formula in NumPy (tests/core/test_rowwise_adam.py). The catch-up of
idle rows with these options is tests/backends/test_cpu_catch_up.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends.cpu import kernels
from optax_sparse_adam._core.bcoo import RowLayout
from optax_sparse_adam._core.row_rules.adam import AdamRule, adam_coefficients, hyperparams_of
from optax_sparse_adam._core.rules import StepConfig, StepInputs, StepPlan, Tables
from tests._helpers import cpu_only, tiered

pytestmark = [
  cpu_only("the fused CPU kernels run, and equal the XLA ops bit for bit,"),
  pytest.mark.skipif(not kernels.available(), reason="the CPU kernels were not built"),
]

ADAM_OPTIONS_KERNEL = "optax_sparse_adam_fused_adam_options_f32"
ROWWISE_KERNEL = "optax_sparse_adam_fused_rowwise_adam_f32"
ENTRY_STEPS_KERNEL = "optax_sparse_adam_entry_steps_s32"
BF16 = {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16}

# name: (factory, keyword arguments), each with a learning rate of 2e-2.
OPTIONS = {
  "adamw": (osa.sparse_adamw, {"weight_decay": 0.3}),
  "l2": (osa.sparse_adam, {"weight_decay": 0.3}),
  "amsgrad": (osa.sparse_adam, {"amsgrad": True}),
  "per_row": (osa.sparse_adam, {"per_row_bias_correction": True}),
  "l2_amsgrad_per_row_maximize": (
    osa.sparse_adam,
    {"weight_decay": 0.1, "amsgrad": True, "per_row_bias_correction": True, "maximize": True},
  ),
  "adamw_amsgrad_per_row": (
    osa.sparse_adamw,
    {"weight_decay": 0.1, "amsgrad": True, "per_row_bias_correction": True},
  ),
  "adamw_bf16_stochastic": (
    osa.sparse_adamw,
    {"weight_decay": 0.1, "moment_rounding": "stochastic", **BF16},
  ),
  "l2_amsgrad_bf16": (osa.sparse_adam, {"weight_decay": 0.1, "amsgrad": True, **BF16}),
  "rowwise_maximize": (osa.sparse_adam, {"rowwise_second_moment": True, "maximize": True}),
  "rowwise_adamw_maximize": (
    osa.sparse_adamw,
    {"weight_decay": 0.1, "rowwise_second_moment": True, "maximize": True},
  ),
  "rowwise_l2_amsgrad_per_row_bf16_stochastic": (
    osa.sparse_adam,
    {
      "weight_decay": 0.1,
      "amsgrad": True,
      "per_row_bias_correction": True,
      "rowwise_second_moment": True,
      "mu_dtype": jnp.bfloat16,
      "moment_rounding": "stochastic",
    },
  ),
}
SHAPE = (30, 6)


def _opt(name):
  factory, kwargs = OPTIONS[name]
  return factory(2e-2, **kwargs)


def _batches(steps=4, nse=24):
  """Ids with a row repeated, padding past the end, a row touched only now and then; values
  with signed zeros, a subnormal, a large value, and a NaN and an inf at the third step."""
  rng = np.random.default_rng(5)
  out = []
  for s in range(steps):
    idx = rng.integers(0, SHAPE[0] - 1, nse)
    idx[1:5] = idx[0]
    idx[-1] = SHAPE[0] + 3
    if s % 2:
      idx[-2] = SHAPE[0] - 1  # a row whose own step count lags the parameter's
    val = rng.standard_normal((nse, SHAPE[1])).astype(np.float32) * (10.0 if s % 2 else 1.0)
    val.reshape(-1)[:4] = [-0.0, 0.0, 1e-40, 3e18]
    if s == 2:
      val[7, 3], val[9, 1] = np.nan, -np.inf
    out.append((idx[:, None].astype(np.int32), val))
  return out


def _step(opt):
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state, updates

  return step


def _train(name, *, use_jit, cpu_kernels):
  """The steps' params, state and updates, and the compiled text of the jitted step."""
  opt = _opt(name)
  params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE), jnp.float32)}
  state = opt.init(params)
  step = jax.jit(_step(opt), donate_argnums=(0, 1)) if use_jit else _step(opt)
  out, text = [], None
  with kernels.use_cpu_kernels(cpu_kernels):
    for idx, val in _batches():
      grads = {"w": sparse.BCOO((jnp.asarray(val), jnp.asarray(idx)), shape=SHAPE)}
      if use_jit and text is None:
        text = step.lower(params, state, grads).compile().as_text()
      params, state, update = step(params, state, grads)
      # Copied now: the next step is given (donates) these params and state.
      out.append(jax.device_get((params, state, update["w"].data, update["w"].indices)))
  return out, text


def _assert_same_bits(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    if x.dtype.kind == "f" or x.dtype == jnp.bfloat16:
      x, y = x.view(f"u{x.dtype.itemsize}"), y.view(f"u{y.dtype.itemsize}")
    np.testing.assert_array_equal(x, y)


# Every option under jit (donated); op by op the two combinations that use the most options.
CASES = [(name, True) for name in OPTIONS] + [
  ("l2_amsgrad_per_row_maximize", False),
  ("rowwise_l2_amsgrad_per_row_bf16_stochastic", False),
]
# The default tier runs the combinations, which take every branch of the kernel the single
# options take (test_cpu_kernels runs the kernel op by op); the rest run in the slow tier.
SLOW_CASES = {
  *((name, True) for name in ("adamw", "l2", "amsgrad", "per_row", "rowwise_maximize")),
  *(
    (name, False)
    for name in ("l2_amsgrad_per_row_maximize", "rowwise_l2_amsgrad_per_row_bf16_stochastic")
  ),
}


@pytest.mark.parametrize(
  "name,use_jit",
  tiered(CASES, lambda case: case in SLOW_CASES),
  ids=[f"{n}-{'jit' if j else 'eager'}" for n, j in CASES],
)
def test_options_on_the_kernels_equal_the_xla_ops_bit_for_bit(name, use_jit):
  with_kernels, text = _train(name, use_jit=use_jit, cpu_kernels=True)
  with_xla, xla_text = _train(name, use_jit=use_jit, cpu_kernels=False)
  _assert_same_bits(with_kernels, with_xla)
  if use_jit:
    # The compiled step runs the kernel (the options among its attributes), XLA ops without.
    kernel = ROWWISE_KERNEL if "rowwise" in name else ADAM_OPTIONS_KERNEL
    assert kernel in text and kernel not in xla_text
    assert ("amsgrad = true" in text) == ("amsgrad" in name)
    assert ("per_row = true" in text) == ("per_row" in name)
    assert (ENTRY_STEPS_KERNEL in text) == ("per_row" in name)
  # The data reach every option: the NaN and inf propagated, the decay moved the params.
  params = with_kernels[-1][0]["w"]
  assert np.isnan(params).any() and np.isfinite(params).any()


def test_weight_decay_needs_the_rounding_zero_for_the_kernel():
  """Without the run-time zero the XLA ops may fuse the decay into an FMA: the XLA ops run."""
  param = jnp.ones(SHAPE)
  tables = Tables({"mu": jnp.zeros(SHAPE), "nu": jnp.zeros(SHAPE)}, param=param)
  hyper = hyperparams_of(adam_coefficients(1e-2, 0.9, 0.999, 1e-8, 0.1))
  rows, values = jnp.array([1, 2], jnp.int32), jnp.ones((2, SHAPE[1]))
  plan = StepPlan(RowLayout(SHAPE[:1], SHAPE[1:]), AdamRule(), StepConfig(weight_decay="decoupled"))
  step = jnp.array(1, jnp.int32)
  with_zero = StepInputs(rows, values, tables, step, hyper, jnp.zeros((), jnp.int32))
  assert kernels.step_applies(with_zero, plan)
  assert not kernels.step_applies(with_zero._replace(opaque_zero=None), plan)


def test_entry_steps_kernel_counts_as_the_xla_gather():
  """Per-row steps: each entry's row count after the step as the XLA path gathers and
  increments it: a row out of range counts from 0, a negative row from the end (a jnp
  gather's rule), a count at the int32 maximum stays there; that count as a float32; and
  the rows' counts with the new ones stored, a repeated row's once."""
  top = np.iinfo(np.int32).max
  row_step = jnp.array([0, 3, top, -5, 7], jnp.int32)
  rows = jnp.array([1, 1, 2, 3, 5, -1, -9, 0, 4], jnp.int32)
  out_types = (
    jax.ShapeDtypeStruct(rows.shape, jnp.int32),
    jax.ShapeDtypeStruct(rows.shape, jnp.float32),
    jax.ShapeDtypeStruct(row_step.shape, jnp.int32),
  )
  call = jax.ffi.ffi_call(ENTRY_STEPS_KERNEL, out_types, input_output_aliases={1: 2})
  steps, counts, stored = jax.jit(call)(rows, row_step)
  expected = optax.safe_increment(row_step.at[rows].get(mode="fill", fill_value=0))
  np.testing.assert_array_equal(steps, expected)
  np.testing.assert_array_equal(steps, [4, 4, top, -4, 1, 8, 1, 1, 8])
  np.testing.assert_array_equal(counts, np.maximum(np.asarray(expected), 1).astype(np.float32))
  wrapped = jnp.where(rows < 0, rows + 5, rows)
  dropped = jnp.where((wrapped >= 0) & (wrapped < 5), wrapped, 5)
  np.testing.assert_array_equal(stored, row_step.at[dropped].set(expected, mode="drop"))
  np.testing.assert_array_equal(stored, [1, 4, top, -4, 8])
