"""End-to-end jitted Flax NNX train step: SparseEmbed + sparse_adam vs nnx.Embed + optax.adam.

The two-tower model of `examples/recommender_nnx.py` with two V x D tables (users and
items, D = 64), batch 4096 with Zipf-distributed ids, at V = 1,000,000 and V = 1,000 by
default (at 1,000 rows the arithmetic is negligible and the per-call cost of the Python
wrapper shows), with the model and optimizer donated:
  * sparse: BCOO table grads (`osa.sparse_value_and_grad`), `sparse_adam` on the
    tables and `adamw` on the towers, applied by scatter (`osa.SparseOptimizer`);
  * dense:  `nnx.value_and_grad` (dense V x D grads) and `optax.adam` on everything
    (`nnx.Optimizer`).
Each runs in three forms: `nnx.jit` (walks the model and optimizer graph at each call),
`nnx.cached_partial` over the same `nnx.jit` step (the form the docs show first: the walk
is cached), and, for the sparse step, `jax.jit` over the `nnx.split` state. It also prints
what `nnx.jit` walks for each (graph nodes, Variables, array leaves) and the time of a
no-op `nnx.jit` call over (model, optimizer): the walk alone. All forms run in this
process, taking turns step by step so that a change in machine load hits each; medians
and ratios are printed.

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


@nnx.jit(donate_argnums=(0, 1))
def noop_step(model, optimizer):
  """Nothing but the walk: `nnx.jit`'s per-call cost over (model, optimizer)."""
  return jnp.zeros((), jnp.float32)


def walk_counts(*nodes):
  """(graph nodes, Variables, array leaves) that `nnx.jit` walks for `nodes` at each call."""
  graphdef, state = nnx.split(nodes)
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return len(graphdef.nodes), len(variables), len(jax.tree.leaves(state))


def time_noop(model, optimizer, batches):
  times = []
  for _ in batches:  # one no-op call per batch, to interleave with the steps
    start = time.perf_counter()
    jax.block_until_ready(noop_step(model, optimizer))
    times.append(time.perf_counter() - start)
  return times


def time_cached(step, batches):
  times = []
  for batch in batches:
    start = time.perf_counter()
    jax.block_until_ready(step(*batch))
    times.append(time.perf_counter() - start)
  return times


