"""The fast coalescing path (payload-free sort, slots marked in a moment table) is exact.

Under jit, `coalesce_and_gather_rows` finds each entry's slot by writing slot
numbers into a moment table and reading them back; eagerly, and in
`coalesce_rows`, by binary search. Both must equal an independent NumPy
coalescing (input-order sums) bit for bit, and a whole `sparse_adam` step must
match the NumPy reference of torch.optim.SparseAdam on whichever path it takes,
leaving untouched rows, and the scratch values, nowhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends.cpu import kernels
from optax_sparse_adam._core import coalesce
from tests._helpers import NumpySparseAdam, cpu_only, tiered, train_step

# The generic XLA path's coalescing; each row's sum in input order, as XLA:CPU adds.
pytestmark = cpu_only("bit-for-bit equality with NumPy's input-order float32 sums")


def _numpy_coalesce(rows, values, num_rows):
  """Distinct in-range rows ascending, and their values summed in input order."""
  rows = np.asarray(rows)
  values = np.asarray(values)
  keep = (rows >= 0) & (rows < num_rows)
  unique = np.unique(rows[keep])
  summed = np.zeros((len(rows),) + values.shape[1:], values.dtype)
  for slot, row in enumerate(unique):
    acc = None
    for k in np.flatnonzero(rows == row):  # input order, one rounding per add
      acc = values[k] if acc is None else (acc + values[k]).astype(values.dtype)
    summed[slot] = acc
  padding = num_rows + np.arange(len(unique), len(rows))
  return np.concatenate([unique, padding]).astype(np.int32), summed


def _random_rows(rng, nse, num_rows):
  rows = rng.integers(0, num_rows, nse)
  if nse > 3:
    rows[1:3] = rows[0]  # duplicates
    rows[-1] = num_rows  # padding, as linear_rows writes it
  return rows.astype(np.int32)


COALESCE_CASES = {
  "empty": (jnp.float32, (3,), 0),
  "one": (jnp.float32, (3,), 1),
  "n_dense0": (jnp.float32, (), 40),
  "n_dense1": (jnp.float32, (3,), 40),
  "n_dense2": (jnp.float32, (2, 3), 9),
  "bf16": (jnp.bfloat16, (3,), 40),
}


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(COALESCE_CASES))
def test_coalesce_paths_match_numpy_bit_for_bit(use_jit, case):
  dtype, dense_shape, nse = COALESCE_CASES[case]
  rng = np.random.default_rng(nse)
  num_rows = 11
  rows = _random_rows(rng, nse, num_rows)
  values = jnp.asarray(rng.standard_normal((nse,) + dense_shape), dtype)
  # The scratch table is float32 (it can mark) or bfloat16 (it can for nse <= 256).
  mu = jnp.asarray(rng.standard_normal((num_rows,) + dense_shape), dtype)
  nu = jnp.asarray(rng.random((num_rows,) + dense_shape), jnp.float32)
  want_rows, want_values = _numpy_coalesce(rows, np.asarray(values), num_rows)

  def by_marking(rows, values, mu, nu):
    return coalesce.coalesce_and_gather_rows(rows, values, num_rows, (mu, nu, None))

  def by_search(rows, values):
    return coalesce.coalesce_rows(rows, values, num_rows)

  if use_jit:
    by_marking, by_search = jax.jit(by_marking), jax.jit(by_search)
  coalesced, gathered, tables = by_marking(jnp.asarray(rows), values, mu, nu)
  searched = by_search(jnp.asarray(rows), values)
  for got in (coalesced, searched):
    np.testing.assert_array_equal(got.rows, want_rows)
    np.testing.assert_array_equal(np.asarray(got.values), want_values)
  # Gathered rows are the old rows (zeros in padding slots), read before any marking.
  for table, got in zip((mu, nu), gathered, strict=False):
    want = np.zeros((nse,) + dense_shape, table.dtype)
    valid = want_rows < num_rows
    want[valid] = np.asarray(table)[want_rows[valid]]
    np.testing.assert_array_equal(np.asarray(got), want)
  assert gathered[2] is None and tables[2] is None
  # Untouched rows of the returned tables are bit-exact; touched rows may hold scratch.
  untouched = np.setdiff1d(np.arange(num_rows), rows)
  for before, after in zip((mu, nu), tables[:2], strict=True):
    np.testing.assert_array_equal(np.asarray(after)[untouched], np.asarray(before)[untouched])


def test_can_mark_needs_exact_slot_numbers():
  f32 = jnp.zeros((5, 2), jnp.float32)
  f16 = jnp.zeros((5, 2), jnp.float16)
  assert coalesce.can_mark(f32, 2**24) and not coalesce.can_mark(f32, 2**24 + 1)
  assert coalesce.can_mark(f16, 2048) and not coalesce.can_mark(f16, 2049)
  # bfloat16 is never scratch: XLA:CPU scatters it through its bits, around table copies.
  assert not coalesce.can_mark(jnp.zeros((5, 2), jnp.bfloat16), 4)
  assert not coalesce.can_mark(jnp.zeros((5, 0)), 4)  # empty rows hold no mark
  assert not coalesce.can_mark(jnp.zeros((5,), jnp.int32), 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_after_is_exact_whatever_the_dependency_holds(dtype):
  x = jnp.arange(5, dtype=jnp.int32)
  for special in (jnp.nan, -jnp.nan, jnp.inf, -jnp.inf, -0.0, -1.5):
    dependency = jnp.full((3, 2), special, dtype)
    np.testing.assert_array_equal(coalesce._after(x, dependency), x)
    np.testing.assert_array_equal(jax.jit(coalesce._after)(x, dependency), x)


def _run_sparse_adam(opt, param0, batches, use_jit, *, cpu_kernels=True):
  with kernels.use_cpu_kernels(cpu_kernels):
    return _run_steps(opt, param0, batches, use_jit)


def _run_steps(opt, param0, batches, use_jit):
  params = {"w": jnp.array(param0)}  # a copy: the jitted step donates it
  state = opt.init(params)

  step = train_step(opt)
  if use_jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  for idx, val in batches:
    grad = sparse.BCOO((jnp.asarray(val, param0.dtype), jnp.asarray(idx)), shape=param0.shape)
    params, state = step(params, state, {"w": grad})
  return params["w"], state


# (param dtype, moment dtypes, nse, CPU kernels allowed): float32 moments take the
# marking path of XLA ops when the CPU kernels are off; bfloat16 moments with
# more entries than bfloat16 holds exactly (nse > 256) take the search path.
PATHS = {
  "f32_cpu_kernels": (jnp.float32, {}, 24, True),
  "f32_marking": (jnp.float32, {}, 24, False),
  "bf16_params_marking": (
    jnp.bfloat16,
    {"mu_dtype": jnp.float32, "nu_dtype": jnp.float32},
    24,
    False,
  ),
  "bf16_moments_search": (
    jnp.float32,
    {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16},
    300,
    False,
  ),
}


# Every path jitted; eagerly (op by op) the kernels' and one marking path in the default
# tier, the other two in the slow one.
EAGER_SLOW = ("f32_marking", "bf16_moments_search")


@pytest.mark.parametrize(
  "path, use_jit",
  tiered(
    [(path, use_jit) for path in PATHS for use_jit in (False, True)],
    lambda case: not case[1] and case[0] in EAGER_SLOW,
  ),
  ids=[f"{path}-{'jit' if j else 'eager'}" for path in PATHS for j in (False, True)],
)
def test_sparse_adam_matches_reference_on_each_path(path, use_jit):
  dtype, moments, nse, cpu_kernels = PATHS[path]
  rng = np.random.default_rng(7)
  num_rows, dim, steps = 40, 3, 6
  param0 = jnp.asarray(rng.standard_normal((num_rows, dim)), dtype)
  batches = []
  for _ in range(steps):
    idx = rng.integers(0, num_rows // 2, (nse, 1)).astype(np.int32)  # rows >= 20 untouched
    idx[-2:] = num_rows + 3  # padding
    val = np.asarray(jnp.asarray(rng.standard_normal((nse, dim)), dtype).astype(jnp.float32))
    batches.append((idx, val))
  got, state = _run_sparse_adam(
    osa.sparse_adam(1e-2, **moments), param0, batches, use_jit, cpu_kernels=cpu_kernels
  )

  ref = NumpySparseAdam(np.asarray(param0.astype(jnp.float32)), lr=1e-2, dtype=np.float32)
  for idx, val in batches:
    ref.step(idx, val)
  # Low-precision storage rounds once per step; float32 matches to float32 rounding.
  low = jnp.bfloat16 in (dtype, moments.get("mu_dtype"))
  tol = dict(rtol=3e-2, atol=3e-2) if low else dict(rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), ref.param, **tol)
  np.testing.assert_allclose(np.asarray(state.mu["w"].astype(jnp.float32)), ref.exp_avg, **tol)
  np.testing.assert_allclose(np.asarray(state.nu["w"].astype(jnp.float32)), ref.exp_avg_sq, **tol)
  # Untouched rows: bit-exact parameter, zero moments (no scratch left behind).
  np.testing.assert_array_equal(np.asarray(got[20:]), np.asarray(param0[20:]))
  assert not np.asarray(state.mu["w"][20:]).any() and not np.asarray(state.nu["w"][20:]).any()
  assert int(state.step["w"]) == steps


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_marking_and_search_paths_agree(monkeypatch, use_jit):
  """The same float32 step with the marking path switched off gives the same result."""
  rng = np.random.default_rng(8)
  param0 = jnp.asarray(rng.standard_normal((30, 4)), jnp.float32)
  batches = [
    (rng.integers(-2, 33, (50, 1)).astype(np.int32), rng.standard_normal((50, 4))) for _ in range(4)
  ]
  opt = osa.sparse_adam(1e-2, amsgrad=True, weight_decay=0.1)
  marked = _run_sparse_adam(opt, param0, batches, use_jit)
  monkeypatch.setattr(coalesce, "can_mark", lambda table_rows, nse: False)
  searched = _run_sparse_adam(opt, param0, batches, use_jit)
  for a, b in zip(jax.tree.leaves(marked), jax.tree.leaves(searched), strict=True):
    if use_jit:  # XLA may fuse the two programs differently: float32 rounding.
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nan_moments_do_not_disturb_coalescing():
  """A NaN in the marked table's first gathered row leaves every other row exact."""
  rng = np.random.default_rng(9)
  opt = osa.sparse_adam(1e-2)
  params = {"w": jnp.asarray(rng.standard_normal((10, 2)), jnp.float32)}
  state = opt.init(params)
  state = state._replace(mu={"w": state.mu["w"].at[1].set(jnp.nan)})
  idx = np.array([[1], [4], [4], [7]], np.int32)
  val = rng.standard_normal((4, 2)).astype(np.float32)
  grads = {"w": sparse.BCOO((jnp.asarray(val), jnp.asarray(idx)), shape=(10, 2))}
  with kernels.use_cpu_kernels(False):  # the marking path of XLA ops
    _, new_state = jax.jit(opt.update)(grads, state, params)
  mu = np.asarray(new_state.mu["w"])
  assert np.isnan(mu[1]).all()
  np.testing.assert_allclose(mu[4], 0.1 * (val[1] + val[2]), rtol=1e-6)
  np.testing.assert_allclose(mu[7], 0.1 * val[3], rtol=1e-6)
  assert not mu[[0, 2, 3, 5, 6, 8, 9]].any()
