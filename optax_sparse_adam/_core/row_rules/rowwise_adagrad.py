"""The row-wise Adagrad rule: FBGEMM's EXACT_ROWWISE_ADAGRAD, one accumulator per row.

`RowwiseAdagradRule` keeps one slot `sum`, one value per row (shape
`(num_rows,)`). On the touched rows r, with `g` the coalesced gradient (L2
weight decay already added by the pipeline) and `D` the number of values in a row,

  sum[r]  += sum_D(g[r]^2) * (1 / D)
  delta[r] = -(lr / (sqrt(sum[r]) + eps)) * g[r]

FBGEMM's weight-decay modes are the pipeline's (`rules.StepConfig`): L2 (mode 1:
`g += wd * w` before the row mean, so `w' = (1 - mult * wd) w - mult * g`) and
decoupled (mode 2: `w' = (1 - lr * wd) w - mult * g`); its `max_norm` is the
pipeline's renormalisation after the step. Differs from FBGEMM only in
rounding: the row sum is added pairwise in a fixed order
(`osa.row_sum`, which the CPU row program runs as one op), and the mean is a
product with `1 / D`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._core.row_rules.adam import block_arithmetic
from optax_sparse_adam._core.row_rules.rowwise_adam import inverse_row_size
from optax_sparse_adam._core.row_sum import row_sum
from optax_sparse_adam._core.rules import (
  CatchUp,
  RowBlock,
  Slot,
  StepConfig,
  still_without_weight_decay,
)


class RowwiseAdagradHyperparams(NamedTuple):
  """The traced hyper-parameters of a row-wise Adagrad step (floats or 0-d arrays)."""

  learning_rate: Any
  eps: Any = 1e-8
  weight_decay: Any = None


@dataclasses.dataclass(frozen=True)
class RowwiseAdagradRule:
  """FBGEMM's EXACT_ROWWISE_ADAGRAD as a row rule (module docstring)."""

  name: str = dataclasses.field(default="rowwise_adagrad", init=False)

  def slots(self) -> tuple[Slot, ...]:
    return (Slot("sum", per_row=True),)

  def update(
    self, block: RowBlock, hyper: RowwiseAdagradHyperparams
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The delta and the new per-row `sum` of `n` rows; see `rules.RowRule.update`."""
    c, r, store = block_arithmetic(block)
    g = block.grad.astype(block.compute_dtype)
    n = g.shape[0]
    row_size = math.prod(g.shape[1:])
    mean_square = row_sum(r(g * g))
    if row_size != 1:
      mean_square = r(mean_square * c(inverse_row_size(row_size, block.compute_dtype)))
    total = store("sum", block.slots["sum"].astype(block.compute_dtype) + mean_square)
    rate = c(hyper.learning_rate) / (jnp.sqrt(total.astype(block.compute_dtype)) + c(hyper.eps))
    rate = rate.reshape((n,) + (1,) * (g.ndim - 1))
    return r(-rate * g), {"sum": total}

  def catch_up(self, config: StepConfig) -> CatchUp:
    """Idle rows stay under dense row-wise Adagrad without weight decay (`rules.CatchUp`)."""
    return still_without_weight_decay(config)
