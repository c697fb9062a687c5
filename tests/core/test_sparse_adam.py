"""sparse_adam against the independent NumPy reference, over layouts, dtypes, jit and options."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import NumpySparseAdam, tiered, train_step

# (param shape, n_sparse): n_dense = ndim - n_sparse covers 0, 1 and 2.
LAYOUTS = [((11,), 1), ((9, 3), 1), ((5, 4), 2), ((4, 3, 2), 1), ((4, 3, 2), 2)]
TOLERANCE = {jnp.float32: dict(rtol=2e-6, atol=1e-7), jnp.bfloat16: dict(rtol=2e-2, atol=2e-3)}


def make_step(opt, use_jit):
  step = train_step(opt)
  return jax.jit(step, donate_argnums=(0, 1)) if use_jit else step


def random_grad(rng, shape, n_sparse, nse, dtype, pad=0, negative=0):
  """A BCOO with repeated indices, `pad` out-of-range and `negative` negative entries."""
  sparse_shape = shape[:n_sparse]
  idx = np.stack([rng.integers(0, d, nse) for d in sparse_shape], axis=1)
  if nse:
    idx[rng.integers(0, nse, nse // 3)] = idx[0]  # force duplicates
  if pad:
    idx[-pad:] = np.array(sparse_shape)  # the sum_duplicates padding convention
  if negative:
    idx[:negative, 0] = -1
  data = rng.normal(size=(nse,) + shape[n_sparse:]).astype(np.float32)
  grad = sparse.BCOO((jnp.asarray(data, dtype), jnp.asarray(idx, jnp.int32)), shape=shape)
  return grad, idx, np.asarray(jnp.asarray(data, dtype).astype(jnp.float32))


# Every layout jitted and eagerly in float32; bfloat16 eagerly (op by op, slow) on two.
REFERENCE_CASES = [
  (layout, dtype, use_jit)
  for i, layout in enumerate(LAYOUTS)
  for dtype in (jnp.float32, jnp.bfloat16)
  for use_jit in (False, True)
  if use_jit or dtype == jnp.float32 or i < 2
]


def _slow_reference_case(layout, dtype, use_jit):
  index = LAYOUTS.index(layout)
  if dtype == jnp.bfloat16:  # jitted on the last layout (two sparse dims), eagerly on the first
    return index != (len(LAYOUTS) - 1 if use_jit else 0)
  return not use_jit and index not in (1, 3)  # float32 eagerly: (9, 3) and (4, 3, 2) by rows


@pytest.mark.parametrize(
  "layout,dtype,use_jit",
  # Default tier: every layout jitted in float32, and each other crossing (bfloat16, eager)
  # on some layouts; the rest in the slow tier, the slowest eager cell (a dense block of
  # two dimensions, op by op) among them.
  tiered(REFERENCE_CASES, lambda case: _slow_reference_case(*case)),
  ids=[
    f"{layout[0]}-{layout[1]}-{'bf16' if d == jnp.bfloat16 else 'f32'}-{'jit' if j else 'eager'}"
    for layout, d, j in REFERENCE_CASES
  ],
)
def test_matches_reference_over_steps(layout, dtype, use_jit):
  shape, n_sparse = layout
  rng = np.random.default_rng(0)
  init = rng.normal(size=shape).astype(np.float32)
  params = {"w": jnp.asarray(init, dtype)}
  opt = osa.sparse_adam(learning_rate=0.05, b1=0.8, b2=0.99, eps=1e-3)
  state = opt.init(params)
  step = make_step(opt, use_jit)
  ref = NumpySparseAdam(np.asarray(params["w"].astype(jnp.float32)), 0.05, (0.8, 0.99), 1e-3)
  for t, (nse, pad) in enumerate([(6, 0), (7, 2), (0, 0), (5, 5), (9, 3)]):
    grad, idx, data = random_grad(rng, shape, n_sparse, nse, dtype, pad=pad)
    params, state = step(params, state, {"w": grad})
    ref.step(idx, data)
    np.testing.assert_allclose(
      np.asarray(params["w"].astype(jnp.float32)), ref.param, **TOLERANCE[dtype]
    )
    assert int(state.step["w"]) == t + 1 == ref.step_count
  np.testing.assert_allclose(
    np.asarray(state.mu["w"].astype(jnp.float32)), ref.exp_avg, **TOLERANCE[dtype]
  )
  np.testing.assert_allclose(
    np.asarray(state.nu["w"].astype(jnp.float32)), ref.exp_avg_sq, **TOLERANCE[dtype]
  )


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_untouched_entries_are_bit_exact(use_jit):
  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.normal(size=(20, 4)), jnp.float32)}
  opt = osa.sparse_adam(learning_rate=0.1)
  state = opt.init(params)
  step = make_step(opt, use_jit)
  params, state = step(params, state, {"w": random_grad(rng, (20, 4), 1, 8, jnp.float32)[0]})
  before = jax.tree.map(np.asarray, (params, state))
  grad, idx, _ = random_grad(rng, (20, 4), 1, 5, jnp.float32)
  params, state = step(params, state, {"w": grad})
  untouched = np.setdiff1d(np.arange(20), idx[:, 0])
  for old, new in [
    (before[0]["w"], params["w"]),
    (before[1].mu["w"], state.mu["w"]),
    (before[1].nu["w"], state.nu["w"]),
  ]:
    np.testing.assert_array_equal(np.asarray(new)[untouched], old[untouched])
  assert not np.array_equal(np.asarray(params["w"])[idx[:, 0]], before[0]["w"][idx[:, 0]])


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_maximize_and_schedule(use_jit):
  rng = np.random.default_rng(2)
  schedule = optax.linear_schedule(0.1, 0.01, transition_steps=4)
  params = {"w": jnp.asarray(rng.normal(size=(7, 2)), jnp.float32)}
  opt = osa.sparse_adam(learning_rate=schedule, maximize=True)
  state = opt.init(params)
  step = make_step(opt, use_jit)
  ref = NumpySparseAdam(np.asarray(params["w"]), maximize=True)
  for t in range(6):
    grad, idx, data = random_grad(rng, (7, 2), 1, 4, jnp.float32)
    params, state = step(params, state, {"w": grad})
    ref.step(idx, data, lr=float(schedule(t)))
  np.testing.assert_allclose(np.asarray(params["w"]), ref.param, rtol=2e-6, atol=1e-7)


def test_negative_indices_are_padding():
  rng = np.random.default_rng(3)
  params = jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)
  opt = osa.sparse_adam(learning_rate=0.1)
  grad, idx, data = random_grad(rng, (6, 2), 1, 5, jnp.float32, negative=2)
  updates, _ = opt.update(grad, opt.init(params))
  ref = NumpySparseAdam(np.asarray(params), lr=0.1)
  ref.step(idx, data)
  np.testing.assert_allclose(np.asarray(osa.apply_updates(params, updates)), ref.param, rtol=2e-6)


def test_update_is_coalesced_bcoo_and_optax_apply_updates_agrees():
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)}
  opt = osa.sparse_adam(learning_rate=0.1)
  grad, idx, _ = random_grad(rng, (10, 3), 1, 8, jnp.float32, pad=2)
  updates, _ = opt.update({"w": grad}, opt.init(params))
  update = updates["w"]
  assert isinstance(update, sparse.BCOO)
  # The flags mirror the gradient's (inside optax.apply_if_finite the update is a plain
  # BCOO with the gradient's tree structure, what its lax.cond needs); the indices are
  # sorted and unique whatever the flags say.
  assert (update.unique_indices, update.indices_sorted) == (
    grad.unique_indices,
    grad.indices_sorted,
  )
  rows = np.asarray(update.indices[:, 0])
  assert np.all(np.diff(rows) > 0)
  valid = rows[rows < 10]
  assert np.array_equal(valid, np.unique(idx[idx[:, 0] < 10, 0]))
  assert len(np.unique(rows)) == len(rows)  # padding slots are distinct too
  np.testing.assert_array_equal(np.asarray(update.data)[rows >= 10], 0)
  assert isinstance(update, osa.RowUpdate)
  with pytest.warns(osa.DensifyingUpdateWarning):  # right, but dense: told
    dense_applied = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(
    np.asarray(osa.apply_updates(params, updates)["w"]), np.asarray(dense_applied["w"])
  )


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_empty_and_none_gradients(use_jit):
  params = {"a": jnp.ones((4, 2)), "b": jnp.ones((3,))}
  opt = osa.sparse_adam()
  state = opt.init(params)
  step = make_step(opt, use_jit)
  empty = sparse.BCOO((jnp.zeros((0, 2)), jnp.zeros((0, 1), jnp.int32)), shape=(4, 2))
  all_padding = sparse.BCOO((jnp.ones((2,)), jnp.array([[3], [3]])), shape=(3,))
  params2, state2 = step(params, state, {"a": empty, "b": all_padding})
  assert int(state2.step["a"]) == 1 and int(state2.step["b"]) == 1
  np.testing.assert_array_equal(params2["a"], np.ones((4, 2)))
  np.testing.assert_array_equal(params2["b"], np.ones((3,)))
  np.testing.assert_array_equal(state2.mu["a"], 0)
  params3, state3 = step(params2, state2, {"a": None, "b": all_padding})
  assert int(state3.step["a"]) == 1 and int(state3.step["b"]) == 2
  np.testing.assert_array_equal(params3["a"], np.ones((4, 2)))


def test_inject_hyperparams_changes_lr_without_recompiling():
  params = {"w": jnp.zeros((8, 2))}
  opt = optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1)
  state = opt.init(params)
  grad = sparse.BCOO((jnp.ones((2, 2)), jnp.array([[1], [5]])), shape=(8, 2))

  @jax.jit
  def step(params, state):
    updates, state = opt.update({"w": grad}, state, params)
    return osa.apply_updates(params, updates), state

  p1, s1 = step(params, state)
  # A strongly typed float32, like the value init stored (a Python float is weakly typed).
  s1.hyperparams["learning_rate"] = jnp.asarray(0.01, jnp.float32)
  p2, _ = step(p1, s1)
  assert step._cache_size() == 1
  delta1 = np.asarray(p1["w"][1])
  delta2 = np.asarray(p2["w"][1] - p1["w"][1])
  # Same gradient each step, so Adam's direction is ~1: the step scales with lr.
  np.testing.assert_allclose(delta2 / delta1, 0.1, rtol=1e-3)


def test_multi_transform_routes_dense_and_sparse():
  params = {"table": jnp.zeros((6, 2)), "dense": jnp.ones((3,))}
  labels = {"table": "sparse", "dense": "dense"}
  opt = optax.multi_transform({"sparse": osa.sparse_adam(0.1), "dense": optax.adam(0.1)}, labels)
  state = opt.init(params)
  grads = {
    "table": sparse.BCOO((jnp.ones((1, 2)), jnp.array([[2]])), shape=(6, 2)),
    "dense": jnp.ones((3,)),
  }
  updates, state = jax.jit(opt.update)(grads, state, params)
  new = osa.apply_updates(params, updates)
  np.testing.assert_allclose(new["dense"], 0.9, rtol=1e-5)
  np.testing.assert_allclose(new["table"][2], -0.1, rtol=1e-5)
  np.testing.assert_array_equal(np.delete(np.asarray(new["table"]), 2, axis=0), 0)


@st.composite
def sparse_case(draw):
  ndim = draw(st.integers(1, 3))
  shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
  n_sparse = draw(st.integers(1, ndim))
  nse = draw(st.integers(0, 8))
  pad = draw(st.integers(0, nse))
  seed = draw(st.integers(0, 2**16))
  hp = dict(
    lr=draw(st.sampled_from([1e-3, 0.1, 1.0])),
    betas=(draw(st.sampled_from([0.0, 0.5, 0.9])), draw(st.sampled_from([0.9, 0.999]))),
    eps=draw(st.sampled_from([1e-8, 1e-3, 1.0])),
    maximize=draw(st.booleans()),
  )
  return shape, n_sparse, nse, pad, seed, hp


def _random_layouts_match_reference(case):
  shape, n_sparse, nse, pad, seed, hp = case
  rng = np.random.default_rng(seed)
  params = jnp.asarray(rng.normal(size=shape), jnp.float32)
  opt = osa.sparse_adam(hp["lr"], *hp["betas"], hp["eps"], maximize=hp["maximize"])
  state = opt.init(params)
  ref = NumpySparseAdam(np.asarray(params), hp["lr"], hp["betas"], hp["eps"], hp["maximize"])
  for _ in range(2):
    grad, idx, data = random_grad(rng, shape, n_sparse, nse, jnp.float32, pad=pad)
    updates, state = opt.update(grad, state)
    params = osa.apply_updates(params, updates)
    ref.step(idx, data)
  np.testing.assert_allclose(np.asarray(params), ref.param, rtol=5e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(state.nu), ref.exp_avg_sq, rtol=5e-6, atol=1e-7)


# A quick pass in the default tier, more examples in the slow one (each compiles its shapes).
test_random_layouts_match_reference = settings(max_examples=12)(
  given(sparse_case())(_random_layouts_match_reference)
)
test_random_layouts_match_reference_soak = pytest.mark.slow(
  settings(max_examples=30)(given(sparse_case())(_random_layouts_match_reference))
)


def test_int64_indices_past_int32_are_padding_not_wrapped():
  """An int64 index of 2**32 + 3 is out of range; cast to int32 first it would hit row 3."""
  with jax.enable_x64(True):
    params = jnp.zeros((10, 2), jnp.float32)
    grad = sparse.BCOO(
      (jnp.ones((2, 2), jnp.float32), jnp.array([[2**32 + 3], [5]], jnp.int64)), shape=(10, 2)
    )
    opt = osa.sparse_adam(0.1)
    updates, state = opt.update(grad, opt.init(params))
    new = np.asarray(osa.apply_updates(params, updates))
  np.testing.assert_array_equal(new[3], 0)
  assert np.all(new[5] < 0)
  np.testing.assert_array_equal(np.asarray(state.mu)[3], 0)
