"""The switches that choose a step's path (`dispatch` reads them), as JAX sees them.

The switches are a `jax.make_user_context`: their value is part of the key of
JAX's trace, lowering and compilation caches, so a function traced after a
switch changes is traced again, even one that was traced before under a fresh
`jax.jit` (what `jax.export` does).
"""

import contextlib
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

ACCELERATOR = "accelerator"
GENERIC_XLA = "generic_xla"
_PATHS = (ACCELERATOR, GENERIC_XLA)
_ENV_FLAG = "OPTAX_SPARSE_ADAM_CPU_KERNELS"


class PathChoice(NamedTuple):
  """The switches in force while a step is traced (hashable: part of JAX's cache keys).

  Attributes:
    cpu_kernels: use the fused CPU kernels where they apply; None follows
      `OPTAX_SPARSE_ADAM_CPU_KERNELS` (default on).
    forced: private, for tests and benchmarks: `ACCELERATOR` or `GENERIC_XLA`
      runs that rows step on every backend, the CPU included; None picks by
      backend.
  """

  cpu_kernels: bool | None = None
  forced: str | None = None


_CHOICE = jax.make_user_context(PathChoice())


def current() -> PathChoice:
  """The switches in force now."""
  return _CHOICE.value


@contextlib.contextmanager
def choose(**changes: Any) -> Iterator[None]:
  """Within this block, steps traced use `current()` with `changes` (fields of `PathChoice`)."""
  choice = current()._replace(**changes)
  if choice.forced not in (None, *_PATHS):
    raise ValueError(f"forced path {choice.forced!r}; expected one of {_PATHS} or None")
  with _CHOICE(choice):
    yield


def forced() -> str | None:
  """The rows step forced onto every backend (`ACCELERATOR`, `GENERIC_XLA`), or None."""
  return current().forced


def cpu_kernels_wanted() -> bool:
  """Whether the switches ask for the CPU kernels (they may still not apply)."""
  choice = current()
  if choice.forced is not None:
    return False
  if choice.cpu_kernels is not None:
    return choice.cpu_kernels
  return os.environ.get(_ENV_FLAG, "1") != "0"
