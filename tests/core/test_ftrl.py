"""FTRL, and rules that read and set rows: `sparse_ftrl` against TF's formula, rows set exactly.

`sparse_ftrl` is checked against a float64 NumPy reference of TF's
`SparseApplyFtrlV2` step (Keras's `Ftrl` on `IndexedSlices`: duplicates summed
first, the touched rows only) written here, on the XLA ops and the accelerator
path forced on the CPU, jitted with donation. A set row is stored exactly: the
parameter's rows after `apply_updates` are the update's entries, bit for bit,
for float32 and bfloat16 tables; L1's zeros are exact zeros. A rule written in
this file reads and sets rows too. Bad input fails before any state changes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice

ROWS, DIM = 10, 3
RNG = np.random.default_rng(7)
TABLE0 = RNG.standard_normal((ROWS, DIM)).astype(np.float32)
BATCHES = [
  (RNG.integers(0, ROWS - 3, 5).astype(np.int32), RNG.standard_normal((5, DIM)).astype(np.float32))
  for _ in range(8)
]  # rows ROWS - 3 and above are never touched; every batch may repeat a row


def _tf_ftrl(batches, lr, power, init, l1, l2, shrink, beta, maximize=False):
  """TF's FTRL-V2 sparse step (training_ops' FtrlCompute), float64, after Keras's dedup."""
  w = TABLE0.astype(np.float64).copy()
  accum = np.full_like(w, init)
  linear = np.zeros_like(w)
  l2_total = l2 + beta / (2.0 * lr)
  for ids, vals in batches:
    summed = np.zeros_like(w)
    np.add.at(summed, ids, vals.astype(np.float64))
    for i in np.unique(ids):
      g = -summed[i] if maximize else summed[i]
      g_shrunk = g + 2.0 * shrink * w[i]
      new_accum = accum[i] + g * g
      linear[i] += g_shrunk - (new_accum ** (-power) - accum[i] ** (-power)) / lr * w[i]
      quadratic = new_accum ** (-power) / lr + 2.0 * l2_total
      w[i] = np.where(
        np.abs(linear[i]) > l1, (np.sign(linear[i]) * l1 - linear[i]) / quadratic, 0.0
      )
      accum[i] = new_accum
  return w, accum, linear


def _step(opt):
  def step(params, state, ids, vals):
    grad = sparse.BCOO((vals, ids[:, None]), shape=params["t"].shape)
    updates, state = opt.update({"t": grad}, state, params)
    return osa.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def _train(opt, batches, dtype=jnp.float32):
  params = {"t": jnp.asarray(TABLE0, dtype)}
  state = opt.init(params)
  step = _step(opt)
  for ids, vals in batches:
    params, state = step(params, state, jnp.asarray(ids), jnp.asarray(vals, dtype))
  return params, state


CASES = {
  "l1": dict(lr=0.3, power=-0.5, init=0.1, l1=1.0, l2=0.0, shrink=0.0, beta=0.0),
  "all": dict(lr=0.2, power=-0.5, init=0.5, l1=0.05, l2=0.1, shrink=0.05, beta=0.3),
  "power": dict(lr=0.2, power=-0.7, init=0.2, l1=0.1, l2=0.01, shrink=0.0, beta=0.0),
  "maximize": dict(lr=0.3, power=-0.5, init=0.1, l1=0.2, l2=0.0, shrink=0.0, beta=0.0),
}


