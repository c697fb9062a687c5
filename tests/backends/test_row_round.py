"""The 16-bit row kernels (`row_round.cc`) against the XLA ops, in every bit.

`row_round.add_rounded_rows` (a step's rows `round(table[rows] + delta)`, to
nearest or stochastically) against `rounding.param_store` on XLA's gathered
rows; `row_round.add_rows_in_place` (the apply `table[rows] += values`) against
`xla.scatter_add`; bfloat16 and float16 tables, jitted and eager, with padding,
repeated rows, NaN, inf, -0.0, float16 subnormals and sums beyond float16's
range (saturated when rounded stochastically, inf to nearest).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import xla
from optax_sparse_adam._backends.cpu import kernels, row_round
from optax_sparse_adam._core import bcoo, rounding
from tests._helpers import BACKEND, tiered, train_step
from tests.backends.test_memory import DIM, NUM_ROWS, _compile, _grad, _table_copies
from tests.backends.test_row_store import _bits

pytestmark = pytest.mark.skipif(
  BACKEND != "cpu" or not kernels.available(), reason="the CPU kernels run on the CPU only"
)

ROWS, WIDTH = 40, 21  # a row of 21 values: vector blocks and a tail
DTYPES = [jnp.bfloat16, jnp.float16]
JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])


def _table(dtype):
  rng = np.random.default_rng(0)
  table = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
  table[1] = 65000.0  # float16: near its largest finite value
  table[2] = np.float32(3e-6)  # float16: subnormal
  table[3, :4] = [np.inf, -np.inf, np.nan, -0.0]
  return jnp.asarray(table, dtype)


def _delta(nse):
  rng = np.random.default_rng(1)
  delta = rng.standard_normal((nse, WIDTH)).astype(np.float32) * 1e-3
  delta[0, :3] = [100.0, -7e4, 1e5]  # overflows float16 (row 1 near 65504)
  delta[1, :3] = [1e-7, -3e-6, 2e-8]  # float16 subnormals
  delta[2, 5] = np.nan
  return jnp.asarray(delta)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@JIT
def test_add_rounded_rows_equals_the_xla_rounding(dtype, stochastic, use_jit):
  table = _table(dtype)
  rows = jnp.asarray([1, 2, 3, 7, 0, 39, ROWS, ROWS + 1], jnp.int32)  # distinct, then padding
  delta = _delta(rows.shape[0])
  step, offset = jnp.asarray(5, jnp.int32), jnp.asarray(3, jnp.int32)
  name = "stochastic" if stochastic else "nearest"

  def ours(table, rows, delta):
    keys = rounding.kernel_keys(step, rounding.PARAM_SLOT, offset)
    return row_round.add_rounded_rows(
      table, rows, delta, keys, num_rows=ROWS, stochastic=stochastic
    )

  def reference(table, rows, delta):
    old = bcoo.gather_rows(table, rows).astype(jnp.float32)
    store = rounding.param_store(name, dtype=dtype, step=step, rows=rows, row_offset=offset)
    rounded = store(old + delta) if stochastic else (old + delta).astype(dtype)
    return jnp.where((rows < ROWS)[:, None], rounded, jnp.zeros((), dtype))

  run = jax.jit if use_jit else (lambda f: f)
  got, want = run(ours)(table, rows, delta), run(reference)(table, rows, delta)
  assert got.dtype == want.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  if dtype == jnp.float16:  # 65000 + 1e5: saturated when rounded stochastically, else inf
    assert float(got[0, 2]) == (65504.0 if stochastic else np.inf)


@pytest.mark.parametrize("values_dtype", ["f32", "table"])
@pytest.mark.parametrize("rows_unique", [True, False], ids=["unique", "repeated"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@JIT
def test_add_rows_in_place_equals_the_xla_scatter_add(dtype, rows_unique, values_dtype, use_jit):
  table = _table(dtype)
  rows = [1, 2, 3, 7, 0, 39, ROWS, ROWS + 3]
  if not rows_unique:
    rows += [7, 2, ROWS, 7]  # repeated rows, added in input order
  rows = jnp.asarray(rows, jnp.int32)
  values = _delta(rows.shape[0])
  if values_dtype == "table":
    values = values.astype(dtype)
  layout = bcoo.RowLayout((ROWS,), (WIDTH,))

  def ours(table, rows, values):
    return row_round.add_rows_in_place(table, rows, values, num_rows=ROWS, rows_unique=rows_unique)

  def reference(table, rows, values):
    return xla.scatter_add(
      table, rows, values, layout=layout, rows_unique=rows_unique, rows_sorted=False
    )

  run = jax.jit if use_jit else (lambda f: f)
  want = run(reference)(table, rows, values)
  got = run(ours)(table, rows, values)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  assert not np.array_equal(_bits(got), _bits(table))


# Each dtype and rounding once in the default tier, and each 16-bit gradient rounded
# stochastically (the one-pass kernel); the others are slow.
@pytest.mark.parametrize(
  "dtype, param_rounding, grad_dtype",
  [
    (jnp.bfloat16, "stochastic", jnp.float32),
    (jnp.float16, "nearest", jnp.float32),
    (jnp.bfloat16, "stochastic", jnp.bfloat16),
    (jnp.float16, "stochastic", jnp.float16),
    pytest.param(jnp.bfloat16, "nearest", jnp.float32, marks=pytest.mark.slow),
    pytest.param(jnp.float16, "stochastic", jnp.float32, marks=pytest.mark.slow),
  ],
  ids=lambda x: jnp.dtype(x).name if not isinstance(x, str) else x,
)
def test_fused_steps_on_16_bit_tables_use_the_kernels_in_xla_bits(
  dtype, param_rounding, grad_dtype
):
  """Adam's fused kernel on a bf16/f16 table: the rows rounded in the kernel's own pass
  (stochastic: `fused_adam_rounded`, then stored by the row store; no second pass over
  the rows) or added in place by `add_rows_in_place` (nearest); three jitted, donated
  steps with repeated and padding rows, inf, NaN, -0.0, float16 subnormals and float16's
  largest value (a step up saturated when rounded stochastically) equal the XLA ops' bits,
  and the compiled step has no table-sized temporary or copy."""
  opt = osa.sparse_adam(
    1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.float32, param_rounding=param_rounding
  )
  table0 = np.asarray(np.random.default_rng(0).standard_normal((ROWS, WIDTH)), np.float32)
  table0[5] = 65504.0  # float16's largest finite value: a step up saturates (stochastic)
  table0[6] = np.float32(3e-6)  # float16: subnormal
  table0[8, :4] = [np.inf, -np.inf, np.nan, -0.0]
  rng = np.random.default_rng(4)
  grads = []
  for _ in range(3):
    ids = rng.integers(0, ROWS, 10).astype(np.int32)
    ids[:3] = ids[3]  # repeated rows
    ids[4:7] = [5, 6, 8]  # the special rows above
    ids[-1] = -1  # padding
    vals = jnp.asarray(rng.standard_normal((10, WIDTH)), grad_dtype)
    grads.append({"t": sparse.BCOO((vals, jnp.asarray(ids)[:, None]), shape=(ROWS, WIDTH))})
  runs = {}
  for on in (True, False):
    params = {"t": jnp.asarray(table0, dtype)}
    state = opt.init(params)
    step = jax.jit(train_step(opt), donate_argnums=(0, 1))
    with kernels.use_cpu_kernels(on):
      for grad in grads:
        params, state = step(params, state, grad)
    runs[on] = params["t"]
  np.testing.assert_array_equal(_bits(runs[True]), _bits(runs[False]))
  assert not np.array_equal(np.asarray(runs[True], np.float32), table0)

  params = {"t": jnp.zeros((NUM_ROWS, DIM), dtype)}
  hlo = _compile(opt, params, {"t": _grad((NUM_ROWS, DIM), 1, rng)}).as_text()
  assert _table_copies(hlo) == []
  if param_rounding == "stochastic":  # one pass rounds the rows, the apply stores them
    assert "optax_sparse_adam_fused_adam_rounded_f32" in hlo
    assert "optax_sparse_adam_store_rows" in hlo
    assert "optax_sparse_adam_add_rounded_rows" not in hlo
  else:
    assert "optax_sparse_adam_add_rows_in_place" in hlo


BF16_GRAD_OPTS = {
  "adam": lambda: osa.sparse_adam(1e-2),
  "adam_amsgrad_l2_maximize": lambda: osa.sparse_adam(
    1e-2, amsgrad=True, weight_decay=0.01, maximize=True
  ),
  "rowwise_adam_bf16_stochastic": lambda: osa.sparse_adam(
    1e-2, rowwise_second_moment=True, mu_dtype="bfloat16", moment_rounding="stochastic"
  ),
  "sgd_momentum": lambda: osa.sparse_sgd(0.1, momentum=0.9, lazy_momentum=True),
  "rowwise_adagrad_max_norm": lambda: osa.sparse_rowwise_adagrad(0.1, max_norm=1.0),
}


# Adam's and SGD's kernels in the default tier; the other cells are slow.
_BF16_GRAD_FAST = {("adam", "f32"), ("sgd_momentum", "bf16"), ("rowwise_adagrad_max_norm", "bf16")}


@pytest.mark.parametrize(
  "name, table_dtype",
  [
    pytest.param(
      name,
      dtype,
      id=f"{name}-{label}",
      marks=[] if (name, label) in _BF16_GRAD_FAST else [pytest.mark.slow],
    )
    for name in sorted(BF16_GRAD_OPTS)
    for label, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16))
  ],
)
def test_a_bfloat16_gradient_takes_the_fused_kernel_in_xla_bits(name, table_dtype):
  """The fused kernels sum a bf16 gradient's rows rounding every add, as XLA does: three
  jitted, donated steps (repeated and padding rows, -0.0) equal the XLA ops' bits, and
  the step runs the rule's fused kernel, not the generic coalescing (but for a kernel that
  reads a 16-bit parameter)."""
  opt = BF16_GRAD_OPTS[name]()
  table0 = np.asarray(np.random.default_rng(0).standard_normal((ROWS, WIDTH)), np.float32)
  rng = np.random.default_rng(5)
  grads = []
  for _ in range(3):
    ids = rng.integers(0, ROWS, 10).astype(np.int32)
    ids[:4] = ids[4]  # repeated rows: their bf16 sum is rounded at every add
    ids[-1] = -1  # padding
    vals = rng.standard_normal((10, WIDTH)).astype(np.float32) * 30
    vals[0] = -0.0
    vals[1, :3] = [np.nan, np.inf, -np.inf]  # summed into a repeated row's NaN and infs
    vals[7, 8:11] = [-np.nan, np.inf, -0.0]  # a row's first (likely only) entry
    vals = jnp.asarray(vals, jnp.bfloat16)
    grads.append({"t": sparse.BCOO((vals, jnp.asarray(ids)[:, None]), shape=(ROWS, WIDTH))})
  runs = {}
  for on in (True, False):
    params = {"t": jnp.asarray(table0, table_dtype)}
    state = opt.init(params)
    step = jax.jit(train_step(opt), donate_argnums=(0, 1))
    with kernels.use_cpu_kernels(on):
      if on:
        hlo = step.lower(params, state, grads[0]).compile().as_text()
        # The kernels read a float32 parameter only (weight decay, max_norm).
        reads_param = name in ("adam_amsgrad_l2_maximize", "rowwise_adagrad_max_norm")
        fused = table_dtype == jnp.float32 or not reads_param
        assert ("optax_sparse_adam_coalesce_gather" not in hlo) == fused
      for grad in grads:
        params, state = step(params, state, grad)
    runs[on] = (params, state)
  for ours, theirs in zip(jax.tree.leaves(runs[True]), jax.tree.leaves(runs[False]), strict=True):
    np.testing.assert_array_equal(_bits(ours), _bits(theirs))


F16_GRAD_OPTS = {
  "adam": lambda rounding: osa.sparse_adam(
    1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.float32, param_rounding=rounding
  ),
  "sgd": lambda rounding: osa.sparse_sgd(0.1, param_rounding=rounding),
  "ftrl": lambda rounding: osa.sparse_ftrl(0.1, param_rounding=rounding),
}


def _f16_grads(rng: np.random.Generator, steps: int) -> list:
  """float16 gradients with a row repeated five times (its sum rounded at every add, some
  adds inexact), padding, -0.0 and float16 subnormals."""
  grads = []
  for _ in range(steps):
    ids = rng.integers(0, ROWS, 12).astype(np.int32)
    ids[:5] = ids[5]
    ids[-1] = -1
    vals = rng.standard_normal((12, WIDTH)).astype(np.float32) * 30
    vals[1] *= 1e-3  # added to the others' sums: their low bits are rounded away
    vals[0] = -0.0
    vals[2, :4] = [3e-6, -4e-7, 6e-8, 1e-5]  # subnormal in float16
    vals = jnp.asarray(vals, jnp.float16)
    grads.append({"t": sparse.BCOO((vals, jnp.asarray(ids)[:, None]), shape=(ROWS, WIDTH))})
  return grads


# Jitted, each rule and rounding in the default tier; eager, one cell (the rest slow).
@pytest.mark.parametrize(
  "name, param_rounding, use_jit",
  tiered(
    [
      (name, rounding, use_jit)
      for use_jit in (True, False)
      for name in sorted(F16_GRAD_OPTS)
      for rounding in ("nearest", "stochastic")
    ],
    slow=lambda c: (
      (not c[2] and c[:2] != ("adam", "stochastic"))
      or c in (("sgd", "nearest", True), ("ftrl", "nearest", True))
    ),
  ),
)
def test_a_float16_gradient_on_a_float16_table_runs_the_kernels_in_xla_bits(
  name, param_rounding, use_jit
):
  """The kernels sum a float16 gradient's rows rounding every add to float16, as XLA's
  scatter-add does: Adam's fused kernel (float32 moments; SGD and FTRL: the generic
  coalescing kernel, or the row program that coalesces in its pass) on a
  float16 table, to nearest and stochastically; two steps (repeated and padding rows, -0.0,
  subnormals; one step eagerly) equal the XLA ops' bits, jitted (donated) and eagerly, and
  the jitted step runs the rule's kernel (no XLA coalescing)."""
  opt = F16_GRAD_OPTS[name](param_rounding)
  table0 = np.asarray(np.random.default_rng(0).standard_normal((ROWS, WIDTH)), np.float32)
  grads = _f16_grads(np.random.default_rng(6), 2 if use_jit else 1)  # eager: op by op, slow
  runs = {}
  for on in (True, False):
    params = {"t": jnp.asarray(table0, jnp.float16)}
    state = opt.init(params)
    step = train_step(opt)
    if use_jit:
      step = jax.jit(step, donate_argnums=(0, 1))
    with kernels.use_cpu_kernels(on):
      if on and use_jit:
        hlo = step.lower(params, state, grads[0]).compile().as_text()
        fused = name == "adam"  # SGD (no slot) and FTRL: the generic coalescing
        generic = ("optax_sparse_adam_coalesce_gather", "optax_sparse_adam_row_program")
        assert any(target in hlo for target in generic) == (not fused)
        assert "custom-call" in hlo and " sort(" not in hlo
      for grad in grads:
        params, state = step(params, state, grad)
    runs[on] = (params, state)
  for ours, theirs in zip(jax.tree.leaves(runs[True]), jax.tree.leaves(runs[False]), strict=True):
    np.testing.assert_array_equal(_bits(ours), _bits(theirs))
  assert not np.array_equal(np.asarray(runs[True][0]["t"], np.float32), table0)


