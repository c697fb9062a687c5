"""Catch-up of idle rows under a learning-rate schedule, against dense Adam/AdamW in float64.

The reference (written here, apart from the package) is dense Adam or AdamW
with the schedule's rate at every step, run on the densified gradients. Rows
caught up inside the step and rows caught up by `catch_up_rows` must charge an
idle window the same rate (the schedule's at the last idle step); the
parameters stay within the bound of `_core/catch_up.py` taken over the window's
rates and bias corrections apart (plus AdamW's decay term), and are exact (to
float32 rounding) where the rate is constant over the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from tests._helpers import padded_grad

F64 = np.float64
PATHS = {
  "generic": {"forced": choice.GENERIC_XLA},
  "kernel": {},  # the default on the CPU: the fused Adam kernel catches up
  "accelerator": {"forced": choice.ACCELERATOR},
}
VOCAB, DIM = 6, 3
STEPS = 30

SCHEDULES = {
  "linear_warmup": optax.linear_schedule(0.0, 0.1, transition_steps=20),
  "cosine_decay": optax.cosine_decay_schedule(0.1, decay_steps=STEPS),
  "exponential_decay": optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.85),
  "piecewise_drop": optax.piecewise_constant_schedule(0.1, {12: 0.1, 22: 0.05}),
}


def pattern(steps: int) -> list[list[int]]:
  """Rows touched per step: every step, every 2nd, every 5th (all three at the last step),
  a row idle from step 4 to 24 (over both drops), and a row touched once."""
  rows = []
  for t in range(1, steps + 1):
    touched = [0]
    touched += [1] if t % 2 == 0 else []
    touched += [2] if t % 5 == 0 else []
    touched += [3] if t in (3, 25, steps) else []  # idle 4..24: over both drops
    touched += [4] if t == 2 else []  # caught up by catch_up_all_rows only
    rows.append(touched)
  return rows


class DenseAdam:
  """Dense Adam/AdamW in float64, this package's eps placement, the rate from a schedule."""

  def __init__(self, param, schedule, *, b1, b2, eps, wd):
    self.p = np.array(param, F64)
    self.m = np.zeros_like(self.p)
    self.v = np.zeros_like(self.p)
    self.t = 0
    self.schedule, self.b1, self.b2, self.eps, self.wd = schedule, b1, b2, eps, wd
    self.rates: list[float] = []  # per step s = 1.., the schedule's rate (count s - 1)
    self.corrections: list[float] = []

  def step(self, grad: np.ndarray) -> None:
    b1, b2 = self.b1, self.b2
    lr = float(self.schedule(self.t))
    self.t += 1
    self.m = b1 * self.m + (1 - b1) * grad
    self.v = b2 * self.v + (1 - b2) * grad * grad
    correction = np.sqrt(1 - b2**self.t) / (1 - b1**self.t)
    self.rates.append(lr)
    self.corrections.append(correction)
    self.p = (
      self.p - lr * correction * self.m / (np.sqrt(self.v) + self.eps) - lr * self.wd * self.p
    )


def window_bound(ref, snapshot, t0: int, until: int, *, wd: float, injected: bool) -> np.ndarray:
  """The documented bound on one row's error over its idle steps t0+1 .. until-1.

  `injected`: the rate came through optax.inject_hyperparams, so the window is
  charged the touching step's rate, and the rates range over it too.
  """
  k = until - 1 - t0
  if k <= 0:
    return np.zeros(DIM)
  b1, b2, eps = ref.b1, ref.b2, ref.eps
  charged = ref.rates[until - 1 if injected else until - 2]
  rates = np.array(ref.rates[t0 : until - 1] + [charged])
  corrections = np.array(ref.corrections[t0 : until - 1])
  eta_min, eta_max = rates.min() * corrections.min(), rates.max() * corrections.max()
  j = np.arange(1, k + 1, dtype=F64)[:, None]
  root = np.sqrt(snapshot["v"])
  w = root / (root + eps)
  d = 1 - rates.min() * wd  # the largest decay factor bounds every d^(k-j)
  terms = d ** (k - j) * (
    (eta_max - eta_min) * (w * (b1 / np.sqrt(b2)) ** j + (1 - w) * b1**j)
    + eta_max * w * (1 - w) * b1**j * (b2 ** (-j / 2) - 1) ** 2
  )
  bound = np.abs(snapshot["m"]) / (root + eps) * terms.sum(axis=0)
  decay = np.abs(np.prod(1 - rates[:-1] * wd) - (1 - charged * wd) ** k)
  return bound + decay * np.abs(snapshot["p"])


