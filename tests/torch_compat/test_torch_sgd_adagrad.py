"""`torch_compat.SGD` and `torch_compat.Adagrad` against real torch on sparse gradients.

Trajectories of 25+ steps with duplicate ids, option by option; untouched rows
bit-identical; torch's state_dict loaded into the adapter mid-training and the
adapter's handed back to torch; torch's refusals (and the dense momentum) refused
with torch's words, before anything changes. torch fuses `param + alpha * values`
into one FMA where the adapter rounds the product first: rows differ from torch's
by a few float32 ulps at most.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

from optax_sparse_adam import torch_compat as tc
from optax_sparse_adam._backends import choice

torch = pytest.importorskip("torch")

ROWS, DIM, STEPS = 24, 3, 26
RNG = np.random.default_rng(0)
TABLE0 = RNG.standard_normal((ROWS, DIM)).astype(np.float32)
# Ids from the first half only (the second half must stay bit-identical), duplicates in each.
BATCHES = [
  (RNG.integers(0, ROWS // 2, 7), RNG.standard_normal((7, DIM)).astype(np.float32))
  for _ in range(STEPS)
]
CASES = [
  ("SGD", {"lr": 0.1}),
  ("SGD", {"lr": 0.05, "maximize": True, "dampening": 0.3, "foreach": True}),
  ("Adagrad", {"lr": 0.1}),
  (
    "Adagrad",
    {"lr": 0.1, "lr_decay": 0.05, "initial_accumulator_value": 0.3, "eps": 1e-6, "maximize": True},
  ),
]


def _pair(name, options, table=TABLE0):
  torch_param = torch.nn.Parameter(torch.tensor(table.copy()))
  ours = tc.Parameter(jnp.asarray(table.copy()))
  return (
    torch_param,
    getattr(torch.optim, name)([torch_param], **options),
    ours,
    getattr(tc, name)([ours], **options),
  )


def _step(torch_param, torch_opt, ours, our_opt, batch):
  ids, vals = batch
  torch_param.grad = torch.sparse_coo_tensor(
    torch.tensor(ids[None]), torch.tensor(vals), (ROWS, DIM), check_invariants=True
  )
  ours.grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids[:, None])), shape=(ROWS, DIM))
  torch_opt.step()
  our_opt.step()


def _assert_close(torch_param, ours):
  theirs, mine = torch_param.detach().numpy(), np.asarray(ours.data)
  np.testing.assert_allclose(mine, theirs, rtol=2e-6, atol=1e-6)
  np.testing.assert_array_equal(mine[ROWS // 2 :], TABLE0[ROWS // 2 :])
  np.testing.assert_array_equal(theirs[ROWS // 2 :], TABLE0[ROWS // 2 :])


@pytest.mark.parametrize("name,options", CASES)
def test_trajectory_and_state_dicts_both_ways_match_torch(name, options):
  torch_param, torch_opt, ours, our_opt = _pair(name, options)
  for batch in BATCHES[:10]:
    _step(torch_param, torch_opt, ours, our_opt, batch)
  _assert_close(torch_param, ours)

  # torch's checkpoint into a fresh adapter, then the adapter's back into a fresh torch.
  _, _, ours2, our_opt2 = _pair(name, options, torch_param.detach().numpy())
  our_opt2.load_state_dict(torch_opt.state_dict())
  for batch in BATCHES[10:18]:
    _step(torch_param, torch_opt, ours2, our_opt2, batch)
  _assert_close(torch_param, ours2)
  torch_param2, torch_opt2, _, _ = _pair(name, options, np.asarray(ours2.data))
  torch_opt2.load_state_dict(tc.state_dict_to_torch(our_opt2.state_dict()))
  for batch in BATCHES[18:]:
    _step(torch_param2, torch_opt2, ours2, our_opt2, batch)
  _assert_close(torch_param2, ours2)

  mine, theirs = our_opt2.state_dict()["state"], torch_opt2.state_dict()["state"]
  assert mine.keys() == theirs.keys()
  for key, value in theirs.get(0, {}).items():
    if key == "step":
      assert mine[0]["step"] == float(value) == STEPS
    else:
      np.testing.assert_allclose(np.asarray(mine[0][key]), value.numpy(), rtol=1e-6)


def _torch_error(name, options, **grad):
  """The exception torch raises at `step()` for `options` on a sparse gradient."""
  torch_param, torch_opt, _, _ = _pair(name, options)
  ids, vals = BATCHES[0]
  torch_param.grad = torch.sparse_coo_tensor(
    torch.tensor(ids[None]), torch.tensor(vals), (ROWS, DIM), check_invariants=True
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fused=True warns on the CPU before it raises
    with pytest.raises(RuntimeError) as info:
      torch_opt.step()
  return str(info.value)


@pytest.mark.parametrize(
  "name,options",
  [
    ("SGD", {"lr": 0.1, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.1, "fused": True}),
    ("Adagrad", {"lr": 0.1, "weight_decay": 0.01}),
    ("Adagrad", {"lr": 0.1, "fused": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),  # torch runs it, densely: refused here
  ],
)
def test_what_torch_refuses_or_densifies_is_refused_before_any_change(name, options):
  ours = tc.Parameter(jnp.asarray(TABLE0.copy()))
  opt = getattr(tc, name)([ours], **options)
  state_before = {k: dict(v) for k, v in opt.state.items()}
  ids, vals = BATCHES[0]
  ours.grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids[:, None])), shape=(ROWS, DIM))
  with pytest.raises(RuntimeError) as info:
    opt.step()
  np.testing.assert_array_equal(np.asarray(ours.data), TABLE0)
  assert {k: dict(v) for k, v in opt.state.items()} == state_before
  message = str(info.value)
  if options.get("momentum"):
    assert "not lazy" in message and "lazy_momentum=True" in message
  else:
    assert message.startswith(_torch_error(name, options))
  assert "param_groups[0]" in message


@pytest.mark.parametrize(
  "name,options",
  [
    ("SGD", {"lr": -1.0}),
    ("SGD", {"momentum": -0.1}),
    ("SGD", {"weight_decay": -1.0}),
    ("SGD", {"nesterov": True}),
    ("Adagrad", {"lr_decay": -1.0}),
    ("Adagrad", {"initial_accumulator_value": -1.0}),
    ("Adagrad", {"eps": -1.0}),
  ],
)
def test_constructor_checks_are_torchs(name, options):
  with pytest.raises(ValueError) as theirs:
    getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(2, 2))], **options)
  with pytest.raises(ValueError) as mine:
    getattr(tc, name)([tc.Parameter(jnp.zeros((2, 2)))], **options)
  assert str(mine.value) == str(theirs.value)


def test_a_dense_gradient_of_another_shape_is_refused_with_the_parameter_named():
  ours = tc.Parameter(jnp.zeros((ROWS, DIM)))
  opt = tc.Adagrad([("emb.weight", ours)], lr=0.1)
  ours.grad = jnp.ones((ROWS, DIM + 1))
  with pytest.raises(RuntimeError, match=r"parameter 'emb.weight' \(param_groups\[0\]"):
    opt.step()
  assert opt.state[ours]["step"] == 0


@pytest.mark.parametrize("name", ["SGD", "Adagrad"])
def test_a_sparse_parameter_is_refused_with_its_index(name):
  table = sparse.BCOO((jnp.ones((1, DIM)), jnp.array([[1]])), shape=(ROWS, DIM))
  with pytest.raises(ValueError, match=r"Sparse params at indices \[\[0, 1\]\]"):
    getattr(tc, name)([tc.Parameter(jnp.zeros((ROWS, DIM))), table])


@pytest.mark.parametrize("name,options", [CASES[1], CASES[3]])
def test_the_accelerator_step_forced_on_the_cpu_matches_torch_too(name, options):
  torch_param, torch_opt, ours, our_opt = _pair(name, options)
  with choice.choose(forced=choice.ACCELERATOR):
    for batch in BATCHES:
      _step(torch_param, torch_opt, ours, our_opt, batch)
  _assert_close(torch_param, ours)
