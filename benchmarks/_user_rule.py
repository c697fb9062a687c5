"""A rule written outside the package: the architecture page's row-wise Adagrad.

Shared by `bench_rules` (its speed on the generic kernels) and the tests of the
generic kernels (`tests/backends/test_row_store.py`, `test_generic_kernels.py`):
what a user brings, with no kernel of its own.
"""

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

import optax_sparse_adam as osa


class UserHyper(NamedTuple):
  learning_rate: Any
  eps: Any = 1e-8
  weight_decay: Any = None  # read by the pipeline's weight decay


@dataclasses.dataclass(frozen=True)
class UserRowwiseAdagrad:
  """docs/architecture.md's rule: one accumulator per row, no kernel of its own."""

  name: str = dataclasses.field(default="user_rowwise_adagrad", init=False)

  def slots(self):
    return (osa.Slot("sum", per_row=True),)

  def update(self, block, hyper):
    g = block.grad
    total = block.slots["sum"] + jnp.mean(g * g, axis=1)
    rate = hyper.learning_rate / (jnp.sqrt(total) + hyper.eps)
    return -rate[:, None] * g, {"sum": total.astype(block.slots["sum"].dtype)}
