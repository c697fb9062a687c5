"""`reset_rows` of the torch adapter's optimizers: a parameter's rows and its state's, fresh.

What `optax_sparse_adam.reset_rows` does for an optax state, for a parameter of
a torch-style optimizer: each per-parameter slot (`exp_avg`, `sum`,
`momentum_buffer`, ...) takes, at the given rows, the value a fresh state holds,
and the parameter's rows take the values given. One jitted call that donates
the parameter and its slots, so it costs O(rows), not a copy of the table.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_sparse_adam._core.errors import describe
from optax_sparse_adam.torch_compat import _convert


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _set_rows(
  param: jax.Array, slots: dict[str, jax.Array], rows: jax.Array, values: Any, fills: dict
) -> tuple[jax.Array, dict[str, jax.Array]]:
  new_slots = {
    key: table.at[rows].set(jnp.asarray(fills[key], table.dtype), mode="drop")
    for key, table in slots.items()
  }
  if values is not None:
    param = param.at[rows].set(values.astype(param.dtype), mode="drop")
  return param, new_slots


def reset_param_rows(
  optimizer: Any, param: Any, ids: Any, values: Any, fills: dict[str, float]
) -> None:
  """Resets the rows `ids` of `param` (to `values`, if given) and of its state (to `fills`).

  Args:
    optimizer: the torch adapter's optimizer holding `param`.
    param: a `Parameter` of one of its groups.
    ids: int row ids of the parameter's leading dim, each in range.
    values: `(len(ids), *row_shape)` new rows of the parameter, or None.
    fills: `{state key: fresh value}` of each per-parameter slot.
  """
  name = type(optimizer).__name__
  if not any(q is param for group in optimizer.param_groups for q in group["params"]):
    raise ValueError(f"{name}.reset_rows: the parameter is not in this optimizer's param groups.")
  data = param.data
  num_rows = data.shape[0] if data.ndim else 0
  rows = np.asarray(_convert.to_numpy(ids) if _convert.is_array(ids) else ids)
  if rows.size == 0:
    rows = rows.astype(np.int32)  # [] is float to NumPy
  if rows.dtype.kind not in "iu":
    raise TypeError(f"{name}.reset_rows: ids must be integers, got {describe(ids)}.")
  rows = rows.reshape(-1)
  if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
    bad = int(rows.min() if rows.min() < 0 else rows.max())
    raise ValueError(
      f"{name}.reset_rows: the parameter has {num_rows} rows, but ids holds {bad}: ids must "
      f"be in [0, {num_rows})."
    )
  if values is not None:
    values = jnp.asarray(_convert.to_numpy(values) if _convert.is_array(values) else values)
    want = (rows.size, *data.shape[1:])
    if tuple(values.shape) != want:
      raise ValueError(
        f"{name}.reset_rows: values has shape {tuple(values.shape)}, but {rows.size} ids of "
        f"rows {tuple(data.shape[1:])} need {want}."
      )
  state = optimizer.state.get(param) or {}
  slots = {key: state[key] for key in fills if key in state}
  if values is None and not slots:
    return  # no state yet: the rows are fresh already
  arrays = [data, *slots.values()]
  for i, array in enumerate(arrays):  # a buffer held twice cannot be donated twice
    if any(array is other for other in arrays[:i]):
      arrays[i] = jnp.copy(array)
  data, slots = arrays[0], dict(zip(slots, arrays[1:], strict=True))
  new_data, new_slots = _set_rows(
    data, slots, jnp.asarray(rows, jnp.int32), values, {key: fills[key] for key in slots}
  )
  param.data = new_data
  for key, table in new_slots.items():
    state[key] = table
