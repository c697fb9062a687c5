"""The optimizer's hooks with torch's semantics, without importing torch.

Removable handles, the six kinds of per-optimizer hooks (`HookRegistry`), and
the step hooks run around `step` in torch's order, global hooks included.
"""

import functools
import itertools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

_next_id = itertools.count()


class RemovableHandle:
  """Removes one registered hook: `remove()` is idempotent; a context manager removes on exit.

  Like `torch.utils.hooks.RemovableHandle`, it holds its hooks dict weakly, so a
  handle never keeps an optimizer alive.
  """

  def __init__(self, hooks: OrderedDict) -> None:
    self._hooks_ref = weakref.ref(hooks)
    self.id = next(_next_id)

  def remove(self) -> None:
    hooks = self._hooks_ref()
    if hooks is not None:
      hooks.pop(self.id, None)

  def __enter__(self) -> "RemovableHandle":
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.remove()

  def __repr__(self) -> str:
    return f"RemovableHandle(id={self.id})"


def register(hooks: OrderedDict, hook: Callable, *, prepend: bool = False) -> RemovableHandle:
  """Adds `hook` to `hooks`, first when `prepend` else last, and returns its handle."""
  if not callable(hook):
    raise TypeError(f"hook must be callable, but got {type(hook).__name__}")
  handle = RemovableHandle(hooks)
  hooks[handle.id] = hook
  if prepend:
    hooks.move_to_end(handle.id, last=False)
  return handle


HOOK_DICTS = (
  "_optimizer_step_pre_hooks",
  "_optimizer_step_post_hooks",
  "_optimizer_state_dict_pre_hooks",
  "_optimizer_state_dict_post_hooks",
  "_optimizer_load_state_dict_pre_hooks",
  "_optimizer_load_state_dict_post_hooks",
)


def global_step_hooks() -> tuple[list[Callable], list[Callable]]:
  """The hooks of torch's `register_optimizer_step_pre_hook`/`_post_hook`, if torch is loaded."""
  torch_optimizer = sys.modules.get("torch.optim.optimizer")
  if torch_optimizer is None:
    return [], []
  return (
    list(torch_optimizer._global_optimizer_pre_hooks.values()),
    list(torch_optimizer._global_optimizer_post_hooks.values()),
  )


def with_step_hooks(step: Callable) -> Callable:
  """Runs the step pre- and post-hooks around `step`, as torch's `profile_hook_step`.

  torch's order: the global pre-hooks (`torch.optim.optimizer.
  register_optimizer_step_pre_hook`), this optimizer's pre-hooks, the step,
  this optimizer's post-hooks, the global post-hooks. As in torch, hooks receive
  `args` including the optimizer itself, and a pre-hook may return
  `(new_args, new_kwargs)` to replace the call's arguments.
  """

  @functools.wraps(step)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    self = args[0]
    global_pre_hooks, global_post_hooks = global_step_hooks()
    for pre_hook in global_pre_hooks + list(self._optimizer_step_pre_hooks.values()):
      result = pre_hook(self, args, kwargs)
      if result is not None:
        if isinstance(result, tuple) and len(result) == 2:
          args, kwargs = result
        else:
          raise RuntimeError(
            f"{step} must return None or a tuple of (new_args, new_kwargs), but got {result}."
          )
    out = step(*args, **kwargs)
    for post_hook in list(self._optimizer_step_post_hooks.values()) + global_post_hooks:
      post_hook(self, args, kwargs)
    return out

  return wrapper


class HookRegistry:
  """The `register_*_hook` methods of `torch.optim.Optimizer`, over the dicts in `HOOK_DICTS`.

  The optimizer creates the six `OrderedDict`s; each method adds a hook to one
  and returns a `RemovableHandle` whose `remove()` unregisters it. The state-dict
  methods take `prepend`: run the hook before those already registered instead
  of after.
  """

  # hook id -> hook, in the order they run (made by the optimizer's __init__).
  _optimizer_step_pre_hooks: OrderedDict[int, Callable]
  _optimizer_step_post_hooks: OrderedDict[int, Callable]
  _optimizer_state_dict_pre_hooks: OrderedDict[int, Callable]
  _optimizer_state_dict_post_hooks: OrderedDict[int, Callable]
  _optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable]
  _optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable]

  def register_step_pre_hook(self, hook: Callable) -> RemovableHandle:
    """Registers `hook(optimizer, args, kwargs) -> None | (new_args, new_kwargs)` before step."""
    return register(self._optimizer_step_pre_hooks, hook)

  def register_step_post_hook(self, hook: Callable) -> RemovableHandle:
    """Registers `hook(optimizer, args, kwargs) -> None` after step."""
    return register(self._optimizer_step_post_hooks, hook)

  def register_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
    """Registers `hook(optimizer) -> None`, run when `state_dict()` starts."""
    return register(self._optimizer_state_dict_pre_hooks, hook, prepend=prepend)

  def register_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
    """Registers `hook(optimizer, state_dict) -> None | state_dict`, run on the result.

    The hook may edit the dict or return a replacement.
    """
    return register(self._optimizer_state_dict_post_hooks, hook, prepend=prepend)

  def register_load_state_dict_pre_hook(
    self, hook: Callable, prepend: bool = False
  ) -> RemovableHandle:
    """Registers `hook(optimizer, state_dict) -> None | state_dict`, run before loading.

    The hook gets a shallow copy of the dict given to `load_state_dict`; it may
    edit it or return a replacement to load.
    """
    return register(self._optimizer_load_state_dict_pre_hooks, hook, prepend=prepend)

  def register_load_state_dict_post_hook(
    self, hook: Callable, prepend: bool = False
  ) -> RemovableHandle:
    """Registers `hook(optimizer) -> None`, run after a successful load."""
    return register(self._optimizer_load_state_dict_post_hooks, hook, prepend=prepend)
