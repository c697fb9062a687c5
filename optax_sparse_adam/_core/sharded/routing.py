"""Moving a row-sharded table's gradient rows to the devices that own them, in fixed shapes.

The functions here run on one device's shard, inside `jax.shard_map` over one
mesh axis of `num_shards` devices. Device `k` owns the table rows
`[k * rows_per_shard, (k + 1) * rows_per_shard)` (the block placement of
`P(axis, None)`). Every array has a static shape:

  bucket_by_owner   a device's coalesced rows, split into `num_shards` buckets
                    of `capacity` slots, one per owner (distinct rows of one
                    owner are contiguous in ascending order, so a bucket is a
                    slice); `overflow` says a bucket needed more slots.
  exchange          one `all_to_all`: bucket `d` of every device goes to device
                    `d`; float32 rows carry their ids bit-cast in one more
                    word, so one collective carries both (two otherwise;
                    bfloat16 and float16 rows as their uint16 bits, `as_bits`).
  gather_all        the overflow path: every device's entries on every device
                    (`all_gather`, in global input order).
  spread_rows       the overflow path: owners' distinct rows placed in global
                    slots, `slots` per device (`psum_scatter`).

Only `jax.lax` collectives over `axis` are used, so a step lowers on any
backend; `ragged_all_to_all` is avoided because XLA:CPU does not implement it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_sparse_adam._core.bcoo import CoalescedRows


class Buckets(NamedTuple):
  """A device's distinct rows sorted into one bucket per owner.

  Attributes:
    rows: int32 `(num_shards * capacity,)` global row ids, bucket `d` at
      `[d * capacity, (d + 1) * capacity)`; unused slots hold `num_rows`.
    values: `(num_shards * capacity, *dense_shape)` summed gradient rows; zero
      in unused slots.
    overflow: bool scalar: some owner has more distinct rows than `capacity`
      (the buckets then miss rows and must not be used).
  """

  rows: jax.Array
  values: jax.Array
  overflow: jax.Array


# The default capacity's margin over the even share, in standard deviations of
# how many of a device's uniform ids one owner gets (a bucket overflows about
# once in 1e9 at this margin).
UNIFORM_MARGIN_SIGMAS = 6.0
# The default capacity's largest multiple of the even share.
DEFAULT_MAX_FACTOR = 2.0


def capacity(local_entries: int, num_shards: int, capacity_factor: float | None) -> int:
  """Slots per owner for a device with `local_entries` entries.

  `capacity_factor` times the even share `share = local_entries / num_shards`;
  None sizes it for uniform ids: the share plus `UNIFORM_MARGIN_SIGMAS`
  standard deviations of the binomial count an owner gets,
  `share + 6 * sqrt(share * (1 - 1 / num_shards))`, at most twice the share.
  At least the share and at most `local_entries` either way (a device cannot
  send one owner more distinct rows than it has entries, so at that size no
  step overflows).

  The default's margin shrinks relative to the share as the share grows: 1.35
  times the share for 2048 entries on 8 devices, 1.13 times on 2, where twice
  the share would send 1.5 to 1.8 times its bytes for no fewer overflowing
  steps of uniform ids; below 36 entries per owner it is twice the share.
  """
  share = local_entries / num_shards
  if capacity_factor is None:
    spread = math.sqrt(share * (1 - 1 / num_shards))
    factor_share = min(DEFAULT_MAX_FACTOR * share, share + UNIFORM_MARGIN_SIGMAS * spread)
  else:
    factor_share = capacity_factor * share
  wanted = math.ceil(factor_share)
  return max(1, min(local_entries, max(math.ceil(share), wanted)))


def bucket_by_owner(
  coalesced: CoalescedRows, *, num_rows: int, num_shards: int, capacity: int
) -> Buckets:
  """Splits a device's coalesced rows (`bcoo.coalesce_rows`) into per-owner buckets.

  Args:
    coalesced: distinct global rows ascending, then padding rows `>= num_rows`.
    num_rows: the table's rows (all shards).
    num_shards: the devices along the axis; `num_rows % num_shards == 0`.
    capacity: slots per owner.

  Returns:
    The `Buckets`.
  """
  rows_per_shard = num_rows // num_shards
  # Owners' rows are contiguous in the ascending distinct rows: bucket d starts
  # where the first row of shard d would be inserted.
  bounds = jnp.arange(num_shards + 1, dtype=jnp.int32) * rows_per_shard
  starts = jnp.searchsorted(coalesced.rows, bounds, side="left", method="compare_all")
  counts = starts[1:] - starts[:-1]
  slot = jnp.arange(capacity, dtype=jnp.int32)
  position = (starts[:-1, None] + slot[None, :]).reshape(-1)
  used = (slot[None, :] < counts[:, None]).reshape(-1)
  position = jnp.where(used, position, 0)
  rows = jnp.where(used, coalesced.rows[position], jnp.int32(num_rows))
  values = coalesced.values[position]
  values = jnp.where(expand(used, values.ndim), values, jnp.zeros((), values.dtype))
  return Buckets(rows, values, jnp.any(counts > capacity))


def exchange(
  rows: jax.Array, values: jax.Array, axis: str, *, max_row: int
) -> tuple[jax.Array, jax.Array]:
  """Sends bucket `d` of `(rows, values)` to device `d` along `axis`.

  Args:
    rows: int32 `(num_shards * capacity,)`, each at most `max_row`.
    values: `(num_shards * capacity, *dense_shape)` of a floating dtype.
    axis: the mesh axis name.
    max_row: a bound on `rows`.

  Returns:
    `(rows, values)` received, the same shapes: slots `[s * capacity, (s + 1) *
    capacity)` came from device `s`, so summing a row's slots in order adds the
    senders' sums in device order. 16-bit float values come as their bits (`as_bits`).
  """
  if _packs(values, max_row):
    received = lax.all_to_all(_pack(rows, values), axis, 0, 0, tiled=True)
    return _unpack(received, values)
  return (
    lax.all_to_all(rows, axis, 0, 0, tiled=True),
    lax.all_to_all(as_bits(values), axis, 0, 0, tiled=True),
  )


def gather_all(
  rows: jax.Array, values: jax.Array, axis: str, *, max_row: int
) -> tuple[jax.Array, jax.Array]:
  """Every device's `(rows, values)`, concatenated in device order (global input order)."""
  if _packs(values, max_row):
    return _unpack(lax.all_gather(_pack(rows, values), axis, axis=0, tiled=True), values)
  return (
    lax.all_gather(rows, axis, axis=0, tiled=True),
    from_bits(lax.all_gather(as_bits(values), axis, axis=0, tiled=True), values.dtype),
  )