def run(schedule, *, wd: float, path: str, steps: int = STEPS, inject: bool = False):
  b1, b2, eps = 0.8, 0.99, 1e-8
  factory = osa.sparse_adamw if wd else osa.sparse_adam
  extra = {"weight_decay": wd} if wd else {}
  kwargs = {"b1": b1, "b2": b2, "eps": eps, "catch_up_idle_rows": True, **extra}
  if inject:
    # sparse_adam's weight_decay=0 must stay a Python zero (no L2 decay) when injected;
    # catch-up checks b1 < sqrt(b2) when the step is traced, so the betas stay Python too.
    static = ("b1", "b2") + (() if wd else ("weight_decay",))
    opt = optax.inject_hyperparams(factory, static_args=static)(learning_rate=schedule, **kwargs)
  else:
    opt = factory(schedule, **kwargs)
  rng = np.random.default_rng(3)
  params = jnp.asarray(rng.normal(size=(VOCAB, DIM)), jnp.float32)
  ref = DenseAdam(params, schedule, b1=b1, b2=b2, eps=eps, wd=wd)
  state = opt.init(params)

  @jax.jit
  def train_step(grad, state, params):
    updates, state = opt.update(grad, state, params)
    return osa.apply_updates(params, updates), state

  last = np.zeros(VOCAB, int)
  snapshots = {0: {"m": ref.m.copy(), "v": ref.v.copy(), "p": ref.p.copy()}}
  bound = np.zeros((VOCAB, DIM))
  with choice.choose(**PATHS[path]):
    for t, rows in enumerate(pattern(steps), 1):
      ids = np.array(rows + rows[:1], np.int32)  # row 0 twice: duplicates are summed
      values = rng.normal(size=(len(ids), DIM)).astype(np.float32)
      # Padded to one shape (every row and the duplicate): one compile per run.
      grad = padded_grad(ids, values, (VOCAB, DIM), VOCAB + 1)
      params, state = train_step(grad, state, params)
      dense = np.zeros((VOCAB, DIM))
      np.add.at(dense, ids, values.astype(F64))
      ref.step(dense)
      snapshots[t] = {"m": ref.m.copy(), "v": ref.v.copy(), "p": ref.p.copy()}
      for row in set(rows):
        bound[row] += window_bound(ref, {k: v[row] for k, v in snapshots[last[row]].items()},
                                   last[row], t, wd=wd, injected=inject)  # fmt: skip
        last[row] = t
  return params, state, ref, bound, opt


def assert_within(params, ref, bound, rows) -> None:
  slack = 4e-7 * ref.t * (np.abs(ref.p).max() + 0.1)  # float32 rounding over the run
  err = np.abs(np.asarray(params, F64) - ref.p)[rows]
  allowed = bound[rows] + slack
  assert np.all(err <= allowed), (
    f"error {err.max():.3g} exceeds the bound by {(err - allowed).max():.3g}"
  )


# Each schedule with Adam and AdamW, spread over the three paths (one compile each).
PATH_PAIRS = [("generic", "kernel"), ("kernel", "accelerator"), ("accelerator", "generic")]
CASES = [
  (name, wd, path)
  for i, name in enumerate(SCHEDULES)
  for wd, path in zip((0.0, 0.3), PATH_PAIRS[i % len(PATH_PAIRS)], strict=True)
]


