"""Removable hook handles with torch's semantics, without importing torch."""

import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

_next_id = itertools.count()


class RemovableHandle:
  """Removes one registered hook: `remove()` is idempotent; a context manager removes on exit.

  Like `torch.utils.hooks.RemovableHandle`, it holds its hooks dict weakly, so a
  handle never keeps an optimizer alive.
  """

  def __init__(self, hooks: OrderedDict) -> None:
    self._hooks_ref = weakref.ref(hooks)
    self.id = next(_next_id)

  def remove(self) -> None:
    hooks = self._hooks_ref()
    if hooks is not None:
      hooks.pop(self.id, None)

  def __enter__(self) -> "RemovableHandle":
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.remove()

  def __repr__(self) -> str:
    return f"RemovableHandle(id={self.id})"


def register(hooks: OrderedDict, hook: Callable, *, prepend: bool = False) -> RemovableHandle:
  """Adds `hook` to `hooks`, first when `prepend` else last, and returns its handle."""
  if not callable(hook):
    raise TypeError(f"hook must be callable, but got {type(hook).__name__}")
  handle = RemovableHandle(hooks)
  hooks[handle.id] = hook
  if prepend:
    hooks.move_to_end(handle.id, last=False)
  return handle
