"""The torch adapter on its own: torch's SparseAdam scenarios, Optimizer bookkeeping, errors."""

import copy
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

from optax_sparse_adam.torch_compat import Parameter, SparseAdam, _step, load_torch_checkpoint
from tests._helpers import NumpySparseAdam

SHAPE = (6, 2)


def _grad(rows, values=None, shape=SHAPE):
  rows = np.asarray(rows)
  if values is None:
    values = np.arange(1, len(rows) * 2 + 1, dtype=np.float32).reshape(len(rows), 2) / 7
  return sparse.BCOO((jnp.asarray(values), jnp.asarray(rows[:, None])), shape=shape)


def _param(seed=0):
  return Parameter(jnp.asarray(np.random.default_rng(seed).normal(size=SHAPE), jnp.float32))


def _snapshot(opt, params):
  """Everything observable: state dict (copied to numpy) and param values."""
  sd = opt.state_dict()
  state = {
    k: {kk: np.array(vv) if hasattr(vv, "shape") else vv for kk, vv in v.items()}
    for k, v in sd["state"].items()
  }
  groups = copy.deepcopy(sd["param_groups"])
  return state, groups, [np.array(p.data) for p in params]


def _assert_unchanged(before, after):
  state_a, groups_a, params_a = before
  state_b, groups_b, params_b = after
  assert groups_a == groups_b
  assert state_a.keys() == state_b.keys()
  for k in state_a:
    assert state_a[k].keys() == state_b[k].keys()
    for kk in state_a[k]:
      np.testing.assert_array_equal(state_a[k][kk], state_b[k][kk])
  for a, b in zip(params_a, params_b, strict=True):
    np.testing.assert_array_equal(a, b)


# torch's SparseAdam scenarios, written afresh.


def _rosenbrock_grad(x):
  a, b = x
  return np.array([-2 * (1 - a) - 400 * a * (b - a * a), 200 * (b - a * a)])


@pytest.mark.parametrize("maximize", [False, True])
def test_rosenbrock_float64_uncoalesced_grads(maximize):
  """Each step's gradient comes as 4 uncoalesced entries: every index twice, split unevenly."""
  with jax.enable_x64(True):
    p = Parameter(jnp.array([1.5, 1.5], jnp.float64))
    opt = SparseAdam([p], lr=0.05, maximize=maximize)
    ref = NumpySparseAdam(np.array([1.5, 1.5]), lr=0.05, maximize=maximize)
    optimum = np.ones(2)
    start = np.linalg.norm(np.asarray(p.data) - optimum)
    for _ in range(400):
      g = _rosenbrock_grad(np.asarray(p.data))
      values = np.array([0.25 * g[1], 0.75 * g[0], 0.75 * g[1], 0.25 * g[0]])
      # The ascent direction is followed with maximize, so feed the loss's grad either way.
      p.grad = sparse.BCOO((jnp.asarray(values), jnp.array([[1], [0], [1], [0]])), shape=(2,))
      opt.step()
      ref.step(np.array([[1], [0], [1], [0]]), values)
      assert p.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(p.data), ref.param, rtol=1e-12)
    end = np.linalg.norm(np.asarray(p.data) - optimum)
    assert opt.state[p]["step"] == 400
    if maximize:
      assert end > 10 * start
    else:
      assert end < 0.85 * start


def test_tiny_lr_group_leaves_its_param_unchanged():
  learning, frozen = _param(0), _param(1)
  before = np.array(frozen.data)
  opt = SparseAdam([{"params": [learning]}, {"params": [frozen], "lr": 1e-28}], lr=0.1)
  for _ in range(3):
    learning.grad, frozen.grad = _grad([1, 4, 1]), _grad([1, 4, 1])
    opt.step()
  np.testing.assert_array_equal(np.asarray(frozen.data), before)
  assert not np.array_equal(np.asarray(learning.data), np.asarray(_param(0).data))
  assert opt.state[frozen]["step"] == 3


