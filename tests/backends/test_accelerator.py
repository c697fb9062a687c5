"""The accelerator rows step (GPU/TPU), checked on the machine at hand.

The step is forced onto this backend with the private, trace-visible switch
`choice.choose(forced=...)` and compared with the paths this backend runs by
default. Bit for bit on the CPU (each row's duplicates are summed in input
order on both); on a GPU a scatter-add may add a row's duplicates in another
order, so there the comparison allows a few ulp. Then the compiled and lowered
programs: no while loop, no table-sized temporary, and, lowered for CUDA and
TPU from this machine, no CPU custom call and each table written exactly once.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from tests._helpers import (
  assert_paths_agree,
  dense_table_temporaries,
  table_shaped_values,
  tiered,
  train_step,
)

# name: (parameter shape, n_sparse)
LAYOUTS = {
  "embedding": ((50, 8), 1),
  "n_dense_0": ((60,), 1),
  "n_dense_2": ((20, 3, 5), 1),
  "n_sparse_2": ((20, 3, 5), 2),
  "n_sparse_2_n_dense_0": ((9, 7), 2),
}

OPTIONS = {
  "default": dict(learning_rate=1e-2),
  "amsgrad_l2_per_row": dict(
    learning_rate=1e-2, amsgrad=True, weight_decay=0.1, per_row_bias_correction=True
  ),
  "decoupled_maximize": dict(learning_rate=3e-2, weight_decay=0.05, maximize=True),
  "bf16_moments": dict(learning_rate=1e-2, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
}


def _batches(shape, n_sparse, rng, *, dtype=np.float32, steps=3, nse=40):
  """Batches with a row repeated six times, padding (negative and past the end), -0.0."""
  out = []
  for _ in range(steps):
    idx = np.stack([rng.integers(0, shape[k], nse) for k in range(n_sparse)], 1)
    idx[1:6] = idx[0]
    idx[-3, 0] = -1
    idx[-2, -1] = shape[n_sparse - 1] + 2
    idx[-1] = idx[-4]
    val = rng.standard_normal((nse,) + shape[n_sparse:]).astype(np.float32)
    val.reshape(-1)[0] = -0.0
    out.append((idx.astype(np.int32), val.astype(dtype)))
  return out


def _train(opt, shape, batches, *, use_jit, forced, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal(shape), dtype)}
  state = opt.init(params)

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state, updates

  if use_jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  updates = []
  with choice.choose(forced=forced):
    for idx, val in batches:
      grads = {"w": sparse.BCOO((jnp.asarray(val), jnp.asarray(idx)), shape=shape)}
      params, state, update = step(params, state, grads)
      updates.append((update["w"].data, update["w"].indices))
  return params, state, updates


CASES = [(layout, option, True) for layout in LAYOUTS for option in OPTIONS]
CASES += [("embedding", option, False) for option in OPTIONS]  # eager: op by op


@pytest.mark.parametrize(
  ("layout", "option", "use_jit"),
  # Every option on the embedding; on every other layout the option that indexes by
  # layout (per-row bias correction, with AMSGrad and L2 over the default's arithmetic);
  # the other crossings and the eager options: slow tier.
  tiered(
    CASES,
    lambda case: (
      (case[1] != "default" and not case[2])
      or (case[0] != "embedding" and case[1] != "amsgrad_l2_per_row")
    ),
  ),
  ids=[f"{layout}-{option}-{jit}" for layout, option, jit in CASES],
)
def test_accelerator_step_equals_the_default_and_generic_paths(layout, option, use_jit):
  """Bit for bit on the CPU, against the CPU kernels where they apply and the generic XLA ops."""
  shape, n_sparse = LAYOUTS[layout]
  batches = _batches(shape, n_sparse, np.random.default_rng(1))
  kwargs = dict(OPTIONS[option])
  if n_sparse > 1:  # per-row bias correction counts steps of the leading dim's rows only
    kwargs.pop("per_row_bias_correction", None)
  make = osa.sparse_adamw if option == "decoupled_maximize" else osa.sparse_adam
  runs = {
    forced: _train(make(**kwargs), shape, batches, use_jit=use_jit, forced=forced)
    for forced in (None, choice.ACCELERATOR, choice.GENERIC_XLA)
  }
  assert_paths_agree(runs[choice.ACCELERATOR], runs[None])
  assert_paths_agree(runs[choice.ACCELERATOR], runs[choice.GENERIC_XLA])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_accelerator_step_with_low_precision_params_and_f32_moments(dtype):
  shape, n_sparse = LAYOUTS["embedding"]
  batches = _batches(shape, n_sparse, np.random.default_rng(2), dtype=dtype)
  opt = osa.sparse_adam(1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  runs = [
    _train(opt, shape, batches, use_jit=True, forced=forced, dtype=dtype)
    for forced in (None, choice.ACCELERATOR)
  ]
  assert_paths_agree(runs[0], runs[1])


def _update(idx, val, shape):
  return sparse.BCOO((jnp.asarray(val), jnp.asarray(idx)), shape=shape)


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_accelerator_apply_updates(use_jit):
  """Unique or repeated rows, in input order: as the generic path and a float64 reference."""
  rng = np.random.default_rng(3)
  param = jnp.asarray(rng.standard_normal((30, 6)), jnp.float32)
  apply = jax.jit(osa.apply_updates) if use_jit else osa.apply_updates
  val = (rng.standard_normal((8, 6)) * 10.0 ** rng.integers(-3, 3, (8, 1))).astype(np.float32)

  unique = _update(np.array([[2], [7], [11], [29], [30], [-1], [0], [5]], np.int32), val, (30, 6))
  repeated = _update(np.array([[7], [2], [7], [29], [-1], [30], [2], [7]], np.int32), val, (30, 6))
  for update in (unique, repeated):
    with choice.choose(forced=choice.ACCELERATOR):
      on_accelerator = apply(param, update)
    with choice.choose(forced=choice.GENERIC_XLA):
      generic = apply(param, update)
    expected = np.asarray(param, np.float64).copy()
    for i, v in zip(np.asarray(update.indices)[:, 0], val, strict=True):
      if 0 <= i < 30:
        expected[i] += v
    np.testing.assert_allclose(on_accelerator, expected, rtol=1e-6, atol=1e-6)
    assert_paths_agree(on_accelerator, generic)


# The compiled program, forced onto this backend.

NUM_ROWS = 100_003  # a prime no other dimension uses: any array of this many rows is a table
DIM = 24
NSE = 64


def _grads(shape, n_sparse, rng):
  idx = np.stack([rng.integers(0, shape[k], NSE) for k in range(n_sparse)], 1)
  idx[:3] = idx[3]
  idx[-2:] = -1
  data = rng.standard_normal((NSE,) + shape[n_sparse:])
  return sparse.BCOO((jnp.asarray(data, jnp.float32), jnp.asarray(idx, jnp.int32)), shape=shape)


def _traced(opt, *, forced, options_rows=NUM_ROWS):
  params = {"w": jnp.zeros((options_rows, DIM), jnp.float32)}
  grads = {"w": _grads((options_rows, DIM), 1, np.random.default_rng(0))}
  jitted = jax.jit(train_step(opt), donate_argnums=(0, 1))
  with choice.choose(forced=forced):
    return jitted.trace(params, opt.init(params), grads), params


@pytest.mark.parametrize(
  "options",
  [{}, {"amsgrad": True, "weight_decay": 0.1, "per_row_bias_correction": True}],
  ids=["default", "amsgrad_l2_per_row"],
)
def test_compiled_accelerator_step_has_no_loop_and_no_table_sized_temporary(options):
  opt = osa.sparse_adam(1e-3, **options)
  traced, params = _traced(opt, forced=choice.ACCELERATOR)
  compiled = traced.lower().compile()
  text = compiled.as_text()
  assert not re.search(r"\bwhile\(", text), "a while loop in the accelerator step"
  num_tables = 3 + bool(options.get("amsgrad"))
  shape = f"f32[{NUM_ROWS},{DIM}]"
  assert dense_table_temporaries(compiled, shape, num_tables) == []
  writes = [v for v in table_shaped_values(text, shape) if v[1] == "scatter"]
  assert len(writes) == num_tables, writes  # each table written exactly once


def _walk(operation):
  for region in operation.regions:
    for block in region.blocks:
      for op in block.operations:
        yield op.operation
        yield from _walk(op.operation)


def _table_writes(lowered, shape: str) -> dict[str, int]:
  """The ops of a lowered module whose result has type `shape`, counted by op name.

  Control flow (`stablehlo.case`, `func.call`, returns) only passes tables on.
  """
  counts: dict[str, int] = {}
  for op in _walk(lowered.compiler_ir("stablehlo").operation):
    if any(str(result.type) == shape for result in op.results):
      counts[op.name] = counts.get(op.name, 0) + 1
  return counts


def _lowered(opt, platform, *, forced=None):
  traced, _ = _traced(opt, forced=forced, options_rows=NUM_ROWS)
  return traced.lower(lowering_platforms=(platform,))


CPU_KERNELS = ("optax_sparse_adam_fused_adam_f32", "optax_sparse_adam_scatter_add_rows_f32")


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize(
  "options",
  [{}, {"amsgrad": True}, {"weight_decay": 0.1, "per_row_bias_correction": True}],
  ids=["default", "amsgrad", "l2_per_row"],
)
def test_step_lowered_for_an_accelerator_is_the_accelerator_path(platform, options):
  """No while loop, no CPU custom call, and param, m, v (and nu_max) each written once."""
  lowered = _lowered(osa.sparse_adam(1e-3, **options), platform)
  text = lowered.as_text()
  assert "stablehlo.while" not in text
  assert not any(kernel in text for kernel in CPU_KERNELS)
  assert "stablehlo.custom_call" not in text
  writes = _table_writes(lowered, f"tensor<{NUM_ROWS}x{DIM}xf32>")
  num_tables = 3 + bool(options.get("amsgrad"))
  assert writes.get("stablehlo.scatter") == num_tables, writes
  assert set(writes) <= {"stablehlo.scatter", "stablehlo.case", "func.call"}, writes
  assert text.count('"stablehlo.sort"') == 1  # one sort of the ids


EVERY_RULE = {
  "sparse_adamw": lambda: osa.sparse_adamw(1e-3, weight_decay=1e-2),
  "catch_up": lambda: osa.sparse_adam(1e-3, catch_up_idle_rows=True),
  "rowwise_nu": lambda: osa.sparse_adam(1e-3, rowwise_second_moment=True),
  "bf16_stochastic": lambda: osa.sparse_adam(
    1e-3, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, moment_rounding="stochastic"
  ),
  "sgd_momentum": lambda: osa.sparse_sgd(1e-2, momentum=0.9, lazy_momentum=True),
  "adagrad": lambda: osa.sparse_adagrad(1e-2),
  "rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(1e-2),
}


@pytest.mark.parametrize("rule", list(EVERY_RULE))
def test_every_rule_lowered_for_cuda_writes_each_table_once(rule):
  """Every rule and option takes the accelerator path on a GPU: one sort, no loop, no
  custom call, and each of its tables (param and every table-shaped slot) written once."""
  opt = EVERY_RULE[rule]()
  lowered = _lowered(opt, "cuda")
  text = lowered.as_text()
  assert "stablehlo.while" not in text
  assert "stablehlo.custom_call" not in text
  assert text.count('"stablehlo.sort"') == 1
  params = {"w": jnp.zeros((NUM_ROWS, DIM), jnp.float32)}
  for dtype in (jnp.float32, jnp.bfloat16):
    tables = [
      x
      for x in jax.tree.leaves((params, opt.init(params)))
      if x.shape == (NUM_ROWS, DIM) and x.dtype == dtype
    ]
    shape = f"tensor<{NUM_ROWS}x{DIM}x{jnp.dtype(dtype).name.replace('float', 'f')}>"
    writes = _table_writes(lowered, shape)
    assert writes.get("stablehlo.scatter", 0) == len(tables), (dtype, writes)
    assert set(writes) <= {"stablehlo.scatter", "stablehlo.case", "func.call"}, writes


def test_the_lowering_check_can_fail():
  """The generic XLA path, lowered for CUDA, writes a fourth table (its slot marks in m)."""
  lowered = _lowered(osa.sparse_adam(1e-3), "cuda", forced=choice.GENERIC_XLA)
  writes = _table_writes(lowered, f"tensor<{NUM_ROWS}x{DIM}xf32>")
  assert writes.get("stablehlo.scatter") == 4, writes
