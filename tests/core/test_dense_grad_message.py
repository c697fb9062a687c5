"""The dense-gradient error points to the fix: the gathered-rows route and sparse_value_and_grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa

TABLE_SHAPE = (50, 4)


def _loss_of_rows(rows, targets):
  return jnp.sum((rows - targets) ** 2)


def _loss(params, ids, targets):
  return _loss_of_rows(params["emb"]["table"][ids], targets)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_dense_gradient_error_names_both_routes(jit):
  params = {"emb": {"table": jnp.zeros(TABLE_SHAPE)}}
  opt = osa.sparse_adam(1e-3)
  state = opt.init(params)
  ids, targets = jnp.array([1, 7, 7]), jnp.ones((3, 4))
  dense_grads = jax.grad(_loss)(params, ids, targets)  # what a user writes first
  update = jax.jit(opt.update) if jit else opt.update
  with pytest.raises(TypeError) as err:
    update(dense_grads, state, params)
  message = str(err.value)
  for fragment in [
    "['emb']['table']",  # where
    "is dense",  # what was wrong
    "BCOO gradients",  # what was expected
    "differentiate with respect to the gathered rows",  # the route in plain JAX
    "sparse.BCOO((row_grads, ids[:, None]), shape=table.shape)",
    "sparse_value_and_grad",  # the route with Flax
    "optax.multi_transform",  # for a parameter that is not a table
  ]:
    assert fragment in message, f"{fragment!r} not in: {message}"


def test_the_route_the_message_names_gives_the_tables_gradient():
  """Following the message (rows = table[ids]; grad of the rows; BCOO) gives jax.grad's answer."""
  table = jnp.asarray(np.random.default_rng(0).normal(size=TABLE_SHAPE), jnp.float32)
  ids, targets = jnp.array([1, 7, 7, 49]), jnp.ones((4, 4))
  rows = table[ids]
  row_grads = jax.grad(_loss_of_rows)(rows, targets)
  grad = sparse.BCOO((row_grads, ids[:, None]), shape=table.shape)
  dense = jax.grad(_loss)({"emb": {"table": table}}, ids, targets)["emb"]["table"]
  np.testing.assert_allclose(grad.todense(), dense, rtol=1e-6)
  opt = osa.sparse_adam(1e-3)
  params = {"emb": {"table": table}}
  updates, _ = opt.update({"emb": {"table": grad}}, opt.init(params), params)
  assert isinstance(updates["emb"]["table"], sparse.BCOO)
