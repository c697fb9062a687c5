"""Error messages that name the offending leaf by its pytree path."""

from collections.abc import Sequence
from typing import Any

import jax


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
