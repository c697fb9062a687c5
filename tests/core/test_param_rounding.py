"""Stochastic rounding of a bfloat16 or float16 table (`param_rounding="stochastic"`).

The stored rows are checked against a NumPy implementation of the documented
rounding (`_core/rounding.py`'s docstring: the hash at slot index -1, top half;
bf16 by adding the bits below the kept 16, f16 by 13 dropped bits or by whole
subnormal ulps) applied to the exact float32 row `w + delta`, which a float32
table's run gives. Every path (the fused CPU kernel then XLA's rounding, the
XLA ops with the CPU's row store, the accelerator step forced onto the CPU)
stores the same bits; the rounding is unbiased (binomial bounds of 5.5 sigma on
a fixed-seed hash: deterministic, it cannot flake); a float32 table's program
is unchanged.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._core import rounding
from tests._helpers import STEP_PATHS, dense_table_temporaries, fmix32, on_path, train_step
from tests.backends.test_accelerator import _walk

PATHS = STEP_PATHS
NARROW = [jnp.bfloat16, jnp.float16]


def _numpy_param_bits(step, rows, row_size):
  """The parameter's documented bits: slot index -1 (salt 0), the hash's top half."""
  with np.errstate(over="ignore"):
    a = fmix32(np.array([(step * 0x9E3779B9) & 0xFFFFFFFF], np.uint32))
    b = fmix32(a ^ (np.asarray(rows, np.uint32) * np.uint32(0x85EBCA77)))
    j = np.arange(row_size, dtype=np.uint32) * np.uint32(0xC2B2AE3D)
    return fmix32(b[:, None] ^ j[None, :]) >> np.uint32(16)


def _numpy_round(x, u, dtype):
  """The documented rounding of float32 `x` with 16-bit integers `u`, in NumPy, as float32."""
  x = np.asarray(x, np.float32)
  u = np.asarray(u, np.uint32)
  out = np.empty_like(x)
  big = np.float32(ml_dtypes.finfo(dtype).max)
  for i, (xi, ui) in enumerate(zip(x.reshape(-1), u.reshape(-1), strict=True)):
    if not np.isfinite(xi):
      out.reshape(-1)[i] = np.float32(xi.astype(dtype))
      continue
    mag = np.abs(xi)
    word = int(mag.view(np.uint32))
    if dtype == jnp.bfloat16:
      r = np.uint32(((word + int(ui)) >> 16) << 16).view(np.float32)
    elif mag >= np.float32(2.0**-14):
      r = np.uint32((word + (int(ui) >> 3)) & 0xFFFFE000).view(np.float32)
    else:
      a = float(mag) * 2.0**24  # exact: float32 has room
      k = np.floor(a)
      up = int((a - k) * 65536) + int(ui) >= 65536
      r = np.float32((k + up) * 2.0**-24)
    r = min(np.float32(r), big)
    out.reshape(-1)[i] = np.copysign(r, xi)
  return out


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("dtype", NARROW)
def test_the_rounding_follows_the_documented_formula(dtype):
  """Every branch (bf16; f16 normal, subnormal, saturated; NaN, inf, -0.0) against NumPy."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(4096) * 2.0 ** rng.integers(-30, 18, 4096)).astype(np.float32)
  x[:8] = [-0.0, np.inf, -np.inf, np.nan, 70000.0, -65519.0, 3e38, 2.0**-25]
  u = rng.integers(0, 2**16, 4096).astype(np.uint32)
  got = rounding.stochastic_round(jnp.asarray(x), jnp.asarray(u), dtype)
  assert got.dtype == dtype
  want = _numpy_round(x, u, dtype).astype(dtype)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  finite = np.isfinite(x)
  assert np.all(np.isfinite(np.asarray(got, np.float32)[finite]))  # saturated, never inf


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("value", [1.0, 2.0**-20, -3.5e-8])
def test_the_rounding_is_unbiased(dtype, value):
  """x between two neighbours at 5 fractions of the gap; 2^16 roundings each go up as often
  as the fraction says (a binomial bound of 5.5 sigma; the bits are a fixed hash)."""
  lo = np.float32(np.asarray(value, dtype).astype(np.float32))
  hi = np.float32(np.nextafter(np.asarray(lo, dtype), np.asarray(np.inf, dtype)))
  rows, row_size = 256, 256
  bits = rounding.random_bits(
    rounding.step_key(jnp.int32(7), rounding.PARAM_SLOT), jnp.arange(rows), row_size
  )
  for fraction in (2.0**-12, 0.1, 0.5, 0.75, 0.99):
    x = np.float32(lo + np.float32(fraction) * (hi - lo))
    p = float((np.float64(x) - np.float64(lo)) / (np.float64(hi) - np.float64(lo)))
    out = np.asarray(rounding.stochastic_round(jnp.full((rows, row_size), x), bits, dtype))
    out = out.astype(np.float32)
    assert set(np.unique(out)) <= {lo, hi}
    n, ups = out.size, int((out == hi).sum())
    assert abs(ups - n * p) <= 5.5 * np.sqrt(n * p * (1 - p)) + 1, (fraction, ups, n * p)


