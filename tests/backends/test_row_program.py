"""The row program (`cpu/row_program.py`, `row_program.cc`): a rule's math per row, XLA's bits.

A rule without a fused kernel whose `update` is elementwise runs on the CPU as
one generic kernel interpreting the rule's traced math. Checked here against
the XLA ops (`GENERIC_XLA`) in every bit, jitted (and donated) and eagerly, over
three steps with repeated rows, padding and a -0.0: FTRL with and without its
options and a scheduled learning rate (its divisions by the learning rate, which
XLA turns into products by its inverse where it is known when the step is
compiled, and contracts into a sum under jit), SGD with momentum and Adagrad
(their step count's scalars, an int32 comparison and conversion, computed by
XLA before the kernel: hoisted), and a rule written in this file (max, min,
abs, a division). A rule with a primitive the program does not
know (`exp`; FTRL's `pow` for a power other than -0.5) or a product of its own
summed unrounded runs the generic kernels instead, says so
(`osa.row_program_report`), and still equals the XLA ops.
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from optax_sparse_adam._backends.cpu import kernels, row_program
from optax_sparse_adam._core.row_rules import adagrad, ftrl, sgd
from tests._helpers import BACKEND, train_step
from tests.backends.test_generic_kernels import ROWS, WIDTH, _batches
from tests.backends.test_memory import DIM, NUM_ROWS, _grad, _table_copies
from tests.backends.test_row_store import _bits

pytestmark = pytest.mark.skipif(
  BACKEND != "cpu" or not kernels.available(), reason="the CPU kernels run on the CPU only"
)


class ClipHyper(NamedTuple):
  learning_rate: Any
  decay: Any = 0.9
  weight_decay: Any = None


@dataclasses.dataclass(frozen=True)
class UserClippedMomentum:
  """A user's rule: momentum whose step is clipped to [-1, 1]; its product is summed as is."""

  name: str = dataclasses.field(default="user_clipped_momentum", init=False)

  def slots(self):
    return (osa.Slot("velocity"),)

  def update(self, block, hyper):
    v = hyper.decay * block.slots["velocity"] + block.grad  # XLA contracts this under jit
    step = jnp.minimum(jnp.maximum(v, -1.0), 1.0)
    return -hyper.learning_rate * step, {"velocity": v}


@dataclasses.dataclass(frozen=True)
class UserClippedSign:
  """A user's rule with no product summed: an accumulated |g|, the step clipped to [-1, 1]."""

  name: str = dataclasses.field(default="user_clipped_sign", init=False)

  def slots(self):
    return (osa.Slot("total", init=0.5),)

  def update(self, block, hyper):
    total = block.slots["total"] + jnp.abs(block.grad)
    step = jnp.minimum(jnp.maximum(block.grad / total, -1.0), 1.0)
    return -hyper.learning_rate * step, {"total": total}


@dataclasses.dataclass(frozen=True)
class UserExpRule:
  """A user's rule with a primitive the row program does not know (`exp`)."""

  name: str = dataclasses.field(default="user_exp", init=False)

  def slots(self):
    return (osa.Slot("scale", init=1.0),)

  def update(self, block, hyper):
    s = block.slots["scale"] * jnp.exp(jnp.abs(block.grad) * -0.5)
    return -hyper.learning_rate * s * block.grad, {"scale": s}


@dataclasses.dataclass(frozen=True)
class UserStepScaled:
  """A user's rule summing a product of uniform values (the step count, a hyper-parameter)
  into a row: XLA may contract that product into the sum, so it is not hoisted."""

  name: str = dataclasses.field(default="user_step_scaled", init=False)

  def slots(self):
    return ()

  def update(self, block, hyper):
    return jnp.abs(block.grad) - block.step.astype(jnp.float32) * hyper.learning_rate, {}


