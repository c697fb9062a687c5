"""Step time of sparse_adam against torch.optim.SparseAdam, dense optax.adam and the memory floor.

Times one training-step update of an embedding table of V rows of D float32
values from a gradient with B ids, drawn Zipf-like (s=1.2, popular rows repeat)
or uniformly:

- sparse_adam: `sparse_adam.update` + `apply_updates` in one `jax.jit` step
  with the params and optimizer state donated (`donate_argnums=(0, 1)`); on the
  CPU this runs the fused CPU kernels;
- the same step in XLA ops only (the kernels off: what a GPU or TPU runs);
- the XLA-ops step coalescing as the first core did (a sort carrying the permutation);
- the same step without donation (XLA then copies every table each step);
- optax.adam + optax.apply_updates on the equivalent dense V x D gradient;
- torch.optim.SparseAdam.step (if torch is installed) on the same gradient;
- the memory floor: one contiguous copy of the bytes the masked step must read
  and write (the touched rows of the parameter, m and v);
- every rule's step (`sparse_sgd`, `sparse_adagrad`, `sparse_rowwise_adagrad`,
  with the CPU kernel and the XLA ops) beside torch.optim.SGD, Adagrad and
  SparseAdam, as ratios to the `sparse_adam` kernel step (`bench_rules`).

Then the sparse_adam and torch steps at several table sizes V, same B, to show
the cost does not grow with V, with 4 KiB pages and with the tables on
transparent huge pages (`osa.advise_huge_pages`, and the same advice for
torch's tensors). All figures of one run come from one process;
compare ratios, not absolute times, on a shared machine.

Run from the repository root:

  python -m benchmarks.bench_step            # about 2-3 minutes
  python -m benchmarks.bench_step --quick    # a smaller, faster run
"""

from benchmarks import _common as c
from benchmarks import bench_rules


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)
  parser.add_argument(
    "--sweep",
    type=int,
    nargs="*",
    default=[100_000, 1_000_000, 4_000_000],
    help="table sizes V for the flat-in-V check (empty to skip)",
  )
  parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
  parser.add_argument("--no-torch", action="store_true", help="skip torch.optim.SparseAdam")
  parser.add_argument("--no-dense", action="store_true", help="skip dense optax.adam")
  parser.add_argument(
    "--no-rules", action="store_true", help="skip every rule beside torch's SGD/Adagrad/SparseAdam"
  )
  parser.add_argument(
    "--bf16-moments", action="store_true", help="also time mu_dtype=nu_dtype=bfloat16"
  )
  parser.add_argument("--quick", action="store_true", help="V=100k headline, sweep 100k and 1M")
  args = parser.parse_args(argv)
  if args.quick:
    args.vocab, args.sweep, args.steps, args.repeats = 100_000, [100_000, 1_000_000], 10, 3
  use_torch = not args.no_torch and c.torch is not None
  v, d, b = args.vocab, args.dim, args.batch
  timing = dict(steps=args.steps, repeats=args.repeats)

  print(f"# sparse_adam step benchmark: V={v:,}, D={d}, B={b:,}, float32")
  print(f"machine: {c.machine()}")
  print("times: best of", args.repeats, "runs of", args.steps, "steps; ratios from this run\n")

  rows = []
  dense = None
  for dist in ("zipf", "uniform"):
    ids, values = c.id_batches(dist, v, b), c.grad_values(b, d)
    ours = c.time_sparse_adam(ids, values, v, **timing)
    xla_ops = c.time_sparse_adam(ids, values, v, cpu_kernels=False, **timing)
    bf16 = None
    if args.bf16_moments:
      bf16 = c.time_sparse_adam(ids, values, v, mu_dtype="bfloat16", nu_dtype="bfloat16", **timing)
    with c.permutation_sort_baseline():
      baseline = c.time_sparse_adam(ids, values, v, **timing)
    undonated = c.time_sparse_adam(ids, values, v, donate=False, steps=3, repeats=2)
    if dense is None and not args.no_dense:
      dense = c.time_optax_adam_dense(ids, values, v)
    torch_s = c.time_torch_sparse_adam(ids, values, v, **timing) if use_torch else None
    floor = c.memory_floor(ids, d)
    rows.append(
      (
        dist,
        c.touched_rows(ids),
        ours,
        xla_ops,
        baseline,
        bf16,
        undonated,
        dense,
        torch_s,
        floor,
      )
    )

  print(
    "| ids | distinct rows | sparse_adam (donated) | XLA ops only | permutation-sort baseline "
    "| without donation | optax.adam dense | torch SparseAdam | memory floor "
    "| torch / ours | torch / XLA ops | ours / floor | dense / ours |"
    + (" bf16 moments |" if args.bf16_moments else "")
  )
  print("|---" * (13 + args.bf16_moments) + "|")
  for (
    dist,
    touched,
    ours,
    xla_ops,
    baseline,
    bf16,
    undonated,
    dense_s,
    torch_s,
    floor,
  ) in rows:
    print(
      f"| {dist} | {touched:.0f} | {c.ms(ours)} | {c.ms(xla_ops)} | {c.ms(baseline)} "
      f"| {c.ms(undonated)} | {c.ms(dense_s)} | {c.ms(torch_s)} | {c.ms(floor)} "
      f"| {c.ratio(torch_s, ours)} | {c.ratio(torch_s, xla_ops)} "
      f"| {c.ratio(ours, floor)} | {c.ratio(dense_s, ours)} |"
      + (f" {c.ms(bf16)} |" if args.bf16_moments else "")
    )
  print()
  print("Targets (issue 6): torch / ours >= 3 on both id streams; ours / floor <= 4.")
  print(f"CPU kernels: {'built and used' if c.cpu_kernels_used() else 'not used (XLA ops)'}.")
  print("Without donation XLA copies param, m and v whole every step: donate them.\n")

  if not args.no_rules:
    print(f"## Every rule beside torch's (Zipf ids, V={v:,}), ratios to the Adam kernel step\n")
    ids, values = c.id_batches("zipf", v, b), c.grad_values(b, d)
    rounds = max(args.repeats, 3)
    print(f"median (range) of {rounds} interleaved rounds of {args.steps} steps each")
    bench_rules.print_ratios(
      bench_rules.time_rules(ids, values, v, steps=args.steps, rounds=rounds, use_torch=use_torch)
    )
    print()

  if args.sweep:
    for huge_pages in (False, True):
      _flat_in_v(args, huge_pages=huge_pages, use_torch=use_torch, timing=timing)