def _grad(rows, dim, num_rows, seed=1):
  g = np.random.default_rng(seed).standard_normal((len(rows), dim)).astype(np.float32)
  return sparse.BCOO((jnp.asarray(g), jnp.asarray(rows, jnp.int32)[:, None]), shape=(num_rows, dim))


class _HalfStep:
  """A user's rule, as docs/architecture.md's: `delta = -lr * g / 2`, no state."""

  name = "half_step"

  def slots(self):
    return ()

  def update(self, block, hyper):
    return -hyper.learning_rate * 0.5 * block.grad, {}

  def __hash__(self):
    return 0

  def __eq__(self, other):
    return isinstance(other, _HalfStep)


FACTORIES = {
  "sgd": lambda **kw: osa.sparse_sgd(0.01, **kw),
  "adagrad": lambda **kw: osa.sparse_adagrad(0.01, **kw),
  "rowwise_adagrad": lambda **kw: osa.sparse_rowwise_adagrad(0.01, **kw),
  "adam": lambda **kw: osa.sparse_adam(1e-3, **kw),
  "adamw_rowwise_bf16_mu": lambda **kw: osa.sparse_adamw(
    1e-3, weight_decay=0.1, mu_dtype=jnp.bfloat16, rowwise_second_moment=True, **kw
  ),
  "ftrl": lambda **kw: osa.sparse_ftrl(0.1, l1_regularization_strength=0.05, **kw),
  "user_rule": lambda **kw: osa.sparse_rule_transformation(
    _HalfStep(), osa.SGDHyperparams(learning_rate=0.01), **kw
  ),
}


def _two_steps(factory, dtype, path, param_rounding):
  num_rows, dim = 24, 8
  params = {"t": jnp.asarray(np.random.default_rng(0).standard_normal((num_rows, dim)), dtype)}
  opt = FACTORIES[factory](param_rounding=param_rounding)
  state = opt.init(params)
  step = jax.jit(train_step(opt))
  with on_path(path):
    # The second step's ids padded to the first's number: one compile per path.
    for seed, rows in ((1, [3, 17, 5, 5, 23, 0]), (2, [5, 9, 3, num_rows, num_rows, num_rows])):
      params, state = step(params, state, {"t": _grad(rows, dim, num_rows, seed)})
  return params["t"]