OPTS = {
  "ftrl": lambda: osa.sparse_ftrl(0.2),
  "ftrl_l1": lambda: osa.sparse_ftrl(0.2, l1_regularization_strength=0.05),
  "ftrl_all_options": lambda: osa.sparse_ftrl(
    0.2,
    initial_accumulator_value=0.3,
    l1_regularization_strength=0.05,
    l2_regularization_strength=0.01,
    l2_shrinkage_regularization_strength=0.02,
    beta=0.3,
  ),
  "ftrl_maximize": lambda: osa.sparse_ftrl(0.2, l1_regularization_strength=0.05, maximize=True),
  "ftrl_schedule": lambda: osa.sparse_ftrl(
    optax.linear_schedule(0.2, 0.1, 5), l2_regularization_strength=0.01
  ),
  "user_clipped_sign": lambda: osa.sparse_rule_transformation(UserClippedSign(), ClipHyper(0.1)),
  # The step count's scalars (SGD's first-step weight, Adagrad's decayed rate, Adam's bias
  # corrections) computed by XLA before the kernel (hoisted); Adagrad over six steps, so
  # that `(t - 1) * lr_decay` rounds.
  "sgd_nesterov_schedule": lambda: osa.sparse_sgd(
    optax.linear_schedule(0.2, 0.1, 5), momentum=0.9, nesterov=True, lazy_momentum=True
  ),
  "adagrad_schedule": lambda: osa.sparse_adagrad(
    optax.linear_schedule(0.2, 0.1, 5), lr_decay=0.013, eps=1e-3, initial_accumulator_value=0.1
  ),
  "adam_amsgrad_schedule": lambda: osa.sparse_adam(
    optax.linear_schedule(0.2, 0.1, 5), b1=0.8, amsgrad=True
  ),
}
FALLBACK = {
  "ftrl_power_0.7": (lambda: osa.sparse_ftrl(0.2, learning_rate_power=-0.7), "'pow'"),
  "user_exp": (
    lambda: osa.sparse_rule_transformation(UserExpRule(), ClipHyper(0.1)),
    "'exp'",
  ),
}


def _run(opt, path, *, use_jit, row_program=True, repeats=1):
  rng = np.random.default_rng(5)
  table0 = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
  params = {"t": jnp.asarray(table0)}
  state = opt.init(params)
  step = jax.jit(train_step(opt), donate_argnums=(0, 1)) if use_jit else train_step(opt)
  hlo = None
  with choice.choose(forced=path, row_program=row_program):
    for ids, vals in _batches(rng) * repeats:
      grad = {"t": sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=(ROWS, WIDTH))}
      if use_jit and hlo is None:
        hlo = step.lower(params, state, grad).as_text()
      params, state = step(params, state, grad)
  assert not np.array_equal(np.asarray(params["t"]), table0)
  return (params, state), hlo


def _assert_same_bits(ours, reference):
  for leaf, xla_leaf in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
    np.testing.assert_array_equal(_bits(leaf), _bits(xla_leaf))


# The default tier runs every rule jitted and FTRL with every option eagerly; the slow tier
# the other eager runs.
CASES = [
  pytest.param(
    name,
    use_jit,
    id=f"{name}-{'jit' if use_jit else 'eager'}",
    marks=[pytest.mark.slow]
    if not use_jit and name not in ("ftrl_all_options", "ftrl_schedule", "ftrl_maximize")
    else [],
  )
  for name in sorted(OPTS)
  for use_jit in (True, False)
]
# Maximize negates the gradient: under jit XLA folds that negation into the ops using it,
# which can flip a NaN's sign, so the step keeps the generic path there (op by op it runs
# the row program).
GENERIC_UNDER_JIT = ("ftrl_maximize",)


@pytest.mark.parametrize(("name", "use_jit"), CASES)
def test_the_row_program_equals_the_xla_ops_bit_for_bit(name, use_jit):
  repeats = 2 if name.startswith("adagrad") else 1
  ours, hlo = _run(OPTS[name](), choice.GENERIC_KERNELS, use_jit=use_jit, repeats=repeats)
  reference, _ = _run(OPTS[name](), choice.GENERIC_XLA, use_jit=use_jit, repeats=repeats)
  _assert_same_bits(ours, reference)
  if use_jit:
    on_program = name not in GENERIC_UNDER_JIT
    assert ("optax_sparse_adam_row_program" in hlo) == on_program
    assert ("optax_sparse_adam_coalesce_gather" in hlo) != on_program