@pytest.mark.parametrize(("name", "wd", "path"), CASES)
def test_in_step_catch_up_within_bound_under_schedule(name, wd, path):
  params, state, ref, bound, _ = run(SCHEDULES[name], wd=wd, path=path)
  touched_last = [0, 1, 2, 3]  # touched at step 30; row 3 after a window over both drops
  assert_within(params, ref, bound, touched_last)
  np.testing.assert_allclose(np.asarray(state.mu, F64)[touched_last], ref.m[touched_last],
                             rtol=2e-5, atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
def test_window_with_a_constant_rate_is_exact(path):
  """The issue's hand case: one value per row, b1 = b2 = 0.5, eps ~ 0, a rate drop at step 41.

  Row 0 is idle at step 40 only (rate 0.1) and touched at step 41 (rate 0.01).
  With eps ~ 0 the closed form is exact for a constant rate over the window, so
  the row must equal dense Adam to float32 rounding; charging step 41's rate to
  step 40 (the bug) moves it by ~0.024.
  """
  schedule = optax.piecewise_constant_schedule(0.1, {40: 0.1})
  opt = osa.sparse_adam(schedule, b1=0.5, b2=0.5, eps=1e-30, catch_up_idle_rows=True)
  params = jnp.zeros((2, 1), jnp.float32)
  state = opt.init(params)
  ref = DenseAdam(np.zeros((2, 1)), schedule, b1=0.5, b2=0.5, eps=1e-30, wd=0.0)
  step = jax.jit(lambda g, s, p: opt.update(g, s, p))
  with choice.choose(**PATHS[path]):
    for t in range(1, 42):
      rows = [1] if t == 40 else [0, 1]
      values = np.array([[1.0 + 0.1 * (t % 3)]] * len(rows), np.float32)
      grad = padded_grad(rows, values, (2, 1), 2)  # one shape: one compile
      updates, state = step(grad, state, params)
      params = osa.apply_updates(params, updates)
      dense = np.zeros((2, 1))
      dense[rows] = values
      ref.step(dense)
  np.testing.assert_allclose(np.asarray(params, F64), ref.p, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("wd", [0.3])  # AdamW: the rate and the decay over the window
def test_in_step_and_catch_up_rows_charge_the_same_rate(wd):
  """A window caught up inside the step equals one caught up by catch_up_rows first."""
  schedule = SCHEDULES["piecewise_drop"]
  factory = osa.sparse_adamw if wd else osa.sparse_adam
  extra = {"weight_decay": wd} if wd else {}
  opt = factory(schedule, b1=0.8, b2=0.99, catch_up_idle_rows=True, **extra)
  params = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2)), jnp.float32)
  state = opt.init(params)

  def grad_of(rows):  # padded to one shape: one compile
    return padded_grad(rows, np.ones((len(rows), 2), np.float32), (3, 2), 2)

  step = jax.jit(lambda g, s, p: opt.update(g, s, p))
  for t in range(1, 23):  # row 2: touched at step 1, idle 2..22; the rate drops at step 23
    updates, state = step(grad_of([0, 2] if t == 1 else [0]), state, params)
    params = osa.apply_updates(params, updates)
  updates, in_step = step(grad_of([2]), state, params)
  in_step_params = osa.apply_updates(params, updates)
  first, first_state = osa.catch_up_rows(opt, params, state, jnp.array([2]))
  updates, after = step(grad_of([2]), first_state, first)
  after_params = osa.apply_updates(first, updates)
  np.testing.assert_allclose(in_step_params, after_params, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(in_step.mu, after.mu, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("wd", [0.0])  # sparse_adam, its weight_decay kept static
def test_inject_hyperparams_within_the_bound_of_its_rates(wd):
  """Under inject_hyperparams the step sees one rate: the window is charged the touching step's.

  The bound then ranges over the window's rates and the touching step's
  (docs/catch_up.md); a schedule given to sparse_adam itself charges the
  window its last idle step's rate instead.
  """
  params, _, ref, bound, _ = run(SCHEDULES["exponential_decay"], wd=wd, path="kernel", inject=True)
  assert_within(params, ref, bound, [0, 1, 2, 3])
