"""How often routed steps and lookups overflowed their capacity: counters on the host.

A routed step or lookup whose buckets overflow takes the all-gather path: the
same numbers, at the cost of the unrouted step. Nothing in its results shows
it, so each routed step and lookup reports, once it has run, whether it
overflowed (`jax.debug.callback` of a replicated flag, outside `shard_map` and
outside the custom-partitioned ops, where callbacks do not lower), and
`routing_stats` reads the counts. So that a layout which defeats routing is
noticed without asking, a `RoutingOverflowWarning` is issued once the
overflowing share of a kind of op is large (`WARN_AFTER`, `WARN_SHARE`).
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

# A flag's values: the op was not routed (its layout is decided by XLA's
# partitioner only once compiled), routed without overflow, or overflowed.
NOT_ROUTED, ROUTED, OVERFLOWED = -1, 0, 1

STEP, LOOKUP = "step", "lookup"

# Warn once this many routed ops of a kind have overflowed, if they are at least
# this share of that kind's routed ops: a few overflows (a burst of hot ids) are
# what the all-gather path is for; a steady share means the layout defeats routing.
WARN_AFTER, WARN_SHARE = 16, 0.05


class RoutingOverflowWarning(UserWarning):
  """Many routed steps or lookups overflowed their capacity and took the all-gather path.

  Issued once per kind (steps, lookups) until `routing_stats(reset=True)`, when
  `WARN_AFTER` routed ops of that kind have overflowed and they are at least
  `WARN_SHARE` of the kind's routed ops. The results are right; the traffic is
  that of the step left to XLA. Filter it as any warning
  (`warnings.simplefilter("ignore", osa.RoutingOverflowWarning)`).
  """


class RoutingStats(NamedTuple):
  """Counts of routed steps and lookups run since the process started (or the last reset).

  Attributes:
    steps: routed optimizer steps run (one per row-sharded parameter and step).
    overflowed_steps: of those, steps that took the all-gather path because a
      device held more distinct rows for one owner than the capacity.
    lookups: routed lookups run (`sharded_lookup`, the Flax tables).
    overflowed_lookups: of those, lookups that took the all-gather path.
  """

  steps: int = 0
  overflowed_steps: int = 0
  lookups: int = 0
  overflowed_lookups: int = 0


_lock = threading.Lock()
_counts = {STEP: [0, 0], LOOKUP: [0, 0]}
_warned: set[str] = set()


def _record(kind: str, flag: jax.Array) -> None:
  value = int(flag)
  if value == NOT_ROUTED:
    return
  with _lock:
    counts = _counts[kind]
    counts[0] += 1
    counts[1] += int(value == OVERFLOWED)
    routed, overflowed = counts
    due = kind not in _warned and overflowed >= WARN_AFTER and overflowed >= WARN_SHARE * routed
    if due:
      _warned.add(kind)
  if due:
    what = "optimizer steps" if kind == STEP else "lookups"
    message = (
      f"{overflowed} of {routed} routed {what} overflowed their capacity and took the "
      "all-gather path, whose traffic grows with the devices: the hot rows share an owner "
      "(a vocabulary sorted by frequency, split in blocks). Place the rows cyclically "
      "(osa.sharded_routing(row_placement='cyclic')) or give a larger capacity_factor; "
      "see docs/sharding.md. osa.routing_stats() has the counts; this warns once until "
      "routing_stats(reset=True)."
    )
    try:
      warnings.warn(message, RoutingOverflowWarning, stacklevel=2)
    except Warning:
      # Warnings made errors (`-W error`) would fail the step from inside its callback,
      # whose results are right: the advice goes to the log instead.
      logging.getLogger(__name__).warning("%s: %s", RoutingOverflowWarning.__name__, message)


def note(kind: str, flag: jax.Array) -> None:
  """Counts one routed `kind` (`STEP` or `LOOKUP`) when it runs; `flag`: a replicated int32."""
  jax.debug.callback(functools.partial(_record, kind), flag)


def flag_of(overflow: jax.Array | bool) -> jax.Array:
  """The int32 flag of a routed op from its (replicated) overflow bool."""
  return jnp.where(overflow, jnp.int32(OVERFLOWED), jnp.int32(ROUTED))


def routing_stats(*, reset: bool = False) -> RoutingStats:
  """How many routed steps and lookups ran, and how many overflowed their capacity.

  A routed step (a row-sharded table, `sharded_routing`) sends each owner a
  fixed number of slots, its capacity. A step in which some device holds more
  distinct rows for one owner than that (ids whose hot rows share an owner)
  is not truncated: it all-gathers every device's entries, with one device's
  numbers but the traffic of the step left to XLA, which grows with the
  devices. Nothing else shows it; these counts do. Read them every few hundred
  steps: a share of overflowing steps above a few percent says the layout
  defeats routing (place rows cyclically, `sharded_routing(row_placement=...)`,
  or give a larger `capacity_factor`; docs/sharding.md).

  Once a kind's overflowing share is steady (`RoutingOverflowWarning`: at least
  16 overflowed, 5% or more of the routed ones), a warning says so, once until
  the counts are reset.

  Counted on the host when each step runs (a `jax.debug.callback`, so the
  counts include only steps that have finished: this waits for pending ones),
  in this process (with several processes each keeps its own counts; not tested there).

  Args:
    reset: set the counts back to zero after reading them.

  Returns:
    The `RoutingStats`.

  Example:
    >>> import optax_sparse_adam as osa
    >>> stats = osa.routing_stats(reset=True)
    >>> stats.overflowed_steps <= stats.steps
    True
  """
  jax.effects_barrier()
  with _lock:
    stats = RoutingStats(*_counts[STEP], *_counts[LOOKUP])
    if reset:
      for counts in _counts.values():
        counts[:] = [0, 0]
      _warned.clear()
  return stats