RULE_OPTS = {
  "sgd_momentum": lambda: osa.sparse_sgd(
    0.1, momentum=0.9, lazy_momentum=True, param_rounding="stochastic"
  ),
  "sgd_nesterov_maximize": lambda: osa.sparse_sgd(
    0.1,
    momentum=0.9,
    nesterov=True,
    lazy_momentum=True,
    maximize=True,
    param_rounding="stochastic",
  ),
  "adagrad": lambda: osa.sparse_adagrad(0.1, lr_decay=0.01, param_rounding="stochastic"),
  "rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(0.1, param_rounding="stochastic"),
}


def _special_table() -> np.ndarray:
  """A table with float16's largest value (a step up saturates), float16 subnormals,
  inf, NaN and -0.0."""
  table = np.asarray(np.random.default_rng(0).standard_normal((ROWS, WIDTH)), np.float32)
  table[5] = 65504.0
  table[6] = np.float32(3e-6)
  table[8, :4] = [np.inf, -np.inf, np.nan, -0.0]
  return table


def _rule_grads(grad_dtype, steps: int = 3) -> list:
  """Gradients with repeated rows, padding, the special rows of `_special_table`, -0.0 and
  float16 subnormals (small deltas to float16 subnormal rows), in `grad_dtype`."""
  rng = np.random.default_rng(7)
  grads = []
  for _ in range(steps):
    ids = rng.integers(0, ROWS, 12).astype(np.int32)
    ids[:3] = ids[3]  # repeated rows
    ids[4:7] = [5, 6, 8]  # the special rows
    ids[-1] = -1  # padding
    vals = rng.standard_normal((12, WIDTH)).astype(np.float32)
    vals[5] *= 1e-4  # the subnormal row's delta stays small
    vals[7, :2] = [-0.0, 3e-6]
    vals = jnp.asarray(vals, grad_dtype)
    grads.append({"t": sparse.BCOO((vals, jnp.asarray(ids)[:, None]), shape=(ROWS, WIDTH))})
  return grads


