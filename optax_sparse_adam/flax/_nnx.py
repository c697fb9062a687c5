"""`SparseEmbed`: an NNX embedding whose table gets BCOO gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from optax_sparse_adam.flax import _options
from optax_sparse_adam.flax._tables import SparseTable, default_embed_init, embedding_lookup


class TableModule(nnx.Module):
  """An NNX module holding a `SparseTable` named `embedding` and torch's table options.

  The base of `SparseEmbed` and `SparseEmbedBag`: it keeps `num_embeddings`,
  `features`, `padding_idx` (normalised), `max_norm`, `norm_type` and `dtype` as
  attributes, and the table with its padding row zeroed.
  """

  def __init__(self, options: _options.TableOptions, rngs: nnx.Rngs) -> None:
    self.num_embeddings, self.features = options.num_embeddings, options.features
    self.padding_idx = options.padding_idx
    self.max_norm, self.norm_type = options.max_norm, options.norm_type
    self.dtype = options.dtype
    self.embedding = SparseTable(options.initial_table(rngs.params()))

  def _renormalise(self, ids: jax.Array) -> None:
    """With `max_norm`, renormalises the rows `ids` names in the table, in place (torch)."""
    if self.max_norm is not None:
      self.embedding.set_value(
        _options.renormalised_table(self.embedding.get_value(), ids, self.max_norm, self.norm_type)
      )


class SparseEmbed(TableModule):
  """An NNX embedding whose table gets BCOO gradients under `sparse_value_and_grad`.

  A drop-in for `nnx.Embed` (same initializer, same call), except that ids
  outside `[0, num_embeddings)` read zero rows instead of NaNs. Under
  `nnx.grad` it behaves like `nnx.Embed` (dense gradient). The options of torch's
  `nn.Embedding(sparse=True)` are available with torch's semantics (see
  docs/porting/embeddings.md).

  Args:
    num_embeddings: number of rows `V`.
    features: row width `D`.
    padding_idx: a row that lookups read but that gets no gradient entry, so
      the optimizer never touches it (its value and moments stay bit-exact);
      zeroed at initialisation, as torch. Negative counts from the end.
    max_norm: if set, each lookup first renormalises, in place in the table
      variable, the looked-up rows whose `norm_type`-norm exceeds it, to
      `max_norm / (norm + 1e-7)` times themselves (torch's forward).
    norm_type: p of the p-norm for `max_norm` (default 2).
    scale_grad_by_freq: scale each id's gradient entries by the inverse of its
      count in the call's ids (torch's dense semantics; torch refuses it with
      `sparse=True`).
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
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    embedding_init: Callable[..., jax.Array] = default_embed_init,
    rngs: nnx.Rngs,
  ):
    super().__init__(_options.TableOptions.checked("SparseEmbed", locals()), rngs)
    self.scale_grad_by_freq = scale_grad_by_freq

  def __call__(self, inputs: jax.Array) -> jax.Array:
    self._renormalise(inputs)
    rows = _options.embedding_rows(
      lambda ids: embedding_lookup(self.embedding, ids),
      self.embedding.get_value(),
      jnp.asarray(inputs),
      padding_idx=self.padding_idx,
      scale_grad_by_freq=self.scale_grad_by_freq,
    )
    return rows if self.dtype is None else rows.astype(self.dtype)