@pytest.mark.parametrize("forced", [None, choice.ACCELERATOR], ids=["xla", "accelerator"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_ftrl_is_tfs_sparse_step(case, forced):
  h = CASES[case]
  maximize = case == "maximize"
  opt = osa.sparse_ftrl(
    h["lr"], h["power"], h["init"], h["l1"], h["l2"], h["shrink"], h["beta"], maximize=maximize
  )
  with choice.choose(forced=forced):
    params, state = _train(opt, BATCHES)
  w, accum, linear = _tf_ftrl(BATCHES, *h.values(), maximize=maximize)
  got = np.asarray(params["t"])
  np.testing.assert_allclose(got, w, rtol=3e-5, atol=3e-6)
  np.testing.assert_allclose(np.asarray(state.slots["accumulator"]["t"]), accum, rtol=3e-6)
  np.testing.assert_allclose(np.asarray(state.slots["linear"]["t"]), linear, rtol=3e-5, atol=3e-6)
  # Lazy: rows no gradient touched keep their bits; L1's zeros are exact zeros.
  np.testing.assert_array_equal(got[ROWS - 3 :], TABLE0[ROWS - 3 :])
  zeros = (w == 0.0)[: ROWS - 3]
  if h["l1"] > 0 and case == "l1":
    assert zeros.sum() >= 3  # the check below has zeros to look at
  np.testing.assert_array_equal(got[: ROWS - 3] == 0.0, zeros)


def test_set_rows_are_stored_exactly_on_every_path_and_dtype():
  """The table's touched rows after the apply are the update's entries, bit for bit."""
  opt = osa.sparse_ftrl(0.3, l1_regularization_strength=0.2, l2_regularization_strength=0.1)
  ids, vals = BATCHES[0]
  seen = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    for forced in (None, choice.ACCELERATOR, choice.GENERIC_XLA):
      with choice.choose(forced=forced):
        params = {"t": jnp.asarray(TABLE0, dtype)}
        grad = sparse.BCOO((jnp.asarray(vals, dtype), jnp.asarray(ids)[:, None]), shape=(ROWS, DIM))
        updates, _ = jax.jit(opt.update)({"t": grad}, opt.init(params), params)
        new = jax.jit(osa.apply_updates)(params, updates)["t"]
      update = updates["t"]
      assert isinstance(update, osa.SetRowsUpdate)
      assert update.data.dtype == dtype
      rows = np.asarray(update.indices[:, 0])
      kept = rows < ROWS
      bits = np.asarray(
        jax.lax.bitcast_convert_type(new, jnp.int32 if dtype == jnp.float32 else jnp.int16)
      )
      want = np.asarray(
        jax.lax.bitcast_convert_type(update.data, jnp.int32 if dtype == jnp.float32 else jnp.int16)
      )
      np.testing.assert_array_equal(bits[rows[kept]], want[kept])
      untouched = np.setdiff1d(np.arange(ROWS), rows[kept])
      np.testing.assert_array_equal(
        np.asarray(new.astype(jnp.float32))[untouched],
        np.asarray(jnp.asarray(TABLE0, dtype).astype(jnp.float32))[untouched],
      )
      seen[(str(dtype), forced)] = np.asarray(new.astype(jnp.float32))
    # Every path gives the same table.
    first = seen[(str(dtype), None)]
    for forced in (choice.ACCELERATOR, choice.GENERIC_XLA):
      np.testing.assert_array_equal(seen[(str(dtype), forced)], first)


# A rule a user writes: SGD whose rows are clipped into [-bound, bound] (it reads and sets rows).
RULE_SOURCE = """
import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

import optax_sparse_adam as osa


class ClipHyper(NamedTuple):
  learning_rate: Any
  bound: Any = 1.0
  weight_decay: Any = None


@dataclasses.dataclass(frozen=True)
class ClippedSGD:
  name: str = dataclasses.field(default="test_clipped_sgd", init=False)
  reads_param: bool = dataclasses.field(default=True, init=False)
  sets_rows: bool = dataclasses.field(default=True, init=False)

  def slots(self):
    return (osa.Slot("touches", per_row=True),)

  def update(self, block, hyper):
    lr = jnp.asarray(hyper.learning_rate, block.compute_dtype)
    new = jnp.clip(block.param - lr * block.grad, -hyper.bound, hyper.bound)
    return new, {"touches": block.slots["touches"] + 1}
"""
_namespace: dict = {}
exec(RULE_SOURCE, _namespace)  # noqa: S102  # the rule a user would write in their own file
ClippedSGD, ClipHyper = _namespace["ClippedSGD"], _namespace["ClipHyper"]


@pytest.mark.parametrize("forced", [None, choice.ACCELERATOR], ids=["xla", "accelerator"])
def test_a_rule_from_a_test_file_reads_and_sets_rows(forced):
  opt = osa.sparse_rule_transformation(
    ClippedSGD(), ClipHyper(0.5, 0.75), weight_decay_mode="none", max_norm=1.0
  )
  with choice.choose(forced=forced):
    params, state = _train(opt, BATCHES)
  w = TABLE0.astype(np.float64).copy()
  touches = np.zeros(ROWS)
  for ids, vals in BATCHES:
    g = np.zeros_like(w)
    np.add.at(g, ids, vals)
    for i in np.unique(ids):
      row = np.clip(w[i] - 0.5 * g[i], -0.75, 0.75)
      norm = np.linalg.norm(row)
      w[i] = row * (1.0 / norm) if norm > 1.0 else row
      touches[i] += 1
  np.testing.assert_allclose(np.asarray(params["t"]), w, rtol=2e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(state.slots["touches"]["t"]), touches)
  # A clipped value is stored as the bound itself (a set, not w + (bound - w)).
  assert np.any(np.asarray(params["t"]) == np.float32(0.75)) or np.any(
    np.asarray(params["t"]) == np.float32(-0.75)
  )


def test_sparse_apply_if_finite_skips_a_set_rows_step():
  opt = osa.sparse_apply_if_finite(osa.sparse_ftrl(0.3), max_consecutive_errors=5)
  params = {"t": jnp.asarray(TABLE0)}
  state = opt.init(params)
  ids, vals = BATCHES[0]
  bad = vals.copy()
  bad[0, 0] = np.nan
  step = _step(opt)
  new, state = step(params, state, jnp.asarray(ids), jnp.asarray(bad))
  np.testing.assert_array_equal(np.asarray(new["t"]), TABLE0)
  new, state = step(new, state, jnp.asarray(ids), jnp.asarray(vals))
  assert not np.array_equal(np.asarray(new["t"]), TABLE0)


BAD_RULE_SOURCE = """
import dataclasses
from typing import Any, NamedTuple

import optax_sparse_adam as osa


class Hyper(NamedTuple):
  learning_rate: Any
  weight_decay: Any = None


@dataclasses.dataclass(frozen=True)
class ExtraSlot:
  name: str = dataclasses.field(default="test_extra_slot", init=False)

  def slots(self):
    return (osa.Slot("sum"),)

  def update(self, block, hyper):
    return -block.grad, {"sum": block.slots["sum"], "other": block.slots["sum"]}
"""
exec(BAD_RULE_SOURCE, _namespace)  # noqa: S102


def test_a_rule_returning_rows_for_an_undeclared_slot_is_refused():
  opt = osa.sparse_rule_transformation(_namespace["ExtraSlot"](), _namespace["Hyper"](0.1))
  params = {"t": jnp.asarray(TABLE0)}
  state = opt.init(params)
  ids, vals = BATCHES[0]
  grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=(ROWS, DIM))
  with pytest.raises(ValueError, match=r"\['other'\] not declared"):
    opt.update({"t": grad}, state, params)


def test_a_rule_that_reads_the_parameter_needs_params_in_update():
  opt = osa.sparse_ftrl(0.1)
  params = {"t": jnp.asarray(TABLE0)}
  state = opt.init(params)
  ids, vals = BATCHES[0]
  grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=(ROWS, DIM))
  with pytest.raises(ValueError, match=r"Parameter at \['t'\] is needed for the 'ftrl' rule"):
    opt.update({"t": grad}, state)