def _cells(names, fast) -> list:
  """Each optimizer of `names` on bf16 and f16 tables with a float32 gradient and one in the
  table's dtype; the cells of `fast` in the default tier, the others slow."""
  return [
    pytest.param(
      name,
      dtype,
      grad,
      id=f"{name}-{dtype}-{grad}",
      marks=[] if (name, dtype, grad) in fast else [pytest.mark.slow],
    )
    for name in sorted(names)
    for dtype in ("bfloat16", "float16")
    for grad in ("float32", dtype)
  ]


def _stepped(opt, init, dtype, grads, kernels_on: bool) -> tuple:
  """`(params, state)` after jitted, donated steps of `opt` on `_special_table()` in `dtype`."""
  params = {"t": jnp.asarray(_special_table(), dtype)}
  state = init(opt, params)
  step = jax.jit(train_step(opt), donate_argnums=(0, 1))
  with kernels.use_cpu_kernels(kernels_on):
    for grad in grads:
      params, state = step(params, state, grad)
  return params, state


def _assert_same_bits(a, b) -> None:
  for ours, theirs in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(_bits(ours), _bits(theirs))


# Two cells in the default tier (a slot row and a row-wise slot; each table dtype, a
# 16-bit gradient: the epilogue is every rule's); the other combinations are slow.
_RULE_FAST = {
  ("sgd_nesterov_maximize", "float16", "float16"),
  ("rowwise_adagrad", "bfloat16", "bfloat16"),
}


