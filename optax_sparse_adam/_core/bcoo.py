"""BCOO plumbing: validate a sparse gradient, coalesce its rows, gather and scatter them.

Every sparse leaf is handled as a table of rows: the `n_sparse` leading dims of
the parameter are flattened into one row axis of length `num_rows` and the
`n_dense` trailing dims form the row. An embedding gradient (indices `(nse, 1)`,
data `(nse, D)`) is the case `n_sparse=1, n_dense=1`; an element-wise gradient
(indices `(nse, 2)`, data `(nse,)`) is `n_sparse=2, n_dense=0`.

All shapes here are static: a step over `nse` gradient entries works on arrays
of length `nse`, whatever the size of the table.
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


class SortedRows(NamedTuple):
  """The distinct rows of a gradient, found by sorting its row ids alone.

  Attributes:
    sorted_rows: int32 `(nse,)`, the row ids in ascending order (out-of-range
      ids, all equal to `num_rows`, last).
    rank: int32 `(nse,)`, for each entry of `sorted_rows`, the slot of its row
      among the distinct rows.
    unique_rows: int32 `(nse,)`, the distinct in-range rows in ascending order,
      then distinct out-of-range rows `num_rows + slot` (see `CoalescedRows`).
  """

  sorted_rows: jax.Array
  rank: jax.Array
  unique_rows: jax.Array


def sort_rows(rows: jax.Array, num_rows: int) -> SortedRows:
  """Sorts `rows` (ids from `linear_rows`) and numbers their distinct values.

  Only the int32 ids are sorted, with no payload: XLA's CPU sort of a lone key
  array is several times faster than a sort that carries a permutation along.
  """
  return number_sorted_rows(lax.sort(rows.astype(jnp.int32)), num_rows)


def number_sorted_rows(sorted_rows: jax.Array, num_rows: int) -> SortedRows:
  """Numbers the distinct values of int32 row ids already sorted ascending (see `SortedRows`)."""
  nse = sorted_rows.shape[0]
  slots = jnp.arange(nse, dtype=jnp.int32)
  is_first = jnp.concatenate([jnp.ones((1,), bool), sorted_rows[1:] != sorted_rows[:-1]])
  rank = jnp.cumsum(is_first, dtype=jnp.int32) - 1
  unique_rows = (
    jnp.full((nse,), num_rows, jnp.int32)
    .at[jnp.where(is_first, rank, nse)]
    .set(sorted_rows, mode="drop", unique_indices=True)
  )
  unique_rows = jnp.where(unique_rows < num_rows, unique_rows, num_rows + slots)
  return SortedRows(sorted_rows, rank, unique_rows)


def segments_by_search(rows: jax.Array, sorted_rows: SortedRows, num_rows: int) -> jax.Array:
  """The slot among the distinct rows of each entry of `rows`, by binary search.

  Out-of-range entries get the out-of-range slot `nse`.
  """
  nse = rows.shape[0]
  position = jnp.searchsorted(sorted_rows.sorted_rows, rows, side="left", method="scan")
  return jnp.where(rows < num_rows, sorted_rows.rank[position], nse)


def can_mark(table_rows: jax.Array, nse: int) -> bool:
  """Whether `segments_by_marking` can use `table_rows` as scratch.

  Its dtype must hold every slot number `0..nse` exactly, and its rows must not
  be empty.
  """
  dtype = table_rows.dtype
  if not jnp.issubdtype(dtype, jnp.floating) or table_rows.ndim == 0:
    return False
  row_size = math.prod(table_rows.shape[1:])
  return row_size > 0 and table_rows.shape[0] > 0 and nse <= 2 ** (jnp.finfo(dtype).nmant + 1)


def segments_by_marking(
  rows: jax.Array, sorted_rows: SortedRows, table_rows: jax.Array, after: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """The slot among the distinct rows of each entry, found through a scratch table.

  Writes each row's slot into the first element of that row of `table_rows`
  and reads it back for every entry: two scatters/gathers of `nse` scalars
  instead of a sort carrying a permutation or a binary search. The caller must
  overwrite every touched row of the returned table afterwards (the Adam step
  writes whole rows), so the scratch values never escape.

  Args:
    rows: int32 `(nse,)` row ids (out-of-range ids are `>= num_rows`).
    sorted_rows: `sort_rows(rows, num_rows)`.
    table_rows: a `(num_rows, ...)` table with `can_mark(table_rows, nse)`,
      typically a donated optimizer moment.
    after: rows already gathered from `table_rows`. The marks are written after
      they are computed, so XLA updates the donated table in place instead of
      copying it to keep the old rows readable.

  Returns:
    `(segment, marked_table)`: int32 `(nse,)` slots, `nse` for out-of-range
    entries; and the table with scratch values in the touched rows.
  """
  nse = rows.shape[0]
  num_rows = table_rows.shape[0]
  flat = table_rows.reshape(num_rows, -1)
  marks = _after(sorted_rows.rank, after).astype(flat.dtype)
  marked = flat.at[sorted_rows.sorted_rows, 0].set(marks, mode="drop", indices_are_sorted=True)
  segment = marked.at[rows, 0].get(mode="fill", fill_value=nse).astype(jnp.int32)
  return segment, marked.reshape(table_rows.shape)


def _after(x: jax.Array, dependency: jax.Array) -> jax.Array:
  """`x`, with a data dependency on `dependency` that XLA cannot simplify away.

  Adds a zero computed from the bits of one element of `dependency` (its top
  bit, shifted out), so `x` stays exact whatever that element holds, NaN too.
  """
  element = dependency.reshape(-1)[0]
  bits = jnp.finfo(element.dtype).bits
  word = lax.bitcast_convert_type(element, jnp.dtype(f"uint{bits}"))
  top_bit = lax.shift_right_logical(word, jnp.array(bits - 1, word.dtype))
  zero = lax.shift_right_logical(top_bit, jnp.array(1, word.dtype))
  return x + zero.astype(x.dtype)


def segment_sum(
  values: jax.Array, segment: jax.Array, *, indices_are_sorted: bool = False
) -> jax.Array:
  """Sums `values` into their slots, in input order; entries with slot `nse` are dropped.

  Slots that receive no entry (the padding slots) hold zeros. `indices_are_sorted`
  promises that `segment` is ascending.
  """
  return (
    jnp.zeros_like(values)
    .at[segment]
    .add(values, mode="drop", indices_are_sorted=indices_are_sorted)
  )


def coalesce_rows(rows: jax.Array, values: jax.Array, num_rows: int) -> CoalescedRows:
  """Sums the values of repeated rows, as torch's `grad.coalesce()` does.

  Entries with an out-of-range row (negative or `>= num_rows`) are dropped. The output has
  the static length of the input; see `CoalescedRows` for its padding. The
  values of each row are added in input order.
  """
  rows = rows.astype(jnp.int32)
  rows = jnp.where((rows >= 0) & (rows < num_rows), rows, jnp.int32(num_rows))
  coalesced, _, _ = coalesce_and_gather_rows(rows, values, num_rows, ())
  return coalesced


def coalesce_and_gather_rows(
  rows: jax.Array,
  values: jax.Array,
  num_rows: int,
  tables: Sequence[jax.Array | None],
) -> tuple[CoalescedRows, list[jax.Array | None], list[jax.Array | None]]:
  """`coalesce_rows`, plus the rows of `tables` at the distinct rows, the fast way.

  The result equals `coalesce_rows(rows, values, num_rows)` bit for bit, and
  the gathered rows equal `gather_rows(table, coalesced.rows)`. Under a trace
  (jit), when one of the tables can hold slot numbers (`can_mark`), it serves as
  scratch for
  `segments_by_marking`: the caller must then scatter whole rows into every
  touched row of the returned tables, as an Adam step does with its moments.

  Args:
    rows: int32 `(nse,)` row ids from `linear_rows` (padding is `num_rows`).
    values: `(nse, ...)` gradient values.
    num_rows: the number of rows of the tables.
    tables: `(num_rows, ...)` tables (or None) whose touched rows are wanted.

  Returns:
    `(coalesced, gathered, tables)`: the `CoalescedRows`; the old rows of each
    table (None for None); the tables, one of them possibly holding scratch.
  """
  tables = list(tables)
  nse = rows.shape[0]
  if nse == 0:
    coalesced = CoalescedRows(rows.astype(jnp.int32), values)
    return (
      coalesced,
      [None if t is None else gather_rows(t, coalesced.rows) for t in tables],
      tables,
    )
  sorted_rows = sort_rows(rows, num_rows)
  unique_rows = sorted_rows.unique_rows
  gathered = [None if t is None else gather_rows(t, unique_rows) for t in tables]
  # Only under a trace (jit): eagerly, every scatter copies its whole table, and
  # marking would add one more such copy to the step.
  scratch = next(
    (k for k, t in enumerate(tables) if isinstance(t, jax.core.Tracer) and can_mark(t, nse)),
    None,
  )
  if scratch is None:
    segment = segments_by_search(rows, sorted_rows, num_rows)
  else:
    segment, tables[scratch] = segments_by_marking(
      rows, sorted_rows, tables[scratch], gathered[scratch]
    )
  return CoalescedRows(unique_rows, segment_sum(values, segment)), gathered, tables


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


def rows_to_bcoo(coalesced: CoalescedRows, layout: RowLayout) -> BCOO:
  """The BCOO of a coalesced row update: sorted, unique indices; padding out of range."""
  return BCOO(
    (coalesced.values, row_indices(coalesced.rows, layout)),
    shape=layout.shape,
    indices_sorted=True,
    unique_indices=True,
  )
