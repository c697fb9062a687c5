"""A parameter's step checked and planned before a backend runs it: `prepare_leaf_step`.

Shared by `leaf.masked_leaf_step` (one table) and `table_steps` (the tables of one
update stepped together): the gradient's ids verified, the tables checked against
the gradient's layout and the options, the compute dtype and the parameter's
rounding settled, and the parameter dropped where the step never reads it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse

from optax_sparse_adam._core import bcoo, rounding, row_update
from optax_sparse_adam._core.errors import path_str
from optax_sparse_adam._core.rules import (
  RowRule,
  StepConfig,
  StepPlan,
  Tables,
  reads_param,
  sets_rows,
)


class PreparedStep(NamedTuple):
  """A parameter's step checked and planned (`prepare_leaf_step`), before a backend runs it."""

  grad: sparse.BCOO
  tables: Tables
  plan: StepPlan
  new_step: jax.Array | None


def prepare_leaf_step(
  grad: sparse.BCOO,
  tables: Tables,
  step: jax.Array | None,
  *,
  rule: RowRule,
  config: StepConfig,
  path: tuple = (),
) -> PreparedStep:
  """`masked_leaf_step`'s checks and plan: the gradient's ids verified, the tables checked."""
  layout = bcoo.row_layout(grad, _param_shape(tables, rule, grad), path)
  grad = row_update.verified(grad, path, what="gradient")
  _check_tables(tables, layout, config, path, rule)
  if tables.param is not None:
    # Stochastic rounding where the table is 16-bit; wider ones hold w + delta as computed.
    config = config._replace(
      param_rounding=rounding.check_param_rounding(config.param_rounding, tables.param.dtype, path)
    )
  if config.param_rounding == "stochastic" and step is None:
    raise ValueError(
      f"param_rounding='stochastic' of the parameter at {path_str(path)} keys its random "
      "bits on the parameter's step count, and this step was given none."
    )
  compute_dtype = jnp.result_type(
    jnp.float32, grad.dtype, *(table.dtype for table in tables.slots.values())
  )
  plan = StepPlan(layout, rule, config._replace(compute_dtype=jnp.dtype(compute_dtype)))
  if (
    config.weight_decay == "none"
    and config.max_norm is None
    and not uses_param(rule)
    and config.param_rounding == "nearest"
  ):
    tables = tables._replace(param=None)
  new_step = None if step is None else optax.safe_increment(step)
  return PreparedStep(grad, tables, plan, new_step)


def uses_param(rule: RowRule) -> bool:
  """Whether the rule's step reads the parameter's rows (it reads them, or sets them)."""
  return reads_param(rule) or sets_rows(rule)


def _param_shape(tables: Tables, rule: RowRule, grad: sparse.BCOO) -> tuple[int, ...]:
  """The parameter's shape: the rule's first full-width slot's, else the parameter's, else
  the gradient's (a rule with per-row slots only checks their rows in `_check_tables`)."""
  for slot in rule.slots():
    if not slot.per_row:
      return tuple(tables.slots[slot.name].shape)
  if tables.param is not None:
    return tuple(jnp.shape(tables.param))
  return tuple(grad.shape)


def _check_tables(
  tables: Tables, layout: bcoo.RowLayout, config: StepConfig, path: tuple, rule: RowRule
) -> None:
  """Refuses a step that lacks the parameter for weight decay, or per-row arrays of another size."""
  for needed, what in (
    (config.weight_decay != "none", "weight decay"),
    (config.max_norm is not None, "max_norm"),
    (uses_param(rule), f"the {rule.name!r} rule, which reads its rows"),
    (config.param_rounding == "stochastic", "param_rounding='stochastic', which rounds its rows"),
  ):
    if needed and tables.param is None:
      raise ValueError(
        f"Parameter at {path_str(path)} is needed for {what}: pass params "
        "to update(grads, state, params)."
      )
  for per_row, option in (
    (tables.row_step, "per-row bias correction"),
    (tables.last_step, "catch-up"),
  ):
    if per_row is not None and per_row.shape != (layout.num_rows,):
      raise ValueError(
        f"Sparse gradient at {path_str(path)} indexes {layout.num_rows} rows "
        f"(sparse dims {layout.sparse_shape}) but {option} keeps "
        f"{per_row.shape[0]} row steps, one per index of the leading dim. Use "
        "n_sparse=1 gradients (bcoo_update_layout(grad, n_dense=ndim - 1))."
      )
  for slot in rule.slots():
    table = tables.slots[slot.name]
    if slot.per_row and tuple(table.shape) != (layout.num_rows,):
      raise ValueError(
        f"Sparse gradient at {path_str(path)} indexes {layout.num_rows} rows "
        f"(sparse dims {layout.sparse_shape}) but the {rule.name!r} rule keeps one "
        f"{slot.name!r} value per row, {tuple(table.shape)}, one per index of the "
        "leading dim. Use n_sparse=1 gradients (bcoo_update_layout(grad, n_dense=ndim - 1))."
      )
