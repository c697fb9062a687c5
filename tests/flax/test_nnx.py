"""Flax NNX glue: BCOO table gradients, SparseOptimizer, and the compiled train step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests._helpers import NumpySparseAdam, dense_table_temporaries

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402
from jax.experimental import sparse  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402

# Distinct from every other dim in these models, so 'f32[V,D]' names only tables.
NUM_USERS, NUM_ITEMS, DIM, HIDDEN = 1013, 517, 6, 5


class TwoTower(nnx.Module):
  """Users and items tables; the item table is looked up twice (item and a 'context' item)."""

  def __init__(self, embed_cls, rngs):
    self.users = embed_cls(NUM_USERS, DIM, rngs=rngs)
    self.items = embed_cls(NUM_ITEMS, DIM, rngs=rngs)
    self.user_tower = nnx.Linear(DIM, HIDDEN, rngs=rngs)
    self.item_tower = nnx.Linear(DIM, HIDDEN, rngs=rngs)

  def __call__(self, users, items, context):
    u = self.user_tower(self.users(users) + 0.5 * self.items(context))
    v = self.item_tower(self.items(items))
    return jnp.sum(jnp.tanh(u) * v, axis=-1)


def make_models(seed=0):
  sparse_model = TwoTower(osa.SparseEmbed, nnx.Rngs(seed))
  dense_model = TwoTower(nnx.Embed, nnx.Rngs(seed))
  return sparse_model, dense_model


def batch(seed, size=16):
  rng = np.random.default_rng(seed)
  # Repeated ids on purpose: duplicates within a lookup and across the two item lookups.
  users = rng.integers(0, 40, size)
  items = rng.integers(0, 30, size)
  context = rng.integers(0, 30, size)
  ratings = rng.normal(size=size).astype(np.float32)
  return tuple(jnp.asarray(x) for x in (users, items, context, ratings))


def loss_fn(model, users, items, context, ratings):
  return jnp.mean((model(users, items, context) - ratings) ** 2)


def bcoo_leaves(tree):
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, sparse.BCOO))
  return [x for x in leaves if isinstance(x, sparse.BCOO)]


def test_sparse_embed_is_initialised_and_reads_like_nnx_embed():
  sparse_model, dense_model = make_models()
  ids = jnp.array([[0, 5], [NUM_USERS - 1, 5]])
  np.testing.assert_array_equal(sparse_model.users.embedding[...], dense_model.users.embedding[...])
  np.testing.assert_array_equal(sparse_model.users(ids), dense_model.users(ids))
  assert isinstance(sparse_model.users.embedding, osa.SparseTable)


@pytest.mark.parametrize("jit", [False, True])
def test_table_gradients_densified_equal_dense_jax_grad(jit):
  sparse_model, dense_model = make_models()
  data = batch(1)

  def sparse_step(model, *data):
    return osa.sparse_value_and_grad(loss_fn)(model, *data)

  def dense_step(model, *data):
    return nnx.value_and_grad(loss_fn)(model, *data)

  if jit:
    sparse_step, dense_step = nnx.jit(sparse_step), nnx.jit(dense_step)
  loss, grads = sparse_step(sparse_model, *data)
  dense_loss, dense_grads = dense_step(dense_model, *data)

  np.testing.assert_allclose(loss, dense_loss, rtol=1e-6)
  for name in ("users", "items"):
    grad = grads[name]["embedding"].get_value()
    assert isinstance(grad, sparse.BCOO) and grad.shape == (
      dense_grads[name]["embedding"][...].shape
    )
    np.testing.assert_allclose(
      grad.todense(), dense_grads[name]["embedding"][...], rtol=1e-5, atol=1e-7
    )
  # Two lookups of the item table: both sets of entries are there, duplicates kept.
  assert grads["items"]["embedding"].get_value().nse == 2 * data[0].size
  for tower in ("user_tower", "item_tower"):
    for leaf in ("kernel", "bias"):
      np.testing.assert_allclose(
        grads[tower][leaf][...], dense_grads[tower][leaf][...], rtol=1e-5, atol=1e-7
      )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_dtype_follows_the_table(dtype):
  model = osa.SparseEmbed(NUM_ITEMS, DIM, param_dtype=dtype, rngs=nnx.Rngs(0))
  twin = nnx.Embed(NUM_ITEMS, DIM, param_dtype=dtype, rngs=nnx.Rngs(0))
  ids = jnp.array([[4, 4], [9, 0]])
  target = jnp.linspace(-1.0, 1.0, DIM)

  def loss(model):
    return jnp.sum((model(ids).astype(jnp.float32) - target) ** 2)

  grad = nnx.jit(osa.sparse_grad(loss))(model)["embedding"].get_value()
  dense = nnx.jit(nnx.grad(loss))(twin)["embedding"][...]
  assert grad.dtype == dtype and dense.dtype == dtype
  np.testing.assert_array_equal(
    np.asarray(grad.todense(), np.float32), np.asarray(dense, np.float32)
  )


def test_table_shared_by_two_towers_accumulates():
  class Shared(nnx.Module):
    def __init__(self, rngs):
      table = osa.SparseEmbed(NUM_ITEMS, DIM, rngs=rngs)
      self.left = nnx.Dict(embed=table, proj=nnx.Linear(DIM, 1, rngs=rngs))
      self.right = nnx.Dict(embed=table, proj=nnx.Linear(DIM, 1, rngs=rngs))

    def __call__(self, a, b):
      return self.left["proj"](self.left["embed"](a)) * self.right["proj"](self.right["embed"](b))

  model = Shared(nnx.Rngs(3))
  a, b = jnp.array([1, 2, 2]), jnp.array([2, 9, 1])

  def loss(model):
    return jnp.sum(model(a, b) ** 2)

  grads = nnx.jit(osa.sparse_grad(loss))(model)
  dense_grads = nnx.jit(nnx.grad(loss))(model)
  # The shared table appears once in the state, with the entries of both lookups.
  (table_grad,) = bcoo_leaves(grads)
  assert table_grad.nse == a.size + b.size
  np.testing.assert_allclose(
    table_grad.todense(), dense_grads["left"]["embed"]["embedding"][...], rtol=1e-5, atol=1e-7
  )


def test_padding_ids_read_zero_rows_and_get_no_gradient():
  model = osa.SparseEmbed(NUM_ITEMS, DIM, rngs=nnx.Rngs(0))
  ids = jnp.array([3, -1, NUM_ITEMS, 3, NUM_ITEMS + 7])
  rows = model(ids)
  np.testing.assert_array_equal(rows[1], 0.0)
  np.testing.assert_array_equal(rows[2], 0.0)

  def loss(model):
    return jnp.sum(model(ids) ** 2) + jnp.sum(model(jnp.array([4])))

  grad = nnx.jit(osa.sparse_grad(loss))(model)["embedding"].get_value()
  # Padding ids map to the out-of-range row V, which every consumer drops.
  np.testing.assert_array_equal(grad.indices[:, 0], [3, NUM_ITEMS, NUM_ITEMS, 3, NUM_ITEMS, 4])
  table = model.embedding[...]
  expected = np.zeros(table.shape, np.float32)
  expected[3] = 4 * table[3]
  expected[4] = 1.0
  np.testing.assert_allclose(grad.todense(), expected, rtol=1e-6)


def test_table_not_looked_up_gets_none_and_keeps_its_step():
  model, _ = make_models()
  users, items, context, ratings = batch(2)
  tx = optax.multi_transform(
    {"sparse": osa.sparse_adam(0.1), "dense": optax.adam(0.1)}, osa.table_labels(model)
  )
  optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)
  items_before = model.items.embedding[...]

  def users_only(model):
    return jnp.mean((model.user_tower(model.users(users)).sum(-1) - ratings) ** 2)

  grads = nnx.jit(osa.sparse_grad(users_only))(model)
  assert grads["items"]["embedding"].get_value() is None
  assert isinstance(grads["users"]["embedding"].get_value(), sparse.BCOO)
  nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))(model, optimizer, grads)
  np.testing.assert_array_equal(model.items.embedding[...], items_before)
  steps = optimizer.opt_state.inner_states["sparse"].inner_state.step
  assert int(steps["users"]["embedding"][...]) == 1
  assert int(steps["items"]["embedding"][...]) == 0


def test_has_aux_and_mutable_state_are_returned_like_nnx_value_and_grad():
  class Counting(nnx.Module):
    def __init__(self, rngs):
      self.embed = osa.SparseEmbed(NUM_ITEMS, DIM, rngs=rngs)
      self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, ids):
      self.calls[...] += 1
      return self.embed(ids)

  model = Counting(nnx.Rngs(0))

  def loss(model, ids):
    rows = model(ids)
    return jnp.sum(rows), {"rows": rows}

  (value, aux), grads = osa.sparse_value_and_grad(loss, has_aux=True)(model, jnp.array([1, 2]))
  np.testing.assert_allclose(aux["rows"], model.embed.embedding[...][jnp.array([1, 2])])
  np.testing.assert_allclose(value, aux["rows"].sum(), rtol=1e-6)
  # The forward's mutation reached the model once (the shape pass is discarded).
  assert int(model.calls[...]) == 1
  assert "calls" not in grads
  grads_only, aux_only = osa.sparse_grad(loss, has_aux=True)(model, jnp.array([3]))
  assert bcoo_leaves(grads_only)[0].nse == 1 and aux_only["rows"].shape == (1, DIM)
  assert int(model.calls[...]) == 2


def test_dropout_rng_state_advances_like_nnx_value_and_grad():
  class WithDropout(nnx.Module):
    def __init__(self, embed_cls, rngs):
      self.embed = embed_cls(NUM_ITEMS, DIM, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, ids):
      return self.dropout(self.embed(ids))

  model = WithDropout(osa.SparseEmbed, nnx.Rngs(0, dropout=1))
  twin = WithDropout(nnx.Embed, nnx.Rngs(0, dropout=1))
  ids = jnp.array([2, 3, 3])

  def loss(model):
    return jnp.sum(model(ids) ** 2)

  for _ in range(2):  # each call draws a fresh mask, the same one on both sides
    value, grads = nnx.jit(osa.sparse_value_and_grad(loss))(model)
    twin_value, twin_grads = nnx.jit(nnx.value_and_grad(loss))(twin)
    np.testing.assert_allclose(value, twin_value, rtol=1e-6)
    np.testing.assert_allclose(
      grads["embed"]["embedding"].get_value().todense(),
      twin_grads["embed"]["embedding"][...],
      rtol=1e-6,
    )
  counts = jax.tree.leaves(nnx.state(model, nnx.RngCount))
  assert counts == jax.tree.leaves(nnx.state(twin, nnx.RngCount)) and 2 in counts


def test_argnums_selects_the_model():
  model = osa.SparseEmbed(NUM_ITEMS, DIM, rngs=nnx.Rngs(0))

  def loss(scale, model):
    return scale * jnp.sum(model(jnp.array([5])))

  grads = osa.sparse_grad(loss, argnums=1)(2.0, model)
  np.testing.assert_allclose(grads["embedding"].get_value().data, 2.0 * np.ones((1, DIM)))


def reference_train(model, data_batches, lr, weight_decay):
  """Torch-semantics reference: dense jax.grad, NumPy SparseAdam on tables, dense AdamW."""
  tables = {
    name: NumpySparseAdam(getattr(model, name).embedding[...], lr=lr, dtype=np.float32)
    for name in ("users", "items")
  }
  towers = ("user_tower", "item_tower")
  dense_tx = optax.adamw(lr, weight_decay=weight_decay)
  tower_params = {k: nnx.as_pure(nnx.state(getattr(model, k))) for k in towers}
  opt_state = dense_tx.init(tower_params)
  dense_grad_fn = nnx.jit(nnx.grad(loss_fn))
  for users, items, context, ratings in data_batches:
    grads = dense_grad_fn(model, users, items, context, ratings)
    touched = {
      "users": np.unique(np.asarray(users)),
      "items": np.unique(np.concatenate([np.asarray(items), np.asarray(context)])),
    }
    for name, ref in tables.items():
      dense_grad = np.asarray(grads[name]["embedding"][...])
      ref.step(touched[name][:, None], dense_grad[touched[name]])
      getattr(model, name).embedding[...] = jnp.asarray(ref.param)
    tower_grads = {k: nnx.as_pure(grads[k]) for k in towers}
    updates, opt_state = dense_tx.update(tower_grads, opt_state, tower_params)
    tower_params = optax.apply_updates(tower_params, updates)
    for k in towers:
      nnx.update(getattr(model, k), tower_params[k])
  return model


def make_optimizer(model, lr, weight_decay):
  tx = optax.multi_transform(
    {"sparse": osa.sparse_adam(lr), "dense": optax.adamw(lr, weight_decay=weight_decay)},
    osa.table_labels(model),
  )
  return osa.SparseOptimizer(model, tx, wrt=nnx.Param)


@pytest.mark.parametrize("form", ["nnx.jit", "cached_partial"])
def test_training_matches_torch_semantics_reference_under_nnx_jit_with_donation(form):
  lr, weight_decay, steps = 0.05, 0.01, 6
  model, _ = make_models(seed=4)
  ref_model, _ = make_models(seed=4)
  optimizer = make_optimizer(model, lr, weight_decay)

  @nnx.jit(donate_argnums=(0, 1))
  def train_step(model, optimizer, users, items, context, ratings):
    loss, grads = osa.sparse_value_and_grad(loss_fn)(model, users, items, context, ratings)
    optimizer.update(model, grads)
    return loss

  batches = [batch(10 + s) for s in range(steps)]
  if form == "cached_partial":  # the form the docs show first: the graph walk is cached
    cached_step = nnx.cached_partial(train_step, model, optimizer)
    for data in batches:
      cached_step(*data)
  else:
    for data in batches:
      train_step(model, optimizer, *data)
  assert train_step.jitted_fn._cache_size() == 1
  reference_train(ref_model, batches, lr, weight_decay)
  for name in ("users", "items"):
    np.testing.assert_allclose(
      getattr(model, name).embedding[...],
      getattr(ref_model, name).embedding[...],
      rtol=2e-5,
      atol=2e-6,
    )
  for tower in ("user_tower", "item_tower"):
    np.testing.assert_allclose(
      getattr(model, tower).kernel[...], getattr(ref_model, tower).kernel[...], rtol=2e-5, atol=2e-6
    )
  # Untouched rows and their moments never moved.
  untouched = np.setdiff1d(np.arange(NUM_USERS), np.concatenate([b[0] for b in batches]))
  mu = optimizer.opt_state.inner_states["sparse"].inner_state.mu["users"]["embedding"][...]
  np.testing.assert_array_equal(mu[untouched], 0.0)
  assert int(optimizer.step[...]) == steps


def walked(*nodes):
  """(graph nodes, Variables) that `nnx.jit` walks for `nodes` at each call."""
  graphdef, state = nnx.split(nodes)
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return len(graphdef.nodes), len(variables)


def test_nnx_jit_walks_less_for_the_sparse_path_than_for_the_dense_one():
  """Counts, not timings: what `nnx.jit` walks at each call cannot creep back up.

  `nnx.Optimizer` makes a Variable and a graph node per container for every leaf of the
  optax state; under `multi_transform` that is a masked params tree per moment per branch.
  `SparseOptimizer` holds the state in one Variable.
  """
  sparse_model, dense_model = make_models()
  sparse_opt = make_optimizer(sparse_model, 0.01, 0.01)
  dense_opt = nnx.Optimizer(dense_model, optax.adam(0.01), wrt=nnx.Param)
  sparse_nodes, sparse_variables = walked(sparse_model, sparse_opt)
  dense_nodes, dense_variables = walked(dense_model, dense_opt)
  assert sparse_nodes <= dense_nodes and sparse_variables <= dense_variables
  # The optimizer: `step` and `opt_state`, whatever the model; the graph does not grow with it.
  assert walked(sparse_opt)[1] == 2
  small = osa.SparseEmbed(7, 3, rngs=nnx.Rngs(0))
  assert walked(make_optimizer(small, 0.01, 0.01))[0] == walked(sparse_opt)[0]
  assert walked(sparse_model, sparse_opt)[0] == walked(sparse_model)[0] + walked(sparse_opt)[0] - 1
  # The state inside the Variable reads as the optax state.
  assert isinstance(sparse_opt.opt_state.get_value(), optax.transforms.PartitionState)


def test_sharding_metadata_keeps_per_leaf_state_variables_for_get_partition_spec():
  """With `out_sharding` metadata on the params, the state keeps `nnx.Optimizer`'s layout."""
  model = nnx.Linear(
    3, 2, kernel_metadata={"out_sharding": (None, "x"), "eager_sharding": False}, rngs=nnx.Rngs(0)
  )
  optimizer = osa.SparseOptimizer(model, optax.adam(0.1), wrt=nnx.Param)
  specs = nnx.get_partition_spec(nnx.state(optimizer))
  assert specs["opt_state"][0]["mu"]["kernel"].get_value() == jax.sharding.PartitionSpec(None, "x")
  grads = nnx.grad(lambda m: (m(jnp.ones((1, 3))) ** 2).sum())(model)
  optimizer.update(model, grads)
  adam = optimizer.opt_state[0]
  assert isinstance(adam.mu["kernel"], nnx.Variable) and int(adam.count[...]) == 1
  np.testing.assert_allclose(adam.mu["kernel"][...], 0.1 * grads["kernel"][...], rtol=1e-6)


