"""The largest embedding table that trains in a memory budget: full Adam against the leanest state.

For each setting the rows V are the most whose table (V x D) plus the
optimizer state `opt.init` makes fit the budget (`--budget-gib`, default 8 GiB):

- full: `sparse_adam()` (m and v float32, torch's SparseAdam state);
- lean: `rowwise_second_moment=True`, `mu_dtype=nu_dtype=bfloat16`,
  `moment_rounding="stochastic"` (a bf16 m and one bf16 v per row);
- rowwise_adagrad_bf16: row-wise Adagrad on a bfloat16 table,
  `param_rounding="stochastic"`, its per-row sum in float32
  (`sparse_rule_transformation(RowwiseAdagradRule(), ..., slot_dtypes={"sum":
  jnp.float32})`; `sparse_rowwise_adagrad` keeps it in the table's dtype): 2D +
  4 bytes a row;
- adam_bf16_lean: `sparse_adam` on a bfloat16 table with a bf16 m and one
  float32 v per row, both roundings stochastic (4D + 4 bytes a row).

A 16-bit table's rows are read in float32 (the loss and the gradient are
float32), as a mixed-precision model reads them.

Each setting runs in its own process (one after the other, never in parallel),
so the peak resident set of one does not hide in the other's. The process
allocates the table (filled with a constant, so every page is resident) and
the state, then runs `--steps` jitted, donated training steps on random batches
of `--batch` Zipf-distributed ids (the fused CPU kernels, the default on the
CPU; `--xla-ops` for the XLA ops, which accelerators run): a loss on the
looked-up rows, its BCOO gradient, `opt.update` and `apply_updates`. It
reports the rows, the table + state bytes, the peak resident set (VmHWM of
/proc/self/status) after each stage, the steps per second, the loss on the
first batch before and after training and whether the touched rows moved while
an untouched row did not.

Run from the repository root (needs the budget plus about 1 GiB free; check
`free -g` first):

  python -m benchmarks.largest_table                 # 8 GiB
  python -m benchmarks.largest_table --budget-gib 2  # a quick check
  python -m benchmarks.largest_table --budget-gib 2 --xla-ops --steps 10
"""

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {
  "full": {},
  "lean": {
    "rowwise_second_moment": True,
    "mu_dtype": "bfloat16",
    "nu_dtype": "bfloat16",
    "moment_rounding": "stochastic",
  },
  # 16-bit tables, rounded stochastically (`param_rounding`): 2D + 4 bytes a row for
  # row-wise Adagrad (one float32 sum a row), 4D + 4 for Adam with a bf16 m and one
  # float32 v a row.
  "rowwise_adagrad_bf16": {
    "optimizer": "rowwise_adagrad_f32_sum",
    "table_dtype": "bfloat16",
    "param_rounding": "stochastic",
  },
  "adam_bf16_lean": {
    "table_dtype": "bfloat16",
    "rowwise_second_moment": True,
    "mu_dtype": "bfloat16",
    "nu_dtype": "float32",
    "moment_rounding": "stochastic",
    "param_rounding": "stochastic",
  },
}
GIB = 2**30


def memory_status() -> dict[str, int]:
  """VmRSS and VmHWM (the peak resident set) of this process, in bytes."""
  status = {}
  with open("/proc/self/status") as f:
    for line in f:
      key, _, value = line.partition(":")
      if key in ("VmRSS", "VmHWM"):
        status[key] = int(value.split()[0]) * 1024
  return status


