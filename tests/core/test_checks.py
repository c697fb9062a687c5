"""The opt-in checked mode: `check_sparse_grads` and `sparse_grad_checks` under checkify."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify, sparse

import optax_sparse_adam as osa

SHAPE = (6, 3)


def _bcoo(data, indices, shape=SHAPE) -> sparse.BCOO:
  return sparse.BCOO((jnp.asarray(data, jnp.float32), jnp.asarray(indices)), shape=shape)


def _params() -> dict:
  return {"emb": {"table": jnp.zeros(SHAPE)}, "other": jnp.zeros((4, 2))}


def _grads(table_grad, other_grad=None) -> dict:
  return {"emb": {"table": table_grad}, "other": other_grad}


def _ones(n: int) -> np.ndarray:
  return np.ones((n, SHAPE[1]), np.float32)


def _strict(grads, params):
  osa.check_sparse_grads(grads, params, allow_padding=False)


def _lenient(grads, params):
  osa.check_sparse_grads(grads, params, check_finite=False)


# Both orders of composition are supported by checkify. The wrappers are built once so
# that the tests share their compilation caches.
CHECKED = {
  "checkify_of_jit": {
    f: checkify.checkify(jax.jit(f)) for f in (osa.check_sparse_grads, _strict, _lenient)
  },
  "jit_of_checkify": {
    f: jax.jit(checkify.checkify(f)) for f in (osa.check_sparse_grads, _strict, _lenient)
  },
}


@pytest.fixture(params=sorted(CHECKED))
def checked(request):
  return CHECKED[request.param].__getitem__


@pytest.mark.parametrize(
  "indices, count, first",
  [
    ([[1], [6], [2], [-1]], 2, 1),
    ([[-3], [0], [0], [0]], 1, 0),
    ([[9], [9], [9], [9]], 4, 0),
  ],
)
def test_out_of_range_reported_with_count_and_path(checked, indices, count, first):
  check = checked(osa.check_sparse_grads)
  err, _ = check(_grads(_bcoo(_ones(4), indices)), _params())
  message = err.get()
  assert message is not None
  assert message.startswith("Sparse gradient at ['emb']['table']: ")
  assert f"{count} of 4 entries have out-of-range indices" in message
  assert f"the first is entry {first}" in message
  assert "sparse shape (6,)" in message
  with pytest.raises(checkify.JaxRuntimeError, match="out-of-range"):
    err.throw()


def test_clean_gradients_pass(checked):
  check = checked(osa.check_sparse_grads)
  err, _ = check(_grads(_bcoo(_ones(3), [[0], [5], [5]])), _params())
  assert err.get() is None
  err.throw()  # no-op


def test_zero_padding_allowed_by_default_and_reported_on_request(checked):
  """`sum_duplicates(nse=...)` pads with out-of-range, all-zero entries."""
  grad = jax.jit(lambda g: g.sum_duplicates(nse=4))(_bcoo(_ones(2), [[3], [3]]))
  assert int(grad.indices[-1, 0]) == SHAPE[0]
  err, _ = checked(osa.check_sparse_grads)(_grads(grad), _params())
  assert err.get() is None
  strict = checked(_strict)
  err, _ = strict(_grads(grad), _params())
  assert "3 of 4 entries have out-of-range indices" in err.get()
  assert "and nonzero values" not in err.get()


def test_padding_that_carries_nan_is_reported(checked):
  data = _ones(2)
  data[1, 2] = np.nan
  err, _ = checked(osa.check_sparse_grads)(_grads(_bcoo(data, [[0], [6]])), _params())
  assert "1 of 2 entries have out-of-range indices" in err.get()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_reported_with_count_and_path(checked, bad):
  other = np.ones((5, 2), np.float32)
  other[1, 0] = bad
  other[3, 1] = bad
  grads = _grads(_bcoo(_ones(1), [[0]]), _bcoo(other, [[0], [1], [2], [3], [0]], (4, 2)))
  err, _ = checked(osa.check_sparse_grads)(grads, _params())
  assert err.get().startswith("Sparse gradient at ['other']: 2 of 5 entries hold NaN or Inf")
  assert "the first is entry 1" in err.get()
  lenient = checked(_lenient)
  err, _ = lenient(grads, _params())
  assert err.get() is None


def test_none_and_dense_leaves_are_skipped(checked):
  err, _ = checked(osa.check_sparse_grads)(_grads(None, jnp.full((4, 2), jnp.nan)), _params())
  assert err.get() is None


def test_element_wise_gradient_reports_per_entry():
  """n_sparse=2, n_dense=0: an index is out of range if any coordinate is."""
  grad = _bcoo(np.ones(3, np.float32), [[0, 0], [5, 3], [-1, 1]])
  err, _ = checkify.checkify(jax.jit(osa.check_sparse_grads))(_grads(grad), _params())
  assert "2 of 3 entries have out-of-range indices" in err.get()
  assert "sparse shape (6, 3)" in err.get()


def test_eager_call_raises_at_once():
  with pytest.raises(checkify.JaxRuntimeError, match=r"\['emb'\]\['table'\]: 1 of 2 entries"):
    osa.check_sparse_grads(_grads(_bcoo(_ones(2), [[0], [17]])), _params())


def test_jit_without_checkify_is_refused_not_silently_skipped():
  with pytest.raises(ValueError, match="checkify"):
    jax.jit(osa.check_sparse_grads)(_grads(_bcoo(_ones(2), [[0], [1]])))


def test_static_problems_raise_at_trace_time():
  with pytest.raises(ValueError, match=r"\['emb'\]\['table'\] has shape \(6, 3\)"):
    osa.check_sparse_grads(
      _grads(_bcoo(_ones(1), [[0]])), {"emb": {"table": jnp.zeros((7, 3))}, "other": None}
    )
  with pytest.raises(ValueError, match="structure differs"):
    osa.check_sparse_grads(_grads(_bcoo(_ones(1), [[0]])), {"emb": jnp.zeros(SHAPE)})


def test_braces_in_a_key_do_not_break_the_message():
  grads = {"a{0}b": _bcoo(_ones(1), [[7]])}
  err, _ = checkify.checkify(jax.jit(osa.check_sparse_grads))(grads)
  assert err.get().startswith("Sparse gradient at ['a{0}b']: 1 of 1 entries")


def test_chained_transform_reports_inside_a_jitted_training_step():
  opt = optax.chain(osa.sparse_grad_checks(), osa.sparse_adam(0.1))
  plain = osa.sparse_adam(0.1)
  params = _params()

  def step(opt, params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  checked_step = jax.jit(checkify.checkify(lambda p, s, g: step(opt, p, s, g)))
  good = _grads(_bcoo(_ones(3), [[1], [1], [4]]))
  err, (new_params, new_state) = checked_step(params, opt.init(params), good)
  assert err.get() is None
  ref_params, ref_state = jax.jit(lambda p, s, g: step(plain, p, s, g))(
    params, plain.init(params), good
  )
  for got, want in zip(
    jax.tree.leaves((new_params, new_state[1])),
    jax.tree.leaves((ref_params, ref_state)),
    strict=True,
  ):
    np.testing.assert_array_equal(got, want)

  bad = _grads(_bcoo(_ones(3), [[1], [-2], [4]]))
  err, _ = checked_step(params, opt.init(params), bad)
  assert "Sparse gradient at ['emb']['table']: 1 of 3 entries" in err.get()


def test_default_transform_has_no_checks_in_its_hot_path():
  """The checks are opt-in: sparse_adam's jaxpr holds no checkify primitive."""
  opt = osa.sparse_adam(0.1)
  params = _params()
  jaxpr = jax.make_jaxpr(opt.update)(_grads(_bcoo(_ones(2), [[0], [9]])), opt.init(params))
  primitives = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
  assert "check" not in primitives
  checked_jaxpr = jax.make_jaxpr(osa.check_sparse_grads)(_grads(_bcoo(_ones(2), [[0], [9]])))
  assert "check" in {eqn.primitive.name for eqn in checked_jaxpr.jaxpr.eqns}