def pure_train_step(model, optimizer):
  """`(jitted_step, graphdef, state)`: the model and optimizer as one donated pytree."""
  graphdef, state = nnx.split((model, optimizer))

  def step(state, users, items, context, ratings):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = osa.sparse_value_and_grad(loss_fn)(model, users, items, context, ratings)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))

  return jax.jit(step, donate_argnums=0), graphdef, state


def test_dense_baseline_fails_the_hlo_check():
  # The check can fail: nnx.Embed + optax.adam builds V x D gradients and updates.
  _, model = make_models()
  optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, users, items, context, ratings):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(loss_fn)(model, users, items, context, ratings)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  compiled = jax.jit(step, donate_argnums=0).lower(state, *batch(0)).compile()
  assert dense_table_temporaries(compiled, f"f32[{NUM_USERS},{DIM}]", 3) != []


def test_compiled_train_step_has_no_dense_table_temporary_and_matches_the_reference():
  lr, steps = 0.02, 3
  model, _ = make_models(seed=7)
  ref_model, _ = make_models(seed=7)
  step, graphdef, state = pure_train_step(model, make_optimizer(model, lr, 0.0))
  batches = [batch(20 + s) for s in range(steps)]
  compiled = step.lower(state, *batches[0]).compile()
  for num_rows in (NUM_USERS, NUM_ITEMS):
    # The table, mu and nu; each written only by a scatter into its donated buffer.
    assert dense_table_temporaries(compiled, f"f32[{num_rows},{DIM}]", 3) == []
  # The step that was checked is the one that trains correctly.
  for data in batches:
    _, state = compiled(state, *data)
  trained, _ = nnx.merge(graphdef, state)
  reference_train(ref_model, batches, lr, 0.0)
  for name in ("users", "items"):
    np.testing.assert_allclose(
      getattr(trained, name).embedding[...],
      getattr(ref_model, name).embedding[...],
      rtol=2e-5,
      atol=2e-6,
    )


