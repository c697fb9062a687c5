"""Plots step time against table size V and against batch size B, for sparse_adam, torch and optax.

Writes a PNG with two panels (log-log): the step time of sparse_adam (jitted,
donated update + apply_updates), torch.optim.SparseAdam (if installed) and
dense optax.adam, first against V at fixed B, then against B at fixed V. Dense
optax.adam is timed only up to --dense-max-vocab rows (its cost is V x D per
step whatever B is, and a dense step at 4M rows takes seconds), and once per V
in the B panel, where it is a flat line. Also prints the figures as markdown.

Run from the repository root:

  python -m benchmarks.plot_scaling                 # about 2-3 minutes, writes docs/scaling.png
  python -m benchmarks.plot_scaling --dist uniform --out /tmp/uniform.png
"""

import argparse
from pathlib import Path

from benchmarks import _common as c

ROOT = Path(__file__).resolve().parents[1]


def sweep(args):
  use_torch = not args.no_torch and c.torch is not None
  timing = dict(steps=args.steps, repeats=args.repeats)
  results = {"V": {}, "B": {}}

  def point(kind, key, vocab, batch):
    ids, values = c.id_batches(args.dist, vocab, batch), c.grad_values(batch, args.dim)
    row = {"sparse_adam": c.time_sparse_adam(ids, values, vocab, **timing)}
    if use_torch:
      row["torch SparseAdam"] = c.time_torch_sparse_adam(ids, values, vocab, **timing)
    if vocab <= args.dense_max_vocab and (kind == "V" or key == args.batches[0]):
      row["optax.adam (dense)"] = c.time_optax_adam_dense(ids, values, vocab, steps=3, repeats=2)
    results[kind][key] = row
    cells = ", ".join(f"{k} {c.ms(v)}" for k, v in row.items())
    print(f"  {kind}={key:,}: {cells}", flush=True)

  print(f"V sweep at B={args.batch:,}, D={args.dim}, {args.dist} ids")
  for vocab in args.vocabs:
    point("V", vocab, vocab, args.batch)
  print(f"B sweep at V={args.vocab:,}, D={args.dim}, {args.dist} ids")
  for batch in args.batches:
    point("B", batch, args.vocab, batch)
  # Dense optax.adam does not depend on B: one timing stands for the whole B panel.
  dense = results["B"][args.batches[0]].get("optax.adam (dense)")
  if dense is not None:
    for batch in args.batches[1:]:
      results["B"][batch]["optax.adam (dense)"] = dense
  return results


def print_tables(results, args):
  for kind, label in (("V", "V (rows)"), ("B", "B (ids per step)")):
    names = list(dict.fromkeys(k for row in results[kind].values() for k in row))
    print(f"\n| {label} | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for key, row in results[kind].items():
      print(f"| {key:,} | " + " | ".join(c.ms(row.get(n)) for n in names) + " |")
  ours_b = {b: r["sparse_adam"] for b, r in results["B"].items()}
  b_lo, b_hi = min(ours_b), max(ours_b)
  print(
    f"\nsparse_adam B={b_hi:,} / B={b_lo:,}: {ours_b[b_hi] / ours_b[b_lo]:.1f}x "
    f"for {b_hi // b_lo}x the ids"
  )
  ours_v = {v: r["sparse_adam"] for v, r in results["V"].items()}
  v_lo, v_hi = min(ours_v), max(ours_v)
  print(f"sparse_adam V={v_hi:,} / V={v_lo:,}: {ours_v[v_hi] / ours_v[v_lo]:.2f}x")


def plot(results, args):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
  styles = {
    "sparse_adam": dict(marker="o", color="C0"),
    "torch SparseAdam": dict(marker="s", color="C1"),
    "optax.adam (dense)": dict(marker="^", color="C2", linestyle="--"),
  }
  for ax, kind, xlabel, fixed in (
    (axes[0], "V", "table rows V", f"B={args.batch:,}"),
    (axes[1], "B", "ids per step B", f"V={args.vocab:,}"),
  ):
    for name, style in styles.items():
      pts = [(x, row[name] * 1e3) for x, row in results[kind].items() if row.get(name)]
      if pts:
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, label=name, **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms per step")
    ax.set_title(f"step time vs {kind} ({fixed}, D={args.dim}, {args.dist} ids)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.suptitle(f"{c.machine()}; dense optax.adam only up to V={args.dense_max_vocab:,}", fontsize=7)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(args.out, dpi=80)
  print(f"\nwrote {args.out}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--vocabs", type=int, nargs="+", default=[10_000, 100_000, 1_000_000, 4_000_000]
  )
  parser.add_argument("--batch", type=int, default=4096, help="B of the V sweep")
  parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096, 16384, 65536])
  parser.add_argument("--vocab", type=int, default=1_000_000, help="V of the B sweep")
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--dist", choices=["zipf", "uniform"], default="zipf")
  parser.add_argument(
    "--dense-max-vocab", type=int, default=1_000_000, help="largest V timed for dense optax.adam"
  )
  parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--out", type=Path, default=ROOT / "docs" / "scaling.png")
  args = parser.parse_args(argv)
  print(f"machine: {c.machine()}")
  results = sweep(args)
  print_tables(results, args)
  plot(results, args)


if __name__ == "__main__":
  main()
