"""A row's sum in a fixed order, the one the CPU kernels compute (`osa.row_sum`).

XLA's own order for `jnp.sum` over a row is an implementation detail (it
depends on the vector width), so the package sums rows pairwise in a fixed
order instead: `pairwise_row_sum` here, `PairwiseSum` in the CPU kernels
(`ffi_common.h`). `row_sum` is that sum as a public helper, wrapped in a
`jax.jit` whose name the row program's compiler recognises in a rule's jaxpr
(`ROW_SUM_NAME`), so that it runs as one reduction op there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from optax_sparse_adam._core.row_rules.adam import rounded

# The name of `row_sum`'s jitted function: one `jit` equation in a jaxpr, whose params
# name it (`row_program_ops` reads it).
ROW_SUM_NAME = "osa_pairwise_row_sum"


def pairwise_row_sum(x: jax.Array) -> jax.Array:
  """The sum over axis 1 of `(n, w)` values in a fixed order: halves added until one is left.

  Each round adds the second half (`w // 2` values) to the first, element by
  element, and carries the odd last value along; the CPU kernels sum in the
  same order. Zero for `w == 0`.
  """
  if x.shape[1] == 0:
    return jnp.zeros(x.shape[:1], x.dtype)
  while x.shape[1] > 1:
    width = x.shape[1]
    half = width // 2
    summed = x[:, :half] + x[:, half : 2 * half]
    x = jnp.concatenate([summed, x[:, 2 * half :]], axis=1) if width % 2 else summed
  return x[:, 0]


def _osa_pairwise_row_sum(x: jax.Array) -> jax.Array:
  return pairwise_row_sum(x.reshape(x.shape[0], math.prod(x.shape[1:])))


_osa_pairwise_row_sum.__name__ = ROW_SUM_NAME
_jitted_row_sum = jax.jit(_osa_pairwise_row_sum)


def row_sum(x: jax.Array, *, opaque_zero: jax.Array | None = None) -> jax.Array:
  """The sum of each row of a block, in the fixed order the CPU fast path computes.

  The row sum the CPU fast path computes: use it in a rule so that the rule
  runs on the row program (`osa.row_program_report`); `jnp.sum` or `jnp.mean`
  over a row keeps the rule on the slower generic path, since XLA's own order
  of a sum is not fixed. The values of each row (all axes but the first,
  flattened in row-major order) are added pairwise: the second half added to
  the first, element by element, the odd last value carried along, until one
  value is left,

    row_sum(x)[i] = ((x[i, 0] + x[i, w/2]) + ...) + ...

  on every backend, jitted or not, under `vmap` and `grad`, with the same bits.

  Under `jax.jit` XLA may fuse a product into the first adds of the sum (one
  rounding for a product and a sum, and where it does so depends on its
  fusions): give the block's `opaque_zero` to round `x` where it stands first
  (an identity on its bits that XLA cannot see through), as the row program
  requires of a product summed under jit.

  Args:
    x: values of shape `(n, ...)`, a block's rows.
    opaque_zero: the block's `RowBlock.opaque_zero` (an int32 zero known only
      when the step runs), or None to sum `x` as it is given.

  Returns:
    The `(n,)` sums, in `x`'s dtype (zero for an empty row).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> osa.row_sum(jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    Array([ 6., 15.], dtype=float32)
  """
  x = jnp.asarray(x)
  if x.ndim < 1:
    raise ValueError(f"row_sum needs rows: an array of shape (n, ...), got shape {x.shape}")
  return _jitted_row_sum(rounded(x, opaque_zero))
