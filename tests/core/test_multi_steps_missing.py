"""`sparse_multi_steps` with None gradients: nothing added, no rows dropped or replayed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import NumpySparseAdam

V, D, LR = 8, 2, 0.1


def bcoo(rows, values):
  rows = np.asarray(rows, np.int32)
  return sparse.BCOO((jnp.asarray(values, jnp.float32), jnp.asarray(rows[:, None])), shape=(V, D))


# Per mini-step, per table: (rows, values) or None (not looked up); cycles of 2.
STEPS = [
  {"a": ([1, 2], [[1, 2], [3, 4]]), "b": ([5], [[1, 1]])},
  {"a": ([1], [[-1, 0.5]]), "b": None},
  {"a": None, "b": ([3], [[2, 2]])},
  {"a": ([4, 4], [[1, 0], [0, 1]]), "b": None},
  {"a": None, "b": None},
  {"a": ([6], [[0.5, 0.5]]), "b": None},  # b: no lookup in the whole cycle, no step
  {"a": ([2], [[1, 1]]), "b": ([5], [[-1, 2]])},
  {"a": None, "b": None},
]


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow), True])  # eager: slow
def test_none_gradients_add_nothing_and_keep_torch_step_counts(jit):
  rng = np.random.default_rng(0)
  params = {name: jnp.asarray(rng.normal(size=(V, D)), jnp.float32) for name in ("a", "b")}
  opt = osa.sparse_multi_steps(osa.sparse_adam(LR), every_k=2, max_nse=2)
  state = opt.init(params)
  step = jax.jit(_step(opt)) if jit else _step(opt)
  refs = {name: NumpySparseAdam(np.asarray(p, np.float64), lr=LR) for name, p in params.items()}
  for start in range(0, len(STEPS), 2):
    cycle = STEPS[start : start + 2]
    for mini in cycle:
      grads = {n: None if g is None else bcoo(*g) for n, g in mini.items()}
      params, state = step(params, state, grads)
    for name, ref in refs.items():
      entries = [mini[name] for mini in cycle if mini[name] is not None]
      if entries:  # the reference: torch's accumulated .grad, the mean over the cycle
        rows = np.concatenate([np.asarray(r) for r, _ in entries])
        values = np.concatenate([np.asarray(v, np.float64) for _, v in entries]) / 2
        ref.step(rows[:, None], values)
  for name, ref in refs.items():
    np.testing.assert_allclose(params[name], ref.param, atol=1e-6, rtol=0)
  # b stepped in cycles 1, 2 and 4 only: torch's step count 3.
  assert int(state.inner_opt_state.step["b"]) == 3
  assert int(state.inner_opt_state.step["a"]) == 4


def _step(opt):
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  return step


def test_none_gradient_without_params_names_the_leaf():
  params = {"a": jnp.zeros((V, D)), "b": jnp.zeros((V, D))}
  opt = osa.sparse_multi_steps(osa.sparse_adam(LR), every_k=2, max_nse=2)
  state = opt.init(params)
  with pytest.raises(ValueError, match=r"\['b'\] is None.*Pass params to update"):
    opt.update({"a": bcoo([1], [[1, 1]]), "b": None}, state)


def test_too_many_none_gradients_in_one_mini_step_are_refused():
  params = {str(i): jnp.zeros((V, D)) for i in range(5)}
  opt = osa.sparse_multi_steps(osa.sparse_adam(LR), every_k=2, max_nse=2)
  state = opt.init(params)
  with pytest.raises(ValueError, match="5 BCOO gradients are None.*padding ids"):
    opt.update({k: None for k in params}, state, params)
