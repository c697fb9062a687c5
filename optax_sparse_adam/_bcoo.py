"""BCOO plumbing: validate a sparse gradient, coalesce its rows, gather and scatter them.

Every sparse leaf is handled as a table of rows: the `n_sparse` leading dims of
the parameter are flattened into one row axis of length `num_rows` and the
`n_dense` trailing dims form the row. An embedding gradient (indices `(nse, 1)`,
data `(nse, D)`) is the case `n_sparse=1, n_dense=1`; an element-wise gradient
(indices `(nse, 2)`, data `(nse,)`) is `n_sparse=2, n_dense=0`.

All shapes here are static: a step over `nse` gradient entries works on arrays
of length `nse`, whatever the size of the table.
"""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse

from optax_sparse_adam import _sharding
from optax_sparse_adam._errors import describe, path_str

BCOO = sparse.BCOO

_INT32_MAX = np.iinfo(np.int32).max


class RowLayout(NamedTuple):
  """Static view of a parameter as `num_rows` rows of shape `dense_shape`."""

  sparse_shape: tuple[int, ...]
  dense_shape: tuple[int, ...]

  @property
  def num_rows(self) -> int:
    return math.prod(self.sparse_shape)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.sparse_shape + self.dense_shape


class CoalescedRows(NamedTuple):
  """A gradient with one slot per distinct row, in ascending row order.

  Attributes:
    rows: int32 `(nse,)`. Slots past the distinct rows hold distinct
      out-of-range rows (`num_rows + slot`), so the indices are unique and every
      scatter drops them.
    values: `(nse, *dense_shape)` sums of the entries of each row; zero in
      padding slots.
  """

  rows: jax.Array
  values: jax.Array


def is_bcoo(x: Any) -> bool:
  return isinstance(x, BCOO)


def row_layout(
  grad: BCOO, param_shape: Sequence[int], path: Sequence[Any] = (), *, what: str = "gradient"
) -> RowLayout:
  """Checks that `grad` is a BCOO gradient usable for a parameter of `param_shape`.

  Raises a `ValueError` or `TypeError` that names the leaf's path otherwise;
  `what` names the BCOO in the message ("gradient" or "update").
  """
  where = f"{what} at {path_str(path)}"
  param_shape = tuple(int(d) for d in param_shape)
  if grad.n_batch != 0:
    raise ValueError(
      f"Sparse {where} has n_batch={grad.n_batch} batch dimensions; "
      "sparse_adam supports only n_batch=0 (indices of shape (nse, n_sparse)). "
      "Convert it with jax.experimental.sparse.bcoo_update_layout(grad, n_batch=0)."
    )
  if tuple(grad.shape) != param_shape:
    raise ValueError(
      f"Sparse {where} has shape {tuple(grad.shape)} but its "
      f"parameter has shape {param_shape}; they must be equal."
    )
  if grad.n_sparse < 1:
    raise ValueError(
      f"Sparse {where} has n_sparse=0: it holds no sparse dimension. "
      "Pass it as a dense gradient to optax.adam instead."
    )
  if not jnp.issubdtype(grad.indices.dtype, jnp.integer):
    raise TypeError(
      f"Sparse {where} has indices of dtype {grad.indices.dtype}; "
      "expected an integer dtype. A transform earlier in the chain probably "
      "mapped over the BCOO's indices (optax.scale does this): wrap such "
      "transforms in optax_sparse_adam.lift_to_bcoo, e.g. "
      "lift_to_bcoo(optax.scale(-1.0)), which acts on the rows' values only."
    )
  if not jnp.issubdtype(grad.data.dtype, jnp.floating):
    raise TypeError(
      f"Sparse {where} has data of dtype {grad.data.dtype}; expected a real floating dtype."
    )
  layout = RowLayout(param_shape[: grad.n_sparse], param_shape[grad.n_sparse :])
  if layout.num_rows + grad.nse > _INT32_MAX:
    raise ValueError(
      f"Sparse {where}: its {layout.num_rows} rows (the product of "
      f"the sparse dims {layout.sparse_shape}) do not fit in int32 row ids. Use "
      "fewer sparse dimensions (n_sparse=1, the rest dense)."
    )
  return layout


def check_param_dtype(param: Any, path: Sequence[Any]) -> None:
  """Refuses parameters that Adam cannot update: integer, bool or complex."""
  dtype = jnp.asarray(param).dtype if not hasattr(param, "dtype") else param.dtype
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(
      f"Parameter at {path_str(path)} is complex ({describe(param)}): "
      "sparse_adam does not support complex parameters."
    )
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f"Parameter at {path_str(path)} has dtype {dtype} ({describe(param)}): "
      "sparse_adam updates only real floating-point parameters."
    )


