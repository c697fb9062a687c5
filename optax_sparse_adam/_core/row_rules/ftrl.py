"""The FTRL-Proximal rule: Keras's `Ftrl` (TF's `SparseApplyFtrlV2`) on sparse gradients.

`FtrlRule` keeps two slots of the parameter's shape, `accumulator` (starting
at `initial_accumulator_value`) and `linear` (at 0), reads the parameter's rows
and sets them. On the touched rows r, with `g` the coalesced gradient (Keras
sums duplicates before the sparse step), `w` the rows, `p = -learning_rate_power`,

  g'       = g + 2 * l2_shrinkage * w            (g itself without shrinkage)
  n'       = n + g^2
  linear  += g' - (n'^p - n^p) / lr * w
  quad     = n'^p / lr + 2 * (l2 + beta / (2 * lr))
  w        = (sign(linear) * l1 - linear) / quad  where |linear| > l1, else exactly 0
  n        = n'

(`n^0.5` is `sqrt`, as in TF's kernel). Rows the gradient skips do not change:
the step is lazy, as TF's sparse step. The new rows are set, not added
(`rules.sets_rows`), so L1's zeros are exact zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._core.errors import is_python_number
from optax_sparse_adam._core.row_rules.adam import block_arithmetic
from optax_sparse_adam._core.rules import CatchUp, RowBlock, Slot, StepConfig


class FtrlHyperparams(NamedTuple):
  """The traced hyper-parameters of an FTRL step (floats or 0-d arrays).

  Attributes:
    learning_rate: `lr`.
    learning_rate_power: `-p`, at most 0 (-0.5: the square root).
    l1_regularization_strength: `l1`.
    l2_regularization_strength: `l2`.
    l2_shrinkage_regularization_strength: the shrinkage added to the gradient.
    beta: added to the denominator, as `beta / (2 * lr)` to `l2`.
    weight_decay: the pipeline's weight decay: None (FTRL's own L2 is above).
  """

  learning_rate: Any
  learning_rate_power: Any = -0.5
  l1_regularization_strength: Any = 0.0
  l2_regularization_strength: Any = 0.0
  l2_shrinkage_regularization_strength: Any = 0.0
  beta: Any = 0.0
  weight_decay: Any = None


@dataclasses.dataclass(frozen=True)
class FtrlRule:
  """Keras's FTRL-Proximal row rule (module docstring).

  Attributes:
    initial_accumulator_value: where `accumulator` starts.
  """

  initial_accumulator_value: float = 0.1
  name: str = dataclasses.field(default="ftrl", init=False)
  reads_param: bool = dataclasses.field(default=True, init=False)
  sets_rows: bool = dataclasses.field(default=True, init=False)

  def slots(self) -> tuple[Slot, ...]:
    return (Slot("accumulator", init=self.initial_accumulator_value), Slot("linear"))

  def update(
    self, block: RowBlock, hyper: FtrlHyperparams
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The new rows and the new `accumulator` and `linear` rows; see `rules.RowRule.update`."""
    c, r, store = block_arithmetic(block)
    cd = block.compute_dtype
    assert block.param is not None  # the rule reads the parameter (`reads_param`)
    w = block.param.astype(cd)
    g = block.grad.astype(cd)
    lr = c(hyper.learning_rate)
    power = hyper.learning_rate_power

    def powered(n: jax.Array) -> jax.Array:
      if is_python_number(power) and power == -0.5:
        return jnp.sqrt(n)
      return jnp.power(n, -c(power))

    shrinkage = hyper.l2_shrinkage_regularization_strength
    shrunk = g
    if not (is_python_number(shrinkage) and shrinkage == 0):
      shrunk = g + r(r(c(2) * c(shrinkage)) * w)
    old = block.slots["accumulator"].astype(cd)
    stored = store("accumulator", old + r(g * g))
    new = stored.astype(cd)
    new_power = powered(new)
    sigma = (new_power - powered(old)) / lr
    stored_linear = store("linear", block.slots["linear"].astype(cd) + shrunk - r(sigma * w))
    linear = stored_linear.astype(cd)
    l1 = c(hyper.l1_regularization_strength)
    l2 = c(hyper.l2_regularization_strength) + c(hyper.beta) / (c(2) * lr)
    quadratic = new_power / lr + r(c(2) * l2)
    rows = jnp.where(
      jnp.abs(linear) > l1,
      (r(jnp.sign(linear) * l1) - linear) / quadratic,
      jnp.zeros((), cd),
    )
    return rows, {"accumulator": stored, "linear": stored_linear}

  def catch_up(self, config: StepConfig) -> CatchUp:
    """Refused (`rules.CatchUp`): dense FTRL moves rows that no step has set yet."""
    del config
    return CatchUp(
      refused="dense FTRL recomputes every row from its linear term at every step, so a "
      "row no gradient has touched moves to 0 (and with l2 shrinkage every row moves): "
      "there is no closed form of the idle steps of a lazy FTRL"
    )
