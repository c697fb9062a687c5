"""The accelerator step of several tables at once: one sort for all of them (FBGEMM's TBE idea).

`accelerator.masked_step` runs one chain per table: a sort of its ids, a
cumulative sum, a segment sum, then the gathers, the rule and the scatters.
On a GPU each of those is one or more kernels whose latency, not their bytes,
bounds a step; a model with N tables pays for N sorts. Here the tables of one
update share the coalescing (`coalesce_tables.coalesce_tables`): one stable sort
of (table, row) keys, one cumulative sum, one scatter of the distinct rows, and
one gather and segment sum of the gradient rows per row width and dtype. Each
table's rows, summed gradient, rule and tables then run through the pipeline
every path shares (`xla.masked_step`), handed the coalesced rows.

The rules' slot tables and parameters stay what they are: one donated array per
table, updated in place. FBGEMM keeps all tables in one flat buffer, which
makes the slots' gather and scatter one kernel each; here that would need the
state to be one buffer (a different state layout), and concatenating the
tables at each step would copy every table. So each table keeps its own gather,
element-wise rule and scatter (XLA fuses the rule into them). Every table of
any rule, option, row width and dtype can share a batch: what follows the
coalescing is each table's own pipeline.

Results equal `accelerator.masked_step`'s table by table, bit for bit on the
CPU (each row's entries summed in input order from -0.0, as on one table).
"""

from collections.abc import Sequence

from optax_sparse_adam._backends import xla
from optax_sparse_adam._core import bcoo, coalesce, coalesce_tables
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan


def masked_steps(steps: Sequence[tuple[StepInputs, StepPlan]]) -> list[RowsStep]:
  """`accelerator.masked_step` of each `(inputs, plan)`, the tables coalesced together.

  Tables without entries are stepped alone (nothing to sort).
  """
  batched = [k for k, (inputs, _) in enumerate(steps) if inputs.rows.shape[0] > 0]
  coalesced = dict(
    zip(
      batched,
      coalesce_tables.coalesce_tables(
        [
          coalesce_tables.TableGrad(
            steps[k][0].rows, steps[k][0].values, steps[k][1].layout.num_rows
          )
          for k in batched
        ]
      )
      if len(batched) > 1
      else [None] * len(batched),
      strict=True,
    )
  )
  results = []
  for k, (inputs, plan) in enumerate(steps):
    given = coalesced.get(k)
    coalescer = coalesce.coalesce_and_gather_by_one_sort if given is None else _given(given)
    results.append(xla.masked_step(inputs, plan, coalescer=coalescer, through_bits=False))
  return results


def _given(rows: bcoo.CoalescedRows) -> coalesce.Coalescer:
  """A coalescer that returns rows already coalesced, and the tables' rows at them."""

  def coalescer(_rows, _values, _num_rows, tables, read_only=()):
    tables = list(tables)
    gathered = [
      None if t is None else bcoo.gather_rows(t, rows.rows) for t in (*tables, *read_only)
    ]
    return rows, gathered, tables

  return coalescer