def linear_rows(indices: jax.Array, layout: RowLayout) -> jax.Array:
  """Row ids of BCOO `indices` `(nse, n_sparse)`; any out-of-range entry maps to `num_rows`.

  Negative indices are out of range too: they are padding here, not Python-style
  wrap-around.
  """
  indices = indices.astype(jnp.int32)
  dims = jnp.asarray(layout.sparse_shape, jnp.int32)
  in_range = jnp.all((indices >= 0) & (indices < dims), axis=-1)
  strides = np.cumprod((1,) + layout.sparse_shape[:0:-1])[::-1].astype(np.int32)
  if len(layout.sparse_shape) == 1:
    rows = indices[:, 0]
  else:
    rows = jnp.sum(indices * jnp.asarray(strides), axis=-1, dtype=jnp.int32)
  return jnp.where(in_range, rows, jnp.int32(layout.num_rows))


def row_indices(rows: jax.Array, layout: RowLayout) -> jax.Array:
  """BCOO indices `(nse, n_sparse)` of row ids; out-of-range rows stay out of range."""
  if len(layout.sparse_shape) == 1:
    return rows[:, None]
  coords = []
  rest = rows
  for dim in layout.sparse_shape[:0:-1]:
    coords.append(rest % dim)
    rest = rest // dim
  # The leading coordinate keeps the quotient, so a padding row stays >= shape[0].
  coords.append(rest)
  return jnp.stack(coords[::-1], axis=-1).astype(jnp.int32)


def coalesce_rows(rows: jax.Array, values: jax.Array, num_rows: int) -> CoalescedRows:
  """Sums the values of repeated rows, as torch's `grad.coalesce()` does.

  Entries with an out-of-range row (`>= num_rows`) are dropped. The output has
  the static length of the input; see `CoalescedRows` for its padding.
  """
  nse = rows.shape[0]
  slots = jnp.arange(nse, dtype=jnp.int32)
  if nse == 0:
    return CoalescedRows(rows.astype(jnp.int32), values)
  sorted_rows, order = lax.sort((rows, slots), num_keys=1, is_stable=True)
  is_first = jnp.concatenate([jnp.ones((1,), bool), sorted_rows[1:] != sorted_rows[:-1]])
  segment_of_sorted = jnp.cumsum(is_first, dtype=jnp.int32) - 1
  # The segment of each entry in input order, so the values need no permutation.
  segment = jnp.zeros((nse,), jnp.int32).at[order].set(segment_of_sorted, unique_indices=True)
  summed = jnp.zeros_like(values).at[segment].add(values, mode="promise_in_bounds")
  unique_rows = (
    jnp.full((nse,), num_rows, jnp.int32)
    .at[jnp.where(is_first, segment_of_sorted, nse)]
    .set(sorted_rows, mode="drop", unique_indices=True)
  )
  valid = unique_rows < num_rows
  unique_rows = jnp.where(valid, unique_rows, num_rows + slots)
  summed = jnp.where(_expand(valid, summed.ndim), summed, jnp.zeros((), summed.dtype))
  return CoalescedRows(unique_rows, summed)


def _expand(mask: jax.Array, ndim: int) -> jax.Array:
  return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def as_rows(table: jax.Array, layout: RowLayout) -> jax.Array:
  """A `(num_rows, *dense_shape)` view of a parameter-shaped array (a free reshape)."""
  return table.reshape((layout.num_rows,) + layout.dense_shape)


def gather_rows(table_rows: jax.Array, rows: jax.Array) -> jax.Array:
  """`table_rows[rows]`, with zeros for out-of-range (padding) rows."""
  return table_rows.at[rows].get(
    mode="fill", fill_value=0, unique_indices=True, indices_are_sorted=True
  )


def scatter_rows(table_rows: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
  """`table_rows[rows] = values` for in-range rows; padding rows are dropped."""
  return table_rows.at[rows].set(
    values.astype(table_rows.dtype),
    mode="drop",
    unique_indices=True,
    indices_are_sorted=True,
  )


def scatter_add_bcoo(param: jax.Array, update: BCOO, path: Sequence[Any] = ()) -> jax.Array:
  """`param + update` for a BCOO update, by scatter-add: never densifies the update.

  Repeated indices add up; out-of-range indices are dropped (BCOO padding).
  The result has `param`'s sharding.
  """
  layout = row_layout(update, param.shape, path, what="update")
  return _sharding.call_with_auto_axes(
    lambda param, update: _scatter_add_rows(param, update, layout),
    (param, update),
    _sharding.spec_of(param),
  )


def _scatter_add_rows(param: jax.Array, update: BCOO, layout: RowLayout) -> jax.Array:
  rows = linear_rows(update.indices, layout)
  out = (
    as_rows(param, layout)
    .at[rows]
    .add(
      update.data.astype(param.dtype),
      mode="drop",
      unique_indices=update.unique_indices,
      indices_are_sorted=update.indices_sorted,
    )
  )
  return out.reshape(param.shape)


def rows_to_bcoo(coalesced: CoalescedRows, layout: RowLayout) -> BCOO:
  """The BCOO of a coalesced row update: sorted, unique indices; padding out of range."""
  return BCOO(
    (coalesced.values, row_indices(coalesced.rows, layout)),
    shape=layout.shape,
    indices_sorted=True,
    unique_indices=True,
  )
