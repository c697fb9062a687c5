r"""Catching idle rows up with dense Adam: the moments' decay and the parameter's discharge.

Lazy Adam leaves a row's moments as they are while the row is idle. Dense Adam
would, at every idle step `j = 1..k` (zero gradient; `s = t0 + j` the step,
`t0` the step of the row's last update), decay them and move the parameter:

  m_j = b1^j m,   v_j = b2^j v,   vmax_j = vmax
  p_j = d p_{j-1} - eta_s m_j / (sqrt(v_j) + eps)       (d = 1 - lr*wd; 1 without AdamW)

with `eta_s = lr * sqrt(1 - b2^s) / (1 - b1^s)`. The moments are caught up
exactly (`b^k` as `exp(k log b)`). The parameter, after `k` such steps, is

  p_k = d^k p - (m / (sqrt(v) + eps)) * sum_j eta_s d^(k-j) phi_j,
  phi_j = b1^j / (w c^j + 1 - w),   c = sqrt(b2),   w = sqrt(v) / (sqrt(v) + eps).

`phi_j` has no closed-form sum for 0 < w < 1; it lies between `b1^j` (w = 0)
and `r^j = (b1 / c)^j` (w = 1), and by the convexity of `1/x` it is at most
their mix `w r^j + (1 - w) b1^j`, which is what is summed here, in closed form:

  sum_j d^(k-j) x^j = x^k (1 - (d/x)^k) / (1 - d/x)      (a geometric sum; k d^(k-1) x at x = d)

each with one step size: the window's bias-corrected step size at the
centroid of its weights `x^j` (an integer step of the window). Hence:

- **exact** (to float32 rounding) as `eps -> 0` (w = 1), with amsgrad (the
  denominator `sqrt(vmax) + eps` is constant over the window, so w = 0 for any
  eps), and when the row's moments are zero; the step size must be constant
  over the window (it is, to float32 rounding, once `b1^s` and `b2^s` are below
  float32's resolution; a given `step_size` is);
- otherwise within the bound, per row and element, of

    |m| / (sqrt(v) + eps) * sum_j d^(k-j) [ (eta_max - eta_min) (w r^j + (1-w) b1^j)
                                            + eta_max w (1-w) b1^j (b2^(-j/2) - 1)^2 ]

  over the window's step sizes `eta_min..eta_max`: the first term is the step
  size's variation (the bias correction, early in training; a schedule), the
  second the mix's gap, second order in `1 - b2^(j/2)` (`w (1-w) <= 1/4`).

The learning rate charged to the idle steps is `hyper.window_learning_rate`: a
schedule's rate at the last idle step (`count - 1`), the same whether the row
is caught up inside the step or by `catch_up_rows`, so it is exact when the
rate is constant over the window. Under a schedule, `eta_min..eta_max` above
range over `lr_min * bc_min .. lr_max * bc_max`, the window's rates and bias
corrections `bc_s = sqrt(1 - b2^s) / (1 - b1^s)` taken apart, and AdamW's decay
adds `|p| |prod_s (1 - lr_s wd) - (1 - lr_w wd)^k|` (`lr_w` the charged rate).
`b1 < sqrt(b2)` is needed without amsgrad (r < 1, else the mix, and the bound,
grow with k): `_optax.catch_up.check_options` refuses the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._core.errors import is_python_number
from optax_sparse_adam._core.row_rules.adam import (
  AdamHyperparams,
  AdamRule,
  bias_corrected_step_size,
)


class CaughtUp(NamedTuple):
  """What catching a block of rows up over their idle steps gives the pipeline.

  Attributes:
    slot_rows: the rule's slots at the rows, decayed over the idle steps.
    shift: the parameter's move over the idle steps, besides weight decay
      (the discharge of the first moment, decayed by the steps after it).
    decay_minus_one: `d^k - 1` per row (decoupled weight decay over the idle
      steps), or None without it.
  """

  slot_rows: dict[str, jax.Array]
  shift: jax.Array
  decay_minus_one: jax.Array | None


def supports(rule: Any) -> bool:
  """Whether `idle_rows` knows how to catch rows of `rule` up."""
  return isinstance(rule, AdamRule)


def _pow(log_base: Any, k: jax.Array) -> jax.Array:
  """`base^k` for a float `k >= 0` as `exp(k log base)`: 1 at k = 0, also for base 0."""
  return jnp.where(k == 0, 1.0, jnp.exp(k * jnp.where(k == 0, 0.0, log_base)))


def _geometric_sum(log_ratio: jax.Array, k: jax.Array) -> jax.Array:
  """`sum_{i<k} q^i = expm1(k log q) / expm1(log q)`, `k` at q = 1; for log q <= 0."""
  safe = jnp.where(log_ratio == 0, -1.0, log_ratio)
  return jnp.where(log_ratio == 0, k, jnp.expm1(k * safe) / jnp.expm1(safe))


def decayed_sum(log_x: Any, log_d: Any, k: jax.Array) -> jax.Array:
  """`sum_{j=1..k} d^(k-j) x^j` for `x, d > 0` (or x = 0), without overflow.

  Written around the larger base: `d^(k-1) x sum_{i<k} (x/d)^i` if x <= d,
  else `x^k sum_{i<k} (d/x)^i`, so the geometric factor stays in [1, k].
  """
  log_ratio = jnp.asarray(log_x - log_d, k.dtype)
  x_below = log_ratio <= 0
  small = -jnp.abs(jnp.where(jnp.isfinite(log_ratio), log_ratio, -jnp.inf))
  geometric = _geometric_sum(small, k)
  lead = jnp.where(x_below, (k - 1) * log_d + log_x, k * log_x)
  return jnp.where(k == 0, 0.0, jnp.exp(jnp.where(k == 0, 0.0, lead)) * geometric)


def _centroid(log_x: Any, k: jax.Array) -> jax.Array:
  """The integer `j` in [1, k] nearest to the centroid `sum j x^j / sum x^j` of the window."""
  log_x = jnp.asarray(log_x, k.dtype)
  one_minus_x = -jnp.expm1(log_x)
  x_k = _pow(log_x, k)
  safe = jnp.where(x_k == 1, 1.0, 1.0 - x_k)
  centroid = 1.0 / one_minus_x - k * x_k / safe
  return jnp.clip(
    jnp.round(jnp.where(jnp.isfinite(centroid), centroid, 1.0)), 1.0, jnp.maximum(k, 1)
  )


def idle_rows(
  rule: AdamRule,
  slot_rows: Mapping[str, jax.Array],
  idle: jax.Array,
  last_step: jax.Array,
  hyper: AdamHyperparams,
  *,
  decoupled: bool,
  compute_dtype: Any,
) -> CaughtUp:
  """Catches a block of rows up over their `idle` zero-gradient steps, as dense Adam would.

  Args:
    rule: the Adam rule.
    slot_rows: the rows' slots (`mu`, `nu`, and `nu_max` with amsgrad).
    idle: int32 `(n, 1, ...)`: the number of idle steps `k` of each row.
    last_step: int32 `(n, 1, ...)`: the step `t0` of the row's last update.
    hyper: the rule's hyper-parameters (`log_b1`, `log_b2` and, unless a
      `step_size` is given, the learning rate).
    decoupled: AdamW's decay `(1 - lr*wd)` applies at every idle step too.
    compute_dtype: the dtype of the arithmetic.

  Returns:
    The `CaughtUp` rows.
  """
  assert hyper.log_b1 is not None and hyper.log_b2 is not None  # the optax layer gives them
  hyper = hyper.for_idle_steps()  # the idle steps' rate, not the touching step's

  def c(x: Any) -> jax.Array:
    return jnp.asarray(x, compute_dtype)

  k = idle.astype(compute_dtype)
  log_b1, log_b2 = c(hyper.log_b1), c(hyper.log_b2)
  m = slot_rows["mu"].astype(compute_dtype)
  v = slot_rows["nu"].astype(compute_dtype)
  new_rows = dict(slot_rows)
  new_rows["mu"] = (m * _pow(log_b1, k)).astype(slot_rows["mu"].dtype)
  new_rows["nu"] = (v * _pow(log_b2, k)).astype(slot_rows["nu"].dtype)

  # The running max does not move while v decays under it: with amsgrad the
  # denominator is constant over the window (w = 0).
  second = slot_rows["nu_max"] if rule.amsgrad else v
  root = jnp.sqrt(second.astype(compute_dtype))
  denom = root + c(hyper.eps)
  if is_python_number(hyper.eps) and hyper.eps > 0:
    inverse = 1.0 / denom
  else:  # 0 where m = v = 0 (a row never touched), even at eps = 0
    inverse = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
  ratio = m * inverse

  decay_minus_one = None
  log_d = c(0.0)
  if decoupled:
    assert hyper.learning_rate is not None and hyper.weight_decay is not None
    log_d = jnp.log1p(-c(hyper.learning_rate) * c(hyper.weight_decay))
    decay_minus_one = jnp.where(k == 0, 0.0, jnp.expm1(k * log_d))

  def step_size(log_x: jax.Array) -> Any:
    if hyper.step_size is not None:
      return c(hyper.step_size)
    at = last_step.astype(compute_dtype) + _centroid(log_x, k)
    return bias_corrected_step_size(hyper, at).astype(compute_dtype)

  by_b1 = step_size(log_b1) * decayed_sum(log_b1, log_d, k)
  if rule.amsgrad:
    return CaughtUp(new_rows, -ratio * by_b1, decay_minus_one)
  log_r = log_b1 - 0.5 * log_b2
  by_r = step_size(log_r) * decayed_sum(log_r, log_d, k)
  w = root * inverse  # sqrt(v) / (sqrt(v) + eps)
  return CaughtUp(new_rows, -ratio * (by_b1 + w * (by_r - by_b1)), decay_minus_one)
