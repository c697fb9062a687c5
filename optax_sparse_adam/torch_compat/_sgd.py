"""`SGD`: `torch.optim.SGD` on sparse gradients, over JAX arrays (a `RuleOptimizer` table)."""

from typing import Any

import numpy as np

from optax_sparse_adam._core import rules
from optax_sparse_adam._core.hyperparams import check_nonnegative
from optax_sparse_adam._core.row_rules.sgd import SGDHyperparams, SGDRule
from optax_sparse_adam.torch_compat import _step
from optax_sparse_adam.torch_compat._rule_optimizer import RuleOptimizer, TorchRule


def _refuse_momentum(group: dict[str, Any], where: str, why: str) -> None:
  """Refuses a nonzero momentum before any change, saying `why` after the group's value."""
  if _step.lr_value(group["momentum"], f"{where}['momentum']") != 0:
    raise RuntimeError(f"{where} has momentum={group['momentum']!r}: {why}")


def _check_momentum(group: dict[str, Any], where: str) -> None:
  """torch runs momentum densely on sparse gradients: refused."""
  _refuse_momentum(
    group,
    where,
    "torch.optim.SGD's momentum is not lazy on sparse gradients (its buffer moves every row "
    "it ever saw on every step), which this adapter does not do. Use "
    "optax_sparse_adam.sparse_sgd(momentum=..., catch_up_idle_rows=True) for torch's numbers "
    "at sparse cost, sparse_sgd(momentum=..., lazy_momentum=True) for a row-wise momentum, "
    "or momentum=0.",
  )


def _check_dense_momentum(group: dict[str, Any], where: str) -> None:
  """Momentum on dense gradients is torch's, but this adapter keeps no buffer: refused."""
  _refuse_momentum(
    group,
    where,
    "this adapter keeps no momentum buffer, for dense gradients either. Use "
    "optax_sparse_adam.sparse_sgd(momentum=...), which steps dense gradients with "
    "torch.optim.SGD's momentum, or momentum=0.",
  )


def _hyper(group: dict[str, Any], step: int, dtype: Any) -> SGDHyperparams:
  del step
  lr = _step.lr_value(group["lr"], "lr")
  wd = float(_step.lr_value(group["weight_decay"], "weight_decay"))
  return SGDHyperparams(
    learning_rate=np.asarray(lr, np.float64).astype(dtype),
    weight_decay=np.asarray(wd, np.float64).astype(dtype),
  )


def _plan(group: dict[str, Any], dense: bool) -> tuple[SGDRule, rules.StepConfig]:
  """torch's L2 decay on dense gradients (refused on sparse ones, `refusals`)."""
  decays = dense and float(_step.lr_value(group["weight_decay"], "weight_decay")) != 0
  return SGDRule(), rules.StepConfig(
    maximize=bool(group["maximize"]), weight_decay="l2" if decays else "none"
  )


_TABLE = TorchRule(
  torch_name="SGD",
  slots={},
  step_key=None,
  step_type=int,
  eager_state=False,
  refusals={
    "fused": "`_fused_sgd` does not support sparse gradients ({where} has fused=True)",
    "weight_decay": "add(sparse, dense) is not supported. Use add(dense, sparse) instead. "
    "({where} has weight_decay={value!r}: torch.optim.SGD refuses weight decay with sparse "
    "gradients, as it would move every row. For a decay of the touched rows only, use "
    "optax_sparse_adam.sparse_rowwise_adagrad(weight_decay_mode=...) or sparse_adamw.)",
  },
  check_group=_check_momentum,
  check_dense=_check_dense_momentum,
  plan=_plan,
  hyper=_hyper,
  slot_init=lambda group, slot: 0.0,
)


class SGD(RuleOptimizer):
  r"""`torch.optim.SGD` for `Parameter`s holding JAX arrays, with BCOO or dense gradients.

  For each parameter with a BCOO gradient, with :math:`g` the gradient with
  duplicate indices summed and :math:`r` the rows it touches,
  :math:`\theta_r \leftarrow \theta_r - \alpha g_r` (ascending with `maximize`),
  and nothing else changes: torch's SGD on a sparse gradient. It keeps no
  state. torch applies an uncoalesced gradient entry by entry: a row with
  duplicate ids then differs from torch's in the last bits. A dense gradient
  (a `jax.Array`, as an MLP's) steps every element as torch's dense SGD, L2
  `weight_decay` included: one `SGD(model_params)` serves a whole model.

  Options torch refuses with sparse gradients (`weight_decay`, `fused=True`)
  are refused with torch's words at `step()`, before anything changes, and so is
  `momentum`, which torch runs densely on sparse gradients (see
  `optax_sparse_adam.sparse_sgd(momentum=..., catch_up_idle_rows=True)`, which
  is torch's momentum at sparse cost). Momentum is refused for dense gradients
  too (this adapter keeps no buffer; `sparse_sgd(momentum=...)` steps dense
  gradients with it).

  Args:
    params: an iterable of `Parameter`s, of `(name, Parameter)` pairs, or of
      param-group dicts.
    lr: learning rate.
    momentum: must be 0 at `step()` (see above).
    dampening: no effect without momentum (as in torch).
    weight_decay: L2 decay of dense gradients; must be 0 at `step()` for a group
      with a sparse gradient (torch raises).
    nesterov: needs momentum (torch's constructor check).
    maximize: ascend the objective instead of descending it.
    foreach: accepted, no effect (torch's sparse path ignores it too).
    differentiable: accepted, no effect.
    fused: must not be True at `step()` (torch raises).
    param_rounding: "nearest" (the default, torch's) or "stochastic": how the new
      rows of a bfloat16 or float16 `Parameter` are rounded. SGD keeps no step:
      "stochastic" keys its bits on a `param_rounding_step` kept per parameter.
      The optimizer's option, not a group's: pass it again when you rebuild the
      optimizer (docs/memory.md, 16-bit tables that learn).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam.torch_compat as tc
    >>> from jax.experimental.sparse import BCOO
    >>> table = tc.Parameter(jnp.ones((4, 2)))
    >>> table.grad = BCOO((jnp.ones((2, 2)), jnp.array([[2], [2]])), shape=(4, 2))  # id 2 twice
    >>> tc.SGD([table], lr=0.25).step()
    >>> table.data[2]
    Array([0.5, 0.5], dtype=float32)

  References:
    `torch.optim.SGD`, https://pytorch.org/docs/stable/generated/torch.optim.SGD.html
  """

  TABLE = _TABLE

  def __init__(
    self,
    params: Any,
    lr: Any = 1e-3,
    momentum: float = 0,
    dampening: float = 0,
    weight_decay: float = 0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    differentiable: bool = False,
    fused: bool | None = None,
    param_rounding: str = "nearest",
  ) -> None:
    # torch's constructor checks, in its order and wording.
    check_nonnegative(
      ("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay), every_value=True
    )
    if nesterov and (momentum <= 0 or dampening != 0):
      raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    super().__init__(params, locals())
