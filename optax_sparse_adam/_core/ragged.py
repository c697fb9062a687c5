"""Ragged ids at a few static sizes: `pad_ids`, and the warning when a step keeps recompiling.

Under `jax.jit` the number of ids is part of the step's shape: a batch of bags
with a new total of ids compiles the step anew. `pad_ids` pads 1-D (or 2-D) ids
with an out-of-range id to one of a few sizes; every lookup and bag of the
library leaves such ids out (a zero row, no gradient entry that any optimizer
applies), so the padded step's results are those of the unpadded one, bit for
bit. `note_traced_ids` counts, per table shape, the id counts that traced
lookups have seen, and warns once where they keep changing.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

# A lookup of one table traced for more distinct id counts than this warns, once.
RECOMPILE_WARNING_THRESHOLD = 16

_LOCK = threading.Lock()
_SEEN: dict[tuple, set[tuple[int, ...]]] = {}
_WARNED: set[tuple] = set()


class RaggedIdsWarning(UserWarning):
  """A table's lookups were traced for many different id counts: the step recompiles."""


def bucket_size(count: int, sizes: Sequence[int] | None = None, *, minimum: int = 8) -> int:
  """The static size `count` ids are padded to: the smallest of `sizes` that holds them.

  Args:
    count: the number of ids.
    sizes: the allowed sizes; None: powers of two (at least `minimum`).
    minimum: the smallest power of two, with `sizes=None`.

  Returns:
    The size, at least `count`.

  Example:
    >>> import optax_sparse_adam as osa
    >>> osa.bucket_size(539), osa.bucket_size(771), osa.bucket_size(539, [768, 1024])
    (1024, 1024, 768)
  """
  if count < 0:
    raise ValueError(f"bucket_size: count must be >= 0, got {count}")
  if sizes is None:
    size = max(int(minimum), 1)
    while size < count:
      size *= 2
    return size
  fitting = sorted(int(s) for s in sizes if int(s) >= count)
  if not fitting:
    raise ValueError(
      f"bucket_size: {count} ids do not fit the largest of the sizes {sorted(sizes)}; "
      "add a larger size"
    )
  return fitting[0]


def pad_ids(
  ids: Any, sizes: Sequence[int] | int | None = None, *, pad_id: int = -1, axis: int = -1
) -> np.ndarray:
  """Pads ids with `pad_id` to a static size, so that ragged batches share one compiled step.

  For 1-D ids with `offsets` (torch's `EmbeddingBag(input, offsets)`), the padding
  goes after the last bag and the offsets stay as they are: without
  `include_last_offset` the last bag runs to the end of the ids, and leaves the
  padding out; with it, the last offset ends the last bag before the padding. For
  2-D ids `(B, N)` it pads each bag (`axis=-1`). A negative `pad_id` (or one at
  least the table's rows) reads a zero row, is left out of every bag (not summed,
  not counted by 'mean') and adds no row to the BCOO gradient: the padded step's
  results are those of the unpadded step, bit for bit.

  Args:
    ids: integer ids (NumPy or JAX, on the host: call it outside `jit`).
    sizes: an int (pad to exactly that), a sequence of allowed sizes (pad to the
      smallest that holds the ids), or None (the next power of two, at least 8).
    pad_id: the padding id; keep it out of `[0, num_embeddings)`.
    axis: the axis to pad.

  Returns:
    A NumPy array of the ids' dtype, padded along `axis`.

  Example:
    >>> import numpy as np
    >>> import optax_sparse_adam as osa
    >>> osa.pad_ids(np.array([3, 1, 4, 1, 5]))
    array([ 3,  1,  4,  1,  5, -1, -1, -1])
    >>> osa.pad_ids(np.array([[2, 7], [1, 8]]), 3)
    array([[ 2,  7, -1],
           [ 1,  8, -1]])
  """
  host = np.asarray(ids)
  if not np.issubdtype(host.dtype, np.integer):
    raise TypeError(f"pad_ids: ids must be integers, got dtype {host.dtype}")
  if host.ndim == 0:
    raise ValueError("pad_ids: ids must have at least one axis, got a scalar")
  count = host.shape[axis]
  if isinstance(sizes, bool):
    raise TypeError("pad_ids: sizes must be an int, a sequence of ints or None, got a bool")
  if isinstance(sizes, (int, np.integer)):
    size = int(sizes)
    if size < count:
      raise ValueError(f"pad_ids: {count} ids do not fit size={size}")
  else:
    size = bucket_size(count, sizes)
  widths = [(0, 0)] * host.ndim
  widths[axis] = (0, size - count)
  return np.pad(host, widths, constant_values=np.asarray(pad_id, host.dtype))


def note_traced_ids(table: str, table_key: tuple, ids_shape: tuple[int, ...]) -> None:
  """Counts a traced lookup's id shape for its table; warns once past the threshold.

  `table` names the table in the warning; `table_key` identifies it across traces
  (its shape and dtype).
  """
  with _LOCK:
    seen = _SEEN.setdefault(table_key, set())
    seen.add(tuple(ids_shape))
    if len(seen) <= RECOMPILE_WARNING_THRESHOLD or table_key in _WARNED:
      return
    _WARNED.add(table_key)
    counts = sorted({int(np.prod(shape)) for shape in seen})
  warnings.warn(
    f"{table} has been looked up in traced steps with {len(seen)} different id shapes "
    f"(id counts from {counts[0]} to {counts[-1]}): under jax.jit each new shape compiles "
    "the step again. Pad the ids to a few sizes with optax_sparse_adam.pad_ids (padding "
    "ids are left out: the results do not change), e.g. "
    "ids = osa.pad_ids(ids, [512, 768, 1024]) with the offsets as they are.",
    RaggedIdsWarning,
    stacklevel=4,
  )


def reset_traced_ids() -> None:
  """Forgets the id shapes seen (tests start from nothing)."""
  with _LOCK:
    _SEEN.clear()
    _WARNED.clear()
