"""Determinism on CPU: the same inputs give bit-identical params and state, run to run,
duplicate indices included (their sum is the only order-sensitive reduction)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import cpu_only, train_step

# On a GPU, a scatter-add may sum a row's duplicates in another order from run to run
# (docs/performance/gpu.md: to be measured, with and without --xla_gpu_deterministic_ops).
pytestmark = cpu_only("run-to-run determinism of the duplicate-row sums")

STEPS = 10


def _grads(step: int) -> dict:
  rng = np.random.default_rng(step)
  # 64 entries over 5 rows: every row repeated ~13 times, in random order.
  table = sparse.BCOO(
    (
      jnp.asarray(rng.normal(size=(64, 8)).astype(np.float32) * 10.0 ** rng.integers(-3, 3)),
      jnp.asarray(rng.integers(0, 5, size=(64, 1)).astype(np.int32)),
    ),
    shape=(30, 8),
  )
  elementwise = sparse.BCOO(
    (
      jnp.asarray(rng.normal(size=(40,)).astype(np.float32)),
      jnp.asarray(rng.integers(0, 3, size=(40, 2)).astype(np.int32)),
    ),
    shape=(6, 4),
  )
  return {"table": table, "matrix": elementwise}


def _params() -> dict:
  rng = np.random.default_rng(7)
  return {
    "table": jnp.asarray(rng.normal(size=(30, 8)).astype(np.float32)),
    "matrix": jnp.asarray(rng.normal(size=(6, 4)).astype(np.float32)),
  }


def _train(step_fn, opt) -> list:
  params = _params()
  state = opt.init(params)
  for i in range(STEPS):
    params, state = step_fn(params, state, _grads(i))
  return [np.asarray(x).tobytes() for x in jax.tree.leaves((params, state))]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_jitted_training_is_bit_identical_run_to_run_and_across_recompilation(amsgrad):
  opt = osa.sparse_adam(0.01, amsgrad=amsgrad)
  step = jax.jit(train_step(opt))
  first = _train(step, opt)
  assert _train(step, opt) == first
  # A new function object is traced and compiled anew.
  recompiled = jax.jit(train_step(opt))
  assert _train(recompiled, opt) == first
  assert recompiled._cache_size() == 1 and step._cache_size() == 1
