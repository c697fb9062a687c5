"""`apply_updates`: BCOO updates applied by scatter-add, dense ones as `optax.apply_updates`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse

from optax_sparse_adam._core import bcoo
from optax_sparse_adam._core.errors import is_grad_leaf, path_difference, path_str
from optax_sparse_adam._optax import leaf


def apply_updates(params: optax.Params, updates: optax.Updates) -> optax.Params:
  """Applies updates to params: BCOO leaves by scatter-add, dense leaves as `optax.apply_updates`.

  A BCOO update is never densified: only its rows of the parameter are read and
  written. A `SetRowsUpdate` (the update of a rule that sets rows, `sparse_ftrl`)
  holds the rows' new values: they are stored, not added. Inside `jax.jit` with
  the params donated this runs in place, in time proportional to the update's
  entries. A None update leaves its parameter as is.

  Args:
    params: a tree of parameters.
    updates: a tree of the same structure, with BCOO, array or None leaves.

  Returns:
    The updated parameters, each in its parameter's dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> u = sparse.BCOO((jnp.array([1.0, 2.0]), jnp.array([[0], [0]])), shape=(3,))
    >>> osa.apply_updates(jnp.zeros(3), u)
    Array([3., 0., 0.], dtype=float32)
  """

  def apply_leaf(path: Any, param: Any, update: Any) -> Any:
    if param is None or update is None:
      return param
    if isinstance(update, sparse.BCOO):
      bcoo.check_param_dtype(param, path)
      return leaf.scatter_add_bcoo(jnp.asarray(param), update, path)
    param_shape, update_shape = jnp.shape(param), jnp.shape(update)
    try:
      fits = jnp.broadcast_shapes(param_shape, update_shape) == param_shape
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(
        f"apply_updates: the update at {path_str(path)} has shape {update_shape} "
        f"but its parameter has shape {param_shape}; expected the parameter's shape."
      )
    return jnp.asarray(param + update).astype(jnp.asarray(param).dtype)

  try:
    return jax.tree_util.tree_map_with_path(
      apply_leaf, params, updates, is_leaf=lambda x: x is None
    )
  except ValueError as err:
    if "tree structure" not in str(err) and "Custom node type mismatch" not in str(err):
      raise
    update_paths = [
      p for p, _ in jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_grad_leaf)[0]
    ]
    raise ValueError(
      "apply_updates: the updates' tree structure differs from the params'"
      f"{path_difference(update_paths, params, 'params', first='updates')}. "
      f"Params: {jax.tree_util.tree_structure(params)}; updates: "
      f"{jax.tree_util.tree_structure(updates, is_leaf=is_grad_leaf)}."
    ) from err
