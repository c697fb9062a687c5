"""Many embedding tables (DLRM-style): one jitted step over all of them against one step per table.

A DLRM model on Criteo has 26 categorical features, each with its own
embedding table; every example looks up one row of each. This benchmark builds
26 tables with Criteo's cardinalities (capped at --max-rows to fit in memory),
draws B Zipf-like ids per table per step, and times:

- fused: `sparse_adam.update` + `apply_updates` over the dict of all 26 tables
  in one jitted, donated step;
- separate: the same step jitted per table, called 26 times, times added up;
- torch.optim.SparseAdam over the 26 tables (one optimizer), if torch is installed.

Run from the repository root:

  python -m benchmarks.bench_tables           # about a minute
"""

import argparse

from benchmarks import _common as c

# The 26 categorical cardinalities of the Criteo Kaggle display-advertising data.
CRITEO_CARDINALITIES = (
  1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
  27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip


def time_torch_tables(tables, *, steps, repeats):
  """torch.optim.SparseAdam over all tables, one optimizer (faster of default / 1 thread)."""
  torch, np = c.torch, c.np
  if torch is None:
    return None
  names = list(tables)
  params = [torch.nn.Parameter(torch.zeros(tables[n][2], tables[n][1][0].shape[1])) for n in names]
  opt = torch.optim.SparseAdam(params, lr=1e-3)
  grads = [
    [
      torch.sparse_coo_tensor(
        torch.from_numpy(tables[n][0][k].astype(np.int64))[None],
        torch.from_numpy(tables[n][1][k]),
        p.shape,
        check_invariants=False,
      )
      for n, p in zip(names, params, strict=True)
    ]
    for k in range(c.NUM_BATCHES)
  ]

  def run(n):
    for k in range(n):
      for p, g in zip(params, grads[k % len(grads)], strict=True):
        p.grad = g
      opt.step()

  default_threads = torch.get_num_threads()
  try:
    best = float("inf")
    for threads in sorted({default_threads, 1}):
      torch.set_num_threads(threads)
      with torch.no_grad():
        best = min(best, c.best_step_time(run, steps, repeats))
    return best
  finally:
    torch.set_num_threads(default_threads)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--max-rows", type=int, default=1_000_000, help="cap on a table's rows")
  parser.add_argument("--dim", type=int, default=16, help="row width D (DLRM on Criteo: 16)")
  parser.add_argument("--batch", type=int, default=4096, help="ids B per table per step")
  parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
  parser.add_argument("--no-torch", action="store_true", help="skip torch.optim.SparseAdam")
  args = parser.parse_args(argv)

  sizes = [min(n, args.max_rows) for n in CRITEO_CARDINALITIES]
  tables = {
    f"t{k:02d}": (
      c.id_batches("zipf", v, args.batch, seed=k),
      c.grad_values(args.batch, args.dim, seed=100 + k),
      v,
    )
    for k, v in enumerate(sizes)
  }
  timing = dict(steps=args.steps, repeats=args.repeats)
  print(
    f"# {len(sizes)} tables (Criteo cardinalities capped at {args.max_rows:,}; "
    f"{sum(sizes):,} rows in all), D={args.dim}, B={args.batch:,} Zipf ids per table"
  )
  print(f"machine: {c.machine()}\n")
  fused = c.time_multi_table(tables, fused=True, **timing)
  separate = c.time_multi_table(tables, fused=False, **timing)
  torch_s = None if args.no_torch else time_torch_tables(tables, **timing)
  print(
    "| one jitted step, all tables | separate jitted steps, added | torch SparseAdam "
    "| separate / fused | torch / fused |"
  )
  print("|---|---|---|---|---|")
  print(
    f"| {c.ms(fused)} | {c.ms(separate)} | {c.ms(torch_s)} | {c.ratio(separate, fused)} "
    f"| {c.ratio(torch_s, fused)} |"
  )
  print("\nTarget (issue 6): one step over all tables at least as fast as the separate steps.")


if __name__ == "__main__":
  main()
