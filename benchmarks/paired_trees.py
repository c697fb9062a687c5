"""The sparse_adam step of two checkouts, timed in turn (A B A B ...), with the ratio per pair.

For a change that must not slow the step (a refactoring, say): give the
checkout before it and the one after; each round runs the same measurement in
a fresh process of each checkout (its own `benchmarks/_common.py` and package),
alternating so that a machine whose speed drifts affects both alike. Measured:
the headline step of `bench_step` (V x D float32 table, B ids a step, Zipf and
uniform ids) with the CPU kernels and with XLA ops only. The ratio B/A of each
round, and their median, are printed.

Run from the repository root:

  python -m benchmarks.paired_trees --a ../before --b .            # ~3 minutes
  python -m benchmarks.paired_trees --a ../before --b . --rounds 3 --vocab 100000
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

_MEASURE = """
import json, sys
from benchmarks import _common as c
vocab, dim, batch, steps = (int(x) for x in sys.argv[1:5])
out = {}
for dist in ("zipf", "uniform"):
  ids = c.id_batches(dist, vocab, batch)
  values = c.grad_values(batch, dim)
  for kernels in (True, False):
    t = c.time_sparse_adam(ids, values, vocab, cpu_kernels=kernels, steps=steps, repeats=3)
    out[f"{dist}, {'CPU kernels' if kernels else 'XLA ops'}"] = t
print(json.dumps(out))
"""


def _measure(tree: str, vocab: int, dim: int, batch: int, steps: int) -> dict[str, float]:
  env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
  result = subprocess.run(
    [sys.executable, "-c", _MEASURE, str(vocab), str(dim), str(batch), str(steps)],
    cwd=tree,
    env=env,
    check=True,
    capture_output=True,
    text=True,
  )
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--a", required=True, help="the checkout before (a directory)")
  parser.add_argument("--b", required=True, help="the checkout after (a directory)")
  parser.add_argument("--rounds", type=int, default=5, help="pairs of runs (A then B)")
  parser.add_argument("--vocab", type=int, default=1_000_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args(argv)

  ratios: dict[str, list[float]] = {}
  times: dict[str, list[tuple[float, float]]] = {}
  for round_ in range(args.rounds):
    a = _measure(args.a, args.vocab, args.dim, args.batch, args.steps)
    b = _measure(args.b, args.vocab, args.dim, args.batch, args.steps)
    for key in a:
      ratios.setdefault(key, []).append(b[key] / a[key])
      times.setdefault(key, []).append((a[key], b[key]))
    print(
      f"round {round_ + 1}/{args.rounds}: "
      + ", ".join(f"{key} {b[key] / a[key]:.3f}" for key in a),
      flush=True,
    )

  print(f"\nV={args.vocab:,} D={args.dim} B={args.batch:,}; ms per step (median over rounds)")
  print(f"{'step':<26}{'A':>9}{'B':>9}{'B/A median':>12}{'B/A min-max':>16}")
  for key, pairs in times.items():
    a_ms = statistics.median(t[0] for t in pairs) * 1e3
    b_ms = statistics.median(t[1] for t in pairs) * 1e3
    r = ratios[key]
    print(
      f"{key:<26}{a_ms:>9.3f}{b_ms:>9.3f}{statistics.median(r):>12.3f}"
      f"{f'{min(r):.3f}-{max(r):.3f}':>16}"
    )


if __name__ == "__main__":
  main()
