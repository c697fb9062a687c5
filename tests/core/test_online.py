"""Online training: rows changed since a step, deltas to a serving copy, and reset rows.

The references are independent of the tracking: the rows a run touched are
counted in NumPy from its batches, a published serving copy is compared with
the trained table bit for bit, and a reset row's trajectory with a fresh
optimizer's on the same gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa

V, D, BATCH = 24, 3, 5

FACTORIES = {
  "adam": lambda **kw: osa.sparse_adam(0.05, **kw),
  "adam_amsgrad_rowbias": lambda **kw: osa.sparse_adam(
    0.05, amsgrad=True, per_row_bias_correction=True, **kw
  ),
  "adamw_catch_up": lambda **kw: osa.sparse_adamw(
    0.05, weight_decay=0.1, catch_up_idle_rows=True, **kw
  ),
  "sgd": lambda **kw: osa.sparse_sgd(0.1, **kw),
  "sgd_momentum_catch_up": lambda **kw: osa.sparse_sgd(
    0.1, momentum=0.9, catch_up_idle_rows=True, **kw
  ),
  "sgd_lazy_momentum": lambda **kw: osa.sparse_sgd(0.1, momentum=0.9, lazy_momentum=True, **kw),
  "adagrad": lambda **kw: osa.sparse_adagrad(0.1, initial_accumulator_value=0.25, **kw),
  "rowwise_adagrad": lambda **kw: osa.sparse_rowwise_adagrad(
    0.1, weight_decay=0.01, weight_decay_mode="decoupled", **kw
  ),
  "rule_transformation": lambda **kw: osa.sparse_rule_transformation(
    osa.SGDRule(), osa.SGDHyperparams(learning_rate=0.2), **kw
  ),
}


def batches(num, seed=0, vocab=V):
  rng = np.random.default_rng(seed)
  return [
    (rng.integers(0, vocab, BATCH), rng.normal(size=(BATCH, D)).astype(np.float32))
    for _ in range(num)
  ]


def bcoo(ids, rows, num_rows=V):
  return sparse.BCOO((jnp.asarray(rows), jnp.asarray(ids)[:, None]), shape=(num_rows, D))


@functools.cache
def make(name, track=True):
  opt = FACTORIES[name](track_changed_rows=track)

  @jax.jit
  def step(params, state, ids, rows):
    grads = {"user": bcoo(ids, rows), "item": None}
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  return opt, step


def fresh_params(seed=1):
  rng = np.random.default_rng(seed)
  return {
    "user": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
    "item": jnp.asarray(rng.normal(size=(8, D)), jnp.float32),
  }


def bits(x):
  return np.asarray(x).view(np.uint32)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_online_run_publishes_deltas_equal_bit_for_bit(name):
  opt, step = make(name)
  params = fresh_params()
  state = opt.init(params)
  serving = jax.tree.map(jnp.copy, params)
  since, touched = 0, set()
  for i, (ids, rows) in enumerate(batches(7)):
    params, state = step(params, state, ids, rows)
    touched |= set(ids.tolist())
    if i % 3 == 2 or i == 6:
      changed = osa.changed_rows(state, since)
      # The rows the batches touched since the last publish, counted here.
      assert changed["user"].tolist() == sorted(touched)
      assert changed["item"].tolist() == []  # a None gradient writes nothing
      delta = osa.rows_delta(params, state, since)
      assert int(delta.counts["user"]) == len(touched)
      assert delta.ids["user"].shape[0] >= len(touched)
      serving = osa.apply_rows_delta(serving, delta)
      for key in params:
        np.testing.assert_array_equal(bits(serving[key]), bits(params[key]))
      since, touched = delta.steps, set()


@pytest.mark.parametrize("name", ["adam", "adamw_catch_up", "sgd_lazy_momentum", "rowwise_adagrad"])
def test_tracking_changes_no_number_of_the_step(name):
  runs = []
  for track in (False, True):
    opt, step = make(name, track)
    params = fresh_params()
    state = opt.init(params)
    for ids, rows in batches(4):
      params, state = step(params, state, ids, rows)
    runs.append((params, state))
  (p0, s0), (p1, s1) = runs
  np.testing.assert_array_equal(bits(p0["user"]), bits(p1["user"]))
  for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1), strict=False):
    if a.shape == b.shape and a.dtype == b.dtype:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if "catch_up" not in name:
    assert s0.row_last_step is None
  assert s1.row_last_step["user"].dtype == jnp.int32
  assert s1.row_last_step["user"].shape == (V,)


def test_state_structure_follows_the_flags_not_the_params():
  for name in ("adam", "adagrad"):
    opt = FACTORIES[name](track_changed_rows=True)
    empty = opt.init({})
    full = opt.init(fresh_params())
    assert type(empty) is type(full)
    assert empty.row_last_step is not None and full.row_last_step is not None
    # optax.tree.map_params finds the per-row array among the params' fields.
    mapped = optax.tree.map_params(opt.init, lambda x: x, full)
    assert mapped.row_last_step["user"].shape == (V,)


# Rules whose row trajectory does not read the parameter's step count: a reset row then
# trained is a fresh optimizer's row (Adam with per-row bias correction counts the row's).
RESET_FRESH = ["adam_amsgrad_rowbias", "sgd_lazy_momentum", "adagrad", "rowwise_adagrad", "sgd"]


@pytest.mark.parametrize("name", RESET_FRESH)
def test_reset_row_then_trained_is_a_fresh_optimizers_row(name):
  opt, step = make(name)
  params = fresh_params()
  state = opt.init(params)
  for ids, rows in batches(4):
    params, state = step(params, state, ids, rows)
  row, start = 7, np.float32([0.5, -1.0, 2.0])
  params, state = osa.reset_rows(
    opt, params, state, {"user": jnp.array([row])}, values={"user": start[None]}
  )
  fresh = {"user": jnp.zeros((V, D)).at[row].set(start), "item": jnp.zeros((8, D))}
  fresh_state = opt.init(fresh)
  for ids, rows in batches(3, seed=5):
    ids = np.where(np.arange(BATCH) < 2, row, ids)  # the row in every batch
    params, state = step(params, state, ids, rows)
    mask = ids == row
    fresh, fresh_state = step(fresh, fresh_state, np.where(mask, row, V), rows)
    np.testing.assert_array_equal(bits(params["user"][row]), bits(fresh["user"][row]))


def per_row_leaves(state):
  """The user table's per-row state: every slot and the row steps (not the last steps)."""
  if isinstance(state, osa.SparseAdamState):
    fields = [state.mu, state.nu, state.nu_max, state.row_step]
  else:
    fields = [*state.slots.values(), state.row_step]
  return [f["user"] for f in fields if f is not None]


