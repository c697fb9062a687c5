"""State bytes per row and step time of the lean optimizer states against full Adam, on the CPU.

For an embedding table of V rows of D float32 values and a gradient of B ids
(Zipf-like, s=1.2), each setting's state is made by `opt.init` and its bytes
per row counted (the moments and any per-row arrays; the parameter's own
`4 * D` bytes not included), and one donated, jitted `update` + `apply_updates`
step timed on the fused CPU kernels and on the XLA ops:

- full: `sparse_adam()` (m and v float32, the torch-parity default);
- rowwise: `rowwise_second_moment=True` (m float32, one float32 v per row);
- bf16: `mu_dtype=nu_dtype=bfloat16` (rounded to nearest);
- bf16_sr: the same, `moment_rounding="stochastic"`;
- rowwise_bf16_sr: a row-wise v and bf16 moments, stochastic rounding.

The rows that fit a memory budget (table plus state, `--budget-gib`) follow from
the bytes per row. All figures of one run come from one process; compare the
ratios, not absolute times, on a shared machine.

Run from the repository root:

  python -m benchmarks.bench_lean_state            # V=1M, D=64, B=4096
  python -m benchmarks.bench_lean_state --quick    # V=100k
"""

import jax
import jax.numpy as jnp

import optax_sparse_adam as osa
from benchmarks import _common as c
from benchmarks._timing import ratio

SETTINGS = {
  "full": {},
  "rowwise": {"rowwise_second_moment": True},
  "bf16": {"mu_dtype": "bfloat16", "nu_dtype": "bfloat16"},
  "bf16_sr": {"mu_dtype": "bfloat16", "nu_dtype": "bfloat16", "moment_rounding": "stochastic"},
  "rowwise_bf16_sr": {
    "rowwise_second_moment": True,
    "mu_dtype": "bfloat16",
    "nu_dtype": "bfloat16",
    "moment_rounding": "stochastic",
  },
}


def state_bytes_per_row(num_rows: int, dim: int, **kwargs) -> float:
  """Bytes of the optimizer state per table row, from the shapes `opt.init` makes."""
  opt = osa.sparse_adam(1e-3, **kwargs)
  shapes = jax.eval_shape(opt.init, {"table": jax.ShapeDtypeStruct((num_rows, dim), jnp.float32)})
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes) if x.ndim)
  return total / num_rows


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)
  parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
  parser.add_argument("--budget-gib", type=float, default=8.0, help="table + state budget")
  parser.add_argument("--quick", action="store_true", help="V=100k, 10 steps")
  args = parser.parse_args(argv)
  if args.quick:
    args.vocab, args.steps = 100_000, 10
  v, d, b = args.vocab, args.dim, args.batch
  timing = dict(steps=args.steps, repeats=args.repeats)

  print(f"# lean-state benchmark: V={v:,}, D={d}, B={b:,}, float32 table, Zipf ids")
  print(f"machine: {c.machine()}")
  print("times: best of", args.repeats, "runs of", args.steps, "steps; ratios from this run\n")

  ids, values = c.id_batches("zipf", v, b), c.grad_values(b, d)
  budget = args.budget_gib * 2**30
  table_bytes = 4 * d
  results = {}
  for name, kwargs in SETTINGS.items():
    per_row = state_bytes_per_row(v, d, **kwargs)
    kernels = c.time_sparse_adam(ids, values, v, **kwargs, **timing)
    xla_ops = c.time_sparse_adam(ids, values, v, cpu_kernels=False, **kwargs, **timing)
    results[name] = (per_row, kernels, xla_ops)

  full_bytes, full_kernels, full_xla = results["full"]
  full_rows = budget / (table_bytes + full_bytes)
  header = (
    "| setting | state bytes/row | state / full | rows in budget | rows / full "
    "| step, CPU kernels | vs full | step, XLA ops | vs full |"
  )
  print(header)
  print("|" + "---|" * (header.count("|") - 1))
  for name, (per_row, kernels, xla_ops) in results.items():
    rows = budget / (table_bytes + per_row)
    print(
      f"| {name} | {per_row:.0f} | {per_row / full_bytes:.2f} | {rows / 1e6:.1f}M "
      f"| {rows / full_rows:.2f}x | {kernels * 1e3:.2f} ms | {ratio(kernels, full_kernels)} "
      f"| {xla_ops * 1e3:.2f} ms | {ratio(xla_ops, full_xla)} |"
    )
  print(
    f"\nrows in budget: {args.budget_gib:g} GiB / (table {table_bytes} B/row + state), "
    "from the state's shapes; 'vs full' is step time / full Adam's (below 1 is faster)."
  )


if __name__ == "__main__":
  main()
