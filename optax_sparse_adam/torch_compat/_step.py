"""The torch adapter's step: every parameter with a gradient updated in one compiled call.

Hyper-parameters reach the compiled function as arrays, never as constants, so
editing `lr`, `betas` or `eps` between steps does not recompile. `maximize` is
compiled in, as in the optax path: the gradient is then negated by the fused
kernels (or after coalescing), not by a pass over every gradient entry; a group
flipping it compiles once per setting. The scalars are computed on the host in
float64 as torch computes them (the step size with `adam.torch_step_size`) and
rounded once to the compute dtype, which is what torch does when it multiplies
a float32 tensor by a Python float.
"""

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

from optax_sparse_adam._core import rules
from optax_sparse_adam._core.row_rules import adam
from optax_sparse_adam._optax import leaf
from optax_sparse_adam.torch_compat import _convert

# Positions in the per-parameter scalar vector: what the step reads, nothing more. The
# learning rate and log-betas are not in it: the Adam rule reads them only for weight
# decay and for a step size it computes itself, and the adapter has neither.
_STEP_SIZE, _ONE_MINUS_B1, _ONE_MINUS_B2, _EPS = range(4)
_RULE = adam.AdamRule()


class GroupHyperparams(NamedTuple):
  """A param group's options, checked and converted for the host arithmetic.

  `lr` is a Python float, or a 0-d floating NumPy array when the group holds a
  1-element array: torch then computes the step size in that array's dtype.
  """

  lr: float | np.ndarray
  b1: float
  b2: float
  eps: float
  maximize: bool


def _number(value: Any, what: str) -> float:
  if type(value) is float or type(value) is int:
    return float(value)  # the usual case, every step: no array checks
  if isinstance(value, bool) or value is None or isinstance(value, (str, bytes)):
    raise TypeError(f"{what} must be a number, but got {value!r}")
  if _convert.is_array(value):
    host = _convert.to_numpy(value)
    if host.size != 1:
      raise ValueError(f"{what} must be a number, but got an array of shape {host.shape}")
    return float(host.reshape(()))
  try:
    return float(value)
  except (TypeError, ValueError) as err:
    raise TypeError(f"{what} must be a number, but got {value!r}") from err


def lr_value(lr: Any, what: str = "lr") -> float | np.ndarray:
  """A Python float, or a 0-d floating NumPy array for a 1-element array lr."""
  if type(lr) is float:
    return lr
  if _convert.is_array(lr):
    host = _convert.to_numpy(lr)
    if host.size != 1:
      raise ValueError(f"Tensor lr must be 1-element: {what} has shape {tuple(host.shape)}")
    if np.issubdtype(host.dtype, np.floating):
      return np.array(host.reshape(()))
    return float(host.reshape(()))
  return _number(lr, what)


def group_hyperparams(group: dict, where: str) -> GroupHyperparams:
  """Reads and checks the options of one param group; `where` names it in errors."""
  for key in ("lr", "betas", "eps"):
    if key not in group:
      raise ValueError(f"{where} has no {key!r} option; SparseAdam needs lr, betas and eps.")
  betas = group["betas"]
  if type(betas) is not tuple and _convert.is_array(betas):
    betas = list(_convert.to_numpy(betas).reshape(-1))
  try:
    b1, b2 = betas
  except (TypeError, ValueError) as err:
    raise ValueError(
      f"{where}['betas'] must be a pair (beta1, beta2), but got {group['betas']!r}"
    ) from err
  maximize = group.get("maximize", False)
  if type(maximize) is not bool and _convert.is_array(maximize):
    maximize = bool(_convert.to_numpy(maximize).reshape(()))
  return GroupHyperparams(
    lr=lr_value(group["lr"], f"{where}['lr']"),
    b1=_number(b1, f"{where}['betas'][0]"),
    b2=_number(b2, f"{where}['betas'][1]"),
    eps=_number(group["eps"], f"{where}['eps']"),
    maximize=bool(maximize),
  )


def step_size(lr: float | np.ndarray, b1: float, b2: float, step: int) -> Any:
  """torch's step size: float64 for a float lr, else in the dtype of a tensor lr.

  With a tensor lr torch evaluates `lr * sqrt(bc2) / bc1` as tensor-by-scalar
  operations, each rounded to the tensor's dtype.
  """
  if isinstance(lr, np.ndarray):
    t = lr.dtype.type
    bias_correction1 = 1 - b1**step
    bias_correction2 = 1 - b2**step
    return t(t(lr * t(math.sqrt(bias_correction2))) / t(bias_correction1))
  return adam.torch_step_size(lr, b1, b2, step)


def host_scalars(hyper: GroupHyperparams, step: int, compute_dtype: Any) -> np.ndarray:
  """The per-parameter scalar vector, each entry rounded once to `compute_dtype`."""

  values = [0.0] * 4
  values[_STEP_SIZE] = step_size(hyper.lr, hyper.b1, hyper.b2, step)
  values[_ONE_MINUS_B1] = 1.0 - hyper.b1
  values[_ONE_MINUS_B2] = 1.0 - hyper.b2
  values[_EPS] = hyper.eps
  # float64 holds every value exactly (a float32 tensor lr too): one rounding each.
  return np.array([float(v) for v in values], np.float64).astype(compute_dtype)


def compute_dtype(param: Any, grad: sparse.BCOO) -> Any:
  """The dtype `leaf.sparse_adam_leaf_step` computes in, for moments in the param's dtype."""
  return _compute_dtype(np.dtype(grad.dtype), np.dtype(param.dtype))


