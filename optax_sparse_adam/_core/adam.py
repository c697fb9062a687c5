"""The arithmetic of a masked (sparse) Adam step: one implementation for every front end.

The optax transformation, the Flax helpers and the torch adapter all call
`sparse_adam_leaf_step`, which updates one parameter from one BCOO gradient:

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

On the CPU, a float32 step without amsgrad, weight decay or per-row bias
correction is lowered to the fused kernels of `_cpu_kernels.cc` instead of XLA
ops (`_cpu_kernel`): the same operations in the same order, which
tests/test_cpu_kernels.py checks bit for bit against `adam_rows` here.
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.experimental import sparse
from jax.sharding import PartitionSpec

from optax_sparse_adam._backends import dispatch
from optax_sparse_adam._backends.cpu import kernels as cpu_kernels
from optax_sparse_adam._core import bcoo, sharding
from optax_sparse_adam._core.errors import path_str

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


def _is_python_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _log(b: Scalar) -> Scalar:
  if _is_python_number(b):
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
    log_b1=_log(b1),
    log_b2=_log(b2),
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


def _rounded(x: jax.Array, opaque_zero: jax.Array | None) -> jax.Array:
  """`x`, rounded where it stands: XLA cannot contract it into a later add as an FMA.

  XOR with a zero known only at run time is the identity on the bits, but it
  forces the product to be materialised (rounded) first, as torch's separate
  kernels do. XLA strips optimization barriers and folds bitcast pairs.
  """
  if opaque_zero is None:
    return x
  int_dtype = {4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
  bits = lax.bitcast_convert_type(x, int_dtype)
  return lax.bitcast_convert_type(bits ^ opaque_zero.astype(int_dtype), x.dtype)


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
    return _rounded(x, opaque_zero)

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


def sparse_adam_leaf_step(
  grad: sparse.BCOO,
  state: LeafState,
  param: jax.Array | None,
  coeffs: AdamCoefficients,
  *,
  maximize: bool = False,
  decoupled_weight_decay: bool = False,
  step_size: jax.Array | None = None,
  path: tuple = (),
  opaque_zero: jax.Array | None = None,
) -> tuple[sparse.BCOO, LeafState]:
  """One masked Adam step of one parameter from its BCOO gradient.

  Args:
    grad: BCOO gradient of the parameter's shape, `n_batch == 0`.
    state: the parameter's `LeafState`.
    param: the parameter, needed only with weight decay.
    coeffs: step constants (`adam_coefficients`).
    maximize: ascend instead of descend.
    decoupled_weight_decay: apply `coeffs.weight_decay` AdamW-style to the
      touched rows instead of adding it to the gradient (L2).
    step_size: an overriding bias-corrected step size for this step, e.g. one
      computed on the host in float64 as torch does. Ignored with per-row bias
      correction.
    path: the leaf's pytree path, for error messages.
    opaque_zero: an int32 zero passed into the compiled function at run time;
      when given, every product is rounded before it is added, as in torch,
      instead of being fused into an FMA by XLA (see `adam_rows`).

  Returns:
    `(update, new_state)`: a BCOO update with sorted unique indices holding the
    signed deltas of the touched rows, and the new state. Only touched rows of
    the moments change; the step advances also when the gradient is empty. The
    new state has the sharding of `state`; under a mesh with `Explicit` axes the
    update is replicated (it holds the gradient's entries, not the table's).
  """
  static = dict(maximize=maximize, decoupled_weight_decay=decoupled_weight_decay, path=path)
  if not sharding.explicit_axes():
    return _leaf_step(
      grad, state, param, coeffs=coeffs, step_size=step_size, opaque_zero=opaque_zero, **static
    )

  # Arrays reach the auto-axes region as arguments, not closures: a closed-over
  # value typed on the Explicit mesh would not match the region's Auto mesh.
  # Python floats stay closed over, so their static paths (no weight decay) hold.
  coeff_arrays = {k: v for k, v in coeffs._asdict().items() if isinstance(v, jax.Array)}

  def leaf_step_arrays(grad, state, param, coeff_arrays, step_size, opaque_zero):
    update, new_state = _leaf_step(
      grad,
      state,
      param,
      coeffs=coeffs._replace(**coeff_arrays),
      step_size=step_size,
      opaque_zero=opaque_zero,
      **static,
    )
    return (update.data, update.indices), new_state

  replicated = PartitionSpec()
  state_specs = jax.tree_util.tree_map(sharding.spec_of, state)
  (data, indices), new_state = sharding.call_with_auto_axes(
    leaf_step_arrays,
    (grad, state, param, coeff_arrays, step_size, opaque_zero),
    ((replicated, replicated), state_specs),
  )
  update = sparse.BCOO((data, indices), shape=grad.shape, indices_sorted=True, unique_indices=True)
  return update, new_state


def _leaf_step(
  grad: sparse.BCOO,
  state: LeafState,
  param: jax.Array | None,
  *,
  coeffs: AdamCoefficients,
  maximize: bool,
  decoupled_weight_decay: bool,
  step_size: jax.Array | None,
  path: tuple,
  opaque_zero: jax.Array | None,
) -> tuple[sparse.BCOO, LeafState]:
  """`sparse_adam_leaf_step`, traced in the caller's sharding mode."""
  layout = bcoo.row_layout(grad, state.mu.shape, path)
  uses_weight_decay = not (_is_python_number(coeffs.weight_decay) and coeffs.weight_decay == 0)
  if uses_weight_decay and param is None:
    raise ValueError(
      f"Parameter at {path_str(path)} is needed for weight decay: pass params "
      "to update(grads, state, params)."
    )
  row_step = state.row_step
  if row_step is not None and row_step.shape != (layout.num_rows,):
    raise ValueError(
      f"Sparse gradient at {path_str(path)} indexes {layout.num_rows} rows "
      f"(sparse dims {layout.sparse_shape}) but per-row bias correction keeps "
      f"{row_step.shape[0]} row steps, one per index of the leading dim. Use "
      "n_sparse=1 gradients (bcoo_update_layout(grad, n_dense=ndim - 1))."
    )
  step = optax.safe_increment(state.step)
  if row_step is None and step_size is None:
    step_size = bias_corrected_step_size(coeffs, step)
  compute_dtype = jnp.result_type(jnp.float32, grad.dtype, state.mu.dtype, state.nu.dtype)
  rows = bcoo.linear_rows(grad.indices, layout)
  options = dict(
    layout=layout,
    param=param,
    row_step=row_step,
    coeffs=coeffs,
    step_size=step_size,
    maximize=maximize,
    decoupled_weight_decay=decoupled_weight_decay,
    uses_weight_decay=uses_weight_decay,
    compute_dtype=compute_dtype,
    opaque_zero=opaque_zero,
  )

  def tables_step(rows_step):
    """A rows step that takes and returns the moments in the parameter's shape."""

    def step(rows, values, mu, nu, nu_max):
      tables = tuple(None if t is None else bcoo.as_rows(t, layout) for t in (mu, nu, nu_max))
      unique_rows, delta, new_tables, new_row_step = rows_step(rows, values, tables, **options)
      mu, nu, nu_max = (
        None if t is None else t.reshape(state.mu.shape if k == 0 else state.nu.shape)
        for k, t in enumerate(new_tables)
      )
      return unique_rows, delta, mu, nu, nu_max, new_row_step

    return step

  # Imported here: the accelerator step builds on this module's arithmetic.
  from optax_sparse_adam._backends import accelerator

  generic = tables_step(_xla_rows_step)
  kernel_computes_it = (
    state.nu_max is None
    and row_step is None
    and not uses_weight_decay
    and cpu_kernels.applies(
      (grad.data, state.mu, state.nu),
      nse=grad.nse,
      num_rows=layout.num_rows,
      row_size=math.prod(layout.dense_shape),
    )
  )
  if kernel_computes_it:
    on_cpu = functools.partial(
      _rows_step_with_cpu_kernels,
      layout=layout,
      coeffs=coeffs,
      step_size=step_size,
      maximize=maximize,
    )
  else:
    on_cpu = generic
  unique_rows, delta, mu_table, nu_table, nu_max_table, row_step = dispatch.by_backend(
    (rows, grad.data, state.mu, state.nu, state.nu_max),
    cpu=on_cpu,
    accelerator=tables_step(accelerator.rows_step),
    generic=generic,
  )

  new_state = LeafState(
    step=step,
    mu=mu_table.reshape(state.mu.shape),
    nu=nu_table.reshape(state.nu.shape),
    nu_max=None if nu_max_table is None else nu_max_table.reshape(state.nu.shape),
    row_step=row_step,
  )
  update = bcoo.rows_to_bcoo(bcoo.CoalescedRows(unique_rows, delta), layout)
  return update, new_state


