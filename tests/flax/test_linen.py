"""Flax Linen glue: LinenSparseEmbed, BCOO grads of boxed tables, SparseTrainState."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests._helpers import NumpySparseAdam, dense_table_temporaries

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from jax.experimental import sparse  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402

# Distinct from every other dim in these models, so 'f32[V,D]' names only tables.
NUM_USERS, NUM_ITEMS, DIM, HIDDEN = 1013, 517, 6, 5


class TwoTower(nn.Module):
  """Users and items tables; the item module is called twice (item and a 'context' item)."""

  embed_cls: type = osa.LinenSparseEmbed

  @nn.compact
  def __call__(self, users, items, context):
    user_table = self.embed_cls(NUM_USERS, DIM, name="users")
    item_table = self.embed_cls(NUM_ITEMS, DIM, name="items")
    u = nn.Dense(HIDDEN, name="user_tower")(user_table(users) + 0.5 * item_table(context))
    v = nn.Dense(HIDDEN, name="item_tower")(item_table(items))
    return jnp.sum(jnp.tanh(u) * v, axis=-1)


def batch(seed, size=16):
  rng = np.random.default_rng(seed)
  users = rng.integers(0, 40, size)
  items = rng.integers(0, 30, size)
  context = rng.integers(0, 30, size)
  ratings = rng.normal(size=size).astype(np.float32)
  return tuple(jnp.asarray(x) for x in (users, items, context, ratings))


MODEL, DENSE_MODEL = TwoTower(), TwoTower(embed_cls=nn.Embed)


def init_params(seed=0):
  return MODEL.init(jax.random.key(seed), *batch(0)[:3])["params"]


def unboxed(params):
  return jax.tree.map(
    lambda x: x.unbox() if isinstance(x, osa.SparseTableBox) else x,
    params,
    is_leaf=lambda x: isinstance(x, osa.SparseTableBox),
  )


def loss_fn(params, users, items, context, ratings, model=MODEL):
  return jnp.mean((model.apply({"params": params}, users, items, context) - ratings) ** 2)


def test_params_hold_boxed_tables_and_apply_matches_nn_embed():
  params = init_params()
  assert isinstance(params["users"]["embedding"], osa.SparseTableBox)
  dense_params = DENSE_MODEL.init(jax.random.key(0), *batch(0)[:3])["params"]
  np.testing.assert_array_equal(
    params["users"]["embedding"].value, dense_params["users"]["embedding"]
  )
  data = batch(1)[:3]
  np.testing.assert_allclose(
    MODEL.apply({"params": params}, *data),
    DENSE_MODEL.apply({"params": unboxed(params)}, *data),
    rtol=1e-6,
  )


@pytest.mark.parametrize("jit", [False, True])
def test_table_gradients_densified_equal_dense_jax_grad(jit):
  params = init_params()
  data = batch(1)

  def sparse_fn(params, *data):
    return osa.sparse_value_and_grad(loss_fn)(params, *data)

  def dense_fn(params, *data):
    return jax.value_and_grad(loss_fn)(params, *data, model=DENSE_MODEL)

  if jit:
    sparse_fn, dense_fn = jax.jit(sparse_fn), jax.jit(dense_fn)
  loss, grads = sparse_fn(params, *data)
  dense_loss, dense_grads = dense_fn(unboxed(params), *data)
  np.testing.assert_allclose(loss, dense_loss, rtol=1e-6)
  for name in ("users", "items"):
    box = grads[name]["embedding"]
    assert isinstance(box, osa.SparseTableBox) and isinstance(box.value, sparse.BCOO)
    np.testing.assert_allclose(
      box.value.todense(), dense_grads[name]["embedding"], rtol=1e-5, atol=1e-7
    )
  # The item module was called twice: both lookups' entries are in its gradient.
  assert grads["items"]["embedding"].value.nse == 2 * data[0].size
  for tower in ("user_tower", "item_tower"):
    np.testing.assert_allclose(
      grads[tower]["kernel"], dense_grads[tower]["kernel"], rtol=1e-5, atol=1e-7
    )


def test_module_shared_by_two_parents_accumulates():
  class Tower(nn.Module):
    embed: nn.Module

    @nn.compact
    def __call__(self, ids):
      return nn.Dense(1)(self.embed(ids))

  class Shared(nn.Module):
    def setup(self):
      self.embed = osa.LinenSparseEmbed(NUM_ITEMS, DIM)
      self.left = Tower(self.embed)
      self.right = Tower(self.embed)

    def __call__(self, a, b):
      return self.left(a) * self.right(b)

  model = Shared()
  a, b = jnp.array([1, 2, 2]), jnp.array([2, 9, 1])
  params = model.init(jax.random.key(1), a, b)["params"]

  def loss(params):
    return jnp.sum(model.apply({"params": params}, a, b) ** 2)

  grads = jax.jit(osa.sparse_grad(loss))(params)
  dense = jax.jit(jax.grad(loss))(params)
  table_grad = grads["embed"]["embedding"].value
  assert table_grad.nse == a.size + b.size
  np.testing.assert_allclose(
    table_grad.todense(), dense["embed"]["embedding"].value, rtol=1e-5, atol=1e-7
  )


def test_two_boxes_holding_one_array_are_refused():
  table = jnp.zeros((NUM_ITEMS, DIM))
  params = {"a": osa.SparseTableBox(table), "b": osa.SparseTableBox(table)}
  with pytest.raises(ValueError, match="same array object"):
    osa.sparse_grad(lambda p: jnp.sum(osa.embedding_lookup(p["a"].value, jnp.array([0]))))(params)


def make_state(params, lr, weight_decay):
  tx = optax.multi_transform(
    {"sparse": osa.sparse_adam(lr), "dense": optax.adamw(lr, weight_decay=weight_decay)},
    osa.table_labels,
  )
  return osa.SparseTrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)


def train_step(state, users, items, context, ratings):
  def loss(params):
    out = state.apply_fn({"params": params}, users, items, context)
    return jnp.mean((out - ratings) ** 2)

  value, grads = osa.sparse_value_and_grad(loss)(state.params)
  return state.apply_gradients(grads=grads), value


def reference_train(params, data_batches, lr, weight_decay):
  """Torch-semantics reference: dense jax.grad, NumPy SparseAdam on tables, dense AdamW."""
  params = unboxed(params)
  tables = {
    name: NumpySparseAdam(params[name]["embedding"], lr=lr, dtype=np.float32)
    for name in ("users", "items")
  }
  towers = ("user_tower", "item_tower")
  dense_tx = optax.adamw(lr, weight_decay=weight_decay)
  opt_state = dense_tx.init({k: params[k] for k in towers})
  dense_grad_fn = jax.jit(jax.grad(lambda *a: loss_fn(*a, model=DENSE_MODEL)))
  for users, items, context, ratings in data_batches:
    grads = dense_grad_fn(params, users, items, context, ratings)
    touched = {
      "users": np.unique(np.asarray(users)),
      "items": np.unique(np.concatenate([np.asarray(items), np.asarray(context)])),
    }
    params = dict(params)
    for name, ref in tables.items():
      dense_grad = np.asarray(grads[name]["embedding"])
      ref.step(touched[name][:, None], dense_grad[touched[name]])
      params[name] = {"embedding": jnp.asarray(ref.param)}
    tower_params = {k: params[k] for k in towers}
    updates, opt_state = dense_tx.update({k: grads[k] for k in towers}, opt_state, tower_params)
    params.update(optax.apply_updates(tower_params, updates))
  return params


def test_training_matches_torch_semantics_reference_under_jit_with_donation():
  lr, weight_decay, steps = 0.05, 0.01, 6
  params = init_params(seed=4)
  state = make_state(params, lr, weight_decay)
  step = jax.jit(train_step, donate_argnums=0)
  batches = [batch(10 + s) for s in range(steps)]
  for data in batches:
    state, _ = step(state, *data)
  assert step._cache_size() == 1
  assert int(state.step) == steps
  # The donated state consumed `params`; the reference starts from a fresh copy.
  expected = reference_train(init_params(seed=4), batches, lr, weight_decay)
  got = unboxed(state.params)
  for name in ("users", "items"):
    np.testing.assert_allclose(
      got[name]["embedding"], expected[name]["embedding"], rtol=2e-5, atol=2e-6
    )
  for tower in ("user_tower", "item_tower"):
    np.testing.assert_allclose(
      got[tower]["kernel"], expected[tower]["kernel"], rtol=2e-5, atol=2e-6
    )


def test_compiled_train_step_has_no_dense_table_temporary():
  state = make_state(init_params(), 0.01, 0.01)
  compiled = jax.jit(train_step, donate_argnums=0).lower(state, *batch(0)).compile()
  for num_rows in (NUM_USERS, NUM_ITEMS):
    assert dense_table_temporaries(compiled, f"f32[{num_rows},{DIM}]", 3) == []


def test_labels_mark_boxed_tables_and_bcoo_grads():
  params = init_params()
  labels = osa.table_labels(params)
  assert labels["users"]["embedding"] == "sparse"
  assert labels["user_tower"]["kernel"] == "dense"
  grads = jax.jit(osa.sparse_grad(loss_fn))(params, *batch(0))
  assert osa.table_labels(grads) == labels
