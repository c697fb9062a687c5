"""Many embedding tables (DLRM-style): one jitted step over all of them against one step per table.

A DLRM model on Criteo has 26 categorical features, each with its own
embedding table; every example looks up one row of each. This benchmark builds
26 tables with Criteo's cardinalities (capped at --max-rows to fit in memory),
draws B Zipf-like ids per table per step, and times:

- fused: `sparse_adam.update` + `apply_updates` over the dict of all 26 tables
  in one jitted, donated step;
- separate: the same step jitted per table, called 26 times, times added up;
- torch.optim.SparseAdam over the 26 tables (one optimizer), if torch is installed.

With `--batched`, it times instead the table-batched accelerator step (issue
42) on NVIDIA's recsys shape, 10 tables of 1.68M x 128 float32 with about 1M
lookups and 350k distinct rows a step (`--small`: 4 tables of 20k x 32, for a
CPU): every table's ids coalesced by one sort (the default on CUDA, ROCm and
TPU) against each table's own sort chain (`batch_tables=False`), interleaved,
with the effective bandwidth over the minimum traffic; on a CPU also the
default path (the CPU kernels), both accelerator steps forced onto it (a sort
carrying a payload is slow on XLA:CPU: CPU figures say nothing about a GPU).

Run from the repository root:

  python -m benchmarks.bench_tables                     # about a minute
  python -m benchmarks.bench_tables --batched           # the recsys shape (a GPU)
  python -m benchmarks.bench_tables --batched --small   # a CPU smoke run
"""

import argparse
import contextlib

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


def batched_rows(args) -> None:
  """The recsys shape: one sort for all tables against one per table, interleaved."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import sparse

  import optax_sparse_adam as osa
  from benchmarks.bench_accelerator import candidate_rows, fits
  from optax_sparse_adam._backends import choice

  if args.small:
    tables, num_rows, dim, lookups, distinct_target = 4, 20_000, 32, 16_000, 5_600
  else:
    tables, num_rows, dim, lookups, distinct_target = 10, 1_680_000, 128, 1_000_000, 350_000
  on_cpu = jax.default_backend() == "cpu"
  paths = {"tables batched (one sort)": {}, "each table alone": {"batch_tables": False}}
  if on_cpu:  # the accelerator steps forced onto the CPU, and its own default path
    paths = {name: {**switches, "forced": choice.ACCELERATOR} for name, switches in paths.items()}
    paths["CPU default (kernels)"] = {}
  # Each path keeps its own param, m and v (donated).
  if not fits(num_rows * tables, dim, 3 * len(paths), share=0.8):
    print(f"recsys shape: {tables} x {num_rows:,} x {dim} does not fit here; skipped")
    return
  rng = np.random.default_rng(1)
  per_table = lookups // tables
  pool = candidate_rows(per_table, distinct_target / tables)
  ids, values, distinct = {}, {}, 0.0
  for t in range(tables):
    candidates = rng.choice(num_rows, pool, replace=False).astype(np.int32)
    batch = np.stack([rng.choice(candidates, per_table) for _ in range(2)])
    ids[f"table_{t}"] = jnp.asarray(batch)
    values[f"table_{t}"] = jnp.asarray(rng.standard_normal((2, per_table, dim), dtype=np.float32))
    distinct += float(np.mean([np.unique(b).size for b in batch]))
  opt = osa.sparse_adam(1e-3)
  steps = max(1, args.steps // 2)

  def run(params, state, ids, values):
    for k in range(steps):
      grads = {
        name: sparse.BCOO((values[name][k % 2], ids[name][k % 2][:, None]), shape=(num_rows, dim))
        for name in params
      }
      updates, state = opt.update(grads, state, params)
      params = osa.apply_updates(params, updates)
    return params, state

  jitted = jax.jit(run, donate_argnums=(0, 1))
  carries = {}
  for name in paths:
    params = {n: jnp.zeros((num_rows, dim), jnp.float32) for n in ids}
    carries[name] = [params, opt.init(params)]

  def call(name):
    with choice.choose(**paths[name]) if paths[name] else contextlib.nullcontext():
      carries[name][:] = jitted(*carries[name], ids, values)
    jax.block_until_ready(carries[name])

  best = {}
  for name in paths:
    call(name)  # compiled and warmed up
  for _ in range(args.repeats):  # interleaved: each repeat times every path once
    for name in paths:
      best[name] = min(
        best.get(name, float("inf")), c.best_seconds(lambda n=name: call(n), 1, warm_up=False)
      )
  min_bytes = distinct * dim * 4 * 6 + per_table * tables * dim * 4
  print(
    f"# recsys shape: {tables} tables x {num_rows:,} x {dim} float32, {per_table * tables:,} "
    f"lookups, {distinct:,.0f} distinct rows a step; minimum traffic {min_bytes / 1e9:.3f} GB"
  )
  print(f"machine: {c.machine()}; backend {jax.default_backend()}\n")
  print("| path | ms per step | effective TB/s |")
  print("|---|---|---|")
  for name in paths:
    seconds = best[name] / steps
    print(f"| {name} | {seconds * 1e3:.3f} | {min_bytes / seconds / 1e12:.3f} |")
  batched, alone = list(best.values())[:2]
  print(f"\neach table alone / tables batched: {c.ratio(alone, batched)}")
  print("Target (issue 42): 1.5 TB/s or more on a GPU at the full shape.")


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
  parser.add_argument(
    "--batched", action="store_true", help="the recsys shape, tables batched or not (issue 42)"
  )
  parser.add_argument("--small", action="store_true", help="with --batched: a CPU-sized shape")
  args = parser.parse_args(argv)
  if args.batched:
    batched_rows(args)
    return

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