def _xla_rows_step(
  rows: jax.Array,
  values: jax.Array,
  tables: tuple[jax.Array, jax.Array, jax.Array | None],
  *,
  coalesce: Any = bcoo.coalesce_and_gather_rows,
  layout: bcoo.RowLayout,
  param: jax.Array | None,
  row_step: jax.Array | None,
  coeffs: AdamCoefficients,
  step_size: jax.Array | None,
  maximize: bool,
  decoupled_weight_decay: bool,
  uses_weight_decay: bool,
  compute_dtype: Any,
  opaque_zero: jax.Array | None,
) -> tuple[jax.Array, jax.Array, tuple, jax.Array | None]:
  """The masked step of one table in XLA ops: any backend, dtype and option.

  Returns `(unique_rows, delta, (mu, nu, nu_max), row_step)`: the coalesced
  rows, their deltas in the gradient's dtype (zero in padding slots), and the
  updated `(num_rows, ...)` tables. `coalesce` finds the distinct rows, their
  summed values and the tables' old rows (`bcoo.coalesce_and_gather_rows`,
  or the accelerator's one-sort version).
  """
  # The moments' old rows are gathered while the gradient is coalesced; one
  # moment table may come back holding scratch values in the touched rows,
  # which the scatters below overwrite.
  coalesced, (mu_old, nu_old, nu_max_old), (mu_table, nu_table, nu_max_table) = coalesce(
    rows, values, layout.num_rows, tables
  )
  rows = coalesced.rows
  g = coalesced.values.astype(compute_dtype)
  if maximize:
    g = -g
  param_rows = None
  if uses_weight_decay:
    param_rows = bcoo.gather_rows(bcoo.as_rows(param, layout), rows).astype(compute_dtype)
    if not decoupled_weight_decay:
      g = g + jnp.asarray(coeffs.weight_decay, compute_dtype) * param_rows

  if row_step is not None:
    new_row_steps = optax.safe_increment(bcoo.gather_rows(row_step, rows))
    row_step_size = bias_corrected_step_size(coeffs, jnp.maximum(new_row_steps, 1))
    step_size = row_step_size.reshape(row_step_size.shape + (1,) * len(layout.dense_shape))
    row_step = bcoo.scatter_rows(row_step, rows, new_row_steps)

  delta, mu_rows, nu_rows, nu_max_rows = adam_rows(
    g,
    mu_old,
    nu_old,
    nu_max_old,
    step_size,
    coeffs,
    compute_dtype=compute_dtype,
    opaque_zero=opaque_zero,
  )
  if uses_weight_decay and decoupled_weight_decay:
    lr_wd = jnp.asarray(coeffs.learning_rate, compute_dtype) * jnp.asarray(
      coeffs.weight_decay, compute_dtype
    )
    delta = delta - lr_wd * param_rows
  valid = rows < layout.num_rows
  delta = jnp.where(
    valid.reshape(valid.shape + (1,) * len(layout.dense_shape)),
    delta,
    jnp.zeros((), delta.dtype),
  ).astype(values.dtype)
  new_tables = (
    bcoo.scatter_rows(mu_table, rows, mu_rows),
    bcoo.scatter_rows(nu_table, rows, nu_rows),
    None if nu_max_table is None else bcoo.scatter_rows(nu_max_table, rows, nu_max_rows),
  )
  return rows, delta, new_tables, row_step


def _rows_step_with_cpu_kernels(
  rows: jax.Array,
  values: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  nu_max: None,
  *,
  layout: bcoo.RowLayout,
  coeffs: AdamCoefficients,
  step_size: jax.Array,
  maximize: bool,
) -> tuple:
  """The fused CPU kernel's step (lowered on the CPU only), results as the XLA rows steps'.

  The moments go in and come out in the parameter's shape.
  """
  del nu_max  # the kernel runs only without amsgrad
  f32 = jnp.float32
  coefficients = jnp.stack(
    [
      jnp.asarray(coeffs.one_minus_b1, f32),
      jnp.asarray(coeffs.one_minus_b2, f32),
      jnp.asarray(coeffs.eps, f32),
      jnp.asarray(step_size, f32),
    ]
  )
  unique_rows, delta, mu, nu = cpu_kernels.adam_rows(
    rows, values, mu, nu, coefficients, num_rows=layout.num_rows, maximize=maximize
  )
  return unique_rows, delta, mu, nu, None, None