def test_empty_grad_advances_step_and_changes_nothing_else():
  p = _param()
  opt = SparseAdam([p], lr=0.1)
  p.grad = _grad([2, 3, 2])
  opt.step()
  before = _snapshot(opt, [p])
  p.grad = sparse.BCOO((jnp.zeros((0, 2)), jnp.zeros((0, 1), jnp.int32)), shape=SHAPE)
  opt.step()
  state, groups, params = _snapshot(opt, [p])
  assert state[0]["step"] == 2
  state[0]["step"] = 1
  _assert_unchanged(before, (state, groups, params))


def test_missing_grad_is_skipped_and_its_step_does_not_advance():
  p, q = _param(0), _param(1)
  opt = SparseAdam([p, q], lr=0.1)
  q_before = np.array(q.data)
  p.grad = _grad([0, 5, 0])
  opt.step()
  assert q not in opt.state  # torch creates state only for params with a grad
  np.testing.assert_array_equal(np.asarray(q.data), q_before)
  q.grad = _grad([0, 5, 0])
  p.grad = None
  opt.step()
  assert opt.state[p]["step"] == 1
  assert opt.state[q]["step"] == 1


def test_one_element_array_lr_equals_float_lr():
  results = []
  for lr in (0.01, np.array([0.01]), jnp.array([0.01]), np.array(0.01, np.float32)):
    p = _param()
    opt = SparseAdam([p], lr=lr)
    for _ in range(3):
      p.grad = _grad([1, 3, 1])
      opt.step()
    results.append(np.asarray(p.data))
  # A float64 array lr computes the step size in float64: exactly the float lr.
  np.testing.assert_array_equal(results[1], results[0])
  # A float32 array lr computes it in float32, as torch does with a float32 tensor lr.
  for r in results[2:]:
    np.testing.assert_allclose(r, results[0], rtol=1e-6)


def test_matches_numpy_reference_over_many_steps_with_duplicates():
  rng = np.random.default_rng(3)
  p = _param(3)
  ref = NumpySparseAdam(np.asarray(p.data), lr=0.02, betas=(0.8, 0.99), dtype=np.float32)
  opt = SparseAdam([p], lr=0.02, betas=(0.8, 0.99))
  for _ in range(10):
    rows = rng.integers(0, SHAPE[0], size=3)
    values = rng.normal(size=(3, 2)).astype(np.float32)
    p.grad = _grad(rows, values)
    opt.step()
    ref.step(rows[:, None], values)
  np.testing.assert_array_equal(np.asarray(p.data), ref.param)
  np.testing.assert_array_equal(np.asarray(opt.state[p]["exp_avg_sq"]), ref.exp_avg_sq)


# One compiled call per step, no recompilation on edits.


def test_one_compiled_call_per_step_and_edits_do_not_recompile(monkeypatch):
  params = [_param(i) for i in range(3)]
  opt = SparseAdam(
    [{"params": params[:2]}, {"params": params[2:], "lr": 0.5, "maximize": True}], lr=0.1
  )
  calls = []
  real = _step.fused_step
  # Counted from an empty cache: another test may have compiled these shapes already.
  real.clear_cache()

  def counting(*args, **kwargs):
    calls.append(len(args[0]))
    return real(*args, **kwargs)

  monkeypatch.setattr(_step, "fused_step", counting)
  for p in params:
    p.grad = _grad([0, 2, 0])
  opt.step()
  compiles = real._cache_size()
  # lr, betas and eps are run-time inputs; maximize is compiled in, once per setting.
  for lr, betas, eps, maximize, new_compiles in [
    (0.3, (0.5, 0.9), 1e-3, (True, True), 1),
    (np.array([0.2]), (0.0, 0.0), 1.0, (False, False), 1),
    (0.05, (0.8, 0.99), 1e-6, (False, True), 0),
    (0.01, (0.9, 0.999), 1e-8, (True, True), 0),
  ]:
    for group, flag in zip(opt.param_groups, maximize, strict=True):
      group.update(lr=lr, betas=betas, eps=eps, maximize=flag)
    before = np.array(params[0].data)
    opt.step()
    assert not np.array_equal(np.asarray(params[0].data), before)
    compiles += new_compiles
    assert real._cache_size() == compiles
  assert calls == [3] * 5


