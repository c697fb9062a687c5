"""The masked step on GPUs and TPUs: one sort of the ids, then distinct rows only.

The generic XLA path (`coalesce.coalesce_and_gather_rows`) sorts the ids alone
and finds each entry's slot by a binary search (a while loop: on a GPU, a host
round trip per iteration) or by writing slot marks into a donated slot table
(which XLA:GPU answers with whole-table copies). Here the rows are coalesced
by `coalesce.coalesce_and_gather_by_one_sort` instead:

  sorted_rows, order = stable sort of (row id, entry position)  (one sort)
  slot   = cumsum(is first of its row) - 1                    (sorted, so sums
  values = segment_sum(grad[order], slot, indices_are_sorted)  need no search)

and the rule's slots of the distinct rows are gathered, updated and scattered
back with unique, sorted indices into the donated tables, as on every path. No
array of the table's size is made besides the donated tables, and there is no
loop. The sort is stable, so each row's entries are summed in input order from
-0.0, as the generic path does: on the CPU the two agree bit for bit. A GPU's
scatter-add may add a row's entries in another order (the last bits of rows
with duplicate ids then differ; everything after the sum is the same
element-wise arithmetic).
"""

from optax_sparse_adam._backends import xla
from optax_sparse_adam._core import coalesce
from optax_sparse_adam._core.rules import RowsStep, StepInputs, StepPlan


def masked_step(inputs: StepInputs, plan: StepPlan) -> RowsStep:
  """`xla.masked_step` (same arguments and results), coalescing by one sort.

  Every rule and option of the generic step is supported: the two differ only
  in how the distinct rows and their summed gradients are found, and in how
  narrow float tables are stored: by a scatter of their own dtype, which GPUs
  and TPUs have (XLA:CPU does not: `xla.masked_step`'s `through_bits`).
  """
  return xla.masked_step(
    inputs, plan, coalescer=coalesce.coalesce_and_gather_by_one_sort, through_bits=False
  )
