"""No composition trains the wrong rows: what follows the optimizer cannot move an update's ids.

Every optax transform that maps over updates is chained after `sparse_adam`. Each either
leaves the rows the update addresses as they were (and then the result equals
`sparse_adam` alone followed by the dense transform's effect on those rows, untouched rows
bit-exact), or fails loudly with the library's route in the message, before a row is
written. The verdicts here are docs/composing.md's table.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._core import row_update

NUM_ROWS, DIM = 32, 4
IDS = np.array([3, 7, 11, 11, 20, 3])
ROUTE = ("lift_to_bcoo", "docs/composing.md")


@pytest.fixture(params=[False, True], ids=["nojit", "jit"])
def jit(request):
  return request.param


def table():
  rng = np.random.default_rng(0)
  return {"table": jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32)}


def grads():
  rng = np.random.default_rng(1)
  data = jnp.asarray(rng.normal(size=(len(IDS), DIM)), jnp.float32)
  return {"table": sparse.BCOO((data, jnp.asarray(IDS[:, None])), shape=(NUM_ROWS, DIM))}


def run_steps(opt, jit, steps=2):
  """`steps` steps of `opt` then `osa.apply_updates`, jitted or not; the final params."""

  def step(params, state):
    updates, state = opt.update(grads(), state, params)
    return osa.apply_updates(params, updates), state

  step = jax.jit(step) if jit else step
  params = table()
  state = opt.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return jax.block_until_ready(params)


def changed_rows(params):
  return np.flatnonzero(np.any(np.asarray(params["table"]) != np.asarray(table()["table"]), 1))


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.05, 2, 10)

# Transforms that map over the leaves of the updates, and what each does after sparse_adam.
# "moved": it changes the int ids and keeps them int (refused by the ids' check);
# "float": it turns the ids into floats (refused by the dtype check);
# "structure": it pairs updates with params or per-leaf state (a pytree error whose
# message carries RowUpdate's route); "works": it leaves ids and values as they are.
MAPPING_TRANSFORMS = {
  "scale_by_learning_rate(schedule)": (lambda: optax.scale_by_learning_rate(SCHEDULE), "moved"),
  "scale_by_schedule": (lambda: optax.scale_by_schedule(SCHEDULE), "moved"),
  "scale(2) (int factor)": (lambda: optax.scale(2), "moved"),
  "scale(-1) (int sign flip)": (lambda: optax.scale(-1), "moved"),
  "scale(-1.0)": (lambda: optax.scale(-1.0), "float"),
  "scale_by_learning_rate(0.1)": (lambda: optax.scale_by_learning_rate(0.1), "float"),
  "clip(0.5)": (lambda: optax.clip(0.5), "float"),
  "clip_by_block_rms": (lambda: optax.clip_by_block_rms(0.1), "float"),
  "centralize": (lambda: optax.centralize(), "float"),
  "normalize_by_update_norm": (lambda: optax.normalize_by_update_norm(), "float"),
  "add_decayed_weights": (lambda: optax.add_decayed_weights(1e-2), "structure"),
  "trace": (lambda: optax.trace(0.9), "structure"),
  "ema": (lambda: optax.ema(0.9), "structure"),
  "adaptive_grad_clip": (lambda: optax.adaptive_grad_clip(0.1), "structure"),
  "apply_every": (lambda: optax.apply_every(2), "structure"),
  "scale_by_trust_ratio": (lambda: optax.scale_by_trust_ratio(), "structure"),
  "keep_params_nonnegative": (lambda: optax.keep_params_nonnegative(), "structure"),
  "zero_nans": (lambda: optax.zero_nans(), "works"),
  "identity": (lambda: optax.identity(), "works"),
}


@pytest.mark.parametrize("name", list(MAPPING_TRANSFORMS))
def test_a_transform_after_the_optimizer_never_moves_rows(name, jit):
  make, verdict = MAPPING_TRANSFORMS[name]
  opt = optax.chain(osa.sparse_adam(0.5), make())
  if verdict == "works":
    alone = run_steps(osa.sparse_adam(0.5), jit)
    np.testing.assert_array_equal(run_steps(opt, jit)["table"], alone["table"])
    return
  # Refused, with the route in the message: eagerly before a row is written, under jit
  # when the step runs (a host callback; the moved update's rows are all dropped).
  with pytest.raises(Exception) as failure, warnings.catch_warnings():
    # keep_params_nonnegative adds the update to the params first (told, then refused).
    warnings.simplefilter("ignore", osa.DensifyingUpdateWarning)
    run_steps(opt, jit)
  message = str(failure.value)
  assert any(route in message for route in ROUTE), message
  if verdict == "moved":
    assert "row ids of the sparse update at ['table'] were changed" in message
  elif verdict == "float":
    assert isinstance(failure.value, TypeError)
    assert "indices of dtype float32" in message
  else:
    assert "RowUpdate" in message


def test_raw_clip_by_global_norm_after_the_optimizer_fails_in_optax():
  """The one failure whose message is optax's own (its lax.select meets the int ids first);
  docs/composing.md's table gives its route, which is tested here to work."""
  params = table()
  opt = optax.chain(osa.sparse_adam(0.5), optax.clip_by_global_norm(0.1))
  with pytest.raises(TypeError, match="lax.select"):
    opt.update(grads(), opt.init(params), params)
  lifted = optax.chain(osa.sparse_adam(0.5), osa.lift_to_bcoo(optax.clip_by_global_norm(0.1)))
  updates, _ = lifted.update(grads(), lifted.init(params), params)
  norm = float(jnp.linalg.norm(updates["table"].data))
  assert norm == pytest.approx(0.1, rel=1e-5)
  assert sorted(changed_rows(osa.apply_updates(params, updates))) == sorted(set(IDS))


