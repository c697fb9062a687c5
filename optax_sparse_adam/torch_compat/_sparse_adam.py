"""`SparseAdam`: `torch.optim.SparseAdam` over JAX arrays, on the library's one step."""

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

from optax_sparse_adam._core import bcoo, hyperparams
from optax_sparse_adam._core.rounding import check_param_rounding, check_rounding
from optax_sparse_adam.torch_compat import _convert, _step
from optax_sparse_adam.torch_compat._hooks import with_step_hooks
from optax_sparse_adam.torch_compat._optimizer import Optimizer, iter_params
from optax_sparse_adam.torch_compat._parameter import Parameter

_DENSE_GRAD = "SparseAdam does not support dense gradients, please consider Adam instead"
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
# A run-time int32 zero for the step (see `_step.fused_step`), made once.
_OPAQUE_ZERO = np.zeros((), np.int32)


def _check_dense_real_params(groups: list[dict[str, Any]], first_index: int = 0) -> None:
  """torch's SparseAdam checks, wording and order: sparse params, then complex ones."""
  sparse_params, complex_params = [], []
  for gi, pi, p in iter_params(groups):
    if _convert.is_sparse_param(p):
      sparse_params.append([gi + first_index, pi])
      continue
    if np.issubdtype(np.dtype(p.dtype), np.complexfloating):
      complex_params.append([gi + first_index, pi])
  if sparse_params:
    raise ValueError(
      f"Sparse params at indices {sparse_params}: SparseAdam requires dense parameter tensors"
    )
  if complex_params:
    raise ValueError(
      f"Complex params at indices {complex_params}: SparseAdam does not support complex parameters"
    )


def _as_step(value: Any, where: str) -> int:
  """A loaded `'step'` as a Python int, as torch's SparseAdam stores it."""
  host = value
  if _convert.is_array(value):
    host = _convert.to_numpy(value)
    if host.size != 1:
      raise ValueError(
        f"loaded state dict has a 'step' of shape {host.shape} for {where}; "
        "expected a non-negative integer"
      )
    host = host.reshape(()).item()
  if isinstance(host, bool) or not isinstance(host, (int, float)):
    raise ValueError(
      f"loaded state dict has a non-integer 'step' {value!r} for {where}; "
      "expected a non-negative integer"
    )
  if isinstance(host, float) and not host.is_integer():
    raise ValueError(
      f"loaded state dict has a non-integer 'step' {value!r} for {where}; "
      "expected a non-negative integer"
    )
  if host < 0:
    raise ValueError(
      f"loaded state dict has a negative 'step' {value!r} for {where}; "
      "expected a non-negative integer"
    )
  return int(host)


def _as_moment(value: Any, param: Parameter, key: str, where: str) -> Any:
  """A loaded moment as a fresh jax.Array in the param's dtype, on its device."""
  if not (_convert.is_array(value) or isinstance(value, (list, tuple))):
    raise ValueError(
      f"loaded state dict has {key!r} of type {type(value).__name__} for {where}; expected an array"
    )
  host = _convert.to_numpy(value) if _convert.is_torch_tensor(value) else value
  shape = tuple(np.shape(host))
  if shape != param.shape:
    raise ValueError(
      f"loaded state dict has {key!r} of shape {shape} for {where}, whose "
      f"parameter has shape {param.shape}; they must be equal"
    )
  # A fresh buffer: the next step donates it, so it must not be the caller's.
  array = jnp.array(host, dtype=param.dtype, copy=True)
  if not param.data.committed:
    return array  # placed as the param is; committing it would recompile the step
  return jax.device_put(array, param.data.sharding)


# The gradient layouts (shapes and dtypes, and the param's shape) that passed `bcoo.row_layout`,
# least recently used first. A step whose layout passed lately skips the checks, which add about a
# quarter to a step of many small tables (8 tables of 1,000 x 16, 64 entries each, on CPU).
# Bounded, so that a run whose layouts keep changing (a new number of entries every batch) keeps
# only the latest; a model with more sparse parameters than the bound checks every step.
_PASSED_LAYOUTS: OrderedDict[tuple, None] = OrderedDict()
_MAX_PASSED_LAYOUTS = 1024


