"""Transparent huge pages for large CPU tables: fewer TLB misses on random rows.

A masked step touches a few thousand rows at random places in tables of
hundreds of MB. With 4 KiB pages nearly every row is a TLB miss, and the page
walk costs more than the row itself; with 2 MiB pages a table's whole range
fits in the TLB. Measured here (V=4M, D=64, uniform ids): 2.57 ms -> 1.76 ms
a step. Linux only; the advice is kept by a buffer for its lifetime, and a
donated step keeps updating the same buffers in place.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, NamedTuple

import jax

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux >= 6.1: collapse now rather than in the background
_HUGE_PAGE_BYTES = 2 << 20


class HugePageAdvice(NamedTuple):
  """What `advise_huge_pages` did.

  Attributes:
    arrays: CPU buffers that were advised.
    advised_bytes: bytes of those buffers in whole, aligned 2 MiB pages.
    collapsed_bytes: of these, bytes moved to huge pages right away; the
      kernel's khugepaged collapses the rest in the background.
  """

  arrays: int
  advised_bytes: int
  collapsed_bytes: int


def _madvise():
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
  except (OSError, AttributeError):
    return None
  madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
  madvise.restype = ctypes.c_int
  return madvise


def advise_huge_pages(
  tree: Any, *, collapse: bool = True, min_bytes: int = 8 << 20
) -> HugePageAdvice:
  """Asks Linux to back the large CPU arrays of `tree` with transparent huge pages.

  Call it once on the params and the optimizer state after creating or
  restoring them, before training with a donated jitted step (which updates
  the same buffers in place). Values are unchanged; only the page size of
  their memory is. Arrays on other devices, smaller than `min_bytes`, or on
  systems without transparent huge pages are left alone.

  Args:
    tree: a pytree of arrays (params, optimizer state, or both).
    collapse: also collapse the advised memory into huge pages now
      (`MADV_COLLAPSE`, Linux >= 6.1; 0.5-2 s per GB), instead of waiting
      for khugepaged.
    min_bytes: smallest array to advise.

  Returns:
    A `HugePageAdvice` with what was done.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_sparse_adam as osa
    >>> params = {"table": jnp.zeros((1 << 16, 64))}  # 16 MiB
    >>> opt = osa.sparse_adam(1e-3)
    >>> state = opt.init(params)
    >>> advice = osa.advise_huge_pages((params, state))
    >>> advice.arrays <= 3 and advice.collapsed_bytes <= advice.advised_bytes
    True
  """
  buffers = []
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, jax.Array):
      continue
    for shard in leaf.addressable_shards:
      if shard.device.platform == "cpu" and shard.data.nbytes >= min_bytes:
        buffers.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
  return advise_memory(buffers, collapse=collapse)


def advise_memory(buffers: list[tuple[int, int]], *, collapse: bool = True) -> HugePageAdvice:
  """`advise_huge_pages` for raw `(address, nbytes)` buffers (a torch tensor's, say)."""
  madvise = _madvise()
  arrays = advised = collapsed = 0
  if madvise is None:
    return HugePageAdvice(0, 0, 0)
  for pointer, nbytes in buffers:
    start = -(-pointer // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    end = (pointer + nbytes) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if end <= start or madvise(start, end - start, _MADV_HUGEPAGE) != 0:
      continue
    arrays += 1
    advised += end - start
    if collapse and madvise(start, end - start, _MADV_COLLAPSE) == 0:
      collapsed += end - start
  return HugePageAdvice(arrays, advised, collapsed)
