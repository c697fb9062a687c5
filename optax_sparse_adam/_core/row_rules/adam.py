"""The Adam row rule: torch.optim.SparseAdam's arithmetic on a block of coalesced rows.

`AdamRule` is the first `rules.RowRule`: slots `mu` and `nu` (and `nu_max`
with amsgrad), each the parameter's shape, and on the touched rows r

  m[r]  += (1 - b1) * (g - m[r])
  v[r]  += (1 - b2) * (g^2 - v[r])
  vmax[r] = max(vmax[r], v[r])                   (amsgrad only)
  step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)
  delta[r]  = -step_size * m[r] / (sqrt(v[r]) + eps)   (vmax[r] with amsgrad)

with `g` the coalesced gradient (maximize and weight decay are the pipeline's,
`rules`). This is `torch.optim.SparseAdam`'s arithmetic, in its order of
operations: `eps` is added to `sqrt(v)`, not to `sqrt(v / (1 - b2^t))` as in
`optax.adam`. Nothing here knows which backend runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_sparse_adam._core.catch_up import _centroid, _pow, decayed_sum
from optax_sparse_adam._core.errors import is_python_number
from optax_sparse_adam._core.rounding import SlotStore, nearest_store
from optax_sparse_adam._core.rules import (
  CatchUp,
  CaughtUp,
  IdleBlock,
  RowBlock,
  Slot,
  StepConfig,
)

Scalar = float | jax.Array


class AdamCoefficients(NamedTuple):
  """The per-parameter constants of a step, as floats (exact, float64) or arrays.

  `log_b1`/`log_b2` give the bias corrections as `1 - b^t = -expm1(t * log b)`,
  which keeps full float32 precision where `1 - b**t` in float32 would lose the
  low bits of `b2 = 0.999` to cancellation.
  """

  learning_rate: Scalar
  one_minus_b1: Scalar
  one_minus_b2: Scalar
  log_b1: Scalar
  log_b2: Scalar
  eps: Scalar
  weight_decay: Scalar


class LeafState(NamedTuple):
  """The optimizer state of one parameter.

  Attributes:
    step: int32 scalar, the number of steps this parameter has taken.
    mu: first moment, the parameter's shape.
    nu: second moment, the parameter's shape.
    nu_max: running max of `nu` (amsgrad), or None.
    row_step: int32 `(num_rows,)` steps of each row (per-row bias correction),
      or None.
  """

  step: jax.Array
  mu: jax.Array
  nu: jax.Array
  nu_max: jax.Array | None = None
  row_step: jax.Array | None = None


def log_beta(b: Scalar) -> Scalar:
  """`log(b)` for the bias corrections; a Python float stays float64 and `log(0)` is `-inf`."""
  if is_python_number(b):
    return math.log(b) if b > 0 else -math.inf
  return jnp.log(b)


def adam_coefficients(
  learning_rate: Scalar, b1: Scalar, b2: Scalar, eps: Scalar, weight_decay: Scalar = 0.0
) -> AdamCoefficients:
  """Step constants from hyper-parameters; Python floats stay float64 until used."""
  return AdamCoefficients(
    learning_rate=learning_rate,
    one_minus_b1=1.0 - b1,
    one_minus_b2=1.0 - b2,
    log_b1=log_beta(b1),
    log_b2=log_beta(b2),
    eps=eps,
    weight_decay=weight_decay,
  )


def bias_corrected_step_size(
  coeffs: AdamCoefficients | AdamHyperparams, step: jax.Array
) -> jax.Array:
  """`lr * sqrt(1 - b2^t) / (1 - b1^t)` in float32 (or wider), for a step array `t >= 1`."""
  assert coeffs.learning_rate is not None and coeffs.log_b1 is not None
  assert coeffs.log_b2 is not None  # a caller without them gives the step size
  t = jnp.asarray(step).astype(jnp.result_type(float))
  bias_correction1 = -jnp.expm1(t * coeffs.log_b1)
  bias_correction2 = -jnp.expm1(t * coeffs.log_b2)
  return coeffs.learning_rate * jnp.sqrt(bias_correction2) / bias_correction1


def torch_step_size(learning_rate: float, b1: float, b2: float, step: int) -> float:
  """The step size exactly as torch computes it on the host, in float64."""
  return learning_rate * math.sqrt(1 - b2**step) / (1 - b1**step)


def rounded(x: jax.Array, opaque_zero: jax.Array | None) -> jax.Array:
  """`x`, rounded where it stands: XLA cannot contract it into a later add as an FMA.

  XOR with a zero known only at run time is the identity on the bits, but it
  forces the product to be materialised (rounded) first, as torch's separate
  kernels do. XLA strips optimization barriers and folds bitcast pairs.
  """
  if opaque_zero is None:
    return x
  return _xor_bits(x, opaque_zero)


def rounded_if_narrow(x: jax.Array, opaque_zero: jax.Array | None) -> jax.Array:
  """A stored slot value about to be read back in the step: pinned to its bits if 16-bit.

  XLA:GPU's default excess precision drops a float32 -> 16-bit -> float32 round
  trip, so the step would read a 16-bit slot's value from before its rounding,
  where torch (and XLA:CPU) read the stored one.
  """
  return rounded(x, opaque_zero) if x.dtype.itemsize < 4 else x


def pinned(x: jax.Array, opaque_zero: jax.Array | None) -> jax.Array:
  """`x` rounded where it stands, as `rounded`, by a bit OR with the run-time zero.

  For a value that may be `rounded` already (a rule's rounded delta): XORed twice with
  the same zero, LLVM cancels the pair once XLA fuses them, and XLA:CPU then contracts
  the product into the sum after it (an FMA); `(x ^ z) | z` simplifies to `x | z` at most.
  """
  if opaque_zero is None:
    return x
  return _or_bits(x, opaque_zero)


def _with_bits(x: jax.Array, opaque_zero: jax.Array, op: Callable) -> jax.Array:
  """`op` of `x`'s bits and the zero, as `x`'s dtype again (the identity on the bits)."""
  int_dtype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
  bits = lax.bitcast_convert_type(x, int_dtype)
  return lax.bitcast_convert_type(op(bits, opaque_zero.astype(int_dtype)), x.dtype)


@jax.custom_jvp
def _xor_bits(x: jax.Array, opaque_zero: jax.Array) -> jax.Array:
  return _with_bits(x, opaque_zero, lax.bitwise_xor)


@jax.custom_jvp
def _or_bits(x: jax.Array, opaque_zero: jax.Array) -> jax.Array:
  return _with_bits(x, opaque_zero, lax.bitwise_or)


def _identity_jvp(bits_op: Any) -> None:
  # The identity on values, so on derivatives too: without this rule the bitcasts
  # would make every derivative through a step silently zero.
  @bits_op.defjvp
  def _jvp(primals, tangents):
    x, opaque_zero = primals
    return bits_op(x, opaque_zero), tangents[0]


_identity_jvp(_xor_bits)
_identity_jvp(_or_bits)


class AdamHyperparams(NamedTuple):
  """The traced hyper-parameters of an Adam step, as floats (exact, float64) or arrays.

  `AdamCoefficients` plus `step_size`: a bias-corrected step size computed by
  the caller (e.g. on the host in float64, as torch does), or None to compute
  it from the step count. A caller passes what it has: None where a value is
  never read (`learning_rate` and the log-betas when `step_size` is given and
  there is no weight decay; `weight_decay` without weight decay).

  `window_learning_rate` is the rate that catch-up of idle rows charges to a
  row's idle steps: the rate of the step before this one (a schedule's value
  at `count - 1`), which is an idle step of every row caught up now, so the
  in-step catch-up and `catch_up_rows` charge a window the same rate. None:
  `learning_rate` (a constant rate).
  """

  learning_rate: Scalar | None
  one_minus_b1: Scalar
  one_minus_b2: Scalar
  log_b1: Scalar | None
  log_b2: Scalar | None
  eps: Scalar
  weight_decay: Scalar | None = None
  step_size: Scalar | None = None
  window_learning_rate: Scalar | None = None

  def for_idle_steps(self) -> AdamHyperparams:
    """These hyper-parameters with the idle steps' rate as `learning_rate`."""
    if self.window_learning_rate is None:
      return self
    return self._replace(learning_rate=self.window_learning_rate, window_learning_rate=None)


