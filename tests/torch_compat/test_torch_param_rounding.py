"""The torch adapter's `param_rounding`: round to nearest by default (torch's), stochastic on ask.

The option is the optimizer's, not a param group's: the state_dict stays torch's,
and a run rebuilt with the option from a state_dict continues the rounding's
stream (keyed on the step count it holds).
"""

import copy
import pickle

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
import optax_sparse_adam.torch_compat as tc

ROWS = (jnp.array([[2], [5], [5]]), jnp.array([[1], [5], [7]]))


def _grad(i):
  values = np.random.default_rng(i).standard_normal((3, 4)).astype(np.float32)
  return sparse.BCOO((jnp.asarray(values), ROWS[i % 2]), shape=(8, 4))


def _init(dtype=jnp.bfloat16):
  return np.asarray(np.random.default_rng(9).standard_normal((8, 4)), dtype)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _run(cls, steps, **kwargs):
  table = tc.Parameter(jnp.asarray(_init()))
  opt = cls([table], lr=1e-2, **kwargs)
  for i in range(steps):
    table.grad = _grad(i)
    opt.step()
  return table, opt


@pytest.mark.parametrize("cls", [tc.SparseAdam, tc.SGD, tc.Adagrad])
def test_nearest_by_default_stochastic_on_ask(cls):
  default, opt = _run(cls, 3)
  nearest, _ = _run(cls, 3, param_rounding="nearest")
  stochastic, _ = _run(cls, 3, param_rounding="stochastic")
  np.testing.assert_array_equal(_bits(default.data), _bits(nearest.data))
  assert np.any(_bits(default.data) != _bits(stochastic.data))
  groups = opt.state_dict()["param_groups"]
  assert all("param_rounding" not in group for group in groups)


def test_sgd_stores_the_optax_paths_bits():
  """tc.SGD and osa.sparse_sgd round the same rows with the same bits (the same steps)."""
  table, _ = _run(tc.SGD, 3, param_rounding="stochastic")
  opt = osa.sparse_sgd(1e-2, param_rounding="stochastic")
  params = {"t": jnp.asarray(_init())}
  state = opt.init(params)
  for i in range(3):
    updates, state = opt.update({"t": _grad(i)}, state, params)
    params = osa.apply_updates(params, updates)
  np.testing.assert_array_equal(_bits(table.data), _bits(params["t"]))


@pytest.mark.parametrize("cls", [tc.SparseAdam, tc.SGD])
def test_a_state_dict_round_trip_continues_the_stream(cls):
  straight, _ = _run(cls, 4, param_rounding="stochastic")
  table, opt = _run(cls, 2, param_rounding="stochastic")
  saved = opt.state_dict()
  again = cls([table], lr=1e-2, param_rounding="stochastic")
  again.load_state_dict(saved)
  for i in range(2, 4):
    table.grad = _grad(i)
    again.step()
  np.testing.assert_array_equal(_bits(table.data), _bits(straight.data))


def test_a_float32_parameter_is_unchanged_by_the_option():
  runs = []
  for mode in ("nearest", "stochastic"):
    table = tc.Parameter(jnp.asarray(_init(np.float32)))
    opt = tc.SparseAdam([table], lr=1e-2, param_rounding=mode)
    for i in range(2):
      table.grad = _grad(i)
      opt.step()
    runs.append(np.asarray(table.data))
  np.testing.assert_array_equal(_bits(runs[0]), _bits(runs[1]))


@pytest.mark.parametrize("cls", [tc.SparseAdam, tc.SGD, tc.Adagrad])
def test_an_unknown_rounding_is_refused(cls):
  with pytest.raises(ValueError, match=r"param_rounding='up'"):
    cls([tc.Parameter(jnp.zeros((2, 2)))], lr=0.1, param_rounding="up")


def test_a_copy_or_pickle_keeps_the_rounding():
  """The option is the optimizer's (not in `state_dict`): copies and pickles keep it."""
  param = tc.Parameter(jnp.zeros((4, 2), jnp.bfloat16))
  opt = tc.SparseAdam([param], lr=0.1, param_rounding="stochastic")
  for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
    assert clone._param_rounding == "stochastic"