def test_edited_hyperparameters_take_effect_next_step():
  p, q = _param(0), _param(0)
  opt_edit = SparseAdam([p], lr=0.1)
  opt_ref = SparseAdam([q], lr=0.1)
  p.grad = q.grad = _grad([1, 2, 1])
  opt_edit.step()
  opt_ref.step()
  opt_edit.param_groups[0].update(lr=0.05, betas=(0.5, 0.9), eps=1e-3, maximize=True)
  ref = NumpySparseAdam(np.asarray(q.data), lr=0.05, betas=(0.5, 0.9), eps=1e-3, maximize=True)
  ref.exp_avg = np.asarray(opt_ref.state[q]["exp_avg"], np.float64)
  ref.exp_avg_sq = np.asarray(opt_ref.state[q]["exp_avg_sq"], np.float64)
  ref.step_count = 1
  p.grad = _grad([3, 2, 3])
  opt_edit.step()
  ref.step(np.array([[3], [2], [3]]), np.asarray(_grad([3, 2, 3]).data))
  np.testing.assert_allclose(np.asarray(p.data), ref.param, rtol=1e-6)


# Optimizer bookkeeping.


def test_param_groups_fill_defaults_and_named_params_give_param_names():
  a, b = _param(0), _param(1)
  opt = SparseAdam([("emb", a), ("out", b)], lr=0.2, betas=(0.5, 0.6))
  (group,) = opt.param_groups
  assert group["params"] == [a, b]
  assert group["param_names"] == ["emb", "out"]
  assert group["lr"] == 0.2 and group["betas"] == (0.5, 0.6)
  assert group["eps"] == 1e-8 and group["maximize"] is False
  sd = opt.state_dict()
  assert sd["param_groups"][0]["param_names"] == ["emb", "out"]
  assert sd["param_groups"][0]["params"] == [0, 1]

  opt2 = SparseAdam([{"params": [a]}, {"params": b, "lr": 0.5}], lr=0.1)
  assert [g["lr"] for g in opt2.param_groups] == [0.1, 0.5]
  assert opt2.param_groups[1]["params"] == [b]
  c = _param(2)
  group = {"params": (c,), "eps": 1e-3}
  opt2.add_param_group(group)
  assert opt2.param_groups[-1] is group  # torch keeps and completes the caller's dict
  assert group == {"params": [c], "eps": 1e-3, "lr": 0.1, "betas": (0.9, 0.999), "maximize": False}


def test_params_sharing_one_array_step_independently():
  shared = jnp.zeros(SHAPE)
  p, q = Parameter(shared), Parameter(shared)
  opt = SparseAdam([p, q], lr=0.1)
  p.grad, q.grad = _grad([1, 1, 1]), _grad([2, 2, 2])
  opt.step()
  assert float(p.data[1, 0]) < 0 and float(p.data[2, 0]) == 0
  assert float(q.data[2, 0]) < 0 and float(q.data[1, 0]) == 0


def test_zero_grad():
  p, q = _param(0), _param(1)
  opt = SparseAdam([p, q])
  p.grad = _grad([1, 2, 1])
  opt.zero_grad(set_to_none=False)
  assert isinstance(p.grad, sparse.BCOO) and p.grad.nse == 0 and p.grad.shape == SHAPE
  assert q.grad is None
  opt.step()  # an emptied grad advances the step and changes nothing
  assert opt.state[p]["step"] == 1
  np.testing.assert_array_equal(np.asarray(opt.state[p]["exp_avg"]), np.zeros(SHAPE))
  opt.zero_grad()
  assert p.grad is None


