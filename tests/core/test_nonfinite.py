"""Non-finite gradients: torch's behaviour by default, and skipping with optax.apply_if_finite."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import NumpySparseAdam, train_step

SHAPE = (6, 3)
LR = 0.1


def _bcoo(data, indices, **flags) -> sparse.BCOO:
  return sparse.BCOO(
    (jnp.asarray(data, jnp.float32), jnp.asarray(indices, jnp.int32)), shape=SHAPE, **flags
  )


def _table() -> np.ndarray:
  return np.random.default_rng(1).normal(size=SHAPE).astype(np.float32)


def _grad_data(step: int, nse: int = 4) -> np.ndarray:
  return np.random.default_rng(100 + step).normal(size=(nse, SHAPE[1])).astype(np.float32)


INDICES = np.array([[1], [3], [3], [4]])


@functools.cache
def _jitted_step(opt):
  return jax.jit(train_step(opt))


SPARSE_ADAM = osa.sparse_adam(LR)


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_default_is_torch_behaviour_nan_reaches_touched_rows_only(bad, jit):
  """A non-finite entry poisons its row of the param and both moments; other rows are exact."""
  params = {"t": jnp.asarray(_table())}
  state = SPARSE_ADAM.init(params)
  ref = NumpySparseAdam(_table(), lr=LR, dtype=np.float32)
  step = _jitted_step(SPARSE_ADAM) if jit else train_step(SPARSE_ADAM)
  for i in range(3):
    data = _grad_data(i)
    if i == 1:
      data[2, 0] = bad  # row 3, which also has a finite duplicate entry
    params, state = step(params, state, {"t": _bcoo(data, INDICES)})
    with np.errstate(invalid="ignore"):  # inf - inf and inf / inf, as expected
      ref.step(INDICES, data)
  table, mu, nu = (np.asarray(x["t"]) for x in (params, state.mu, state.nu))
  for got, want in ((table, ref.param), (mu, ref.exp_avg), (nu, ref.exp_avg_sq)):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)  # NaNs compared equal
  # Row 3 is NaN in the param (inf/inf) from the bad step on, like torch.
  assert np.isnan(table[3]).any()
  assert not np.isfinite(nu[3, 0])
  finite_rows = [0, 1, 2, 4, 5]
  assert np.isfinite(table[finite_rows]).all()
  assert np.isfinite(mu[finite_rows]).all() and np.isfinite(nu[finite_rows]).all()
  np.testing.assert_array_equal(table[[0, 2, 5]], _table()[[0, 2, 5]])


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize(
  "flags",
  [{}, {"indices_sorted": True, "unique_indices": True}],
  ids=["unflagged", "flagged"],
)
def test_apply_if_finite_skips_the_step_with_state_untouched(bad, flags):
  """The NaN step changes neither the sparse_adam state nor the params (bit for bit).

  apply_if_finite's `isfinite` walks every leaf of the BCOO, indices included;
  integer indices are always finite, so only the data decide. Training then goes
  on exactly as if the bad step had never been taken.
  """
  guarded = optax.apply_if_finite(osa.sparse_adam(LR), max_consecutive_errors=3)
  step = jax.jit(train_step(guarded))
  params = {"t": jnp.asarray(_table())}
  state = guarded.init(params)
  grads = [_grad_data(i) for i in range(4)]
  grads[2][0, 1] = bad

  for i in range(2):
    params, state = step(params, state, {"t": _bcoo(grads[i], INDICES, **flags)})
  params_before, inner_before = _bits(params), _bits(state.inner_state)
  params, state = step(params, state, {"t": _bcoo(grads[2], INDICES, **flags)})
  assert _bits(params) == params_before
  assert _bits(state.inner_state) == inner_before
  assert int(state.notfinite_count) == 1 and int(state.total_notfinite) == 1
  assert not bool(state.last_finite)
  params, state = step(params, state, {"t": _bcoo(grads[3], INDICES, **flags)})
  assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 1

  # The same run without the bad step, on the plain transform.
  plain_step = _jitted_step(SPARSE_ADAM)
  plain_params = {"t": jnp.asarray(_table())}
  plain_state = SPARSE_ADAM.init(plain_params)
  for i in (0, 1, 3):
    plain_params, plain_state = plain_step(
      plain_params, plain_state, {"t": _bcoo(grads[i], INDICES, **flags)}
    )
  np.testing.assert_array_equal(params["t"], plain_params["t"])
  for got, want in zip(
    jax.tree.leaves(state.inner_state), jax.tree.leaves(plain_state), strict=True
  ):
    np.testing.assert_array_equal(got, want)


def test_apply_if_finite_gives_up_after_max_consecutive_errors():
  """Past max_consecutive_errors the bad update goes through: torch's NaN rows again."""
  guarded = optax.apply_if_finite(osa.sparse_adam(LR), max_consecutive_errors=1)
  step = jax.jit(train_step(guarded))
  params = {"t": jnp.asarray(_table())}
  state = guarded.init(params)
  data = _grad_data(0)
  data[0, 0] = np.nan  # row 1
  params, state = step(params, state, {"t": _bcoo(data, INDICES)})
  np.testing.assert_array_equal(params["t"], _table())
  params, state = step(params, state, {"t": _bcoo(data, INDICES)})
  table = np.asarray(params["t"])
  assert np.isnan(table[1, 0]) and np.isfinite(np.delete(table, 1, axis=0)).all()
  assert int(state.inner_state.step["t"]) == 1


def test_out_of_range_padding_is_finite_for_apply_if_finite():
  """An all-padding (or empty) gradient is finite: the step is taken, nothing moves."""
  guarded = optax.apply_if_finite(osa.sparse_adam(LR), max_consecutive_errors=1)
  params = {"t": jnp.asarray(_table())}
  state = guarded.init(params)
  padding = _bcoo(np.zeros((2, 3)), [[6], [6]])
  params, state = jax.jit(train_step(guarded))(params, state, {"t": padding})
  assert bool(state.last_finite)
  assert int(state.inner_state.step["t"]) == 1
  np.testing.assert_array_equal(params["t"], _table())
