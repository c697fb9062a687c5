"""`Optimizer`: the bookkeeping of `torch.optim.Optimizer`, for `Parameter`s holding JAX arrays.

Param groups, per-parameter state, `state_dict`/`load_state_dict` in torch's
layout, `zero_grad` and the six kinds of hooks, with torch's order of checks and
its error wording (often followed by details torch does not give). Subclasses
implement `step` and `_load_param_state`.

When torch is installed, `Optimizer` also derives from `torch.optim.Optimizer`,
so that everything in torch that checks `isinstance(optimizer, Optimizer)` (the
learning-rate schedulers, `SWALR`, ...) accepts it. Every method that such code
calls is defined here; torch's `__init__` never runs and no torch tensor is made.
Without torch the class stands alone and torch is never imported.
"""

import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from copy import deepcopy
from itertools import chain
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from jax.experimental import sparse

from optax_sparse_adam.torch_compat import _convert, _hooks, _reset
from optax_sparse_adam.torch_compat._parameter import Parameter

StateDict = dict[str, Any]

# Appended to torch's wording where it says "Tensor".
_TENSOR_HINT = " (here a Tensor is an optax_sparse_adam.torch_compat.Parameter)"


def _typename(x: Any) -> str:
  cls = type(x)
  module = cls.__module__
  return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _torch_optimizer_base() -> type:
  """`torch.optim.Optimizer` when torch is installed, else `object`."""
  try:
    from torch.optim import Optimizer as TorchOptimizer
  except ImportError:
    return object
  return TorchOptimizer


if TYPE_CHECKING:
  # The checker sees the class without torch's base: everything torch's code calls is defined
  # here, not inherited, and that base exists only where torch is installed.
  _TorchOptimizer = object
else:
  _TorchOptimizer = _torch_optimizer_base()


