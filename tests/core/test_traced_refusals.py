"""A hyper-parameter the step would ignore is refused when nonzero, even when traced.

`optax.inject_hyperparams` passes every hyper-parameter as an array, traced under
`jit`, and lets the user change it in the state later: a value the factory cannot see.
A weight decay that sparse leaves ignore (torch's SGD and Adagrad, `weight_decay_mode=
"none"`) or a momentum with no buffer to keep it must then fail when the step runs,
naming the leaf, instead of being dropped without a word.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa

CASES = {
  "sgd_weight_decay": (osa.sparse_sgd, "weight_decay", "torch.optim.SGD refuses weight decay"),
  "adagrad_weight_decay": (
    osa.sparse_adagrad,
    "weight_decay",
    "not compatible with sparse gradients",
  ),
  "rowwise_adagrad_weight_decay": (
    osa.sparse_rowwise_adagrad,
    "weight_decay",
    "weight_decay_mode='none', which would ignore it",
  ),
  "sgd_momentum": (osa.sparse_sgd, "momentum", "keeps no momentum buffer"),
}


def params():
  return {"emb": jnp.arange(8.0).reshape(4, 2)}


def grads():
  ids = jnp.array([[1], [3], [1]])
  return {"emb": sparse.BCOO((jnp.ones((3, 2)), ids), shape=(4, 2))}


def injected(factory, field, value):
  """`factory` under inject_hyperparams, made with `field` 0, then set to `value` in the state."""
  opt = optax.inject_hyperparams(factory)(learning_rate=0.1, **{field: 0.0})
  state = opt.init(params())
  state.hyperparams[field] = jnp.asarray(value, jnp.float32)
  return opt, state


@pytest.mark.parametrize("case", list(CASES))
def test_a_traced_value_the_step_would_ignore_is_refused_when_it_runs(case):
  factory, field, words = CASES[case]
  opt, state = injected(factory, field, 0.5)
  with pytest.raises(Exception) as failure:
    updates, _ = jax.jit(opt.update)(grads(), state, params())
    jax.block_until_ready(updates)
  message = str(failure.value)
  assert f"{field} is traced" in message and "0.5 when the step runs" in message, message
  assert "['emb']" in message and words in message, message


@pytest.mark.parametrize("case", list(CASES))
def test_the_concrete_value_is_refused_before_the_step(case):
  factory, field, words = CASES[case]
  opt, state = injected(factory, field, 0.5)
  with pytest.raises(ValueError, match="0.5"):
    opt.update(grads(), state, params())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_traced_zero_steps_as_the_python_zero_does(case, jit):
  factory, field, _ = CASES[case]
  opt, state = injected(factory, field, 0.0)
  update = jax.jit(opt.update) if jit else opt.update
  plain = factory(learning_rate=0.1)
  plain_state = plain.init(params())
  p, q = params(), params()
  for _ in range(3):
    updates, state = update(grads(), state, p)
    p = osa.apply_updates(p, updates)
    plain_updates, plain_state = plain.update(grads(), plain_state, q)
    q = osa.apply_updates(q, plain_updates)
  np.testing.assert_array_equal(p["emb"], q["emb"])


@pytest.mark.parametrize("factory", [osa.sparse_sgd, osa.sparse_adagrad], ids=["sgd", "adagrad"])
def test_a_traced_decay_still_decays_dense_leaves(factory):
  """torch's SGD and Adagrad decay dense gradients: a traced rate does so, sparse leaves absent."""
  dense_params = {"w": jnp.array([1.0, -2.0, 3.0])}
  dense_grads = {"w": jnp.array([0.5, 0.5, -1.0])}
  opt = optax.inject_hyperparams(factory)(learning_rate=0.1, weight_decay=0.0)
  state = opt.init(dense_params)
  state.hyperparams["weight_decay"] = jnp.asarray(0.25, jnp.float32)
  updates, _ = jax.jit(opt.update)(dense_grads, state, dense_params)
  known = functools.partial(factory, learning_rate=0.1, weight_decay=0.25)()
  expected, _ = known.update(dense_grads, known.init(dense_params), dense_params)
  np.testing.assert_array_equal(updates["w"], expected["w"])
  assert not np.array_equal(updates["w"], -0.1 * dense_grads["w"])