@pytest.mark.parametrize(
  "make,words",
  [
    (lambda: osa.sparse_ftrl(0.1, learning_rate_power=0.5), "`learning_rate_power` needs"),
    (lambda: osa.sparse_ftrl(0.1, initial_accumulator_value=-1.0), "`initial_accumulator_value`"),
    (lambda: osa.sparse_ftrl(0.1, l1_regularization_strength=-1.0), "`l1_regularization_str"),
    (lambda: osa.sparse_ftrl(0.1, l2_regularization_strength=-1.0), "`l2_regularization_str"),
    (
      lambda: osa.sparse_ftrl(0.1, l2_shrinkage_regularization_strength=-1.0),
      "`l2_shrinkage_regularization_strength` needs",
    ),
    (lambda: osa.sparse_ftrl(0.0), "`learning_rate` needs to be positive"),
    (lambda: osa.sparse_ftrl(0.1, catch_up_idle_rows=True), "unexpected keyword"),
  ],
)
def test_ftrl_options_are_checked_with_kerass_names(make, words):
  with pytest.raises((ValueError, TypeError), match=words):
    make()


def test_ftrl_catch_up_is_refused_with_the_rules_reason():
  with pytest.raises(ValueError, match="no closed form of the idle steps of a lazy FTRL"):
    osa.sparse_rule_transformation(
      osa.FtrlRule(), osa.FtrlHyperparams(0.1), catch_up_idle_rows=True
    )