def test_lifted_schedule_after_the_optimizer_scales_the_touched_rows_only(jit):
  """The route of the silent case: the schedule's factor on the rows, the ids untouched."""
  alone = osa.sparse_adam(1.0)
  lifted = optax.chain(osa.sparse_adam(1.0), osa.lift_to_bcoo(optax.scale_by_learning_rate(0.1)))
  params = table()

  def updates_of(opt):
    fn = lambda g, s, p: opt.update(g, s, p)[0]  # noqa: E731
    return (jax.jit(fn) if jit else fn)(grads(), opt.init(params), params)

  u_alone, u_lifted = updates_of(alone), updates_of(lifted)
  assert isinstance(u_lifted["table"], osa.RowUpdate)
  dense_alone = np.asarray(u_alone["table"].todense())
  np.testing.assert_allclose(
    np.asarray(u_lifted["table"].todense()), -0.1 * dense_alone, rtol=1e-6, atol=0
  )
  after = osa.apply_updates(params, u_lifted)
  assert sorted(changed_rows(after)) == sorted(set(IDS))


def test_an_unchanged_rebuilt_update_passes_and_a_moved_one_is_refused_at_once():
  params = table()
  opt = osa.sparse_adam(0.5)
  updates, _ = opt.update(grads(), opt.init(params), params)
  update = updates["table"]
  assert isinstance(update, osa.RowUpdate) and update.sealed
  rebuilt = jax.tree.map(lambda x: x, update)  # a tree map rebuilds the instance
  assert isinstance(rebuilt, osa.RowUpdate) and not rebuilt.sealed
  np.testing.assert_array_equal(
    osa.apply_updates(params, {"table": rebuilt})["table"],
    osa.apply_updates(params, updates)["table"],
  )
  shifted = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.int32 else x, update)
  before = np.asarray(params["table"]).copy()
  with pytest.raises(ValueError, match=r"row ids .* at \['table'\] were changed"):
    osa.apply_updates(params, {"table": shifted})
  np.testing.assert_array_equal(params["table"], before)


