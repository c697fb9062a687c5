"""Row sums and per-row slots on the row program (`osa.row_sum`, `row_program.cc`), XLA's bits.

A rule whose update sums its rows with `osa.row_sum` and keeps per-row slots
(one value a row) runs on the row program: the row sum is one op over the whole
row in `PairwiseSum`'s order, per-row values run on one lane and are broadcast
over the row, per-row slot tables are read and written in place. Checked here
against the XLA ops (`GENERIC_XLA`) in every bit, over three donated jitted
steps with repeated and padding rows and NaN, inf and -0.0 entries, for the
architecture page's user rule (`benchmarks/_user_rule.py`), the package's
`RowwiseAdagradRule` and row-wise Adam with amsgrad with their fused kernels
switched off (`GENERIC_KERNELS`), and a rule of this file with a per-row slot
and no sum; rows of 1, 64 and 100
values and 2-D rows; op by op too (slow tier). `osa.row_sum` gives the same
bits jitted, eagerly, under `vmap` and its gradient is one; a rule that sums
with `jnp.mean`, or sums an unrounded product under jit, keeps the generic path,
still equal to the XLA ops, and the report says why.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks._user_rule import UserHyper, UserMeanRowwiseAdagrad, UserRowwiseAdagrad
from optax_sparse_adam._backends import choice
from optax_sparse_adam._backends.cpu import kernels
from optax_sparse_adam._core.row_rules import adam, rowwise_adagrad, rowwise_adam
from tests._helpers import BACKEND, train_step
from tests.backends.test_memory import DIM, NUM_ROWS, _grad, _table_copies
from tests.backends.test_row_store import _bits

pytestmark = pytest.mark.skipif(
  BACKEND != "cpu" or not kernels.available(), reason="the CPU kernels run on the CPU only"
)

ROWS = 40
PROGRAM, GATHER = "optax_sparse_adam_row_program", "optax_sparse_adam_coalesce_gather"


@dataclasses.dataclass(frozen=True)
class UserRowCount:
  """A user's rule with a per-row slot and no sum: each row's step divided by its count."""

  name: str = dataclasses.field(default="user_row_count", init=False)

  def slots(self):
    return (osa.Slot("count", per_row=True),)

  def update(self, block, hyper):
    g = block.grad
    count = block.slots["count"] + 1.0
    per_row = count.reshape((g.shape[0],) + (1,) * (g.ndim - 1))
    return g / per_row * -hyper.learning_rate, {"count": count}


@dataclasses.dataclass(frozen=True)
class UserUnroundedSum:
  """The user's row-wise Adagrad summing `g * g` as it stands (no `opaque_zero`)."""

  name: str = dataclasses.field(default="user_unrounded_sum", init=False)

  def slots(self):
    return (osa.Slot("sum", per_row=True),)

  def update(self, block, hyper):
    g = block.grad
    total = block.slots["sum"] + osa.row_sum(g * g) / g.shape[1]
    rate = hyper.learning_rate / (jnp.sqrt(total) + hyper.eps)
    return -rate[:, None] * g, {"sum": total}


RULES = {
  "user_rowwise_adagrad": lambda: osa.sparse_rule_transformation(
    UserRowwiseAdagrad(), UserHyper(0.1)
  ),
  "rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(0.1, eps=1e-6),
  "user_row_count": lambda: osa.sparse_rule_transformation(UserRowCount(), UserHyper(0.1)),
  # Row-wise Adam's per-row `nu` (and amsgrad's `nu_max`), its bias corrections hoisted.
  "rowwise_adam_amsgrad": lambda: osa.sparse_adam(1e-2, rowwise_second_moment=True, amsgrad=True),
}


