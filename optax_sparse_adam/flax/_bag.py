"""Sparse `EmbeddingBag`s (NNX and Linen): pooled lookups whose tables get BCOO gradients.

A bag pools (sum, mean or max) the rows of its ids. The rows are read with
`embedding_lookup`, one entry per id, so `sparse_value_and_grad` gives the table
the BCOO gradient of those entries (the same mechanism as `SparseEmbed`); the
pooling is segment arithmetic on the `(N, D)` rows, never on a `V x D` array.

Static shapes: torch's `offsets` make bags of data-dependent lengths. Here the
number of bags is the length of `offsets` (minus one with `include_last_offset`),
which is static under `jit`; each id's bag (its segment id) is computed from the
offsets on device, so a new batch with the same number of ids and bags does not
recompile. 2-D ids are `B` bags of `N` ids; ids outside `[0, V)` (for example -1)
and `padding_idx` are left out of their bag, so ragged bags can also be written
as 2-D ids padded with -1.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax import lax

from optax_sparse_adam._core.errors import describe
from optax_sparse_adam.flax import _options
from optax_sparse_adam.flax._linen import linen_table
from optax_sparse_adam.flax._nnx import TableModule
from optax_sparse_adam.flax._tables import _lookup, default_embed_init

MODES = ("sum", "mean", "max")


def _check_mode(mode: str, owner: str) -> None:
  if mode not in MODES:
    raise ValueError(f"{owner}: mode must be one of {MODES}, got {mode!r}.")


def _is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _bag_segments(
  ids: jax.Array, offsets: Any, include_last_offset: bool, owner: str
) -> tuple[jax.Array, jax.Array, int]:
  """`(flat ids, bag of each id, number of bags)`; a bag index out of `[0, B)` means no bag."""
  if ids.ndim == 2:
    if offsets is not None:
      raise ValueError(
        f"{owner}: offsets must be None when the ids are 2-D (each row is one bag), "
        f"got offsets {describe(offsets)}."
      )
    num_bags, length = ids.shape
    segments = jnp.repeat(jnp.arange(num_bags, dtype=jnp.int32), length)
    return ids.reshape(-1), segments, num_bags
  if ids.ndim != 1:
    raise ValueError(f"{owner}: ids must be 1-D (with offsets) or 2-D, got {describe(ids)}.")
  if offsets is None:
    raise ValueError(f"{owner}: 1-D ids need offsets (the start of each bag in the ids).")
  offsets = jnp.asarray(offsets)
  if offsets.ndim != 1 or not jnp.issubdtype(offsets.dtype, jnp.integer):
    raise ValueError(f"{owner}: offsets must be a 1-D integer array, got {describe(offsets)}.")
  num_bags = offsets.shape[0] - (1 if include_last_offset else 0)
  if num_bags < 0:
    raise ValueError(f"{owner}: include_last_offset=True needs at least one offset, got none.")
  if _is_concrete(offsets) and offsets.shape[0]:
    # Under jit the offsets are data and are trusted; eagerly they are checked, as torch does.
    values = jax.device_get(offsets)
    if values[0] != 0:
      raise ValueError(f"{owner}: offsets[0] must be 0, got {int(values[0])}.")
    if (values[1:] < values[:-1]).any():
      raise ValueError(f"{owner}: offsets must be non-decreasing, got {values.tolist()}.")
    if values[-1] > ids.shape[0]:
      raise ValueError(f"{owner}: offsets[-1]={int(values[-1])} is beyond the {ids.shape[0]} ids.")
  positions = jnp.arange(ids.shape[0], dtype=offsets.dtype)
  segments = jnp.searchsorted(offsets, positions, side="right").astype(jnp.int32) - 1
  return ids, segments, num_bags


def embedding_bag_lookup(
  table: Any,
  ids: Any,
  offsets: Any = None,
  *,
  mode: str = "mean",
  per_sample_weights: Any = None,
  padding_idx: int | None = None,
  include_last_offset: bool = False,
) -> jax.Array:
  """torch's `F.embedding_bag` on recorded lookups: BCOO table gradients in `sparse_value_and_grad`.

  bag_b = sum_i w_i table[ids_i] (sum), that over the bag's count (mean), or the
  per-feature max with its gradient going to the first entry that attains it (max),
  over the ids `i` of bag `b` that are in `[0, V)` and not `padding_idx`. Empty bags
  are zeros.

  Args:
    table: a `(V, D)` array or an NNX `SparseTable`.
    ids: integer ids, `(N,)` with `offsets`, or `(B, N)` (one bag per row).
    offsets: `(B,)` start of each bag in 1-D `ids` (`(B + 1,)` with
      `include_last_offset`); `offsets[0]` is 0 and they do not decrease.
    mode: 'sum', 'mean' or 'max'.
    per_sample_weights: weights of the shape of `ids` (mode 'sum' only, as torch).
    padding_idx: an id (in `[0, V)`) left out of every bag.
    include_last_offset: `offsets` ends with the end of the last bag (CSR style).

  Returns:
    The pooled rows, `(B, D)` in the table's dtype.
  """
  return _bag_lookup(
    table,
    ids,
    offsets,
    mode=mode,
    per_sample_weights=per_sample_weights,
    padding_idx=padding_idx,
    include_last_offset=include_last_offset,
    module=None,
  )


def _bag_lookup(
  table: Any,
  ids: Any,
  offsets: Any,
  *,
  mode: str,
  per_sample_weights: Any,
  padding_idx: int | None,
  include_last_offset: bool,
  module: Any,
) -> jax.Array:
  """`embedding_bag_lookup`; `module` is the Linen module whose table `table` is, if any.

  Passing it lets the lookup name the module, and refuse (as `LinenSparseEmbed`
  does) a table seen through a nested transform or a copy of the params, instead
  of silently giving it a dense gradient.
  """
  owner = "embedding_bag_lookup"
  _check_mode(mode, owner)
  array = table.get_value() if isinstance(table, nnx.Variable) else table
  if jnp.ndim(array) != 2:
    raise ValueError(
      f"{owner}: the table must be (num_embeddings, features), got {describe(array)}."
    )
  padding_idx = _options.check_padding_idx(padding_idx, array.shape[0], owner)
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{owner}: ids must be integers, got {describe(ids)}.")
  flat_ids, segments, num_bags = _bag_segments(ids, offsets, include_last_offset, owner)
  if per_sample_weights is not None:
    if mode != "sum":
      raise ValueError(
        f"{owner}: per_sample_weights is only supported for mode='sum' (as torch), got "
        f"mode={mode!r}."
      )
    per_sample_weights = jnp.asarray(per_sample_weights)
    if per_sample_weights.shape != ids.shape:
      raise ValueError(
        f"{owner}: per_sample_weights must have the shape of the ids {tuple(ids.shape)}, "
        f"got {describe(per_sample_weights)}."
      )
  num_rows = array.shape[0]
  valid = (segments >= 0) & (segments < num_bags) & (flat_ids >= 0) & (flat_ids < num_rows)
  if padding_idx is not None:
    valid &= flat_ids != padding_idx
  segments = jnp.where(valid, segments, num_bags)  # out of range: dropped by the segment ops
  rows = _lookup(table, jnp.where(valid, flat_ids, -1), owner=module)
  if mode == "max":
    return _segment_argmax_rows(rows, valid, segments, num_bags)
  if per_sample_weights is not None:
    rows = rows * per_sample_weights.reshape(-1, 1).astype(rows.dtype)
  pooled = jax.ops.segment_sum(rows, segments, num_bags)
  if mode == "mean":
    counts = jax.ops.segment_sum(valid.astype(jnp.int32), segments, num_bags)
    pooled = pooled / jnp.maximum(counts, 1)[:, None].astype(pooled.dtype)
  return pooled


def _segment_argmax_rows(rows: jax.Array, valid: jax.Array, segments: jax.Array, num_bags: int):
  """Per bag and feature, the row entry of the first maximum (torch's max mode); zeros if empty.

  Selected by a gather, so the gradient goes to that one entry (JAX's own max
  would split it among ties).
  """
  num_ids, features = rows.shape
  values = jnp.where(valid[:, None], lax.stop_gradient(rows), -jnp.inf)
  bag_max = jax.ops.segment_max(values, segments, num_bags)
  at_max = valid[:, None] & (values == bag_max.at[segments].get(mode="fill", fill_value=jnp.inf))
  positions = jnp.where(at_max, jnp.arange(num_ids, dtype=jnp.int32)[:, None], num_ids)
  first = jax.ops.segment_min(positions, segments, num_bags)  # num_ids where the bag is empty
  first = jnp.minimum(first, num_ids)
  columns = jnp.broadcast_to(jnp.arange(features), first.shape)
  return rows.at[first, columns].get(mode="fill", fill_value=0)


class SparseEmbedBag(TableModule):
  """An NNX `EmbeddingBag` (torch's `nn.EmbeddingBag(sparse=True)`) whose table gets BCOO gradients.

  Holds a `SparseTable` named `embedding`, initialised like `SparseEmbed` (the
  padding row zeroed); a call pools the rows of each bag (`embedding_bag_lookup`).
  The number of bags is static (the length of `offsets`, or the rows of 2-D ids).

  The table's arguments are `SparseEmbed`'s, with its defaults and meanings:
  `num_embeddings` (rows `V`), `features` (row width `D`), `max_norm` and
  `norm_type` (the looked-up rows renormalised in place before they are
  pooled), `dtype` (of the pooled rows), `param_dtype`, `embedding_init` and
  `rngs`. The bag's own (its keywords in `nn.EmbeddingBag`'s order):

  Args:
    mode: 'sum', 'mean' (torch's default) or 'max'.
    include_last_offset: `offsets` has `B + 1` entries, the last the end of bag `B`.
    padding_idx: an id left out of every bag, whose row gets no gradient entry;
      negative counts from the end.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> bag = osa.SparseEmbedBag(10, 4, mode="sum", rngs=nnx.Rngs(0))
    >>> ids, offsets = jnp.array([1, 2, 4, 4, 7]), jnp.array([0, 2, 2])
    >>> bag(ids, offsets).shape
    (3, 4)
    >>> grads = osa.sparse_grad(lambda m: m(ids, offsets).sum())(bag)
    >>> grads["embedding"].get_value().indices[:, 0]
    Array([1, 2, 4, 4, 7], dtype=int32)
  """

  def __init__(
    self,
    num_embeddings: int,
    features: int,
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    mode: str = "mean",
    include_last_offset: bool = False,
    padding_idx: int | None = None,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    embedding_init: Callable[..., jax.Array] = default_embed_init,
    rngs: nnx.Rngs,
  ):
    _check_mode(mode, "SparseEmbedBag")
    super().__init__(_options.TableOptions.checked("SparseEmbedBag", locals()), rngs)
    self.mode = mode
    self.include_last_offset = include_last_offset

  def __call__(
    self, inputs: jax.Array, offsets: jax.Array | None = None, per_sample_weights: Any = None
  ) -> jax.Array:
    """The pooled rows `(B, D)` of `inputs` (1-D with `offsets`, or 2-D)."""
    self._renormalise(inputs)
    pooled = embedding_bag_lookup(
      self.embedding,
      inputs,
      offsets,
      mode=self.mode,
      per_sample_weights=per_sample_weights,
      padding_idx=self.padding_idx,
      include_last_offset=self.include_last_offset,
    )
    return pooled if self.dtype is None else pooled.astype(self.dtype)


class LinenSparseEmbedBag(nn.Module):
  """A Linen `EmbeddingBag` whose table (param `embedding`, boxed) gets BCOO gradients.

  The Linen twin of `SparseEmbedBag`; called as `bag(ids, offsets=None,
  per_sample_weights=None)`. With `max_norm`, `apply` needs `mutable=['params']`
  (see `LinenSparseEmbed`).

  Attributes:
    num_embeddings: number of rows `V`.
    features: row width `D`.
    mode: 'sum', 'mean' (default) or 'max'.
    padding_idx: see `SparseEmbedBag`.
    max_norm: see `SparseEmbed`.
    norm_type: see `SparseEmbed`.
    include_last_offset: see `SparseEmbedBag`.
    dtype: dtype of the returned rows; default the table's.
    param_dtype: dtype of the table.
    embedding_init: initializer of the table.
  """

  num_embeddings: int
  features: int
  mode: str = "mean"
  padding_idx: int | None = None
  max_norm: float | None = None
  norm_type: float = 2.0
  include_last_offset: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  embedding_init: Callable[..., jax.Array] = default_embed_init

  @nn.compact
  def __call__(
    self, inputs: jax.Array, offsets: jax.Array | None = None, per_sample_weights: Any = None
  ) -> jax.Array:
    _check_mode(self.mode, "LinenSparseEmbedBag")
    table, padding_idx = linen_table(self, inputs)
    pooled = _bag_lookup(
      table,
      inputs,
      offsets,
      mode=self.mode,
      per_sample_weights=per_sample_weights,
      padding_idx=padding_idx,
      include_last_offset=self.include_last_offset,
      module=self,
    )
    return pooled if self.dtype is None else pooled.astype(self.dtype)
