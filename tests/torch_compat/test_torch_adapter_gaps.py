"""The adapter against real torch where recipes touch the optimizer's edges.

Global step hooks and their order, state that is not a parameter's kept through
`load_state_dict`, `copy.deepcopy`, and the exception types and wording of every
constructor and `add_param_group` error.
"""

import copy
import pickle

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

from optax_sparse_adam.torch_compat import Parameter, SparseAdam

torch = pytest.importorskip("torch")
from torch.optim.optimizer import (  # noqa: E402
  register_optimizer_step_post_hook,
  register_optimizer_step_pre_hook,
)

SHAPE = (4, 2)


def _pair():
  """A torch parameter and an adapter parameter with the same value."""
  init = np.arange(8, dtype=np.float32).reshape(SHAPE) / 8
  return torch.nn.Parameter(torch.from_numpy(init.copy())), Parameter(jnp.asarray(init))


def _grads(rows=(1, 3, 1)):
  values = np.ones((len(rows), SHAPE[1]), np.float32)
  torch_grad = torch.sparse_coo_tensor(
    torch.tensor([list(rows)]), torch.from_numpy(values), SHAPE, check_invariants=True
  )
  return torch_grad, sparse.BCOO((jnp.asarray(values), jnp.array(rows)[:, None]), shape=SHAPE)


# Step hooks.


def _recorded_step_order(opt, param, grad):
  calls = []
  handles = [
    register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
    opt.register_step_pre_hook(lambda o, a, k: calls.append("local pre")),
    opt.register_step_post_hook(lambda o, a, k: calls.append("local post")),
    register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post")),
    # Registered second, run second among the globals.
    register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre 2")),
    register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post 2")),
  ]
  try:
    param.grad = grad
    opt.step(lambda: calls.append("step"))
  finally:
    for handle in handles:
      handle.remove()
  return calls


def test_global_step_hooks_run_in_torchs_order():
  t_param, j_param = _pair()
  t_grad, j_grad = _grads()
  want = _recorded_step_order(torch.optim.SparseAdam([t_param]), t_param, t_grad)
  got = _recorded_step_order(SparseAdam([j_param]), j_param, j_grad)
  assert got == want
  assert want[0] == "global pre" and want[-1] == "global post 2"


def test_global_pre_hook_may_replace_the_arguments():
  _, param = _pair()
  opt = SparseAdam([param])
  closure_calls = []

  def replace_closure(optimizer, args, kwargs):
    assert optimizer is opt
    return (optimizer, lambda: closure_calls.append("replaced") or 1.5), {}

  handle = register_optimizer_step_pre_hook(replace_closure)
  try:
    param.grad = _grads()[1]
    assert opt.step() == 1.5
  finally:
    handle.remove()
  assert closure_calls == ["replaced"]


# State of keys that are not parameters.


def test_load_state_dict_keeps_non_parameter_state_as_torch():
  t_param, j_param = _pair()
  t_grad, j_grad = _grads()
  t_opt, j_opt = torch.optim.SparseAdam([t_param]), SparseAdam([j_param])
  for opt, param, grad in ((t_opt, t_param, t_grad), (j_opt, j_param, j_grad)):
    param.grad = grad
    opt.step()

    def add_extra(optimizer, state_dict):
      state_dict["state"]["ema_decay"] = {"value": 0.99}

    opt.register_state_dict_post_hook(add_extra)
  t_state, j_state = t_opt.state_dict(), j_opt.state_dict()
  t_opt.load_state_dict(t_state)
  j_opt.load_state_dict(j_state)
  assert t_opt.state["ema_decay"] == {"value": 0.99}
  assert j_opt.state["ema_decay"] == t_opt.state["ema_decay"]
  assert j_opt.state_dict()["state"]["ema_decay"] == t_opt.state_dict()["state"]["ema_decay"]
  # The parameters' state still loads and steps as before.
  j_param.grad = j_grad
  j_opt.step()
  assert j_opt.state[j_param]["step"] == 2


