"""End-to-end jitted Flax NNX train step: SparseEmbed + sparse_adam vs nnx.Embed + optax.adam.

The two-tower model of `examples/recommender_nnx.py` with two V x D tables (users and
items, V = 1,000,000, D = 64 by default), batch 4096 with Zipf-distributed ids, both
steps under `nnx.jit` with the model and optimizer donated:
  * sparse: BCOO table grads (`osa.sparse_value_and_grad`), `sparse_adam` on the
    tables and `adamw` on the towers, applied by scatter (`osa.SparseOptimizer`);
  * dense:  `nnx.value_and_grad` (dense V x D grads) and `optax.adam` on everything
    (`nnx.Optimizer`).
Both run in this process, alternating in rounds so that a change in machine load hits
both; the median step time of each and their ratio are printed.

  python -m benchmarks.bench_flax
  python -m benchmarks.bench_flax --num-rows 100000 --rounds 2
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_sparse_adam as osa
from benchmarks._two_tower import TwoTower, dense_step, mse, sparse_step


def pure_sparse_step(graphdef):
  """The sparse step under `jax.jit` over `nnx.split` state: no per-call graph traversal."""

  def step(state, users, items, ratings):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = osa.sparse_value_and_grad(mse)(model, users, items, ratings)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))

  return jax.jit(step, donate_argnums=0)


def time_pure_steps(step, model, optimizer, batches):
  state = nnx.state((model, optimizer))
  times = []
  for batch in batches:
    start = time.perf_counter()
    loss, state = step(state, *batch)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - start)
  nnx.update((model, optimizer), state)  # the donated arrays live on in the model
  return times


def zipf_batches(num_rows, batch_size, count, seed):
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(count):
    # Zipf ranks (exponent 1.1) capped to the table; a fixed shuffle maps ranks to ids.
    users = np.minimum(rng.zipf(1.1, batch_size), num_rows) - 1
    items = np.minimum(rng.zipf(1.1, batch_size), num_rows) - 1
    ratings = rng.normal(size=batch_size).astype(np.float32)
    batches.append(
      tuple(
        jnp.asarray(x) for x in ((users * 7919) % num_rows, (items * 104729) % num_rows, ratings)
      )
    )
  return batches


def time_steps(step, model, optimizer, batches):
  times = []
  for batch in batches:
    start = time.perf_counter()
    jax.block_until_ready(step(model, optimizer, *batch))
    times.append(time.perf_counter() - start)
  return times


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num-rows", type=int, default=1_000_000, help="rows V of each table")
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--batch-size", type=int, default=4096)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--sparse-steps", type=int, default=10, help="sparse steps per round")
  parser.add_argument("--dense-steps", type=int, default=2, help="dense steps per round")
  args = parser.parse_args()

  lr = 1e-3
  sparse_model = TwoTower(
    args.num_rows, args.num_rows, args.dim, args.hidden, embed_cls=osa.SparseEmbed, rngs=nnx.Rngs(0)
  )
  tx = optax.multi_transform(
    {"sparse": osa.sparse_adam(lr), "dense": optax.adamw(lr)}, osa.table_labels(sparse_model)
  )
  sparse_opt = osa.SparseOptimizer(sparse_model, tx, wrt=nnx.Param)
  dense_model = TwoTower(
    args.num_rows, args.num_rows, args.dim, args.hidden, embed_cls=nnx.Embed, rngs=nnx.Rngs(0)
  )
  dense_opt = nnx.Optimizer(dense_model, optax.adam(lr), wrt=nnx.Param)

  batches = zipf_batches(
    args.num_rows, args.batch_size, max(args.sparse_steps, args.dense_steps), 0
  )
  compile_times = {}
  for name, step, model, opt in (
    ("sparse", sparse_step, sparse_model, sparse_opt),
    ("dense", dense_step, dense_model, dense_opt),
  ):
    start = time.perf_counter()
    jax.block_until_ready(step(model, opt, *batches[0]))  # compile + first step
    compile_times[name] = time.perf_counter() - start
  pure_step = pure_sparse_step(nnx.graphdef((sparse_model, sparse_opt)))
  start = time.perf_counter()
  time_pure_steps(pure_step, sparse_model, sparse_opt, batches[:1])
  compile_times["pure"] = time.perf_counter() - start

  sparse_times, pure_times, dense_times = [], [], []
  for r in range(args.rounds):
    sparse_times += time_steps(sparse_step, sparse_model, sparse_opt, batches[: args.sparse_steps])
    pure_times += time_pure_steps(pure_step, sparse_model, sparse_opt, batches[: args.sparse_steps])
    dense_times += time_steps(dense_step, dense_model, dense_opt, batches[: args.dense_steps])
    print(
      f"round {r + 1}/{args.rounds}: sparse {np.median(sparse_times) * 1e3:.2f} ms, "
      f"sparse (jax.jit) {np.median(pure_times) * 1e3:.2f} ms, "
      f"dense {np.median(dense_times) * 1e3:.1f} ms",
      flush=True,
    )
  assert sparse_step.jitted_fn._cache_size() == 1 and dense_step.jitted_fn._cache_size() == 1
  assert pure_step._cache_size() == 1

  sparse_ms, dense_ms = np.median(sparse_times) * 1e3, np.median(dense_times) * 1e3
  pure_ms = np.median(pure_times) * 1e3
  table_mb = args.num_rows * args.dim * 4 / 2**20
  print(
    f"\nFlax NNX two-tower train step, 2 tables of {args.num_rows:,} x {args.dim} "
    f"({table_mb:.0f} MiB each), batch {args.batch_size}, nnx.jit with donation, "
    f"{jax.default_backend()}, {jax.device_count()} device(s)"
  )
  print(f"{'':36}{'median ms/step':>16}{'steps timed':>13}{'first call s':>14}")
  print(
    f"{'SparseEmbed + sparse_adam/adamw':36}{sparse_ms:>16.2f}{len(sparse_times):>13}"
    f"{compile_times['sparse']:>14.1f}"
  )
  print(
    f"{'  same, jax.jit over nnx.split state':36}{pure_ms:>16.2f}{len(pure_times):>13}"
    f"{compile_times['pure']:>14.1f}"
  )
  print(
    f"{'nnx.Embed + optax.adam':36}{dense_ms:>16.2f}{len(dense_times):>13}"
    f"{compile_times['dense']:>14.1f}"
  )
  print(
    f"\nsparse path speed-up, end to end: {dense_ms / sparse_ms:.1f}x with nnx.jit, "
    f"{dense_ms / pure_ms:.1f}x with jax.jit over the split state (target >= 10x)"
  )


if __name__ == "__main__":
  main()