def to_local(rows: jax.Array, shard: jax.Array, rows_per_shard: int) -> jax.Array:
  """Global row ids as ids of shard `shard`'s block; rows of other blocks become padding.

  Padding is `rows_per_shard`, out of range of the block, so every scatter drops it.
  """
  local = rows - shard * rows_per_shard
  return jnp.where((local >= 0) & (local < rows_per_shard), local, jnp.int32(rows_per_shard))


def spread_rows(
  rows: jax.Array,
  values: jax.Array,
  first_slot: jax.Array,
  *,
  axis: str,
  slots: int,
  num_rows: int,
) -> tuple[jax.Array, jax.Array]:
  """Places each device's rows in global slots from `first_slot` on, `slots` per device.

  The in-range rows of `rows` (first, as a rows step returns them) take global
  slots `first_slot, first_slot + 1, ...`; device `d` gets back slots
  `[d * slots, (d + 1) * slots)`. Devices must give disjoint slot ranges.

  Args:
    rows: int32 `(n,)` global row ids, in-range ones first, then padding.
    values: `(n, *dense_shape)` their values.
    first_slot: int32 scalar, this device's first global slot.
    axis: the mesh axis name.
    slots: slots per device.
    num_rows: the table's rows; ids `>= num_rows` are padding.

  Returns:
    `(ids, values)` of this device's slots: `ids` holds row id + 1, 0 where no
    row landed (`decode_rows` turns them into row ids); 16-bit float values as their
    bits (`as_bits`).
  """
  total = lax.axis_size(axis) * slots
  valid = rows < num_rows
  target = jnp.where(valid, first_slot + jnp.arange(rows.shape[0], dtype=jnp.int32), total)
  # One contributor per slot and zeros elsewhere: the sums below are exact.
  ids = jnp.zeros((total,), jnp.int32).at[target].set(rows + 1, mode="drop")
  # A 16-bit float's bits summed as integers: one contributor and zeros, so exact too
  # (and -0.0 and NaN payloads kept, which a float sum with +0.0 would not keep).
  bits = as_bits(values)
  vals = jnp.zeros((total,) + bits.shape[1:], bits.dtype).at[target].set(bits, mode="drop")
  ids = lax.psum_scatter(ids, axis, scatter_dimension=0, tiled=True)
  return ids, lax.psum_scatter(vals, axis, scatter_dimension=0, tiled=True)


