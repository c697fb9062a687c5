"""`catch_up_idle_rows`: sparse steps that follow dense Adam, checked against dense Adam.

The reference is dense Adam written here in float64 NumPy with this package's
eps placement (`m / (sqrt(v) + eps)` times `lr sqrt(1 - b2^t) / (1 - b1^t)`),
run on the densified gradients: every row steps at every step, a skipped row
with a zero gradient. `torch.optim.Adam` places eps elsewhere
(`sqrt(v) / sqrt(1 - b2^t) + eps`); with `eps=0` the two coincide, so the torch
comparison runs at `eps=0`. The moments must match to float32 rounding; the
parameters within the bound of `_core/catch_up.py`, which the test computes
from the reference's own step sizes and moments, and to float32 rounding where
that bound is zero (eps = 0 or amsgrad, at a settled bias correction).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from tests._helpers import padded_grad, tiered

F64 = np.float64
PATHS = {
  "default": {},
  "generic": {"forced": choice.GENERIC_XLA},
  "accelerator": {"forced": choice.ACCELERATOR},
}
VOCAB, DIM = 8, 3
# Entries per gradient: every row and the duplicate at most, padded to one shape
# so that a run's jitted step compiles once.
NSE = VOCAB + 1


def bcoo(ids: np.ndarray, values: np.ndarray, nse: int = NSE) -> sparse.BCOO:
  return padded_grad(ids, values, (VOCAB, DIM), nse)


def touch_pattern(steps: int) -> list[list[int]]:
  """Rows touched at each step: idle exactly 1, 2, 3 steps, a long gap, never, then idle."""
  pattern = []
  for t in range(1, steps + 1):
    rows = [0]
    rows += [1] if t % 2 == 1 else []
    rows += [2] if t % 3 == 1 else []
    rows += [3] if t % 4 == 1 else []
    rows += [4] if t in (1, steps) else []
    rows += [6] if t in (1, 2) else []
    rows += [7] if t == steps // 2 else []
    pattern.append(rows)
  return pattern


def sparse_grads(pattern: list[list[int]], seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per step, (ids, values); row 0's gradient comes in two entries (a duplicate id)."""
  rng = np.random.default_rng(seed)
  grads = []
  for rows in pattern:
    values = rng.normal(size=(len(rows), DIM)).astype(np.float32)
    ids = np.array(rows, np.int32)
    # Split row 0 in two halves: the step must sum duplicates.
    ids = np.concatenate([ids, ids[:1]])
    values = np.concatenate([values, values[:1] * 0.5])
    values[0] *= 0.5
    grads.append((ids, values))
  return grads


