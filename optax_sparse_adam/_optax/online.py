"""Online training: which rows changed since a step, deltas for serving, and resetting rows.

A factory made with `track_changed_rows=True` keeps, per table, an int32 per row
(`row_last_step`, 4 bytes a row): the parameter step at which the optimizer last
wrote the row. Catch-up of idle rows keeps the same array for its own use (the
step up to which a row is caught up, which is also the step that last wrote it),
so the two share it. A step writes its own step count `t` for the rows it
touches: the fused CPU kernels and the accelerator step do it where catch-up
runs in them; with tracking alone, the XLA ops after the step do it
(`mark_stepped`), so the step itself runs as before.

`reset_rows` writes `t + 1` (the next step) for the rows it resets: a reset
between step `t` and step `t + 1` happens after a delta published at `t`, so the
next delta, of the rows written after `t`, holds them; catch-up counts no idle
steps for them (a row stamped `t + 1` has none before step `t + 1`): a reset row
is a new row.

The public functions over it: `deltas` (`changed_rows`, `rows_delta`,
`apply_rows_delta`) and `reset` (`reset_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import sparse

from optax_sparse_adam._core.errors import path_str
from optax_sparse_adam._core.sharded import routed, sharding
from optax_sparse_adam._optax import catch_up


def any_treedef(x: Any) -> Any:
  return x


def check_flag(track_changed_rows: Any, name: str) -> bool:
  """`track_changed_rows` as a bool; refuses anything but True or False."""
  if not isinstance(track_changed_rows, bool):
    raise TypeError(f"{name}: track_changed_rows must be True or False, got {track_changed_rows!r}")
  return track_changed_rows


def last_step_leaves(
  treedef: Any, paths: list[Any], state: Any, *, catch_up_kept: bool, tracked: bool, name: str
) -> list[jax.Array | None]:
  """Per gradient leaf, its `row_last_step` (None where neither catch-up nor tracking keeps it)."""
  wanted = catch_up_kept or tracked
  have = getattr(state, "row_last_step", None) is not None
  if wanted != have:
    if wanted:
      made = " and ".join(
        flag
        for flag, on in (
          ("catch_up_idle_rows=True", catch_up_kept),
          ("track_changed_rows=True", tracked),
        )
        if on
      )
      why = f"the transformation was made with {made}, which keeps one"
    else:
      why = (
        "the transformation was made with catch_up_idle_rows=False (or a rule whose idle "
        "rows do not move) and track_changed_rows=False, which keep none"
      )
    raise ValueError(
      f"{name}: the optimizer state {'lacks' if wanted else 'has'} row_last_step, but "
      f"{why}: pass the state that this transformation's init made."
    )
  return catch_up.last_step_leaves(treedef, paths, state, wanted)


def mark_stepped(
  last_step: jax.Array, update: sparse.BCOO, step: jax.Array, path: Sequence[Any]
) -> jax.Array:
  """`last_step` with the rows of `update` (padding out of range: dropped) set to `step`."""
  if update.indices.shape[-1] != 1:
    raise ValueError(
      f"track_changed_rows keeps one step per row of the leading dim, but the gradient at "
      f"{path_str(path)} has {update.indices.shape[-1]} sparse dims. Use n_sparse=1 "
      "gradients (bcoo_update_layout(grad, n_dense=ndim - 1))."
    )
  refuse_cyclic("track_changed_rows")

  def mark(last: jax.Array, indices: jax.Array, step: jax.Array) -> jax.Array:
    rows = indices[:, 0]
    # Negative ids are padding too (not wrapped): the same row count drops them.
    rows = jnp.where(rows < 0, last.shape[0], rows)
    return last.at[rows].set(step.astype(last.dtype), mode="drop")

  return sharding.call_with_auto_axes(
    mark, (last_step, update.indices, step), sharding.spec_of(last_step)
  )


def new_last_steps(
  grads_with_path: list[tuple[Any, Any]],
  kept: list[jax.Array | None],
  stepped: list[jax.Array | None],
  updates: list[Any],
  steps: list[Any],
  *,
  marks: bool,
) -> list[jax.Array | None]:
  """Each leaf's `row_last_step` after a step: the backend's (catch-up) or marked here."""
  if not marks:
    return stepped
  out = []
  for (path, grad), last, update, step in zip(grads_with_path, kept, updates, steps, strict=True):
    if grad is None or last is None:
      out.append(last)
    else:
      out.append(mark_stepped(last, update, step, path))
  return out


def refuse_cyclic(what: str) -> None:
  if routed.current().row_placement == "cyclic":
    raise ValueError(
      f"{what} does not support tables placed cyclically (sharded_routing("
      "row_placement='cyclic')): its row ids would be the physical rows. Use "
      "row_placement='block'."
    )


def flatten_like(treedef: Any, tree: Any, what: str, name: str) -> list[Any]:
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as err:
    raise ValueError(
      f"{what}: {name} must have the structure of the state's tables ({treedef}), got "
      f"{jax.tree.structure(tree)}. Inside optax.multi_transform or optax.masked, pass "
      "the params masked as the state is (optax.MaskedNode() where the transformation "
      "does not apply)."
    ) from err
