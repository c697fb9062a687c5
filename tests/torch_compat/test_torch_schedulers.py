"""torch's learning-rate schedulers drive `torch_compat.SparseAdam` as they drive torch's.

Each scheduler runs side by side on real `torch.optim.SparseAdam` and on the
adapter, same data: the learning rates agree exactly at every step, the
parameters after the run agree to torch's few-ulp `sqrt` (see
test_torch_parity.py), the scheduler's `state_dict` round-trips (a run resumed
from a mid-run checkpoint equals the uninterrupted one bit for bit), and
changing the learning rate never recompiles the step.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

from optax_sparse_adam.torch_compat import Parameter, SparseAdam, _step

torch = pytest.importorskip("torch")
lr_scheduler = torch.optim.lr_scheduler

SHAPES = [(10, 3), (6,)]
STEPS = 12
RESUME_AT = 5
# torch's CPU float32 sqrt is off by at most 1 ulp; a parameter inherits a few such roundings.
PARAM_RTOL, PARAM_ATOL = 16 * 2.0**-23, 1e-7


def _plateau_metric(step: int) -> float:
  # Improves, then stalls long enough to trigger ReduceLROnPlateau twice.
  return max(1.0 - 0.1 * step, 0.7)


def _sequential(opt):
  warmup = lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
  decay = lr_scheduler.ExponentialLR(opt, gamma=0.8)
  return lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[3])


def _chained(opt):
  return lr_scheduler.ChainedScheduler(
    [lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=4), lr_scheduler.StepLR(opt, 3, 0.7)],
    optimizer=opt,
  )


SCHEDULERS = {
  "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
  "MultiStepLR": lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[2, 5, 9], gamma=0.3),
  "ExponentialLR": lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.9),
  "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=7, eta_min=1e-3),
  "CosineAnnealingWarmRestarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(
    opt, T_0=3, T_mult=2, eta_min=1e-3
  ),
  "LinearLR": lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=6),
  "ConstantLR": lambda opt: lr_scheduler.ConstantLR(opt, factor=0.25, total_iters=4),
  "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, [lambda e: 1.0 / (1 + e), lambda e: 0.95**e]),
  "MultiplicativeLR": lambda opt: lr_scheduler.MultiplicativeLR(opt, lambda e: 0.9),
  "PolynomialLR": lambda opt: lr_scheduler.PolynomialLR(opt, total_iters=8, power=2.0),
  "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(
    opt, max_lr=[0.05, 0.02], total_steps=STEPS, cycle_momentum=False
  ),
  # With momentum cycling the scheduler rewrites betas[0] every step, as it does for torch's.
  "OneCycleLR-betas": lambda opt: lr_scheduler.OneCycleLR(
    opt, max_lr=0.05, total_steps=STEPS, base_momentum=0.8, max_momentum=0.95
  ),
  "CyclicLR": lambda opt: lr_scheduler.CyclicLR(
    opt, base_lr=1e-3, max_lr=0.05, step_size_up=3, mode="triangular2", cycle_momentum=False
  ),
  "CyclicLR-betas": lambda opt: lr_scheduler.CyclicLR(
    opt, base_lr=1e-3, max_lr=0.05, step_size_up=4, base_momentum=0.8, max_momentum=0.9
  ),
  "SequentialLR": _sequential,
  "ChainedScheduler": _chained,
  "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(
    opt, factor=0.5, patience=1, threshold=1e-3
  ),
}


def _grads(step: int):
  """The step's gradients (repeated rows), as torch sparse tensors and as BCOOs."""
  rng = np.random.default_rng(1000 + step)
  torch_grads, jax_grads = [], []
  for shape in SHAPES:
    rows = rng.integers(0, shape[0], size=5)
    rows[-1] = rows[0]
    values = rng.normal(size=(5,) + shape[1:]).astype(np.float32)
    torch_grads.append(
      torch.sparse_coo_tensor(
        torch.from_numpy(rows[None].copy()), torch.from_numpy(values), shape, check_invariants=True
      )
    )
    jax_grads.append(sparse.BCOO((jnp.asarray(values), jnp.asarray(rows[:, None])), shape=shape))
  return torch_grads, jax_grads


def _inits():
  rng = np.random.default_rng(0)
  return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def _groups(params):
  return [{"params": [params[0]], "lr": 0.01}, {"params": [params[1]], "lr": 0.02}]


def _torch_run(make_scheduler):
  params = [torch.nn.Parameter(torch.from_numpy(x)) for x in _inits()]
  opt = torch.optim.SparseAdam(_groups(params))
  scheduler = make_scheduler(opt)
  lrs = []
  for step in range(STEPS):
    for p, g in zip(params, _grads(step)[0], strict=True):
      p.grad = g
    opt.step()
    _scheduler_step(scheduler, step)
    lrs.append(scheduler.get_last_lr())
  return lrs, [p.detach().numpy() for p in params], scheduler.state_dict()


