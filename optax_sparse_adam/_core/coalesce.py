"""Coalescing: a gradient's entries summed into one slot per distinct row, in three ways.

The XLA ops of every backend coalesce here, by `coalesce_and_gather_rows`; which `way` is the
backend's choice:

- "mark" and "search" (the generic XLA path): sorts the ids alone (a
  sort with no payload is several times faster on XLA:CPU), then finds each
  entry's slot by a binary search (`coalesce_and_gather_rows_unmarked`), or,
  under jit, by writing slot marks into a donated table that the step
  overwrites anyway (`segments_by_marking`).
- "one_sort", `coalesce_and_gather_by_one_sort` (GPUs and TPUs): one stable sort of
  (row id, entry position), then a sorted segment sum: no search loop (a host
  round trip per iteration on a GPU) and no write into a whole table.

All return the same `bcoo.CoalescedRows` bit for bit: each row's entries are
summed in input order from -0.0 (`segment_sum`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol, TypeAlias

import jax
import jax.numpy as jnp
from jax import lax

from optax_sparse_adam._core.bcoo import CoalescedRows, bits_dtype, gather_rows, set_rows

# The coalesced gradient, each table's old rows at its rows (then each read-only
# table's), and the tables (one of them possibly holding scratch in the touched rows).
Coalesced: TypeAlias = tuple[CoalescedRows, list[jax.Array | None], list[jax.Array | None]]
# How `coalesce_and_gather_rows` finds each entry's slot among the distinct rows.
Way: TypeAlias = Literal["mark", "search", "one_sort"]


class Coalescer(Protocol):
  """How a backend coalesces: `coalesce_and_gather_rows`'s signature and results."""

  def __call__(
    self,
    rows: jax.Array,
    values: jax.Array,
    num_rows: int,
    tables: Sequence[jax.Array | None],
    read_only: Sequence[jax.Array | None] = (),
  ) -> Coalesced: ...


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

  Its dtype must hold every slot number `0..nse` exactly and be one XLA scatters
  natively (not bfloat16 or an 8-bit float: their scatter goes through the bits,
  which XLA:CPU does around two copies of the table), and its rows must not be
  empty.
  """
  dtype = table_rows.dtype
  if not jnp.issubdtype(dtype, jnp.floating) or table_rows.ndim == 0:
    return False
  if bits_dtype(dtype) is not None:
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
  marks = _after(sorted_rows.rank, after)
  marked = set_rows(flat, (sorted_rows.sorted_rows, 0), marks, mode="drop", indices_are_sorted=True)
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
  values: jax.Array, segment: jax.Array, used: jax.Array, *, indices_are_sorted: bool = False
) -> jax.Array:
  """Sums `values` into their slots, in input order; entries past the last slot are dropped.

  Each used slot's sum starts from -0.0, the identity of float addition (-0.0 + x is x,
  either zero included), so it is its first entry plus the others, as torch's `coalesce`
  copies a row's first entry and adds the rest: entries that are all -0.0 sum to -0.0
  (from +0.0 they would give +0.0; the CPU kernels' `kSumStart` is the same). Slots that
  receive no entry (the padding slots) hold +0.0.

  Args:
    values: `(nse, ...)` the entries.
    segment: int32 `(nse,)` each entry's slot; a slot past the last (`slots`) drops it.
    used: bool `(slots,)` the slots that receive an entry.
    indices_are_sorted: promises that `segment` is ascending.

  Returns:
    `(slots, ...)` the slots' sums.
  """
  slots = used.shape[0]
  used = used.reshape(used.shape + (1,) * (values.ndim - 1))
  start = jnp.where(used, jnp.array(-0.0, values.dtype), jnp.array(0.0, values.dtype))
  start = jnp.broadcast_to(start, (slots, *values.shape[1:]))
  return start.at[segment].add(values, mode="drop", indices_are_sorted=indices_are_sorted)


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


def gathered_at(
  coalesced: CoalescedRows,
  tables: Sequence[jax.Array | None],
  read_only: Sequence[jax.Array | None],
) -> Coalesced:
  """A `Coalescer`'s result where the tables serve as no scratch: each table's rows (then each
  read-only table's) gathered at the coalesced rows, the tables as given."""
  gathered = [None if t is None else gather_rows(t, coalesced.rows) for t in (*tables, *read_only)]
  return coalesced, gathered, list(tables)


def coalesce_and_gather_rows(
  rows: jax.Array,
  values: jax.Array,
  num_rows: int,
  tables: Sequence[jax.Array | None],
  read_only: Sequence[jax.Array | None] = (),
  *,
  way: Way = "mark",
) -> Coalesced:
  """`coalesce_rows`, plus the rows of `tables` at the distinct rows, the fast way.

  The result equals `coalesce_rows(rows, values, num_rows)` bit for bit, and
  the gathered rows equal `gather_rows(table, coalesced.rows)`, whichever `way`.
  With "mark", under a trace (jit), when one of the tables can hold slot numbers
  (`can_mark`), it serves as scratch for
  `segments_by_marking`: the caller must then scatter whole rows into every
  touched row of the returned tables, as an Adam step does with its moments.

  Args:
    rows: int32 `(nse,)` row ids from `linear_rows` (padding is `num_rows`).
    values: `(nse, ...)` gradient values.
    num_rows: the number of rows of the tables.
    tables: `(num_rows, ...)` tables (or None) whose touched rows are wanted.
    read_only: more such tables, never used as scratch (e.g. the parameter).
    way: how each entry finds its row's slot: "mark" (marks written into a
      table, as above, else as "search"), "search" (`segments_by_search`, no
      table used as scratch) or "one_sort" (`coalesce_by_one_sort`: no search
      loop, no table written).

  Returns:
    `(coalesced, gathered, tables)`: the `CoalescedRows`; the old rows of each
    table, then of each read-only table (None for None); the tables, one of them
    possibly holding scratch.
  """
  nse = rows.shape[0]
  if nse == 0:
    return gathered_at(CoalescedRows(rows.astype(jnp.int32), values), tables, read_only)
  if way == "one_sort":
    return gathered_at(coalesce_by_one_sort(rows, values, num_rows), tables, read_only)
  tables = list(tables)
  sorted_rows = sort_rows(rows, num_rows)
  unique_rows = sorted_rows.unique_rows
  gathered = [None if t is None else gather_rows(t, unique_rows) for t in tables]
  # Only under a trace (jit): eagerly, every scatter copies its whole table, and
  # marking would add one more such copy to the step.
  scratch = next(
    (k for k, t in enumerate(tables) if isinstance(t, jax.core.Tracer) and can_mark(t, nse)),
    None,
  )
  if way != "mark":
    scratch = None
  if scratch is None:
    segment = segments_by_search(rows, sorted_rows, num_rows)
  else:
    table, old_rows = tables[scratch], gathered[scratch]
    assert table is not None and old_rows is not None  # chosen among the arrays
    segment, tables[scratch] = segments_by_marking(rows, sorted_rows, table, old_rows)
  gathered += [None if t is None else gather_rows(t, unique_rows) for t in read_only]
  summed = segment_sum(values, segment, unique_rows < num_rows)
  return CoalescedRows(unique_rows, summed), gathered, tables


def coalesce_by_one_sort(rows: jax.Array, values: jax.Array, num_rows: int) -> CoalescedRows:
  """`coalesce_rows` by one stable sort of (row id, entry position) and a sorted segment sum.

  `rows` are ids from `bcoo.linear_rows` (out of range is `num_rows`).
  """
  nse = rows.shape[0]
  positions = lax.iota(jnp.int32, nse)
  sorted_ids, order = lax.sort((rows.astype(jnp.int32), positions), num_keys=1, is_stable=True)
  numbered = number_sorted_rows(sorted_ids, num_rows)
  # Out-of-range ids sort last, so their slot `nse` (dropped) keeps the slots sorted.
  segment = jnp.where(sorted_ids < num_rows, numbered.rank, nse)
  sorted_values = values.at[order].get(mode="promise_in_bounds", unique_indices=True)
  summed = segment_sum(
    sorted_values, segment, numbered.unique_rows < num_rows, indices_are_sorted=True
  )
  return CoalescedRows(numbered.unique_rows, summed)


# The other ways, each a `Coalescer`.
coalesce_and_gather_by_one_sort: Coalescer = functools.partial(
  coalesce_and_gather_rows, way="one_sort"
)
"""`coalesce_and_gather_rows` by `coalesce_by_one_sort`: the same results, tables untouched."""
# For a step whose tables are stored by something other than XLA's scatter (the CPU's
# in-place row store): a scratch scatter there would be one more write of the table, and
# XLA copies a table that a scatter and a custom call both update.
coalesce_and_gather_rows_unmarked: Coalescer = functools.partial(
  coalesce_and_gather_rows, way="search"
)
"""`coalesce_and_gather_rows` with no table used as scratch (`segments_by_search`)."""
