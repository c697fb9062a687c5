"""BCOO rows: validate a sparse gradient, view it as rows, gather and scatter them.

Every sparse leaf is handled as a table of rows: the `n_sparse` leading dims of
the parameter are flattened into one row axis of length `num_rows` and the
`n_dense` trailing dims form the row. An embedding gradient (indices `(nse, 1)`,
data `(nse, D)`) is the case `n_sparse=1, n_dense=1`; an element-wise gradient
(indices `(nse, 2)`, data `(nse,)`) is `n_sparse=2, n_dense=0`.

All shapes here are static: a step over `nse` gradient entries works on arrays
of length `nse`, whatever the size of the table. Coalescing (duplicates summed)
is `_core.coalesce`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse

from optax_sparse_adam._core.errors import describe, path_str

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
  # The range check runs in the indices' own dtype: an int64 index past 2**31
  # must not wrap into a valid int32 row.
  dims = jnp.asarray(layout.sparse_shape, indices.dtype)
  in_range = jnp.all((indices >= 0) & (indices < dims), axis=-1)
  indices = indices.astype(jnp.int32)
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


def as_rows(table: jax.Array, layout: RowLayout) -> jax.Array:
  """A `(num_rows, *dense_shape)` view of a parameter-shaped array (a free reshape)."""
  return table.reshape((layout.num_rows,) + layout.dense_shape)


def gather_rows(table_rows: jax.Array, rows: jax.Array) -> jax.Array:
  """`table_rows[rows]`, with zeros for out-of-range (padding) rows."""
  return table_rows.at[rows].get(
    mode="fill", fill_value=0, unique_indices=True, indices_are_sorted=True
  )


def scatter_rows(
  table_rows: jax.Array, rows: jax.Array, values: jax.Array, *, through_bits: bool = True
) -> jax.Array:
  """`table_rows[rows] = values` for in-range rows; padding rows are dropped.

  `through_bits`: whether a narrow float table is stored through its bits
  (`set_rows`); the backend decides.
  """
  if not through_bits:
    return table_rows.at[rows].set(
      values.astype(table_rows.dtype), mode="drop", unique_indices=True, indices_are_sorted=True
    )
  return set_rows(
    table_rows, rows, values, mode="drop", unique_indices=True, indices_are_sorted=True
  )


def bits_dtype(dtype: Any) -> np.dtype | None:
  """The unsigned integer dtype that a table of `dtype` is stored through, else None.

  bfloat16 and the 8-bit floats are: XLA:CPU has no scatter for them and
  converts the whole table to a wider float and back around each one. float16
  is not: XLA:CPU scatters it natively.
  """
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.float16:
    return None
  bits = jnp.finfo(dtype).bits
  return jnp.dtype(f"uint{bits}") if bits in (8, 16) and dtype.itemsize * 8 == bits else None


def set_rows(table: jax.Array, index: Any, values: jax.Array, **scatter_flags: Any) -> jax.Array:
  """`table.at[index].set(values, **scatter_flags)`, with `values` cast to the table's dtype.

  A bfloat16 or 8-bit float table (`bits_dtype`) is written through its bits: a set of
  bits is a set of values on every backend. XLA:CPU has no 16-bit float scatter
  and converts the whole table to float32 and back around a float one; around
  this integer scatter it makes two same-width copies of the table instead
  (half the bytes, half the time, no float32 table).
  """
  values = values.astype(table.dtype)
  bits = bits_dtype(table.dtype)
  if bits is None:
    return table.at[index].set(values, **scatter_flags)
  stored = (
    lax.bitcast_convert_type(table, bits)
    .at[index]
    .set(lax.bitcast_convert_type(values, bits), **scatter_flags)
  )
  return lax.bitcast_convert_type(stored, table.dtype)


def rows_to_bcoo(
  coalesced: CoalescedRows,
  layout: RowLayout,
  *,
  indices_sorted: bool = True,
  unique_indices: bool = True,
) -> BCOO:
  """The BCOO of a coalesced row update; padding rows stay out of range.

  Its indices are sorted and unique whatever the flags say: the flags are the
  BCOO's metadata, which a caller may set to mirror a gradient's so that
  updates keep the gradients' tree structure.
  """
  return BCOO(
    (coalesced.values, row_indices(coalesced.rows, layout)),
    shape=layout.shape,
    indices_sorted=indices_sorted,
    unique_indices=unique_indices,
  )