@pytest.mark.parametrize(
  "make",
  [
    lambda: osa.sparse_rowwise_adagrad(0.1, weight_decay=0.01),
    lambda: osa.sparse_rowwise_adagrad(0.1, weight_decay=jnp.float32(0.01)),
    lambda: osa.sparse_rowwise_adagrad(0.1, weight_decay=optax.constant_schedule(0.01)),
    lambda: osa.sparse_rule_transformation(
      osa.RowwiseAdagradRule(),
      osa.RowwiseAdagradHyperparams(0.1, weight_decay=0.01),
      weight_decay_mode="none",
    ),
  ],
)
def test_a_weight_decay_that_mode_none_would_ignore_is_refused(make):
  with pytest.raises(ValueError, match="weight_decay_mode='none', which would ignore it"):
    make()


def test_a_zero_weight_decay_with_mode_none_is_accepted_also_through_inject_hyperparams():
  for opt in (
    osa.sparse_rowwise_adagrad(0.1, weight_decay=0.0),
    optax.inject_hyperparams(osa.sparse_rowwise_adagrad)(learning_rate=0.1, weight_decay=0.0),
  ):
    params, _ = _train(opt, BATCHES[:1])
    assert np.isfinite(np.asarray(params["t"])).all()
  with pytest.raises(ValueError, match="would ignore it"):
    optax.inject_hyperparams(osa.sparse_rowwise_adagrad)(learning_rate=0.1, weight_decay=0.5).init(
      {"t": jnp.asarray(TABLE0)}
    )


def test_the_dense_gradient_error_of_a_rule_without_a_dense_twin_names_no_adam():
  opt = osa.sparse_ftrl(0.1)
  params = {"t": jnp.asarray(TABLE0)}
  with pytest.raises(TypeError) as info:
    opt.update({"t": jnp.zeros((ROWS, DIM))}, opt.init(params), params)
  message = str(info.value)
  assert "sparse_ftrl needs BCOO gradients" in message
  assert "give it to a dense optax optimizer" in message
  assert "give it to optax.adam" not in message


def test_optax_apply_if_finite_around_a_rule_that_sets_rows_is_refused():
  opt = optax.apply_if_finite(osa.sparse_ftrl(0.1), max_consecutive_errors=2)
  params = {"t": jnp.asarray(TABLE0)}
  ids, vals = BATCHES[0]
  grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=(ROWS, DIM))
  with pytest.raises(ValueError, match="Use osa.sparse_apply_if_finite"):
    opt.update({"t": grad}, opt.init(params), params)


def test_a_set_rows_update_added_with_plus_is_refused():
  """optax.apply_updates adds with '+': rows added to rows would be a silent wrong result."""
  opt = osa.sparse_ftrl(0.1)
  params = {"t": jnp.asarray(TABLE0)}
  ids, vals = BATCHES[0]
  grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=(ROWS, DIM))
  updates, _ = opt.update({"t": grad}, opt.init(params), params)
  with pytest.raises(TypeError, match="Apply it with optax_sparse_adam.apply_updates"):
    optax.apply_updates(params, updates)
