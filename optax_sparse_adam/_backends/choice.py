"""The switches that choose a step's path (`dispatch` reads them), as JAX sees them.

The switches are a `jax.make_user_context`: their value is part of the key of
JAX's trace, lowering and compilation caches, so a function traced after a
switch changes is traced again, even one that was traced before under a fresh
`jax.jit` (what `jax.export` does).
"""

import os
from typing import NamedTuple

from optax_sparse_adam._core.switches import Switch

ACCELERATOR = "accelerator"
GENERIC_XLA = "generic_xla"
# On the CPU, the generic kernels for every rule (no hand-fused kernel); elsewhere as None.
GENERIC_KERNELS = "generic_kernels"
_PATHS = (ACCELERATOR, GENERIC_XLA, GENERIC_KERNELS)
_ENV_FLAG = "OPTAX_SPARSE_ADAM_CPU_KERNELS"


class PathChoice(NamedTuple):
  """The switches in force while a step is traced (hashable: part of JAX's cache keys).

  Attributes:
    cpu_kernels: use the fused CPU kernels where they apply; None follows
      `OPTAX_SPARSE_ADAM_CPU_KERNELS` (default on).
    forced: private, for tests and benchmarks: `ACCELERATOR` or `GENERIC_XLA`
      runs that rows step on every backend, the CPU included; `GENERIC_KERNELS`
      runs every rule on the CPU's generic kernels (no hand-fused kernel); None
      picks by backend.
    batch_tables: private, for tests and benchmarks: where the accelerator step
      runs, step the sparse tables of one update through one sort
      (`table_batched`); False: each table through its own.
    row_program: private, for tests and benchmarks: run a rule without a fused
      kernel on the row program where it applies (`cpu/row_program.py`); False:
      on the generic kernels around its math in XLA ops.
  """

  cpu_kernels: bool | None = None
  forced: str | None = None
  batch_tables: bool = True
  row_program: bool = True


def _check(choice: PathChoice) -> None:
  if choice.forced not in (None, *_PATHS):
    raise ValueError(f"forced path {choice.forced!r}; expected one of {_PATHS} or None")
  if not isinstance(choice.batch_tables, bool):
    raise TypeError(f"batch_tables must be a bool, got {choice.batch_tables!r}")
  if not isinstance(choice.row_program, bool):
    raise TypeError(f"row_program must be a bool, got {choice.row_program!r}")


_SWITCH = Switch(PathChoice(), _check)
# The switches in force now; within a `choose(**changes)` block, steps traced use them changed.
current = _SWITCH.current
choose = _SWITCH.choose


def forced() -> str | None:
  """The rows step forced onto every backend (`ACCELERATOR`, `GENERIC_XLA`), or None."""
  path = current().forced
  return None if path == GENERIC_KERNELS else path


def fused_kernels_wanted() -> bool:
  """Whether a rule's hand-fused CPU kernel may run (not forced onto the generic kernels)."""
  return current().forced != GENERIC_KERNELS


def cpu_kernels_wanted() -> bool:
  """Whether the switches ask for the CPU kernels (they may still not apply)."""
  choice = current()
  if forced() is not None:
    return False
  if choice.cpu_kernels is not None:
    return choice.cpu_kernels
  return os.environ.get(_ENV_FLAG, "1") != "0"