def test_repr_lists_groups_like_torch():
  opt = SparseAdam([{"params": [_param()]}, {"params": [_param(1)], "lr": 0.5}], lr=0.1)
  assert repr(opt) == (
    "SparseAdam (\n"
    "Parameter Group 0\n    betas: (0.9, 0.999)\n    eps: 1e-08\n    lr: 0.1\n    maximize: False\n"
    "\nParameter Group 1\n    betas: (0.9, 0.999)\n    eps: 1e-08\n    lr: 0.5\n"
    "    maximize: False\n"
    ")"
  )
  assert "Parameter containing" in repr(_param())


def test_step_closure_runs_first_and_may_set_grads():
  p = _param()
  opt = SparseAdam([p], lr=0.1)

  def closure():
    p.grad = _grad([0, 1, 0])
    return 42.0

  assert opt.step(closure) == 42.0
  assert opt.state[p]["step"] == 1
  assert opt.step() is None


# Hooks.


def test_step_hooks_order_arguments_and_removal():
  p = _param()
  opt = SparseAdam([p], lr=0.1)
  log = []
  h1 = opt.register_step_pre_hook(lambda o, args, kwargs: log.append(("pre1", args, kwargs)))
  opt.register_step_pre_hook(lambda o, args, kwargs: log.append(("pre2", len(args))))
  opt.register_step_post_hook(lambda o, args, kwargs: log.append(("post", o is opt)))
  opt.step()
  assert log == [("pre1", (opt,), {}), ("pre2", 1), ("post", True)]
  h1.remove()
  h1.remove()  # idempotent
  log.clear()
  opt.step()
  assert [entry[0] for entry in log] == ["pre2", "post"]

  def set_grad_closure():
    p.grad = _grad([0, 3, 0])
    return "loss"

  # A pre-hook may replace the arguments (which, as in torch, include the optimizer).
  with opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": set_grad_closure})):
    assert opt.step() == "loss"
  assert opt.state[p]["step"] == 1
  with opt.register_step_pre_hook(lambda o, args, kwargs: "nonsense"):
    with pytest.raises(RuntimeError, match="must return None or a tuple of"):
      opt.step()
  assert opt.step() is None  # the context managers removed both hooks


def test_state_dict_hooks_order_prepend_and_replacement():
  opt = SparseAdam([_param()], lr=0.1)
  log = []
  opt.register_state_dict_pre_hook(lambda o: log.append("pre_a"))
  opt.register_state_dict_pre_hook(lambda o: log.append("pre_b"), prepend=True)
  opt.register_state_dict_post_hook(lambda o, sd: log.append("post_a"))
  handle = opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1}, prepend=True)
  sd = opt.state_dict()
  assert log == ["pre_b", "pre_a", "post_a"]
  assert sd["extra"] == 1
  handle.remove()
  assert "extra" not in opt.state_dict()


def test_load_state_dict_hooks_order_prepend_and_replacement():
  p = _param()
  opt = SparseAdam([p], lr=0.1)
  sd = opt.state_dict()
  log = []

  def replace(o, state_dict):
    log.append("pre_replace")
    new = copy.deepcopy(state_dict)
    new["param_groups"][0]["lr"] = 0.7
    return new

  opt.register_load_state_dict_pre_hook(replace)
  opt.register_load_state_dict_pre_hook(lambda o, s: log.append("pre_first"), prepend=True)
  opt.register_load_state_dict_post_hook(lambda o: log.append(("post", o.param_groups[0]["lr"])))
  with opt.register_load_state_dict_post_hook(lambda o: log.append("post_first"), prepend=True):
    opt.load_state_dict(sd)
  assert log == ["pre_first", "pre_replace", "post_first", ("post", 0.7)]
  assert sd["param_groups"][0]["lr"] == 0.1  # the caller's dict is untouched
  log.clear()
  opt.load_state_dict(sd)
  assert log == ["pre_first", "pre_replace", ("post", 0.7)]


