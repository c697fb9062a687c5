"""Opt-in runtime checks of BCOO gradients, for `jax.experimental.checkify`.

`sparse_adam` cannot raise on values inside `jax.jit`, so it treats entries with
out-of-range indices as BCOO padding and lets NaN flow into the touched rows, as
`torch.optim.SparseAdam` does. These checks report both, with counts and the
leaf's path, when asked; they are kept out of the default transform.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import optax
from jax.experimental import checkify, sparse

from optax_sparse_adam._core import bcoo
from optax_sparse_adam._core.errors import flatten_grads, leaves_up_to, path_str


def _format_safe(text: str) -> str:
  # `checkify.check` formats its message: braces in a dict key must not be read as fields.
  return text.replace("{", "{{").replace("}", "}}")


def _check_leaf(
  grad: sparse.BCOO,
  param_shape: Sequence[int],
  path: Sequence[Any],
  *,
  allow_padding: bool,
  check_finite: bool,
) -> None:
  layout = bcoo.row_layout(grad, param_shape, path)
  where = _format_safe(path_str(path))
  nse = grad.nse
  if nse == 0:
    return
  in_range = bcoo.linear_rows(grad.indices, layout) < layout.num_rows
  entry_axes = tuple(range(1, grad.data.ndim))
  out_of_range = ~in_range
  if allow_padding:
    # Padding carries no gradient: only out-of-range entries holding a nonzero
    # (or NaN) value lose part of the gradient.
    out_of_range &= jnp.any(grad.data != 0, axis=entry_axes)
  shape_text = _format_safe(str(layout.sparse_shape))
  checkify.check(
    ~jnp.any(out_of_range),
    f"Sparse gradient at {where}: {{count}} of {nse} entries have out-of-range indices "
    f"(negative, or not below the sparse shape {shape_text})"
    + (" and nonzero values" if allow_padding else "")
    + "; the first is entry {first}. sparse_adam ignores such entries as BCOO "
    "padding, so their gradient is lost.",
    count=jnp.sum(out_of_range, dtype=jnp.int32),
    first=jnp.argmax(out_of_range),
  )
  if check_finite:
    non_finite = in_range & ~jnp.all(jnp.isfinite(grad.data), axis=entry_axes)
    checkify.check(
      ~jnp.any(non_finite),
      f"Sparse gradient at {where}: {{count}} of {nse} entries hold NaN or Inf; the "
      "first is entry {first}. sparse_adam would write NaN into the touched rows of "
      "the parameter and its moments (torch's behaviour); skip such steps with "
      "optax.apply_if_finite.",
      count=jnp.sum(non_finite, dtype=jnp.int32),
      first=jnp.argmax(non_finite),
    )


def check_sparse_grads(
  grads: optax.Updates,
  params: optax.Params | None = None,
  *,
  allow_padding: bool = True,
  check_finite: bool = True,
) -> None:
  """Reports out-of-range indices and non-finite values of BCOO gradients, via checkify.

  For every BCOO leaf of `grads`, checks with `jax.experimental.checkify.check`
  that no entry has an index outside the sparse shape (negative, or too large)
  and, with `check_finite`, that no in-range entry holds NaN or Inf. Failures
  name the leaf's pytree path, count the offending entries and give the first.
  Dense and None leaves are skipped. Static problems (shape or structure
  mismatches, n_batch > 0, float indices) raise at once, as in `sparse_adam`.

  Outside `jax.jit` a failed check raises `checkify.JaxRuntimeError` at once;
  inside `jax.jit`, functionalize the function with `checkify.checkify` and call
  `.throw()` on the returned error.

  Args:
    grads: a tree of gradients, with BCOO, array or None leaves.
    params: the parameters, of the same tree structure; if given, each BCOO
      leaf's shape must match its parameter's.
    allow_padding: accept out-of-range entries whose values are all zero, the
      padding that `BCOO.sum_duplicates(nse=...)` writes; if False, report every
      out-of-range entry.
    check_finite: also report in-range entries holding NaN or Inf.

  Returns:
    None; the checks are recorded for `checkify`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import checkify, sparse
    >>> import optax_sparse_adam as osa
    >>> grad = sparse.BCOO((jnp.ones((2, 3)), jnp.array([[1], [9]])), shape=(5, 3))
    >>> checked = checkify.checkify(jax.jit(osa.check_sparse_grads))
    >>> err, _ = checked({"table": grad})
    >>> print(err.get().split(" (negative")[0])
    Sparse gradient at ['table']: 1 of 2 entries have out-of-range indices
  """
  grads_with_path, treedef = flatten_grads(grads)
  if params is None:
    param_leaves = [getattr(g, "shape", None) for _, g in grads_with_path]
  else:
    paths = [path for path, _ in grads_with_path]
    param_leaves = [
      None if p is None else jnp.shape(p) for p in leaves_up_to(treedef, params, "params", paths)
    ]
  for (path, grad), param_shape in zip(grads_with_path, param_leaves, strict=True):
    if isinstance(grad, sparse.BCOO):
      _check_leaf(
        grad,
        grad.shape if param_shape is None else param_shape,
        path,
        allow_padding=allow_padding,
        check_finite=check_finite,
      )


def sparse_grad_checks(
  *, allow_padding: bool = True, check_finite: bool = True
) -> optax.GradientTransformationExtraArgs:
  """An identity transformation that runs `check_sparse_grads` on the gradients.

  Chain it in front of `sparse_adam` while debugging, and functionalize the
  training step with `jax.experimental.checkify.checkify`; remove it for
  production runs. Its state is `optax.EmptyState`.

  Args:
    allow_padding: accept all-zero out-of-range entries as BCOO padding.
    check_finite: also report in-range entries holding NaN or Inf.

  Returns:
    An `optax.GradientTransformationExtraArgs` that returns the gradients
    unchanged (and ignores extra keyword arguments of `update`).

  Example:
    >>> import optax, optax_sparse_adam as osa
    >>> opt = optax.chain(osa.sparse_grad_checks(), osa.sparse_adam(1e-3))
  """

  def init_fn(params: optax.Params) -> optax.EmptyState:
    del params
    return optax.EmptyState()

  def update_fn(
    updates: optax.Updates,
    state: optax.EmptyState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, optax.EmptyState]:
    del extra_args
    check_sparse_grads(updates, params, allow_padding=allow_padding, check_finite=check_finite)
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