@functools.cache
def _compute_dtype(grad_dtype: np.dtype, param_dtype: np.dtype) -> np.dtype:
  # Cached: jnp.result_type costs more than the rest of a small step's host work.
  return np.dtype(jnp.result_type(jnp.float32, grad_dtype, param_dtype))


def rounding_steps(param_rounding: str, steps: Sequence[int]) -> list[np.ndarray | None]:
  """Each parameter's step count before this step, as the key of its stochastic rounding
  (`_core.rounding`), or None each with round-to-nearest (the step needs no count)."""
  if param_rounding != "stochastic":
    return [None] * len(steps)
  return [np.asarray(step - 1, np.int32) for step in steps]


@functools.partial(
  jax.jit, donate_argnums=(0, 1, 2), static_argnames=("maximize", "param_rounding")
)
def fused_step(
  params: Sequence[jax.Array],
  exp_avgs: Sequence[jax.Array],
  exp_avg_sqs: Sequence[jax.Array],
  grads: Sequence[sparse.BCOO],
  scalars: Sequence[jax.Array],
  opaque_zero: jax.Array,
  steps: Sequence[jax.Array | None] | None = None,
  *,
  maximize: tuple[bool, ...],
  param_rounding: str = "nearest",
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
  """One SparseAdam step of every listed parameter; params and moments are donated.

  `scalars[i]` is parameter i's vector from `host_scalars`; `maximize[i]` its
  group's flag. `opaque_zero` is an int32 zero given at run time, so that the
  core rounds every product as torch does (no FMA contraction): bit-exact float32.
  Negating after coalescing equals torch's `-grad` before it exactly: rounding
  is symmetric. `steps[i]` (`rounding_steps`) keys parameter i's stochastic
  rounding (`param_rounding`); the step size still comes computed.
  """
  steps = steps if steps is not None else [None] * len(params)
  new_params, new_exp_avgs, new_exp_avg_sqs = [], [], []
  for param, exp_avg, exp_avg_sq, grad, s, sign_flip, count in zip(
    params, exp_avgs, exp_avg_sqs, grads, scalars, maximize, steps, strict=True
  ):
    rounds = param_rounding == "stochastic"
    step = leaf.masked_leaf_step(
      grad,
      rules.Tables({"mu": exp_avg, "nu": exp_avg_sq}, param=param if rounds else None),
      count,  # None: the step count lives on the host; the step size comes computed
      rule=_RULE,
      config=rules.StepConfig(maximize=sign_flip, param_rounding=param_rounding),  # type: ignore[arg-type]
      hyper=adam.AdamHyperparams(
        learning_rate=None,
        one_minus_b1=s[_ONE_MINUS_B1],
        one_minus_b2=s[_ONE_MINUS_B2],
        log_b1=None,
        log_b2=None,
        eps=s[_EPS],
        step_size=s[_STEP_SIZE],
      ),
      opaque_zero=opaque_zero,
    )
    update = step.update
    state_mu, state_nu = step.tables.slots["mu"], step.tables.slots["nu"]
    new_params.append(leaf.scatter_add_bcoo(param, update))
    new_exp_avgs.append(state_mu)
    new_exp_avg_sqs.append(state_nu)
  return new_params, new_exp_avgs, new_exp_avg_sqs


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames=("plans",))
def fused_rule_step(
  params: Sequence[jax.Array],
  slots: Sequence[dict[str, jax.Array]],
  grads: Sequence[sparse.BCOO | jax.Array],
  hypers: Sequence[Any],
  opaque_zero: jax.Array,
  steps: Sequence[jax.Array | None] | None = None,
  *,
  plans: tuple[tuple[Any, rules.StepConfig], ...],
) -> tuple[list[jax.Array], list[dict[str, jax.Array]]]:
  """One step of every listed parameter under its `(rule, StepConfig)`; params and slots donated.

  A BCOO gradient steps its rows; a dense one every element (`leaf.dense_leaf_step`).

  `hypers[i]` are parameter i's hyper-parameters, computed on the host (arrays:
  editing a group's options does not recompile; None fields are static).
  `steps[i]`: parameter i's step count before this step where its rows are
  rounded stochastically (`rounding_steps`), else None.
  """
  steps = steps if steps is not None else [None] * len(params)
  new_params, new_slots = [], []
  for param, tables, grad, hyper, (rule, config), count in zip(
    params, slots, grads, hypers, plans, steps, strict=True
  ):
    if not isinstance(grad, sparse.BCOO):  # torch's dense step: every element
      dense = leaf.dense_leaf_step(
        grad,
        rules.Tables(dict(tables), param=param),
        count,
        rule=rule,
        config=config,
        hyper=hyper,
        opaque_zero=opaque_zero,
      )
      if isinstance(dense.update, sparse.BCOO):  # rows rounded stochastically: stored
        new_params.append(leaf.scatter_add_bcoo(param, dense.update))
      else:
        new_params.append((param + dense.update).astype(param.dtype))
      new_slots.append(dense.tables.slots)
      continue
    step = leaf.masked_leaf_step(
      grad,
      rules.Tables(dict(tables), param=param),
      count,  # None: the step count lives on the host; the hyper-parameters come computed
      rule=rule,
      config=config,
      hyper=hyper,
      opaque_zero=opaque_zero,
    )
    new_params.append(leaf.scatter_add_bcoo(param, step.update))
    new_slots.append(step.tables.slots)
  return new_params, new_slots
