"""How a rule's new slot rows are rounded to their storage dtype: to nearest, or stochastically.

A moment kept in bfloat16 has 8 significant bits. Rounded to nearest, an
update smaller than half a bf16 ulp of the moment is lost every time: with
`b2 = 0.999`, `v += 0.001 * (g^2 - v)` changes `v` by less than half an ulp
(2^-9 relative) whenever `|g^2 - v| < 2 v`, so `v` stalls instead of tracking
`g^2`, and `m` stalls likewise once its steps fall below 2^-9 of its size.
Stochastic rounding rounds up with probability equal to the dropped fraction,
so the stored moment is unbiased: `E[round(x)] = x`, and small updates
accumulate in expectation.

The random bits come from a counter-based hash, not a PRNG state. Slots go
in pairs, `(0, 1)`, `(2, 3)`, ... (Adam's mu and nu); a rounding needs 16
random bits and the hash gives 32, so a pair shares one hash. For the pair's
first slot `p` (even), the parameter's step count `t`, row `r` and element
`j` of the row,

  a = fmix32(t * 0x9E3779B9 + (p + 1) * 0x27D4EB2F)      (per step and pair)
  b = fmix32(a ^ (r * 0x85EBCA77))                       (per row)
  h = fmix32(b ^ (j * 0xC2B2AE3D))                       (32 bits per element)
  u = h >> 16          (slot p: 16 random bits)
  u = h & 0xFFFF       (slot p + 1)
  bf16 bits = (f32 bits + u) >> 16                       (finite values; NaN and
                                                          inf round to nearest)

with 32-bit wrapping arithmetic and `fmix32` MurmurHash3's finalizer (whose
last `x ^ (x >> 16)` mixes the low half). A one-slot rule's slot is slot 0:
it takes `h >> 16`. A per-row slot (row-wise Adam's nu) has one element,
`j = 0`. `r` is
the global row: a shard of a row-split table adds its first row
(`StepInputs.row_offset`), so a routed step draws one device's bits. Two runs
give the same bits, and a run resumed from a checkpoint (which holds the step
count) continues the same stream. The CPU kernels (`kernels.cc`) compute the
same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_sparse_adam._core.errors import path_str

MomentRounding = Literal["nearest", "stochastic"]
ROUNDINGS = ("nearest", "stochastic")

# A slot's rows in the rule's compute dtype -> in the slot's storage dtype.
SlotStore = Callable[[str, jax.Array], jax.Array]

_STEP_MULTIPLIER = 0x9E3779B9
_SLOT_MULTIPLIER = 0x27D4EB2F
_ROW_MULTIPLIER = 0x85EBCA77
_ELEMENT_MULTIPLIER = 0xC2B2AE3D


def fmix32(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer: a bijection of uint32 with full avalanche."""
  x = x ^ (x >> 16)
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def step_key(step: jax.Array, slot_index: int) -> jax.Array:
  """`a` of the module docstring: the uint32 key of one slot at one step."""
  t = jnp.asarray(step).astype(jnp.uint32)
  salt = np.uint32(((slot_index + 1) * _SLOT_MULTIPLIER) & 0xFFFFFFFF)
  return fmix32(t * np.uint32(_STEP_MULTIPLIER) + salt)


def hash_half(slot_names: Sequence[str], name: str) -> tuple[int, bool]:
  """Where slot `name` draws its bits: its pair's first slot (`step_key`'s index) and
  whether it takes the element hash's low half (a pair's second slot)."""
  index = list(slot_names).index(name)
  return index - index % 2, index % 2 == 1


def kernel_keys(step: jax.Array | None, pair: int, row_offset: Any = None) -> jax.Array:
  """uint32 `(2,)` for the CPU kernels: the pair's key at `step` (None: 0) and the
  tables' first global row (`row_offset`, None: 0)."""
  t = jnp.zeros((), jnp.int32) if step is None else step
  offset = 0 if row_offset is None else row_offset
  return jnp.stack([step_key(t, pair), jnp.asarray(offset).astype(jnp.uint32)])