# State dicts.


def _train(opt, params, rows_list):
  for rows in rows_list:
    for p in params:
      p.grad = _grad(rows)
    opt.step()


@pytest.mark.parametrize("convert", ["jax", "numpy"])
def test_state_dict_round_trip_continues_identically(convert):
  ref_params = [_param(0), _param(1)]
  ref = SparseAdam([{"params": [ref_params[0]]}, {"params": [ref_params[1]], "lr": 0.3}], lr=0.1)
  _train(ref, ref_params, [[0, 1, 0], [2, 3, 2]])
  sd = ref.state_dict()
  if convert == "numpy":
    sd = {
      "state": {
        k: {kk: np.array(vv) if kk != "step" else np.int64(vv) for kk, vv in v.items()}
        for k, v in sd["state"].items()
      },
      "param_groups": sd["param_groups"],
    }
  params = [Parameter(jnp.array(p.data)) for p in ref_params]
  opt = SparseAdam([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.9)
  opt.load_state_dict(sd)
  assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3]
  assert all(isinstance(opt.state[p]["step"], int) for p in params)
  _train(ref, ref_params, [[4, 5, 4], [1, 1, 1]])
  _train(opt, params, [[4, 5, 4], [1, 1, 1]])
  for p, q in zip(params, ref_params, strict=True):
    np.testing.assert_array_equal(np.asarray(p.data), np.asarray(q.data))
    np.testing.assert_array_equal(
      np.asarray(opt.state[p]["exp_avg"]), np.asarray(ref.state[q]["exp_avg"])
    )
    assert opt.state[p]["step"] == ref.state[q]["step"] == 4


def test_state_dict_is_live_like_torch_and_loading_copies_arrays():
  p = _param()
  opt = SparseAdam([p], lr=0.1)
  _train(opt, [p], [[0, 1, 0]])
  sd = opt.state_dict()
  q = _param()
  other = SparseAdam([q], lr=0.1)
  other.load_state_dict(sd)
  loaded = other.state[q]["exp_avg"]
  assert loaded is not sd["state"][0]["exp_avg"]
  _train(opt, [p], [[0, 1, 0]])
  assert sd["state"][0]["step"] == 2  # torch's state dict shows later steps too
  np.testing.assert_array_equal(
    np.asarray(sd["state"][0]["exp_avg"]), np.asarray(opt.state[p]["exp_avg"])
  )
  assert not loaded.is_deleted()  # the donating step of `opt` did not touch the copy


def test_state_dict_pickles():
  p = _param()
  opt = SparseAdam([("w", p)], lr=0.1)
  _train(opt, [p], [[0, 1, 0]])
  sd = pickle.loads(pickle.dumps(opt.state_dict()))
  q = _param()
  other = SparseAdam([("w", q)])
  other.load_state_dict(sd)
  assert other.param_groups[0]["param_names"] == ["w"]
  assert other.state[q]["step"] == 1


# Errors.


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"lr": -0.1}, ValueError, "Invalid learning rate: -0.1"),
    ({"lr": 0.0}, ValueError, "Invalid learning rate: 0.0"),
    ({"lr": np.array([0.1, 0.2])}, ValueError, "Tensor lr must be 1-element"),
    ({"eps": 0.0}, ValueError, "Invalid epsilon value: 0.0"),
    ({"betas": (1.0, 0.9)}, ValueError, "Invalid beta parameter at index 0: 1.0"),
    ({"betas": (0.9, -0.1)}, ValueError, "Invalid beta parameter at index 1: -0.1"),
  ],
)
def test_constructor_checks_in_torch_wording(kwargs, error, match):
  with pytest.raises(error, match=match):
    SparseAdam([_param()], **kwargs)


