"""Train a matrix-factorisation recommender with sparse_adam in a jitted, donated step.

Two embedding tables (users, items) predict ratings as dot products. The gradient
of each table is a BCOO (the looked-up ids and the cotangents of the looked-up
rows), so a step reads and writes only the rows in the batch, never the tables.

    python examples/train_embedding.py
    python examples/train_embedding.py --table-dtype bfloat16 --param-rounding stochastic
    python examples/train_embedding.py --help

Gallery:
  title: Matrix factorisation in plain JAX and optax
  extras: none
  optional extras: examples
  shows: two BCOO-gradient tables trained by sparse_adam in a jitted, donated step; loss curve
    and held-out RMSE
  run time: 6.9 s on the 2-core shared CPU VM of the project, under nice, 2026-11-23
"""

import _gallery  # the extras this example needs, read from the Gallery block above

_gallery.require_extras(__doc__, __file__)

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

import optax_sparse_adam as osa

try:
  from tqdm import trange
except ImportError:  # progress bars are optional

  def trange(n, **_):
    return range(n)


def make_ratings(rng, n_users, n_items, rank, n_ratings):
  """Ratings from planted low-rank factors; items drawn with Zipf-like popularity."""
  true_u = rng.normal(size=(n_users, rank)) / rank**0.25
  true_i = rng.normal(size=(n_items, rank)) / rank**0.25
  users = rng.integers(0, n_users, n_ratings)
  popularity = 1.0 / np.arange(1, n_items + 1) ** 1.1
  items = rng.choice(n_items, n_ratings, p=popularity / popularity.sum())
  ratings = np.sum(true_u[users] * true_i[items], axis=1) + 0.1 * rng.normal(size=n_ratings)
  return users.astype(np.int32), items.astype(np.int32), ratings.astype(np.float32)


def row_gradient(rows_grad, ids, num_rows):
  """The BCOO gradient of a table from the cotangents of its looked-up rows."""
  return sparse.BCOO((rows_grad, ids[:, None]), shape=(num_rows, rows_grad.shape[-1]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--users", type=int, default=50_000)
  parser.add_argument("--items", type=int, default=20_000)
  parser.add_argument("--dim", type=int, default=32)
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--lr", type=float, default=0.01)
  parser.add_argument(
    "--table-dtype",
    choices=["float32", "bfloat16", "float16"],
    default="float32",
    help="the tables' storage; their rows are read and trained in float32",
  )
  parser.add_argument(
    "--param-rounding",
    choices=["nearest", "stochastic"],
    default="nearest",
    help="how a 16-bit table stores its new rows (docs/memory.md)",
  )
  args = parser.parse_args()

  rng = np.random.default_rng(0)
  users, items, ratings = make_ratings(rng, args.users, args.items, 8, 2_000_000)
  n_test = 100_000
  test = (users[:n_test], items[:n_test], ratings[:n_test])
  train = (users[n_test:], items[n_test:], ratings[n_test:])

  key_u, key_i = jax.random.split(jax.random.key(0))
  params = {
    "users": (0.1 * jax.random.normal(key_u, (args.users, args.dim))).astype(args.table_dtype),
    "items": (0.1 * jax.random.normal(key_i, (args.items, args.dim))).astype(args.table_dtype),
  }
  # The moments in float32 whatever the tables' storage: a float16 second moment
  # underflows (docs/memory.md, "Choosing a precision").
  opt = osa.sparse_adam(
    learning_rate=args.lr,
    mu_dtype=jnp.float32,
    nu_dtype=jnp.float32,
    param_rounding=args.param_rounding,
  )
  state = opt.init(params)

  def loss_of_rows(user_rows, item_rows, ratings):
    predictions = jnp.sum(user_rows * item_rows, axis=-1)
    return jnp.mean((predictions - ratings) ** 2)

  # Donating params and state lets XLA scatter the touched rows in place; without
  # donation every step would copy both tables and both moments.
  def train_step(params, state, user_ids, item_ids, ratings):
    # Rows read in float32, so the gradients (and the moments) are float32 too.
    user_rows = params["users"][user_ids].astype(jnp.float32)
    item_rows = params["items"][item_ids].astype(jnp.float32)
    loss, (g_users, g_items) = jax.value_and_grad(loss_of_rows, argnums=(0, 1))(
      user_rows, item_rows, ratings
    )
    grads = {
      "users": row_gradient(g_users, user_ids, args.users),
      "items": row_gradient(g_items, item_ids, args.items),
    }
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state, loss

  train_step = jax.jit(train_step, donate_argnums=(0, 1))

  @jax.jit
  def rmse(params, user_ids, item_ids, ratings):
    rows = params["users"][user_ids], params["items"][item_ids]
    return jnp.sqrt(loss_of_rows(*(r.astype(jnp.float32) for r in rows), ratings))

  print(
    f"tables: users {args.users:,} x {args.dim}, items {args.items:,} x {args.dim} "
    f"({args.table_dtype}, param_rounding={args.param_rounding!r}); "
    f"{len(train[0]):,} training ratings; batch {args.batch}"
  )
  baseline = float(np.sqrt(np.mean((test[2] - train[2].mean()) ** 2)))
  start = time.perf_counter()
  curve = []
  bar = trange(args.steps, desc="training", unit="step", mininterval=1.0)
  for step in bar:
    batch = rng.integers(0, len(train[0]), args.batch)
    params, state, loss = train_step(params, state, *(a[batch] for a in train))
    if step % 100 == 0 or step == args.steps - 1:
      curve.append((step, float(loss)))
      if hasattr(bar, "set_postfix"):
        bar.set_postfix(loss=f"{float(loss):.4f}")
  elapsed = time.perf_counter() - start

  print("\nloss curve (training MSE):")
  for step, loss in curve:
    print(f"  step {step:5d}  {loss:.4f}")
  test_rmse = float(rmse(params, *test))
  print(
    f"\nheld-out RMSE {test_rmse:.4f} (predicting the mean: {baseline:.3f}); "
    f"{elapsed / args.steps * 1e3:.2f} ms per step including compilation, "
    f"per-table steps taken: {int(state.step['users'])}"
  )


if __name__ == "__main__":
  main()
