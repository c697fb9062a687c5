"""Each row of docs/porting/schedulers.md's table: the optax schedule's learning rates are torch's.

The table is read from the page itself, so the page and this test cannot drift
apart: the torch cell is evaluated with `opt` a real `torch.optim.SparseAdam`,
the optax cell with the page's helper functions, and the two learning-rate
sequences must agree to float32 rounding (optax schedules compute in float32,
torch's schedulers in float64).
"""

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa

torch = pytest.importorskip("torch")

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "porting" / "schedulers.md"
LR = 0.1
UPDATES = 120
# float32 schedules against float64 torch: a few float32 ulps, or tiny absolute near zero.
RTOL, ATOL = 1e-5, 1e-8


def _page():
  return PAGE.read_text()


def _helpers():
  """The namespace of the page's python block that defines the helper schedules."""
  blocks = re.findall(r"```python\n(.*?)```", _page(), re.S)
  (source,) = [b for b in blocks if "def one_cycle(" in b]
  namespace = {"__name__": "schedulers_page"}
  exec(compile(source, str(PAGE), "exec"), namespace)  # noqa: S102 - the page's own snippet
  return namespace


def _rows():
  table = _page().split("### torch scheduler to optax schedule", 1)[1]
  rows = []
  for line in table.splitlines():
    cells = re.findall(r"\|\s*`([^`]*)`\s*", line)
    if line.startswith("| `") and len(cells) >= 2:
      rows.append((cells[0], cells[1]))
  return rows


ROWS = _rows()


def test_the_table_covers_every_torch_scheduler():
  names = {torch_cell.split("(")[0] for torch_cell, _ in ROWS}
  assert names == {
    "StepLR",
    "MultiStepLR",
    "ExponentialLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "LinearLR",
    "ConstantLR",
    "LambdaLR",
    "MultiplicativeLR",
    "PolynomialLR",
    "OneCycleLR",
    "CyclicLR",
    "SequentialLR",
    "ChainedScheduler",
    "ReduceLROnPlateau",
  }


def _torch_scheduler(torch_cell):
  opt = torch.optim.SparseAdam([torch.nn.Parameter(torch.zeros(2))], lr=LR)
  namespace = dict(vars(torch.optim.lr_scheduler), opt=opt)
  return opt, eval(torch_cell, namespace)  # noqa: S307 - the page's own table


def _plateau_metrics():
  # Improves, stalls (a reduction), improves a little, stalls again, within cooldowns.
  return [1.0, 0.8, 0.8, 0.8, 0.8, 0.8, 0.79, 0.79, 0.79, 0.79, 0.79, 0.7] + [0.7] * 12


def _torch_lrs(opt, scheduler, updates):
  lrs = []
  for metric in _plateau_metrics() if _is_plateau(scheduler) else range(updates):
    if not _is_plateau(scheduler):
      lrs.append(opt.param_groups[0]["lr"])  # the lr of this update
    opt.step()  # no gradients: changes nothing, but schedulers expect it before their step
    if _is_plateau(scheduler):
      scheduler.step(metric)
      lrs.append(opt.param_groups[0]["lr"])  # the lr after seeing this metric
    else:
      scheduler.step()
  return lrs


def _is_plateau(scheduler):
  return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _optax_lrs(optax_cell, updates):
  namespace = dict(_helpers(), lr=LR, optax=optax, osa=osa, jnp=jnp, np=np)
  schedule = eval(optax_cell, namespace)  # noqa: S307 - the page's own table
  if isinstance(schedule, optax.GradientTransformation):
    # A scale of the updates: run it on sparse_adam's updates, one metric per update.
    tx = optax.chain(osa.sparse_adam(LR), schedule)
    params = jnp.zeros(2)
    state = tx.init(params)

    grad = sparse.BCOO((jnp.ones(1), jnp.array([[0]])), shape=(2,))
    lrs = []
    for metric in _plateau_metrics():
      _, state = tx.update(grad, state, params, value=metric)
      lrs.append(LR * float(state[1].scale))
    return lrs
  return [float(schedule(count)) for count in range(updates)]


@pytest.mark.parametrize("torch_cell, optax_cell", ROWS, ids=[row[0] for row in ROWS])
def test_optax_schedule_gives_torchs_learning_rates(torch_cell, optax_cell):
  opt, scheduler = _torch_scheduler(torch_cell)
  updates = UPDATES
  if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
    updates = scheduler.total_steps  # torch refuses to step past it
  if isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):
    updates = scheduler.T_max + 1  # the table's note: optax's stays at eta_min after T_max
  want = _torch_lrs(opt, scheduler, updates)
  got = _optax_lrs(optax_cell, updates)
  assert len(set(want)) > 1  # the schedule does move
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
