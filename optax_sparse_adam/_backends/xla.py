"""The masked step and the apply in plain XLA ops: every backend, dtype and option.

The rows are coalesced by `_core.bcoo.coalesce_and_gather_rows` (which may use a
donated first moment as scratch to number the distinct rows), the moments'
rows gathered, `adam_rows` applied, and the new rows scattered back in place.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._core import adam, bcoo
from optax_sparse_adam._core.adam import RowsStep, StepOptions, TableState


def rows_step(
  rows: jax.Array,
  values: jax.Array,
  tables: TableState,
  *,
  layout: bcoo.RowLayout,
  options: StepOptions,
  coalesce: Callable[..., Any] = bcoo.coalesce_and_gather_rows,
) -> RowsStep:
  """One parameter's masked step in XLA ops.

  Args:
    rows: int32 `(nse,)` row ids (`bcoo.linear_rows`; padding is `num_rows`).
    values: `(nse, *dense_shape)` gradient entries.
    tables: the moments (parameter-shaped), and the optional arrays.
    layout: the parameter viewed as rows.
    options: how the step computes.
    coalesce: finds the distinct rows, their summed values and the tables'
      old rows: `bcoo.coalesce_and_gather_rows`, or the accelerator's one-sort
      version (`accelerator.coalesce_and_gather_rows`), with its signature.

  Returns:
    The `RowsStep`: distinct rows, their deltas, the new tables.
  """
  compute_dtype = options.compute_dtype
  as_rows = lambda table: None if table is None else bcoo.as_rows(table, layout)  # noqa: E731
  # The moments' old rows are gathered while the gradient is coalesced; one
  # moment table may come back holding scratch values in the touched rows,
  # which the scatters below overwrite.
  coalesced, (mu_old, nu_old, nu_max_old), (mu_table, nu_table, nu_max_table) = coalesce(
    rows,
    values,
    layout.num_rows,
    (as_rows(tables.mu), as_rows(tables.nu), as_rows(tables.nu_max)),
  )
  rows = coalesced.rows
  g = coalesced.values.astype(compute_dtype)
  if options.maximize:
    g = -g
  param_rows = None
  if options.weight_decay != "none":
    param_rows = bcoo.gather_rows(as_rows(tables.param), rows).astype(compute_dtype)
    if options.weight_decay == "l2":
      g = g + jnp.asarray(options.coeffs.weight_decay, compute_dtype) * param_rows

  step_size = options.step_size
  row_step = tables.row_step
  if row_step is not None:
    new_row_steps = optax.safe_increment(bcoo.gather_rows(row_step, rows))
    row_step_size = adam.bias_corrected_step_size(options.coeffs, jnp.maximum(new_row_steps, 1))
    step_size = row_step_size.reshape(row_step_size.shape + (1,) * len(layout.dense_shape))
    row_step = bcoo.scatter_rows(row_step, rows, new_row_steps)

  delta, mu_rows, nu_rows, nu_max_rows = adam.adam_rows(
    g,
    mu_old,
    nu_old,
    nu_max_old,
    step_size,
    options.coeffs,
    compute_dtype=compute_dtype,
    opaque_zero=options.opaque_zero,
  )
  if options.weight_decay == "decoupled":
    lr_wd = jnp.asarray(options.coeffs.learning_rate, compute_dtype) * jnp.asarray(
      options.coeffs.weight_decay, compute_dtype
    )
    delta = delta - lr_wd * param_rows
  valid = rows < layout.num_rows
  delta = jnp.where(
    valid.reshape(valid.shape + (1,) * len(layout.dense_shape)),
    delta,
    jnp.zeros((), delta.dtype),
  ).astype(values.dtype)

  def scattered(table, table_rows, new_rows):
    return bcoo.scatter_rows(table_rows, rows, new_rows).reshape(table.shape)

  new_tables = TableState(
    mu=scattered(tables.mu, mu_table, mu_rows),
    nu=scattered(tables.nu, nu_table, nu_rows),
    nu_max=None if nu_max_rows is None else scattered(tables.nu_max, nu_max_table, nu_max_rows),
    row_step=row_step,
  )
  return RowsStep(rows, delta, new_tables)


def scatter_add(
  param: jax.Array,
  rows: jax.Array,
  values: jax.Array,
  *,
  layout: bcoo.RowLayout,
  unique_rows: bool,
  sorted_rows: bool,
) -> jax.Array:
  """`param[rows] += values` in XLA ops; out-of-range (padding) rows are dropped."""
  param_rows = bcoo.as_rows(param, layout)
  return (
    param_rows.at[rows]
    .add(
      values.astype(param_rows.dtype),
      mode="drop",
      unique_indices=unique_rows,
      indices_are_sorted=sorted_rows,
    )
    .reshape(param.shape)
  )
