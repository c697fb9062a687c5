"""Rules beyond Adam: a rule written in this file alone, and the row-wise Adagrad against FBGEMM.

The custom rule (`RULE_SOURCE`, no edit to the package) runs through
`sparse_rule_transformation` in `optax.chain`, a jitted step with donation, a
checkpoint round trip, the XLA and the accelerator path (forced on the CPU), and
a row-sharded table on 4 forced CPU devices (a subprocess: the device count is
fixed when JAX starts). `sparse_rowwise_adagrad` is checked against FBGEMM's
published EXACT_ROWWISE_ADAGRAD formula in float64 NumPy, written here.
"""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from tests.core._forced_devices import run_checks

# A rule a newcomer writes: sign SGD that counts each row's touches (a per-row slot) and
# keeps the last step's sign (a full-width slot).
RULE_SOURCE = """
import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

import optax_sparse_adam as osa


class SignHyper(NamedTuple):
  learning_rate: Any
  weight_decay: Any = None


@dataclasses.dataclass(frozen=True)
class SignRule:
  name: str = dataclasses.field(default="test_sign_sgd", init=False)

  def slots(self):
    return (osa.Slot("last_sign"), osa.Slot("touches", per_row=True))

  def update(self, block, hyper):
    sign = jnp.sign(block.grad)
    delta = -jnp.asarray(hyper.learning_rate, block.compute_dtype) * sign
    new = {
      "last_sign": sign.astype(block.slots["last_sign"].dtype),
      "touches": block.slots["touches"] + 1,
    }
    return delta, new
"""
_namespace: dict = {}
exec(RULE_SOURCE, _namespace)  # noqa: S102  # the rule a user would write in their own file
SignRule, SignHyper = _namespace["SignRule"], _namespace["SignHyper"]