def test_a_moved_update_under_jit_raises_and_writes_no_row():
  """Traced, a moved update raises when the step runs, its ids turned into padding first."""
  params = table()
  opt = osa.sparse_adam(0.5)
  updates, _ = opt.update(grads(), opt.init(params), params)
  moved = jax.tree.map(lambda x: x * 0 if x.dtype == jnp.int32 else x, updates["table"])

  def apply(params, update):
    return osa.apply_updates(params, {"table": update})

  with pytest.raises(Exception, match=r"row ids of the sparse update at \['table'\]"):
    jax.block_until_ready(jax.jit(apply)(params, moved))
  # What the scatter receives in that case: distinct, out-of-range ids, so no row is written.
  dropped = jax.jit(row_update.padding_if)(jnp.bool_(True), moved)
  assert np.all(np.asarray(dropped)[:, 0] >= NUM_ROWS)
  assert len(set(np.asarray(dropped)[:, 0].tolist())) == moved.nse
  dropped_update = sparse.BCOO((moved.data, dropped), shape=moved.shape)
  np.testing.assert_array_equal(
    osa.apply_updates(params, {"table": dropped_update})["table"], params["table"]
  )
  kept = jax.jit(row_update.padding_if)(jnp.bool_(False), updates["table"])
  np.testing.assert_array_equal(kept, updates["table"].indices)


def test_a_gradient_rebuilt_with_moved_ids_is_refused_by_the_optimizer():
  """A RowUpdate fed back as a gradient (lift_to_bcoo's output, then a raw optax map)."""
  params = table()
  opt = optax.chain(
    osa.lift_to_bcoo(optax.identity()), optax.scale_by_schedule(SCHEDULE), osa.sparse_adam(0.5)
  )
  sealed_grads = {"table": row_update.seal(grads()["table"])}
  with pytest.raises(ValueError, match=r"sparse gradient at \['table'\] were changed"):
    opt.update(sealed_grads, opt.init(params), params)


def test_optax_apply_updates_is_right_and_says_once_that_it_densifies():
  params = table()
  opt = osa.sparse_adam(0.5)
  updates, _ = opt.update(grads(), opt.init(params), params)
  with pytest.warns(osa.DensifyingUpdateWarning, match=r"\(32, 4\).*osa.SparseOptimizer"):
    dense = optax.apply_updates(params, updates)
  expected = osa.apply_updates(params, updates)["table"]
  np.testing.assert_array_equal(dense["table"], expected)
  with warnings.catch_warnings(record=True) as told:
    warnings.simplefilter("default")  # Python's own filter: once per call site
    for _ in range(3):
      again = optax.apply_updates(params, updates)
  assert [w.category for w in told] == [osa.DensifyingUpdateWarning]
  np.testing.assert_array_equal(again["table"], expected)


def test_schedule_free_with_a_sparse_base_is_told_it_densifies():
  params = table()
  opt = optax.contrib.schedule_free(osa.sparse_adam(0.1), 0.1)
  with pytest.warns(osa.DensifyingUpdateWarning, match="schedule_free"):
    updates, _ = opt.update(grads(), opt.init(params), params)
  assert not isinstance(updates["table"], sparse.BCOO)  # its updates are dense, as it says


def test_optax_apply_if_finite_around_sparse_adam_still_matches_its_branches(jit):
  opt = optax.apply_if_finite(osa.sparse_adam(0.5), 2)
  guarded = run_steps(opt, jit)
  np.testing.assert_array_equal(guarded["table"], run_steps(osa.sparse_adam(0.5), jit)["table"])


def test_sparse_apply_if_finite_skips_with_a_checked_all_padding_update(jit):
  params = table()
  opt = osa.sparse_apply_if_finite(osa.sparse_adam(0.5), 3)
  nan = {
    "table": sparse.BCOO((jnp.full((1, DIM), jnp.nan), jnp.array([[2]])), shape=(NUM_ROWS, DIM))
  }
  fn = lambda g, s, p: opt.update(g, s, p)[0]  # noqa: E731
  updates = (jax.jit(fn) if jit else fn)(nan, opt.init(params), params)
  update = updates["table"]
  assert isinstance(update, osa.RowUpdate)
  rebuilt = jax.tree.map(lambda x: x, update)  # its check holds for the padding ids
  np.testing.assert_array_equal(
    osa.apply_updates(params, {"table": rebuilt})["table"], table()["table"]
  )


