"""`LinenSparseEmbed`: a Linen embedding whose table gets BCOO gradients."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from optax_sparse_adam.flax._tables import SparseTableBox, default_embed_init, embedding_lookup


class LinenSparseEmbed(nn.Module):
  """A Linen embedding whose table gets BCOO gradients under `sparse_value_and_grad`.

  A drop-in for `nn.Embed` (same initializer, the param is also named
  `embedding`), except that the param is stored in a `SparseTableBox` and ids
  outside `[0, num_embeddings)` read zero rows instead of NaNs.

  Attributes:
    num_embeddings: number of rows `V`.
    features: row width `D`.
    dtype: dtype of the returned rows; default the table's.
    param_dtype: dtype of the table.
    embedding_init: initializer of the table.
  """

  num_embeddings: int
  features: int
  dtype: Any = None
  param_dtype: Any = jnp.float32
  embedding_init: Callable[..., jax.Array] = default_embed_init

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    table = self.param(
      "embedding",
      lambda key, shape, dtype: SparseTableBox(self.embedding_init(key, shape, dtype)),
      (self.num_embeddings, self.features),
      self.param_dtype,
    )
    rows = embedding_lookup(table, inputs)
    return rows if self.dtype is None else rows.astype(self.dtype)
