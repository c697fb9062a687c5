"""The arithmetic of a masked (sparse) Adam step: one implementation for every front end.

The optax transformation, the Flax helpers and the torch adapter all step a
parameter with `sparse_adam_leaf_step` (`_core.leaf`), and every backend
computes the rows of that step with `adam_rows`:

  g      = coalesce(grad)                        (duplicates summed first)
  g      = -g if maximize;  g += wd * p[rows] if L2 weight decay
  m[r]  += (1 - b1) * (g - m[r])                 (touched rows r only)
  v[r]  += (1 - b2) * (g^2 - v[r])
  vmax[r] = max(vmax[r], v[r])                   (amsgrad only)
  step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)
  delta[r]  = -step_size * m[r] / (sqrt(v[r]) + eps)   (vmax[r] with amsgrad)
  delta[r] -= lr * wd * p[r]                     (decoupled weight decay only)

This is `torch.optim.SparseAdam`'s arithmetic, in its order of operations:
`eps` is added to `sqrt(v)`, not to `sqrt(v / (1 - b2^t))` as in `optax.adam`.
Nothing here knows which backend runs it; `StepOptions` and `TableState` are
what the core hands a backend (`_backends.dispatch`).
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from optax_sparse_adam._core import sharding
from optax_sparse_adam._core.errors import is_python_number

Scalar = float | jax.Array
WeightDecay = Literal["none", "l2", "decoupled"]


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


class StepOptions(NamedTuple):
  """How one parameter's masked step computes: what the core hands a backend.

  Attributes:
    coeffs: the step constants (`adam_coefficients`).
    step_size: the bias-corrected step size of this step, or None with
      per-row bias correction (each row then has its own).
    maximize: ascend instead of descend.
    weight_decay: "none", "l2" (added to the gradient) or "decoupled" (AdamW,
      on the touched rows).
    compute_dtype: the dtype of the arithmetic (float32 or wider).
    opaque_zero: an int32 zero known only at run time, or None: when given,
      every product is rounded before it is added, as torch does (`adam_rows`).
  """

  coeffs: AdamCoefficients
  step_size: jax.Array | None
  maximize: bool
  weight_decay: WeightDecay
  compute_dtype: Any
  opaque_zero: jax.Array | None


class TableState(NamedTuple):
  """The arrays of one parameter's step that are indexed by its rows.

  The moments come in the parameter's shape (a backend views them as rows as it
  needs: an in-place kernel must not see a reshaped copy); `row_step` is
  `(num_rows,)`. `param` is read (weight decay), never written.
  """

  mu: jax.Array
  nu: jax.Array
  nu_max: jax.Array | None = None
  row_step: jax.Array | None = None
  param: jax.Array | None = None


class RowsStep(NamedTuple):
  """What a backend returns for one parameter's step.

  Attributes:
    unique_rows: int32 `(nse,)` distinct rows, ascending, then padding slots
      (`bcoo.CoalescedRows`).
    delta: the signed parameter update of each slot, in the gradient's dtype;
      zero in padding slots.
    tables: the new `TableState` (without `param`).
  """

  unique_rows: jax.Array
  delta: jax.Array
  tables: TableState


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


def bias_corrected_step_size(coeffs: AdamCoefficients, step: jax.Array) -> jax.Array:
  """`lr * sqrt(1 - b2^t) / (1 - b1^t)` in float32 (or wider), for a step array `t >= 1`."""
  t = jnp.asarray(step).astype(jnp.result_type(float))
  bias_correction1 = -jnp.expm1(t * coeffs.log_b1)
  bias_correction2 = -jnp.expm1(t * coeffs.log_b2)
  return coeffs.learning_rate * jnp.sqrt(bias_correction2) / bias_correction1


def torch_step_size(learning_rate: float, b1: float, b2: float, step: int) -> float:
  """The step size exactly as torch computes it on the host, in float64."""
  return learning_rate * math.sqrt(1 - b2**step) / (1 - b1**step)


def init_leaf_state(
  param: jax.Array,
  *,
  sparse_dims: int | None = None,
  mu_dtype: Any = None,
  nu_dtype: Any = None,
  amsgrad: bool = False,
  per_row_bias_correction: bool = False,
) -> LeafState:
  """Zero moments with the parameter's shape (and sharding), and step 0.

  `sparse_dims` is the number of leading dims that index rows for per-row bias
  correction (1 for an embedding table); it is needed only with that option.
  """
  mu = jnp.zeros_like(param, dtype=mu_dtype or param.dtype)
  nu = jnp.zeros_like(param, dtype=nu_dtype or param.dtype)
  nu_max = jnp.zeros_like(nu) if amsgrad else None
  row_step = None
  if per_row_bias_correction:
    num_dims = 1 if sparse_dims is None else sparse_dims
    num_rows = math.prod(param.shape[:num_dims])
    # Split like the table's rows, so that a row-sharded table's row steps are too.
    rows_sharding = sharding.leading_dims_sharding(param, num_dims)
    if isinstance(rows_sharding, PartitionSpec):
      row_step = jnp.zeros((num_rows,), jnp.int32, out_sharding=rows_sharding)
    else:
      row_step = jnp.zeros((num_rows,), jnp.int32, device=rows_sharding)
  step = jnp.zeros([], jnp.int32, device=sharding.replicated_like(param))
  return LeafState(step, mu, nu, nu_max, row_step)


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


def adam_rows(
  grad_rows: jax.Array,
  mu_rows: jax.Array,
  nu_rows: jax.Array,
  nu_max_rows: jax.Array | None,
  step_size: jax.Array,
  coeffs: AdamCoefficients,
  *,
  compute_dtype: Any,
  opaque_zero: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """The Adam moment and parameter arithmetic on gathered rows, in torch's order.

  Returns `(delta, mu, nu, nu_max)`: the signed parameter update (before any
  decoupled weight decay) and the new moments, each in its storage dtype.
  `opaque_zero`, an int32 zero that is a run-time input of the compiled
  function, pins the rounding of every product (bit-exact torch on backends
  that would fuse multiply-adds into FMAs).
  """

  def c(x):
    return jnp.asarray(x, compute_dtype)

  def r(x):
    return rounded(x, opaque_zero)

  g = grad_rows.astype(compute_dtype)
  m = mu_rows.astype(compute_dtype)
  v = nu_rows.astype(compute_dtype)
  mu_new = (m + r((g - m) * c(coeffs.one_minus_b1))).astype(mu_rows.dtype)
  nu_new = (v + r((r(g * g) - v) * c(coeffs.one_minus_b2))).astype(nu_rows.dtype)
  second = nu_new
  nu_max_new = None
  if nu_max_rows is not None:
    nu_max_new = jnp.maximum(nu_max_rows, nu_new.astype(nu_max_rows.dtype))
    second = nu_max_new
  denom = jnp.sqrt(second.astype(compute_dtype)) + c(coeffs.eps)
  delta = r(-c(step_size) * (mu_new.astype(compute_dtype) / denom))
  return delta, mu_new, nu_new, nu_max_new