@pytest.mark.parametrize(
  "name", ["adam", "adam_amsgrad_rowbias", "sgd_momentum_catch_up", "adagrad"]
)
def test_reset_sets_every_per_row_slot_to_inits(name):
  opt, step = make(name)
  params = fresh_params()
  state = opt.init(params)
  for ids, rows in batches(3):
    params, state = step(params, state, ids, rows)
  ids = np.unique(batches(3)[0][0])[:3]
  new_params, new_state = osa.reset_rows(opt, params, state, {"user": jnp.asarray(ids)})
  init = opt.init(params)
  other = np.setdiff1d(np.arange(V), ids)
  for a, b, c in zip(
    per_row_leaves(new_state), per_row_leaves(init), per_row_leaves(state), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a)[ids], np.asarray(b)[ids])
    np.testing.assert_array_equal(np.asarray(a)[other], np.asarray(c)[other])
  # Params without values are left; the last step is the next one's.
  np.testing.assert_array_equal(np.asarray(new_params["user"]), np.asarray(params["user"]))
  assert set(np.asarray(new_state.row_last_step["user"])[ids].tolist()) == {4}
  # The next delta holds the reset rows, even though no step touched them.
  assert set(ids.tolist()) <= set(osa.changed_rows(new_state, 3)["user"].tolist())


def test_catch_up_treats_a_reset_row_as_new():
  opt, step = make("adamw_catch_up")
  params = fresh_params()
  state = opt.init(params)
  for ids, rows in batches(4):
    params, state = step(params, state, ids, rows)
  start = np.float32([[1.0, 2.0, 3.0]])
  params, state = osa.reset_rows(
    opt, params, state, {"user": jnp.array([7])}, values={"user": start}
  )
  # Catch-up charges the reset row no idle steps (the weight decay of AdamW would move it).
  caught, _ = osa.catch_up_all_rows(opt, params, state)
  np.testing.assert_array_equal(np.asarray(caught["user"][7]), start[0])
  # A row never reset, idle as long, is moved by the catch-up.
  idle = [r for r in range(V) if int(state.row_last_step["user"][r]) == 0][0]
  assert not np.array_equal(np.asarray(caught["user"][idle]), np.asarray(params["user"][idle]))


