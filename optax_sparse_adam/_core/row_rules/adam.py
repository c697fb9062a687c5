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
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_sparse_adam._core.errors import is_python_number
from optax_sparse_adam._core.rounding import SlotStore, nearest_store
from optax_sparse_adam._core.rules import RowBlock, Slot

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


@jax.custom_jvp
def _xor_bits(x: jax.Array, opaque_zero: jax.Array) -> jax.Array:
  int_dtype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
  bits = lax.bitcast_convert_type(x, int_dtype)
  return lax.bitcast_convert_type(bits ^ opaque_zero.astype(int_dtype), x.dtype)


@_xor_bits.defjvp
def _xor_bits_jvp(primals, tangents):
  # The identity on values, so on derivatives too: without this rule the bitcasts
  # would make every derivative through a step silently zero.
  x, opaque_zero = primals
  x_dot, _ = tangents
  return _xor_bits(x, opaque_zero), x_dot


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

  return c, r, block.store or nearest_store(block.slots)


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
