"""The state of `sparse_adam`, and how a step reads one parameter's part of it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_sparse_adam._core import rules
from optax_sparse_adam._core.errors import flatten_up_to, leaves_up_to
from optax_sparse_adam._core.row_rules.adam import LeafState


def check_param_steps(param_steps: Any, num_params: int, holder: str, hint: str = "") -> None:
  """Refuses step counts that are not one int32 vector with a count per parameter."""
  shape = getattr(param_steps, "shape", None)
  if shape is None or tuple(shape) != (num_params,):
    raise ValueError(
      f"The optimizer state's param_steps has shape {shape}, but {holder} hold "
      f"{num_params} parameters: param_steps must be int32 ({num_params},), one step "
      f"count per parameter.{hint}"
    )


class SparseAdamState(NamedTuple):
  """State of `sparse_adam`.

  Its structure depends only on the flags given to `sparse_adam`, never on
  the params given to `init`, so `optax.tree.map_params` finds the fields that
  follow the params (`mu`, `nu`, `nu_max`, `row_step`, `row_last_step`) and
  maps the others (`count`, `param_steps`) with `transform_non_params`.

  Attributes:
    count: int32 number of `update` calls, the input of a learning-rate schedule.
    param_steps: int32 `(num_params,)`, per parameter (in the order of the
      params' leaves) the number of steps it has taken (torch's
      `state['step']`); a parameter whose gradient is None does not advance.
      One vector, not a tree of scalars like the params, so that a
      parameter's sharding is never given to its counter. Read it per
      parameter as `step`.
    mu: per parameter, the first moment (torch's `exp_avg`).
    nu: per parameter, the second moment (torch's `exp_avg_sq`); with
      `rowwise_second_moment=True`, one value per row, shape `(num_rows,)`.
    nu_max: per parameter, the running max of `nu` (of `nu`'s shape) with
      `amsgrad=True`, else None.
    row_step: per parameter, int32 steps of each row with
      `per_row_bias_correction=True`, else None.
    row_last_step: per parameter, int32 `(num_rows,)`, the step up to which
      each row is caught up with `catch_up_idle_rows=True`, else None.
  """

  # `count` shadows tuple.count, as in optax's states (ScaleByAdamState.count).
  count: jax.Array  # type: ignore[assignment]
  param_steps: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  nu_max: optax.Updates | None
  row_step: optax.Updates | None
  row_last_step: optax.Updates | None = None

  @property
  def step(self) -> optax.Updates:
    """`param_steps` as a tree like the params: each parameter's step count, a scalar."""
    leaves, treedef = jax.tree.flatten(self.mu)
    return jax.tree.unflatten(treedef, [self.param_steps[i] for i in range(len(leaves))])

  @classmethod
  def from_step_tree(cls, old: Any) -> SparseAdamState:
    """A state of the 0.1.0 layout, whose `step` is a tree like the params, in this layout.

    Args:
      old: an object or a mapping with the fields `count`, `step` (a scalar per
        parameter, in a tree like `mu`'s), `mu`, `nu` and optionally `nu_max` and
        `row_step`: e.g. the `opt_state` of a checkpoint restored without a
        target (`orbax.checkpoint.StandardCheckpointer().restore(path)`).

    Returns:
      The same state with `param_steps` in place of `step`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> old = {"count": 2, "step": {"a": 2, "b": 1}, "mu": {"a": jnp.zeros(3), "b": jnp.zeros(2)},
      ...        "nu": {"a": jnp.zeros(3), "b": jnp.zeros(2)}}
      >>> osa.SparseAdamState.from_step_tree(old).param_steps
      Array([2, 1], dtype=int32)
    """

    def get(name: str) -> Any:
      return old.get(name) if isinstance(old, Mapping) else getattr(old, name, None)

    mu = get("mu")
    treedef = jax.tree.structure(mu)
    steps = flatten_up_to(
      treedef,
      get("step"),
      lambda: (
        f"from_step_tree: the old state's step must be a tree like its mu ({treedef}), "
        f"got {get('step')!r}."
      ),
    )
    return cls(
      count=jnp.asarray(get("count"), jnp.int32),
      param_steps=jnp.asarray(np.array(steps, np.int64).reshape(-1), jnp.int32),
      mu=mu,
      nu=get("nu"),
      nu_max=get("nu_max"),
      row_step=get("row_step"),
    )


def leaf_state_of(step: jax.Array, tables: rules.Tables) -> LeafState:
  """A parameter's `LeafState` from its step count and its rule's tables."""
  slots = tables.slots
  return LeafState(step, slots["mu"], slots["nu"], slots.get("nu_max"), tables.row_step)


def param_indices(treedef: Any, paths: list[Any], state: SparseAdamState) -> list[int | None]:
  """Per gradient leaf, its parameter's position in `state.param_steps` (None: no parameter)."""
  num_params = len(jax.tree.leaves(state.mu))
  check_param_steps(
    state.param_steps,
    num_params,
    "its moments",
    " A SparseAdamState whose step counts are a tree like the params (the layout of "
    "0.1.0) converts with SparseAdamState.from_step_tree.",
  )
  indices = jax.tree.unflatten(jax.tree.structure(state.mu), range(num_params))
  return leaves_up_to(treedef, indices, "optimizer state", paths)


def leaf_states(
  treedef: Any, paths: list[Any], state: SparseAdamState, indices: list[int | None]
) -> list[LeafState]:
  """One `LeafState` per gradient leaf (None where the gradient has no parameter)."""
  step = [None if i is None else state.param_steps[i] for i in indices]
  mu = leaves_up_to(treedef, state.mu, "optimizer state", paths)
  nu = leaves_up_to(treedef, state.nu, "optimizer state", paths)
  nu_max = leaves_up_to(treedef, state.nu_max, "optimizer state", paths)
  row_step = leaves_up_to(treedef, state.row_step, "optimizer state", paths)
  return [
    LeafState(*fields)  # type: ignore[arg-type]  # step is None only where grad is
    for fields in zip(step, mu, nu, nu_max, row_step, strict=True)
  ]