def test_constructor_rejects_bad_params():
  with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
    SparseAdam([])
  with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
    SparseAdam(_param())
  with pytest.raises(TypeError, match="can only optimize Tensors, but one of the params is"):
    SparseAdam([jnp.zeros(3)])
  with pytest.raises(ValueError, match=r"Complex params at indices \[\[0, 1\]\]"):
    SparseAdam([_param(), Parameter(jnp.zeros(3, jnp.complex64))])
  with pytest.raises(TypeError, match="floating point"):
    Parameter(jnp.zeros(3, jnp.int32))


def test_add_param_group_checks_and_failure_changes_nothing():
  a, b = _param(0), _param(1)
  opt = SparseAdam([a], lr=0.1)
  cases = [
    ({"params": [a]}, ValueError, "some parameters appear in more than one parameter group"),
    ({"params": {b}}, TypeError, "ordered collections"),
    ({"params": [("x", b)]}, ValueError, "cannot add param group with names"),
    ({"params": [b], "lr": jnp.array([0.1, 0.2])}, ValueError, "Tensor lr must be 1-element"),
    (
      {"params": [Parameter(jnp.zeros(2, jnp.complex64))]},
      ValueError,
      "Complex params at indices \\[\\[1, 0\\]\\]",
    ),
    ([b], TypeError, "param_group must be a dict"),
  ]
  for group, error, match in cases:
    with pytest.raises(error, match=match):
      opt.add_param_group(group)
    assert len(opt.param_groups) == 1
  with pytest.raises(ValueError, match="Some param names are missing"):
    SparseAdam([("x", a), b])
  named = SparseAdam([("x", a)])
  with pytest.raises(ValueError, match="cannot add param group without names"):
    named.add_param_group({"params": [b]})
  with pytest.warns(UserWarning, match="duplicate parameters"):
    opt.add_param_group({"params": [b, b]})
  opt.add_param_group({"params": [], "lr": 0.5})  # torch allows an empty group
  assert len(opt.param_groups) == 3


def test_dense_grad_raises_before_anything_changes():
  p, q = _param(0), _param(1)
  opt = SparseAdam([{"params": [p]}, {"params": [q]}], lr=0.1)
  _train(opt, [p, q], [[0, 1, 0]])
  before = _snapshot(opt, [p, q])
  p.grad = _grad([2, 3, 2])
  q.grad = jnp.ones(SHAPE)
  with pytest.raises(
    RuntimeError,
    match="SparseAdam does not support dense gradients, please consider Adam instead",
  ):
    opt.step()
  _assert_unchanged(before, _snapshot(opt, [p, q]))
  q.grad = _grad([0, 1], shape=(3, 2))
  with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*shape \(3, 2\)"):
    opt.step()
  _assert_unchanged(before, _snapshot(opt, [p, q]))


def _trained_pair():
  p, q = _param(0), _param(1)
  opt = SparseAdam([{"params": [p]}, {"params": [q], "lr": 0.2}], lr=0.1)
  _train(opt, [p, q], [[0, 1, 0]])
  return opt, [p, q]


def _corrupt(edit):
  opt, _ = _trained_pair()
  sd = opt.state_dict()
  sd = {
    "state": {k: dict(v) for k, v in sd["state"].items()},
    "param_groups": [dict(g) for g in sd["param_groups"]],
  }
  edit(sd)
  return sd


