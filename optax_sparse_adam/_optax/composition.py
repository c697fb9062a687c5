"""BCOO-aware optax building blocks: lift element-wise and norm-based transforms, and combinators.

A `jax.experimental.sparse.BCOO` is a pytree of `(data, indices)`, so an optax
transform that maps over the gradient tree also maps over the indices:
`optax.scale(-2.0)` turns row ids into negative floats. The wrappers here hide
the indices: each BCOO gradient is coalesced (duplicate rows summed, padding
zeroed) and only its row values are shown to the wrapped transform, next to the
dense leaves of the same tree. The result is rebuilt as a BCOO with sorted,
unique indices, so a later transform (e.g. `sparse_adam`) sees a well-formed
gradient.

Combinators that keep per-parameter state or build their own zero updates
cannot be lifted this way; `sparse_apply_if_finite` (here) and
`sparse_multi_steps` (`_optax.multi_steps`) replace `optax.apply_if_finite` and
`optax.MultiSteps` for BCOO gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.experimental import sparse

from optax_sparse_adam._core import bcoo, coalesce, row_update
from optax_sparse_adam._core.errors import (
  describe,
  flatten_grads,
  flatten_up_to,
  is_grad_leaf,
  leaves_up_to,
  path_str,
)
from optax_sparse_adam._core.set_rows import SetRowsUpdate
from optax_sparse_adam._core.sharded import sharding


def _param_shape(grad: sparse.BCOO, param: Any) -> tuple[int, ...]:
  return tuple(grad.shape) if param is None else tuple(jnp.shape(param))


def _grows_with_params(transform: optax.GradientTransformation, params: Any) -> list[str]:
  """Paths of state leaves whose shape follows the parameters' shapes.

  The state is built (abstractly) for the params and for params with one more
  trailing dim; leaves that change shape hold per-parameter (per-entry) state.
  """

  def grown(p: Any) -> Any:
    if not hasattr(p, "shape"):
      return p
    return jax.ShapeDtypeStruct(tuple(p.shape) + (1,), p.dtype)

  state = jax.eval_shape(transform.init, params)
  probe = jax.eval_shape(transform.init, jax.tree.map(grown, params))
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  probe_leaves = jax.tree.leaves(probe)
  if len(leaves) != len(probe_leaves):
    return ["<structure>"]
  return [
    path_str(path)
    for (path, a), b in zip(leaves, probe_leaves, strict=True)
    if getattr(a, "shape", None) != getattr(b, "shape", None)
  ]


class _Lifted(NamedTuple):
  """Coalesced views of the BCOO leaves of one gradient tree."""

  treedef: Any
  # Per leaf: a BCOO's layout and coalesced row ids, or None for a dense or None leaf.
  rows: list[tuple[bcoo.RowLayout, jax.Array] | None]
  values: list[Any]
  params: list[Any]


def _lift(updates: Any, params: Any, who: str) -> _Lifted:
  """Coalesces every BCOO leaf; gathers the matching rows of its parameter."""
  leaves_with_path, treedef = flatten_grads(updates)
  param_leaves = leaves_up_to(treedef, params, "params")
  rows: list[tuple[bcoo.RowLayout, jax.Array] | None] = []
  values, lifted_params = [], []
  for (path, grad), param in zip(leaves_with_path, param_leaves, strict=True):
    if not isinstance(grad, sparse.BCOO):
      rows.append(None)
      values.append(grad)
      lifted_params.append(param)
      continue
    if isinstance(grad, SetRowsUpdate):
      raise TypeError(
        f"{who}: the update at {path_str(path)} is a SetRowsUpdate, the new rows of a rule "
        "that sets rows (sparse_ftrl, say) or of a 16-bit table rounded stochastically "
        "(param_rounding='stochastic'), not deltas: a transform after it would "
        "transform the parameter's rows themselves. Give a schedule to the optimizer "
        "(learning_rate=schedule), or lift the transform before the optimizer."
      )
    layout = checked_row_layout(grad, _param_shape(grad, param), path, who)
    indices = row_update.checked_indices(grad, path, what="update")
    coalesced = coalesce.coalesce_rows(
      bcoo.linear_rows(indices, layout), grad.data, layout.num_rows
    )
    rows.append((layout, coalesced.rows))
    values.append(coalesced.values)
    lifted_params.append(
      None
      if param is None
      else bcoo.gather_rows(bcoo.as_rows(jnp.asarray(param), layout), coalesced.rows)
    )
  return _Lifted(treedef, rows, values, lifted_params)


def checked_row_layout(
  grad: sparse.BCOO, shape: Sequence[int], path: Any, who: str
) -> bcoo.RowLayout:
  try:
    return bcoo.row_layout(grad, shape, path)
  except (TypeError, ValueError) as err:
    raise type(err)(f"{who}: {err}") from None


def _raise_bcoo_state(who: str, inner_paths: list[str], instead: str) -> None:
  raise ValueError(
    f"{who} cannot wrap this transformation: its state leaves {inner_paths} have "
    "the shape of the parameters (per-entry state such as moments or "
    "accumulators). A BCOO gradient updates only some rows, and the wrapped "
    "transformation would see row slots, not rows. " + instead
  )


def lift_to_bcoo(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  r"""Applies an element-wise or norm-based transformation to the coalesced rows of BCOO gradients.

  For each BCOO gradient :math:`g` with touched rows :math:`r`, the wrapped
  transformation sees the dense array :math:`\mathrm{coalesce}(g)_r` of shape
  `(nse, *row_shape)` (duplicates summed, padding slots zero) in place of the
  BCOO, and the gathered parameter rows :math:`\theta_r` in place of the
  parameter; dense leaves are passed through unchanged. Its output is rebuilt
  as a BCOO on the same rows, with sorted unique indices:

  .. math::
    \mathrm{lift}(T)(g)_r = T(\mathrm{coalesce}(g)_r, \theta_r)

  This equals the dense transformation restricted to the touched rows for any
  transformation that acts entry by entry (`optax.scale`, `clip`,
  `scale_by_learning_rate`, `scale_by_schedule`, `add_decayed_weights`,
  `zero_nans`) or through a global norm of the whole tree
  (`clip_by_global_norm`): each row counts once and untouched rows are zero.
  The indices never reach the wrapped transformation.

  Transformations with per-parameter state (moments, accumulators: `optax.adam`,
  `optax.ema`, `optax.MultiSteps`) are refused at `init`: use `sparse_adam`,
  `sparse_multi_steps`, or route those leaves elsewhere with
  `optax.multi_transform`.

  Args:
    inner: a stateless or shape-free-state transformation (counts, schedules and
      scalar flags are fine).

  Returns:
    An `optax.GradientTransformationExtraArgs` with `inner`'s state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> g = sparse.BCOO((jnp.array([3.0, 1.0]), jnp.array([[2], [2]])), shape=(5,))
    >>> clip = osa.lift_to_bcoo(optax.clip_by_global_norm(2.0))
    >>> u, _ = clip.update(g, clip.init(jnp.zeros(5)))
    >>> u.todense()
    Array([0., 0., 2., 0., 0.], dtype=float32)

  References:
    `jax.experimental.sparse.BCOO`,
    https://docs.jax.dev/en/latest/jax.experimental.sparse.html
  """
  inner = optax.with_extra_args_support(inner)
  who = "lift_to_bcoo"

  def init_fn(params: optax.Params) -> optax.OptState:
    paths = _grows_with_params(inner, params)
    if paths:
      _raise_bcoo_state(
        who,
        paths,
        "Use optax_sparse_adam.sparse_adam/sparse_adamw for Adam, "
        "sparse_multi_steps for gradient accumulation, or route the BCOO leaves "
        "away from it with optax.multi_transform.",
      )
    return inner.init(params)

  # Unannotated, as optax's own update functions: the returned transformation is the typed API.
  def update_fn(updates, state, params=None, **extra_args):
    lifted = _lift(updates, params, who)
    values = lifted.treedef.unflatten(lifted.values)
    inner_params = None if params is None else lifted.treedef.unflatten(lifted.params)
    new_values, new_state = inner.update(values, state, inner_params, **extra_args)
    out_leaves = flatten_up_to(
      lifted.treedef,
      new_values,
      lambda: (
        f"{who}: the wrapped transformation changed the updates' tree structure "
        f"from {lifted.treedef} to {jax.tree_util.tree_structure(new_values)}."
      ),
    )
    leaves_with_path, _ = flatten_grads(updates)
    out = []
    for (path, in_leaf), out_leaf, values_leaf, lifted_rows in zip(
      leaves_with_path, out_leaves, lifted.values, lifted.rows, strict=True
    ):
      if lifted_rows is None:
        out.append(out_leaf)
        continue
      layout, rows = lifted_rows
      if jnp.shape(out_leaf) != values_leaf.shape:
        raise ValueError(
          f"{who}: the wrapped transformation turned the rows of the BCOO "
          f"gradient at {path_str(path)} of shape {values_leaf.shape} into "
          f"{describe(out_leaf)}; only element-wise and norm-based "
          "transformations can be lifted."
        )
      valid = (rows < layout.num_rows).reshape((-1,) + (1,) * len(layout.dense_shape))
      # Padding slots stay zero whatever the wrapped transformation maps 0 to.
      data = jnp.where(valid, out_leaf, jnp.zeros((), jnp.result_type(out_leaf)))
      lifted_update = bcoo.rows_to_bcoo(bcoo.CoalescedRows(rows, data), layout)
      # A RowUpdate in (after an optimizer) gives a RowUpdate out; a gradient stays a BCOO.
      if isinstance(in_leaf, row_update.RowUpdate):
        lifted_update = row_update.seal(lifted_update)
      out.append(lifted_update)
    return lifted.treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def empty_updates_like(shapes: Any) -> Any:
  """Zero updates with the structure (and BCOO metadata) of `shapes`.

  A BCOO becomes all padding: zero data at distinct, sorted, out-of-range
  indices, which every consumer drops.
  """

  def empty(s: Any) -> Any:
    if s is None:
      return None
    if isinstance(s, sparse.BCOO):
      nse, n_sparse = s.indices.shape[-2:]
      leading = s.shape[s.n_batch] + jnp.arange(nse, dtype=s.indices.dtype)
      indices = jnp.zeros(s.indices.shape, s.indices.dtype).at[..., 0].set(leading)
      # Its own type: a RowUpdate stays one (its check made for the padding ids), and a
      # rule's set rows (`SetRowsUpdate`) stay set rows, all dropped.
      return type(s)(
        (
          _typed_like(jnp.zeros(s.data.shape, s.data.dtype), s.data),
          _typed_like(indices, s.indices),
        ),
        shape=s.shape,
        indices_sorted=s.indices_sorted,
        unique_indices=s.unique_indices,
      )
    return _typed_like(jnp.zeros(s.shape, s.dtype), s)

  return jax.tree.map(empty, shapes, is_leaf=is_grad_leaf)


def _typed_like(x: jax.Array, shape: Any) -> jax.Array:
  """`x` with the sharding in `shape`'s type under `Explicit` axes (a routed update is split)."""
  spec = getattr(getattr(shape, "sharding", None), "spec", None)
  if spec is None or not sharding.explicit_axes():
    return x
  return jax.sharding.reshard(x, spec)


