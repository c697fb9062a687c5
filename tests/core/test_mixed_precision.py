"""Mixed precision: bfloat16 and float16 params with float32 moments (mu_dtype/nu_dtype).

tests/core/mixed_precision_drift.py trains a small table for 1,000 steps (one
`lax.scan`) and compares it with float64 NumPy references of torch's algorithm: an exact
one (the drift that low-precision storage costs) and one whose params are rounded to the
low-precision dtype after every step (the drift our arithmetic adds on top, which must
stay within two units in the last place). The README (Mixed precision) prints its table.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import train_step
from tests.core import mixed_precision_drift as mp

LOW = pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])


@LOW
def test_low_precision_params_keep_float32_moments_and_their_own_dtype(param_dtype):
  params, state = mp.train(param_dtype, jnp.float32)
  assert params.dtype == param_dtype
  assert state.mu.dtype == jnp.float32 and state.nu.dtype == jnp.float32
  assert np.isfinite(np.asarray(params, np.float32)).all()
  assert np.isfinite(state.mu).all() and np.isfinite(state.nu).all()
  assert int(state.step) == mp.STEPS
  assert mp.loss(params) < mp.loss(mp.INIT)  # it trains (bf16 slowly: see below)


@LOW
def test_drift_within_two_ulps_of_a_float64_run_with_the_same_storage(param_dtype):
  """Our float32 arithmetic adds at most 2 ulps over 1,000 steps to storage rounding."""
  assert mp.drift_in_ulps(param_dtype, jnp.float32).max() <= 2.0


def test_float32_drift_from_float64_is_at_rounding_level():
  assert mp.drift(jnp.float32, None, round_params=False).max() < 1e-5


@pytest.mark.parametrize(
  "param_dtype, max_mean_drift",
  # bfloat16 stalls: lr=1e-3 steps are below half an ulp (2^-8) of params near 1, so
  # many updates round away; this is the cost of bf16 storage, not of the optimizer.
  [(jnp.bfloat16, 0.25), (jnp.float16, 0.01)],
  ids=["bf16", "f16"],
)
def test_drift_from_exact_float64_is_bounded(param_dtype, max_mean_drift):
  assert mp.drift(param_dtype, jnp.float32, round_params=False).mean() < max_mean_drift


def test_float16_moments_underflow_where_float32_moments_do_not():
  """Why nu_dtype=float32 matters with float16 params.

  With b2 = 0.999, (1 - b2) * g^2 rounds to zero in float16 for |g| below about 5e-3, for
  example at a row's first touch; then m / (sqrt(v) + eps) is about m / 1e-8 and the row
  jumps far from where it was. float32 moments do not underflow.
  """
  with_f32 = mp.drift(jnp.float16, jnp.float32, round_params=False).max()
  with_f16 = mp.drift(jnp.float16, None, round_params=False).max()
  assert with_f32 < 0.1
  assert with_f16 > 10 * with_f32


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_a_narrow_moment_is_read_back_as_stored(platform):
  """The step reads a 16-bit moment back through its stored bits on every backend.

  XLA:GPU's default excess precision removes a float32 -> float16 -> float32 round
  trip, so the step's denominator would read nu from before its rounding (measured on
  an H100: float16 moments did not underflow there, as the test above needs). The
  stored value passes through an integer XOR with a run-time zero (`adam.rounded`),
  which no compiler can fold, in the program lowered for each backend.
  """
  params = {"t": jnp.zeros((16, 4), jnp.float16)}
  grads = {"t": sparse.BCOO((jnp.ones((2, 4), jnp.float16), jnp.array([[1], [3]])), shape=(16, 4))}
  pinned = {}
  for nu_dtype in (jnp.float16, jnp.float32):
    opt = osa.sparse_adam(1e-3, mu_dtype=jnp.float32, nu_dtype=nu_dtype)
    traced = jax.jit(train_step(opt)).trace(params, opt.init(params), grads)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    pinned[nu_dtype] = re.search(r"stablehlo\.xor .*tensor<\d+x\d+xi16>", text) is not None
  assert pinned == {jnp.float16: True, jnp.float32: False}


def test_caught_up_narrow_moments_are_read_back_as_stored():
  """Catch-up's 16-bit moments, read back by the step, pass through their bits too."""
  params = {"t": jnp.zeros((16, 4), jnp.float32)}
  grads = {"t": sparse.BCOO((jnp.ones((2, 4)), jnp.array([[1], [3]])), shape=(16, 4))}
  pins = {}
  for catch_up in (False, True):
    opt = osa.sparse_adam(
      1e-3, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, catch_up_idle_rows=catch_up
    )
    traced = jax.jit(train_step(opt)).trace(params, opt.init(params), grads)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    pins[catch_up] = len(re.findall(r"stablehlo\.xor .*tensor<\d+x\d+xi16>", text))
  assert pins[False] >= 2  # the step's stores of mu and nu
  assert pins[True] == pins[False] + 2  # and the caught-up mu and nu
