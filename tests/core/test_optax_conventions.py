"""optax's conventions where its generic tools reach: extra arguments through `update`,
`optax.tree.map_params` on the state, `optax.tree.get`/`set` on injected hyper-parameters,
`optax.contrib.reduce_on_plateau` and `schedule_free` around the sparse step, and states
saved in the 0.1.0 layout. The sharded use of the specs is in test_state_specs_sharding.py."""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.experimental import checkify, sparse
from jax.sharding import PartitionSpec as P

import optax_sparse_adam as osa
from optax_sparse_adam._optax.transform import AdamFlags
from tests._helpers import NumpySparseAdam

NUM_ROWS, DIM = 10, 3


@pytest.fixture(params=[False, True], ids=["nojit", "jit"])
def jit(request):
  return request.param


def maybe_jit(fn, jit):
  return jax.jit(fn) if jit else fn


def checked_jit(fn, jit):
  """`fn`, jitted through checkify where asked (sparse_grad_checks stages checks)."""
  if not jit:
    return fn
  checked = jax.jit(checkify.checkify(fn))

  def run(*args):
    err, out = checked(*args)
    err.throw()
    return out

  return run


def make_grad(seed, nse=6):
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, NUM_ROWS, size=nse)
  idx[1] = idx[0]  # a duplicate row
  idx[-1] = NUM_ROWS + 1  # padding
  data = rng.normal(size=(nse, DIM)).astype(np.float32)
  data[-1] = 0.0  # padding holds zeros
  return sparse.BCOO((jnp.asarray(data), jnp.asarray(idx[:, None])), shape=(NUM_ROWS, DIM))


def rows_of(g):
  """The touched rows and the summed dense gradient of a BCOO row gradient, in NumPy."""
  idx = np.asarray(g.indices)[:, 0]
  keep = (idx >= 0) & (idx < g.shape[0])
  dense = np.zeros(g.shape)
  np.add.at(dense, idx[keep], np.asarray(g.data, np.float64)[keep])
  rows = np.unique(idx[keep])
  return rows, dense


def table():
  return jnp.asarray(np.random.default_rng(7).normal(size=(NUM_ROWS, DIM)), jnp.float32)


# --- 1. Extra keyword arguments through update. ---

CONSTRUCTORS = {
  "sparse_adam": lambda: osa.sparse_adam(0.1),
  "sparse_adamw": lambda: osa.sparse_adamw(0.1, weight_decay=0.1),
  "amsgrad_per_row": lambda: osa.sparse_adam(0.1, amsgrad=True, per_row_bias_correction=True),
  "lift_to_bcoo": lambda: osa.lift_to_bcoo(optax.scale(-0.5)),
  "sparse_apply_if_finite": lambda: osa.sparse_apply_if_finite(osa.sparse_adam(0.1), 2),
  "sparse_multi_steps": lambda: osa.sparse_multi_steps(osa.sparse_adam(0.1), 1, max_nse=6),
  "sparse_grad_checks": lambda: osa.sparse_grad_checks(),
  "masked": lambda: optax.masked(osa.sparse_adam(0.1), {"table": True}),
  "multi_transform": lambda: optax.multi_transform({"s": osa.sparse_adamw(0.1)}, {"table": "s"}),
}


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
def test_every_constructor_takes_and_ignores_extra_args(name, jit):
  opt = CONSTRUCTORS[name]()
  assert isinstance(opt, optax.GradientTransformationExtraArgs)
  params = {"table": table()}
  state = opt.init(params)
  grads = {"table": make_grad(0)}
  plain = checked_jit(lambda g, s, p: opt.update(g, s, p), jit)
  extra = checked_jit(lambda g, s, p: opt.update(g, s, p, value=jnp.float32(3.0), other=1), jit)
  expected = plain(grads, state, params)
  got = extra(grads, state, params)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(a, b)


def test_flax_optimizer_passes_extra_args_to_the_chain():
  nnx = pytest.importorskip("flax.nnx")
  model = osa.SparseEmbed(NUM_ROWS, DIM, rngs=nnx.Rngs(0))
  tx = optax.chain(osa.sparse_adam(0.1), osa.lift_to_bcoo(optax.contrib.reduce_on_plateau()))
  optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)
  ids = jnp.array([1, 4])
  loss, grads = osa.sparse_value_and_grad(lambda m: (m(ids) ** 2).sum())(model)
  before = np.asarray(model.embedding[...])
  optimizer.update(model, grads, value=loss)
  after = np.asarray(model.embedding[...])
  assert not np.array_equal(after[[1, 4]], before[[1, 4]])
  np.testing.assert_array_equal(np.delete(after, [1, 4], 0), np.delete(before, [1, 4], 0))


