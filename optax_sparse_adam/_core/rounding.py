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

The parameter. A bfloat16 or float16 table rounded to nearest loses every
update below half an ulp of its value (lr 1e-3 against weights near 1: most
of them). With `param_rounding="stochastic"` the new rows `w + delta` (float32)
are rounded to the table's dtype up or down, up with probability the dropped
fraction, so `E[stored] = w + delta`. The parameter has its own place in the
stream: slot index `-1` (`PARAM_SLOT`), which no moment pair uses (pairs start
at 0), so its key is `a = fmix32(t * 0x9E3779B9)` (the salt `(p + 1) * ...` is
0), and it takes the element hash's top half, `u = h >> 16`, with `r` the global
row and `j` the element of the row as above. From `u`:

  bfloat16:  bits = (f32 bits + u) >> 16                  (as a moment)
  float16, |x| >= 2^-14 (normal):
             bits = (f32 bits + (u >> 3)) & ~0x1FFF, as float16   (13 dropped bits,
                                                          so P(up) is exact)
  float16, |x| < 2^-14 (subnormal, ulp 2^-24):
             a = |x| * 2^24, k = floor(a), f = a - k
             |result| = (k + (floor(f * 2^16) + u >= 2^16)) * 2^-24, x's sign

that is, in every case: round up iff `floor(2^16 * dropped fraction of an ulp) + u
>= 2^16`. That probability is the dropped fraction exactly for bfloat16 and
normal float16 values, and within 2^-16 of it for float16's subnormals (whose
dropped fraction has more than 16 bits). A finite `x` beyond the largest
finite value of the dtype is stored as that value, with `x`'s sign (saturated:
float16's is 65504, small enough for an update to reach; a cast to nearest
would store inf, and the next step NaN); NaN and inf are stored as a cast
stores them. The step keys on `t`, the parameter's step count after the step,
as the moments' do. (The float16 bits operate on `|x|` and take `x`'s sign
back; for bfloat16 adding to the signed word is the same.) The rows are rounded
by these XLA ops on every path: after the fused CPU kernel's step (its delta is
the XLA ops' delta, bit for bit), inside `xla.masked_step` on the other paths;
the row-store kernel (`row_store.cc`) and the apply's scatter only move the
rounded bits.
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
ParamRounding = Literal["nearest", "stochastic"]
ROUNDINGS = ("nearest", "stochastic")
# The parameter's place in the hash's stream: a slot index no moment pair uses.
PARAM_SLOT = -1
# The table dtypes stochastic rounding of the parameter rounds to; wider floats
# (float32, float64) hold `w + delta` as computed: the option changes nothing.
ROUNDED_PARAM_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

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


def stochastic_round(x: jax.Array, bits16: jax.Array, dtype: Any) -> jax.Array:
  """`x` (float32) rounded to `dtype` (bfloat16 or float16) up or down, unbiased, saturating.

  The parameter's rounding (module docstring): up with probability the dropped
  fraction of an ulp, read from `bits16` (uniform integers in `[0, 2^16)`, of
  `x`'s shape); a finite value beyond the dtype's largest is stored as the
  largest with its sign; NaN and inf round to nearest.
  """
  dtype = jnp.dtype(dtype)
  x = x.astype(jnp.float32)
  finite = jnp.isfinite(x)
  biggest = jnp.asarray(jnp.finfo(dtype).max, jnp.float32)
  if dtype == jnp.dtype(jnp.bfloat16):
    word = lax.bitcast_convert_type(x, jnp.uint32)
    up = lax.bitcast_convert_type(((word + bits16) >> 16).astype(jnp.uint16), jnp.bfloat16)
    saturated = jnp.where(jnp.isinf(up), jnp.copysign(biggest, x).astype(dtype), up)
    return jnp.where(finite, saturated, x.astype(dtype))
  if dtype != jnp.dtype(jnp.float16):
    raise ValueError(f"stochastic rounding to {dtype}: expected bfloat16 or float16")
  magnitude = jnp.abs(x)
  word = lax.bitcast_convert_type(magnitude, jnp.uint32)
  # Normal float16 values: 13 dropped bits, rounded up by 13 random bits.
  normal = lax.bitcast_convert_type((word + (bits16 >> 3)) & np.uint32(0xFFFFE000), jnp.float32)
  # Subnormal ones: whole ulps (2^-24) and the dropped fraction, exact in float32.
  scaled = magnitude * np.float32(2.0**24)
  whole = jnp.floor(scaled)
  fraction = ((scaled - whole) * np.float32(65536.0)).astype(jnp.uint32)
  carry = (fraction + bits16 >= np.uint32(65536)).astype(jnp.float32)
  subnormal = (whole + carry) * np.float32(2.0**-24)
  rounded_magnitude = jnp.where(magnitude < np.float32(2.0**-14), subnormal, normal)
  rounded_magnitude = jnp.minimum(rounded_magnitude, biggest)
  return jnp.where(finite, jnp.copysign(rounded_magnitude, x).astype(dtype), x.astype(dtype))


def param_store(
  rounding: str,
  *,
  dtype: Any,
  step: jax.Array | None,
  rows: jax.Array,
  row_offset: jax.Array | None = None,
) -> Callable[[jax.Array], jax.Array]:
  """The parameter's new rows `(n, ...)` (float32) -> the table's dtype, as `rounding` asks.

  "stochastic" to a bfloat16 or float16 table draws the parameter's bits
  (`PARAM_SLOT`, top half) at `step` for `rows` (+ `row_offset`); anything else
  is a cast (to nearest; exact for float32 from float32).
  """

  def store(x: jax.Array) -> jax.Array:
    if rounding != "stochastic" or jnp.dtype(dtype) not in ROUNDED_PARAM_DTYPES:
      return x.astype(dtype)
    if step is None:
      raise ValueError("stochastic rounding of the parameter needs its step count")
    n = x.shape[0]
    row_size = int(np.prod(x.shape[1:], dtype=np.int64))
    bits = random_bits(step_key(step, PARAM_SLOT), rows, row_size, row_offset)
    return stochastic_round(x.reshape(n, row_size), bits, dtype).reshape(x.shape)

  return store


def check_param_rounding(rounding: str, dtype: Any, path: Sequence[Any]) -> ParamRounding:
  """The rounding a table of `dtype` gets: "stochastic" for bf16/f16, else "nearest".

  Refuses stochastic rounding of a table dtype it does not serve (8-bit floats:
  neither rounded nor exact), naming the parameter; float32 and wider hold the
  new rows as computed, so the option changes nothing there.
  """
  if rounding != "stochastic":
    return "nearest"
  dtype = jnp.dtype(dtype)
  if dtype in ROUNDED_PARAM_DTYPES:
    return "stochastic"
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 32:
    return "nearest"
  raise ValueError(
    f"param_rounding='stochastic' rounds bfloat16 and float16 tables (float32 and wider "
    f"need no rounding), but the parameter at {path_str(path)} is {dtype}: store it in "
    "one of those, or pass param_rounding='nearest'."
  )


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
