"""The Adagrad rule: torch.optim.Adagrad's arithmetic on sparse gradients.

`AdagradRule` keeps one slot `sum` (the parameter's shape, starting at
`initial_accumulator_value`). On the touched rows r, with `g` the coalesced
gradient (torch coalesces a sparse gradient first) and `t` the parameter's step,

  sum[r]  += g^2
  clr      = lr / (1 + (t - 1) * lr_decay)
  delta[r] = -clr * (g / (sqrt(sum[r]) + eps))

in torch's order of operations (`_single_tensor_adagrad`'s sparse branch). The
torch adapter gives `clr` computed on the host in float64, as torch does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._core.row_rules.adam import block_arithmetic
from optax_sparse_adam._core.rules import (
  CatchUp,
  RowBlock,
  Slot,
  StepConfig,
  still_without_weight_decay,
)


class AdagradHyperparams(NamedTuple):
  """The traced hyper-parameters of an Adagrad step (floats or 0-d arrays).

  Attributes:
    learning_rate: `lr`.
    lr_decay: the decay of the learning rate with the step count.
    eps: added to `sqrt(sum)`.
    weight_decay: the pipeline's weight-decay rate, or None.
    step_size: `clr` given by the caller (the torch adapter), or None to
      compute it from the step count.
  """

  learning_rate: Any
  lr_decay: Any = 0.0
  eps: Any = 1e-10
  weight_decay: Any = None
  step_size: Any = None


@dataclasses.dataclass(frozen=True)
class AdagradRule:
  """torch.optim.Adagrad's row rule (module docstring).

  Attributes:
    initial_accumulator_value: where `sum` starts.
  """

  initial_accumulator_value: float = 0.0
  name: str = dataclasses.field(default="adagrad", init=False)

  def slots(self) -> tuple[Slot, ...]:
    return (Slot("sum", init=self.initial_accumulator_value),)

  def update(
    self, block: RowBlock, hyper: AdagradHyperparams
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The delta and the new `sum` rows of `n` rows; see `rules.RowRule.update`."""
    c, r, store = block_arithmetic(block)
    g = block.grad.astype(block.compute_dtype)
    total = store("sum", block.slots["sum"].astype(block.compute_dtype) + r(g * g))
    std = jnp.sqrt(total.astype(block.compute_dtype)) + c(hyper.eps)
    clr = step_size(hyper, block.step, block.compute_dtype)
    return r(-clr * (g / std)), {"sum": total}

  def catch_up(self, config: StepConfig) -> CatchUp:
    """Idle rows stay under dense Adagrad without weight decay (`rules.CatchUp`)."""
    return still_without_weight_decay(config)


def step_size(hyper: AdagradHyperparams, step: Any, dtype: Any) -> jax.Array:
  """torch's `clr = lr / (1 + (t - 1) * lr_decay)` at step count `t`, or the given step size.

  One place for the CPU kernel (`rule_steps`) and `AdagradRule.update` to read it.
  """
  if hyper.step_size is not None:
    return jnp.asarray(hyper.step_size, dtype)
  if step is None:
    raise ValueError("an Adagrad step needs a step count or a given step size")
  t = jnp.asarray(step).astype(dtype)
  lr, lr_decay = jnp.asarray(hyper.learning_rate, dtype), jnp.asarray(hyper.lr_decay, dtype)
  return lr / (1 + (t - 1) * lr_decay)
