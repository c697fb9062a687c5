"""A rule written outside the package: the architecture page's row-wise Adagrad.

Shared by `bench_rules` (its speed against the default Adam step) and the tests
(`tests/backends/test_row_store.py`, `test_generic_kernels.py`,
`test_row_sum_program.py`): what a user brings, with no kernel of its own. Its
row mean is `osa.row_sum` of the squares (rounded where they stand) divided by the row's
size (`jnp.mean` would keep it on the generic path: `UserMeanRowwiseAdagrad`), so its
CPU step runs on the row program.
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
    squares = osa.row_sum(g * g, opaque_zero=block.opaque_zero)  # (n,): the fast path's sum
    total = block.slots["sum"] + squares / g.shape[1]
    rate = hyper.learning_rate / (jnp.sqrt(total) + hyper.eps)
    return -rate[:, None] * g, {"sum": total.astype(block.slots["sum"].dtype)}


@dataclasses.dataclass(frozen=True)
class UserMeanRowwiseAdagrad:
  """The same rule with `jnp.mean` over the row: it runs, on the generic path."""

  name: str = dataclasses.field(default="user_mean_rowwise_adagrad", init=False)

  def slots(self):
    return (osa.Slot("sum", per_row=True),)

  def update(self, block, hyper):
    g = block.grad
    total = block.slots["sum"] + jnp.mean(g * g, axis=1)
    rate = hyper.learning_rate / (jnp.sqrt(total) + hyper.eps)
    return -rate[:, None] * g, {"sum": total.astype(block.slots["sum"].dtype)}