def _rule_state(opt, params):
  """`opt.init(params)`, a float16 table's slot in float32: the factories keep it in the
  table's dtype, which no fused kernel stores (they store float32 or bfloat16 slots)."""
  state = opt.init(params)
  return jax.tree.map(
    lambda x: x.astype(jnp.float32) if x.dtype == jnp.dtype(jnp.float16) else x, state
  )


@pytest.mark.parametrize("name, dtype, grad_dtype", _cells(RULE_OPTS, _RULE_FAST))
def test_rule_kernels_round_16_bit_rows_in_their_pass_in_xla_bits(name, dtype, grad_dtype):
  """The rule kernels (SGD with momentum, Nesterov, Adagrad, row-wise Adagrad) round a
  bf16/f16 table's rows stochastically in their own pass (`RoundedRows`): three jitted,
  donated steps with repeated and padding rows, inf, NaN, -0.0, float16 subnormals and
  float16's largest value equal the XLA ops' bits, and the compiled step calls the rule
  kernel and the row store, with no `add_rounded_rows` and no table copy."""
  opt = RULE_OPTS[name]()
  table0 = _special_table()
  grads = _rule_grads(grad_dtype)
  runs = {on: _stepped(opt, _rule_state, dtype, grads, on) for on in (True, False)}
  _assert_same_bits(runs[True], runs[False])
  table = np.asarray(runs[True][0]["t"], np.float32)
  assert not np.array_equal(table, table0)
  if dtype == "float16":  # float16's largest value: never rounded into inf
    assert np.isfinite(table[5]).all()

  # The compiled step of a V-row table: the rule kernel rounds, the row store stores.
  params = {"t": jnp.zeros((NUM_ROWS, DIM), dtype)}
  grad = {"t": _grad((NUM_ROWS, DIM), 1, np.random.default_rng(8), dtype=grad_dtype)}
  step = jax.jit(train_step(opt), donate_argnums=(0, 1))
  hlo = step.lower(params, _rule_state(opt, params), grad).compile().as_text()
  assert "optax_sparse_adam_rule_step_f32" in hlo
  assert "optax_sparse_adam_store_rows" in hlo
  assert "optax_sparse_adam_add_rounded_rows" not in hlo
  assert _table_copies(hlo) == []