def _check_layout(grad: sparse.BCOO, param_shape: tuple[int, ...], path: tuple) -> None:
  key = (
    grad.shape,
    grad.indices.shape,
    grad.indices.dtype,
    grad.data.shape,
    grad.data.dtype,
    param_shape,
  )
  if key in _PASSED_LAYOUTS:
    _PASSED_LAYOUTS.move_to_end(key)
    return
  bcoo.row_layout(grad, param_shape, path)
  _PASSED_LAYOUTS[key] = None
  if len(_PASSED_LAYOUTS) > _MAX_PASSED_LAYOUTS:
    _PASSED_LAYOUTS.popitem(last=False)


def param_label(group: dict[str, Any], where: str, index: int) -> str:
  """How errors name a parameter: its name where the group has names, and its position."""
  position = f"{where}['params'][{index}]"
  names = group.get("param_names")
  if names is not None and index < len(names):
    return f"parameter {names[index]!r} ({position})"
  return position


def grads_to_step(
  param_groups: list[dict[str, Any]],
  dense_message: Callable[[str], str],
  per_group: Callable[[dict[str, Any], str], Any],
  *,
  dense_ok: bool = False,
) -> list[tuple[Parameter, Any, Any]]:
  """`(param, grad, per_group(group))` for every parameter with a gradient, all checked first.

  A dense gradient fails with `dense_message(what it is)` (unless `dense_ok`: then
  one of another shape or a non-floating dtype fails), a BCOO of the wrong layout
  with `bcoo.row_layout`'s error; `per_group` runs once per group that has a
  gradient (reading and checking its options). Parameters are named as the user
  named them where known (`param_label`). Nothing has changed when one fails.
  """
  todo = []
  for gi, group in enumerate(param_groups):
    where = f"param_groups[{gi}]"
    value = None
    for pi, p in enumerate(group["params"]):
      grad = p.grad
      if grad is None:
        continue
      label = param_label(group, where, pi)
      if not isinstance(grad, sparse.BCOO):
        shape = getattr(grad, "shape", None)
        if not dense_ok:
          raise RuntimeError(
            dense_message(
              f"{label} has a dense gradient of type {type(grad).__name__}"
              f"{'' if shape is None else f' with shape {tuple(shape)}'}"
            )
          )
        dtype = getattr(grad, "dtype", None)
        if shape is None or tuple(shape) != tuple(p.shape):
          raise RuntimeError(
            f"{label} has a gradient of shape {None if shape is None else tuple(shape)} "
            f"but the parameter has shape {tuple(p.shape)}; they must be equal"
          )
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
          raise RuntimeError(f"{label} has a gradient of dtype {dtype}; expected a float dtype")
      else:
        _check_layout(grad, p.shape, (label,))
      if value is None:
        value = per_group(group, where)
      todo.append((p, grad, value))
  return todo


def loaded_state(value: Any, keys: list[str], name: str, where: str) -> dict[str, Any]:
  """A copy of one parameter's loaded state (`{}` if empty), refused unless it has `keys`.

  Keys besides `keys` are kept as they are, as torch keeps them.
  """
  if not isinstance(value, dict):
    raise ValueError(
      f"loaded state dict has a {type(value).__name__} as the state of {where}; "
      f"expected a dict with keys {keys}"
    )
  missing = [key for key in keys if key not in value] if value else []
  if missing:
    raise ValueError(
      f"loaded state dict is missing {missing} in the state of {where}; "
      f"{name} keeps {keys} per parameter"
    )
  return dict(value)


