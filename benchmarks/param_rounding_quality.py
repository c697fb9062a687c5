"""16-bit tables that learn: float32 against bfloat16/float16, rounded to nearest or stochastically.

The recipe of docs/reliability.md's mixed-precision table
(`tests/core/mixed_precision_drift.py`): a 64 x 8 table trained for 1,000
steps of `sparse_adam` (float32 moments) on a noisy quadratic loss, 16 random
rows a step (duplicates included), in one `lax.scan`; here over several seeds
(each its own target, start, rows and noise). Printed: the final loss (mean and
min..max over seeds) of the float32 table, and of each 16-bit table with
`param_rounding="nearest"` (the default: updates below half an ulp are lost)
and `"stochastic"`, with each one's mean against float32's.

  python -m benchmarks.param_rounding_quality            # 5 seeds, lr 1e-3 and 1e-2
  python -m benchmarks.param_rounding_quality --seeds 2
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse

import optax_sparse_adam as osa

ROWS, DIM, NSE, STEPS = 64, 8, 16, 1000
TABLES = [
  ("float32", jnp.float32, "nearest"),
  ("bfloat16, nearest", jnp.bfloat16, "nearest"),
  ("bfloat16, stochastic", jnp.bfloat16, "stochastic"),
  ("float16, nearest", jnp.float16, "nearest"),
  ("float16, stochastic", jnp.float16, "stochastic"),
]


def recipe(seed: int):
  rng = np.random.default_rng(seed)
  target = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  init = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  indices = rng.integers(0, ROWS, size=(STEPS, NSE, 1)).astype(np.int32)
  noise = (0.1 * rng.normal(size=(STEPS, NSE, DIM))).astype(np.float32)
  return target, init, indices, noise


def final_loss(seed: int, dtype, param_rounding: str, learning_rate: float) -> float:
  target, init, indices, noise = recipe(seed)
  opt = osa.sparse_adam(
    learning_rate, mu_dtype=jnp.float32, nu_dtype=jnp.float32, param_rounding=param_rounding
  )
  target_j = jnp.asarray(target)

  def body(carry, xs):
    params, state = carry
    ids, eps = xs
    rows = ids[:, 0]
    # The gradient of 0.5 |p - target|^2 plus noise, in the table's dtype as autodiff gives.
    grad = (params[rows].astype(jnp.float32) - target_j[rows] + eps).astype(dtype)
    updates, state = opt.update(sparse.BCOO((grad, ids), shape=(ROWS, DIM)), state, params)
    return (osa.apply_updates(params, updates), state), None

  @jax.jit
  def run(params):
    (params, _), _ = lax.scan(body, (params, opt.init(params)), (indices, noise))
    return params

  table = np.asarray(run(jnp.asarray(init, dtype)), np.float64)
  return float(0.5 * np.mean((table - target) ** 2))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. n-1")
  parser.add_argument("--lr", type=float, nargs="+", default=[1e-3, 1e-2])
  args = parser.parse_args(argv)
  seeds = list(range(args.seeds))
  start = time.perf_counter()
  print(
    f"# {STEPS:,} steps of sparse_adam (float32 moments), {ROWS}x{DIM} table, {NSE} ids a "
    f"step, noisy quadratic loss; final loss over seeds {seeds} (lower is better)"
  )
  print("\n| lr | table | final loss, mean | min .. max | vs float32 (mean) |")
  print("|---|---|---|---|---|")
  for learning_rate in args.lr:
    finals = {
      name: np.array([final_loss(s, dtype, mode, learning_rate) for s in seeds])
      for name, dtype, mode in TABLES
    }
    base = finals["float32"].mean()
    for name, values in finals.items():
      print(
        f"| {learning_rate:g} | {name} | {values.mean():.4f} | {values.min():.4f} .. "
        f"{values.max():.4f} | {values.mean() / base - 1:+.2%} |"
      )
  print(f"\n{time.perf_counter() - start:.0f} s, {jax.default_backend()}")


if __name__ == "__main__":
  main()