def _batches(rng, dense_shape, *, specials=True):
  batches = []
  for k in range(3):
    ids = rng.integers(0, ROWS, 12).astype(np.int32)
    ids[:3] = ids[3]  # repeated rows
    ids[-1] = -1  # padding
    vals = rng.standard_normal((12, *dense_shape)).astype(np.float32)
    flat = vals.reshape(12, -1)
    flat[4, 0] = -0.0
    if (
      k == 1 and specials
    ):  # a NaN and an inf (and inf - inf summed in a repeated row), in later steps
      flat[5, -1] = np.nan
      flat[6, 0] = np.inf
      flat[0, 0], flat[1, 0] = np.inf, -np.inf
    batches.append((ids, vals))
  return batches


def _run(make, path, dense_shape, *, use_jit, name=""):
  rng = np.random.default_rng(11)
  opt = make()
  params = {"t": jnp.asarray(rng.standard_normal((ROWS, *dense_shape)), jnp.float32)}
  state = opt.init(params)
  step = jax.jit(train_step(opt), donate_argnums=(0, 1)) if use_jit else train_step(opt)
  hlo = None
  shape = (ROWS, *dense_shape)
  # Row-wise Adam multiplies two NaNs (its rate's and its first moment's) where a row has
  # one: which one's bits XLA gives depends on how it vectorizes the product (the XLA ops
  # on the gathered rows, the generic path, differ from the whole XLA step there too).
  specials = name != "rowwise_adam_amsgrad"
  with choice.choose(forced=path):
    for ids, vals in _batches(rng, dense_shape, specials=specials):
      grad = {"t": sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=shape)}
      if use_jit and hlo is None:
        hlo = step.lower(params, state, grad).as_text()
      params, state = step(params, state, grad)
  return (params, state), hlo


def _assert_same_bits(ours, reference):
  for leaf, xla_leaf in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
    np.testing.assert_array_equal(_bits(leaf), _bits(xla_leaf))


SHAPES = {"1": (1,), "64": (64,), "100": (100,), "2x3": (2, 3)}
# The default tier: each rule and each width once, jitted; the rest in the slow tier.
_DEFAULT = {
  ("user_rowwise_adagrad", "64"),
  ("user_rowwise_adagrad", "100"),
  ("rowwise_adagrad", "1"),
  ("rowwise_adagrad", "2x3"),
  ("user_row_count", "64"),
  ("rowwise_adam_amsgrad", "100"),
}
# The user's rule is written for rows of one axis (`rate[:, None]`).
CASES = [
  pytest.param(
    name, shape, use_jit, id=f"{name}-{shape}-{'jit' if use_jit else 'eager'}",
    marks=[] if use_jit and (name, shape) in _DEFAULT else [pytest.mark.slow],
  )
  for name in sorted(RULES)
  for shape in SHAPES
  for use_jit in (True, False)
  if not (name == "user_rowwise_adagrad" and shape == "2x3")
]  # fmt: skip


@pytest.mark.parametrize(("name", "shape", "use_jit"), CASES)
def test_row_sums_and_per_row_slots_equal_the_xla_ops_bit_for_bit(name, shape, use_jit):
  dense_shape = SHAPES[shape]
  ours, hlo = _run(RULES[name], choice.GENERIC_KERNELS, dense_shape, use_jit=use_jit, name=name)
  reference, _ = _run(RULES[name], choice.GENERIC_XLA, dense_shape, use_jit=use_jit, name=name)
  _assert_same_bits(ours, reference)
  if use_jit:
    # A row of one value: its per-row values are row values, whose negation under jit XLA
    # may fold into the product (a NaN's sign): the two row-wise Adagrads keep the
    # generic path there.
    on_program = not (dense_shape == (1,) and name in ("user_rowwise_adagrad", "rowwise_adagrad"))

    assert (PROGRAM in hlo) == on_program, name
    assert (GATHER in hlo) != on_program, name


