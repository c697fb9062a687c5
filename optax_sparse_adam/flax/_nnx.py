"""`SparseEmbed`: an NNX embedding whose table gets BCOO gradients."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from optax_sparse_adam.flax._tables import SparseTable, default_embed_init, embedding_lookup


class SparseEmbed(nnx.Module):
  """An NNX embedding whose table gets BCOO gradients under `sparse_value_and_grad`.

  A drop-in for `nnx.Embed` (same initializer, same call), except that ids
  outside `[0, num_embeddings)` read zero rows instead of NaNs. Under
  `nnx.grad` it behaves like `nnx.Embed` (dense gradient).

  Args:
    num_embeddings: number of rows `V`.
    features: row width `D`.
    dtype: dtype of the returned rows; default the table's.
    param_dtype: dtype of the table.
    embedding_init: initializer of the table.
    rngs: `nnx.Rngs` with a `params` stream.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> embed = osa.SparseEmbed(10, 4, rngs=nnx.Rngs(0))
    >>> loss = lambda m: (m(jnp.array([1, 1, 7])) ** 2).sum()
    >>> grads = osa.sparse_grad(loss)(embed)
    >>> grads["embedding"].get_value().indices[:, 0]
    Array([1, 1, 7], dtype=int32)
  """

  def __init__(
    self,
    num_embeddings: int,
    features: int,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    embedding_init: Callable[..., jax.Array] = default_embed_init,
    rngs: nnx.Rngs,
  ):
    self.num_embeddings = num_embeddings
    self.features = features
    self.dtype = dtype
    self.embedding = SparseTable(
      embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
    )

  def __call__(self, inputs: jax.Array) -> jax.Array:
    rows = embedding_lookup(self.embedding, inputs)
    return rows if self.dtype is None else rows.astype(self.dtype)