def _all_finite(updates: Any, params: Any, who: str) -> jax.Array:
  """Whether the dense equivalent of `updates` is finite: BCOO padding is ignored."""
  leaves_with_path, treedef = flatten_grads(updates)
  checks = [jnp.array(True)]
  for (path, leaf), param in zip(
    leaves_with_path, leaves_up_to(treedef, params, "params"), strict=True
  ):
    if leaf is None:
      continue
    if isinstance(leaf, sparse.BCOO):
      layout = checked_row_layout(leaf, _param_shape(leaf, param), path, who)
      # A dense sum is non-finite exactly when one of its in-range terms is.
      indices = row_update.checked_indices(leaf, path, what="update")
      valid = bcoo.linear_rows(indices, layout) < layout.num_rows
      finite = jnp.isfinite(leaf.data)
      entry_finite = jnp.all(finite, axis=tuple(range(1, finite.ndim)))
      checks.append(jnp.all(entry_finite | ~valid))
    else:
      checks.append(jnp.all(jnp.isfinite(leaf)))
  return jnp.all(jnp.stack(checks))


def sparse_apply_if_finite(
  inner: optax.GradientTransformation, max_consecutive_errors: int
) -> optax.GradientTransformationExtraArgs:
  """`optax.apply_if_finite` for trees with BCOO gradients.

  Skips the step (zero updates, unchanged inner state) when a gradient is not
  finite, unless that happened more than `max_consecutive_errors` times in a
  row. A BCOO gradient is non-finite when an entry with an in-range index is
  (padding entries are ignored, as in the dense sum). A skipped step emits BCOO
  updates made only of padding, with the metadata `inner` would emit, so
  `optax.apply_if_finite`'s failure (`zeros_like` of a BCOO zeroes its indices)
  cannot happen. The state is `optax.ApplyIfFiniteState`.

  Args:
    inner: the transformation to guard, e.g. `sparse_adam(...)`.
    max_consecutive_errors: how many non-finite steps in a row are skipped.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> opt = osa.sparse_apply_if_finite(osa.sparse_adam(0.1), 3)
    >>> state = opt.init(jnp.zeros(4))
    >>> g = sparse.BCOO((jnp.array([jnp.nan]), jnp.array([[1]])), shape=(4,))
    >>> u, state = opt.update(g, state)
    >>> u.todense(), int(state.total_notfinite)
    (Array([0., 0., 0., 0.], dtype=float32), 1)
  """
  inner = optax.with_extra_args_support(inner)
  who = "sparse_apply_if_finite"

  def init_fn(params: optax.Params) -> optax.ApplyIfFiniteState:
    return optax.ApplyIfFiniteState(
      notfinite_count=jnp.zeros([], jnp.int32),
      last_finite=jnp.array(True, jnp.bool_),
      total_notfinite=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    is_finite = _all_finite(updates, params, who)
    notfinite_count = jnp.where(
      is_finite, jnp.zeros([], jnp.int32), optax.safe_increment(state.notfinite_count)
    )

    def do_update(operands):
      updates, inner_state, params, extra_args = operands
      return inner.update(updates, inner_state, params, **extra_args)

    operands = (updates, state.inner_state, params, extra_args)
    out_shapes, _ = jax.eval_shape(do_update, operands)

    def reject_update(operands):
      return empty_updates_like(out_shapes), operands[1]

    new_updates, new_inner_state = lax.cond(
      is_finite | (notfinite_count > max_consecutive_errors),
      do_update,
      reject_update,
      operands,
    )
    return new_updates, optax.ApplyIfFiniteState(
      notfinite_count=notfinite_count,
      last_finite=is_finite,
      total_notfinite=jnp.where(
        is_finite, state.total_notfinite, optax.safe_increment(state.total_notfinite)
      ),
      inner_state=new_inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def on_dense_shapes(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """Wraps a mask or label function so that it sees params and BCOO gradients alike.

  `optax.masked` and `optax.multi_transform` call a callable `mask`/`labels` on the
  params at `init` and on the gradients at `update`. A function that maps over its tree
  (`jax.tree.map(lambda x: x.ndim > 1, tree)`) then maps into a BCOO gradient's
  `data` and `indices` and returns another tree than it did for the params, which optax
  reports as a pytree structure error. The wrapped function is called on the tree's
  shapes instead: every array and every BCOO leaf becomes a `jax.ShapeDtypeStruct` of
  the dense leaf's shape and dtype, so it gives one tree for both.

  Args:
    fn: a function from a tree of parameters (or their shapes) to a tree of masks or
      labels. It may read each leaf's `shape`, `ndim`, `size` and `dtype`, not its values.

  Returns:
    The function to give to `optax.masked` or `optax.multi_transform`.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.experimental import sparse
    >>> import optax_sparse_adam as osa
    >>> params = {"table": jnp.zeros((8, 2)), "bias": jnp.zeros(2)}
    >>> is_table = osa.on_dense_shapes(lambda p: jax.tree.map(lambda x: x.ndim == 2, p))
    >>> opt = optax.masked(osa.sparse_adam(0.1), is_table)
    >>> grads = {"table": sparse.BCOO((jnp.ones((1, 2)), jnp.array([[3]])), shape=(8, 2)),
    ...          "bias": jnp.ones(2)}
    >>> updates, _ = opt.update(grads, opt.init(params), params)
    >>> [round(x, 4) for x in osa.apply_updates(params, updates)["table"][3].tolist()]
    [-0.1, -0.1]
  """

  def on_shapes(tree: Any) -> Any:
    shapes = jax.tree.map(
      lambda x: x if x is None else jax.ShapeDtypeStruct(jnp.shape(x), _dtype_of(x)),
      tree,
      is_leaf=is_grad_leaf,
    )
    return fn(shapes)

  return on_shapes


def _dtype_of(x: Any) -> Any:
  return x.dtype if isinstance(x, sparse.BCOO) else jnp.result_type(x)