def test_the_rules_with_row_sums_and_per_row_slots_say_they_run_the_row_program():
  for rule, hyper in (
    (UserRowwiseAdagrad(), UserHyper(0.1)),
    (rowwise_adagrad.RowwiseAdagradRule(), osa.RowwiseAdagradHyperparams(0.1)),
    (UserRowCount(), UserHyper(0.1)),
    (
      rowwise_adam.RowwiseAdamRule(amsgrad=True),
      adam.AdamHyperparams(0.1, 0.1, 1e-3, float(np.log(0.9)), float(np.log(0.999)), 1e-8),
    ),
  ):
    report = osa.row_program_report(rule, hyper, dense_shape=(64,))
    assert "runs the row program" in report, report


@pytest.mark.parametrize(
  ("rule", "reason"),
  [
    pytest.param(UserMeanRowwiseAdagrad(), "'reduce_sum'", id="jnp.mean"),
    pytest.param(UserUnroundedSum(), "an unrounded product feeds osa.row_sum", id="unrounded"),
  ],
)
def test_a_rule_summing_as_the_row_program_cannot_keeps_the_generic_path_and_says_why(rule, reason):
  """`jnp.mean` sums in XLA's own order; `g * g` summed unrounded may be contracted by XLA
  into the sum's first adds under jit (where depends on its fusions)."""
  report = osa.row_program_report(rule, UserHyper(0.1), dense_shape=(DIM,))
  assert "runs the generic path" in report and reason in report, report
  assert "osa.row_sum" in report, report  # what to do about it
  make = lambda: osa.sparse_rule_transformation(rule, UserHyper(0.1))  # noqa: E731
  ours, hlo = _run(make, choice.GENERIC_KERNELS, (6,), use_jit=True)
  _assert_same_bits(ours, _run(make, choice.GENERIC_XLA, (6,), use_jit=True)[0])
  assert PROGRAM not in hlo and GATHER in hlo


def test_the_compiled_step_with_a_per_row_slot_runs_the_row_program_and_copies_no_table():
  opt = RULES["user_rowwise_adagrad"]()
  params = {"t": jnp.zeros((NUM_ROWS, DIM))}
  grads = {"t": _grad((NUM_ROWS, DIM), 1, np.random.default_rng(0))}
  jitted = jax.jit(train_step(opt), donate_argnums=(0, 1))
  hlo = jitted.lower(params, opt.init(params), grads).compile().as_text()
  assert _table_copies(hlo) == []
  assert PROGRAM in hlo  # the default path: no switch needed
  assert " gather(" not in hlo and " scatter(" not in hlo


def _pairwise(x):
  """`osa.row_sum`'s order written out in NumPy, in float32."""
  x = np.asarray(x, np.float32).reshape(len(x), -1)
  while x.shape[1] > 1:
    half = x.shape[1] // 2
    summed = x[:, :half] + x[:, half : 2 * half]
    x = np.concatenate([summed, x[:, 2 * half :]], axis=1)
  return x[:, 0]


@pytest.mark.parametrize(
  "shape",
  [
    pytest.param((5, 1), marks=pytest.mark.slow),
    (5, 7),
    pytest.param((3, 100), marks=pytest.mark.slow),
    pytest.param((4, 2, 3), marks=pytest.mark.slow),
  ],
)
def test_row_sum_is_the_pairwise_sum_jitted_eagerly_and_under_vmap(shape):
  rng = np.random.default_rng(2)
  scale = np.resize([1.0, 1e4, 1e-4, 3.0], shape)  # sums whose rounding depends on the order
  x = jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
  expected = _pairwise(np.asarray(x)).view(np.uint32)
  zero = jnp.zeros((), jnp.int32)
  for got in (
    osa.row_sum(x),
    jax.jit(osa.row_sum)(x),
    jax.jit(lambda x, z: osa.row_sum(x, opaque_zero=z))(x, zero),
    jax.vmap(osa.row_sum)(x[None])[0],
    jax.jit(jax.vmap(osa.row_sum, in_axes=1, out_axes=1))(x[:, None])[:, 0],
  ):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), expected)
  grad = jax.grad(lambda x: osa.row_sum(x, opaque_zero=zero).sum())(x)
  np.testing.assert_array_equal(grad, np.ones(shape, np.float32))
  with pytest.raises(ValueError, match="row_sum needs rows"):
    osa.row_sum(jnp.float32(1.0))