# Each rule once, the two dtypes in turn (the rounding itself is tested on both above).
@pytest.mark.parametrize(
  "factory, dtype", [(name, NARROW[i % 2]) for i, name in enumerate(FACTORIES)]
)
def test_every_rule_and_path_stores_the_same_bits(factory, dtype):
  """Two jitted steps: the three paths agree bit for bit (the rows' bits against the
  documented formula: `test_first_step_rows_follow_the_documented_bits`)."""
  runs = {path: _two_steps(factory, dtype, path, "stochastic") for path in PATHS}
  for path in PATHS[1:]:
    np.testing.assert_array_equal(_bits(runs[path]), _bits(runs["default"]), err_msg=path)
  # The option reaches the rule: its update is the rounded rows (only traced here).
  params = {"t": jnp.zeros((24, 8), dtype)}
  for mode in ("stochastic", "nearest"):
    opt = FACTORIES[factory](param_rounding=mode)
    grads = {"t": _grad([3, 5], 8, 24)}
    updates, _ = jax.eval_shape(opt.update, grads, opt.init(params), params)
    sets = mode == "stochastic" or factory == "ftrl"  # FTRL sets its rows either way
    assert isinstance(updates["t"], osa.SetRowsUpdate) == sets, mode


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("path", PATHS)
def test_first_step_rows_follow_the_documented_bits(dtype, path):
  """The stored rows are the float32 table's rows `w + delta`, rounded with the documented
  bits of step 1 (NumPy); the update is a SetRowsUpdate holding them; other rows unchanged."""
  num_rows, dim = 40, 24
  rows = np.array([3, 17, 5, 39, 0])
  w = np.asarray(np.random.default_rng(0).standard_normal((num_rows, dim)), dtype)
  grad = _grad(rows, dim, num_rows)
  exact_opt = osa.sparse_adam(1e-2)
  w32 = jnp.asarray(w.astype(np.float32))
  u, _ = exact_opt.update({"t": grad}, exact_opt.init({"t": w32}), {"t": w32})
  exact = np.asarray(osa.apply_updates({"t": w32}, u)["t"])  # w + delta, in float32
  # float32 moments, as the float32 table's: the same delta.
  opt = osa.sparse_adam(
    1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.float32, param_rounding="stochastic"
  )
  params = {"t": jnp.asarray(w)}
  with on_path(path):
    updates, _ = jax.jit(opt.update)({"t": grad}, opt.init(params), params)
    new = osa.apply_updates(params, updates)["t"]
  assert isinstance(updates["t"], osa.SetRowsUpdate)
  want = _numpy_round(exact[rows], _numpy_param_bits(1, rows, dim), dtype).astype(dtype)
  np.testing.assert_array_equal(_bits(np.asarray(new)[rows]), _bits(want))
  untouched = np.setdiff1d(np.arange(num_rows), rows)
  np.testing.assert_array_equal(_bits(np.asarray(new)[untouched]), _bits(w[untouched]))


@pytest.mark.parametrize("dtype", NARROW)
def test_small_updates_accumulate_in_expectation(dtype):
  """Updates of a tenth of an ulp: to nearest nothing moves; stochastically the mean moves by
  the exact sum (a binomial bound of 5.5 sigma per step over 2^15 elements)."""
  num_rows, dim, steps = 512, 64, 3
  ulp = float(np.spacing(np.asarray(1.0, dtype)))
  lr = 0.1 * ulp
  params = {"t": jnp.ones((num_rows, dim), dtype)}
  grad = sparse.BCOO(
    (jnp.ones((num_rows, dim), jnp.float32), jnp.arange(num_rows)[:, None]),
    shape=(num_rows, dim),
  )
  finals = {}
  for mode in ("nearest", "stochastic"):
    opt = osa.sparse_sgd(lr, param_rounding=mode)
    p, state = params, opt.init(params)
    step = jax.jit(train_step(opt))
    for _ in range(steps):
      p, state = step(p, state, {"t": grad})
    finals[mode] = np.asarray(p["t"], np.float64)
  assert np.all(finals["nearest"] == 1.0)  # every update lost
  # Below 1.0 the ulp halves: each step moves an element down one (half) ulp with
  # probability 0.2 (0.1 ulp of 1.0 is 0.2 ulp below it), so the mean is exact in expectation.
  n = finals["stochastic"].size
  mean_drop = 1.0 - finals["stochastic"].mean()
  exact = steps * lr
  sigma = np.sqrt(steps * 0.2 * 0.8 / n) * ulp / 2
  assert abs(mean_drop - exact) <= 5.5 * sigma, (mean_drop, exact, sigma)


