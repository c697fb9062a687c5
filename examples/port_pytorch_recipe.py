"""Porting a PyTorch recipe: nn.Embedding(sparse=True) + SparseAdam, and its JAX port.

The recipe is a small matrix-factorisation recommender: a user table and an
item table, a rating predicted as the dot product of two rows, squared error.
The PyTorch half is the code people already have; the JAX half keeps its
shape line by line (`Parameter`, `SparseAdam`, `.grad`, `step`, `zero_grad`),
with the sparse gradients built as BCOO from the gathered rows, as
nn.Embedding(sparse=True) builds them. Both start from the same tables and see
the same batches, so their loss curves coincide.

Run: python examples/port_pytorch_recipe.py  (the torch half runs if torch is installed)

Gallery:
  title: Porting a torch.optim.SparseAdam recipe
  extras: examples
  optional extras: torch
  shows: an nn.Embedding(sparse=True) + SparseAdam recipe and its torch_compat port, with loss
    curves side by side
  run time: 5.1 s (with torch installed) on the 2-core shared CPU VM of the project, under nice,
    2026-11-23
"""

import _gallery  # the extras this example needs, read from the Gallery block above

_gallery.require_extras(__doc__, __file__)

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse
from tqdm import tqdm

from optax_sparse_adam.torch_compat import Parameter, SparseAdam


def make_data(num_users, num_items, dim, num_ratings, seed):
  """Ratings from hidden low-rank tastes, plus noise; and the shared initial tables."""
  rng = np.random.default_rng(seed)
  true_users = rng.normal(size=(num_users, dim)).astype(np.float32) / dim**0.25
  true_items = rng.normal(size=(num_items, dim)).astype(np.float32) / dim**0.25
  users = rng.integers(0, num_users, size=num_ratings)
  items = rng.integers(0, num_items, size=num_ratings)
  ratings = np.sum(true_users[users] * true_items[items], axis=1)
  ratings = (ratings + 0.1 * rng.normal(size=num_ratings)).astype(np.float32)
  init_users = (0.1 * rng.normal(size=(num_users, dim))).astype(np.float32)
  init_items = (0.1 * rng.normal(size=(num_items, dim))).astype(np.float32)
  return users, items, ratings, init_users, init_items


def batches(num_ratings, batch_size, steps, seed):
  rng = np.random.default_rng(seed + 1)
  for _ in range(steps):
    yield rng.integers(0, num_ratings, size=batch_size)


def train_torch(data, args):
  """The original recipe."""
  import torch

  users, items, ratings, init_users, init_items = data
  user_emb = torch.nn.Embedding(len(init_users), args.dim, sparse=True)
  item_emb = torch.nn.Embedding(len(init_items), args.dim, sparse=True)
  with torch.no_grad():
    user_emb.weight.copy_(torch.from_numpy(init_users))
    item_emb.weight.copy_(torch.from_numpy(init_items))
  opt = torch.optim.SparseAdam(
    [{"params": user_emb.parameters()}, {"params": item_emb.parameters(), "lr": args.lr / 2}],
    lr=args.lr,
  )
  losses = []
  for batch in tqdm(
    batches(len(ratings), args.batch, args.steps, args.seed),
    total=args.steps,
    desc="torch",
    leave=False,
  ):
    u, i, r = (torch.from_numpy(x[batch]) for x in (users, items, ratings))
    pred = (user_emb(u) * item_emb(i)).sum(dim=1)
    loss = ((pred - r) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
  return np.array(losses)


@jax.jit
def loss_and_grads(user_table, item_table, users, items, ratings):
  """The loss and the tables' gradients as BCOO, like nn.Embedding(sparse=True)'s."""

  def loss_fn(user_rows, item_rows):
    pred = jnp.sum(user_rows * item_rows, axis=1)
    return jnp.mean((pred - ratings) ** 2)

  loss, (user_rows_grad, item_rows_grad) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
    user_table[users], item_table[items]
  )
  # One entry per looked-up row, repeats left uncoalesced, exactly as torch does.
  user_grad = sparse.BCOO((user_rows_grad, users[:, None]), shape=user_table.shape)
  item_grad = sparse.BCOO((item_rows_grad, items[:, None]), shape=item_table.shape)
  return loss, user_grad, item_grad


def train_jax(data, args):
  """The port: the same recipe on optax_sparse_adam.torch_compat."""
  users, items, ratings, init_users, init_items = data
  user_weight = Parameter(jnp.asarray(init_users))
  item_weight = Parameter(jnp.asarray(init_items))
  opt = SparseAdam(
    [{"params": [user_weight]}, {"params": [item_weight], "lr": args.lr / 2}], lr=args.lr
  )
  losses = []
  for batch in tqdm(
    batches(len(ratings), args.batch, args.steps, args.seed),
    total=args.steps,
    desc="jax",
    leave=False,
  ):
    loss, user_weight.grad, item_weight.grad = loss_and_grads(
      user_weight.data, item_weight.data, users[batch], items[batch], ratings[batch]
    )
    opt.step()
    opt.zero_grad()
    losses.append(float(loss))
  return np.array(losses), opt


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--users", type=int, default=1000)
  parser.add_argument("--items", type=int, default=500)
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--ratings", type=int, default=20_000)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--lr", type=float, default=0.05)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  data = make_data(args.users, args.items, args.dim, args.ratings, args.seed)
  start = time.perf_counter()
  jax_losses, opt = train_jax(data, args)
  jax_seconds = time.perf_counter() - start
  try:
    start = time.perf_counter()
    torch_losses = train_torch(data, args)
    torch_seconds = time.perf_counter() - start
  except ImportError:
    torch_losses, torch_seconds = None, None
    print("torch is not installed: showing the JAX port alone.\n")

  print(opt, "\n")
  every = max(1, args.steps // 10)
  header = f"{'step':>6}  {'jax loss':>10}"
  if torch_losses is not None:
    header += f"  {'torch loss':>10}  {'rel. diff':>9}"
  print(header)
  for step in list(range(0, args.steps, every)) + [args.steps - 1]:
    line = f"{step + 1:>6}  {jax_losses[step]:>10.5f}"
    if torch_losses is not None:
      rel = abs(jax_losses[step] - torch_losses[step]) / abs(torch_losses[step])
      line += f"  {torch_losses[step]:>10.5f}  {rel:>9.1e}"
    print(line)
  print(f"\nJAX port: {jax_seconds:.1f} s for {args.steps} steps (includes compilation).")
  if torch_losses is not None:
    gap = np.max(np.abs(jax_losses - torch_losses) / np.abs(torch_losses))
    print(f"PyTorch:  {torch_seconds:.1f} s. Largest relative gap between the curves: {gap:.1e}")
    print("(the gradients are summed in different orders by the two autodiffs; the optimizer")
    print(" steps themselves agree with torch.optim.SparseAdam to float32 rounding)")


if __name__ == "__main__":
  main()
