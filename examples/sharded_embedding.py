"""Train a recommender's embedding tables sharded over 8 devices with sparse_adam.

Matrix factorisation on synthetic ratings: a rating is the dot product of a user
embedding and an item embedding. Both tables, and their Adam moments, are split
by rows over a 1-D mesh of all devices (PartitionSpec('x', None)); each batch
is split over the same axis. XLA's SPMD partitioner does all the communication:
each device updates only the rows it holds, and only gradient-sized arrays
(ids and gathered rows) cross devices.

On a CPU-only machine the script makes 8 host devices
(--xla_force_host_platform_device_count), so it shows the layout without
accelerators; on GPUs or TPUs the same code uses the real devices.

  python examples/sharded_embedding.py
  python examples/sharded_embedding.py --steps 2000 --users 1000000

Gallery:
  title: Sharded embedding tables
  extras: examples
  shows: user and item tables row-sharded over 8 (forced CPU) devices, trained by sparse_adam
    under jit
  run time: 12.0 s on the 2-core shared CPU VM of the project, under nice, 2026-11-23
"""

import _gallery  # the extras this example needs, read from the Gallery block above

_gallery.require_extras(__doc__, __file__)

import argparse
import os
import time

# Forced host devices matter only for the CPU backend; set before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--users", type=int, default=20_000)
  parser.add_argument("--items", type=int, default=5_000)
  parser.add_argument("--dim", type=int, default=32)
  parser.add_argument("--batch", type=int, default=4096, help="global batch size")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--learning-rate", type=float, default=0.02)
  return parser.parse_args()


def synthetic_ratings(args, rng):
  """Ratings from hidden rank-8 factors plus noise; item popularity is Zipf-like."""
  true_users = rng.normal(size=(args.users, 8)).astype(np.float32) / 8**0.25
  true_items = rng.normal(size=(args.items, 8)).astype(np.float32) / 8**0.25
  popularity = 1.0 / np.arange(1, args.items + 1) ** 0.8
  popularity /= popularity.sum()

  def sample(n):
    users = rng.integers(0, args.users, size=n).astype(np.int32)
    items = rng.choice(args.items, size=n, p=popularity).astype(np.int32)
    ratings = np.sum(true_users[users] * true_items[items], axis=-1)
    ratings += 0.1 * rng.normal(size=n).astype(np.float32)
    return users, items, ratings.astype(np.float32)

  return sample


def loss_of_rows(user_rows, item_rows, ratings):
  return jnp.mean((jnp.sum(user_rows * item_rows, axis=-1) - ratings) ** 2)


def make_train_step(optimizer):
  def train_step(params, opt_state, users, items, ratings):
    # The model sees only the gathered rows, so the gradient is taken with
    # respect to them; paired with the ids it is the tables' gradient as a BCOO
    # (entry k adds row grad[k] at row ids[k]), and no dense table-sized
    # gradient is ever formed. (The Flax glue of optax_sparse_adam does this for
    # nnx.Embed; plain JAX keeps this example self-contained.)
    user_rows = params["user"][users]
    item_rows = params["item"][items]
    loss, (user_grad, item_grad) = jax.value_and_grad(loss_of_rows, argnums=(0, 1))(
      user_rows, item_rows, ratings
    )
    grads = {
      "user": sparse.BCOO((user_grad, users[:, None]), shape=params["user"].shape),
      "item": sparse.BCOO((item_grad, items[:, None]), shape=params["item"].shape),
    }
    updates, opt_state = optimizer.update(grads, opt_state)
    return osa.apply_updates(params, updates), opt_state, loss

  return train_step


def main():
  args = parse_args()
  devices = jax.devices()
  if args.batch % len(devices):
    raise SystemExit(f"--batch {args.batch} must be a multiple of the {len(devices)} devices.")
  # A 1-D mesh over every device. Auto axes let XLA's partitioner place the
  # gathers and scatters; with Explicit axes (jax.make_mesh's default) the
  # optimizer works too, but the model's own lookup `table[ids]` must then be
  # wrapped in jax.sharding.auto_axes.
  mesh = jax.make_mesh((len(devices),), ("x",), axis_types=(AxisType.Auto,))
  table_sharding = NamedSharding(mesh, P("x", None))
  batch_sharding = NamedSharding(mesh, P("x"))

  rng = np.random.default_rng(0)
  sample = synthetic_ratings(args, rng)
  params = {
    "user": jax.device_put(
      0.1 * rng.normal(size=(args.users, args.dim)).astype(np.float32), table_sharding
    ),
    "item": jax.device_put(
      0.1 * rng.normal(size=(args.items, args.dim)).astype(np.float32), table_sharding
    ),
  }
  optimizer = osa.sparse_adam(args.learning_rate)
  opt_state = optimizer.init(params)  # m and v are created with the tables' sharding
  train_step = jax.jit(make_train_step(optimizer), donate_argnums=(0, 1))
  evaluate = jax.jit(lambda params, u, i, r: loss_of_rows(params["user"][u], params["item"][i], r))
  held_out = [jax.device_put(x, batch_sharding) for x in sample(16 * args.batch)]
  train_data = sample(args.steps * args.batch)

  initial_mse = float(evaluate(params, *held_out))
  start = None
  progress = tqdm(
    range(args.steps), desc=f"training on {len(devices)} {devices[0].platform}", mininterval=0.5
  )
  for step in progress:
    part = slice(step * args.batch, (step + 1) * args.batch)
    batch = [jax.device_put(x[part], batch_sharding) for x in train_data]
    params, opt_state, loss = train_step(params, opt_state, *batch)
    if step == 0:
      jax.block_until_ready(loss)
      start = time.perf_counter()  # time the steps after compilation
    if step % 50 == 0 or step == args.steps - 1:
      progress.set_postfix(train_mse=f"{float(loss):.4f}")
  jax.block_until_ready(params)
  seconds_per_step = (time.perf_counter() - start) / max(args.steps - 1, 1)
  final_mse = float(evaluate(params, *held_out))

  table = params["user"]
  per_device = sum(
    x.addressable_shards[0].data.nbytes
    for x in (params["user"], params["item"], opt_state.mu["user"], opt_state.mu["item"])
    + (opt_state.nu["user"], opt_state.nu["item"])
  )
  total = sum(
    x.nbytes for tree in (params, opt_state.mu, opt_state.nu) for x in jax.tree.leaves(tree)
  )
  print()
  print(f"devices:              {len(devices)} x {devices[0].device_kind}")
  print(f"tables:               user {table.shape}, item {params['item'].shape}, float32")
  print(
    f"table sharding:       {table.sharding.spec}; moments: {opt_state.mu['user'].sharding.spec}"
  )
  print(
    f"memory per device:    {per_device / 2**20:.1f} MiB of {total / 2**20:.1f} MiB "
    f"(tables + m + v; 1/{total / per_device:.0f})"
  )
  print(f"held-out MSE:         {initial_mse:.4f} -> {final_mse:.4f} (noise floor 0.0100)")
  print(f"time per step:        {1e3 * seconds_per_step:.1f} ms (batch {args.batch})")


if __name__ == "__main__":
  main()