@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
def test_callable_masks_and_labels_work_through_on_dense_shapes(wrapper, jit):
  params = {**table(), "bias": jnp.ones(DIM)}
  g = {**grads(), "bias": jnp.ones(DIM)}
  if wrapper == "masked":
    opt = optax.chain(
      optax.masked(
        osa.sparse_adam(0.5), osa.on_dense_shapes(lambda p: {"table": True, "bias": False})
      ),
      optax.masked(
        optax.adam(0.5), osa.on_dense_shapes(lambda p: jax.tree.map(lambda x: x.ndim == 1, p))
      ),
    )
  else:
    labels = osa.on_dense_shapes(lambda p: jax.tree.map(lambda x: "s" if x.ndim == 2 else "d", p))
    opt = optax.multi_transform({"s": osa.sparse_adam(0.5), "d": optax.adam(0.5)}, labels)
  fn = lambda g, s, p: opt.update(g, s, p)[0]  # noqa: E731
  updates = (jax.jit(fn) if jit else fn)(g, opt.init(params), params)
  after = osa.apply_updates(params, updates)
  reference = osa.sparse_adam(0.5)
  ref_updates, _ = reference.update(grads(), reference.init(table()), table())
  np.testing.assert_array_equal(after["table"], osa.apply_updates(table(), ref_updates)["table"])
  dense = optax.adam(0.5)
  dense_updates, _ = dense.update(g["bias"], dense.init(params["bias"]))
  np.testing.assert_array_equal(after["bias"], params["bias"] + dense_updates)


def test_raw_callable_masks_fail_in_optax_and_on_dense_shapes_is_the_route():
  params = {**table(), "bias": jnp.ones(DIM)}
  g = {**grads(), "bias": jnp.ones(DIM)}
  raw = optax.masked(osa.sparse_adam(0.5), lambda p: jax.tree.map(lambda x: x.ndim == 2, p))
  with pytest.raises(ValueError, match="pytree structure"):
    raw.update(g, raw.init(params), params)


def test_the_type_repr_in_pytree_errors_names_the_route():
  assert "lift_to_bcoo" in repr(osa.RowUpdate)
  assert isinstance(osa.RowUpdate((jnp.ones((1, 2)), jnp.array([[1]])), shape=(3, 2)), sparse.BCOO)


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.add_decayed_weights(0.1),
    lambda: optax.keep_params_nonnegative(),
    lambda: optax.scale_by_learning_rate(SCHEDULE),
    lambda: optax.clip_by_global_norm(0.1),
  ],
  ids=["add_decayed_weights", "keep_params_nonnegative", "schedule", "clip_by_global_norm"],
)
def test_lifted_after_the_optimizer_equals_the_dense_composition_on_touched_rows(make):
  """The route the refusals name: X on the rows equals X on the dense update there."""
  params = table()
  opt = osa.sparse_adam(0.5)
  updates, _ = opt.update(grads(), opt.init(params), params)
  dense_update = {"table": updates["table"].todense()}
  lifted, raw = osa.lift_to_bcoo(make()), make()
  got, _ = lifted.update(updates, lifted.init(params), params)
  want, _ = raw.update(dense_update, raw.init(params), params)
  touched = np.array(sorted(set(IDS)))
  untouched = np.setdiff1d(np.arange(NUM_ROWS), touched)
  after = osa.apply_updates(params, got)["table"]
  np.testing.assert_allclose(
    after[touched], (params["table"] + want["table"])[touched], rtol=1e-6, atol=1e-7
  )
  np.testing.assert_array_equal(after[untouched], params["table"][untouched])


def test_lookahead_over_a_sparse_optimizer_is_refused_with_the_route():
  params = optax.LookaheadParams.init_synced(table())
  opt = optax.lookahead(osa.sparse_adam(0.5), 2, 0.5)
  with pytest.raises(ValueError, match="RowUpdate.*docs/composing.md"), warnings.catch_warnings():
    # Its fast weights take the update with '+' first (told), then it pairs it with state.
    warnings.simplefilter("ignore", osa.DensifyingUpdateWarning)
    opt.update(grads(), opt.init(params), params)
