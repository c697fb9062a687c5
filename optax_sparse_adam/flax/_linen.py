"""`LinenSparseEmbed`: a Linen embedding whose table gets BCOO gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import linen as nn

from optax_sparse_adam.flax import _options
from optax_sparse_adam.flax._tables import SparseTableBox, _lookup, default_embed_init


class LinenSparseEmbed(nn.Module):
  """A Linen embedding whose table gets BCOO gradients under `sparse_value_and_grad`.

  A drop-in for `nn.Embed` (same initializer, the param is also named
  `embedding`), except that the param is stored in a `SparseTableBox` and ids
  outside `[0, num_embeddings)` read zero rows instead of NaNs. The options of
  torch's `nn.Embedding(sparse=True)` are those of `SparseEmbed`.

  With `max_norm`, the renormalised table is written back to the `params`
  collection, as torch renormalises its weight in place: `apply` must be called
  with `mutable=['params']` and the returned params kept (for example returned as
  aux from the loss, then given to the train state before `apply_gradients`).
  Without it, `apply` raises rather than train a table that differs from torch's.
  `init` does not renormalise (torch's constructor does not).

  Attributes:
    num_embeddings: number of rows `V`.
    features: row width `D`.
    padding_idx: see `SparseEmbed`.
    max_norm: see `SparseEmbed`; needs `mutable=['params']` in `apply`.
    norm_type: see `SparseEmbed`.
    scale_grad_by_freq: see `SparseEmbed`.
    dtype: dtype of the returned rows; default the table's.
    param_dtype: dtype of the table.
    embedding_init: initializer of the table.
  """

  num_embeddings: int
  features: int
  padding_idx: int | None = None
  max_norm: float | None = None
  norm_type: float = 2.0
  scale_grad_by_freq: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  embedding_init: Callable[..., jax.Array] = default_embed_init

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    table, padding_idx = linen_table(self, inputs)
    rows = _options.embedding_rows(
      lambda ids: _lookup(table, ids, owner=self),
      table,
      jnp.asarray(inputs),
      padding_idx=padding_idx,
      scale_grad_by_freq=self.scale_grad_by_freq,
    )
    return rows if self.dtype is None else rows.astype(self.dtype)


def linen_table(module: nn.Module, ids: jax.Array) -> tuple[jax.Array, int | None]:
  """`(table, padding_idx)` of a Linen embedding module, renormalised for `ids` if it has max_norm.

  `module` has the fields of `TableOptions` (`LinenSparseEmbed`, `LinenSparseEmbedBag`); its
  param is `embedding`, boxed.
  """
  owner = type(module).__name__
  options = _options.TableOptions.checked(owner, module)
  # `param` returns the value unboxed; flax types it as what the initializer returns (the box).
  table = cast(
    jax.Array, module.param("embedding", lambda key: SparseTableBox(options.initial_table(key)))
  )
  if options.max_norm is not None and not module.is_initializing():
    if not module.is_mutable_collection("params"):
      raise ValueError(
        f"{owner}(max_norm={options.max_norm}) at {'/'.join(module.path)}: the lookup "
        "renormalises rows of the table in place, as torch does, so the params must be "
        "writable: call apply(..., mutable=['params']) and keep the params it returns "
        "(their table is the one the gradient belongs to)."
      )
    table = _options.renormalised_table(table, ids, options.max_norm, options.norm_type)
    module.put_variable("params", "embedding", SparseTableBox(table))
  return table, options.padding_idx
