"""Mixed precision drift: low-precision params and moments against float64 references.

A 64 x 8 table is trained for 1,000 steps on a noisy quadratic loss (each step touches 16
random rows, duplicates included) inside one `lax.scan`, with params in float32, bfloat16
or float16 and moments (mu_dtype/nu_dtype) in the params' dtype or float32. It is compared
with two float64 NumPy references of torch's algorithm that compute their own gradients:

* "exact": everything in float64, the drift that low-precision storage costs;
* "same storage": float64 arithmetic, params rounded to the low-precision dtype after
  every step as stored params are; the difference is what our arithmetic adds.

Run from the repository root: python -m tests.core.mixed_precision_drift
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import NumpySparseAdam

ROWS, DIM, NSE, STEPS = 64, 8, 16, 1000

_rng = np.random.default_rng(0)
TARGET = _rng.normal(size=(ROWS, DIM)).astype(np.float32)
INIT = _rng.normal(size=(ROWS, DIM)).astype(np.float32)
INDICES = _rng.integers(0, ROWS, size=(STEPS, NSE, 1)).astype(np.int32)
NOISE = (0.1 * _rng.normal(size=(STEPS, NSE, DIM))).astype(np.float32)


def stored(x, dtype) -> np.ndarray:
  """`x` rounded to `dtype` (round to nearest even), returned as float64."""
  return np.asarray(np.asarray(x, np.float32), jnp.dtype(dtype)).astype(np.float64)


@functools.cache
def train(param_dtype, moment_dtype, learning_rate: float = 1e-3):
  """Our run: params in `param_dtype`, moments in `moment_dtype` (None: the param's)."""
  opt = osa.sparse_adam(learning_rate, mu_dtype=moment_dtype, nu_dtype=moment_dtype)
  target = jnp.asarray(TARGET)

  def body(carry, xs):
    params, state = carry
    indices, noise = xs
    rows = indices[:, 0]
    # The gradient of 0.5 * |p - target|^2 plus noise, in the params' dtype as autodiff gives.
    grad = (params[rows].astype(jnp.float32) - target[rows] + noise).astype(param_dtype)
    updates, state = opt.update(sparse.BCOO((grad, indices), shape=(ROWS, DIM)), state)
    return (osa.apply_updates(params, updates), state), None

  @jax.jit
  def run(params):
    (params, state), _ = lax.scan(body, (params, opt.init(params)), (INDICES, NOISE))
    return params, state

  return run(jnp.asarray(INIT, param_dtype))


@functools.cache
def reference(param_dtype, round_params: bool, learning_rate: float = 1e-3) -> np.ndarray:
  """float64 reference from the same initial (rounded) params."""
  ref = NumpySparseAdam(stored(INIT, param_dtype), lr=learning_rate)
  for t in range(STEPS):
    rows = INDICES[t, :, 0]
    grad = ref.param[rows] - TARGET[rows] + NOISE[t]
    if round_params:
      grad = stored(grad, param_dtype)
    ref.step(INDICES[t], grad)
    if round_params:
      ref.param = stored(ref.param, param_dtype)
  return ref.param


def drift(param_dtype, moment_dtype, round_params: bool, learning_rate: float = 1e-3):
  params, _ = train(param_dtype, moment_dtype, learning_rate)
  ref = reference(param_dtype, round_params, learning_rate)
  return np.abs(np.asarray(params, np.float64) - ref)


def drift_in_ulps(param_dtype, moment_dtype, learning_rate: float = 1e-3) -> np.ndarray:
  """Drift from the same-storage reference, in ulps of max(|reference|, 1) in `param_dtype`."""
  ref = reference(param_dtype, True, learning_rate)
  ulp = np.spacing(np.asarray(np.maximum(np.abs(ref), 1.0), jnp.dtype(param_dtype)))
  return drift(param_dtype, moment_dtype, True, learning_rate) / np.asarray(ulp, np.float64)


def loss(table) -> float:
  return float(0.5 * np.mean((np.asarray(table, np.float64) - TARGET) ** 2))


def main() -> None:
  print(
    f"{STEPS:,} steps, {ROWS}x{DIM} table, {NSE} entries a step, noisy quadratic loss; "
    f"initial loss {loss(INIT):.4f}"
  )
  print(
    "| lr | params | moments | max drift vs float64 | mean drift | "
    "max drift vs same-storage float64 | final loss (float64 ref) |"
  )
  print("|---|---|---|---|---|---|---|")
  configs = (
    (jnp.float32, None),
    (jnp.bfloat16, None),
    (jnp.bfloat16, jnp.float32),
    (jnp.float16, None),
    (jnp.float16, jnp.float32),
  )
  for learning_rate in (1e-3, 1e-2):
    for param_dtype, moment_dtype in configs:
      exact = drift(param_dtype, moment_dtype, False, learning_rate)
      if param_dtype == jnp.float32:
        same_storage = "-"
      else:
        same_storage = f"{drift_in_ulps(param_dtype, moment_dtype, learning_rate).max():.1f} ulp"
      params, _ = train(param_dtype, moment_dtype, learning_rate)
      moments = jnp.dtype(moment_dtype or param_dtype).name
      print(
        f"| {learning_rate:g} | {jnp.dtype(param_dtype).name} | {moments} | {exact.max():.2e} | "
        f"{exact.mean():.2e} | {same_storage} | {loss(params):.4f} "
        f"({loss(reference(param_dtype, False, learning_rate)):.4f}) |"
      )


if __name__ == "__main__":
  main()