@pytest.mark.parametrize("maximize", [False, True])
def test_nan_and_inf_entries_keep_the_xla_ops_bits_and_sign(maximize):
  """inf - inf, NaN entries and -0.0 summed in a row: the NaNs' signs are XLA's too. A
  negation (maximize) under jit is refused: XLA folds it into the ops that use it."""
  ids = np.array([3, 3, 5, 7, 7, 3], np.int32)
  vals = np.array(
    [[np.inf, np.nan, 1, -np.nan], [-np.inf, 1, np.nan, 2], [1, 2, 3, 4],
     [np.inf, -np.inf, 0.5, -0.0], [1, 1, -0.0, -0.0], [0.5, -np.nan, 1, 1]], np.float32
  )  # fmt: skip
  vals = np.resize(vals, (len(ids), WIDTH))  # the columns repeated to the table's width
  grad = {"t": sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=(ROWS, WIDTH))}
  params = {"t": jnp.asarray(np.random.default_rng(1).standard_normal((ROWS, WIDTH)), jnp.float32)}
  runs = {}
  schedule = optax.linear_schedule(0.2, 0.1, 5)  # a learning rate known only at the step
  makes = {
    "ftrl": lambda: osa.sparse_ftrl(0.2, maximize=maximize),
    "sgd": lambda: osa.sparse_sgd(0.1, maximize=maximize),
    "adagrad": lambda: osa.sparse_adagrad(schedule, lr_decay=0.1, maximize=maximize),
  }
  for opt_name, make in makes.items():
    opt = make()
    for path in (choice.GENERIC_KERNELS, choice.GENERIC_XLA):  # not the fused kernels
      step = jax.jit(train_step(opt))
      with choice.choose(forced=path):
        hlo = step.lower(params, opt.init(params), grad).as_text()
        new, _ = step(params, opt.init(params), grad)
      runs[opt_name, path] = (_bits(new["t"]), hlo)
    ours, hlo = runs[opt_name, choice.GENERIC_KERNELS]
    np.testing.assert_array_equal(ours, runs[opt_name, choice.GENERIC_XLA][0], err_msg=opt_name)
    assert ("optax_sparse_adam_row_program" in hlo) != maximize, opt_name
  rule, hyper = ftrl.FtrlRule(), ftrl.FtrlHyperparams(0.2)
  report = osa.row_program_report(rule, hyper, dense_shape=(WIDTH,), maximize=maximize)
  assert ("negation" in report) == maximize, report


def test_the_rules_that_run_the_row_program_say_so():
  report = osa.row_program_report(ftrl.FtrlRule(), ftrl.FtrlHyperparams(0.2), dense_shape=(6,))
  assert report.startswith("the 'ftrl' rule runs the row program (")
  clipped = osa.row_program_report(UserClippedSign(), ClipHyper(0.1), dense_shape=(2, 3))
  assert "runs the row program" in clipped
  # The step count's scalars are hoisted into XLA: SGD's momentum and Adagrad run it.
  for rule, hyper in (
    (sgd.SGDRule(momentum=True, nesterov=True), sgd.SGDHyperparams(0.1, 0.9, 0.2)),
    (adagrad.AdagradRule(), adagrad.AdagradHyperparams(0.1, lr_decay=0.01)),
  ):
    report = osa.row_program_report(rule, hyper, dense_shape=(WIDTH,))
    assert "runs the row program" in report, report
  scaled = osa.row_program_report(UserStepScaled(), ClipHyper(0.1), dense_shape=(WIDTH,))
  assert "runs the generic path: an unrounded product feeds sub" in scaled
  opt = osa.sparse_rule_transformation(UserStepScaled(), ClipHyper(0.1))
  ours, hlo = _run(opt, choice.GENERIC_KERNELS, use_jit=True)
  _assert_same_bits(ours, _run(opt, choice.GENERIC_XLA, use_jit=True)[0])
  assert "optax_sparse_adam_row_program" not in hlo


@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_an_unknown_primitive_keeps_the_generic_path_and_says_why(name):
  make, primitive = FALLBACK[name]
  opt = make()
  ours, hlo = _run(opt, choice.GENERIC_KERNELS, use_jit=True)
  reference, _ = _run(opt, choice.GENERIC_XLA, use_jit=True)
  _assert_same_bits(ours, reference)
  assert "optax_sparse_adam_row_program" not in hlo
  assert "optax_sparse_adam_coalesce_gather" in hlo
  rule, hyper = {
    "ftrl_power_0.7": (ftrl.FtrlRule(), ftrl.FtrlHyperparams(0.2, learning_rate_power=-0.7)),
    "user_exp": (UserExpRule(), ClipHyper(0.1)),
  }[name]
  report = osa.row_program_report(rule, hyper, dense_shape=(WIDTH,))
  assert "runs the generic path" in report and primitive in report


def test_the_gather_path_is_kept_for_ftrl_when_the_row_program_is_off():
  ours, hlo = _run(OPTS["ftrl_l1"](), choice.GENERIC_KERNELS, use_jit=True, row_program=False)
  reference, _ = _run(OPTS["ftrl_l1"](), choice.GENERIC_XLA, use_jit=True)
  _assert_same_bits(ours, reference)
  assert "optax_sparse_adam_coalesce_gather" in hlo and "row_program" not in hlo


def test_the_compiled_row_program_step_copies_no_table():
  opt = osa.sparse_ftrl(0.1, l1_regularization_strength=0.01)
  params = {"t": jnp.zeros((NUM_ROWS, DIM))}
  grads = {"t": _grad((NUM_ROWS, DIM), 1, np.random.default_rng(0))}
  jitted = jax.jit(train_step(opt), donate_argnums=(0, 1))
  hlo = jitted.lower(params, opt.init(params), grads).compile().as_text()
  assert _table_copies(hlo) == []
  assert "optax_sparse_adam_row_program" in hlo  # the default path, no switch needed
  assert " gather(" not in hlo and " scatter(" not in hlo


