"""Several tables' gradients coalesced at once: one sort of (table, row) keys for all of them.

A step over N tables (FBGEMM's table-batched embedding, TBE) needs each
table's distinct rows and summed gradient rows, as `coalesce.coalesce_by_one_sort`
gives for one table. Here all tables share one chain:

  key      = offset[table] + row       (offsets leave each table V + 1 keys: its
                                        rows, then its padding id V)
  sorted, order = one stable sort of (key, entry position)
  first    = sorted key differs from the one before; rank = cumsum(first) - 1
  segment  = the table's window start + the row's rank within its table
             (padding: the table's spare slot, so segments stay ascending)
  summed   = one segment sum of the gathered gradient rows per row width and dtype

Every key of a table is below every key of the next, so a table's entries
occupy a range of the sorted keys fixed when the step is traced (its entries'
count), as its summed rows occupy a fixed window of the segment sum: each
table's result is a static slice, and it equals what its own sort gives bit
for bit (the sort is stable and the positions ascend within a table, so each
row's entries are summed in input order from -0.0, as on one table).

Tables of different row widths or gradient dtypes share the sort; each width
and dtype has its own gather and segment sum (the tables are ordered by
width and dtype first, so each group's entries are one range of the sort).
Where the keys of all tables would not fit in int32, the sort takes two keys
(table, row) instead: still one sort.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_sparse_adam._core.bcoo import CoalescedRows
from optax_sparse_adam._core.coalesce import segment_sum

# The largest key of a one-key sort (int32); a larger sum of tables sorts by (table, row).
MAX_KEY = int(np.iinfo(np.int32).max)


class TableGrad(NamedTuple):
  """One table's gradient, as a step coalesces it.

  Attributes:
    rows: int32 `(nse,)` row ids (`bcoo.linear_rows`: padding is `num_rows`).
    values: `(nse, ...)` gradient rows.
    num_rows: the table's number of rows.
  """

  rows: jax.Array
  values: jax.Array
  num_rows: int


def width_groups(grads: Sequence[TableGrad]) -> list[list[int]]:
  """The tables by row shape and dtype (each group one gather and segment sum), in order."""
  groups: dict[tuple, list[int]] = {}
  for k, grad in enumerate(grads):
    groups.setdefault((tuple(grad.values.shape[1:]), jnp.dtype(grad.values.dtype)), []).append(k)
  return list(groups.values())


def coalesce_tables(grads: Sequence[TableGrad], *, max_key: int = MAX_KEY) -> list[CoalescedRows]:
  """Each table's `coalesce.coalesce_by_one_sort(rows, values, num_rows)`, from one sort.

  Args:
    grads: the tables' gradients, each with at least one entry.
    max_key: the largest key a one-key sort may use (tests lower it to reach
      the two-key sort).

  Returns:
    One `CoalescedRows` per table, in the order given, equal bit for bit to the
    table's own `coalesce_by_one_sort`.
  """
  groups = width_groups(grads)
  order_of_tables = [k for group in groups for k in group]
  ordered = [grads[k] for k in order_of_tables]
  sizes = [grad.rows.shape[0] for grad in ordered]
  if min(sizes, default=0) == 0:
    raise ValueError(f"coalesce_tables: every table needs an entry, got sizes {sizes}")
  # Static: each table's first entry in the sort, and first slot of the segment sum
  # (its entries' slots, then one spare slot that its padding entries are summed into).
  bases = np.concatenate([[0], np.cumsum(sizes)]).tolist()
  windows = [base + k for k, base in enumerate(bases)]
  total = bases[-1]
  positions = lax.iota(jnp.int32, total)
  # Each table's keys: its rows, then its padding id num_rows.
  offsets = np.concatenate([[0], np.cumsum([grad.num_rows + 1 for grad in ordered])]).tolist()
  one_key = offsets[-1] - 1 <= max_key
  if one_key:
    keys = jnp.concatenate(
      [
        grad.rows.astype(jnp.int32) + np.int32(off)
        for grad, off in zip(ordered, offsets[:-1], strict=True)
      ]
    )
    sorted_keys, order = lax.sort((keys, positions), num_keys=1, is_stable=True)
    first = sorted_keys[1:] != sorted_keys[:-1]
    sorted_rows = [
      sorted_keys[bases[t] : bases[t + 1]] - np.int32(offsets[t]) for t in range(len(ordered))
    ]
  else:
    tables = jnp.concatenate([jnp.full((n,), t, jnp.int32) for t, n in enumerate(sizes)])
    rows = jnp.concatenate([grad.rows.astype(jnp.int32) for grad in ordered])
    sorted_tables, sorted_all, order = lax.sort(
      (tables, rows, positions), num_keys=2, is_stable=True
    )
    first = (sorted_all[1:] != sorted_all[:-1]) | (sorted_tables[1:] != sorted_tables[:-1])
    sorted_rows = [sorted_all[bases[t] : bases[t + 1]] for t in range(len(ordered))]
  is_first = jnp.concatenate([jnp.ones((1,), bool), first])
  rank = jnp.cumsum(is_first, dtype=jnp.int32) - 1  # each entry's row among all tables' rows

  segments = []
  for t, grad in enumerate(ordered):
    local = rank[bases[t] : bases[t + 1]] - rank[bases[t]]
    valid = sorted_rows[t] < grad.num_rows
    segments.append(jnp.where(valid, windows[t] + local, windows[t] + sizes[t]))
  segment = jnp.concatenate(segments)  # ascending: tables in order, padding last in each
  num_slots = windows[-1]  # every table's slots and spare slot
  # The distinct rows of every table, in one scatter: each first entry at its slot.
  distinct = (
    jnp.full((num_slots,), MAX_KEY, jnp.int32)
    .at[jnp.where(is_first, segment, num_slots)]
    .set(jnp.concatenate(sorted_rows), mode="drop", unique_indices=True)
  )

  results: list[CoalescedRows | None] = [None] * len(grads)
  start = 0
  for group in groups:
    members = range(start, start + len(group))
    start += len(group)
    lo, hi = bases[members[0]], bases[members[-1] + 1]
    slot_lo = windows[members[0]]
    values = jnp.concatenate([ordered[t].values for t in members])
    gathered = values.at[order[lo:hi] - np.int32(lo)].get(
      mode="promise_in_bounds", unique_indices=True
    )
    # The slots of the group's tables that receive an in-range row (not the spare slots).
    used = jnp.concatenate(
      [distinct[windows[t] : windows[t + 1]] < ordered[t].num_rows for t in members]
    )
    summed = segment_sum(
      gathered, segment[lo:hi] - np.int32(slot_lo), used, indices_are_sorted=True
    )
    for t in members:
      grad, window = ordered[t], windows[t]
      unique = distinct[window : window + sizes[t]]
      slots = lax.iota(jnp.int32, sizes[t])
      table_rows = jnp.where(unique < grad.num_rows, unique, grad.num_rows + slots)
      table_sums = summed[window - slot_lo : window - slot_lo + sizes[t]]
      results[order_of_tables[t]] = CoalescedRows(table_rows, table_sums)
  return [r for r in results if r is not None]