def test_a_float32_table_compiles_the_same_program():
  """On float32 (and with no 16-bit table) the option changes nothing: the same HLO."""
  params = {"t": jnp.zeros((16, 4))}
  grad = {"t": _grad([1, 2, 2], 4, 16)}
  texts = []
  for mode in ("nearest", "stochastic"):
    opt = osa.sparse_adam(1e-3, param_rounding=mode)
    lowered = jax.jit(train_step(opt)).lower(params, opt.init(params), grad)
    texts.append(lowered.as_text())
  assert texts[0] == texts[1]


def test_a_resumed_run_continues_the_stream():
  """Four steps, or two, a checkpoint through NumPy, two more: the same bits."""
  num_rows, dim = 32, 8
  opt = osa.sparse_adam(1e-2, param_rounding="stochastic")
  step = jax.jit(train_step(opt))
  grads = [{"t": _grad([1, 4, 4, 30], dim, num_rows, seed)} for seed in range(4)]
  params = {"t": jnp.asarray(np.random.default_rng(3).standard_normal((num_rows, dim)), "bfloat16")}

  def run(p, s, gs):
    for g in gs:
      p, s = step(p, s, g)
    return p, s

  straight, _ = run(params, opt.init(params), grads)
  half_p, half_s = run(params, opt.init(params), grads[:2])
  restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), (half_p, half_s))
  resumed, _ = run(*restored, grads[2:])
  np.testing.assert_array_equal(_bits(resumed["t"]), _bits(straight["t"]))


def test_a_dense_gradient_of_a_16_bit_parameter_is_rounded_too():
  """sparse_sgd's dense leaves: every row set (SetRowsUpdate), rounded as a sparse step's."""
  w = jnp.asarray(np.random.default_rng(0).standard_normal((6, 3)), jnp.bfloat16)
  g = jnp.asarray(np.random.default_rng(1).standard_normal((6, 3)), jnp.float32)
  opt = osa.sparse_sgd(0.01, param_rounding="stochastic")
  updates, _ = opt.update({"w": g}, opt.init({"w": w}), {"w": w})
  assert isinstance(updates["w"], osa.SetRowsUpdate)
  dense = osa.apply_updates({"w": w}, updates)["w"]
  as_bcoo = sparse.BCOO((g, jnp.arange(6)[:, None]), shape=(6, 3))
  u2, _ = opt.update({"w": as_bcoo}, opt.init({"w": w}), {"w": w})
  np.testing.assert_array_equal(_bits(dense), _bits(osa.apply_updates({"w": w}, u2)["w"]))


def test_float16_overflow_saturates_instead_of_a_nan_row():
  """A step past float16's largest finite value stores 65504 (documented), not inf;
  the next step stays finite, where nearest stores inf and then NaN."""
  params = {"t": jnp.full((4, 2), 65000.0, jnp.float16)}
  grad = {"t": sparse.BCOO((jnp.full((1, 2), -1.0), jnp.array([[1]])), shape=(4, 2))}
  finals = {}
  for mode in ("nearest", "stochastic"):
    opt = osa.sparse_sgd(5000.0, param_rounding=mode)
    p, state = params, opt.init(params)
    for _ in range(2):
      u, state = opt.update(grad, state, p)
      p = osa.apply_updates(p, u)
      if mode == "nearest":  # a cast's result, as torch's
        break
    finals[mode] = np.asarray(p["t"], np.float32)
  assert np.all(finals["stochastic"][1] == 65504.0)
  assert np.all(np.isinf(finals["nearest"][1]))


