"""The one place that decides how a step runs: fused CPU kernels, or generic XLA ops.

Both `rows_step` (the masked Adam step of one parameter) and `scatter_add`
(`apply_updates` of one parameter) come here. What can be decided at trace
time (dtypes, options, the kernels' switch) is decided here in Python; what
depends on the backend the step is lowered for is left to
`lax.platform_dependent`, so one traced step lowers to the CPU kernels on the
CPU and to XLA ops everywhere else. Every path returns the same results: on
the CPU the kernels equal the XLA ops bit for bit (tests/backends).
"""

import jax
from jax import lax

from optax_sparse_adam._backends import xla
from optax_sparse_adam._backends.cpu import kernels
from optax_sparse_adam._core.adam import RowsStep, StepOptions, TableState
from optax_sparse_adam._core.bcoo import RowLayout


def rows_step(
  rows: jax.Array,
  values: jax.Array,
  tables: TableState,
  *,
  layout: RowLayout,
  options: StepOptions,
) -> RowsStep:
  """One parameter's masked step on the backend it is lowered for (see `xla.rows_step`)."""

  def generic(rows, values, tables):
    return xla.rows_step(rows, values, tables, layout=layout, options=options)

  if not kernels.step_applies(values, tables, layout=layout, options=options):
    return generic(rows, values, tables)

  def on_cpu(rows, values, tables):
    return kernels.rows_step(rows, values, tables, layout=layout, options=options)

  return lax.platform_dependent(rows, values, tables, cpu=on_cpu, default=generic)


def scatter_add(
  param: jax.Array,
  rows: jax.Array,
  values: jax.Array,
  *,
  layout: RowLayout,
  unique_rows: bool,
  sorted_rows: bool,
) -> jax.Array:
  """`param[rows] += values` on the backend it is lowered for; padding rows dropped."""

  def generic(param, rows, values):
    return xla.scatter_add(
      param, rows, values, layout=layout, unique_rows=unique_rows, sorted_rows=sorted_rows
    )

  if not kernels.scatter_add_applies(param, values, layout=layout):
    return generic(param, rows, values)

  def on_cpu(param, rows, values):
    # The kernel takes the parameter in its own shape: a reshaped operand that
    # it updates in place would be copied by XLA.
    return kernels.scatter_add_rows(
      param, rows, values, num_rows=layout.num_rows, unique_rows=unique_rows
    )

  return lax.platform_dependent(param, rows, values, cpu=on_cpu, default=generic)
