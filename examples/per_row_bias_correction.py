"""How per-row bias correction changes the convergence of rare embedding rows.

Task: learn an embedding table `E` (rows x dim) from noisy observations
`y = W[id] + noise` with ids drawn from a Zipf law, so a few rows are seen
thousands of times and most rows a handful of times. The loss of a batch is
`0.5 * mean ||E[id] - y||^2`; its gradient is a BCOO over the batch's ids.

We train with `sparse_adam` (torch SparseAdam's numerics: one step count per
table, so a row first touched at step 5000 gets the bias correction of step
5000) and with `sparse_adam(per_row_bias_correction=True)` (each row counts its
own steps from its first touch), for two learning rates, and report the error
`||E_r - W_r||^2 / dim` of the rows grouped by how often they were seen.

Run: `python examples/per_row_bias_correction.py`.

Gallery:
  title: Per-row bias correction and rare rows
  extras: examples
  shows: how per_row_bias_correction changes the error of rarely seen rows, by how often rows
    were seen
  run time: 4.4 s on the 2-core shared CPU VM of the project, under nice, 2026-11-23
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

import optax_sparse_adam as osa

BUCKETS = ((1, 2), (3, 10), (11, 100), (101, None), (1, None))


def batches(rng, num_steps, batch, rows, zipf_a):
  """Zipf ids, shuffled over rows so popularity does not follow the row number."""
  ranks = rng.zipf(zipf_a, size=(num_steps, batch)) - 1
  ranks = np.where(ranks < rows, ranks, rng.integers(0, rows, size=ranks.shape))
  perm = rng.permutation(rows)
  return perm[ranks].astype(np.int32)


def train(ids, target, noise, lr, per_row, chunk):
  rows, dim = target.shape
  opt = osa.sparse_adam(lr, per_row_bias_correction=per_row)
  params = jnp.zeros((rows, dim))
  state = opt.init(params)

  def step(carry, xs):
    params, state = carry
    batch_ids, batch_noise = xs
    pred = params[batch_ids]
    residual = pred - (target[batch_ids] + batch_noise)
    loss = 0.5 * jnp.mean(jnp.sum(residual**2, axis=-1))
    # d loss / d E is a BCOO: one row per looked-up id, duplicates summed by the optimizer.
    grad = sparse.BCOO((residual / batch_ids.shape[0], batch_ids[:, None]), shape=(rows, dim))
    updates, state = opt.update(grad, state)
    return (osa.apply_updates(params, updates), state), loss

  run_chunk = jax.jit(lambda carry, xs: jax.lax.scan(step, carry, xs), donate_argnums=0)
  carry, losses = (params, state), []
  label = f"lr={lr:g} {'per-row' if per_row else 'default'}"
  for start in tqdm(range(0, len(ids), chunk), desc=f"{label:>20}", leave=False):
    carry, chunk_losses = run_chunk(
      carry, (jnp.asarray(ids[start : start + chunk]), jnp.asarray(noise[start : start + chunk]))
    )
    losses.append(np.asarray(chunk_losses))
  return np.asarray(carry[0]), np.concatenate(losses)


def bucket_name(lo, hi):
  if hi is not None:
    return f"{lo}-{hi}"
  return "all" if lo == 1 else f">{lo - 1}"


def bucket_errors(table, target, counts):
  err = ((table - target) ** 2).mean(axis=1)
  out = []
  for lo, hi in BUCKETS:
    mask = (counts >= lo) & (counts <= (hi if hi is not None else counts.max()))
    out.append((int(mask.sum()), float(err[mask].mean()) if mask.any() else float("nan")))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=20_000)
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=2_000)
  parser.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the ids")
  parser.add_argument("--noise", type=float, default=0.3, help="std of the observation noise")
  parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.05, 0.2])
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  rng = np.random.default_rng(args.seed)
  target = jnp.asarray(rng.normal(size=(args.rows, args.dim)), jnp.float32)
  ids = batches(rng, args.steps, args.batch, args.rows, args.zipf)
  noise = (args.noise * rng.normal(size=(args.steps, args.batch, args.dim))).astype(np.float32)
  counts = np.bincount(ids.ravel(), minlength=args.rows)
  first_seen = np.full(args.rows, -1)
  for step in range(args.steps - 1, -1, -1):
    first_seen[ids[step]] = step
  print(
    f"{args.rows} rows x {args.dim}, {args.steps} steps of {args.batch} Zipf({args.zipf}) ids: "
    f"{(counts > 0).sum()} rows touched, median first touch of rows seen 1-2 times: "
    f"step {int(np.median(first_seen[(counts >= 1) & (counts <= 2)]))}"
  )

  start = time.perf_counter()
  results = {}
  for lr in args.lrs:
    for per_row in (False, True):
      table, losses = train(ids, target, noise, lr, per_row, chunk=250)
      results[lr, per_row] = (bucket_errors(np.asarray(table), np.asarray(target), counts), losses)

  floor = args.noise**2
  print(f"\nMean squared error per row ||E_r - W_r||^2/dim (noise floor ~ {floor:.3f}/seen count)")
  header = f"{'seen (times)':>14} {'rows':>6} " + " ".join(
    f"{f'lr={lr:g} ' + ('per-row' if p else 'default'):>20}"
    for lr in args.lrs
    for p in (False, True)
  )
  print(header)
  for b, (lo, hi) in enumerate(BUCKETS):
    name = bucket_name(lo, hi)
    num = results[args.lrs[0], False][0][b][0]
    cells = " ".join(f"{results[lr, p][0][b][1]:>20.4f}" for lr in args.lrs for p in (False, True))
    print(f"{name:>14} {num:>6} {cells}")
  last = max(1, args.steps // 10)
  cells = " ".join(
    f"{results[lr, p][1][-last:].mean():>20.4f}" for lr in args.lrs for p in (False, True)
  )
  print(f"{'train loss*':>14} {'':>6} {cells}")
  print(f"* mean batch loss over the last {last} steps (dominated by popular rows).")
  print("\nSummary: best error over the learning rates, per bucket of rows")
  for b, (lo, hi) in enumerate(BUCKETS):
    name = bucket_name(lo, hi)
    best = {p: min((results[lr, p][0][b][1], lr) for lr in args.lrs) for p in (False, True)}
    (err_d, lr_d), (err_p, lr_p) = best[False], best[True]
    print(
      f"  rows seen {name:>6}: default {err_d:.4f} (lr={lr_d:g}), per-row {err_p:.4f} "
      f"(lr={lr_p:g}): per-row/default = {err_p / err_d:.2f}x"
    )
  loss = {p: min((results[lr, p][1][-last:].mean(), lr) for lr in args.lrs) for p in (False, True)}
  print(
    f"  train loss: default {loss[False][0]:.4f} (lr={loss[False][1]:g}), per-row "
    f"{loss[True][0]:.4f} (lr={loss[True][1]:g})"
  )
  b1, b2 = 0.9, 0.999
  print(
    "  A row's first update is lr x (1-b1)/sqrt(1-b2) x sqrt(1-b2^t)/(1-b1^t) under the default "
    f"(up to {(1 - b1) / (1 - b2) ** 0.5:.2f} lr for rows first seen late), exactly lr with "
    "per-row bias correction."
  )
  print(f"\n({time.perf_counter() - start:.1f} s of training)")


if __name__ == "__main__":
  main()
