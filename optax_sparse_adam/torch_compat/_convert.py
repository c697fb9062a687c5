"""Moving arrays and checkpoints between torch and JAX; torch is imported only when used.

A torch tensor is recognised through `sys.modules`: if one was passed in, torch
is already imported, so nothing here imports torch just to convert.
"""

import os
import pickle
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

from optax_sparse_adam.torch_compat import _atomic_file

_TORCH_MISSING = (
  "{what} needs torch, which is not installed: pip install 'optax_sparse_adam[torch]'."
)


def is_torch_tensor(x: Any) -> bool:
  torch = sys.modules.get("torch")
  return torch is not None and isinstance(x, torch.Tensor)


def is_sparse_param(x: Any) -> bool:
  """Whether `x` is a sparse tensor given as a parameter: a BCOO, or torch's `is_sparse` (COO)."""
  return isinstance(x, sparse.BCOO) or (is_torch_tensor(x) and bool(x.is_sparse))


def is_array(x: Any) -> bool:
  """Whether `x` is an array: jax, numpy or torch (Python numbers are not)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) or is_torch_tensor(x)


def to_numpy(x: Any) -> np.ndarray:
  """A host NumPy array of a jax, numpy or torch array; bfloat16 survives the trip."""
  if is_torch_tensor(x):
    import torch

    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
      return x.view(torch.int16).numpy().view(jnp.bfloat16)
    return x.numpy()
  return np.asarray(x)


def _to_torch_tensor(x: Any) -> Any:
  import torch

  host = np.array(x, copy=True)
  if host.dtype == jnp.bfloat16:
    return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
  return torch.from_numpy(host)


def state_dict_to_torch(state_dict: Mapping[str, Any]) -> dict[str, Any]:
  """A copy of a state dict with every array (jax or numpy) turned into a torch tensor.

  The result loads into `torch.optim.SparseAdam.load_state_dict` and saves with
  `torch.save`. Python numbers (such as `'step'`) and strings stay as they are.

  Args:
    state_dict: a dict from `SparseAdam.state_dict()`.

  Returns:
    The same nesting of dicts, lists and tuples, holding torch tensors.
  """
  try:
    import torch  # noqa: F401
  except ImportError as err:
    raise ImportError(_TORCH_MISSING.format(what="state_dict_to_torch")) from err

  def convert(value: Any) -> Any:
    if isinstance(value, Mapping):
      return {k: convert(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return type(value)(convert(v) for v in value)
    if isinstance(value, (jax.Array, np.ndarray)):
      return _to_torch_tensor(value)
    return value

  return convert(state_dict)


def save_torch_checkpoint(state_dict: Mapping[str, Any], path: str | os.PathLike | Any) -> None:
  """Writes a state dict with `torch.save`, arrays as torch tensors, for `torch.load`.

  Crash-safe: the checkpoint is written to a temporary file in the same
  directory, flushed and fsynced, then renamed over `path`. A crash, a kill or
  a full disk during the save leaves the previous file at `path` intact.

  Args:
    state_dict: a dict from `SparseAdam.state_dict()` (or any nesting of them).
    path: the file to write; a binary file object (e.g. `io.BytesIO`) is
      written to directly, as `torch.save` does, with no crash safety.
  """
  import torch

  tensors = state_dict_to_torch(state_dict)
  if hasattr(path, "write"):
    torch.save(tensors, path)
    return
  _atomic_file.write_atomically(path, lambda file: torch.save(tensors, file))


def load_torch_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
  """Reads a file written by `torch.save`, safely: `torch.load(weights_only=True)` only.

  Only tensors, numbers, strings and containers load; a file that needs
  arbitrary Python objects unpickled is refused. Tensors are mapped to the CPU.
  Pass the result (or its optimizer entry) to `SparseAdam.load_state_dict`.

  Args:
    path: a file written by `torch.save`, e.g. of `optimizer.state_dict()`.

  Returns:
    The dict saved in the file, holding torch tensors.

  Raises:
    ImportError: torch is not installed.
    ValueError: the file is not a torch checkpoint, needs unsafe unpickling, or
      does not hold a dict.
  """
  try:
    import torch
  except ImportError as err:
    raise ImportError(_TORCH_MISSING.format(what="load_torch_checkpoint")) from err
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No checkpoint file at {os.fspath(path)!r}.")
  try:
    obj = torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as err:
    if "weights_only" in str(err) or "Weights only" in str(err):
      raise ValueError(
        f"{os.fspath(path)!r} holds Python objects that only a full unpickle can "
        "restore; load_torch_checkpoint reads with torch.load(weights_only=True) "
        "and never unpickles arbitrary objects. Save only state dicts (tensors, "
        "numbers, strings, containers)."
      ) from err
    raise ValueError(_not_a_checkpoint(path, err)) from err
  except Exception as err:  # torch raises RuntimeError, EOFError, ... for non-checkpoints
    raise ValueError(_not_a_checkpoint(path, err)) from err
  if not isinstance(obj, dict):
    raise ValueError(
      f"{os.fspath(path)!r} holds a {type(obj).__name__}, not a dict; expected a "
      "checkpoint saved from optimizer.state_dict() (or a dict holding one)."
    )
  return obj


def _not_a_checkpoint(path: Any, err: BaseException) -> str:
  reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
  return (
    f"{os.fspath(path)!r} is not a torch checkpoint: torch.load could not read it "
    f"({type(err).__name__}: {reason}). Expected a file written by torch.save."
  )
