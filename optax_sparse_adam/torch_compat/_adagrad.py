"""`Adagrad`: `torch.optim.Adagrad` on sparse gradients over JAX arrays (a `TorchRule` table)."""

from typing import Any

import numpy as np

from optax_sparse_adam._core import rules
from optax_sparse_adam._core.hyperparams import check_nonnegative
from optax_sparse_adam._core.row_rules.adagrad import AdagradHyperparams, AdagradRule
from optax_sparse_adam.torch_compat import _step
from optax_sparse_adam.torch_compat._rule_optimizer import RuleOptimizer, TorchRule


def _hyper(group: dict[str, Any], step: int, dtype: Any) -> AdagradHyperparams:
  """torch's `clr = lr / (1 + (step - 1) * lr_decay)` in float64, rounded once."""
  lr = float(_step.lr_value(group["lr"], "lr"))
  clr = lr / (1 + (step - 1) * float(group["lr_decay"]))
  return AdagradHyperparams(
    learning_rate=None,
    lr_decay=None,
    eps=np.asarray(float(group["eps"]), np.float64).astype(dtype),
    weight_decay=np.asarray(float(group["weight_decay"]), np.float64).astype(dtype),
    step_size=np.asarray(clr, np.float64).astype(dtype),
  )


def _plan(group: dict[str, Any], dense: bool) -> tuple[AdagradRule, rules.StepConfig]:
  """torch's L2 decay on dense gradients (refused on sparse ones, `refusals`)."""
  decays = dense and float(group["weight_decay"]) != 0
  return AdagradRule(), rules.StepConfig(
    maximize=bool(group["maximize"]), weight_decay="l2" if decays else "none"
  )


_TABLE = TorchRule(
  torch_name="Adagrad",
  slots={"sum": "sum"},
  step_key="step",
  step_type=float,
  eager_state=True,
  # torch refuses these after counting the step; here before any change.
  refusals={
    "fused": "`fused` does not support sparse grad or complex param ({where} has fused=True)",
    "weight_decay": "weight_decay option is not compatible with sparse gradients ({where} "
    "has weight_decay={value!r}; torch's decay would move every row. For a decay of the "
    "touched rows only, use optax_sparse_adam.sparse_rowwise_adagrad(weight_decay_mode=...).)",
  },
  plan=_plan,
  hyper=_hyper,
  slot_init=lambda group, slot: float(group["initial_accumulator_value"]),
)


class Adagrad(RuleOptimizer):
  r"""`torch.optim.Adagrad` for `Parameter`s holding JAX arrays, with BCOO or dense gradients.

  For each parameter with a gradient, its step :math:`t` advances and, with
  :math:`g` the gradient with duplicate indices summed (torch coalesces it) and
  :math:`r` the rows it touches,

  .. math::
    s_r \leftarrow s_r + g_r^2, \quad
    \theta_r \leftarrow \theta_r - \frac{\alpha}{1 + (t - 1)\eta} \frac{g_r}{\sqrt{s_r} + \epsilon}

  and nothing else changes. The state is torch's: `'step'` (a float) and
  `'sum'` (the parameter's shape, from `initial_accumulator_value`), made in the
  constructor for every parameter, as torch does; state dicts move both ways.

  A dense gradient (a `jax.Array`, as an MLP's) steps every element as torch's
  dense Adagrad, L2 `weight_decay` (:math:`g + \lambda\theta` first) included:
  one `Adagrad(model_params)` serves a whole model.

  `weight_decay` and `fused=True`, which torch refuses with sparse gradients,
  are refused at `step()` with torch's words for a group with a sparse gradient,
  before anything changes.

  Args:
    params: an iterable of `Parameter`s, of `(name, Parameter)` pairs, or of
      param-group dicts.
    lr: learning rate :math:`\alpha`.
    lr_decay: :math:`\eta`.
    weight_decay: L2 decay of dense gradients; must be 0 at `step()` for a group
      with a sparse gradient (torch raises).
    initial_accumulator_value: where :math:`s` starts.
    eps: added to :math:`\sqrt{s}`.
    foreach: accepted, no effect (torch's sparse path ignores it too).
    maximize: ascend the objective instead of descending it.
    differentiable: accepted, no effect.
    fused: must not be True at `step()` (torch raises).
    param_rounding: "nearest" (the default, torch's) or "stochastic": how the new
      rows of a bfloat16 or float16 `Parameter` are rounded ("stochastic" keys
      its bits on `'step'`). Not a group option: pass it again when you rebuild
      the optimizer (docs/memory.md, 16-bit tables that learn).

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental.sparse import BCOO
    >>> from optax_sparse_adam import torch_compat as tc
    >>> opt = tc.Adagrad([tc.Parameter(jnp.zeros((4, 2)))], lr=0.1)
    >>> (table,) = opt.param_groups[0]["params"]
    >>> table.grad = BCOO((jnp.full((1, 2), 3.0), jnp.array([[2]])), shape=(4, 2))
    >>> opt.step()
    >>> table.data[2], opt.state[table]["step"]
    (Array([-0.1, -0.1], dtype=float32), 1.0)

  References:
    `torch.optim.Adagrad`,
    https://pytorch.org/docs/stable/generated/torch.optim.Adagrad.html
  """

  TABLE = _TABLE

  def __init__(
    self,
    params: Any,
    lr: Any = 1e-2,
    lr_decay: float = 0,
    weight_decay: float = 0,
    initial_accumulator_value: float = 0,
    eps: float = 1e-10,
    foreach: bool | None = None,
    *,
    maximize: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
    param_rounding: str = "nearest",
  ) -> None:
    # torch's constructor checks, in its order and wording.
    check_nonnegative(
      ("lr", lr),
      ("lr_decay", lr_decay),
      ("weight_decay", weight_decay),
      ("initial_accumulator_value", initial_accumulator_value),
      ("epsilon", eps),
      every_value=True,
    )
    super().__init__(params, locals())