def test_labels_route_tables_to_sparse_adam_and_the_rest_to_the_dense_transform():
  model, _ = make_models()
  labels = osa.table_labels(model)
  assert labels["users"]["embedding"] == "sparse" and labels["items"]["embedding"] == "sparse"
  assert labels["user_tower"]["kernel"] == "dense"
  state = make_optimizer(model, 0.01, 0.01).opt_state.inner_states
  # sparse_adam keeps moments for the tables only; adamw none for them.
  sparse_mu = state["sparse"].inner_state.mu
  assert sparse_mu["users"]["embedding"][...].shape == (NUM_USERS, DIM)
  assert isinstance(sparse_mu["user_tower"]["kernel"], optax.MaskedNode)


def test_errors_name_the_problem():
  model = osa.SparseEmbed(NUM_ITEMS, DIM, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="ids must be integers"):
    model(jnp.array([1.0]))
  with pytest.raises(TypeError, match="real scalar loss"):
    osa.sparse_grad(lambda m: m(jnp.array([1, 2])))(model)
  with pytest.raises(TypeError, match="argnums must be one int"):
    osa.sparse_grad(lambda m: 0.0, argnums=(0,))
  with pytest.raises(ValueError, match="argnums=3"):
    osa.sparse_grad(lambda m: 0.0, argnums=3)(model)
  with pytest.raises(ValueError, match="nested transform"):
    osa.sparse_grad(lambda m: nnx.remat(lambda m: m(jnp.array([1, 2])).sum())(m))(model)


def test_flax_glue_without_flax_names_the_extra(monkeypatch):
  """Without flax installed, the lazy top-level names say which extra to install."""
  import sys

  monkeypatch.setitem(sys.modules, "flax", None)  # what an absent package looks like
  for name in [m for m in sys.modules if m.startswith("optax_sparse_adam.flax")]:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.delattr(osa, "flax")
  with pytest.raises(ModuleNotFoundError, match=r"pip install 'optax_sparse_adam\[flax\]'"):
    osa.SparseEmbed  # noqa: B018