def owned_ids(local_rows: jax.Array, shard: jax.Array, rows_per_shard: int) -> jax.Array:
  """Shard `shard`'s block ids as global row id + 1; 0 for padding (see `spread_rows`)."""
  return jnp.where(local_rows < rows_per_shard, local_rows + shard * rows_per_shard + 1, 0)


def decode_rows(ids: jax.Array, shard: jax.Array, num_rows: int) -> jax.Array:
  """Row ids from `spread_rows`'s `ids`; an empty slot `i` gets padding unique on all devices.

  A device's padding slot `i` becomes `num_rows + shard * len(ids) + i`, so the
  update's indices stay unique across devices, as a BCOO update promises.
  """
  slots = ids.shape[0]
  padding = num_rows + shard * slots + jnp.arange(slots, dtype=jnp.int32)
  return jnp.where(ids > 0, ids - 1, padding)


def chunk(x: jax.Array, index: jax.Array, size: int, fill: int | float) -> jax.Array:
  """`x[index * size:(index + 1) * size]`, reading `fill` past the end of `x`."""
  rounds = -(-x.shape[0] // size)
  pad = [(0, rounds * size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
  padded = jnp.pad(x, pad, constant_values=fill)
  return lax.dynamic_slice_in_dim(padded, index * size, size)


def as_bits(x: jax.Array) -> jax.Array:
  """A bfloat16 or float16 array as its uint16 bits (free), any other as it is.

  XLA:CPU moves and selects bfloat16 through float32 (a conversion each way around
  every collective, select and loop carry); its bits move as they are.
  """
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
    return lax.bitcast_convert_type(x, jnp.uint16)
  return x


def from_bits(x: jax.Array, dtype) -> jax.Array:
  """The inverse of `as_bits` for an array of `dtype`."""
  if x.dtype == jnp.dtype(dtype):
    return x
  return lax.bitcast_convert_type(x, dtype)


def expand(mask: jax.Array, ndim: int) -> jax.Array:
  return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


# The first float32 bit pattern that is not a finite number: ids below it travel
# as float32 bits unchanged (NaN payloads could be rewritten on the way).
_FLOAT32_NONFINITE = 0x7F800000


def _packs(values: jax.Array, max_row: int) -> bool:
  """Whether ids can travel bit-cast in `values`' float32 words.

  Only float32: 16-bit words would hold NaN patterns for some ids, which XLA may
  canonicalize (XLA:CPU computes bfloat16 through float32).
  """
  return values.dtype == jnp.float32 and max_row < _FLOAT32_NONFINITE


def _pack(rows: jax.Array, values: jax.Array) -> jax.Array:
  """`(n, 1 + W)` float32: each row's id bit-cast, then its W values."""
  n = rows.shape[0]
  words = lax.bitcast_convert_type(rows.astype(jnp.int32), jnp.float32)[:, None]
  return jnp.concatenate([words, values.reshape(n, math.prod(values.shape[1:]))], axis=1)


def _unpack(packed: jax.Array, like: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The inverse of `_pack`; `like` gives the values' trailing shape."""
  rows = lax.bitcast_convert_type(packed[:, 0], jnp.int32)
  return rows, packed[:, 1:].reshape((packed.shape[0],) + like.shape[1:])


def int32_fits(num_rows: int, total_slots: int) -> bool:
  """Whether padding ids `num_rows + slot` of `total_slots` slots fit in int32."""
  return num_rows + total_slots <= np.iinfo(np.int32).max
