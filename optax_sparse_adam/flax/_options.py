"""torch's `nn.Embedding` options: one checked value (`TableOptions`) and pure functions.

The modules (`SparseEmbed`, `LinenSparseEmbed`, the bags) compose these with
`embedding_lookup`, so the BCOO gradients come from the one mechanism in
`_tables` / `_grads`; the only tie to the tape is `renormalised_table`, which tells
it that the renormalised table is the same table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_sparse_adam.flax._tables import replace_table

# torch's embedding_renorm_ adds this to the norm before dividing.
_RENORM_EPS = 1e-7


def check_padding_idx(padding_idx: int | None, num_embeddings: int, owner: str) -> int | None:
  """`padding_idx` in `[0, num_embeddings)` (a negative one counts from the end, as torch)."""
  if padding_idx is None:
    return None
  if not isinstance(padding_idx, int) or isinstance(padding_idx, bool):
    raise TypeError(f"{owner}: padding_idx must be an int or None, got {padding_idx!r}.")
  if not -num_embeddings <= padding_idx < num_embeddings:
    raise ValueError(
      f"{owner}: padding_idx={padding_idx} is outside [-{num_embeddings}, {num_embeddings}) "
      f"for a table of {num_embeddings} rows."
    )
  return padding_idx % num_embeddings


def check_max_norm(max_norm: float | None, norm_type: float, owner: str) -> None:
  """`max_norm` positive (or None) and `norm_type` a positive number, before any state exists."""
  if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
    raise ValueError(f"{owner}: max_norm must be a positive number or None, got {max_norm!r}.")
  if not (isinstance(norm_type, (int, float)) and norm_type > 0):
    raise ValueError(
      f"{owner}: norm_type must be a positive number (p of the p-norm), got {norm_type!r}."
    )


@dataclasses.dataclass(frozen=True)
class TableOptions:
  """The options a table module shares with torch's `nn.Embedding`, checked.

  Built once from a module's public keywords or fields (`checked`) and passed
  whole between the modules; the table is made from it (`initial_table`).

  Attributes:
    num_embeddings: number of rows `V`.
    features: row width `D`.
    padding_idx: the padding row in `[0, V)`, or None.
    max_norm: renormalise looked-up rows to at most this norm, or None.
    norm_type: p of the p-norm for `max_norm`.
    dtype: dtype of the returned rows; None for the table's.
    param_dtype: dtype of the table.
    embedding_init: initializer of the table.
  """

  num_embeddings: int
  features: int
  padding_idx: int | None
  max_norm: float | None
  norm_type: float
  dtype: Any
  param_dtype: Any
  embedding_init: Callable[..., jax.Array]

  @classmethod
  def checked(cls, owner: str, arguments: Any) -> TableOptions:
    """The options of a module, `padding_idx` normalised (negative counts from the end).

    Args:
      owner: the module's class name, in errors.
      arguments: where each option is found by its name: a mapping (the `locals()`
        of an NNX module's constructor, which takes them as keywords) or an
        object with them as attributes (a Linen module's fields).

    Returns:
      The checked options; errors name `owner`.
    """
    get = arguments.__getitem__ if isinstance(arguments, Mapping) else arguments.__getattribute__
    fields = {field.name: get(field.name) for field in dataclasses.fields(cls)}
    fields["padding_idx"] = check_padding_idx(
      fields["padding_idx"], fields["num_embeddings"], owner
    )
    check_max_norm(fields["max_norm"], fields["norm_type"], owner)
    return cls(**fields)

  def initial_table(self, key: jax.Array) -> jax.Array:
    """A new table from `embedding_init`, its padding row zeroed (torch's `reset_parameters`)."""
    table = self.embedding_init(key, (self.num_embeddings, self.features), self.param_dtype)
    return zero_padding_row(table, self.padding_idx)


def zero_padding_row(table: jax.Array, padding_idx: int | None) -> jax.Array:
  """The initial table with the padding row zeroed, as torch's `reset_parameters` does."""
  return table if padding_idx is None else table.at[padding_idx].set(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def renorm_rows(table: jax.Array, ids: jax.Array, max_norm: float, norm_type: float) -> jax.Array:
  """The table with the rows `ids` names rescaled to norm `max_norm` where theirs exceeds it.

  torch's `embedding_renorm_`: a row whose `norm_type`-norm exceeds `max_norm` is
  multiplied by `max_norm / (norm + 1e-7)`; ids outside `[0, V)` are skipped. Only
  the looked-up rows are read and written (a gather and a scatter), so with a
  donated table this is in place. The gradient passes through unchanged, as torch
  renormalises under `no_grad` and its `.grad` is that of the renormalised weight.

  Args:
    table: `(V, D)` table.
    ids: integer ids, any shape.
    max_norm: the largest norm a looked-up row keeps.
    norm_type: p of the p-norm (`inf` allowed).

  Returns:
    The renormalised table (same shape and dtype).
  """
  num_rows = table.shape[0]
  flat = jnp.ravel(ids)
  rows_at = jnp.where((flat >= 0) & (flat < num_rows), flat, num_rows)
  rows = table.at[rows_at].get(mode="fill", fill_value=0)
  norms = jnp.linalg.norm(rows.astype(jnp.float32), ord=norm_type, axis=-1)
  scale = max_norm / (norms + _RENORM_EPS)
  renormed = jnp.where(
    (norms > max_norm)[:, None],
    (rows.astype(jnp.float32) * scale[:, None]).astype(rows.dtype),
    rows,
  )
  return table.at[rows_at].set(renormed, mode="drop")


def _renorm_fwd(table, ids, max_norm, norm_type):
  return renorm_rows(table, ids, max_norm, norm_type), ids


def _renorm_bwd(max_norm, norm_type, ids, cotangent):
  del max_norm, norm_type
  return cotangent, jnp.zeros(ids.shape, jax.dtypes.float0)


renorm_rows.defvjp(_renorm_fwd, _renorm_bwd)


@jax.custom_vjp
def scale_cotangent(rows: jax.Array, scale: jax.Array) -> jax.Array:
  """`rows` unchanged; the cotangent flowing back through it multiplied by `scale[..., None]`."""
  del scale
  return rows


def _scale_fwd(rows, scale):
  return rows, scale


def _scale_bwd(scale, cotangent):
  return (cotangent * scale[..., None].astype(cotangent.dtype), jnp.zeros_like(scale))


scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


def inverse_frequency(ids: jax.Array) -> jax.Array:
  """`1 / count(ids == ids[i])` for each entry: torch's `scale_grad_by_freq` factor (float32)."""
  flat = jnp.ravel(ids)
  ordered = jnp.sort(flat)
  counts = jnp.searchsorted(ordered, flat, side="right") - jnp.searchsorted(
    ordered, flat, side="left"
  )
  return (1.0 / counts.astype(jnp.float32)).reshape(ids.shape)


def read_padding_row(
  rows: jax.Array, table: jax.Array, ids: jax.Array, padding_idx: int
) -> jax.Array:
  """`rows` with the entries of `padding_idx` replaced by that row's value, gradient-free.

  The padding entries were looked up as out-of-range ids (no gradient entry); torch
  still reads the row's value in the forward, so it is put back here, detached.
  """
  padding_row = lax.stop_gradient(table[padding_idx]).astype(rows.dtype)
  return jnp.where((ids == padding_idx)[..., None], padding_row, rows)


def embedding_rows(
  lookup: Any,
  table: jax.Array,
  ids: jax.Array,
  *,
  padding_idx: int | None,
  scale_grad_by_freq: bool,
) -> jax.Array:
  """`lookup(ids)` with torch's padding_idx and scale_grad_by_freq applied.

  Args:
    lookup: `ids -> rows`, the recorded lookup of the (already renormalised) table.
    table: the table's array (for the padding row's value).
    ids: integer ids.
    padding_idx: normalised padding index, or None.
    scale_grad_by_freq: scale each entry's gradient by 1 / its id's count in `ids`.

  Returns:
    The rows, `ids.shape + (D,)`.
  """
  lookup_ids = ids if padding_idx is None else jnp.where(ids == padding_idx, -1, ids)
  rows = lookup(lookup_ids)
  if padding_idx is not None:
    rows = read_padding_row(rows, table, ids, padding_idx)
  if scale_grad_by_freq:
    rows = scale_cotangent(rows, inverse_frequency(ids))
  return rows


def renormalised_table(table: jax.Array, ids: jax.Array, max_norm: float, norm_type: float):
  """torch's in-place `embedding_renorm_` of the rows `ids` names, as a new table array.

  The caller stores the result where the table lives (an NNX variable, a mutable
  Linen `params` collection); lookups of it inside `sparse_value_and_grad` are
  recorded as lookups of the original table.
  """
  new = renorm_rows(table, jnp.asarray(ids), float(max_norm), float(norm_type))
  replace_table(table, new)
  return new