ADAM_OPTION_OPTS = {
  "adam_amsgrad_per_row": lambda: osa.sparse_adam(
    1e-2,
    amsgrad=True,
    per_row_bias_correction=True,
    mu_dtype=jnp.float32,
    nu_dtype=jnp.float32,
    param_rounding="stochastic",
  ),
  "adam_catch_up_bf16_moments": lambda: osa.sparse_adam(
    1e-2,
    catch_up_idle_rows=True,
    mu_dtype=jnp.bfloat16,
    nu_dtype=jnp.bfloat16,
    moment_rounding="stochastic",
    param_rounding="stochastic",
  ),
  "rowwise_adam_amsgrad_maximize": lambda: osa.sparse_adam(
    1e-2,
    rowwise_second_moment=True,
    amsgrad=True,
    maximize=True,
    mu_dtype=jnp.float32,
    nu_dtype=jnp.float32,
    param_rounding="stochastic",
  ),
}
_OPTION_TARGETS = {
  "adam_amsgrad_per_row": "optax_sparse_adam_fused_adam_options_f32",
  "adam_catch_up_bf16_moments": "optax_sparse_adam_fused_adam_options_f32",
  "rowwise_adam_amsgrad_maximize": "optax_sparse_adam_fused_rowwise_adam_f32",
}
# One cell in the default tier (`RunOptionStep`, which Adam's option kernel shares); the
# other combinations are slow.
_OPTION_FAST = {("rowwise_adam_amsgrad_maximize", "bfloat16", "bfloat16")}