ROWS, DIM = 12, 4
RNG = np.random.default_rng(0)
TABLE0 = RNG.standard_normal((ROWS, DIM)).astype(np.float32)
BATCHES = [
  (RNG.integers(0, ROWS // 2, 6).astype(np.int32), RNG.standard_normal((6, DIM)).astype(np.float32))
  for _ in range(6)
]


def _bcoo(ids, vals, shape=(ROWS, DIM)):
  return sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=shape)


def _train(opt, batches, params=None, state=None, step=None):
  params = params or {"t": jnp.asarray(TABLE0)}
  state = state if state is not None else opt.init(params)
  step = step or _jitted_step(opt)
  for ids, vals in batches:
    params, state = step(params, state, ids, vals)
  return params, state


def _jitted_step(opt):
  def step(params, state, ids, vals):
    updates, state = opt.update({"t": _bcoo(ids, vals)}, state, params)
    return osa.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def _custom_opt():
  # An optax transformation over the gradients' values first (a no-op clip here).
  clip = osa.lift_to_bcoo(optax.clip(100.0))
  return optax.chain(clip, osa.sparse_rule_transformation(SignRule(), SignHyper(0.1)))


def _sign_reference(batches):
  table = TABLE0.astype(np.float64).copy()
  touches = np.zeros(ROWS)
  for ids, vals in batches:
    summed = np.zeros_like(table)
    np.add.at(summed, ids, vals)
    for row in np.unique(ids):
      table[row] -= 0.1 * np.sign(summed[row])
      touches[row] += 1
  return table, touches


@pytest.mark.parametrize("forced", [choice.GENERIC_XLA, choice.ACCELERATOR])
def test_a_rule_from_a_test_file_trains_jitted_donated_and_resumes_from_a_checkpoint(forced):
  opt = _custom_opt()
  step = _jitted_step(opt)  # one compiled step for the three runs
  with choice.choose(forced=forced):
    params, state = _train(opt, BATCHES, step=step)
    # A checkpoint mid-way: the state through host arrays and pickle, then onwards.
    half, half_state = _train(opt, BATCHES[:3], step=step)
    saved = pickle.dumps(jax.tree.map(np.asarray, (half, half_state)))
    half, restored = jax.tree.map(jnp.asarray, pickle.loads(saved))
    resumed, resumed_state = _train(opt, BATCHES[3:], half, restored, step=step)
  table, touches = _sign_reference(BATCHES)
  np.testing.assert_allclose(np.asarray(params["t"]), table, rtol=1e-6, atol=1e-6)
  rule_state = state[1]
  assert isinstance(rule_state, osa.SparseRuleState)
  np.testing.assert_array_equal(np.asarray(rule_state.slots["touches"]["t"]), touches)
  np.testing.assert_array_equal(np.asarray(rule_state.param_steps), [len(BATCHES)])
  untouched = np.asarray(params["t"])[ROWS // 2 :]
  np.testing.assert_array_equal(untouched, TABLE0[ROWS // 2 :])  # bit-identical
  np.testing.assert_array_equal(np.asarray(resumed["t"]), np.asarray(params["t"]))
  assert jax.tree.structure(resumed_state) == jax.tree.structure(state)


def test_the_rule_state_follows_the_params_for_map_params():
  opt = osa.sparse_rule_transformation(SignRule(), SignHyper(0.1))
  state = opt.init({"t": jnp.zeros((ROWS, DIM))})
  shapes = optax.tree.map_params(opt, lambda p: p.shape, state, transform_non_params=lambda _: None)
  assert shapes.slots["last_sign"]["t"] == (ROWS, DIM)
  assert shapes.slots["touches"]["t"] == (ROWS,)
  assert shapes.count is None


_SHARDED_SCRIPT = (
  "from tests.core._forced_devices import force_cpu_devices\n"
  "force_cpu_devices(4)\n"
  + RULE_SOURCE
  + r"""
import json
import jax, numpy as np
from jax.experimental import sparse
from jax.sharding import NamedSharding, PartitionSpec as P

rows, dim = 64, 4
rng = np.random.default_rng(1)
table0 = rng.standard_normal((rows, dim)).astype(np.float32)
batches = [
  (rng.integers(0, rows, 16).astype(np.int32), rng.standard_normal((16, dim)).astype(np.float32))
  for _ in range(2)
]
mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
opts = {
  "custom": osa.sparse_rule_transformation(SignRule(), SignHyper(0.1)),
  "rowwise_adagrad": osa.sparse_rowwise_adagrad(0.1, max_norm=1.5),
  # A rule that reads and sets rows: the routed apply stores them (L1's zeros exact).
  "ftrl": osa.sparse_ftrl(0.3, l1_regularization_strength=0.5),
}
out = {"devices": jax.device_count()}

def train(opt, sharded):
  table = jnp.asarray(table0)
  if sharded:
    table = jax.device_put(table, NamedSharding(mesh, P("x", None)))
  params = {"t": table}
  state = opt.init(params)
  def step(params, state, ids, vals):
    g = sparse.BCOO((vals, ids[:, None]), shape=(rows, dim))
    u, state = opt.update({"t": g}, state, params)
    return osa.apply_updates(params, u), state
  step = jax.jit(step, donate_argnums=(0, 1))
  for ids, vals in batches:
    params, state = step(params, state, jnp.asarray(ids), jnp.asarray(vals))
  return params, state

def diff(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))

for name, opt in opts.items():
  p1, s1 = train(opt, False)
  p4, s4 = train(opt, True)
  slot = sorted(s4.slots)[-1]
  out[name] = {
    "param_diff": diff(p1["t"], p4["t"]),
    "slot_diff": diff(s1.slots[slot]["t"], s4.slots[slot]["t"]),
    "table_spec": str(p4["t"].sharding.spec),
    "slot_spec": str(s4.slots[slot]["t"].sharding.spec),
    "zeros": [int(np.sum(np.asarray(p1["t"]) == 0)), int(np.sum(np.asarray(p4["t"]) == 0))],
    "bits_equal": bool(np.array_equal(np.asarray(p1["t"]), np.asarray(p4["t"]))),
  }
print(json.dumps(out))
"""
)


def test_rules_on_a_row_sharded_table_match_one_device(tmp_path):
  script = tmp_path / "rules_sharded.py"
  script.write_text(_SHARDED_SCRIPT)
  out = run_checks(str(script), timeout=300)
  assert out["devices"] == 4
  for name in ("custom", "rowwise_adagrad", "ftrl"):
    assert out[name]["param_diff"] <= 1e-6, (name, out[name])
    assert out[name]["slot_diff"] <= 1e-6, (name, out[name])
    assert out[name]["table_spec"].endswith("('x', None)"), (name, out[name])
    assert "('x'" in out[name]["slot_spec"], (name, out[name])
  # FTRL's rows are set on their owners as on one device: the same bits, zeros included.
  assert out["ftrl"]["bits_equal"], out["ftrl"]
  assert out["ftrl"]["zeros"][0] == out["ftrl"]["zeros"][1] > 0, out["ftrl"]


def _fbgemm_rowwise_adagrad(batches, lr, eps, wd, mode, max_norm):
  """FBGEMM's EXACT_ROWWISE_ADAGRAD (codegen `rowwise_adagrad`, its CPU update), float64."""
  w = TABLE0.astype(np.float64).copy()
  momentum1 = np.zeros(ROWS)
  for ids, vals in batches:
    grad = np.zeros_like(w)
    np.add.at(grad, ids, vals.astype(np.float64))
    for idx in np.unique(ids):
      g = grad[idx]
      g_decayed = g + wd * w[idx] if mode == "l2" else g
      momentum1[idx] += np.sum(g_decayed * g_decayed) / DIM
      multiplier = lr / (np.sqrt(momentum1[idx]) + eps)
      correction = {"l2": 1.0 - multiplier * wd, "decoupled": 1.0 - lr * wd}.get(mode, 1.0)
      w[idx] = correction * w[idx] - multiplier * g
      norm = np.sqrt(np.sum(w[idx] ** 2))
      if max_norm and norm > max_norm:
        w[idx] *= max_norm / norm
  return w, momentum1


@pytest.mark.parametrize(
  "mode,wd,max_norm,forced",
  [
    ("none", 0.0, None, None),
    ("l2", 0.3, None, None),
    ("decoupled", 0.3, 1.2, None),
    ("decoupled", 0.3, 1.2, choice.ACCELERATOR),  # the GPU/TPU step, forced on the CPU
  ],
)
def test_rowwise_adagrad_is_fbgemms_formula(mode, wd, max_norm, forced):
  batches = BATCHES * 5  # 30 steps, duplicates in every batch
  opt = osa.sparse_rowwise_adagrad(
    0.05, eps=1e-6, weight_decay=wd, weight_decay_mode=mode, max_norm=max_norm
  )
  with choice.choose(forced=forced):
    params, state = _train(opt, batches)
  w, momentum1 = _fbgemm_rowwise_adagrad(batches, 0.05, 1e-6, wd, mode, max_norm)
  np.testing.assert_allclose(np.asarray(params["t"]), w, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(np.asarray(state.slots["sum"]["t"]), momentum1, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(params["t"])[ROWS // 2 :], TABLE0[ROWS // 2 :])
  if max_norm:
    assert np.linalg.norm(np.asarray(params["t"])[: ROWS // 2], axis=1).max() <= max_norm * (
      1 + 1e-6
    )


def _bad_update(opt, grads, params):
  state = opt.init(params)
  before = jax.tree.map(np.asarray, state)
  with pytest.raises((TypeError, ValueError)) as info:
    opt.update(grads, state, params)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)
  return str(info.value)


@pytest.mark.parametrize(
  "make",
  [
    lambda: osa.sparse_sgd(0.1),
    lambda: osa.sparse_adagrad(0.1),
    lambda: osa.sparse_rowwise_adagrad(0.1),
  ],
)
def test_bad_gradients_fail_before_any_state_changes(make):
  opt = make()
  params = {"a": jnp.zeros((ROWS, DIM)), "b": jnp.zeros((ROWS, DIM))}
  good = _bcoo(np.array([1]), np.ones((1, DIM)))
  # sparse_sgd and sparse_adagrad take dense gradients (as torch), of the param's shape.
  message = _bad_update(opt, {"a": good, "b": jnp.ones((ROWS, DIM + 1))}, params)
  assert "['b']" in message and "dense" in message
  wrong_layout = _bcoo(np.array([1]), np.ones((1, DIM)), shape=(ROWS + 1, DIM))
  message = _bad_update(opt, {"a": good, "b": wrong_layout}, params)
  assert "['b']" in message


@pytest.mark.parametrize(
  "make,words",
  [
    (lambda: osa.sparse_sgd(-0.1), "Invalid learning rate: -0.1"),
    (lambda: osa.sparse_adagrad(-1.0), "Invalid learning rate: -1.0"),
    (lambda: osa.sparse_adagrad(0.1, lr_decay=-1.0), "Invalid lr_decay value: -1.0"),
    (lambda: osa.sparse_rowwise_adagrad(-0.1), "Invalid learning rate: -0.1"),
    (
      lambda: osa.sparse_rowwise_adagrad(weight_decay_mode="decay"),
      "unknown weight_decay_mode 'decay'",
    ),
    (lambda: osa.sparse_sgd(0.1, momentum=jnp.asarray(0.9)), "lazy_momentum=True"),
    (lambda: osa.sparse_sgd(0.1, nesterov=True), "Nesterov momentum requires a momentum"),
    (
      lambda: osa.sparse_adagrad(0.1, weight_decay=0.1, catch_up_idle_rows=True),
      "catch_up_idle_rows=True does not compose with weight decay",
    ),
    (lambda: osa.sparse_rowwise_adagrad(max_norm=-1.0), "max_norm must be a positive"),
    (
      lambda: osa.sparse_sgd(0.1, momentum=0.9, lazy_momentum=True, catch_up_idle_rows=True),
      "ask for two different momenta",
    ),
    (
      lambda: osa.sparse_rowwise_adagrad(
        weight_decay=0.1, weight_decay_mode="l2", catch_up_idle_rows=True
      ),
      "not available for the rule 'rowwise_adagrad', because under weight decay",
    ),
    (
      lambda: osa.sparse_rule_transformation(
        SignRule(), SignHyper(0.1), slot_dtypes={"nu": "bfloat16"}
      ),
      "'nu', which the 'test_sign_sgd' rule does not keep",
    ),
  ],
)
def test_bad_options_are_refused_with_their_name(make, words):
  with pytest.raises(ValueError) as info:
    make()
  assert words in str(info.value)


def test_lazy_momentum_sgd_against_a_numpy_reference_and_inject_hyperparams():
  opt = osa.sparse_sgd(0.1, momentum=0.9, dampening=0.1, lazy_momentum=True)
  params, state = _train(opt, BATCHES)
  w = TABLE0.astype(np.float64).copy()
  buf = np.zeros_like(w)
  for step, (ids, vals) in enumerate(BATCHES, 1):
    g = np.zeros_like(w)
    np.add.at(g, ids, vals)
    rows = np.unique(ids)
    # torch's buffer is the gradient itself at the first step (no dampening then).
    buf[rows] = 0.9 * buf[rows] + (1.0 if step == 1 else 0.9) * g[rows]
    w[rows] -= 0.1 * buf[rows]
  np.testing.assert_allclose(np.asarray(params["t"]), w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    np.asarray(state.slots["momentum_buffer"]["t"]), buf, rtol=1e-5, atol=1e-6
  )
  # Hyper-parameters injected as arrays (schedules too) run jitted.
  injected = optax.inject_hyperparams(osa.sparse_adagrad)(
    learning_rate=optax.linear_schedule(0.1, 0.01, 4)
  )
  params, state = _train(injected, BATCHES)
  assert np.isfinite(np.asarray(params["t"])).all()
  np.testing.assert_array_equal(np.asarray(state.inner_state.param_steps), [len(BATCHES)])


def test_rowwise_adam_max_norm_renormalises_the_touched_rows_after_each_step():
  max_norm = 1.1
  clipped = osa.sparse_adam(0.05, rowwise_second_moment=True, max_norm=max_norm)
  params, _ = _train(clipped, BATCHES)
  # Reference: the same Adam without max_norm, each touched row scaled back in NumPy after
  # each step (the moments do not read the parameter, so they are the same).
  plain = osa.sparse_adam(0.05, rowwise_second_moment=True)
  update = jax.jit(plain.update)
  state, table = plain.init({"t": jnp.asarray(TABLE0)}), TABLE0.astype(np.float64)
  for ids, vals in BATCHES:
    updates, state = update({"t": _bcoo(ids, vals)}, state)
    table = table + np.asarray(updates["t"].todense(), np.float64)
    rows = np.unique(ids)
    norms = np.linalg.norm(table[rows], axis=1, keepdims=True)
    table[rows] *= np.where(norms > max_norm, max_norm / norms, 1.0)
  np.testing.assert_allclose(np.asarray(params["t"]), table, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(params["t"])[ROWS // 2 :], TABLE0[ROWS // 2 :])
  with pytest.raises(ValueError, match="max_norm does not compose with catch_up_idle_rows"):
    osa.sparse_adam(max_norm=1.0, catch_up_idle_rows=True)


def test_a_rule_drives_the_flax_glue():
  nnx = pytest.importorskip("flax.nnx")
  model = osa.SparseEmbed(10, 4, rngs=nnx.Rngs(0))
  before = np.asarray(model.embedding[...]).copy()
  labels = osa.table_labels(model)
  tx = optax.multi_transform(
    {"sparse": osa.sparse_rowwise_adagrad(0.1), "dense": optax.adamw(0.1)}, labels
  )
  optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def train_step(model, optimizer, ids):
    loss, grads = osa.sparse_value_and_grad(lambda m: (m(ids) ** 2).sum())(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer, jnp.array([1, 2, 2]))) for _ in range(3)]
  after = np.asarray(model.embedding[...])
  assert losses[-1] < losses[0]
  np.testing.assert_array_equal(np.flatnonzero(np.any(after != before, axis=1)), [1, 2])