def hyperparams_of(
  coeffs: AdamCoefficients,
  step_size: Scalar | None = None,
  *,
  window_learning_rate: Scalar | None = None,
) -> AdamHyperparams:
  """`AdamHyperparams` from `AdamCoefficients` (an optional given step size, idle steps' rate)."""
  return AdamHyperparams(*coeffs, step_size=step_size, window_learning_rate=window_learning_rate)


def block_arithmetic(
  block: RowBlock,
) -> tuple[Callable[[Any], jax.Array], Callable[[jax.Array], jax.Array], SlotStore]:
  """`(c, r, store)` for a rule's update of `block`: a constant in the compute dtype,
  a product rounded where it stands (`rounded`), and the slots' store (to nearest
  unless the block brings one)."""

  def c(x: Any) -> jax.Array:
    return jnp.asarray(x, block.compute_dtype)

  def r(x: jax.Array) -> jax.Array:
    return rounded(x, block.opaque_zero)

  store = block.store or nearest_store(block.slots)

  def pinned_store(name: str, x: jax.Array) -> jax.Array:
    # A rule reads a stored slot back in the same step (the denominator, amsgrad's max).
    return rounded_if_narrow(store(name, x), block.opaque_zero)

  return c, r, pinned_store


@dataclasses.dataclass(frozen=True)
class AdamRule:
  """torch.optim.SparseAdam's row rule (with amsgrad's running max where asked).

  Attributes:
    amsgrad: keep `nu_max`, the running max of `nu`, and divide by its root.
  """

  amsgrad: bool = False
  name: str = dataclasses.field(default="adam", init=False)

  def slots(self) -> tuple[Slot, ...]:
    amsgrad = (Slot("nu_max", dtype_of="nu"),) if self.amsgrad else ()
    return (Slot("mu"), Slot("nu"), *amsgrad)

  def step_size(self, hyper: AdamHyperparams, step: jax.Array | None) -> Any:
    """The given step size, else `lr * sqrt(1 - b2^t) / (1 - b1^t)` for the step count(s)."""
    if hyper.step_size is not None:
      return hyper.step_size
    if step is None:
      raise ValueError("an Adam step needs a step count or a given step size")
    return bias_corrected_step_size(hyper, step)

  def catch_up(self, config: StepConfig) -> CatchUp:
    """Dense Adam's idle steps (`idle_rows`); none under L2 weight decay (`rules.CatchUp`)."""
    if config.weight_decay == "l2":
      return CatchUp(
        refused="with L2 weight decay dense Adam's idle rows have the gradient "
        "weight_decay * p, whose steps have no closed form (use decoupled weight decay)"
      )
    decoupled = config.weight_decay == "decoupled"
    return CatchUp(rows=functools.partial(idle_rows, self, decoupled=decoupled))

  def update(
    self, block: RowBlock, hyper: AdamHyperparams
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The moments and the parameter delta of the rows, in torch's order of operations.

    `opaque_zero`, an int32 zero that is a run-time input of the compiled
    function, pins the rounding of every product (bit-exact torch on backends
    that would fuse multiply-adds into FMAs). See `rules.RowRule.update`.
    """
    grad, slot_rows, step, compute_dtype = block[:4]
    c, r, store = block_arithmetic(block)
    mu_rows, nu_rows = slot_rows["mu"], slot_rows["nu"]
    g = grad.astype(compute_dtype)
    m = mu_rows.astype(compute_dtype)
    v = nu_rows.astype(compute_dtype)
    mu_new = store("mu", m + r((g - m) * c(hyper.one_minus_b1)))
    nu_new = store("nu", v + r((r(g * g) - v) * c(hyper.one_minus_b2)))
    new_rows = {"mu": mu_new, "nu": nu_new}
    second = nu_new
    if self.amsgrad:
      nu_max_rows = slot_rows["nu_max"]
      second = new_rows["nu_max"] = jnp.maximum(nu_max_rows, nu_new.astype(nu_max_rows.dtype))
    denom = jnp.sqrt(second.astype(compute_dtype)) + c(hyper.eps)
    delta = r(-c(self.step_size(hyper, step)) * (mu_new.astype(compute_dtype) / denom))
    return delta, new_rows


def idle_rows(
  rule: AdamRule, block: IdleBlock, hyper: AdamHyperparams, *, decoupled: bool
) -> CaughtUp:
  r"""Catches a block of rows up over their idle zero-gradient steps, as dense Adam would.

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
  grow with k): `_optax.catch_up.check_options` refuses the rest, and
  `AdamRule.catch_up` L2 weight decay.

  Args:
    rule: the Adam rule.
    block: the rows' slots (`mu`, `nu`, and `nu_max` with amsgrad), their idle
      steps `k` and last steps `t0`.
    hyper: the rule's hyper-parameters (`log_b1`, `log_b2` and, unless a
      `step_size` is given, the learning rate).
    decoupled: AdamW's decay `(1 - lr*wd)` applies at every idle step too.

  Returns:
    The `CaughtUp` rows.
  """
  assert hyper.log_b1 is not None and hyper.log_b2 is not None  # the optax layer gives them
  hyper = hyper.for_idle_steps()  # the idle steps' rate, not the touching step's

  slot_rows, idle, last_step, compute_dtype = block

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
