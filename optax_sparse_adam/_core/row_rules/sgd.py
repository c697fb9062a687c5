"""The SGD rule: torch.optim.SGD's arithmetic on a block of coalesced rows.

`SGDRule` keeps no state without momentum; with it, one slot `momentum_buffer`
(the parameter's shape). On the touched rows r, with `g` the coalesced gradient
(maximize and weight decay are the pipeline's, `rules`),

  buf[r] = m * buf[r] + (1 - d) * g          (with momentum)
  delta[r] = -lr * g                           (no momentum)
           = -lr * buf[r]                      (momentum)
           = -lr * (g + m * buf[r])            (momentum, nesterov)

Without momentum this is `torch.optim.SGD` on a sparse gradient. With momentum it
is the *lazy* (row-wise) form: a row's buffer decays only when the row is
touched. torch's SGD keeps moving every row it ever buffered on every step (its
sparse buffer decays all its rows), which is dense in the end; the optax and
torch front ends refuse momentum unless asked for the lazy form by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from optax_sparse_adam._core.row_rules.adam import block_arithmetic
from optax_sparse_adam._core.rules import RowBlock, Slot


class SGDHyperparams(NamedTuple):
  """The traced hyper-parameters of an SGD step (floats or 0-d arrays).

  Attributes:
    learning_rate: the step size.
    momentum: the buffer's decay `m` (read with a momentum buffer only).
    dampening: `d`, the gradient's weight `1 - d` in the buffer.
    weight_decay: the pipeline's weight-decay rate, or None.
  """

  learning_rate: Any
  momentum: Any = 0.0
  dampening: Any = 0.0
  weight_decay: Any = None


@dataclasses.dataclass(frozen=True)
class SGDRule:
  """torch.optim.SGD's row rule, with an optional lazy momentum buffer (module docstring).

  Attributes:
    momentum: keep `momentum_buffer`, a full-width slot.
    nesterov: step along `g + m * buf` instead of `buf` (with momentum).
  """

  momentum: bool = False
  nesterov: bool = False
  name: str = dataclasses.field(default="sgd", init=False)

  def slots(self) -> tuple[Slot, ...]:
    return (Slot("momentum_buffer"),) if self.momentum else ()

  def update(self, block: RowBlock, hyper: SGDHyperparams) -> tuple[jax.Array, dict[str, Any]]:
    """The delta (and the new buffer rows) of `n` rows; see `rules.RowRule.update`."""
    c, r, store = block_arithmetic(block)
    g = block.grad.astype(block.compute_dtype)
    if not self.momentum:
      return r(-c(hyper.learning_rate) * g), {}
    old = block.slots["momentum_buffer"].astype(block.compute_dtype)
    m = c(hyper.momentum)
    buf = store("momentum_buffer", r(old * m) + r(g * c(1.0 - hyper.dampening)))
    direction = buf.astype(block.compute_dtype)
    if self.nesterov:
      direction = g + r(direction * m)
    return r(-c(hyper.learning_rate) * direction), {"momentum_buffer": buf}
