"""Step time of `catch_up_idle_rows=True` against the lazy step, and of `catch_up_all_rows`.

Times one training step (`sparse_adam.update` + `apply_updates`, jitted, params
and state donated) of an embedding table of V rows of D float32 values from a
gradient of B Zipf-distributed ids, in one process:

- the lazy step as users get it (on the CPU: the fused CPU kernels);
- the catch-up step as users get it (on the CPU: the same fused kernel,
  catching the rows up as it updates them);
- the same two in XLA ops (the kernels off: what GPUs and TPUs run);
- lazy and catch-up AdamW (decoupled weight decay), as run (on the CPU: lazy
  AdamW in XLA ops, catch-up AdamW in the fused kernel);
- the lazy and catch-up steps with amsgrad (XLA ops: the kernel has no
  amsgrad; its catch-up is exact);
- `catch_up_all_rows` (O(V): every row), jitted and donated, for scale.

Each catch-up step is compared with its lazy counterpart on the same path
(kernel with kernel, XLA ops with XLA ops), timed in the same interleaved runs.
Compare ratios, not absolute times, on a shared machine.

Run from the repository root:

  python -m benchmarks.bench_catch_up            # about a minute
  python -m benchmarks.bench_catch_up --quick
"""

import contextlib
import math
import time

import jax
import jax.numpy as jnp
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks import _common as c
from benchmarks._timing import best_seconds, ratio

VARIANTS = {
  "lazy, as run (CPU kernels where they apply)": ({}, None),
  "catch-up, as run": ({"catch_up_idle_rows": True}, None),
  "lazy, XLA ops": ({}, False),
  "catch-up, XLA ops": ({"catch_up_idle_rows": True}, False),
  "lazy AdamW, as run": ({"weight_decay": 1e-2, "decoupled": True}, None),
  "catch-up AdamW, as run": ({"weight_decay": 1e-2, "decoupled": True, "catch_up": True}, None),
  "lazy amsgrad, as run": ({"amsgrad": True}, None),
  "catch-up amsgrad": ({"amsgrad": True, "catch_up_idle_rows": True}, None),
}
# Each catch-up step against the lazy step of its own path.
PAIRS = {
  "CPU kernel (as run)": ("catch-up, as run", "lazy, as run (CPU kernels where they apply)"),
  "XLA ops": ("catch-up, XLA ops", "lazy, XLA ops"),
  "AdamW, as run": ("catch-up AdamW, as run", "lazy AdamW, as run"),
  "amsgrad, as run": ("catch-up amsgrad", "lazy amsgrad, as run"),
}


def _optimizer(kwargs: dict):
  """sparse_adam, or sparse_adamw for a variant with `decoupled` (catch-up with `catch_up`)."""
  kwargs = dict(kwargs)
  if kwargs.pop("decoupled", False):
    catch_up = kwargs.pop("catch_up", False)
    return osa.sparse_adamw(1e-3, catch_up_idle_rows=catch_up, **kwargs)
  return osa.sparse_adam(1e-3, **kwargs)


def _runner(opt, grads, num_rows: int, dim: int, cpu_kernels: bool | None):
  """`run(n)`: n jitted, donated steps of `opt`, under its CPU-kernel setting."""
  jitted = jax.jit(c.sparse_step(opt), donate_argnums=(0, 1))
  params = {"table": jnp.zeros((num_rows, dim), jnp.float32)}
  carry = [params, opt.init(params)]

  def run(n: int) -> None:
    # The setting is read when a step is traced and is part of JAX's cache key:
    # every call runs inside it.
    setting = contextlib.nullcontext() if cpu_kernels is None else osa.use_cpu_kernels(cpu_kernels)
    with setting:
      p, s = carry
      for k in range(n):
        p, s = jitted(p, s, grads[k % len(grads)])
      jax.block_until_ready((p, s))
      carry[:] = [p, s]

  run(2)  # compilation
  return run


def interleaved_step_times(ids, values, num_rows, *, steps: int, repeats: int) -> dict:
  """Seconds per step of each variant: runs of the variants alternate, the best run counts.

  Alternating the variants' runs spreads a shared machine's slow spells over all of them.
  """
  dim = values[0].shape[1]
  grads = [
    {"table": sparse.BCOO((jnp.asarray(v), jnp.asarray(i[:, None])), shape=(num_rows, dim))}
    for i, v in zip(ids, values, strict=True)
  ]
  runs = {
    name: _runner(_optimizer(kwargs), grads, num_rows, dim, cpu_kernels)
    for name, (kwargs, cpu_kernels) in VARIANTS.items()
  }
  best = dict.fromkeys(runs, math.inf)
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      run(steps)
      best[name] = min(best[name], (time.perf_counter() - start) / steps)
  return best


def time_catch_up_all_rows(num_rows: int, dim: int, repeats: int) -> float:
  opt = osa.sparse_adam(1e-3, catch_up_idle_rows=True)
  params = {"table": jnp.ones((num_rows, dim), jnp.float32)}
  carry = [params, opt.init(params)]
  caught_up = jax.jit(lambda p, s: osa.catch_up_all_rows(opt, p, s), donate_argnums=(0, 1))

  def call():
    carry[:] = caught_up(*carry)
    jax.block_until_ready(carry)

  return best_seconds(call, repeats)


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)
  parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
  parser.add_argument("--repeats", type=int, default=15, help="timed runs; the fastest counts")
  parser.add_argument("--quick", action="store_true", help="V=100k, fewer runs")
  args = parser.parse_args(argv)
  if args.quick:
    args.vocab, args.steps, args.repeats = 100_000, 10, 7
  v, d, b = args.vocab, args.dim, args.batch
  print(f"# catch-up step benchmark: V={v:,}, D={d}, B={b:,}, float32, Zipf ids")
  print(f"machine: {c.machine()}")
  print(
    f"times: best of {args.repeats} interleaved runs of {args.steps} steps; ratios from this run\n"
  )

  ids, values = c.id_batches("zipf", v, b), c.grad_values(b, d)
  times = interleaved_step_times(ids, values, v, steps=args.steps, repeats=args.repeats)
  every_row = time_catch_up_all_rows(v, d, max(3, args.repeats // 3))
  lazy, lazy_xla = times["lazy, as run (CPU kernels where they apply)"], times["lazy, XLA ops"]

  print("| step | time | vs lazy (XLA ops) | vs lazy (as run) |")
  print("|---|---:|---:|---:|")
  for name, seconds in times.items():
    print(
      f"| {name} | {seconds * 1e3:.3f} ms | {ratio(seconds, lazy_xla)} | {ratio(seconds, lazy)} |"
    )
  print("\ncatch-up step vs the lazy step of the same path (this run):")
  for label, (caught, plain) in PAIRS.items():
    print(f"  {label}: {ratio(times[caught], times[plain])}")
  print(
    f"catch_up_all_rows over all {v:,} rows: {every_row * 1e3:.3f} ms "
    f"({ratio(every_row, lazy)} a lazy step)"
  )


if __name__ == "__main__":
  main()
