"""`RuleOptimizer`: a torch optimizer over any row rule, driven by a declarative table.

A subclass states, in a `TorchRule` table, torch's param-group defaults, the
state_dict names of its per-parameter state (each a rule slot, or the step
count), the checks torch makes (constructor, step) and how a group's options
become the rule and its host-computed hyper-parameters. Everything else is
shared: torch's `Optimizer` bookkeeping (`_optimizer`), the gradient checks and
loading of arrays (`_sparse_adam`), and one jitted step over every parameter
with a gradient (`_step.fused_rule_step`), donating the parameters and slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

from optax_sparse_adam._core import rules
from optax_sparse_adam._core.rounding import check_param_rounding, check_rounding
from optax_sparse_adam.torch_compat import _step
from optax_sparse_adam.torch_compat._hooks import with_step_hooks
from optax_sparse_adam.torch_compat._optimizer import Optimizer, iter_params
from optax_sparse_adam.torch_compat._parameter import Parameter
from optax_sparse_adam.torch_compat._sparse_adam import (
  _as_moment,
  _as_step,
  copy_shared_buffers,
  grads_to_step,
  loaded_state,
  param_label,
)

_OPAQUE_ZERO = np.zeros((), np.int32)
# The state key of the step count that keys stochastic rounding, for a rule that keeps
# none of its own (SGD); only with param_rounding="stochastic".
ROUNDING_STEP = "param_rounding_step"


class TorchRule(NamedTuple):
  """How a torch optimizer maps onto a row rule: the adapter's whole table.

  Attributes:
    torch_name: the torch class, in messages ("SGD").
    slots: torch's state_dict key of each rule slot, `{state key: slot name}`.
    step_key: torch's state_dict key of the step count, or None (no count kept).
    step_type: how the count is stored (`int`, or `float` as Adagrad's tensor).
    eager_state: make every parameter's state in the constructor, as torch does.
    refusals: `{option: message}`, the options torch refuses with sparse gradients
      (refused where a flag is true or a number is not 0), with torch's words
      (formatted with `where`, the group, and `value`); checked at step time,
      before any change, for a group with a sparse gradient.
    plan: `(group, dense) -> (rule, StepConfig)`, static per group, for its sparse
      (`dense=False`) or dense gradients (torch's dense step: every element).
    hyper: `(group, step, compute dtype) -> hyper-parameters` on the host.
    slot_init: `(group, slot name) -> fill value` of a fresh slot.
    check_group: `(group, where)`: any other refusal at step time for a group with
      a sparse gradient, or None.
    check_dense: `(group, where)`: a refusal at step time for a group with a dense
      gradient, or None.
  """

  torch_name: str
  slots: dict[str, str]
  step_key: str | None
  step_type: type
  eager_state: bool
  refusals: dict[str, str]
  plan: Callable[[dict[str, Any], bool], tuple[Any, rules.StepConfig]]
  hyper: Callable[[dict[str, Any], int, Any], Any]
  slot_init: Callable[[dict[str, Any], str], float]
  check_group: Callable[[dict[str, Any], str], None] | None = None
  check_dense: Callable[[dict[str, Any], str], None] | None = None

  def refuse(self, group: dict[str, Any], where: str) -> None:
    """Raises torch's error for the first option of `group` that torch refuses."""
    for option, message in self.refusals.items():
      value = group.get(option)
      if value is None or isinstance(value, bool):
        refused = bool(value)
      else:
        refused = _step.lr_value(value, f"{where}[{option!r}]") != 0
      if refused:
        raise RuntimeError(message.format(where=where, value=value))
    if self.check_group is not None:
      self.check_group(group, where)


class RuleOptimizer(Optimizer):
  """A `torch.optim` optimizer for `Parameter`s with BCOO or dense gradients, from a `TorchRule`."""

  TABLE: TorchRule

  def __init__(self, params: Any, arguments: dict[str, Any]) -> None:
    """`arguments`: the subclass constructor's `locals()`, after torch's checks.

    torch's param-group defaults are every argument but the params, by its name.
    """
    # Not a group option: the state_dict stays torch's (pass it again to a new optimizer).
    self._param_rounding = arguments.get("param_rounding", "nearest")
    check_rounding(self._param_rounding, "param_rounding")
    skipped = ("self", "params", "__class__", "param_rounding")
    defaults = {k: v for k, v in arguments.items() if k not in skipped}
    super().__init__(params, defaults)
    if self.TABLE.eager_state:
      for _, _, p in iter_params(self.param_groups):
        self.state[p] = self._fresh_state(p, self._group_of(p))

  def _check_param_group(self, param_group: dict[str, Any], index: int) -> None:
    sparse_params = [
      [index, i] for i, p in enumerate(param_group["params"]) if isinstance(p, sparse.BCOO)
    ]
    if sparse_params:
      raise ValueError(
        f"Sparse params at indices {sparse_params}: this {self.TABLE.torch_name} steps dense "
        "parameters (optax_sparse_adam.torch_compat.Parameter) with sparse gradients"
      )

  def _group_of(self, param: Parameter) -> dict[str, Any]:
    return next(g for g in self.param_groups if any(q is param for q in g["params"]))

  def _fresh_state(self, param: Parameter, group: dict[str, Any]) -> dict[str, Any]:
    table = self.TABLE
    state: dict[str, Any] = {}
    if table.step_key is not None:
      state[table.step_key] = table.step_type(0)
    for key, slot in table.slots.items():
      state[key] = jnp.full_like(param.data, table.slot_init(group, slot))
    return state

  def _load_param_state(self, param: Parameter, value: Any, where: str) -> dict[str, Any]:
    table = self.TABLE
    keys = ([table.step_key] if table.step_key else []) + list(table.slots)
    state = loaded_state(value, keys, table.torch_name, where)
    if not state:
      return {}
    if table.step_key is not None:
      state[table.step_key] = table.step_type(_as_step(value[table.step_key], where))
    for key in table.slots:
      state[key] = _as_moment(value[key], param, key, where)
    return state

  def _fresh_rows(self, param: Parameter) -> dict[str, float]:
    group = self._group_of(param)
    return {key: self.TABLE.slot_init(group, slot) for key, slot in self.TABLE.slots.items()}

  @with_step_hooks
  def step(self, closure: Any = None) -> Any:
    """Performs one optimization step of every parameter that has a gradient.

    A parameter whose `.grad` is None is skipped; a BCOO gradient steps the rows
    it touches, a dense one every element (torch's dense step); every gradient
    and every group's options are checked before anything changes.

    Args:
      closure: an optional callable that recomputes the loss; called first.

    Returns:
      The closure's loss, or None.
    """
    loss = None if closure is None else closure()
    table = self.TABLE
    todo = grads_to_step(self.param_groups, str, lambda group, where: group, dense_ok=True)
    if not todo:
      return loss
    for gi, group in enumerate(self.param_groups):
      kinds = {isinstance(grad, sparse.BCOO) for _, grad, g in todo if g is group}
      where = f"param_groups[{gi}]"
      if True in kinds:
        table.refuse(group, where)
      if False in kinds and table.check_dense is not None:
        table.check_dense(group, where)

    rounds = self._param_rounding == "stochastic"
    params, slots, grads, hypers, plans, steps, counts = [], [], [], [], [], [], []
    for p, _, group in todo:
      state = self.state.get(p) or self._fresh_state(p, group)
      step = (state[table.step_key] if table.step_key else 0) + 1
      params.append(p.data)
      slots.append({slot: state[key] for key, slot in table.slots.items()})
      grads.append(p.grad)
      hypers.append(table.hyper(group, int(step), _step.compute_dtype(p, p.grad)))
      rule, config = table.plan(group, not isinstance(p.grad, sparse.BCOO))
      if rounds:
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        pi = next(i for i, q in enumerate(group["params"]) if q is p)
        label = param_label(group, f"param_groups[{gi}]", pi)
        rounded = check_param_rounding(self._param_rounding, p.data.dtype, (label,))
        config = config._replace(param_rounding=rounded)
        # A rule without a step count (SGD) counts its rounding's steps in the state.
        if table.step_key is None:
          step = int(state.get(ROUNDING_STEP, 0)) + 1
      plans.append((rule, config))
      steps.append(step)
      counts.append(step)
    copy_shared_buffers(params)
    new_params, new_slots = _step.fused_rule_step(
      params,
      slots,
      grads,
      hypers,
      _OPAQUE_ZERO,
      _step.rounding_steps(self._param_rounding, counts),
      plans=tuple(plans),
    )
    for (p, _, group), data, slot_tables, step in zip(
      todo, new_params, new_slots, steps, strict=True
    ):
      p.data = data
      state = self.state.get(p) or self._fresh_state(p, group)
      if table.step_key is not None:
        state[table.step_key] = step
      elif rounds:
        state[ROUNDING_STEP] = step
      for key, slot in table.slots.items():
        state[key] = slot_tables[slot]
      if state:
        self.state[p] = state
    return loss
