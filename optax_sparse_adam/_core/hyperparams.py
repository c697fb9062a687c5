"""The checks of the rules' hyper-parameters and slot dtypes, shared by every front end.

Ranges are checked in torch's order and wording where torch has the option
(`check_hyperparams` is torch's Adam constructor's; `check_nonnegative` any
rule's non-negative values); each rule's factory adds its own.
"""

from typing import Any

import jax
import jax.numpy as jnp

from optax_sparse_adam._core.errors import describe, is_python_number


def is_real_scalar(value: Any) -> bool:
  """A real number, or a 0-d array of a real dtype (as `optax.inject_hyperparams` passes)."""
  if is_python_number(value):
    return True
  dtype = getattr(value, "dtype", None)
  return (
    dtype is not None
    and getattr(value, "ndim", None) == 0
    and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
  )


def check_ranges(
  lr: Any, betas: Any, eps: Any, weight_decay: Any = 0.0, *, every_value: bool = False
) -> None:
  """torch.optim's range checks and messages, in its order, for the values that are numbers.

  Values that are arrays (traced, or given by `optax.inject_hyperparams`) are
  not checked: their values are not known here. With `every_value`, every value
  is compared as torch compares it (concrete values only): one that is no number
  fails with Python's TypeError, as in torch. `betas` is the pair `(b1, b2)`, read
  only when its check comes (after lr and eps), as torch reads it.
  """

  def checked(value: Any) -> bool:
    return every_value or is_python_number(value)

  if checked(lr) and not 0.0 < lr:
    raise ValueError(f"Invalid learning rate: {lr}")
  if checked(eps) and not 0.0 < eps:
    raise ValueError(f"Invalid epsilon value: {eps}")
  for index in (0, 1):
    beta = betas[index]
    if checked(beta) and not 0.0 <= beta < 1.0:
      raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
  if checked(weight_decay) and not 0.0 <= weight_decay:
    raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def known_number(value: Any) -> float | None:
  """A hyper-parameter's value where it is known now: a number or a concrete 0-d array.

  None for a schedule, a traced array (`optax.inject_hyperparams` calls a factory
  with concrete arrays in `init` and traced ones in a jitted `update`: the values
  are checked at `init`) or anything else.
  """
  if is_python_number(value):
    return value
  if callable(value) or isinstance(value, jax.core.Tracer) or jnp.ndim(value) != 0:
    return None
  return float(value)


def check_nonnegative(*named: tuple[str, Any], every_value: bool = False) -> None:
  """torch's `Invalid {name} value: {value}` checks, in the order given, of values >= 0.

  Args:
    *named: `(torch's name, value)` pairs; "lr" reads "learning rate", as in torch.
    every_value: compare every value as torch's constructors do (one that is no
      number fails with Python's TypeError); else only the values known now
      (`known_number`), as the optax factories do.
  """
  for name, value in named:
    known = value if every_value else known_number(value)
    if known is not None and not 0.0 <= known:
      label = "learning rate" if name == "lr" else f"{name} value"
      raise ValueError(f"Invalid {label}: {known}")


def check_hyperparams(
  learning_rate: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any = 0.0
) -> None:
  """torch's constructor checks, in torch's order and wording, for concrete numbers.

  Every hyper-parameter must be a real number or a 0-d real array; the values of
  arrays (as `optax.inject_hyperparams` passes) are not checked. Schedules are
  checked by the caller.
  """
  for name, value in (
    ("learning_rate", learning_rate),
    ("b1", b1),
    ("b2", b2),
    ("eps", eps),
    ("weight_decay", weight_decay),
  ):
    if not is_real_scalar(value):
      raise TypeError(
        f"Invalid {name}: {value!r} ({describe(value)}); expected a float or a "
        "0-d real array" + (", or an optax.Schedule." if name == "learning_rate" else ".")
      )
  check_ranges(learning_rate, (b1, b2), eps, weight_decay)


def moment_dtype(dtype: Any, name: str) -> Any:
  """`dtype` as a NumPy dtype, refused unless it is a real floating dtype."""
  if dtype is None:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as err:
    raise TypeError(f"Invalid {name}: {dtype!r} is not a dtype.") from err
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"Invalid {name}: {dtype}; expected a real floating dtype such as float32.")
  return dtype