def plateau():
  return optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1)


@pytest.mark.parametrize("flavour", ["adam", "adamw"])
def test_reduce_on_plateau_after_the_sparse_step(flavour, jit):
  """The chain scales the sparse step by the plateau's factor: checked against the sparse
  step alone times the scale that reduce_on_plateau reaches on the same losses."""
  make = {"adam": osa.sparse_adam, "adamw": osa.sparse_adamw}[flavour]
  opt = optax.chain(make(0.1), osa.lift_to_bcoo(plateau()))
  alone = make(0.1)
  params = {"table": table()}
  state, alone_state = opt.init(params), alone.init(params)
  scale_only = plateau()
  scale_state = scale_only.init(jnp.zeros(()))
  step = maybe_jit(lambda g, s, p, v: opt.update(g, s, p, value=v), jit)
  losses = [3.0, 2.0, 2.5, 2.5, 2.5, 2.5]  # a plateau after the second step
  scales = []
  for i, loss in enumerate(losses):
    grads = {"table": make_grad(i)}
    u, state = step(grads, state, params, jnp.float32(loss))
    u_alone, alone_state = alone.update(grads, alone_state, params)
    scale, scale_state = scale_only.update(jnp.ones(()), scale_state, value=jnp.float32(loss))
    scales.append(float(scale))
    np.testing.assert_allclose(
      u["table"].todense(), scale * u_alone["table"].todense(), rtol=1e-6, atol=1e-7
    )
    params = osa.apply_updates(params, u)
  assert min(scales) < 1.0  # the plateau was reached: the check above was not vacuous
  assert float(state[1].scale) == scales[-1]


def test_reduce_on_plateau_unlifted_is_refused_where_it_corrupts_the_indices():
  """reduce_on_plateau scales every leaf, a BCOO's indices too: the update is refused at
  apply_updates with a pointer to lift_to_bcoo, never applied to the wrong rows."""
  opt = optax.chain(osa.sparse_adam(0.1), plateau())
  params = {"table": table()}
  u, _ = opt.update({"table": make_grad(0)}, opt.init(params), params, value=jnp.float32(1.0))
  with pytest.raises(TypeError, match="lift_to_bcoo"):
    osa.apply_updates(params, u)


# --- 4. optax's generic helpers. ---


def test_tree_get_and_set_injected_hyperparameters(jit):
  opt = optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1, b1=0.9, b2=0.99)
  params = {"table": table()}
  state = opt.init(params)
  assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(0.1)
  step = maybe_jit(opt.update, jit)
  ref = NumpySparseAdam(np.asarray(params["table"]), lr=0.1, betas=(0.9, 0.99))
  lrs = [0.1, 0.1, 0.02, 0.05]
  for i, lr in enumerate(lrs):
    state = optax.tree.set(state, learning_rate=jnp.asarray(lr))
    assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(lr)
    g = make_grad(i)
    u, state = step({"table": g}, state, params)
    params = osa.apply_updates(params, u)
    rows, dense = rows_of(g)
    ref.step(rows[:, None], dense[rows], lr=lr)
  np.testing.assert_allclose(params["table"], ref.param, rtol=2e-5, atol=1e-6)
  assert int(state.inner_state.count) == len(lrs)


def test_sparse_adamw_takes_sparse_adams_flags_and_inject_hyperparams_sees_each():
  """`sparse_adamw(..., **flags)`: `AdamFlags` is sparse_adam's keyword-only flags but
  weight_decay, and `inspect.signature(sparse_adamw)` lists each one (inject_hyperparams binds
  against it: one `flags` dict would reach the factory as an unknown flag)."""
  adam = inspect.signature(osa.sparse_adam).parameters
  adamw = inspect.signature(osa.sparse_adamw).parameters
  flags = [n for n, p in adam.items() if p.kind is p.KEYWORD_ONLY and n != "weight_decay"]
  assert sorted(AdamFlags.__optional_keys__) == sorted(flags)
  assert [n for n, p in adamw.items() if p.kind is p.KEYWORD_ONLY] == flags
  assert [(n, p.default) for n, p in adamw.items()][:5] == [
    ("learning_rate", 1e-3),
    ("b1", 0.9),
    ("b2", 0.999),
    ("eps", 1e-8),
    ("weight_decay", 1e-2),
  ]
  with pytest.raises(TypeError, match="'momentum'"):
    osa.sparse_adamw(momentum=0.9)
  kwargs = {"learning_rate": 0.1, "weight_decay": 0.2, "amsgrad": True, "maximize": True}
  injected = optax.inject_hyperparams(osa.sparse_adamw)(**kwargs)
  params, grads = {"table": table()}, {"table": make_grad(0)}
  state = injected.init(params)
  assert sorted(state.hyperparams) == ["b1", "b2", "eps", "learning_rate", "weight_decay"]
  got, _ = injected.update(grads, state, params)
  direct = osa.sparse_adamw(**kwargs)
  want, want_state = direct.update(grads, direct.init(params), params)
  assert want_state.nu_max is not None
  np.testing.assert_allclose(got["table"].todense(), want["table"].todense(), rtol=1e-6)


