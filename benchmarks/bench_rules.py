"""Step time of every rule (Adam, SGD, Adagrad, row-wise Adagrad, FTRL) beside torch's, in one run.

Times one training-step update of an embedding table of V rows of D float32
values from a gradient with B ids, Zipf-drawn (popular rows repeat) and uniform:

- each optax transformation's `update` + `apply_updates` in one `jax.jit` step,
  params and state donated. The rules with a hand-fused CPU kernel (`sparse_sgd`
  with lazy momentum, `sparse_adagrad`, `sparse_rowwise_adagrad` with decoupled
  weight decay and `max_norm`, `sparse_adam` and its options) are timed with it
  and with the generic kernels every rule runs (the rows coalesced and gathered,
  the rule's math as XLA ops, the rows stored in place): a fused kernel earns its
  code only where it beats the generic kernels;
- plain `sparse_sgd`, `sparse_ftrl` and a rule defined outside the package
  (the architecture page's row-wise Adagrad, `_user_rule.py`: with `osa.row_sum`,
  on the row program, and with `jnp.mean`, on the generic kernels around its XLA
  math), which have no kernel of their own: the generic kernels (the row program
  where it applies), and the XLA ops for reference;
- `sparse_adam` and `sparse_ftrl` on bfloat16 and float16 tables (the gradient
  in the table's dtype), beside the float32 table in the same run;
- `sparse_adam` (float32 moments) and `sparse_rowwise_adagrad` on 16-bit tables
  rounded stochastically (`param_rounding="stochastic"`), the gradient in the
  table's dtype or in float32 (`--tables-only` times just these);
- torch.optim.SGD, Adagrad and SparseAdam `.step()` on the same sparse gradients
  (if torch is installed).

Each is timed against the `sparse_adam` kernel step in interleaved rounds (one
run of `--steps` steps of the Adam step, then one of the other), so load from
other processes hits both alike; printed is the median (and range) over rounds of
the per-round ratio. On a shared machine compare the ratios, not absolute times.

Run from the repository root:

  python -m benchmarks.bench_rules            # V = 1M, D = 64, B = 4096, Zipf and uniform
  python -m benchmarks.bench_rules --quick    # V = 100k, fewer steps and rounds
  python -m benchmarks.bench_rules --fused-vs-generic --only sgd adagrad  # each against its
                                              # own fused kernel, no Adam step between
"""

import time

import jax
import jax.numpy as jnp
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks import _common as c
from benchmarks._user_rule import UserHyper, UserMeanRowwiseAdagrad, UserRowwiseAdagrad
from benchmarks.bench_options import OPTIONS, _Stepper, _summary, _times
from optax_sparse_adam._backends import choice

# Rules with no fused kernel: the generic kernels on the CPU (and, for reference, the XLA ops).
NO_KERNEL = [
  ("sparse_sgd", osa.sparse_sgd(1e-3)),  # its fused kernel was deleted: within 10%
  ("sparse_ftrl", osa.sparse_ftrl(1e-2)),
  (
    "sparse_ftrl l1, l2",
    osa.sparse_ftrl(1e-2, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3),
  ),
  (
    "user rule (architecture page)",
    osa.sparse_rule_transformation(UserRowwiseAdagrad(), UserHyper(1e-2)),
  ),
  (  # the same rule summing with jnp.mean: the generic kernels around its XLA math
    "user rule with jnp.mean",
    osa.sparse_rule_transformation(UserMeanRowwiseAdagrad(), UserHyper(1e-2)),
  ),
]
# Steps on 16-bit tables, beside the float32 table (kernels on).
TABLE_DTYPES = [
  (
    "sparse_adam f32 moments",
    lambda: osa.sparse_adam(1e-3, mu_dtype="float32", nu_dtype="float32"),
  ),
  ("sparse_ftrl", lambda: osa.sparse_ftrl(1e-2)),
]
# 16-bit tables rounded stochastically (`param_rounding`), beside the float32 table: the
# gradient in the table's dtype, or float32 (rows read in float32: the fused kernels run).
STOCHASTIC_TABLES = [
  (
    "sparse_adam f32 moments, stochastic",
    lambda: osa.sparse_adam(
      1e-3, mu_dtype="float32", nu_dtype="float32", param_rounding="stochastic"
    ),
  ),
  (
    "sparse_rowwise_adagrad, stochastic",
    lambda: osa.sparse_rowwise_adagrad(1e-2, param_rounding="stochastic"),
  ),
]


class _PathStepper(_Stepper):
  """`_Stepper` on a path: "kernels" (a hand-fused kernel where the rule has one), "generic"
  (the generic kernels for every rule) or "xla" (the XLA ops)."""

  def __init__(self, opt, num_rows, grads, path="kernels"):
    super().__init__(opt, num_rows, grads, cpu_kernels=path != "xla")
    self.forced = choice.GENERIC_KERNELS if path == "generic" else None

  def seconds_per_step(self, n: int) -> float:
    with choice.choose(forced=self.forced):
      return super().seconds_per_step(n)


