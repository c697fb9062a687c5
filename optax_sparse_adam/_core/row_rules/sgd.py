"""The SGD rule: torch.optim.SGD's arithmetic on a block of coalesced rows.

`SGDRule` keeps no state without momentum; with it, one slot `momentum_buffer`
(the parameter's shape). On the touched rows r, with `g` the coalesced gradient
(maximize and weight decay are the pipeline's, `rules`),

  buf[r] = m * buf[r] + (1 - d) * g          (with momentum; `g` at the first step)
  delta[r] = -lr * g                           (no momentum)
           = -lr * buf[r]                      (momentum)
           = -lr * (g + m * buf[r])            (momentum, nesterov)

Without momentum this is `torch.optim.SGD` on a sparse gradient. With momentum
it is torch's arithmetic on the touched rows (torch's buffer is the gradient
itself at the parameter's first step: no dampening then). torch's SGD also
moves every row it ever buffered on every step (its sparse buffer decays all
its rows, and the parameter steps along it): an idle row `k` steps after its
last update has moved by

  buf * (m + m^2 + ... + m^k)        (times m with nesterov: the step is g + m * buf, g = 0)

times `-lr`, and its buffer is `m^k buf`. `catch_up` declares that closed form
(a geometric sum, exact for any `k`, `m = 1` and `m = 0` included), so that the
pipeline takes it before a row's step (catch-up of idle rows): torch's
numbers at sparse cost. Without catch-up the buffer is lazy (a row's buffer
decays and moves only when the row is touched).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._core import rules
from optax_sparse_adam._core.catch_up import _pow, decayed_sum
from optax_sparse_adam._core.row_rules.adam import block_arithmetic
from optax_sparse_adam._core.rules import RowBlock, Slot


class SGDHyperparams(NamedTuple):
  """The traced hyper-parameters of an SGD step (floats or 0-d arrays).

  Attributes:
    learning_rate: the step size.
    momentum: the buffer's decay `m` (read with a momentum buffer only).
    dampening: `d`, the gradient's weight `1 - d` in the buffer.
    weight_decay: the pipeline's weight-decay rate, or None.
    window_learning_rate: the rate charged to a row's idle steps by catch-up (a
      schedule's at the last idle step, as Adam's); None: `learning_rate`.
  """

  learning_rate: Any
  momentum: Any = 0.0
  dampening: Any = 0.0
  weight_decay: Any = None
  window_learning_rate: Any = None


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

  def catch_up(self, config: rules.StepConfig) -> rules.CatchUp:
    """Idle rows stay without momentum; with it, the buffer's discharge (module docstring)."""
    if config.weight_decay != "none":
      return rules.CatchUp(
        refused="under weight decay dense SGD moves idle rows by the decay too (fed into "
        "the momentum buffer), which has no closed form here"
      )
    return rules.CatchUp(rows=self.idle_rows) if self.momentum else rules.STILL

  def idle_rows(self, block: rules.IdleBlock, hyper: SGDHyperparams) -> rules.CaughtUp:
    """The buffer `m^k buf` and the move `-lr buf sum_{j=1..k} m^j` (nesterov: times `m`)."""

    def c(x: Any) -> jax.Array:
      return jnp.asarray(x, block.compute_dtype)

    k = block.idle.astype(block.compute_dtype)
    m = c(hyper.momentum)
    log_m = jnp.log(m)  # -inf at m = 0: no move, the buffer 0 after a step
    lr = hyper.learning_rate if hyper.window_learning_rate is None else hyper.window_learning_rate
    old = block.slots["momentum_buffer"]
    buf = old.astype(block.compute_dtype)
    discharge = decayed_sum(log_m, c(0.0), k)  # m + ... + m^k, k at m = 1, 0 at k = 0
    if self.nesterov:
      discharge = discharge * m
    decayed = (buf * _pow(log_m, k)).astype(old.dtype)
    return rules.CaughtUp({"momentum_buffer": decayed}, -c(lr) * discharge * buf, None)

  def update(self, block: RowBlock, hyper: SGDHyperparams) -> tuple[jax.Array, dict[str, Any]]:
    """The delta (and the new buffer rows) of `n` rows; see `rules.RowRule.update`."""
    c, r, store = block_arithmetic(block)
    g = block.grad.astype(block.compute_dtype)
    if not self.momentum:
      return r(-c(hyper.learning_rate) * g), {}
    old = block.slots["momentum_buffer"].astype(block.compute_dtype)
    m = c(hyper.momentum)
    weight = gradient_weight(hyper, block.step, block.compute_dtype)
    buf = store("momentum_buffer", r(old * m) + r(g * weight))
    direction = buf.astype(block.compute_dtype)
    if self.nesterov:
      direction = g + r(direction * m)
    return r(-c(hyper.learning_rate) * direction), {"momentum_buffer": buf}


def gradient_weight(hyper: SGDHyperparams, step: Any, dtype: Any) -> jax.Array:
  """The gradient's weight in the momentum buffer: `1 - dampening`, or 1 at the first
  step, where torch's buffer starts as the gradient itself (no dampening).

  One place for the CPU kernel (`rule_steps`) and `SGDRule.update` to read it.
  """
  weight = jnp.asarray(1.0 - hyper.dampening, dtype)
  if step is not None:
    weight = jnp.where(jnp.asarray(step) == 1, jnp.asarray(1.0, dtype), weight)
  return weight
