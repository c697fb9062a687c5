"""Every option's step against the default step, timed in interleaved rounds in one process.

For each option (weight decay, amsgrad, per-row bias correction, row-wise second
moment, bf16 moments, stochastic rounding, catch-up, a learning-rate schedule, and
combinations), the jitted, donated `update` + `apply_updates` step of a V x D
float32 table with B ids a step (Zipf or uniform) is timed against the default `sparse_adam` step:
each round runs `--steps` steps of the default, then of the option, so a machine
whose speed drifts affects both alike. Printed: the median over rounds of the
per-round ratio option / default (and the range), and the ratio of the fastest
rounds (the least disturbed on a loaded machine), for the CPU kernels (where
they apply) and, with `--xla`, for the XLA ops (the kernels off: where these
options ran before their kernels). Only one option's tables are held at a time
next to the default's. `--batches` distinct id batches are cycled (128 by
default): with few, rows come back at a few fixed intervals, and catch-up, whose
per-row factors depend on how long a row was idle, computes fewer of them than in
training.

Run from the repository root:

  python -m benchmarks.bench_options                  # about 5 minutes
  python -m benchmarks.bench_options --vocab 100000 --rounds 3 --only adamw amsgrad
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks import _common as c
from optax_sparse_adam._backends.cpu import kernels

BF16 = {"mu_dtype": "bfloat16", "nu_dtype": "bfloat16"}
STOCHASTIC = {**BF16, "moment_rounding": "stochastic"}


def _scheduled(learning_rate: float, **kwargs: Any) -> Any:
  """`sparse_adam` whose learning rate is an `optax.linear_schedule` (read each step)."""
  return osa.sparse_adam(
    optax.linear_schedule(learning_rate, 0.1 * learning_rate, 100_000), **kwargs
  )


# name: (factory, keyword arguments); the default is sparse_adam(1e-3).
OPTIONS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
  "catch_up": (osa.sparse_adam, {"catch_up_idle_rows": True}),
  "linear_schedule": (_scheduled, {}),
  "adamw": (osa.sparse_adamw, {"weight_decay": 1e-2}),
  "l2": (osa.sparse_adam, {"weight_decay": 1e-2}),
  "amsgrad": (osa.sparse_adam, {"amsgrad": True}),
  "per_row": (osa.sparse_adam, {"per_row_bias_correction": True}),
  "adamw_amsgrad_per_row": (
    osa.sparse_adamw,
    {"weight_decay": 1e-2, "amsgrad": True, "per_row_bias_correction": True},
  ),
  "adamw_catch_up": (osa.sparse_adamw, {"weight_decay": 1e-2, "catch_up_idle_rows": True}),
  "adamw_amsgrad_catch_up": (
    osa.sparse_adamw,
    {"weight_decay": 1e-2, "amsgrad": True, "catch_up_idle_rows": True},
  ),
  # bf16 moments and the row-wise rule alone, to read the options' cost on top of them.
  "bf16_stochastic": (osa.sparse_adam, STOCHASTIC),
  "adamw_bf16_stochastic": (osa.sparse_adamw, {"weight_decay": 1e-2, **STOCHASTIC}),
  "l2_amsgrad_bf16": (osa.sparse_adam, {"weight_decay": 1e-2, "amsgrad": True, **BF16}),
  "rowwise_bf16mu_stochastic": (
    osa.sparse_adam,
    {"rowwise_second_moment": True, "mu_dtype": "bfloat16", "moment_rounding": "stochastic"},
  ),
  "rowwise": (osa.sparse_adam, {"rowwise_second_moment": True}),
  "rowwise_adamw": (osa.sparse_adamw, {"weight_decay": 1e-2, "rowwise_second_moment": True}),
  "rowwise_l2_amsgrad_per_row": (
    osa.sparse_adam,
    {
      "weight_decay": 1e-2,
      "rowwise_second_moment": True,
      "amsgrad": True,
      "per_row_bias_correction": True,
    },
  ),
}


class _Stepper:
  """One option's jitted, donated step over its own tables, run `n` steps at a time."""

  def __init__(self, opt, num_rows: int, grads: list[Any], *, cpu_kernels: bool = True):
    dim = grads[0]["table"].shape[1]
    self.params = {"table": jnp.zeros((num_rows, dim), jnp.float32)}
    self.state = opt.init(self.params)
    self.grads = grads
    self.jitted = jax.jit(c.sparse_step(opt), donate_argnums=(0, 1))
    self.k = 0
    self.cpu_kernels = cpu_kernels  # the setting is part of jit's cache key: keep it per call

  def seconds_per_step(self, n: int) -> float:
    p, s = self.params, self.state
    with kernels.use_cpu_kernels(self.cpu_kernels):
      start = time.perf_counter()
      for _ in range(n):
        p, s = self.jitted(p, s, self.grads[self.k % len(self.grads)])
        self.k += 1
      jax.block_until_ready((p, s))
      elapsed = time.perf_counter() - start
    self.params, self.state = p, s
    return elapsed / n