def densify(ids: np.ndarray, values: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
  grad = np.zeros((vocab, values.shape[1]), F64)
  np.add.at(grad, ids, values.astype(F64))
  return grad


class DenseAdam:
  """Dense Adam (AdamW with `decoupled`) in float64, this package's eps placement."""

  def __init__(self, param, *, lr, b1, b2, eps, wd=0.0, amsgrad=False, maximize=False):
    self.p = np.array(param, F64)
    self.m = np.zeros_like(self.p)
    self.v = np.zeros_like(self.p)
    self.vmax = np.zeros_like(self.p)
    self.t = 0
    self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd
    self.amsgrad, self.maximize = amsgrad, maximize
    self.etas: list[float] = []

  def step(self, grad: np.ndarray) -> None:
    b1, b2 = self.b1, self.b2
    self.t += 1
    g = -grad if self.maximize else grad
    self.m = b1 * self.m + (1 - b1) * g
    self.v = b2 * self.v + (1 - b2) * g * g
    self.vmax = np.maximum(self.vmax, self.v)
    eta = self.lr * np.sqrt(1 - b2**self.t) / (1 - b1**self.t)
    self.etas.append(eta)
    den = np.sqrt(self.vmax if self.amsgrad else self.v) + self.eps
    ratio = np.divide(self.m, den, out=np.zeros_like(self.m), where=den > 0)
    self.p = self.p - eta * ratio - self.lr * self.wd * self.p


def window_bound(ref_at_t0: dict, etas: np.ndarray, *, b1, b2, eps, d, amsgrad) -> np.ndarray:
  """The bound of `_core/catch_up.py` on one row's parameter error over one idle window."""
  k = len(etas)
  if k == 0:
    return np.zeros_like(ref_at_t0["m"])
  j = np.arange(1, k + 1, dtype=F64)[:, None]
  root = np.sqrt(ref_at_t0["vmax"] if amsgrad else ref_at_t0["v"])
  w = (
    np.zeros_like(root)
    if amsgrad
    else np.divide(root, root + eps, out=np.ones_like(root), where=root + eps > 0)
  )
  r = b1 / np.sqrt(b2)
  spread = etas.max() - etas.min()
  terms = d ** (k - j) * (
    spread * (w * r**j + (1 - w) * b1**j)
    + etas.max() * w * (1 - w) * b1**j * (b2 ** (-j / 2) - 1) ** 2
  )
  den = root + eps
  scale = np.divide(np.abs(ref_at_t0["m"]), den, out=np.zeros_like(den), where=den > 0)
  return scale * terms.sum(axis=0)


def run(
  options: dict[str, Any],
  pattern: list[list[int]],
  *,
  seed: int = 0,
  jit: bool = True,
  path: str = "generic",
  catch_up_all: bool = True,
  catch_up_at: tuple[int, ...] = (),
):
  """Runs `pattern` through sparse_adam(w) with catch-up and through dense Adam.

  Returns the sparse params and state (before and after `catch_up_all_rows`), the
  dense reference, and per row the summed bound over its idle windows.
  """
  opts = dict(options)
  wd = opts.pop("weight_decay", 0.0)
  factory = osa.sparse_adamw if wd else osa.sparse_adam
  extra = {"weight_decay": wd} if wd else {}
  opt = factory(**opts, **extra, catch_up_idle_rows=True)
  lr, b1, b2, eps = opts["learning_rate"], opts["b1"], opts["b2"], opts["eps"]
  amsgrad = opts.get("amsgrad", False)
  ref = DenseAdam(
    np.zeros((VOCAB, DIM)),
    lr=lr,
    b1=b1,
    b2=b2,
    eps=eps,
    wd=wd,
    amsgrad=amsgrad,
    maximize=opts.get("maximize", False),
  )
  rng = np.random.default_rng(seed + 100)
  params = jnp.asarray(rng.normal(size=(VOCAB, DIM)), jnp.float32)
  ref.p = np.asarray(params, F64)
  ref.p0 = ref.p.copy()
  state = opt.init(params)

  def train_step(grad, state, params):
    updates, state = opt.update(grad, state, params)
    return osa.apply_updates(params, updates), state

  train_step = jax.jit(train_step) if jit else train_step
  last = np.zeros(VOCAB, int)
  snapshots = {0: {"m": ref.m.copy(), "v": ref.v.copy(), "vmax": ref.vmax.copy()}}
  bound = np.zeros((VOCAB, DIM))
  d = 1 - lr * wd
  grads = sparse_grads(pattern, seed)

  def add_window(row: int, until: int) -> None:
    t0 = last[row]
    etas = np.array(ref.etas[t0 : until - 1 if until > t0 else t0], F64)
    at = {key: value[row] for key, value in snapshots[t0].items()}
    bound[row] += window_bound(at, etas, b1=b1, b2=b2, eps=eps, d=d, amsgrad=amsgrad)

  with choice.choose(**PATHS[path]):
    for t, (ids, values) in enumerate(grads, 1):
      grad = bcoo(ids, values)
      params, state = train_step(grad, state, params)
      ref.step(densify(ids, values))
      snapshots[t] = {"m": ref.m.copy(), "v": ref.v.copy(), "vmax": ref.vmax.copy()}
      for row in sorted(set(ids.tolist())):
        add_window(row, t)
        last[row] = t
      if t in catch_up_at:
        params, state = osa.catch_up_all_rows(opt, params, state)
        for row in range(VOCAB):
          add_window(row, t + 1)
          last[row] = t
  caught = None
  if catch_up_all:
    caught = osa.catch_up_all_rows(opt, params, state)
    for row in range(VOCAB):
      add_window(row, len(grads) + 1)
  return params, state, caught, ref, bound


def slack(ref: DenseAdam) -> float:
  """Float32 rounding over the run: a few ulps of the parameters per step."""
  return 4e-7 * ref.t * (np.abs(ref.p).max() + ref.lr)


def assert_moments(state, ref: DenseAdam, rows) -> None:
  rows = np.asarray(rows)
  for name, want in (("mu", ref.m), ("nu", ref.v)):
    got = np.asarray(getattr(state, name), F64)[rows]
    np.testing.assert_allclose(
      got, want[rows], rtol=2e-5, atol=1e-7 * np.abs(want).max(), err_msg=name
    )
  if state.nu_max is not None:
    got = np.asarray(state.nu_max, F64)[rows]
    np.testing.assert_allclose(got, ref.vmax[rows], rtol=2e-5, err_msg="nu_max")


def assert_params(params, ref: DenseAdam, bound: np.ndarray, rows) -> None:
  rows = np.asarray(rows)
  err = np.abs(np.asarray(params, F64) - ref.p)[rows]
  allowed = bound[rows] + slack(ref)
  assert np.all(err <= allowed), (err - allowed).max()


OPTIONS = {
  "adam": {"learning_rate": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-8},
  "adam_large_eps": {"learning_rate": 0.05, "b1": 0.9, "b2": 0.99, "eps": 0.3},
  "adamw": {"learning_rate": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.5},
  "amsgrad": {"learning_rate": 0.05, "b1": 0.8, "b2": 0.99, "eps": 1e-3, "amsgrad": True},
  "maximize": {"learning_rate": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "maximize": True},
  "eps0": {"learning_rate": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-30},
}


# "default" on the CPU: the fused kernel catches up (amsgrad: the XLA ops).
# The kernel's own arithmetic for every option: tests/backends/test_cpu_catch_up.py.
CASES = [(name, "generic") for name in OPTIONS]
CASES += [(name, "default") for name in ("adam", "adamw", "amsgrad")]
CASES += [(name, "accelerator") for name in ("adamw", "amsgrad")]


# The generic path for every option in the slow tier; the default tier keeps Adam, AdamW
# and eps ~ 0 there (the kernel's arithmetic of every option: test_cpu_catch_up).
SLOW_CASES = {("adam_large_eps", "generic"), ("amsgrad", "generic"), ("maximize", "generic")}
SLOW_CASES |= {("amsgrad", "accelerator")}


@pytest.mark.parametrize(("name", "path"), tiered(CASES, lambda case: case in SLOW_CASES))
def test_touched_rows_follow_dense_adam(name, path):
  steps = 37
  params, state, caught, ref, bound = run(OPTIONS[name], touch_pattern(steps), path=path)
  touched_last = [0, 1, 2, 3, 4]  # touched at the last step (37 = 1 mod 2, 3 and 4)
  assert_moments(state, ref, touched_last)
  assert_params(params, ref, bound, touched_last)
  np.testing.assert_array_equal(state.row_last_step, [37, 37, 37, 37, 37, 0, 2, 18])
  # Row 5 was never touched: no moments; dense Adam does not move it either (m = 0).
  assert not np.any(np.asarray(state.mu)[5])
  # After catching every row up, every row's moments are dense Adam's.
  params, state = caught
  assert_moments(state, ref, range(VOCAB))
  assert_params(params, ref, bound, range(VOCAB))
  np.testing.assert_array_equal(state.row_last_step, [37] * VOCAB)


@pytest.mark.slow  # eager ops compile one by one; the jitted steps are the default tier's
def test_without_jit():
  # 7 eager steps (eager ops are slow): rows 0, 1, 2 and 4 are touched at the last one.
  params, state, _, ref, bound = run(OPTIONS["adamw"], touch_pattern(7), jit=False)
  assert_moments(state, ref, [0, 1, 2, 4])
  assert_params(params, ref, bound, [0, 1, 2, 4])


def test_lazy_differs_where_catch_up_agrees():
  """The check can fail: lazy Adam's moments of an idle row are not dense Adam's."""
  pattern = touch_pattern(13)
  opt = osa.sparse_adam(0.05)
  params = jnp.zeros((VOCAB, DIM))
  state = opt.init(params)
  ref = DenseAdam(np.zeros((VOCAB, DIM)), lr=0.05, b1=0.9, b2=0.999, eps=1e-8)
  for ids, values in sparse_grads(pattern, 0):
    grad = bcoo(ids, values)
    _, state = opt.update(grad, state)
    ref.step(densify(ids, values))
  with pytest.raises(AssertionError):
    assert_moments(state, ref, [3])


@pytest.mark.parametrize("path", ["generic", "default"])
def test_large_idle_gap(path):
  """A row idle for 1500 steps: b1^k and b2^k underflow or nearly, both sides agree."""
  steps = 1502
  pattern = [[0, 1] if t in (1, steps) else [0] for t in range(1, steps + 1)]
  pattern[700] = [0, 2]
  params, state, caught, ref, bound = run(OPTIONS["adam"], pattern, seed=3, path=path)
  assert_moments(state, ref, [0, 1])
  assert_params(params, ref, bound, [0, 1])
  params, state = caught
  assert_moments(state, ref, range(VOCAB))
  assert_params(params, ref, bound, range(VOCAB))


SETTLED = 30  # steps after which b^t < 1e-9 for b = 0.5: the bias correction is 1 in float32


@pytest.mark.parametrize(
  "options",
  [
    {"learning_rate": 0.05, "b1": 0.5, "b2": 0.5, "eps": 1e-30},
    {"learning_rate": 0.05, "b1": 0.5, "b2": 0.5, "eps": 0.1, "amsgrad": True},
    {"learning_rate": 0.05, "b1": 0.5, "b2": 0.5, "eps": 1e-30, "weight_decay": 0.5},
  ],
  ids=["eps0", "amsgrad", "adamw_eps0"],
)
@pytest.mark.parametrize("path", [pytest.param("generic", marks=pytest.mark.slow), "default"])
def test_exact_where_claimed(options, path):
  """eps = 0, or amsgrad, at a constant step size: the discharge is exact."""
  pattern = [list(range(VOCAB))] * SETTLED + touch_pattern(25)
  params, state, caught, ref, bound = run(options, pattern, path=path)
  # The bound is zero up to the step size's float32 resolution ...
  assert bound.max() <= 1e-7 * options["learning_rate"]
  # ... and the parameters agree to float32 rounding.
  assert_moments(state, ref, [0, 1, 2, 3, 4])
  assert_params(params, ref, np.zeros_like(bound), [0, 1, 2, 3, 4])
  params, state = caught
  assert_params(params, ref, np.zeros_like(bound), range(VOCAB))


def test_bound_is_not_vacuous():
  """With eps > 0 and early bias correction the discharge is inexact, and the bound covers it."""
  params, _, _, ref, bound = run(OPTIONS["adam_large_eps"], touch_pattern(37))
  err = np.abs(np.asarray(params, F64) - ref.p)[:5]
  assert err.max() > 10 * slack(ref)  # not exact ...
  assert bound[:5].max() < 0.5 * np.abs(ref.p).max()  # ... and the bound is informative


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_against_torch_adam(weight_decay):
  """torch.optim.Adam/AdamW on the densified gradients, at eps=1e-30: both eps placements agree."""
  import torch

  pattern = [list(range(VOCAB))] + touch_pattern(37)[1:]
  options = {"learning_rate": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-30}
  if weight_decay:
    options["weight_decay"] = weight_decay
  params, state, caught, ref, bound = run(options, pattern, seed=5)
  torch_param = torch.nn.Parameter(torch.tensor(ref.p0))
  torch_opt = (torch.optim.AdamW if weight_decay else torch.optim.Adam)(
    [torch_param], lr=0.05, betas=(0.9, 0.999), eps=0.0, weight_decay=weight_decay
  )
  for ids, values in sparse_grads(pattern, 5):
    torch_param.grad = torch.tensor(densify(ids, values))
    torch_opt.step()
  torch_state = torch_opt.state[torch_param]
  np.testing.assert_allclose(ref.p, torch_param.detach().numpy(), rtol=1e-10, atol=1e-12)
  params, state = caught
  np.testing.assert_allclose(
    np.asarray(state.mu, F64), torch_state["exp_avg"].numpy(), rtol=2e-5, atol=1e-9
  )
  np.testing.assert_allclose(
    np.asarray(state.nu, F64), torch_state["exp_avg_sq"].numpy(), rtol=2e-5, atol=1e-12
  )
  err = np.abs(np.asarray(params, F64) - torch_param.detach().numpy())
  assert np.all(err <= bound + slack(ref))


@pytest.mark.parametrize(
  ("make", "match"),
  [
    (lambda: osa.sparse_adam(catch_up_idle_rows=True, per_row_bias_correction=True), "per_row"),
    (lambda: osa.sparse_adam(weight_decay=0.1, catch_up_idle_rows=True), "weight_decay=0"),
    (lambda: osa.sparse_adam(b1=0.99, b2=0.9, catch_up_idle_rows=True), r"b1 < sqrt\(b2\)"),
  ],
)
def test_refused_when_made(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_injected_betas_are_checked_or_refused_before_any_change():
  """Betas injected by inject_hyperparams: checked where concrete, refused where traced.

  A traced pair could be b1 >= sqrt(b2), whose catch-up error grows without bound.
  """
  params = jnp.zeros((VOCAB, DIM))
  grad = sparse.BCOO((jnp.ones((1, DIM)), jnp.array([[1]])), shape=(VOCAB, DIM))
  inject = functools.partial(optax.inject_hyperparams, osa.sparse_adam)
  with pytest.raises(ValueError, match=r"b1 < sqrt\(b2\)"):
    inject(static_args=("weight_decay",))(b1=0.99, b2=0.9, catch_up_idle_rows=True).init(params)
  opt = inject(static_args=("weight_decay",))(b1=0.9, b2=0.999, catch_up_idle_rows=True)
  state = opt.init(params)
  before = jax.tree.map(np.asarray, state)
  with pytest.raises(ValueError, match=r"b1 and b2 are traced.*static_args=\('b1', 'b2'\)"):
    jax.jit(opt.update)(grad, state, params)
  for kept, was in zip(jax.tree.leaves(state), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(kept, was)
  static = inject(static_args=("weight_decay", "b1", "b2"))
  amsgrad = inject(static_args=("weight_decay",))
  for made in (
    static(b1=0.9, b2=0.999, catch_up_idle_rows=True),
    amsgrad(b1=0.99, b2=0.9, amsgrad=True, catch_up_idle_rows=True),
  ):
    updates, _ = jax.jit(made.update)(grad, made.init(params), params)
    assert updates.nse == 1


def test_amsgrad_composes_for_any_betas():
  osa.sparse_adam(b1=0.99, b2=0.9, amsgrad=True, catch_up_idle_rows=True)


def test_state_of_the_other_kind_is_refused_before_any_change():
  params = jnp.zeros((VOCAB, DIM))
  grad = sparse.BCOO((jnp.ones((1, DIM)), jnp.array([[1]])), shape=(VOCAB, DIM))
  lazy, catching = osa.sparse_adam(), osa.sparse_adam(catch_up_idle_rows=True)
  with pytest.raises(ValueError, match="catch_up_idle_rows=True"):
    catching.update(grad, lazy.init(params))
  with pytest.raises(ValueError, match="catch_up_idle_rows=False"):
    lazy.update(grad, catching.init(params))


def test_catch_up_all_rows_refuses_other_optimizers():
  params = jnp.zeros((VOCAB, DIM))
  lazy = osa.sparse_adam()
  with pytest.raises(ValueError, match="catch_up_idle_rows=True"):
    osa.catch_up_all_rows(lazy, params, lazy.init(params))
  catching = osa.sparse_adam(catch_up_idle_rows=True)
  chained = optax.chain(catching)
  with pytest.raises(ValueError, match="catch_up_idle_rows=True"):
    osa.catch_up_all_rows(chained, params, chained.init(params))
  with pytest.raises(ValueError, match="SparseAdamState"):
    osa.catch_up_all_rows(catching, params, chained.init(params))
  with pytest.raises(ValueError, match="shape"):
    osa.catch_up_all_rows(catching, jnp.zeros((VOCAB, 2)), catching.init(params))


def test_steps_after_catch_up_all_rows_go_on_as_dense():
  """An on-demand catch-up in the middle of training changes nothing but when rows are caught up."""
  params, state, caught, ref, bound = run(OPTIONS["adamw"], touch_pattern(25), catch_up_at=(7, 12))
  assert_moments(state, ref, [0, 1, 2, 3, 4])
  assert_params(params, ref, bound, [0, 1, 2, 3, 4])
  params, state = caught
  assert_moments(state, ref, range(VOCAB))
  assert_params(params, ref, bound, range(VOCAB))


def test_catch_up_rows_reads_rows_as_dense_adam_has_them():
  """Catching a batch's rows up before the step equals catching them up in the step."""
  pattern = touch_pattern(7)
  opt = osa.sparse_adamw(0.05, weight_decay=0.5, catch_up_idle_rows=True)
  params = jnp.asarray(np.random.default_rng(0).normal(size=(VOCAB, DIM)), jnp.float32)
  in_step = (params, opt.init(params))
  before = (params, opt.init(params))
  # Jitted, the ids padded to one shape (out-of-range ids are skipped): one compile each.
  catch_up = jax.jit(functools.partial(osa.catch_up_rows, opt))
  step = jax.jit(lambda g, s, p: (lambda u, s: (osa.apply_updates(p, u), s))(*opt.update(g, s, p)))
  for ids, values in sparse_grads(pattern, 0):
    grad = bcoo(ids, values)
    p, s = before
    out_of_range = np.array([-1] * (NSE - len(ids)) + [-1, 99], np.int32)
    p, s = catch_up(p, s, jnp.asarray(np.concatenate([ids, out_of_range])))
    # The rows of the batch are up to date; the others are not touched.
    np.testing.assert_array_equal(np.asarray(s.row_last_step)[ids], int(s.param_steps[0]))
    before = step(grad, s, p)
    in_step = step(grad, in_step[1], in_step[0])
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(in_step), strict=True):
    np.testing.assert_allclose(np.asarray(a, F64), np.asarray(b, F64), rtol=2e-6, atol=2e-7)


def _steps(opt, params, grads, *, nse=NSE):
  state = opt.init(params)
  step = jax.jit(lambda p, s, g: (lambda u, s: (osa.apply_updates(p, u), s))(*opt.update(g, s, p)))
  for ids, values in grads:
    grad = bcoo(ids, values, nse)
    params, state = step(params, state, grad)
  return params, state


def test_inside_optax_chain():
  grads = sparse_grads(touch_pattern(9), 1)
  inner = osa.sparse_adam(0.05, catch_up_idle_rows=True)
  chained = optax.chain(inner, optax.identity())
  params = jnp.ones((VOCAB, DIM))
  alone = _steps(inner, params, grads)
  in_chain = _steps(chained, params, grads)
  np.testing.assert_array_equal(alone[0], in_chain[0])
  caught = osa.catch_up_all_rows(inner, in_chain[0], in_chain[1][0])
  want = osa.catch_up_all_rows(inner, *alone)
  for a, b in zip(jax.tree.leaves(caught), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)


def test_inside_sparse_multi_steps():
  """Every second mini-step steps the inner catch-up optimizer with the mean gradient."""
  grads = sparse_grads(touch_pattern(12), 2)
  inner = osa.sparse_adam(0.05, catch_up_idle_rows=True)
  multi = osa.sparse_multi_steps(inner, every_k=2, max_nse=NSE)
  params = jnp.ones((VOCAB, DIM))
  got, state = _steps(multi, params, grads)
  merged = []
  for (ids_a, values_a), (ids_b, values_b) in zip(grads[::2], grads[1::2], strict=True):
    merged.append((np.concatenate([ids_a, ids_b]), np.concatenate([values_a, values_b]) / 2))
  want, want_state = _steps(inner, params, merged, nse=2 * NSE)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(state.inner_opt_state.row_last_step, want_state.row_last_step)


def test_row_sharded_table_on_a_one_device_mesh_matches():
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  grads = sparse_grads(touch_pattern(9), 3)
  opt = osa.sparse_adamw(0.05, weight_decay=0.5, catch_up_idle_rows=True)
  params = jnp.ones((VOCAB, DIM))
  want = _steps(opt, params, grads)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    sharded = jax.device_put(params, NamedSharding(mesh, P("x", None)))
    got = _steps(opt, sharded, grads)
    assert got[1].row_last_step.sharding.spec == P("x")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)


def test_with_inject_hyperparams():
  """Injected (traced) hyper-parameters give the same steps as floats, to float32 rounding."""
  grads = sparse_grads(touch_pattern(9), 4)
  kwargs = {"learning_rate": 0.05, "weight_decay": 0.5, "catch_up_idle_rows": True}
  # The betas stay Python numbers: catch-up checks b1 < sqrt(b2) when the step is traced.
  injected = optax.inject_hyperparams(osa.sparse_adamw, static_args=("b1", "b2"))(**kwargs)
  params = jnp.ones((VOCAB, DIM))
  got, state = _steps(injected, params, grads)
  want, want_state = _steps(osa.sparse_adamw(**kwargs), params, grads)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(state.inner_state.row_last_step, want_state.row_last_step)


@pytest.mark.parametrize("path", [pytest.param("generic", marks=pytest.mark.slow), "accelerator"])
def test_grad_through_catch_up_steps(path):
  """d(loss after catch-up steps)/d(learning rate) is finite and matches finite differences."""
  grads = sparse_grads(touch_pattern(3), 6)  # rows 1 to 4 and 6 idle a step or two
  params = jnp.asarray(np.random.default_rng(6).normal(size=(VOCAB, DIM)), jnp.float32)

  def loss_after(lr):
    opt = osa.sparse_adamw(lr, weight_decay=0.5, catch_up_idle_rows=True)
    p, s = params, opt.init(params)
    for ids, values in grads:
      g = sparse.BCOO((jnp.asarray(values), jnp.asarray(ids)[:, None]), shape=(VOCAB, DIM))
      updates, s = opt.update(g, s, p)
      p = osa.apply_updates(p, updates)
    p, _ = osa.catch_up_all_rows(opt, p, s)
    return jnp.sum(p**2)

  with choice.choose(**PATHS[path]):
    derivative = jax.jit(jax.grad(loss_after))(jnp.float32(0.05))
    h, loss_at = 1e-3, jax.jit(loss_after)
    numeric = (loss_at(jnp.float32(0.05 + h)) - loss_at(jnp.float32(0.05 - h))) / (2 * h)
  assert np.isfinite(derivative)
  np.testing.assert_allclose(derivative, numeric, rtol=2e-2)