def test_reset_under_jit_with_donation():
  opt, step = make("adagrad")
  params = fresh_params()
  state = opt.init(params)
  for ids, rows in batches(2):
    params, state = step(params, state, ids, rows)
  expected = osa.reset_rows(opt, params, state, {"user": jnp.array([1, 4])})
  reset = jax.jit(functools.partial(osa.reset_rows, opt), donate_argnums=(0, 1))
  got = reset(
    jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state), {"user": jnp.array([1, 4])}
  )
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_deltas_survive_an_orbax_checkpoint(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  opt, step = make("adam")
  params = fresh_params()
  state = opt.init(params)
  serving = jax.tree.map(jnp.copy, params)
  data = batches(6)
  for ids, rows in data[:3]:
    params, state = step(params, state, ids, rows)
  delta = osa.rows_delta(params, state, 0)
  serving = osa.apply_rows_delta(serving, delta)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "state": state, "since": delta.steps})
  checkpointer.wait_until_finished()
  target = {"params": params, "state": state, "since": delta.steps}
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  params, state, since = restored["params"], restored["state"], restored["since"]
  assert isinstance(state, osa.SparseAdamState)
  for ids, rows in data[3:]:
    params, state = step(params, state, ids, rows)
  serving = osa.apply_rows_delta(serving, osa.rows_delta(params, state, since))
  np.testing.assert_array_equal(bits(serving["user"]), bits(params["user"]))
  touched = set(np.concatenate([ids for ids, _ in data[3:]]).tolist())
  assert osa.changed_rows(state, since)["user"].tolist() == sorted(touched)


def trained(name="adam"):
  opt, step = make(name)
  params = fresh_params()
  state = opt.init(params)
  for ids, rows in batches(2):
    params, state = step(params, state, ids, rows)
  return opt, params, state


def unchanged(before, after):
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_ids_and_tables_are_refused_and_change_nothing():
  opt, params, state = trained()
  copy = jax.tree.map(jnp.copy, (params, state))
  with pytest.raises(ValueError, match=r"\['user'\] has 24 rows, but ids holds 24"):
    osa.reset_rows(opt, params, state, {"user": jnp.array([3, 24])})
  with pytest.raises(ValueError, match=r"ids holds -1"):
    osa.reset_rows(opt, params, state, {"user": jnp.array([-1])})
  with pytest.raises(ValueError, match=r"names a table at \['users'\].*\['item'\], \['user'\]"):
    osa.reset_rows(opt, params, state, {"users": jnp.array([3])})
  with pytest.raises(ValueError, match=r"values has shape \(1, 2\).*need \(1, 3\)"):
    osa.reset_rows(opt, params, state, {"user": jnp.array([3])}, values={"user": jnp.ones((1, 2))})
  with pytest.raises(TypeError, match="ids must be integers"):
    osa.reset_rows(opt, params, state, {"user": jnp.array([1.0])})
  with pytest.raises(ValueError, match="needs the transformation returned by"):
    osa.reset_rows(optax.sgd(0.1), params, state, {"user": jnp.array([1])})
  unchanged(copy, (params, state))
  unchanged(copy, osa.reset_rows(opt, params, state, {"user": []}))  # no rows: no change


def test_bad_since_and_serving_copies_are_refused():
  opt, params, state = trained()
  with pytest.raises(ValueError, match="since=3 is in the future: the optimizer has taken 2"):
    osa.changed_rows(state, 3)
  with pytest.raises(ValueError, match="since=1 for parameter 0 is in the future.*taken 0 steps"):
    osa.changed_rows(state, np.array([1, 1]))
  with pytest.raises(ValueError, match="is negative"):
    osa.rows_delta(params, state, -1)
  with pytest.raises(ValueError, match=r"since has shape \(3,\)"):
    osa.changed_rows(state, np.array([0, 0, 0]))
  with pytest.raises(TypeError, match="since must be an int"):
    osa.changed_rows(state, 1.5)
  untracked = osa.sparse_adam(0.1)
  with pytest.raises(ValueError, match="track_changed_rows=True"):
    osa.changed_rows(untracked.init(params), 0)
  delta = osa.rows_delta(params, state, 0)
  serving = jax.tree.map(jnp.copy, params)
  with pytest.raises(ValueError, match=r"the table at \['user'\].*dtype"):
    osa.apply_rows_delta({**serving, "user": serving["user"].astype(jnp.bfloat16)}, delta)
  small = {"item": serving["item"], "user": serving["user"][:4]}
  with pytest.raises(ValueError, match=r"\['user'\] has 4 rows, but the delta's ids reach"):
    osa.apply_rows_delta(small, delta)
  with pytest.raises(ValueError, match="structure of the state's tables"):
    osa.apply_rows_delta({"user": serving["user"]}, delta)
  unchanged(params, serving)