def random_bits(
  key: jax.Array,
  rows: jax.Array,
  row_size: int,
  row_offset: jax.Array | None = None,
  *,
  low: bool = False,
) -> jax.Array:
  """16 random bits (as uint32) per element of `(n, row_size)` rows, from a step key.

  `row_offset` (int32 scalar, or None: 0) is added to `rows`: a shard's rows
  then hash as the global rows they are. The bits are the element hash's top
  half (`h >> 16`), or with `low` its low half (`h & 0xFFFF`: a pair's second
  slot).
  """
  r = rows.astype(jnp.uint32)
  if row_offset is not None:
    r = r + jnp.asarray(row_offset).astype(jnp.uint32)
  row_keys = fmix32(key ^ (r * np.uint32(_ROW_MULTIPLIER)))
  elements = lax.iota(jnp.uint32, row_size) * np.uint32(_ELEMENT_MULTIPLIER)
  h = fmix32(row_keys[:, None] ^ elements[None, :])
  return h & np.uint32(0xFFFF) if low else h >> 16


def stochastic_round_to_bf16(x: jax.Array, bits16: jax.Array) -> jax.Array:
  """`x` (float32) rounded to bfloat16 up or down, up with probability the dropped fraction.

  `bits16` are uniform integers in `[0, 2^16)`, of `x`'s shape. NaN and inf
  round to nearest (they would otherwise change class).
  """
  x = x.astype(jnp.float32)
  word = lax.bitcast_convert_type(x, jnp.uint32)
  rounded = lax.bitcast_convert_type(((word + bits16) >> 16).astype(jnp.uint16), jnp.bfloat16)
  return jnp.where(jnp.isfinite(x), rounded, x.astype(jnp.bfloat16))


def check_rounding(rounding: str, name: str = "moment_rounding") -> None:
  """Refuses a rounding other than "nearest" or "stochastic", naming the argument."""
  if rounding not in ROUNDINGS:
    raise ValueError(f"{name}={rounding!r}; expected one of {ROUNDINGS}.")


def check_slot_dtypes(
  rounding: str, dtypes: Mapping[str, Any], param_dtype: Any, path: Sequence[Any]
) -> None:
  """Refuses stochastic rounding to a slot dtype other than bf16 or float32 and wider.

  `dtypes` maps slot names to their dtype setting (None: the parameter's).
  """
  if rounding != "stochastic":
    return
  for name, dtype in dtypes.items():
    dtype = jnp.dtype(dtype or param_dtype)
    if dtype != jnp.bfloat16 and jnp.finfo(dtype).bits < 32:
      raise ValueError(
        f"moment_rounding='stochastic' rounds moments to bfloat16 only, but the {name} of "
        f"the parameter at {path_str(path)} would be {dtype}: set {name}_dtype=jnp.bfloat16 "
        "(or float32), or moment_rounding='nearest'."
      )


def slot_store(
  rounding: str,
  *,
  slot_names: tuple[str, ...],
  dtypes: dict[str, Any],
  step: jax.Array | None,
  rows: jax.Array,
  row_offset: jax.Array | None = None,
) -> SlotStore:
  """The pipeline's `store` for one step: new slot rows in compute dtype -> storage dtype.

  Args:
    rounding: "nearest" (`astype`) or "stochastic" (bf16 slots only; wider
      slots are stored exactly as with "nearest").
    slot_names: the rule's slots, in order (a slot's position picks its pair's
      key and its half of the pair's hash).
    dtypes: each slot's storage dtype.
    step: the parameter's step count of this step (needed for "stochastic").
    rows: int32 `(n,)` the rows of the block (the key's row counter).
    row_offset: int32 scalar added to `rows` in the key (a shard's first
      global row), or None (0).
  """

  def store(name: str, x: jax.Array) -> jax.Array:
    dtype = jnp.dtype(dtypes[name])
    if rounding != "stochastic" or dtype != jnp.bfloat16:
      return x.astype(dtype)
    if step is None:
      raise ValueError("stochastic rounding needs the parameter's step count")
    n = x.shape[0]
    row_size = int(np.prod(x.shape[1:], dtype=np.int64))
    pair, low = hash_half(slot_names, name)
    bits = random_bits(step_key(step, pair), rows, row_size, row_offset, low=low)
    return stochastic_round_to_bf16(x.reshape(n, row_size), bits).reshape(x.shape)

  return store


def nearest_store(slot_rows: Mapping[str, jax.Array]) -> SlotStore:
  """`store` by `astype` to each slot's dtype: round to nearest."""
  return lambda name, x: x.astype(slot_rows[name].dtype)
