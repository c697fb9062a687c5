"""Property-based tests (hypothesis) against the independent NumPy reference.

Random cases cover layouts (n_sparse 1-3, n_dense 0/1/2), duplicate indices, padding
(too-large and negative indices carrying nonzero values), empty gradients, maximize and
hyperparameters. To keep CI fast the shapes come from a small fixed set, the number of
entries is fixed at NSE (or 0), and hyperparameters are traced arguments, so every case
reuses one of a few compiled steps.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import NumpySparseAdam

# (param shape, n_sparse): n_dense is len(shape) - n_sparse.
LAYOUTS = (
  ((7,), 1),  # n_dense 0
  ((5, 3), 1),  # n_dense 1, an embedding table
  ((5, 3), 2),  # n_dense 0, element-wise
  ((4, 3, 2), 1),  # n_dense 2
  ((4, 3, 2), 2),  # n_dense 1
  ((3, 2, 2), 3),  # n_dense 0
)
NSE = 8


@functools.partial(jax.jit, static_argnames=("shape", "maximize"))
def _step(params, state, data, indices, hyper, *, shape, maximize):
  """One training step; returns the new params and state, and the BCOO update."""
  learning_rate, b1, b2, eps = hyper
  opt = osa.sparse_adam(learning_rate, b1, b2, eps, maximize=maximize)
  updates, state = opt.update(sparse.BCOO((data, indices), shape=shape), state)
  return osa.apply_updates(params, updates), state, updates


@st.composite
def _cases(draw, max_steps=3):
  """A layout, flags and float32 hyperparameters; the entries come from a NumPy seed.

  Few draws per case keep hypothesis' own overhead low; the per-step structure
  (how many valid entries, how many distinct rows) is drawn from the seed.
  """
  shape, n_sparse = draw(st.sampled_from(LAYOUTS))
  empty = draw(st.integers(0, 9)) == 0  # one case in ten has empty gradients
  hyper = (
    draw(st.floats(1e-4, 1.0)),
    draw(st.sampled_from([0.0, 0.9]) | st.floats(0.0, 0.99)),
    draw(st.sampled_from([0.0, 0.999]) | st.floats(0.0, 0.9999)),
    draw(st.sampled_from([1e-8]) | st.floats(1e-10, 1e-1)),
  )
  return dict(
    shape=shape,
    n_sparse=n_sparse,
    sparse_shape=shape[:n_sparse],
    dense_shape=shape[n_sparse:],
    nse=0 if empty else NSE,
    n_steps=draw(st.integers(1, max_steps)),
    # Round to float32: the reference gets exactly the values the transform sees.
    hyper=tuple(float(np.float32(h)) for h in hyper),
    maximize=False if empty else draw(st.booleans()),
    scale=draw(st.sampled_from([1e-3, 1.0, 1e3])),
    seed=draw(st.integers(0, 2**32 - 1)),
  )


@functools.cache
def _zero_state(shape):
  return jax.jit(osa.sparse_adam().init)(jnp.zeros(shape))


def _gradient(case, rng, distinct=False):
  """`nse` entries: some in range over a few distinct rows (duplicates), the rest padding."""
  nse = case["nse"]
  n_valid = rng.integers(0, nse + 1)
  n_rows = nse if distinct else rng.integers(1, 4)
  sparse_shape = np.array(case["sparse_shape"])
  rows = rng.integers(0, sparse_shape, size=(n_rows, len(sparse_shape)))
  indices = rows[rng.integers(0, n_rows, size=nse)]
  padding = np.arange(nse) >= n_valid
  # Padding: one coordinate negative or too large; its data is nonzero and must be ignored.
  coord = rng.integers(0, len(sparse_shape), size=nse)
  bad = np.where(rng.random(nse) < 0.5, -rng.integers(1, 4, size=nse), sparse_shape[coord])
  indices[padding, coord[padding]] = bad[padding]
  order = rng.permutation(nse)
  indices = indices[order].astype(np.int32)
  data = (rng.normal(size=(nse, *case["dense_shape"])) * case["scale"]).astype(np.float32)
  return data, indices


def _touched(case, indices) -> np.ndarray:
  """Boolean mask over the sparse dims of the entries the gradient validly touches."""
  mask = np.zeros(case["sparse_shape"], bool)
  in_range = np.all((indices >= 0) & (indices < np.array(case["sparse_shape"])), axis=1)
  mask[tuple(indices[in_range].T)] = True
  return mask


def _run_step(case, params, state, data, indices):
  """One compiled step; NumPy inputs go straight to the jitted function."""
  return _step(
    params,
    state,
    data,
    indices,
    np.asarray(case["hyper"], np.float32),
    shape=case["shape"],
    maximize=case["maximize"],
  )


_U = float(np.finfo(np.float32).eps) / 2  # unit roundoff of float32


def _coalesced(case, data, indices) -> np.ndarray:
  """The dense float32 gradient: in-range entries summed in entry order, as torch does."""
  grad = np.zeros(case["shape"], np.float32)
  in_range = np.all((indices >= 0) & (indices < np.array(case["sparse_shape"])), axis=1)
  np.add.at(grad, tuple(indices[in_range].T), data[in_range])
  return -grad if case["maximize"] else grad


def _steps_match_the_numpy_reference(case):
  """Every step: untouched entries keep their bits; touched moments match the reference
  within float32 rounding of their terms; params follow `p - lr_t * m / (sqrt(v) + eps)`.

  Tolerances follow the rounding-error bound of each formula rather than a relative
  tolerance: with b2 near 0, `v + (g^2 - v) * (1 - b2)` cancels, so its relative
  error is unbounded, in torch's arithmetic as in ours (XLA may fuse into FMAs).
  """
  rng = np.random.default_rng(case["seed"])
  init = rng.normal(size=case["shape"]).astype(np.float32)
  params, state = init, _zero_state(case["shape"])
  lr, b1, b2, eps = case["hyper"]
  ref = NumpySparseAdam(
    init, lr=lr, betas=(b1, b2), eps=eps, maximize=case["maximize"], dtype=np.float32
  )
  before = [init, np.zeros_like(init), np.zeros_like(init)]
  mu_error = nu_error = np.zeros(case["shape"], np.float64)
  for t in range(1, case["n_steps"] + 1):
    data, indices = _gradient(case, rng)
    params, state, _ = _run_step(case, params, state, data, indices)
    ref.step(indices, data)
    after = [np.asarray(x) for x in (params, state.mu, state.nu)]
    assert int(state.step) == t  # the step advances even for an empty gradient
    # Masked: entries outside the touched rows keep their exact bits.
    touched = _touched(case, indices)
    for old, new in zip(before, after, strict=True):
      np.testing.assert_array_equal(new[~touched], old[~touched])
    # Moments: the reference's, within the accumulated rounding of their terms.
    g = _coalesced(case, data, indices).astype(np.float64)
    m_old, v_old = (x.astype(np.float64) for x in before[1:])
    mu_error = mu_error + 8 * _U * (np.abs(m_old) + np.abs(g) + np.abs(ref.exp_avg))
    nu_error = nu_error + 8 * _U * (np.abs(v_old) + g * g + np.abs(ref.exp_avg_sq))
    assert np.all(np.abs(after[1] - ref.exp_avg) <= mu_error)
    assert np.all(np.abs(after[2] - ref.exp_avg_sq) <= nu_error)
    # Params: this step's update from this step's moments, torch's formula in float32.
    step_size = np.float32(lr * math.sqrt(1 - b2**t) / (1 - b1**t))
    delta = -step_size * (after[1] / (np.sqrt(after[2]) + np.float32(eps)))
    expected = np.where(_expand(touched, case), before[0] + delta, before[0])
    tolerance = 4e-6 * np.abs(delta) + 2 * _U * np.abs(expected)
    assert np.all(np.abs(after[0] - expected) <= tolerance)
    before = after


def _expand(mask, case):
  return mask.reshape(mask.shape + (1,) * len(case["dense_shape"]))


def _update_is_sorted_unique_and_apply_updates_equals_densified_add(case):
  rng = np.random.default_rng(case["seed"])
  params = rng.normal(size=case["shape"]).astype(np.float32)
  data, indices = _gradient(case, rng)
  new_params, _, updates = _run_step(case, params, _zero_state(case["shape"]), data, indices)
  strides = np.cumprod((1,) + case["sparse_shape"][:0:-1])[::-1]
  rows = np.asarray(updates.indices) @ strides  # padding keeps distinct rows >= num_rows
  assert np.all(np.diff(rows) > 0)  # sorted and unique, padding included
  valid = rows < np.prod(case["sparse_shape"])
  assert valid.sum() == _touched(case, indices).sum()
  np.testing.assert_array_equal(np.asarray(updates.data)[~valid], 0)
  dense = params.copy()
  np.add.at(dense, tuple(np.asarray(updates.indices)[valid].T), np.asarray(updates.data)[valid])
  np.testing.assert_array_equal(new_params, dense)


def _entry_order_does_not_matter_without_duplicates(case):
  """With distinct rows the result is bit-identical under any permutation of the entries."""
  rng = np.random.default_rng(case["seed"])
  params = rng.normal(size=case["shape"]).astype(np.float32)
  data, indices = _gradient(case, rng, distinct=True)
  # Drop repeated rows, then pad back to the same nse with all-zero padding.
  _, first = np.unique(indices, axis=0, return_index=True)
  pad = case["nse"] - len(first)
  indices = np.concatenate([indices[np.sort(first)], np.full((pad, case["n_sparse"]), -1)])
  data = np.concatenate([data[np.sort(first)], np.zeros((pad, *case["dense_shape"]))])
  indices, data = indices.astype(np.int32), data.astype(np.float32)
  perm = rng.permutation(case["nse"])
  state = _zero_state(case["shape"])
  results = [
    _run_step(case, params, state, data[order], indices[order])
    for order in (np.arange(case["nse"]), perm)
  ]
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
    np.testing.assert_array_equal(a, b)


# Examples per property: a quick pass in the default tier, the soak in the slow tier (CI
# runs both; each example compiles its own shapes).
QUICK_EXAMPLES, SOAK_EXAMPLES = 150, 800


def _quick_and_soak(strategy, check):
  """`check` as two hypothesis tests: QUICK_EXAMPLES examples, and SOAK_EXAMPLES marked slow."""
  quick = settings(max_examples=QUICK_EXAMPLES)(given(strategy)(check))
  soak = pytest.mark.slow(settings(max_examples=SOAK_EXAMPLES)(given(strategy)(check)))
  return quick, soak


test_steps_match_the_numpy_reference, test_steps_match_the_numpy_reference_soak = _quick_and_soak(
  _cases(), _steps_match_the_numpy_reference
)
(
  test_update_is_sorted_unique_and_apply_updates_equals_densified_add,
  test_update_is_sorted_unique_and_apply_updates_equals_densified_add_soak,
) = _quick_and_soak(
  _cases(max_steps=1), _update_is_sorted_unique_and_apply_updates_equals_densified_add
)
(
  test_entry_order_does_not_matter_without_duplicates,
  test_entry_order_does_not_matter_without_duplicates_soak,
) = _quick_and_soak(_cases(max_steps=1), _entry_order_does_not_matter_without_duplicates)