class _TableStepper(_PathStepper):
  """`_PathStepper` over a table (and gradient) of another dtype."""

  def __init__(self, opt, num_rows, grads, dtype, *, grad_dtype=None):
    cast = [
      {
        "table": sparse.BCOO(
          (g["table"].data.astype(grad_dtype or dtype), g["table"].indices),
          shape=g["table"].shape,
        )
      }
      for g in grads
    ]
    super().__init__(opt, num_rows, cast)
    dim = grads[0]["table"].shape[1]
    self.params = {"table": jnp.zeros((num_rows, dim), dtype)}
    self.state = opt.init(self.params)


# The rules with a hand-fused kernel, each with the options a recipe sets (timed with that
# kernel and with the generic kernels).
RULES = [
  ("sparse_sgd lazy momentum", osa.sparse_sgd(1e-3, momentum=0.9, lazy_momentum=True)),
  (
    "sparse_sgd lazy momentum, nesterov",
    osa.sparse_sgd(1e-3, momentum=0.9, nesterov=True, lazy_momentum=True),
  ),
  (
    "sparse_sgd lazy momentum, dampening",
    osa.sparse_sgd(1e-3, momentum=0.9, dampening=0.1, lazy_momentum=True),
  ),
  ("sparse_adagrad", osa.sparse_adagrad(1e-2)),
  ("sparse_rowwise_adagrad", osa.sparse_rowwise_adagrad(1e-2)),
  (
    "sparse_rowwise_adagrad decoupled, max_norm",
    osa.sparse_rowwise_adagrad(
      1e-2, weight_decay=1e-4, weight_decay_mode="decoupled", max_norm=1.0
    ),
  ),
  ("sparse_adam", osa.sparse_adam(1e-3)),
  *(
    (f"sparse_adam {name}", OPTIONS[name][0](1e-3, **OPTIONS[name][1]))
    for name in ("l2", "adamw", "amsgrad", "per_row", "catch_up", "bf16_stochastic", "rowwise")
  ),
]


class _TorchStepper:
  """A torch optimizer's steps on the same sparse gradients, `n` at a time."""

  def __init__(self, make, ids, values, num_rows):
    torch = c.torch
    self.param = torch.nn.Parameter(torch.zeros(num_rows, values[0].shape[1]))
    self.run = c.torch_sparse_steps(self.param, make([self.param]), ids, values)

  def seconds_per_step(self, n: int) -> float:
    torch = c.torch
    # torch's sparse Adagrad builds sparse tensors without saying whether to check them.
    with torch.no_grad(), torch.sparse.check_sparse_tensor_invariants(enable=False):
      start = time.perf_counter()
      self.run(n)
      return (time.perf_counter() - start) / n


def time_tables(grads, num_rows, default, *, steps, rounds):
  """`(name, ratios)` of the 16-bit tables rounded stochastically, and the float32 table."""
  results = []
  for name, make in STOCHASTIC_TABLES:
    for dtype, grad_dtype in (
      (jnp.float32, None),
      (jnp.bfloat16, None),
      (jnp.float16, None),
      (jnp.bfloat16, jnp.float32),
      (jnp.float16, jnp.float32),
    ):
      stepper = _TableStepper(make(), num_rows, grads, dtype, grad_dtype=grad_dtype)
      label = f"{name}, {jnp.dtype(dtype).name} table"
      if grad_dtype is not None:
        label += ", f32 gradient"
      results.append((label, _times(stepper, default, rounds=rounds, steps=steps)))
      del stepper
  return results


