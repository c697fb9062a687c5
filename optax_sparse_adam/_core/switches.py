"""Trace-time switches in JAX's cache keys: one `jax.make_user_context` per set of switches.

A switch's value is part of the key of JAX's trace, lowering and compilation
caches, so a function traced after a switch changes is traced again, even one
traced before under a fresh `jax.jit` (what `jax.export` does).
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import jax

Switches = TypeVar("Switches", bound=NamedTuple)


class Switch(Generic[Switches]):
  """A NamedTuple of switches, read with `current()` and changed in a `choose` block."""

  def __init__(self, default: Switches, check: Callable[[Switches], None]) -> None:
    self._context = jax.make_user_context(default)
    self._check = check

  def current(self) -> Switches:
    """The switches in force now."""
    return self._context.value

  def set_default(self, **changes: Any) -> None:
    """Changes the switches in force outside every `choose` block (a new cache key)."""
    self._context.set_global(self._context.get_global()._replace(**changes))

  @contextlib.contextmanager
  def choose(self, **changes: Any) -> Iterator[None]:
    """Within this block, steps traced use `current()` with `changes`, checked first."""
    choice = self.current()._replace(**changes)
    self._check(choice)
    with self._context(choice):
      yield
