"""weight_decay (L2), sparse_adamw, amsgrad, per-row bias correction vs torch.optim.Adam/AdamW.

The dense equivalent of a masked step restricted to the touched rows: the rows a
gradient touches form a small parameter of their own, with their stored moments
and the parameter's step count t (or each row's own count, with per-row bias
correction), and take one torch.optim.Adam (AdamW) step with the coalesced
gradient; every other row and its state is left alone. torch.optim.Adam adds eps
to sqrt(v / (1 - b2^t)) where SparseAdam adds it to sqrt(v), so the reference
runs Adam with eps / sqrt(1 - b2^t), which is algebraically SparseAdam's
placement. The reference runs in float64, on the host, one torch step per group
of rows sharing a step count.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import NumpySparseAdam

torch = pytest.importorskip("torch")

NUM_ROWS, DIM = 12, 3
LR, BETAS, EPS = 0.05, (0.9, 0.999), 1e-8


class TouchedRowsTorchAdam:
  """torch.optim.Adam (or AdamW) applied, at each step, to the touched rows only."""

  def __init__(
    self,
    param,
    *,
    weight_decay=0.0,
    decoupled=False,
    amsgrad=False,
    per_row=False,
    maximize=False,
  ):
    self.param = np.array(param, np.float64)
    self.mu = np.zeros_like(self.param)
    self.nu = np.zeros_like(self.param)
    self.nu_max = np.zeros_like(self.param)
    self.row_step = np.zeros(self.param.shape[0], np.int64)
    self.step_count = 0
    self.weight_decay, self.decoupled = weight_decay, decoupled
    self.amsgrad, self.per_row, self.maximize = amsgrad, per_row, maximize

  def step(self, indices, values):
    self.step_count += 1
    idx = np.asarray(indices)[:, 0]
    keep = (idx >= 0) & (idx < self.param.shape[0])
    grad = np.zeros_like(self.param)
    np.add.at(grad, idx[keep], np.asarray(values, np.float64)[keep])
    rows = np.unique(idx[keep])
    steps = self.row_step[rows] + 1 if self.per_row else np.full(len(rows), self.step_count)
    for t in np.unique(steps):
      group = rows[steps == t]
      self._torch_step(group, grad[group], int(t))
    self.row_step[rows] += 1

  def _torch_step(self, rows, grad, t):
    p = torch.nn.Parameter(torch.tensor(self.param[rows]))
    p.grad = torch.tensor(grad)
    cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
    opt = cls(
      [p],
      lr=LR,
      betas=BETAS,
      eps=EPS / math.sqrt(1 - BETAS[1] ** t),
      weight_decay=self.weight_decay,
      amsgrad=self.amsgrad,
      maximize=self.maximize,
      foreach=False,
    )
    state = {
      "step": torch.tensor(float(t - 1), dtype=torch.float64),
      "exp_avg": torch.tensor(self.mu[rows]),
      "exp_avg_sq": torch.tensor(self.nu[rows]),
    }
    if self.amsgrad:
      state["max_exp_avg_sq"] = torch.tensor(self.nu_max[rows])
    opt.state[p] = state
    opt.step()
    self.param[rows] = p.detach().numpy()
    self.mu[rows] = state["exp_avg"].numpy()
    self.nu[rows] = state["exp_avg_sq"].numpy()
    if self.amsgrad:
      self.nu_max[rows] = state["max_exp_avg_sq"].numpy()


def zipf_grads(num_steps, seed=0, nse=6):
  """Row gradients with a skewed row distribution, duplicates, padding and an all-padding step."""
  rng = np.random.default_rng(seed)
  out = []
  for s in range(num_steps):
    idx = np.minimum(rng.zipf(1.5, size=nse) - 1, NUM_ROWS + 5)  # > NUM_ROWS: padding
    if s == 2:
      idx[:] = NUM_ROWS + 1  # touches nothing: the step still advances
    data = rng.normal(size=(nse, DIM)).astype(np.float32)
    if s % 2:
      data *= 10.0  # large then small gradients make amsgrad's max bind
    out.append((idx[:, None], data))
  return out


OPTIONS = {
  "l2": dict(weight_decay=0.1),
  "adamw": dict(weight_decay=0.1, decoupled=True),
  "amsgrad": dict(amsgrad=True),
  "per_row": dict(per_row=True),
  "l2_amsgrad_per_row": dict(weight_decay=0.05, amsgrad=True, per_row=True),
  "adamw_amsgrad_per_row_maximize": dict(
    weight_decay=0.05, decoupled=True, amsgrad=True, per_row=True, maximize=True
  ),
  "l2_maximize": dict(weight_decay=0.1, maximize=True),
}


def make_opt(weight_decay=0.0, decoupled=False, amsgrad=False, per_row=False, maximize=False):
  kw = dict(amsgrad=amsgrad, per_row_bias_correction=per_row, maximize=maximize)
  if decoupled:
    return osa.sparse_adamw(LR, *BETAS, EPS, weight_decay=weight_decay, **kw)
  return osa.sparse_adam(LR, *BETAS, EPS, weight_decay=weight_decay, **kw)


def initial_params():
  return {"table": jnp.asarray(np.random.default_rng(7).normal(size=(NUM_ROWS, DIM)), jnp.float32)}


# Every option under jit; without jit (slow: op by op) the two combinations that use them all.
CASES = [(name, True) for name in sorted(OPTIONS)] + [
  ("l2_amsgrad_per_row", False),
  ("adamw_amsgrad_per_row_maximize", False),
]


@pytest.mark.parametrize(
  "name,jit", CASES, ids=[f"{n}-{'jit' if j else 'nojit'}" for n, j in CASES]
)
def test_option_matches_torch_adam_on_touched_rows(name, jit):
  options = OPTIONS[name]
  params = initial_params()
  opt = make_opt(**options)
  state = opt.init(params)
  ref = TouchedRowsTorchAdam(params["table"], **options)

  def step(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  step = jax.jit(step) if jit else step
  for idx, data in zipf_grads(6):
    g = sparse.BCOO((jnp.asarray(data), jnp.asarray(idx)), shape=(NUM_ROWS, DIM))
    old_params, old_state = params, state
    params, state = step({"table": g}, state, params)
    ref.step(idx, data)
    touched = np.zeros(NUM_ROWS, bool)
    touched[np.unique(idx[(idx >= 0) & (idx < NUM_ROWS)])] = True
    # Untouched rows of the parameter and of every state array are bit-exact.
    for new, old in (
      (params["table"], old_params["table"]),
      (state.mu["table"], old_state.mu["table"]),
      (state.nu["table"], old_state.nu["table"]),
    ) + (((state.nu_max["table"], old_state.nu_max["table"]),) if options.get("amsgrad") else ()):
      np.testing.assert_array_equal(np.asarray(new)[~touched], np.asarray(old)[~touched])
    np.testing.assert_allclose(params["table"], ref.param, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(state.mu["table"], ref.mu, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(state.nu["table"], ref.nu, rtol=2e-5, atol=1e-6)
    if options.get("amsgrad"):
      np.testing.assert_allclose(state.nu_max["table"], ref.nu_max, rtol=2e-5, atol=1e-6)
    if options.get("per_row"):
      np.testing.assert_array_equal(state.row_step["table"], ref.row_step)
    assert int(state.step["table"]) == ref.step_count


def test_amsgrad_max_binds_in_this_data():
  """The test data above makes the running max differ from v (else amsgrad would be untested)."""
  ref = TouchedRowsTorchAdam(initial_params()["table"], amsgrad=True)
  for idx, data in zipf_grads(6):
    ref.step(idx, data)
  assert (ref.nu_max > ref.nu * (1 + 1e-6)).any()


def test_per_row_bias_correction_differs_from_default_on_late_rows():
  """A row first touched at step t gets step size of its step 1, not of step t."""
  params = {"table": jnp.zeros((NUM_ROWS, DIM))}
  default, per_row = make_opt(), make_opt(per_row=True)
  sd, sp = default.init(params), per_row.init(params)
  default_update, per_row_update = jax.jit(default.update), jax.jit(per_row.update)
  g0 = sparse.BCOO((jnp.ones((1, DIM)), jnp.array([[0]])), shape=(NUM_ROWS, DIM))
  for _ in range(5):
    _, sd = default_update({"table": g0}, sd)
    _, sp = per_row_update({"table": g0}, sp)
  g5 = sparse.BCOO((jnp.ones((1, DIM)), jnp.array([[5]])), shape=(NUM_ROWS, DIM))
  ud, _ = default_update({"table": g5}, sd)
  up, sp = per_row_update({"table": g5}, sp)
  # A first step of Adam moves by lr exactly (m/sqrt(v) = 1 after bias correction).
  np.testing.assert_allclose(up["table"].todense()[5], -LR, rtol=1e-6)
  t, (b1, b2) = 6, BETAS
  expected_default = -LR * math.sqrt(1 - b2**t) / (1 - b1**t) * (1 - b1) / math.sqrt(1 - b2)
  np.testing.assert_allclose(ud["table"].todense()[5], expected_default, rtol=1e-5)
  np.testing.assert_array_equal(sp.row_step["table"], [5, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0])


def test_per_row_state_cost_is_one_int32_per_row():
  params = {"table": jnp.zeros((1000, 16)), "small": jnp.zeros((7, 2, 3))}
  state = make_opt(per_row=True).init(params)
  assert state.row_step["table"].shape == (1000,) and state.row_step["table"].dtype == jnp.int32
  assert state.row_step["small"].shape == (7,)
  assert make_opt().init(params).row_step is None


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_defaults_keep_sparse_adam_numerics(jit):
  """Defaults == torch.optim.SparseAdam (float32) == explicit neutral options, bit for bit."""
  params = initial_params()
  default = osa.sparse_adam(LR)
  neutral = osa.sparse_adam(LR, weight_decay=0.0, amsgrad=False, per_row_bias_correction=False)
  sd, sn = default.init(params), neutral.init(params)
  tp = torch.nn.Parameter(torch.tensor(np.asarray(params["table"])))
  topt = torch.optim.SparseAdam([tp], lr=LR)
  upd_default = jax.jit(default.update) if jit else default.update
  upd_neutral = jax.jit(neutral.update) if jit else neutral.update
  pd = pn = params
  for idx, data in zipf_grads(6):
    g = {"table": sparse.BCOO((jnp.asarray(data), jnp.asarray(idx)), shape=(NUM_ROWS, DIM))}
    ud, sd = upd_default(g, sd, pd)
    un, sn = upd_neutral(g, sn, pn)
    pd, pn = osa.apply_updates(pd, ud), osa.apply_updates(pn, un)
    keep = idx[:, 0] < NUM_ROWS
    tp.grad = torch.sparse_coo_tensor(
      torch.tensor(idx[keep].T), torch.tensor(data[keep]), (NUM_ROWS, DIM), check_invariants=True
    )
    topt.step()
  np.testing.assert_array_equal(pd["table"], pn["table"])
  np.testing.assert_allclose(pd["table"], tp.detach().numpy(), rtol=1e-6, atol=1e-7)
  ref = NumpySparseAdam(np.asarray(params["table"]), lr=LR)
  for idx, data in zipf_grads(6):
    ref.step(idx, data)
  np.testing.assert_allclose(pd["table"], ref.param, rtol=1e-5, atol=1e-6)


def test_amsgrad_first_step_equals_default_bitwise():
  params = initial_params()
  idx, data = zipf_grads(1)[0]
  g = {"table": sparse.BCOO((jnp.asarray(data), jnp.asarray(idx)), shape=(NUM_ROWS, DIM))}
  ua, _ = make_opt(amsgrad=True).update(g, make_opt(amsgrad=True).init(params))
  ud, _ = make_opt().update(g, make_opt().init(params))
  np.testing.assert_array_equal(ua["table"].data, ud["table"].data)


def test_per_row_equals_default_when_every_row_is_touched_every_step():
  params = initial_params()
  opts = make_opt(), make_opt(per_row=True)
  states = [o.init(params) for o in opts]
  updates = [jax.jit(o.update) for o in opts]
  rng = np.random.default_rng(3)
  outs = [params, params]
  for _ in range(4):
    idx = np.concatenate([np.arange(NUM_ROWS), rng.integers(0, NUM_ROWS, 3)])[:, None]
    data = rng.normal(size=(len(idx), DIM)).astype(np.float32)
    g = {"table": sparse.BCOO((jnp.asarray(data), jnp.asarray(idx)), shape=(NUM_ROWS, DIM))}
    for i in range(len(opts)):
      u, states[i] = updates[i](g, states[i], outs[i])
      outs[i] = osa.apply_updates(outs[i], u)
  np.testing.assert_allclose(outs[0]["table"], outs[1]["table"], rtol=1e-6)


def test_weight_decay_needs_params():
  opt = make_opt(weight_decay=0.1)
  params = initial_params()
  idx, data = zipf_grads(1)[0]
  g = {"table": sparse.BCOO((jnp.asarray(data), jnp.asarray(idx)), shape=(NUM_ROWS, DIM))}
  with pytest.raises(ValueError, match=r"\['table'\] is needed for weight decay"):
    opt.update(g, opt.init(params))


@pytest.mark.parametrize("factory", [osa.sparse_adam, osa.sparse_adamw])
def test_negative_weight_decay_is_refused(factory):
  with pytest.raises(ValueError, match="Invalid weight_decay value: -0.1"):
    factory(0.1, weight_decay=-0.1)
