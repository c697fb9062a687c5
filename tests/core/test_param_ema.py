"""`sparse_param_ema`: the lazy average of the parameters equals the dense one, every step.

The reference is the average written out densely in float64 over every row after every
step, from the parameters the run itself produced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa

NUM_ROWS, DIM, DECAY = 24, 3, 0.8
BATCHES = [[1, 5, 5, 9], [5, 7, 2, 2], [1, 1, 1, 1], [20, 9, 5, 3], [7, 6, 5, 4], [2, 3, 2, 3]]


@pytest.fixture(params=[False, True], ids=["nojit", "jit"])
def jit(request):
  return request.param


def run(jit, steps=None):
  rng = np.random.default_rng(0)
  params = {
    "table": jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32),
    "bias": jnp.asarray(rng.normal(size=(DIM,)), jnp.float32),
  }
  opt = optax.chain(
    optax.multi_transform(
      {"s": osa.sparse_adam(0.1), "d": optax.sgd(0.1)}, {"table": "s", "bias": "d"}
    ),
    osa.sparse_param_ema(DECAY),
  )
  state = opt.init(params)

  def step(params, state, ids, rows):
    grads = {
      "table": sparse.BCOO((rows, ids[:, None]), shape=(NUM_ROWS, DIM)),
      "bias": jnp.sum(rows, axis=0),
    }
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(1,)) if jit else step
  history = [jax.tree.map(np.asarray, params)]
  for ids in BATCHES[: steps or len(BATCHES)]:
    rows = jnp.asarray(rng.normal(size=(len(ids), DIM)), jnp.float32)
    params, state = step(params, state, jnp.asarray(ids), rows)
    history.append(jax.tree.map(np.asarray, params))
  return params, state, history


def dense_average(history):
  ema = jax.tree.map(lambda p: p.astype(np.float64), history[0])
  for params in history[1:]:
    ema = jax.tree.map(lambda e, p: DECAY * e + (1 - DECAY) * p.astype(np.float64), ema, params)
  return ema


def test_the_lazy_average_equals_the_dense_one(jit):
  params, state, history = run(jit)
  averaged = osa.ema_params(state, params)
  expected = dense_average(history)
  for name in ("table", "bias"):
    np.testing.assert_allclose(averaged[name], expected[name], rtol=2e-6, atol=2e-6)
  touched = sorted({i for batch in BATCHES for i in batch})
  untouched = np.setdiff1d(np.arange(NUM_ROWS), touched)
  # A row never stepped keeps its parameter exactly.
  np.testing.assert_array_equal(averaged["table"][untouched], history[0]["table"][untouched])


def test_a_step_touches_only_the_stepped_rows_of_the_average():
  params, state, _ = run(False, steps=1)
  ema_state = state[1]
  last = np.asarray(ema_state.last_step["table"])
  assert sorted(np.flatnonzero(last == 1)) == sorted(set(BATCHES[0]))
  assert np.all(last[np.setdiff1d(np.arange(NUM_ROWS), BATCHES[0])] == 0)
  assert np.all(np.asarray(ema_state.last_step["bias"]) == 1)


def test_the_updates_pass_through_unchanged():
  params = {"table": jnp.zeros((NUM_ROWS, DIM))}
  grads = {"table": sparse.BCOO((jnp.ones((2, DIM)), jnp.array([[3], [3]])), shape=(NUM_ROWS, DIM))}
  plain = osa.sparse_adam(0.1)
  updates, _ = plain.update(grads, plain.init(params), params)
  chained = optax.chain(osa.sparse_adam(0.1), osa.sparse_param_ema(0.9))
  passed, _ = chained.update(grads, chained.init(params), params)
  assert isinstance(passed["table"], osa.RowUpdate) and passed["table"].sealed
  np.testing.assert_array_equal(passed["table"].todense(), updates["table"].todense())


def test_bad_input_is_refused_clearly():
  with pytest.raises(ValueError, match="decay"):
    osa.sparse_param_ema(1.0)
  with pytest.raises(ValueError, match="no ParamEMAState"):
    osa.ema_params(osa.sparse_adam(0.1).init({"t": jnp.zeros((2, 2))}), {"t": jnp.zeros((2, 2))})
  ema = osa.sparse_param_ema(0.5)
  with pytest.raises(ValueError, match="params"):
    ema.update({"t": jnp.zeros((2, 2))}, ema.init({"t": jnp.zeros((2, 2))}))
