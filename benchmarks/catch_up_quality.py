"""Lazy, catch-up and dense Adam on one recommender problem: distance to dense Adam, and loss.

A matrix-factorisation recommender (user and item tables of D values, ratings
from hidden embeddings plus noise, Zipf-distributed user and item ids, MSE on
the dot product) trained with the same batches by:

- lazy Adam: `sparse_adam` (torch.optim.SparseAdam's numerics);
- catch-up: `sparse_adam(catch_up_idle_rows=True)`, the batch's rows brought
  up to date before the forward pass (`catch_up_rows`), `catch_up_all_rows`
  before each measurement;
- catch-up at the step only: the same without `catch_up_rows` (the gradient
  is taken at a row's value before its idle steps);
- dense Adam with the same eps placement: `sparse_adam` given a gradient that
  covers every row (zeros where the batch has none), so every row steps at
  every step.

Prints, per optimizer over several seeds, the relative distance of the tables
to dense Adam's at a few steps, and the held-out loss at the end. With
`--convex` the item table is fixed (the hidden one) and only the user table is
trained: a convex problem, whose dense trajectory is stable, so distances show
the catch-up's own error rather than the divergence of two nonconvex runs.

Run from the repository root:

  python -m benchmarks.catch_up_quality            # about a minute
  python -m benchmarks.catch_up_quality --quick
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

import optax_sparse_adam as osa


def make_problem(seed: int, users: int, items: int, dim: int, steps: int, batch: int):
  rng = np.random.default_rng(seed)
  true_u = rng.normal(size=(users, dim)) / dim**0.25
  true_i = rng.normal(size=(items, dim)) / dim**0.25

  def draw(n, size):
    return np.minimum(rng.zipf(1.3, size=size) - 1, n - 1).astype(np.int32)

  def ratings(u, i):
    return (np.sum(true_u[u] * true_i[i], axis=1) + 0.1 * rng.normal(size=u.shape)).astype(
      np.float32
    )

  batches = []
  for _ in range(steps):
    u, i = draw(users, batch), draw(items, batch)
    batches.append((u, i, ratings(u, i)))
  u, i = draw(users, 8 * batch), draw(items, 8 * batch)
  return batches, (u, i, ratings(u, i)), jnp.asarray(true_i, jnp.float32)


def loss_fn(rows_u, rows_i, y):
  return jnp.mean((jnp.sum(rows_u * rows_i, axis=1) - y) ** 2)


def train(kind: str, batches, held_out, users, items, dim, seed, checkpoints, fixed_items=None):
  catch_up = kind.startswith("catch-up")
  opt = osa.sparse_adam(0.05, catch_up_idle_rows=catch_up)
  key_u, key_i = jax.random.split(jax.random.key(seed))
  params = {
    "u": 0.1 * jax.random.normal(key_u, (users, dim)),
    "i": 0.1 * jax.random.normal(key_i, (items, dim)),
  }
  if fixed_items is not None:
    del params["i"]
  state = opt.init(params)
  all_u, all_i = jnp.arange(users)[:, None], jnp.arange(items)[:, None]

  @jax.jit
  def step(params, state, u, i, y):
    if kind == "catch-up":
      ids = {"u": u, "i": i}
      params, state = osa.catch_up_rows(opt, params, state, {name: ids[name] for name in params})
    rows_u = params["u"][u]
    rows_i = fixed_items[i] if fixed_items is not None else params["i"][i]
    g_u, g_i = jax.grad(loss_fn, argnums=(0, 1))(rows_u, rows_i, y)
    if kind == "dense":  # every row, a zero gradient where the batch has none
      g_u = jnp.zeros((users, dim)).at[u].add(g_u)
      g_i = jnp.zeros((items, dim)).at[i].add(g_i)
      grads = {
        "u": sparse.BCOO((g_u, all_u), shape=(users, dim)),
        "i": sparse.BCOO((g_i, all_i), shape=(items, dim)),
      }
    else:
      grads = {
        "u": sparse.BCOO((g_u, u[:, None]), shape=(users, dim)),
        "i": sparse.BCOO((g_i, i[:, None]), shape=(items, dim)),
      }
    grads = {name: grads[name] for name in params}
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  snapshots = {}
  for t, (u, i, y) in enumerate(batches, 1):
    params, state = step(params, state, u, i, y)
    if t in checkpoints:
      seen = osa.catch_up_all_rows(opt, params, state)[0] if catch_up else params
      snapshots[t] = jax.tree.map(np.asarray, seen)
  final = snapshots[max(checkpoints)]
  u, i, y = held_out
  items_table = fixed_items if fixed_items is not None else final["i"]
  return snapshots, float(loss_fn(final["u"][u], items_table[i], y))


def distance(a, b) -> float:
  num = sum(np.sum((a[k] - b[k]) ** 2) for k in a)
  den = sum(np.sum(b[k] ** 2) for k in b)
  return float(np.sqrt(num / den))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--users", type=int, default=5000)
  parser.add_argument("--items", type=int, default=2000)
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--convex", action="store_true", help="train the user table only")
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  if args.quick:
    args.users, args.items, args.steps, args.seeds = 1000, 500, 300, 2
  checkpoints = sorted({args.steps // 10, args.steps // 3, args.steps})
  print(
    f"# lazy vs catch-up vs dense Adam: users {args.users:,}, items {args.items:,}, "
    f"D={args.dim}, {args.steps} steps of {args.batch} Zipf(1.3) ids, lr 0.05, "
    f"{args.seeds} seeds" + (", item table fixed (convex)" if args.convex else "")
  )
  kinds = ("lazy", "catch-up at the step only", "catch-up", "dense")
  results = {kind: {"dist": {t: [] for t in checkpoints}, "loss": []} for kind in kinds}
  for seed in range(args.seeds):
    batches, held_out, true_items = make_problem(
      seed, args.users, args.items, args.dim, args.steps, args.batch
    )
    fixed = true_items if args.convex else None
    runs = {
      kind: train(
        kind, batches, held_out, args.users, args.items, args.dim, seed, checkpoints, fixed
      )
      for kind in results
    }
    for kind, (snapshots, loss) in runs.items():
      results[kind]["loss"].append(loss)
      for t in checkpoints:
        results[kind]["dist"][t].append(distance(snapshots[t], runs["dense"][0][t]))
  header = " | ".join(f"step {t}" for t in checkpoints)
  print(f"\n| optimizer | relative distance to dense Adam: {header} | held-out MSE |")
  print("|---|" + "---:|" * (len(checkpoints) + 1))
  for kind, r in results.items():
    dists = " | ".join(f"{np.mean(r['dist'][t]):.2e}" for t in checkpoints)
    loss = f"{np.mean(r['loss']):.4f} ± {np.std(r['loss']):.4f}"
    print(f"| {kind} | {dists} | {loss} |")


if __name__ == "__main__":
  main()
