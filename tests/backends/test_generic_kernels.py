"""The generic CPU kernels (`row_gather.cc`, `row_store.cc`): every rule, in the XLA ops' bits.

Any rule runs on the CPU as: the rows coalesced and every table's rows gathered
by one generic kernel, the rule's own math traced by XLA, the rows stored in
place by the generic store. Checked here with the hand-fused kernels switched
off (the private `GENERIC_KERNELS` path; FTRL there runs the row program:
`test_row_program.py`) against the XLA ops (`GENERIC_XLA`), in every bit,
over several jitted, donated steps with repeated and padding rows: SGD with
and without momentum, Adagrad, row-wise Adagrad, FTRL, Adam's options and a
rule written in a test file; the coalescing and gathering kernel
alone against `coalesce.coalesce_and_gather_rows` for tables of every dtype;
and that the compiled step runs the generic kernels with no table-sized
temporary or copy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks._user_rule import UserHyper, UserRowwiseAdagrad
from optax_sparse_adam._backends import choice
from optax_sparse_adam._backends.cpu import kernels
from optax_sparse_adam._core import coalesce
from tests._helpers import BACKEND, train_step
from tests.backends.test_memory import DIM, NUM_ROWS, _grad, _table_copies
from tests.backends.test_row_store import _bits

pytestmark = pytest.mark.skipif(
  BACKEND != "cpu" or not kernels.available(), reason="the CPU kernels run on the CPU only"
)

OPTS = {
  "sgd": lambda: osa.sparse_sgd(0.1),
  "sgd_momentum": lambda: osa.sparse_sgd(0.1, momentum=0.9, nesterov=True, catch_up_idle_rows=True),
  "adagrad": lambda: osa.sparse_adagrad(0.1),
  "rowwise_adagrad_max_norm": lambda: osa.sparse_rowwise_adagrad(
    0.1, weight_decay=0.01, weight_decay_mode="decoupled", max_norm=1.0
  ),
  "ftrl": lambda: osa.sparse_ftrl(0.2, l1_regularization_strength=0.05),
  "user_rule": lambda: osa.sparse_rule_transformation(UserRowwiseAdagrad(), UserHyper(0.1)),
  "adam": lambda: osa.sparse_adam(1e-2),
  "adam_amsgrad_l2": lambda: osa.sparse_adam(1e-2, amsgrad=True, weight_decay=0.01),
  "adamw_per_row": lambda: osa.sparse_adamw(1e-2, per_row_bias_correction=True),
  "adam_catch_up": lambda: osa.sparse_adam(1e-2, catch_up_idle_rows=True),
  "adam_bf16_stochastic": lambda: osa.sparse_adam(
    1e-2, mu_dtype="bfloat16", nu_dtype="bfloat16", moment_rounding="stochastic"
  ),
  "rowwise_adam": lambda: osa.sparse_adam(1e-2, rowwise_second_moment=True, maximize=True),
}
# The default tier runs one of each kind of table; the rest are in the slow tier.
_SLOW = {"sgd", "adagrad", "adam", "adam_amsgrad_l2", "rowwise_adam", "user_rule"}
CASES = [
  pytest.param(name, marks=[pytest.mark.slow] if name in _SLOW else [], id=name)
  for name in sorted(OPTS)
]
ROWS, WIDTH = 50, 6


def _batches(rng):
  batches = []
  for _ in range(3):
    ids = rng.integers(0, ROWS, 12).astype(np.int32)
    ids[:3] = ids[3]  # repeated rows
    ids[-1] = -1  # padding
    values = rng.standard_normal((12, WIDTH)).astype(np.float32)
    values[4, 0] = -0.0
    batches.append((ids, values))
  return batches


@pytest.mark.parametrize("name", CASES)
def test_every_rule_on_the_generic_kernels_equals_the_xla_ops_bit_for_bit(name):
  opt = OPTS[name]()
  rng = np.random.default_rng(5)
  table0 = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
  batches = _batches(rng)
  runs = {}
  for path in (choice.GENERIC_KERNELS, choice.GENERIC_XLA):
    params = {"t": jnp.asarray(table0)}
    state = opt.init(params)
    step = jax.jit(train_step(opt), donate_argnums=(0, 1))
    with choice.choose(forced=path):
      for ids, vals in batches:
        grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=(ROWS, WIDTH))
        params, state = step(params, state, {"t": grad})
    runs[path] = (params, state)
  generic, reference = runs[choice.GENERIC_KERNELS], runs[choice.GENERIC_XLA]
  for leaf, xla_leaf in zip(jax.tree.leaves(generic), jax.tree.leaves(reference), strict=True):
    np.testing.assert_array_equal(_bits(leaf), _bits(xla_leaf))
  assert not np.array_equal(np.asarray(generic[0]["t"]), table0)


def _coalesce_cases(values_dtype):
  rng = np.random.default_rng(1)
  nse = 20
  rows = rng.integers(0, ROWS, nse).astype(np.int32)
  rows[1:4] = rows[0]
  rows[-3:] = ROWS  # padding, as `bcoo.linear_rows` writes it
  # 19 values a row: the kernel sums a block of 16 values, then one at a time.
  width = 19
  scale = np.resize([1, 1e3, 1e-3, 1, 1e-6, 3e4], width)
  values = rng.standard_normal((nse, width)).astype(np.float32) * scale
  values = np.clip(values, -6e4, 6e4)
  values[1] = -0.0  # -0.0 + ...: a sum from -0.0 (a row of -0.0s alone stays -0.0)
  values[5, 2] = values[2, 17] = np.nan
  tables = [
    jnp.asarray(rng.standard_normal((ROWS, width)), dtype)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
  ]
  tables += [jnp.arange(ROWS, dtype=jnp.float32) + 0.5, jnp.arange(ROWS, dtype=jnp.int32)]
  return jnp.asarray(rows), jnp.asarray(values, values_dtype), tables


@pytest.mark.parametrize("values_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_coalescing_and_gathering_equals_the_xla_ops(use_jit, values_dtype):
  # Every add is rounded to the values' dtype (16-bit sums round after each add, as XLA's;
  # float16's with F16C's conversions for 16 values, then the portable ones for the tail).
  rows, values, tables = _coalesce_cases(values_dtype)

  def run(coalescer):
    def f(rows, values, tables):
      coalesced, gathered, _ = coalescer(rows, values, ROWS, tables[:2], tables[2:])
      return coalesced, gathered

    return (jax.jit(f) if use_jit else f)(rows, values, tables)

  ours = run(kernels.coalesce_and_gather)
  reference = run(coalesce.coalesce_and_gather_rows_unmarked)
  for leaf, xla_leaf in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
    assert leaf.dtype == xla_leaf.dtype and leaf.shape == xla_leaf.shape
    np.testing.assert_array_equal(_bits(leaf), _bits(xla_leaf))


@pytest.mark.parametrize(
  "name",
  [
    "ftrl",
    pytest.param("adam_catch_up", marks=pytest.mark.slow),
    pytest.param("rowwise_adagrad_max_norm", marks=pytest.mark.slow),
  ],
)
def test_the_compiled_generic_step_runs_the_kernels_with_no_table_copy(name):
  opt = OPTS[name]()
  params = {"t": jnp.zeros((NUM_ROWS, DIM))}
  grads = {"t": _grad((NUM_ROWS, DIM), 1, np.random.default_rng(0))}
  # FTRL runs the row program by default (test_row_program.py); here, the gather path.
  with choice.choose(forced=choice.GENERIC_KERNELS, row_program=False):
    jitted = jax.jit(train_step(opt), donate_argnums=(0, 1))
    hlo = jitted.lower(params, opt.init(params), grads).compile().as_text()
  assert _table_copies(hlo) == []
  assert "optax_sparse_adam_coalesce_gather" in hlo
  assert "optax_sparse_adam_store_rows" in hlo
  assert " gather(" not in hlo and " scatter(" not in hlo  # no XLA gather or scatter is left