def test_load_state_dict_still_checks_every_parameter_state():
  _, param = _pair()
  opt = SparseAdam([param])
  param.grad = _grads()[1]
  opt.step()
  state = opt.state_dict()
  bad = {
    "state": {0: dict(state["state"][0], exp_avg=np.zeros((3, 2))), "extra": [1, 2]},
    "param_groups": [dict(g) for g in state["param_groups"]],
  }
  before = np.asarray(opt.state[param]["exp_avg"])
  with pytest.raises(ValueError, match=r"'exp_avg' of shape \(3, 2\) for parameter 0"):
    opt.load_state_dict(bad)
  assert "extra" not in opt.state
  np.testing.assert_array_equal(np.asarray(opt.state[param]["exp_avg"]), before)


# Deep copies.


def _deepcopy_report(opt, params, grads):
  for p, g in zip(params, grads, strict=True):
    p.grad = g
  opt.step()
  opt.register_step_pre_hook(lambda *a: None)
  opt.register_state_dict_post_hook(lambda *a: None)
  copied = copy.deepcopy(opt)
  new_params = copied.param_groups[0]["params"]
  return {
    "new params": all(n is not p for n, p in zip(new_params, params, strict=True)),
    "copy grads": [p.grad is None for p in new_params],
    "original grads kept": [p.grad is not None for p in params],
    "hooks": [
      len(copied._optimizer_step_pre_hooks),
      len(copied._optimizer_state_dict_post_hooks),
    ],
    "defaults": copied.defaults,
    "group keys": sorted(copied.param_groups[0]),
    "state keys": [set(copied.state[p]) for p in new_params],
    "steps": [copied.state[p]["step"] for p in new_params],
  }, copied


def test_deepcopy_as_torch():
  t_param, j_param = _pair()
  t_grad, j_grad = _grads()
  want, t_copy = _deepcopy_report(torch.optim.SparseAdam([t_param], lr=0.1), [t_param], [t_grad])
  j_opt = SparseAdam([j_param], lr=0.1)
  got, j_copy = _deepcopy_report(j_opt, [j_param], [j_grad])
  assert got == want
  # The copy is independent: stepping it leaves the original's parameter and state alone.
  before = np.asarray(j_param.data), np.asarray(j_opt.state[j_param]["exp_avg"])
  copied_param = j_copy.param_groups[0]["params"][0]
  copied_param.grad = j_grad
  j_copy.step()
  t_copied = t_copy.param_groups[0]["params"][0]
  t_copied.grad = t_grad
  t_copy.step()
  np.testing.assert_array_equal(np.asarray(j_param.data), before[0])
  np.testing.assert_array_equal(np.asarray(j_opt.state[j_param]["exp_avg"]), before[1])
  np.testing.assert_allclose(
    np.asarray(copied_param.data), t_copied.detach().numpy(), rtol=1e-6, atol=1e-7
  )


def test_pickle_round_trip_as_torch():
  t_param, j_param = _pair()
  t_grad, j_grad = _grads()
  t_opt, j_opt = torch.optim.SparseAdam([t_param], lr=0.1), SparseAdam([j_param], lr=0.1)
  reports = []
  for opt, param, grad in ((t_opt, t_param, t_grad), (j_opt, j_param, j_grad)):
    param.grad = grad
    opt.step()
    opt.register_step_pre_hook(lambda *a: None)
    loaded = pickle.loads(pickle.dumps(opt))
    new_param = loaded.param_groups[0]["params"][0]
    reports.append(
      (
        new_param.grad is None,
        len(loaded._optimizer_step_pre_hooks),
        loaded.defaults,
        loaded.state[new_param]["step"],
      )
    )
    new_param.grad = grad
    loaded.step()
    reports[-1] += (loaded.state[new_param]["step"],)
  assert reports[1] == reports[0]


# Errors: the same type as torch's and torch's words first.


def _t():
  return torch.nn.Parameter(torch.zeros(SHAPE))


def _j():
  return Parameter(jnp.zeros(SHAPE))


def _t_sparse():
  return torch.zeros(SHAPE).to_sparse()


def _j_sparse():
  return sparse.BCOO.fromdense(jnp.zeros(SHAPE))


def _t_complex():
  return torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))


def _j_complex():
  return Parameter(jnp.zeros(3, jnp.complex64))


class _Thing:
  pass


def _in_two_groups(make_opt, param):
  return make_opt([{"params": [param]}, {"params": [param]}])