def run(num_rows, args):
  """Times every form at `num_rows`; returns {form: median ms} and prints the rounds."""
  lr = 1e-3
  sparse_model = TwoTower(
    num_rows, num_rows, args.dim, args.hidden, embed_cls=osa.SparseEmbed, rngs=nnx.Rngs(0)
  )
  tx = optax.multi_transform(
    {"sparse": osa.sparse_adam(lr), "dense": optax.adamw(lr)}, osa.table_labels(sparse_model)
  )
  sparse_opt = osa.SparseOptimizer(sparse_model, tx, wrt=nnx.Param)
  dense_model = TwoTower(
    num_rows, num_rows, args.dim, args.hidden, embed_cls=nnx.Embed, rngs=nnx.Rngs(0)
  )
  dense_opt = nnx.Optimizer(dense_model, optax.adam(lr), wrt=nnx.Param)
  counts = {
    "sparse": walk_counts(sparse_model, sparse_opt),
    "dense": walk_counts(dense_model, dense_opt),
  }

  # Small tables: as many dense steps as sparse ones (both take ms).
  dense_steps = args.sparse_steps if num_rows <= 100_000 else args.dense_steps
  batches = zipf_batches(num_rows, args.batch_size, max(args.sparse_steps, dense_steps), 0)
  sparse_cached = nnx.cached_partial(sparse_step, sparse_model, sparse_opt)
  dense_cached = nnx.cached_partial(dense_step, dense_model, dense_opt)
  pure_step = pure_sparse_step(nnx.graphdef((sparse_model, sparse_opt)))
  forms = {
    "sparse nnx.jit": lambda b: time_steps(sparse_step, sparse_model, sparse_opt, b),
    "sparse cached_partial": lambda b: time_cached(sparse_cached, b),
    "sparse jax.jit split": lambda b: time_pure_steps(pure_step, sparse_model, sparse_opt, b),
    "dense nnx.jit": lambda b: time_steps(dense_step, dense_model, dense_opt, b),
    "dense cached_partial": lambda b: time_cached(dense_cached, b),
    "walk sparse": lambda b: time_noop(sparse_model, sparse_opt, b),
    "walk dense": lambda b: time_noop(dense_model, dense_opt, b),
  }
  first_call = {}
  for name, form in forms.items():
    start = time.perf_counter()
    form(batches[:1])  # compile + first step
    first_call[name] = time.perf_counter() - start

  def cache_sizes():
    return (
      sparse_step.jitted_fn._cache_size(),
      dense_step.jitted_fn._cache_size(),
      pure_step._cache_size(),
    )

  compiled = cache_sizes()
  times = {name: [] for name in forms}
  for r in range(args.rounds):
    # Step by step, each form in turn: a burst of load on a shared machine hits them all.
    for i in range(len(batches)):
      for name, form in forms.items():
        if i < (dense_steps if name.startswith("dense") else args.sparse_steps):
          times[name] += form(batches[i : i + 1])
    print(
      f"V = {num_rows:,}, round {r + 1}/{args.rounds}: "
      + ", ".join(f"{name} {np.median(t) * 1e3:.2f}" for name, t in times.items())
      + " ms",
      flush=True,
    )
  assert cache_sizes() == compiled, "a timed step compiled again"
  return {name: float(np.median(t) * 1e3) for name, t in times.items()}, counts, first_call


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--num-rows", type=int, nargs="+", default=[1_000_000, 1_000], help="rows V of each table"
  )
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--batch-size", type=int, default=4096)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--sparse-steps", type=int, default=10, help="sparse steps per round")
  parser.add_argument(
    "--dense-steps", type=int, default=2, help="dense steps per round above 100,000 rows"
  )
  args = parser.parse_args()

  results = {num_rows: run(num_rows, args) for num_rows in args.num_rows}
  print(
    f"\nFlax NNX two-tower train step, 2 tables of V x {args.dim}, batch {args.batch_size}, "
    f"model and optimizer donated, {jax.default_backend()}, {jax.device_count()} device(s); "
    "median ms per step"
  )
  columns = (
    ("sparse nnx.jit", "sparse, nnx.jit"),
    ("sparse cached_partial", "sparse, cached_partial"),
    ("sparse jax.jit split", "sparse, jax.jit split"),
    ("dense nnx.jit", "dense, nnx.jit"),
    ("dense cached_partial", "dense, cached_partial"),
  )
  print(f"{'V':>10}" + "".join(f"{title:>24}" for _, title in columns))
  for num_rows, (medians, _, _) in results.items():
    print(f"{num_rows:>10,}" + "".join(f"{medians[key]:>24.2f}" for key, _ in columns))
  print("\nspeed-up against dense nnx.Embed + optax.adam under nnx.jit (the same form for both):")
  for num_rows, (medians, _, _) in results.items():
    dense = medians["dense nnx.jit"]
    print(
      f"  V = {num_rows:>9,}: nnx.jit {dense / medians['sparse nnx.jit']:.2f}x, "
      f"cached_partial {medians['dense cached_partial'] / medians['sparse cached_partial']:.2f}x"
      f" (against dense cached_partial), "
      f"{dense / medians['sparse cached_partial']:.2f}x (against dense nnx.jit), "
      f"jax.jit split {dense / medians['sparse jax.jit split']:.2f}x"
    )
  print("\nwhat nnx.jit walks at each call over (model, optimizer), and the walk alone:")
  for num_rows, (medians, counts, _) in results.items():
    for side in ("sparse", "dense"):
      nodes, variables, leaves = counts[side]
      print(
        f"  V = {num_rows:>9,} {side:>6}: {nodes} graph nodes, {variables} Variables, "
        f"{leaves} array leaves; no-op nnx.jit call {medians['walk ' + side]:.3f} ms"
      )
  for num_rows, (medians, _, _) in results.items():
    overhead = {
      side: medians[f"{side} nnx.jit"] - medians[f"{side} cached_partial"]
      for side in ("sparse", "dense")
    }
    print(
      f"  V = {num_rows:>9,}: nnx.jit minus cached_partial: sparse {overhead['sparse']:.2f} ms, "
      f"dense {overhead['dense']:.2f} ms"
    )


if __name__ == "__main__":
  main()