def _times(
  option: _Stepper, default: _Stepper, *, rounds: int, steps: int
) -> list[tuple[float, float]]:
  """(default, option) seconds per step in each of `rounds` interleaved rounds."""
  option.seconds_per_step(3)  # compile and warm up
  default.seconds_per_step(3)
  out = []
  for _ in range(rounds):
    base = default.seconds_per_step(steps)
    out.append((base, option.seconds_per_step(steps)))
  return out


def _summary(times: list[tuple[float, float]]) -> str:
  """The median (and range) of the per-round ratios, then the ratio of the fastest rounds.

  On a loaded machine a round that another process interrupted is slow, not
  fast: the fastest rounds of each are the least disturbed, so their ratio is
  the steadier figure when the median's range is wide.
  """
  ratios = [option / base for base, option in times]
  fastest = min(option for _, option in times) / min(base for base, _ in times)
  return (
    f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); fastest {fastest:.2f}"
  )


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)
  parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per option")
  parser.add_argument("--dist", nargs="*", default=["zipf", "uniform"], help="id distributions")
  parser.add_argument("--only", nargs="*", default=None, help="options to time (default: all)")
  parser.add_argument("--xla", action="store_true", help="also time each option on XLA ops")
  parser.add_argument(
    "--batches",
    type=int,
    default=128,
    help="distinct id batches cycled (catch-up's idle counts vary as in training only with many)",
  )
  args = parser.parse_args(argv)
  names = args.only or list(OPTIONS)
  v, d, b = args.vocab, args.dim, args.batch

  print(
    f"# every option's step / the default step: V={v:,}, D={d}, B={b:,}, float32 table,"
    f" {args.batches} id batches cycled"
  )
  print(f"machine: {c.machine()}; CPU kernels built: {kernels.available()}")
  print(
    f"median (range) of the ratios in {args.rounds} interleaved rounds of {args.steps} steps"
    " each; fastest: the fastest option round / the fastest default round\n"
  )
  paths = (True, False) if args.xla else (True,)
  columns = [f"{dist}{'' if on else ', XLA ops'}" for dist in args.dist for on in paths]
  print("| option | " + " | ".join(columns) + " |")
  print("|---" * (1 + len(columns)) + "|")
  grads_of = {}
  for dist in args.dist:
    # Values cycle apart from the ids: only the ids decide which rows are idle, and how long.
    ids = c.id_batches(dist, v, b, count=args.batches)
    values = [jnp.asarray(x) for x in c.grad_values(b, d)]
    grads_of[dist] = [
      {"table": sparse.BCOO((values[k % len(values)], jnp.asarray(i[:, None])), shape=(v, d))}
      for k, i in enumerate(ids)
    ]
  defaults = {dist: _Stepper(osa.sparse_adam(1e-3), v, grads_of[dist]) for dist in args.dist}
  for name in names:
    factory, kwargs = OPTIONS[name]
    cells = []
    for dist in args.dist:
      for on in paths:
        option = _Stepper(factory(1e-3, **kwargs), v, grads_of[dist], cpu_kernels=on)
        times = _times(option, defaults[dist], rounds=args.rounds, steps=args.steps)
        del option
        cells.append(_summary(times))
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