@pytest.mark.parametrize("name, dtype, grad_dtype", _cells(ADAM_OPTION_OPTS, _OPTION_FAST))
def test_adam_option_kernels_round_16_bit_rows_in_their_pass(name, dtype, grad_dtype, monkeypatch):
  """Adam's option kernel (amsgrad, per-row steps, catch-up) and row-wise Adam round a
  bf16/f16 table's rows stochastically in their own pass (`RoundedRows`, the rule kernels'
  epilogue): three jitted, donated steps (repeated and padding rows, inf, NaN, -0.0,
  float16 subnormals and largest value) equal the two-pass path's bits (the kernel's
  delta, then `add_rounded_rows`) and, but with catch-up (float32 rounding there: the C
  library's exp), the XLA ops' bits; the compiled step has no `add_rounded_rows`."""
  opt = ADAM_OPTION_OPTS[name]()
  table0 = _special_table()
  grads = _rule_grads(grad_dtype)

  def run(on: bool) -> tuple:
    return _stepped(opt, lambda o, params: o.init(params), dtype, grads, on)

  one_pass = run(True)
  if "catch_up" not in name:
    _assert_same_bits(one_pass, run(False))
  params = {"t": jnp.zeros((NUM_ROWS, DIM), dtype)}
  grad = {"t": _grad((NUM_ROWS, DIM), 1, np.random.default_rng(8), dtype=grad_dtype)}
  hlo = _compile(opt, params, grad).as_text()
  assert _OPTION_TARGETS[name] in hlo
  assert "optax_sparse_adam_add_rounded_rows" not in hlo
  assert _table_copies(hlo) == []
  with monkeypatch.context() as patch:  # the former path: the kernel, then a second pass
    patch.setattr(kernels, "rounds_in_pass", lambda inputs, plan: False)
    assert "optax_sparse_adam_add_rounded_rows" in _compile(opt, params, grad).as_text()
    _assert_same_bits(one_pass, run(True))
  assert not np.array_equal(np.asarray(one_pass[0]["t"], np.float32), table0)
