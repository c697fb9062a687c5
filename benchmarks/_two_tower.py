"""The two-tower model and train steps that bench_flax times (those of examples/recommender_nnx.py).

Kept here, not imported from examples/, so a benchmark depends only on the
installed package; the model is the example's, line for line, so the benchmark
times what the example shows.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

import optax_sparse_adam as osa


class TwoTower(nnx.Module):
  """Score = <user_tower(user row), item_tower(item row)> / sqrt(hidden) + bias."""

  def __init__(self, num_users, num_items, dim, hidden, *, embed_cls, rngs):
    self.users = embed_cls(num_users, dim, rngs=rngs)
    self.items = embed_cls(num_items, dim, rngs=rngs)
    self.user_tower = nnx.Linear(dim, hidden, rngs=rngs)
    self.item_tower = nnx.Linear(dim, hidden, rngs=rngs)
    self.bias = nnx.Param(jnp.full((), 3.0, jnp.float32))  # strongly typed: one compilation
    self.scale = 1.0 / np.sqrt(hidden)

  def __call__(self, users, items):
    u = self.user_tower(self.users(users))
    v = self.item_tower(self.items(items))
    return jnp.sum(u * v, axis=-1) * self.scale + self.bias[...]


def mse(model, users, items, ratings):
  return jnp.mean((model(users, items) - ratings) ** 2)


@nnx.jit(donate_argnums=(0, 1))
def sparse_step(model, optimizer, users, items, ratings):
  loss, grads = osa.sparse_value_and_grad(mse)(model, users, items, ratings)
  optimizer.update(model, grads)
  return loss


@nnx.jit(donate_argnums=(0, 1))
def dense_step(model, optimizer, users, items, ratings):
  loss, grads = nnx.value_and_grad(mse)(model, users, items, ratings)
  optimizer.update(model, grads)
  return loss
