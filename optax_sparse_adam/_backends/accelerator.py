"""The masked step on GPUs and TPUs: one sort of the ids, then distinct rows only.

The generic XLA path (`bcoo.coalesce_and_gather_rows`) sorts the ids alone
and finds each entry's slot by a binary search (a while loop: on a GPU, a host
round trip per iteration) or by writing slot marks into the donated first
moment (which XLA:GPU answers with whole-table copies). Here instead:

  sorted_rows, order = stable sort of (row id, entry position)  (one sort)
  slot   = cumsum(is first of its row) - 1                    (sorted, so sums
  values = segment_sum(grad[order], slot, indices_are_sorted)  need no search)
  m, v, p rows of the distinct rows: gathered, Adam'd (`adam.adam_rows`),
  scattered back with unique, sorted indices into the donated tables.

No array of the table's size is made besides the donated tables, and there is
no loop. The sort is stable, so each row's entries are summed in input order
from +0.0, as the generic path does: on the CPU the two agree bit for bit. A
GPU's scatter-add may add a row's entries in another order (the last bits of
rows with duplicate ids then differ; everything after the sum is the same
element-wise arithmetic).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from optax_sparse_adam._backends import xla
from optax_sparse_adam._core import bcoo
from optax_sparse_adam._core.adam import RowsStep, StepOptions, TableState


def coalesce_and_gather_rows(
  rows: jax.Array,
  values: jax.Array,
  num_rows: int,
  tables: Sequence[jax.Array | None],
) -> tuple[bcoo.CoalescedRows, list[jax.Array | None], list[jax.Array | None]]:
  """`bcoo.coalesce_and_gather_rows` by one stable sort: the same results, tables untouched.

  Args:
    rows: int32 `(nse,)` row ids from `bcoo.linear_rows` (padding is `num_rows`).
    values: `(nse, ...)` gradient values.
    num_rows: the number of rows of the tables.
    tables: `(num_rows, ...)` tables (or None) whose touched rows are wanted.

  Returns:
    `(coalesced, gathered, tables)`: the `CoalescedRows`, the old rows of each
    table at the coalesced rows (None for None), and `tables` as given.
  """
  tables = list(tables)
  nse = rows.shape[0]
  if nse == 0:
    coalesced = bcoo.CoalescedRows(rows.astype(jnp.int32), values)
  else:
    coalesced = coalesce_rows(rows, values, num_rows)
  gathered = [None if t is None else bcoo.gather_rows(t, coalesced.rows) for t in tables]
  return coalesced, gathered, tables


def coalesce_rows(rows: jax.Array, values: jax.Array, num_rows: int) -> bcoo.CoalescedRows:
  """Sums the values of repeated rows in input order; rows `>= num_rows` are dropped.

  See `bcoo.CoalescedRows` for the padding of the result.
  """
  nse = rows.shape[0]
  positions = lax.iota(jnp.int32, nse)
  sorted_ids, order = lax.sort((rows.astype(jnp.int32), positions), num_keys=1, is_stable=True)
  numbered = bcoo.number_sorted_rows(sorted_ids, num_rows)
  # Out-of-range ids sort last, so their slot `nse` (dropped) keeps the slots sorted.
  segment = jnp.where(sorted_ids < num_rows, numbered.rank, nse)
  sorted_values = values.at[order].get(mode="promise_in_bounds", unique_indices=True)
  summed = bcoo.segment_sum(sorted_values, segment, indices_are_sorted=True)
  return bcoo.CoalescedRows(numbered.unique_rows, summed)


def rows_step(
  rows: jax.Array,
  values: jax.Array,
  tables: TableState,
  *,
  layout: bcoo.RowLayout,
  options: StepOptions,
) -> RowsStep:
  """`xla.rows_step` (same arguments and results), coalescing by one sort.

  Every option of the generic step is supported: the two differ only in how
  the distinct rows and their summed gradients are found.
  """
  return xla.rows_step(
    rows, values, tables, layout=layout, options=options, coalesce=coalesce_and_gather_rows
  )
