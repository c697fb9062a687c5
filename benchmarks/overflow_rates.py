"""How often a routed step overflows, by row placement, id distribution, local batch and devices.

A routed step (docs/sharding.md) gives each owner a fixed number of slots per
device, the capacity (`routing.capacity`); a step overflows when some device
holds more distinct rows of one owner than that, and then all-gathers every
device's entries. This counts it in NumPy, as the step does (distinct ids of
each device's local batch, by owner, against the capacity), over many random
batches, for uniform ids and Zipf ids over a vocabulary sorted by frequency
(id 0 the most frequent, as real vocabularies are built), with the rows placed
in blocks (`P(axis, None)` as is: every hot row on device 0) or cyclically
(`sharded_routing(row_placement="cyclic")`: row `r` on device `r % N`).

Per line: the share of overflowing steps with the default capacity and with
`capacity_factor=2`; `need`: the most distinct rows a device held for one owner
over all batches, as a multiple of the even share `b / N` (the capacity that
would never have overflowed); `bytes`: what a device sends per step, as a
multiple of one local batch of entries (ids and rows), routed `N * capacity /
b`, plus, for the overflowing share of steps, the overflow path's all-gather,
reduce-scatter and apply (about `3 N` local batches); `floor`: the distinct
rows that devices other than the owner hold, for the owner that needs most, per
local batch: what ANY exchange (larger capacities, variable-length, a reduction
tree) must bring that owner. Only the placement lowers it.
No devices are needed, and the counts are deterministic (fixed seeds).

  python -m benchmarks.overflow_rates              # about two minutes
  python -m benchmarks.overflow_rates --steps 500 --rows 262144
"""

import argparse

import numpy as np

from optax_sparse_adam._core.sharded import routing

KINDS = {"uniform": None, "zipf 1.05": 1.05, "zipf 1.2": 1.2}
PLACEMENTS = ("block", "cyclic")
FLOOR_BATCHES = 20  # the floor is a mean, steady over few batches (and slower to count)


def batches(exponent, rows: int, size: int, steps: int, rng: np.random.Generator) -> np.ndarray:
  """`steps` global batches of `size` ids: uniform (exponent None) or Zipf, id 0 the hottest."""
  if exponent is None:
    return rng.integers(0, rows, (steps, size))
  cdf = np.cumsum(1.0 / np.arange(1, rows + 1) ** exponent)
  return np.minimum(np.searchsorted(cdf, rng.random((steps, size)) * cdf[-1]), rows - 1)


def max_bucket(ids: np.ndarray, rows: int, num_devices: int, placement: str) -> int:
  """The most distinct rows one device holds for one owner, in one global batch."""
  worst = 0
  for local in ids.reshape(num_devices, -1):
    distinct = np.unique(local)
    owner = owner_of(distinct, rows, num_devices, placement)
    worst = max(worst, int(np.max(np.bincount(owner, minlength=num_devices))))
  return worst


def owner_of(ids: np.ndarray, rows: int, num_devices: int, placement: str) -> np.ndarray:
  return ids % num_devices if placement == "cyclic" else ids // (rows // num_devices)


def floor(ids: np.ndarray, rows: int, num_devices: int, placement: str) -> int:
  """The least one owner must receive in one global batch, whatever the exchange.

  Each distinct row that some other device holds must reach its owner at least
  once (summed on the way, as a reduction tree would, or not); this counts those
  rows for the owner that needs most. No capacity, variable-length exchange or
  routing order sends less to that owner: only the placement changes it.
  """
  local = ids.reshape(num_devices, -1)
  pairs = np.unique(
    np.stack([np.repeat(np.arange(num_devices), local.shape[1]), local.ravel()]), axis=1
  )
  device, row = pairs
  owner = owner_of(row, rows, num_devices, placement)
  foreign = np.unique(row[device != owner])  # rows some non-owner holds
  return int(
    np.max(np.bincount(owner_of(foreign, rows, num_devices, placement), minlength=num_devices))
  )


def rates(exponent, rows: int, local: int, num_devices: int, steps: int) -> dict:
  """Per placement: overflow % (default, cf 2), need, bytes (default, cf 2), floor."""
  rng = np.random.default_rng(num_devices * 1000 + local + rows)
  ids = batches(exponent, rows, local * num_devices, steps, rng)
  out = {}
  for placement in PLACEMENTS:
    worst = np.array([max_bucket(step, rows, num_devices, placement) for step in ids])
    cells = []
    for factor in (None, 2.0):
      capacity = routing.capacity(local, num_devices, factor)
      share = float(np.mean(worst > capacity))
      routed = num_devices * capacity / local
      cells.append((100.0 * share, routed + share * 3 * num_devices))
    need = float(worst.max()) / (local / num_devices)
    least = np.mean([floor(step, rows, num_devices, placement) for step in ids[:FLOOR_BATCHES]])
    least = float(least) / local
    out[placement] = (cells[0][0], cells[1][0], need, cells[0][1], cells[1][1], least)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[262_144, 1_048_576])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--local-batches", type=int, nargs="+", default=[2048, 8192])
  parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
  args = parser.parse_args()
  print(
    f"{args.steps} random batches per line; overflowing steps in percent; need: the most "
    "distinct rows of one owner on one device / the even share; bytes: sent per device per "
    "step / one local batch of entries (overflowing steps counted at 3 N); floor: the "
    "distinct rows that other devices hold for the neediest owner, which any exchange must "
    f"bring it, / one local batch (mean over {FLOOR_BATCHES} batches)\n"
  )
  header = f"{'ids':<9} {'V':>7} {'b':>5} {'N':>2} | " + " | ".join(
    f"{p}: {'default':>7} {'cf 2':>6} {'need':>5} {'bytes':>6} {'cf2 B':>6} {'floor':>5}"
    for p in PLACEMENTS
  )
  print(header)
  print("-" * len(header))
  for kind, exponent in KINDS.items():
    for rows in args.rows:
      for local in args.local_batches:
        for num_devices in args.devices:
          found = rates(exponent, rows, local, num_devices, args.steps)
          cells = [
            f"{p}: {d:>6.1f}% {c:>5.1f}% {need:>5.2f} {b:>5.2f}x {b2:>5.2f}x {fl:>5.2f}"
            for p, (d, c, need, b, b2, fl) in found.items()
          ]
          print(f"{kind:<9} {rows:>7} {local:>5} {num_devices:>2} | " + " | ".join(cells))


if __name__ == "__main__":
  main()