class Optimizer(_hooks.HookRegistry, _TorchOptimizer):
  """Base class with `torch.optim.Optimizer`'s behaviour; see `SparseAdam`.

  A `torch.optim.Optimizer` (by inheritance) when torch is installed.

  Attributes:
    defaults: the options a param group gets when it does not give them.
    param_groups: a list of dicts, each with `'params'` (a list of
      `Parameter`s), its options and, for named parameters, `'param_names'`.
      Edit the options between steps; the next step uses them.
    state: per `Parameter`, a dict of its optimizer state (a defaultdict, as
      in torch: reading a missing entry creates an empty one).
  """

  def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
    self.defaults = defaults
    for name in _hooks.HOOK_DICTS:
      setattr(self, name, OrderedDict())

    if isinstance(params, (Parameter, sparse.BCOO)) or hasattr(params, "__array__"):
      raise TypeError(
        "params argument given to the optimizer should be an iterable of Tensors or dicts, "
        f"but got {_typename(params)}{_TENSOR_HINT}"
      )
    self.state: defaultdict[Parameter, dict[str, Any]] = defaultdict(dict)
    self.param_groups: list[dict[str, Any]] = []

    param_groups = list(params)
    if len(param_groups) == 0:
      raise ValueError("optimizer got an empty parameter list")
    if not isinstance(param_groups[0], dict):
      param_groups = [{"params": param_groups}]
    for param_group in param_groups:
      self.add_param_group(param_group)

  # Pickling and deepcopy, as torch: hooks (and a scheduler's patch of `step`) are not kept.

  def __getstate__(self) -> dict[str, Any]:
    state = {"defaults": self.defaults, "state": self.state, "param_groups": self.param_groups}
    if "_param_rounding" in self.__dict__:  # the optimizer's option, not a group's (torch's)
      state["_param_rounding"] = self.__dict__["_param_rounding"]
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    for name in _hooks.HOOK_DICTS:
      self.__dict__.setdefault(name, OrderedDict())
    self.defaults.setdefault("differentiable", False)

  def __repr__(self) -> str:
    text = self.__class__.__name__ + " ("
    for i, group in enumerate(self.param_groups):
      text += f"\nParameter Group {i}\n"
      for key in sorted(group.keys()):
        if key != "params":
          text += f"    {key}: {group[key]}\n"
    return text + ")"

  # Param groups.

  def add_param_group(self, param_group: dict[str, Any]) -> None:
    """Adds a param group, as torch does: the dict itself is kept and completed.

    Args:
      param_group: a dict with `'params'` (a `Parameter`, or a list of them or
        of `(name, Parameter)` pairs) and any options; missing options are
        taken from `defaults`.
    """
    if not isinstance(param_group, dict):
      raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
    if "params" not in param_group:
      # torch fails on `param_group["params"]` with a KeyError; same type, clearer words.
      raise KeyError(
        "params",
        "param_group must have a 'params' entry holding its Parameters, but got "
        f"keys {sorted(map(str, param_group))}",
      )
    params = param_group["params"]
    if isinstance(params, Parameter):
      params = [params]
    elif isinstance(params, (set, frozenset)):
      raise TypeError(
        "optimizer parameters need to be organized in ordered collections, but "
        "the ordering of tensors in sets will change between runs. Please use a list instead."
      )
    else:
      params = list(params)

    extracted_params, extracted_names = [], []
    for param in params:
      if isinstance(param, tuple):
        extracted_names.append(param[0])
        extracted_params.append(param[1])
      else:
        extracted_params.append(param)
    names = None
    if extracted_names:
      if len(extracted_names) != len(extracted_params):
        raise ValueError(
          "all optimizer params should be with/without names. Some param names are missing"
        )
      names = extracted_names

    for param in extracted_params:
      # A sparse tensor (a BCOO, or torch's own) passes, as in torch: SparseAdam then
      # names its index in torch's words.
      if not isinstance(param, Parameter) and not _convert.is_sparse_param(param):
        raise TypeError(
          f"optimizer can only optimize Tensors, but one of the params is {_typename(param)}"
          f"{_TENSOR_HINT}; wrap arrays as optax_sparse_adam.torch_compat.Parameter(array)"
        )

    candidate = dict(param_group)
    candidate["params"] = extracted_params
    if names is not None:
      candidate["param_names"] = names
    for name, default in self.defaults.items():
      candidate.setdefault(name, default)

    if len(extracted_params) != len({id(p) for p in extracted_params}):
      warnings.warn(
        "optimizer contains a parameter group with duplicate parameters; "
        "in future, this will cause an error; "
        "see github.com/pytorch/pytorch/issues/40967 for more information",
        stacklevel=3,
      )

    existing: set[int] = set()
    for group in self.param_groups:
      existing.update(id(p) for p in group["params"])
      if ("param_names" in candidate) != ("param_names" in group):
        current = "with names" if "param_names" in candidate else "without names"
        raise ValueError(
          "all optimizer param groups should be with/without names. "
          f"cannot add param group {current} to the optimizer"
        )
    if not existing.isdisjoint(id(p) for p in extracted_params):
      raise ValueError("some parameters appear in more than one parameter group")

    self._check_param_group(candidate, len(self.param_groups))
    # Only now, with every check passed, complete the caller's dict as torch does.
    param_group.clear()
    param_group.update(candidate)
    self.param_groups.append(param_group)

  def _check_param_group(self, param_group: dict[str, Any], index: int) -> None:
    """Subclass checks of a group about to be added (index `index`)."""

  # Gradients.

  def zero_grad(self, set_to_none: bool = True) -> None:
    """Resets the gradients: to None, or else to an empty BCOO (torch zeroes a sparse grad so).

    Args:
      set_to_none: set every `.grad` to None (the default) instead of emptying it.
    """
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is None:
          continue
        if set_to_none:
          p.grad = None
        elif isinstance(p.grad, sparse.BCOO):
          grad = p.grad
          p.grad = sparse.BCOO(
            (
              jnp.zeros((0,) + grad.data.shape[1:], grad.dtype),
              jnp.zeros((0, grad.n_sparse), grad.indices.dtype),
            ),
            shape=grad.shape,
            indices_sorted=True,
            unique_indices=True,
          )
        else:
          p.grad = jnp.zeros_like(jnp.asarray(p.grad))

  # State dicts.

  def state_dict(self) -> StateDict:
    """The optimizer's state in torch's layout.

    `{'state': {id: {...}}, 'param_groups': [{..., 'params': [ids]}]}`, ids
    numbering the parameters in group order. As in torch, nothing is copied:
    each per-parameter dict is the live one, so a later `step()` shows in it.

    Returns:
      The state dict (after the state-dict post-hooks).
    """
    for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
      pre_hook(self)

    param_mappings: dict[int, int] = {}
    start_index = 0

    def pack_group(group: dict[str, Any]) -> dict[str, Any]:
      nonlocal start_index
      packed = {k: v for k, v in group.items() if k != "params"}
      for i, p in enumerate(group["params"], start_index):
        param_mappings.setdefault(id(p), i)
      packed["params"] = [param_mappings[id(p)] for p in group["params"]]
      start_index += len(packed["params"])
      return packed

    param_groups = [pack_group(g) for g in self.param_groups]
    packed_state = {
      (param_mappings[id(k)] if isinstance(k, Parameter) else k): v for k, v in self.state.items()
    }
    state_dict = {"state": packed_state, "param_groups": param_groups}
    for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
      result = post_hook(self, state_dict)
      if result is not None:
        state_dict = result
    return state_dict

  def load_state_dict(self, state_dict: StateDict) -> None:
    """Loads a state dict from `state_dict()` here or from `torch.optim` (tensors welcome).

    torch's checks come first, in its order: the number of groups, then each
    group's size. Then what torch leaves to the next step: every group's
    options, and every parameter's state (its keys, shapes and step). All is
    checked before anything changes; a failed load leaves the optimizer as it
    was. Arrays are copied (the next step donates them) and cast to their
    parameter's dtype, on its device.

    Args:
      state_dict: `{'state': ..., 'param_groups': ...}`, with jax, numpy or
        torch arrays.
    """
    if not isinstance(state_dict, dict):
      raise TypeError(
        f"state_dict must be a dict with 'state' and 'param_groups', but got "
        f"{_typename(state_dict)}"
      )
    state_dict = state_dict.copy()
    for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
      result = pre_hook(self, state_dict)
      if result is not None:
        state_dict = result

    for key in ("param_groups", "state"):
      if key not in state_dict:
        raise ValueError(
          f"loaded state dict has no {key!r} entry; expected a dict from "
          "optimizer.state_dict() with keys 'state' and 'param_groups', but got "
          f"keys {sorted(map(str, state_dict))}"
        )
    groups = self.param_groups
    saved_groups = deepcopy(state_dict["param_groups"])
    if not isinstance(saved_groups, (list, tuple)) or not all(
      isinstance(g, dict) and "params" in g for g in saved_groups
    ):
      raise ValueError(
        "loaded state dict's 'param_groups' must be a list of dicts, each with "
        "a 'params' list of parameter ids"
      )
    if len(groups) != len(saved_groups):
      raise ValueError(
        "loaded state dict has a different number of parameter groups "
        f"({len(saved_groups)}; the optimizer has {len(groups)})"
      )
    for i, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
      if len(group["params"]) != len(saved["params"]):
        raise ValueError(
          "loaded state dict contains a parameter group that doesn't match the "
          f"size of optimizer's group (group {i}: {len(saved['params'])} "
          f"parameters saved, {len(group['params'])} in the optimizer)"
        )

    where: dict[Any, tuple[int, int]] = {}  # saved id -> (group, index in group), for messages
    for gi, saved in enumerate(saved_groups):
      for pi, saved_id in enumerate(saved["params"]):
        where.setdefault(saved_id, (gi, pi))
    id_map = dict(
      zip(
        chain.from_iterable(g["params"] for g in saved_groups),
        chain.from_iterable(g["params"] for g in groups),
        strict=True,
      )
    )
    for gi, saved in enumerate(saved_groups):
      self._check_loaded_group(saved, f"loaded state dict's param group {gi}")

    saved_state = state_dict["state"]
    if not isinstance(saved_state, dict):
      raise ValueError(
        f"loaded state dict's 'state' must be a dict of parameter id to state, "
        f"but got {_typename(saved_state)}"
      )
    state: defaultdict[Parameter, dict[str, Any]] = defaultdict(dict)
    for k, v in saved_state.items():
      if k not in id_map:
        # Not a parameter's id (e.g. what a state_dict hook added): kept as is, as torch does.
        state[k] = v
        continue
      gi, pi = where[k]
      state[id_map[k]] = self._load_param_state(
        id_map[k], v, f"parameter {k!r} (param_groups[{gi}]['params'][{pi}])"
      )

    def update_group(group: dict[str, Any], new_group: dict[str, Any]) -> dict[str, Any]:
      new_group["params"] = group["params"]
      if "param_names" in group and "param_names" not in new_group:
        new_group["param_names"] = group["param_names"]
      return new_group

    self.param_groups = [update_group(g, ng) for g, ng in zip(groups, saved_groups, strict=True)]
    self.state = state
    # torch's __setstate__ adds this default on every load; mirrored so that
    # groups added afterwards match torch's.
    self.defaults.setdefault("differentiable", False)

    for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
      post_hook(self)

  def reset_rows(self, param: Parameter, ids: Any, values: Any = None) -> None:
    """Resets the rows `ids` of `param`'s optimizer state to a fresh state's, and its rows.

    For a row evicted from a vocabulary, or handed to a new id: its per-row
    state (`exp_avg`, `sum`, `momentum_buffer`, ...) at those rows becomes what
    a fresh state holds, as if the rows had never been stepped; the step count
    is the parameter's and does not change. `optax_sparse_adam.reset_rows` does
    the same for an optax state. One compiled call donating the buffers: O(rows).

    Args:
      param: a `Parameter` of this optimizer's groups.
      ids: int row ids (of the leading dim), each in range.
      values: `(len(ids), *row_shape)`, the parameter's new rows, or None to
        leave them.

    Raises:
      ValueError: `param` is not this optimizer's, an id is out of range, or
        `values` has the wrong shape; nothing changes.
    """
    held = any(q is param for group in self.param_groups for q in group["params"])
    # A parameter not held is refused by reset_param_rows, naming it.
    _reset.reset_param_rows(self, param, ids, values, self._fresh_rows(param) if held else {})

  def _fresh_rows(self, param: Parameter) -> dict[str, float]:
    """`{state key: a fresh row's value}` of each per-row slot of `param`'s state."""
    raise NotImplementedError

  def _check_loaded_group(self, group: dict[str, Any], where: str) -> None:
    """Subclass checks of a loaded group's options."""

  def _load_param_state(self, param: Parameter, value: Any, where: str) -> dict[str, Any]:
    """Checks and converts one parameter's loaded state; subclasses know its keys."""
    raise NotImplementedError


def iter_params(param_groups: Iterable[dict[str, Any]]) -> Iterable[tuple[int, int, Parameter]]:
  """`(group index, index in group, parameter)` over all groups."""
  for gi, group in enumerate(param_groups):
    for pi, p in enumerate(group["params"]):
      yield gi, pi, p