# (name, torch call, adapter call, {torch word: adapter word} for type names).
CONSTRUCTOR_ERRORS = [
  ("empty", lambda: torch.optim.SparseAdam([]), lambda: SparseAdam([]), {}),
  (
    "a single parameter",
    lambda: torch.optim.SparseAdam(_t()),
    lambda: SparseAdam(_j()),
    {"torch.FloatTensor": "optax_sparse_adam.torch_compat._parameter.Parameter"},
  ),
  ("None", lambda: torch.optim.SparseAdam(None), lambda: SparseAdam(None), {}),
  ("an int", lambda: torch.optim.SparseAdam([3]), lambda: SparseAdam([3]), {}),
  ("an object", lambda: torch.optim.SparseAdam([_Thing()]), lambda: SparseAdam([_Thing()]), {}),
  (
    "a numpy array",
    lambda: torch.optim.SparseAdam([np.zeros(3)]),
    lambda: SparseAdam([np.zeros(3)]),
    {},
  ),
  (
    "a sparse param",
    lambda: torch.optim.SparseAdam([_t(), _t_sparse()]),
    lambda: SparseAdam([_j(), _j_sparse()]),
    {},
  ),
  (
    "sparse params in groups",
    lambda: torch.optim.SparseAdam([{"params": [_t_sparse()]}, {"params": [_t(), _t_sparse()]}]),
    lambda: SparseAdam([{"params": [_j_sparse()]}, {"params": [_j(), _j_sparse()]}]),
    {},
  ),
  (
    "a complex param",
    lambda: torch.optim.SparseAdam([{"params": [_t()]}, {"params": [_t_complex()]}]),
    lambda: SparseAdam([{"params": [_j()]}, {"params": [_j_complex()]}]),
    {},
  ),
  (
    "sparse before complex",
    lambda: torch.optim.SparseAdam([_t_complex(), _t_sparse()]),
    lambda: SparseAdam([_j_complex(), _j_sparse()]),
    {},
  ),
  (
    "negative lr",
    lambda: torch.optim.SparseAdam([_t()], lr=-1),
    lambda: SparseAdam([_j()], lr=-1),
    {},
  ),
  (
    "zero lr",
    lambda: torch.optim.SparseAdam([_t()], lr=0.0),
    lambda: SparseAdam([_j()], lr=0.0),
    {},
  ),
  (
    "nan lr",
    lambda: torch.optim.SparseAdam([_t()], lr=float("nan")),
    lambda: SparseAdam([_j()], lr=float("nan")),
    {},
  ),
  (
    "string lr",
    lambda: torch.optim.SparseAdam([_t()], lr="0.1"),
    lambda: SparseAdam([_j()], lr="0.1"),
    {},
  ),
  (
    "2-element tensor lr",
    lambda: torch.optim.SparseAdam([_t()], lr=torch.tensor([0.1, 0.2])),
    lambda: SparseAdam([_j()], lr=jnp.array([0.1, 0.2])),
    {},
  ),
  (
    "zero eps",
    lambda: torch.optim.SparseAdam([_t()], eps=0.0),
    lambda: SparseAdam([_j()], eps=0.0),
    {},
  ),
  (
    "None eps",
    lambda: torch.optim.SparseAdam([_t()], eps=None),
    lambda: SparseAdam([_j()], eps=None),
    {},
  ),
  (
    "beta1 of 1",
    lambda: torch.optim.SparseAdam([_t()], betas=(1.0, 0.9)),
    lambda: SparseAdam([_j()], betas=(1.0, 0.9)),
    {},
  ),
  (
    "negative beta2",
    lambda: torch.optim.SparseAdam([_t()], betas=(0.9, -0.1)),
    lambda: SparseAdam([_j()], betas=(0.9, -0.1)),
    {},
  ),
  (
    "one beta",
    lambda: torch.optim.SparseAdam([_t()], betas=(0.9,)),
    lambda: SparseAdam([_j()], betas=(0.9,)),
    {},
  ),
  (
    "bad lr before one beta (torch checks lr first)",
    lambda: torch.optim.SparseAdam([_t()], lr=-1.0, betas=(0.9,)),
    lambda: SparseAdam([_j()], lr=-1.0, betas=(0.9,)),
    {},
  ),
  (
    "names missing",
    lambda: torch.optim.SparseAdam([("a", _t()), _t()]),
    lambda: SparseAdam([("a", _j()), _j()]),
    {},
  ),
  (
    "a set of params in a group",
    lambda: torch.optim.SparseAdam([{"params": {_t()}}]),
    lambda: SparseAdam([{"params": {_j()}}]),
    {},
  ),
  (
    "a param in two groups",
    lambda: _in_two_groups(torch.optim.SparseAdam, _t()),
    lambda: _in_two_groups(SparseAdam, _j()),
    {},
  ),
  (
    "groups with and without names",
    lambda: torch.optim.SparseAdam([{"params": [("a", _t())]}, {"params": [_t()]}]),
    lambda: SparseAdam([{"params": [("a", _j())]}, {"params": [_j()]}]),
    {},
  ),
  (
    "a group without params",
    lambda: torch.optim.SparseAdam([{"lr": 0.1}]),
    lambda: SparseAdam([{"lr": 0.1}]),
    {},
  ),
]