def _scheduler_step(scheduler, step):
  if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
    scheduler.step(_plateau_metric(step))
  else:
    scheduler.step()


def _fresh_adapter(make_scheduler):
  params = [Parameter(jnp.asarray(x)) for x in _inits()]
  opt = SparseAdam(_groups(params))
  return params, opt, make_scheduler(opt)


def _adapter_steps(params, opt, scheduler, steps):
  lrs = []
  for step in steps:
    for p, g in zip(params, _grads(step)[1], strict=True):
      p.grad = g
    opt.step()
    _scheduler_step(scheduler, step)
    lrs.append(scheduler.get_last_lr())
  return lrs


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_drives_the_adapter_as_torch(name):
  make_scheduler = SCHEDULERS[name]
  torch_lrs, torch_params, torch_state = _torch_run(make_scheduler)

  params, opt, scheduler = _fresh_adapter(make_scheduler)
  assert isinstance(opt, torch.optim.Optimizer)
  lrs = _adapter_steps(params, opt, scheduler, range(1))
  compiles = _step.fused_step._cache_size()
  lrs += _adapter_steps(params, opt, scheduler, range(1, STEPS))
  assert _step.fused_step._cache_size() == compiles  # new lrs (and betas) never recompile

  assert lrs == torch_lrs
  assert len({tuple(lr) for lr in lrs}) > 1  # the schedule did change the lr
  for got, want in zip(params, torch_params, strict=True):
    np.testing.assert_allclose(np.asarray(got.data), want, rtol=PARAM_RTOL, atol=PARAM_ATOL)
  assert _comparable(scheduler.state_dict()) == _comparable(torch_state)
  assert [g["lr"] for g in opt.param_groups] == torch_lrs[-1]


def _comparable(state):
  """A scheduler state dict without the parts that are objects (lambdas, bound functions)."""
  if isinstance(state, dict):
    return {k: _comparable(v) for k, v in state.items() if not callable(v)}
  if isinstance(state, (list, tuple)):
    return type(state)(_comparable(v) for v in state)
  return state


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_state_dict_round_trip_resumes_bit_for_bit(name):
  make_scheduler = SCHEDULERS[name]
  params, opt, scheduler = _fresh_adapter(make_scheduler)
  straight_lrs = _adapter_steps(params, opt, scheduler, range(STEPS))
  straight = [np.asarray(p.data) for p in params]

  params, opt, scheduler = _fresh_adapter(make_scheduler)
  first_lrs = _adapter_steps(params, opt, scheduler, range(RESUME_AT))
  opt_state = opt.state_dict()
  opt_state = {
    "state": {k: dict(v) for k, v in opt_state["state"].items()},
    "param_groups": [dict(g) for g in opt_state["param_groups"]],
  }
  scheduler_state = scheduler.state_dict()
  saved_data = [np.asarray(p.data) for p in params]

  # A new process would rebuild everything, then load: scheduler first, as torch advises.
  params = [Parameter(jnp.asarray(x)) for x in saved_data]
  opt = SparseAdam(_groups(params))
  resumed = make_scheduler(opt)
  opt.load_state_dict(opt_state)
  resumed.load_state_dict(scheduler_state)
  rest_lrs = _adapter_steps(params, opt, resumed, range(RESUME_AT, STEPS))

  assert first_lrs + rest_lrs == straight_lrs
  for got, want in zip(params, straight, strict=True):
    np.testing.assert_array_equal(np.asarray(got.data), want)


def test_scheduler_updates_a_tensor_lr_in_place_as_torch():
  """A 1-element tensor lr is updated in place by torch's schedulers, as on torch's optimizer."""
  t_param = torch.nn.Parameter(torch.from_numpy(_inits()[0]))
  t_opt = torch.optim.SparseAdam([t_param], lr=torch.tensor(0.01))
  t_sched = lr_scheduler.ExponentialLR(t_opt, gamma=0.5)
  param = Parameter(jnp.asarray(_inits()[0]))
  opt = SparseAdam([param], lr=torch.tensor(0.01))
  sched = lr_scheduler.ExponentialLR(opt, gamma=0.5)
  for step in range(4):
    t_param.grad = _grads(step)[0][0]
    param.grad = _grads(step)[1][0]
    t_opt.step()
    opt.step()
    t_sched.step()
    sched.step()
    assert float(opt.param_groups[0]["lr"]) == float(t_opt.param_groups[0]["lr"])
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
  np.testing.assert_allclose(
    np.asarray(param.data), t_param.detach().numpy(), rtol=PARAM_RTOL, atol=PARAM_ATOL
  )
