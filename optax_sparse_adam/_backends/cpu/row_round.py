"""The generic CPU kernels of 16-bit tables (`row_round.cc`): rows rounded once, in XLA's bits.

A bfloat16 or float16 table's new rows `round(w + delta)` (to nearest or
stochastically, `rounding.stochastic_round`), and its apply `w[rows] += delta`
in place: what a fused kernel's step needs on a 16-bit table, reading and
writing the table's 2 bytes a value. Registered with the other kernels
(`kernels.available`).
"""

import jax
import jax.numpy as jnp

from optax_sparse_adam._backends.cpu import kernels, moment_steps

# The tables `add_rounded_rows` and `add_rows_in_place` round to.
_ROUNDED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def rounds_rows(table: jax.Array, *, nse: int, num_rows: int) -> bool:
  """Whether `add_rounded_rows` and `add_rows_in_place` take `table` (bfloat16 or float16;
  as `store_applies` otherwise)."""
  return jnp.dtype(table.dtype) in _ROUNDED_DTYPES and kernels.store_applies(
    table, nse=nse, num_rows=num_rows
  )


def add_rounded_rows(
  table: jax.Array,
  rows: jax.Array,
  delta: jax.Array,
  keys: jax.Array,
  *,
  num_rows: int,
  stochastic: bool,
) -> jax.Array:
  """`round(table[rows] + delta)` in the table's dtype, `(nse, ...)`, zeros where a row is padding.

  `rows` are distinct where in range (a step's coalesced rows); `delta` is
  float32 (the step's update of those rows); `keys` (uint32 `(2,)`,
  `rounding.kernel_keys` at `PARAM_SLOT`) key the stochastic bits. The sum is
  float32, rounded once to nearest or stochastically (`rounding.stochastic_round`):
  `xla.rounded_param_rows`'s bits, reading 2 bytes a value of the table
  (`row_round.cc`).
  """
  nse = rows.shape[0]
  call = jax.ffi.ffi_call(
    kernels.ADD_ROUNDED_ROWS,
    jax.ShapeDtypeStruct((nse, *table.shape[1:]), table.dtype),
    vmap_method=moment_steps.VMAP_METHOD,
  )
  return call(
    rows.astype(jnp.int32),
    delta.astype(jnp.float32).reshape(nse, -1),
    table,
    keys.astype(jnp.uint32),
    num_rows=num_rows,
    stochastic=stochastic,
  )


def add_rows_in_place(
  table: jax.Array, rows: jax.Array, values: jax.Array, *, num_rows: int, rows_unique: bool
) -> jax.Array:
  """`table[rows] += values` for a bfloat16 or float16 table, in place; padding rows dropped.

  Each value is cast to the table's dtype first; a row's entries are added in
  float32 in input order and rounded once to nearest for bfloat16
  (`xla.scatter_add`'s path), at every add for float16 (XLA's scatter-add).
  `table` keeps its shape and is viewed as `num_rows` rows (`row_round.cc`).
  """
  if jnp.dtype(values.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(table.dtype)):
    values = values.astype(table.dtype)
  call = jax.ffi.ffi_call(
    kernels.ADD_ROWS_IN_PLACE,
    jax.ShapeDtypeStruct(table.shape, table.dtype),
    input_output_aliases={2: 0},
    vmap_method=moment_steps.VMAP_METHOD,
  )
  return call(
    rows.astype(jnp.int32),
    values.reshape(rows.shape[0], -1),
    table,
    num_rows=num_rows,
    rows_unique=rows_unique,
    round_each_add=jnp.dtype(table.dtype) == jnp.dtype(jnp.float16),
  )
