"""The cost of `track_changed_rows=True` per rule, and of a delta, timed in one process.

For each rule's default factory, the jitted, donated `update` + `apply_updates`
step of a V x D float32 table with B ids a step is timed with tracking against
the same factory without it, in interleaved rounds (bench_options' method):
printed, the median of the per-round ratios tracked / untracked (and their
range), and the ratio of the fastest rounds. Then the time of `rows_delta` after
`--publish-every` steps, against one step.

`--digest` prints instead a hash of each default (untracked) step's lowered
program: run it on two checkouts to show that the default step did not change;
and of the catch-up step with tracking, which keeps the array catch-up keeps
(the same program as without).

Run from the repository root:

  python -m benchmarks.bench_online                 # a few minutes
  python -m benchmarks.bench_online --vocab 100000 --rounds 3
  PYTHONPATH=. python -m benchmarks.bench_online --digest
"""

import hashlib
import time

import jax
import jax.numpy as jnp
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks import _common as c
from benchmarks.bench_options import _Stepper, _summary, _times
from optax_sparse_adam._backends.cpu import kernels

FACTORIES = {
  "sparse_adam": lambda **kw: osa.sparse_adam(1e-3, **kw),
  "sparse_adamw, catch-up": lambda **kw: osa.sparse_adamw(1e-3, catch_up_idle_rows=True, **kw),
  "sparse_sgd": lambda **kw: osa.sparse_sgd(1e-2, **kw),
  "sparse_adagrad": lambda **kw: osa.sparse_adagrad(1e-2, **kw),
  "sparse_rowwise_adagrad": lambda **kw: osa.sparse_rowwise_adagrad(1e-2, **kw),
}


TRACKED = {"track_changed_rows": True}


def _digests(v: int, d: int, b: int) -> None:
  grads = {"table": sparse.BCOO((jnp.ones((b, d)), jnp.zeros((b, 1), jnp.int32)), shape=(v, d))}
  params = {"table": jnp.zeros((v, d))}
  tracked = [(name, {}) for name in FACTORIES] + [("sparse_adamw, catch-up", TRACKED)]
  for name, kwargs in tracked:
    opt = FACTORIES[name](**kwargs)
    lowered = jax.jit(c.sparse_step(opt), donate_argnums=(0, 1)).lower(
      params, opt.init(params), grads
    )
    text = lowered.as_text()
    name += ", tracked" if kwargs else ""
    print(f"{name}: {hashlib.sha256(text.encode()).hexdigest()[:16]} ({len(text)} chars)")


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)
  parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per rule")
  parser.add_argument("--publish-every", type=int, default=10, help="steps between deltas")
  parser.add_argument("--digest", action="store_true", help="hash the default steps instead")
  args = parser.parse_args(argv)
  v, d, b = args.vocab, args.dim, args.batch
  if args.digest:
    _digests(v, d, b)
    return
  print(f"# track_changed_rows=True / off, per rule: V={v:,}, D={d}, B={b:,}, float32 table")
  print(f"machine: {c.machine()}; CPU kernels built: {kernels.available()}")
  print(
    f"median (range) of the ratios in {args.rounds} interleaved rounds of {args.steps} steps"
    " each; fastest: the fastest tracked round / the fastest untracked round\n"
  )
  ids = c.id_batches("zipf", v, b, count=32)
  values = [jnp.asarray(x) for x in c.grad_values(b, d)]
  grads = [
    {"table": sparse.BCOO((values[k % len(values)], jnp.asarray(i[:, None])), shape=(v, d))}
    for k, i in enumerate(ids)
  ]
  print("| rule | tracked / untracked step | rows_delta / one step |")
  print("|---|---|---|")
  for name, factory in FACTORIES.items():
    off = _Stepper(factory(), v, grads)
    on = _Stepper(factory(track_changed_rows=True), v, grads)
    times = _times(on, off, rounds=args.rounds, steps=args.steps)
    del off
    step = min(t for _, t in times)
    since = int(on.state.count)
    on.seconds_per_step(args.publish_every)
    osa.rows_delta(on.params, on.state, since)  # compile
    start = time.perf_counter()
    delta = osa.rows_delta(on.params, on.state, since)
    jax.block_until_ready(delta)
    publish = time.perf_counter() - start
    print(f"| {name} | {_summary(times)} | {publish / step:.1f} |", flush=True)
    del on


if __name__ == "__main__":
  main()
