"""Paths, descriptions and tree-structure checks: how every error names the offending leaf.

The rules that several modules share live here once: what a gradient leaf is
(a BCOO, a dense array or None), what counts as a Python number, and how a
tree whose structure differs from the gradients' is reported.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental import sparse


def path_str(path: Sequence[Any]) -> str:
  """Renders a pytree key path the way users index it, e.g. `['embed']['table']`."""
  text = jax.tree_util.keystr(tuple(path))
  return text if text else "<root>"


def describe(x: Any) -> str:
  """A short description of a leaf for error messages: its type, shape and dtype."""
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None:
    return type(x).__name__
  return f"{type(x).__name__}(shape={tuple(shape)}, dtype={dtype})"


def is_python_number(x: Any) -> bool:
  """An int or float (not a bool): a hyper-parameter known at trace time."""
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_grad_leaf(x: Any) -> bool:
  """Gradient trees stop at a BCOO (not its data and indices) and at None (no gradient)."""
  return x is None or isinstance(x, sparse.BCOO)


def flatten_grads(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
  """`(path, leaf)` pairs and the treedef of a gradient tree, BCOO and None as leaves."""
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_grad_leaf)


def path_difference(
  paths: Sequence[Any], tree: Any, what: str, *, first: str = "gradients", limit: int = 5
) -> str:
  """Names the leaf paths found in only one of `paths` (the `first`'s) and `tree`, if any."""
  grad_paths = [path_str(p) for p in paths]
  tree_paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  only_grads = [p for p in grad_paths if p not in set(tree_paths)][:limit]
  only_tree = [p for p in tree_paths if p not in set(grad_paths)][:limit]
  parts = []
  if only_grads:
    parts.append(f"only in the {first}: {', '.join(only_grads)}")
  if only_tree:
    parts.append(f"only in the {what}: {', '.join(only_tree)}")
  return f" ({'; '.join(parts)})" if parts else ""


def flatten_up_to(treedef: Any, tree: Any, mismatch: Callable[[], str]) -> list[Any]:
  """`treedef.flatten_up_to(tree)`: a `ValueError` saying `mismatch()` if `tree` does not fit.

  `treedef` is typed `Any`: jaxlib ships no type stub for `PyTreeDef`, so its methods are
  unknown to a type checker.
  """
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as err:
    raise ValueError(mismatch()) from err


def leaves_up_to(
  treedef: Any, tree: Any, what: str, paths: Sequence[Any] | None = None
) -> list[Any]:
  """The leaves of `tree` at the gradient leaves' positions; refuses other structures.

  `flatten_up_to` accepts a subtree where the gradient has a leaf; that is a
  structure mismatch too, reported with the gradient leaf's path.

  Args:
    treedef: the gradient tree's structure (`flatten_grads`).
    tree: the tree to read (params, a state field), or None for no tree.
    what: how the message names `tree` ("params", "optimizer state").
    paths: the gradient leaves' paths, to name the leaves found on one side only.

  Returns:
    One leaf of `tree` per gradient leaf (all None when `tree` is None).
  """
  if tree is None:
    return [None] * treedef.num_leaves
  leaves = flatten_up_to(
    treedef,
    tree,
    lambda: (
      f"The gradient tree's structure differs from the {what}'s"
      f"{'' if paths is None else path_difference(paths, tree, what)}. Gradients: "
      f"{treedef}; {what}: "
      f"{jax.tree_util.tree_structure(tree)}. Pass gradients with the structure of "
      "the params given to init."
    ),
  )
  for path, leaf in zip(paths or [()] * len(leaves), leaves, strict=True):
    if leaf is not None and not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(leaf)):
      raise ValueError(
        f"The gradient tree's structure differs from the {what}'s: the gradient "
        f"at {path_str(path)} is a single leaf, but the {what} holds a subtree "
        f"{jax.tree_util.tree_structure(leaf)} there. Pass gradients with the "
        "structure of the params given to init."
      )
  return leaves
