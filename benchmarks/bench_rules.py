"""Step time of every rule (Adam, SGD, Adagrad, row-wise Adagrad) beside torch's, in one run.

Times one training-step update of an embedding table of V rows of D float32
values from a gradient with B Zipf-drawn ids (popular rows repeat):

- each optax transformation's `update` + `apply_updates` in one `jax.jit` step,
  params and state donated: `sparse_adam` (the fused CPU kernels, and the XLA
  ops), `sparse_adam(rowwise_second_moment=True)`, `sparse_sgd`, `sparse_adagrad`,
  `sparse_rowwise_adagrad` (with a recipe's options: lazy momentum; decoupled
  weight decay and `max_norm`), each with the CPU kernel and with the XLA ops;
- torch.optim.SGD, Adagrad and SparseAdam `.step()` on the same sparse gradients
  (if torch is installed).

Every figure is printed with its ratio to the `sparse_adam` kernel step of the same
run; on a shared machine compare the ratios, not the absolute times.

Run from the repository root:

  python -m benchmarks.bench_rules            # V = 1M, D = 64, B = 4096
  python -m benchmarks.bench_rules --quick    # V = 100k, fewer steps
"""

import argparse

import jax
import jax.numpy as jnp
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks import _common as c


def _time_osa(opt, ids, values, num_rows, *, steps, repeats, cpu_kernels=True):
  dim = values[0].shape[1]
  grads = [
    {"t": sparse.BCOO((jnp.asarray(v), jnp.asarray(i)[:, None]), shape=(num_rows, dim))}
    for i, v in zip(ids, values, strict=True)
  ]
  params = {"t": jnp.zeros((num_rows, dim), jnp.float32)}
  with osa.use_cpu_kernels(cpu_kernels):
    return c.time_jitted_steps(
      c.sparse_step(opt),
      params,
      opt.init(params),
      grads,
      donate=True,
      steps=steps,
      repeats=repeats,
    )


def _time_torch(make, ids, values, num_rows, *, steps, repeats):
  torch = c.torch
  dim = values[0].shape[1]
  param = torch.nn.Parameter(torch.zeros(num_rows, dim))
  run = c.torch_sparse_steps(param, make([param]), ids, values)

  # torch's sparse Adagrad builds sparse tensors without saying whether to check them.
  with torch.no_grad(), torch.sparse.check_sparse_tensor_invariants(enable=False):
    return c.best_step_time(run, steps, repeats)


# The new rules, each with the options a recipe sets (timed with the kernel and with the XLA ops).
RULES = [
  ("sparse_sgd", osa.sparse_sgd(1e-3)),
  ("sparse_sgd lazy momentum", osa.sparse_sgd(1e-3, momentum=0.9, lazy_momentum=True)),
  ("sparse_adagrad", osa.sparse_adagrad(1e-2)),
  ("sparse_rowwise_adagrad", osa.sparse_rowwise_adagrad(1e-2)),
  (
    "sparse_rowwise_adagrad decoupled, max_norm",
    osa.sparse_rowwise_adagrad(
      1e-2, weight_decay=1e-4, weight_decay_mode="decoupled", max_norm=1.0
    ),
  ),
]


def time_rules(ids, values, num_rows, *, steps, repeats, use_torch=True):
  """`(name, seconds)` of every rule's step (kernels and XLA ops), then torch's optimizers."""
  timing = {"steps": steps, "repeats": repeats}
  rows = [
    ("sparse_adam (CPU kernels)", osa.sparse_adam(1e-3), True),
    ("sparse_adam (XLA ops)", osa.sparse_adam(1e-3), False),
    ("sparse_adam rowwise (CPU kernels)", osa.sparse_adam(1e-3, rowwise_second_moment=True), True),
  ]
  for name, opt in RULES:
    rows += [(f"{name} (CPU kernels)", opt, True), (f"{name} (XLA ops)", opt, False)]
  results = []
  for name, opt, kernels in rows:
    seconds = _time_osa(opt, ids, values, num_rows, cpu_kernels=kernels, **timing)
    results.append((name, seconds))
  if use_torch and c.torch is not None:
    optim = c.torch.optim
    for name, make in (
      ("torch.optim.SGD", lambda p: optim.SGD(p, lr=1e-3)),
      ("torch.optim.Adagrad", lambda p: optim.Adagrad(p, lr=1e-2)),
      ("torch.optim.SparseAdam", lambda p: optim.SparseAdam(p, lr=1e-3)),
    ):
      results.append((name, _time_torch(make, ids, values, num_rows, **timing)))
  return results


def print_ratios(results) -> None:
  """Each step's time and its ratio to the first (the `sparse_adam` kernel step)."""
  baseline = results[0][1]
  for name, seconds in results:
    print(f"  {name:56s} {c.ms(seconds):>10s}   {seconds / baseline:5.2f}x the Adam kernel step")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--vocab", type=int, default=1_000_000, help="rows V")
  parser.add_argument("--dim", type=int, default=64, help="row width D")
  parser.add_argument("--batch", type=int, default=4096, help="ids B per gradient")
  parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
  parser.add_argument("--quick", action="store_true", help="V = 100k, 10 steps")
  args = parser.parse_args(argv)
  if args.quick:
    args.vocab, args.steps = 100_000, 10
  ids = c.id_batches("zipf", args.vocab, args.batch)
  values = c.grad_values(args.batch, args.dim)
  print(f"{c.machine()}; V={args.vocab:,} D={args.dim} B={args.batch} (Zipf ids)")
  print(f"jax {jax.__version__}, CPU kernels available: {osa.cpu_kernels_available()}")
  print_ratios(time_rules(ids, values, args.vocab, steps=args.steps, repeats=args.repeats))


if __name__ == "__main__":
  main()