@pytest.mark.parametrize("factory", ["sgd", "adam", "ftrl", "user_rule"])
def test_an_unknown_rounding_is_refused(factory):
  with pytest.raises(ValueError, match=r"param_rounding='up'; expected one of"):
    FACTORIES[factory](param_rounding="up")


def test_a_dtype_it_does_not_serve_is_refused_naming_the_leaf():
  params = {"emb": jnp.zeros((4, 2), jnp.float8_e4m3fn)}
  opt = osa.sparse_sgd(0.1, param_rounding="stochastic")
  with pytest.raises(ValueError, match=r"\['emb'\] is float8_e4m3fn"):
    opt.init(params)
  grad = {"emb": sparse.BCOO((jnp.ones((1, 2)), jnp.array([[1]])), shape=(4, 2))}
  with pytest.raises(ValueError, match=r"\['emb'\] is float8_e4m3fn"):
    opt.update(grad, osa.sparse_sgd(0.1).init(params), params)


def test_the_step_needs_the_params():
  params = {"t": jnp.zeros((4, 2), jnp.bfloat16)}
  opt = osa.sparse_adam(0.1, param_rounding="stochastic")
  grad = {"t": sparse.BCOO((jnp.ones((1, 2)), jnp.array([[1]])), shape=(4, 2))}
  with pytest.raises(ValueError, match=r"needed for param_rounding='stochastic'"):
    opt.update(grad, opt.init(params))


def test_the_update_is_stored_not_added():
  """A SetRowsUpdate: `optax.apply_updates` (which adds) is refused, so nothing rounds twice."""
  params = {"t": jnp.ones((4, 2), jnp.bfloat16)}
  opt = osa.sparse_sgd(0.1, param_rounding="stochastic")
  grad = {"t": sparse.BCOO((jnp.ones((1, 2)), jnp.array([[1]])), shape=(4, 2))}
  updates, _ = opt.update(grad, opt.init(params), params)
  with pytest.raises(TypeError, match="SetRowsUpdate"):
    optax.apply_updates(params, updates)
  stored = osa.apply_updates(params, updates)["t"]
  np.testing.assert_array_equal(_bits(stored[1]), _bits(updates["t"].data[0]))


def test_slot_marker_is_not_a_moment_pair():
  """The parameter's stream is its own: slot -1's key differs from every pair's at a step."""
  keys = {int(rounding.step_key(jnp.int32(5), p)) for p in range(0, 16, 2)}
  assert int(rounding.step_key(jnp.int32(5), rounding.PARAM_SLOT)) not in keys


def test_no_table_sized_temporary_on_the_cpu_nor_lowered_for_cuda():
  """The donated step of a bf16 table writes it in place on the CPU (kernel or row store);
  lowered for CUDA, the table is written by one scatter (the apply's set) and nothing else."""
  rows, dim = 100_003, 8  # a prime no other dimension uses
  params = {"t": jnp.zeros((rows, dim), jnp.bfloat16)}
  opt = osa.sparse_adam(
    1e-3, mu_dtype=jnp.float32, nu_dtype=jnp.float32, param_rounding="stochastic"
  )
  grads = {"t": _grad([1, 5, 5, 99_999], dim, rows)}
  jitted = jax.jit(train_step(opt), donate_argnums=(0, 1))
  compiled = jitted.lower(params, opt.init(params), grads).compile()
  assert dense_table_temporaries(compiled, f"bf16[{rows},{dim}]", num_donated=1) == []
  lowered = jitted.trace(params, opt.init(params), grads).lower(lowering_platforms=("cuda",))
  writes: dict[str, int] = {}
  for op in _walk(lowered.compiler_ir("stablehlo").operation):
    if any(str(result.type) == f"tensor<{rows}x{dim}xbf16>" for result in op.results):
      writes[op.name] = writes.get(op.name, 0) + 1
  assert writes.get("stablehlo.scatter") == 1, writes
  assert set(writes) <= {"stablehlo.scatter", "stablehlo.case", "func.call"}, writes