def child(setting: str, budget_gib: float, dim: int, batch: int, steps: int, xla_ops: bool):
  """One setting in this process: allocate, train, measure. Returns the figures."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if xla_ops:
    os.environ["OPTAX_SPARSE_ADAM_CPU_KERNELS"] = "0"  # the XLA ops, as accelerators run
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import sparse

  import optax_sparse_adam as osa

  stages = {"imports": memory_status()}
  options = dict(SETTINGS[setting])
  optimizer = options.pop("optimizer", "sparse_adam")
  if optimizer == "rowwise_adagrad_f32_sum":  # sparse_rowwise_adagrad, its sum in float32

    def make(lr, **kw):
      return osa.sparse_rule_transformation(
        osa.RowwiseAdagradRule(),
        osa.RowwiseAdagradHyperparams(lr),
        slot_dtypes={"sum": jnp.float32},
        name="sparse_rowwise_adagrad",
        **kw,
      )

  else:
    make = getattr(osa, optimizer)
  table_dtype = jnp.dtype(options.pop("table_dtype", "float32"))
  opt = make(1e-2, **options)

  def state_bytes(rows):
    shape = {"table": jax.ShapeDtypeStruct((rows, dim), table_dtype)}
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(opt.init, shape)))

  # State bytes grow linearly in the rows (plus a few scalars): two probes find the rate.
  per_row = (state_bytes(2_000_000) - state_bytes(1_000_000)) / 1_000_000
  fixed = state_bytes(1_000_000) - per_row * 1_000_000
  rows = int((budget_gib * GIB - fixed) // (table_dtype.itemsize * dim + per_row))
  table_bytes, opt_bytes = table_dtype.itemsize * rows * dim, state_bytes(rows)

  params = {"table": jax.jit(lambda: jnp.full((rows, dim), 0.01, table_dtype))()}
  jax.block_until_ready(params)
  stages["table"] = memory_status()
  state = opt.init(params)
  jax.block_until_ready(state)
  stages["state"] = memory_status()

  rng = np.random.default_rng(0)
  batches = []
  for _ in range(8):
    ids = ((rng.zipf(1.2, batch) - 1) * 7919 % rows).astype(np.int32)  # hot ids spread out
    batches.append((jnp.asarray(ids), jnp.asarray(rng.normal(size=batch), jnp.float32)))

  def loss_of_rows(rows_, targets):  # rows read in float32 (a 16-bit table's too)
    return jnp.mean((jnp.sum(rows_.astype(jnp.float32), axis=1) - targets) ** 2)

  def step(params, state, ids, targets):
    rows_ = params["table"][ids].astype(jnp.float32)
    loss, row_grads = jax.value_and_grad(loss_of_rows)(rows_, targets)
    grads = {"table": sparse.BCOO((row_grads, ids[:, None]), shape=(rows, dim))}
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state, loss

  step = jax.jit(step, donate_argnums=(0, 1))
  first_ids, first_targets = batches[0]
  touched = np.unique(np.asarray(first_ids))
  untouched = int(np.setdiff1d(np.arange(min(rows, 1_000_000)), np.concatenate(
    [np.asarray(i) for i, _ in batches]))[0])  # fmt: skip
  before = np.asarray(params["table"][touched])
  before_untouched = np.asarray(params["table"][untouched])
  loss_before = float(jax.jit(loss_of_rows)(params["table"][first_ids], first_targets))

  params, state, _ = step(params, state, *batches[0])  # compiles
  jax.block_until_ready(params)
  stages["first step"] = memory_status()
  start = time.perf_counter()
  for k in range(1, steps):
    params, state, _ = step(params, state, *batches[k % len(batches)])
  jax.block_until_ready((params, state))
  seconds = time.perf_counter() - start
  stages["steps"] = memory_status()

  after = np.asarray(params["table"][touched])
  loss_after = float(jax.jit(loss_of_rows)(params["table"][first_ids], first_targets))
  return {
    "setting": setting,
    "options": SETTINGS[setting],
    "rows": rows,
    "dim": dim,
    "state_bytes_per_row": per_row,
    "table_bytes_per_row": table_dtype.itemsize * dim,
    "table_bytes": table_bytes,
    "state_bytes": opt_bytes,
    "budget_bytes": budget_gib * GIB,
    "stages": stages,
    "steps_per_second": (steps - 1) / seconds,
    "loss_before": loss_before,
    "loss_after": loss_after,
    "touched_rows_moved": float(np.mean(np.any(after != before, axis=1))),
    "untouched_row_kept": bool(
      np.array_equal(np.asarray(params["table"][untouched]), before_untouched)
    ),
    "backend": jax.default_backend(),
    "cpu_kernels": osa.cpu_kernels_available() and not xla_ops,
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--budget-gib", type=float, default=8.0, help="table + state budget")
  parser.add_argument("--dim", type=int, default=64, help="row width D")
  parser.add_argument("--batch", type=int, default=4096, help="ids per step")
  parser.add_argument("--steps", type=int, default=50, help="training steps per setting")
  parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
  parser.add_argument(
    "--xla-ops", action="store_true", help="step with the XLA ops, not the fused CPU kernels"
  )
  parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    figures = child(args.child, args.budget_gib, args.dim, args.batch, args.steps, args.xla_ops)
    print(json.dumps(figures))
    return

  print(
    f"# largest table in {args.budget_gib:g} GiB (table + optimizer state): D={args.dim}, "
    f"{args.steps} donated steps of {args.batch} Zipf ids, one process each, "
    + ("XLA ops" if args.xla_ops else "the fused CPU kernels where they apply")
  )
  results = {}
  for setting in args.settings:  # one at a time: each allocates the whole budget
    command = [sys.executable, "-m", "benchmarks.largest_table", "--child", setting]
    command += ["--budget-gib", str(args.budget_gib), "--dim", str(args.dim)]
    command += ["--batch", str(args.batch), "--steps", str(args.steps)]
    command += ["--xla-ops"] if args.xla_ops else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
      sys.exit(f"{setting}: the child process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    results[setting] = json.loads(done.stdout.strip().splitlines()[-1])

  print(
    "\n| setting | rows | table + state B/row | table + state | peak RSS | peak - budget "
    "| steps/s | loss first batch, before -> after | touched rows moved | untouched row kept "
    "| rows / full's |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|")

  def ratio(name):
    if "full" not in results:
      return "-"
    return f"{results[name]['rows'] / results['full']['rows']:.2f}x"

  for name, r in results.items():
    used = r["table_bytes"] + r["state_bytes"]
    peak = r["stages"]["steps"]["VmHWM"]
    print(
      f"| {name} | {r['rows']:,} | {r['table_bytes_per_row'] + r['state_bytes_per_row']:.0f} "
      f"| {used / GIB:.2f} GiB "
      f"| {peak / GIB:.2f} GiB | {(peak - used) / GIB:+.2f} GiB | {r['steps_per_second']:.3g} "
      f"| {r['loss_before']:.4f} -> {r['loss_after']:.4f} | {r['touched_rows_moved']:.0%} "
      f"| {r['untouched_row_kept']} | {ratio(name)} |"
    )
  print("\npeak resident set (VmHWM) after each stage, GiB:")
  for name, r in results.items():
    stages = ", ".join(f"{k} {v['VmHWM'] / GIB:.2f}" for k, v in r["stages"].items())
    path = "CPU kernels" if r["cpu_kernels"] else "XLA ops"
    print(f"  {name} ({path}): {stages}")
  if "full" in results and "lean" in results:
    lean_ratio = results["lean"]["rows"] / results["full"]["rows"]
    print(f"\nrows(lean) / rows(full) = {lean_ratio:.2f}x")


if __name__ == "__main__":
  main()