def _add_group(make_opt, make_param, group_of):
  opt = make_opt([make_param()])
  return opt.add_param_group(group_of(opt))


ADD_PARAM_GROUP_ERRORS = [
  ("not a dict", lambda opt: [opt.param_groups[0]["params"][0]]),
  ("a param already in a group", lambda opt: {"params": opt.param_groups[0]["params"]}),
  ("a set", lambda opt: {"params": set(opt.param_groups[0]["params"])}),
  ("an int", lambda opt: {"params": [3]}),
  ("no params", lambda opt: {"lr": 0.1}),
  ("names into an unnamed optimizer", lambda opt: {"params": [("x", _make_like(opt))]}),
]


def _make_like(opt):
  return _t() if isinstance(opt, torch.optim.SparseAdam) else _j()


def _caught(call):
  with pytest.raises(Exception) as info:
    call()
  return info.value


def _assert_like_torch(ours, theirs, type_words):
  assert type(ours) is type(theirs), (ours, theirs)
  if isinstance(theirs, KeyError):
    assert ours.args[0] == theirs.args[0]
    return
  want = str(theirs)
  for torch_word, our_word in type_words.items():
    want = want.replace(torch_word, our_word)
  assert str(ours).startswith(want), (str(ours), want)


@pytest.mark.parametrize(
  "name, torch_call, adapter_call, type_words",
  CONSTRUCTOR_ERRORS,
  ids=[row[0] for row in CONSTRUCTOR_ERRORS],
)
def test_constructor_errors_as_torch(name, torch_call, adapter_call, type_words):
  _assert_like_torch(_caught(adapter_call), _caught(torch_call), type_words)


@pytest.mark.parametrize(
  "name, group_of", ADD_PARAM_GROUP_ERRORS, ids=[row[0] for row in ADD_PARAM_GROUP_ERRORS]
)
def test_add_param_group_errors_as_torch_and_change_nothing(name, group_of):
  theirs = _caught(lambda: _add_group(torch.optim.SparseAdam, _t, group_of))
  opt = SparseAdam([_j()])
  before = [dict(g) for g in opt.param_groups]
  ours = _caught(lambda: opt.add_param_group(group_of(opt)))
  _assert_like_torch(ours, theirs, {})
  assert opt.param_groups == before


@pytest.mark.parametrize(
  "make_param, match",
  [
    (_j_sparse, r"Sparse params at indices \[\[1, 0\]\]: SparseAdam requires dense"),
    (_j_complex, r"Complex params at indices \[\[1, 0\]\]: SparseAdam does not support"),
  ],
)
def test_add_param_group_refuses_what_torchs_step_would_fail_on(make_param, match):
  # torch accepts these groups and fails at the next step; the adapter refuses them up front.
  opt = SparseAdam([_j()])
  with pytest.raises(ValueError, match=match):
    opt.add_param_group({"params": [make_param()]})
  assert len(opt.param_groups) == 1


def test_parameter_of_a_bcoo_is_a_value_error():
  with pytest.raises(ValueError, match="SparseAdam requires dense parameter tensors"):
    Parameter(_j_sparse())


def test_duplicate_params_warn_as_torch():
  with pytest.warns(UserWarning, match="duplicate parameters") as theirs:
    p = _t()
    torch.optim.SparseAdam([p, p])
  with pytest.warns(UserWarning, match="duplicate parameters") as ours:
    q = _j()
    SparseAdam([q, q])
  assert str(ours[0].message) == str(theirs[0].message)
