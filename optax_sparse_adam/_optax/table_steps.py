"""The sparse parameters of one update stepped together: on accelerators, one sort for all tables.

`masked_leaf_steps` is `leaf.masked_leaf_step` for every BCOO leaf of an
update. The leaves whose step is local (not row-sharded, not left to XLA's
partitioner, outside `optax.apply_if_finite` and Explicit mesh axes) go to
`dispatch.masked_steps` together, which on CUDA, ROCm and TPU coalesces all
their gradients with one sort (`_backends/table_batched.py`) and on the CPU
runs each table's own path, as before. The others are stepped one by one, for
the reason `unbatched_reason` gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.experimental import sparse

from optax_sparse_adam._backends import dispatch
from optax_sparse_adam._core import bcoo, row_update
from optax_sparse_adam._core.rules import RowRule, StepConfig, StepInputs, Tables, stores_rows
from optax_sparse_adam._core.set_rows import as_set_rows
from optax_sparse_adam._core.sharded import auto_partition, routed, sharding
from optax_sparse_adam._optax import leaf, leaf_plan


class SparseLeaf(NamedTuple):
  """One parameter's BCOO gradient and what its step reads.

  Attributes:
    path: the leaf's pytree path, for error messages.
    grad: its BCOO gradient.
    tables: the rule's tables (and the parameter).
    step: its step count before this step, or None.
    update_flags: the update BCOO's `(indices_sorted, unique_indices)` metadata.
  """

  path: tuple
  grad: sparse.BCOO
  tables: Tables
  step: jax.Array | None
  update_flags: tuple[bool, bool] = (True, True)


def unbatched_reason(prepared: leaf_plan.PreparedStep | None) -> str | None:
  """Why a leaf's step is not batched with the others' (None: it is), for `prepared`.

  None as `prepared` asks about the update as a whole (the reasons that hold
  for every leaf).
  """
  if sharding.explicit_axes():
    return "the step runs under Explicit mesh axes (each table in its own auto-axes region)"
  if leaf._inside_optax_apply_if_finite():
    return "the step is inside optax.apply_if_finite (its updates are plain BCOOs)"
  if prepared is None:
    return None
  grad, tables, plan, _ = prepared
  if routed.plan_step(grad, tables, plan) is not None:
    return "the table is row-sharded: its step is routed to each row's owner"
  if auto_partition.plan_step(grad, tables, plan) is not None:
    return "the table is split under Auto mesh axes: XLA's partitioner steps it"
  return None


def masked_leaf_steps(
  leaves: Sequence[SparseLeaf],
  *,
  rule: RowRule,
  config: StepConfig,
  hyper: Any,
  opaque_zero: jax.Array | None = None,
) -> list[leaf.LeafStep]:
  """`leaf.masked_leaf_step` of each leaf (same results), the local ones stepped together."""

  def alone(item: SparseLeaf) -> leaf.LeafStep:
    return leaf.masked_leaf_step(
      item.grad,
      item.tables,
      item.step,
      rule=rule,
      config=config,
      hyper=hyper,
      path=item.path,
      opaque_zero=opaque_zero,
      update_flags=item.update_flags,
    )

  if len(leaves) < 2 or unbatched_reason(None) is not None:
    return [alone(item) for item in leaves]
  prepared: dict[int, leaf_plan.PreparedStep] = {}
  for k, item in enumerate(leaves):
    ready = leaf_plan.prepare_leaf_step(
      item.grad, item.tables, item.step, rule=rule, config=config, path=item.path
    )
    if unbatched_reason(ready) is None:
      prepared[k] = ready
  if len(prepared) < 2:
    return [alone(item) for item in leaves]
  steps = []
  for ready in prepared.values():
    routed.check_placement(None, list(ready.tables.slots.values()), "step")
    rows = bcoo.linear_rows(ready.grad.indices, ready.plan.layout)
    inputs = StepInputs(rows, ready.grad.data, ready.tables, ready.new_step, hyper, opaque_zero)
    steps.append((inputs, ready.plan))
  results = dict(zip(prepared, dispatch.masked_steps(steps), strict=True))
  out = []
  for k, item in enumerate(leaves):
    if k not in results:
      out.append(alone(item))
      continue
    ready, result = prepared[k], results[k]
    coalesced = bcoo.CoalescedRows(result.rows, result.delta)
    built = bcoo.rows_to_bcoo(coalesced, ready.plan.layout)
    indices_sorted, unique_indices = item.update_flags
    update = row_update.RowUpdate(
      (built.data, built.indices),
      shape=ready.grad.shape,
      indices_sorted=indices_sorted,
      unique_indices=unique_indices,
    )
    final = as_set_rows(update) if stores_rows(rule, ready.plan.config) else update
    out.append(leaf.LeafStep(final, ready.new_step, result.tables))
  return out