def _flat_in_v(args, *, huge_pages: bool, use_torch: bool, timing: dict) -> None:
  b, d = args.batch, args.dim
  pages = "transparent huge pages" if huge_pages else "4 KiB pages"
  print(f"\n## Flat in V (B={b:,}, D={d}), tables on {pages}\n")
  print(
    "| V | distinct rows zipf / uniform | sparse_adam zipf | sparse_adam uniform "
    "| torch zipf | torch uniform |"
  )
  print("|---|---|---|---|---|---|")
  sweep = {}
  for vocab in args.sweep:
    distinct = [c.touched_rows(c.id_batches(dist, vocab, b)) for dist in ("zipf", "uniform")]
    cells = [" / ".join(f"{n:.0f}" for n in distinct)]
    for who in ("ours", "torch"):
      for dist in ("zipf", "uniform"):
        ids, values = c.id_batches(dist, vocab, b), c.grad_values(b, d)
        if who == "ours":
          seconds = c.time_sparse_adam(ids, values, vocab, huge_pages=huge_pages, **timing)
        elif use_torch:
          seconds = c.time_torch_sparse_adam(ids, values, vocab, huge_pages=huge_pages, **timing)
        else:
          seconds = None
        sweep[(vocab, who, dist)] = seconds
        cells.append(c.ms(seconds))
    print(f"| {vocab:,} | " + " | ".join(cells) + " |", flush=True)
  lo, hi = min(args.sweep), max(args.sweep)
  for dist in ("zipf", "uniform"):
    print(
      f"\nsparse_adam {dist}: V={hi:,} / V={lo:,} = "
      f"{c.ratio(sweep[(hi, 'ours', dist)], sweep[(lo, 'ours', dist)])} (target <= 1.2x); "
      f"torch {c.ratio(sweep[(hi, 'torch', dist)], sweep[(lo, 'torch', dist)])}",
      end="",
    )
  print()


if __name__ == "__main__":
  main()