def test_a_product_summed_unrounded_keeps_the_generic_path_and_says_why():
  # Whether XLA contracts `decay * v + g` into an FMA depends on how it fuses the program
  # (the generic kernels' XLA math and the whole XLA step differ here in an ulp): the row
  # program, which must give one answer, leaves such a rule to the generic path.
  opt = osa.sparse_rule_transformation(UserClippedMomentum(), ClipHyper(0.1))
  _, hlo = _run(opt, choice.GENERIC_KERNELS, use_jit=True)
  assert "optax_sparse_adam_row_program" not in hlo
  report = osa.row_program_report(UserClippedMomentum(), ClipHyper(0.1), dense_shape=(WIDTH,))
  assert "runs the generic path: an unrounded product feeds add" in report


def test_op_by_op_under_vmap_is_not_taken_for_jit():
  """Eagerly under `vmap` (and `grad`) each primitive runs on its own, so XLA contracts no
  product: the row program of a vmapped eager step equals the vmapped XLA ops' bits."""
  opt = OPTS["ftrl_all_options"]()
  rng = np.random.default_rng(3)
  params = jnp.asarray(rng.standard_normal((2, ROWS, WIDTH)), jnp.float32)
  vals = jnp.asarray(rng.standard_normal((2, 12, WIDTH)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, ROWS // 3, (2, 12, 1)), jnp.int32)

  def two_steps(p, v, i):
    grad, state = sparse.BCOO((v, i), shape=(ROWS, WIDTH)), opt.init(p)
    for _ in range(2):
      updates, state = opt.update(grad, state, p)
      p = osa.apply_updates(p, updates)
    return p

  runs = {}
  for path in (choice.GENERIC_KERNELS, choice.GENERIC_XLA):
    with choice.choose(forced=path):
      runs[path] = _bits(jax.vmap(two_steps)(params, vals, ids))
  np.testing.assert_array_equal(runs[choice.GENERIC_KERNELS], runs[choice.GENERIC_XLA])
  assert row_program.traced_into_jit(jnp.ones(2)) is False
  assert jax.jit(lambda x: jnp.float32(row_program.traced_into_jit(x)))(1.0) == 1.0


@dataclasses.dataclass(frozen=True)
class UserLastGradients:
  """A user's rule whose new slots are input rows: the gradient's, and another slot's old row
  (the kernel copies them aside before it writes any output into the tables)."""

  name: str = dataclasses.field(default="user_last_gradients", init=False)

  def slots(self):
    return (osa.Slot("last", init=0.25), osa.Slot("before"))

  def update(self, block, hyper):
    last = block.slots["last"]
    return -hyper.learning_rate * last, {"last": block.grad, "before": last}


@pytest.mark.parametrize(
  ("make", "width"),
  [
    pytest.param(OPTS["ftrl_all_options"], 1, id="ftrl-width-1"),
    pytest.param(OPTS["ftrl_all_options"], 100, id="ftrl-width-100"),
    pytest.param(
      lambda: osa.sparse_rule_transformation(UserLastGradients(), ClipHyper(0.1)),
      100,
      id="slots-set-to-input-rows-width-100",
    ),
  ],
)
def test_rows_of_any_width_and_slots_set_to_input_rows_keep_the_xla_ops_bits(make, width):
  """The kernel runs a row in chunks of 64 columns: a row narrower than a chunk, and one of
  a full chunk and a remainder (100); a rule setting slots to the gradient's and another
  slot's old rows."""
  runs = {}
  for path in (choice.GENERIC_KERNELS, choice.GENERIC_XLA):
    rng = np.random.default_rng(7)
    opt = make()
    params = {"t": jnp.asarray(rng.standard_normal((ROWS, width)), jnp.float32)}
    state = opt.init(params)
    step = jax.jit(train_step(opt), donate_argnums=(0, 1))
    with choice.choose(forced=path):
      for _ in range(2):
        ids = rng.integers(0, ROWS, 12).astype(np.int32)
        ids[:3] = ids[3]  # repeated rows
        ids[-1] = -1  # padding
        vals = rng.standard_normal((12, width)).astype(np.float32)
        ids_2d = jnp.asarray(ids)[:, None]
        grad = {"t": sparse.BCOO((jnp.asarray(vals), ids_2d), shape=(ROWS, width))}
        if path == choice.GENERIC_KERNELS:
          assert "optax_sparse_adam_row_program" in step.lower(params, state, grad).as_text()
        params, state = step(params, state, grad)
    runs[path] = (params, state)
  _assert_same_bits(runs[choice.GENERIC_KERNELS], runs[choice.GENERIC_XLA])
