"""The row-wise Adam rule: a full first moment and one second moment per row.

`RowwiseAdamRule` is FBGEMM's PARTIAL_ROWWISE_ADAM (`fbgemm_gpu/codegen/genscript/
optimizers.py`, `partial_rowwise_adam`) as a `rules.RowRule`: slots `mu` (the
parameter's shape) and `nu` (one value per row, shape `(num_rows,)`), and on
the touched rows r, with `D` the number of values in a row,

  m[r]  += (1 - b1) * (g[r] - m[r])
  v[r]  += (1 - b2) * (sum_D(g[r]^2) * (1 / D) - v[r])
  vmax[r] = max(vmax[r], v[r])                          (amsgrad only)
  delta[r] = -(lr / (1 - b1^t)) / (sqrt(v[r] * (1 / (1 - b2^t))) + eps) * m[r]

so the state costs one table plus one scalar per row instead of two tables.

Against FBGEMM's reference update:

- Matches: the second moment is an exponential average of the row's mean of
  squared (coalesced) gradients; both moments are bias-corrected separately,
  `eps` is added to the root of the *bias-corrected* second moment (as in
  `optax.adam`, not as in `torch.optim.SparseAdam`/`AdamRule`, which add it to
  `sqrt(v)` and fold the corrections into the step size); decoupled weight
  decay (`sparse_adamw`) is `delta -= lr * wd * p` on the touched rows, FBGEMM's
  `weight_decay` term.
- Differs: `t` is the parameter's own step count (FBGEMM's `iter`, which counts
  the module's iterations: the same for a table stepped every iteration), or
  each row's with `per_row_bias_correction` (FBGEMM offers a row counter for its
  full Adam only); `1 - b^t` is computed as `-expm1(t * log b)` rather than by
  `powf`; the first moment is updated in the `m + (1 - b1)(g - m)` form of
  `AdamRule` (so `mu` is bit-identical to full Adam's), where FBGEMM writes
  `b1 * m + (1 - b1) * g`; L2 weight decay (`sparse_adam(weight_decay=...)`),
  which FBGEMM's row-wise Adam lacks, adds `wd * p` to the gradient before both
  moments, as FBGEMM's row-wise Adagrad does in its L2 mode; amsgrad (absent in
  FBGEMM) keeps a per-row running max of `v`; the row mean is a pairwise sum in
  a fixed order (below), not a warp reduction; the two divisions by a
  per-step scalar (`D`, `1 - b2^t`) are products with its rounded reciprocal
  (an ulp from a division, as XLA compiles either).

The row's sum of squares is added pairwise in a fixed order (halves added
element-wise until one value is left, an odd last value carried along), so the
XLA ops and the fused CPU kernel (`kernels.cc`) agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_sparse_adam._core.row_rules.adam import AdamHyperparams, block_arithmetic
from optax_sparse_adam._core.row_sum import pairwise_row_sum as pairwise_row_sum
from optax_sparse_adam._core.row_sum import row_sum
from optax_sparse_adam._core.rules import CatchUp, RowBlock, Slot, StepConfig


def bias_corrections(
  hyper: AdamHyperparams, step: jax.Array | None, compute_dtype: Any
) -> tuple[jax.Array, jax.Array]:
  """`(lr / (1 - b1^t), 1 / (1 - b2^t))` for the step count(s) `t`, in `compute_dtype`.

  The second is a reciprocal to multiply by: XLA turns a division by a
  broadcast scalar into that product anyway, so the CPU kernel, given both
  values computed by this very function, multiplies too and gets the same bits.
  """
  if (
    step is None
    or hyper.step_size is not None
    or hyper.learning_rate is None
    or hyper.log_b1 is None
    or hyper.log_b2 is None
  ):
    raise ValueError(
      "the row-wise Adam rule bias-corrects its two moments separately: it needs the "
      "step count, the learning rate and the betas' logs, not a precomputed step size"
    )
  t = jnp.asarray(step).astype(compute_dtype)
  bias_correction1 = -jnp.expm1(t * hyper.log_b1)
  bias_correction2 = -jnp.expm1(t * hyper.log_b2)
  one = jnp.ones((), compute_dtype)
  return jnp.asarray(hyper.learning_rate, compute_dtype) / bias_correction1, one / bias_correction2


def inverse_row_size(row_size: int, compute_dtype: Any) -> Any:
  """`1 / D` rounded once to `compute_dtype`: the row mean is the sum times this."""
  dtype = np.dtype(compute_dtype)
  return dtype.type(1) / dtype.type(max(row_size, 1))


@dataclasses.dataclass(frozen=True)
class RowwiseAdamRule:
  """FBGEMM's PARTIAL_ROWWISE_ADAM as a row rule: a full `mu`, a per-row `nu` (module docstring).

  Attributes:
    amsgrad: keep `nu_max`, the per-row running max of `nu`, and divide by its
      bias-corrected root.
  """

  amsgrad: bool = False
  name: str = dataclasses.field(default="rowwise_adam", init=False)

  def slots(self) -> tuple[Slot, ...]:
    amsgrad = (Slot("nu_max", per_row=True, dtype_of="nu"),) if self.amsgrad else ()
    return (Slot("mu"), Slot("nu", per_row=True), *amsgrad)

  def catch_up(self, config: StepConfig) -> CatchUp:
    """None implemented (`rules.CatchUp`): dense row-wise Adam moves idle rows."""
    del config
    return CatchUp(
      refused="dense row-wise Adam moves idle rows (its first moment discharges), and "
      "that closed form is implemented for the full Adam only"
    )

  def update(
    self, block: RowBlock, hyper: AdamHyperparams
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The moments and the parameter delta of `n` rows (see `rules.RowRule.update`).

    `step` is a scalar or each row's `(n, 1, ...)`; `slot_rows["nu"]` is `(n,)`.
    """
    grad, slot_rows, step, compute_dtype = block[:4]
    c, r, store = block_arithmetic(block)
    n = grad.shape[0]
    mu_rows, nu_rows = slot_rows["mu"], slot_rows["nu"]
    g = grad.astype(compute_dtype)
    m = mu_rows.astype(compute_dtype)
    mu_new = store("mu", m + r((g - m) * c(hyper.one_minus_b1)))

    row_size = math.prod(grad.shape[1:])
    mean_square = row_sum(r(g * g))
    if row_size != 1:
      # (A row of one value is its square, already rounded: a second `rounded`
      # would cancel the first, two XORs with the same zero.)
      mean_square = r(mean_square * c(inverse_row_size(row_size, compute_dtype)))
    v = nu_rows.astype(compute_dtype)
    nu_new = store("nu", v + r((mean_square - v) * c(hyper.one_minus_b2)))
    new_rows = {"mu": mu_new, "nu": nu_new}
    second = nu_new
    if self.amsgrad:
      nu_max_rows = slot_rows["nu_max"]
      second = new_rows["nu_max"] = jnp.maximum(nu_max_rows, nu_new.astype(nu_max_rows.dtype))

    per_row_step = None if step is None else jnp.reshape(step, (n,) if jnp.ndim(step) else ())
    lr_over_bc1, inv_bc2 = bias_corrections(hyper, per_row_step, compute_dtype)
    denom = jnp.sqrt(second.astype(compute_dtype) * r(inv_bc2)) + c(hyper.eps)
    # The sign goes on the numerator, and every scalar is rounded where it
    # stands, as in the CPU kernel: XLA would otherwise merge the divisions, or
    # move a negation across a product, which flips the sign of a NaN.
    neg_rate = r(-r(lr_over_bc1)) / denom
    neg_rate = neg_rate.reshape((n,) + (1,) * (grad.ndim - 1))
    delta = r(r(neg_rate) * mu_new.astype(compute_dtype))
    return delta, new_rows
