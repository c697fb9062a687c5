"""`RowUpdate`: the BCOO the optimizers emit, whose row ids carry a check no transform can keep.

An optax transform chained after a sparse optimizer maps over every leaf of the
update tree, a BCOO's int32 row ids included: `optax.scale_by_learning_rate(schedule)`
multiplies them by the step size cast to int32, so every update lands on row 0 and
nothing fails. A `RowUpdate` is a BCOO with one more leaf, `row_check`, the bitwise
complement of its indices (`~ids == -ids - 1`). A map that leaves the ids as they were
leaves the pair consistent; any scaling by `s != 1`, shift, sign flip, clip that moves
an id or zeroing breaks it (`~(s * ~x) == s * x + s - 1`, which is `s * x` only for
`s == 1`). `checked_indices` verifies the pair where the ids are used:

- the instance the library built reaches the consumer unchanged (sealed): nothing to
  check, no cost;
- rebuilt by a tree map (a transform, a `lax.cond`, a `jit` boundary) with concrete
  values: checked at once, and a moved id raises before anything is written;
- rebuilt and traced: the check runs in the step; if an id moved, every entry of the
  update is turned into padding (no row is written) and a host callback raises.

A plain BCOO (one a user built) is not checked: it carries nothing to check against.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse

from optax_sparse_adam._core.errors import path_str

_ROUTE = (
  "Apply element-wise transforms to its rows with osa.lift_to_bcoo(transform), give a "
  "schedule to the optimizer itself (learning_rate=schedule), or see the verdict table "
  "in docs/composing.md"
)


class DensifyingUpdateWarning(UserWarning):
  """A sparse update was added to a dense array with `+` (`optax.apply_updates`, say).

  The sum is right, but it builds an array the size of the table at every step.
  `optax_sparse_adam.apply_updates` scatters the touched rows instead.
  """


class _RowUpdateType(type(sparse.BCOO)):  # type: ignore[misc]
  """The metaclass of `RowUpdate`: its `repr` says what to do.

  JAX's pytree structure errors print the type of the mismatched subtree. When an optax
  transform that pairs updates with params or with per-leaf state (`add_decayed_weights`,
  `trace`, `ema`, `lookahead`) meets a `RowUpdate`, the error it raises then names the
  route instead of leaving the user with two type names.
  """

  def __repr__(cls) -> str:
    return (
      f"<class 'optax_sparse_adam.{cls.__name__}'> (a sparse optimizer's update of some rows: "
      "optax transforms that pair updates with params or keep state per leaf cannot "
      f"follow the optimizer on it. {_ROUTE}.)"
    )


@jax.tree_util.register_pytree_node_class
class RowUpdate(sparse.BCOO, metaclass=_RowUpdateType):
  """A BCOO update of rows that carries `row_check`, the bitwise complement of its indices.

  It is a `jax.experimental.sparse.BCOO` in every other way (`todense`, `indices`,
  `data`); `apply_updates` and the library's transformations verify the pair before
  they use the ids (see the module docstring).
  """

  row_check: jax.Array
  # The (indices, row_check) objects this instance was built with: a tree map rebuilds
  # the instance through `tree_unflatten`, which leaves this None.
  _sealed: tuple[Any, Any] | None = None

  def __init__(
    self,
    args: tuple[Any, Any],
    *,
    shape: Sequence[int],
    indices_sorted: bool = False,
    unique_indices: bool = False,
  ):
    super().__init__(
      args, shape=tuple(shape), indices_sorted=indices_sorted, unique_indices=unique_indices
    )
    self.row_check = lax.bitwise_not(self.indices)
    self._sealed = (self.indices, self.row_check)

  @property
  def sealed(self) -> bool:
    """Whether this is the instance the library built, with the ids it was built with."""
    return (
      self._sealed is not None
      and self._sealed[0] is self.indices
      and self._sealed[1] is self.row_check
    )

  def tree_flatten(self) -> tuple[tuple[Any, Any, Any], dict[str, Any]]:
    return (self.data, self.indices, self.row_check), self._info._asdict()

  @classmethod
  def tree_unflatten(cls, aux_data: dict[str, Any], children: Sequence[Any]) -> RowUpdate:
    obj = object.__new__(cls)
    obj.data, obj.indices, obj.row_check = children
    obj.__dict__.update(**aux_data)
    return obj

  # `param + update` is how optax.apply_updates, nnx.Optimizer and
  # optax.contrib.schedule_free apply updates: right once the ids are verified, but dense.
  def __add__(self, other: Any) -> Any:
    return _dense_sum(self, other)

  def __radd__(self, other: Any) -> Any:
    return _dense_sum(self, other)


def _dense_sum(update: RowUpdate, other: Any) -> Any:
  """`other + update` with the ids verified; a dense `other` is told once that it densifies."""
  plain = verified(update, (), what="update added with +")
  if isinstance(other, sparse.JAXSparse) or jnp.ndim(other) == 0:
    return sparse.BCOO.__add__(plain, other)
  shape, dtype = tuple(int(d) for d in update.shape), jnp.result_type(other)
  size = int(np.prod(shape)) * dtype.itemsize
  # Told once per place it happens: Python's default warning filter shows a warning once
  # per call site, and a jitted step is traced once.
  warnings.warn(
    f"a sparse update of shape {shape} ({update.nse} entries) was added to a dense "
    f"{dtype} array with '+' (optax.apply_updates, nnx.Optimizer and "
    "optax.contrib.schedule_free do this): the result is right, but every step "
    f"builds a dense array the size of the table ({size / 2**20:.1f} MiB) and writes "
    "every row. Use optax_sparse_adam.apply_updates (osa.SparseOptimizer in Flax NNX), "
    "which scatters the touched rows.",
    DensifyingUpdateWarning,
    stacklevel=3,
  )
  return sparse.BCOO.__radd__(plain, other)


def seal(update: sparse.BCOO) -> RowUpdate:
  """`update` as a sealed `RowUpdate` with the same arrays and metadata."""
  return RowUpdate(
    (update.data, update.indices),
    shape=update.shape,
    indices_sorted=update.indices_sorted,
    unique_indices=update.unique_indices,
  )


def moved_message(path: Sequence[Any] | str, what: str) -> str:
  where = path if isinstance(path, str) else path_str(path)
  return (
    f"the row ids of the sparse {what} at {where} were changed after the optimizer emitted "
    "them (its RowUpdate's indices no longer match their check): an optax transform that "
    "maps over every leaf of the updates, such as optax.scale_by_learning_rate, "
    "optax.scale_by_schedule, optax.scale or optax.clip, scaled or clipped the row ids "
    f"along with the values, which would update the wrong rows. {_ROUTE}."
  )


def checked_indices(update: sparse.BCOO, path: Sequence[Any], *, what: str) -> jax.Array:
  """The indices of `update`, verified against its `row_check` when it is a rebuilt `RowUpdate`.

  Raises a `ValueError` naming the leaf at once if the values are concrete and an id
  moved. Traced, it returns indices that are all padding (distinct, out of range, so
  every consumer drops them) if an id moved, and a host callback raises the same error
  when the step runs. A sealed `RowUpdate` and a plain BCOO are returned as they are.
  """
  if not isinstance(update, RowUpdate) or update.sealed:
    return update.indices
  indices, check = update.indices, update.row_check
  if (
    jnp.shape(check) != jnp.shape(indices)
    or not jnp.issubdtype(jnp.result_type(check), jnp.integer)
    or jnp.result_type(check) != jnp.result_type(indices)
  ):
    raise ValueError(moved_message(path, what))
  moved = jnp.any(indices != lax.bitwise_not(check))
  if not isinstance(moved, jax.core.Tracer):
    if bool(moved):
      raise ValueError(moved_message(path, what))
    return indices
  message = moved_message(path, what)

  def raise_if_moved(flag: Any) -> None:
    if np.any(flag):
      raise ValueError(message)

  jax.debug.callback(raise_if_moved, moved)
  return padding_if(moved, update)


def padding_if(moved: jax.Array, update: sparse.BCOO) -> jax.Array:
  """The update's indices, or where `moved` all padding: distinct, sorted, out of range."""
  indices = update.indices
  nse = indices.shape[-2]
  padding = (
    jnp.zeros_like(indices)
    .at[..., 0]
    .set(update.shape[update.n_batch] + jnp.arange(nse, dtype=indices.dtype))
  )
  return jnp.where(moved, padding, indices)


def verified(update: sparse.BCOO, path: Sequence[Any], *, what: str) -> sparse.BCOO:
  """`update` with its indices verified (`checked_indices`), as a plain BCOO of the same flags."""
  if not isinstance(update, RowUpdate):
    return update
  return sparse.BCOO(
    (update.data, checked_indices(update, path, what=what)),
    shape=update.shape,
    indices_sorted=update.indices_sorted,
    unique_indices=update.unique_indices,
  )