def time_rules(
  ids, values, num_rows, *, steps, rounds, use_torch=True, tables_only=False, only=None
):
  """`(name, ratios)`: each step's per-round ratios to the `sparse_adam` kernel step; `only`:
  the steps whose name contains one of these strings (no 16-bit tables, no torch)."""
  dim = values[0].shape[1]
  grads = [
    {"table": sparse.BCOO((jnp.asarray(v), jnp.asarray(i)[:, None]), shape=(num_rows, dim))}
    for i, v in zip(ids, values, strict=True)
  ]
  if tables_only:
    default = _PathStepper(osa.sparse_adam(1e-3), num_rows, grads)
    results = [("sparse_adam (CPU kernels)", [(1.0, 1.0)])]
    return results + time_tables(grads, num_rows, default, steps=steps, rounds=rounds)
  rows = [("sparse_adam (XLA ops)", osa.sparse_adam(1e-3), "xla")]
  for name, opt in RULES:
    rows += [
      (f"{name} (fused kernel)", opt, "kernels"),
      (f"{name} (generic kernels)", opt, "generic"),
    ]
  for name, opt in NO_KERNEL:
    rows += [(f"{name} (generic kernels)", opt, "kernels"), (f"{name} (XLA ops)", opt, "xla")]
  default = _PathStepper(osa.sparse_adam(1e-3), num_rows, grads)
  results = [("sparse_adam (CPU kernels)", [(1.0, 1.0)])]
  if only:
    rows = [row for row in rows if any(part in row[0] for part in only)]
  for name, opt, path in rows:
    # One option's tables at a time next to the default's.
    stepper = _PathStepper(opt, num_rows, grads, path)
    results.append((name, _times(stepper, default, rounds=rounds, steps=steps)))
    del stepper
  if only:
    return results
  for name, make in TABLE_DTYPES:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
      stepper = _TableStepper(make(), num_rows, grads, dtype)
      label = f"{name}, {jnp.dtype(dtype).name} table"
      results.append((label, _times(stepper, default, rounds=rounds, steps=steps)))
      del stepper
  results += time_tables(grads, num_rows, default, steps=steps, rounds=rounds)
  if use_torch and c.torch is not None:
    optim = c.torch.optim
    for name, make in (
      ("torch.optim.SGD", lambda p: optim.SGD(p, lr=1e-3)),
      ("torch.optim.Adagrad", lambda p: optim.Adagrad(p, lr=1e-2)),
      ("torch.optim.SparseAdam", lambda p: optim.SparseAdam(p, lr=1e-3)),
    ):
      stepper = _TorchStepper(make, ids, values, num_rows)
      results.append((name, _times(stepper, default, rounds=rounds, steps=steps)))
      del stepper
  return results


def time_fused_against_generic(ids, values, num_rows, *, steps, rounds, only=None):
  """`(name, ratios)`: each rule with a fused kernel on the generic kernels (the row program
  where it applies), timed against its own fused kernel in interleaved rounds."""
  dim = values[0].shape[1]
  grads = [
    {"table": sparse.BCOO((jnp.asarray(v), jnp.asarray(i)[:, None]), shape=(num_rows, dim))}
    for i, v in zip(ids, values, strict=True)
  ]
  results = []
  for name, opt in RULES:
    if only and not any(part in name for part in only):
      continue
    fused = _PathStepper(opt, num_rows, grads, "kernels")
    generic = _PathStepper(opt, num_rows, grads, "generic")
    results.append((name, _times(generic, fused, rounds=rounds, steps=steps)))
    del fused, generic
  return results


def print_ratios(results, against="the Adam kernel step") -> None:
  """Each step's median (range) and fastest ratio to the `sparse_adam` kernel step, then
  that step's fastest time (to compare runs of two versions; noisy on a shared machine)."""
  for name, times in results:
    print(f"  {name:56s} {_summary(times):>34s}  x {against}")
  timed = [base for _, times in results[1:] for base, _ in times]
  if timed and against == "the Adam kernel step":
    print(f"  the Adam kernel step itself: fastest {min(timed) * 1e3:.3f} ms")


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)  # --vocab, --dim, --batch
  parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per step")
  parser.add_argument("--quick", action="store_true", help="V = 100k, 10 steps, 3 rounds")
  parser.add_argument(
    "--tables-only", action="store_true", help="only the 16-bit tables rounded stochastically"
  )
  parser.add_argument("--dist", nargs="*", default=["zipf", "uniform"], help="id distributions")
  parser.add_argument("--no-torch", action="store_true", help="skip torch's optimizers")
  parser.add_argument(
    "--fused-vs-generic",
    action="store_true",
    help="each rule with a fused kernel on the generic kernels against its fused kernel",
  )
  parser.add_argument(
    "--only", nargs="*", help="only the steps whose name contains one of these strings"
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.vocab, args.steps, args.rounds = 100_000, 10, 3
  values = c.grad_values(args.batch, args.dim)
  print(f"jax {jax.__version__}, CPU kernels available: {osa.cpu_kernels_available()}")
  print(f"median (range) of {args.rounds} interleaved rounds of {args.steps} steps each")
  for dist in args.dist:
    ids = c.id_batches(dist, args.vocab, args.batch)
    print(f"{c.machine()}; V={args.vocab:,} D={args.dim} B={args.batch} ({dist} ids)")
    if args.fused_vs_generic:
      timed = time_fused_against_generic(
        ids, values, args.vocab, steps=args.steps, rounds=args.rounds, only=args.only
      )
      print_ratios(timed, against="its fused kernel (generic kernels / fused)")
      continue
    print_ratios(
      time_rules(
        ids,
        values,
        args.vocab,
        steps=args.steps,
        rounds=args.rounds,
        use_torch=not args.no_torch,
        tables_only=args.tables_only,
        only=args.only,
      )
    )


if __name__ == "__main__":
  main()