def copy_shared_buffers(*lists: list[Any]) -> None:
  """Copies, in place in `lists`, every array whose buffer an earlier entry already holds.

  Parameters built from one array share its buffer, which cannot be donated twice.
  """
  donated: set[int] = set()
  for arrays in lists:
    for i, array in enumerate(arrays):
      if id(array) in donated:
        arrays[i] = jnp.copy(array)
      donated.add(id(arrays[i]))


class SparseAdam(Optimizer):
  r"""`torch.optim.SparseAdam` for `Parameter`s holding JAX arrays and BCOO gradients.

  For each parameter with a gradient, its step :math:`t` advances and, with
  :math:`g` the gradient with duplicate indices summed and :math:`r` the rows
  it touches,

  .. math::
    m_r &\leftarrow m_r + (1 - \beta_1)(g_r - m_r) \\
    v_r &\leftarrow v_r + (1 - \beta_2)(g_r^2 - v_r) \\
    \theta_r &\leftarrow \theta_r - \alpha \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}
      \frac{m_r}{\sqrt{v_r} + \epsilon}

  and nothing else changes. The step size is computed on the host in float64,
  as torch does, so float32 results match torch bit for bit.

  One `step()` updates every parameter that has a gradient in one compiled
  call, donating the parameters' and moments' buffers. `lr`, `betas` and `eps`
  enter as arrays: editing them between steps (as torch's lr schedulers do)
  does not recompile; a new set of gradient shapes (or of parameters with
  gradients) does, and so does a new `maximize` setting, once.

  When torch is installed, this is a `torch.optim.Optimizer`: torch's
  learning-rate schedulers (`torch.optim.lr_scheduler`) drive it as they drive
  torch's SparseAdam, and torch's global step hooks run around its steps.

  Args:
    params: an iterable of `Parameter`s, of `(name, Parameter)` pairs, or of
      dicts defining param groups (each with `'params'` and any options).
    lr: learning rate: a float, or a 1-element array (the step size is then
      computed in the array's dtype, as torch does with a tensor lr).
    betas: decay rates of the first and second moments.
    eps: added to :math:`\sqrt{v}` in the denominator.
    maximize: ascend the objective instead of descending it.
    param_rounding: "nearest" (the default, torch's) or "stochastic": how the new
      rows of a bfloat16 or float16 `Parameter` are rounded, as
      `optax_sparse_adam.sparse_adam`'s option (docs/memory.md, 16-bit tables that
      learn). Not a group option: pass it again when you rebuild the optimizer.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.experimental import sparse
    >>> from optax_sparse_adam.torch_compat import Parameter, SparseAdam
    >>> table = Parameter(jnp.zeros((4, 2)))
    >>> opt = SparseAdam([table], lr=0.1)
    >>> table.grad = sparse.BCOO((jnp.ones((1, 2)), jnp.array([[2]])), shape=(4, 2))
    >>> opt.step()
    >>> table.data[2]
    Array([-0.09999996, -0.09999996], dtype=float32)
    >>> opt.state[table]["step"]
    1

  References:
    `torch.optim.SparseAdam`,
    https://pytorch.org/docs/stable/generated/torch.optim.SparseAdam.html
  """

  def __init__(
    self,
    params: Any,
    lr: Any = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    maximize: bool = False,
    *,
    param_rounding: str = "nearest",
  ) -> None:
    self._initialized = False
    check_rounding(param_rounding, "param_rounding")
    self._param_rounding = param_rounding
    # An array lr must be 1-element ("Tensor lr must be 1-element") and is compared by value.
    is_array_lr = _convert.is_array(lr)
    lr_number = _step.lr_value(lr) if is_array_lr else lr
    # torch's checks, order and wording: every value compared as torch compares it, so one
    # that is no number (None, a string) fails with Python's TypeError, as in torch.
    hyperparams.check_ranges(lr_number, betas, eps, every_value=True)
    if not is_array_lr:
      _step.lr_value(lr)  # what compares like a number but is none (a bool) is refused
    defaults = {"lr": lr, "betas": betas, "eps": eps, "maximize": maximize}
    super().__init__(params, defaults)
    _check_dense_real_params(self.param_groups)
    self._initialized = True

  def _check_param_group(self, param_group: dict[str, Any], index: int) -> None:
    if _convert.is_array(param_group["lr"]):
      _step.lr_value(param_group["lr"], f"param group {index}'s lr")
    if self._initialized:
      # torch checks only in the constructor and fails later; here before the group is added.
      _check_dense_real_params([param_group], first_index=index)

  def _check_loaded_group(self, group: dict[str, Any], where: str) -> None:
    _step.group_hyperparams(group, where)

  def _load_param_state(self, param: Parameter, value: Any, where: str) -> dict[str, Any]:
    state = loaded_state(value, list(_STATE_KEYS), "SparseAdam", where)
    if not state:
      return {}
    state["step"] = _as_step(value["step"], where)
    state["exp_avg"] = _as_moment(value["exp_avg"], param, "exp_avg", where)
    state["exp_avg_sq"] = _as_moment(value["exp_avg_sq"], param, "exp_avg_sq", where)
    return state

  def _fresh_rows(self, param: Parameter) -> dict[str, float]:
    return {"exp_avg": 0.0, "exp_avg_sq": 0.0}

  def _label(self, param: Parameter) -> str:
    for gi, group in enumerate(self.param_groups):
      for pi, q in enumerate(group["params"]):
        if q is param:
          return param_label(group, f"param_groups[{gi}]", pi)
    return "a parameter"

  @with_step_hooks
  def step(self, closure: Any = None) -> Any:
    """Performs one optimization step of every parameter that has a gradient.

    A parameter whose `.grad` is None is skipped (its step does not advance);
    an empty BCOO advances its step and changes nothing else. Every gradient
    is checked before anything changes.

    Args:
      closure: an optional callable that recomputes the loss (and may set the
        gradients); it is called first and its result returned.

    Returns:
      The closure's loss, or None.
    """
    loss = None
    if closure is not None:
      loss = closure()

    todo = grads_to_step(
      self.param_groups, lambda text: f"{_DENSE_GRAD} ({text})", _step.group_hyperparams
    )
    if not todo:
      return loss

    rounds = self._param_rounding == "stochastic"
    params, exp_avgs, exp_avg_sqs, grads, scalars, steps = [], [], [], [], [], []
    for p, grad, hyper in todo:
      if rounds:  # a dtype it does not serve is refused, naming the parameter
        check_param_rounding(self._param_rounding, p.data.dtype, (self._label(p),))
      state = self.state.get(p) or {}
      step = state.get("step", 0) + 1
      params.append(p.data)
      exp_avgs.append(state["exp_avg"] if state else jnp.zeros_like(p.data))
      exp_avg_sqs.append(state["exp_avg_sq"] if state else jnp.zeros_like(p.data))
      grads.append(grad)
      scalars.append(_step.host_scalars(hyper, step, _step.compute_dtype(p, grad)))
      steps.append(step)

    copy_shared_buffers(params, exp_avgs, exp_avg_sqs)
    new_params, new_exp_avgs, new_exp_avg_sqs = _step.fused_step(
      params,
      exp_avgs,
      exp_avg_sqs,
      grads,
      scalars,
      _OPAQUE_ZERO,
      _step.rounding_steps(self._param_rounding, steps),
      maximize=tuple(hyper.maximize for _, _, hyper in todo),
      param_rounding=self._param_rounding,
    )
    for (p, _, _), data, exp_avg, exp_avg_sq, step in zip(
      todo, new_params, new_exp_avgs, new_exp_avg_sqs, steps, strict=True
    ):
      p.data = data
      state = self.state[p]
      state["step"] = step
      state["exp_avg"] = exp_avg
      state["exp_avg_sq"] = exp_avg_sq
    return loss