@pytest.mark.parametrize(
  "edit, match",
  [
    (lambda sd: sd["param_groups"].pop(), "different number of parameter groups"),
    (
      lambda sd: sd["param_groups"][1].update(params=[1, 2]),
      "doesn't match the size of optimizer's group",
    ),
    (
      lambda sd: sd["state"][0].pop("exp_avg"),
      r"missing \['exp_avg'\] in the state of parameter 0",
    ),
    (
      lambda sd: sd["state"][1].update(exp_avg_sq=np.zeros((5, 2))),
      r"'exp_avg_sq' of shape \(5, 2\) for parameter 1 .*shape \(6, 2\)",
    ),
    (lambda sd: sd["state"][0].update(step=1.5), "non-integer 'step' 1.5"),
    (lambda sd: sd["state"][0].update(step="3"), "non-integer 'step'"),
    (lambda sd: sd["state"][0].update(step=-1), "negative 'step'"),
    (lambda sd: sd["param_groups"][0].pop("betas"), "param group 0 has no 'betas'"),
    (lambda sd: sd["param_groups"][1].update(lr=np.ones(2)), "Tensor lr must be 1-element"),
    (lambda sd: sd.pop("state"), "has no 'state' entry"),
    (lambda sd: sd.pop("param_groups"), "has no 'param_groups' entry"),
  ],
)
def test_load_state_dict_rejects_bad_input_and_changes_nothing(edit, match):
  opt, params = _trained_pair()
  before = _snapshot(opt, params)
  bad = _corrupt(edit)
  with pytest.raises(ValueError, match=match):
    opt.load_state_dict(bad)
  _assert_unchanged(before, _snapshot(opt, params))
  with pytest.raises(TypeError, match="state_dict must be a dict"):
    opt.load_state_dict([1, 2])


def test_load_state_dict_accepts_integral_float_steps_and_casts_dtype():
  opt, params = _trained_pair()
  sd = _corrupt(lambda sd: sd["state"][0].update(step=np.float32(1.0), exp_avg=np.ones(SHAPE)))
  opt.load_state_dict(sd)
  state = opt.state[params[0]]
  assert state["step"] == 1 and type(state["step"]) is int
  assert state["exp_avg"].dtype == jnp.float32


def test_torch_is_never_imported_when_absent(tmp_path):
  script = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # any `import torch` now fails
    import numpy as np, jax.numpy as jnp
    from jax.experimental import sparse
    from optax_sparse_adam.torch_compat import Parameter, SparseAdam, load_torch_checkpoint
    p = Parameter(jnp.zeros((4, 2)))
    opt = SparseAdam([p], lr=np.array([0.1]))
    p.grad = sparse.BCOO((jnp.ones((1, 2)), jnp.array([[1]])), shape=(4, 2))
    opt.step()
    sd = opt.state_dict()
    sd["state"][0] = {k: np.array(v) for k, v in sd["state"][0].items()}
    opt.load_state_dict(sd)
    try:
      load_torch_checkpoint("x.pt")
    except ImportError as err:
      assert "needs torch" in str(err)
    print("ok", float(p.data[1, 0]))
    """
  )
  out = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120
  )
  assert out.returncode == 0, out.stderr
  word, value = out.stdout.split()
  assert word == "ok" and abs(float(value) + 0.1) < 1e-6


def test_load_torch_checkpoint_refuses_non_checkpoints(tmp_path):
  torch = pytest.importorskip("torch")
  junk = tmp_path / "junk.pt"
  junk.write_bytes(b"this is not a checkpoint")
  with pytest.raises(ValueError, match="is not a torch checkpoint"):
    load_torch_checkpoint(junk)
  with pytest.raises(FileNotFoundError, match="No checkpoint file"):
    load_torch_checkpoint(tmp_path / "missing.pt")
  unsafe = tmp_path / "unsafe.pt"
  torch.save({"state": {}, "param_groups": [], "obj": _Unsafe()}, unsafe)
  with pytest.raises(ValueError, match="never unpickles arbitrary objects"):
    load_torch_checkpoint(unsafe)
  tensor_only = tmp_path / "tensor.pt"
  torch.save(torch.zeros(3), tensor_only)
  with pytest.raises(ValueError, match="holds a Tensor, not a dict"):
    load_torch_checkpoint(tensor_only)


class _Unsafe:
  pass
