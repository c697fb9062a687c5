"""The catalogue of bad inputs (README, Reliability): each one fails with a clear error, and
a failed call changes nothing.

Errors are checked for the three parts of a useful message: where (the leaf's pytree
path), what was wrong, and what was expected. "Nothing changed" is checked by comparing
params and state with copies taken before the call, and, for a jitted step that donates
them, by checking that no buffer was donated away by the failed call.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import train_step

PATH = "['emb']['table']"
SHAPE = (5, 2)


def _bcoo(data, indices, shape=SHAPE, **flags) -> sparse.BCOO:
  return sparse.BCOO((jnp.asarray(data), jnp.asarray(indices)), shape=shape, **flags)


def _good_grad() -> sparse.BCOO:
  return _bcoo(np.full((2, 2), 0.5, np.float32), [[1], [3]])


def _params() -> dict:
  table = jnp.asarray(np.random.default_rng(0).normal(size=SHAPE).astype(np.float32))
  return {"emb": {"table": table}, "bias": jnp.arange(3.0)}


def _grads(table_grad: Any) -> dict:
  return {"emb": {"table": table_grad}, "bias": None}


def _snapshot(tree: Any) -> Any:
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _assert_same(snapshot: Any, tree: Any) -> None:
  """Bitwise equality, dtypes included, of every leaf of `tree` with `snapshot`."""
  assert jax.tree.structure(snapshot) == jax.tree.structure(tree)
  for before, after in zip(jax.tree.leaves(snapshot), jax.tree.leaves(tree), strict=True):
    assert not getattr(after, "is_deleted", lambda: False)(), "a buffer was donated away"
    after = np.asarray(after)
    assert (before.dtype, before.shape) == (after.dtype, after.shape)
    assert before.tobytes() == after.tobytes(), f"changed: {before} -> {after}"


def _assert_message(err: BaseException, fragments: list[str]) -> None:
  text = str(err)
  for fragment in fragments:
    assert fragment in text, f"{fragment!r} not in error message: {text}"


@functools.cache
def _jitted_step(opt: optax.GradientTransformation):
  """One compiled, donating step per optimizer, shared by the tests."""
  return jax.jit(train_step(opt), donate_argnums=(0, 1))


SPARSE_ADAM = osa.sparse_adam(0.1)
SPARSE_ADAMW = osa.sparse_adamw(0.1, weight_decay=0.1)


def _trained_state(opt: optax.GradientTransformation, params: dict) -> Any:
  """A state after two real steps, so that 'unchanged' compares nonzero moments."""
  state = opt.init(params)
  for _ in range(2):
    params, state = _jitted_step(opt)(params, state, _grads(_good_grad()))
  return params, state


@pytest.fixture(params=["eager", "jit_donated"])
def run_step(request):
  """Runs one training step eagerly, or jitted with params and state donated."""

  def run(opt, params, state, grads):
    step = _jitted_step(opt) if request.param == "jit_donated" else train_step(opt)
    return step(params, state, grads)

  return run


class Case(NamedTuple):
  grad: Any
  error: type
  fragments: list[str]


def _n_batch_1() -> sparse.BCOO:
  """A (5, 2) BCOO with one batch dim: indices (5, nse=2, 1), data (5, 2)."""
  indices = np.tile(np.array([[[0], [1]]], np.int32), (5, 1, 1))
  return _bcoo(np.ones((5, 2), np.float32), indices)


def _n_sparse_0() -> sparse.BCOO:
  """A (5, 2) BCOO with no sparse dim: indices (1, 0), data (1, 5, 2)."""
  return _bcoo(np.ones((1, *SHAPE), np.float32), np.zeros((1, 0), np.int32))


def _float_indices_grad() -> sparse.BCOO:
  # The BCOO constructor refuses float indices, but tree-mapping transforms such as
  # optax.scale rebuild BCOOs from float-converted leaves without validation.
  updates, _ = optax.scale(2.0).update(_good_grad(), optax.EmptyState())
  return updates


GRAD_CASES = {
  "dense_grad": lambda: Case(
    jnp.ones(SHAPE), TypeError, [PATH, "is dense", "optax.adam", "multi_transform"]
  ),
  "shape_mismatch": lambda: Case(
    _bcoo(np.ones((1, 2), np.float32), [[1]], shape=(6, 2)),
    ValueError,
    [PATH, "shape (6, 2)", "parameter has shape (5, 2)", "must be equal"],
  ),
  "dense_dims_mismatch": lambda: Case(
    _bcoo(np.ones((1, 3), np.float32), [[1]], shape=(5, 3)),
    ValueError,
    [PATH, "shape (5, 3)", "(5, 2)"],
  ),
  "integer_grad_data": lambda: Case(
    _bcoo(np.ones((1, 2), np.int32), [[1]]),
    TypeError,
    [PATH, "data of dtype int32", "expected a real floating dtype"],
  ),
  "complex_grad_data": lambda: Case(
    _bcoo(np.ones((1, 2), np.complex64), [[1]]),
    TypeError,
    [PATH, "complex64", "expected a real floating dtype"],
  ),
  "bcoo_n_batch_1": lambda: Case(
    _n_batch_1(),
    ValueError,
    [PATH, "n_batch=1", "only n_batch=0", "bcoo_update_layout"],
  ),
  "bcoo_n_sparse_0": lambda: Case(
    _n_sparse_0(),
    ValueError,
    [PATH, "n_sparse=0", "optax.adam"],
  ),
  "float_indices": lambda: Case(
    _float_indices_grad(),
    TypeError,
    [PATH, "indices of dtype float32", "expected an integer dtype", "optax.scale"],
  ),
}


@pytest.mark.parametrize("case_name", sorted(GRAD_CASES))
def test_bad_gradient_fails_whole_and_changes_nothing(case_name, run_step):
  case = GRAD_CASES[case_name]()
  opt = SPARSE_ADAM
  params, state = _trained_state(opt, _params())
  before = _snapshot((params, state))
  with pytest.raises(case.error) as err:
    run_step(opt, params, state, _grads(case.grad))
  _assert_message(err.value, case.fragments)
  _assert_same(before, (params, state))


def test_a_bad_leaf_after_good_ones_fails_the_whole_call(run_step):
  """Leaves are validated before any is updated: no half-updated state."""
  opt = SPARSE_ADAM
  params = {"a": jnp.zeros(SHAPE), "b": jnp.zeros(SHAPE), "c": jnp.zeros((4,))}
  params, state = _trained_state_multi(opt, params)
  before = _snapshot((params, state))
  bad = {"a": _good_grad(), "b": _good_grad(), "c": jnp.ones((4,))}
  with pytest.raises(TypeError) as err:
    run_step(opt, params, state, bad)
  _assert_message(err.value, ["['c']", "is dense"])
  _assert_same(before, (params, state))


def _trained_state_multi(opt, params):
  state = opt.init(params)
  grads = {
    "a": _good_grad(),
    "b": _good_grad(),
    "c": _bcoo(np.ones((1,), np.float32), [[2]], shape=(4,)),
  }
  return _jitted_step(opt)(params, state, grads)


STRUCTURE_CASES = {
  "renamed_key": (
    lambda g: {"emb": {"tab": g}, "bias": None},
    [
      "structure differs",
      "only in the gradients: ['emb']['tab']",
      "only in the optimizer state: ['emb']['table']",
      "structure of the params given to init",
    ],
  ),
  "leaf_for_subtree": (
    lambda g: {"emb": g, "bias": None},
    ["structure differs", "the gradient at ['emb'] is a single leaf", "subtree"],
  ),
  "list_for_dict": (lambda g: [g], ["structure differs", "PyTreeDef([*])"]),
  "missing_leaf": (
    lambda g: {"emb": {"table": g}},
    ["structure differs", "only in the optimizer state: ['bias']"],
  ),
}


@pytest.mark.parametrize("case_name", sorted(STRUCTURE_CASES))
def test_grads_structure_differs_from_params(case_name, run_step):
  make_grads, fragments = STRUCTURE_CASES[case_name]
  opt = SPARSE_ADAM
  params, state = _trained_state(opt, _params())
  before = _snapshot((params, state))
  with pytest.raises(ValueError) as err:
    run_step(opt, params, state, make_grads(_good_grad()))
  _assert_message(err.value, fragments)
  _assert_same(before, (params, state))


def test_params_of_another_shape_than_the_state(run_step):
  opt = SPARSE_ADAMW
  params, state = _trained_state(opt, _params())
  before = _snapshot((params, state))
  other = {"emb": {"table": jnp.zeros((6, 2))}, "bias": params["bias"]}
  with pytest.raises(ValueError) as err:
    run_step(opt, other, state, _grads(_good_grad()))
  _assert_message(err.value, [PATH, "shape (6, 2)", "optimizer state has shape (5, 2)"])
  _assert_same(before, (params, state))


def test_weight_decay_without_params():
  opt = SPARSE_ADAMW
  params, state = _trained_state(opt, _params())
  before = _snapshot(state)
  with pytest.raises(ValueError) as err:
    opt.update(_grads(_good_grad()), state)
  _assert_message(err.value, [PATH, "needed for weight decay", "update(grads, state, params)"])
  _assert_same(before, state)


@pytest.mark.parametrize(
  "dtype, fragments",
  [
    (jnp.int32, ["dtype int32", "only real floating-point parameters"]),
    (jnp.bool_, ["dtype bool", "only real floating-point parameters"]),
    (jnp.complex64, ["is complex", "complex64", "does not support complex"]),
  ],
)
def test_non_float_params_refused_at_init(dtype, fragments):
  params = {"emb": {"table": jnp.zeros(SHAPE, dtype)}, "bias": jnp.zeros(3)}
  before = _snapshot(params)
  with pytest.raises(TypeError) as err:
    osa.sparse_adam(0.1).init(params)
  _assert_message(err.value, [PATH, *fragments])
  _assert_same(before, params)


HYPERPARAM_CASES = {
  "string_lr": (
    dict(learning_rate="0.1"),
    TypeError,
    ["Invalid learning_rate: '0.1'", "expected a float"],
  ),
  "list_lr": (dict(learning_rate=[0.1]), TypeError, ["Invalid learning_rate: [0.1]"]),
  "none_lr": (dict(learning_rate=None), TypeError, ["Invalid learning_rate: None"]),
  "vector_lr": (
    dict(learning_rate=jnp.array([0.1, 0.2])),
    TypeError,
    ["Invalid learning_rate", "shape=(2,)", "0-d real array"],
  ),
  "betas_as_b1": (
    dict(b1=(0.9, 0.999, 0.5)),
    TypeError,
    ["Invalid b1: (0.9, 0.999, 0.5)", "expected a float"],
  ),
  "bool_b2": (dict(b2=True), TypeError, ["Invalid b2: True"]),
  "b1_one": (dict(b1=1.0), ValueError, ["Invalid beta parameter at index 0: 1.0"]),
  "b2_negative": (dict(b2=-0.1), ValueError, ["Invalid beta parameter at index 1: -0.1"]),
  "lr_negative": (dict(learning_rate=-1e-3), ValueError, ["Invalid learning rate: -0.001"]),
  "eps_zero": (dict(eps=0.0), ValueError, ["Invalid epsilon value: 0.0"]),
  "weight_decay_negative": (
    dict(weight_decay=-0.1),
    ValueError,
    ["Invalid weight_decay value: -0.1"],
  ),
  "mu_dtype_int": (
    dict(mu_dtype=jnp.int32),
    TypeError,
    ["Invalid mu_dtype: int32", "real floating dtype"],
  ),
  "nu_dtype_not_a_dtype": (dict(nu_dtype="fp32"), TypeError, ["Invalid nu_dtype: 'fp32'"]),
}


@pytest.mark.parametrize("case_name", sorted(HYPERPARAM_CASES))
@pytest.mark.parametrize("factory", [osa.sparse_adam, osa.sparse_adamw])
def test_bad_hyperparameters_refused_at_construction(case_name, factory):
  kwargs, error, fragments = HYPERPARAM_CASES[case_name]
  with pytest.raises(error) as err:
    factory(**kwargs)
  _assert_message(err.value, fragments)


def test_good_hyperparameter_kinds_accepted():
  """The checks refuse only wrong kinds: numpy scalars, 0-d arrays and schedules pass."""
  params = _params()
  for kwargs in (
    dict(learning_rate=np.float32(0.1), b1=np.float64(0.8)),
    dict(learning_rate=jnp.asarray(0.1), b2=jnp.asarray(0.99)),
    dict(learning_rate=optax.linear_schedule(0.1, 0.0, 10)),
    dict(mu_dtype="float32", nu_dtype=jnp.bfloat16),
  ):
    opt = osa.sparse_adam(**kwargs)
    updates, _ = jax.jit(opt.update)(_grads(_good_grad()), opt.init(params))
    assert updates["emb"]["table"].data.shape == (2, 2)


APPLY_CASES = {
  "structure_differs": (
    lambda u: {"emb": {"tab": u}, "bias": None},
    lambda p: p,
    ValueError,
    [
      "apply_updates",
      "only in the updates: ['emb']['tab']",
      "only in the params: ['emb']['table']",
    ],
  ),
  "sparse_shape_mismatch": (
    lambda u: {"emb": {"table": u}, "bias": None},
    lambda p: {**p, "emb": {"table": jnp.zeros((6, 2))}},
    ValueError,
    ["Sparse update at " + PATH, "shape (5, 2)", "parameter has shape (6, 2)"],
  ),
  "dense_shape_mismatch": (
    lambda u: {"emb": {"table": u}, "bias": jnp.ones((4,))},
    lambda p: p,
    ValueError,
    ["update at ['bias']", "shape (4,)", "parameter has shape (3,)"],
  ),
  "integer_param": (
    lambda u: {"emb": {"table": u}, "bias": None},
    lambda p: {**p, "emb": {"table": jnp.zeros(SHAPE, jnp.int32)}},
    TypeError,
    [PATH, "dtype int32", "real floating-point"],
  ),
  "n_batch_update": (
    lambda u: {"emb": {"table": _n_batch_1()}, "bias": None},
    lambda p: p,
    ValueError,
    ["Sparse update at " + PATH, "n_batch=1"],
  ),
  "float_indices_update": (
    lambda u: {"emb": {"table": _float_indices_grad()}, "bias": None},
    lambda p: p,
    TypeError,
    ["Sparse update at " + PATH, "indices of dtype float32"],
  ),
}


@pytest.mark.parametrize("case_name", sorted(APPLY_CASES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit_donated"])
def test_apply_updates_bad_input(case_name, jit):
  make_updates, make_params, error, fragments = APPLY_CASES[case_name]
  opt = SPARSE_ADAM
  params = _params()
  updates, _ = opt.update(_grads(_good_grad()), opt.init(params))
  params = make_params(params)
  bad_updates = make_updates(updates["emb"]["table"])
  before = _snapshot((params, bad_updates))
  apply = jax.jit(osa.apply_updates, donate_argnums=0) if jit else osa.apply_updates
  with pytest.raises(error) as err:
    apply(params, bad_updates)
  _assert_message(err.value, fragments)
  _assert_same(before, (params, bad_updates))


@pytest.mark.parametrize("bad_index", [-1, -5, 5, 7], ids=lambda i: f"index{i}")
def test_out_of_range_indices_are_padding_not_wraparound(bad_index, run_step):
  """Negative and too-large indices cannot raise under jit: they are ignored as padding.

  Row 4 (where -1 would wrap to in NumPy) and every row the gradient does not
  validly touch keep their params and moments bit for bit; the step advances.
  `check_sparse_grads` reports such entries (tests/core/test_checks.py).
  """
  opt = SPARSE_ADAM
  params, state = _trained_state(opt, _params())
  before = _snapshot((params, state))
  grad = _bcoo(np.ones((2, 2), np.float32), [[bad_index], [1]])
  new_params, new_state = run_step(opt, params, state, _grads(grad))
  untouched = np.array([0, 2, 3, 4])
  before_params, before_state = before
  for tree_before, tree_after in (
    (before_params["emb"]["table"], new_params["emb"]["table"]),
    (before_state.mu["emb"]["table"], new_state.mu["emb"]["table"]),
    (before_state.nu["emb"]["table"], new_state.nu["emb"]["table"]),
  ):
    np.testing.assert_array_equal(np.asarray(tree_after)[untouched], tree_before[untouched])
    assert not np.array_equal(np.asarray(tree_after)[1], tree_before[1])
  assert int(new_state.step["emb"]["table"]) == int(before_state.step["emb"]["table"]) + 1


def test_float16_gradients_for_float32_params_are_accepted():
  """Not an error: low-precision gradient data is computed in float32."""
  opt = SPARSE_ADAM
  params = _params()
  grad16 = _bcoo(np.full((2, 2), 0.5, np.float16), [[1], [3]])
  updates16, _ = opt.update(_grads(grad16), opt.init(params))
  updates32, _ = opt.update(_grads(_good_grad()), opt.init(params))
  assert updates16["emb"]["table"].dtype == jnp.float16
  np.testing.assert_allclose(
    np.asarray(updates16["emb"]["table"].data, np.float32),
    updates32["emb"]["table"].data,
    rtol=1e-3,
  )
