"""Catch-up of idle rows for every rule: SGD's momentum against real torch, the rest.

`sparse_sgd(momentum=..., catch_up_idle_rows=True)` is checked against
`torch.optim.SGD` on sparse gradients (whose momentum buffer moves every row it
ever saw, every step) over 30 steps with duplicate ids and rows that go idle for
1 to 29 steps: after `catch_up_all_rows` the table and the buffer equal torch's
to float32 rounding. The rules whose idle rows do not move take `catch_up_rows`
as the identity; the ones without a closed form are refused with their reason.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice

torch = pytest.importorskip("torch")

ROWS, DIM, STEPS, LR = 8, 3, 30, 0.05
RNG = np.random.default_rng(3)
TABLE0 = RNG.standard_normal((ROWS, DIM)).astype(np.float32)
# Rows 0-2 are hot, 3-5 come back after gaps of 1 to 29 steps, 6 is touched once (step 1),
# 7 never; every batch repeats an id.
_RARE = {3: (2, 9, 10, 25), 4: (5, 30), 5: (1, 13, 14, 15, 29)}
BATCHES = []
for _t in range(1, STEPS + 1):
  _ids = [_t % 3, _t % 3, (_t + 1) % 3] + [r for r, ts in _RARE.items() if _t in ts]
  _ids += [6] if _t == 1 else []
  BATCHES.append(
    (np.asarray(_ids, np.int32), RNG.standard_normal((len(_ids), DIM)).astype(np.float32))
  )

OPTIONS = {
  "momentum": {"momentum": 0.9},
  "dampening_maximize": {"momentum": 0.8, "dampening": 0.3, "maximize": True},
  "nesterov": {"momentum": 0.7, "nesterov": True},
  "momentum_one": {"momentum": 1.0},
}


def _torch_run(options):
  """torch.optim.SGD over BATCHES: the table and the momentum buffer, densified."""
  p = torch.nn.Parameter(torch.from_numpy(TABLE0.copy()))
  opt = torch.optim.SGD([p], lr=LR, **options)
  for ids, vals in BATCHES:
    indices = torch.from_numpy(ids.astype(np.int64))[None]
    p.grad = torch.sparse_coo_tensor(
      indices, torch.from_numpy(vals), (ROWS, DIM), check_invariants=True
    )
    opt.step()
  return p.detach().numpy(), opt.state[p]["momentum_buffer"].to_dense().numpy()


def _bcoo(ids, vals):
  # Padded to one length (id ROWS is BCOO padding, ignored): one compiled step for all.
  pad = 6 - len(ids)
  ids = np.concatenate([ids, np.full(pad, ROWS, np.int32)])
  vals = np.concatenate([vals, np.zeros((pad, DIM), np.float32)])
  return sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids)[:, None]), shape=(ROWS, DIM))


def _run(opt, catch_up_at=None):
  @jax.jit
  def step(params, state, grad):
    updates, state = opt.update({"t": grad}, state, params)
    return osa.apply_updates(params, updates), state

  params = {"t": jnp.asarray(TABLE0)}
  state = opt.init(params)
  for t, (ids, vals) in enumerate(BATCHES, 1):
    params, state = step(params, state, _bcoo(ids, vals))
    if t == catch_up_at:  # a forward pass's rows brought up to date mid-run (9 is padding)
      ids = {"t": jnp.array([3, 4, 9, -1])}
      params, state = jax.jit(functools.partial(osa.catch_up_rows, opt))(params, state, ids)
  return params, state


def _assert_float32_close(got, want):
  """Within 8 float32 ulps of the array's largest magnitude (measured: 2-5 for the
  table, 1-3 for the buffer): torch rounds every step, the closed form its sum once."""
  bound = 8 * np.spacing(np.float32(np.abs(want).max()))
  assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_sgd_momentum_catch_up_is_torchs_dense_buffer(name):
  options = OPTIONS[name]
  table, buf = _torch_run(options)
  opt = osa.sparse_sgd(LR, catch_up_idle_rows=True, **options)
  # The step as the accelerator runs it (one sort), forced on the CPU, for one of them.
  forced = choice.ACCELERATOR if name == "nesterov" else choice.GENERIC_XLA
  with choice.choose(forced=forced):
    params, state = _run(opt, catch_up_at=12)
  # Lazy at the end: rows 4, 6 and 7 wait until caught up.
  assert not np.allclose(np.asarray(params["t"])[6], table[6])
  params, state = jax.jit(functools.partial(osa.catch_up_all_rows, opt))(params, state)
  got_table = np.asarray(params["t"])
  _assert_float32_close(got_table, table)
  _assert_float32_close(np.asarray(state.slots["momentum_buffer"]["t"]), buf)
  # Row 7 was never touched: bit for bit as it was, in torch too.
  np.testing.assert_array_equal(got_table[7], TABLE0[7])
  np.testing.assert_array_equal(table[7], TABLE0[7])
  np.testing.assert_array_equal(np.asarray(state.row_last_step["t"]), [STEPS] * ROWS)


@pytest.mark.parametrize(
  "make",
  [
    lambda: osa.sparse_sgd(LR),
    lambda: osa.sparse_sgd(LR, catch_up_idle_rows=True),
    lambda: osa.sparse_adagrad(LR),
    lambda: osa.sparse_adagrad(LR, catch_up_idle_rows=True),
    lambda: osa.sparse_rowwise_adagrad(LR),
    lambda: osa.sparse_rowwise_adagrad(LR, catch_up_idle_rows=True),
  ],
)
def test_catch_up_is_the_identity_where_idle_rows_do_not_move(make):
  opt = make()
  params = {"t": jnp.asarray(TABLE0)}
  updates, state = jax.jit(opt.update)({"t": _bcoo(*BATCHES[0])}, opt.init(params), params)
  params = osa.apply_updates(params, updates)
  assert getattr(state, "row_last_step", None) is None  # no state kept for it
  same_params, same_state = osa.catch_up_all_rows(opt, params, state)
  assert same_params is params and same_state is state
  ids = {"t": jnp.array([6, 7])}
  assert osa.catch_up_rows(opt, params, state, ids) == (params, state)


class _Hyper(NamedTuple):
  learning_rate: Any
  weight_decay: Any = None


@dataclasses.dataclass(frozen=True)
class _NoHookRule:  # a user's rule that declares no closed form
  name: str = dataclasses.field(default="test_no_hook", init=False)

  def slots(self):
    return (osa.Slot("trace"),)

  def update(self, block, hyper):
    return -hyper.learning_rate * block.grad, {"trace": block.grad}


@pytest.mark.parametrize(
  "make,words",
  [
    (
      lambda: osa.sparse_rowwise_adagrad(LR, weight_decay=0.1, weight_decay_mode="decoupled"),
      "rule 'rowwise_adagrad' has no closed form of its idle steps, because under weight decay",
    ),
    (
      lambda: osa.sparse_sgd(LR, momentum=0.9, lazy_momentum=True),
      "sparse_sgd transformation was made without catch_up_idle_rows=True",
    ),
    (
      lambda: osa.sparse_adam(LR, rowwise_second_moment=True),
      "rule 'rowwise_adam' has no closed form",
    ),
    (
      lambda: osa.sparse_rule_transformation(_NoHookRule(), _Hyper(LR)),
      "'test_no_hook' rule declares no closed form",
    ),
  ],
)
def test_catch_up_rows_refuses_rules_without_a_closed_form_by_name(make, words):
  opt = make()
  params = {"t": jnp.asarray(TABLE0)}
  state = opt.init(params)
  with pytest.raises(ValueError) as info:
    osa.catch_up_rows(opt, params, state, {"t": jnp.array([1])})
  assert words in str(info.value)


@pytest.mark.parametrize(
  "make,words",
  [
    (
      lambda: osa.sparse_rule_transformation(_NoHookRule(), _Hyper(LR), catch_up_idle_rows=True),
      "not available for the rule 'test_no_hook', because the 'test_no_hook' rule declares",
    ),
    (
      lambda: osa.sparse_adam(LR, rowwise_second_moment=True, catch_up_idle_rows=True),
      "sparse_adam: catch_up_idle_rows=True is not available for the rule 'rowwise_adam'",
    ),
    (
      lambda: osa.sparse_sgd(LR, momentum=jnp.asarray(0.9)),
      "catch_up_idle_rows=True for torch's numbers",
    ),
  ],
)
def test_catch_up_idle_rows_is_refused_when_made_without_a_closed_form(make, words):
  with pytest.raises(ValueError) as info:
    make()
  assert words in str(info.value)
