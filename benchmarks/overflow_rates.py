"""How often a routed step overflows, by capacity, id distribution, local batch and devices.

A routed step (docs/sharding.md) gives each owner a fixed number of slots per
device, the capacity (`routing.capacity`); a step overflows when some device
holds more distinct rows of one owner than that. This counts it in NumPy,
as the step does (distinct ids of each device's local batch, by owner, against
the capacity), for uniform and Zipf ids, over many random batches, for the
default capacity and fixed capacity factors (Zipf ids also with their hot rows
spread over the owners). It also prints the bytes one
all-to-all sends per device as a multiple of one local batch of entries (ids
and rows: `N * capacity / b`, the same for every row width). No devices are
needed, and the counts are deterministic (fixed seeds).

  python -m benchmarks.overflow_rates              # a few seconds
  python -m benchmarks.overflow_rates --steps 2000
"""

import argparse

import numpy as np

from optax_sparse_adam._core import routing

CAPACITIES = {"default": None, "cf 1.5": 1.5, "cf 2": 2.0}


def batches(
  kind: str, rows: int, size: int, steps: int, num_devices: int, rng: np.random.Generator
):
  """`steps` global batches of `size` ids: uniform; Zipf (exponent 1.05; the low ids hot,
  all on the first owner); or Zipf with the hot rows spread over the owners (row `r`
  stored at `(r % N) * (rows / N) + r // N`, as docs/sharding.md suggests)."""
  if kind == "uniform":
    return rng.integers(0, rows, (steps, size))
  popularity = 1.0 / np.arange(1, rows + 1) ** 1.05
  ids = rng.choice(rows, (steps, size), p=popularity / popularity.sum())
  if kind == "zipf":
    return ids
  return (ids % num_devices) * (rows // num_devices) + ids // num_devices


def max_bucket(ids: np.ndarray, rows: int, num_devices: int) -> int:
  """The most distinct rows one device holds for one owner, in one global batch."""
  per_owner = rows // num_devices
  return max(
    int(np.max(np.bincount(np.unique(local) // per_owner, minlength=num_devices)))
    for local in ids.reshape(num_devices, -1)
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=262144)
  parser.add_argument("--steps", type=int, default=500)
  parser.add_argument("--local-batches", type=int, nargs="+", default=[256, 2048])
  args = parser.parse_args()
  print(
    f"table of {args.rows} rows split by rows over N devices; {args.steps} random batches "
    "per line; overflowing steps in percent; bytes: one all-to-all per device, as a "
    "multiple of one local batch of entries\n"
  )
  names = list(CAPACITIES)
  header = f"{'ids':<11} {'b':>5} {'N':>2} | " + " | ".join(
    f"{name:>8} {'slots':>5} {'bytes':>6}" for name in names
  )
  print(header)
  print("-" * len(header))
  for kind in ("uniform", "zipf", "zipf_spread"):
    for local in args.local_batches:
      for num_devices in (2, 4, 8):
        rng = np.random.default_rng(num_devices * 1000 + local)
        steps = batches(kind, args.rows, local * num_devices, args.steps, num_devices, rng)
        worst = np.array([max_bucket(ids, args.rows, num_devices) for ids in steps])
        cells = []
        for factor in CAPACITIES.values():
          capacity = routing.capacity(local, num_devices, factor)
          rate = 100.0 * float(np.mean(worst > capacity))
          cells.append(f"{rate:>7.1f}% {capacity:>5} {num_devices * capacity / local:>5.2f}x")
        print(f"{kind:<11} {local:>5} {num_devices:>2} | " + " | ".join(cells))


if __name__ == "__main__":
  main()
