"""Every row of the README's composition table: optax transforms applied to BCOO gradients.

Each verdict is proven against a dense equivalent computed with optax on dense
gradients (or the NumPy reference of SparseAdam): the composed result equals the
dense one on the touched rows, and untouched rows stay bit-exact.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import NumpySparseAdam, train_step

NUM_ROWS, DIM = 10, 3


@pytest.fixture(params=[False, True], ids=["nojit", "jit"])
def jit(request):
  return request.param


def update_of(opt, jit):
  fn = lambda g, s, p: opt.update(g, s, p)  # noqa: E731
  return jax.jit(fn) if jit else fn


def make_grad(seed, nse=7, with_padding=True):
  """A BCOO row gradient with duplicate rows and (optionally) out-of-range padding."""
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, NUM_ROWS, size=nse)
  idx[1] = idx[0]  # a duplicate row
  if with_padding:
    idx[-1] = NUM_ROWS + 2  # padding, ignored
    idx[-2] = -1  # negative: padding too
  data = rng.normal(size=(nse, DIM)).astype(np.float32)
  return sparse.BCOO((jnp.asarray(data), jnp.asarray(idx[:, None])), shape=(NUM_ROWS, DIM))


def densify(g):
  """NumPy sum of the in-range entries of a BCOO row gradient, and the touched-row mask."""
  idx = np.asarray(g.indices)[:, 0]
  data = np.asarray(g.data, np.float64)
  keep = (idx >= 0) & (idx < g.shape[0])
  dense = np.zeros(g.shape)
  np.add.at(dense, idx[keep], data[keep])
  touched = np.zeros(g.shape[0], bool)
  touched[idx[keep]] = True
  return dense, touched


def params_tree():
  rng = np.random.default_rng(123)
  return {
    "table": jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32),
    "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
  }


def bias_grad(seed):
  return jnp.asarray(np.random.default_rng(seed + 1000).normal(size=(4,)), jnp.float32)


def assert_untouched_exact(new_table, old_table, touched):
  np.testing.assert_array_equal(np.asarray(new_table)[~touched], np.asarray(old_table)[~touched])


# --- Element-wise and norm-based transforms: lift_to_bcoo == dense, on touched rows. ---

LIFTED = {
  "scale": lambda: optax.scale(-2.0),
  "scale_by_learning_rate": lambda: optax.scale_by_learning_rate(0.3),
  "scale_by_schedule": lambda: optax.scale_by_schedule(lambda count: 0.5 / (count + 1)),
  "clip": lambda: optax.clip(0.4),
  "clip_by_global_norm": lambda: optax.clip_by_global_norm(1.0),
  "add_decayed_weights": lambda: optax.add_decayed_weights(0.1),
  "zero_nans": lambda: optax.zero_nans(),
  "chain": lambda: optax.chain(optax.clip(0.8), optax.scale_by_learning_rate(0.1)),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=0.7),
  "masked": lambda: optax.masked(optax.scale(3.0), {"table": True, "bias": False}),
}


@pytest.mark.parametrize("name", sorted(LIFTED))
def test_lifted_transform_equals_dense_on_touched_rows(name, jit):
  params = params_tree()
  sparse_opt = osa.lift_to_bcoo(LIFTED[name]())
  dense_opt = LIFTED[name]()
  sparse_state, dense_state = sparse_opt.init(params), dense_opt.init(params)
  sparse_update, dense_update = update_of(sparse_opt, jit), update_of(dense_opt, False)
  for seed in range(3):  # several steps: stateful schedules advance
    g = make_grad(seed)
    dense_g, touched = densify(g)
    if name == "zero_nans":
      g = sparse.BCOO((g.data.at[0, 1].set(jnp.nan), g.indices), shape=g.shape)
      dense_g[np.asarray(g.indices)[0, 0], 1] = np.nan
    grads = {"table": g, "bias": bias_grad(seed)}
    dense_grads = {"table": jnp.asarray(dense_g, jnp.float32), "bias": grads["bias"]}
    u, sparse_state = sparse_update(grads, sparse_state, params)
    du, dense_state = dense_update(dense_grads, dense_state, params)
    assert isinstance(u["table"], sparse.BCOO)
    assert u["table"].indices.dtype == jnp.int32
    got, got_touched = densify(u["table"])
    assert not got_touched[~touched].any()
    np.testing.assert_allclose(got[touched], np.asarray(du["table"])[touched], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(u["bias"], du["bias"], rtol=2e-6)
    new = osa.apply_updates(params, u)
    assert_untouched_exact(new["table"], params["table"], touched)
    # The state's tree structure is the dense transform's: no BCOO node leaks in.
    assert jax.tree.structure(sparse_state) == jax.tree.structure(dense_state)


def test_raw_optax_scale_corrupts_indices_and_lift_does_not():
  g = sparse.BCOO((jnp.ones((4,)), jnp.array([[1], [1], [3], [12]])), shape=(20,))
  raw, _ = optax.scale(-2.0).update(g, optax.EmptyState())
  np.testing.assert_array_equal(raw.indices[:, 0], [-2, -2, -6, -24])  # what the issue reports
  lifted, _ = osa.lift_to_bcoo(optax.scale(-2.0)).update(g, optax.EmptyState())
  np.testing.assert_array_equal(lifted.indices[:3, 0], [1, 3, 12])
  np.testing.assert_array_equal(lifted.data[:3], [-4.0, -2.0, -2.0])


def test_global_norm_counts_each_row_once_after_coalescing():
  # Entries +3 and -3 on the same row cancel: the dense gradient is [0, 0, 4, 0].
  g = sparse.BCOO((jnp.array([3.0, -3.0, 4.0]), jnp.array([[1], [1], [2]])), shape=(4,))
  dense = jnp.array([1.0, 0.0])
  opt = osa.lift_to_bcoo(optax.clip_by_global_norm(2.5))
  u, _ = opt.update({"s": g, "d": dense}, opt.init({"s": jnp.zeros(4), "d": dense}))
  norm = np.sqrt(16.0 + 1.0)  # not sqrt(9 + 9 + 16 + 1): the row is summed first
  np.testing.assert_allclose(u["s"].todense(), np.array([0, 0, 4.0, 0]) * 2.5 / norm, rtol=1e-6)
  np.testing.assert_allclose(u["d"], np.array([1.0, 0.0]) * 2.5 / norm, rtol=1e-6)


def test_raw_clip_by_global_norm_raises():
  g = make_grad(0)
  with pytest.raises(TypeError):
    optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())


def test_raw_add_decayed_weights_raises():
  g = make_grad(0)
  with pytest.raises(ValueError, match="pytree structure"):
    optax.add_decayed_weights(0.1).update(g, optax.EmptyState(), jnp.ones(g.shape))


def test_raw_zero_nans_differs_from_dense_on_duplicates_and_lift_matches():
  # Duplicates: NaN + 2 is NaN in the dense gradient, so the dense row is zeroed.
  g = sparse.BCOO((jnp.array([jnp.nan, 2.0]), jnp.array([[1], [1]])), shape=(3,))
  raw, _ = optax.zero_nans().update(g, optax.zero_nans().init(jnp.zeros(3)))
  assert float(raw.todense()[1]) == 2.0  # silently keeps half a row
  lifted_opt = osa.lift_to_bcoo(optax.zero_nans())
  lifted, state = lifted_opt.update(g, lifted_opt.init(jnp.zeros(3)))
  np.testing.assert_array_equal(lifted.todense(), [0.0, 0.0, 0.0])
  assert bool(state.found_nan)


@pytest.mark.parametrize(
  "factory",
  [lambda: optax.adam(0.1), lambda: optax.ema(0.9), lambda: optax.MultiSteps(optax.sgd(0.1), 2)],
  ids=["adam", "ema", "MultiSteps"],
)
def test_lift_refuses_per_parameter_state_at_init(factory):
  opt = osa.lift_to_bcoo(factory())
  with pytest.raises(ValueError, match="have the shape of the parameters"):
    opt.init(params_tree())


# --- Combinators around sparse_adam: works as is, proven against the NumPy reference. ---


def run_reference(grads_seq, lr=0.1, transform=None):
  params = params_tree()
  ref = NumpySparseAdam(np.asarray(params["table"]), lr=lr)
  for g in grads_seq:
    dense, touched = densify(g)
    if transform is not None:
      dense = transform(dense)
    rows = np.nonzero(touched)[0]
    ref.step(rows[:, None], dense[rows])
  return ref.param


def test_chain_lifted_clip_then_sparse_adam(jit):
  params = {"table": params_tree()["table"]}
  opt = optax.chain(
    osa.lift_to_bcoo(optax.zero_nans()),
    osa.lift_to_bcoo(optax.clip_by_global_norm(0.5)),
    osa.sparse_adam(0.1),
  )
  state = opt.init(params)
  update = update_of(opt, jit)
  grads = [make_grad(s) for s in range(3)]
  p = params
  for g in grads:
    u, state = update({"table": g}, state, p)
    p = osa.apply_updates(p, u)

  def clip(dense):
    norm = np.sqrt((dense**2).sum())
    return dense * min(1.0, 0.5 / norm)

  np.testing.assert_allclose(p["table"], run_reference(grads, transform=clip), rtol=2e-5)
  touched = np.zeros(NUM_ROWS, bool)
  for g in grads:
    touched |= densify(g)[1]
  assert_untouched_exact(p["table"], params["table"], touched)


def two_leaf_setup():
  params = params_tree()
  params["other"] = jnp.zeros((NUM_ROWS, DIM))
  grads = {"table": make_grad(0), "bias": bias_grad(0), "other": make_grad(1)}
  return params, grads


def test_masked_sparse_adam_works_as_is(jit):
  params, grads = two_leaf_setup()
  del grads["bias"], params["bias"]
  opt = optax.masked(osa.sparse_adam(0.1), {"table": True, "other": False})
  u, _ = update_of(opt, jit)(grads, opt.init(params), params)
  new = osa.apply_updates(params, u)
  np.testing.assert_allclose(new["table"], run_reference([grads["table"]]), rtol=1e-6)
  # Masked-out leaves pass their gradient through, as optax.masked does for dense ones.
  np.testing.assert_array_equal(u["other"].data, grads["other"].data)
  np.testing.assert_array_equal(u["other"].indices, grads["other"].indices)


def test_multi_transform_sparse_and_dense_works_as_is(jit):
  params, grads = two_leaf_setup()
  del grads["other"], params["other"]
  opt = optax.multi_transform(
    {"sparse": osa.sparse_adam(0.1), "dense": optax.adam(0.1)},
    {"table": "sparse", "bias": "dense"},
  )
  u, _ = update_of(opt, jit)(grads, opt.init(params), params)
  new = osa.apply_updates(params, u)
  np.testing.assert_allclose(new["table"], run_reference([grads["table"]]), rtol=1e-6)
  dense_opt = optax.adam(0.1)
  du, _ = dense_opt.update(grads["bias"], dense_opt.init(params["bias"]))
  np.testing.assert_allclose(u["bias"], du, rtol=1e-6)


def test_inject_hyperparams_sparse_adam_works_as_is(jit):
  params = {"table": params_tree()["table"]}
  opt = optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1)
  state = opt.init(params)
  update = update_of(opt, jit)
  grads = [make_grad(s) for s in range(3)]
  ref = NumpySparseAdam(np.asarray(params["table"]), lr=0.1)
  p = params
  for i, g in enumerate(grads):
    lr = 0.1 / (i + 1)
    state.hyperparams["learning_rate"] = jnp.asarray(lr)
    u, state = update({"table": g}, state, p)
    p = osa.apply_updates(p, u)
    dense, touched = densify(g)
    rows = np.nonzero(touched)[0]
    ref.step(rows[:, None], dense[rows], lr=lr)
  np.testing.assert_allclose(p["table"], ref.param, rtol=1e-5)


def test_optax_adam_and_adamw_raise_on_bcoo():
  params = {"table": jnp.zeros((NUM_ROWS, DIM))}
  for opt in (optax.adam(0.1), optax.adamw(0.1)):
    with pytest.raises(ValueError, match="pytree structure"):
      opt.update({"table": make_grad(0)}, opt.init(params), params)


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_sparse_adam_is_optax_adam_restricted_to_touched_rows(decoupled, jit):
  """sparse_adam(w) == optax.adam(w) run on the touched rows only, when they are the same rows.

  eps is negligible here: sparse_adam adds it to sqrt(v) (torch's placement),
  optax to sqrt(v / (1 - b2^t)).
  """
  rows = np.array([1, 4, 7])
  params = {"table": params_tree()["table"]}
  kw = dict(learning_rate=0.05, eps=1e-30)
  if decoupled:
    opt, dense_opt = osa.sparse_adamw(weight_decay=0.1, **kw), optax.adamw(weight_decay=0.1, **kw)
  else:
    opt, dense_opt = osa.sparse_adam(**kw), optax.adam(**kw)
  state, dense_state = opt.init(params), dense_opt.init(params["table"][rows])
  update = update_of(opt, jit)
  p, dense_p = params, params["table"][rows]
  rng = np.random.default_rng(0)
  for _ in range(4):
    data = rng.normal(size=(4, DIM)).astype(np.float32)
    idx = np.array([rows[0], rows[1], rows[2], rows[1]])  # a duplicate
    g = sparse.BCOO((jnp.asarray(data), jnp.asarray(idx[:, None])), shape=(NUM_ROWS, DIM))
    u, state = update({"table": g}, state, p)
    p = osa.apply_updates(p, u)
    dense_g = np.stack([data[0], data[1] + data[3], data[2]])
    du, dense_state = dense_opt.update(jnp.asarray(dense_g), dense_state, dense_p)
    dense_p = optax.apply_updates(dense_p, du)
  np.testing.assert_allclose(np.asarray(p["table"])[rows], dense_p, rtol=1e-5, atol=1e-6)
  untouched = np.ones(NUM_ROWS, bool)
  untouched[rows] = False
  assert_untouched_exact(p["table"], params["table"], ~untouched)


# --- apply_if_finite: optax's works around sparse_adam; ours also ignores padding. ---
# --- MultiSteps: refused, replaced by sparse_multi_steps. ---


def test_optax_apply_if_finite_skips_but_counts_nan_padding_as_non_finite():
  """optax.apply_if_finite composes with sparse_adam (tests/core/test_nonfinite.py proves the
  skip is exact); it checks every entry, so a NaN in a padding entry, which is not part of
  the gradient, also skips the step. sparse_apply_if_finite does not."""
  params = {"table": params_tree()["table"]}
  good = make_grad(0)
  nan_in_padding = sparse.BCOO((good.data.at[-1, 0].set(jnp.nan), good.indices), shape=good.shape)
  theirs = optax.apply_if_finite(osa.sparse_adam(0.1), 2)
  ours = osa.sparse_apply_if_finite(osa.sparse_adam(0.1), 2)
  u, state = theirs.update({"table": nan_in_padding}, theirs.init(params), params)
  assert not bool(state.last_finite)
  np.testing.assert_array_equal(osa.apply_updates(params, u)["table"], params["table"])
  _, state = ours.update({"table": nan_in_padding}, ours.init(params), params)
  assert bool(state.last_finite)


def test_sparse_apply_if_finite(jit):
  params = {"table": params_tree()["table"]}
  opt = osa.sparse_apply_if_finite(osa.sparse_adam(0.1), max_consecutive_errors=1)
  state = opt.init(params)
  update = update_of(opt, jit)
  good = make_grad(0)
  bad = sparse.BCOO((good.data.at[2, 0].set(jnp.inf), good.indices), shape=good.shape)
  # NaN in a padding entry (out-of-range index) is not part of the gradient.
  nan_in_padding = sparse.BCOO((good.data.at[-1, 0].set(jnp.nan), good.indices), shape=good.shape)

  u, state_after_bad = update({"table": bad}, state, params)
  np.testing.assert_array_equal(osa.apply_updates(params, u)["table"], params["table"])
  assert int(state_after_bad.total_notfinite) == 1 and not bool(state_after_bad.last_finite)
  for a, b in zip(
    jax.tree.leaves(state_after_bad.inner_state), jax.tree.leaves(state.inner_state), strict=True
  ):
    np.testing.assert_array_equal(a, b)

  u, state2 = update({"table": nan_in_padding}, state_after_bad, params)
  assert bool(state2.last_finite)
  np.testing.assert_allclose(
    osa.apply_updates(params, u)["table"], run_reference([good]), rtol=1e-6
  )

  # Past max_consecutive_errors the update goes through (and is non-finite), as in optax.
  _, s = update({"table": bad}, state, params)
  u, s = update({"table": bad}, s, params)
  assert int(s.notfinite_count) == 2
  assert not np.isfinite(np.asarray(u["table"].data)).all()


def test_optax_multi_steps_refused_with_pointer_to_sparse_multi_steps():
  opt = optax.MultiSteps(osa.sparse_adam(0.1), 2)
  params = {"table": jnp.zeros((NUM_ROWS, DIM))}
  with pytest.raises(TypeError, match="sparse_multi_steps"):
    opt.update({"table": make_grad(0)}, opt.init(params), params)


def test_sparse_multi_steps_equals_mean_gradient_step(jit):
  params = params_tree()
  k, cycles = (3, 2) if jit else (2, 1)  # eager lax.cond is slow; jit covers more
  opt = osa.sparse_multi_steps(
    optax.multi_transform(
      {"sparse": osa.sparse_adam(0.1), "dense": optax.adam(0.1)},
      {"table": "sparse", "bias": "dense"},
    ),
    every_k=k,
    max_nse={"table": 8, "bias": None},
  )
  state = opt.init(params)
  update = update_of(opt, jit)
  p = params
  micro = [make_grad(s, nse=6 + s % 2) for s in range(cycles * k)]  # nse varies up to the cap
  for i, g in enumerate(micro):
    u, state = update({"table": g, "bias": bias_grad(i)}, state, p)
    before, p = p, osa.apply_updates(p, u)
    if i % k != k - 1:
      np.testing.assert_array_equal(p["table"], before["table"])
      assert float(jnp.abs(u["table"].data).sum()) == 0.0
      assert float(jnp.abs(u["bias"]).sum()) == 0.0
  assert int(state.gradient_step) == cycles

  ref = NumpySparseAdam(np.asarray(params["table"]), lr=0.1)
  dense_opt = optax.adam(0.1)
  dense_state, dense_p = dense_opt.init(params["bias"]), params["bias"]
  touched = np.zeros(NUM_ROWS, bool)
  for cycle in range(cycles):
    gs = micro[cycle * k : (cycle + 1) * k]
    mean = sum(densify(g)[0] for g in gs) / k
    t = np.logical_or.reduce([densify(g)[1] for g in gs])
    touched |= t
    ref.step(np.nonzero(t)[0][:, None], mean[t])
    bias_mean = sum(bias_grad(cycle * k + j) for j in range(k)) / k
    du, dense_state = dense_opt.update(bias_mean, dense_state)
    dense_p = optax.apply_updates(dense_p, du)
  np.testing.assert_allclose(p["table"], ref.param, rtol=1e-5)
  np.testing.assert_allclose(p["bias"], dense_p, rtol=1e-5)
  assert_untouched_exact(p["table"], params["table"], touched)


def test_sparse_multi_steps_refuses_nse_beyond_cap():
  params = {"table": jnp.zeros((NUM_ROWS, DIM))}
  opt = osa.sparse_multi_steps(osa.sparse_adam(0.1), every_k=2, max_nse=4)
  with pytest.raises(ValueError, match=r"nse=7 entries .* max_nse=4.*max_nse >= 7"):
    opt.update({"table": make_grad(0, nse=7)}, opt.init(params), params)


def test_sparse_multi_steps_refuses_bad_configuration():
  params = {"table": jnp.zeros((NUM_ROWS, DIM)), "bias": jnp.zeros(4)}
  with pytest.raises(ValueError, match="every_k must be a Python int"):
    osa.sparse_multi_steps(osa.sparse_adam(0.1), every_k=optax.constant_schedule(2), max_nse=4)
  opt = osa.sparse_multi_steps(optax.sgd(0.1), every_k=2, max_nse={"table": None, "bias": None})
  with pytest.raises(TypeError, match="max_nse was None"):
    opt.update({"table": make_grad(0), "bias": jnp.zeros(4)}, opt.init(params))
  opt = osa.sparse_multi_steps(optax.sgd(0.1), every_k=2, max_nse={"table": 8, "bias": 8})
  with pytest.raises(TypeError, match="is dense"):
    opt.update({"table": make_grad(0), "bias": jnp.zeros(4)}, opt.init(params))
  elementwise = sparse.BCOO((jnp.ones(2), jnp.array([[0, 1], [2, 2]])), shape=(NUM_ROWS, DIM))
  opt = osa.sparse_multi_steps(osa.sparse_adam(0.1), every_k=2, max_nse=4)
  with pytest.raises(ValueError, match="n_sparse=2"):
    opt.update({"table": elementwise}, opt.init({"table": params["table"]}))


# --- Corrupted indices are caught by every entry point of ours. ---


def corrupted(g):
  raw, _ = optax.scale(-2.0).update(g, optax.EmptyState())
  return raw


ENTRY_POINTS = {
  "sparse_adam": lambda g, p: osa.sparse_adam(0.1).update(g, osa.sparse_adam(0.1).init(p), p),
  "sparse_adamw": lambda g, p: osa.sparse_adamw(0.1).update(g, osa.sparse_adamw(0.1).init(p), p),
  "lift_to_bcoo": lambda g, p: osa.lift_to_bcoo(optax.scale(1.0)).update(g, optax.EmptyState(), p),
  "sparse_apply_if_finite": lambda g, p: (lambda o: o.update(g, o.init(p), p))(
    osa.sparse_apply_if_finite(osa.sparse_adam(0.1), 1)
  ),
  "sparse_multi_steps": lambda g, p: (lambda o: o.update(g, o.init(p), p))(
    osa.sparse_multi_steps(osa.sparse_adam(0.1), every_k=2, max_nse=8)
  ),
  "apply_updates": lambda g, p: osa.apply_updates(p, g),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_corrupted_indices_are_refused_clearly(entry, jit):
  params = {"table": jnp.zeros((NUM_ROWS, DIM))}
  fn = jax.jit(ENTRY_POINTS[entry]) if jit else ENTRY_POINTS[entry]
  with pytest.raises(TypeError, match=r"\['table'\] has indices of dtype float32.*lift_to_bcoo"):
    fn({"table": corrupted(make_grad(0))}, params)


def test_documented_composition_compiles_once_and_keeps_untouched_rows():
  """The example of the README's composition section, in a jitted training loop."""
  opt = osa.sparse_apply_if_finite(
    optax.chain(
      osa.lift_to_bcoo(optax.clip_by_global_norm(1.0)),
      optax.multi_transform(
        {"sparse": osa.sparse_adam(1e-3), "dense": optax.adam(1e-3)},
        {"table": "sparse", "bias": "dense"},
      ),
    ),
    max_consecutive_errors=5,
  )
  params = params_tree()

  step = jax.jit(train_step(opt))

  p, state = params, opt.init(params)
  touched = np.zeros(NUM_ROWS, bool)
  for seed in range(3):
    g = make_grad(seed)
    touched |= densify(g)[1]
    p, state = step(p, state, {"table": g, "bias": bias_grad(seed)})
  assert step._cache_size() == 1
  assert_untouched_exact(p["table"], params["table"], touched)
  assert not np.array_equal(np.asarray(p["table"])[touched], np.asarray(params["table"])[touched])
