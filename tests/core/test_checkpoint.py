"""orbax-checkpoint: save params and the sparse_adam state mid-training, restore, and resume
bit-exactly. Real orbax, writing to a real directory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import train_step

ROWS, DIM, NSE = 12, 4, 6
STEPS, SAVE_AT = 8, 4

CONFIGS = {
  "plain": lambda: (osa.sparse_adam(0.05), jnp.float32),
  "amsgrad_per_row_schedule": lambda: (
    osa.sparse_adam(
      optax.linear_schedule(0.1, 0.01, STEPS), amsgrad=True, per_row_bias_correction=True
    ),
    jnp.float32,
  ),
  "adamw_bf16_f32_moments": lambda: (
    osa.sparse_adamw(0.05, weight_decay=0.1, mu_dtype=jnp.float32, nu_dtype=jnp.float32),
    jnp.bfloat16,
  ),
  "rowwise_amsgrad_per_row_schedule": lambda: (
    osa.sparse_adam(
      optax.linear_schedule(0.1, 0.01, STEPS),
      amsgrad=True,
      per_row_bias_correction=True,
      rowwise_second_moment=True,
    ),
    jnp.float32,
  ),
  "rowwise_bf16_stochastic": lambda: (
    osa.sparse_adam(
      0.05,
      mu_dtype=jnp.bfloat16,
      nu_dtype=jnp.bfloat16,
      moment_rounding="stochastic",
      rowwise_second_moment=True,
    ),
    jnp.float32,
  ),
  "catch_up_adamw": lambda: (
    osa.sparse_adamw(0.05, weight_decay=0.1, catch_up_idle_rows=True),
    jnp.float32,
  ),
  "apply_if_finite": lambda: (
    optax.apply_if_finite(osa.sparse_adam(0.05), max_consecutive_errors=2),
    jnp.float32,
  ),
}


def _grads(step: int, dtype) -> dict:
  rng = np.random.default_rng(step)
  data = rng.normal(size=(NSE, DIM)).astype(np.float32)
  if step == 5:
    data[0, 0] = np.nan  # exercises apply_if_finite's counters across the restore
  indices = rng.integers(0, ROWS + 2, size=(NSE, 1)).astype(np.int32)  # some padding
  table = sparse.BCOO((jnp.asarray(data, dtype), jnp.asarray(indices)), shape=(ROWS, DIM))
  return {"emb": {"table": table}, "head": None}


def _initial_params(dtype) -> dict:
  rng = np.random.default_rng(42)
  return {
    "emb": {"table": jnp.asarray(rng.normal(size=(ROWS, DIM)), dtype)},
    "head": jnp.asarray(rng.normal(size=(3,)), dtype),
  }


def _bits(tree) -> list:
  return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_resume_from_orbax_checkpoint_is_bit_exact(tmp_path, config):
  opt, dtype = CONFIGS[config]()

  step = jax.jit(train_step(opt))

  params = _initial_params(dtype)
  state = opt.init(params)
  checkpointer = ocp.StandardCheckpointer()
  for i in range(STEPS):
    if i == SAVE_AT:
      checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
      checkpointer.wait_until_finished()
    params, state = step(params, state, _grads(i, dtype))
  uninterrupted = {"params": params, "opt_state": state}

  # A fresh process would build the target from a freshly initialised state.
  fresh_params = _initial_params(dtype)
  target = jax.tree.map(
    ocp.utils.to_shape_dtype_struct, {"params": fresh_params, "opt_state": opt.init(fresh_params)}
  )
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  checkpointer.close()
  assert jax.tree.structure(restored) == jax.tree.structure(target)
  assert type(restored["opt_state"]) is type(uninterrupted["opt_state"])
  params, state = restored["params"], restored["opt_state"]
  for i in range(SAVE_AT, STEPS):
    params, state = step(params, state, _grads(i, dtype))

  assert _bits({"params": params, "opt_state": state}) == _bits(uninterrupted)
  # The checkpoint really holds mid-training state: resuming from init would differ.
  assert _bits(restored["opt_state"]) != _bits(opt.init(fresh_params))
