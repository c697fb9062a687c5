"""`Parameter`: a mutable holder of a jax.Array, in the role of `torch.nn.Parameter`."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import sparse

from optax_sparse_adam.torch_compat import _convert


@functools.cache
def _optimizable(dtype: Any) -> bool:
  # Cached: every step rebinds `data`, and the dtype checks cost more than the rebinding.
  return bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating))


class Parameter:
  """A parameter the torch-style optimizer updates: `.data` is rebound, never mutated.

  JAX arrays are immutable, so `SparseAdam.step()` replaces `.data` with the
  updated array and donates the old one: read `p.data` after each step rather
  than keeping the array from before.

  Attributes:
    data: the parameter's value, a dense `jax.Array` (floating or complex).
    grad: its gradient for the next step: a `jax.experimental.sparse.BCOO` of
      the same shape, or None.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_sparse_adam.torch_compat import Parameter
    >>> p = Parameter(jnp.zeros((4, 2)))
    >>> p.shape, p.dtype, p.grad
    ((4, 2), dtype('float32'), None)
  """

  def __init__(self, data: Any) -> None:
    self.data = data
    self.grad: Any = None

  @property
  def data(self) -> jax.Array:
    return self._data

  @data.setter
  def data(self, value: Any) -> None:
    if isinstance(value, Parameter):
      value = value.data
    if isinstance(value, sparse.BCOO):
      # torch's SparseAdam raises ValueError for a sparse parameter; same type here.
      raise ValueError(
        "SparseAdam requires dense parameter tensors: Parameter data must be a dense "
        "array, but got a BCOO (the gradients are the sparse ones)."
      )
    if _convert.is_torch_tensor(value):
      value = _convert.to_numpy(value)
    if not isinstance(value, jax.Array):
      value = jnp.asarray(value)
    if not _optimizable(value.dtype):
      raise TypeError(
        f"Parameter data must have a floating point (or complex) dtype, but got "
        f"{value.dtype}: only those can be optimized."
      )
    self._data = value

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self._data.shape)

  @property
  def dtype(self) -> Any:
    return self._data.dtype

  @property
  def ndim(self) -> int:
    return self._data.ndim

  def __deepcopy__(self, memo: dict[int, Any]) -> "Parameter":
    # As `torch.nn.Parameter`: the data is copied, the gradient is not.
    return Parameter(jnp.array(self._data, copy=True))

  def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
    # Pickled as `torch.nn.Parameter` is: the data, not the gradient.
    return (Parameter, (self._data,))

  def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
    import numpy as np

    return np.asarray(self._data, dtype=dtype)

  def __repr__(self) -> str:
    return f"Parameter containing:\n{self._data!r}"
