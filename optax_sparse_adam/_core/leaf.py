"""One parameter's step and one parameter's apply: the core's two calls into the backends.

`sparse_adam_leaf_step` validates a BCOO gradient against its state, advances
the step counter, computes the step size, and hands the rows to
`_backends.dispatch.rows_step`, which picks how they run on the backend the
step is lowered for. `scatter_add_bcoo` does the same for `param + update`.
Under a mesh with `Explicit` axes both run in an auto-axes region
(`_core.sharding`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse
from jax.sharding import PartitionSpec

from optax_sparse_adam._backends import dispatch
from optax_sparse_adam._core import bcoo, routed, sharding
from optax_sparse_adam._core.adam import (
  AdamCoefficients,
  LeafState,
  StepOptions,
  TableState,
  bias_corrected_step_size,
)
from optax_sparse_adam._core.errors import is_python_number, path_str


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
    A routed step (a row-sharded table, `sharded_routing`) returns the update
    split over the table's axis, each device's rows sorted, padding between.
  """
  static = dict(maximize=maximize, decoupled_weight_decay=decoupled_weight_decay, path=path)
  reads_param = _weight_decay(coeffs, decoupled_weight_decay) != "none"
  plan = routed.plan_step(
    grad, (state.mu, state.nu, state.nu_max, param if reads_param else None), (state.row_step,)
  )
  if plan is not None:  # a row-sharded table: each row's gradient goes to its owner
    rows_step = functools.partial(routed.rows_step, plan=plan, local_rows_step=dispatch.rows_step)
    update, new_state = _leaf_step(
      grad,
      state,
      param,
      coeffs=coeffs,
      step_size=step_size,
      opaque_zero=opaque_zero,
      rows_step=rows_step,
      **static,
    )
    # Sorted within each device's block only.
    update = sparse.BCOO(
      (update.data, update.indices), shape=update.shape, indices_sorted=False, unique_indices=True
    )
    return update, new_state
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
  rows_step: Callable[..., Any] = dispatch.rows_step,
) -> tuple[sparse.BCOO, LeafState]:
  """`sparse_adam_leaf_step`, traced in the caller's sharding mode, its rows run by `rows_step`."""
  layout = bcoo.row_layout(grad, state.mu.shape, path)
  weight_decay = _weight_decay(coeffs, decoupled_weight_decay)
  if weight_decay != "none" and param is None:
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
  if row_step is not None:
    step_size = None  # each row has its own
  elif step_size is None:
    step_size = bias_corrected_step_size(coeffs, step)
  options = StepOptions(
    coeffs=coeffs,
    step_size=step_size,
    maximize=maximize,
    weight_decay=weight_decay,
    compute_dtype=jnp.result_type(jnp.float32, grad.dtype, state.mu.dtype, state.nu.dtype),
    opaque_zero=opaque_zero,
  )
  tables = TableState(
    state.mu, state.nu, state.nu_max, row_step, None if weight_decay == "none" else param
  )
  rows = bcoo.linear_rows(grad.indices, layout)
  unique_rows, delta, new_tables = rows_step(
    rows, grad.data, tables, layout=layout, options=options
  )
  new_state = LeafState(step, new_tables.mu, new_tables.nu, new_tables.nu_max, new_tables.row_step)
  update = bcoo.rows_to_bcoo(bcoo.CoalescedRows(unique_rows, delta), layout)
  return update, new_state


def _weight_decay(coeffs: AdamCoefficients, decoupled: bool) -> str:
  if is_python_number(coeffs.weight_decay) and coeffs.weight_decay == 0:
    return "none"
  return "decoupled" if decoupled else "l2"


def scatter_add_bcoo(param: jax.Array, update: sparse.BCOO, path: Sequence[Any] = ()) -> jax.Array:
  """`param + update` for a BCOO update, by scatter-add: never densifies the update.

  Repeated indices add up; out-of-range indices are dropped (BCOO padding).
  The result has `param`'s sharding.
  """
  layout = bcoo.row_layout(update, param.shape, path, what="update")
  plan = routed.plan_apply(param, update)
  if plan is not None:  # row-split: each device adds the rows it owns
    return routed.scatter_add(
      param, update, layout=layout, plan=plan, local_scatter_add=dispatch.scatter_add
    )

  def scatter_add(param, update):
    rows = bcoo.linear_rows(update.indices, layout)
    return dispatch.scatter_add(
      param,
      rows,
      update.data,
      layout=layout,
      unique_rows=update.unique_indices,
      sorted_rows=update.indices_sorted,
    )

  return sharding.call_with_auto_axes(scatter_add, (param, update), sharding.spec_of(param))