def test_tree_get_finds_no_hyperparameter_without_injection():
  """As with optax.adam: hyper-parameters are in the state only through inject_hyperparams."""
  state = osa.sparse_adam(0.1).init({"table": table()})
  assert optax.tree.get(state, "learning_rate") is None
  assert int(optax.tree.get(state, "count")) == 0


def test_schedule_free_around_sparse_adam_equals_it_around_the_densified_step(jit):
  """schedule_free gives its base only the gradient and adds the base's updates to its dense
  z; around sparse_adam it equals schedule_free around the same step made dense. Its
  averaging moves every row at every step, so its updates are dense."""
  base = osa.sparse_adam(0.1)

  def densified_update(updates, state, params=None, **extra):
    u, state = base.update(updates, state, params, **extra)
    return jax.tree.map(
      lambda x: x.todense(), u, is_leaf=lambda x: isinstance(x, sparse.BCOO)
    ), state

  ours = optax.contrib.schedule_free(base, 0.1)
  ref = optax.contrib.schedule_free(
    optax.GradientTransformationExtraArgs(base.init, densified_update), 0.1
  )
  params = ref_params = {"table": table()}
  state, ref_state = ours.init(params), ref.init(params)
  step = maybe_jit(ours.update, jit)
  for i in range(4):
    g = {"table": make_grad(i)}
    with warnings.catch_warnings():
      # Its z adds the update densely, which it is told (tests/core/test_row_update.py).
      warnings.simplefilter("ignore", osa.DensifyingUpdateWarning)
      u, state = step(g, state, params)
    ru, ref_state = ref.update(g, ref_state, ref_params)
    assert not isinstance(u["table"], sparse.BCOO)
    params = osa.apply_updates(params, u)
    ref_params = optax.apply_updates(ref_params, ru)
  np.testing.assert_allclose(params["table"], ref_params["table"], rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(state.base_optimizer_state.param_steps, [4])


# --- 2. optax.tree.map_params and the state's structure. ---

FLAGS = {
  "plain": {},
  "amsgrad": {"amsgrad": True},
  "per_row": {"per_row_bias_correction": True},
  "all": {"amsgrad": True, "per_row_bias_correction": True},
  "catch_up": {"amsgrad": True, "catch_up_idle_rows": True},
}


def two_params():
  return {"table": table(), "bias": jnp.zeros(4), "none": None}


def fit_rank(leaf, spec):
  """A parameter's spec cut to the rank of a state leaf (per-row steps are 1-D)."""
  return P(*tuple(spec)[: jnp.ndim(leaf)])


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_state_structure_follows_the_flags_not_the_params(flags):
  opt = osa.sparse_adam(0.1, **FLAGS[flags])
  states = [opt.init(p) for p in ({}, {"a": jnp.zeros(2)}, two_params(), jnp.zeros((3, 2)))]
  for state in states:
    assert (state.nu_max is None) == ("amsgrad" not in FLAGS[flags])
    assert (state.row_step is None) == ("per_row_bias_correction" not in FLAGS[flags])
    assert (state.row_last_step is None) == ("catch_up_idle_rows" not in FLAGS[flags])
    assert state.param_steps.dtype == jnp.int32 and state.param_steps.ndim == 1
  assert [s.param_steps.shape[0] for s in states] == [0, 1, 2, 1]


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_map_params_gives_every_state_leaf_a_spec_of_its_rank(flags):
  opt = osa.sparse_adam(0.1, **FLAGS[flags])
  params = two_params()
  state = opt.init(params)
  param_specs = {"table": P("x", None), "bias": P(), "none": None}
  per_row = "per_row_bias_correction" in FLAGS[flags] or "catch_up_idle_rows" in FLAGS[flags]
  # The plain recipe (spec as is) where every per-parameter leaf has its parameter's rank;
  # with per-row bias correction the row steps are 1-D, so the spec is cut to the leaf's rank.
  fn = fit_rank if per_row else (lambda _, spec: spec)
  specs = optax.tree.map_params(opt, fn, state, param_specs, transform_non_params=lambda _: P())
  assert specs.count == P() and specs.param_steps == P()
  assert specs.mu == {"table": P("x", None), "bias": P(), "none": None}
  leaves = jax.tree.leaves(state)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  assert len(leaves) == len(spec_leaves)
  for leaf, spec in zip(leaves, spec_leaves, strict=True):
    assert len(spec) <= leaf.ndim, (leaf.shape, spec)
  if "per_row_bias_correction" in FLAGS[flags]:
    assert specs.row_step == {"table": P("x"), "bias": P(), "none": None}
  if "catch_up_idle_rows" in FLAGS[flags]:
    assert specs.row_last_step == {"table": P("x"), "bias": P(), "none": None}


def test_map_params_through_chains_and_wrappers():
  opt = optax.chain(
    osa.sparse_grad_checks(),
    optax.inject_hyperparams(osa.sparse_adamw)(learning_rate=0.1),
    osa.lift_to_bcoo(optax.contrib.reduce_on_plateau()),
  )
  opt = osa.sparse_apply_if_finite(opt, 2)
  params = {"table": table(), "bias": jnp.zeros(4)}
  state = opt.init(params)
  specs = optax.tree.map_params(
    opt,
    lambda _, s: s,
    state,
    {"table": P("x", None), "bias": P()},
    transform_non_params=lambda _: P(),
  )
  adam_specs = specs.inner_state[1].inner_state
  assert adam_specs.mu == {"table": P("x", None), "bias": P()}
  assert adam_specs.param_steps == P()


def test_step_is_a_view_of_param_steps(jit):
  opt = osa.sparse_adam(0.1)
  params = {"a": table(), "b": table(), "c": None}
  state = opt.init(params)
  step = maybe_jit(opt.update, jit)
  for i in range(3):
    grads = {"a": make_grad(i), "b": make_grad(10 + i) if i == 1 else None, "c": None}
    _, state = step(grads, state, params)
  np.testing.assert_array_equal(state.param_steps, [3, 1])
  assert jax.tree.map(int, state.step) == {"a": 3, "b": 1, "c": None}
  single = opt.init(table())
  _, single = opt.update(make_grad(0), single)
  assert int(single.step) == 1


def test_a_state_whose_step_counts_do_not_match_its_moments_is_refused():
  opt = osa.sparse_adam(0.1)
  params = {"table": table()}
  state = opt.init(params)
  bad = state._replace(param_steps=jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"param_steps has shape \(2,\).*from_step_tree"):
    opt.update({"table": make_grad(0)}, bad, params)


# --- Checkpoints saved in the 0.1.0 layout (step a tree like the params). ---


def old_layout(state):
  """A state as 0.1.0 saved it: the same fields, with `step` a tree of scalars."""
  fields = state._asdict()
  del fields["param_steps"]
  return {"step": state.step, **fields}


def test_from_step_tree_converts_the_old_layout_exactly():
  opt = osa.sparse_adam(0.1, amsgrad=True, per_row_bias_correction=True)
  params = {"table": table(), "bias": table()}
  state = opt.init(params)
  for i in range(3):
    grads = {"table": make_grad(i), "bias": None if i else make_grad(5)}
    _, state = opt.update(grads, state, params)
  converted = osa.SparseAdamState.from_step_tree(old_layout(state))
  assert jax.tree.structure(converted) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(state), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="step must be a tree like its mu"):
    osa.SparseAdamState.from_step_tree({**old_layout(state), "step": {"table": 1}})


def test_old_checkpoint_is_refused_by_orbax_and_loads_through_from_step_tree(tmp_path):
  opt = osa.sparse_adam(0.1)
  params = {"table": table()}
  state = opt.init(params)
  grads = [{"table": make_grad(i)} for i in range(4)]
  for g in grads[:2]:
    u, state = opt.update(g, state, params)
    params = osa.apply_updates(params, u)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "old", {"params": params, "opt_state": old_layout(state)})
  checkpointer.wait_until_finished()
  target = jax.tree.map(
    ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt.init(params)}
  )
  with pytest.raises(ValueError, match="param_steps"):
    checkpointer.restore(tmp_path / "old", target)
  raw = checkpointer.restore(tmp_path / "old")
  checkpointer.close()
  restored = osa.SparseAdamState.from_step_tree(raw["opt_state"])
  resumed = raw["params"]
  for g in grads[2:]:
    u, restored = opt.update(g, restored, resumed)
    resumed = osa.apply_updates(resumed, u)
    u, state = opt.update(g, state, params)
    params = osa.apply_updates(params, u)
  np.testing.assert_array_equal(resumed["table"], params["table"])
  np.testing.assert_array_equal(restored.param_steps, [4])