@dataclasses.dataclass(frozen=True)
class UserPeak:
  """A user's rule of `jnp.maximum` and `jnp.minimum` (XLA:CPU's: -0 below +0, NaNs)."""

  name: str = dataclasses.field(default="user_peak", init=False)

  def slots(self):
    return (osa.Slot("peak", init=-0.0), osa.Slot("low", init=-0.0))

  def update(self, block, hyper):
    g, peak, low = block.grad, block.slots["peak"], block.slots["low"]
    return g * 0.5, {"peak": jnp.maximum(peak, g), "low": jnp.minimum(g, low)}


@pytest.mark.parametrize(
  "use_jit", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["jit", "eager"]
)
def test_maximum_and_minimum_keep_the_xla_ops_bits_for_signed_zeros_and_nans(use_jit):
  # (-0.0 on the slots' side too: their initial value.)
  specials = np.array([0.0, -0.0, 2.0, np.nan, -np.nan, np.inf, -np.inf, 1.0, -1.0], np.float32)
  width = len(specials) ** 2  # every pair of a gradient's value and a slot's
  g_values = np.repeat(specials, len(specials))
  runs = {}
  for path in (choice.GENERIC_KERNELS, choice.GENERIC_XLA):
    opt = osa.sparse_rule_transformation(UserPeak(), UserHyper(0.1))
    params = {"t": jnp.zeros((4, width), jnp.float32)}
    state = opt.init(params)
    step = jax.jit(train_step(opt)) if use_jit else train_step(opt)
    with choice.choose(forced=path):
      for k in range(2):
        # First the slots (-0.0) meet every special value, then every pair of two.
        vals = np.tile(specials, len(specials)) if k == 0 else g_values
        grad = sparse.BCOO(
          (jnp.asarray(vals[None]), jnp.asarray([[1]], jnp.int32)), shape=(4, width)
        )
        if use_jit and path == choice.GENERIC_KERNELS:
          assert PROGRAM in step.lower(params, state, {"t": grad}).as_text()
        params, state = step(params, state, {"t": grad})
    runs[path] = state  # (the parameter's NaN + NaN is the apply's, not the row program's)
  _assert_same_bits(runs[choice.GENERIC_KERNELS], runs[choice.GENERIC_XLA])


@dataclasses.dataclass(frozen=True)
class UserFlip:
  """A user's rule multiplying by -1, which LLVM may turn into a negation under jit."""

  name: str = dataclasses.field(default="user_flip", init=False)

  def slots(self):
    return ()

  def update(self, block, hyper):
    return block.grad * -1.0, {}


def test_a_product_by_minus_one_is_refused_under_jit_and_a_product_op_by_op():
  """Op by op XLA multiplies (a NaN keeps its sign), as the row program does; under jit
  LLVM may turn it into a negation folded into what uses it: refused, as a negation."""
  report = osa.row_program_report(UserFlip(), UserHyper(0.1), dense_shape=(8,))
  assert "runs the generic path: a negation" in report, report
  opt = osa.sparse_rule_transformation(UserFlip(), UserHyper(0.1))
  vals = np.array([[np.nan, -np.nan, 1.0, -1.0, np.inf, 0.0, 2.0, 3.0]], np.float32)
  grad = {"t": sparse.BCOO((jnp.asarray(vals), jnp.asarray([[2]], jnp.int32)), shape=(4, 8))}
  runs = {}
  for path in (choice.GENERIC_KERNELS, choice.GENERIC_XLA):
    params = {"t": jnp.zeros((4, 8), jnp.float32)}
    with choice.choose(forced=path):
      runs[path] = opt.update(grad, opt.init(params), params)[0]
  _assert_same_bits(runs[choice.GENERIC_KERNELS], runs[choice.GENERIC_XLA])