def test_a_state_of_another_flag_is_refused():
  opt, params, state = trained()
  untracked = osa.sparse_adam(0.05)
  grads = {"user": bcoo(np.array([1]), np.ones((1, D), np.float32)), "item": None}
  with pytest.raises(ValueError, match="has row_last_step.*track_changed_rows=False"):
    untracked.update(grads, state, params)
  with pytest.raises(ValueError, match="lacks row_last_step.*track_changed_rows=True"):
    opt.update(grads, untracked.init(params), params)
  with pytest.raises(TypeError, match="track_changed_rows must be True or False"):
    osa.sparse_sgd(0.1, track_changed_rows=1)


@pytest.mark.parametrize("name", ["adam", "adamw_catch_up", "adagrad"])
def test_every_path_tracks_the_same_rows(name):
  """The CPU kernels, the accelerator step (forced here on the CPU) and the XLA ops."""
  from optax_sparse_adam._backends import choice

  opt = FACTORIES[name](track_changed_rows=True)

  def step(params, state, ids, rows):
    updates, state = opt.update({"user": bcoo(ids, rows), "item": None}, state, params)
    return osa.apply_updates(params, updates), state

  runs = []
  for forced in (None, choice.ACCELERATOR, choice.GENERIC_XLA):
    with choice.choose(forced=forced):
      jitted = jax.jit(step)
      params = fresh_params()
      state = opt.init(params)
      for ids, rows in batches(3):
        params, state = jitted(params, state, ids, rows)
    runs.append((params, state))
  (p0, s0), *others = runs
  for p, s in others:
    np.testing.assert_array_equal(
      np.asarray(s.row_last_step["user"]), np.asarray(s0.row_last_step["user"])
    )
    np.testing.assert_allclose(np.asarray(p["user"]), np.asarray(p0["user"]), rtol=1e-6)
  touched = np.unique(np.concatenate([ids for ids, _ in batches(3)]))
  assert osa.changed_rows(s0, 0)["user"].tolist() == touched.tolist()


def test_inside_multi_transform_with_masked_params():
  params = {"emb": jnp.zeros((6, D)), "w": jnp.ones(3)}
  sparse_opt = osa.sparse_adam(0.1, track_changed_rows=True)
  opt = optax.multi_transform(
    {"sparse": sparse_opt, "dense": optax.adam(0.1)}, {"emb": "sparse", "w": "dense"}
  )
  state = opt.init(params)
  grads = {"emb": bcoo(np.array([4, 1]), np.ones((2, D), np.float32), 6), "w": jnp.ones(3)}
  updates, state = opt.update(grads, state, params)
  params = osa.apply_updates(params, updates)
  inner = state.inner_states["sparse"].inner_state
  with pytest.raises(ValueError, match="optax.MaskedNode"):
    osa.rows_delta(params, inner, 0)
  masked = {"emb": params["emb"], "w": optax.MaskedNode()}
  delta = osa.rows_delta(masked, inner, 0)
  assert delta.ids["emb"].tolist() == [1, 4]
  serving = osa.apply_rows_delta({"emb": jnp.zeros((6, D)), "w": optax.MaskedNode()}, delta)
  np.testing.assert_array_equal(bits(serving["emb"]), bits(params["emb"]))
  _, reset = osa.reset_rows(sparse_opt, masked, inner, {"emb": jnp.array([4])})
  assert not np.asarray(reset.mu["emb"][4]).any() and np.asarray(reset.mu["emb"][1]).any()


def test_cyclic_tables_are_refused():
  opt, params, state = trained()
  with osa.sharded_routing(row_placement="cyclic"):
    with pytest.raises(ValueError, match="row_placement='cyclic'"):
      osa.changed_rows(state, 0)
    with pytest.raises(ValueError, match="row_placement='cyclic'"):
      osa.reset_rows(opt, params, state, {"user": jnp.array([1])})
