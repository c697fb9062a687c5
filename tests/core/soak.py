"""Soak run: 100,000 sparse_adam steps on a small table against a float64 reference.

Each step pulls the touched rows of a 256 x 16 float32 table towards a target (the
gradient of 0.5 * |p - target|^2) plus heavy-tailed noise whose scale changes by up to
nine orders of magnitude from step to step (1e-6 to 1e3); rows are drawn Zipf-like, so
some are touched every step and some rarely, with duplicates and out-of-range padding.
Steps run on device in chunks of `lax.scan`; a float64 NumPy reference of torch's
algorithm (tests/_helpers.py) computes its own gradients from its own params.

Checked at the end of every chunk (NaN and Inf are sticky in Adam's state, so a
transient one would still be visible):
  * params, mu and nu are finite;
  * |mu| <= the largest |g| seen and 0 <= nu <= the largest g^2 seen (each is a convex
    combination of past gradients);
  * the params stay within a drift bound of the float64 reference.

Run from the repository root: python -m tests.core.soak [--steps 100000]
"""

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import NumpySparseAdam

ROWS, DIM, NSE = 256, 16, 32


@dataclasses.dataclass
class SoakResult:
  steps: int
  seconds: float
  device_seconds: float
  max_drift: float
  drift_bound: float
  final_loss: float
  final_loss_reference: float
  max_abs_mu: float
  max_nu: float
  max_abs_grad: float
  finite: bool
  within_bounds: bool

  @property
  def ok(self) -> bool:
    return self.finite and self.within_bounds and self.max_drift <= self.drift_bound


def _chunk_inputs(
  rng: np.random.Generator, row_of_rank: np.ndarray, steps: int
) -> tuple[np.ndarray, np.ndarray]:
  """Indices (steps, NSE, 1) and noise (steps, NSE, DIM) for one chunk."""
  rank = np.minimum(rng.zipf(1.3, size=(steps, NSE)) - 1, ROWS + 7)  # >= ROWS: padding
  indices = np.where(rank >= ROWS, rank, row_of_rank[np.minimum(rank, ROWS - 1)])
  indices = indices[..., None].astype(np.int32)
  scale = 10.0 ** rng.uniform(-6, 3, size=(steps, 1, 1))
  noise = rng.standard_t(3, size=(steps, NSE, DIM)) * scale
  return indices, noise.astype(np.float32)


def make_chunk_fn(learning_rate: float):
  opt = osa.sparse_adam(learning_rate)

  @jax.jit
  def run_chunk(params, state, target, indices, noise):
    def body(carry, xs):
      params, state = carry
      step_indices, step_noise = xs
      rows = jnp.minimum(step_indices[:, 0], ROWS - 1)
      grad = params[rows] - target[rows] + step_noise
      updates, state = opt.update(
        sparse.BCOO((grad, step_indices), shape=(ROWS, DIM)), state, params
      )
      return (osa.apply_updates(params, updates), state), None

    (params, state), _ = lax.scan(body, (params, state), (indices, noise))
    return params, state

  return opt, run_chunk


def run_soak(
  steps: int = 100_000,
  chunk: int = 1_000,
  learning_rate: float = 1e-2,
  drift_bound: float = 1e-4,
  seed: int = 0,
  progress: bool = False,
) -> SoakResult:
  rng = np.random.default_rng(seed)
  target = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  init = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  row_of_rank = rng.permutation(ROWS)  # which rows are hot, fixed for the run
  opt, run_chunk = make_chunk_fn(learning_rate)
  params = jnp.asarray(init)
  state = opt.init(params)
  target_device = jnp.asarray(target)
  reference = NumpySparseAdam(init, lr=learning_rate)
  target64 = target.astype(np.float64)

  max_drift = max_abs_mu = max_nu = max_abs_grad = max_grad_sq = 0.0
  finite = within_bounds = True
  start = time.perf_counter()
  device_seconds = 0.0
  done = 0
  while done < steps:
    n = min(chunk, steps - done)
    indices, noise = _chunk_inputs(rng, row_of_rank, n)
    device_start = time.perf_counter()
    params, state = jax.block_until_ready(run_chunk(params, state, target_device, indices, noise))
    device_seconds += time.perf_counter() - device_start
    for t in range(n):
      step_indices = indices[t]
      rows = np.minimum(step_indices[:, 0], ROWS - 1)
      grad = reference.param[rows] - target64[rows] + noise[t]
      max_abs_grad = max(max_abs_grad, float(np.abs(grad).max()))
      max_grad_sq = max(max_grad_sq, float((grad * grad).max()))
      reference.step(step_indices, grad)
    done += n
    table, mu, nu = (np.asarray(x) for x in (params, state.mu, state.nu))
    finite &= bool(np.isfinite(table).all() and np.isfinite(mu).all() and np.isfinite(nu).all())
    # Bounds, with float32 slack: moments are convex combinations of past gradients.
    max_abs_mu = max(max_abs_mu, float(np.abs(mu).max()))
    max_nu = max(max_nu, float(nu.max()))
    within_bounds &= bool(
      max_abs_mu <= 1.01 * max_abs_grad and nu.min() >= 0 and max_nu <= 1.01 * max_grad_sq
    )
    max_drift = max(max_drift, float(np.abs(table - reference.param).max()))
    if progress and (done // chunk) % 10 == 0:
      print(
        f"  step {done:>7,}: max drift {max_drift:.2e}, finite={finite}, "
        f"in bounds={within_bounds}, {time.perf_counter() - start:6.1f} s",
        flush=True,
      )
  seconds = time.perf_counter() - start
  table = np.asarray(params, np.float64)
  return SoakResult(
    steps=done,
    seconds=seconds,
    device_seconds=device_seconds,
    max_drift=max_drift,
    drift_bound=drift_bound,
    final_loss=float(0.5 * np.mean((table - target64) ** 2)),
    final_loss_reference=float(0.5 * np.mean((reference.param - target64) ** 2)),
    max_abs_mu=max_abs_mu,
    max_nu=max_nu,
    max_abs_grad=max_abs_grad,
    finite=finite,
    within_bounds=within_bounds,
  )


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100_000)
  parser.add_argument("--chunk", type=int, default=1_000)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  print(
    f"soak: {args.steps:,} steps of sparse_adam on a {ROWS}x{DIM} float32 table, "
    f"{NSE} entries a step, chunks of {args.chunk:,} (lax.scan), on {jax.devices()[0]}"
  )
  result = run_soak(args.steps, args.chunk, seed=args.seed, progress=True)
  print(
    f"done: {result.steps:,} steps in {result.seconds:.1f} s, of which sparse_adam "
    f"{result.device_seconds:.1f} s (first chunk's compilation included; the rest is the "
    "float64 NumPy reference)\n"
    f"  state finite throughout:           {result.finite}\n"
    f"  moments within gradient bounds:     {result.within_bounds} "
    f"(max |mu| {result.max_abs_mu:.3g}, max nu {result.max_nu:.3g}, "
    f"max |g| {result.max_abs_grad:.3g})\n"
    f"  max |param - float64 reference|:    {result.max_drift:.2e} "
    f"(bound {result.drift_bound:.0e})\n"
    f"  final loss: {result.final_loss:.6f} (float64 reference {result.final_loss_reference:.6f})"
  )
  print("OK" if result.ok else "FAILED")
  return 0 if result.ok else 1


if __name__ == "__main__":
  sys.exit(main())
